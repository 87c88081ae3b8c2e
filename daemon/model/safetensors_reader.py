"""Read tensors out of `.safetensors` files by memory map, bf16 included.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte range),
then raw little-endian data. Reading it directly lets bf16 checkpoints (which NumPy has no dtype for)
be widened to fp32 on the way in.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np

NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64,
                "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


ITEM_BYTES = {"BF16": 2, **{name: np.dtype(t).itemsize for name, t in NUMPY_DTYPES.items()}}
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """The checkpoint is unusable: a file truncated or corrupt, or tensors missing, unexpected or mis-shaped."""


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint: from the index when there is one."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / n for n in names]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {directory}")
    return files


class SafetensorsFile:
    """One file, its header checked against its size on open: a truncated copy fails here, naming the
    file and the first tensor it cut, not later as a reshape error."""

    def __init__(self, path: Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            header, self.data_start = _read_header(self.path, f.read(8), f, size)
        header.pop("__metadata__", None)
        self.entries: dict[str, dict] = header
        _check_entries(self.path, header, size - self.data_start)
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


def _read_header(path: Path, prefix: bytes, f, size: int) -> tuple[dict, int]:
    if len(prefix) < 8:
        raise CheckpointError(f"{path} is truncated: {size} bytes, not even the header length")
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > size - 8:
        raise CheckpointError(f"{path}: header corrupt or file truncated (the header says {header_len} "
                              f"bytes, the file holds {size})")
    try:
        header = json.loads(f.read(header_len))
    except ValueError as exc:
        raise CheckpointError(f"{path}: header corrupt ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header corrupt (not a JSON object)")
    return header, 8 + header_len


def _check_entries(path: Path, header: dict, data_bytes: int) -> None:
    for name, entry in header.items():
        try:
            begin, end = entry["data_offsets"]
            want = ITEM_BYTES[entry["dtype"]] * math.prod(entry["shape"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: header corrupt at tensor {name} ({exc!r})") from exc
        if end - begin != want or begin < 0:
            raise CheckpointError(f"{path}: header corrupt at tensor {name} (bytes {begin}..{end} for "
                                  f"{entry['dtype']} {entry['shape']})")
        if end > data_bytes:
            raise CheckpointError(f"{path} is truncated: tensor {name} ends at data byte {end}, the file "
                                  f"holds {data_bytes}")
