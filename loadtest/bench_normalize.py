"""What a long prompt's text costs the gateway in one process: normalization and fingerprint.

``python -m loadtest.bench_normalize [--chars N] [--runs K] [--json]`` times, on texts of each
layout of :func:`long_text` (``lines``, ``words``, ``ragged``, ``typeset``, ``emoji``, ``cjk``;
also the long prompts of ``loadtest.bench_overhead --long-text``), in ms, medians of
``--runs``:

* ``rules``: :func:`gateway.normalize.normalize_text`, the text seen for the first time;
* ``rules, seen``: the same text again, remembered (:class:`gateway.normal_texts.NormalTexts`);
* ``next turn``, ``next turn, seen``: the rules on texts that each add a line to the one
  before (a completions agent's turns), without and with the memo;
* ``fingerprint``: :func:`gateway.fingerprint.fingerprint` of the normalized text;
  ``fingerprint, next turn``: of texts that each add a line to the one before, hashed past it
  (:class:`gateway.fingerprint_memo.FingerprintMemo`).

on ``--sessions`` agents whose contexts share an opening, their turns interleaved
(:func:`measure_sessions`: the fingerprint of each next turn, hashed past its session's last
where the memo has it), and on agent transcripts of ``--messages`` messages (a tool call, then
its result of a few lines, in turn; :func:`transcript`): the body's JSON decoding,
:func:`parse_chat` (validation, the rules, the canonical rendering with every tool call as
canonical JSON) and the fingerprint of the rendering: what a request costs by its number of
messages.

No I/O, no event loop: the part of a long request's CPU that grows with the text, apart from
JSON decoding (orjson), reading and writing. To compare with another checkout, run this file
(``python loadtest/bench_normalize.py``) with that checkout first on ``PYTHONPATH``; ``rules,
seen`` is left out where it has no :mod:`gateway.normal_texts`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from gateway import normalize
from gateway.fingerprint import Namespace, fingerprint
from gateway.openai_schema import decode_json_object, parse_chat
from gateway.settings import GatewaySettings
from loadtest.workloads import words

# The layouts of long prompts' text (long_text), for this bench and bench_overhead's.
LONG_TEXTS = ("lines", "words", "ragged", "typeset", "emoji", "cjk")


def long_text(rng: random.Random, chars: int, layout: str) -> str:
    """``chars`` characters of seeded words: one line (``words``), or lines of 4-16 words, a
    third of them indented (``lines``), and a quarter of them ending in spaces as a
    re-rendered context's do (``ragged``), which the gateway's normalization trims, or with
    a typeset quote or dash in one line of eight (``typeset``: text that is not ASCII, as a
    model's answers and most edited prose are), or an emoji (``emoji``: characters beyond
    the Basic Multilingual Plane); or lines of 10-40 CJK ideographs (``cjk``)."""
    if layout == "words":
        return _whole_last_line(words(rng, chars // 3 + 1)[:chars])
    if layout not in LONG_TEXTS:
        raise ValueError(f"unknown long text layout {layout!r}; one of {LONG_TEXTS}")
    lines, size = [], 0
    while size < chars:
        if layout == "cjk":
            line = "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(rng.randint(10, 40)))
        else:
            line = "    " * (rng.random() < 0.33) + words(rng, rng.randint(4, 16))
        if layout == "ragged" and rng.random() < 0.25:
            line += "  "
        elif layout == "typeset" and rng.random() < 0.125:
            line += rng.choice((" \u2014 it\u2019s so", " \u201cquoted\u201d"))
        elif layout == "emoji" and rng.random() < 0.125:
            line += rng.choice((" \U0001f600", " \U0001f44d", " \U0001f680"))
        lines.append(line)
        size += len(line) + 1
    text = "\n".join(lines)[:chars]
    return text if layout == "ragged" else _whole_last_line(text)


def _whole_last_line(text: str) -> str:
    """``text`` with the whitespace a cut may leave at its end written as dots: a next turn's
    newline would make it a line ending in spaces, which the rules trim (only ``ragged`` text
    is meant to be rewritten)."""
    kept = text.rstrip()
    return kept + "." * (len(text) - len(kept))


def _median_ms(run: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _row(text: str, runs: int, settings: GatewaySettings) -> dict[str, float]:
    opts, fp_opts = settings.normalize_options(), settings.fingerprint_options()
    namespace = Namespace(tenant="t", model="m", cache_salt="")
    normal = normalize.normalize_text(text, opts)
    row = {"rules": _median_ms(lambda: normalize.normalize_text(text, opts), runs)}
    try:  # a checkout from before the memo has none
        from gateway.normal_texts import NormalTexts
    except ImportError:
        NormalTexts = None  # type: ignore[assignment,misc]
    if NormalTexts is not None:
        texts = NormalTexts()
        normalize.normalize_text(text, opts, texts.scope("t", ""))
        row["rules, seen"] = _median_ms(
            lambda: normalize.normalize_text(text, opts, texts.scope("t", "")), runs)
        # An agent's turns: each text the one before and a line more, checked whole, then
        # with the memo (which begins from the turn before where it can).
        turns = [text]
        for i in range(runs):
            turns.append(f"{turns[-1]}\nturn {i}: {text[:100]}")
        whole, memo = iter(turns[1:]), iter(turns[1:])
        row["next turn"] = _median_ms(lambda: normalize.normalize_text(next(whole), opts), runs)
        chain = NormalTexts()
        normalize.normalize_text(text, opts, chain.scope("t", ""))
        row["next turn, seen"] = _median_ms(
            lambda: normalize.normalize_text(next(memo), opts, chain.scope("t", "")), runs)
    row["fingerprint"] = _median_ms(lambda: fingerprint(normal, namespace, fp_opts), runs)
    try:  # a checkout from before it has none
        from gateway.fingerprint_memo import FingerprintMemo
    except ImportError:
        return row
    # The fingerprint of an agent's turns, each the one before and a line more (normalized
    # beforehand), hashed past the turn before.
    normal_turns = [normal]
    for i in range(runs):
        normal_turns.append(f"{normal_turns[-1]}\nturn {i}: {normal[:100]}")
    keys = FingerprintMemo()
    keys.fingerprint(normal, namespace, fp_opts)
    later = iter(normal_turns[1:])
    row["fingerprint, next turn"] = _median_ms(
        lambda: keys.fingerprint(next(later), namespace, fp_opts), runs)
    return row


def measure(chars: int, runs: int, seed: int = 0) -> dict[str, dict[str, float]]:
    """Layout -> {part: median ms} for texts of ``chars`` characters."""
    settings = GatewaySettings()
    normalize.normalize_text("\u00e9", settings.normalize_options())  # tables, built once
    return {layout: _row(long_text(random.Random(seed), chars, layout), runs, settings)
            for layout in LONG_TEXTS}


def agent_messages(rng: random.Random, messages: int = 0, chars: int = 0) -> list[dict[str, Any]]:
    """Tool calls and their results (a few lines of text each), in turn: ``messages`` of them,
    or as many as make ``chars`` characters of results."""
    out: list[dict[str, Any]] = []
    size = 0
    while len(out) < messages or size < chars:
        call = f"call_{len(out) // 2}"
        if len(out) % 2 == 0:
            out.append({"role": "assistant", "content": None, "tool_calls": [{
                "id": call, "type": "function", "function": {
                    "name": "read_file",
                    "arguments": orjson.dumps({"path": f"src/module_{len(out)}.py"}).decode()}}]})
        else:
            result = long_text(rng, rng.randint(200, 600), "lines")
            out.append({"role": "tool", "tool_call_id": call, "content": result})
            size += len(result)
    return out


def transcript(messages: int, seed: int = 0, turn: int = 0) -> bytes:
    """A chat body of a system prompt and ``messages`` more (:func:`agent_messages`); with
    ``turn``, that many more in turn, as an agent's next turn sends them."""
    system = {"role": "system", "content": "You are a coding agent."}
    return orjson.dumps({"model": "m", "messages": [
        system, *agent_messages(random.Random(seed), messages=messages + turn)]})


def _transcript_row(raw: bytes, runs: int, settings: GatewaySettings,
                    earlier: Sequence[bytes], turns: Sequence[bytes]) -> dict[str, float]:
    opts, fp_opts = settings.normalize_options(), settings.fingerprint_options()
    namespace = Namespace(tenant="t", model="m", cache_salt="")
    body = decode_json_object(raw)
    text = parse_chat(body, opts).fingerprint_text
    row = {
        "decode": _median_ms(lambda: decode_json_object(raw), runs),
        "parse_chat": _median_ms(lambda: parse_chat(body, opts), runs),
        "fingerprint": _median_ms(lambda: fingerprint(text, namespace, fp_opts), runs),
    }
    try:
        from gateway.chat_histories import ChatHistories
    except ImportError:  # a checkout from before chat histories
        return row
    opts_seed = ChatHistories.seed("t", opts)
    histories = ChatHistories()
    times = []
    # An agent's turns, two messages more each: the first two are not timed (the first body
    # is remembered, the second checks where its history ends).
    for i, turn_raw in enumerate([*earlier, *turns]):
        start = time.perf_counter()
        # What a turn costs the gateway's chat route: decode, parse, remember.
        turn, found = histories.decode(turn_raw, opts_seed)
        done = parse_chat(turn, opts, None, found.history if found else None,
                          keep_history=True)
        if done.history is None or len(turn_raw) < histories.min_bytes:
            return row  # too short to be remembered
        histories.remember(turn_raw, opts_seed, turn, done.history, found)
        if i >= len(earlier):
            if found is None:
                raise RuntimeError("a next turn was not joined to the one before")
            times.append(time.perf_counter() - start)
    row["next turn: decode + parse_chat"] = statistics.median(times) * 1e3
    return row


def measure_transcripts(sizes: list[int], runs: int) -> dict[str, dict[str, float]]:
    """Transcript name -> {part: median ms}, one per size in messages."""
    settings = GatewaySettings()
    out = {}
    for size in sizes:
        raw = transcript(size)
        out[f"{size} messages ({len(raw) // 1024} KiB)"] = _transcript_row(
            raw, runs, settings, [raw, transcript(size, turn=2)],
            [transcript(size, turn=2 * i) for i in range(2, runs + 2)])
    return out


def to_markdown(result: dict[str, dict[str, float]], chars: int) -> str:
    parts = list(next(iter(result.values())))
    lines = [f"Texts of {chars:,} characters, ms (medians):", "",
             "| layout | " + " | ".join(parts) + " |", "|---|" + "---:|" * len(parts)]
    lines += [f"| {layout} | " + " | ".join(f"{row[p]:.3f}" for p in parts) + " |"
              for layout, row in result.items()]
    return "\n".join(lines)


def measure_sessions(sessions: int, turns: int, layouts: Sequence[str] = ("lines", "typeset"),
                     opening_chars: int = 20_000, turn_chars: int = 4_000,
                     seed: int = 0) -> dict[str, dict[str, float]]:
    """Agents sharing an opening (one system prompt and tool list of ``opening_chars``), their
    turns interleaved, each adding ``turn_chars`` of its own: per layout, the memo's
    fingerprint of a turn in ms (median over the second half of the ``turns``), the texts'
    length at the end and the share of turns hashed past their session's last one."""
    from gateway.fingerprint_memo import FingerprintMemo

    fp_opts = GatewaySettings().fingerprint_options()
    namespace = Namespace(tenant="t", model="m", cache_salt="")
    out = {}
    for layout in layouts:
        rng = random.Random(seed)
        opening = long_text(rng, opening_chars, layout)
        contexts = [f"{opening}\nsession {s}\n" for s in range(sessions)]
        memo = FingerprintMemo()
        times: list[float] = []
        for turn in range(turns):
            for s in range(sessions):
                contexts[s] += long_text(rng, turn_chars, layout)
                started = time.perf_counter()
                memo.fingerprint(contexts[s], namespace, fp_opts)
                if turn >= turns // 2:
                    times.append(time.perf_counter() - started)
        out[layout] = {"fingerprint, next turn": statistics.median(times) * 1e3,
                       "chars": float(len(contexts[0])),
                       "hit share": memo.hits / (sessions * turns)}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--chars", type=int, default=640_000, help="text length in characters")
    p.add_argument("--runs", type=int, default=15, help="timed runs per part (median)")
    p.add_argument("--messages", default="10,100,1000",
                   help="transcript sizes in messages, comma-separated (empty: none)")
    p.add_argument("--sessions", type=int, default=16,
                   help="agents sharing an opening, their turns interleaved (0: none)")
    p.add_argument("--session-turns", type=int, default=20, help="turns per agent")
    p.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    args = p.parse_args(argv)
    result = measure(args.chars, args.runs)
    sizes = [int(n) for n in args.messages.split(",") if n.strip()]
    chats = measure_transcripts(sizes, args.runs) if sizes else {}
    agents = measure_sessions(args.sessions, args.session_turns) if args.sessions else {}
    if args.json:
        print(json.dumps({"texts": result, "transcripts": chats, "sessions": agents}, indent=2))
        return
    print(to_markdown(result, args.chars))
    if chats:
        parts = list(dict.fromkeys(p for row in chats.values() for p in row))
        print("\nAgent transcripts, ms (medians; - : too short to be remembered):\n")
        print("| transcript | " + " | ".join(parts) + " |\n|---|" + "---:|" * len(parts))
        for name, row in chats.items():
            cells = (f"{row[p]:.3f}" if p in row else "-" for p in parts)
            print(f"| {name} | " + " | ".join(cells) + " |")
    if agents:
        print(f"\n{args.sessions} agents sharing a 20,000-character opening, "
              f"{args.session_turns} turns of 4,000 characters each, interleaved:\n")
        print("| layout | fingerprint, next turn (ms) | characters at the end | turns hashed "
              "past their last |\n|---|---:|---:|---:|")
        for layout, row in agents.items():
            print(f"| {layout} | {row['fingerprint, next turn']:.3f} | {row['chars']:,.0f} | "
                  f"{row['hit share']:.2f} |")


if __name__ == "__main__":
    main()
