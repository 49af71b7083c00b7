"""llama.cpp's greedy tokens on kvpark's parity prompts, for tests/model/test_llamacpp_greedy.py.

    kvpark bench build-llama-server                       # once: the llama-server binary
    kvpark bench --scenario llamacpp-reference            # -> tests/data/llamacpp_greedy.json

For each parity prompt of tests/model/test_model_parity.py (a question in the model's chat
template, tokenised by kvpark exactly as ``LLM.chat`` does), llama-server continues the same token
ids (``prompt`` as a list of ints on ``/completion``, no BOS added) for 32 tokens, greedy
(``temperature 0``, ``top_k 1``), end of sequence ignored, no prompt cache, and reports its two
most likely tokens at each step. The file keeps the greedy ids, llama.cpp's two best tokens with
their log-probabilities at each step (two close ones are a near-tie, where two correct
implementations may part), llama.cpp's version, the GGUF's sha256, this CPU's flags and the
command that remakes it.

The issue asked for llama-cpp-python's tokens; this script uses llama-server, the same llama.cpp
code behind an HTTP server, built reproducibly from PyPI (the file's ``made_with`` says so). It
writes into the source checkout's tests/data (``--out`` elsewhere); the test only reads the JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kvpark import _core
from kvpark.bench.machine import REPO, cpu_name, default_model
from kvpark.bench.peers import default_llama_server, llama_server_version
from kvpark.bench.servers import managed_server
from kvpark.model.gguf_file import GgufFile
from kvpark.tokenizer.tokenizer import Tokenizer

# the parity prompts of tests/model/test_model_parity.py and tests/runner/test_cpu_paths.py
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the ocean.",
    "Explain in two sentences why the sky is blue.",
]
N_PREDICT = 32
DATA = REPO / "tests" / "data" / "llamacpp_greedy.json"


def prompt_ids(tokenizer: Tokenizer, question: str) -> list[int]:
    """A question as ``LLM.chat`` sends it: the chat template, then token ids (BOS, if any, is
    the template's own)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}])
    return tokenizer.encode(text, add_special_tokens=False)


def completion_body(ids: list[int]) -> dict[str, Any]:
    return {
        "prompt": ids,
        "n_predict": N_PREDICT,
        "temperature": 0.0,
        "top_k": 1,
        "ignore_eos": True,
        "cache_prompt": False,
        "n_probs": 2,
        "post_sampling_probs": False,  # log-probabilities of the model's distribution, not top-1's
        "return_tokens": True,
        "stream": False,
    }


def greedy_record(answer: dict[str, Any]) -> tuple[list[int], list[list[list[float]]]]:
    """(greedy ids, llama.cpp's two best ``[id, logprob]`` at each step) from a ``/completion``
    answer; a step with fewer than two candidates keeps what it has."""
    ids = [int(t) for t in answer["tokens"]]
    top2 = []
    for step in answer.get("completion_probabilities", []):
        ranked = sorted(step.get("top_logprobs", []), key=lambda p: -p["logprob"])[:2]
        top2.append([[int(p["id"]), round(float(p["logprob"]), 4)] for p in ranked])
    return ids, top2


def llama_cpp_summary(info: dict[str, Any]) -> dict[str, Any]:
    """The build's tag, version line, flags and compiler (no local paths)."""
    build = info.get("build", {})
    keep = ("package", "llama_cpp_tag", "cmake_flags", "compiler")
    return {"version_output": info["version_output"], **{k: build[k] for k in keep if k in build}}


def compact_json(doc: dict[str, Any]) -> str:
    """Indented JSON with every list of numbers (and list of such lists) on one line."""
    text = json.dumps(doc, indent=1)
    text = re.sub(r"\[\s+([-0-9.e,\s]+?)\s+\]", lambda m: "[" + " ".join(m[1].split()) + "]", text)
    return re.sub(
        r"\[\s+((?:\[[^\[\]]*\],?\s*)+)\]", lambda m: "[" + " ".join(m[1].split()) + "]", text
    )


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--llama-server", type=Path, default=default_llama_server(), metavar="PATH")
    p.add_argument("--model", default=None, help="GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--port", type=int, default=8124)
    p.add_argument("--out", type=Path, default=DATA)
    args = p.parse_args(argv)
    if not args.llama_server.is_file():
        print(f"llama-server is not built at {args.llama_server}: run "
              "`kvpark bench build-llama-server` (or give --llama-server PATH)")  # fmt: skip
        return 2
    model = args.model or default_model()
    tokenizer = Tokenizer.from_gguf_metadata(GgufFile(model).metadata)
    # one slot, one thread: the plainest configuration (llama.cpp's CPU matmuls give each output
    # row to one thread, so the thread count does not change the sums anyway)
    cmd = [str(args.llama_server), "-m", model, "-np", "1", "-c", "1024", "-t", "1", "-tb", "1",
           "--host", "127.0.0.1", "--port", str(args.port), "--no-webui"]  # fmt: skip
    url = f"http://127.0.0.1:{args.port}"
    prompts = []
    log = Path(tempfile.gettempdir()) / "kvpark-llamacpp-reference.log"
    print(f"{' '.join(cmd)}  (log: {log})", flush=True)
    with managed_server(cmd, url + "/health", log):
        for question in QUESTIONS:
            ids = prompt_ids(tokenizer, question)
            answer = httpx.post(url + "/completion", json=completion_body(ids), timeout=300.0)
            answer.raise_for_status()
            greedy, top2 = greedy_record(answer.json())
            if len(greedy) != N_PREDICT:
                raise RuntimeError(f"llama-server gave {len(greedy)} tokens, not {N_PREDICT}")
            prompts.append({"question": question, "prompt_ids": ids, "greedy_ids": greedy,
                            "top2": top2})  # fmt: skip
    doc = {
        "about": "llama.cpp's greedy tokens on kvpark's parity prompts "
        "(tests/model/test_llamacpp_greedy.py)",
        "made_with": "llama-server, built by kvpark bench build-llama-server: the same llama.cpp "
        "code "
        "as llama-cpp-python (the issue's suggestion), which was not built when this was made",
        "remake": "kvpark bench build-llama-server && kvpark bench --scenario llamacpp-reference",
        "created": time.strftime("%Y-%m-%d"),
        "llama_cpp": llama_cpp_summary(llama_server_version(str(args.llama_server))),
        "gguf": {"file": Path(model).name, "sha256": sha256(model)},
        "cpu": cpu_name(),
        "cpu_flags": _core._cpu_features()[0],
        "server_command": [Path(cmd[0]).name, "-m", Path(model).name, *cmd[3:]],
        "request": {k: v for k, v in completion_body([]).items() if k != "prompt"},
        "prompts": prompts,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(compact_json(doc) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
