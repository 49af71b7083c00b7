"""The lean runner in processes of its own: the default CPU process never imports torch (an
embedding included), a CPU without AVX2 serves through the same decoder without torch, a process
without torch installed names the extra that brings it, and every instruction set this CPU runs
gives the plain path's bits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from kvpark import _core

NO_TORCH = """
import sys
import kvpark
llm = kvpark.LLM(kv_cells=512, threads=1)
out = llm.generate("The capital of France is", kvpark.SamplingParams(temperature=0.7, seed=3,
                   max_tokens=8, logprobs=2))[0]
assert out.error is None and len(out.choices[0].token_ids) == 8, out
print(type(llm.engine.runner).__name__, llm.engine.runner.cpu_paths.isa, "torch" in sys.modules)
ids = llm.engine.tokenizer.encode("Paris")
vector = llm.engine.runner.embed(ids)
print(len(vector.tolist()), "torch" in sys.modules)
"""

# torch made unimportable, as in a serving-only install (`pip install kvpark`)
WITHOUT_TORCH = """
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "triton"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoTorch())
import kvpark
for options in (dict(runner="torch"), dict(weights="dense")):
    try:
        kvpark.LLM(kv_cells=256, threads=1, **options)
    except ValueError as e:
        print(e)
"""


def run(code: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_the_default_cpu_process_never_imports_torch() -> None:
    """Sampling, logprobs and an embedding: torch never loads."""
    isa = str(_core._cpu_features()[0]["isa"])
    lines = run(NO_TORCH).stdout.split("\n")
    assert lines[0] == f"LeanCpuRunner {isa} False"
    assert lines[1] == "576 False"  # the hidden size


def test_a_cpu_without_avx2_serves_through_the_decoder_without_torch() -> None:
    lines = run(NO_TORCH, KVPARK_CPU_ISA="plain").stdout.split("\n")
    assert lines[0] == "LeanCpuRunner plain False"
    assert lines[1] == "576 False"


def test_without_torch_the_torch_runner_names_the_extra() -> None:
    lines = run(WITHOUT_TORCH).stdout.strip().split("\n")
    assert (
        lines[0] == "--runner torch needs torch, which is not installed: pip install 'kvpark[gpu]'"
    )
    assert lines[1].startswith("this model needs the torch runner (the lean runner cannot run it: ")
    assert "dense" in lines[1] and lines[1].endswith("pip install 'kvpark[gpu]'")


STEP = """
import sys
import numpy as np
sys.path.insert(0, sys.argv[2])
from test_lean_runner import lean, prefill, prompts_of
r = lean()
# each prompt's last 5 tokens: 15 rows, a full tile of the kernels' 8 rows (ROW_TILE) and a partial
# one, reach every kernel of a step; the whole prompts took the plain path (~0.4 s a row) a minute
np.save(sys.argv[1], prefill(r, [p[-5:] for p in prompts_of(r)]))
"""


def test_every_path_this_cpu_runs_gives_the_plain_bits(tmp_path: Path) -> None:
    levels = ["plain", "avx2", "avx512"]
    runnable = levels[: levels.index(str(_core._cpu_features()[0]["isa"])) + 1]
    here = str(Path(__file__).parent)
    results = {}
    for cap in runnable:
        out = tmp_path / f"{cap}.npy"
        run(STEP, str(out), here, KVPARK_CPU_ISA=cap)
        results[cap] = np.load(out)
    for cap, got in results.items():
        assert np.array_equal(got, results["plain"]), cap
