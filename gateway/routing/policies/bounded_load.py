"""Bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018), measured in tokens.

With ``L`` the in-flight tokens of all candidates and ``r`` the cost of this request, a worker of
weight share ``s`` (``weight / sum of weights``; 1/n when all are equal) may take the request
only while its in-flight tokens are at most ``c * s * (L + r)``: after taking it, it holds at
most ``c`` times its fair share plus this one request. The least-loaded worker always passes
(its load is at most its share), so the filter never empties the pool.

A floor keeps the bound meaningful when the pool is nearly idle: a worker with at most
``floor_requests`` requests' worth (``floor_requests * r`` tokens) in flight is never over it.
Without it, a worker serving a single request while the others idle is "over 1.25x the mean"
and a second request of the same prefix is sent away to prefill from scratch, although the
holder has free slots; and replicas that see each other's load a moment late would disagree on
who is loaded at all. From a few requests per worker upwards the relative bound rules.

With ``match_credit`` (``cache_aware``'s guard) a worker's bound grows by the prompt tokens it
is known to hold for this request: the prefill a move to another worker would have to redo.
Diverting a request from the holder of its prefix trades that prefill for the holder's excess
load, so the holder is left only when it is over the bound by more than the move costs. A
conversation is then not moved off its worker because its own earlier turns are still in
flight there (their prompt tokens are mostly cached), while a cold prefix or a shallow match
meets the plain bound. A holder's bound also grows by the prompt tokens it was predicted to
find cached for its requests in flight that do not share the part of this prompt it holds
(other sessions' histories, served from its cache: little work, though counted in tokens).
Counting those whole contexts against it sent sessions away from the worker holding their
history. Requests that share that part (a hot prompt piling up there) get no such allowance,
so the guard still spreads a hot spot. The credit is not given to a request placed past a
shared trunk (``Context.branch_anchor``) or to a hot prefix (whose tight bound is meant to
spread it).

With ``quick_s`` (``cache_aware``'s guard) the bound applies only where tokens in flight make
requests wait. A worker whose engine gave the requests it started since the scrape before
their first token within ``quick_s`` on average (vLLM's ``time_to_first_token`` histogram) is
never over it: however many tokens it has in flight, a request sent there starts sooner than
one that must redo its prefill elsewhere, and diverting it would only trade a cache hit for
nothing. An engine that does not report the histogram, or has not started a request since it
came up, is bounded as before, and so is a hot prefix (``hot_threshold``, off by default), whose
tight bound exists to spread it by request count.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from gateway.fingerprint import PrefixKey
from gateway.routing.engine import Context
from gateway.routing.types import WorkerView


def _cached_elsewhere(key: PrefixKey, held: int, view: WorkerView) -> int:
    """Prompt tokens the requests in flight on ``view`` were predicted to find cached, for
    those that do not share the first ``held`` blocks of ``key`` (the part that worker holds
    of this request). O(requests in flight there)."""
    depths = key.depths
    i = min(bisect.bisect_right(depths, held) - 1 if depths else held - 1, len(key.blocks) - 1)
    if i < 0:
        return 0
    mark = key.blocks[i]
    return sum(cached for blocks, cached in view.inflight_prompts
               if len(blocks) <= i or blocks[i] != mark)


def starts_at_once(view: WorkerView, quick_s: float) -> bool:
    """Whether ``view``'s engine reports giving its requests their first token within
    ``quick_s`` on average (0: never): tokens in flight there make nobody wait."""
    return bool(quick_s) and view.first_token_s is not None and view.first_token_s < quick_s


def load_bound(
    c: float, total_tokens: int, cost_tokens: int, share: float, floor_requests: float = 0.0
) -> float:
    """Most in-flight tokens a worker may have and still take a request of ``cost_tokens``."""
    return max(c * share * (total_tokens + cost_tokens), floor_requests * cost_tokens)


class BoundedLoadFilter:
    name = "bounded_load"

    def __init__(
        self, c: float = 1.25, floor_requests: float = 0.0, hot_c: float | None = None,
        match_credit: bool = False, quick_s: float = 0.0,
    ) -> None:
        if c < 1.0 or (hot_c is not None and hot_c < 1.0):
            raise ValueError("the load bound factors must be >= 1")
        if floor_requests < 0.0 or quick_s < 0.0:
            raise ValueError("floor_requests and quick_s must be >= 0")
        self.c = c
        self.floor_requests = floor_requests
        self.hot_c = hot_c  # the factor for hot prefixes (Context.hot), if different
        self.match_credit = match_credit
        self.quick_s = quick_s  # engines this quick to a first token are not bounded

    def apply(self, ctx: Context, candidates: Sequence[WorkerView]) -> list[WorkerView]:
        if ctx.pool_load is not None:  # the engine narrowed the candidates: use the whole pool
            total, weight_sum = ctx.pool_load
        else:
            # One pass, summed in order (as sum() would): once per decision.
            total, weight_sum = 0, 0
            for w in candidates:
                total += w.inflight_tokens
                weight_sum += w.worker.weight
        weight_sum = weight_sum or 1.0
        cost = ctx.request.cost_tokens
        c = self.hot_c if ctx.hot and self.hot_c is not None else self.c
        blocks = ctx.request.key.total_blocks
        credit = (ctx.request.prompt_tokens / blocks if self.match_credit and blocks
                  and not ctx.hot and ctx.branch_anchor is None else 0.0)
        matches = ctx.matches
        floor = self.floor_requests * cost
        # A hot prefix (hot_threshold, off by default) keeps its tight bound: whoever turned
        # that rule on asked for hot prefixes to spread by their request count.
        quick = 0.0 if ctx.hot else self.quick_s
        kept: list[WorkerView] = []
        for w in candidates:
            # starts_at_once(w, quick), inline: once per candidate.
            if quick and w.first_token_s is not None and w.first_token_s < quick:
                kept.append(w)  # no bound: requests start there at once
                continue
            # load_bound(c, total, cost, share, floor_requests), inline: once per candidate.
            bound = max(c * (w.worker.weight / weight_sum) * (total + cost), floor)
            if credit and (held := matches.get(w.id, 0)):
                # What its other requests in flight find cached (none in flight: nothing).
                elsewhere = (_cached_elsewhere(ctx.request.key, held, w)
                             if w.inflight_prompts else 0)
                bound += credit * held + elsewhere
            ctx.load_bounds[w.id] = bound
            if w.inflight_tokens <= bound:
                kept.append(w)
        return kept
