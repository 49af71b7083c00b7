"""The lean runner in processes of its own: the default CPU process never imports torch (an
embedding included), a CPU without AVX2 serves through the same decoder without torch, a process
without torch installed names the extra that brings it and serves a Hugging Face checkpoint (a
real ``kvpark serve``), and every instruction set this CPU runs gives the plain path's bits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

import kvpark
from kvpark import _core
from kvpark.model.gguf_file import GgufFile
from kvpark.tokenizer.tokenizer import Tokenizer
from support.servers import TEST_FLAGS, Server, free_port, stop_server, wait_healthy
from support.tiny_hf import save_tiny

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
HIDE_TORCH = """
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "triton"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoTorch())
"""
WITHOUT_TORCH = (
    HIDE_TORCH
    + """
import kvpark
for options in (dict(runner="torch"), dict(weights="dense")):
    try:
        kvpark.LLM(kv_cells=256, threads=1, **options)
    except ValueError as e:
        print(e)
"""
)
SERVE_WITHOUT_TORCH = (
    HIDE_TORCH
    + """
from kvpark.cli.main import main
sys.exit(main(sys.argv[1:]))
"""
)


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
    """Sampling, logprobs and an embedding: torch never loads. The runner names the ISA its
    kernels run under: the CPU's, capped by ``KVPARK_CPU_ISA`` where that is set."""
    isa = str(_core._cpu_features()[1]["isa"])
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


def test_without_torch_a_hugging_face_checkpoint_serves_on_the_lean_runner(
    default_gguf_path: str, tmp_path: Path
) -> None:
    """``kvpark serve --model DIR`` in a process that cannot import torch: /props says the lean
    runner over dense weights with no torch, a greedy completion is the lean runner's in this
    process (same tokens), and /v1/embeddings answers a unit vector of the hidden size."""
    torch.set_num_threads(1)
    tokenizer = Tokenizer.from_gguf_metadata(GgufFile(default_gguf_path).metadata)
    root = tmp_path / "checkpoint"
    save_tiny("qwen3 (qk norm, head_dim 32)", tokenizer, root).to(torch.bfloat16).save_pretrained(
        str(root)
    )
    prompt = "Once upon a time"
    params = kvpark.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    here = kvpark.LLM(str(root), threads=1, kv_cells=256).generate(prompt, params)[0]
    port, log = free_port(), tmp_path / "server.log"
    argv = ["serve", "--host", "127.0.0.1", "--port", str(port), *TEST_FLAGS, "--model", str(root)]
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-c", SERVE_WITHOUT_TORCH, *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    server = wait_healthy(Server(f"http://127.0.0.1:{port}", process, log, owns_log=False))
    try:
        with server.client() as c:
            cpu = c.get("/props").json()["cpu"]
            assert (cpu["runner"], cpu["weights"], cpu["torch"]) == ("lean", "dense", False)
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            done = c.post("/v1/completions", json=body).json()
            assert done["usage"]["completion_tokens"] == 8
            assert done["choices"][0]["text"] == here.choices[0].text
            vector = c.post("/v1/embeddings", json={"input": "Paris"}).json()["data"][0]
            values = np.array(vector["embedding"])
            assert values.shape == (64,) and abs(float(np.linalg.norm(values)) - 1) < 1e-5
    finally:
        stop_server(server)
    assert "runner: lean" in log.read_text()


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
