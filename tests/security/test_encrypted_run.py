"""With MVP_PAYLOAD_KEY set, a real run on a real dev server keeps prompt and completion
text out of Temporal's stored history, while a client with the key still reads it.

The test starts its own dev server and orchestrator worker (not the session's shared
ones), so its encrypted history never mixes with theirs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from google.protobuf.message import Message
from temporalio.api.common.v1 import Payload
from temporalio.api.enums.v1 import EventType
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowHandle,
    WorkflowHistory,
    WorkflowQueryFailedError,
)
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError

from mvp_core import names
from mvp_core.models import (
    Done,
    RequestShutdown,
    RunOutcome,
    RunRequest,
    ShutdownReason,
    SubmitPrompt,
)
from mvp_core.run_state import RunState
from temporal.client import PromptRejected, RunHandle
from temporal.codec import ENCODING, EncryptionCodec, new_key, parse_key
from temporal.connect import connect, encrypted_data_converter
from temporal.devserver import start_dev_server
from tests.helpers.waits import eventually
from tests.integration.conftest import OrchestratorProcess, node_processes

RUN_ID = 9301
PROMPT = "Okapi-Zanzibar-7719 is a secret code word. Tell me about"


def _payloads(msg: Message, *, skip: frozenset[str] = frozenset()) -> Iterator[Payload]:
    """Every Payload inside a proto message (fields named in ``skip`` left out)."""
    if isinstance(msg, Payload):
        yield msg
        return
    for field, value in msg.ListFields():
        if field.name in skip or field.type != field.TYPE_MESSAGE:
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            items = list(value.values())
        elif field.is_repeated:
            items = list(value)
        else:
            items = [value]
        for item in items:
            if isinstance(item, Message):
                yield from _payloads(item, skip=skip)


async def _wait_prompt_ready(handle: WorkflowHandle[object, object], timeout: float) -> None:
    """Until the run is prompt-ready; a run that closed or stopped first fails at once."""
    last: list[RunState | None] = [None]

    async def ready() -> bool:
        try:
            last[0] = await handle.query(names.QUERY_SNAPSHOT, result_type=RunState)
        except (RPCError, WorkflowQueryFailedError):
            last[0] = None
            desc = await handle.describe()
            if desc.status != WorkflowExecutionStatus.RUNNING:
                await handle.result()  # raises the run's failure, decoded with the key
                raise AssertionError(f"run closed before prompt-ready: {desc.status}") from None
            return False
        state = last[0]
        assert not state.stopping, f"run stopped: {state.first_fault}"
        return state.phase.value == "prompt_ready"

    await eventually(
        ready,
        timeout=timeout,
        what="prompt-ready",
        interval=0.2,
        detail=lambda: f"last phase: {last[0] and last[0].phase}",
    )


async def _histories(raw: Client, run_wf: str) -> dict[str, WorkflowHistory]:
    """Raw (undecoded) history events of the run and its prompt children."""
    ids: set[str] = set()

    async def listed() -> bool:  # visibility lags the close by a moment
        nonlocal ids
        ids = {wf.id async for wf in raw.list_workflows()}
        return run_wf in ids and any(i.startswith(f"{run_wf}-prompt-") for i in ids)

    await eventually(
        listed,
        timeout=30,
        what="the run and its prompts listed",
        interval=0.1,
        detail=lambda: repr(ids),
    )
    return {wf_id: await raw.get_workflow_handle(wf_id).fetch_history() for wf_id in sorted(ids)}


@pytest.mark.timeout(150)
async def test_prompt_and_completion_are_encrypted_at_rest(tmp_path: Path):
    key = new_key()
    codec = EncryptionCodec(parse_key(key))
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    server = start_dev_server(
        str(tmp_path / "temporal.db"), log_file=str(tmp_path / "temporal.log")
    )
    orchestrator = OrchestratorProcess(
        server.address, state_dir, tmp_path, {"MVP_PAYLOAD_KEY": key}
    )
    client: Client | None = None
    try:
        orchestrator.start()
        client = await connect(server.address, data_converter=encrypted_data_converter(codec))
        raw = await connect(server.address, data_converter=pydantic_data_converter)
        request = RunRequest.model_validate(
            {"model": {"bundled": "SmolLM2-135M-Instruct.Q4_1"}, "default_max_tokens": 16}
        )
        handle = await client.start_workflow(
            names.RUN_WORKFLOW,
            request,
            id=names.run_workflow_id(RUN_ID),
            task_queue=names.ORCHESTRATOR_TASK_QUEUE,
        )
        # Failure messages are sealed too (encode_common_attributes); a keyed client reads them.
        with pytest.raises(PromptRejected) as rejected:
            await RunHandle(client, RUN_ID).submit(SubmitPrompt(request_id=0, prompt_text=PROMPT))
        assert rejected.value.kind == "RunNotPromptReady"
        assert str(rejected.value) not in ("", "Encoded failure")
        await _wait_prompt_ready(handle, 60)
        done = await RunHandle(client, RUN_ID).submit(
            SubmitPrompt(request_id=1, prompt_text=PROMPT)
        )
        assert isinstance(done, Done), done
        completion = done.final_text.strip()
        assert len(completion) >= 8, done  # long enough that a chance match means a leak
        outcome = await handle.execute_update(
            "request_shutdown_and_wait",
            RequestShutdown(run_id=RUN_ID, reason=ShutdownReason.OPERATOR_REQUESTED),
            result_type=RunOutcome,
        )
        assert outcome is not None
        await asyncio.wait_for(handle.result(), 30)

        histories = await _histories(raw, handle.id)
        # The texts as they are and as they appear inside JSON (escaped newlines).
        escaped = json.dumps(completion)[1:-1].encode()
        secrets_ = {PROMPT.encode(), completion.encode(), escaped, b"Okapi-Zanzibar"}
        secrets_ |= {line.encode() for line in completion.splitlines() if len(line) >= 8}
        decoded = bytearray()
        for wf_id, history in histories.items():
            whole = history.to_json().encode()  # the whole history as the CLI would dump it
            for s in secrets_:
                assert s not in whole, f"{wf_id}: user text in clear in the history"
            for event in history.events:
                blob = event.SerializeToString()
                for s in secrets_:
                    assert s not in blob, f"{wf_id}: {event.event_type} holds user text in clear"
                if event.event_type == EventType.EVENT_TYPE_MARKER_RECORDED and (
                    event.marker_recorded_event_attributes.marker_name == "core_patch"
                ):
                    # A workflow.patched() marker: the SDK's core writes the patch id
                    # itself, never through the codec. It holds that id and nothing else.
                    details = event.marker_recorded_event_attributes.details
                    assert list(details) == ["patch-data"], list(details)
                    (data,) = details["patch-data"].payloads
                    assert json.loads(data.data) in [
                        {"id": patch, "deprecated": False}
                        for patch in (
                            names.PATCH_PROMPT_STARTS_ACTIVE,
                            names.PATCH_WATCH_ENDS_BEFORE_CLOSE,
                            names.PATCH_RUN_DATASTREAM,
                            names.PATCH_SHUTDOWN_WAITS_CLOSE,
                            names.PATCH_CANCEL_BEFORE_CHILD_START,
                            names.PATCH_COMPLETE_BOOTSTRAP,
                        )
                    ]
                    continue
                # Every payload but search attributes (which Temporal must index) is sealed.
                for p in _payloads(event, skip=frozenset({"search_attributes"})):
                    assert p.metadata.get("encoding") == ENCODING, (wf_id, event.event_type)
                    decoded += codec.decrypt(p).SerializeToString()
        assert PROMPT.encode() in decoded
        assert escaped in decoded

        await eventually(
            lambda: not node_processes(state_dir),
            timeout=10,
            what="no node process left after the run",
            interval=0.2,
            detail=lambda: repr(node_processes(state_dir)),
        )
    finally:
        if client is not None:
            try:
                desc = await client.get_workflow_handle(names.run_workflow_id(RUN_ID)).describe()
                if desc.status == WorkflowExecutionStatus.RUNNING:
                    await client.get_workflow_handle(desc.id).terminate("test clean-up")
            except RPCError:
                pass
        for proc in node_processes(state_dir):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        orchestrator.stop()
        server.stop()
