"""Read tensors out of `.safetensors` files by memory map, bf16 included.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte range),
then raw little-endian data. Reading it directly lets bf16 checkpoints (which NumPy has no dtype for)
be widened to fp32 on the way in.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64,
                "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


class SafetensorsFile:
    def __init__(self, path: Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        header.pop("__metadata__", None)
        self.entries: dict[str, dict] = header
        self.data_start = 8 + header_len
        self.buffer = np.memmap(self.path, dtype=np.uint8, mode="r")

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def read(self, name: str) -> np.ndarray:
        """The tensor as a NumPy array (bf16 widened to fp32)."""
        entry = self.entries[name]
        begin, end = entry["data_offsets"]
        raw = self.buffer[self.data_start + begin:self.data_start + end]
        if entry["dtype"] == "BF16":
            widened = raw.view(np.uint16).astype(np.uint32) << 16
            return widened.view(np.float32).reshape(entry["shape"])
        return raw.view(NUMPY_DTYPES[entry["dtype"]]).reshape(entry["shape"])
