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


def test_a_draw_is_a_function_of_seed_and_index_only() -> None:
    """Stage recovery continues a sequence with a fresh Sampler at the index it reached:
    its draws from there must be the undisturbed sampler's, whatever logits came before."""
    rng = torch.Generator().manual_seed(7)
    steps = [torch.randn(500, generator=rng) for _ in range(12)]
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=1234)
    whole = Sampler(params)
    undisturbed = [whole.sample(x) for x in steps]
    for k in (1, 5, 11):
        resumed = Sampler(params, index=k)
        assert [resumed.sample(x) for x in steps[k:]] == undisturbed[k:]
    # Other logits before index k change nothing at k onwards.
    other = Sampler(params)
    for _ in range(5):
        other.sample(torch.zeros(500))
    assert [other.sample(x) for x in steps[5:]] == undisturbed[5:]


def test_an_unseeded_sampler_draws_its_seed_once_and_can_be_resumed() -> None:
    rng = torch.Generator().manual_seed(8)
    steps = [torch.randn(500, generator=rng) for _ in range(8)]
    first = Sampler(SamplingParams(temperature=1.0))
    tokens = [first.sample(x) for x in steps]
    resumed = Sampler(SamplingParams(temperature=1.0, seed=first.seed), index=3)
    assert [resumed.sample(x) for x in steps[3:]] == tokens[3:]
    assert Sampler(SamplingParams(temperature=1.0)).seed != first.seed


def test_a_negative_index_is_rejected() -> None:
    with pytest.raises(ValueError, match="index"):
        Sampler(SamplingParams(), index=-1)
