"""Issue 37, response formats through the gateway (docs/gateway.md, DECISIONS 89): the
official ``openai`` client against the gateway app in front of one real 2-stage run of
the bundled model that generates up to 4 prompts at once. A JSON schema with nested
objects and enums gives JSON of the schema every time (greedy and seeded, alone and
batched, chat and completions, streamed and not); json_object gives an object; a
format the run cannot honour is a 400 naming response_format."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import AsyncOpenAI
from temporalio.client import Client

from tests.helpers.json_formats import validates
from tests.integration.conftest import (
    OrchestratorProcess,
)
from tests.integration.test_gateway import openai_on_run

RUN = 3702
MODEL = "SmolLM2-135M-Instruct.Q4_1"
N = 96  # max_tokens: room for the value; a shorter one ends "length", honestly
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "country": {"enum": ["France", "Italy", "Spain", "Germany"]},
        "facts": {
            "type": "object",
            "properties": {
                "population": {"type": "integer"},
                "capital": {"type": "boolean"},
                "river": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            },
            "required": ["population", "capital"],
            "additionalProperties": False,
        },
    },
    "required": ["city", "country", "facts"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
QUESTIONS = [
    "Describe Paris as JSON.",
    "Tell me about Rome in JSON.",
    "Give facts about Madrid as a JSON object.",
    "What do you know about Berlin? Answer in JSON.",
]


@pytest.fixture(scope="module")
async def oai(
    client: Client, orchestrator: OrchestratorProcess, state_dir: Path, faults_file: Path
) -> AsyncIterator[AsyncOpenAI]:
    async with openai_on_run(client, orchestrator, state_dir, faults_file, RUN) as api:
        yield api


async def _chat(oai: AsyncOpenAI, question: str, fmt: dict[str, Any], **kw: Any) -> tuple[str, str]:
    got = await oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        response_format=fmt,  # type: ignore[arg-type]
        **{"temperature": 0, "max_tokens": N, **kw},
    )
    choice = got.choices[0]
    return choice.message.content or "", choice.finish_reason


def _check(text: str, finish: str, schema: Any) -> None:
    """A text that ended is JSON of the schema; one cut by max_tokens says "length"."""
    assert finish in ("stop", "length"), finish
    if finish == "stop":
        assert validates(json.loads(text), schema), text


async def test_a_json_schema_gives_json_of_the_schema_greedy_seeded_and_batched(
    oai: AsyncOpenAI,
) -> None:
    alone = await _chat(oai, QUESTIONS[0], FORMAT)
    assert alone[1] == "stop", alone  # the greedy text of the bundled model ends in time
    _check(*alone, CITY)
    # Four at once (the run's batch), greedy and seeded: each its own mask.
    batched = await asyncio.gather(
        _chat(oai, QUESTIONS[0], FORMAT),
        _chat(oai, QUESTIONS[1], FORMAT, temperature=0.9, seed=7),
        _chat(oai, QUESTIONS[2], FORMAT, temperature=0.7, seed=8),
        _chat(oai, QUESTIONS[3], FORMAT),
    )
    assert batched[0] == alone  # greedy: the same text alone and batched
    for text, finish in batched:
        _check(text, finish, CITY)
    assert sum(finish == "stop" for _, finish in batched) >= 3, batched
    # Beside a free prompt, which keeps its own (unconstrained) text.
    free = await _chat(oai, QUESTIONS[0], {"type": "text"}, max_tokens=12)
    mixed = await asyncio.gather(
        _chat(oai, QUESTIONS[0], {"type": "text"}, max_tokens=12), _chat(oai, QUESTIONS[0], FORMAT)
    )
    assert mixed == [free, alone]


async def test_json_object_streamed_and_completions(oai: AsyncOpenAI) -> None:
    kw: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "List three colours as a JSON object."}],
        "max_tokens": N,
        "temperature": 0,
        "response_format": {"type": "json_object"},
    }
    whole = await oai.chat.completions.create(**kw)
    text = whole.choices[0].message.content or ""
    assert whole.choices[0].finish_reason == "stop", text
    assert isinstance(json.loads(text), dict)
    stream = await oai.chat.completions.create(**kw, stream=True)
    streamed = ""
    async for chunk in stream:
        for c in chunk.choices:
            streamed += c.delta.content or ""
    assert streamed == text
    done = await oai.completions.create(
        model=MODEL,
        prompt="The capital of Italy, as JSON:",
        max_tokens=N,
        temperature=0,
        extra_body={"response_format": FORMAT},
    )
    _check(done.choices[0].text, done.choices[0].finish_reason, CITY)
    # Too few tokens for the value: "length", and the text is where it stopped.
    short = await _chat(oai, QUESTIONS[0], FORMAT, max_tokens=5)
    assert short[1] == "length" and short[0].lstrip().startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(short[0])


@pytest.mark.parametrize(
    "fmt",
    [
        {"type": "yaml"},
        {"type": "json_schema", "json_schema": {"name": "x"}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string",
                                                                        "pattern": "a+"}}},
    ],
)  # fmt: skip
async def test_a_format_the_run_cannot_honour_is_a_400(oai: AsyncOpenAI, fmt: Any) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        await _chat(oai, QUESTIONS[0], fmt)
    assert err.value.status_code == 400 and err.value.param == "response_format"
