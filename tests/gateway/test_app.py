"""The gateway without a run: stop strings, request validation, and the HTTP mapping of
each way a prompt can end (the run's API replaced by a script of events). The real run
is in tests/integration/test_gateway.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from temporalio.service import RPCError, RPCStatusCode

from mvp_core.errors import ErrorType
from mvp_core.models import (
    ChatMessage,
    Done,
    Fault,
    SubmitPrompt,
    TextDelta,
    TokenLogprob,
    TopLogprob,
)
from temporal.client import PromptRejected
from workers.gateway.app import create_app
from workers.gateway.service import ServedModel
from workers.gateway.stops import StopMatcher, cut_at_stop
from workers.gateway.wire import ApiError, ChatRequest, CompletionRequest, parse_body

MODEL = "m"

# --------------------------------------------------------------------------- stop strings


def _run(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    m = StopMatcher(stops)
    out = []
    for p in pieces:
        text, hit = m.push(p)
        out.append(text)
        if hit:
            return "".join(out), True
    return "".join(out) + m.flush(), False


def test_stop_across_deltas_is_cut_and_partial_prefixes_are_held_back():
    m = StopMatcher(["</s>", "\n\n"])
    assert m.push("Hello <") == ("Hello ", False)  # "<" could start "</s>"
    assert m.push("/") == ("", False)
    assert m.push("x") == ("</x", False)  # not a stop after all: released
    assert m.push(" bye\n") == (" bye", False)
    assert m.push("\nmore") == ("", True)
    assert m.matched == "\n\n" and m.push("later") == ("", True) and m.flush() == ""
    assert _run(["ab"], ["xa", "a", "b", "c"]) == ("xa", True)
    assert _run(["b", "ab"], ["xab"]) == ("x", True)  # both complete at once: the longer
    assert _run(["a", "\naa"], ["\naa"]) == ("\n", True)  # "a" completes first
    assert _run(["never"], ["a", "nev", "e"]) == ("anev" + "e", False)
    assert cut_at_stop("héllo wörld", ["ö"]) == ("héllo w", True)
    assert cut_at_stop("plain", []) == ("plain", False)


@given(
    st.text(alphabet="ab\n", max_size=30),
    st.lists(st.text(alphabet="ab\n", min_size=1, max_size=3), min_size=1, max_size=3),
    st.lists(st.integers(min_value=1, max_value=30), max_size=6),
)
def test_any_split_gives_the_text_before_the_first_stop(text, stops, cuts):
    bounds = sorted({c for c in cuts if c < len(text)})
    pieces = [text[i:j] for i, j in zip([0, *bounds], [*bounds, len(text)], strict=True)]
    # The stop that completes first (as a token-by-token check sees it; a tie: the one
    # that starts first), whatever the split.
    ends = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    expected = (text[: min(ends)[1]], True) if ends else (text, False)
    assert _run(stops, pieces) == expected


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("body", "model", "param", "code"),
    [
        (b"{", CompletionRequest, None, "invalid_json"),
        (b"[]", CompletionRequest, None, "invalid_json"),
        (b'{"model": "m"}', CompletionRequest, "prompt", "missing_required_parameter"),
        (b'{"prompt": "x"}', CompletionRequest, "model", "missing_required_parameter"),
        (b'{"model": "m", "prompt": 3}', CompletionRequest, "prompt", "invalid_value"),
        (
            b'{"model": "m", "prompt": "x", "max_tokens": 0}',
            CompletionRequest,
            "max_tokens",
            "invalid_value",
        ),
        (
            b'{"model": "m", "prompt": "x", "max_tokens": "9"}',
            CompletionRequest,
            "max_tokens",
            "invalid_value",
        ),
        (
            b'{"model": "m", "prompt": "x", "temperature": 3}',
            CompletionRequest,
            "temperature",
            "invalid_value",
        ),
        (b'{"model": "m", "prompt": "x", "stop": ""}', CompletionRequest, "stop", "invalid_value"),
        (
            b'{"model": "m", "prompt": "x", "echo": true}',
            CompletionRequest,
            "echo",
            "unsupported_parameter",
        ),
        (
            b'{"model": "m", "prompt": "x", "logprobs": 6}',
            CompletionRequest,
            "logprobs",
            "invalid_value",
        ),
        (
            b'{"model": "m", "prompt": "x", "logprobs": -1}',
            CompletionRequest,
            "logprobs",
            "invalid_value",
        ),
        (
            b'{"model": "m", "prompt": "x", "logprobs": true}',
            CompletionRequest,
            "logprobs",
            "invalid_value",
        ),
        (
            b'{"model": "m", "prompt": "x", "top_logprobs": 2}',
            CompletionRequest,
            "top_logprobs",
            "unsupported_parameter",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21}',
            ChatRequest,
            "top_logprobs",
            "invalid_value",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": -1}',
            ChatRequest,
            "top_logprobs",
            "invalid_value",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}',
            ChatRequest,
            "top_logprobs",
            "invalid_value",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": false, "top_logprobs": 0}',
            ChatRequest,
            "top_logprobs",
            "invalid_value",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": 1}',
            ChatRequest,
            "logprobs",
            "invalid_value",
        ),
        (b'{"model": "m", "prompt": "x", "n": 5}', CompletionRequest, "n", "invalid_value"),
        (b'{"model": "m", "prompt": "x", "n": 0}', CompletionRequest, "n", "invalid_value"),
        (b'{"model": "m", "messages": []}', ChatRequest, "messages", "invalid_value"),
        (
            b'{"model": "m", "messages": [{"role": "robot", "content": "x"}]}',
            ChatRequest,
            "messages.0.role",
            "invalid_value",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}',
            ChatRequest,
            "tools",
            "unsupported_parameter",
        ),
    ],
)
def test_bad_requests_are_400_naming_the_parameter(body, model, param, code):
    with pytest.raises(ApiError) as err:
        parse_body(body, model)
    assert err.value.status == 400
    assert (err.value.param, err.value.code) == (param, code)
    assert set(err.value.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    "body",
    [
        {"model": MODEL, "prompt": "x", "logprobs": 9},
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True,
         "top_logprobs": 21},
    ],
)  # fmt: skip
async def test_a_bad_logprobs_request_is_a_400_and_reaches_no_node(fake, body):
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    r = await fake.http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] in ("logprobs", "top_logprobs") and error["param"] in error["message"]
    assert fake.prompts == []


SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "n": {"type": "integer"}},
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "fmt",
    [
        {"type": "xml"},
        "json_object",
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"schema": SCHEMA}},  # no name
        {"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}},
        {"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}},
        {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": 1}},
        {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "date"}}},
        {"type": "json_schema",
         "json_schema": {"name": "a", "schema": {"type": "string", "pattern": "^a$"}}},
        {"type": "json_schema", "json_schema": {"name": "a", "schema": {"enum": ["x" * 20000]}}},
        {"type": "json_schema",
         "json_schema": {"name": "a", "schema": {"type": "object", "required": ["q"]}}},
    ],
)  # fmt: skip
async def test_a_format_the_run_cannot_honour_is_a_400_and_reaches_no_node(fake, fmt):
    for body in (
        {"model": MODEL, "prompt": "x", "response_format": fmt},
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "response_format": fmt},
    ):
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        r = await fake.http.post(path, json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["param"], error["code"]) == ("response_format", "invalid_value")
        assert error["type"] == "invalid_request_error" and error["message"]
    assert fake.prompts == []


def test_the_format_goes_to_the_prompt_only_where_asked():
    chat = b'{"model": "m", "messages": [{"role": "user", "content": "x"}]'
    assert parse_body(chat + b"}", ChatRequest).format_fields() == {}
    text = parse_body(chat + b', "response_format": {"type": "text"}}', ChatRequest)
    assert text.format_fields() == {}
    obj = parse_body(b'{"model": "m", "prompt": "x", "response_format": {"type": "json_object"}}',
                     CompletionRequest)  # fmt: skip
    assert obj.format_fields() == {"response_format": {"type": "json_object"}}
    spec = {"name": "city", "schema": SCHEMA, "strict": True}
    body = {
        "model": "m",
        "prompt": "x",
        "response_format": {"type": "json_schema", "json_schema": spec},
    }
    req = parse_body(json.dumps(body).encode(), CompletionRequest)
    fields = req.format_fields()
    assert fields == {"response_format": {"type": "json_schema", "json_schema": SCHEMA}}
    prompt = SubmitPrompt(request_id=1, prompt_text="x", **fields)
    assert prompt.response_format is not None and prompt.response_format.json_schema == SCHEMA


def test_defaults_follow_openai_and_unknown_fields_are_ignored():
    req = parse_body(
        b'{"model": "m", "prompt": "x", "user": "u", "presence_penalty": 0.5}', CompletionRequest
    )
    assert req.token_limit() == 16
    assert req.sampling() == {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": None}
    chat = parse_body(
        b'{"model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},'
        b' {"type": "text", "text": "b"}]}], "max_tokens": 5, "max_completion_tokens": 7, "seed": -1,'
        b' "top_p": 0}',
        ChatRequest,
    )
    assert chat.token_limit() == 7 and chat.messages[0].text() == "ab"
    assert chat.messages[0].template_role() == "system"
    assert chat.sampling()["seed"] == 2**64 - 1 and chat.sampling()["top_p"] == 1e-6


# --------------------------------------------------------------------------- HTTP mapping

Script = Callable[[SubmitPrompt], list[Any]]


class FakeRun:
    """The run's API as the gateway calls it: each prompt gets the events of ``script``."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.prompts: list[SubmitPrompt] = []
        self.cancelled: list[int] = []

    async def stream_prompt(
        self, client: Any, run_id: int, prompt: SubmitPrompt, **kw: Any
    ) -> AsyncIterator[Any]:
        self.prompts.append(prompt)
        events = self.script(prompt)
        if isinstance(events, Exception):
            raise events
        kw["on_admitted"]()
        for event in events:
            yield event

    async def cancel(self, request_id: int) -> None:
        self.cancelled.append(request_id)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch):
    run = FakeRun(lambda p: [])
    app = create_app(client=None, run_id=5)  # type: ignore[arg-type]
    gw = app.state.gateway
    # The run's prompt stream, as the gateway's RunHandle gives it.
    monkeypatch.setattr(
        gw.run, "stream", lambda prompt, **kw: run.stream_prompt(None, 5, prompt, **kw)
    )
    served = ServedModel(MODEL, frozenset(), 1, 64)

    async def served_model() -> ServedModel:
        return served

    monkeypatch.setattr(gw, "served", served_model)
    monkeypatch.setattr(gw, "_cancel", run.cancel)
    run.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")  # type: ignore[attr-defined]
    return run


PROMPT_TOKENS = 3  # what the scripted head node says it encoded


def _text(prompt: SubmitPrompt, *pieces: str, reason: str = "max_tokens") -> list[Any]:
    """The events of a prompt whose every delta is one token."""
    rid = prompt.request_id
    deltas = [
        TextDelta(request_id=rid, text=p, tokens=1, prompt_tokens=PROMPT_TOKENS if i == 0 else None)
        for i, p in enumerate(pieces)
    ]
    done = Done(
        request_id=rid,
        final_text="".join(pieces),
        tokens_generated=len(pieces),
        elapsed_ms=1,
        stop_reason=reason,
        prompt_tokens=PROMPT_TOKENS,
    )
    return [*deltas, done]


def _events(resp: httpx.Response) -> list[Any]:
    out = []
    for block in resp.text.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            data = block[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def test_completion_maps_done_and_usage(fake):
    fake.script = lambda p: _text(p, "Hel", "lo", reason="eos")
    r = await fake.http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "hi", "temperature": 0}
    )
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "Hello" and body["choices"][0]["finish_reason"] == "stop"
    # The head node's counts: the gateway tokenizes nothing.
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    prompt = fake.prompts[0]
    assert body["id"] == f"cmpl-5-{prompt.request_id}"
    assert 0 < prompt.request_id <= 2**53 - 1  # JavaScript-safe (defect 15)
    assert (prompt.prompt_text, prompt.chat, prompt.max_tokens, prompt.temperature) == (
        "hi",
        False,
        16,
        0,
    )
    assert fake.cancelled == []


async def test_the_head_nodes_cached_prompt_tokens_are_in_usage_streamed_and_not(fake):
    """DECISIONS 91: the head stage's prefix cache gave some of the prompt's tokens; the
    node says how many on the first delta and the Done, the usage says it as OpenAI's
    prompt_tokens_details.cached_tokens (and not at all for a node that did not say)."""

    def script(p: SubmitPrompt) -> list[Any]:
        first, *rest, done = _text(p, "Hel", "lo", " you")
        assert isinstance(done, Done)
        first.cached_tokens = 2
        done.cached_tokens = 2
        return [first, *rest, done]

    fake.script = script
    want = {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hey"}]}
    r = await fake.http.post("/v1/chat/completions", json=body)
    assert r.json()["usage"] == want
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    r = await fake.http.post("/v1/chat/completions", json=streamed)
    assert _events(r)[-2]["usage"] == want
    # Cut by a stop string before the Done: the first delta's count.
    r = await fake.http.post("/v1/chat/completions", json={**streamed, "stop": ["lo"]})
    assert _events(r)[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}


async def test_one_user_message_takes_the_runs_chat_path(fake):
    fake.script = lambda p: _text(p, "Hi")
    r = await fake.http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hey"}], "stream": True},
    )
    events = _events(r)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[1]["choices"][0]["delta"] == {"content": "Hi"}
    assert events[2]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "length",
    }
    assert events[-1] == "[DONE]" and len(events) == 4
    assert (fake.prompts[0].prompt_text, fake.prompts[0].chat, fake.prompts[0].max_tokens) == (
        "Hey",
        True,
        None,
    )


async def test_a_conversation_goes_to_the_run_whose_template_refusal_is_a_400(fake):
    # The head node renders a longer conversation with the model's template; the gateway
    # neither renders nor counts it.
    fake.script = lambda p: _text(p, "ok")
    conversation = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    r = await fake.http.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": conversation}
    )
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == PROMPT_TOKENS
    prompt = fake.prompts[-1]
    assert prompt.chat and prompt.prompt_text == ""
    assert prompt.messages == [
        ChatMessage(role="system", content="s"),
        ChatMessage(role="user", content="u"),
    ]
    refused = "the model's chat template refused the messages: roles must alternate"
    fake.script = lambda p: [
        Fault(request_id=p.request_id, error=refused, kind=ErrorType.CHAT_TEMPLATE_REFUSED)
    ]
    for stream in (False, True):
        r = await fake.http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": conversation, "stream": stream},
        )
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["code"], err["param"], err["message"]) == (
            "chat_template_refused",
            "messages",
            refused,
        )


async def test_a_stop_string_cuts_and_cancels_streamed_and_not(fake):
    fake.script = lambda p: _text(p, "one two", " thr", "ee four", " five")
    body = {"model": MODEL, "prompt": "x", "stop": ["three", "zzz"]}
    r = await fake.http.post("/v1/completions", json=body)
    assert (
        r.json()["choices"][0]["text"] == "one two "
        and r.json()["choices"][0]["finish_reason"] == "stop"
    )
    r = await fake.http.post(
        "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    events = _events(r)
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == "one two "
    assert events[-3]["choices"][0]["finish_reason"] == "stop"
    # The node's counts: the prompt's, and the tokens of the deltas up to the stop.
    assert events[-2]["choices"] == [] and events[-2]["usage"] == {
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": 3,
        "total_tokens": PROMPT_TOKENS + 3,
    }
    assert fake.cancelled == [p.request_id for p in fake.prompts]
    # The stops travel with the prompt, for a client that re-attaches to it.
    assert [p.stop for p in fake.prompts] == [["three", "zzz"]] * 2


async def test_rejections_and_faults_have_their_status(fake):
    cases: list[tuple[Any, int, str]] = [
        (PromptRejected("PromptQueueFull", "full"), 429, "prompt_queue_full"),
        (PromptRejected("RunNotPromptReady", "no"), 503, "run_not_ready"),
        (PromptRejected("InvalidPrompt", "bad"), 400, "invalid_prompt"),
        (PromptRejected("SomethingNew", "?"), 500, "prompt_rejected"),
        (
            RPCError(
                "limit on number of concurrent in-flight updates has been reached (10)",
                RPCStatusCode.RESOURCE_EXHAUSTED,
                b"",
            ),
            429,
            "server_limit",
        ),
        (RuntimeError("server gone"), 503, "run_unreachable"),
    ]
    for exc, status, code in cases:
        fake.script = lambda p, exc=exc: exc
        r = await fake.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text
    assert r.status_code == 503 and r.headers["retry-after"] == "1"

    fake.script = lambda p: [Fault(request_id=p.request_id, error="stage 1 died")]
    r = await fake.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 500 and r.json()["error"]["code"] == "prompt_fault"
    # A fault is read by its type, never by its text.
    too_long = "prompt has 900 tokens; the planned context holds 512 (prompt plus ...)"
    fake.script = lambda p: [Fault(request_id=p.request_id, error=too_long)]
    r = await fake.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 500 and r.json()["error"]["code"] == "prompt_fault"
    fake.script = lambda p: [
        Fault(
            request_id=p.request_id,
            error="the node's words",
            kind=ErrorType.PROMPT_TOO_LONG,
            prompt_tokens=900,
        )
    ]
    r = await fake.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 400 and r.json()["error"] == {
        "message": "This model's maximum context length is 64 tokens; your prompt has 900 "
        "(the prompt and at least one generated token must fit).",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": "context_length_exceeded",
    }
    # Streamed, the refusal is still an HTTP 400: no byte of a 200 stream goes out first.
    r = await fake.http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True}
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.headers["content-type"].startswith("application/json")
    r = await fake.http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    # After the headers: the fault is the last event, and no [DONE].
    fake.script = lambda p: [
        TextDelta(request_id=p.request_id, text="a"),
        Fault(request_id=p.request_id, error="boom"),
    ]
    r = await fake.http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True}
    )
    events = _events(r)
    assert events[0]["choices"][0]["text"] == "a"
    assert events[-1]["error"]["code"] == "prompt_fault" and "[DONE]" not in events


async def test_a_duplicate_request_id_is_retried_with_another(fake):
    seen: list[int] = []

    def script(p: SubmitPrompt) -> Any:
        seen.append(p.request_id)
        return PromptRejected("DuplicateRequestId", "dup") if len(seen) == 1 else _text(p, "ok")

    fake.script = script
    r = await fake.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"
    assert len(set(seen)) == 2


async def test_models_and_unknown_names(fake):
    r = await fake.http.get("/v1/models")
    assert r.json() == {
        "object": "list",
        "data": [{"id": MODEL, "object": "model", "created": 1, "owned_by": "mvp-orchestrator"}],
    }
    r = await fake.http.post("/v1/completions", json={"model": "other", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = await fake.http.post("/v1/completions", content=b"x" * (1 << 21))
    assert r.status_code == 413
    r = await fake.http.delete("/v1/models")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


# --------------------------------------------------------------------------- re-attach


async def _viewed(events: list[Any], stops: list[str]) -> list[Any]:
    from workers.gateway.attach import view

    async def rest() -> AsyncIterator[Any]:
        for e in events[1:]:
            yield e

    return [item async for item in view(events[0], rest(), stops)]


async def test_a_reattached_completion_is_cut_at_the_original_stop_strings():
    rid = 7
    deltas = [
        TextDelta(request_id=rid, text=t, tokens=1) for t in ("one tw", "o thr", "ee", " four")
    ]
    cancelled = Fault(request_id=rid, error="cancelled")
    out = await _viewed([*deltas, cancelled], ["three"])
    assert "".join(x for x in out if isinstance(x, str)) == "one two "
    end = out[-1]
    assert (end.reason, end.extra, end.completion_tokens) == ("stop", {}, 3)
    # Without stop strings: the run's text, and the cancel says so.
    out = await _viewed([*deltas, cancelled], [])
    assert "".join(x for x in out if isinstance(x, str)) == "one two three four"
    assert (out[-1].reason, out[-1].extra["mvp_status"]) == (None, "cancelled")


@pytest.mark.parametrize("stream", [False, True])
async def test_a_retrieve_whose_run_stops_answering_midway_is_a_503_not_a_broken_stream(
    fake, monkeypatch: pytest.MonkeyPatch, stream: bool
):
    """A re-attach that loses its run after the first text (a run between workers, a
    server restart): the client is told to ask again (503 and Retry-After, or the same
    error as the stream's last event), never a 500 or a stream cut without an end."""
    from temporal.client import PromptUnavailable
    from workers.gateway import attach

    async def events(request_id: int, **kw: Any) -> AsyncIterator[Any]:
        yield TextDelta(request_id=request_id, text="Once upon", tokens=2)
        raise PromptUnavailable(f"prompt {request_id}: the run did not answer")

    async def no_stops(*args: Any) -> list[str]:
        return []

    gw = fake.http._transport.app.state.gateway
    monkeypatch.setattr(gw.run, "attach", events)
    monkeypatch.setattr(attach, "original_stops", no_stops)
    r = await fake.http.get("/v1/completions/cmpl-5-7", params={"stream": str(stream).lower()})
    if not stream:
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["code"] == "run_unavailable"
        assert "did not answer" in r.json()["error"]["message"]
        return
    assert r.status_code == 200
    got = _events(r)
    assert got[0]["choices"][0]["text"] == "Once upon"
    assert got[-1]["error"]["code"] == "run_unavailable" and "[DONE]" not in got


async def test_n_choices_are_prompts_of_their_own_streamed_and_not(fake):
    """n=3: three prompts (a given seed + i each), three choices by index, usage with the
    prompt once; streamed, each choice's text and finish by its index."""
    fake.script = lambda p: _text(p, f"s{p.seed}", "!", reason="eos")
    body = {"model": MODEL, "prompt": "hi", "temperature": 0.8, "seed": 41, "n": 3}
    r = await fake.http.post("/v1/completions", json=body)
    got = r.json()
    assert r.status_code == 200, got
    assert [c["index"] for c in got["choices"]] == [0, 1, 2]
    assert [c["text"] for c in got["choices"]] == ["s41!", "s42!", "s43!"]
    assert got["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    assert [p.seed for p in fake.prompts] == [41, 42, 43]
    assert len({p.request_id for p in fake.prompts}) == 3

    r = await fake.http.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "seed": 7,
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    events = _events(r)
    assert events[-1] == "[DONE]"
    text = {0: "", 1: ""}
    finishes = {}
    for ev in events[:-2]:
        (choice,) = ev["choices"]
        text[choice["index"]] += choice["delta"].get("content") or ""
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert text == {0: "s7!", 1: "s8!"} and finishes == {0: "stop", 1: "stop"}
    assert events[-2]["usage"]["completion_tokens"] == 4


async def test_a_refused_choice_cancels_the_choices_admitted_before_it(fake):
    def script(p: SubmitPrompt) -> Any:
        if len(fake.prompts) == 2:
            return PromptRejected("PromptQueueFull", "full")
        return _text(p, "x")[:-1]  # still generating: no terminal event yet

    fake.script = script
    r = await fake.http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 2})
    assert r.status_code == 429 and r.json()["error"]["code"] == "prompt_queue_full"
    for _ in range(500):  # the cancel is sent in the background: until it was
        if fake.cancelled:
            break
        await asyncio.sleep(0.01)
    assert fake.cancelled == [fake.prompts[0].request_id]


# --------------------------------------------------------------------------- logprobs


def _lp(token: str, logprob: float, *top: tuple[str, float]) -> TokenLogprob:
    alts = [TopLogprob(token=t, logprob=v, bytes=list(t.encode())) for t, v in top]
    return TokenLogprob(token=token, logprob=logprob, bytes=list(token.encode()), top_logprobs=alts)


LPS = [
    _lp("Hel", -0.5, ("Hel", -0.5), ("Hi", -1.0)),
    _lp("lo", -0.25, ("lo", -0.25), ("p", -2.0)),
    _lp(" END", -0.75, (" END", -0.75), ("!", -1.5)),
    _lp(" x", -0.1, (" x", -0.1), (" y", -3.0)),
]


def _with_logprobs(prompt: SubmitPrompt, pieces: list[list[int]]) -> list[Any]:
    """Deltas of several tokens each (``pieces``: indices into LPS), then Done."""
    rid = prompt.request_id
    deltas = [
        TextDelta(
            request_id=rid,
            text="".join(LPS[i].token for i in idx),
            tokens=len(idx),
            prompt_tokens=PROMPT_TOKENS if k == 0 else None,
            logprobs=[LPS[i] for i in idx] if prompt.logprobs else None,
        )
        for k, idx in enumerate(pieces)
    ]
    text = "".join(d.text for d in deltas)
    n = sum(len(idx) for idx in pieces)
    done = Done(request_id=rid, final_text=text, tokens_generated=n, elapsed_ms=1,
                stop_reason="max_tokens", prompt_tokens=PROMPT_TOKENS)  # fmt: skip
    return [*deltas, done]


async def test_chat_logprobs_streamed_and_not_in_openais_shape(fake):
    fake.script = lambda p: _with_logprobs(p, [[0], [1, 2]])
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True,
            "top_logprobs": 2}  # fmt: skip
    r = await fake.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "Hello END"
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == ["Hel", "lo", " END"]
    assert content[0] == {
        "token": "Hel",
        "logprob": -0.5,
        "bytes": list(b"Hel"),
        "top_logprobs": [
            {"token": "Hel", "logprob": -0.5, "bytes": list(b"Hel")},
            {"token": "Hi", "logprob": -1.0, "bytes": list(b"Hi")},
        ],
    }
    assert (fake.prompts[-1].logprobs, fake.prompts[-1].top_logprobs) == (True, 2)
    r = await fake.http.post("/v1/chat/completions", json={**body, "stream": True})
    events = _events(r)
    assert events[0]["choices"][0]["logprobs"] is None  # the role chunk
    texts = [e["choices"][0]["delta"].get("content") for e in events[1:-2]]
    lps = [[c["token"] for c in e["choices"][0]["logprobs"]["content"]] for e in events[1:-2]]
    assert (texts, lps) == (["Hel", "lo END"], [["Hel"], ["lo", " END"]])
    assert events[-2]["choices"][0]["logprobs"] is None and events[-1] == "[DONE]"


async def test_completion_logprobs_with_offsets_and_a_stop_string(fake):
    fake.script = lambda p: _with_logprobs(p, [[0, 1], [2, 3]])
    body = {"model": MODEL, "prompt": "x", "logprobs": 1, "stop": "ND x"}
    r = await fake.http.post("/v1/completions", json=body)
    choice = r.json()["choices"][0]
    # The stop string cuts " END x" after " E": the token that begins before it stays.
    assert (choice["text"], choice["finish_reason"]) == ("Hello E", "stop")
    assert choice["logprobs"] == {
        "tokens": ["Hel", "lo", " END"],
        "token_logprobs": [-0.5, -0.25, -0.75],
        "top_logprobs": [{"Hel": -0.5, "Hi": -1.0}, {"lo": -0.25, "p": -2.0},
                         {" END": -0.75, "!": -1.5}],
        "text_offset": [0, 3, 5],
    }  # fmt: skip
    r = await fake.http.post("/v1/completions", json={**body, "stream": True, "stop": None})
    events = _events(r)[:-1]
    got = [e["choices"][0]["logprobs"] for e in events]
    assert [g["tokens"] for g in got[:-1]] == [["Hel", "lo"], [" END", " x"]]
    assert [g["text_offset"] for g in got[:-1]] == [[0, 3], [5, 9]]
    assert got[-1] is None  # the finish chunk


async def test_no_logprobs_unless_asked_and_none_where_the_text_came_whole(fake):
    fake.script = lambda p: _with_logprobs(p, [[0, 1]])
    r = await fake.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.json()["choices"][0]["logprobs"] is None
    prompt = fake.prompts[-1]
    assert "logprobs" not in prompt.model_dump(exclude_defaults=True)  # an old run reads it
    # A run-hosted prompt whose text came whole with its end carries none.
    fake.script = lambda p: _with_logprobs(p, [[0, 1]])[-1:]
    r = await fake.http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "logprobs": 0})
    assert r.json()["choices"][0]["text"] == "Hello"
    assert r.json()["choices"][0]["logprobs"] is None


def test_a_delta_cut_where_the_reader_switches_streams_keeps_only_its_new_tokens_logprobs():
    """A reader that goes on from another stream (temporal.client.text.cut) has the first
    characters of a delta already: their tokens' logprobs too."""
    from temporal.client.text import cut

    delta = TextDelta(request_id=1, text="Hello END", tokens=3, logprobs=LPS[:3])
    rest, left = cut(delta, 4)  # "Hell": "Hel" is had, "lo" is half had: kept
    assert rest is not None and left == 0
    assert (rest.text, [e.token for e in rest.logprobs or ()]) == ("o END", ["lo", " END"])
    assert cut(delta, 9) == (None, 0)
    plain, _ = cut(TextDelta(request_id=1, text="abc", tokens=1), 1)
    assert plain is not None and plain.logprobs is None
