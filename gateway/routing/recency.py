"""What the prefix index has seen of the traffic lately: decayed counts, halved every half-life.

:class:`gateway.routing.prefix_index.PrefixIndex` keeps which worker holds which prefix; this
keeps how the traffic used them, each count halved every ``half_life_s`` (decayed lazily: a
count remembers when it was last updated):

* **heat**: per prefix checkpoint, the requests that shared it (as their deepest known part,
  or as their end): a system prompt many users send is hot, one conversation's history is not;
* **churn**: per worker and for the whole pool, the requests recorded, the blocks they added
  to the modelled cache and the blocks they routed (whole prompts, cached part included);
* **sessions**: per chain of prompts that extend each other (a session's turns), the requests
  and blocks it routed, kept in order of last use so that expiry drops the oldest first;
* **forks**: per fork (the deepest prefix known when a prompt went on along a new path), how
  often later prompts *extended* what went on from it (a session's next turn, from the end of
  one) against how often they *reused* it (another question on a shared document, from
  inside one); the same for the pool's forks together.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Churn:
    """Requests recorded for a worker and the blocks they added, decayed; ``at`` = last update."""

    requests: float = 0.0
    new_blocks: float = 0.0
    routed_blocks: float = 0.0  # whole prompts, cached part included
    at: float = 0.0


@dataclass(slots=True)
class Fork:
    """What later prompts did with the prompts that went on from one fork, decayed:
    ``extended``, went on from the end of one (a session's next turn); ``reused``, went on
    from inside one (another request sharing part of what came after the fork)."""

    extended: float = 0.0
    reused: float = 0.0
    at: float = 0.0


class Recency:
    """The decayed counts of one prefix index (see the module docstring); ``half_life_s`` <= 0
    keeps them undecayed."""

    def __init__(self, half_life_s: float) -> None:
        self.half_life_s = half_life_s
        self.heat: dict[int, tuple[float, float]] = {}  # checkpoint -> (count, at)
        self.pool = Churn()
        self.forks: dict[int, Fork] = {}
        self.pool_forks = Fork()
        # Session -> its recent requests and routed blocks, in order of last use.
        self.sessions: dict[int, Churn] = {}
        self._next_session = 0

    def factor(self, at: float, now: float) -> float:
        """What a count last updated at ``at`` keeps of itself at ``now``."""
        if self.half_life_s <= 0 or now <= at:
            return 1.0
        return float(0.5 ** ((now - at) / self.half_life_s))

    def count(self, churn: Churn, new_blocks: int, routed: int, now: float) -> None:
        """One more request in ``churn``, which added ``new_blocks`` and routed ``routed``."""
        keep = self.factor(churn.at, now)
        churn.requests = churn.requests * keep + 1.0
        churn.new_blocks = churn.new_blocks * keep + new_blocks
        churn.routed_blocks = churn.routed_blocks * keep + routed
        churn.at = now

    def recorded(self, worker: Churn, session: int, new_blocks: int, routed: int,
                 now: float) -> None:
        """A request recorded for the worker whose churn is ``worker``, in ``session``."""
        self.count(worker, new_blocks, routed, now)
        self.count(self.pool, new_blocks, routed, now)
        churn = self.sessions.pop(session, None) or Churn(at=now)
        self.sessions[session] = churn  # re-inserted: the dict stays in order of last use
        self.count(churn, new_blocks, routed, now)

    # -- heat ---------------------------------------------------------------------------------

    def heat_up(self, block: int, now: float) -> None:
        heat = self.heat.get(block)
        self.heat[block] = (
            (heat[0] * self.factor(heat[1], now) if heat is not None else 0.0) + 1.0, now)

    def heat_of(self, block: int, now: float) -> float:
        heat = self.heat.get(block)
        if heat is None:
            return 0.0
        return heat[0] * self.factor(heat[1], now)

    # -- sessions -----------------------------------------------------------------------------

    def new_session(self) -> int:
        self._next_session += 1
        return self._next_session - 1

    def session_blocks(self, session: int, now: float) -> float:
        churn = self.sessions.get(session)
        return churn.routed_blocks * self.factor(churn.at, now) if churn else 0.0

    def expire_sessions(self, cutoff: float) -> None:
        """Forget the sessions last used before ``cutoff``."""
        sessions = self.sessions
        while sessions:
            session, churn = next(iter(sessions.items()))
            if churn.at >= cutoff:
                break
            del sessions[session]

    # -- forks --------------------------------------------------------------------------------

    def tally(self, stats: Fork | None, extended: bool, now: float) -> None:
        """A later prompt extended (or reused) what went on from a fork (``stats``: its own
        counts, None for a fork no longer known); the pool's counts too."""
        for s in (stats, self.pool_forks):
            if s is not None:
                keep = self.factor(s.at, now)
                s.extended = s.extended * keep + extended
                s.reused = s.reused * keep + (not extended)
                s.at = now

    def branches_grow(self, block: int, unseen: bool | None = None) -> bool:
        stats = self.forks.get(block)
        if stats is None or stats.extended + stats.reused == 0.0:
            if unseen is not None:
                return unseen
            stats = self.pool_forks
        return stats.extended >= stats.reused

    def drop(self, block: int) -> None:
        """A checkpoint no worker holds any more: its heat and fork go with it."""
        self.forks.pop(block, None)
        self.heat.pop(block, None)
