"""The cluster simulator: the gateway's routing and the worker's cache, on a simulated clock.

Entry point: ``python -m loadtest.simulate`` (see :mod:`loadtest.simulate`).
"""

from loadtest.sim.cluster import (
    DEFAULT_COSTS,
    ClusterSim,
    SimConfig,
    SimResult,
    WorkerResult,
    gateway_key,
    pooled_bound,
    simulate,
    worker_ids,
)
from loadtest.sim.report import markdown_one, markdown_table, metrics
from loadtest.sim.routers import ORACLE, build_router, policy_names

__all__ = [
    "DEFAULT_COSTS",
    "ORACLE",
    "ClusterSim",
    "SimConfig",
    "SimResult",
    "WorkerResult",
    "build_router",
    "gateway_key",
    "markdown_one",
    "markdown_table",
    "metrics",
    "policy_names",
    "pooled_bound",
    "simulate",
    "worker_ids",
]
