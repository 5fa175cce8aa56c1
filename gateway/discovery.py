"""Workers found in Kubernetes: the ready pods a label selector names, as they come and go.

``--k8s-selector app=vllm`` makes the gateway list the pods of its namespace that carry those
labels and then watch them (the API server's list-then-watch protocol: ``GET
/api/v1/namespaces/NS/pods?labelSelector=...``, then the same with ``watch=1`` from the list's
``resourceVersion``, newline-delimited ``{"type": ..., "object": Pod}`` events). A pod is a
worker while it is running, not being deleted, has an IP and its ``Ready`` condition is true;
its URL is ``SCHEME://POD_IP:PORT``, where ``--k8s-port`` is a number or the name of a
container port (so pods of different shapes can name their port alike), and ``--k8s-scheme
vllm+http`` makes them vLLM workers (tenant namespaces go as ``cache_salt``). The worker's id is
the pod's name. A pod that stops being ready or is deleted leaves the routing at once (its
requests in flight finish); one that becomes ready joins and is probed at once (the health
loop's next round starts) before it takes requests.

Annotations on a pod name where its engine publishes KV events (``affinity-gateway/kv-events``
and ``affinity-gateway/kv-replay``: a port, or a ``tcp://`` endpoint), as a ``--worker`` URL's
fragment does (:mod:`gateway.kvevents.endpoints`); ``affinity-gateway/dp-size: "N"`` says the pod
serves N data-parallel engine ranks behind its port (vLLM's ``--data-parallel-size``), each
routed to as a worker ``POD/dp<r>`` of its own.

In a pod, the defaults need nothing else: the API server from ``KUBERNETES_SERVICE_HOST`` and
``KUBERNETES_SERVICE_PORT``, the service account's token (read again for every request, since
the kubelet rotates it), CA certificate and namespace from
``/var/run/secrets/kubernetes.io/serviceaccount``. The account needs ``get``, ``list`` and
``watch`` on ``pods`` in that namespace. A watch that ends is resumed from the last version
seen (bookmarks keep it current); one the server no longer has (410 Gone) starts again from a
fresh list; errors are logged and retried with a backoff of up to 30 s, and the workers known
so far keep serving meanwhile. Discovered workers sit beside ``--worker`` ones and registered
ones; discovery only ever removes the workers it added.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.contracts.tasks import stop_if_cancelled
from gateway.kvevents.endpoints import EventEndpoints, data_parallel_size
from gateway.pool import WorkerPool

log = logging.getLogger(__name__)

SOURCE = "kubernetes"  # the pool's source label of discovered workers
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
KV_EVENTS_ANNOTATION = "affinity-gateway/kv-events"
KV_REPLAY_ANNOTATION = "affinity-gateway/kv-replay"
DP_SIZE_ANNOTATION = "affinity-gateway/dp-size"
WATCH_TIMEOUT_S = 300  # the server ends each watch after this; it is resumed at once
MAX_EVENT_BYTES = 16 * 1024 * 1024  # one pod's JSON, managed fields included
_BACKOFF_S = (0.5, 30.0)
QUICK_END_S = 1.0  # a watch that ends this soon with no event is retried after a backoff


@dataclass(frozen=True, slots=True)
class KubernetesOptions:
    selector: str  # a label selector, e.g. "app=vllm,tier=gpu"
    namespace: str = ""  # "": the service account's namespace, else "default"
    port: str = "8000"  # a container port number, or a container port's name
    scheme: str = "http"  # or https, vllm+http, vllm+https (gateway.backends.registry)
    api_url: str = ""  # "": https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT
    token_file: str = str(SERVICE_ACCOUNT / "token")
    ca_file: str = str(SERVICE_ACCOUNT / "ca.crt")

    def resolved_api_url(self) -> str:
        if self.api_url:
            return self.api_url.rstrip("/")
        host = os.environ.get("KUBERNETES_SERVICE_HOST", "")
        if not host:
            raise ValueError("--k8s-selector outside a pod needs --k8s-api-url (no "
                             "KUBERNETES_SERVICE_HOST in the environment)")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"

    def resolved_namespace(self) -> str:
        if self.namespace:
            return self.namespace
        try:
            return (SERVICE_ACCOUNT / "namespace").read_text().strip() or "default"
        except OSError:
            return "default"


class DiscoveryCollector(Collector):
    """``gateway_discovery_up``, ``gateway_discovery_pods`` and ``gateway_discovery_errors``
    at scrape time."""

    def __init__(self, discovery: PodDiscovery) -> None:
        self._discovery = discovery

    def collect(self) -> Iterator[Metric]:
        d = self._discovery
        up = GaugeMetricFamily("gateway_discovery_up",
                               "1 while the Kubernetes API answers pod discovery, else 0")
        up.add_metric([], 1.0 if d.up else 0.0)
        pods = GaugeMetricFamily("gateway_discovery_pods",
                                 "ready pods of the selector used as workers")
        pods.add_metric([], float(d.pod_count()))
        errors = CounterMetricFamily("gateway_discovery_errors",
                                     "pod list or watch requests that failed")
        errors.add_metric([], float(d.errors))
        yield from (up, pods, errors)


class Gone(Exception):
    """The server no longer has the version a watch asked for: list again."""


def _port(pod: Mapping[str, Any], port: str) -> int | None:
    if port.isdigit():
        return int(port)
    for container in pod.get("spec", {}).get("containers", ()):
        for p in container.get("ports", ()) or ():
            if p.get("name") == port and isinstance(p.get("containerPort"), int):
                return int(p["containerPort"])
    return None


def _ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status", {})
    if pod.get("metadata", {}).get("deletionTimestamp") or status.get("phase") != "Running":
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in status.get("conditions", ()) or ())


def _endpoint(value: str, ip: str) -> str:
    """An annotation's endpoint: a port on the pod's IP, or a whole ``tcp://`` address."""
    value = value.strip()
    if value.isdigit():
        return f"tcp://[{ip}]:{value}" if ":" in ip else f"tcp://{ip}:{value}"
    if not value.startswith("tcp://"):
        raise ValueError(f"a KV-event annotation is a port or a tcp:// endpoint, not {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class PodWorker:
    """What a ready pod serves: its URL and where its engine publishes KV events."""

    url: str
    events: EventEndpoints | None = None


def pod_worker(pod: Mapping[str, Any], options: KubernetesOptions) -> PodWorker | None:
    """The worker a pod is, or None while it is not one (not running and ready, no IP).
    Raises ValueError for a ready pod that cannot be one: no container port of that name, a
    malformed KV-event or data-parallel annotation."""
    ip = pod.get("status", {}).get("podIP")
    if not _ready(pod) or not isinstance(ip, str) or not ip:
        return None
    port = _port(pod, options.port)
    if port is None:
        raise ValueError(f"it has no container port named {options.port!r}")
    host = f"[{ip}]" if ":" in ip else ip
    annotations = pod.get("metadata", {}).get("annotations") or {}
    events = None
    if annotations.get(KV_EVENTS_ANNOTATION):
        replay = annotations.get(KV_REPLAY_ANNOTATION, "")
        events = EventEndpoints(_endpoint(annotations[KV_EVENTS_ANNOTATION], ip),
                                _endpoint(replay, ip) if replay else "")
    url = f"{options.scheme}://{host}:{port}"
    dp_size = str(annotations.get(DP_SIZE_ANNOTATION, "")).strip()
    if dp_size and dp_size != "1":
        url += f"#dp-size={dp_size}"
        ranks = data_parallel_size(url)  # a malformed size makes the pod unusable, said once
        if events is not None:
            events.ranks(ranks)  # so do event ports the ranks would share
    return PodWorker(url, events)


async def _lines(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The newline-delimited JSON documents of a watch response, as they arrive."""
    buffer = bytearray()
    async for chunk in response.content.iter_any():
        start = len(buffer)
        buffer += chunk
        while (end := buffer.find(b"\n", start)) >= 0:
            line = bytes(buffer[:end])
            del buffer[:end + 1]
            start = 0
            if line.strip():
                yield line
        if len(buffer) > MAX_EVENT_BYTES:
            raise ValueError(f"a watch event over {MAX_EVENT_BYTES} bytes")
    if buffer.strip():
        yield bytes(buffer)


class PodDiscovery:
    """Keeps the pool's discovered workers equal to the selector's ready pods."""

    def __init__(self, pool: WorkerPool, options: KubernetesOptions) -> None:
        self.pool = pool
        self.options = options
        self.api_url = options.resolved_api_url()
        self.namespace = options.resolved_namespace()
        self._path = (f"{self.api_url}/api/v1/namespaces/{quote(self.namespace, safe='')}"
                      "/pods")
        self._pods: dict[str, PodWorker] = {}  # pod name -> the worker it is
        self._skipped: dict[str, str] = {}  # ready pods not used as workers -> why
        # Told each pod's worker id as it joins (the health loop probes it at once).
        self.joined: Callable[[str], None] | None = None
        # Set once the first list was applied or failed: start-up waits for no more.
        self.first_try = asyncio.Event()
        self.up = False  # the last list or watch was answered
        self.lists = 0  # full lists applied (the first, then one after each 410)
        self.events = 0  # watch events read
        self.errors = 0
        self.last_error = ""

    # -- what the pods say --------------------------------------------------------------------
    def _apply(self, name: str, pod: Mapping[str, Any] | None) -> None:
        """Pod ``name`` is now ``pod`` (None: deleted): add, replace or remove its worker."""
        reason = ""
        try:
            worker = pod_worker(pod, self.options) if pod is not None else None
        except ValueError as exc:
            reason, worker = str(exc), None
        except (AttributeError, KeyError, TypeError) as exc:  # not shaped like a pod
            reason, worker = f"unreadable pod object ({type(exc).__name__}: {exc})", None
        known = self._pods.get(name)
        if worker is not None and known is None and name in self.pool:
            reason, worker = "a worker of that id exists", None
        if reason:
            self._skip(name, reason)
        else:
            self._skipped.pop(name, None)
        if known == worker:
            return
        if known is not None and worker is not None and known.url == worker.url:
            self._pods[name] = worker  # only its KV-event endpoints changed
            if name in self.pool:
                self.pool.set_events(name, worker.events)
            return
        if known is not None:
            del self._pods[name]
            self._remove(name)
        if worker is not None:
            self._pods[name] = worker
            self.pool.add(worker.url, wid=name, source=SOURCE, events=worker.events)
            if self.joined is not None:
                self.joined(name)

    def _skip(self, name: str, reason: str) -> None:
        """A ready pod that is not used as a worker: said once per reason (a pod's updates
        repeat it), and listed in :meth:`status`."""
        if self._skipped.get(name) != reason:
            log.warning("pod %s is not used as a worker: %s", name, reason)
        self._skipped[name] = reason

    def _remove(self, name: str) -> None:
        if name in self.pool and self.pool.get(name).source == SOURCE:
            self.pool.remove(name)

    def _replace_all(self, pods: Mapping[str, Mapping[str, Any]]) -> None:
        for name in [n for n in (*self._pods, *self._skipped) if n not in pods]:
            self._apply(name, None)
        for name, pod in pods.items():
            self._apply(name, pod)

    def pod_count(self) -> int:
        """Pods used as workers now."""
        return len(self._pods)

    def status(self) -> dict[str, Any]:
        """What ``/admin/workers`` says of discovery."""
        return {"selector": self.options.selector, "namespace": self.namespace,
                "api_url": self.api_url, "up": self.up, "pods": sorted(self._pods),
                "skipped": dict(sorted(self._skipped.items())),
                "lists": self.lists, "errors": self.errors, "last_error": self.last_error}

    # -- the API server -----------------------------------------------------------------------
    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        try:
            token = Path(self.options.token_file).read_text().strip()
        except OSError:
            token = ""
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return headers

    def _ssl(self) -> ssl.SSLContext | bool:
        if not self.api_url.startswith("https://"):
            return True
        if Path(self.options.ca_file).is_file():
            return ssl.create_default_context(cafile=self.options.ca_file)
        return True

    async def _get(self, http: aiohttp.ClientSession, params: dict[str, str],
                   limits: aiohttp.ClientTimeout) -> aiohttp.ClientResponse:
        response = await http.get(self._path, params=params, headers=self._headers(),
                                  ssl=self._ssl(), timeout=limits)
        if response.status == 410:
            response.release()
            raise Gone
        if response.status != 200:
            text = (await response.text())[:300]
            response.release()
            raise aiohttp.ClientResponseError(
                response.request_info, (), status=response.status,
                message=f"{response.reason}: {text}")
        return response

    async def list_pods(self, http: aiohttp.ClientSession) -> str:
        """List the selector's pods, make the pool agree, and return the list's version."""
        timeout = aiohttp.ClientTimeout(total=30)
        response = await self._get(http, {"labelSelector": self.options.selector}, timeout)
        async with response:
            body = await response.json(content_type=None)
        pods = {p["metadata"]["name"]: p for p in body.get("items", ())}
        self._replace_all(pods)
        self.up = True
        self.lists += 1
        return str(body.get("metadata", {}).get("resourceVersion", ""))

    async def watch(self, http: aiohttp.ClientSession, version: str) -> str:
        """Apply the pods' changes from ``version`` on until the server ends the watch;
        returns the last version seen. Raises :class:`Gone` when the version is too old."""
        params = {"labelSelector": self.options.selector, "watch": "1",
                  "allowWatchBookmarks": "true", "timeoutSeconds": str(WATCH_TIMEOUT_S)}
        if version:
            params["resourceVersion"] = version
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30,
                                        sock_read=WATCH_TIMEOUT_S + 30)
        response = await self._get(http, params, timeout)
        self.up = True
        async with response:
            async for line in _lines(response):
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise Gone
                    raise ValueError(f"watch error {obj.get('code')}: {obj.get('message')}")
                self.events += 1
                meta = obj.get("metadata", {})
                version = str(meta.get("resourceVersion", version))
                if kind in ("ADDED", "MODIFIED"):
                    self._apply(meta["name"], obj)
                elif kind == "DELETED":
                    self._apply(meta["name"], None)
        return version

    async def run(self) -> None:
        """List, then watch, for as long as the gateway runs."""
        backoff = _BACKOFF_S[0]
        async with aiohttp.ClientSession() as http:
            version = ""
            while True:
                try:
                    if not version:
                        try:
                            version = await self.list_pods(http)
                        finally:
                            self.first_try.set()
                        log.info("kubernetes: %d ready pod(s) for %r in %s", len(self._pods),
                                 self.options.selector, self.namespace)
                    began = asyncio.get_running_loop().time()
                    events = self.events
                    version = await self.watch(http, version)
                    if (self.events == events
                            and asyncio.get_running_loop().time() - began < QUICK_END_S):
                        # Ended at once with nothing said (a proxy that does not hold
                        # streams?): wait before the next, as after an error.
                        await asyncio.sleep(backoff)
                        backoff = min(backoff * 2, _BACKOFF_S[1])
                    else:
                        backoff = _BACKOFF_S[0]
                except Gone:
                    version = ""  # the next round lists afresh
                except Exception as exc:  # discovery must outlive any answer it gets
                    stop_if_cancelled()
                    if not isinstance(exc, TimeoutError | aiohttp.ClientError):
                        version = ""  # an answer we could not read: list afresh
                    self.up = False
                    self.errors += 1
                    self.last_error = f"{type(exc).__name__}: {exc}"[:300]
                    expected = isinstance(exc, TimeoutError | aiohttp.ClientError | ValueError
                                          | KeyError | TypeError)
                    log.log(logging.WARNING if expected else logging.ERROR,
                            "kubernetes pod discovery: %s: %s (retrying in %.1f s)",
                            type(exc).__name__, exc, backoff, exc_info=not expected)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, _BACKOFF_S[1])
