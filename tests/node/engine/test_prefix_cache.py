"""Prefix reuse (prefix_cache.py, DECISIONS 91): a prompt that starts as a recent one did
prefills only the rest, and its tokens are the tokens without reuse, bit for bit.

On SmolLM2 (Q4_1) and Gemma 3 (Q4_K_M, whose sums for a row depend on its product's row
count through the row kinds), on 1 and 2 stages, greedy and seeded, 8 prompts at once,
under eviction and with a stage whose cache was emptied (a replacement's).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from mvp_io.model_store import GEMMA3_BUNDLED, fetch_bundled
from tests.node.engine.conftest import native_kernel
from workers.node.engine import EngineOptions, SamplingParams, Stage, load_stage
from workers.node.engine.batch_generate import BatchGenerator
from workers.node.engine.prefix_cache import (
    BLOCK,
    ENV_MB,
    PrefixCache,
    budget_from_env,
    default_budget,
    ids_bytes,
    reuse_bounds,
)
from workers.node.engine.tokenizer import Tokenizer

MAX_SEQ = 640
NEW = 6
PREFIX = 64  # the shared prefix of the checks (the TTFT figure's is 512)
MB = 2**20
TEXT = (
    "You are a helpful assistant for a small city library. Answer questions about opening "
    "hours, borrowing rules, events and the catalogue politely and briefly. The library "
    "opens at nine and closes at six on weekdays; on Saturdays it closes at one. "
)
TAILS = [
    "Q: When does the library open?\nA:",
    "Q: Can I borrow ten books?\nA:",
    "Q: Is there a reading club?\nA:",
    "Q: Where is the catalogue?\nA:",
    "Q: Are dogs allowed inside?\nA:",
    "Q: Who runs the events?\nA:",
    "Q: How long is a loan?\nA:",
    "Q: Is it open on Sunday?\nA:",
]
SEEDED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=7)


class Model:
    def __init__(self, path: str, splits: list[tuple[int, int]]) -> None:
        tok = Tokenizer.from_gguf(path)
        ids: list[int] = []
        while len(ids) < 512:
            ids += tok.encode(TEXT)
        self.system = ids[:512]  # a 512-token system prompt, as a chat repeats it
        self.tails = [tok.encode(t) for t in TAILS]
        self.one = [load_stage(path, 0, splits[-1][1], EngineOptions(device="cpu", threads=1))]
        self.two = [
            load_stage(path, a, b, EngineOptions(device="cpu", threads=1)) for a, b in splits
        ]
        self._alone: dict[tuple[int, SamplingParams], list[int]] = {}

    def prompt(self, i: int, prefix: int = PREFIX) -> list[int]:
        return self.system[:prefix] + self.tails[i]

    def alone(self, i: int, sampling: SamplingParams = SamplingParams()) -> list[int]:
        """Prompt i's tokens on one stage without reuse (2 stages give the same: float32
        hand-over)."""
        key = (i, sampling)
        if key not in self._alone:
            self._alone[key] = _alone(self.one, self.prompt(i), sampling)
        return self._alone[key]

    def close(self) -> None:
        for s in [*self.one, *self.two]:
            s.close()


@pytest.fixture(scope="module")
def smollm(smollm_path: str) -> Iterator[Model]:
    with native_kernel():
        m = Model(smollm_path, [(0, 15), (15, 30)])
        try:
            yield m
        finally:
            m.close()


def _gen(stages: list[Stage], budget: int, chunk: int = MAX_SEQ, slots: int = 1) -> BatchGenerator:
    return BatchGenerator(
        stages, slots=slots, max_seq_len=MAX_SEQ, chunk_size=chunk, prefix_budget=budget
    )


def _run(gen: BatchGenerator, prompt: list[int], sampling: SamplingParams) -> tuple[list[int], int]:
    gen.add("p", prompt, sampling=sampling, max_new_tokens=NEW)
    reused = gen.reused("p")
    tokens = []
    while "p" in gen.active:
        tokens += [e.token for e in gen.step() if e.token is not None]
    return tokens, reused


def _alone(stages: list[Stage], prompt: list[int], sampling: SamplingParams) -> list[int]:
    gen = _gen(stages, 0)
    try:
        return _run(gen, prompt, sampling)[0]
    finally:
        gen.close()


def test_kv_of_a_position_is_the_same_in_any_whole_chunk(smollm: Model) -> None:
    """Why a copied prefix is exact: a position's K/V (and output rows) are the same
    whether it was computed in one chunk of the prompt or in chunks of other lengths
    (SmolLM2's Q4_1 sums do not depend on the row count at all)."""
    stage = smollm.one[0]
    prompt = smollm.prompt(0, 96)
    caches = []
    for cuts in ([len(prompt)], [1, 7, 16, 40, len(prompt) - 64], [64, len(prompt) - 64]):
        s = stage.new_batch_session(1, MAX_SEQ)
        slot, at = s.acquire(), 0
        for c in cuts:
            s.forward([(slot, prompt[at : at + c])])
            at += c
        assert s._k is not None and s._v is not None
        caches.append((s._k[0, :, :, : len(prompt)].clone(), s._v[0, :, :, : len(prompt)].clone()))
        s.close()
    for k, v in caches[1:]:
        assert torch.equal(k, caches[0][0]) and torch.equal(v, caches[0][1])


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("sampling", [SamplingParams(), SEEDED], ids=["greedy", "seeded"])
def test_a_shared_prefix_is_reused_and_the_tokens_are_those_without(
    smollm: Model, stages: int, sampling: SamplingParams
) -> None:
    parts = smollm.one if stages == 1 else smollm.two
    gen = _gen(parts, 64 * MB)
    try:
        first, reused = _run(gen, smollm.prompt(0), sampling)
        assert reused == 0
        assert first == smollm.alone(0, sampling)
        second, reused = _run(gen, smollm.prompt(1), sampling)
        assert reused == PREFIX  # the system prompt's blocks, every stage
        assert second == smollm.alone(1, sampling)
        again, reused = _run(gen, smollm.prompt(0), sampling)  # the whole prompt cached
        assert reused == len(smollm.prompt(0)) // BLOCK * BLOCK
        assert again == first
    finally:
        gen.close()


def test_chunked_prefill_reuses_on_its_own_chunk_boundaries(smollm: Model) -> None:
    chunk = 24  # not a multiple of the block: reuse at multiples of both (48)
    parts = smollm.two
    gen = _gen(parts, 64 * MB, chunk=chunk)
    try:
        want = [_alone_chunked(parts, smollm.prompt(i, 100), chunk) for i in (0, 1)]
        assert _run(gen, smollm.prompt(0, 100), SamplingParams())[0] == want[0]
        got, reused = _run(gen, smollm.prompt(1, 100), SamplingParams())
        assert reused == 96
        assert got == want[1]
    finally:
        gen.close()


def _alone_chunked(stages: list[Stage], prompt: list[int], chunk: int) -> list[int]:
    gen = _gen(stages, 0, chunk=chunk)
    try:
        gen.add("p", prompt, max_new_tokens=NEW)
        return gen.run()["p"]
    finally:
        gen.close()


def test_eight_prompts_sharing_a_prefix_at_once_each_get_their_own_tokens(
    smollm: Model,
) -> None:
    parts = smollm.two
    prompts = [smollm.prompt(i) for i in range(8)]
    samplings = [SEEDED if i % 2 else SamplingParams() for i in range(8)]
    want = [smollm.alone(i, s) for i, s in enumerate(samplings)]
    gen = _gen(parts, 64 * MB, slots=8)
    try:
        warm = smollm.system[:PREFIX] + smollm.tails[0][:1] * 9
        _run(gen, warm, SamplingParams())
        for i, p in enumerate(prompts):
            gen.add(i, p, sampling=samplings[i], max_new_tokens=NEW)
        assert all(gen.reused(i) == PREFIX for i in range(8))
        got: dict[int, list[int]] = {i: [] for i in range(8)}
        events = gen.step()
        while True:
            for e in events:
                if e.token is not None:
                    got[int(str(e.seq_id))].append(e.token)
            if not gen.active:
                break
            events = gen.step()
    finally:
        gen.close()
    assert [got[i] for i in range(8)] == want
    assert len({tuple(t) for t in want}) > 1


def test_the_least_recently_used_prefix_is_evicted_and_its_next_use_misses(
    smollm: Model,
) -> None:
    """A cap that holds about one prefix: the older one goes; using it again is a miss
    that still gives the right tokens (and keeps it again)."""
    stage = smollm.one
    per_token = 2 * 30 * 3 * 64 * 2  # SmolLM2's k and v, float16: 23 KB a position
    gen = _gen(stage, 80 * per_token)
    other = [t + 1 for t in smollm.system]
    try:
        _run(gen, smollm.prompt(0), SamplingParams())
        _run(gen, other[:PREFIX] + smollm.tails[1], SamplingParams())  # evicts the first
        cache = gen.sessions[0].prefix
        assert cache is not None
        assert cache.stats.evicted_blocks > 0
        assert cache.stats.used_bytes <= cache.stats.budget_bytes
        got, reused = _run(gen, smollm.prompt(2), SamplingParams())
        assert reused < PREFIX  # at most the blocks that survived
        assert got == smollm.alone(2)
        got, reused = _run(gen, smollm.prompt(3), SamplingParams())
        assert reused == PREFIX  # kept again
        assert got == smollm.alone(3)
    finally:
        gen.close()


def test_a_stage_whose_cache_was_emptied_makes_the_prompt_compute_it_all(
    smollm: Model,
) -> None:
    """A replacement stage starts with an empty cache: the shared prefix is a miss there,
    so nothing is reused (every stage must hold it) and the tokens are unchanged."""
    parts = smollm.two
    gen = _gen(parts, 64 * MB)
    try:
        _run(gen, smollm.prompt(0), SEEDED)
        later = gen.sessions[1].prefix
        assert later is not None
        later.clear()
        got, reused = _run(gen, smollm.prompt(1), SEEDED)
        assert reused == 0
        assert got == smollm.alone(1, SEEDED)
        got, reused = _run(gen, smollm.prompt(2), SEEDED)  # both hold it again
        assert reused == PREFIX
        assert got == smollm.alone(2, SEEDED)
    finally:
        gen.close()


def test_keys_are_checked_not_only_their_digest() -> None:
    cache = PrefixCache(MB, keep_keys=True)
    ids = list(range(100, 148))
    keys = ids_bytes(ids)
    k = torch.zeros(2, 1, 64, 4, dtype=torch.float16)
    digests = cache.chain(keys, 4)
    cache.store(digests, keys, 4, 48, k, k.clone(), None)
    assert cache.match(digests, keys, 4, 40) == 32
    forged = ids_bytes([1, *ids[1:]])  # the same digests, other ids in block 0
    assert cache.match(digests, forged, 4, 40) == 0
    assert reuse_bounds(100, None) == (92, 1, 100)
    assert reuse_bounds(100, 48) == (99, 48, 96)


def test_the_cap_is_the_nodes_setting_or_a_tenth_of_the_kv_cache() -> None:
    assert default_budget(10 << 30) == 1 << 30 and default_budget(1 << 20) == 64 * MB
    assert budget_from_env(5, {}) == 5
    assert budget_from_env(5, {ENV_MB: "0"}) == 0  # off
    assert budget_from_env(5, {ENV_MB: "1.5"}) == 3 * MB // 2
    with pytest.raises(ValueError, match=ENV_MB):
        budget_from_env(5, {ENV_MB: "lots"})


def test_gemma_k_quant_reuse_gives_the_tokens_without() -> None:
    """Gemma 3's Q4_K sums for a row depend on its product's row count (the row kinds):
    reuse keeps every reused and recomputed position's kinds, so the tokens stay."""
    path = str(fetch_bundled(GEMMA3_BUNDLED))
    with native_kernel():
        m = Model(path, [(0, 9), (9, 18)])
        try:
            for parts in (m.one, m.two):
                gen = _gen(parts, 64 * MB)
                try:
                    _run(gen, m.prompt(0), SamplingParams())
                    got, reused = _run(gen, m.prompt(1), SamplingParams())
                    assert reused == PREFIX
                    assert got == m.alone(1)
                finally:
                    gen.close()
        finally:
            m.close()


def test_ttft_of_a_repeated_512_token_prefix(smollm: Model) -> None:
    """Printed, not asserted: the first token's time of a chat's second turn, whose
    512-token system prompt the first turn left in the cache, against the first's."""
    stage = smollm.one
    gen = _gen(stage, 64 * MB)
    try:
        times = []
        for i in (0, 1):
            gen.add(i, smollm.prompt(i, 512), max_new_tokens=1)
            t0 = time.perf_counter()
            while i in gen.active:
                gen.step()
            times.append(time.perf_counter() - t0)
    finally:
        gen.close()
    print(
        f"\nTTFT, {len(smollm.prompt(0, 512))}-token prompt, 1 thread: first turn "
        f"{times[0] * 1e3:.0f} ms, second (512 reused) {times[1] * 1e3:.0f} ms, "
        f"ratio {times[1] / times[0]:.3f}"
    )
