"""cache_aware's placement of a new session past its ring choices: for a branch off a shared
trunk, when each choice would make the prompt wait (a prefill queued there), the first workers
further along the ring with none (``SpreadPicker.beyond``).

Four workers; the first two on the ring from the anchor are the choices (``ring_choices=2``),
the other two lie further along. In-flight prefill is set per worker; the choices may hold a
trunk of the prompt (``Context.matches``).
"""

from __future__ import annotations

from collections.abc import Mapping

from gateway.fingerprint import PrefixKey
from gateway.routing.engine import Context
from gateway.routing.policies import PolicyOptions, build_engine
from gateway.routing.policies.spread_picker import SpreadPicker
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.ring import Ring
from gateway.routing.types import RouteRequest, Snapshot, Worker, WorkerView

IDS = ("w0", "w1", "w2", "w3")
RING = Ring({wid: 1.0 for wid in IDS})
# An anchor whose ring walk is w0, w1, then the other two in some order.
ANCHOR = next(a for a in range(1_000_000) if tuple(RING.walk(a))[:2] == ("w0", "w1"))
WALK = tuple(RING.walk(ANCHOR))
BLOCKS = 40  # 640 tokens
REQUEST = RouteRequest(PrefixKey(tuple(range(10_000, 10_000 + BLOCKS)), ANCHOR, BLOCKS * 64),
                       "m", BLOCKS * 16 + 10, BLOCKS * 16)


def _views(prefill: Mapping[str, int], waiting: Mapping[str, int] | None = None,
           first_token_s: float | None = None) -> tuple[WorkerView, ...]:
    waiting = waiting or {}
    return tuple(
        WorkerView(Worker(wid, f"http://{wid}"), True, 1 if prefill.get(wid) else 0,
                   prefill.get(wid, 0), inflight_prefill=prefill.get(wid, 0),
                   waiting_requests=waiting.get(wid, 0), first_token_s=first_token_s)
        for wid in IDS
    )


def _branch(prefill: Mapping[str, int], waiting: Mapping[str, int] | None = None,
            first_token_s: float | None = None, trunk: int = 0,
            picker: SpreadPicker | None = None) -> tuple[str, str]:
    """Where a new session off a trunk of ``trunk`` blocks (held by the two choices) goes,
    and how: the picker's choice among equals, as the engine asks it for a branch."""
    views = _views(prefill, waiting, first_token_s)
    matches = {"w0": trunk, "w1": trunk} if trunk else {}
    ctx = Context(REQUEST, Snapshot(views, PrefixIndex().at(1.0), RING), matches,
                  branch_anchor=ANCHOR)
    picker = picker or SpreadPicker(choices=2, quick_s=0.02)
    chosen, how = picker.pick(ctx, views, {w.id: 0.0 for w in views})
    return chosen.id, how


def test_both_choices_queued_goes_on_to_a_worker_without_a_queue() -> None:
    wid, how = _branch({"w0": 500, "w1": 300})
    assert wid in WALK[2:]
    assert how.endswith("past queued choices")
    # With the third on the ring busy too, the fourth.
    assert _branch({"w0": 500, "w1": 300, WALK[2]: 100}) == (
        WALK[3], "ring skip=3 past queued choices")


def test_a_choice_without_a_queue_keeps_the_placement_on_the_choices() -> None:
    assert _branch({"w0": 500})[0] == "w1"
    assert _branch({})[0] in ("w0", "w1")


def test_every_worker_queued_stays_on_the_choices() -> None:
    wid, how = _branch({wid: 100 for wid in IDS})
    assert wid in ("w0", "w1")
    assert "past" not in how


def test_requests_the_engine_has_waiting_count_as_a_wait() -> None:
    # No prefill queued on the choices, but their engines hold requests for admission.
    assert _branch({}, waiting={"w0": 2, "w1": 1})[0] in WALK[2:]


def test_an_engine_quick_to_its_first_token_makes_nobody_wait() -> None:
    # The choices have prefill queued, but every engine reports first tokens within 20 ms:
    # the queue costs nothing there (zero-cost engines), so the placement stays on them.
    assert _branch({"w0": 500, "w1": 300}, first_token_s=0.005)[0] in ("w0", "w1")
    assert _branch({"w0": 500, "w1": 300}, first_token_s=0.5)[0] in WALK[2:]


def test_a_trunk_the_choices_hold_is_weighed_against_their_wait() -> None:
    # The choices hold 20 of the prompt's 40 blocks (the shared trunk): elsewhere 320 of its
    # 640 tokens are prefilled again. A wait of 100 tokens is worth less; one of 500 more.
    assert _branch({"w0": 100, "w1": 100}, trunk=20)[0] in ("w0", "w1")
    assert _branch({"w0": 500, "w1": 500}, trunk=20)[0] in WALK[2:]


def test_switched_off_the_placement_stays_on_the_choices() -> None:
    picker = SpreadPicker(choices=2, past_queued=False)
    assert _branch({"w0": 500, "w1": 300}, picker=picker)[0] in ("w0", "w1")


def test_a_cold_prefix_stays_on_its_queued_choices() -> None:
    # Not a branch: a prompt nobody holds any of may be a document many later requests
    # share, whose place the choices' balance matters more for than one request's wait.
    views = _views({"w0": 500, "w1": 300})
    decision = build_engine("cache_aware", PolicyOptions(ring_choices=2)).route(
        REQUEST, Snapshot(views, PrefixIndex().at(1.0), RING))
    assert decision.worker_id in ("w0", "w1")
    assert decision.reason.startswith("cold -> ring")
