"""Stop sequences (the ``stop`` parameter): generated text is cut at the first of them.

As vLLM does, the stop string and everything after it never reach the client, the choice ends
with ``finish_reason`` ``"stop"``, and the engine stops generating for it. A stream cannot send
text that may turn out to be the start of a stop string: :class:`StopText` holds such an end
back until the next piece tells.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopText:
    """The text of one output, as it may go out, piece by piece."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        """What can go out now, of the text so far and ``piece`` (nothing once stopped)."""
        if self.stopped:
            return ""
        text = self._held + piece
        if not self._stops:
            return text
        cut = min((at for stop in self._stops if (at := text.find(stop)) >= 0), default=-1)
        if cut >= 0:
            self.stopped, self._held = True, ""
            return text[:cut]
        keep = max((self._open_end(text, stop) for stop in self._stops), default=0)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        """The end held back, once generation ended without reaching a stop string."""
        held, self._held = self._held, ""
        return held

    @staticmethod
    def _open_end(text: str, stop: str) -> int:
        """How many of ``text``'s last characters begin ``stop`` (the longest such end)."""
        for size in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:size]):
                return size
        return 0
