"""Sampler behaviour on hand-made logits."""

from __future__ import annotations

import pytest
import torch

from workers.node.engine import Sampler, SamplingParams

LOGITS = torch.tensor([0.0, 3.0, 2.9, -1.0, 1.0])


def test_greedy_takes_the_argmax() -> None:
    assert Sampler(SamplingParams()).sample(LOGITS) == 1


def test_top_k_one_is_greedy_at_any_temperature() -> None:
    sampler = Sampler(SamplingParams(temperature=5.0, top_k=1, seed=0))
    assert {sampler.sample(LOGITS) for _ in range(20)} == {1}


def test_top_p_keeps_the_smallest_sufficient_prefix() -> None:
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.5, seed=0))
    # p(1) ~ 0.45 < 0.5, so tokens 1 and 2 stay and nothing else.
    assert {sampler.sample(LOGITS) for _ in range(200)} == {1, 2}


def test_same_seed_same_sequence_different_seed_differs() -> None:
    flat = torch.zeros(1000)

    def seq(seed: int) -> list[int]:
        s = Sampler(SamplingParams(temperature=1.0, seed=seed))
        return [s.sample(flat) for _ in range(10)]

    assert seq(1) == seq(1)
    assert seq(1) != seq(2)


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=-1), SamplingParams(top_k=-1), SamplingParams(top_p=0)]
)
def test_invalid_parameters_are_rejected(params: SamplingParams) -> None:
    with pytest.raises(ValueError):
        Sampler(params)
