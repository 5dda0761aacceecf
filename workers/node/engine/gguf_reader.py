"""A small, lazy GGUF file: the header decoded once, tensors handed out as views.

The header is decoded by ``mvp_core.gguf_header`` (shared with the planner). The file is
memory-mapped; ``raw`` gives numpy views of single tensors on demand and records each
tensor it materialises, so a stage can prove it never touched another stage's weights.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

import numpy as np
from gguf.constants import Keys

from mvp_core.gguf_header import (
    DEFAULT_ALIGNMENT,
    GGML_TYPES,
    GGUF_MAGIC,
    GGUFError,
    LazyArray,
    TensorInfo,
    decode_array,
    parse_header,
)

__all__ = [
    "DEFAULT_ALIGNMENT",
    "GGML_TYPES",
    "GGUF_MAGIC",
    "GGUFError",
    "GGUFFile",
    "LazyArray",
    "TensorInfo",
    "map_file",
    "read_metadata",
]


def map_file(path: str) -> mmap.mmap | bytes:
    """The file read-only and memory-mapped (b"" when it is empty: mmap refuses those)."""
    with open(path, "rb") as fh:
        if os.fstat(fh.fileno()).st_size == 0:
            return b""
        return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)


class GGUFFile:
    """Metadata plus lazily materialised tensor views of one GGUF file."""

    def __init__(self, path: str, *, map_tensors: bool = True) -> None:
        self.path = path
        self.materialized: set[str] = set()
        self._mmap: mmap.mmap | None = None
        buf = map_file(path)
        try:
            header = parse_header(buf, path)
        except BaseException:
            _close(buf)
            raise
        self.metadata: dict[str, Any] = header.metadata
        self.tensors: dict[str, TensorInfo] = header.tensors
        if map_tensors and isinstance(buf, mmap.mmap):
            self._mmap = buf
        else:
            _close(buf)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get(Keys.General.ARCHITECTURE, ""))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def arch_key(self, key: str, default: Any = None) -> Any:
        """An architecture's key from the metadata: ``key`` is a gguf.constants.Keys
        template such as ``Keys.LLM.BLOCK_COUNT`` ("{arch}.block_count")."""
        return self.metadata.get(key.format(arch=self.architecture), default)

    def raw(self, name: str) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """The tensor's bytes as a read-only uint8 view of the mapping (no copy)."""
        if self._mmap is None:
            raise GGUFError(f"{self.path} was opened for metadata only")
        info = self.tensors[name]
        if info.offset + info.n_bytes > len(self._mmap):
            raise GGUFError(f"{self.path}: tensor {name} extends past the end of the file")
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
            _close(self._mmap)
            self._mmap = None


def _close(buf: mmap.mmap | bytes) -> None:
    if isinstance(buf, mmap.mmap):
        try:
            buf.close()
        except BufferError:
            # A view still references the mapping; it is closed when collected.
            pass


def read_metadata(path: str, prefix: str = "") -> dict[str, Any]:
    """The metadata keys that start with ``prefix``, large arrays decoded too, from one
    mapping of the file (the tokenizer's vocabulary, merges and token types)."""
    buf = map_file(path)
    try:
        return {
            key: decode_array(buf, value) if isinstance(value, LazyArray) else value
            for key, value in parse_header(buf, path).metadata.items()
            if key.startswith(prefix)
        }
    finally:
        _close(buf)
