"""The float32 path against HF transformers float32, the default path against llama.cpp next to
HF float32 (facts from scripts/reference/hf_reference.py and llamacpp_reference.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from scripts.reference.fidelity import common_prefix
from workers.node.engine import SamplingParams, Stage, generate

from .conftest import PLAIN_C_TIMEOUT_S, native_stage
from .llamacpp_facts import logit_mismatches

DATA = Path(__file__).parent / "data" / "hf_reference.json"
LLAMA = Path(__file__).parent / "data" / "llamacpp_reference.json"
SLACK = 3  # "a few tokens" a prompt may lose against HF float32


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


def _agreement(stage: Stage) -> list[tuple[str, int, int]]:
    """(prompt, leading tokens of llama.cpp's continuation ``stage`` keeps, HF float32's)."""
    llama = json.loads(LLAMA.read_text())["generations"]
    hf = {c["prompt"]: c["greedy"] for c in json.loads(DATA.read_text())["llamacpp_prompts"]}
    assert len(llama) >= 12 and all(len(g["ids"]) == 32 for g in llama)
    rows = []
    for g in llama:
        n = len(g["ids"])
        ours = generate(
            [stage], g["prompt_ids"], max_new_tokens=n,
            max_seq_len=len(g["prompt_ids"]) + n, sampling=SamplingParams(), stop_ids=[],
        )  # fmt: skip
        rows.append(
            (
                g["prompt"],
                common_prefix(list(ours), g["ids"]),
                common_prefix(hf[g["prompt"]], g["ids"]),
            )
        )
    for prompt, o, h in rows:
        print(f"{prompt!r:48} ours {o:2}  HF float32 {h:2}")
    return rows


@pytest.mark.timeout(PLAIN_C_TIMEOUT_S)
def test_default_path_reproduces_llamacpps_greedy_text(smollm_path: str) -> None:
    """Issue 13's bar, on the default path (the engine's own kernel, native.py, in
    llama.cpp's float order: DECISIONS 44): on llama.cpp's greedy reference continuations
    (16 prompts x 32 tokens of prose, facts, code and lists) it keeps every token, where HF
    transformers float32 keeps 341 of 512 (scripts/reference/fidelity.py). The group
    order kept 400; torch's bfloat16 int4 kernel 334."""
    from workers.node.engine.kernels import NativeLinear

    with native_stage(smollm_path, 30) as stage:
        assert isinstance(stage.model.layers[0].qkv, NativeLinear)
        rows = _agreement(stage)
    assert [r for r in rows if r[1] < 32] == []
    assert sum(o for _, o, _ in rows) > sum(h for _, _, h in rows)


@pytest.mark.timeout(PLAIN_C_TIMEOUT_S)
def test_default_path_computes_llamacpps_logits(smollm_path: str) -> None:
    """Fed llama.cpp's tokens, every step's top logits equal llama.cpp's recorded ones (to
    their 5 decimals) and its choice is llama.cpp's."""
    llama = json.loads(LLAMA.read_text())["generations"]
    with native_stage(smollm_path, 30) as stage:
        differ = {g["prompt"]: logit_mismatches(stage, g) for g in llama}
    assert {p: d for p, d in differ.items() if d} == {}


def test_exact_path_keeps_llamacpp_text_as_well_as_hf_float32(smollm_exact: Stage) -> None:
    """The same bar on "exact" (torch's int4 kernel with float32-exact decode products,
    DECISIONS 42). Measured: 372 against HF's 341."""
    rows = _agreement(smollm_exact)
    assert sum(o for _, o, _ in rows) >= sum(h for _, _, h in rows)
    assert [r for r in rows if r[1] < r[2] - SLACK] == []


def test_single_row_products_are_float32_exact(smollm_exact: Stage, smollm_f32: Stage) -> None:
    """A decode step's int4 products equal float32 ones of the same (bfloat16) inputs: the
    kernel's rounding of its output and of the weights' scales is undone."""
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name in ("qkv", "wo", "gate_up", "down"):
            ours = getattr(smollm_exact.model.layers[3], name)
            ref = getattr(smollm_f32.model.layers[3], name)
            x = torch.randn(1, ref.in_features, generator=gen).bfloat16().float()
            want = ref(x)
            rel = float((ours(x) - want).norm() / want.norm())
            assert rel < 1e-4, (name, rel)  # measured ~5e-6; one bfloat16 rounding: ~2e-3
