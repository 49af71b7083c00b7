"""Files stay small enough to hold one idea: every Python file of the package, the kernels, the
tests and the benchmarks is at most 320 lines, and every Rust file at most 500. No file is let
off: the message names each one over its limit with its count. The control shows the count flags
a file one line over.
"""

from __future__ import annotations

from pathlib import Path

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
PYTHON_LIMIT = 320
RUST_LIMIT = 500
# (folder, suffix, limit); python/kvpark/kernels is a dev tree's link to kernels/, counted there
SCANNED = (
    ("python/kvpark", ".py", PYTHON_LIMIT),
    ("kernels", ".py", PYTHON_LIMIT),
    ("tests", ".py", PYTHON_LIMIT),
    ("bench", ".py", PYTHON_LIMIT),
    ("rust", ".rs", RUST_LIMIT),
)
SKIPPED = {REPO / "python" / "kvpark" / "kernels"}
SKIPPED_DIRS = {"target", ".venv", "__pycache__"}


def line_count(path: Path) -> int:
    """Lines as ``wc -l`` counts them for a file that ends in a newline."""
    return len(path.read_text(errors="replace").splitlines())


def over_limit(paths: list[Path], limit: int, root: Path = REPO) -> list[str]:
    """``path: N lines (limit L)`` for each file longer than ``limit``."""
    return [
        f"{path.relative_to(root)}: {n} lines (limit {limit})"
        for path in paths
        if (n := line_count(path)) > limit
    ]


def scanned_files(top: Path, suffix: str) -> list[Path]:
    found = []
    for path in sorted(top.rglob(f"*{suffix}")):
        skipped = any(path.is_relative_to(s) for s in SKIPPED)
        if path.is_file() and not skipped and not SKIPPED_DIRS & set(path.parts):
            found.append(path)
    return found


def test_no_file_is_over_its_limit() -> None:
    offenders: list[str] = []
    counted = 0
    for folder, suffix, limit in SCANNED:
        files = scanned_files(REPO / folder, suffix)
        assert files, f"no {suffix} files under {folder}/"
        counted += len(files)
        offenders += over_limit(files, limit)
    assert counted > 300, f"the scan found only {counted} files"
    assert not offenders, "files over their line limit:\n" + "\n".join(offenders)


def test_the_count_flags_a_file_one_line_over(tmp_path: Path) -> None:
    """The control: 321 lines is over the Python limit, 320 is not."""
    over, at = tmp_path / "over.py", tmp_path / "at.py"
    over.write_text("x = 1\n" * (PYTHON_LIMIT + 1))
    at.write_text("x = 1\n" * PYTHON_LIMIT)
    assert line_count(over) == 321
    assert over_limit([over, at], PYTHON_LIMIT, tmp_path) == ["over.py: 321 lines (limit 320)"]
