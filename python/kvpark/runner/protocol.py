"""``kvpark.Runner``: what the engine asks of a model runner, so that your own model code can run
under kvpark's pool, scheduler, preemption and server (docs/custom-runners.md walks through it).

::

    engine ──StepPlan──► runner.execute(plan) ──► logits [sampled rows, vocab] float32 ──► sampler
    parking ─► runner.bytes_per_cell / host_buffer / save_cells / restore_cells   (swap parks)
    engine reads runner.tokenizer, model_name, vocab_size, max_model_len, row_invariant

The engine touches a runner only through these members. The runner owns the K/V storage for the
pool's cells (``kv_cells`` cells in pages of ``page_size``, both in ``EngineConfig.pool``); the Rust
pool decides which cells each sequence holds, and the plan says which cells each row writes and
reads. Three optional members, not checked at start: ``embed(token_ids: list[int])`` (the prompt's
float32 embedding ``[hidden]``, a numpy array or a torch tensor, computed without touching the
pool's cells), which ``/v1/embeddings`` needs (engine/embeddings.py; without it the route answers
501); ``kv_window: int | None``, the sliding window every layer attends over (a row reads the
last ``kv_window`` positions of its sequence only, itself included): the pool then gives back each
sequence's pages behind it, and the plan's page tables hold ``-1`` for them (absent or None: every
page is kept); ``kv_window_split: int | None`` with ``use_window_space(n_cells)``, a model whose
sliding layers (of that window) can keep their K/V in ``n_cells`` cells of their own beside global
layers that keep every cell (the engine calls it before the first step; the plan's
``window_slot_mapping`` and ``window_page_tables`` then address them, sched/window_space.py); and
``close()``, which the engine calls once at shutdown, after every request is
aborted (the tensor-parallel runner stops its other ranks there). The built-in
runners are the CPU's one stack, ``kvpark.runner.lean_runner.LeanCpuRunner`` (the Rust decoder
over numpy weights and pool, no torch), and ``kvpark.runner.torch_runner.TorchRunner`` (CUDA, and
on the CPU the reference and what the decoder cannot run; it needs the ``gpu`` extra).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any, Protocol, cast, runtime_checkable

from kvpark.config.layers import EngineConfig
from kvpark.sched.plan import StepPlan
from kvpark.tokenizer.tokenizer import Tokenizer

log = logging.getLogger("kvpark.runner")

# What ``execute`` returns and the host buffers parking copies through: a numpy array or a torch
# tensor (on any device, for logits); the engine reads them without importing torch
Logits = Any
HostBuffer = Any


@runtime_checkable
class Runner(Protocol):
    """A model runner: runs the rows a step plan names over its own K/V cells.

    Data members may be plain attributes or properties; the engine reads them once, at start,
    except ``row_invariant``, which ``/props`` reads while serving.
    """

    @property
    def tokenizer(self) -> Tokenizer:
        """Text <-> ids and the chat template (``kvpark.load_tokenizer`` builds one from a GGUF
        file or a Hugging Face directory)."""
        ...

    @property
    def model_name(self) -> str:
        """What ``/v1/models`` and ``/props`` report."""
        ...

    @property
    def vocab_size(self) -> int:
        """Width of the logits ``execute`` returns; token ids at or past it are refused."""
        ...

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + completion) the model can run; the engine caps it
        further at ``--max-model-len`` and at the pool's size."""
        ...

    @property
    def row_invariant(self) -> bool:
        """True only if a row's logits are bit-identical whatever other rows share its step and
        however its prompt was chunked (docs/exact.md). Exact mode refuses a runner that says False;
        ``/props.exact`` reports this value."""
        ...

    def execute(self, plan: StepPlan) -> Logits:
        """Run one step: do ``plan.page_copies`` first, write every row's K/V at its cell in
        ``plan.slot_mapping``, attend each row over its sequence's cells ``0 .. position`` (read
        through ``plan.page_tables``), and return float32 logits ``[rows with sample=True,
        vocab_size]`` in item order: a numpy array, or a torch tensor on any device."""
        ...

    def bytes_per_cell(self) -> int:
        """Bytes one cell's saved state takes (K and V of every layer): swap parks are budgeted
        with it against ``--preempt-ram``."""
        ...

    def host_buffer(self, n_bytes: int) -> HostBuffer:
        """A host array (numpy) or tensor (torch) of at least ``n_bytes`` bytes that
        ``save_cells`` can fill. Raise ``MemoryError`` (or ``RuntimeError``) when it cannot be
        had: the park then recomputes."""
        ...

    def save_cells(self, cells: list[int], out: HostBuffer) -> None:
        """Copy the state of ``cells`` (a sequence's cells in logical order) into ``out``, a buffer
        from ``host_buffer`` with room for ``len(cells) * bytes_per_cell()`` bytes. The cells are
        freed right after: the copy must have landed when this returns. Raise ``MemoryError``
        when the state cannot be saved whole (a tensor-parallel rank could not save its share):
        the cells are left as they are and the park recomputes."""
        ...

    def restore_cells(self, src: HostBuffer, cells: list[int]) -> None:
        """Write a state saved by ``save_cells`` back into ``cells`` (fresh ones, in the same
        logical order; usually not the cells it was saved from)."""
        ...


RunnerFactory = Callable[[EngineConfig], Runner]
"""Builds a runner for a config; what ``--runner module:factory`` and ``LLM(runner=...)`` call.
A runner class whose ``__init__`` takes the ``EngineConfig`` is one."""

_MEMBERS = (
    "tokenizer",
    "model_name",
    "vocab_size",
    "max_model_len",
    "row_invariant",
    "execute",
    "bytes_per_cell",
    "host_buffer",
    "save_cells",
    "restore_cells",
)


def runner_name(runner: object) -> str:
    kind = type(runner)
    return f"{kind.__module__}.{kind.__qualname__}"


def load_runner_factory(spec: str) -> RunnerFactory:
    """``"package.module:name"`` -> the callable ``name`` of that module (imported now).

    ValueError for a malformed spec, ImportError or AttributeError for a missing module or name,
    TypeError when the name is not callable.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{spec!r} is not of the form module:factory")
    module = importlib.import_module(module_name)
    factory: object = module
    for part in attr.split("."):  # module:Class.method works too
        factory = getattr(factory, part)
    if not callable(factory):
        raise TypeError(f"{spec} is not callable")
    return cast(RunnerFactory, factory)


def build_runner(config: EngineConfig, given: Runner | RunnerFactory | None = None) -> Runner:
    """The runner the engine will drive: ``given`` itself when it is a runner, ``given(config)``
    when it is a factory, else the factory ``config.model.runner`` names, else a built-in one
    (``auto``, ``lean``, ``torch``). Checked by :func:`check_runner`."""
    runner: object
    custom = given is not None or config.model.runner not in BUILT_IN_RUNNERS
    if custom and config.model.tensor_parallel > 1:
        raise ValueError("--tensor-parallel shards the built-in torch model, not a custom runner")
    if given is not None and not isinstance(given, type) and isinstance(given, Runner):
        runner = given  # a runner may be callable too (a torch Module): its members decide
    elif given is not None:
        runner = cast(RunnerFactory, given)(config)
    elif config.model.runner not in BUILT_IN_RUNNERS:
        runner = load_runner_factory(config.model.runner)(config)
    else:
        runner = _built_in(config)
    checked = check_runner(runner, config)
    if config.model.chat_template is not None:  # --chat-template: whatever runner it is
        checked.tokenizer.set_chat_template(config.model.chat_template)
    return checked


BUILT_IN_RUNNERS = (None, "auto", "lean", "torch")
# what a user without torch installs to get the torch runner
GPU_EXTRA = "pip install 'kvpark[gpu]'"


def _built_in(config: EngineConfig) -> Runner:
    """``--runner auto``: on the CPU the lean runner where the Rust decoder can run the model;
    elsewhere (a GPU, or weights the decoder does not take) the torch runner. ``lean`` and
    ``torch`` insist on theirs."""
    name = config.model.runner or "auto"
    why: str | None = None
    if config.model.tensor_parallel > 1:
        return _tensor_parallel(config)
    if name in ("auto", "lean"):
        from kvpark.runner.lean_runner import try_lean  # numpy and the Rust core: no torch

        lean, why = try_lean(config)
        if lean is not None:
            return lean
        if name == "lean":
            raise ValueError(f"--runner lean cannot run this model: {why}")
        log.info("runner: torch (the lean runner cannot run this model: %s)", why)
    try:
        from kvpark.runner.torch_runner import TorchRunner  # torch: only when it is the one
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in ("torch", "triton"):
            raise
        raise ValueError(torch_missing(name, why)) from None
    return TorchRunner(config.model, config.pool)


def _tensor_parallel(config: EngineConfig) -> Runner:
    """``--tensor-parallel N``: the torch model's shards on N ranks (runner/tp_runner.py)."""
    try:
        from kvpark.runner.tp_runner import TpRunner  # torch
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in ("torch", "triton"):
            raise
        raise ValueError(
            f"--tensor-parallel needs torch, which is not installed: {GPU_EXTRA}"
        ) from None
    return TpRunner(config)


def torch_missing(runner: str, why_not_lean: str | None) -> str:
    """What a user without torch is told when the torch runner is the one asked for or needed."""
    if runner == "torch":
        return f"--runner torch needs torch, which is not installed: {GPU_EXTRA}"
    return (
        f"this model needs the torch runner (the lean runner cannot run it: {why_not_lean}), "
        f"and torch is not installed: {GPU_EXTRA}"
    )


def check_runner(runner: object, config: EngineConfig) -> Runner:
    """TypeError unless ``runner`` has every member of :class:`Runner`; ValueError for exact mode
    with a runner that is not row-invariant, or for sizes that cannot be right."""
    name = runner_name(runner)
    missing = [m for m in _MEMBERS if not hasattr(runner, m)]
    if missing:
        raise TypeError(f"{name} is not a kvpark.Runner: it lacks {', '.join(missing)}")
    checked = cast(Runner, runner)
    if config.model.exact and not checked.row_invariant:
        raise ValueError(
            f"exact mode cannot run with the runner {name}: it declares row_invariant = False, so "
            "a row's logits may change with what else shares its step, and exact mode promises "
            "bit-identical outputs whatever runs beside them; turn exact mode off or use a "
            "row-invariant runner"
        )
    for member in ("vocab_size", "max_model_len"):
        value = getattr(runner, member)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}.{member} must be a positive int, got {value!r}")
    return checked
