"""Triton kernels for kvpark's CUDA path, shipped in the wheel as ``kvpark.kernels``.

Each module holds one kernel in Triton-tutorial shape: a docstring, a ``@triton.jit`` kernel,
a launcher that checks, allocates and launches, a torch reference, and a ``__main__`` check.
On CPU they run under ``TRITON_INTERPRET=1`` (set before import) for the tests.
"""
