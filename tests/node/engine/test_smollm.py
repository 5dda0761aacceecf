"""SmolLM2-135M Q4_1: stage composition, the exact greedy continuation, sessions, sampling."""

from __future__ import annotations

import pytest
import torch

from mvp_core.models import ActivationDtype
from tests.node.engine.conftest import ONCE_CONTINUATION, ONCE_UPON_A_TIME, THREADS
from workers.node.engine import (
    ContextOverflow,
    EngineOptions,
    SamplingParams,
    Stage,
    generate,
    load_stage,
    read_model_facts,
)
from workers.node.engine.boundary import from_boundary, to_boundary

GREEDY = SamplingParams()


def _gen(stages: list[Stage], n: int = 32, **kw: object) -> list[int]:
    args: dict[str, object] = {
        "max_new_tokens": n, "max_seq_len": 128, "sampling": GREEDY, "stop_ids": [2],
    }  # fmt: skip
    args.update(kw)
    return list(generate(stages, ONCE_UPON_A_TIME, **args))  # type: ignore[arg-type]


def test_model_facts_come_from_metadata(smollm_path: str) -> None:
    facts = read_model_facts(smollm_path)
    assert (facts.architecture, facts.block_count, facts.embedding_length) == ("llama", 30, 576)
    assert (facts.context_length, facts.vocab_size, facts.eos_token_id) == (8192, 49152, 2)


def test_default_path_greedy_once_upon_a_time(smollm_default: Stage) -> None:
    assert _gen([smollm_default]) == ONCE_CONTINUATION


def test_float32_path_greedy_once_upon_a_time(smollm_f32: Stage) -> None:
    assert _gen([smollm_f32]) == ONCE_CONTINUATION


@pytest.mark.parametrize("precision", ["float32", "default"])
def test_stages_compose_to_the_whole_model(
    smollm_path: str, smollm_default: Stage, smollm_f32: Stage, precision: str
) -> None:
    whole = smollm_f32 if precision == "float32" else smollm_default
    opts = EngineOptions(device="cpu", precision=precision, threads=THREADS)
    ids = ONCE_UPON_A_TIME + ONCE_CONTINUATION[:4]
    expected = whole.new_session(32).forward_tokens(ids)
    for k in (1, 15, 29):
        first, last = load_stage(smollm_path, 0, k, opts), load_stage(smollm_path, k, 30, opts)
        assert first.is_first and not first.is_last and last.is_last and not last.is_first
        hidden = first.new_session(32).forward_tokens(ids)
        assert hidden.shape == (len(ids), 576)
        got = last.new_session(32).forward_hidden(hidden)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-3)
        first.close()
        last.close()


def test_each_stage_loads_only_its_tensors(smollm_path: str) -> None:
    opts = EngineOptions(device="cpu", threads=THREADS)
    stages = [load_stage(smollm_path, a, b, opts) for a, b in ((0, 10), (10, 20), (20, 30))]
    for stage in stages:
        for name in stage.tensor_names_loaded:
            if name.startswith("blk."):
                assert stage.layer_start <= int(name.split(".")[1]) < stage.layer_end
    assert "token_embd.weight" in stages[0].tensor_names_loaded
    assert "output_norm.weight" not in stages[0].tensor_names_loaded
    assert not any(n.startswith(("token_embd", "output")) for n in stages[1].tensor_names_loaded)
    # SmolLM2 ties the head to the embedding: the last stage holds token_embd too.
    assert {"output_norm.weight", "token_embd.weight"} <= stages[2].tensor_names_loaded
    # Three stages hand on float32 (DECISIONS 53): the whole model's greedy text.
    assert _gen(stages) == ONCE_CONTINUATION
    # With float16 hand-overs they give one stage's text with the same float16 rounding at
    # the two splits; the rounding itself moves an int8 activation code here and there,
    # and the greedy text leaves the unsplit one's after 4 tokens.
    emulated = load_stage(
        smollm_path, 0, 30, EngineOptions(device="cpu", threads=THREADS, fp16_split_points=(10, 20))
    )
    got = _gen(stages, activation_dtype=ActivationDtype.FLOAT16)
    assert got == _gen([emulated])
    assert got[:4] == ONCE_CONTINUATION[:4]
    for stage in [*stages, emulated]:
        stage.close()


def test_fp16_split_points_reproduce_a_float16_two_stage_run(smollm_path: str) -> None:
    opts = EngineOptions(device="cpu", threads=THREADS)
    first, last = load_stage(smollm_path, 0, 15, opts), load_stage(smollm_path, 15, 30, opts)
    emulated = load_stage(
        smollm_path, 0, 30, EngineOptions(device="cpu", threads=THREADS, fp16_split_points=(15,))
    )
    ids = ONCE_UPON_A_TIME + ONCE_CONTINUATION[:8]
    rows = to_boundary(first, first.new_session(32).forward_tokens(ids), ActivationDtype.FLOAT16)
    assert rows.dtype == torch.float16 and first.float16_scale == 1.0
    split = last.new_session(32).forward_hidden(from_boundary(last, rows))
    torch.testing.assert_close(
        emulated.new_session(32).forward_tokens(ids), split, rtol=0, atol=1e-4
    )
    f16 = ActivationDtype.FLOAT16
    assert _gen([first, last], 16, activation_dtype=f16) == _gen([emulated], 16)
    for s in (first, last, emulated):
        s.close()


def test_incremental_decode_matches_batched_prefill(smollm_f32: Stage) -> None:
    ids = ONCE_UPON_A_TIME + ONCE_CONTINUATION[:6]
    batched = smollm_f32.new_session(32).forward_tokens(ids)
    session = smollm_f32.new_session(32)
    session.forward_tokens(ids[:3])
    for t in ids[3:]:
        step = session.forward_tokens([t])
    assert session.position == len(ids)
    torch.testing.assert_close(step, batched, rtol=0, atol=1e-3)


def test_reset_starts_a_new_prompt(smollm_default: Stage) -> None:
    session = smollm_default.new_session(32)
    first = session.forward_tokens(ONCE_UPON_A_TIME)
    session.forward_tokens([28, 260])
    session.reset()
    assert session.position == 0
    torch.testing.assert_close(session.forward_tokens(ONCE_UPON_A_TIME), first, rtol=0, atol=1e-5)
    session.close()
    with pytest.raises(RuntimeError):
        session.forward_tokens([1])


def test_context_limit(smollm_default: Stage) -> None:
    session = smollm_default.new_session(6)
    session.forward_tokens(ONCE_UPON_A_TIME)
    with pytest.raises(ContextOverflow):
        session.forward_tokens([1, 2, 3])
    session.forward_tokens([1, 2])
    with pytest.raises(ContextOverflow):
        session.forward_tokens([1])
    # generate stops cleanly when the context is full: every yielded token has a slot.
    assert _gen([smollm_default], 100, max_seq_len=10) == ONCE_CONTINUATION[:6]
    with pytest.raises(ContextOverflow):  # raised at call time, before iterating
        generate([smollm_default], ONCE_UPON_A_TIME, max_new_tokens=4, max_seq_len=3,
                 sampling=GREEDY, stop_ids=[])  # fmt: skip
    assert _gen([smollm_default], 0) == []


def test_generate_stops_on_stop_ids_and_should_stop(smollm_default: Stage) -> None:
    # The 3rd generated token is a stop id: it is not yielded.
    assert _gen([smollm_default], stop_ids=[ONCE_CONTINUATION[2]]) == ONCE_CONTINUATION[:2]
    calls = iter(range(100))
    assert _gen([smollm_default], should_stop=lambda: next(calls) >= 3) == ONCE_CONTINUATION[:3]
    assert _gen([smollm_default], 5) == ONCE_CONTINUATION[:5]


def test_sampling_is_reproducible_by_seed(smollm_default: Stage) -> None:
    def run(seed: int) -> list[int]:
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=seed)
        return _gen([smollm_default], 12, sampling=params)

    a, b, c = run(7), run(7), run(8)
    assert a == b
    assert a != c
