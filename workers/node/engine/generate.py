"""Run stages in order in one process and stream generated token ids."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Iterator, Sequence

import torch

from .sampling import Sampler, SamplingParams
from .session import ContextOverflow, StageSession
from .stage import Stage


def _never() -> bool:
    return False


def _round_fp16(hidden: torch.Tensor) -> torch.Tensor:
    """Activations cross a stage boundary as float16 (the data-plane contract)."""
    return hidden.to(torch.float16)


def _step(sessions: Sequence[StageSession], ids: Sequence[int]) -> torch.Tensor:
    out = sessions[0].forward_tokens(ids)
    for s in sessions[1:]:
        out = s.forward_hidden(_round_fp16(out))
    return out


def generate(
    stages: Sequence[Stage],
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int | None,
    max_seq_len: int,
    sampling: SamplingParams,
    stop_ids: Collection[int],
    should_stop: Callable[[], bool] = _never,
) -> Iterator[int]:
    """Yield generated token ids one at a time (stop ids are not yielded).

    Ends on a stop id, ``max_new_tokens``, ``should_stop()`` (polled before each token), or
    when the context is full: every yielded token has a cache slot, so at most
    ``max_seq_len - len(prompt)`` tokens come out. Raises ContextOverflow (at call time)
    when the prompt alone does not fit. Closing the iterator early frees the KV caches.
    """
    if not stages:
        raise ValueError("no stages")
    if not stages[0].is_first or not stages[-1].is_last:
        raise ValueError("stages must cover the model from its first to its last layer")
    for a, b in itertools.pairwise(stages):
        if a.layer_end != b.layer_start:
            raise ValueError(
                f"stages are not contiguous: [{a.layer_start}, {a.layer_end}) then [{b.layer_start}, {b.layer_end})"
            )
    if not prompt_ids:
        raise ValueError("empty prompt")
    if len(prompt_ids) > max_seq_len:
        raise ContextOverflow(
            f"prompt of {len(prompt_ids)} tokens exceeds max_seq_len {max_seq_len}"
        )
    # Validation above runs at call time; the loop below runs as the caller iterates.
    return _generate(stages, prompt_ids, max_new_tokens, max_seq_len, Sampler(sampling),
                     frozenset(stop_ids), should_stop)  # fmt: skip


def _generate(
    stages: Sequence[Stage],
    prompt_ids: Sequence[int],
    max_new_tokens: int | None,
    max_seq_len: int,
    sampler: Sampler,
    stops: frozenset[int],
    should_stop: Callable[[], bool],
) -> Iterator[int]:
    if max_new_tokens is not None and max_new_tokens <= 0:
        return
    sessions = [s.new_session(max_seq_len) for s in stages]
    try:
        logits = _step(sessions, prompt_ids)
        produced = 0
        while True:
            if sessions[0].position >= max_seq_len or should_stop():
                return
            token = sampler.sample(logits)
            if token in stops:
                return
            yield token
            produced += 1
            if max_new_tokens is not None and produced >= max_new_tokens:
                return
            logits = _step(sessions, [token])
    finally:
        for s in sessions:
            s.close()
