"""Deterministic text for trace block ids, so that shared ids become shared text prefixes.

A Mooncake trace gives each request's prompt as a chain of block ids (one id = one 512-token KV
block). To replay it against real servers every id needs text: :meth:`TextSynth.block` turns an id
into a fixed-length chunk of seeded words (the same id and seed give the same chunk on every
machine; different ids give different chunks, each starts with its id), and
:meth:`TextSynth.prompt` concatenates the chunks of a chain. Two requests whose chains share their
first ``k`` ids therefore share their first ``k`` chunks of text, and so their first blocks of
tokens and of the gateway's fingerprint.

Chunk shape: it starts with a space and ends with a non-space character. With the worker's
:class:`~worker.tokenizer.HashTokenizer` (GPT-2 regex, no look-behind) text cut at such a
boundary tokenizes piecewise, so ``encode(a + b) == encode(a) + encode(b)``: the tokens of a
shared chunk prefix are the same whatever follows.

About 4 characters make a token, so :data:`DEFAULT_BLOCK_CHARS` (2,048) is ~512 tokens' worth, a
real Mooncake block. Live runs on CPU workers scale it down (``chars``), which keeps every
sharing relation and shrinks the prompts.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable

from loadtest.traces import TraceRequest
from loadtest.workloads import (
    COMPLETIONS_PATH,
    VOCABULARY,
    LiveRequest,
    LiveSpec,
    trace_body,
    trace_prompt_blocks,
)

DEFAULT_BLOCK_CHARS = 2048
_MIN_BLOCK_CHARS = 32  # room for the id marker and a few words
# Text laid out in lines (``TextSynth(lines=True)``): a chunk's every fifth word starts a new
# line, lines of about 35 characters, as code comes (a 64-character chunk has one or two).
LINE_WORDS = 5


class TextSynth:
    """Block id -> text chunk, with a bounded memo (chunks repeat a lot in a trace)."""

    def __init__(self, chars: int = DEFAULT_BLOCK_CHARS, seed: int = 0,
                 memo_size: int = 65536, lines: bool = False) -> None:
        if chars < _MIN_BLOCK_CHARS:
            raise ValueError(f"chars must be >= {_MIN_BLOCK_CHARS}")
        self.chars = chars
        self.seed = seed
        self.lines = lines
        self._memo_size = max(0, memo_size)
        self._memo: dict[int, str] = {}

    def block(self, block_id: int) -> str:
        """The chunk of ``block_id``: exactly ``chars`` characters, leading space, no trailing."""
        text = self._memo.get(block_id)
        if text is None:
            text = block_text(block_id, self.chars, self.seed, self.lines)
            if len(self._memo) >= self._memo_size:
                self._memo.clear()  # simple and bounded; a trace's hot ids come back quickly
            if self._memo_size:
                self._memo[block_id] = text
        return text

    def prompt(self, block_ids: Iterable[int]) -> str:
        """The prompt of a chain of ids: their chunks, concatenated."""
        return "".join(self.block(b) for b in block_ids)


def block_text(block_id: int, chars: int = DEFAULT_BLOCK_CHARS, seed: int = 0,
               lines: bool = False) -> str:
    """The text chunk of one block id (see module docstring); pure. ``lines``: the same words,
    every :data:`LINE_WORDS`-th of them on a new line (a line break for the space before it)."""
    if chars < _MIN_BLOCK_CHARS:
        raise ValueError(f"chars must be >= {_MIN_BLOCK_CHARS}")
    rng = random.Random(f"{seed}:block:{block_id}")
    parts = [f" [{block_id:x}]"]  # the id itself: different ids never give the same chunk
    length = len(parts[0])
    while length < chars:
        word = rng.choice(VOCABULARY)
        parts.append(("\n" if lines and len(parts) % LINE_WORDS == 0 else " ") + word)
        length += len(word) + 1
    text = "".join(parts)[:chars]
    if text[-1].isspace():
        text = text[:-1] + "x"
    return text


# Edits a reader cannot see, each undone by the gateway's normalization (gateway.normalize):
# a format character inserted (zero-width space, word joiner, soft hyphen, BOM), a space turned
# into a no-break or narrow no-break space, trailing spaces at the end of the prompt, or, in
# text laid out in lines, trailing spaces at the end of an inner line.
_INSERTED = ("\u200b", "\u2060", "\u00ad", "\ufeff")
_SPACES = ("\u00a0", "\u202f")


def invisible_edit(text: str, rng: random.Random) -> str:
    """``text`` with one invisible edit at a position drawn uniformly: what an editor, a
    rich-text paste or an agent framework's re-render does to a context it sends again. Text
    without a line break draws from the other kinds only."""
    ends = len(_INSERTED) + len(_SPACES)  # the kind: trailing spaces at the end
    kind = rng.randrange(ends + 2 if "\n" in text else ends + 1)
    if kind > ends:  # trailing spaces on an inner line, before one of its line breaks
        at = rng.choice([m.start() for m in re.finditer("\n", text)])
        return text[:at] + " " * rng.randint(1, 3) + text[at:]
    if kind == ends or not text:
        return text + " " * rng.randint(1, 3)
    if kind < len(_INSERTED):
        at = rng.randrange(len(text) + 1)
        return text[:at] + _INSERTED[kind] + text[at:]
    spaces = [i for i in range(len(text)) if text[i] == " "]
    if not spaces:
        return text + " "
    at = rng.choice(spaces)
    return text[:at] + _SPACES[kind - len(_INSERTED)] + text[at + 1:]


def trace_request(request: TraceRequest, synth: TextSynth, spec: LiveSpec,
                  max_blocks: int = 0) -> LiveRequest:
    """A replayed trace request as a streaming ``/v1/completions`` call.

    The prompt is the text of its first ``max_blocks`` blocks (0: all), so two trace requests
    sharing ``k`` leading ids share ``k`` chunks of prompt text; the decode length is the trace's,
    capped at ``spec.max_tokens``.
    """
    blocks = trace_prompt_blocks(request.blocks, max_blocks)
    body = trace_body(spec, synth.prompt(blocks), request.output_tokens)
    body["user"] = f"trace-{request.index}"
    return LiveRequest(COMPLETIONS_PATH, body, "", "mooncake")
