"""Several prompts admitted in one ``admit_prompts`` Update (DECISIONS 106), on the
time-skipping test server with every activity mocked by name (tests/helpers/fake_cluster.py):
each prompt is admitted or refused on its own, in its order, with the id its key gives;
a malformed Update, or one while the run takes no prompt, is refused whole and leaves no
trace in history; and a handle's burst of prompts goes in fewer Updates than prompts,
each with its own text."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

from mvp_core import names
from mvp_core.errors import ErrorType
from mvp_core.models import (
    AdmissionAnswers,
    Done,
    PromptAdmission,
    PromptAdmissions,
    RequestShutdown,
    RunPhase,
    SubmitPrompt,
)
from temporal.client import RunHandle
from tests.helpers.fake_cluster import FakeCluster, wait_phase


def _item(request_id: int, key: str, text: str | None = None) -> PromptAdmission:
    return PromptAdmission(
        prompt=SubmitPrompt(
            request_id=request_id,
            prompt_text=f"p{request_id}" if text is None else text,
            max_tokens=2,
        ),
        key=key,
    )


async def _accepted_updates(handle: Any) -> int:
    return len(
        [
            e
            async for e in handle.fetch_history_events()
            if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED
        ]
    )


async def test_each_prompt_of_one_update_is_admitted_or_refused_on_its_own(
    env: WorkflowEnvironment, task_queue: str
) -> None:
    run_id = 910
    async with FakeCluster(env.client, task_queue).serving() as cluster:
        handle = await cluster.start_run(
            run_id, max_active_prompts=2, prompt_queue_capacity=2, prompt_host="run"
        )
        await wait_phase(handle, RunPhase.PROMPT_READY)
        batch = [
            _item(1, "k1"),
            _item(2, "k2"),
            _item(2, "k2b"),  # its request id was admitted just before it
            _item(3, "k3", text=""),  # nothing to prompt with
            _item(4, "k4"),  # the run's third: 2 active, 1 queued
            _item(5, "k5"),  # the queue is full
        ]
        got = await handle.execute_update(
            names.UPDATE_ADMIT_PROMPTS,
            PromptAdmissions(items=batch),
            result_type=AdmissionAnswers,
        )
        answers = got.answers
        assert len(answers) == 6
        assert [a.admitted is not None for a in answers] == [True, True, False, False, True, False]
        assert [a.refused_type for a in answers] == [
            None,
            None,
            ErrorType.DUPLICATE_REQUEST_ID,
            ErrorType.INVALID_PROMPT,
            None,
            ErrorType.PROMPT_QUEUE_FULL,
        ]
        assert answers[2].refused is not None and "request_id 2" in answers[2].refused
        for rid, key, answer in (
            (1, "k1", answers[0]),
            (2, "k2", answers[1]),
            (4, "k4", answers[4]),
        ):
            assert answer.admitted is not None
            assert answer.admitted.prompt_id == names.prompt_workflow_id(run_id, rid, key)
            assert answer.admitted.request_id == rid and answer.admitted.hosted
        run = RunHandle(env.client, run_id, direct_text=False)
        ends = [
            await run.prompt_end(a.admitted.prompt_id, a.admitted.request_id, hosted=True)
            for a in answers
            if a.admitted is not None
        ]
        assert [e.final_text for e in ends if isinstance(e, Done)] == ["1p", "2p", "4p"]

        # A key that names a prompt the run has served is refused, though its request id
        # is free again; the same prompt under a new key is admitted.
        again = await handle.execute_update(
            names.UPDATE_ADMIT_PROMPTS,
            PromptAdmissions(items=[_item(1, "k1"), _item(1, "k1-again")]),
            result_type=AdmissionAnswers,
        )
        assert again.answers[0].refused_type == ErrorType.DUPLICATE_REQUEST_ID
        assert again.answers[0].refused is not None and "key" in again.answers[0].refused
        late = again.answers[1].admitted
        assert late is not None and late.prompt_id.endswith("-k1-again")
        assert await run.prompt_end(late.prompt_id, 1, hosted=True) == Done(
            request_id=1,
            final_text="1p",
            tokens_generated=2,
            elapsed_ms=1,
            stop_reason="max_tokens",
        )
        await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown())
        outcome = await handle.result()
    assert outcome.prompts_completed == 4


@pytest.mark.parametrize(
    ("run_id", "items", "says"),
    [
        (911, [], "items"),
        (
            912,
            [{"prompt": {"request_id": i, "prompt_text": "x"}, "key": f"k{i}"} for i in range(17)],
            "items",
        ),
        (913, [{"prompt": {"request_id": 1, "prompt_text": "x"}}], "key"),
        (914, [{"prompt": {"request_id": 1, "prompt_text": "x"}, "key": ""}], "key"),
        (915, [{"prompt": {"request_id": -1, "prompt_text": "x"}, "key": "k"}], "request_id"),
    ],
)
async def test_a_malformed_update_is_refused_whole_and_leaves_no_trace(
    env: WorkflowEnvironment, task_queue: str, run_id: int, items: list[Any], says: str
) -> None:
    async with FakeCluster(env.client, task_queue).serving() as cluster:
        handle = await cluster.start_run(run_id)
        await wait_phase(handle, RunPhase.PROMPT_READY)
        before = await _accepted_updates(handle)
        with pytest.raises(WorkflowUpdateFailedError) as caught:
            await handle.execute_update(names.UPDATE_ADMIT_PROMPTS, {"items": items})
        assert await _accepted_updates(handle) == before
        await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown())
        await handle.result()
    cause = caught.value.cause
    assert isinstance(cause, ApplicationError)
    assert cause.type == ErrorType.INVALID_PROMPT
    assert says in cause.message


async def test_an_update_before_the_run_takes_prompts_is_refused_whole(
    env: WorkflowEnvironment, task_queue: str
) -> None:
    cluster = FakeCluster(env.client, task_queue)
    release = cluster.hold("plan")
    async with cluster.serving():
        handle = await cluster.start_run(930)
        await cluster.reached_step("plan")
        with pytest.raises(WorkflowUpdateFailedError) as caught:
            await handle.execute_update(
                names.UPDATE_ADMIT_PROMPTS, PromptAdmissions(items=[_item(1, "a"), _item(2, "b")])
            )
        release.set()
        await wait_phase(handle, RunPhase.PROMPT_READY)
        await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown())
        await handle.result()
    cause = caught.value.cause
    assert isinstance(cause, ApplicationError)
    assert cause.type == ErrorType.RUN_NOT_PROMPT_READY
    assert "phase planning" in cause.message and "request_id" not in cause.message


async def test_a_handles_burst_goes_in_fewer_updates_each_prompt_with_its_own_text(
    env: WorkflowEnvironment, task_queue: str
) -> None:
    run_id = 931
    async with FakeCluster(env.client, task_queue).serving() as cluster:
        handle = await cluster.start_run(
            run_id, max_active_prompts=32, prompt_queue_capacity=8, prompt_host="run"
        )
        await wait_phase(handle, RunPhase.PROMPT_READY)
        run = RunHandle(env.client, run_id, direct_text=False)
        prompts = [SubmitPrompt(request_id=i, prompt_text=f"n{i}", max_tokens=3) for i in range(36)]
        ends = await asyncio.gather(*(run.submit(p) for p in prompts))
        assert [e.final_text for e in ends if isinstance(e, Done)] == [
            f"n{i}"[::-1] for i in range(36)
        ]
        assert run._admissions is not None
        sent = run._admissions.updates
        # All 36 wait before the first sender runs: it takes 16, the next 16, the next 4.
        assert sent <= 8, sent
        await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown())
        outcome = await handle.result()
    assert outcome.prompts_completed == 36
    assert sorted(c for c in cluster.calls if c.startswith("generate ")) == sorted(
        f"generate {i}" for i in range(36)
    )
