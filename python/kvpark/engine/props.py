"""What ``/props`` says about the engine: the model, the pool, exact mode, the CPU paths, the prefix
cache and preemption, as ``AsyncEngine.props`` returns it."""

from __future__ import annotations

import sys

from kvpark.config.layers import EngineConfig
from kvpark.engine.llm_engine import LLMEngine
from kvpark.engine.stats import EngineStats


def describe_props(
    config: EngineConfig, engine: LLMEngine | None, stats: EngineStats
) -> dict[str, object]:
    """``engine``: None while the model loads; ``stats``: the counts as of the last step."""
    s = config.scheduler
    cached = stats.kv_cells_cached
    return {
        "model": engine.model_name if engine is not None else None,
        "max_model_len": engine.max_model_len if engine is not None else None,
        "pool": {
            "kv_cells": config.pool.kv_cells,
            "page_size": config.pool.page_size,
            "parallel": s.parallel,
            # the sliding layers' own cells (docs/models.md "The window space"); null: none
            "window_cells": stats.kv_window_cells_total or None,
        },
        # ranks the model is sharded over (--tensor-parallel; 1: one process)
        "tensor_parallel": config.model.tensor_parallel,
        # true only when exact mode runs: asked for, and a row-invariant runner doing it
        "exact": engine is not None and config.model.exact and engine.runner.row_invariant,
        # the CPU paths the built-in runner chose (docs/cpu-kernels.md); null on CUDA or
        # for a custom runner
        "cpu": cpu_paths(engine),
        # full pages kept after their last holder, found again by later prompts
        # (docs/preemption.md "Prefix cache"); counts as of the last step
        "prefix_cache": {
            "enabled": config.pool.prefix_cache,
            "cells_cached": cached,
            "pages_cached": cached // config.pool.page_size,
        },
        "preempt": {
            "enabled": s.preempt,
            "ram_mib": s.preempt_ram_mib,
            "policy": s.preempt_policy,
            "async": engine is not None
            and engine.preemption is not None
            and engine.preemption.asynchronous,
            "notices": True,
            "granularity": config.pool.page_size,
        },
    }


def cpu_paths(engine: LLMEngine | None) -> dict[str, object] | None:
    """The built-in runner's CPU paths (``props.cpu``); None for a custom runner or on CUDA."""
    runner = engine.runner if engine is not None else None
    describe = getattr(getattr(runner, "cpu_paths", None), "describe", None)
    if not callable(describe):
        return None
    shown: dict[str, object] = describe()
    shown["runner"] = getattr(runner, "runner_kind", None)  # lean, native or torch
    # whether this process holds torch (~360 MiB resident): not with the lean runner until an
    # embedding request loads the torch model (runner/lean_runner.py)
    shown["torch"] = "torch" in sys.modules
    return shown
