"""Issue 37, one gateway over several runs (docs/gateway.md, DECISIONS 90): the official
``openai`` client and raw HTTP against the gateway app in front of real 1-stage runs of
both bundled models, SmolLM2 (two runs: replicas) and Gemma 3 270M. Each model's
request reaches its own run (its answer is that run's own, by ``submit``), an unknown
model is a 404, a run added through the admin API serves next, replicas share
concurrent requests (by the runs' own records), and a run terminated mid-stream leaves
``/v1/models`` while the other run's stream completes. One set of runs serves the
module (its fixture checks what ``runs`` checks)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle

from mvp_core import names
from mvp_core.models import Done, RequestShutdown, RunPhase, SubmitPrompt
from mvp_io.model_store import GEMMA3_BUNDLED
from temporal.client import RunHandle
from tests.helpers.runs import log_sizes, task_failures
from tests.helpers.waits import eventually
from tests.integration.conftest import (
    REPO,
    OrchestratorProcess,
    Runs,
    node_pids,
    node_processes,
    snapshot,
    wait_closed,
    wait_phase,
)
from tests.integration.test_gateway import serve
from workers.gateway.runs import RunSpec
from workers.gateway.service import model_id_of

SMOL_A, GEMMA, SMOL_B = 3711, 3712, 3713  # SMOL_B: added through the admin API
TEXT = "The capital of France is"
N = 8  # max_tokens: short, the suite's budget


class Site:
    def __init__(self, client: Client, url: str, handles: dict[int, WorkflowHandle[Any, Any]]):
        self.client = client
        self.url = url
        self.handles = handles
        self.models: dict[int, str] = {}  # run id -> its model id
        self.oai = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        self.http = httpx.AsyncClient(base_url=url, timeout=60)

    async def served_by(self, run_id: int) -> set[int]:
        """The request ids run ``run_id`` admitted, by its own records."""
        state = await snapshot(self.handles[run_id])
        return {
            r.request_id
            for r in state.lifecycle
            if r.kind.value == "PromptAccepted" and r.request_id is not None
        }


def _ids(response_id: str) -> tuple[int, int]:
    """(run id, request id) of a completion id ``cmpl-<run>-<request>``."""
    _, run, request = response_id.split("-")
    return int(run), int(request)


@pytest.fixture(scope="module")
async def site(
    client: Client, orchestrator: OrchestratorProcess, state_dir: Path, faults_file: Path
) -> AsyncIterator[Site]:
    runs = Runs(client, orchestrator, faults_file)
    seen = log_sizes(orchestrator.log_dir)
    handles = {
        SMOL_A: await runs.start(SMOL_A, max_context=512, max_active_prompts=1),
        GEMMA: await runs.start(GEMMA, model={"bundled": GEMMA3_BUNDLED}, max_context=512),
        SMOL_B: await runs.start(SMOL_B, max_context=512, max_active_prompts=2),
    }
    try:
        async with serve(client, [RunSpec(SMOL_A), RunSpec(GEMMA)]) as url:
            s = Site(client, url, handles)
            for run_id, handle in handles.items():
                state = await wait_phase(handle, RunPhase.PROMPT_READY, timeout=150)
                assert state.plan is not None
                s.models[run_id] = model_id_of(state.plan.model_path)
            yield s
            await s.http.aclose()
            await s.oai.close()
        for run_id in (SMOL_A, SMOL_B):
            await handles[run_id].signal(
                names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=run_id)
            )
        for run_id in (SMOL_A, SMOL_B):
            assert await wait_closed(handles[run_id]) is WorkflowExecutionStatus.COMPLETED
        assert not task_failures(orchestrator.log_dir, since=seen)
        await eventually(lambda: not node_processes(state_dir), timeout=20, what="nodes gone")
    finally:
        for handle in handles.values():
            with contextlib.suppress(Exception):
                await handle.terminate("test clean-up")
        for p in node_processes(state_dir):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)


async def test_models_lists_the_model_of_each_run(site: Site) -> None:
    smol, gemma = site.models[SMOL_A], site.models[GEMMA]
    assert (smol, gemma) == ("SmolLM2-135M-Instruct.Q4_1", "gemma-3-270m-q4_k_m")
    models = await site.oai.models.list()
    assert sorted(m.id for m in models.data) == sorted([smol, gemma])
    assert (await site.oai.models.retrieve(gemma)).id == gemma
    health = (await site.http.get("/health")).json()
    assert health["status"] == "ok"
    assert [(r["run"], r["ready"]) for r in health["runs"]] == [
        (names.run_workflow_id(SMOL_A), True),
        (names.run_workflow_id(GEMMA), True),
    ]


async def test_each_model_answers_from_its_own_run(site: Site) -> None:
    """The same greedy prompt to each model: each answer is its run's own (by submit on
    that run), the two differ, and the run's records hold the gateway's request."""
    answers = {}
    for run_id in (SMOL_A, GEMMA):
        got = await site.oai.completions.create(
            model=site.models[run_id], prompt=TEXT, max_tokens=N, temperature=0
        )
        ref = await RunHandle(site.client, run_id).submit(
            SubmitPrompt(request_id=run_id, prompt_text=TEXT, max_tokens=N)
        )
        assert isinstance(ref, Done)
        assert got.choices[0].text == ref.final_text, (run_id, got.choices[0].text)
        served_run, request_id = _ids(got.id)
        assert served_run == run_id and request_id in await site.served_by(run_id)
        answers[run_id] = ref.final_text
    assert answers[SMOL_A] != answers[GEMMA]


async def test_an_unknown_model_is_a_404_naming_it(site: Site) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        await site.oai.completions.create(model="gpt-4o", prompt=TEXT, max_tokens=1)
    assert err.value.status_code == 404
    assert err.value.body == {
        "message": "The model `gpt-4o` does not exist or you do not have access to it.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }


async def test_a_run_added_through_the_admin_api_serves_and_replicas_share_requests(
    site: Site,
) -> None:
    """SMOL_B added under an alias serves that alias at once; added again without one,
    it is a replica of SMOL_A: four concurrent requests spread over both runs (SMOL_A
    generates one prompt at a time, SMOL_B two: the gateway read that from the run)."""
    wid = names.run_workflow_id(SMOL_B)
    bad = await site.http.post("/admin/runs", json={"workflow_id": wid, "alias": "a b"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "alias"
    ghost = await site.http.post("/admin/runs", json={"workflow_id": "mvp-run-3799"})
    assert ghost.status_code == 400 and ghost.json()["error"]["code"] == "run_not_found"
    added = await site.http.post("/admin/runs", json={"workflow_id": wid, "alias": "smol-b"})
    assert added.status_code == 201, added.text
    got = await site.oai.completions.create(model="smol-b", prompt=TEXT, max_tokens=2)
    assert got.model == "smol-b" and _ids(got.id)[0] == SMOL_B
    assert _ids(got.id)[1] in await site.served_by(SMOL_B)
    assert len((await site.oai.models.list()).data) == 3

    assert (await site.http.delete(f"/admin/runs/{wid}")).status_code == 200
    assert len((await site.oai.models.list()).data) == 2
    assert (await site.http.post("/admin/runs", json={"workflow_id": wid})).status_code == 201

    async def known() -> bool:
        runs = (await site.http.get("/admin/runs")).json()["runs"]
        entry = next(e for e in runs if e["workflow_id"] == wid)
        return entry["model"] == site.models[SMOL_A] and entry["ready"]

    await eventually(known, timeout=15, what="the replica's model to be known")
    entries = (await site.http.get("/admin/runs")).json()["runs"]
    assert [e["max_active_prompts"] for e in entries] == [1, 1, 2]  # SMOL_A, GEMMA, SMOL_B
    assert sorted(m.id for m in (await site.oai.models.list()).data) == sorted(
        [site.models[SMOL_A], site.models[GEMMA]]
    )
    before = {run: await site.served_by(run) for run in (SMOL_A, SMOL_B)}
    got_all = await asyncio.gather(
        *(
            site.oai.completions.create(
                model=site.models[SMOL_A], prompt=TEXT, max_tokens=N, temperature=0
            )
            for _ in range(4)
        )
    )
    texts = {g.choices[0].text for g in got_all}
    assert len(texts) == 1  # replicas of one model: the same greedy text
    by_run: dict[int, set[int]] = {SMOL_A: set(), SMOL_B: set()}
    for g in got_all:
        run, request = _ids(g.id)
        by_run[run].add(request)
    for run in (SMOL_A, SMOL_B):
        records = await site.served_by(run) - before[run]
        assert records == by_run[run], run  # the run's own records say who served
        assert records, f"run {run} served none of the four"


async def test_the_command_serves_several_runs_by_repeated_workflow_ids(
    site: Site, temporal_server: Any
) -> None:
    env = {**os.environ, "TEMPORAL_ADDRESS": temporal_server.address}
    cmd = [sys.executable, "-m", "workers.gateway.main", "--listen", "127.0.0.1:0"]
    runs = ["--workflow-id", f"mvp-run-{SMOL_A}", "--workflow-id", f"mvp-run-{SMOL_B}=smol-b"]
    proc = subprocess.Popen(
        [*cmd, *runs, "--log-level", "warning"],
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
            ids = sorted(m.id for m in (await oai.models.list()).data)
            assert ids == sorted([site.models[SMOL_A], "smol-b"])
            got = await oai.completions.create(model="smol-b", prompt=TEXT, max_tokens=1)
            assert _ids(got.id)[0] == SMOL_B
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    for run_id in (SMOL_A, SMOL_B):  # attached, not owned: left running
        assert (await site.handles[run_id].describe()).status is WorkflowExecutionStatus.RUNNING


async def test_a_run_that_ends_mid_stream_leaves_and_the_others_stream_completes(
    site: Site,
) -> None:
    """Gemma's run is terminated while a Gemma stream and a SmolLM2 stream are open: the
    Gemma stream ends with run_ended, the SmolLM2 stream completes, and Gemma leaves
    /v1/models within seconds."""
    gemma, smol = site.models[GEMMA], site.models[SMOL_A]
    doomed = await site.oai.completions.create(
        model=gemma, prompt=TEXT, max_tokens=400, temperature=0, stream=True
    )
    assert (await anext(aiter(doomed))).choices  # generating
    other = await site.oai.completions.create(
        model=smol, prompt=TEXT, max_tokens=24, temperature=0, stream=True
    )
    first = await anext(aiter(other))
    pids = node_pids(await snapshot(site.handles[GEMMA]))
    await site.handles[GEMMA].terminate("the test ends the run mid-stream")
    try:
        with pytest.raises(openai.APIError) as err:
            async with asyncio.timeout(20):
                async for _ in doomed:
                    pass
        assert "ended (terminated)" in err.value.message, err.value.message
        assert (err.value.body or {}).get("code") == "run_ended", err.value.body
        text = first.choices[0].text if first.choices else ""
        finish = None
        async for chunk in other:
            for c in chunk.choices:
                text += c.text
                finish = c.finish_reason or finish
        assert finish == "length" and text

        async def gone() -> bool:
            ids = [m.id for m in (await site.oai.models.list()).data]
            return ids == [smol]

        await eventually(gone, timeout=5, what="the ended run to leave /v1/models")
        with pytest.raises(openai.NotFoundError):
            await site.oai.completions.create(model=gemma, prompt=TEXT, max_tokens=1)
    finally:
        for pid in pids:  # a terminated run tears nothing down
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
