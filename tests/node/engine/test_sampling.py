"""Sampler behaviour on hand-made logits."""

from __future__ import annotations

import pytest
import torch

from workers.node.engine import Sampler, SamplingParams
from workers.node.engine.sampling import token_logprobs

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


# --------------------------------------------------------------------------- logprobs


def test_token_logprobs_are_the_log_softmax_of_the_raw_logits_sorted_ties_by_id() -> None:
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(4000, generator=gen) * 4
    logits[[10, 3000, 17]] = 20.0  # a three-way tie at the top, ids out of order
    logits[[5, 6]] = 19.0
    ref = torch.log_softmax(logits, dim=-1)
    got = token_logprobs(logits, 123, 6)
    assert got.logprob == float(ref[123])
    assert [t for t, _ in got.top] == [10, 17, 3000, 5, 6, int(torch.argsort(ref)[-6])]
    assert [v for _, v in got.top] == [float(ref[t]) for t, _ in got.top]
    assert [v for _, v in got.top] == sorted((v for _, v in got.top), reverse=True)
    # Cut inside a tie: the lower ids win.
    assert [t for t, _ in token_logprobs(logits, 0, 2).top] == [10, 17]
    assert token_logprobs(logits, 0, 0).top == ()


def test_token_logprobs_ignore_temperature_and_a_rows_place_in_a_batch() -> None:
    batch = torch.randn(5, 300, generator=torch.Generator().manual_seed(1))
    alone = batch[3].clone()
    hot = Sampler(SamplingParams(temperature=1.7, top_k=5, top_p=0.5, seed=3, logprobs=True,
                                 top_logprobs=4))  # fmt: skip
    token, lp = hot.choose(batch[3])
    assert lp is not None
    assert lp == token_logprobs(alone, token, 4)
    assert lp.logprob == float(torch.log_softmax(alone, -1)[token])


def test_greedy_choice_is_the_top_logprob_and_off_computes_nothing() -> None:
    token, lp = Sampler(SamplingParams(logprobs=True, top_logprobs=3)).choose(LOGITS)
    assert token == 1 and lp is not None
    assert lp.top[0] == (1, lp.logprob) and [t for t, _ in lp.top] == [1, 2, 4]
    assert Sampler(SamplingParams()).choose(LOGITS) == (1, None)
