"""The c = 1 phase timer against the real gateway and reference workers: every checkpoint is
passed by every request, and the spans add up to the request's time in the gateway."""

from __future__ import annotations

from pathlib import Path

from loadtest import phases


async def test_every_request_passes_every_checkpoint_in_order(tmp_path: Path) -> None:
    result = await phases.measure(40, [], tmp_path,
                                  ["gateway.pool:WorkerPool.snapshot:snapshot"])
    assert result["requests"] == 32  # the first fifth is warm-up
    labels = [key for key, _ in result["spans_us"]]
    reached = {part for key in labels for part in key.split(" -> ")}
    for label in [label for _, _, label in phases.CHECKPOINTS] + ["snapshot"]:
        assert {label + ">", label + "<"} <= reached, label
    # In the order a request reaches them: the decision before the write to the worker,
    # the worker's reply before the write to the client.
    order = [key.split(" -> ")[0] for key in labels]
    assert order.index("decide>") < order.index("snapshot>") < order.index("decide<")
    assert order.index("decide<") < order.index("write to worker>")
    assert order.index("worker's reply<") < order.index("write to client>")
    assert all(us >= 0 for _, us in result["spans_us"])
    assert sum(us for _, us in result["spans_us"]) >= result["first_to_last_us"] * 0.5
    assert result["gateway_cpu_ms_per_request"] > 0
