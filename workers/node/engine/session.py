"""Per-request state of a stage: the KV cache and the next position."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Protocol, cast

import torch

from .config import ArchConfig
from .models import StageModel
from .prefix_cache import PrefixCache, budget_from_env, default_budget, supported


class _Embedding(Protocol):
    def __call__(self, ids: torch.Tensor) -> torch.Tensor: ...


class SessionStage(Protocol):
    """What a session reads of its stage (``stage.Stage``; this module does not import
    it, so the stage can make sessions without an import cycle)."""

    @property
    def cfg(self) -> ArchConfig: ...
    @property
    def layer_start(self) -> int: ...
    @property
    def layer_end(self) -> int: ...
    @property
    def is_first(self) -> bool: ...
    @property
    def is_last(self) -> bool: ...
    @property
    def model(self) -> StageModel[Any]: ...
    @property
    def embedding(self) -> _Embedding | None: ...
    @property
    def torch_device(self) -> torch.device: ...


def kv_dtype(attention_f16: bool) -> torch.dtype:
    """The KV cache's element type: float16 (llama.cpp's default cache type, half of
    float32's memory) where attention rounds keys and values to float16 anyway (the
    default precision); float32 for the "exact" and "float32" precisions, which do not."""
    return torch.float16 if attention_f16 else torch.float32


def _kv_caches(
    stage: SessionStage, max_seq_len: int, *slots: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed k and v caches [*slots, layers, n_kv_head, max_seq_len, head_dim] for the
    stage's layers (``kv_dtype``), ``max_seq_len`` checked against the model's context
    length; the model's rope tables grown to it."""
    if max_seq_len <= 0:
        raise ValueError("max_seq_len must be positive")
    cfg = stage.cfg
    if cfg.context_length and max_seq_len > cfg.context_length:
        raise ValueError(
            f"max_seq_len {max_seq_len} exceeds the model's context length {cfg.context_length}"
        )
    n = stage.layer_end - stage.layer_start
    shape = (*slots, n, cfg.n_kv_head, max_seq_len, cfg.head_dim)
    dev = stage.torch_device
    dtype = kv_dtype(stage.model.attention_f16)
    k = torch.zeros(shape, dtype=dtype, device=dev)
    v = torch.zeros(shape, dtype=dtype, device=dev)
    stage.model.ensure_positions(max_seq_len)
    return k, v


class ContextOverflow(Exception):
    """The tokens do not fit in the session's ``max_seq_len``."""


class NoFreeSlot(Exception):
    """Every slot of a BatchSession holds a sequence."""


class StageSession:
    """KV cache preallocated for ``max_seq_len`` positions of the stage's layers.

    Feed a prompt in one call (batched prefill), then one token per call. ``reset``
    starts a new prompt; ``close`` frees the cache.
    """

    def __init__(self, stage: SessionStage, max_seq_len: int) -> None:
        k, v = _kv_caches(stage, max_seq_len)
        self.stage = stage
        self.max_seq_len = max_seq_len
        self.position = 0
        self._k: torch.Tensor | None = k
        self._v: torch.Tensor | None = v

    def _check(self, t: int) -> None:
        if self._k is None:
            raise RuntimeError("session is closed")
        if t <= 0:
            raise ValueError("no tokens to process")
        if self.position + t > self.max_seq_len:
            raise ContextOverflow(
                f"{t} tokens at position {self.position} exceed max_seq_len {self.max_seq_len}"
            )

    def _run(self, h: torch.Tensor) -> torch.Tensor:
        assert self._k is not None and self._v is not None
        stage = self.stage
        h = stage.model.forward(h, self._k, self._v, self.position)
        self.position += h.shape[0]
        if stage.is_last:
            return stage.model.logits(h[-1]).cpu()
        return h

    def forward_tokens(self, token_ids: Sequence[int]) -> torch.Tensor:
        """First stage: hidden [T, H] float32, or last-position logits [vocab] if also last."""
        if self.stage.embedding is None:
            raise RuntimeError("forward_tokens needs the first stage")
        self._check(len(token_ids))
        with torch.inference_mode():
            ids = torch.tensor(list(token_ids), dtype=torch.int64)
            return self._run(self.stage.embedding(ids))

    def forward_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """Later stages: hidden [T, H] (any float dtype) from the previous stage."""
        if self.stage.is_first:
            raise RuntimeError("the first stage takes tokens, not hidden states")
        if hidden.dim() != 2 or hidden.shape[1] != self.stage.cfg.hidden:
            raise ValueError(
                f"hidden must be [T, {self.stage.cfg.hidden}], got {tuple(hidden.shape)}"
            )
        self._check(hidden.shape[0])
        with torch.inference_mode():
            h = hidden.to(device=self.stage.torch_device, dtype=torch.float32)
            return self._run(h)

    def reset(self) -> None:
        """Forget the current prompt; the cache is reused (stale entries are never read)."""
        self.position = 0

    def close(self) -> None:
        self._k = None
        self._v = None
        self.position = 0


# What a BatchSession's forward takes per sequence: its slot and its new tokens (the first
# stage) or its hidden rows [T, hidden] from the previous stage.
BatchRow = tuple[int, Sequence[int] | torch.Tensor]


class BatchSession:
    """A stage's state for up to ``slots`` sequences at once: each slot its own KV cache
    region ([layers, n_kv_head, max_seq_len, head_dim], as a StageSession's) and position.

    ``forward`` runs one step over several sequences: a decode row (one token) or a prompt
    chunk (several tokens) per sequence, all rows through every product at once, rope at
    each row's position, attention per sequence against its own slot (causal within a
    chunk). A sequence's outputs are those it gets alone (a StageSession fed the same
    chunks), bit for bit, whatever else runs beside it (StageModel.forward_batch).
    ``acquire`` takes a free slot, ``release`` frees it (a joining sequence starts at 0).

    ``prefix``: the stage's cache of recent prompts' prefixes (prefix_cache.py), where
    ``prefix_budget`` (bytes; None: ``MVP_PREFIX_CACHE_MB``, else a tenth of the slots'
    KV cache and at least 64 MiB) is positive and the stage computes with the native layers; ``keep_rows``: the
    blocks keep the stage's output rows too (a stage that hands its rows on).
    """

    def __init__(
        self,
        stage: SessionStage,
        slots: int,
        max_seq_len: int,
        *,
        prefix_budget: int | None = 0,
        keep_rows: bool = False,
    ) -> None:
        if slots <= 0:
            raise ValueError("slots must be positive")
        k, v = _kv_caches(stage, max_seq_len, slots)
        self.stage = stage
        self.slots = slots
        self.max_seq_len = max_seq_len
        self._k: torch.Tensor | None = k
        self._v: torch.Tensor | None = v
        self._positions = [0] * slots
        self._used = [False] * slots
        self.keep_rows = keep_rows
        self.prefix: PrefixCache | None = None
        if prefix_budget is None:
            prefix_budget = budget_from_env(default_budget(2 * k.numel() * k.element_size()))
        if prefix_budget > 0 and supported(stage.model):
            self.prefix = PrefixCache(prefix_budget, keep_keys=stage.is_first)

    @property
    def free_slots(self) -> int:
        return self._used.count(False)

    def acquire(self) -> int:
        """A free slot, now in use at position 0; raises NoFreeSlot."""
        if self._k is None:
            raise RuntimeError("session is closed")
        for slot, used in enumerate(self._used):
            if not used:
                self._used[slot] = True
                self._positions[slot] = 0
                return slot
        raise NoFreeSlot(f"all {self.slots} slots hold a sequence")

    def release(self, slot: int) -> None:
        """Free ``slot`` (its stale cache entries are never read: a new sequence writes
        every position before attending to it)."""
        self._check_slot(slot)
        self._used[slot] = False
        self._positions[slot] = 0

    def position(self, slot: int) -> int:
        self._check_slot(slot)
        return self._positions[slot]

    def load_prefix(self, slot: int, digests: Sequence[bytes], length: int) -> torch.Tensor | None:
        """Start ``slot`` (at position 0) at ``length``, its first positions copied from
        the prefix cache (a ``PrefixCache.match`` of this session's cache); returns their
        output rows [length, hidden] where the cache keeps them."""
        self._check_slot(slot)
        if self._k is None or self._v is None or self.prefix is None:
            raise RuntimeError("session has no prefix cache")
        if self._positions[slot] != 0:
            raise ValueError(f"slot {slot} is at position {self._positions[slot]}, not 0")
        rows = self.prefix.load(digests, length, self._k[slot], self._v[slot])
        self._positions[slot] = length
        return rows

    def store_prefix(
        self, slot: int, digests: Sequence[bytes], keys: bytes | memoryview, width: int,
        upto: int, rows: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        """Keep the whole blocks of ``slot``'s first ``upto`` positions in the prefix cache
        (``rows``: the stage's output rows of those positions, where it keeps rows)."""
        self._check_slot(slot)
        if self._k is None or self._v is None or self.prefix is None:
            return
        upto = min(upto, self._positions[slot])
        self.prefix.store(digests, keys, width, upto, self._k[slot], self._v[slot], rows)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} outside 0..{self.slots - 1}")
        if not self._used[slot]:
            raise ValueError(f"slot {slot} holds no sequence")

    def forward(self, rows: Sequence[BatchRow]) -> dict[int, torch.Tensor]:
        """One step over several sequences (each slot at most once): per slot its hidden
        rows [T, hidden] float32, or where this stage is the last its last position's
        logits [vocab]. Checks every row first: on an error no slot has moved."""
        if self._k is None or self._v is None:
            raise RuntimeError("session is closed")
        if not rows:
            raise ValueError("no rows to process")
        stage, k, v = self.stage, self._k, self._v
        seen: set[int] = set()
        counts = []
        for slot, x in rows:
            self._check_slot(slot)
            if slot in seen:
                raise ValueError(f"slot {slot} appears twice in one step")
            seen.add(slot)
            if stage.is_first:
                if isinstance(x, torch.Tensor):
                    raise ValueError("the first stage takes token ids, not hidden states")
                t = len(x)
            else:
                if not isinstance(x, torch.Tensor):
                    raise ValueError("later stages take hidden states, not token ids")
                if x.dim() != 2 or x.shape[1] != stage.cfg.hidden:
                    raise ValueError(
                        f"hidden must be [T, {stage.cfg.hidden}], got {tuple(x.shape)}"
                    )
                t = x.shape[0]
            if t <= 0:
                raise ValueError(f"no tokens to process for slot {slot}")
            if self._positions[slot] + t > self.max_seq_len:
                raise ContextOverflow(
                    f"{t} tokens at position {self._positions[slot]} of slot {slot} exceed "
                    f"max_seq_len {self.max_seq_len}"
                )
            counts.append(t)
        model = stage.model
        with torch.inference_mode():
            if stage.is_first:
                assert stage.embedding is not None
                ids = torch.tensor([i for _, x in rows for i in cast(Sequence[int], x)])
                h = stage.embedding(ids)
            else:
                dev = stage.torch_device
                h = torch.cat([cast(torch.Tensor, x) for _, x in rows]).to(
                    device=dev, dtype=torch.float32
                )
            segments = [
                (t, self._positions[slot], k[slot], v[slot])
                for (slot, _), t in zip(rows, counts, strict=True)
            ]
            h = model.forward_batch(h, segments)
            for (slot, _), t in zip(rows, counts, strict=True):
                self._positions[slot] += t
            ends = list(itertools.accumulate(counts))
            if stage.is_last:
                logits = model.logits_rows(h[[e - 1 for e in ends]]).cpu()
                return {slot: logits[i] for i, (slot, _) in enumerate(rows)}
            return {slot: h[e - t : e] for (slot, _), t, e in zip(rows, counts, ends, strict=True)}

    def close(self) -> None:
        self._k = None
        self._v = None
        self._used = [False] * self.slots
        if self.prefix is not None:
            self.prefix.clear()
