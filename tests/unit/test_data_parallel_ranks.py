"""Data-parallel engine ranks behind one worker URL (``#dp-size=N``): each a worker of its own,
pinned by ``X-data-parallel-rank``, with its own metrics and KV-event endpoints."""

from __future__ import annotations

import pytest

from gateway.backends.metrics_page import parse_engine_metrics
from gateway.discovery import KubernetesOptions, PodDiscovery, pod_worker
from gateway.kvevents.endpoints import EventEndpoints, data_parallel_size, split_url
from gateway.pool import WorkerPool
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.types import Worker
from infra.local import LocalCluster
from tests.k8s_api import pod

EVENTS = "#kv-events=tcp://10.0.0.5:5557&kv-replay=tcp://10.0.0.5:5600"


def test_the_size_comes_from_the_fragment_and_is_checked() -> None:
    assert data_parallel_size("http://10.0.0.5:8000") == 1
    assert data_parallel_size("http://10.0.0.5:8000#dp-size=4") == 4
    assert data_parallel_size("http://10.0.0.5:8000" + EVENTS + "&dp-size=2") == 2
    for bad in ("0", "x", "-1", "1.5", "257", ""):
        with pytest.raises(ValueError, match="dp-size must be"):
            data_parallel_size(f"http://10.0.0.5:8000#dp-size={bad}")
    with pytest.raises(ValueError, match="known: kv-events, kv-replay, dp-size"):
        data_parallel_size("http://10.0.0.5:8000#dp=2")
    # The events part of the fragment reads as before beside it.
    assert split_url("http://h:1" + EVENTS + "&dp-size=2")[1] == EventEndpoints(
        "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5600")


def test_each_rank_publishes_on_the_ports_plus_its_rank() -> None:
    base = EventEndpoints("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5600")
    assert base.for_rank(0) is base
    assert base.for_rank(3) == EventEndpoints("tcp://10.0.0.5:5560", "tcp://10.0.0.5:5603")
    assert EventEndpoints("tcp://[::1]:5557").for_rank(1) == EventEndpoints("tcp://[::1]:5558")
    assert EventEndpoints("ipc:///run/kv").for_rank(2) == EventEndpoints("ipc:///run/kv_dp2")
    with pytest.raises(ValueError, match="no port for rank 2"):
        EventEndpoints("tcp://h:65534").for_rank(2)
    with pytest.raises(ValueError, match="names no port"):
        split_url("http://h:1#kv-events=tcp://h")


def test_an_endpoint_of_ranks_is_a_worker_per_rank() -> None:
    pool = WorkerPool(["http://10.0.0.5:8000#dp-size=3&kv-events=tcp://10.0.0.5:5557"],
                      PrefixIndex())
    ids = sorted(s.worker.id for s in pool.states())
    assert ids == ["10.0.0.5:8000/dp0", "10.0.0.5:8000/dp1", "10.0.0.5:8000/dp2"]
    ranks = {s.worker.id: s.worker for s in pool.states()}
    assert [ranks[i].rank for i in ids] == [0, 1, 2]
    assert {w.url for w in ranks.values()} == {"http://10.0.0.5:8000"}
    assert {w.endpoint_id for w in ranks.values()} == {"10.0.0.5:8000"}
    assert pool.event_endpoints() == {
        f"10.0.0.5:8000/dp{r}": EventEndpoints(f"tcp://10.0.0.5:{5557 + r}") for r in range(3)}
    # The endpoint's id stands for its ranks.
    assert "10.0.0.5:8000" in pool
    assert pool.get("10.0.0.5:8000").worker.rank == 0
    pool.set_events("10.0.0.5:8000", EventEndpoints("tcp://10.0.0.5:7000"))
    assert pool.event_endpoints()["10.0.0.5:8000/dp2"] == EventEndpoints("tcp://10.0.0.5:7002")
    pool.remove("10.0.0.5:8000")
    assert pool.states() == []
    assert "10.0.0.5:8000" not in pool


def test_a_single_engine_keeps_its_plain_id_and_no_rank() -> None:
    pool = WorkerPool(["http://10.0.0.5:8000#dp-size=1"], PrefixIndex())
    (state,) = pool.states()
    assert state.worker == Worker("10.0.0.5:8000", "http://10.0.0.5:8000")
    assert state.worker.endpoint_id == "10.0.0.5:8000"


def test_ranks_need_a_backend_that_can_pin_them() -> None:
    with pytest.raises(ValueError, match="dp-size needs"):
        WorkerPool(["sagemaker://my-endpoint/variant-a#dp-size=2"], PrefixIndex())
    pool = WorkerPool(["vllm+http://10.0.0.5:8000#dp-size=2"], PrefixIndex())
    assert {s.worker.kind for s in pool.states()} == {"vllm"}


PAGE = """\
# HELP vllm:num_requests_running Requests running.
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 5.0
vllm:num_requests_waiting{model_name="m",engine="1"} 2.0
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="200"} 1.0
"""


def test_a_rank_reads_its_own_engine_series() -> None:
    assert parse_engine_metrics(PAGE, 0) == {
        "vllm:num_requests_running": 3.0, "cache_capacity_tokens": 1600.0}
    assert parse_engine_metrics(PAGE, 1) == {
        "vllm:num_requests_running": 5.0, "vllm:num_requests_waiting": 2.0,
        "cache_capacity_tokens": 3200.0}
    # The whole server, as one worker: the load of every engine.
    assert parse_engine_metrics(PAGE)["vllm:num_requests_running"] == 8.0
    # A page without the label speaks for every rank alike.
    plain = 'vllm:num_requests_running{model_name="m"} 4.0\n'
    assert parse_engine_metrics(plain, 1) == {"vllm:num_requests_running": 4.0}


def test_a_pod_annotated_with_ranks_is_a_worker_per_rank() -> None:
    options = KubernetesOptions(selector="app=vllm", port="http",
                                api_url="http://127.0.0.1:1")
    annotated = pod("engine-a", 8000, ip="10.0.0.9",
                    annotations={"affinity-gateway/dp-size": "2"})
    worker = pod_worker(annotated, options)
    assert worker is not None
    assert worker.url == "http://10.0.0.9:8000#dp-size=2"
    with pytest.raises(ValueError, match="dp-size must be"):
        pod_worker(pod("b", 8000, annotations={"affinity-gateway/dp-size": "two"}), options)
    pool = WorkerPool([], PrefixIndex())
    discovery = PodDiscovery(pool, options)
    discovery._apply("engine-a", annotated)
    assert sorted(s.worker.id for s in pool.states()) == ["engine-a/dp0", "engine-a/dp1"]
    assert {s.source for s in pool.states()} == {"kubernetes"}
    discovery._apply("engine-a", None)  # deleted: both ranks leave
    assert pool.states() == []


def test_what_is_said_of_an_endpoint_is_said_of_each_rank() -> None:
    pool = WorkerPool([], PrefixIndex())
    pool.add("http://10.0.0.5:8000", wid="engine-a", source="registry", dp_size=2)
    ranks = ["engine-a/dp0", "engine-a/dp1"]
    pool.mark_up("engine-a", frozenset({"m"}))
    assert [pool.get(r).healthy for r in ranks] == [True, True]
    assert [pool.get(r).worker.models for r in ranks] == [frozenset({"m"})] * 2
    pool.set_weights({"engine-a": 2.0})
    assert [pool.get(r).worker.weight for r in ranks] == [2.0, 2.0]
    pool.set_capacity("engine-a", 300)
    assert pool.capacities() == {"engine-a/dp0": 300, "engine-a/dp1": 300}
    # One rank leaving leaves the endpoint its other rank.
    pool.remove("engine-a/dp0")
    assert "engine-a" in pool
    assert pool.get("engine-a").worker.id == "engine-a/dp1"
    pool.remove("engine-a/dp1")
    assert "engine-a" not in pool
    assert pool.states() == []


def test_ranks_whose_event_ports_would_collide_are_refused() -> None:
    # vLLM adds the rank to both ports: rank 1's events would be rank 0's replay.
    with pytest.raises(ValueError, match="leave 2 ports between them"):
        WorkerPool(["http://h:8000#dp-size=2&kv-events=tcp://h:5557&kv-replay=tcp://h:5558"],
                   PrefixIndex())
    pool = WorkerPool(["http://h:8000#dp-size=2&kv-events=tcp://h:5557&kv-replay=tcp://h:5559"],
                      PrefixIndex())
    assert pool.event_endpoints()["h:8000/dp1"] == EventEndpoints("tcp://h:5558", "tcp://h:5560")


def test_a_pod_whose_ranks_would_share_event_ports_is_not_a_worker() -> None:
    options = KubernetesOptions(selector="app=vllm", port="http", api_url="http://127.0.0.1:1")
    with pytest.raises(ValueError, match="leave 4 ports between them"):
        pod_worker(pod("a", 8000, annotations={
            "affinity-gateway/dp-size": "4", "affinity-gateway/kv-events": "5557",
            "affinity-gateway/kv-replay": "5558"}), options)


def test_a_local_cluster_of_ranks_starts_them_and_lists_them() -> None:
    cluster = LocalCluster(workers=2, worker_base_port=9001, dp_size=4)
    for cmd in cluster.worker_commands():
        assert cmd[cmd.index("--data-parallel-size") + 1] == "4"
    gateway = cluster.gateway_command()
    assert [gateway[i + 1] for i, a in enumerate(gateway) if a == "--worker"] == [
        "http://127.0.0.1:9001#dp-size=4", "http://127.0.0.1:9002#dp-size=4"]
    plain = LocalCluster(workers=1)
    assert "--data-parallel-size" not in plain.worker_commands()[0]
    assert "#" not in " ".join(plain.gateway_command())


def test_a_cache_size_without_the_engine_label_is_every_ranks() -> None:
    page = ('vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="50"} 1.0\n')
    assert parse_engine_metrics(page, 1) == {
        "vllm:num_requests_running": 2.0, "cache_capacity_tokens": 800.0}
