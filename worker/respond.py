"""Running a validated request on the engine and shaping the OpenAI response (whole or SSE).

The cache report (summed over the request's prompts) goes into ``usage`` and the ``x-cache-*``
headers; a streaming response sends its headers once every prompt is admitted, before the first
token. When the client goes away (in the queue, in prefill or mid-stream, the server cancels
the handler: :mod:`gateway.contracts.httpserver`), the producers are cancelled, their queue
entry or KV blocks released, and ``worker_requests_aborted_total`` counts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from gateway.contracts.headers import (
    ENGINE_COMPUTED_HEADER,
    ENGINE_DONE_HEADER,
    HIT_RATIO_HEADER,
    INPUT_TOKENS_HEADER,
    MATCHED_BLOCKS_HEADER,
    MATCHED_TOKENS_HEADER,
)
from worker.engines.base import Admission, Engine, GenerationRequest
from worker.metrics import RankMetrics
from worker.observe import PromptTiming, RequestTrace
from worker.parsing import CommonParams
from worker.stops import StopText


@dataclass(frozen=True)
class _Admitted:
    index: int
    admission: Admission


@dataclass(frozen=True)
class _Piece:
    index: int
    text: str


@dataclass(frozen=True)
class _Done:
    index: int
    finish: str  # "length", or "stop" at a stop sequence
    tokens: int  # tokens generated (a stop string's included, though its text is not sent)


_Event = _Admitted | _Piece | _Done


@dataclass(frozen=True)
class CacheReport:
    """Cache statistics of one response (summed over its prompts)."""

    input_tokens: int
    matched_tokens: int
    matched_blocks: int

    @property
    def cache_hit_ratio(self) -> float:
        return self.matched_tokens / self.input_tokens if self.input_tokens else 0.0

    @classmethod
    def of(cls, admissions: Sequence[Admission]) -> CacheReport:
        return cls(
            input_tokens=sum(a.input_tokens for a in admissions),
            matched_tokens=sum(a.matched_tokens for a in admissions),
            matched_blocks=sum(a.matched_blocks for a in admissions),
        )

    def headers(self) -> dict[str, str]:
        return {
            INPUT_TOKENS_HEADER: str(self.input_tokens),
            MATCHED_TOKENS_HEADER: str(self.matched_tokens),
            MATCHED_BLOCKS_HEADER: str(self.matched_blocks),
            HIT_RATIO_HEADER: f"{self.cache_hit_ratio:.6f}",
        }

    def usage(self, completion_tokens: int) -> dict[str, Any]:
        return {
            "prompt_tokens": self.input_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.input_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.matched_tokens},
            "input_tokens": self.input_tokens,
            "matched_tokens": self.matched_tokens,
            "matched_blocks": self.matched_blocks,
            "cache_hit_ratio": self.cache_hit_ratio,
        }


async def _produce(
    engine: Engine,
    request: GenerationRequest,
    index: int,
    events: asyncio.Queue[_Event],
    on_first_token: Callable[[], None],
    timing: PromptTiming,
    stops: Sequence[str] = (),
) -> None:
    loop = asyncio.get_running_loop()
    text = StopText(stops)
    async with engine.admit(request) as generation:
        timing.admitted = loop.time()
        admission = generation.admission
        timing.input_tokens = admission.input_tokens
        timing.cached_tokens = admission.matched_tokens
        events.put_nowait(_Admitted(index, admission))
        first = True
        async with contextlib.aclosing(generation.tokens()) as pieces:
            async for piece in pieces:
                if first:
                    timing.first_token = loop.time()
                    timing.computed_at = time.monotonic()
                    on_first_token()
                    first = False
                timing.output_tokens += 1
                if out := text.feed(piece):
                    events.put_nowait(_Piece(index, out))
                if text.stopped:
                    break  # the engine generates no more for this output
        if rest := text.flush():
            events.put_nowait(_Piece(index, rest))
    timing.done = loop.time()
    timing.freed_at = time.monotonic()
    events.put_nowait(_Done(index, "stop" if text.stopped else "length", timing.output_tokens))


def _observe(metrics: RankMetrics, timing: PromptTiming) -> None:
    if not timing.done:
        return  # cancelled: the client went away
    n = timing.output_tokens
    tpot = (timing.done - timing.first_token) / (n - 1) if n > 1 and timing.first_token else None
    metrics.observe_request(timing.done - timing.arrived, timing.admitted - timing.arrived, tpot)


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


@dataclass(frozen=True)
class Job:
    """One validated request, ready to run."""

    kind: str  # "completion", "chat" or "response" (the Responses API's, run as a chat)
    response_id: str
    created: int
    model: str
    common: CommonParams
    token_lists: tuple[list[int], ...]
    namespace: str
    system_tokens: int = 0
    """Leading tokens of the (single) prompt that are the chat's system messages."""
    on_response: Callable[[dict[str, Any]], None] | None = None
    """A Responses answer, once complete (what stores it)."""
    echo: Mapping[str, Any] = field(default_factory=dict)
    """A Responses request's settings its response repeats (its tools, instructions, ...)."""

    @property
    def sequences(self) -> int:
        """Outputs the job makes: ``n`` samples of each prompt, choice ``p * n + j`` the
        ``j``-th of prompt ``p`` (as OpenAI orders a batch's choices)."""
        return len(self.token_lists) * self.common.n

    def first_sample(self, index: int) -> bool:
        """Whether output ``index`` is its prompt's first sample: the one whose admission
        reports what the prompt found cached (usage counts each prompt once, as vLLM's)."""
        return index % self.common.n == 0

    @property
    def message_id(self) -> str:
        """A Responses answer's message: named after the response (``resp_X``: ``msg_X``)."""
        return "msg_" + self.response_id.removeprefix("resp_")

    @property
    def object_name(self) -> str:
        return "text_completion" if self.kind == "completion" else "chat.completion"

    def envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }


async def _run_prompts(
    engine: Engine,
    metrics: RankMetrics,
    job: Job,
    handle: Callable[[_Event], Awaitable[None]],
    trace: RequestTrace,
) -> None:
    """Run a job's prompts concurrently on the engine, passing each event to ``handle``.

    ``handle`` runs inside the task group, so when it raises (client gone) the producers are
    cancelled and their KV blocks released.
    """
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    def first_token() -> None:
        metrics.observe_ttft(loop.time() - t0)

    queue: asyncio.Queue[_Event] = asyncio.Queue()
    n = job.common.n
    timings = [trace.prompt(t0) for _ in range(job.sequences)]
    admitted = False
    try:
        async with asyncio.TaskGroup() as group:
            for i in range(job.sequences):
                request = GenerationRequest(
                    request_id=f"{job.response_id}-{i}",
                    prompt_tokens=job.token_lists[i // n],
                    max_tokens=job.common.max_tokens,
                    namespace=job.namespace,
                    priority=job.common.cache_priority,
                    system_tokens=job.system_tokens,
                    sample=i % n,
                    schedule_priority=job.common.priority,
                )
                group.create_task(_produce(engine, request, i, queue, first_token,
                                           timings[i], job.common.stop))
            remaining = job.sequences
            while remaining:
                event = await queue.get()
                if isinstance(event, _Done):
                    remaining -= 1
                elif isinstance(event, _Admitted):
                    admitted = True
                await handle(event)
    except BaseException as exc:
        if _is_abort(exc):
            metrics.count_abort("running" if admitted else "waiting")
        raise
    for i, timing in enumerate(timings):
        if job.first_sample(i):  # one request per prompt, whatever its samples
            _observe(metrics, timing)


def _is_abort(exc: BaseException) -> bool:
    """The client went away: its handler was cancelled, or a write to it failed."""
    if isinstance(exc, asyncio.CancelledError | ConnectionResetError):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return any(_is_abort(e) for e in exc.exceptions)
    return False


async def respond_whole(
    request: web.Request, job: Job, headers: dict[str, str], engine: Engine,
    metrics: RankMetrics, trace: RequestTrace,
) -> web.Response:
    admissions: list[Admission] = []
    texts: list[list[str]] = [[] for _ in range(job.sequences)]
    ends: list[_Done] = []

    async def collect(event: _Event) -> None:
        if isinstance(event, _Admitted):
            if job.first_sample(event.index):
                admissions.append(event.admission)
        elif isinstance(event, _Piece):
            texts[event.index].append(event.text)
        else:
            ends.append(event)

    await _run_prompts(engine, metrics, job, collect, trace)
    report = CacheReport.of(admissions)
    tokens = sum(end.tokens for end in ends)
    headers = {**headers, **report.headers(),
               ENGINE_DONE_HEADER: f"{max(p.freed_at for p in trace.prompts):.6f}",
               ENGINE_COMPUTED_HEADER: f"{max(p.computed_at for p in trace.prompts):.6f}"}
    if job.kind == "response":
        body = response_object(job, "".join(texts[0]), report, tokens)
        if job.on_response is not None:
            job.on_response(body)
        return web.json_response(body, headers=headers)
    finish = {end.index: end.finish for end in ends}
    choices: list[dict[str, Any]] = []
    for i, pieces in enumerate(texts):
        text = "".join(pieces)
        choice: dict[str, Any] = {"index": i, "logprobs": None, "finish_reason": finish[i]}
        if job.kind == "completion":
            choice["text"] = text
        else:
            choice["message"] = {"role": "assistant", "content": text}
        choices.append(choice)
    body = job.envelope(job.object_name, choices)
    body["usage"] = report.usage(tokens)
    return web.json_response(body, headers=headers)


def response_defaults() -> dict[str, Any]:
    """What a Responses API response says of the request's settings it did not give
    (OpenAI's defaults; a new dict each time); those it gave are repeated (``Job.echo``)."""
    return {
        "instructions": None, "previous_response_id": None, "max_output_tokens": None,
        "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "temperature": 1.0,
        "top_p": 1.0, "metadata": {}, "store": True,
    }


def response_echo(body: Mapping[str, Any]) -> dict[str, Any]:
    """The settings of a Responses request (``body``) its response repeats."""
    return {k: body[k] for k in response_defaults() if body.get(k) is not None}


def response_object(job: Job, text: str | None, report: CacheReport,
                    output_tokens: int) -> dict[str, Any]:
    """A Responses API ``response``: in progress (``text`` None: no output yet) or completed
    with one assistant message of ``text``, its usage in the Responses API's names."""
    output: list[dict[str, Any]] = []
    if text is not None:
        output.append({
            "type": "message", "id": job.message_id, "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        })
    return {
        "id": job.response_id, "object": "response", "created_at": job.created,
        "status": "in_progress" if text is None else "completed", "model": job.model,
        "output": output, "error": None, "incomplete_details": None,
        **response_defaults(), **job.echo,
        "usage": None if text is None else {
            "input_tokens": report.input_tokens,
            "input_tokens_details": {"cached_tokens": report.matched_tokens},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": report.input_tokens + output_tokens,
        },
    }


def _chunk_choice(job: Job, index: int, text: str | None, finish: str | None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": finish}
    if job.kind == "completion":
        choice["text"] = text or ""
    else:
        choice["delta"] = {"content": text} if text is not None else {}
    return choice


class _SseWriter:
    """Streams a job as server-sent events; headers go out once every prompt is admitted."""

    def __init__(self, request: web.Request, job: Job, headers: dict[str, str]) -> None:
        self._request = request
        self._job = job
        self._headers = headers
        self._object = "text_completion" if job.kind == "completion" else "chat.completion.chunk"
        self._admissions: list[tuple[int, Admission]] = []  # (output, its admission)
        self._pending: list[_Event] = []
        self.response: web.StreamResponse | None = None
        self.report = CacheReport(0, 0, 0)
        self.completion_tokens = 0
        self._sequence = 0
        self._text: list[str] = []  # a Responses stream's text, for its completed event

    async def _write(self, payload: dict[str, Any]) -> None:
        assert self.response is not None
        await self.response.write(_sse(payload))

    async def _event(self, kind: str, **fields: Any) -> None:
        """One Responses API stream event (``event:`` line, then its JSON with its type)."""
        assert self.response is not None
        self._sequence += 1
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        await self.response.write(b"event: " + kind.encode() + b"\n" + _sse(payload))

    async def _start(self) -> None:
        self.report = CacheReport.of(
            [a for i, a in self._admissions if self._job.first_sample(i)])
        self.response = web.StreamResponse(
            headers={
                **self._headers,
                **self.report.headers(),
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
            }
        )
        await self.response.prepare(self._request)
        if self._job.kind == "response":
            await self._event("response.created",
                              response=response_object(self._job, None, self.report, 0))
        elif self._job.kind == "chat":
            for i in range(self._job.sequences):
                role = {"index": i, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None}
                await self._write(self._job.envelope(self._object, [role]))

    async def handle(self, event: _Event) -> None:
        if self.response is None:
            if isinstance(event, _Admitted):
                self._admissions.append((event.index, event.admission))
            else:
                self._pending.append(event)
            if len(self._admissions) < self._job.sequences:
                return
            await self._start()
            backlog, self._pending = self._pending, []
        else:
            backlog = [event]
        for item in backlog:
            if isinstance(item, _Done):
                self.completion_tokens += item.tokens
            if self._job.kind == "response":
                if isinstance(item, _Piece):
                    self._text.append(item.text)
                    await self._event(
                        "response.output_text.delta", item_id=self._job.message_id,
                        output_index=0, content_index=0, delta=item.text)
                continue
            if isinstance(item, _Piece):
                choice = _chunk_choice(self._job, item.index, item.text, None)
            elif isinstance(item, _Done):
                choice = _chunk_choice(self._job, item.index, None, item.finish)
            else:
                continue
            await self._write(self._job.envelope(self._object, [choice]))

    async def finish(self) -> None:
        if self._job.kind == "response":  # the usage goes in the completed response
            done = response_object(
                self._job, "".join(self._text), self.report, self.completion_tokens)
            if self._job.on_response is not None:
                self._job.on_response(done)
            await self._event("response.completed", response=done)
            assert self.response is not None
            await self.response.write_eof()
            return
        if self._job.common.include_usage:
            final = self._job.envelope(self._object, [])
            final["usage"] = self.report.usage(self.completion_tokens)
            await self._write(final)
        assert self.response is not None
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()


async def respond_stream(
    request: web.Request, job: Job, headers: dict[str, str], engine: Engine,
    metrics: RankMetrics, trace: RequestTrace,
) -> web.StreamResponse:
    writer = _SseWriter(request, job, headers)
    try:
        await _run_prompts(engine, metrics, job, writer.handle, trace)
        await writer.finish()
    except* ConnectionResetError:
        pass  # the client went away; the engine released the blocks on the way out
    if writer.response is None:  # only if the client vanished before the headers went out
        return web.Response(status=499)
    return writer.response
