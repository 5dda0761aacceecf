"""Web UI metadata: activity summaries, the prompt child's static summary/details and
the workflows' current details name nodes, stages, ids and phases, never user text."""

from __future__ import annotations

from temporalio.api.enums.v1 import EventType
from temporalio.api.sdk.v1 import WorkflowMetadata
from temporalio.client import Client, WorkflowHandle

from mvp_core import names
from mvp_core.models import Done, RequestShutdown, RunOutcome, RunPhase, SubmitPrompt
from temporal.client import RunHandle
from tests.integration.conftest import Runs, wait_phase

RUN_ID = 3501
PROMPT_TEXT = "Tell me about the lighthouse keeper Zebulon"


async def _details(handle: WorkflowHandle[object, object]) -> str:
    meta: WorkflowMetadata = await handle.query(
        "__temporal_workflow_metadata", result_type=WorkflowMetadata
    )
    return meta.current_details


async def _summaries(client: Client, handle: WorkflowHandle[object, object]) -> list[str]:
    history = await handle.fetch_history()
    conv = client.data_converter
    out = []
    for event in history.events:
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            assert event.user_metadata.HasField("summary"), event
            out.append((await conv.decode([event.user_metadata.summary]))[0])
    return out


async def test_web_ui_metadata_names_nodes_stages_and_ids(runs: Runs):
    handle = await runs.start(RUN_ID, pipeline_stages=2)
    state = await wait_phase(handle, RunPhase.PROMPT_READY)
    ready = await _details(handle)
    assert f"run {RUN_ID}" in ready and "2 stage(s)" in ready, ready
    assert "SmolLM2" in ready and ready.startswith("**phase: prompt_ready**"), ready
    assert "provider process" in ready, ready

    done = await RunHandle(runs.client, RUN_ID).submit(
        SubmitPrompt(request_id=7, prompt_text=PROMPT_TEXT, max_tokens=4)
    )
    assert isinstance(done, Done)
    await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=RUN_ID))
    RunOutcome.model_validate(await handle.result())

    run_summaries = await _summaries(runs.client, handle)
    joined = "\n".join(run_summaries)
    placed = sorted((n.node_id, n.stage_index) for n in state.nodes)
    assert [stage for _, stage in placed] == [0, 1]
    for node, stage in placed:
        assert f"start node {node} (stage {stage})" in joined, joined
        assert f"lease node {node} (stage {stage})" in joined, joined
        assert f"provision stage {stage} of 2 on node {node}" in joined, joined
        assert f"stop stage {stage} on node {node}" in joined, joined
    assert any(s.startswith("plan ") and "in 2 stage(s)" in s for s in run_summaries), joined
    final = await _details(handle)
    assert "phase: torn_down" in final and "1 completed" in final, final
    run_desc = await handle.describe()
    assert await run_desc.static_summary() == (
        f"run {RUN_ID}: SmolLM2-135M-Instruct.Q4_1, 2 stage(s) on process"
    )
    run_details = await run_desc.static_details()
    assert run_details is not None and run_details.startswith(f"**run {RUN_ID}**"), run_details
    assert "model: SmolLM2-135M-Instruct.Q4_1 (bundled)" in run_details, run_details
    assert "stages: 2 (activations float32)" in run_details and "provider: process" in run_details
    assert "MvpRunPhase" in run_details, run_details

    prompt_id = None
    async for wf in runs.client.list_workflows(f"WorkflowId STARTS_WITH 'mvp-run-{RUN_ID}-'"):
        prompt_id = wf.id
    assert prompt_id is not None
    prompt = runs.client.get_workflow_handle(prompt_id)
    desc = await prompt.describe()
    summary, details = await desc.static_summary(), await desc.static_details()
    assert summary == f"prompt 7 of run {RUN_ID}", summary
    assert details is not None and "request 7" in details and "max tokens 4" in details
    prompt_summaries = await _summaries(runs.client, prompt)
    head = min(state.nodes, key=lambda n: n.stage_index).node_id
    assert prompt_summaries == [f"generate request 7 on node {head} (run {RUN_ID})"]
    prompt_details = await _details(prompt)
    assert f"run {RUN_ID} · request 7: done: 4 tokens" in prompt_details, prompt_details

    every = [*run_summaries, *prompt_summaries, summary, details, ready, final, prompt_details]
    for text in every:
        assert "Zebulon" not in text and "lighthouse" not in text, text
        assert done.final_text.strip() == "" or done.final_text.strip() not in text, text
