"""Helpers the test files share (tests/conftest.py puts tests/ on sys.path; pyproject's pytest
``pythonpath`` names it too, so ``import support`` works whichever test runs first).

- ``servers``: the one way to start a real ``kvpark serve`` and wait for ``/health``;
- ``metrics``: the one Prometheus text parser, on ``prometheus_client``'s own;
- ``sse``: SSE lines and data objects of a streamed response;
- ``preempt_server``: streams, watchers and checks for the preemption scenarios over HTTP;
- ``preempt_reference``: the unparked reference server and completions the forced parks match;
- ``preempt``: a fake asynchronous copier, and the engine's "nothing left behind" check;
- ``scripted``: a scripted event source and response builder for SSE framing without an engine;
- ``tiny_model`` / ``attention``: random tiny models and attention steps for op and kernel tests;
- ``kernels``: random tensors, tolerances and paged step layouts for the Triton kernel tests;
- ``cli_args``: the command line parsed in-process (configs, usage errors, ``--help`` text);
- ``hf_runner``: a custom runner on transformers' Llama, written against the public protocol.
- ``llamacpp``: kvpark's steps against llama.cpp's recorded greedy tokens by one rule
  (``step_fault``), for the llama.cpp comparison and the KV pool rule under int8;
- ``kquants``: GGUF K-quant bytes (a reference quantiser, random valid blocks), which gguf cannot
  write;
- ``tiny_gguf`` / ``tiny_hf``: tiny random GGUF files and Hugging Face checkpoints of each variant
  the readers take, for the loading and runner tests.

conftest.py registers this package for pytest's assertion rewriting, as if it were test code.
"""
