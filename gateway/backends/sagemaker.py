"""Amazon SageMaker real-time endpoints as gateway targets (aiobotocore, ``sagemaker-runtime``).

A worker URL ``sagemaker://ENDPOINT?variant=V...`` (see :mod:`gateway.backends.sagemaker_target`)
names one endpoint variant or inference component. ``stream: true`` requests go through
``InvokeEndpointWithResponseStream``, the others through ``InvokeEndpoint``.

* **Clients**: one aiobotocore client per (service, region, endpoint URL), created on first use
  inside the backend's exit stack (opened in :meth:`start`, closed in :meth:`close`); in the usual
  one-region deployment that is one runtime client and one control-plane client (for probes).
  botocore's retries are off (``standard`` mode, ``total_max_attempts=1``): the gateway retries
  across targets itself, before the first byte, and never after streaming began.
* **Affinity inside a variant**: the gateway's prefix anchor (``UpstreamRequest.anchor``, the
  routing decision's anchor) goes out as ``PrefixAwareId`` (a modeled parameter of the
  installed botocore, header ``X-Amzn-SageMaker-Prefix-Aware-Id``), so a ``PREFIX_AWARE`` variant
  keeps one prefix on one instance. With ``session=auto`` a prefix seen ``session_after`` times
  opens a stateful session (``SessionId=NEW_SESSION``, non-streaming calls only, as the API
  allows); later requests of that prefix reuse the returned id (also when streaming) until it
  expires, the container reports it closed (``ClosedSessionId``) or a call with it fails.
* **Errors** (a reply status the proxy understands; nothing has reached the client yet):
  ``ThrottlingException`` and ``ModelNotReadyException`` -> 429, ``ServiceUnavailable`` -> 503,
  ``InternalFailure`` -> 500, ``InternalDependencyException`` -> 502: retried on another target.
  ``ModelError`` (the container itself failed) is never retried: the container's 4xx passes
  through as that status, anything else becomes 424; an OpenAI-shaped error body from the
  container is kept, other bodies are wrapped in one. ``ValidationError`` -> 400. Connection
  failures and timeouts before a reply -> :class:`BackendUnavailable`. Mid-stream
  ``ModelStreamError`` / ``InternalStreamFailure`` end the client's stream with an SSE error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from datetime import datetime
from typing import Any

import aiohttp
from aiobotocore.config import AioConfig
from aiobotocore.session import AioSession, get_session
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    EventStreamError,
    HTTPClientError,
)
from botocore.exceptions import (
    ConnectionError as BotoConnectionError,
)

from gateway.backends.base import BackendUnavailable, UpstreamRequest, WorkerProbe
from gateway.backends.eventstream import LineBuffer
from gateway.backends.kinds import BackendKind, BackendOptions
from gateway.backends.sagemaker_body import (
    BodyError,
    OpenAIStream,
    TGIStream,
    encode_request,
    error_event,
    tgi_reply,
)
from gateway.backends.sagemaker_target import SCHEME, SageMakerTarget, parse_target
from gateway.contracts.errors import openai_error
from gateway.routing.types import Worker

log = logging.getLogger(__name__)

NEW_SESSION = "NEW_SESSION"
RETRIED = {  # SageMaker error code -> reply status that makes the proxy try another target
    "ThrottlingException": 429,
    "ModelNotReadyException": 429,
    "ServiceUnavailable": 503,
    "InternalFailure": 500,
    "InternalDependencyException": 502,
}
_CREDENTIAL_ERRORS = frozenset({
    "AccessDeniedException", "UnrecognizedClientException", "InvalidSignatureException",
    "ExpiredTokenException", "IncompleteSignature", "MissingAuthenticationToken",
})
_SERVING = frozenset({"InService", "Updating", "SystemUpdating", "RollingBack"})


def _snake(code: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", code).lower()


def _openai_error(status: int, message: str, code: str) -> bytes:
    if status == 429:
        kind = "rate_limit_error"
    elif 400 <= status < 500 and status != 424:
        kind = "invalid_request_error"
    else:
        kind = "upstream_error"
    return json.dumps(openai_error(message, kind, code=code)).encode("utf-8")


# -- stateful sessions ---------------------------------------------------------------------------

SessionKey = tuple[str, str]  # (target id, prefix anchor)


class SessionTable:
    """Open stateful sessions by (target, prefix anchor), and how often each prefix was seen.

    Both maps are LRU-bounded; a session is dropped a little before the expiry SageMaker gave.
    """

    def __init__(
        self, capacity: int = 4096, *, clock: Callable[[], float] = time.time,
        margin_s: float = 5.0,
    ) -> None:
        self._capacity = capacity
        self._clock = clock
        self._margin_s = margin_s
        self._open: OrderedDict[SessionKey, tuple[str, float]] = OrderedDict()
        self._seen: OrderedDict[SessionKey, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._open)

    def get(self, key: SessionKey) -> str | None:
        entry = self._open.get(key)
        if entry is None:
            return None
        session_id, expires = entry
        if self._clock() >= expires - self._margin_s:
            del self._open[key]
            return None
        self._open.move_to_end(key)
        return session_id

    def seen(self, key: SessionKey) -> int:
        """Count one more request of this prefix on this target; return the count."""
        count = self._seen.pop(key, 0) + 1
        self._seen[key] = count
        while len(self._seen) > self._capacity:
            self._seen.popitem(last=False)
        return count

    def opened(self, key: SessionKey, header: str) -> str | None:
        """Record ``X-Amzn-SageMaker-New-Session-Id`` (``<id>; Expires=<ISO time>``)."""
        session_id, _, rest = header.partition(";")
        session_id = session_id.strip()
        if not session_id:
            return None
        expires = float("inf")
        match = re.search(r"Expires=([^;]+)", rest)
        if match:
            with contextlib.suppress(ValueError):
                expires = datetime.fromisoformat(match.group(1).strip()).timestamp()
        self._open[key] = (session_id, expires)
        self._open.move_to_end(key)
        while len(self._open) > self._capacity:
            self._open.popitem(last=False)
        return session_id

    def forget(self, key: SessionKey) -> None:
        self._open.pop(key, None)

    def closed(self, target_id: str, session_id: str) -> None:
        for key, (sid, _) in list(self._open.items()):
            if key[0] == target_id and sid == session_id.strip():
                del self._open[key]


# -- replies -------------------------------------------------------------------------------------


class BufferedReply:
    """A whole reply (non-streaming answer, or an error) already in memory."""

    def __init__(self, status: int, body: bytes, headers: Mapping[str, str] | None = None) -> None:
        self.status = status
        self.headers: Mapping[str, str] = {"Content-Type": "application/json", **(headers or {})}
        self._body = body

    async def chunks(self) -> AsyncIterator[bytes]:
        yield self._body

    async def read(self) -> bytes:
        return self._body

    def release(self) -> None:
        return None


class StreamReply:
    """``InvokeEndpointWithResponseStream``'s event stream as the client's SSE stream."""

    def __init__(
        self, response: Mapping[str, Any], translator: OpenAIStream | TGIStream,
        on_failure: Callable[[], None],
    ) -> None:
        self.status = 200
        self.headers: Mapping[str, str] = {"Content-Type": "text/event-stream"}
        self._stream = response["Body"]
        self._translator = translator
        self._on_failure = on_failure

    async def chunks(self) -> AsyncIterator[bytes]:
        lines = LineBuffer()
        try:
            async for event in self._stream:
                part = event.get("PayloadPart")
                if part is None:
                    continue
                data = self._translator.lines(list(lines.feed(part.get("Bytes", b""))))
                if data:
                    yield data
        except EventStreamError as exc:  # ModelStreamError, InternalStreamFailure
            self._on_failure()
            error = exc.response.get("Error", {})
            code = str(error.get("Code", "StreamError"))
            yield error_event(_snake(code), f"SageMaker {code}: {error.get('Message', '')}")
            return
        except (BotoCoreError, aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self._on_failure()
            yield error_event("stream_interrupted",
                              f"the SageMaker stream broke off: {type(exc).__name__}: {exc}")
            return
        tail = self._translator.lines(list(lines.flush())) + self._translator.finish()
        if tail:
            yield tail

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    def release(self) -> None:
        self._stream.close()


# -- the backend ---------------------------------------------------------------------------------


class SageMakerBackend:
    relays_engine_api = False  # an endpoint takes completions only

    def __init__(
        self,
        *,
        connect_timeout_s: float,
        read_timeout_s: float,
        max_connections: int,
        probe_timeout_s: float = 5.0,
        session_capacity: int = 4096,
    ) -> None:
        self._config = AioConfig(
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            max_pool_connections=max_connections,
            # Explicit: no SDK-level retries; the gateway retries on another target instead.
            # (In client config ``max_attempts`` counts retries; ``total_max_attempts`` counts
            # attempts: 1 = the call itself only.)
            retries={"mode": "standard", "total_max_attempts": 1},
        )
        self._probe_timeout_s = probe_timeout_s
        self._session: AioSession | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._clients: dict[tuple[str, str, str], Any] = {}
        self._lock = asyncio.Lock()
        self._targets: dict[str, SageMakerTarget] = {}
        self.sessions = SessionTable(session_capacity)

    async def start(self) -> None:
        self._session = get_session()
        self._stack = contextlib.AsyncExitStack()

    async def close(self) -> None:
        if self._stack is not None:
            await self._stack.aclose()
        self._stack = None
        self._clients.clear()

    def target(self, worker: Worker) -> SageMakerTarget:
        target = self._targets.get(worker.url)
        if target is None:
            target = self._targets[worker.url] = parse_target(worker.url)
        return target

    async def _client(self, service: str, target: SageMakerTarget) -> Any:
        key = (service, target.region, target.endpoint_url)
        client = self._clients.get(key)
        if client is not None:
            return client
        async with self._lock:
            if key not in self._clients:
                if self._session is None or self._stack is None:
                    raise RuntimeError("backend used before start()")
                self._clients[key] = await self._stack.enter_async_context(
                    self._session.create_client(
                        service,
                        region_name=target.region or None,
                        endpoint_url=target.endpoint_url or None,
                        config=self._config,
                    )
                )
            return self._clients[key]

    # -- invoke ----------------------------------------------------------------------------------
    def _params(
        self, target: SageMakerTarget, payload: bytes, request: UpstreamRequest
    ) -> dict[str, Any]:
        params: dict[str, Any] = {
            "EndpointName": target.endpoint,
            "Body": payload,
            "ContentType": "application/json",
            "Accept": "application/json",
        }
        if target.variant:
            params["TargetVariant"] = target.variant
        if target.component:
            params["InferenceComponentName"] = target.component
        anchor = request.anchor
        if anchor and target.prefix_aware:
            params["PrefixAwareId"] = anchor[:64]
        headers = request.headers
        request_id = request.request_id or headers.get("x-request-id", "")
        if request_id:
            params["InferenceId"] = request_id[:64]
        # The trace context reaches the container the only way SageMaker passes caller data
        # through: CustomAttributes (ASCII, at most 1024 characters), as W3C key=value pairs.
        trace = [f"{k}={headers[k]}" for k in ("traceparent", "tracestate") if headers.get(k)]
        if trace and len(attributes := ";".join(trace)) <= 1024:
            params["CustomAttributes"] = attributes
        return params

    def send(self, worker: Worker,
             request: UpstreamRequest) -> Coroutine[Any, Any, BufferedReply | StreamReply]:
        """:meth:`open` as it is: an endpoint's invocations are not ordered among themselves,
        so there is no place in line to take before it is awaited."""
        return self.open(worker, request)

    async def open(
        self, worker: Worker, request: UpstreamRequest
    ) -> BufferedReply | StreamReply:
        target = self.target(worker)
        path, body = request.path, request.body
        try:
            payload = encode_request(target.body, path, body)
        except BodyError as exc:
            return BufferedReply(400, _openai_error(400, str(exc), "unsupported_for_target"))
        stream = bool(body.get("stream"))
        params = self._params(target, payload, request)
        anchor = request.anchor
        key: SessionKey = (target.id, anchor)
        session = ""
        if target.sessions and anchor:
            session = self.sessions.get(key) or ""
            seen = self.sessions.seen(key)
            if not session and not stream and seen >= target.session_after:
                session = NEW_SESSION
        client = await self._guarded(self._client("sagemaker-runtime", target))
        try:
            return await self._invoke(client, target, path, body, params, stream, key, session)
        except ClientError as exc:
            if not session:
                return self._error_reply(exc)
            # A session that failed (expired, closed, instance gone) is forgotten; a rejected
            # session id costs one more call without it, before anything reached the client.
            self.sessions.forget(key)
            if exc.response.get("Error", {}).get("Code") != "ValidationError":
                return self._error_reply(exc)
            log.info("session %s on %s rejected; retrying without it", session, target.id)
        try:
            return await self._invoke(client, target, path, body, params, stream, key, "")
        except ClientError as exc:
            return self._error_reply(exc)

    async def _guarded(self, call: Any) -> Any:
        try:
            return await call
        except (BotoConnectionError, HTTPClientError, aiohttp.ClientError, OSError,
                TimeoutError) as exc:
            raise BackendUnavailable(f"{type(exc).__name__}: {exc}") from exc
        except BotoCoreError as exc:  # no region, no credentials, bad endpoint URL ...
            raise BackendUnavailable(f"SageMaker client: {type(exc).__name__}: {exc}") from exc

    async def _invoke(
        self, client: Any, target: SageMakerTarget, path: str, body: Mapping[str, Any],
        params: dict[str, Any], stream: bool, key: SessionKey, session: str,
    ) -> BufferedReply | StreamReply:
        call = dict(params)
        if session:
            call["SessionId"] = session
        if stream:
            response = await self._guarded(client.invoke_endpoint_with_response_stream(**call))
            translator = TGIStream(path, body) if target.body == "tgi" else OpenAIStream()
            on_failure = (lambda: self.sessions.forget(key)) if session else (lambda: None)
            return StreamReply(response, translator, on_failure)
        response = await self._guarded(client.invoke_endpoint(**call))
        try:
            raw: bytes = await self._guarded(response["Body"].read())
        finally:
            response["Body"].close()
        if session == NEW_SESSION and response.get("NewSessionId"):
            opened = self.sessions.opened(key, str(response["NewSessionId"]))
            log.debug("opened session %s on %s", opened, target.id)
        if response.get("ClosedSessionId"):
            self.sessions.closed(target.id, str(response["ClosedSessionId"]))
        if target.body == "tgi":
            try:
                raw = tgi_reply(path, body, raw)
            except BodyError as exc:
                return BufferedReply(502, _openai_error(502, str(exc), "bad_model_reply"))
        return BufferedReply(200, raw)

    def _error_reply(self, exc: ClientError) -> BufferedReply:
        error = exc.response.get("Error", {})
        code = str(error.get("Code", "Unknown"))
        message = f"SageMaker {code}: {error.get('Message', '')}".strip()
        http = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 502))
        if code == "ModelError":
            original = exc.response.get("OriginalStatusCode")
            original_message = str(exc.response.get("OriginalMessage") or "")
            passes = isinstance(original, int) and 400 <= original < 500 and original not in (
                408, 429)
            status = int(original) if passes else 424
            with contextlib.suppress(ValueError, UnicodeDecodeError):
                decoded = json.loads(original_message)
                if isinstance(decoded, dict) and isinstance(decoded.get("error"), dict):
                    return BufferedReply(status, original_message.encode("utf-8"))
            detail = f" (the model answered {original}: {original_message[:500]})" if (
                original is not None) else ""
            return BufferedReply(status, _openai_error(status, message + detail, "model_error"))
        if code in RETRIED:
            status = RETRIED[code]
        elif code == "ValidationError":
            status = 400
        elif code in _CREDENTIAL_ERRORS or http in (401, 403):
            status = 502  # the gateway's AWS credentials, not the client's request
        else:
            status = http if 400 <= http < 600 else 502
        return BufferedReply(status, _openai_error(status, message, _snake(code)))

    # -- health ----------------------------------------------------------------------------------
    async def probe(self, worker: Worker) -> WorkerProbe:
        try:
            target = self.target(worker)
        except ValueError as exc:
            return WorkerProbe(False, frozenset(), str(exc))
        models = target.advertised_models()
        if not target.probe:
            return WorkerProbe(True, models)
        try:
            client = await self._guarded(self._client("sagemaker", target))
            if target.component:
                described = await asyncio.wait_for(
                    client.describe_inference_component(InferenceComponentName=target.component),
                    self._probe_timeout_s,
                )
                status = described.get("InferenceComponentStatus", "")
                if status not in _SERVING:
                    return WorkerProbe(False, models, f"inference component is {status}")
                return WorkerProbe(True, models)
            described = await asyncio.wait_for(
                client.describe_endpoint(EndpointName=target.endpoint), self._probe_timeout_s
            )
        except (ClientError, BotoCoreError, BackendUnavailable, TimeoutError) as exc:
            return WorkerProbe(False, frozenset(), f"{type(exc).__name__}: {exc}")
        status = described.get("EndpointStatus", "")
        if status not in _SERVING:
            return WorkerProbe(False, models, f"endpoint is {status}")
        if target.variant:
            variants = {v.get("VariantName"): v for v in described.get("ProductionVariants", [])}
            variant = variants.get(target.variant)
            if variant is None:
                return WorkerProbe(False, models, f"endpoint has no variant {target.variant!r}")
            if variant.get("CurrentInstanceCount", 1) < 1:
                return WorkerProbe(False, models, "variant has no instance in service")
        return WorkerProbe(True, models)


def _build(options: BackendOptions) -> SageMakerBackend:
    return SageMakerBackend(
        connect_timeout_s=options.connect_timeout_s,
        read_timeout_s=options.read_timeout_s,
        max_connections=options.max_connections,
    )


# The query of a target URL describes the target; the gateway invokes it in its own AWS
# account, whose cache size no probe reports.
SAGEMAKER = BackendKind(
    "sagemaker", (SCHEME,), worker_id=lambda url: parse_target(url).id,
    target_url=lambda url: url, build=_build,
    query_names_credentials=False, trust_unconfirmed_capacity=True,
)
