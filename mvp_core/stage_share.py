"""Which bytes of a model's files one stage needs: each file's header and its own tensors.

Pure: from a (joined) GGUF header and each file's header length. A stage holds the
tensors of its layers (``blk.<i>.*``); the first stage the token embedding; the last the
output norm and head (the embedding, where the head is tied to it); every stage the
other tensors outside the layers (Llama 3's ``rope_freqs``: a few hundred bytes). That
is what the engine's loader reads (workers/node/engine: ``load_stage``), so a node that
fetched only its share can load its stage.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from mvp_core.gguf_header import GGUFHeader, TensorInfo
from mvp_core.models import ByteRange

EMBEDDING = "token_embd.weight"
OUTPUT = "output.weight"
OUTPUT_NORM = "output_norm.weight"
# Gaps up to this many bytes between two ranges are fetched rather than split into two
# requests (tensors are aligned, usually to 32 bytes: their padding lies between them).
MERGE_GAP = 4096
_LAYER = re.compile(r"blk\.([0-9]{1,6})\..+", re.ASCII)


def stage_tensors(
    header: GGUFHeader, start: int, end: int, *, first: bool, last: bool
) -> list[TensorInfo]:
    """The tensors of a stage holding layers ``[start, end)``, in file order."""
    tied = OUTPUT not in header.tensors
    wanted: list[TensorInfo] = []
    for name, info in header.tensors.items():
        m = _LAYER.fullmatch(name)
        if m is not None:
            keep = start <= int(m.group(1)) < end
        elif name == EMBEDDING:
            keep = first or (last and tied)
        elif name in (OUTPUT, OUTPUT_NORM):
            keep = last
        else:
            keep = True
        if keep:
            wanted.append(info)
    return sorted(wanted, key=lambda t: (t.part, t.offset))


def share_ranges(
    header: GGUFHeader,
    header_bytes: Sequence[int],
    start: int,
    end: int,
    *,
    first: bool,
    last: bool,
) -> list[ByteRange]:
    """The byte ranges a stage's node fetches: every file's header (``header_bytes[i]``:
    the bytes before file ``i``'s tensor data) and its tensors, merged where they touch
    (or lie within MERGE_GAP of each other), in file order. ValueError where the table
    names a part that is not there (an untrusted file: planning refuses it)."""
    spans: list[tuple[int, int, int]] = [(i, 0, n) for i, n in enumerate(header_bytes)]
    for t in stage_tensors(header, start, end, first=first, last=last):
        if not 0 <= t.part < len(header_bytes):
            raise ValueError(f"tensor {t.name} is in part {t.part + 1}, which the model lacks")
        if t.n_bytes:
            spans.append((t.part, t.offset, t.offset + t.n_bytes))
    spans.sort()
    merged: list[list[int]] = []
    for part, lo, hi in spans:
        if merged and merged[-1][0] == part and lo <= merged[-1][2] + MERGE_GAP:
            merged[-1][2] = max(merged[-1][2], hi)
        else:
            merged.append([part, lo, hi])
    return [ByteRange(part=p, start=lo, end=hi) for p, lo, hi in merged]
