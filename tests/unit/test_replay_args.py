"""``python -m loadtest replay``'s options that shape the fleet: extra worker flags, peers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from loadtest.replay import Fleet, build_parser, config_from_args, gateway_command


def _config(*argv: str) -> tuple[list[str], tuple[str, ...]]:
    parser = build_parser()
    args = parser.parse_args(["--workers", "2", *argv])
    return args.peer, config_from_args(parser, args).worker_args()


def test_worker_args_reach_every_worker_after_the_replay_own() -> None:
    _, flags = _config("--worker-arg=--engine=torch", "--worker-arg=--device=cuda")
    assert flags[-2:] == ("--engine=torch", "--device=cuda")
    # The replay's own flags stay: a worker flag given twice takes its last value.
    assert "--block-size" in flags
    assert "--max-model-len" in flags


def test_the_simulator_knows_whether_the_workers_run_priority_scheduling() -> None:
    """The simulator's engines run session copies at the gateway's copy priority only when
    the live workers run priority scheduling, as the gateway's probe of them would find."""
    parser = build_parser()

    def priority(*argv: str) -> bool:
        return config_from_args(parser, parser.parse_args(["--workers", "2", *argv])) \
            .priority_engines()

    assert not priority()
    assert priority("--worker-arg=--scheduling-policy=priority")
    assert not priority("--worker-arg=--scheduling-policy=fcfs")


def test_no_worker_args_by_default() -> None:
    _, flags = _config()
    assert not any(f.startswith("--engine") for f in flags)


def test_one_peer_without_the_others() -> None:
    peers, _ = _config("--peer", "sglang-router")
    assert peers == ["sglang-router"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--peer", "nginx"])


def test_each_router_on_a_core_of_its_own_only_when_asked() -> None:
    parser = build_parser()
    shared = config_from_args(parser, parser.parse_args(["--workers", "2"]))
    alone = config_from_args(parser, parser.parse_args(["--workers", "2", "--own-core"]))
    assert (shared.own_core, alone.own_core) == (False, True)


def test_one_disruption_of_one_existing_worker_per_run() -> None:
    """A worker restarted, restarted in place or flushed at a time into each run: one of
    them, on a worker the fleet has."""
    parser = build_parser()

    def config(*argv: str) -> tuple[object, object, object]:
        c = config_from_args(parser, parser.parse_args(["--workers", "2", *argv]))
        return c.restart_worker, c.restart_in_place, c.flush_worker

    assert config() == (None, None, None)
    assert config("--restart-in-place", "1@20") == (None, (1, 20.0), None)
    assert config("--flush-worker", "0@5.5") == (None, None, (0, 5.5))
    for bad in (["--restart-in-place", "2@20"], ["--restart-in-place", "one@20"],
                ["--restart-in-place", "0@20", "--flush-worker", "1@20"],
                ["--restart-worker", "0@20", "--restart-in-place", "1@20"]):
        with pytest.raises(SystemExit):
            config(*bad)


def test_worker_niceness_is_checked_and_reaches_the_config() -> None:
    parser = build_parser()
    assert config_from_args(parser, parser.parse_args(["--workers", "2"])).worker_nice == 0
    nice = config_from_args(parser, parser.parse_args(["--workers", "2", "--worker-nice", "10"]))
    assert nice.worker_nice == 10
    for bad in ("-1", "20"):
        with pytest.raises(SystemExit):
            config_from_args(parser, parser.parse_args(["--workers", "2", "--worker-nice", bad]))


def test_a_gateway_variant_may_run_another_checkouts_code(tmp_path: Path) -> None:
    """``@DIR`` among a variant's arguments runs its gateway from that checkout (its modules
    first on the path), with the other arguments passed on; without it, from this one."""
    parser = build_parser()
    config = config_from_args(parser, parser.parse_args(["--workers", "2"]))
    fleet = Fleet(config, 9000, tmp_path)
    plain = gateway_command(fleet, "cache_aware", extra=["--volume-guard", "0"])
    assert plain[:3] == [sys.executable, "-m", "gateway"]
    assert plain[-2:] == ["--volume-guard", "0"]
    other = gateway_command(fleet, "cache_aware", extra=["@/src/before", "--volume-guard", "0"])
    assert other[:3] == ["env", "-C", "/src/before"]
    assert other[3].startswith("PYTHONPATH=/src/before")
    assert other[4:] == plain
