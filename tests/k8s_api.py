"""A Kubernetes API test server: the pods of one namespace, on the real wire format.

aiohttp on 127.0.0.1, answering what a client of the core API's pods sends:

* ``GET /api/v1/namespaces/{ns}/pods?labelSelector=...``: a ``PodList`` with the list's
  ``metadata.resourceVersion``; equality selectors (``k=v``, ``k==v``, ``k!=v``, comma-joined).
* The same with ``watch=1`` (or ``true``) from ``resourceVersion``: newline-delimited
  ``{"type": "ADDED"|"MODIFIED"|"DELETED", "object": Pod}`` events written as they happen,
  ``BOOKMARK`` events (an object with only ``metadata.resourceVersion``) when
  ``allowWatchBookmarks`` is set and :meth:`bookmark` is called, the stream ended after
  ``timeoutSeconds``. A version older than the history kept (:meth:`compact`) is answered as
  the API server does: a 200 stream with one ``ERROR`` event holding a ``Status`` of code 410
  ("Expired"), or with ``gone_as_status`` an HTTP 410 carrying that ``Status``.
* A bearer token other than :attr:`token` gets a 401 ``Status``.

Pods are built by :func:`pod` in the shape the kubelet reports them (phase, ``podIP``,
``Ready`` condition, container ports, annotations); every change gets the next
``resourceVersion``. Every request is recorded in :attr:`calls` (its query parameters).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime as dt
import json
import uuid
from typing import Any

from aiohttp import web


def pod(name: str, port: int, *, ready: bool = True, labels: dict[str, str] | None = None,
        ip: str = "127.0.0.1", port_name: str = "http", phase: str = "Running",
        annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """A pod as the API server returns it (the fields discovery reads, and some it does not)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name, "namespace": "default", "uid": str(uuid.uuid4()),
            "labels": labels if labels is not None else {"app": "vllm"},
            "annotations": annotations or {},
            "creationTimestamp": "2026-12-04T10:00:00Z",
        },
        "spec": {
            "containers": [{
                "name": "engine", "image": "vllm/vllm-openai:latest",
                "ports": [{"name": "metrics-side", "containerPort": 9090, "protocol": "TCP"},
                          {"name": port_name, "containerPort": port, "protocol": "TCP"}],
            }],
        },
        "status": {
            "phase": phase, "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": "10.0.0.1",
            "conditions": [
                {"type": "Initialized", "status": "True"},
                {"type": "Ready", "status": "True" if ready else "False"},
                {"type": "ContainersReady", "status": "True" if ready else "False"},
            ],
        },
    }


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


def _matches(labels: dict[str, str], selector: str) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        else:
            key, _, value = term.replace("==", "=").partition("=")
            if labels.get(key.strip()) != value.strip():
                return False
    return True


class KubernetesAPI:
    def __init__(self, token: str = "secret-token", gone_as_status: bool = False) -> None:
        self.token = token
        self.gone_as_status = gone_as_status
        self.hold_watches = True  # False: each watch ends at once, empty (a bad proxy)
        self.pods: dict[str, dict[str, Any]] = {}
        self.version = 100
        self.history: list[tuple[int, str, dict[str, Any]]] = []
        self.oldest = 100  # watches from an older version are told 410 Gone
        self.calls: list[dict[str, str]] = []
        self._changed = asyncio.Condition()
        self._streams: dict[int, web.Request] = {}  # the requests of the open watches
        self._bookmarks: list[int] = []
        self._closing = False

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._pods)
        app.on_shutdown.append(self._close)
        return app

    async def _close(self, _: web.Application) -> None:
        """Open watches end when the server shuts down (they would otherwise hold it)."""
        self._closing = True
        async with self._changed:
            self._changed.notify_all()

    # -- changes the tests make ---------------------------------------------------------------
    async def _record(self, kind: str, obj: dict[str, Any]) -> None:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        self.history.append((self.version, kind, copy.deepcopy(obj)))
        async with self._changed:
            self._changed.notify_all()

    async def put(self, obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        kind = "MODIFIED" if name in self.pods else "ADDED"
        self.pods[name] = obj
        await self._record(kind, obj)

    async def set_ready(self, name: str, ready: bool) -> None:
        obj = self.pods[name]
        for condition in obj["status"]["conditions"]:
            if condition["type"] in ("Ready", "ContainersReady"):
                condition["status"] = "True" if ready else "False"
        await self._record("MODIFIED", obj)

    async def terminate(self, name: str) -> None:
        """The pod is being deleted: it stays listed, with a deletion timestamp."""
        obj = self.pods[name]
        obj["metadata"]["deletionTimestamp"] = dt.datetime.now(dt.UTC).isoformat()
        await self._record("MODIFIED", obj)

    async def delete(self, name: str) -> None:
        await self._record("DELETED", self.pods.pop(name))

    async def bookmark(self) -> None:
        """Watches that allow bookmarks get one at the current version."""
        self._bookmarks.append(self.version)
        async with self._changed:
            self._changed.notify_all()

    def compact(self) -> None:
        """Forget the history: a watch resumed from any version seen so far gets 410."""
        self.history.clear()
        self.oldest = self.version + 1

    async def drop_watches(self) -> None:
        """End every open watch abruptly (a restarted API server, a dropped connection)."""
        for request in list(self._streams.values()):
            if request.transport is not None:
                request.transport.close()

    def watches(self) -> int:
        return len(self._streams)

    # -- the API ------------------------------------------------------------------------------
    async def _pods(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        self.calls.append(query)
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response(_status(401, "Unauthorized", "Unauthorized"), status=401)
        selector = query.get("labelSelector", "")
        if query.get("watch") not in ("1", "true"):
            items = [p for p in self.pods.values()
                     if _matches(p["metadata"].get("labels", {}), selector)]
            return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                      "metadata": {"resourceVersion": str(self.version)},
                                      "items": items})
        return await self._watch(request, query, selector)

    async def _watch(self, request: web.Request, query: dict[str, str],
                     selector: str) -> web.StreamResponse:
        since = int(query.get("resourceVersion") or self.version)
        expired = _status(410, "Expired", f"too old resource version: {since} ({self.oldest})")
        if since < self.oldest - 1 and self.gone_as_status:
            return web.json_response(expired, status=410)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        if not self.hold_watches:
            return response
        self._streams[id(request)] = request
        try:
            if since < self.oldest - 1:
                await response.write(json.dumps({"type": "ERROR", "object": expired}).encode()
                                     + b"\n")
                return response
            bookmarks = query.get("allowWatchBookmarks") == "true"
            seen_bookmarks = len(self._bookmarks)
            deadline = asyncio.get_running_loop().time() + float(
                query.get("timeoutSeconds", "1800"))
            sent = since
            while True:
                for version, kind, obj in self.history:
                    if version > sent and _matches(obj["metadata"].get("labels", {}),
                                                   selector):
                        await response.write(
                            json.dumps({"type": kind, "object": obj}).encode() + b"\n")
                    sent = max(sent, version)
                if bookmarks:
                    for version in self._bookmarks[seen_bookmarks:]:
                        mark = {"kind": "Pod", "apiVersion": "v1",
                                "metadata": {"resourceVersion": str(version)}}
                        await response.write(
                            json.dumps({"type": "BOOKMARK", "object": mark}).encode() + b"\n")
                seen_bookmarks = len(self._bookmarks)
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0 or self._closing:
                    return response
                async with self._changed:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._changed.wait(), left)
        finally:
            self._streams.pop(id(request), None)
