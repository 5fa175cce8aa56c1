"""Named routing policies: each is a profile of filters, weighted scorers and a picker.

=================  ==========================================  ==========================
policy             filters                                     scorers -> picker
=================  ==========================================  ==========================
round_robin        healthy, model                              round robin
least_load         healthy, model                              load -> best (ring ties)
consistent_hash    healthy, model                              ring owner of the anchor
bounded_hash       healthy, model, bounded_load(c)             ring walk from the anchor
prefix_affinity    healthy, model, bounded_load(c)             prefix_match -> best (ring)
cache_aware        healthy, model, bounded_load(c)             cache_cost -> best (ring)
=================  ==========================================  ==========================

``prefix_affinity`` sends a request to the worker holding its longest known prefix; a cold
prefix (no holder) scores 0 everywhere and falls to the ring walk, i.e. ``bounded_hash``; a
holder over the load bound is filtered out, so the request goes to the next-best holder or, if
none, to the ring, and the new worker becomes a second holder of the prefix.

``cache_aware`` (the default) replaces the longest-match switch with one cost per worker,
prefill it would have to compute plus its queue (see ``cache_cost``), under the same hard bound:
a holder wins until its queue outweighs the prefill it saves; holders of a hot prefix share its
traffic by load; a cold prefix still goes to its ring position.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.routing.engine import Profile, RoutingEngine
from gateway.routing.policies.bounded_load import BoundedLoadFilter
from gateway.routing.policies.cache_cost import CacheCostScorer
from gateway.routing.policies.healthy import HealthyFilter, ModelFilter
from gateway.routing.policies.load import LoadScorer
from gateway.routing.policies.prefix_match import PrefixMatchScorer
from gateway.routing.policies.ring_picker import RingPicker
from gateway.routing.policies.round_robin import RoundRobinPicker

POLICY_NAMES = (
    "cache_aware",
    "prefix_affinity",
    "bounded_hash",
    "consistent_hash",
    "least_load",
    "round_robin",
)


@dataclass(frozen=True, slots=True)
class PolicyOptions:
    load_factor: float = 1.25
    load_floor_requests: float = 1.0
    prefill_weight: float = 1.0
    queue_weight: float = 0.5


def build_engine(name: str, opts: PolicyOptions = PolicyOptions()) -> RoutingEngine:
    """A fresh engine for policy ``name`` (each has its own picker state)."""
    base = (HealthyFilter(), ModelFilter())
    bounded = (*base, BoundedLoadFilter(opts.load_factor, opts.load_floor_requests))
    match name:
        case "round_robin":
            profile = Profile(name, base, (), RoundRobinPicker())
        case "least_load":
            profile = Profile(name, base, ((LoadScorer(), 1.0),), RingPicker())
        case "consistent_hash":
            profile = Profile(name, base, (), RingPicker())
        case "bounded_hash":
            profile = Profile(name, bounded, (), RingPicker())
        case "prefix_affinity":
            profile = Profile(
                name, bounded, ((PrefixMatchScorer(), 1.0),), RingPicker(), uses_prefix_index=True
            )
        case "cache_aware":
            scorer = CacheCostScorer(opts.prefill_weight, opts.queue_weight)
            profile = Profile(name, bounded, ((scorer, 1.0),), RingPicker(), uses_prefix_index=True)
        case _:
            raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    return RoutingEngine(profile)
