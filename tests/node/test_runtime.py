"""The head node tokenizes once and reports what the gateway needs (issue 21): the
prompt's token count, the tokens behind each piece of text, and a typed refusal of a
prompt it cannot serve (too long, a chat template that refuses it). The real bundled
model in direct mode; tests/integration/test_gateway.py drives the same through a run."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from activities.models_store import DEFAULT_BUNDLED, fetch_bundled
from mvp_core.errors import ErrorType
from mvp_core.generation import PromptRefused
from mvp_core.models import ChatMessage, EngineSettings, LayerRange, StageProvision, SubmitPrompt
from workers.node.runtime import StageRuntime

CONTEXT = 64


@pytest.fixture(scope="module")
def runtime() -> Iterator[StageRuntime]:
    path = str(fetch_bundled(DEFAULT_BUNDLED))
    provision = StageProvision(
        run_id=1,
        authorized_orchestrator="test",
        node_id=1,
        stage_index=0,
        stage_count=1,
        layers=LayerRange(start=0, end=30),
        inbound_edge=None,
        outbound_edge=None,
        consumer_endpoint=None,
        model_name="smollm",
        model_path=path,
        tokenizer_path=path,
        max_seq_len=CONTEXT,
        readiness_id="r",
        engine=EngineSettings(device="cpu", threads=1, compute_cpus="off", token_path_nice=None),
        run_workflow_id="mvp-run-1",
    )
    rt = StageRuntime.load(provision)
    yield rt
    rt.close()


def test_a_generation_reports_the_prompts_tokens_and_the_tokens_behind_its_text(runtime):
    prompt = SubmitPrompt(request_id=1, prompt_text="The capital of France is")
    counted: list[int] = []
    pieces: list[tuple[str, int]] = []
    result = runtime.run(
        prompt, 6, lambda text, n: pieces.append((text, n)), lambda: False, counted.append
    )
    n_prompt = len(runtime.tokenizer.encode(prompt.prompt_text))
    assert counted == [n_prompt] and result.prompt_tokens == n_prompt
    assert result.tokens == 6 and "".join(t for t, _ in pieces) == result.text
    counts = [n for _, n in pieces]
    assert counts == sorted(counts) and counts[-1] == result.tokens


def test_a_prompt_past_the_context_is_refused_typed_with_its_count(runtime):
    text = "one two three four five six seven eight nine ten " * 10
    n = len(runtime.tokenizer.encode(text))
    assert n >= CONTEXT
    with pytest.raises(PromptRefused) as err:
        runtime.encode(SubmitPrompt(request_id=1, prompt_text=text))
    assert err.value.kind is ErrorType.PROMPT_TOO_LONG and err.value.prompt_tokens == n
    assert f"prompt has {n} tokens; the planned context holds {CONTEXT}" in str(err.value)


def test_a_chat_template_that_refuses_the_conversation_is_a_typed_refusal(
    runtime, monkeypatch: pytest.MonkeyPatch
):
    chat = SubmitPrompt(
        request_id=1,
        prompt_text="",
        chat=True,
        messages=[ChatMessage(role="user", content="a"), ChatMessage(role="user", content="b")],
    )
    assert runtime.encode(chat)  # SmolLM2's own template takes it
    tok = runtime.tokenizer
    monkeypatch.setattr(
        tok, "chat_template", "{{ raise_exception('Conversation roles must alternate') }}"
    )
    with pytest.raises(PromptRefused) as err:
        runtime.encode(chat)
    assert err.value.kind is ErrorType.CHAT_TEMPLATE_REFUSED
    assert "chat template refused the messages: Conversation roles must alternate" in str(err.value)
    monkeypatch.setattr(tok, "chat_template", None)
    monkeypatch.setattr(tok, "has_chat_template", False)
    with pytest.raises(PromptRefused, match="the model has no chat template") as err:
        runtime.encode(chat)
    assert err.value.kind is ErrorType.CHAT_TEMPLATE_REFUSED
