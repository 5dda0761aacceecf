"""Response formats on the engine (DECISIONS 89): masks over SmolLM2's real vocabulary
equal a token-by-token check, the sampler masks its own row only and keeps the greedy
token wherever the format allows it, and a formatted sequence in a continuous batch
writes JSON of its schema while the sequences beside it keep their tokens."""

from __future__ import annotations

import json
import random
from collections.abc import Hashable

import pytest
import torch

from mvp_core.constrain import Recognizer, TokenVocabulary, compile_schema, format_text
from mvp_io.model_store import GEMMA3_BUNDLED, fetch_bundled
from tests.helpers.json_formats import PERSON, brute_mask, states_along, validates
from workers.node.engine import EngineOptions, SamplingParams, load_stage
from workers.node.engine.batch_generate import BatchGenerator, Finish
from workers.node.engine.formats import StageFormats
from workers.node.engine.sampling import Sampler
from workers.node.engine.tokenizer import Tokenizer

from .conftest import THREADS

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "country": {"enum": ["France", "Italy", "Spain"]},
        "facts": {
            "type": "object",
            "properties": {
                "population": {"type": "integer"},
                "capital": {"type": "boolean"},
            },
            "required": ["population", "capital"],
            "additionalProperties": False,
        },
    },
    "required": ["city", "country", "facts"],
    "additionalProperties": False,
}
CITY_FORMAT = format_text({"type": "json_schema", "schema": CITY})


@pytest.fixture(scope="module")
def tokenizer(smollm_path: str) -> Tokenizer:
    return Tokenizer.from_gguf(smollm_path)


def _eos(tok: Tokenizer) -> set[int]:
    return set(tok.eog_token_ids) | ({tok.eos_token_id} if tok.eos_token_id is not None else set())


def test_masks_over_a_real_vocabulary_equal_the_token_by_token_check(tokenizer: Tokenizer) -> None:
    """SmolLM2's 49k tokens (byte-level BPE), the string fast path included."""
    tok = tokenizer
    vocab = TokenVocabulary([tok.token_to_bytes(i) for i in range(tok.vocab_size)], _eos(tok))
    masks = vocab.masks({"type": "json_schema", "schema": PERSON})
    text = json.dumps(
        {"name": "Zoë \"Z\" O'Neil", "age": 41, "address": {"street": "1 Main St"},
         "tags": ["x"], "city": "Zürich", "height": 1.75},
        indent=1, ensure_ascii=False,
    ).encode()  # fmt: skip
    rec = masks.rec
    states = states_along(rec, [text], random.Random(3))
    states.append(rec.feed(rec.start, b'{"name": "Zo'))  # inside a free string
    for state in states:
        assert masks.mask(state) == brute_mask(masks, state)


def test_masks_over_gemmas_vocabulary_equal_the_token_by_token_check() -> None:
    """Gemma 3's 262k SentencePiece tokens (spaces as U+2581, byte tokens): the start,
    inside a free string (the fast path), and inside an enum's value."""
    tok = Tokenizer.from_gguf(fetch_bundled(GEMMA3_BUNDLED))
    vocab = TokenVocabulary([tok.token_to_bytes(i) for i in range(tok.vocab_size)], _eos(tok))
    masks = vocab.masks({"type": "json_schema", "schema": PERSON})
    rec = masks.rec
    for prefix in (b"", b'{"name": "Zo\xc3\xab ', b'{"name": "", "city": "Z'):
        state = rec.feed(rec.start, prefix)
        assert state and masks.mask(state) == brute_mask(masks, state)


def test_the_sampler_masks_its_row_and_keeps_the_greedy_token_where_allowed(
    tokenizer: Tokenizer,
) -> None:
    formats = StageFormats(tokenizer, _eos(tokenizer))
    gen = torch.Generator().manual_seed(5)
    greedy = Sampler(SamplingParams(response_format=CITY_FORMAT), formats=formats)
    seeded = Sampler(
        SamplingParams(temperature=1.0, top_k=50, seed=3, response_format=CITY_FORMAT),
        formats=formats,
    )
    kept = 0
    for _ in range(40):
        batch = torch.randn(3, tokenizer.vocab_size, generator=gen)
        before = batch.clone()
        for sampler in (greedy, seeded):
            assert sampler.constraint is not None
            allowed = torch.frombuffer(bytearray(sampler.constraint.allowed()), dtype=torch.bool)
            best = int(torch.argmax(batch[1]))
            token = sampler.sample(batch[1])
            assert allowed[token]
            if sampler is greedy and allowed[best]:
                assert token == best
                kept += 1
        assert torch.equal(batch, before)  # the row, and the rows beside it, untouched
    assert kept  # random logits: inside the string, the greedy token is often allowed


def test_a_format_without_the_stage_vocabulary_is_refused() -> None:
    with pytest.raises(ValueError, match="needs the stage's vocabulary"):
        Sampler(SamplingParams(response_format=CITY_FORMAT))


PROMPT = 'A JSON object about Paris: {"city": "'
FREE = ["Once upon a time", "The capital of France is"]
NEW = 64


def test_formatted_sequences_in_a_batch_write_their_schema_and_leave_the_others_alone(
    smollm_path: str, tokenizer: Tokenizer
) -> None:
    stage = load_stage(smollm_path, 0, 30, EngineOptions(device="cpu", threads=THREADS))
    formats = StageFormats(tokenizer, _eos(tokenizer))
    stops = _eos(tokenizer)
    free_ids = [tokenizer.encode(t) for t in FREE]
    fmt_ids = tokenizer.encode(PROMPT)
    samplings = {
        "greedy": SamplingParams(response_format=CITY_FORMAT),
        "seeded": SamplingParams(temperature=0.8, top_p=0.95, seed=11, response_format=CITY_FORMAT),
    }

    def run(with_formats: bool, with_free: bool) -> dict[Hashable, tuple[list[int], Finish]]:
        g = BatchGenerator([stage], slots=4, max_seq_len=256, formats=formats)
        out: dict[Hashable, tuple[list[int], Finish]] = {}
        got: dict[Hashable, list[int]] = {}
        if with_formats:
            for name, sampling in samplings.items():
                g.add(name, fmt_ids, sampling=sampling, max_new_tokens=NEW, stop_ids=stops)
        if with_free:
            for i, ids in enumerate(free_ids):
                g.add(i, ids, max_new_tokens=12, stop_ids=stops)
        try:
            while g.active:
                for ev in g.step():
                    if ev.token is not None:
                        got.setdefault(ev.seq_id, []).append(ev.token)
                    if ev.finish is not None:
                        out[ev.seq_id] = (got.get(ev.seq_id, []), ev.finish)
        finally:
            g.close()
        return out

    try:
        batched = run(True, True)
        assert {k: v for k, v in batched.items() if isinstance(k, int)} == run(False, True)
        assert {k: v for k, v in batched.items() if isinstance(k, str)} == run(True, False)
    finally:
        stage.close()
    rec = Recognizer(compile_schema(CITY))
    for name in samplings:
        tokens, finish = batched[name]
        text = tokenizer.decode(tokens)
        if finish is Finish.STOP:  # the model's end token: only where the value is whole
            assert validates(json.loads(text), CITY), text
        else:  # out of tokens: an incomplete value, still on course
            assert finish is Finish.LENGTH and rec.feed(rec.start, text.encode()), text
    assert batched["greedy"][1] is Finish.STOP, tokenizer.decode(batched["greedy"][0])


def test_a_resumed_formatted_sequence_goes_on_with_its_undisturbed_tokens(
    smollm_path: str, tokenizer: Tokenizer
) -> None:
    """Stage recovery (DECISIONS 68): the resumed tokens advance the constraint as the
    sampled ones did, so the tokens after them are the undisturbed run's."""
    stage = load_stage(smollm_path, 0, 30, EngineOptions(device="cpu", threads=THREADS))
    formats = StageFormats(tokenizer, _eos(tokenizer))
    ids = tokenizer.encode(PROMPT)
    sampling = SamplingParams(temperature=0.8, seed=5, response_format=CITY_FORMAT)
    try:
        g = BatchGenerator([stage], slots=1, max_seq_len=256, formats=formats)
        g.add(0, ids, sampling=sampling, max_new_tokens=20)
        whole = g.run()[0]
        g.close()
        g = BatchGenerator([stage], slots=1, max_seq_len=256, formats=formats)
        g.add(0, ids, sampling=sampling, max_new_tokens=20, resume=whole[:8])
        rest = g.run()[0]
        g.close()
    finally:
        stage.close()
    assert len(whole) == 20 and rest == whole[8:]
