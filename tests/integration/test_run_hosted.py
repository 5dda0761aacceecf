"""Issue 22, DECISIONS 66: a run whose ``prompt_host`` is ``run`` serves each prompt in its
own ``submit_prompt`` Update, with no PromptWorkflow.

Real 2-stage runs of the bundled model on local node processes, 8 prompts active at once:
each prompt's text is its text alone, no prompt workflow is ever started, a cancel of one
of eight ends it cancelled while the other seven finish, a client that cannot read the
head node gets the whole text with one end, a re-attach mid-stream and after the end gets
the whole text and one end, the run's history grows by the same few events per prompt
whatever its length, and a head node killed under eight ends each with one fault.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from temporalio.client import WorkflowExecutionStatus, WorkflowQueryFailedError

from mvp_core import names
from mvp_core.edge_auth import EDGE_SECRET_ENV
from mvp_core.models import Done, Fault, RunPhase, ShutdownReason, SubmitPrompt, TextDelta
from temporal.client import RunHandle
from tests.integration.conftest import REPO, Runs, wait_closed, wait_phase
from tests.integration.test_gateway import serve
from tests.integration.test_serve import COUNTING, TEXTS, _prompt, _stream_all, kill_under_eight

MODEL = "SmolLM2-135M-Instruct.Q4_1"

HOSTED: dict[str, Any] = {
    "pipeline_stages": 2,
    "max_active_prompts": 8,
    "prompt_queue_capacity": 2,
    "max_context": 1024,
    "prompt_host": "run",
    "layer_split": "balanced",  # DECISIONS 67: the output head weighs 8 layers here
}


async def _prompt_workflows(run: RunHandle) -> int:
    prefix = names.prompt_workflow_id(run.run_id, 0, "").rsplit("-", 2)[0]
    query = f"WorkflowType = '{names.PROMPT_WORKFLOW}' AND WorkflowId STARTS_WITH '{prefix}-'"
    return len([wf async for wf in run.client.list_workflows(query)])


async def _run_events(run: RunHandle) -> int:
    return len([e async for e in run.workflow.fetch_history_events()])


async def test_a_run_hosted_prompt_is_served_streamed_cancelled_and_re_attached(
    runs: Runs, temporal_server: Any, tmp_path: Path
):
    run_id = 2240
    handle = await runs.start(run_id, **HOSTED)
    state = await wait_phase(handle, RunPhase.PROMPT_READY, timeout=180)
    assert state.prompt_host.value == "run"
    assert state.plan is not None
    assert [(s.layers.start, s.layers.end) for s in state.plan.stages] == [(0, 19), (19, 30)]
    run = RunHandle(runs.client, run_id)

    # 8 at once: each prompt's text alone, greedy and seeded.
    greedy: list[Done | Fault] = []
    for seeded in (False, True):
        base = 100 if seeded else 0
        alone = [await run.submit(_prompt(base + i, t, seeded)) for i, t in enumerate(TEXTS)]
        together = await asyncio.gather(
            *(run.submit(_prompt(base + 50 + i, t, seeded)) for i, t in enumerate(TEXTS))
        )
        for a, b in zip(alone, together, strict=True):
            assert isinstance(a, Done) and isinstance(b, Done), (a, b)
            assert (b.final_text, b.tokens_generated) == (a.final_text, a.tokens_generated)
        greedy = greedy or list(together)
    assert (await run.snapshot()).most_active >= 2

    # The run's history per prompt does not grow with the prompt's length, streamed from
    # the head node or not.
    temporal_only = RunHandle(runs.client, run_id, direct_text=False)
    growth = []
    for rid, (reader, tokens) in enumerate(
        [(run, 32), (run, 512), (temporal_only, 32), (temporal_only, 512)], 200
    ):
        before = await _run_events(run)
        prompt = SubmitPrompt(request_id=rid, prompt_text=COUNTING, max_tokens=tokens)
        text, ends = await _stream_all(reader, prompt)
        # A client that cannot read the head node: the whole text, with its one end.
        assert len(ends) == 1 and isinstance(ends[0], Done), ends
        assert text == ends[0].final_text and ends[0].tokens_generated == tokens
        # An end the head node told with the text (DECISIONS 95) is counted by the run a
        # workflow task later.
        await reader.wait_ends_counted()
        growth.append(await _run_events(run) - before)
    assert run.direct_streams >= 2 and temporal_only.direct_streams == 0
    assert max(growth) - min(growth) <= 9, growth  # a workflow task or two either way

    # A prompt the head node generated in one go ends with its text's end line, which
    # carries its Done (DECISIONS 95): the client asks the run nothing for it, and it is
    # the run's own end.
    told = RunHandle(runs.client, run_id)
    text, ends = await _stream_all(
        told, SubmitPrompt(request_id=300, prompt_text=COUNTING, max_tokens=24)
    )
    assert told.direct_streams == 1 and len(ends) == 1 and isinstance(ends[0], Done), ends
    assert told._end_board is None, told._end_board.queries
    async with asyncio.timeout(60):  # the run counts it a workflow task or two later
        while (kept := await told.served(300)) is None:
            await asyncio.sleep(0.05)
    assert kept.outcome.terminal == ends[0] and text == ends[0].final_text

    # An early start (DECISIONS 103): a handle that knows the head node already hands it
    # the prompt with its text stream's request, before the run admits it; the idle head
    # starts it, and the prompt's generate adopts it. Its text is, bit for bit, the text
    # of the same prompt started by its generate (a handle's first: no head known yet).
    # A handle told not to (``MVP_EARLY_START=0`` for a whole process) never does.
    async def served(reader: RunHandle, rid: int) -> tuple[str, float | None]:
        prompt = SubmitPrompt(request_id=rid, prompt_text=COUNTING, max_tokens=48)
        text, ends = await _stream_all(reader, prompt)
        assert len(ends) == 1 and isinstance(ends[0], Done) and text == ends[0].final_text
        async with asyncio.timeout(60):
            while (kept := await reader.served(rid)) is None:
                await asyncio.sleep(0.05)
        timing = kept.outcome.timing
        assert timing is not None
        return text, timing.early_ms

    fresh = RunHandle(runs.client, run_id)
    plain = RunHandle(runs.client, run_id, early_start=False)
    alone, early_ms = await served(fresh, 310)
    assert early_ms is None
    # The start races the run's admission to the head (a loaded host can lose it): one
    # of ten is early.
    for rid in range(311, 321):
        text, early_ms = await served(fresh, rid)
        assert text == alone
        if early_ms is not None:
            break
    assert early_ms is not None and early_ms > 0
    for rid in (330, 331):
        assert await served(plain, rid) == (alone, None)

    # Cancel one of eight mid-stream: it ends cancelled, the other seven finish.
    victim = SubmitPrompt(request_id=40, prompt_text="1, 2, 3, 4, 5,", max_tokens=900)
    first_text = asyncio.Event()
    ending: list[Done | Fault] = []
    victim_text: list[str] = []
    victim_tokens: list[int] = []

    async def follow() -> None:
        async for event in run.stream(victim):
            if isinstance(event, TextDelta):
                victim_text.append(event.text)
                victim_tokens.append(event.tokens or 0)
                first_text.set()
            else:
                ending.append(event)

    streaming = asyncio.ensure_future(follow())
    others = [
        asyncio.ensure_future(run.submit(_prompt(i, t, False))) for i, t in enumerate(TEXTS[1:], 1)
    ]
    await asyncio.wait_for(first_text.wait(), 120)
    await run.cancel_prompt(40)
    await asyncio.wait_for(streaming, 60)
    assert len(ending) == 1 and isinstance(ending[0], Fault) and ending[0].error == "cancelled"
    # Its text so far travels with its end (no stream holds it): a client that cannot
    # read the head node gets it after the end too.
    assert ending[0].text and ending[0].text == "".join(victim_text)
    # With the tokens it holds, so that a usage summed from the deltas is whole.
    assert ending[0].tokens_generated == sum(victim_tokens) > 0
    late_cancel = [e async for e in temporal_only.attach(40)]
    assert late_cancel == [
        TextDelta(request_id=40, text=ending[0].text, tokens=ending[0].tokens_generated),
        ending[0],
    ]
    for i, b in enumerate(await asyncio.gather(*others), 1):
        g = greedy[i]
        assert isinstance(b, Done) and isinstance(g, Done), (b, g)
        assert (b.final_text, b.tokens_generated) == (g.final_text, g.tokens_generated)

    # Re-attach mid-stream (a direct-capable and a Temporal-only client), then after the
    # end: the whole text and one end each time.
    never = "\u2603never"
    fourth = SubmitPrompt(request_id=4, prompt_text=COUNTING, max_tokens=300, stop=[never])
    started = asyncio.Event()
    owner: list[Any] = []

    async def own() -> None:
        async for event in run.stream(fourth):
            started.set()
            owner.append(event)

    owning = asyncio.ensure_future(own())
    await asyncio.wait_for(started.wait(), 120)
    # In flight: located by its key; admitted by admit_prompt, no Update of it is open
    # (DECISIONS 77): a viewer waits on the run's prompt_end. The run has its stops.
    found = await run.locate(4)
    assert found is not None and found.hosted and found.served is None
    assert found.update_id is None
    assert await run.hosted_stops(4) == [never]
    for viewer in (RunHandle(runs.client, run_id), temporal_only):
        seen = [e async for e in viewer.attach(4)]
        assert sum(not isinstance(e, TextDelta) for e in seen) == 1
        assert isinstance(seen[-1], Done)
        assert "".join(e.text for e in seen if isinstance(e, TextDelta)) == seen[-1].final_text
    await asyncio.wait_for(owning, 120)
    # Many ends in one query (DECISIONS 78), in the order asked; an unknown key: None.
    # A malformed ask fails that query alone, saying what was wrong.
    ends = await handle.query(
        names.QUERY_PROMPT_ENDS, [found.workflow_id, "no-such-prompt"], result_type=list[Any]
    )
    assert ends[1] is None and ends[0]["open"] is False
    assert Done.model_validate(ends[0]["terminal"]) == owner[-1]
    for bad, says in (
        (["k"] * (names.PROMPT_ENDS_PER_QUERY + 1), "at most 256 prompt keys"),
        ([1, 2], "list of prompt keys"),
        ({"keys": 1}, "list of prompt keys"),
    ):
        with pytest.raises(WorkflowQueryFailedError, match=says):
            await handle.query(names.QUERY_PROMPT_ENDS, bad)
    for viewer in (RunHandle(runs.client, run_id), temporal_only):
        late = [e async for e in viewer.attach(4)]
        assert isinstance(late[-1], Done) and late[-1] == owner[-1]
        assert "".join(e.text for e in late if isinstance(e, TextDelta)) == late[-1].final_text

    await _through_the_gateway(runs, run_id)
    await _through_a_gateway_of_its_own(runs, run_id, temporal_server, tmp_path)
    assert await _prompt_workflows(run) == 0
    await run.shutdown_and_wait(ShutdownReason.OPERATOR_REQUESTED)
    assert await wait_closed(handle) is WorkflowExecutionStatus.COMPLETED
    # A closed run still answers for its last prompts (a worker replays it).
    late = [e async for e in RunHandle(runs.client, run_id).attach(4)]
    assert late[-1] == owner[-1]


async def _through_the_gateway(runs: Runs, run_id: int) -> None:
    """mvp-gateway's re-attach (GET /v1/completions/{id}) of a run-hosted completion, mid
    stream and after its end, cut at the request's stop strings as the original was."""
    async with (
        serve(runs.client, run_id) as url,
        httpx.AsyncClient(base_url=url, timeout=120) as http,
    ):
        body = {"model": MODEL, "prompt": COUNTING, "max_tokens": 200, "temperature": 0}
        whole = (await http.post("/v1/completions", json=body)).json()
        text = whole["choices"][0]["text"]
        stop = " " + text.split()[6]  # a word some way in
        cut = text[: text.index(stop)]
        stopped = (await http.post("/v1/completions", json={**body, "stop": [stop]})).json()
        assert stopped["choices"][0]["text"] == cut, stopped
        again = (await http.get(f"/v1/completions/{stopped['id']}")).json()
        assert again["choices"][0]["text"] == cut and again["choices"][0]["finish_reason"] == "stop"
        # Its tokens: at least those the original counted to the stop (the cancel that the
        # stop string sent lands a token or two later), never 0.
        assert again["usage"]["completion_tokens"] >= stopped["usage"]["completion_tokens"] > 0

        original: list[str] = []
        ident = ""
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
            lines = resp.aiter_lines()
            async for line in lines:
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    ident = event["id"]
                    original.append(event["choices"][0]["text"])
                    if len(original) >= 2:
                        break  # mid-generation: the viewer comes now
            viewer = await http.get(f"/v1/completions/{ident}")  # waits for the end
            async for line in lines:
                if line.startswith("data: {"):
                    original.append(json.loads(line[6:])["choices"][0]["text"])
        viewed = viewer.json()
        assert viewed["choices"][0]["text"] == "".join(original) == text, viewed


async def test_a_head_killed_while_eight_run_hosted_prompts_generate_ends_each_once(
    runs: Runs,
):
    request = {**HOSTED, "prompt_queue_capacity": 1}
    cause = await kill_under_eight(runs, 2241, 0, max_tokens=900, **request)
    assert "node" in cause or cause.startswith("prompt serving"), cause


async def _streamed_chunks(url: str, prompt: str, tokens: int) -> list[str]:
    """The text of each content chunk of a streamed /v1/completions, in order."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0}
    chunks: list[str] = []
    async with (
        httpx.AsyncClient(base_url=url, timeout=180) as http,
        http.stream("POST", "/completions", json={**body, "stream": True}) as resp,
    ):
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                text = json.loads(line[6:])["choices"][0]["text"]
                if text:
                    chunks.append(text)
    return chunks


async def _through_a_gateway_of_its_own(
    runs: Runs, run_id: int, temporal_server: Any, tmp_path: Path
) -> None:
    """DECISIONS 80: a gateway on a host of its own (its own state directory, no
    MVP_EDGE_SECRET) admits each prompt with a random key and reads its text with it
    straight from the head node: a run-hosted completion streams in many chunks, as
    through a gateway that holds the secret, not whole at its end, and the text is the
    same; the gateway's host never gets the secret."""
    own_state = tmp_path / "gateway-state"
    env = {k: v for k, v in os.environ.items() if k != EDGE_SECRET_ENV}
    env |= {"TEMPORAL_ADDRESS": temporal_server.address, "MVP_STATE_DIR": str(own_state)}
    wf_id = names.run_workflow_id(run_id)
    gateway = ["workers.gateway.main", "--workflow-id", wf_id, "--listen", "127.0.0.1:0"]
    proc = subprocess.Popen(
        [sys.executable, "-m", *gateway, "--log-level", "warning"],
        env=env,
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stderr.readline), 60)
        url = line.split(" at ")[1].split()[0]
        apart = await _streamed_chunks(url, COUNTING, 120)
        async with serve(runs.client, run_id) as local:  # this host: it holds the secret
            together = await _streamed_chunks(f"{local}/v1", COUNTING, 120)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(proc.wait, 30)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert "".join(apart) == "".join(together)
    # Whole at the end would be one chunk; live, the head node's flushes (every 100 ms).
    assert len(apart) >= 3 and len(together) >= 3, (len(apart), len(together))
    assert not (own_state / "edge-secret").exists()
