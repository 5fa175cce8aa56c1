"""Signed worker registrations: every field a gateway acts on is covered by the signature."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from gateway.contracts.registry_signing import load_secret, signed, verified
from gateway.store.base import WorkerRecord

SECRET = b"registration secret"
RECORD = WorkerRecord(id="w1:8000", url="http://w1:8000", models=("m",), capacity_blocks=2048,
                      block_size=16, kv_events="tcp://w1:5557", kv_replay="tcp://w1:5558")


def test_a_signed_record_verifies_and_an_unsigned_one_does_not() -> None:
    assert verified(signed(RECORD, SECRET), SECRET)
    assert not verified(RECORD, SECRET)
    assert not verified(signed(RECORD, b"another secret"), SECRET)


@pytest.mark.parametrize(("field", "value"), [
    ("id", "w2:8000"), ("url", "http://evil:8000"), ("models", ("m", "other")),
    ("capacity_blocks", 2048 * 1000), ("block_size", 32), ("kind", "vllm"),
    ("kv_events", "tcp://evil:5557"), ("kv_replay", "tcp://evil:5558"),
])
def test_changing_any_field_breaks_the_signature(field: str, value: Any) -> None:
    tampered = dataclasses.replace(signed(RECORD, SECRET), **{field: value})
    assert not verified(tampered, SECRET)


def test_without_a_secret_nothing_is_signed_or_checked() -> None:
    assert signed(RECORD, b"") == RECORD
    assert verified(RECORD, b"")


def test_secret_from_a_file_wins_and_bad_files_are_errors(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("from-file\nsecond line\n", encoding="utf-8")
    assert load_secret("direct", str(path)) == b"from-file"
    assert load_secret("direct", "") == b"direct"
    (tmp_path / "empty").write_text("\n", encoding="utf-8")
    with pytest.raises(ValueError, match="empty"):
        load_secret("", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="cannot read"):
        load_secret("", str(tmp_path / "missing"))
