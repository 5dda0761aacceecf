"""A small, lazy GGUF reader.

Why not ``gguf.GGUFReader``: it decodes every metadata array eagerly (the tokenizer's
tens of thousands of strings) and builds numpy views for every tensor, which costs more
than loading a small model's weights. This reader parses the header once, skips large
arrays without decoding them, memory-maps the file and hands out numpy views of single
tensors on demand, recording each tensor it materialises (so a stage can prove it never
touched another stage's weights).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# Arrays longer than this are kept as lazy references instead of Python lists.
_EAGER_ARRAY_LIMIT = 4096

# Value types of GGUF metadata.
_SCALAR_FORMATS: dict[int, str] = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING = 8
_ARRAY = 9

# ggml tensor types: (name, block size in elements, bytes per block).
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    30: ("BF16", 1, 2),
}


class GGUFError(ValueError):
    """The file is not a GGUF this reader understands."""


@dataclass(frozen=True)
class LazyArray:
    """A metadata array too large to decode up front (e.g. the tokenizer vocabulary)."""

    item_type: int
    count: int
    offset: int


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lives in the file. ``shape`` is numpy order (rows first)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # absolute byte offset in the file

    @property
    def type_name(self) -> str:
        return (
            GGML_TYPES[self.ggml_type][0] if self.ggml_type in GGML_TYPES else str(self.ggml_type)
        )

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def n_bytes(self) -> int:
        if self.ggml_type not in GGML_TYPES:
            raise GGUFError(f"tensor {self.name}: unsupported ggml type {self.ggml_type}")
        _, block, size = GGML_TYPES[self.ggml_type]
        return self.n_elements // block * size


class _Cursor:
    """Sequential little-endian reads from a file object, buffered by the OS."""

    def __init__(self, fh: BinaryIO) -> None:
        self.fh = fh

    def read(self, n: int) -> bytes:
        data = self.fh.read(n)
        if len(data) != n:
            raise GGUFError("unexpected end of file in GGUF header")
        return data

    def u32(self) -> int:
        return int(struct.unpack("<I", self.read(4))[0])

    def u64(self) -> int:
        return int(struct.unpack("<Q", self.read(8))[0])

    def string(self) -> str:
        return self.read(self.u64()).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALAR_FORMATS:
            fmt = _SCALAR_FORMATS[vtype]
            return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type = self.u32()
            count = self.u64()
            start = self.fh.tell()
            if count > _EAGER_ARRAY_LIMIT:
                self.skip_array(item_type, count)
                return LazyArray(item_type, count, start)
            return [self.value(item_type) for _ in range(count)]
        raise GGUFError(f"unknown GGUF metadata type {vtype}")

    def skip_array(self, item_type: int, count: int) -> None:
        if item_type in _SCALAR_FORMATS:
            self.fh.seek(count * struct.calcsize(_SCALAR_FORMATS[item_type]), 1)
        elif item_type == _STRING:
            for _ in range(count):
                self.fh.seek(self.u64(), 1)
        else:
            for _ in range(count):
                self.value(item_type)


class GGUFFile:
    """Metadata plus lazily materialised tensor views of one GGUF file."""

    def __init__(self, path: str, *, map_tensors: bool = True) -> None:
        self.path = path
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self.materialized: set[str] = set()
        self._mmap: mmap.mmap | None = None
        with open(path, "rb") as fh:
            self._parse(_Cursor(fh))
            if map_tensors:
                self._mmap = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)

    def _parse(self, cur: _Cursor) -> None:
        if cur.read(4) != GGUF_MAGIC:
            raise GGUFError(f"{self.path} is not a GGUF file")
        version = cur.u32()
        if version not in (2, 3):
            raise GGUFError(f"{self.path}: unsupported GGUF version {version}")
        n_tensors = cur.u64()
        n_kv = cur.u64()
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.u32())
        raw: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.u32()
            dims = tuple(cur.u64() for _ in range(n_dims))
            ggml_type = cur.u32()
            rel = cur.u64()
            raw.append((name, tuple(reversed(dims)), ggml_type, rel))
        align = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        pos = cur.fh.tell()
        data_start = (pos + align - 1) // align * align
        for name, shape, ggml_type, rel in raw:
            self.tensors[name] = TensorInfo(name, shape, ggml_type, data_start + rel)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def arch_key(self, suffix: str, default: Any = None) -> Any:
        """``{arch}.{suffix}`` from the metadata."""
        return self.metadata.get(f"{self.architecture}.{suffix}", default)

    def raw(self, name: str) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """The tensor's bytes as a read-only uint8 view of the mapping (no copy)."""
        if self._mmap is None:
            raise GGUFError(f"{self.path} was opened for metadata only")
        info = self.tensors[name]
        self.materialized.add(name)
        return np.frombuffer(self._mmap, dtype=np.uint8, count=info.n_bytes, offset=info.offset)

    def release_pages(self) -> None:
        """Drop the mapped pages we touched from this process's RSS (they stay in page cache)."""
        if self._mmap is not None and hasattr(mmap, "MADV_DONTNEED"):
            try:
                self._mmap.madvise(mmap.MADV_DONTNEED)
            except OSError:
                pass

    def close(self) -> None:
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                # A view still references the mapping; it is closed when collected.
                pass
            self._mmap = None


def read_lazy_array(path: str, ref: LazyArray) -> list[Any]:
    """Decode a lazily skipped metadata array (for callers that need it)."""
    with open(path, "rb") as fh:
        fh.seek(ref.offset)
        cur = _Cursor(fh)
        return [cur.value(ref.item_type) for _ in range(ref.count)]
