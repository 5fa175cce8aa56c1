"""Inference engines behind the worker's HTTP API: ``sim`` here; ``torch`` (optional) in
:mod:`worker.engines.torch_engine`, imported only when selected."""

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
