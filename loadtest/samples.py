"""What one live request measured, and the running affinity tally (pure: no locust, no I/O).

The locustfile records one :class:`Sample` per request (JSON lines, for the report) and adds it
to an :class:`AffinityTally` (the live numbers its web UI tab and console lines show). Kept free
of locust and gevent so the report, the wrapper and the tests can import it without gevent's
monkey-patching.

Hit rate everywhere = sum of worker-reported matched tokens / sum of worker-reported input tokens
(``x-cache-matched-tokens`` / ``x-cache-input-tokens``, or the stream's final ``usage``:
``prompt_tokens_details.cached_tokens`` / ``prompt_tokens`` for servers without the headers).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

# TTFTs kept per worker for the live percentiles (the report uses every sample instead).
_LIVE_TTFT_KEEP = 4096


@dataclass(frozen=True, slots=True)
class Sample:
    """One request as the load generator saw it (``t``: seconds since the test started)."""

    t: float
    ok: bool
    status: int  # 0: no HTTP answer
    worker: str  # x-route-worker
    input_tokens: int
    matched_tokens: int
    ttft_ms: float | None  # time to the first SSE data chunk (the whole answer if not streamed)
    latency_ms: float  # time to the end of the answer
    label: str = ""
    reason: str = ""  # x-route-reason
    error: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> Sample:
        obj = json.loads(line)
        ttft = obj.get("ttft_ms")
        return cls(
            t=float(obj["t"]), ok=bool(obj["ok"]), status=int(obj["status"]),
            worker=str(obj.get("worker", "")), input_tokens=int(obj.get("input_tokens", 0)),
            matched_tokens=int(obj.get("matched_tokens", 0)),
            ttft_ms=None if ttft is None else float(ttft), latency_ms=float(obj["latency_ms"]),
            label=str(obj.get("label", "")), reason=str(obj.get("reason", "")),
            error=str(obj.get("error", "")),
        )


def read_samples(lines: Iterable[str]) -> list[Sample]:
    """Samples from JSON lines (blank and torn lines, e.g. a last line cut by a kill, skipped)."""
    out: list[Sample] = []
    for line in lines:
        if not line.strip():
            continue
        try:
            out.append(Sample.from_json(line))
        except (ValueError, KeyError, TypeError):
            continue
    return out


def int_header(headers: Mapping[str, str] | Any, name: str) -> int:
    """An integer response header, 0 when absent or malformed (or no headers at all)."""
    try:
        return int(headers.get(name) or 0)
    except (ValueError, TypeError, AttributeError):
        return 0


# -- reading a server-sent-event stream ------------------------------------------------------------


@dataclass(slots=True)
class StreamScan:
    """Feed an OpenAI SSE stream chunk by chunk; it notes the first data event that carries a
    token, a final ``usage`` and any error event. ``feed`` returns True when this chunk held the
    first token (the caller stamps TTFT then). Role-only chunks (a chat stream's first event,
    which our worker sends before prefill) do not count."""

    buffer: str = ""
    seen_data: bool = False
    done: bool = False
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""
    response_id: str = ""  # a Responses answer's id (its created event, or the whole answer)

    def feed(self, chunk: str) -> bool:
        first = False
        self.buffer += chunk
        while "\n" in self.buffer:
            line, self.buffer = self.buffer.split("\n", 1)
            first |= self._line(line.strip())
        return first

    def close(self) -> None:
        if self.buffer.strip():
            self._line(self.buffer.strip())
        self.buffer = ""

    def _line(self, line: str) -> bool:
        if line.startswith("{"):  # a whole answer, not a stream: a Responses answer's id
            self._whole(line)
            return False
        if not line.startswith("data:"):
            return False
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return False
        try:
            event = json.loads(data)
        except ValueError:
            return False
        if not isinstance(event, dict):
            return False
        kind = event.get("type")
        if isinstance(kind, str) and kind.startswith("response."):
            return self._response_event(kind, event)
        if "error" in event or kind == "error":
            err = event.get("error") or event.get("message")
            self.error = str(err.get("message", err) if isinstance(err, dict) else err)[:300]
            return False
        self._usage(event.get("usage"))
        if self.seen_data or not _has_token(event.get("choices")):
            return False  # a usage-only or role-only chunk is not the first token
        self.seen_data = True
        return True


    def _usage(self, usage: object) -> None:
        """Prompt and cached tokens of a usage report: chat and completions name them
        ``prompt_tokens`` / ``prompt_tokens_details``, the Responses API ``input_tokens`` /
        ``input_tokens_details``."""
        if not isinstance(usage, dict):
            return
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
        try:
            self.prompt_tokens = int(usage.get("prompt_tokens") or usage.get("input_tokens") or 0)
            self.cached_tokens = int(details.get("cached_tokens") or 0)
        except (TypeError, ValueError, AttributeError):
            pass

    def _response_event(self, kind: str, event: dict[str, Any]) -> bool:
        """A Responses API stream event: the first text delta is the first token; the
        completed response ends the stream with its usage (cached tokens in
        ``input_tokens_details``); a failed one is an error."""
        if kind == "response.output_text.delta":
            first = not self.seen_data
            self.seen_data = True
            return first
        response = event.get("response")
        if kind == "response.created" and isinstance(response, dict):
            self.response_id = str(response.get("id") or "")
        if kind == "response.completed" and isinstance(response, dict):
            self.done = True
            self._usage(response.get("usage"))
        elif kind in ("response.failed", "response.error") and isinstance(response, dict):
            self.error = str(response.get("error") or kind)[:300]
        return False


    def _whole(self, text: str) -> None:
        try:
            answer = json.loads(text)
        except ValueError:
            return
        if isinstance(answer, dict) and answer.get("object") == "response":
            self.response_id = str(answer.get("id") or "")


def _has_token(choices: object) -> bool:
    """Whether a chunk's choices carry generated text (``delta.content`` for chat, ``text`` for
    completions) or end a choice (a completion that produced no text still ends its wait)."""
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if choice.get("text") or (isinstance(delta, dict) and delta.get("content")):
            return True
        if choice.get("finish_reason"):
            return True
    return False


# -- the running tally -----------------------------------------------------------------------------


@dataclass(slots=True)
class WorkerTally:
    requests: int = 0
    errors: int = 0
    input_tokens: int = 0
    matched_tokens: int = 0
    ttfts_ms: list[float] = field(default_factory=list)

    def add(self, sample: Sample) -> None:
        self.requests += 1
        if not sample.ok:
            self.errors += 1
            return
        self.input_tokens += sample.input_tokens
        self.matched_tokens += sample.matched_tokens
        if sample.ttft_ms is not None:
            self.ttfts_ms.append(sample.ttft_ms)
            if len(self.ttfts_ms) > 2 * _LIVE_TTFT_KEEP:
                del self.ttfts_ms[:-_LIVE_TTFT_KEEP]

    def merge(self, data: Mapping[str, Any]) -> None:
        self.requests += int(data.get("requests", 0))
        self.errors += int(data.get("errors", 0))
        self.input_tokens += int(data.get("input_tokens", 0))
        self.matched_tokens += int(data.get("matched_tokens", 0))
        self.ttfts_ms.extend(float(x) for x in data.get("ttfts_ms", ()))
        if len(self.ttfts_ms) > 2 * _LIVE_TTFT_KEEP:
            del self.ttfts_ms[:-_LIVE_TTFT_KEEP]

    @property
    def hit_rate(self) -> float:
        return self.matched_tokens / self.input_tokens if self.input_tokens else 0.0


@dataclass(slots=True)
class AffinityTally:
    """Per-worker counters of a live run (one per locust process; a distributed master merges
    its workers' deltas with :meth:`merge`)."""

    workers: dict[str, WorkerTally] = field(default_factory=dict)

    def add(self, sample: Sample) -> None:
        self.workers.setdefault(sample.worker or "(none)", WorkerTally()).add(sample)

    def total(self) -> WorkerTally:
        out = WorkerTally()
        for w in self.workers.values():
            out.merge(asdict(w))
        return out

    def export(self) -> dict[str, dict[str, Any]]:
        """The counters as plain data (to send to a distributed master)."""
        return {wid: asdict(w) for wid, w in self.workers.items()}

    def merge(self, data: Mapping[str, Mapping[str, Any]]) -> None:
        for wid, counters in data.items():
            self.workers.setdefault(wid, WorkerTally()).merge(counters)

    def clear(self) -> None:
        self.workers.clear()

    def rows(self) -> list[dict[str, Any]]:
        """One row per worker plus a ``total`` row: the live table of the web UI tab."""
        total = self.total()
        out = []
        for wid, w in sorted(self.workers.items()):
            out.append(_row(wid, w, total.requests))
        out.append(_row("total", total, total.requests))
        return out

    def line(self) -> str:
        """One console line: total hit rate, TTFT and the per-worker share."""
        total = self.total()
        shares = " ".join(
            f"{wid}={w.requests / total.requests:.0%}"
            for wid, w in sorted(self.workers.items()) if total.requests
        )
        ttft = percentile(total.ttfts_ms, 50) if total.ttfts_ms else 0.0
        return (f"affinity hit rate {total.hit_rate:.1%} (matched {total.matched_tokens} / input "
                f"{total.input_tokens} tokens), {total.requests} requests, {total.errors} errors, "
                f"TTFT p50 {ttft:.0f} ms; share {shares}")


def _row(name: str, w: WorkerTally, all_requests: int) -> dict[str, Any]:
    return {
        "name": name,
        "requests": w.requests,
        "share": f"{w.requests / all_requests:.1%}" if all_requests else "-",
        "input_tokens": w.input_tokens,
        "matched_tokens": w.matched_tokens,
        "hit_rate": f"{w.hit_rate:.1%}",
        "ttft_p50_ms": round(percentile(w.ttfts_ms, 50)) if w.ttfts_ms else "-",
        "errors": w.errors,
    }


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in (0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0
