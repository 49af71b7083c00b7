"""The random model of a real model's shape (bench/random_gguf.py), at a tiny shape: its tensors,
the source's tokenizer and metadata with the shape keys replaced, seeded values of the intended
scale; kvpark serves it on the lean runner; make-quant-files makes and records files from it (a
fake quantize tool, as in test_quant_types.py). The 1B shape itself is only named, never written.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest

import kvpark
from kvpark.bench import main
from kvpark.bench import quant_files as qf
from kvpark.bench import random_gguf as rg
from kvpark.sampling.params import SamplingParams

TINY = rg.Shape(hidden=256, layers=2, ffn=512, heads=4, kv_heads=2)


@pytest.fixture(scope="module")
def tiny_random(default_gguf_path: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("random") / "F32.gguf"
    assert rg.write_random(Path(default_gguf_path), dest, TINY)["tensors"] == 2 + 9 * 2
    return dest


def test_the_random_model_has_the_shape_and_the_sources_tokenizer(
    tiny_random: Path, default_gguf_path: str
) -> None:
    source, made = gguf.GGUFReader(default_gguf_path), gguf.GGUFReader(tiny_random)
    vocab = len(source.fields["tokenizer.ggml.tokens"].contents())
    want = rg.tensors(TINY, vocab)
    assert [(t.name, tuple(reversed(t.shape.tolist()))) for t in made.tensors] == want
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in made.tensors)
    fields = {k: made.fields[k].contents() for k in made.fields if not k.startswith("GGUF.")}
    assert fields["llama.block_count"] == 2 and fields["llama.embedding_length"] == 256
    assert fields["llama.attention.head_count_kv"] == 2
    assert fields["llama.feed_forward_length"] == 512 and fields["llama.rope.dimension_count"] == 64
    assert fields["general.file_type"] == int(gguf.LlamaFileType.ALL_F32)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template",
                "llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon"):  # fmt: skip
        assert fields[key] == source.fields[key].contents(), key
    values = {t.name: np.asarray(t.data) for t in made.tensors}
    assert np.array_equal(values["output_norm.weight"], np.ones(256, np.float32))
    # N(0, 1 / in): 131,072 and 262,144 samples put the standard deviation within 1 %
    for name, fan_in in (("blk.0.attn_q.weight", 256), ("blk.1.ffn_down.weight", 512)):
        assert abs(float(values[name].std()) * fan_in**0.5 - 1) < 0.01, name
    assert abs(float(values["token_embd.weight"].std()) / 0.02 - 1) < 0.01


def test_the_random_model_is_seeded(tiny_random: Path, default_gguf_path: str) -> None:
    again, other = tiny_random.with_name("again.gguf"), tiny_random.with_name("other.gguf")
    rg.write_random(Path(default_gguf_path), again, TINY)
    rg.write_random(Path(default_gguf_path), other, TINY, seed=1)
    assert again.read_bytes() == tiny_random.read_bytes()
    assert other.read_bytes() != tiny_random.read_bytes()
    with pytest.raises(ValueError, match="Llama source"):
        qwen = tiny_random.with_name("qwen.gguf")
        w = gguf.GGUFWriter(qwen, "qwen2")
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        rg.write_random(qwen, tiny_random.with_name("never.gguf"), TINY)


def test_kvpark_serves_the_random_model(tiny_random: Path) -> None:
    llm = kvpark.LLM(str(tiny_random), threads=1, kv_cells=256)
    assert type(llm.engine.runner).__name__ == "LeanCpuRunner"
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    (out,) = llm.generate([[1, 2, 3, 4]], [params])
    assert len(out.token_ids) == 6 and all(0 <= t < 49152 for t in out.token_ids)


def test_make_quant_files_from_a_random_shape(
    tmp_path: Path, tiny_random: Path, default_gguf_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["make-quant-files", "--random-shape", "llama-1b", "--types", "Q4_K_M", "--dry-run"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "(F32, random llama-1b weights)" in out and ".random-llama-1b/Q4_K_M.gguf" in out
    tool = tmp_path / "llama-quantize"
    tool.write_text('#!/bin/sh\ncp "$1" "$2"\n')
    tool.chmod(0o755)
    folder = tmp_path / "files"
    files = qf.make_files(Path(default_gguf_path), folder, ["Q4_K_M", "F32"], tool, 1, shape=TINY)
    assert files["F32"].read_bytes() == tiny_random.read_bytes()
    record = json.loads((folder / "quant-files.json").read_text())
    assert record["random_shape"] == {
        "hidden": 256, "layers": 2, "ffn": 512, "heads": 4, "kv_heads": 2,
    }  # fmt: skip
    assert record["note"].startswith("seeded random weights")
