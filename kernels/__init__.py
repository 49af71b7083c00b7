"""Triton kernels for kvpark's CUDA path, shipped in the wheel as ``kvpark.kernels``.

Each module holds one kernel in Triton-tutorial shape: a docstring, a ``@triton.jit`` kernel,
a launcher that checks, allocates and launches, a torch reference, and a ``__main__`` check.
On CPU they run under ``TRITON_INTERPRET=1`` (set before import) for the tests.

``store_kv`` (K/V rows to their cells), ``paged_attention`` (prompt and decode rows over each
sequence's cells), ``rms_norm`` and ``matmul`` (batch invariant); ``kvpark.model.ops.triton_ops``
wires them into an ``OpSet``. Numerics and tests: docs/kernels.md.
"""
