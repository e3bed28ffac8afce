"""Lazy, memory-mapped reading of safetensors files (single file or sharded index).

Tensors come back as NumPy views over the mapped file, so slicing one device's shard out of a
(transposed, reshaped) view reads only those bytes. bfloat16 is supported through ml_dtypes.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class CheckpointError(ValueError):
    """A malformed, missing or misshapen checkpoint file or tensor."""


def _read_header(path: Path) -> tuple[dict, int]:
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: truncated safetensors file (no header length)")
            (n,) = struct.unpack("<Q", raw)
            if n > os.path.getsize(path) - 8:
                raise CheckpointError(f"{path}: header length {n} exceeds the file size")
            header = json.loads(f.read(n))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    return header, 8 + n


class SafetensorsReader:
    """Name -> lazily mapped tensor over every safetensors file of a checkpoint directory."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        index = self.directory / INDEX_NAME
        single = self.directory / SINGLE_NAME
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: malformed index ({e!r})") from None
            files = sorted(set(weight_map.values()))
        elif single.exists():
            files = [SINGLE_NAME]
        else:
            found = sorted(p.name for p in self.directory.glob("*.safetensors"))
            if not found:
                raise CheckpointError(f"{self.directory}: no safetensors weights found")
            files = found
        self._entries: dict[str, tuple[Path, dict, int]] = {}
        for name in files:
            path = self.directory / name
            if not path.exists():
                raise CheckpointError(f"{path}: listed in the index but missing")
            header, offset = _read_header(path)
            for key, meta in header.items():
                if key != "__metadata__":
                    self._entries[key] = (path, meta, offset)
        self._maps: dict[Path, np.memmap] = {}

    def keys(self) -> list[str]:
        return sorted(self._entries)

    def __iter__(self):
        return iter(self.keys())

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def file_of(self, name: str) -> Path:
        return self._entries[name][0]

    def get(self, name: str) -> np.ndarray:
        """A read-only view of tensor ``name`` in its stored dtype."""
        if name not in self._entries:
            raise CheckpointError(f"{self.directory}: tensor {name!r} is missing")
        path, meta, offset = self._entries[name]
        try:
            dtype = np.dtype(_DTYPES[meta["dtype"]])
            start, end = meta["data_offsets"]
            shape = tuple(meta["shape"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry") from None
        count = int(np.prod(shape)) if shape else 1
        if end - start != count * dtype.itemsize:
            raise CheckpointError(
                f"{path}: tensor {name!r} spans {end - start} bytes, expected "
                f"{count * dtype.itemsize} for {meta['dtype']}{list(shape)}"
            )
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        raw = self._maps[path][offset + start : offset + end]
        if raw.size != end - start:
            raise CheckpointError(f"{path}: tensor {name!r} runs past the end of the file")
        return raw.view(dtype).reshape(shape)
