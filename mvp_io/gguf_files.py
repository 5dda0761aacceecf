"""A GGUF model's files opened as one model: a single file, or the parts of a split model.

A split model (llama.cpp's ``gguf-split``: ``NAME-00001-of-00003.gguf`` ...) is named by
its first part's path, as llama.cpp takes it; the other parts are found beside it by name
and checked against the first (``mvp_core.gguf_header.join_split``). Every file is
memory-mapped read-only, so opening one reads only its header's pages: the planner's
facts, the tokenizer and the stage engine all open models through here.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field

from mvp_core.gguf_header import (
    GGUFError,
    GGUFHeader,
    join_split,
    parse_header,
    split_of,
    split_part_paths,
)

Mapping = mmap.mmap | bytes


# What identifies a file on its host as it was mapped: device, inode, size and
# modification time (ns) of the open file itself, not of whatever its path names later.
Identity = tuple[int, int, int, int]


def _map(path: str) -> tuple[Mapping, Identity]:
    with open(path, "rb") as fh:
        st = os.fstat(fh.fileno())
        identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if st.st_size == 0:
            return b"", identity
        return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ), identity


def map_file(path: str) -> Mapping:
    """The file read-only and memory-mapped (b"" when it is empty: mmap refuses those)."""
    return _map(path)[0]


def close_mapping(buf: Mapping) -> None:
    if isinstance(buf, mmap.mmap):
        try:
            buf.close()
        except BufferError:
            # A view still references the mapping; it is closed when collected.
            pass


@dataclass
class ModelFiles:
    """A model's header (a split model's joined: each tensor names its ``part``), its
    files in part order and their mappings (index = ``TensorInfo.part``)."""

    header: GGUFHeader
    paths: list[str]
    mappings: list[Mapping] = field(default_factory=list)
    identities: list[Identity] = field(default_factory=list)  # of the files mapped

    def close(self) -> None:
        for buf in self.mappings:
            close_mapping(buf)
        self.mappings = []

    def __enter__(self) -> ModelFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_model(path: str) -> ModelFiles:
    """The model whose (first) file is ``path``, every file mapped; GGUFError (or OSError)
    naming the file at fault: not a GGUF file, a later part given instead of the first, a
    part missing, or parts that do not belong together."""
    first, identity = _map(path)
    mappings, identities = [first], [identity]
    try:
        header = parse_header(first, path)
        where = split_of(header, path)
        if where is None:
            return ModelFiles(header, [path], mappings, identities)
        no, count = where
        if no != 0:
            raise GGUFError(
                f"{path} is part {no + 1} of {count} of a split model: give the first part "
                f"(its name ends in -00001-of-{count:05d}.gguf)"
            )
        paths = split_part_paths(path, count)
        headers = [header]
        for index, part in enumerate(paths[1:], start=2):
            if not os.path.isfile(part):
                raise GGUFError(f"split part {index} of {count} is missing: {part}")
            buf, identity = _map(part)
            mappings.append(buf)
            identities.append(identity)
            headers.append(parse_header(buf, part))
        return ModelFiles(join_split(headers, paths), paths, mappings, identities)
    except BaseException:
        for buf in mappings:
            close_mapping(buf)
        raise
