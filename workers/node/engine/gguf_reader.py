"""A small, lazy GGUF file: the header decoded once, tensors handed out as views.

The header is decoded by ``mvp_core.gguf_header`` (shared with the planner). The file is
memory-mapped; ``raw`` gives numpy views of single tensors on demand and records each
tensor it materialises, so a stage can prove it never touched another stage's weights.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
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
from mvp_io.gguf_files import close_mapping, map_file, open_model

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


class GGUFFile:
    """Metadata plus lazily materialised tensor views of one GGUF model: one file, or the
    parts of a split model (``path`` its first part), each tensor read from its part."""

    def __init__(self, path: str, *, map_tensors: bool = True) -> None:
        self.path = path
        self.materialized: set[str] = set()
        # Told the name of each tensor a loader takes up (``raw``, the loader's look-up):
        # a stage's load progress (DECISIONS 93). None: nothing to tell.
        self.on_tensor: Callable[[str], None] | None = None
        files = open_model(path)
        self.header = files.header
        self.paths = files.paths
        # The mapped files' identity on this host (the layout cache's key: the files
        # read, whatever their paths name by the time the key is made).
        self.identities = list(files.identities)
        self.metadata: dict[str, Any] = files.header.metadata
        self.tensors: dict[str, TensorInfo] = files.header.tensors
        self._maps: list[mmap.mmap] = []
        if map_tensors and all(isinstance(b, mmap.mmap) for b in files.mappings):
            self._maps = [b for b in files.mappings if isinstance(b, mmap.mmap)]
        else:
            files.close()

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
        if not self._maps:
            raise GGUFError(f"{self.path} was opened for metadata only")
        info = self.tensors[name]
        buf = self._maps[info.part]
        if info.offset + info.n_bytes > len(buf):
            raise GGUFError(
                f"{self.paths[info.part]}: tensor {name} extends past the end of the file"
            )
        self.materialized.add(name)
        if self.on_tensor is not None:
            self.on_tensor(name)
        return np.frombuffer(buf, dtype=np.uint8, count=info.n_bytes, offset=info.offset)

    def release_range(self, name: str, start: int, length: int) -> None:
        """Drop bytes ``[start, start + length)`` of a tensor's mapped pages from this
        process's RSS once converted (they stay in the page cache; a later read maps them
        again): a load holds the file's pages of one chunk at a time."""
        if not self._maps or not hasattr(mmap, "MADV_DONTNEED"):
            return
        info = self.tensors[name]
        buf = self._maps[info.part]
        page = mmap.PAGESIZE
        begin = info.offset + start
        start = begin // page * page
        end = min(len(buf), begin + length)
        if end > start:
            try:
                buf.madvise(mmap.MADV_DONTNEED, start, end - start)
            except (OSError, ValueError):
                pass

    def release_pages(self) -> None:
        """Drop the mapped pages we touched from this process's RSS (they stay in page cache)."""
        if hasattr(mmap, "MADV_DONTNEED"):
            for buf in self._maps:
                try:
                    buf.madvise(mmap.MADV_DONTNEED)
                except OSError:
                    pass

    def close(self) -> None:
        for buf in self._maps:
            close_mapping(buf)
        self._maps = []


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
        close_mapping(buf)
