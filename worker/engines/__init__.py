"""Inference engines behind the worker's HTTP API (today only the simulated one)."""

from worker.engines.base import (
    Admission,
    Engine,
    EngineStats,
    Generation,
    GenerationRequest,
    RequestRejectedError,
)
from worker.engines.sim import SimCosts, SimEngine

__all__ = [
    "Admission",
    "Engine",
    "EngineStats",
    "Generation",
    "GenerationRequest",
    "RequestRejectedError",
    "SimCosts",
    "SimEngine",
]
