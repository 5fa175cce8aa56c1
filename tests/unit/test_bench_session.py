"""loadtest.bench_session: the routing session's cost per request, beside another checkout."""

from __future__ import annotations

import pytest

from loadtest.bench_session import PARTS, ROOT, main, one_pass, route_requests


@pytest.mark.parametrize("keys", ["prompts", "mooncake"])
def test_a_pass_routes_every_request_and_times_each_part(keys: str) -> None:
    requests = route_requests(keys, 200)
    assert len(requests) == 200
    if keys == "prompts":  # bench_overhead's shape: 20 shared system prompts, a question each
        assert 1 < len({r.key.blocks[20] for r in requests}) <= 20
        assert len({r.key.blocks[-1] for r in requests}) == len(requests)
    timed = one_pass(keys, 4, requests)
    assert set(timed) == set(PARTS)
    assert all(us > 0.0 for us in timed.values())


def test_a_baseline_checkout_runs_in_a_child_process_beside_this_one(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--keys", "prompts", "--workers", "4", "--passes", "1", "--requests", "100",
                 "--baseline", str(ROOT)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith("| prompts |")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[1] == "4"
    assert cells[-1].endswith("x")
    assert float(cells[-1][:-1]) > 0.0
