"""kvpark: an LLM server that parks requests instead of dropping them when the KV pool fills.

The public API, loaded lazily: ``import kvpark.core`` or ``import kvpark.sched`` loads no torch;
``kvpark.LLM`` (say) imports the engine on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# first: caps torch's kernels by KVPARK_CPU_ISA as it is imported, before anything loads torch
from kvpark.config import env as _env  # noqa: F401

if TYPE_CHECKING:
    from kvpark.config.layers import (
        EngineConfig,
        ModelConfig,
        PoolConfig,
        SchedulerConfig,
        ServerConfig,
    )
    from kvpark.engine.async_engine import AsyncEngine
    from kvpark.engine.llm import LLM, RequestOutput
    from kvpark.engine.llm_engine import LLMEngine, RequestRejected
    from kvpark.model.sources import load_tokenizer
    from kvpark.runner.protocol import Runner, RunnerFactory
    from kvpark.sampling.params import SamplingParams
    from kvpark.sched.plan import StepItem, StepPlan
    from kvpark.tokenizer.tokenizer import Tokenizer

# public name -> the module that defines it
_EXPORTS = {
    "LLM": "kvpark.engine.llm",
    "RequestOutput": "kvpark.engine.llm",
    "AsyncEngine": "kvpark.engine.async_engine",
    "LLMEngine": "kvpark.engine.llm_engine",
    "RequestRejected": "kvpark.engine.llm_engine",
    "EngineConfig": "kvpark.config.layers",
    "ModelConfig": "kvpark.config.layers",
    "PoolConfig": "kvpark.config.layers",
    "SchedulerConfig": "kvpark.config.layers",
    "ServerConfig": "kvpark.config.layers",
    "Runner": "kvpark.runner.protocol",
    "RunnerFactory": "kvpark.runner.protocol",
    "SamplingParams": "kvpark.sampling.params",
    "StepItem": "kvpark.sched.plan",
    "StepPlan": "kvpark.sched.plan",
    "Tokenizer": "kvpark.tokenizer.tokenizer",
    "load_tokenizer": "kvpark.model.sources",
}
__all__ = [
    "LLM",
    "AsyncEngine",
    "EngineConfig",
    "LLMEngine",
    "ModelConfig",
    "PoolConfig",
    "RequestOutput",
    "RequestRejected",
    "Runner",
    "RunnerFactory",
    "SamplingParams",
    "SchedulerConfig",
    "ServerConfig",
    "StepItem",
    "StepPlan",
    "Tokenizer",
    "load_tokenizer",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``kvpark.LLM`` and the other public names, imported when first asked for."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvpark' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
