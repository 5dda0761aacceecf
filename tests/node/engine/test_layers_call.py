"""A stage's layers in one foreign call (native.Layers, qmm.c mvk_layers) compute what the
per-op forward computes (engine/models/): the same logits to the bit, at prefill and
decode, across a float16 hand-over point (fp16_split_points), on both bundled models."""

from __future__ import annotations

import pytest
import torch

from mvp_io.model_store import DEFAULT_BUNDLED, GEMMA3_BUNDLED, fetch_bundled
from workers.node.engine import EngineOptions, load_stage, native, read_model_facts

from .conftest import native_kernel

PROMPT = [2, 504, 3458, 282, 260, 1345, 28, 2021, 314, 16, 17, 18, 715, 1099, 30, 60, 1, 5]


def _greedy_logits(stage, n_decode: int) -> list[torch.Tensor]:
    s = stage.new_session(64)
    out = [s.forward_tokens(PROMPT)]
    for _ in range(n_decode):
        out.append(s.forward_tokens([int(out[-1].argmax())]))
    s.close()
    return out


@pytest.mark.parametrize("bundled", [DEFAULT_BUNDLED, GEMMA3_BUNDLED], ids=["smollm2", "gemma3"])
def test_one_call_layers_are_the_per_op_forward(bundled) -> None:
    with native_kernel():
        _one_call_is_the_per_op_forward(bundled)


def _one_call_is_the_per_op_forward(bundled: str) -> None:
    if native.library() is None:
        pytest.fail(f"the native kernel did not build here: {native.why_not()}")
    path = str(fetch_bundled(bundled))
    n = read_model_facts(path).block_count
    opts = EngineOptions(device="cpu", threads=2, fp16_split_points=(n // 2,))
    stage = load_stage(path, 0, n, opts)
    try:
        model = stage.model
        fast = _greedy_logits(stage, 6)
        assert model._layers is not None  # the one-call path ran
        kept = model._layers
        model._layers = None  # the per-op forward
        slow = _greedy_logits(stage, 6)
        model._layers = kept
        for step, (a, b) in enumerate(zip(fast, slow, strict=True)):
            assert torch.equal(a, b), step
    finally:
        stage.close()
