"""What decides where a simulated request goes: the gateway's own engines, or the oracle.

Every gateway policy comes from :func:`gateway.routing.policies.build_engine` by name; the
simulator has no code of its own for any of them. The only simulator-side router is the
``oracle``: a reference line that no real gateway can reach, because it reads every worker's
actual KV cache (:meth:`worker.kvcache.PrefixCache.lookup`) instead of a prefix index.
"""

from __future__ import annotations

from collections.abc import Mapping

from gateway.routing.policies import POLICY_NAMES, PolicyOptions, build_engine
from gateway.routing.policies.bounded_load import load_bound
from gateway.routing.types import Decision, DecisionKind, NoCandidates, RouteRequest, Snapshot
from gateway.session import Router
from worker.kvcache import PrefixCache

ORACLE = "oracle"


def policy_names() -> tuple[str, ...]:
    """Every policy the simulator can run: the gateway's, then the oracle."""
    return (*POLICY_NAMES, ORACLE)


class OracleRouter:
    """Longest *real* cached prefix among workers under the bounded-load bound.

    The bound is the gateway's (:func:`~gateway.routing.policies.bounded_load.load_bound`, in
    in-flight tokens, with the policy options' factor ``c`` and floor); ties in match length go
    to the least-loaded worker (then the smaller id), and a prefix no worker holds goes to the
    least-loaded worker.
    """

    name = ORACLE
    uses_prefix_index = False

    def __init__(self, caches: Mapping[str, PrefixCache], c: float,
                 floor_requests: float = 0.0) -> None:
        self._caches = caches
        self._c = c
        self._floor = floor_requests

    def route(
        self, request: RouteRequest, snapshot: Snapshot, exclude: frozenset[str] = frozenset()
    ) -> Decision:
        views = [w for w in snapshot.workers
                 if w.healthy and w.worker.serves(request.model) and w.id not in exclude]
        if not views:
            raise NoCandidates("no healthy worker serves the model")
        total = sum(w.inflight_tokens for w in views)
        weight_sum = sum(w.worker.weight for w in views) or 1.0
        tokens = request.key.blocks
        best_key: tuple[int, int, str] | None = None
        best = views[0]
        best_match = 0
        for w in views:
            share = w.worker.weight / weight_sum
            bound = load_bound(self._c, total, request.cost_tokens, share, self._floor)
            if w.inflight_tokens > bound:
                continue
            cache = self._caches[w.id]
            match = cache.lookup(tokens) // cache.block_size
            key = (-match, w.inflight_tokens, w.id)
            if best_key is None or key < best_key:
                best_key, best, best_match = key, w, match
        kind = DecisionKind.PREFIX_HIT if best_match else DecisionKind.COLD
        return Decision(worker=best, policy=ORACLE, kind=kind, match_blocks=best_match,
                        placement="least load", picker="oracle")


def build_router(name: str, caches: Mapping[str, PrefixCache],
                 opts: PolicyOptions | None = None) -> Router:
    """A fresh router for policy ``name`` (a gateway policy, or ``oracle``)."""
    opts = opts or PolicyOptions()
    if name == ORACLE:
        return OracleRouter(caches, opts.load_factor, opts.load_floor_requests)
    return build_engine(name, opts)
