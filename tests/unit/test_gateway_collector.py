"""The gateway's process tunes the cyclic garbage collector once start-up is done."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from gateway.__main__ import GC_YOUNG_THRESHOLD, quiet_collector


@pytest.fixture
def restored_collector() -> Iterator[None]:
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def test_quiet_collector_freezes_start_up_and_raises_the_young_threshold(
    restored_collector: None,
) -> None:
    gc.unfreeze()
    built = [object() for _ in range(10)]  # start-up state, reachable
    quiet_collector()
    assert gc.get_freeze_count() > 0
    young, middle, oldest = gc.get_threshold()
    assert young == GC_YOUNG_THRESHOLD > 700
    assert (middle, oldest) == (10, 10)  # the older generations keep CPython's defaults
    assert built
