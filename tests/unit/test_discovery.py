"""Which pods are workers, and at what URL (``gateway.discovery.pod_worker``)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from gateway.discovery import KubernetesOptions, PodDiscovery, pod_worker
from gateway.kvevents.endpoints import EventEndpoints
from gateway.pool import WorkerPool
from gateway.routing.prefix_index import PrefixIndex
from tests.k8s_api import pod

NAMED = KubernetesOptions(selector="app=vllm", port="http")


def test_a_ready_running_pod_is_a_worker_at_its_named_port() -> None:
    worker = pod_worker(pod("a", 8123), NAMED)
    assert worker is not None
    assert worker.url == "http://127.0.0.1:8123"
    assert worker.events is None


def test_a_port_number_needs_no_container_port_and_the_scheme_is_kept() -> None:
    options = KubernetesOptions(selector="app=vllm", port="8000", scheme="vllm+https")
    worker = pod_worker(pod("a", 8123, ip="10.1.2.3"), options)
    assert worker is not None
    assert worker.url == "vllm+https://10.1.2.3:8000"


def test_an_ipv6_pod_address_is_bracketed() -> None:
    worker = pod_worker(pod("a", 8000, ip="fd00::5", annotations={
        "affinity-gateway/kv-events": "5557"}), NAMED)
    assert worker is not None
    assert worker.url == "http://[fd00::5]:8000"
    assert worker.events == EventEndpoints("tcp://[fd00::5]:5557", "")


def _terminating() -> dict[str, Any]:
    p = pod("a", 8000)
    p["metadata"]["deletionTimestamp"] = "2026-12-04T10:00:00Z"
    return p


def _no_ip() -> dict[str, Any]:
    p = pod("a", 8000)
    del p["status"]["podIP"]
    return p


@pytest.mark.parametrize("p", [
    pytest.param(pod("a", 8000, ready=False), id="not-ready"),
    pytest.param(pod("a", 8000, phase="Pending"), id="pending"),
    pytest.param(pod("a", 8000, phase="Succeeded"), id="ended"),
    pytest.param(_terminating(), id="terminating"),
    pytest.param(_no_ip(), id="no-ip"),
])
def test_pods_that_cannot_serve_are_not_workers(p: dict[str, Any]) -> None:
    assert pod_worker(p, NAMED) is None


def test_a_ready_pod_without_the_named_port_is_an_error_to_report() -> None:
    with pytest.raises(ValueError, match="no container port named 'http'"):
        pod_worker(pod("a", 8000, port_name="grpc"), NAMED)


def test_kv_event_annotations_take_a_port_or_an_endpoint() -> None:
    worker = pod_worker(pod("a", 8000, ip="10.0.0.9", annotations={
        "affinity-gateway/kv-events": "tcp://10.0.0.9:6000",
        "affinity-gateway/kv-replay": "6001"}), NAMED)
    assert worker is not None
    assert worker.events == EventEndpoints("tcp://10.0.0.9:6000", "tcp://10.0.0.9:6001")
    with pytest.raises(ValueError, match="port or a tcp://"):
        pod_worker(pod("a", 8000, annotations={"affinity-gateway/kv-events": "zmq"}), NAMED)


def test_the_api_server_and_namespace_default_to_the_pods_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    assert NAMED.resolved_api_url() == "https://10.96.0.1:6443"
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    assert NAMED.resolved_api_url() == "https://[fd00::1]:6443"
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    with pytest.raises(ValueError, match="--k8s-api-url"):
        NAMED.resolved_api_url()
    assert KubernetesOptions(selector="x", namespace="llm").resolved_namespace() == "llm"


def test_a_pod_named_as_another_worker_is_skipped_and_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pool = WorkerPool([], PrefixIndex())
    pool.add("http://10.0.0.1:8000", wid="engine-a", source="registry")
    discovery = PodDiscovery(pool, KubernetesOptions(selector="app=vllm", port="http",
                                                     api_url="http://127.0.0.1:1"))
    with caplog.at_level(logging.WARNING, logger="gateway.discovery"):
        discovery._apply("engine-a", pod("engine-a", 8000))
        discovery._apply("engine-a", pod("engine-a", 8000))  # an update of the same pod
    assert [r.getMessage() for r in caplog.records] == [
        "pod engine-a is not used as a worker: a worker of that id exists"]
    assert discovery.status()["skipped"] == {"engine-a": "a worker of that id exists"}
    assert pool.get("engine-a").source == "registry"
    discovery._apply("engine-a", None)  # deleted: forgotten, the other worker untouched
    assert discovery.status()["skipped"] == {}
    assert "engine-a" in pool


def test_an_object_not_shaped_like_a_pod_is_skipped_not_fatal() -> None:
    pool = WorkerPool([], PrefixIndex())
    discovery = PodDiscovery(pool, KubernetesOptions(selector="app=vllm", port="http",
                                                     api_url="http://127.0.0.1:1"))
    broken = pod("broken", 8001)
    broken["status"] = "Running"  # a string where an object belongs
    discovery._replace_all({"broken": broken, "good": pod("good", 8002)})
    assert discovery.status()["pods"] == ["good"]
    assert "unreadable pod object" in discovery.status()["skipped"]["broken"]
    assert "good" in pool
