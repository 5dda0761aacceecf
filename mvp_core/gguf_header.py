"""Decoding a GGUF header: metadata and tensor table, from a buffer the caller provides.

Pure: the caller maps or reads the file; this only decodes bytes. Both the planner's
facts (orchestrator) and the stage engine (nodes) read headers through here, so they
agree on the format and neither pays for ``gguf.GGUFReader``, which decodes every
metadata array eagerly (the tokenizer's tens of thousands of strings: ~1.6 s for
SmolLM2 against ~20 ms here). Large arrays are skipped and kept as lazy references.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
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


class GGUFTruncated(GGUFError):
    """The bytes end inside the header: the file is cut short, or (a header read by parts,
    from a hub) more of it is needed."""


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
    offset: int  # absolute byte offset in the file (in its part, for a split model)
    part: int = 0  # which file of a split model holds it (0: the first, or the only one)

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
            raise GGUFTruncated("unexpected end of file in GGUF header")
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
            # A tokenizer's vocabulary and merges: hundreds of thousands of strings, so
            # one tight loop (a node reads them at every start; 25x faster than _need).
            buf, pos, size, unpack = self.buf, self.pos, self.size, _U64.unpack_from
            try:
                for _ in range(count):
                    pos += 8 + unpack(buf, pos)[0]
                    if pos > size:
                        break
            except struct.error:
                pos = size + 1
            if pos > size:
                raise GGUFTruncated("unexpected end of file in GGUF header")
            self.pos = pos
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
    """Decode an array that ``parse_header`` skipped, from the same buffer (a tokenizer's
    vocabulary, scores and merges: one pass each, without a call per item)."""
    if ref.item_type in _SCALARS:
        item = _SCALARS[ref.item_type]
        fmt = struct.Struct(f"<{ref.count}{item.format[-1]}")
        if ref.offset + fmt.size > len(buf):
            raise GGUFTruncated("unexpected end of file in GGUF header")
        return list(fmt.unpack_from(buf, ref.offset))
    if ref.item_type == _STRING:
        out: list[Any] = []
        pos, size, unpack = ref.offset, len(buf), _U64.unpack_from
        try:
            for _ in range(ref.count):
                n = unpack(buf, pos)[0]
                pos += 8
                if pos + n > size:
                    break
                out.append(str(buf[pos : pos + n], "utf-8", "replace"))
                pos += n
        except struct.error:
            pass
        if len(out) != ref.count:
            raise GGUFTruncated("unexpected end of file in GGUF header")
        return out
    dec = _Decoder(buf, ref.offset)
    return [dec.value(ref.item_type) for _ in range(ref.count)]


# ---- split models (llama.cpp's gguf-split: NAME-00001-of-00003.gguf ...) -----------------
# Every part is a GGUF file with the keys below; the model's metadata is in the first
# (the others carry only these), each tensor is in exactly one part, and llama.cpp finds
# the parts by name from the first part's path, as this does.
SPLIT_NO = "split.no"  # u16: this part's index, 0-based
SPLIT_COUNT = "split.count"  # u16: how many parts
SPLIT_TENSORS = "split.tensors.count"  # i32: tensors in all parts together
MAX_SPLIT_PARTS = 99_999  # the name has five digits
_SPLIT_NAME = re.compile(r"-([0-9]{5})-of-([0-9]{5})\.gguf$", re.ASCII)


def _int_key(header: GGUFHeader, key: str, source: str) -> int | None:
    value = header.metadata.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise GGUFError(f"{source}: {key} {value!r} is not an integer")
    return value


def split_of(header: GGUFHeader, source: str = "GGUF") -> tuple[int, int] | None:
    """(this part's index, the number of parts) of a part of a split model; None for a
    model in one file (no split keys, or a split of one)."""
    count = _int_key(header, SPLIT_COUNT, source)
    if count is None or count == 1:
        return None
    if not 1 < count <= MAX_SPLIT_PARTS:
        raise GGUFError(f"{source}: {SPLIT_COUNT} {count} is not 1..{MAX_SPLIT_PARTS}")
    no = _int_key(header, SPLIT_NO, source)
    if no is None or not 0 <= no < count:
        raise GGUFError(f"{source}: {SPLIT_NO} {no!r} is not a part of {count}")
    return no, count


def split_part_paths(first: str, count: int) -> list[str]:
    """The paths of a split model's ``count`` parts, from its first part's path (which must
    be named as gguf-split names it: NAME-00001-of-0000N.gguf)."""
    m = _SPLIT_NAME.search(first)
    if m is None or int(m.group(1)) != 1 or int(m.group(2)) != count:
        want = f"-00001-of-{count:05d}.gguf"
        raise GGUFError(
            f"{first} is the first of {count} parts of a split model, but its name does not "
            f"end in {want!r}, so the other parts cannot be found"
        )
    stem = first[: m.start()]
    return [f"{stem}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


def join_split(headers: Sequence[GGUFHeader], sources: Sequence[str]) -> GGUFHeader:
    """One header for a split model from its parts' headers, in order: the first part's
    metadata, every part's tensors (each with its ``part``). GGUFError naming the part
    where they do not belong together: a part out of place or of another split, a tensor
    in two parts, a tensor count other than the one the parts state."""
    count = len(headers)
    if count != len(sources) or count < 2:
        raise GGUFError(f"a split model needs its parts and their names, got {count}")
    stated = _int_key(headers[0], SPLIT_TENSORS, sources[0])
    tensors: dict[str, TensorInfo] = {}
    for index, (header, source) in enumerate(zip(headers, sources, strict=True)):
        where = split_of(header, source)
        if where != (index, count):
            got = "no split keys" if where is None else f"part {where[0] + 1} of {where[1]}"
            raise GGUFError(f"{source}: expected part {index + 1} of {count}, it says {got}")
        if _int_key(header, SPLIT_TENSORS, source) != stated:
            raise GGUFError(
                f"{source}: {SPLIT_TENSORS} differs from the first part's ({stated}): "
                "a part of another split"
            )
        for name, info in header.tensors.items():
            if name in tensors:
                other = sources[tensors[name].part]
                raise GGUFError(f"tensor {name} is in two parts: {other} and {source}")
            tensors[name] = replace(info, part=index)
    if stated is not None and stated != len(tensors):
        raise GGUFError(
            f"{sources[0]}: the parts hold {len(tensors)} tensors, {SPLIT_TENSORS} says {stated}"
        )
    head = headers[0]
    return GGUFHeader(head.version, head.metadata, tensors, head.data_start)
