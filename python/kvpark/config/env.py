"""Every ``KVPARK_*`` environment variable, in one table.

Two kinds: each ``kvpark serve`` flag has a mirror ``KVPARK_<NAME>`` (``--kv-cells`` ->
``KVPARK_KV_CELLS``, ``--no-preempt`` -> ``KVPARK_NO_PREEMPT=1``; a flag on the command line wins
over its variable), and the knobs below, which have no flag. The test knobs exist to make rare paths
happen on demand in tests; they are documented as such and are never needed in production.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

PREFIX = "KVPARK_"
TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off", ""})


@dataclass(frozen=True)
class Knob:
    name: str
    default: str
    help: str
    test_only: bool = False


KNOBS: dict[str, Knob] = {
    knob.name: knob
    for knob in (
        Knob(
            "KVPARK_PREEMPT_EVERY",
            "0",
            "Park every generating request every N generated tokens, pressure or not (0: off).",
            test_only=True,
        ),
        Knob(
            "KVPARK_PREEMPT_FAIL_SAVE",
            "0",
            "1: every swap's host allocation fails, so every park falls back to recompute.",
            test_only=True,
        ),
        Knob(
            "KVPARK_PREEMPT_PLANNER",
            "on",
            "off: plan nothing ahead of a step; park only when a step actually fails to allocate.",
            test_only=True,
        ),
        Knob(
            "KVPARK_FAULT_STEP",
            "0",
            "The Nth step that runs the model (counted from 1) raises a RuntimeError from the "
            "runner, as a model bug would; a comma list (5,40,41) fails each of those steps "
            "(0: off).",
            test_only=True,
        ),
        Knob(
            "KVPARK_FAULT_PANIC",
            "0",
            "The Nth step that runs the model raises pyo3's PanicException from the runner, what "
            "a Rust panic in the core raises: a BaseException, not an Exception (0: off).",
            test_only=True,
        ),
        Knob(
            "KVPARK_FAULT_WEDGE",
            "0",
            "The Nth step that runs the model never returns: the engine thread makes no progress "
            "and --engine-timeout fires (0: off).",
            test_only=True,
        ),
        Knob(
            "KVPARK_FAULT_DIE",
            "0",
            "After the Nth step that runs the model, the engine thread's loop raises outside any "
            "step: the thread dies (0: off).",
            test_only=True,
        ),
        Knob(
            "KVPARK_TP_FAIL_SAVE",
            "0",
            "R >= 1: rank R of a tensor-parallel group fails every save of a swap park, so "
            "every park turns into a recompute on every rank (0: off).",
            test_only=True,
        ),
        Knob(
            "KVPARK_TP_TIMEOUT",
            "30",
            "Seconds a collective of a tensor-parallel step (or park) may wait for the other "
            "ranks before the step fails and the server exits 1 (a rank that has exited fails "
            "it at once); below --engine-timeout, so that a rank that hangs is named. Joining "
            "and loading have 10 minutes.",
        ),
        Knob("KVPARK_LOG_LEVEL", "info", "Log level: debug, info, warning or error."),
        Knob(
            "KVPARK_RELEASE_GPU_LIBS",
            "on",
            "off: keep the CUDA build of torch's GPU libraries resident on a CPU-only server "
            "instead of handing their pages back after the import.",
        ),
        Knob(
            "KVPARK_GC_FREEZE",
            "on",
            "off: leave the objects loading made (torch's, the model's, the tokenizer's) to "
            "Python's collector instead of freezing them (gc.freeze) once the server is ready.",
        ),
        Knob(
            "KVPARK_CPU_PACK",
            "on",
            "off: keep the lean runner's q4, q6 and Q5_K matrices in the loader's row layout "
            "instead of packing them as they are read for the side-by-side kernels (same bits; "
            "q6 and Q5_K then take 10 bits a weight, not 6.5 or 5.5; for measuring).",
        ),
        Knob(
            "KVPARK_HUGE_PAGES",
            "on",
            "off: leave the lean runner's matrices in numpy's own arrays instead of one mapping "
            "advised for transparent huge pages (same bits; for measuring).",
        ),
        Knob(
            "KVPARK_CPU_ISA",
            "auto",
            "Cap the CPU paths at avx512, avx2 or plain (auto: what the CPU has): the Rust "
            "kernels, the --dtype/--weights/--prompt-path rule, and torch's own kernels when set "
            "before kvpark is imported (docs/cpu-kernels.md).",
        ),
    )
}


def flag_env_name(flag: str) -> str:
    """``--kv-cells`` -> ``KVPARK_KV_CELLS``."""
    return PREFIX + flag.lstrip("-").replace("-", "_").upper()


def parse_bool(text: str) -> bool:
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"{text!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


def raw(name: str, environ: Mapping[str, str] | None = None) -> str:
    """The variable's value, or its default from :data:`KNOBS`."""
    env = os.environ if environ is None else environ
    return env.get(name, KNOBS[name].default)


@dataclass(frozen=True)
class Knobs:
    """The knobs, parsed once (the engine reads them at start)."""

    preempt_every: int = 0
    preempt_fail_save: bool = False
    preempt_planner: bool = True
    gc_freeze: bool = True
    release_gpu_libs: bool = True
    huge_pages: bool = True
    # the step (1-based, steps that run the model) each fault hits; 0: never
    fault_step: frozenset[int] = frozenset()  # KVPARK_FAULT_STEP may name several
    fault_panic: int = 0
    fault_wedge: int = 0
    fault_die: int = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Knobs:
        every = _count_knob("KVPARK_PREEMPT_EVERY", environ)
        planner = raw("KVPARK_PREEMPT_PLANNER", environ).strip().lower()
        if planner not in ("on", "off"):
            raise ValueError(f"KVPARK_PREEMPT_PLANNER={planner!r}: use on or off")
        return cls(
            preempt_every=every,
            preempt_fail_save=_bool_knob("KVPARK_PREEMPT_FAIL_SAVE", environ),
            preempt_planner=planner == "on",
            gc_freeze=_bool_knob("KVPARK_GC_FREEZE", environ),
            release_gpu_libs=_bool_knob("KVPARK_RELEASE_GPU_LIBS", environ),
            huge_pages=_bool_knob("KVPARK_HUGE_PAGES", environ),
            fault_step=_steps_knob("KVPARK_FAULT_STEP", environ),
            fault_panic=_count_knob("KVPARK_FAULT_PANIC", environ),
            fault_wedge=_count_knob("KVPARK_FAULT_WEDGE", environ),
            fault_die=_count_knob("KVPARK_FAULT_DIE", environ),
        )


def tp_timeout_s(environ: Mapping[str, str] | None = None) -> float:
    """``KVPARK_TP_TIMEOUT``: read where a tensor-parallel group starts (runner/tp_group.py)."""
    text = raw("KVPARK_TP_TIMEOUT", environ)
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"KVPARK_TP_TIMEOUT={text!r} is not a number of seconds") from None
    if not value > 0:
        raise ValueError(f"KVPARK_TP_TIMEOUT={text} must be > 0")
    return value


def tp_fail_save_rank(environ: Mapping[str, str] | None = None) -> int:
    """``KVPARK_TP_FAIL_SAVE``: the rank whose saves fail (0: none)."""
    return _count_knob("KVPARK_TP_FAIL_SAVE", environ)


def _count_knob(name: str, environ: Mapping[str, str] | None) -> int:
    """A knob that is a count (>= 0); a ValueError that names the variable otherwise."""
    text = raw(name, environ)
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer") from None
    if value < 0:
        raise ValueError(f"{name}={value} must be >= 0")
    return value


def _steps_knob(name: str, environ: Mapping[str, str] | None) -> frozenset[int]:
    """A comma list of step numbers (each >= 1; ``0`` alone: none)."""
    text = raw(name, environ)
    steps: set[int] = set()
    for part in text.split(","):
        try:
            step = int(part)
        except ValueError:
            raise ValueError(f"{name}={text!r}: {part!r} is not an integer") from None
        if step < 0:
            raise ValueError(f"{name}={step} must be >= 0")
        steps.add(step)
    steps.discard(0)
    return frozenset(steps)


def _bool_knob(name: str, environ: Mapping[str, str] | None) -> bool:
    """A boolean knob; a ValueError that names the variable for any other word."""
    try:
        return parse_bool(raw(name, environ))
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


# What KVPARK_CPU_ISA sets for torch's own kernels (ATen's dispatch, oneDNN, MKL), where unset.
TORCH_ISA_CAPS = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "plain": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
              "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}  # fmt: skip


def cap_torch_isa(environ: dict[str, str] | os._Environ[str] = os.environ) -> None:
    """Carry ``KVPARK_CPU_ISA`` over to torch's kernels. They read their variables once, when
    torch loads, so this runs when kvpark is imported (which loads no torch)."""
    cap = environ.get("KVPARK_CPU_ISA", "").strip().lower()
    for name, value in TORCH_ISA_CAPS.get(cap, {}).items():
        environ.setdefault(name, value)


cap_torch_isa()
