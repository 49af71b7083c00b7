"""The per-quant-type benchmark's own layers, on fakes: the quantize tool's place in the peer's
build, the F32 writer (on tiny GGUFs: every tensor's values and every metadata key kept), the
llama-quantize command lines and the files' record (a fake tool), the prefill figure, the targets
per type and the docs table. Nothing here builds llama.cpp or starts a server.
"""

from __future__ import annotations

import json
import math
import stat
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from kvpark.bench import llama_build as build
from kvpark.bench import main
from kvpark.bench import quant_files as qf
from kvpark.bench import quant_table as table
from kvpark.bench.client import RequestResult
from kvpark.bench.report import LevelSummary, RunResult
from kvpark.bench.suites import quant_types
from support.tiny_gguf import write_tiny


def test_the_quantize_tool_is_built_with_the_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert build.TARGETS == ("llama-server", "llama-quantize")
    argv = ["build-llama-server", "--dry-run", "--cache", str(tmp_path), "--version", "9.0.0"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert "cmake targets: llama-server llama-quantize" in out
    assert f"llama-quantize: {tmp_path.resolve() / '9.0.0' / 'llama-quantize'}" in out
    folder = tmp_path / "9.0.0"
    folder.mkdir()
    (folder / "llama-server").write_text("")
    (folder / "llama-server.json").write_text("{}")
    assert build.cached_binary(folder) is None  # a cache from before the tool was a target
    (folder / "llama-quantize").write_text("")
    assert build.cached_binary(folder) == folder / "llama-server"
    assert build.quantize_binary(folder / "llama-server") == folder / "llama-quantize"


def equal_fields(a: gguf.GGUFReader, b: gguf.GGUFReader) -> list[str]:
    """The metadata keys (not the GGUF.* header) whose values differ between two files."""
    keys = [k for k in a.fields if not k.startswith("GGUF.")]
    assert keys == [k for k in b.fields if not k.startswith("GGUF.")]
    return [k for k in keys if a.fields[k].contents() != b.fields[k].contents()]


def test_the_f32_file_holds_every_tensor_dequantised(tmp_path: Path) -> None:
    source, dest = tmp_path / "tiny.gguf", tmp_path / "out" / "F32.gguf"
    write_tiny(source, "llama", attn=Q.Q4_K, mlp=Q.Q6_K, embed=Q.Q4_1, head=Q.Q8_0, v=Q.Q5_K)
    assert qf.write_f32(source, dest)["tensors"] == len(gguf.GGUFReader(source).tensors)
    a, b = gguf.GGUFReader(source), gguf.GGUFReader(dest)
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]  # Q/K rows as stored
    for x, y in zip(a.tensors, b.tensors, strict=True):
        assert y.tensor_type == Q.F32 and list(x.shape) == list(y.shape), x.name
        want = gguf.quants.dequantize(x.data, x.tensor_type).reshape(-1)
        assert np.array_equal(want, np.asarray(y.data).reshape(-1)), x.name
    assert equal_fields(a, b) == []
    assert not list(dest.parent.glob("*.partial"))


def test_the_f32_file_keeps_the_tokenizer_and_template(tmp_path: Path) -> None:
    source, dest = tmp_path / "meta.gguf", tmp_path / "F32.gguf"
    w = gguf.GGUFWriter(source, "llama")
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_1))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["<s>", "a", "b c"])
    w.add_token_types([1, 1, 6])
    w.add_add_bos_token(False)
    w.add_rope_freq_base(1e5)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    w.add_tensor("token_embd.weight", gguf.quants.quantize(np.ones((3, 32), np.float32), Q.Q4_1),
                 raw_dtype=Q.Q4_1)  # fmt: skip
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    qf.write_f32(source, dest)
    a, b = gguf.GGUFReader(source), gguf.GGUFReader(dest)
    assert equal_fields(a, b) == ["general.file_type"]
    assert b.fields["general.file_type"].contents() == int(gguf.LlamaFileType.ALL_F32)
    assert b.fields["tokenizer.ggml.tokens"].contents() == ["<s>", "a", "b c"]
    assert np.array_equal(np.asarray(b.tensors[0].data), np.ones((3, 32), np.float32))


def test_types_and_the_quantize_command_lines() -> None:
    assert qf.TYPES[-1] == "F32" and len(qf.TYPES) == 11
    assert qf.parse_types("f16, Q4_K_M") == ["Q4_K_M", "F16"]  # the table's order
    assert qf.parse_types("all") == list(qf.TYPES)
    for bad in ("Q2_K", "", "Q8_0,IQ2_XS"):
        with pytest.raises(ValueError):
            qf.parse_types(bad)
    tool, folder = Path("/t/llama-quantize"), Path("/f")
    assert qf.quantize_command(tool, folder / "F32.gguf", folder / "Q6_K.gguf", "Q6_K", 2) == [
        "/t/llama-quantize", "/f/F32.gguf", "/f/Q6_K.gguf", "Q6_K", "2",
    ]  # fmt: skip
    plan = qf.plan(folder, ["Q8_0", "F32"], tool, 2)
    assert list(plan) == ["Q8_0"] and plan["Q8_0"][1] == "/f/F32.gguf"  # F32 is written here
    source = Path("/x/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert qf.default_dir(source, "9.0.0").parts[-3:] == (
        "quant-files", "9.0.0", "SmolLM2-135M-Instruct.Q4_1",
    )  # fmt: skip


def fake_quantize(tmp_path: Path) -> Path:
    """A stand-in for llama-quantize: copies its input to its output and logs its arguments."""
    tool = tmp_path / "bin" / "llama-quantize"
    tool.parent.mkdir()
    tool.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls\ncp "$1" "$2"\n')
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    (tool.parent / "llama-server.json").write_text('{"llama_cpp_tag": "b9"}')
    return tool


def test_the_files_are_made_once_and_recorded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source, folder, tool = tmp_path / "src.gguf", tmp_path / "files", fake_quantize(tmp_path)
    write_tiny(source, "llama")
    argv = ["make-quant-files", "--model", str(source), "--out", str(folder)]
    argv += ["--types", "Q8_0,F16,F32", "--llama-quantize", str(tool), "--threads", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for qtype in ("Q8_0", "F16", "F32"):
        assert f"{qtype}: {folder / qtype}.gguf" in out
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls == [f"{folder}/F32.gguf {folder}/Q8_0.gguf.partial Q8_0 1",
                     f"{folder}/F32.gguf {folder}/F16.gguf.partial F16 1"]  # fmt: skip
    record = json.loads((folder / "quant-files.json").read_text())
    assert record["llama_build"] == {"llama_cpp_tag": "b9"} and record["source"] == str(source)
    assert record["files"]["F32"]["tensor_types"] == {"F32": len(gguf.GGUFReader(source).tensors)}
    assert main(argv) == 0  # a second run keeps the files
    assert len((tmp_path / "calls").read_text().splitlines()) == 2
    assert main([*argv, "--dry-run"]) == 0
    assert "llama-quantize" in capsys.readouterr().out
    missing = ["make-quant-files", "--model", str(source), "--llama-quantize", "/no/tool"]
    assert main([*missing, "--out", str(tmp_path / "other")]) == 2
    with pytest.raises(SystemExit) as refused:
        main(["make-quant-files", "--types", "Q3_K"])
    assert refused.value.code == 2


def result(
    prompt: int | None, sent: float, first: float, error: str | None = None
) -> RequestResult:
    r = RequestResult(0, sent_s=sent, token_s=[first], chunks=1, prompt_tokens=prompt, error=error)
    r.cached_tokens = 0
    return r


def test_prefill_is_the_median_of_prompt_tokens_over_ttft() -> None:
    runs = [result(400, 0.0, 0.5), result(400, 1.0, 1.4), result(400, 2.0, 2.8)]
    summary = table.prefill_summary([*runs, result(None, 0.0, 1.0), result(400, 0, 1, "boom")])
    assert summary["tok_s"] == pytest.approx(800.0) and len(summary["per_request_tok_s"]) == 3
    assert summary["errors"] == ["boom"] and summary["cached_tokens"][:3] == [0, 0, 0]
    assert table.prefill_summary([])["tok_s"] is None


def run_result(label: str, single: float, agg8: float, dec8: float) -> RunResult:
    levels = [LevelSummary(1, 4, 4, 0, 1.0, 8, single, single, 0.1, 0.1, 0.01, 0.01, 0),
              LevelSummary(8, 16, 16, 0, 1.0, 8, agg8, dec8, 0.1, 0.1, 0.01, 0.01, 0)]  # fmt: skip
    return RunResult(label, "http://x", "m", "sweep", {}, levels)


def row(qtype: str, with_peer: bool = True) -> table.TypeRow:
    ours = table.figures(run_result("kvpark", 66.0, 250.0, 30.0), {"tok_s": 900.0}, 220.0, 8)
    base = table.figures(run_result("llama-server", 60.0, 100.0, 15.0), {"tok_s": 1000.0}, 200.0, 8)
    peer = base if with_peer else None
    return table.TypeRow(qtype, 87.5, "lean", ours, peer, table.judge(ours, peer, 8))


def test_the_targets_per_type() -> None:
    single, agg, prefill, rss = row("Q4_0").verdicts
    assert single["ratio"] == pytest.approx(1.1) and single["met"] is True
    assert agg["goal"] == "aggregate tok/s at 8 chats" and agg["ratio"] == pytest.approx(2.5)
    assert prefill["ratio"] == pytest.approx(0.9) and prefill["met"] is False
    assert rss["ratio"] == pytest.approx(1.1) and rss["met"] is True  # at most 1.1x
    assert all(v["met"] is None for v in row("Q4_0", with_peer=False).verdicts)
    nan = table.figures(run_result("kvpark", math.nan, 1.0, 1.0), None, None, 8)
    assert nan.single_tok_s is None and nan.prefill_tok_s is None
    assert table.figures(run_result("kvpark", 1.0, 1.0, 1.0), None, 1.0, 4).aggregate_tok_s is None
    text = table.format_verdicts([row("Q4_0")])
    assert "Q4_0    prefill tok/s: 0.90x (target >= 1x): NOT MET" in text
    assert "peak resident memory: 1.10x (target <= 1.1x): MET" in text


def test_the_docs_table_has_a_line_per_type() -> None:
    lines = table.markdown_rows([row("Q4_0"), row("F32", with_peer=False)], 8, 448)
    assert lines[0].startswith("| type | file MiB | kvpark runner | single-stream decode tok/s")
    assert "aggregate tok/s at 8 chats" in lines[0] and "(~448 tokens)" in lines[0]
    assert lines[2] == (
        "| Q4_0 | 87.5 | lean | 66.0 / 60.0 (1.10×) | 250.0 / 100.0 (2.50×) "
        "| 30.0 / 15.0 (2.00×) | 900 / 1 000 (0.90×) | 220 / 200 (1.10×) "
        "| 3/4 (not: prefill) |"
    )
    assert lines[3].startswith("| F32 | 87.5 | lean | 66.0 / - | ") and lines[3].endswith("| - |")
    assert row("Q4_0").to_json()["kvpark"]["peak_mib"] == 220.0


def test_rounds_take_each_rates_median_and_the_largest_peak() -> None:
    def figs(
        single: float | None, agg: float, prefill: float | None, peak: float | None
    ) -> table.Figures:
        return table.Figures(single, agg, agg / 8, prefill, peak)

    rounds = [
        figs(60.0, 200.0, None, 300.0),
        figs(90.0, 100.0, 700.0, 320.0),
        figs(None, 150.0, 500.0, None),
    ]
    m = table.median_figures(rounds)
    assert m.single_tok_s == pytest.approx(75.0) and m.aggregate_tok_s == pytest.approx(150.0)
    assert m.decode_tok_s == pytest.approx(150.0 / 8) and m.prefill_tok_s == pytest.approx(600.0)
    assert m.peak_mib == 320.0
    none = table.median_figures([table.Figures(None, None, None, None, None)])
    assert none == table.Figures(None, None, None, None, None)


def test_rounds_alternate_which_server_goes_first() -> None:
    labels = ["llama-server", "kvpark"]
    assert quant_types.round_order(labels, 0) == labels
    assert quant_types.round_order(labels, 1) == ["kvpark", "llama-server"]
    assert quant_types.round_order(labels, 2) == labels
    p = quant_types.build_parser()
    base = ["--scenario", "quant-types"]
    assert p.parse_args(base).rounds == 1 and p.parse_args([*base, "--rounds", "3"]).rounds == 3
    with pytest.raises(SystemExit):
        quant_types.check(p, p.parse_args([*base, "--rounds", "0", "--peer", "none"]))
