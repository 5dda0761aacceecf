"""PromptWorkflow on its own: started by the run at admission, activated on its turn,
generating on the head node's queue; one terminal event, and how it ended in its
result and its search attribute (MvpPromptStatus). The generate activity is mocked by
name on a head queue of the test's own (``<task_queue>-head``)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from mvp_core import names
from mvp_core.errors import ErrorType
from mvp_core.models import (
    Done,
    Fault,
    GenerateInput,
    NodeLossPolicy,
    PromptHead,
    PromptInput,
    PromptOutcome,
    PromptStatus,
    StopGenerateInput,
    SubmitPrompt,
)
from workflows.prompt import PromptWorkflow

STATUS = names.SEARCH_ATTRIBUTE_PROMPT


class Head:
    """The head node's generate: Done with the text reversed, or the given failure."""

    def __init__(self, task_queue: str) -> None:
        self.task_queue = task_queue  # the prompt workflows'
        self.queue = f"{task_queue}-head"  # the head node's
        self.calls: list[int] = []
        self.fail: ApplicationError | None = None
        self.until_stopped = False  # generate runs (without heartbeats) until stopped
        self.generating: dict[str, asyncio.Event] = {}
        self.stops: list[str] = []
        self.stop_answers = True  # False: a stop reaches the engine, its answer never comes
        self.started: list[str] = []  # the prompt workflows' ids

    @activity.defn(name=names.ACT_NODE_GENERATE)
    async def generate(self, inp: GenerateInput) -> PromptOutcome:
        self.calls.append(inp.prompt.request_id)
        if self.fail is not None:
            raise self.fail
        if self.until_stopped:
            stopped = self.generating[inp.prompt_workflow_id] = asyncio.Event()
            await stopped.wait()
            return PromptOutcome(
                terminal=Fault(request_id=inp.prompt.request_id, error="cancelled")
            )
        text = inp.prompt.prompt_text[::-1]
        return PromptOutcome(
            terminal=Done(
                request_id=inp.prompt.request_id,
                final_text=text,
                tokens_generated=len(text),
                elapsed_ms=1,
                stop_reason="eos",
            )
        )

    @activity.defn(name=names.ACT_NODE_STOP_GENERATE)
    async def stop_generate(self, inp: StopGenerateInput) -> bool:
        self.stops.append(inp.prompt_workflow_id)
        stopped = self.generating.get(inp.prompt_workflow_id)
        if stopped is not None:
            stopped.set()
        if not self.stop_answers:
            await asyncio.Event().wait()  # the node went before it answered: until cancelled
        return stopped is not None


@pytest.fixture
async def head(env: WorkflowEnvironment, task_queue: str) -> AsyncIterator[Head]:
    fake = Head(task_queue)
    async with (
        Worker(env.client, task_queue=task_queue, workflows=[PromptWorkflow]),
        Worker(env.client, task_queue=fake.queue, activities=[fake.generate, fake.stop_generate]),
    ):
        yield fake
        for wf_id in fake.started:  # one a failed test left open: not on the shared server
            with contextlib.suppress(RPCError):
                await env.client.get_workflow_handle(wf_id).terminate("the test ended")


async def start(env: WorkflowEnvironment, head: Head, request_id: int, *, active: bool) -> Any:
    handle = await env.client.start_workflow(
        PromptWorkflow.run,
        PromptInput(
            run_id=900,
            readiness_id="r",
            prompt=SubmitPrompt(request_id=request_id, prompt_text="hello"),
            max_new_tokens=5,
            head_task_queue=head.queue,
            head_node_id=1,
            start_active=active,
        ),
        id=names.prompt_workflow_id(900, request_id, uuid.uuid4().hex),
        task_queue=head.task_queue,
    )
    head.started.append(handle.id)
    return handle


async def status_of(handle: Any) -> str:
    desc = await handle.describe()
    values = desc.raw_description.workflow_execution_info.search_attributes.indexed_fields
    status: str = values[STATUS].data.decode().strip('"')
    return status


async def test_a_prompt_started_active_generates_at_once_and_ends_done(
    env: WorkflowEnvironment, head: Head
) -> None:
    handle = await start(env, head, 1, active=True)
    outcome = PromptOutcome.model_validate(await handle.result())
    assert outcome.terminal == Done(
        request_id=1, final_text="olleh", tokens_generated=5, elapsed_ms=1, stop_reason="eos"
    )
    assert outcome.status is PromptStatus.DONE and outcome.run_fault is None
    assert head.calls == [1]
    assert await status_of(handle) == "done"


async def test_a_queued_prompt_waits_for_its_activation(
    env: WorkflowEnvironment, head: Head
) -> None:
    handle = await start(env, head, 2, active=False)
    await handle.signal(names.SIGNAL_PROMPT_ACTIVATE)
    outcome = PromptOutcome.model_validate(await handle.result())
    assert outcome.terminal.type == "done" and head.calls == [2]
    assert outcome.queued_ms is not None


async def test_a_prompt_cancelled_before_its_turn_never_generates(
    env: WorkflowEnvironment, head: Head
) -> None:
    handle = await start(env, head, 3, active=False)
    await handle.signal(names.SIGNAL_PROMPT_CANCEL, "client went away")
    outcome = PromptOutcome.model_validate(await handle.result())
    assert outcome.terminal == Fault(request_id=3, error="client went away")
    assert outcome.status is PromptStatus.CANCELLED
    assert head.calls == []
    assert await status_of(handle) == "cancelled"


async def test_a_cancel_mid_generate_is_pushed_to_the_head_node(
    env: WorkflowEnvironment, head: Head
) -> None:
    """The generate learns of its cancel from the stop pushed to its node, not only from
    a heartbeat's answer (this fake never heartbeats: without the push it would run until
    its heartbeat timed out)."""
    head.until_stopped = True
    handle = await start(env, head, 4, active=True)
    while handle.id not in head.generating:
        await asyncio.sleep(0.01)
    await handle.signal(names.SIGNAL_PROMPT_CANCEL, "client went away")
    async with asyncio.timeout(30):  # without the push: until its heartbeat timeout
        outcome = PromptOutcome.model_validate(await handle.result())
    assert head.stops == [handle.id] and head.generating[handle.id].is_set()
    assert outcome.terminal == Fault(request_id=4, error="client went away")
    assert outcome.status is PromptStatus.CANCELLED
    assert await status_of(handle) == "cancelled"


async def test_a_stop_left_unanswered_is_cancelled_once_the_generate_ended(
    env: WorkflowEnvironment, head: Head
) -> None:
    """The generate ends (its engine got the stop) but the stop's answer never comes (the
    head node went): the prompt ends with its generate, the stop cancelled, not awaited
    to its bound (which the time-skipping server would otherwise reach at once)."""
    head.until_stopped = True
    head.stop_answers = False
    handle = await start(env, head, 5, active=True)
    while handle.id not in head.generating:
        await asyncio.sleep(0.01)
    await handle.signal(names.SIGNAL_PROMPT_CANCEL, "client went away")
    outcome = PromptOutcome.model_validate(await handle.result())
    assert outcome.terminal == Fault(request_id=5, error="client went away")
    assert head.stops == [handle.id]
    history = await handle.fetch_history()
    stop_ids = {
        e.event_id
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and e.activity_task_scheduled_event_attributes.activity_type.name
        == names.ACT_NODE_STOP_GENERATE
    }
    assert len(stop_ids) == 1, stop_ids
    kinds = [e.event_type for e in history.events]
    assert EventType.EVENT_TYPE_ACTIVITY_TASK_CANCEL_REQUESTED in kinds
    assert EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT not in kinds, kinds


async def test_a_failed_generate_faults_the_prompt_and_reports_a_run_fault(
    env: WorkflowEnvironment, head: Head
) -> None:
    head.fail = ApplicationError(
        "engine fault on stage 0: RuntimeError: boom",
        type=ErrorType.ENGINE_FAULT,
        non_retryable=True,
    )
    handle = await start(env, head, 4, active=True)
    outcome = PromptOutcome.model_validate(await handle.result())
    assert outcome.terminal == Fault(
        request_id=4, error="prompt serving fault: engine fault on stage 0: RuntimeError: boom"
    )
    assert outcome.status is PromptStatus.FAULTED
    assert outcome.run_fault == (
        f"prompt serving: generate on {head.queue} failed: engine fault on stage 0: RuntimeError: boom"
    )
    assert await status_of(handle) == "faulted"


class DeadHead:
    """A head node that is gone: its generate never ends and never heartbeats, a stop
    pushed to it is never answered (the activities are cancelled when the test ends)."""

    def __init__(self) -> None:
        self.nonce8 = uuid.uuid4().hex[:8]
        self.queue = names.node_task_queue(900, 1, self.nonce8)
        self.generating = asyncio.Event()
        self.stops = 0

    @activity.defn(name=names.ACT_NODE_GENERATE)
    async def generate(self, inp: GenerateInput) -> PromptOutcome:
        self.generating.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    @activity.defn(name=names.ACT_NODE_STOP_GENERATE)
    async def stop_generate(self, inp: StopGenerateInput) -> bool:
        self.stops += 1
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


@pytest.mark.parametrize(
    ("policy", "cancel"),
    [(NodeLossPolicy.FAIL, False), (NodeLossPolicy.FAIL, True), (NodeLossPolicy.REPLACE, True)],
)
async def test_a_prompt_whose_head_is_gone_is_not_left_to_its_generate_s_heartbeat_timeout(
    env: WorkflowEnvironment, task_queue: str, policy: NodeLossPolicy, cancel: bool
) -> None:
    """The run's news that the head node is gone (DECISIONS 101) ends a generating
    prompt of a fail-stop run with a Fault naming the node, and a cancelled prompt (any
    run) as cancelled, without waiting for the dead node's generate: no activity times
    out in its history (the generate's heartbeat timeout is 10 minutes)."""
    dead = DeadHead()
    async with (
        Worker(env.client, task_queue=task_queue, workflows=[PromptWorkflow]),
        Worker(env.client, task_queue=dead.queue, activities=[dead.generate, dead.stop_generate]),
    ):
        handle = await env.client.start_workflow(
            PromptWorkflow.run,
            PromptInput(
                run_id=900,
                readiness_id=f"{dead.nonce8}-1-0",
                prompt=SubmitPrompt(request_id=7, prompt_text="hello"),
                max_new_tokens=5,
                head_task_queue=dead.queue,
                head_node_id=1,
                start_active=True,
                generate_heartbeat_s=600,
                on_node_loss=policy,
            ),
            id=names.prompt_workflow_id(900, 7, uuid.uuid4().hex),
            task_queue=task_queue,
        )
        try:
            await asyncio.wait_for(dead.generating.wait(), 30)
            if cancel:
                await handle.signal(names.SIGNAL_PROMPT_CANCEL, "run is shutting down")
            gone = PromptHead(
                node_id=1, task_queue=dead.queue, readiness_id=f"{dead.nonce8}-1-0", ready=False
            )
            await handle.signal(names.SIGNAL_PROMPT_HEAD, gone)
            async with asyncio.timeout(60):
                outcome = PromptOutcome.model_validate(await handle.result())
            history = await handle.fetch_history()
        finally:
            with contextlib.suppress(RPCError):
                await handle.terminate("the test ended")
    kinds = [e.event_type for e in history.events]
    assert EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT not in kinds, kinds
    assert EventType.EVENT_TYPE_MARKER_RECORDED in kinds  # the patch (head-loss-ends-generate)
    if cancel:
        assert outcome.terminal == Fault(request_id=7, error="run is shutting down")
        assert outcome.status is PromptStatus.CANCELLED
    else:
        assert outcome.terminal == Fault(
            request_id=7, error="prompt serving fault: node 1 was lost while it generated"
        )
        assert outcome.status is PromptStatus.FAULTED and outcome.run_fault is None
        assert dead.stops == 0  # nothing is pushed to a node that is gone
