"""No signal or update payload, however malformed, can fail a run (hardening 1, 5, 15).

A malformed, mismatched or unknown signal is ignored, counted and described (kind and
reason, never its content) in ``snapshot`` and in the worker log; a malformed update is a
typed, non-retryable error for its caller; ``request_shutdown`` with no payload is an
operator shutdown.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from temporalio.client import WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError

from mvp_core import names
from mvp_core.models import Done, RunOutcome, RunPhase, SubmitPrompt
from temporal.client import PromptRejected, RunHandle
from temporal.devserver import DevServer, temporal_binary
from tests.integration.conftest import (
    OrchestratorProcess,
    Runs,
    node_processes,
    snapshot,
    wait_phase,
)

pytestmark = pytest.mark.quick

MARK = "zz-untrusted-marker-zz"


def cli(server: DevServer, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [temporal_binary(), *args, "--address", server.address],
        capture_output=True,
        text=True,
        timeout=60,
    )


def signal(server: DevServer, wf: str, name: str, payload: str | None) -> None:
    args = ["workflow", "signal", "--workflow-id", wf, "--name", name]
    if payload is not None:
        args += ["--input", payload]
    done = cli(server, *args)
    assert done.returncode == 0, done.stderr


async def test_malformed_signals_from_the_cli_are_ignored_counted_and_described(
    temporal_server: DevServer, runs: Runs, orchestrator: OrchestratorProcess, state_dir: Path
):
    handle = await runs.start(901)
    await wait_phase(handle, RunPhase.PROMPT_READY)
    before = await snapshot(handle)
    bad = [
        (names.SIGNAL_CANCEL_PROMPT, None),
        (names.SIGNAL_NODE_RUNTIME_READY, None),
        (names.SIGNAL_STAGE_FAULT, json.dumps(MARK)),
        (
            names.SIGNAL_STAGE_FAULT,
            json.dumps({"run_id": 901, "stage_index": 0, "reason": MARK, "readiness_id": MARK}),
        ),
        (names.SIGNAL_REQUEST_SHUTDOWN, json.dumps("hello")),
        (names.SIGNAL_REQUEST_SHUTDOWN, json.dumps({"reason": MARK})),
        (names.SIGNAL_REQUEST_SHUTDOWN, json.dumps({"run_id": 999})),
        (names.SIGNAL_LEASE_STARTED, json.dumps([1, 2, 3])),
        (names.SIGNAL_WEIGHTS_READY, json.dumps({"run_id": MARK})),
        ("no_such_signal", json.dumps({"x": MARK})),
    ]
    for name, payload in bad:
        signal(temporal_server, handle.id, name, payload)
    ok = await RunHandle(runs.client, 901).submit(
        SubmitPrompt(request_id=1, prompt_text="Hello", max_tokens=4)
    )
    assert isinstance(ok, Done)  # the run still serves: reports are facts, not commands
    state = await snapshot(handle)
    assert state.phase == RunPhase.PROMPT_READY and not state.stopping
    assert state.ignored_reports - before.ignored_reports == len(bad)
    described = state.ignored[-len(bad) :]
    assert [i.kind for i in described] == [name for name, _ in bad]
    reasons = {i.kind + ": " + i.reason for i in described}
    assert any("missing payload" in r for r in reasons), reasons
    assert any(r.startswith("request_shutdown: invalid RequestShutdown: reason") for r in reasons)
    assert any("run_id 999 is not this run" in r for r in reasons)
    assert any("unknown signal" in r for r in reasons)
    assert MARK not in json.dumps(state.model_dump(mode="json"))
    log = "".join(p.read_text() for p in orchestrator.log_dir.glob("orchestrator-*.log"))
    assert "ignored request_shutdown: run_id 999 is not this run" in log
    assert MARK not in log

    # request_shutdown with no payload at all is an operator shutdown
    signal(temporal_server, handle.id, names.SIGNAL_REQUEST_SHUTDOWN, None)
    outcome = RunOutcome.model_validate(await handle.result())
    assert outcome.outcome.value == "operator_stopped"
    assert outcome.lifecycle[-1].kind.value == "RunTornDown"
    assert node_processes(state_dir) == []


async def test_malformed_updates_are_typed_non_retryable_errors_without_values(
    temporal_server: DevServer, runs: Runs
):
    handle = await runs.start(902)
    await wait_phase(handle, RunPhase.PROMPT_READY)
    for payload, words in (
        ({"request_id": MARK, "prompt_text": "x"}, "request_id"),
        ({"request_id": 1}, "prompt_text"),
        ([MARK], "got an array"),
        ({"request_id": 1, "prompt_text": ""}, "must not be empty"),
    ):
        with pytest.raises(WorkflowUpdateFailedError) as err:
            await handle.execute_update(names.UPDATE_SUBMIT_PROMPT, payload)
        cause = err.value.cause
        assert isinstance(cause, ApplicationError) and cause.type == "InvalidPrompt"
        assert cause.non_retryable and words in cause.message and MARK not in cause.message
    # through the CLI: the same typed error, and the CLI says it failed
    done = cli(
        temporal_server,
        "workflow", "update", "execute", "--workflow-id", handle.id,
        "--name", names.UPDATE_SHUTDOWN_AND_WAIT, "--input", json.dumps({"run_id": 999}),
    )  # fmt: skip
    assert done.returncode != 0 and "InvalidShutdown" in done.stderr + done.stdout
    assert "not this run" in done.stderr + done.stdout
    assert (await snapshot(handle)).phase == RunPhase.PROMPT_READY
    outcome = await handle.execute_update(
        names.UPDATE_SHUTDOWN_AND_WAIT, None, result_type=RunOutcome
    )
    assert outcome.outcome.value == "operator_stopped"


async def test_the_client_raises_prompt_rejected_at_admission(runs: Runs):
    handle = await runs.start(903, faults={"MVP_FAULT_TEXT_DELAY_MS": "20"})
    with pytest.raises(PromptRejected) as early:
        await RunHandle(runs.client, 903).start_prompt(SubmitPrompt(request_id=1, prompt_text="x"))
    assert early.value.kind == "RunNotPromptReady"
    await wait_phase(handle, RunPhase.PROMPT_READY)
    first = await RunHandle(runs.client, 903).start_prompt(
        SubmitPrompt(request_id=1, prompt_text="Once upon a time", max_tokens=64)
    )
    with pytest.raises(PromptRejected) as dup:
        await RunHandle(runs.client, 903).start_prompt(
            SubmitPrompt(request_id=1, prompt_text="again")
        )
    assert dup.value.kind == "DuplicateRequestId"
    with pytest.raises(PromptRejected) as dup_stream:
        async for _ in RunHandle(runs.client, 903).stream(
            SubmitPrompt(request_id=1, prompt_text="y")
        ):
            pass
    assert dup_stream.value.kind == "DuplicateRequestId"
    with pytest.raises(PromptRejected) as empty:
        await RunHandle(runs.client, 903).submit(SubmitPrompt(request_id=2, prompt_text=""))
    assert empty.value.kind == "InvalidPrompt"
    result = await first.result()
    assert result.type == "done"
    await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN)
    await handle.result()


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
REPORT_SIGNALS = [
    names.SIGNAL_NODE_RUNTIME_READY,
    names.SIGNAL_LEASE_STARTED,
    names.SIGNAL_WEIGHTS_READY,
    names.SIGNAL_STAGE_READY,
    names.SIGNAL_STAGE_FAULT,
    names.SIGNAL_TOKEN_ENDPOINTS_READY,
    names.SIGNAL_STAGE_STOPPED,
    names.SIGNAL_CANCEL_PROMPT,
    names.SIGNAL_REQUEST_SHUTDOWN,
]
FUZZ_CASES = 60


async def test_fuzzed_signal_and_update_payloads_never_change_a_run(runs: Runs):
    """Random JSON to every signal and update of a live run: each is refused with a reason
    (or, for the few shapes that happen to be valid and match nothing, ignored), the run
    stays prompt-ready and serves, and no worker crashes."""
    handle = await runs.start(904)
    await wait_phase(handle, RunPhase.PROMPT_READY)
    before = await snapshot(handle)
    sent: list[tuple[str, object]] = []

    @settings(
        max_examples=FUZZ_CASES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(name=st.sampled_from(REPORT_SIGNALS), payload=JSON)
    def case(name: str, payload: object) -> None:
        if name == names.SIGNAL_REQUEST_SHUTDOWN and (
            payload is None or (isinstance(payload, dict) and set(payload) <= {"reply_to"})
        ):
            payload = {"run_id": 999}  # a valid shutdown would end the run on purpose
        sent.append((name, payload))

    case()
    for name, payload in sent:
        await handle.signal(name, payload)
    update_errors = 0
    for _, payload in sent[:20]:
        try:
            await handle.execute_update(names.UPDATE_SUBMIT_PROMPT, payload)
        except WorkflowUpdateFailedError as err:
            assert isinstance(err.cause, ApplicationError) and err.cause.non_retryable
            update_errors += 1
    ok = await RunHandle(runs.client, 904).submit(
        SubmitPrompt(request_id=77, prompt_text="Hello", max_tokens=4)
    )
    assert isinstance(ok, Done)
    state = await snapshot(handle)
    assert state.phase == RunPhase.PROMPT_READY and not state.stopping
    assert state.first_fault is None and state.shutdown is None
    assert state.ignored_reports - before.ignored_reports == len(sent)
    assert [n.model_dump() for n in state.nodes] == [n.model_dump() for n in before.nodes]
    assert update_errors == min(20, len(sent))
    print(f"fuzz: {len(sent)} signal payloads, {update_errors} update payloads refused")
    await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN)
    await handle.result()
