"""The architecture as tests: the layers of docs/architecture.md hold, imports run in no circle (in
Python or in the Rust core), and the rooms that promise no torch load none.

docs/architecture.md's layer line (lowest first) is read here: every room in it has a rule in
:data:`ALLOWED` and every rule a place in it, and a room's rule names only rooms to its left, so
the line the docs show and the table the imports are held to cannot part.

Python: every import inside ``python/kvpark`` -- at module level, deferred into a function, or
type-only under ``TYPE_CHECKING`` -- goes from a room to itself or to a room its entry in
:data:`ALLOWED` names; and those same imports, all of them, form no cycle among rooms or among
modules, so that no circle hides behind a deferred or a type-only import. Rust: the ``use
crate::`` paths between the core crate's top-level modules form no cycle, ``page_table`` is a leaf,
and pyo3 appears only under ``rust/py/``.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
PACKAGE = REPO / "python" / "kvpark"
ROOT = "kvpark"  # the package's __init__: the public API, loaded lazily
MAIN = "__main__"  # python -m kvpark: above the command line it starts
BENCH_IN_PROCESS = "bench.in_process"  # a room of its own inside bench/
# room -> the rooms it may import (besides itself), at module level, deferred or type-only; the
# lowest rooms first
ALLOWED: dict[str, set[str]] = {
    "config": set(),
    "_core": set(),
    "core": {"_core", "config"},  # the preemption policies' names are config's
    "tokenizer": {"config"},
    "sampling": {"tokenizer", "config"},  # grammar masks are built over the served tokenizer
    "model": {"tokenizer", "config", "_core", "kernels"},
    "sched": {"sampling", "config", "core", "_core"},
    "runner": {"sched", "model", "tokenizer", "sampling", "config", "core", "_core", "kernels"},
    "preempt": {"sched", "model", "config", "core", "_core"},
    "engine": {
        "preempt", "sched", "runner", "model", "sampling", "tokenizer", "config", "core", "_core",
    },
    "server": {"engine", "sampling", "tokenizer", "config"},
    "bench": {"config"},
    # the benchmarks that run an engine in their own process; the bench starts them as
    # subprocesses by module name, so nothing imports them
    BENCH_IN_PROCESS: {
        ROOT, "bench", "engine", "preempt", "runner", "sched", "model", "sampling", "tokenizer",
        "config", "core", "_core",
    },
    # the public API names what it loads lazily (by the module's name, and for type checkers)
    ROOT: {"engine", "runner", "model", "sampling", "sched", "tokenizer", "config"},
    "cli": {
        ROOT, "server", "bench", "engine", "runner", "sampling", "tokenizer", "config", "_core",
    },
    MAIN: {"cli"},
}  # fmt: skip
# modules written against the public API on purpose (docs/custom-runners.md includes it): outside
# code that lives in the tree, so each is a room of its own in the rooms' circle check
PUBLIC_API_EXAMPLES = {"kvpark.runner.echo_runner": {ROOT, "core", "config", "sched"}}
DOCS = REPO / "docs" / "architecture.md"
LAYERS_INTRO = "The layers, lowest"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    found = {module_name(p): p for p in PACKAGE.rglob("*.py") if "kernels" not in p.parts}
    assert len(found) > 50, f"found only {len(found)} modules under {PACKAGE}"
    found["kvpark._core"] = PACKAGE / "_core.pyi"  # the Rust extension: imports nothing of ours
    return found


def imports(path: Path, known: dict[str, Path]) -> Iterator[tuple[str, str]]:
    """(imported kvpark module, how) for every import in ``path``, how being ``module`` (runs when
    the module is imported), ``deferred`` (inside a function) or ``type-only`` (under
    ``TYPE_CHECKING``)."""
    if path.suffix == ".pyi":
        return

    def walk(node: ast.AST, how: str) -> Iterator[tuple[str, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for stmt in child.body:
                    yield from walk_one(stmt, "type-only")
                for stmt in child.orelse:
                    yield from walk_one(stmt, how)
                continue
            yield from walk_one(child, how)

    def walk_one(node: ast.AST, how: str) -> Iterator[tuple[str, str]]:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, how
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                yield (full if full in known else node.module), how
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from walk(node, "type-only" if how == "type-only" else "deferred")
        else:
            yield from walk(node, how)

    for name, how in walk(ast.parse(path.read_text()), "module"):
        if name == ROOT or name.startswith(ROOT + "."):
            yield name, how


def room(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] == MAIN:
        return MAIN
    if parts[1:3] == BENCH_IN_PROCESS.split("."):
        return BENCH_IN_PROCESS
    return ROOT if len(parts) == 1 else parts[1]


def documented_layers() -> list[str]:
    """The rooms of docs/architecture.md's layer line, lowest first: the first code block after
    the paragraph that introduces it, one line of names (``model(ops)`` is the room ``model``)."""
    text = DOCS.read_text()
    assert LAYERS_INTRO in text, f"{DOCS} lost its layer line's introduction"
    block = text[text.index(LAYERS_INTRO) :].split("```")[1]
    names = block.split()
    return [re.sub(r"\(.*\)$", "", name) for name in names]


def misplaced(layers: list[str], allowed: dict[str, set[str]]) -> list[str]:
    """Each room of ``layers`` whose rule names a room not to its left."""
    return [
        f"{name} may import {sorted(above)}, which the docs put above it"
        for i, name in enumerate(layers)
        if (above := allowed.get(name, set()) - set(layers[:i]))
    ]


def test_the_documented_layers_are_the_tested_ones() -> None:
    layers = documented_layers()
    assert len(layers) == len(set(layers)), f"a room twice in the docs' line: {layers}"
    assert set(layers) == set(ALLOWED) | {"kernels"}, (
        f"the docs' line and the rules differ: only in the docs {set(layers) - set(ALLOWED)}, "
        f"only in the rules {set(ALLOWED) - set(layers) - {'kernels'}}"
    )
    assert not misplaced(layers, ALLOWED), "\n".join(misplaced(layers, ALLOWED))


def test_the_layer_check_sees_a_room_out_of_order() -> None:
    """The control: the docs' line with two rooms swapped fails, ``model(ops)`` reads as model."""
    layers = documented_layers()
    assert layers[0] == "config" and layers[-1] == MAIN and "model" in layers
    i, j = layers.index("sched"), layers.index("runner")
    layers[i], layers[j] = layers[j], layers[i]
    assert misplaced(layers, ALLOWED) == [
        "runner may import ['sched'], which the docs put above it"
    ]


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports, every kind of import counted."""
    known = modules()
    return {
        name: {t for t, _ in imports(path, known) if t in known and t != name}
        for name, path in known.items()
    }


def test_every_import_follows_the_layers() -> None:
    known = modules()
    wrong = set()
    for name, path in sorted(known.items()):
        allowed = ALLOWED[room(name)] | PUBLIC_API_EXAMPLES.get(name, set())
        for target, how in imports(path, known):
            if room(target) != room(name) and room(target) not in allowed:
                wrong.add(f"{name} imports {target} ({how})")
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))


def test_the_checker_counts_every_kind_of_import(tmp_path: Path) -> None:
    """The control of :func:`imports`: it sees a type-only import and a deferred one, as such."""
    source = tmp_path / "probe.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "import kvpark.config.env\n"
        "if TYPE_CHECKING:\n"
        "    from kvpark.engine.outputs import Events\n"
        "def later() -> None:\n"
        "    from kvpark.sched import plan\n"
    )
    known = {"kvpark.config.env": source, "kvpark.sched.plan": source}
    assert sorted(imports(source, known)) == [
        ("kvpark.config.env", "module"),
        ("kvpark.engine.outputs", "type-only"),
        ("kvpark.sched.plan", "deferred"),
    ]


def test_every_room_is_listed_and_the_layers_form_no_circle() -> None:
    rooms = {room(m) for m in modules()} | {"kernels"}
    assert rooms - {"kernels"} <= set(ALLOWED), f"rooms without a rule: {rooms - set(ALLOWED)}"
    assert_acyclic({r: deps - {r} for r, deps in ALLOWED.items()}, "rooms")


def test_the_rooms_imports_form_no_circle() -> None:
    """Over the imports themselves, not the table: every kind of import is an edge."""

    def room_of(module: str) -> str:
        return module if module in PUBLIC_API_EXAMPLES else room(module)

    graph: dict[str, set[str]] = {}
    for name, targets in import_graph().items():
        graph.setdefault(room_of(name), set()).update(
            room_of(t) for t in targets if room_of(t) != room_of(name)
        )
    assert_acyclic(graph, "rooms")


def assert_acyclic(graph: dict[str, set[str]], what: str) -> None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycle = [*path[path.index(nxt) :], nxt]
                raise AssertionError(f"import circle among {what}: {' -> '.join(cycle)}")
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_the_modules_imports_form_no_circle() -> None:
    """Module-level, deferred and type-only imports alike: a circle may not hide behind any."""
    assert_acyclic(import_graph(), "modules")


def test_the_checker_sees_a_circle() -> None:
    """The control: the same check fails on a graph with a circle in it."""
    with pytest.raises(AssertionError, match="a -> b -> c -> a"):
        assert_acyclic({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, "modules")


@pytest.mark.parametrize(
    "statement",
    [
        "import kvpark",
        "import kvpark.core",
        "import kvpark.sched.scheduler, kvpark.sched.plan",
        # the CPU server's whole path: the lean runner, the engine, the sampler, parking
        "import kvpark.server.app, kvpark.runner.lean_runner, kvpark.runner.protocol",
    ],
)
def test_these_imports_load_no_torch(statement: str) -> None:
    code = f"{statement}; import sys; print(sorted(m for m in sys.modules if m == 'torch'))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": ""},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"{statement} loaded torch"


RUST = REPO / "rust"
CORE_MODULES = ("error", "ids", "occupancy", "page_table", "planner", "pool", "py")
USE = re.compile(r"\bcrate::(?:\{([^}]*)\}|(\w+))")


def rust_uses(module: str) -> set[str]:
    """The core crate's other top-level modules that ``module`` (a file or a directory) names."""
    files = [RUST / f"{module}.rs", *sorted((RUST / module).rglob("*.rs"))]
    used: set[str] = set()
    for path in files:
        if not path.is_file():
            continue
        for group, single in USE.findall(path.read_text()):
            names = [n.strip().split("::")[0] for n in group.split(",")] if group else [single]
            used |= {n for n in names if n in CORE_MODULES and n != module}
    return used


def test_the_rust_core_modules_form_no_circle() -> None:
    assert (RUST / "lib.rs").is_file()
    graph = {m: rust_uses(m) for m in CORE_MODULES}
    assert graph["pool"], "the pool uses page tables and errors: the scan found nothing"
    assert_acyclic(graph, "the Rust core's modules")
    assert graph["page_table"] <= {"ids"}, "page_table.rs must stay a leaf"
    assert "py" not in set().union(*graph.values()), "nothing in the core uses its bindings"


def test_pyo3_appears_only_in_the_bindings() -> None:
    outside = [
        str(p.relative_to(REPO))
        for p in RUST.rglob("*.rs")
        if "pyo3" in p.read_text() and (RUST / "py") not in p.parents and p.name != "lib.rs"
    ]
    assert not outside, f"pyo3 outside rust/py/: {outside}"
