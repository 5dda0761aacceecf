"""Issue 37, log probabilities through the gateway (docs/gateway.md): the official
``openai`` client against the gateway app in front of one real 2-stage run of the bundled
model that generates up to 4 prompts at once. Chat (``logprobs``, ``top_logprobs``) and
completions (``logprobs``), streamed and not: each token's text, its logprob the largest
of its step's under greedy decoding, the tokens' texts making up the completion's, and
the same logprobs for a prompt alone and beside three others in the run's batch."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI
from temporalio.client import Client

from tests.integration.conftest import (
    OrchestratorProcess,
)
from tests.integration.test_gateway import openai_on_run

RUN = 3701
MODEL = "SmolLM2-135M-Instruct.Q4_1"
TEXT = "The capital of France is"
QUESTION = "What is the capital of France?"
OTHERS = ["Once upon a time", "def fibonacci(n):", "Water boils at"]
N = 8  # max_tokens: short, the suite's budget


@pytest.fixture(scope="module")
async def oai(
    client: Client, orchestrator: OrchestratorProcess, state_dir: Path, faults_file: Path
) -> AsyncIterator[AsyncOpenAI]:
    async with openai_on_run(client, orchestrator, state_dir, faults_file, RUN) as api:
        yield api


def _check_greedy_chat(content: list[Any], text: str, top: int, tokens: int) -> None:
    assert "".join(c.token for c in content) == text and len(content) == tokens
    for c in content:
        assert c.bytes == list(c.token.encode()) and c.logprob <= 0
        assert len(c.top_logprobs) == top
        best = c.top_logprobs[0]
        assert (best.token, best.logprob) == (c.token, c.logprob)  # greedy: the largest
        assert c.logprob == max(t.logprob for t in c.top_logprobs)
        values = [t.logprob for t in c.top_logprobs]
        assert values == sorted(values, reverse=True)


async def test_chat_logprobs_streamed_and_not(oai: AsyncOpenAI) -> None:
    kw: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": N,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
    }
    whole = await oai.chat.completions.create(**kw)
    choice = whole.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert choice.message.content and whole.usage is not None
    tokens = whole.usage.completion_tokens
    _check_greedy_chat(choice.logprobs.content, choice.message.content, 3, tokens)

    stream = await oai.chat.completions.create(**kw, stream=True)
    text, content = "", []
    async for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.logprobs is not None and c.logprobs.content:
                content.extend(c.logprobs.content)
    assert text == choice.message.content
    assert [c.model_dump() for c in content] == [c.model_dump() for c in choice.logprobs.content]
    # logprobs without top_logprobs: the sampled tokens' only.
    bare = await oai.chat.completions.create(**{**kw, "top_logprobs": None})
    lp = bare.choices[0].logprobs
    assert lp is not None and lp.content is not None
    assert [c.top_logprobs for c in lp.content] == [[]] * tokens
    assert [c.logprob for c in lp.content] == [c.logprob for c in choice.logprobs.content]


async def test_completion_logprobs_streamed_and_not(oai: AsyncOpenAI) -> None:
    kw: dict[str, Any] = {
        "model": MODEL,
        "prompt": TEXT,
        "max_tokens": N,
        "temperature": 0,
        "logprobs": 2,
    }
    whole = await oai.completions.create(**kw)
    choice = whole.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert lp.text_offset is not None
    assert whole.usage is not None and whole.usage.completion_tokens == N
    assert "".join(lp.tokens) == choice.text and len(lp.tokens) == N
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(N)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == value == max(top.values())  # greedy: the largest
        assert 1 <= len(top) <= 2

    stream = await oai.completions.create(**kw, stream=True)
    text, tokens, values = "", list[str](), list[float]()
    async for chunk in stream:
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None and c.logprobs.tokens:
                tokens.extend(c.logprobs.tokens)
                values.extend(c.logprobs.token_logprobs or [])
    assert (text, tokens, values) == (choice.text, lp.tokens, lp.token_logprobs)


async def test_logprobs_are_the_same_alone_and_in_the_runs_batch(oai: AsyncOpenAI) -> None:
    async def ask(prompt: str, **kw: Any) -> tuple[str, list[Any]]:
        got = await oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=N,
            logprobs=True,
            top_logprobs=5,
            **{"temperature": 0, **kw},
        )
        lp = got.choices[0].logprobs
        assert lp is not None and lp.content is not None
        return got.choices[0].message.content or "", [c.model_dump() for c in lp.content]

    alone = await ask(QUESTION)
    sampled = await ask(QUESTION, temperature=0.9, seed=11)
    assert len(alone[1]) > 1
    # Admitted first, then last, beside three others: each step one forward over them all.
    batched = await asyncio.gather(ask(QUESTION), *(ask(p) for p in OTHERS))
    assert batched[0] == alone
    batched = await asyncio.gather(
        *(ask(p) for p in OTHERS[:2]), ask(QUESTION), ask(QUESTION, temperature=0.9, seed=11)
    )
    assert batched[2] == alone
    assert batched[3] == sampled  # values before temperature: the same for a sampled prompt
