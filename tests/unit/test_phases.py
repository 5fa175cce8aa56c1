"""The c = 1 phase timer's parts: every checkpoint names a function that exists, wrapping
keeps what the function returns, and a log of sequential requests becomes median spans."""

from __future__ import annotations

import asyncio
import sys
import types

import pytest

from loadtest import phases


def test_every_checkpoint_names_a_function_of_the_gateway() -> None:
    for module, path, _ in phases.CHECKPOINTS:
        _, _, fn = phases.resolve(module, path)
        assert callable(fn), f"{module}.{path}"


def test_a_renamed_function_is_reported_not_skipped() -> None:
    with pytest.raises(AttributeError):
        phases.resolve("gateway.proxy", "no_such_function")


def test_spans_are_medians_between_consecutive_checkpoints_in_request_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(phases, "CHECKPOINTS", (("m", "f", "first"), ("m", "g", "x")))
    first = "first"
    log: list[tuple[str, int]] = [(first + ">", 0), (first + "<", 10)]  # a health check
    t = 100_000
    for i in range(10):
        # Each request: enter the first checkpoint, leave it 1-2 us later, then "x" after 5 us.
        log += [(first + ">", t), (first + "<", t + 1000 + 100 * (i % 2)), ("x>", t + 6000)]
        t += 100_000
    table, total, kept = phases.spans(log, skip_share=0.2)
    assert kept == 8  # the health check left out, then the first two requests
    assert [key for key, _ in table] == [f"{first}> -> {first}<", f"{first}< -> x>"]
    assert table[0][1] == pytest.approx(1.05)  # the median of 1.0 and 1.1 us, four each
    assert table[1][1] == pytest.approx(4.95)
    assert total == pytest.approx(6.0)


def test_wrapped_functions_return_what_they_did_and_log_around_the_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("timed_for_test")

    def begin(*a: object) -> tuple[str, tuple[object, ...]]:
        return "begun", a

    async def read(*a: object) -> bytes:
        return b"body"

    module.begin, module.read = begin, read  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "timed_for_test", module)
    monkeypatch.setattr(phases, "CHECKPOINTS", (
        ("timed_for_test", "begin", "sync"), ("timed_for_test", "read", "async")))
    log: list[tuple[str, int]] = []
    phases.install(log)
    assert module.begin(1, 2) == ("begun", (1, 2))
    assert asyncio.run(module.read()) == b"body"
    assert [label for label, _ in log] == ["sync>", "sync<", "async>", "async<"]
    assert [ns for _, ns in log] == sorted(ns for _, ns in log)


def test_a_checkpoint_spec_names_module_attribute_and_label() -> None:
    assert phases.checkpoint("gateway.pool:WorkerPool.snapshot:snapshot") == (
        "gateway.pool", "WorkerPool.snapshot", "snapshot")
    assert phases.checkpoint("gateway.api:prepare") == ("gateway.api", "prepare", "prepare")
    with pytest.raises(ValueError, match="MODULE:ATTRIBUTE"):
        phases.checkpoint("gateway.api")
