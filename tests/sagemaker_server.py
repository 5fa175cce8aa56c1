"""A SageMaker-runtime test server: what moto lacks, on the real wire format.

aiohttp on 127.0.0.1, speaking what botocore's ``sagemaker-runtime`` client sends and parses:

* ``POST /endpoints/{name}/invocations``: the container's answer as the body; stateful sessions
  (``X-Amzn-SageMaker-Session-Id: NEW_SESSION`` opens one and answers
  ``X-Amzn-SageMaker-New-Session-Id: <id>; Expires=<ISO time>``; a known id pins the instance;
  ``X-Amzn-SageMaker-Closed-Session-Id`` when a session is closed).
* ``POST /endpoints/{name}/invocations-response-stream``: AWS event-stream frames (prelude,
  headers, payload, both CRC32s) of ``PayloadPart`` events whose bytes are cut at arbitrary
  offsets, themselves written to the socket in arbitrary pieces; optionally a
  ``ModelStreamError`` / ``InternalStreamFailure`` frame after N parts.
* ``POST /`` with ``X-Amz-Target: SageMaker.DescribeEndpoint`` (the control-plane call the
  gateway's probe makes), JSON 1.1.
* Error injection per endpoint (optionally per variant): the next N calls answer a modeled error
  with its real status and ``x-amzn-ErrorType`` (``ThrottlingException`` 400,
  ``ModelNotReadyException`` 429, ``ModelError`` 424 with ``OriginalStatusCode``,
  ``ServiceUnavailable`` 503, ``InternalFailure`` 500, ``ValidationError`` 400).

Behind each variant are N "instances" (containers): an echo of the prompt in the OpenAI or the
TGI schema, or our reference worker over HTTP. ``PrefixAwareId`` picks an instance by a stable
hash; otherwise instances take turns. SigV4 is not verified. Every call is recorded in ``calls``.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import random
import uuid
import zlib
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from gateway.backends.eventstream import payload_part, stream_exception

ERROR_STATUS = {
    "ThrottlingException": 400,
    "ModelNotReadyException": 429,
    "ModelError": 424,
    "ServiceUnavailable": 503,
    "InternalFailure": 500,
    "ValidationError": 400,
}


class Container(Protocol):
    async def invoke(self, body: bytes) -> tuple[int, bytes]: ...

    def stream(self, body: bytes) -> AsyncIterator[bytes]: ...


def _tokens(text: str, n: int) -> list[str]:
    words = text.split() or ["ok"]
    return [w if i == 0 else " " + w for i, w in enumerate(itertools.islice(
        itertools.cycle(words), n))]


def _prompt_of(request: dict[str, Any]) -> str:
    if "messages" in request:
        content = request["messages"][-1].get("content", "")
        return content if isinstance(content, str) else json.dumps(content)
    if "inputs" in request:  # a rendered chat: echo its last user turn
        inputs = str(request["inputs"])
        turns = inputs.removesuffix("\nassistant:").split("\n")
        return turns[-1].removeprefix("user: ") if inputs.endswith("\nassistant:") else inputs
    prompt = request.get("prompt", "")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


@dataclass
class EchoContainer:
    """Answers with the prompt's words (``max_tokens`` of them), in the ``openai`` or ``tgi``
    schema. ``requests`` keeps every decoded request body."""

    shape: str = "openai"
    requests: list[dict[str, Any]] = field(default_factory=list)

    def _decode(self, body: bytes) -> tuple[dict[str, Any], list[str]]:
        request = json.loads(body)
        self.requests.append(request)
        if self.shape == "tgi":
            n = int(request.get("parameters", {}).get("max_new_tokens") or 8)
        else:
            n = int(request.get("max_tokens") or request.get("max_completion_tokens") or 8)
        return request, _tokens(_prompt_of(request), n)

    async def invoke(self, body: bytes) -> tuple[int, bytes]:
        request, tokens = self._decode(body)
        text = "".join(tokens)
        prompt_tokens = len(_prompt_of(request).split())
        if self.shape == "tgi":
            details = {"finish_reason": "length", "generated_tokens": len(tokens),
                       "prefill": [{"id": i} for i in range(prompt_tokens)]}
            return 200, json.dumps([{"generated_text": text, "details": details}]).encode()
        chat = "messages" in request
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        reply = {
            "id": "cmpl-echo", "object": "chat.completion" if chat else "text_completion",
            "created": 0, "model": request.get("model", ""), "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(tokens),
                      "total_tokens": prompt_tokens + len(tokens)},
        }
        return 200, json.dumps(reply).encode()

    async def stream(self, body: bytes) -> AsyncIterator[bytes]:
        request, tokens = self._decode(body)
        if self.shape == "tgi":
            for i, token in enumerate(tokens):
                event: dict[str, Any] = {
                    "index": i, "token": {"id": i, "text": token, "logprob": -0.5,
                                          "special": False},
                    "generated_text": None, "details": None,
                }
                if i == len(tokens) - 1:
                    event["generated_text"] = "".join(tokens)
                    event["details"] = {"finish_reason": "length",
                                        "generated_tokens": len(tokens), "seed": None}
                yield f"data:{json.dumps(event)}\n\n".encode()
            return
        chat = "messages" in request
        for i, token in enumerate(tokens):
            choice: dict[str, Any] = {"index": 0, "finish_reason": None}
            if chat:
                choice["delta"] = {"content": token, **({"role": "assistant"} if i == 0 else {})}
            else:
                choice["text"] = token
            chunk = {"id": "cmpl-echo", "created": 0, "model": request.get("model", ""),
                     "object": "chat.completion.chunk" if chat else "text_completion",
                     "choices": [choice]}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        yield b"data: [DONE]\n\n"


@dataclass
class WorkerContainer:
    """Our reference worker behind SageMaker: the OpenAI schema over HTTP."""

    url: str

    def _path(self, body: bytes) -> str:
        return "/v1/chat/completions" if b'"messages"' in body else "/v1/completions"

    async def invoke(self, body: bytes) -> tuple[int, bytes]:
        async with aiohttp.ClientSession() as http, http.post(
            self.url + self._path(body), data=body, headers={"Content-Type": "application/json"}
        ) as r:
            return r.status, await r.read()

    async def stream(self, body: bytes) -> AsyncIterator[bytes]:
        async with aiohttp.ClientSession() as http, http.post(
            self.url + self._path(body), data=body, headers={"Content-Type": "application/json"}
        ) as r:
            async for chunk in r.content.iter_any():
                yield chunk


@dataclass
class Variant:
    name: str
    instances: list[Container]
    status: str = "InService"
    turn: int = 0

    def pick(self, prefix_aware_id: str) -> int:
        if prefix_aware_id:
            return zlib.crc32(prefix_aware_id.encode()) % len(self.instances)
        self.turn += 1
        return self.turn % len(self.instances)


@dataclass
class Endpoint:
    name: str
    variants: dict[str, Variant]
    status: str = "InService"


@dataclass(frozen=True)
class Call:
    operation: str  # "invoke" | "stream"
    endpoint: str
    variant: str
    session: str  # the session id header sent ("" none)
    prefix_aware_id: str
    inference_id: str
    instance: int | None
    status: int
    error: str = ""
    custom_attributes: str = ""  # X-Amzn-SageMaker-Custom-Attributes as sent


@dataclass
class Failure:
    code: str
    variant: str = ""  # "" = any variant of the endpoint
    original_status: int = 500
    original_message: str = "model exploded"


@dataclass
class Session:
    endpoint: str
    variant: str
    instance: int
    expires: dt.datetime
    closing: bool = False


class SageMakerRuntimeServer:
    def __init__(self, *, seed: int = 7, max_part: int = 7) -> None:
        self.endpoints: dict[str, Endpoint] = {}
        self.calls: list[Call] = []
        self.sessions: dict[str, Session] = {}
        self._failures: dict[str, deque[Failure]] = {}
        self._stream_failures: dict[str, tuple[int, str]] = {}
        self._rng = random.Random(seed)
        self._max_part = max_part

    # -- setup -----------------------------------------------------------------------------------
    def add_endpoint(self, name: str, variants: dict[str, list[Container]]) -> Endpoint:
        endpoint = Endpoint(name, {v: Variant(v, list(c)) for v, c in variants.items()})
        self.endpoints[name] = endpoint
        return endpoint

    def inject(self, endpoint: str, code: str, count: int = 1, *, variant: str = "",
               original_status: int = 500, original_message: str = "model exploded") -> None:
        """The next ``count`` calls to ``endpoint`` (``variant``) answer the error ``code``."""
        if code not in ERROR_STATUS:
            raise ValueError(f"unknown error {code}")
        queue = self._failures.setdefault(endpoint, deque())
        for _ in range(count):
            queue.append(Failure(code, variant, original_status, original_message))

    def fail_stream(self, endpoint: str, after_parts: int,
                    kind: str = "ModelStreamError") -> None:
        """The next stream from ``endpoint`` breaks after ``after_parts`` payload parts."""
        self._stream_failures[endpoint] = (after_parts, kind)

    def expire_session(self, session_id: str) -> None:
        self.sessions[session_id].expires = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)

    def close_session(self, session_id: str) -> None:
        """The next call in this session closes it (``ClosedSessionId`` in the answer)."""
        self.sessions[session_id].closing = True

    def app(self) -> web.Application:
        app = web.Application(client_max_size=6 * 1024 * 1024)
        app.router.add_post("/endpoints/{name}/invocations", self._invoke)
        app.router.add_post("/endpoints/{name}/invocations-response-stream", self._stream)
        app.router.add_post("/", self._control)
        return app

    # -- helpers ---------------------------------------------------------------------------------
    @staticmethod
    def _error(code: str, message: str, **extra: Any) -> web.Response:
        return web.json_response(
            {"message": message, **extra}, status=ERROR_STATUS.get(code, 400),
            headers={"x-amzn-ErrorType": f"{code}:http://internal.amazon.com/coral/"
                                         "com.amazon.sagemaker/",
                     "x-amzn-RequestId": str(uuid.uuid4())},
        )

    def _injected(self, endpoint: str, variant: str) -> web.Response | None:
        queue = self._failures.get(endpoint)
        if not queue:
            return None
        for failure in list(queue):
            if failure.variant in ("", variant):
                queue.remove(failure)
                if failure.code == "ModelError":
                    return self._error(
                        "ModelError",
                        f"Received server error ({failure.original_status}) from primary "
                        f"with message \"{failure.original_message}\".",
                        OriginalStatusCode=failure.original_status,
                        OriginalMessage=failure.original_message,
                        LogStreamArn="arn:aws:logs:us-east-1:123456789012:log-group:/aws/"
                                     f"sagemaker/Endpoints/{endpoint}",
                    )
                return self._error(failure.code, f"injected {failure.code}")
        return None

    def _route(
        self, request: web.Request, operation: str
    ) -> tuple[Endpoint | None, Variant | None, int | None, dict[str, str], web.Response | None]:
        """Endpoint, variant, instance, extra headers, or an error response."""
        name = request.match_info["name"]
        endpoint = self.endpoints.get(name)
        if endpoint is None:
            return None, None, None, {}, self._error(
                "ValidationError", f"Endpoint {name} of account 123456789012 not found.")
        wanted = (request.headers.get("X-Amzn-SageMaker-Target-Variant")
                  or request.headers.get("X-Amzn-SageMaker-Inference-Component")
                  or next(iter(endpoint.variants)))
        variant = endpoint.variants.get(wanted)
        if variant is None:
            return endpoint, None, None, {}, self._error(
                "ValidationError", f"Target variant {wanted} not found for endpoint {name}.")
        injected = self._injected(name, variant.name)
        if injected is not None:
            return endpoint, variant, None, {}, injected
        session = request.headers.get("X-Amzn-SageMaker-Session-Id", "")
        prefix_id = request.headers.get("X-Amzn-SageMaker-Prefix-Aware-Id", "")
        extra: dict[str, str] = {}
        if session == "NEW_SESSION":
            if operation == "stream":
                return endpoint, variant, None, {}, self._error(
                    "ValidationError", "NEW_SESSION is only valid with InvokeEndpoint.")
            instance = variant.pick(prefix_id)
            sid = uuid.uuid4().hex
            expires = dt.datetime.now(dt.UTC) + dt.timedelta(minutes=20)
            self.sessions[sid] = Session(name, variant.name, instance, expires)
            extra["X-Amzn-SageMaker-New-Session-Id"] = (
                f"{sid}; Expires={expires.strftime('%Y-%m-%dT%H:%M:%SZ')}")
            return endpoint, variant, instance, extra, None
        if session:
            known = self.sessions.get(session)
            if known is None or known.expires <= dt.datetime.now(dt.UTC):
                self.sessions.pop(session, None)
                return endpoint, variant, None, {}, self._error(
                    "ValidationError", f"Invalid session ID {session}: not found or expired.")
            if known.closing:
                del self.sessions[session]
                extra["X-Amzn-SageMaker-Closed-Session-Id"] = session
            return endpoint, variant, known.instance, extra, None
        return endpoint, variant, variant.pick(prefix_id), extra, None

    def _record(self, request: web.Request, operation: str, variant: Variant | None,
                instance: int | None, status: int, error: str = "") -> None:
        h = request.headers
        self.calls.append(Call(
            operation=operation, endpoint=request.match_info["name"],
            variant=variant.name if variant else "",
            session=h.get("X-Amzn-SageMaker-Session-Id", ""),
            prefix_aware_id=h.get("X-Amzn-SageMaker-Prefix-Aware-Id", ""),
            inference_id=h.get("X-Amzn-SageMaker-Inference-Id", ""),
            instance=instance, status=status, error=error,
            custom_attributes=h.get("X-Amzn-SageMaker-Custom-Attributes", ""),
        ))

    # -- handlers --------------------------------------------------------------------------------
    async def _invoke(self, request: web.Request) -> web.Response:
        _, variant, instance, extra, error = self._route(request, "invoke")
        if error is not None:
            self._record(request, "invoke", variant, None, error.status,
                         error.headers.get("x-amzn-ErrorType", "").split(":")[0])
            return error
        assert variant is not None
        assert instance is not None
        status, body = await variant.instances[instance].invoke(await request.read())
        if status >= 400:
            self._record(request, "invoke", variant, instance, 424, "ModelError")
            return self._error("ModelError", f"Received client error ({status}) from primary",
                               OriginalStatusCode=status, OriginalMessage=body.decode())
        self._record(request, "invoke", variant, instance, 200)
        return web.Response(body=body, headers={
            "Content-Type": "application/json",
            "x-Amzn-Invoked-Production-Variant": variant.name, **extra,
        })

    def _cut(self, data: bytes) -> list[bytes]:
        parts, i = [], 0
        while i < len(data):
            n = self._rng.randint(1, self._max_part)
            parts.append(data[i:i + n])
            i += n
        return parts

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        _, variant, instance, extra, error = self._route(request, "stream")
        if error is not None:
            self._record(request, "stream", variant, None, error.status,
                         error.headers.get("x-amzn-ErrorType", "").split(":")[0])
            return error
        assert variant is not None
        assert instance is not None
        self._record(request, "stream", variant, instance, 200)
        response = web.StreamResponse(headers={
            "Content-Type": "application/vnd.amazon.eventstream",
            "X-Amzn-SageMaker-Content-Type": "text/event-stream",
            "x-Amzn-Invoked-Production-Variant": variant.name, **extra,
        })
        await response.prepare(request)
        fail_after, fail_kind = self._stream_failures.pop(name, (-1, ""))
        sent = 0
        async for piece in variant.instances[instance].stream(await request.read()):
            for part in self._cut(piece):
                if sent == fail_after:
                    await response.write(stream_exception(
                        fail_kind, "the model stopped", "ModelInvocationTimeExceeded"))
                    await response.write_eof()
                    return response
                for wire in self._cut(payload_part(part)):  # frames cut on the socket too
                    await response.write(wire)
                sent += 1
        await response.write_eof()
        return response

    async def _control(self, request: web.Request) -> web.Response:
        target = request.headers.get("X-Amz-Target", "")
        body = json.loads(await request.read() or b"{}")
        if target != "SageMaker.DescribeEndpoint":
            return self._error("ValidationError", f"unsupported operation {target}")
        endpoint = self.endpoints.get(body.get("EndpointName", ""))
        if endpoint is None:
            return self._error("ValidationError", "Could not find endpoint.")
        return web.json_response({
            "EndpointName": endpoint.name,
            "EndpointArn": f"arn:aws:sagemaker:us-east-1:123456789012:endpoint/{endpoint.name}",
            "EndpointConfigName": endpoint.name,
            "EndpointStatus": endpoint.status,
            "CreationTime": 0, "LastModifiedTime": 0,
            "ProductionVariants": [
                {"VariantName": v.name, "CurrentInstanceCount": len(v.instances),
                 "DesiredInstanceCount": len(v.instances), "CurrentWeight": 1.0,
                 "DesiredWeight": 1.0}
                for v in endpoint.variants.values()
            ],
        }, content_type="application/x-amz-json-1.1")


def aws_test_env() -> dict[str, str]:
    """Fake credentials and a region, and no look-up anywhere but loopback (no IMDS, no files)."""
    return {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": "/nonexistent/aws-config",
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials",
    }


def target_url(endpoint: str, base: str, *, model: str = "sim-model", **params: str) -> str:
    """A ``sagemaker://`` worker URL pointing at a local server."""
    query = "&".join(f"{k}={v}" for k, v in
                     {"region": "us-east-1", "endpoint_url": base, "model": model,
                      **params}.items())
    return f"sagemaker://{endpoint}?{query}"
