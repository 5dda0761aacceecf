"""Issue 12, the OpenAI-compatible gateway (`mvp-gateway`, docs/gateway.md): the official
``openai`` client and raw HTTP against the gateway app (uvicorn, in-process) in front of
one real 2-stage run of the bundled model, compared with ``submit_prompt`` on the same
run. One run serves the whole module (its fixture checks what ``runs`` checks)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from openai import AsyncOpenAI
from temporalio.client import Client, WorkflowExecutionStatus

from mvp_core import names
from mvp_core.models import ChatMessage, Done, RequestShutdown, RunPhase, SubmitPrompt
from temporal.client import RunHandle
from tests.helpers.runs import log_sizes, task_failures
from tests.helpers.waits import eventually
from tests.integration.conftest import (
    REPO,
    OrchestratorProcess,
    Runs,
    node_processes,
    snapshot,
    wait_closed,
    wait_phase,
    wait_state,
)
from workers.gateway.app import create_app
from workers.gateway.main import SignallessServer
from workers.gateway.runs import RunSpec
from workers.node.engine.tokenizer import Tokenizer

RUN = 3301
GHOST = 3399  # never started
MODEL = "SmolLM2-135M-Instruct.Q4_1"
TEXT = "The capital of France is"
QUESTION = "What is the capital of France?"
# Greedy SmolLM2 counts on and on: a prompt that lasts until the context is full.
ENDLESS = "1, 2, 3, 4, 5, 6, 7, 8,"
N = 24  # max_tokens of the compared prompts


class Site:
    def __init__(self, client: Client, handle: Any, url: str, tok: Tokenizer) -> None:
        self.client = client
        self.handle = handle
        self.url = url
        self.tok = tok
        self.oai = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        self.http = httpx.AsyncClient(base_url=url, timeout=60)
        self._next = 1

    def rid(self) -> int:
        self._next += 1
        return self._next

    async def reference(self, text: str, *, chat: bool = False, max_tokens: int = N) -> Done:
        done = await RunHandle(self.client, RUN).submit(
            SubmitPrompt(request_id=self.rid(), prompt_text=text, chat=chat, max_tokens=max_tokens),
        )
        assert isinstance(done, Done), done
        return done

    async def prompt_status(self, response_id: str | None, timeout: float = 15.0) -> str:
        """How the prompt behind a response ended (its workflow's MvpPromptStatus); None:
        the prompt the run admitted last."""
        request_id = None if response_id is None else int(response_id.rsplit("-", 1)[1])
        state = await snapshot(self.handle)
        wf = next(
            r.detail
            for r in reversed(state.lifecycle)
            if r.kind.value == "PromptAccepted" and request_id in (None, r.request_id)
        )
        child = self.client.get_workflow_handle(wf)

        async def ended() -> str | None:
            desc = await child.describe()
            if desc.status is WorkflowExecutionStatus.RUNNING:
                return None
            return str(desc.search_attributes.get(names.SEARCH_ATTRIBUTE_PROMPT, ["?"])[0])

        return await eventually(ended, timeout=timeout, what=f"{wf} to end", interval=0.1)


@contextlib.asynccontextmanager
async def serve(client: Client, run_id: int | Sequence[RunSpec]) -> AsyncIterator[str]:
    """The gateway app of ``run_id`` (or of several runs) on a free loopback port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        create_app(client, run_id), log_level="warning", lifespan="on", timeout_graceful_shutdown=2
    )
    server = SignallessServer(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))

    def started() -> bool:
        assert not task.done(), task.exception()
        return bool(server.started)

    await eventually(started, timeout=30, what="the gateway to start", interval=0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 20)


@contextlib.asynccontextmanager
async def openai_on_run(
    client: Client,
    orchestrator: OrchestratorProcess,
    state_dir: Path,
    faults_file: Path,
    run_id: int,
) -> AsyncIterator[AsyncOpenAI]:
    """The official ``openai`` client on a gateway over run ``run_id``: a real 2-stage run
    of the bundled model generating up to 4 prompts at once, shut down at the end, which
    then checks that it completed, no workflow task failed and no node is left."""
    runs = Runs(client, orchestrator, faults_file)
    seen = log_sizes(orchestrator.log_dir)
    handle = await runs.start(
        run_id, pipeline_stages=2, max_active_prompts=4, prompt_queue_capacity=8, max_context=512
    )
    try:
        async with serve(client, run_id) as url:
            await wait_phase(handle, RunPhase.PROMPT_READY, timeout=120)
            api = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            yield api
            await api.close()
        await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=run_id))
        assert await wait_closed(handle) is WorkflowExecutionStatus.COMPLETED
        assert not task_failures(orchestrator.log_dir, since=seen)
        assert not node_processes(state_dir)
    finally:
        with contextlib.suppress(Exception):
            await handle.terminate("test clean-up")
        for p in node_processes(state_dir):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
async def site(
    client: Client, orchestrator: OrchestratorProcess, state_dir: Path, faults_file: Path
) -> AsyncIterator[Site]:
    runs = Runs(client, orchestrator, faults_file)
    seen = log_sizes(orchestrator.log_dir)
    handle = await runs.start(
        RUN, pipeline_stages=2, prompt_queue_capacity=2, max_context=4096, default_max_tokens=64
    )
    try:
        async with serve(client, RUN) as url:
            # While the run starts, the gateway answers 503 (the run is not prompt-ready).
            async with httpx.AsyncClient(base_url=url) as http:
                early = await http.post(
                    "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}
                )
            assert early.status_code == 503, early.text
            assert early.json()["error"]["code"] in ("run_not_ready", "run_not_found"), early.text
            state = await wait_phase(handle, RunPhase.PROMPT_READY, timeout=120)
            assert state.plan is not None
            tok = Tokenizer.from_gguf(state.plan.tokenizer_path)
            s = Site(client, handle, url, tok)
            yield s
            await s.http.aclose()
            await s.oai.close()
        await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=RUN))
        assert await wait_closed(handle) is WorkflowExecutionStatus.COMPLETED
        assert not task_failures(orchestrator.log_dir, since=seen)
        assert not node_processes(state_dir)
    finally:
        with contextlib.suppress(Exception):
            await handle.terminate("test clean-up")
        for p in node_processes(state_dir):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)


async def _first_chunk(stream: Any) -> float:
    t0 = time.perf_counter()
    async for _ in stream:
        return time.perf_counter() - t0
    raise AssertionError("empty stream")


# --------------------------------------------------------------------------- 1. texts


async def test_models_lists_the_runs_model(site: Site):
    models = await site.oai.models.list()
    assert [m.id for m in models.data] == [MODEL]
    m = models.data[0]
    assert m.object == "model" and m.owned_by == "mvp-orchestrator" and m.created > 0
    assert (await site.oai.models.retrieve(MODEL)).id == MODEL


async def test_completion_equals_submit_prompt_streamed_and_not(site: Site):
    ref = await site.reference(TEXT)
    assert ref.stop_reason == "max_tokens" and ref.tokens_generated == N
    prompt_tokens = len(site.tok.encode(TEXT))
    whole = await site.oai.completions.create(model=MODEL, prompt=TEXT, max_tokens=N, temperature=0)
    assert whole.object == "text_completion" and whole.model == MODEL
    assert whole.choices[0].text == ref.final_text
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt_tokens, N)
    assert whole.usage.total_tokens == prompt_tokens + N

    stream = await site.oai.completions.create(
        model=MODEL,
        prompt=TEXT,
        max_tokens=N,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.final_text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == N
    assert chunks[-1].usage.prompt_tokens == prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1 and chunks[0].id != whole.id


async def test_n_choices_are_each_the_single_choice_of_their_seed(site: Site):
    """n=2 with the official client (the run holds 2 prompts): each choice is the completion a request of seed
    s + i alone gives (its own sequence in the run's batch), streamed and not."""
    kw: dict[str, Any] = {"model": MODEL, "prompt": TEXT, "max_tokens": 6, "temperature": 0.9}
    alone = [
        (await site.oai.completions.create(**kw, seed=500 + i)).choices[0].text for i in range(2)
    ]
    whole = await site.oai.completions.create(**kw, seed=500, n=2)
    assert [c.index for c in whole.choices] == [0, 1]
    assert [c.text for c in whole.choices] == alone
    assert whole.usage is not None and whole.usage.completion_tokens == 12
    stream = await site.oai.completions.create(**kw, seed=500, n=2, stream=True)
    texts = ["", ""]
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == alone


async def test_chat_equals_submit_prompt_of_the_chat_template(site: Site):
    ref = await site.reference(QUESTION, chat=True)
    rendered = site.tok.apply_chat_template([{"role": "user", "content": QUESTION}])
    prompt_tokens = len(site.tok.encode(rendered, parse_special=True))
    messages: Any = [{"role": "user", "content": QUESTION}]
    whole = await site.oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=N, temperature=0
    )
    assert whole.object == "chat.completion"
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == ref.final_text
    assert choice.finish_reason == ("stop" if ref.stop_reason == "eos" else "length")
    assert whole.usage is not None and whole.usage.prompt_tokens == prompt_tokens
    assert whole.usage.completion_tokens == ref.tokens_generated

    stream = await site.oai.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=N,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.final_text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == ref.tokens_generated

    # A whole conversation goes to the run as messages: rendered on the head node with the
    # model's template, its control tokens encoded as such (not as their characters).
    convo = [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": QUESTION},
    ]
    ref2 = await RunHandle(site.client, RUN).submit(
        SubmitPrompt(
            request_id=site.rid(),
            prompt_text="",
            chat=True,
            messages=[ChatMessage(**m) for m in convo],
            max_tokens=N,
        ),
    )
    assert isinstance(ref2, Done), ref2
    as_text = await site.reference(site.tok.apply_chat_template(convo))
    two: Any = convo
    got = await site.oai.chat.completions.create(
        model=MODEL, messages=two, max_tokens=N, temperature=0
    )
    assert got.choices[0].message.content == ref2.final_text
    rendered2 = site.tok.apply_chat_template(convo)
    assert got.usage is not None
    assert got.usage.prompt_tokens == len(site.tok.encode(rendered2, parse_special=True))
    assert len(site.tok.encode(rendered2, parse_special=True)) < len(
        site.tok.encode(rendered2, parse_special=False)
    )  # the control tokens are single tokens
    print(f"\nconversation as messages: {ref2.final_text!r}; as plain text: {as_text.final_text!r}")


async def test_stop_string_cuts_the_text_and_cancels_the_prompt(site: Site):
    # The counting prompt goes on for hundreds of tokens: the prompt surely outlives the
    # stop string, and its workflow then says it was cancelled, not done.
    ref = await site.reference(ENDLESS, max_tokens=N)
    words = ref.final_text.split()
    stop = f" {words[3]}"  # a word some way in: the text is cut before its first occurrence
    cut = ref.final_text[: ref.final_text.index(stop)]
    assert cut
    whole = await site.oai.completions.create(
        model=MODEL, prompt=ENDLESS, max_tokens=400, temperature=0, stop=[stop, "\u2603never"]
    )
    assert whole.choices[0].text == cut
    assert whole.choices[0].finish_reason == "stop"
    assert await site.prompt_status(whole.id) == "cancelled"  # not 400 tokens later
    # Re-attached, the completion is what the original response was: the same stop
    # strings cut it (the run generated past the stop string until its cancel).
    again = (await site.http.get(f"/v1/completions/{whole.id}")).json()
    assert again["choices"][0]["text"] == cut, again
    assert again["choices"][0]["finish_reason"] == "stop" and "mvp_status" not in again
    viewed: list[str] = []
    finishes: list[str | None] = []
    async with site.http.stream("GET", f"/v1/completions/{whole.id}?stream=true") as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                (choice,) = json.loads(line[6:])["choices"]
                viewed.append(choice["text"])
                finishes.append(choice["finish_reason"])
    assert "".join(viewed) == cut and finishes[-1] == "stop" and set(finishes[:-1]) <= {None}

    stream = await site.oai.completions.create(
        model=MODEL, prompt=ENDLESS, max_tokens=400, temperature=0, stop=stop, stream=True
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert await site.prompt_status(chunks[0].id) == "cancelled"


# --------------------------------------------------------------------------- 2. going away


async def test_a_client_that_goes_away_cancels_its_prompt_at_once(site: Site):
    async def ttft() -> float:
        stream = await site.oai.completions.create(
            model=MODEL, prompt=TEXT, max_tokens=4, temperature=0, stream=True
        )
        t = await _first_chunk(stream)
        async for _ in stream:
            pass
        return t

    idle = min([await ttft() for _ in range(2)])
    body = {"model": MODEL, "prompt": ENDLESS, "max_tokens": 4000, "temperature": 0, "stream": True}
    async with site.http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.aiter_lines()
        first = await anext(lines)
        assert first.startswith("data: ")
        abandoned = json.loads(first[6:])["id"]
    t0 = time.perf_counter()
    after = await ttft()
    status = await site.prompt_status(abandoned, timeout=30)
    took = time.perf_counter() - t0
    print(f"\nGATEWAY idle TTFT {idle:.3f} s; after a disconnect {after:.3f} s; ended {took:.3f} s")
    assert status == "cancelled"
    # The abandoned prompt had ~4000 tokens to go (25 s or more here); the next one waits
    # only for its cancellation.
    assert after < idle + 5.0, (idle, after)
    # Cancelled, not run out: ended in under a second here quiet, 14 s once on a
    # CI host with every core busy (the chain of workflow tasks behind a cancel); the
    # abandoned prompt's own 4000 tokens take far longer than this bound.
    assert took < 30, took

    # Not streamed: the same, when the client gives up waiting.
    with pytest.raises(httpx.ReadTimeout):
        await site.http.post("/v1/completions", json={**body, "stream": False}, timeout=1.0)
    assert await site.prompt_status(None) == "cancelled"


async def test_a_viewer_reattaches_by_the_completion_id_mid_stream_and_after(site: Site):
    """GET /v1/chat/completions/{id}: a second client attaches to a streaming completion
    mid-generation and gets its whole text and one finish; after the end, the whole."""
    ref = await site.reference(TEXT, chat=True, max_tokens=48)
    stream = await site.oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": TEXT}],
        max_tokens=48,
        temperature=0,
        stream=True,
    )
    original: list[str] = []
    ident = ""
    async for chunk in stream:
        ident = chunk.id
        if chunk.choices and chunk.choices[0].delta.content:
            original.append(chunk.choices[0].delta.content)
            if len(original) >= 2:
                break  # mid-generation: the viewer comes now, the original reads on
    viewed: list[str] = []
    finishes: list[str | None] = []
    async with site.http.stream("GET", f"/v1/chat/completions/{ident}?stream=true") as resp:
        assert resp.status_code == 200, await resp.aread()
        reading = asyncio.ensure_future(_drain(stream, original))
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert event["id"] == ident
            (choice,) = event["choices"]
            viewed.append(choice["delta"].get("content") or "")
            if choice["finish_reason"] is not None or "mvp_status" in event:
                finishes.append(choice["finish_reason"])
        await reading
    assert "".join(viewed) == "".join(original) == ref.final_text
    expected = "stop" if ref.stop_reason == "eos" else "length"
    assert finishes == [expected]
    # After the end, not streamed: the stored completion, as OpenAI's retrieve gives it.
    got = (await site.http.get(f"/v1/chat/completions/{ident}")).json()
    assert got["object"] == "chat.completion" and got["id"] == ident
    assert got["choices"][0]["message"]["content"] == ref.final_text
    assert got["choices"][0]["finish_reason"] == expected
    assert got["usage"]["completion_tokens"] == ref.tokens_generated
    # The same through the completions route, and the refusals.
    done = await site.oai.completions.create(model=MODEL, prompt=TEXT, max_tokens=8)
    again = (await site.http.get(f"/v1/completions/{done.id}")).json()
    assert again["choices"][0]["text"] == done.choices[0].text
    for bad, word in [
        (f"/v1/chat/completions/{done.id}", "expected chatcmpl"),
        (f"/v1/completions/cmpl-{RUN + 1}-1", f"belongs to run {RUN + 1}"),
        (f"/v1/completions/cmpl-{RUN}-987654", "No completion found"),
    ]:
        resp = await site.http.get(bad)
        assert resp.status_code == 404, (bad, resp.text)
        assert word in resp.json()["error"]["message"], resp.text


async def _until_pending(site: Site, n: int, timeout: float = 30.0) -> None:
    await wait_state(
        site.handle, lambda s: len(s.pending) >= n, f"{n} pending prompt(s)", timeout=timeout
    )


async def test_a_prompt_past_the_context_is_a_400_by_the_head_nodes_count(site: Site):
    """The head node encodes the prompt and refuses it, typed (PromptTooLong); the
    gateway answers 400 context_length_exceeded with the node's count, streamed or not,
    before any byte of a stream, and the run serves on."""
    long = "1, 2, 3, 4, 5, 6, 7, 8, " * 400
    n = len(site.tok.encode(long))
    assert n > 4096, n
    for stream in (False, True):
        resp = await site.http.post(
            "/v1/completions", json={"model": MODEL, "prompt": long, "stream": stream}
        )
        assert resp.status_code == 400, resp.text
        assert resp.headers["content-type"].startswith("application/json")
        err = resp.json()["error"]
        assert (err["code"], err["param"]) == ("context_length_exceeded", "prompt"), err
        assert f"maximum context length is 4096 tokens; your prompt has {n} " in err["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        await site.oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": long}], stream=True
        )
    assert (refused.value.code, refused.value.param) == ("context_length_exceeded", "messages")
    ok = await site.oai.completions.create(model=MODEL, prompt=TEXT, max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason == "length"


async def _drain(stream: Any, into: list[str]) -> None:
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            into.append(chunk.choices[0].delta.content)


# --------------------------------------------------------------------------- 3. errors


async def test_http_errors_in_openai_shape(site: Site, client: Client):
    http = site.http

    def error(resp: httpx.Response, status: int, code: str | None) -> dict[str, Any]:
        assert resp.status_code == status, resp.text
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err
        return dict(err)

    bad = await http.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    error(bad, 400, "invalid_json")
    missing = await http.post("/v1/chat/completions", json={"model": MODEL})
    assert error(missing, 400, "missing_required_parameter")["param"] == "messages"
    wrong = await http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1}
    )
    assert error(wrong, 400, "invalid_value")["param"] == "max_tokens"
    five = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 5})
    assert error(five, 400, "invalid_value")["param"] == "n"
    unknown = await http.post(
        "/v1/chat/completions",
        json={"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert error(unknown, 404, "model_not_found")["param"] == "model"
    error(await http.get("/v1/models/gpt-4o"), 404, "model_not_found")
    error(await http.get("/v1/nothing"), 404, "not_found")
    with pytest.raises(openai.NotFoundError):
        await site.oai.completions.create(model="gpt-4o", prompt="x")
    with pytest.raises(openai.BadRequestError):
        await site.oai.completions.create(model=MODEL, prompt="x", stop=["a", "b", "c", "d", "e"])

    # A full queue (capacity 2: one active, one pending): 429, and the two go away. A
    # stream commits to 200 only at its prompt's first event, so the pending one (no
    # event until its turn) waits in a task until the run shows it queued.
    body = {"model": MODEL, "prompt": ENDLESS, "max_tokens": 1000, "temperature": 0, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as active:
        assert active.status_code == 200
        pending = asyncio.ensure_future(http.post("/v1/completions", json=body))
        try:
            await _until_pending(site, 1)
            full = await http.post("/v1/completions", json={**body, "stream": False})
            error(full, 429, "prompt_queue_full")
            assert full.headers["retry-after"] == "1"
            with pytest.raises(openai.RateLimitError):
                await site.oai.completions.create(model=MODEL, prompt="x", max_tokens=1)
        finally:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pending
    # The two are cancelled: the run serves again (once their cancellations land; the
    # client's own retries, on Retry-After, cover that).
    retrying = site.oai.with_options(max_retries=5)
    ok = await retrying.completions.create(model=MODEL, prompt=TEXT, max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason == "length"

    # A run that does not exist: 503, and the models list says so too.
    async with serve(client, GHOST) as url, httpx.AsyncClient(base_url=url) as ghost:
        gone = await ghost.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert error(gone, 503, "run_not_found")["type"] == "server_error"
        error(await ghost.get("/v1/models"), 503, "run_not_found")
        assert (await ghost.get("/health")).status_code == 503
    assert (await http.get("/health")).json()["phase"] == "prompt_ready"


# --------------------------------------------------------------------------- the command


async def test_the_command_serves_an_existing_run_and_leaves_it_running(
    site: Site, temporal_server: Any
):
    env = {**os.environ, "TEMPORAL_ADDRESS": temporal_server.address}
    bad = subprocess.run(
        [sys.executable, "-m", "workers.gateway.main", "--workflow-id", "run-1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 1 and bad.stderr.strip().splitlines() == [
        "mvp-gateway: invalid --workflow-id 'run-1': use mvp-run-N"
    ], bad.stderr
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "workers.gateway.main",
            "--workflow-id",
            names.run_workflow_id(RUN),
            "--listen",
            "127.0.0.1:0",
            "--log-level",
            "warning",
        ],
        env=env,
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stderr.readline), 60)
        url = line.split(" at ")[1].split()[0]
        async with AsyncOpenAI(base_url=url, api_key="unused", max_retries=0) as oai:
            got = await oai.completions.create(
                model=MODEL, prompt=TEXT, max_tokens=3, temperature=0
            )
        assert got.choices[0].finish_reason == "length"
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (await site.handle.describe()).status is WorkflowExecutionStatus.RUNNING


async def test_the_command_beyond_loopback_needs_keys_and_answers_only_them(
    site: Site, temporal_server: Any, tmp_path: Path
):
    """Listening beyond loopback without keys is refused; with keys (a file and the
    environment) the official client gets 401 without the right one, and its answer with
    it; no key reaches the gateway's output."""
    key, other = "sk-mvp-file-0123456789", "sk-mvp-env-9876543210"
    env = {**os.environ, "TEMPORAL_ADDRESS": temporal_server.address}
    cmd = [
        sys.executable,
        "-m",
        "workers.gateway.main",
        "--workflow-id",
        names.run_workflow_id(RUN),
    ]
    refused = subprocess.run(
        [*cmd, "--listen", "0.0.0.0:0"], env=env, capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 1 and "needs API keys" in refused.stderr, refused.stderr
    keys = tmp_path / "keys"
    keys.write_text(f"# ours\n{key}\n")
    proc = subprocess.Popen(
        [*cmd, "--listen", "0.0.0.0:0", "--api-key-file", str(keys), "--log-level", "info"],
        env={**env, "MVP_GATEWAY_API_KEYS": other},
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = ""
        while " at http://" not in line:  # uvicorn's own lines come first at info
            line = await asyncio.wait_for(asyncio.to_thread(proc.stderr.readline), 60)
            assert line, "the gateway exited"
        port = line.split(" at http://")[1].split()[0].rsplit(":", 1)[1].split("/")[0]
        url = f"http://127.0.0.1:{port}/v1"
        async with AsyncOpenAI(base_url=url, api_key="sk-wrong-0123456789", max_retries=0) as oai:
            with pytest.raises(openai.AuthenticationError) as err:
                await oai.completions.create(model=MODEL, prompt=TEXT, max_tokens=2)
            assert err.value.code == "invalid_api_key"
        for good in (key, other):
            async with AsyncOpenAI(base_url=url, api_key=good, max_retries=0) as oai:
                got = await oai.completions.create(
                    model=MODEL, prompt=TEXT, max_tokens=2, temperature=0
                )
                assert got.usage is not None and got.usage.completion_tokens == 2
        proc.send_signal(signal.SIGTERM)
        out, rest = await asyncio.to_thread(proc.communicate, timeout=30)
        assert proc.returncode == 0, rest
        assert key not in line + rest + out and other not in line + rest + out
        assert '"POST /v1/completions HTTP/1.1" 401' in out  # the refusal, never the key
    finally:
        if proc.poll() is None:
            proc.kill()


async def test_the_command_starts_a_run_and_shuts_it_down_on_sigterm(
    site: Site, client: Client, temporal_server: Any, tmp_path: Path
):
    request = tmp_path / "run.json"
    request.write_text(json.dumps({"model": {"bundled": MODEL}, "default_max_tokens": 8}))
    env = {**os.environ, "TEMPORAL_ADDRESS": temporal_server.address}
    cmd = [sys.executable, "-m", "workers.gateway.main", "--run-request", str(request)]
    proc = subprocess.Popen(
        [*cmd, "--run-id", str(RUN + 1), "--listen", "127.0.0.1:0", "--log-level", "warning"],
        env=env,
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    handle = client.get_workflow_handle(names.run_workflow_id(RUN + 1))
    try:
        assert proc.stderr is not None
        lines: list[str] = []
        while not lines or "is prompt-ready:" not in lines[-1]:
            line = await asyncio.wait_for(asyncio.to_thread(proc.stderr.readline), 120)
            assert line, lines
            lines.append(line)
        url = lines[-1].split(" at ")[1].split()[0]
        async with AsyncOpenAI(base_url=url, api_key="unused", max_retries=0) as oai:
            got = await oai.completions.create(
                model=MODEL, prompt=TEXT, max_tokens=3, temperature=0
            )
        assert got.usage is not None and got.usage.completion_tokens == 3
        pids = sorted(
            n.handle.pid for n in (await snapshot(handle)).nodes if n.handle and n.handle.pid
        )
        proc.send_signal(signal.SIGTERM)
        rest = await asyncio.to_thread(proc.communicate, timeout=60)
        assert proc.returncode == 0, rest
        assert "closed: operator_stopped" in rest[1], rest
        assert (await handle.describe()).status is WorkflowExecutionStatus.COMPLETED
        assert pids and not [p for p in pids if _alive(p)], pids
        # It refuses a run that exists already.
        again = subprocess.run(
            [*cmd, "--run-id", str(RUN), "--listen", "127.0.0.1:0"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert again.returncode == 1, again.stderr
        assert (
            again.stderr.strip()
            .splitlines()[-1]
            .startswith(f"mvp-gateway: run mvp-run-{RUN} exists already")
        ), again.stderr
    finally:
        if proc.poll() is None:
            proc.kill()
        with contextlib.suppress(Exception):
            await handle.terminate("test clean-up")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
