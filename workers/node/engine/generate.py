"""Run stages in order in one process and stream generated token ids."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Iterator, Sequence

import torch

from mvp_core.models import ActivationDtype

from .boundary import from_boundary, to_boundary
from .sampling import Sampler, SamplingParams
from .session import ContextOverflow, StageSession
from .stage import Stage, check_whole_model


def _never() -> bool:
    return False


def _step(
    stages: Sequence[Stage],
    sessions: Sequence[StageSession],
    ids: Sequence[int],
    dtype: ActivationDtype,
) -> torch.Tensor:
    """One forward through every stage; the hidden state crosses each boundary as the
    data plane carries it (``dtype``, boundary.py)."""
    out = sessions[0].forward_tokens(ids)
    for (prev, _), (stage, s) in itertools.pairwise(zip(stages, sessions, strict=True)):
        out = s.forward_hidden(from_boundary(stage, to_boundary(prev, out, dtype)))
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
    activation_dtype: ActivationDtype = ActivationDtype.FLOAT32,
) -> Iterator[int]:
    """Yield generated token ids one at a time (stop ids are not yielded).

    Several stages run in order, their hidden state handed on as ``activation_dtype``
    (as a pipeline's edges carry it: float32 computes the 1-stage text bit for bit).

    Ends on a stop id, ``max_new_tokens``, ``should_stop()`` (polled before each token), or
    when the context is full: every yielded token has a cache slot, so at most
    ``max_seq_len - len(prompt)`` tokens come out. Raises ContextOverflow (at call time)
    when the prompt alone does not fit. Closing the iterator early frees the KV caches.
    """
    check_whole_model(stages)
    if not prompt_ids:
        raise ValueError("empty prompt")
    if len(prompt_ids) > max_seq_len:
        raise ContextOverflow(
            f"prompt of {len(prompt_ids)} tokens exceeds max_seq_len {max_seq_len}"
        )
    # Validation above runs at call time; the loop below runs as the caller iterates.
    return _generate(stages, prompt_ids, max_new_tokens, max_seq_len, Sampler(sampling),
                     frozenset(stop_ids), should_stop, activation_dtype)  # fmt: skip


def _generate(
    stages: Sequence[Stage],
    prompt_ids: Sequence[int],
    max_new_tokens: int | None,
    max_seq_len: int,
    sampler: Sampler,
    stops: frozenset[int],
    should_stop: Callable[[], bool],
    dtype: ActivationDtype,
) -> Iterator[int]:
    if max_new_tokens is not None and max_new_tokens <= 0:
        return
    sessions = [s.new_session(max_seq_len) for s in stages]
    try:
        logits = _step(stages, sessions, prompt_ids, dtype)
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
            logits = _step(stages, sessions, [token], dtype)
    finally:
        for s in sessions:
            s.close()
