"""A model's files read into numpy weights (weight_arrays.py), without torch: the one reader, for
the torch model (loader.py builds it over these arrays) and the Rust decoder of the lean CPU runner
(runner/lean_runner.py), so both hold the same bits.

A GGUF's tensors come from gguf_tensors.py (blocks kept or repacked, Q/K rows unpermuted), a
Hugging Face directory's from its safetensors files (hf_loader.py); weight_assembly.py puts them
together. ``decoder_unfit`` is the one rule for what the decoder runs: every matrix, the embedding
and the head included, in blocks (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL,
IQ4_XS) or dense as the file stores it (F32, F16, BF16), a fused matrix's parts each so. The
decoder runs every feature a ``ModelArch`` describes (Q/K/V and output biases, Qwen3's per-head
Q/K norms, a tied head, rope scaling through its tables), so the matrices alone decide. A file it
refuses (a Q2_K head, say) loads through the torch model, dense where it must be.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from tqdm import tqdm

from kvpark.model import hf_loader
from kvpark.model.arch import ModelLoadError
from kvpark.model.gguf_arch import arch_from_gguf
from kvpark.model.gguf_blocks import Blocks
from kvpark.model.gguf_file import GgufFile, is_gguf
from kvpark.model.gguf_tensors import iter_tensors
from kvpark.model.sources import gguf_tokenizer
from kvpark.model.weight_arrays import (
    DENSE_ARRAYS,
    Matrix,
    NamedTensor,
    NumpyLayer,
    NumpyWeights,
    Stacked,
    Unfit,
)
from kvpark.model.weight_assembly import assemble_weights
from kvpark.tokenizer.tokenizer import Tokenizer

__all__ = [
    "NumpyLayer",
    "NumpyWeights",
    "Unfit",
    "decoder_unfit",
    "fit_for_decoder",
    "load_numpy_weights",
    "read_gguf",
    "read_model",
]


def load_numpy_weights(g: GgufFile) -> NumpyWeights:
    """The weights of ``g`` as the decoder runs them (``decoder_unfit``'s rule); each tensor's
    file pages released after its copy. Raises Unfit (its reason) for a file the decoder cannot
    run, stopping at the first tensor that shows it; ModelLoadError for a broken one."""
    return fit_for_decoder(read_gguf(g, blocks=True, strict=True))


def fit_for_decoder(weights: NumpyWeights) -> NumpyWeights:
    """``weights`` themselves, or Unfit with ``decoder_unfit``'s reason."""
    why = decoder_unfit(weights)
    if why is not None:
        raise Unfit(why)
    return weights


def decoder_unfit(w: NumpyWeights) -> str | None:
    """Why the Rust decoder cannot run these weights (the first matrix it cannot multiply, and
    why not), or None where it can."""
    named: list[tuple[str, Matrix]] = [("the embedding", w.embed), ("the head", w.head)]
    for i, layer in enumerate(w.layers):
        named += [(f"layer {i}'s {attr}", m) for attr, m in layer.matrices.items()]
    for what, matrix in named:
        if what in w.unfit_why:
            return w.unfit_why[what]
        for m in matrix.parts if isinstance(matrix, Stacked) else (matrix,):
            if not isinstance(m, Blocks) and (m.ndim != 2 or m.dtype.type not in DENSE_ARRAYS):
                return f"{what} is a {m.dtype} array of shape {m.shape}, not a matrix it takes"
    return None


# how a caller holds each block matrix it reads (read_gguf's ``keep``)
Keep = Callable[[Blocks], Blocks]


def read_gguf(
    g: GgufFile,
    *,
    blocks: bool,
    strict: bool = False,
    progress: bool = False,
    dense_dtype: str | None = None,
    keep: Keep | None = None,
) -> NumpyWeights[Matrix]:
    """Every tensor of ``g``; ``blocks``: matrices of the kept types as ``Blocks`` (else dense),
    ``strict``: Unfit at the first matrix the decoder cannot multiply; ``dense_dtype``: dense
    tensors stored in the model's dtype as they are read (weight_arrays.converted; vectors are
    float32 whatever); ``keep``: each ``Blocks`` as the caller holds it (the lean runner's
    packing), applied as it is read, so the file's form of one matrix at a time is in memory."""
    arch = arch_from_gguf(g)
    tensors = iter_tensors(g, arch, blocks=blocks, dense_dtype=dense_dtype)
    if keep is not None:
        tensors = _kept(tensors, keep)
    shown = _bar(tensors, len(g.tensors), progress, Path(g.path).name)
    return assemble_weights(arch, shown, g.path, strict=strict)


def _kept(tensors: Iterator[NamedTensor], keep: Keep) -> Iterator[NamedTensor]:
    for t in tensors:
        yield NamedTensor(t.name, keep(t.value), t.fmt) if isinstance(t.value, Blocks) else t


def read_model(
    path: str,
    *,
    blocks: bool = False,
    progress: bool = False,
    dense_dtype: str | None = None,
    strict: bool = False,
    keep: Keep | None = None,
) -> tuple[NumpyWeights[Matrix], Tokenizer, str]:
    """A GGUF file or a Hugging Face directory (config.json, *.safetensors, tokenizer.json): its
    weights, tokenizer and name (what /v1/models reports). ``blocks``: a GGUF's Q4_0, Q4_1,
    Q8_0, Q5_0, Q5_1, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS matrices kept as ``Blocks``;
    everything else is dense, in ``dense_dtype`` where given, else as the file stores it (BF16 as
    its bits). ``strict``: Unfit at the first matrix the decoder cannot multiply
    (weight_assembly.assemble_weights); ``keep``: as ``read_gguf``'s (a GGUF's blocks)."""
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelLoadError(f"{path} is a directory without config.json")
        return _read_hf(p, progress, dense_dtype, strict)
    if is_gguf(p):
        g = GgufFile(path)
        weights = read_gguf(
            g,
            blocks=blocks,
            strict=strict,
            progress=progress,
            dense_dtype=dense_dtype,
            keep=keep,
        )
        return weights, gguf_tokenizer(g.metadata), p.name
    raise ModelLoadError(f"{path} is neither a GGUF file nor a Hugging Face model directory")


def _read_hf(
    root: Path, progress: bool, dense_dtype: str | None, strict: bool
) -> tuple[NumpyWeights[Matrix], Tokenizer, str]:
    cfg = hf_loader.read_json(root / "config.json")
    hf_loader.variant(cfg)  # an unsupported architecture is the clearest error: check it first
    files = hf_loader.safetensor_files(root)
    names = hf_loader.tensor_names(files)
    arch = hf_loader.arch_from_config(cfg, has_lm_head="lm_head.weight" in names)
    tokenizer = hf_loader.tokenizer_from_dir(root, cfg)
    tensors = hf_loader.iter_tensors(files, dense_dtype, arch.arch)
    shown = _bar(tensors, len(names), progress, root.name)
    return assemble_weights(arch, shown, str(root), strict=strict), tokenizer, root.name


def _bar(
    tensors: Iterator[NamedTensor], total: int, progress: bool, what: str
) -> Iterable[NamedTensor]:
    bar: Iterable[NamedTensor] = tqdm(
        tensors,
        total=total,
        desc=f"loading {what}",
        unit="tensor",
        disable=not progress,
        leave=False,
    )
    return bar
