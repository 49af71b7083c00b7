"""A ``*.safetensors`` file's tensors as numpy arrays over a memory map, without torch.

The format is an 8-byte little-endian header size, a JSON header (name -> dtype, shape and byte
range of the data after the header), then the data. Read here rather than with
``safetensors.safe_open(framework="np")``, which refuses bfloat16 (numpy has no such type): a
bfloat16 tensor comes as its uint16 bits (dense_weights.py says how the model reads them).
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np

from kvpark.model.arch import ModelLoadError

# safetensors dtype -> numpy dtype; BF16 as its bits
_DTYPES: dict[str, type[np.generic]] = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class SafetensorsFile:
    """One file's header, and its tensors as read-only views of the mapped file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            (size,) = struct.unpack_from("<Q", self._mm, 0)
            header: dict[str, Any] = json.loads(self._mm[8 : 8 + size].decode("utf-8"))
        except (OSError, ValueError, struct.error) as e:
            raise ModelLoadError(f"cannot read {path}: {e}") from e
        header.pop("__metadata__", None)
        self._data_start = 8 + size
        self.header = header

    def keys(self) -> list[str]:
        return list(self.header)

    def dtype_name(self, name: str) -> str:
        return str(self.header[name]["dtype"])

    def get(self, name: str) -> np.ndarray:
        """The tensor ``name``: a read-only view of the file (BF16 as uint16 bits)."""
        entry = self.header[name]
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ModelLoadError(f"{self.path}: tensor {name} has dtype {entry['dtype']}")
        start, end = entry["data_offsets"]
        shape = tuple(int(s) for s in entry["shape"])
        count = (end - start) // np.dtype(dtype).itemsize
        try:
            flat = np.frombuffer(self._mm, dtype, count, self._data_start + start)
            return flat.reshape(shape)
        except ValueError as e:
            raise ModelLoadError(f"{self.path}: tensor {name} does not fit the file ({e})") from e
