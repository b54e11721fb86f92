"""Memory-mapped safetensors reading and writing with numpy (bf16 through ml_dtypes).

Reading maps the file and hands out zero-copy views, so a sharded load touches only the bytes each
device needs. The format: 8-byte little-endian header length, a JSON header of
{name: {dtype, shape, data_offsets}}, then the raw little-endian data.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterable

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class SafetensorsError(ValueError):
    """An unreadable or malformed safetensors file; the message names the file."""


class SafetensorsFile:
    """One mapped file: `names()`, `shape(name)`, and `get(name)` (a read-only numpy view)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        try:
            self._f = open(self.path, "rb")
            size = os.fstat(self._f.fileno()).st_size
            (n,) = struct.unpack("<Q", self._f.read(8))
            if n <= 0 or 8 + n > size:
                raise SafetensorsError(f"{self.path}: bad header length {n} (file is {size} bytes)")
            header = json.loads(self._f.read(n))
            self._mm = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        except SafetensorsError:
            raise
        except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SafetensorsError(f"{self.path}: not a readable safetensors file ({e})") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self._entries = header
        self._base = 8 + n
        for name, e in header.items():
            if e.get("dtype") not in _DTYPES:
                raise SafetensorsError(f"{self.path}: tensor {name!r} has unsupported dtype {e.get('dtype')}")
            begin, end = e["data_offsets"]
            want = int(np.prod(e["shape"], dtype=np.int64)) * _DTYPES[e["dtype"]].itemsize
            if end - begin != want or self._base + end > size:
                raise SafetensorsError(
                    f"{self.path}: tensor {name!r} is truncated or corrupt (offsets {begin}..{end}, "
                    f"file {size} bytes)")

    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        e = self._entries[name]
        begin, end = e["data_offsets"]
        dtype = _DTYPES[e["dtype"]]
        if end == begin:
            return np.zeros(e["shape"], dtype)
        arr = np.frombuffer(self._mm, dtype=dtype, count=(end - begin) // dtype.itemsize,
                            offset=self._base + begin)
        return arr.reshape(e["shape"])

    def close(self):
        # Views handed out keep the map alive; closing the file object is enough.
        self._f.close()


def save_file(tensors: Iterable[tuple[str, np.ndarray]], path: str | os.PathLike,
              metadata: dict[str, str] | None = None) -> None:
    """Writes (name, array) pairs; the file appears atomically (temp file, then rename)."""
    items = [(name, np.ascontiguousarray(arr)) for name, arr in tensors]
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, arr in items:
        if arr.dtype not in _NAMES:
            raise SafetensorsError(f"tensor {name!r}: dtype {arr.dtype} cannot be written to safetensors")
        header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = f"{os.fspath(path)}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, arr in items:
            f.write(memoryview(arr.reshape(-1).view(np.uint8)))
    os.replace(tmp, path)
