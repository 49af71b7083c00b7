"""The repository stands alone: its README, docs, code comments and tests cite no document outside
it (design notes, specs or studies a user of the repo does not have). Each citation form that once
crept in is a pattern here; the control below shows the scan finds one."""

from __future__ import annotations

import re
from pathlib import Path

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
SCANNED = (
    "README.md",
    "Makefile",
    "pyproject.toml",
    "docs",
    "python",
    "rust",
    "tests",
    "bench",
    ".ci",
)
SUFFIXES = {".md", ".py", ".pyi", ".rs", ".toml", ".sh", ".txt", ""}
SKIPPED_DIRS = {"target", ".venv", "__pycache__", "data"}  # data: test fixtures, not prose
OUTSIDE = re.compile(
    r"DESIGN\.md|STYLE\.md|SPEC\.md|\bSPEC §|feasibility (?:§|study|addendum)|"
    r"original-system\.md|\.\./shared/|shared/reference"
)
THIS = Path(__file__).resolve()


def text_files() -> list[Path]:
    found: list[Path] = []
    for name in SCANNED:
        top = REPO / name
        paths = [top] if top.is_file() else sorted(top.rglob("*"))
        for path in paths:
            parts = set(path.relative_to(REPO).parts)
            if path.is_file() and path.suffix in SUFFIXES and not parts & SKIPPED_DIRS:
                found.append(path)
    return found


def citations(path: Path) -> list[str]:
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        return []
    return [
        f"{path.relative_to(REPO)}:{n}: {line.strip()}"
        for n, line in enumerate(text.splitlines(), 1)
        if OUTSIDE.search(line)
    ]


def test_nothing_cites_a_document_outside_the_repo() -> None:
    files = [p for p in text_files() if p.resolve() != THIS]
    assert len(files) > 200, f"the scan found only {len(files)} files"
    found = [c for path in files for c in citations(path)]
    assert not found, "citations of documents outside the repo:\n" + "\n".join(found)


def test_the_scan_finds_a_citation() -> None:
    """The control: the same check flags each form."""
    for line in ("see DESIGN.md", "as SPEC §3.4 says", "(feasibility §3.1)", "../shared/STYLE.md"):
        assert OUTSIDE.search(line), line
    assert not OUTSIDE.search("docs/architecture.md, the SPECIAL case, a shared cell")
