"""The float32 path against HF transformers float32 (facts from scripts/reference/hf_reference.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from workers.engine import SamplingParams, Stage, generate

DATA = Path(__file__).parent / "data" / "hf_reference.json"


def _cases() -> list[dict[str, Any]]:
    if not DATA.exists():
        return []
    cases: list[dict[str, Any]] = json.loads(DATA.read_text())["cases"]
    return cases


def test_reference_facts_cover_enough_prompts() -> None:
    cases = _cases()
    assert len(cases) >= 5
    assert all(len(c["steps"]) == 16 for c in cases)


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c["prompt"][:20])
def test_float32_path_matches_hf_at_every_step(smollm_f32: Stage, case: dict[str, Any]) -> None:
    session = smollm_f32.new_session(64)
    logits = session.forward_tokens(case["prompt_ids"])
    worst = 0.0
    for step, token in zip(case["steps"], case["greedy"], strict=True):
        assert int(torch.argmax(logits)) == step["top1"]
        ours = logits[step["ids"]]
        worst = max(worst, float((ours - torch.tensor(step["logits"])).abs().max()))
        logits = session.forward_tokens([token])
    session.close()
    assert worst <= 0.1


def test_float32_greedy_generation_equals_hf(smollm_f32: Stage) -> None:
    for case in _cases()[:2]:
        out = list(
            generate(
                [smollm_f32], case["prompt_ids"], max_new_tokens=16, max_seq_len=64,
                sampling=SamplingParams(), stop_ids=[],
            )
        )  # fmt: skip
        assert out == case["greedy"]


def test_default_path_deviation_from_hf_is_bounded(smollm_default: Stage) -> None:
    """The compact path is not held to 0.1 (DECISIONS 23: reduced precision reports its
    deviation); measured: top-1 94/96 steps, max |diff| 0.33, mean 0.16. Guard against drift."""
    agree = total = 0
    worst = 0.0
    for case in _cases():
        session = smollm_default.new_session(64)
        logits = session.forward_tokens(case["prompt_ids"])
        for step, token in zip(case["steps"], case["greedy"], strict=True):
            ours = logits[step["ids"]]
            worst = max(worst, float((ours - torch.tensor(step["logits"])).abs().max()))
            agree += int(torch.argmax(logits)) == step["top1"]
            total += 1
            logits = session.forward_tokens([token])
        session.close()
    print(f"default path vs HF float32: top-1 {agree}/{total}, max |logit diff| {worst:.3f}")
    assert agree >= 0.95 * total
    assert worst <= 0.6
