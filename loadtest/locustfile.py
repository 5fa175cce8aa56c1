"""Locust users for the gateway: one user class per workload, streaming, with live affinity stats.

Run it as locust users expect, against a running gateway::

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --workload chat
    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 RagUser      # pick a class
    locust -f loadtest/locustfile.py --headless -u 16 -r 16 -t 60s --host ... --workload tenants

(or ``python -m loadtest run ...``, which starts a cluster, runs this file headless and writes a
report). Workloads: ``chat`` (multi-turn, growing history), ``tenants`` (many system prompts),
``rag`` (document prefix + question), ``fewshot`` (templates), ``mooncake`` (trace replay, each
block id a deterministic text chunk), ``shared-prompts`` (20 shared system prompts + unique
suffixes) and ``agent-sessions`` (long agent contexts growing per turn), the last two generated
traces replayed like ``mooncake``; see :mod:`loadtest.workloads`, :mod:`loadtest.trace_workloads`
and :mod:`loadtest.textgen`.
Pick one with ``--workload`` (env ``LOADTEST_WORKLOAD``) or by naming its user class; with
neither, ``chat``.

What locust shows:

* the request itself (``POST <workload>``): response time = the whole streamed answer;
* ``TTFT <workload>`` (request type ``TTFT``): time to the first SSE chunk carrying a token,
  one entry per successful request (so the "Aggregated" row counts each request twice);
* the **affinity hit rate** (worker-reported matched / input tokens, from ``x-cache-*``
  headers or the stream's final ``usage``): live in the web UI's **Cache affinity** tab (one row
  per worker plus the total: requests, share, input and matched tokens, hit rate, TTFT p50,
  errors; refreshed with the stats), and in headless runs as a console line every
  ``--affinity-interval`` seconds plus a final table. It is not a request entry on purpose: a
  ratio of sums is not a response time, and fake entries would skew the aggregated numbers.

``--samples-file PATH`` also writes one JSON line per request (:class:`loadtest.samples.Sample`),
the input of :mod:`loadtest.report`. Loops are bounded: ``--run-time`` as usual, and
``--max-requests`` (default 100,000) stops the run after that many requests in all.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, ClassVar

import gevent
from flask import Response, request
from locust import FastHttpUser, events, task
from locust.argument_parser import LocustArgumentParser
from locust.env import Environment
from locust.exception import StopUser
from locust.runners import MasterRunner, WorkerRunner

from loadtest.samples import AffinityTally, Sample, StreamScan, int_header
from loadtest.textgen import TextSynth, trace_request
from loadtest.trace_workloads import workload_trace
from loadtest.traces import DEFAULT_TRACE_DIR, TraceRequest, read_mooncake
from loadtest.workloads import (
    REPLAYED_WORKLOADS,
    WORKLOADS,
    LiveRequest,
    LiveSpec,
    as_responses,
    stored_turn,
    user_requests,
)

log = logging.getLogger("loadtest")

TAB_KEY = "cache-affinity"
_STATE_ATTR = "loadtest_state"
_DEFAULT_TRACE = DEFAULT_TRACE_DIR / "conversation_trace.jsonl"
_UNREACHABLE_BACKOFF_S = 1.0
STORED = "responses-stored"  # --api: conversations the server stores


class LoadState:
    """Everything the users of one locust process share, kept on the Environment."""

    def __init__(self, environment: Environment, options: Any) -> None:
        self.environment = environment
        self.workload: str = options.workload
        self.spec = LiveSpec(
            seed=options.seed, model=options.model, max_tokens=options.max_tokens,
            stream=not options.no_stream,
        )
        api = getattr(options, "api", "native")
        self.responses_api: bool = api in ("responses", STORED)
        # Conversations stored by the server: each next turn names the last answer.
        self.stored: bool = api == STORED
        self.max_requests: int = options.max_requests
        self.think_s: float = options.think_time
        self.tally = AffinityTally()
        self.sent = 0
        self.users = 0
        self.started = time.monotonic()
        self.quitting = False
        self.samples: IO[str] | None = None
        self.samples_path: str = options.samples_file
        # Trace replay: one shared cursor, so the users together replay the trace in order.
        self.trace: list[TraceRequest] = []
        self.trace_cursor = 0
        self.trace_speedup: float = options.trace_speedup
        self.max_blocks: int = options.max_blocks
        self.synth = TextSynth(chars=options.block_chars, seed=options.seed)
        self.trace_path: str = options.trace

    def load_trace(self) -> None:
        if self.trace or self.workload not in REPLAYED_WORKLOADS:
            return
        if self.workload == "mooncake":
            self.trace = read_mooncake(self.trace_path)
        else:
            self.trace = workload_trace(self.workload, seed=self.spec.seed)
            if self.workload == "agent-sessions":
                self.max_blocks = 0  # the long contexts are the point

    def next_user(self) -> int:
        self.users += 1
        return self.users - 1

    def next_trace_request(self) -> TraceRequest | None:
        if self.trace_cursor >= len(self.trace):
            return None
        item = self.trace[self.trace_cursor]
        self.trace_cursor += 1
        return item

    def record(self, sample: Sample) -> None:
        self.tally.add(sample)
        if self.samples is not None:
            self.samples.write(sample.to_json() + "\n")

    def open_samples(self) -> None:
        if self.samples_path and self.samples is None:
            path = Path(self.samples_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            self.samples = path.open("w", encoding="utf-8")

    def close_samples(self) -> None:
        if self.samples is not None:
            self.samples.close()
            self.samples = None

    def elapsed(self) -> float:
        return time.monotonic() - self.started


def state_of(environment: Environment) -> LoadState:
    state = getattr(environment, _STATE_ATTR, None)
    if not isinstance(state, LoadState):
        raise RuntimeError("the loadtest locustfile's init listener has not run")
    return state


# -- users -------------------------------------------------------------------------------------


class LLMUser(FastHttpUser):
    """Base class: sends its workload's requests, streaming, and records what came back."""

    abstract = True
    workload: ClassVar[str] = "chat"
    # Long prompts on a busy CPU cluster: wait for the whole stream, not the default 60 s.
    network_timeout = 300.0
    connection_timeout = 10.0

    def on_start(self) -> None:
        self.state = state_of(self.environment)
        self.index = self.state.next_user()
        self.think_rng = random.Random(f"{self.state.spec.seed}:think:{self.index}")
        self.conversation: tuple[list[Any], str] | None = None  # --api responses-stored
        self.requests = (
            None if self.workload in REPLAYED_WORKLOADS
            else user_requests(self.workload, self.state.spec, self.index)
        )

    def wait_time(self) -> float:
        """Think time: uniform in [0, 2 x --think-time] (0: a closed loop at full speed)."""
        think = self.state.think_s
        return self.think_rng.uniform(0.0, 2.0 * think) if think > 0 else 0.0

    def _next(self) -> LiveRequest:
        state = self.state
        if state.sent >= state.max_requests:
            _quit_once(state)
            raise StopUser()
        if self.requests is not None:
            return next(self.requests)
        item = state.next_trace_request()
        if item is None:
            _quit_once(state)
            raise StopUser()
        if state.trace_speedup > 0:  # pace by the trace's arrival times
            delay = item.arrival_s / state.trace_speedup - state.elapsed()
            if delay > 0:
                gevent.sleep(delay)
        return trace_request(item, state.synth, state.spec, state.max_blocks)

    @task
    def send(self) -> None:
        req = self._next()
        whole: list[Any] | None = None  # a stored conversation's input, as sent whole
        if self.state.responses_api:
            req = as_responses(req)
            if self.state.stored:
                items = req.body.get("input")
                whole = items if isinstance(items, list) else None
                req = LiveRequest(req.path, stored_turn(req.body, self.conversation),
                                  req.api_key, req.label)
        self.state.sent += 1
        headers = {"Authorization": f"Bearer {req.api_key}"} if req.api_key else {}
        started = time.perf_counter()
        t0 = self.state.elapsed()
        ttft_ms: float | None = None
        scan = StreamScan()
        nbytes = 0
        with self.client.request(
            "POST", req.path, name=req.label or self.workload, json=req.body, headers=headers,
            stream=True, catch_response=True,
        ) as resp:
            status = int(resp.status_code or 0)
            error = ""
            if status == 200:
                try:
                    for line in _lines(resp):
                        nbytes += len(line)
                        if scan.feed(line.decode("utf-8", "replace")) and ttft_ms is None:
                            ttft_ms = (time.perf_counter() - started) * 1e3
                    scan.close()
                except Exception as exc:
                    error = f"stream broke off: {exc}"
                if not error and scan.error:
                    error = scan.error
                if not error and req.body.get("stream") and not scan.done:
                    error = "stream ended without [DONE]"
                if not req.body.get("stream") and ttft_ms is None:
                    ttft_ms = (time.perf_counter() - started) * 1e3
            else:
                error = _failure_text(resp, status)
            latency_ms = (time.perf_counter() - started) * 1e3
            resp.request_meta["response_time"] = latency_ms  # the whole answer, not headers
            resp.request_meta["response_length"] = nbytes
            if error:
                resp.failure(error)
            else:
                resp.success()
            got = resp.headers if resp.headers is not None else {}  # None: no HTTP answer
            input_tokens = int_header(got, "x-cache-input-tokens")
            matched = int_header(got, "x-cache-matched-tokens")
            if not input_tokens and scan.prompt_tokens:  # e.g. vLLM: the usage chunk
                input_tokens, matched = scan.prompt_tokens, scan.cached_tokens
            worker = str(got.get("x-route-worker") or "")
            reason = str(got.get("x-route-reason") or "")
        ok = not error
        if self.state.stored:  # what the next turn continues (a failed turn: a new start)
            self.conversation = ((whole, scan.response_id)
                                 if ok and whole is not None and scan.response_id else None)
        if ok and ttft_ms is not None:
            self.environment.events.request.fire(
                request_type="TTFT", name=req.label or self.workload, response_time=ttft_ms,
                response_length=0, exception=None, context={},
            )
        self.state.record(Sample(
            t=round(t0, 4), ok=ok, status=status, worker=worker, input_tokens=input_tokens,
            matched_tokens=matched, ttft_ms=None if ttft_ms is None else round(ttft_ms, 3),
            latency_ms=round(latency_ms, 3), label=req.label, reason=reason, error=error[:300],
        ))
        if status == 0:
            gevent.sleep(_UNREACHABLE_BACKOFF_S)  # no server there: do not spin on refusals


def _lines(resp: Any) -> Iterator[bytes]:
    """The body's lines as they arrive. ``FastResponse.iter_content(n)`` waits for ``n`` bytes
    (or the end), which would stamp TTFT at the end of a short answer; geventhttpclient's
    ``readline`` returns each SSE line as soon as it is in."""
    raw = resp._response  # the underlying geventhttpclient response (stream=True keeps it open)
    if raw is None:
        return
    while line := raw.readline(b"\n"):
        yield line


def _failure_text(resp: Any, status: int) -> str:
    if status == 0:
        return f"no HTTP answer: {getattr(resp, 'error', None) or 'connection failed'}"
    try:
        body = resp.text or ""
    except Exception:
        body = ""
    return f"HTTP {status}: {body[:200]}"


def _quit_once(state: LoadState) -> None:
    """Stop the whole run (request budget or trace exhausted) once, from outside the user."""
    if state.quitting or state.environment.runner is None:
        return
    state.quitting = True
    log.info("loadtest: request budget or trace exhausted after %d requests; stopping",
             state.sent)
    gevent.spawn_later(0.1, state.environment.runner.quit)


class ChatUser(LLMUser):
    """Multi-turn chat: every request repeats the conversation so far."""

    workload = "chat"


class TenantsUser(LLMUser):
    """Many tenants, each with its own system prompt and API key."""

    workload = "tenants"


class RagUser(LLMUser):
    """A shared instruction, a (popular) document, then a question."""

    workload = "rag"


class FewShotUser(LLMUser):
    """Few-shot templates followed by a new input."""

    workload = "fewshot"


class MooncakeUser(LLMUser):
    """Replays a Mooncake trace in order (shared cursor), each block id a text chunk."""

    workload = "mooncake"


class SharedPromptsUser(LLMUser):
    """20 shared system prompts, each request one of them plus a unique suffix (generated
    trace, replayed in order like ``mooncake``)."""

    workload = "shared-prompts"


class AgentSessionsUser(LLMUser):
    """Long-context agent sessions: one shared tool + system prefix, contexts growing by a few
    thousand tokens per turn (generated trace, replayed in order, whole prompts)."""

    workload = "agent-sessions"


USER_CLASSES: dict[str, type[LLMUser]] = {
    c.workload: c for c in (ChatUser, TenantsUser, RagUser, FewShotUser, MooncakeUser,
                            SharedPromptsUser, AgentSessionsUser)
}


# -- command line, lifecycle, web UI ---------------------------------------------------------


def add_arguments(parser: Any) -> None:
    # On the parser itself, not an argument group: only its add_argument knows
    # include_in_web_ui (these options then show in the web UI's start form too).
    group = parser
    group.add_argument("--workload", choices=WORKLOADS,
                       default=os.environ.get("LOADTEST_WORKLOAD", "chat"),
                       help="workload to run (env LOADTEST_WORKLOAD; default chat). Naming a user "
                       "class on the command line overrides it")
    group.add_argument("--seed", type=int, default=2024, help="workload seed")
    group.add_argument("--model", default="sim-model", help="model name sent in requests")
    group.add_argument("--max-tokens", type=int, default=8, help="decode budget per request")
    group.add_argument("--no-stream", action="store_true", default=False,
                       help="send non-streaming requests (TTFT = whole answer)")
    group.add_argument("--api", choices=("native", "responses", STORED), default="native",
                       help="send each request as its workload does (chat or completions), or "
                       "as the same request for OpenAI's Responses API (/v1/responses); "
                       f"{STORED}: a conversation's next turn sends only its new messages "
                       "after previous_response_id (the server keeps the conversation)")
    group.add_argument("--think-time", type=float, default=0.0,
                       help="mean seconds a user waits between requests (uniform 0..2x)")
    group.add_argument("--max-requests", type=int, default=100_000,
                       help="stop the run after this many requests in all")
    group.add_argument("--samples-file", default="", include_in_web_ui=False,
                       help="write one JSON line per request here (for loadtest.report)")
    group.add_argument("--affinity-interval", type=float, default=5.0,
                       help="headless: seconds between console lines with the live hit rate")
    group.add_argument("--trace", default=str(_DEFAULT_TRACE),
                       help="mooncake: the Mooncake jsonl trace to replay")
    group.add_argument("--trace-speedup", type=float, default=0.0,
                       help="mooncake: replay at the trace's arrival times divided by this "
                       "(0: as fast as the users go)")
    group.add_argument("--block-chars", type=int, default=256,
                       help="mooncake: characters of text per trace block (2048 ~ 512 tokens, a "
                       "real block; the default, 8x smaller, keeps prompts small for CPU workers)")
    group.add_argument("--max-blocks", type=int, default=48,
                       help="mooncake: send at most this many leading blocks of a prompt (0: all)")


def on_init(environment: Environment, **_: Any) -> None:
    options = environment.parsed_options
    if options is None:  # used as a library without parsed options: our defaults
        parser = LocustArgumentParser()
        add_arguments(parser)
        options = parser.parse_args([])
    state = LoadState(environment, options)
    setattr(environment, _STATE_ATTR, state)
    if len(environment.user_classes) != 1:  # no class named on the command line: --workload
        environment.user_classes = [USER_CLASSES[state.workload]]
    else:
        named = environment.user_classes[0]
        if issubclass(named, LLMUser):
            state.workload = named.workload
    if not isinstance(environment.runner, MasterRunner):
        state.load_trace()
    _distributed_listeners(environment, state)
    if environment.web_ui is not None:
        _extend_web_ui(environment, state)


def _extend_web_ui(environment: Environment, state: LoadState) -> None:
    """The "Cache affinity" tab: a table fed from every /stats/requests poll."""
    web_ui = environment.web_ui
    assert web_ui is not None
    web_ui.template_args["extended_tabs"] = [{"title": "Cache affinity", "key": TAB_KEY}]
    web_ui.template_args["extended_tables"] = [{
        "key": TAB_KEY,
        "structure": [
            {"key": "name", "title": "Worker"},
            {"key": "requests", "title": "# Requests"},
            {"key": "share", "title": "Share"},
            {"key": "input_tokens", "title": "Input tokens"},
            {"key": "matched_tokens", "title": "Matched tokens"},
            {"key": "hit_rate", "title": "Hit rate"},
            {"key": "ttft_p50_ms", "title": "TTFT p50 (ms)"},
            {"key": "errors", "title": "Errors"},
        ],
    }]

    def add_affinity(response: Response) -> Response:
        if request.path != "/stats/requests" or response.json is None:
            return response
        data = dict(response.json)
        data["extended_stats"] = [{"key": TAB_KEY, "data": state.tally.rows()}]
        response.set_data(json.dumps(data))
        return response

    assert web_ui.app is not None
    web_ui.app.after_request(add_affinity)


def on_test_start(environment: Environment, **_: Any) -> None:
    state = state_of(environment)
    state.started = time.monotonic()
    state.tally.clear()
    if isinstance(environment.runner, WorkerRunner):
        return  # the master reports
    state.open_samples()
    options = environment.parsed_options
    if options is not None and options.headless and options.affinity_interval > 0:
        gevent.spawn(_report_loop, state, float(options.affinity_interval))


def _report_loop(state: LoadState, interval: float) -> None:
    while not state.quitting:
        gevent.sleep(interval)
        if state.tally.workers:
            log.info("%s", state.tally.line())


def on_test_stop(environment: Environment, **_: Any) -> None:
    state = state_of(environment)
    if isinstance(environment.runner, WorkerRunner):
        return
    state.quitting = True
    if state.samples is not None:
        state.samples.flush()
    if state.tally.workers:
        rows = state.tally.rows()
        lines = [f"{'worker':<24}{'requests':>10}{'share':>8}{'hit rate':>10}{'TTFT p50':>10}"]
        for r in rows:
            lines.append(f"{r['name']:<24}{r['requests']:>10}{r['share']:>8}{r['hit_rate']:>10}"
                         f"{r['ttft_p50_ms']!s:>10}")
        log.info("cache affinity (worker-reported matched / input tokens):\n%s", "\n".join(lines))


def on_quitting(environment: Environment, **_: Any) -> None:
    state = getattr(environment, _STATE_ATTR, None)
    if isinstance(state, LoadState):
        state.close_samples()


def _distributed_listeners(environment: Environment, state: LoadState) -> None:
    """Distributed runs: each worker process sends its tally since the last report and clears
    it; the master merges them. Registered per environment, so no module state is needed."""

    def report_to_master(client_id: str, data: dict[str, Any], **_: Any) -> None:
        del client_id
        data["loadtest_affinity"] = state.tally.export()
        state.tally.clear()

    def worker_report(client_id: str, data: dict[str, Any], **_: Any) -> None:
        del client_id
        if "loadtest_affinity" in data:
            state.tally.merge(data["loadtest_affinity"])

    def reset_stats(**_: Any) -> None:
        state.tally.clear()

    if isinstance(environment.runner, WorkerRunner):
        environment.events.report_to_master.add_listener(report_to_master)
    if isinstance(environment.runner, MasterRunner):
        environment.events.worker_report.add_listener(worker_report)
    environment.events.reset_stats.add_listener(reset_stats)


events.init_command_line_parser.add_listener(add_arguments)
events.init.add_listener(on_init)
events.test_start.add_listener(on_test_start)
events.test_stop.add_listener(on_test_stop)
events.quitting.add_listener(on_quitting)
