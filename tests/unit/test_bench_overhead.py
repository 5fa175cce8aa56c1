from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest

from loadtest.bench_overhead import (
    OverheadConfig,
    OverheadResult,
    Rep,
    TargetResult,
    bodies_for,
    gateway_command,
    long_bodies,
    paired_ms,
    to_markdown,
    top_functions,
)
from loadtest.harness import MODEL, histogram_totals
from loadtest.peers import peer_command, proc_tree_cpu_s


def test_top_functions_counts_own_and_inclusive_samples() -> None:
    collapsed = "main;handle;parse 6\nmain;handle;route 3\nmain;idle 1\nnot a stack line\n"
    top = top_functions(collapsed, count=2)
    assert top == [("parse", 0.6, 0.6), ("route", 0.3, 0.3)]
    assert top_functions("") == []


def test_proc_tree_cpu_grows_with_work() -> None:
    before = proc_tree_cpu_s(os.getpid())
    deadline = before + 0.05
    while proc_tree_cpu_s(os.getpid()) < deadline:
        sum(range(10_000))
    assert proc_tree_cpu_s(os.getpid()) >= deadline
    assert proc_tree_cpu_s(2**22 + 12345) == 0.0  # no such process


def test_proc_tree_cpu_resolves_less_than_a_clock_tick() -> None:
    # A clock tick is 10 ms; 2 ms of work must show as about 2 ms, not as 0 or 10.
    before, own = proc_tree_cpu_s(os.getpid()), time.thread_time()
    while time.thread_time() - own < 0.002:
        sum(range(1_000))
    spent = proc_tree_cpu_s(os.getpid()) - before
    assert 0.002 <= spent < 0.009


def test_proc_tree_cpu_counts_child_processes_and_their_exited_threads() -> None:
    # The child burns its CPU in a thread that has exited by the time it is measured.
    burn = ("import threading, time\n"
            "def spin():\n"
            "    t = time.thread_time()\n"
            "    while time.thread_time() - t < 0.3: pass\n"
            "worker = threading.Thread(target=spin)\nworker.start()\nworker.join()\n"
            "print('done', flush=True)\ntime.sleep(30)\n")
    child = subprocess.Popen([sys.executable, "-c", burn], stdout=subprocess.PIPE, text=True)
    try:
        before = proc_tree_cpu_s(os.getpid()) - proc_tree_cpu_s(child.pid)
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "done"
        assert proc_tree_cpu_s(child.pid) >= 0.3
        assert proc_tree_cpu_s(os.getpid()) - before >= 0.3
    finally:
        child.kill()
        child.wait()


def test_cpu_is_paired_by_repetition_against_ours() -> None:
    def target(name: str, *cpu: float) -> TargetResult:
        return TargetResult(name, reps=[Rep(100.0, 1.0, 2.0, 0, c) for c in cpu])

    # The load drifts between repetitions; the paired ratio is the median of 3.0/2.0 and 1.0/1.0,
    # not the ratio of the medians.
    result = OverheadResult("cmd", OverheadConfig(), [
        TargetResult("direct"), target("ours", 2.0, 1.0), target("ours[before]", 3.0, 1.0)], {})
    text = to_markdown(result)
    assert "- ours[before]: 1.250x ours" in text
    assert "- direct:" not in text.split("paired by repetition")[1].split("Per repetition")[0]


def test_added_latency_is_paired_by_round_against_sglang_router() -> None:
    # Round by round ours is 0.1 ms over sglang-router, though the medians differ by more:
    # the rounds where ours was slow are ones where the machine was slow for both.
    ours = TargetResult("ours", seq_ms=[1.1, 1.2, 5.1, 5.2, 5.3], seq_p50_ms=5.1)
    ref = TargetResult("sglang-router", seq_ms=[1.0, 1.1, 1.2, 5.1, 5.2], seq_p50_ms=1.2)
    assert paired_ms(ours, ref) is not None
    assert abs((paired_ms(ours, ref) or 0) - 0.1) < 1e-9
    assert paired_ms(TargetResult("floor"), ref) is None  # not run sequentially
    text = to_markdown(OverheadResult("cmd", OverheadConfig(), [
        TargetResult("direct", seq_ms=[1.0], seq_p50_ms=1.0), ours, ref], {}))
    assert "| ours | - | - | - | +3.90 | +0.100 |" in text
    assert "own core" not in text  # --own-core not given


def test_added_latency_on_own_cores_is_paired_by_round_too() -> None:
    ours = TargetResult("ours", seq_ms=[1.5], seq_p50_ms=1.5, own_seq_ms=[1.4, 2.0, 2.6])
    ref = TargetResult("sglang-router", seq_ms=[1.0], seq_p50_ms=1.0,
                       own_seq_ms=[1.0, 1.8, 2.5])
    assert abs((paired_ms(ours, ref, own_core=True) or 0) - 0.2) < 1e-9
    assert paired_ms(TargetResult("floor", seq_ms=[1.0]), ref, own_core=True) is None
    direct = TargetResult("direct", seq_ms=[0.5], seq_p50_ms=0.5, own_seq_ms=[0.7],
                          own_seq_p50_ms=0.7)
    ours.own_seq_p50_ms, ref.own_seq_p50_ms = 2.0, 1.8
    text = to_markdown(OverheadResult("cmd", OverheadConfig(own_core=True),
                                      [direct, ours, ref], {}))
    assert "c=1 paired, each router on its own core (ms) |" in text
    assert "| ours | - | - | - | +0.50 | +0.500 | +0.200 |" in text
    # Also without a peer to pair with: the added p50 over direct, both ways.
    assert "| added p50 c=1 ms, each router on its own core |" in text
    assert "| ours | 0 | 0.00 | 0.00 | 0.000 | +1.00 | 0.00 | +1.30 |" in text
    assert "| direct | 0 | 0.00 | 0.00 | - | (0.50) | 0.00 | (0.70) |" in text


def test_long_prompts_report_medians_the_ratio_and_decision_time() -> None:
    ours = TargetResult("ours", long_cpu_runs={1000: [2.0, 9.0, 3.0], 64000: [6.0, 5.0, 30.0]},
                        long_cpu_ms={1000: 3.0, 64000: 6.0}, long_decision_us={1000: 40.0,
                                                                               64000: 55.0})
    peer = TargetResult("sglang-router", long_cpu_runs={1000: [1.0], 64000: [4.0]},
                        long_cpu_ms={1000: 1.0, 64000: 4.0})
    text = to_markdown(OverheadResult("cmd", OverheadConfig(long_reps=3), [ours, peer], {}))
    assert "| ours | 3.00 (2.00, 9.00, 3.00) | 6.00 (6.00, 5.00, 30.00) | 2.00x |" in text
    assert "| sglang-router | 1.00 (1.00) | 4.00 (4.00) | 4.00x |" in text
    assert "- ours: routing decision 40 us at 1,000 chars, 55 us at 64,000 chars" in text
    assert "Less what each router spends" not in text  # idle CPU not measured


def test_long_prompts_net_of_idle_cpu() -> None:
    ours = TargetResult("ours", long_cpu_runs={1000: [2.0], 64000: [6.0]},
                        idle_ms_per_s=1.5, long_net_runs={1000: [1.9], 64000: [4.5, 5.0]})
    peer = TargetResult("smg", long_cpu_runs={1000: [1.0], 64000: [4.0]})
    text = to_markdown(OverheadResult("cmd", OverheadConfig(), [ours, peer], {}))
    net = text.split("Less what each router spends")[1]
    assert "(its idle CPU ms per second: ours 1.50)" in net
    assert "| ours | 1.90 (1.90) | 4.75 (4.50, 5.00) | 2.50x |" in net
    assert "| smg |" not in net


def test_histogram_totals_add_up_label_sets_and_skip_buckets() -> None:
    page = (
        "# HELP vllm:time_to_first_token_seconds Time to first token\n"
        'vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 3.0\n'
        'vllm:time_to_first_token_seconds_sum{model_name="m"} 0.25\n'
        'vllm:time_to_first_token_seconds_count{model_name="m"} 3.0\n'
        'vllm:time_to_first_token_seconds_sum{model_name="n"} 0.5\n'
        'vllm:time_to_first_token_seconds_count{model_name="n"} 2.0\n'
        "vllm:time_to_first_token_seconds_sum_other 9.0\n"
        "gateway_route_decision_seconds_sum 0.004\n"
        "gateway_route_decision_seconds_count 8.0\n"
    )
    assert histogram_totals(page, "vllm:time_to_first_token_seconds") == (0.75, 5)
    assert histogram_totals(page, "gateway_route_decision_seconds") == (0.004, 8)
    assert histogram_totals(page, "absent_seconds") == (0.0, 0)


def test_every_router_logs_each_request_alike() -> None:
    # Without request logs none logs per request: our access line off, the peers at warn;
    # with them each logs as it does by default. Never one side only.
    quiet = gateway_command(9000, ["http://w:1"], OverheadConfig())
    assert quiet[quiet.index("--access-log") + 1] == "off"
    logged = gateway_command(9000, ["http://w:1"], OverheadConfig(request_logs=True))
    assert "--access-log" not in logged
    for request_logs, level in ((False, "warn"), (True, "info")):
        peer = peer_command("sglang-router", "h", 1, 2, ["http://w:1"],
                            request_logs=request_logs)
        assert peer[peer.index("--log-level") + 1] == level
    header = to_markdown(OverheadResult(command="x", config=OverheadConfig(), targets=[],
                                        skipped={}))
    assert "No router logs each request" in header


def test_a_variant_may_run_the_gateway_on_another_interpreter() -> None:
    base = gateway_command(9000, ["http://w:1"], OverheadConfig())
    assert base[:3] == [sys.executable, "-m", "gateway"]
    other = gateway_command(9000, ["http://w:1"], OverheadConfig(),
                            ("python=/opt/py/bin/python", "--procs", "1"))
    assert other[:3] == ["/opt/py/bin/python", "-m", "gateway"]
    assert "--procs" in other
    assert not any(a.startswith("python=") for a in other)
    # The report says which interpreter ran it (its build matters to a Python router).
    header = to_markdown(OverheadResult(command="x", config=OverheadConfig(), targets=[],
                                        skipped={}))
    assert f"on CPython {sys.version.split()[0]}" in header


def test_long_requests_share_one_system_prompt_unless_each_has_its_own() -> None:
    for unique in (False, True):
        config = OverheadConfig(long_requests=3, long_unique=unique)
        systems = [json.loads(b)["messages"][0]["content"] for b in long_bodies(config, 5_000)]
        assert len(set(systems)) == (3 if unique else 1)
        assert all(len(text) >= 5_000 for text in systems)
        # A later round sends prompts of its own, or the same one again.
        later = {json.loads(b)["messages"][0]["content"] for b in long_bodies(config, 5_000, 1)}
        assert later.isdisjoint(systems) if unique else later == set(systems)


def test_completions_turns_each_extend_the_prompt_before() -> None:
    config = OverheadConfig(long_requests=4, long_api="completions", long_unique=True)
    prompts = [json.loads(b)["prompt"] for b in long_bodies(config, 5_000)]
    assert len(prompts[0]) >= 5_000
    for before, after in itertools.pairwise(prompts):
        assert after.startswith(before + "\nTurn ")
    later = [json.loads(b)["prompt"] for b in long_bodies(config, 5_000, 1)]
    assert not later[0].startswith(prompts[0][:20])  # a round of its own
    with pytest.raises(ValueError, match="text layout"):
        long_bodies(dataclasses.replace(config, long_text="transcript"), 5_000)


def test_transcript_bodies_share_an_agent_history_of_the_size_asked() -> None:
    config = OverheadConfig(long_requests=2, long_text="transcript")
    first, second = (json.loads(b)["messages"] for b in long_bodies(config, 20_000))
    assert first[1:-1] == second[1:-1]
    assert first[-1] != second[-1]
    results = [m["content"] for m in first if m["role"] == "tool"]
    assert sum(map(len, results)) >= 20_000
    assert len(first) > 60


def test_transcript_turns_grow_by_a_tool_call_and_its_result() -> None:
    config = OverheadConfig(long_requests=3, long_text="transcript-turns")
    turns = [json.loads(b)["messages"] for b in long_bodies(config, 20_000)]
    for earlier, later in itertools.pairwise(turns):
        assert later[:len(earlier)] == earlier  # each turn carries the one before
        assert [m["role"] for m in later[len(earlier):]] == ["assistant", "tool"]
    results = [m["content"] for m in turns[0] if m["role"] == "tool"]
    assert sum(map(len, results)) >= 20_000


def test_agents_sharing_an_opening_take_turns_each_extending_its_own_last() -> None:
    config = OverheadConfig(long_requests=3, long_api="completions", long_sessions=4)
    prompts = [json.loads(b)["prompt"] for b in long_bodies(config, 5_000)]
    assert len(prompts) == 12  # three turns of each of four agents, one agent after another
    opening = prompts[0].rpartition("\nAgent ")[0]
    assert len(opening) >= 5_000
    for i, prompt in enumerate(prompts):
        assert prompt.startswith(f"{opening}\nAgent {i % 4}.")
        if i >= 4:
            assert prompt.startswith(prompts[i - 4] + "\nTurn ")
    chats = OverheadConfig(long_requests=2, long_text="transcript-turns", long_sessions=3)
    loops = [json.loads(b)["messages"] for b in long_bodies(chats, 20_000)]
    assert len(loops) == 6
    first = loops[0]
    assert loops[1] == loops[2] == first  # every agent's first turn: the shared opening
    for s in range(3):
        later = loops[3 + s]
        assert later[:len(first)] == first
        assert [m["role"] for m in later[len(first):]] == ["assistant", "tool"]
    assert loops[3][len(first):] != loops[4][len(first):]  # tool calls of their own
    alone = OverheadConfig(long_requests=3, long_text="transcript-turns")
    assert long_bodies(alone, 20_000) == long_bodies(
        dataclasses.replace(chats, long_requests=3, long_sessions=1), 20_000)


@pytest.mark.parametrize(("api", "expected"), [
    ("embeddings", lambda m: {"model": MODEL, "input": m[0]["content"] + "\n" + m[1]["content"]}),
    ("responses", lambda m: {"model": MODEL, "instructions": m[0]["content"],
                             "input": m[1]["content"], "max_output_tokens": 1}),
])
def test_other_apis_carry_the_chat_texts(api: str, expected: Any) -> None:
    chat, prefixes = bodies_for(OverheadConfig(requests=20))
    asked, same = bodies_for(OverheadConfig(requests=20, api=api))
    assert same == prefixes
    for c, a in zip(chat, asked, strict=True):
        assert json.loads(a) == expected(json.loads(c)["messages"])


def test_cpu_by_process_sums_router_workers_and_client() -> None:
    """On cores they share, the requests/s follow the sum of every process's CPU per request:
    the table gives the router's, the workers' and the client's medians, and their sum."""
    ours = TargetResult("ours", reps=[Rep(100.0, 1.0, 2.0, 0, 0.3, 0.9, 0.2),
                                      Rep(100.0, 1.0, 2.0, 0, 0.5, 1.1, 0.1),
                                      Rep(100.0, 1.0, 2.0, 0, 0.4, 1.0, 0.15)])
    text = to_markdown(OverheadResult("cmd", OverheadConfig(), [ours], {}))
    assert "| ours | 0.400 | 1.000 | 0.150 | 1.550 |" in text
