"""Per-request state of a stage: the KV cache and the next position."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from .config import ArchConfig
from .gemma3 import Gemma3StageModel
from .model import StageModel


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
    def model(self) -> StageModel | Gemma3StageModel: ...
    @property
    def embedding(self) -> _Embedding | None: ...
    @property
    def torch_device(self) -> torch.device: ...


class ContextOverflow(Exception):
    """The tokens do not fit in the session's ``max_seq_len``."""


class StageSession:
    """KV cache preallocated for ``max_seq_len`` positions of the stage's layers.

    Feed a prompt in one call (batched prefill), then one token per call. ``reset``
    starts a new prompt; ``close`` frees the cache.
    """

    def __init__(self, stage: SessionStage, max_seq_len: int) -> None:
        if max_seq_len <= 0:
            raise ValueError("max_seq_len must be positive")
        cfg = stage.cfg
        if cfg.context_length and max_seq_len > cfg.context_length:
            raise ValueError(
                f"max_seq_len {max_seq_len} exceeds the model's context length {cfg.context_length}"
            )
        self.stage = stage
        self.max_seq_len = max_seq_len
        self.position = 0
        n = stage.layer_end - stage.layer_start
        shape = (n, cfg.n_kv_head, max_seq_len, cfg.head_dim)
        dev = stage.torch_device
        self._k: torch.Tensor | None = torch.zeros(shape, dtype=torch.float32, device=dev)
        self._v: torch.Tensor | None = torch.zeros(shape, dtype=torch.float32, device=dev)
        stage.model.rope.ensure(max_seq_len)

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
