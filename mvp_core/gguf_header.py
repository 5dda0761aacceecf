"""Decoding a GGUF header: metadata and tensor table, from a buffer the caller provides.

Pure: the caller maps or reads the file; this only decodes bytes. Both the planner's
facts (orchestrator) and the stage engine (nodes) read headers through here, so they
agree on the format and neither pays for ``gguf.GGUFReader``, which decodes every
metadata array eagerly (the tokenizer's tens of thousands of strings: ~1.6 s for
SmolLM2 against ~20 ms here). Large arrays are skipped and kept as lazy references.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# Arrays longer than this are kept as lazy references instead of Python lists.
EAGER_ARRAY_LIMIT = 4096

# Value types of GGUF metadata (ids from gguf.constants): scalar struct formats, then
# string and array.
_V = GGUFValueType
_SCALARS: dict[int, struct.Struct] = {
    int(t): struct.Struct(f)
    for t, f in {
        _V.UINT8: "<B",
        _V.INT8: "<b",
        _V.UINT16: "<H",
        _V.INT16: "<h",
        _V.UINT32: "<I",
        _V.INT32: "<i",
        _V.FLOAT32: "<f",
        _V.BOOL: "<?",
        _V.UINT64: "<Q",
        _V.INT64: "<q",
        _V.FLOAT64: "<d",
    }.items()
}
_STRING = int(_V.STRING)
_ARRAY = int(_V.ARRAY)
_U32 = _SCALARS[_V.UINT32]
_U64 = _SCALARS[_V.UINT64]

# ggml tensor types: (name, block size in elements, bytes per block), from gguf.constants.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    int(t): (t.name, *GGML_QUANT_SIZES[t]) for t in GGMLQuantizationType if t in GGML_QUANT_SIZES
}


class GGUFError(ValueError):
    """The bytes are not a GGUF header this decoder understands."""


@dataclass(frozen=True)
class LazyArray:
    """A metadata array too large to decode up front (e.g. the tokenizer vocabulary):
    its item type, length and the offset of its first item in the file."""

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


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    data_start: int = 0  # absolute offset of the tensor data section


class _Decoder:
    """Little-endian reads at a moving offset of a buffer (an mmap, bytes, memoryview)."""

    def __init__(self, buf: Any, pos: int = 0) -> None:
        self.buf = buf
        self.size = len(buf)
        self.pos = pos

    def _need(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > self.size:
            raise GGUFError("unexpected end of file in GGUF header")
        self.pos = start + n
        return start

    def scalar(self, s: struct.Struct) -> Any:
        return s.unpack_from(self.buf, self._need(s.size))[0]

    def u32(self) -> int:
        return int(self.scalar(_U32))

    def u64(self) -> int:
        return int(self.scalar(_U64))

    def string(self) -> str:
        n = self.u64()
        start = self._need(n)
        return bytes(self.buf[start : start + n]).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type = self.u32()
            count = self.u64()
            start = self.pos
            if count > EAGER_ARRAY_LIMIT:
                self.skip_array(item_type, count)
                return LazyArray(item_type, count, start)
            return [self.value(item_type) for _ in range(count)]
        raise GGUFError(f"unknown GGUF metadata type {vtype}")

    def skip_array(self, item_type: int, count: int) -> None:
        if item_type in _SCALARS:
            self._need(count * _SCALARS[item_type].size)
        elif item_type == _STRING:
            for _ in range(count):
                self._need(self.u64())
        else:
            for _ in range(count):
                self.value(item_type)


def parse_header(buf: Any, source: str = "GGUF") -> GGUFHeader:
    """Decode the header at the start of ``buf`` (the whole file, or at least its header).

    ``source`` (usually the path) prefixes the errors that name the file.
    """
    dec = _Decoder(buf)
    if len(buf) < 4 or bytes(buf[:4]) != GGUF_MAGIC:
        raise GGUFError(f"{source} is not a GGUF file")
    dec.pos = 4
    version = dec.u32()
    if version not in (2, 3):
        raise GGUFError(f"{source}: unsupported GGUF version {version}")
    n_tensors = dec.u64()
    n_kv = dec.u64()
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = dec.string()
        metadata[key] = dec.value(dec.u32())
    raw: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(n_tensors):
        name = dec.string()
        n_dims = dec.u32()
        dims = tuple(dec.u64() for _ in range(n_dims))
        ggml_type = dec.u32()
        rel = dec.u64()
        raw.append((name, tuple(reversed(dims)), ggml_type, rel))
    align = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or isinstance(align, bool) or align <= 0:
        raise GGUFError(f"{source}: general.alignment {align!r} is not a positive integer")
    data_start = (dec.pos + align - 1) // align * align
    tensors = {
        name: TensorInfo(name, shape, ggml_type, data_start + rel)
        for name, shape, ggml_type, rel in raw
    }
    return GGUFHeader(version, metadata, tensors, data_start)


def decode_array(buf: Any, ref: LazyArray) -> list[Any]:
    """Decode an array that ``parse_header`` skipped, from the same buffer."""
    dec = _Decoder(buf, ref.offset)
    return [dec.value(ref.item_type) for _ in range(ref.count)]
