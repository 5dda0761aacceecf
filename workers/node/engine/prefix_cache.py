"""A stage's cache of recent prompts' prefixes: their KV (and output rows), reused by a
prompt that starts the same way, so that it prefills only the rest (DECISIONS 91).

Blocks of ``BLOCK`` positions, each keyed by a chained BLAKE2b digest of the prefix's
keys up to its end (``digest_b = H(digest_{b-1} || keys of block b)``), so a block stands
for its whole prefix. A stage's keys per position are what determines its rows there: the
token ids on the first stage, the input rows' bytes on a later one (which receives rows,
not ids). A hit walks the blocks from position 0 and checks each one's parent digest and,
where the cache keeps them (token ids: 4 bytes a position), the keys themselves.

Per block: k and v [layers, n_kv_head, BLOCK, head_dim] as the session's cache holds them
(kv_dtype) and, on a stage that hands rows on, the stage's output rows [BLOCK, hidden]
float32 (what the next stage needs from it to compute what its own cache lacks). Bounded
by ``budget_bytes``; least recently used blocks go first, the tails of a prefix before
its head (a hit or a store touches a prefix's blocks last to first).

Exactness (the text with reuse is the text without, bit for bit). The engine's kernel
gives a row the sums its own sequence's product of T rows gives it: on Q4_K/Q5_K/Q6_K a
row's sums depend on T through two row kinds only (native.segment_kinds: PER64 for a row
in the product's whole fours, TILED where T >= 8; none on the other formats). Every
position of a cached prefix was computed with both kinds, and so it would be in the
prompt that reuses it: ``reuse_bounds`` keeps the part that prompt still computes at 8 or
more rows (one chunk) or on its own chunk boundaries (chunked), and stores only positions
computed in a chunk of 8 or more rows (lengths multiples of 4: BLOCK is). The torch
kernels (no native layers: other CPUs' fallback, the "exact" and "float32" precisions,
CUDA) promise no such thing for a row's sums, so a stage without the native layers keeps
no prefixes (``supported``).
"""

from __future__ import annotations

import hashlib
import math
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

BLOCK = 16  # positions per block: a multiple of 4 and >= 8 (the row kinds, above)
MIN_SUFFIX = 8  # rows a one-chunk prompt still computes after a reused prefix (TILED)
ENV_MB = "MVP_PREFIX_CACHE_MB"  # a stage's cap in MiB (0: off); unset: default_budget
DEFAULT_FLOOR = 64 << 20  # bytes: SmolLM2's 2800 positions, a Llama 3 8B's 512
_DIGEST = 32  # bytes of BLAKE2b: the key of a block whose keys are not kept (rows)


def supported(model: Any) -> bool:
    """Whether a stage's rows are computed by the native layers, whose sums for a row
    depend on its product's row count only through the row kinds (module docstring)."""
    native_layers = getattr(model, "_native_layers", None)
    return native_layers is not None and native_layers() is not None


def default_budget(kv_bytes: int) -> int:
    """A tenth of the session's KV cache (what the memory plan's 10% margin adds for it,
    mvp_core.memory_plan), and at least DEFAULT_FLOOR (a small run's context is small)."""
    return max(kv_bytes // 10, DEFAULT_FLOOR)


def budget_from_env(default: int, environ: dict[str, str] | None = None) -> int:
    """``MVP_PREFIX_CACHE_MB`` where set (0 turns the cache off), else ``default``."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV_MB, "").strip()
    if not raw:
        return default
    try:
        mb = float(raw)
    except ValueError:
        raise ValueError(f"{ENV_MB}={raw!r} is not a number of MiB") from None
    if mb < 0 or not math.isfinite(mb):
        raise ValueError(f"{ENV_MB}={raw!r} must be a finite number >= 0")
    return int(mb * 2**20)


def ids_bytes(ids: Sequence[int]) -> bytes:
    """A first stage's keys: the token ids as u32 (as token-in carries them)."""
    return np.asarray(ids, dtype="<u4").tobytes()


def reuse_bounds(n: int, chunk: int | None) -> tuple[int, int, int]:
    """For a prompt of ``n`` positions fed in chunks of ``chunk`` (None: one chunk):
    (the longest prefix it may reuse, what that length must be a multiple of, the
    positions it may store)."""
    if chunk is None or chunk >= n:
        return n - MIN_SUFFIX, 1, n
    full = chunk >= MIN_SUFFIX and chunk % 4 == 0  # a whole chunk's rows: both kinds
    return n - 1, chunk, (n // chunk * chunk if full else 0)


@dataclass
class PrefixStats:
    """What a stage's prefix cache holds and did (its stage's stats report them)."""

    budget_bytes: int = 0
    used_bytes: int = 0
    blocks: int = 0
    lookups: int = 0
    hits: int = 0
    reused_tokens: int = 0
    stored_blocks: int = 0
    evicted_blocks: int = 0


@dataclass(eq=False)
class _Block:
    parent: bytes
    keys: bytes | None  # the block's keys, where kept (token ids)
    k: torch.Tensor  # [layers, nkv, BLOCK, hd]
    v: torch.Tensor
    rows: torch.Tensor | None  # [BLOCK, hidden] float32, the stage's output rows
    nbytes: int


def _tensor_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class PrefixCache:
    """One stage's prefixes (one thread's: its session's). ``keep_keys``: keep each
    block's keys to check on a hit (token ids; rows are checked by their digest)."""

    def __init__(self, budget_bytes: int, *, keep_keys: bool, block: int = BLOCK) -> None:
        if block < MIN_SUFFIX or block % 4:
            raise ValueError(f"prefix block {block} must be a multiple of 4 and >= {MIN_SUFFIX}")
        self.block = block
        self.keep_keys = keep_keys
        self.stats = PrefixStats(budget_bytes=max(0, budget_bytes))
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()  # least recent first

    def chain(self, keys: bytes | memoryview, width: int) -> list[bytes]:
        """The digest of every whole block of ``keys`` (``width`` bytes a position)."""
        size = self.block * width
        view = memoryview(keys).cast("B")
        out: list[bytes] = []
        prev = b""
        for b in range(len(view) // size):
            h = hashlib.blake2b(prev, digest_size=_DIGEST)
            h.update(view[b * size : (b + 1) * size])
            prev = h.digest()
            out.append(prev)
        return out

    def match(
        self, digests: Sequence[bytes], keys: bytes | memoryview, width: int, limit: int,
        multiple: int = 1,
    ) -> int:  # fmt: skip
        """The longest cached prefix's length: a multiple of the block and of
        ``multiple``, at most ``limit``; every block's parent and kept keys checked."""
        if self.stats.budget_bytes <= 0:
            return 0
        self.stats.lookups += 1
        view = memoryview(keys).cast("B")
        size, found, parent = self.block * width, 0, b""
        for b, d in enumerate(digests):
            if (b + 1) * self.block > limit:
                break
            blk = self._blocks.get(d)
            if blk is None or blk.parent != parent:
                break
            if blk.keys is not None and blk.keys != view[b * size : (b + 1) * size]:
                break
            found, parent = b + 1, d
        step = self.block * multiple // math.gcd(self.block, multiple)
        return found * self.block // step * step

    def load(
        self, digests: Sequence[bytes], length: int, k_slot: torch.Tensor, v_slot: torch.Tensor
    ) -> torch.Tensor | None:
        """Copy the first ``length`` positions (a ``match``) into a slot's caches
        [layers, nkv, max_seq, hd]; their output rows [length, hidden] where kept."""
        blocks = [self._blocks[d] for d in digests[: length // self.block]]
        for b, blk in enumerate(blocks):
            p = b * self.block
            k_slot[:, :, p : p + self.block] = blk.k
            v_slot[:, :, p : p + self.block] = blk.v
        self._touch(digests[: len(blocks)])
        self.stats.hits += 1
        self.stats.reused_tokens += length
        if any(blk.rows is None for blk in blocks):
            return None
        return torch.cat([blk.rows for blk in blocks if blk.rows is not None])

    def store(
        self, digests: Sequence[bytes], keys: bytes | memoryview, width: int, upto: int,
        k_slot: torch.Tensor, v_slot: torch.Tensor, rows: torch.Tensor | None,
    ) -> None:  # fmt: skip
        """Keep the whole blocks of the first ``upto`` positions of a slot (its caches
        hold them), with their output ``rows`` [>= upto, hidden] where given; then evict
        down to the budget."""
        if self.stats.budget_bytes <= 0:
            return
        view = memoryview(keys).cast("B")
        n = min(upto // self.block, len(digests))
        size, parent = self.block * width, b""
        for b, d in enumerate(digests[:n]):
            if d not in self._blocks:
                p = b * self.block
                k = k_slot[:, :, p : p + self.block].clone()
                v = v_slot[:, :, p : p + self.block].clone()
                r = None if rows is None else rows[p : p + self.block].to(torch.float32).clone()
                kept = bytes(view[b * size : (b + 1) * size]) if self.keep_keys else None
                nbytes = _tensor_bytes(k) + _tensor_bytes(v) + _tensor_bytes(r) + len(kept or b"")
                self._blocks[d] = _Block(parent, kept, k, v, r, nbytes)
                self.stats.used_bytes += nbytes
                self.stats.stored_blocks += 1
            parent = d
        self._touch(digests[:n])
        while self.stats.used_bytes > self.stats.budget_bytes and self._blocks:
            _, old = self._blocks.popitem(last=False)
            self.stats.used_bytes -= old.nbytes
            self.stats.evicted_blocks += 1
        self.stats.blocks = len(self._blocks)

    def _touch(self, digests: Sequence[bytes]) -> None:
        """Most recent: a prefix's first block; its tails go before it."""
        for d in reversed(digests):
            if d in self._blocks:
                self._blocks.move_to_end(d)

    def clear(self) -> None:
        self._blocks.clear()
        self.stats.used_bytes = 0
        self.stats.blocks = 0
