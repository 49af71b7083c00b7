"""kvpark: an LLM server that parks requests instead of dropping them when the KV pool fills."""

from __future__ import annotations

# first: env caps torch's kernels by KVPARK_CPU_ISA as it is imported, before anything loads torch
from kvpark import env  # noqa: F401
from kvpark.async_engine import AsyncEngine
from kvpark.config import EngineConfig, ModelConfig, PoolConfig, SchedulerConfig, ServerConfig
from kvpark.engine import LLMEngine, RequestRejected
from kvpark.llm import LLM, RequestOutput
from kvpark.model import Tokenizer, load_tokenizer
from kvpark.plan import StepItem, StepPlan
from kvpark.runner_protocol import Runner, RunnerFactory
from kvpark.sampling import SamplingParams

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
