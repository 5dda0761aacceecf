"""Every exported history replays on the current workflow code.

A change to RunWorkflow or PromptWorkflow that would break a run in flight (a command
added, removed or reordered against what the history recorded) fails here, before a
deployment meets a live run. The histories come from real runs (real dev server, real
nodes) covering each way a run goes: direct and two-stage serving, RunRejected,
RunFaulted by a killed node, cancels (active and pending), malformed signals, a
continue-as-new chain, stage recovery (a middle and then a head node replaced), and
prompts admitted one by one and together (``admit_prompt``, ``admit_prompts``).

Re-export (one command, ~1-2 min, replaces ``tests/histories/<scenario>/``)::

    .venv/bin/python scripts/export_histories.py

Only re-export for a change that is meant to be incompatible (and is versioned, or
deployed on a new task queue): otherwise a failure here is the bug.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from temporalio import workflow
from temporalio.client import WorkflowHistory
from temporalio.converter import DataConverter
from temporalio.worker import Replayer

from mvp_core import names
from mvp_core.models import PromptInput, PromptOutcome
from temporal.connect import default_data_converter
from workflows.prompt import PromptWorkflow
from workflows.run import RunWorkflow

HISTORIES = Path(__file__).resolve().parents[1] / "histories"
SCENARIOS = [
    "direct",
    "two_stages",
    "rejected",
    "faulted",
    "cancelled",
    "malformed",
    "continue_as_new",
    "recovered",
    "admitted",
    "admitted_together",
]
# The workers' converter (pydantic payloads) without a payload key: the histories are
# exported in plaintext, and replay needs only the payload and failure converters.
CONVERTER: DataConverter = default_data_converter({})


def load(scenario: str) -> dict[str, WorkflowHistory]:
    """File name -> history, with the workflow id that ``workflows.json`` names."""
    folder = HISTORIES / scenario
    index: dict[str, str] = json.loads((folder / "workflows.json").read_text())
    files = {p.name for p in folder.glob("*.json")} - {"workflows.json"}
    assert files == set(index), f"{folder}: files and workflows.json disagree"
    return {
        name: WorkflowHistory.from_json(workflow_id, (folder / name).read_text())
        for name, workflow_id in sorted(index.items())
    }


async def replay(replayer: Replayer, histories: dict[str, WorkflowHistory]) -> dict[str, str]:
    """Replay all, return file name -> failure for those that did not replay."""

    async def each() -> AsyncIterator[WorkflowHistory]:
        for history in histories.values():
            yield history

    results = await replayer.replay_workflows(each(), raise_on_replay_failure=False)
    by_run = {h.run_id: name for name, h in histories.items()}
    return {by_run[run]: repr(err) for run, err in results.replay_failures.items()}


@pytest.mark.parametrize("scenario", SCENARIOS)
async def test_exported_histories_replay_on_the_current_code(scenario: str) -> None:
    histories = load(scenario)
    assert histories, f"no histories in {HISTORIES / scenario}: run scripts/export_histories.py"
    kinds = {
        h.events[0].workflow_execution_started_event_attributes.workflow_type.name
        for h in histories.values()
    }
    assert names.RUN_WORKFLOW in kinds
    replayer = Replayer(workflows=[RunWorkflow, PromptWorkflow], data_converter=CONVERTER)
    failures = await replay(replayer, histories)
    assert not failures, failures


def test_the_continue_as_new_chain_has_more_than_one_run() -> None:
    runs = [n for n in load("continue_as_new") if n.startswith("run.")]
    assert len(runs) >= 2, runs


@workflow.defn(name=names.PROMPT_WORKFLOW, sandboxed=False)
class AlteredPromptWorkflow(PromptWorkflow):
    """PromptWorkflow with a timer up front: a change that is not replay-compatible."""

    @workflow.run
    async def run(self, inp: PromptInput) -> PromptOutcome:
        await workflow.sleep(0.01)
        return await super().run(inp)


async def test_a_non_deterministic_change_is_caught() -> None:
    """The check above can fail: the same prompt histories on altered code do not replay."""
    histories = {n: h for n, h in load("direct").items() if n.startswith("prompt-")}
    assert histories
    replayer = Replayer(workflows=[AlteredPromptWorkflow], data_converter=CONVERTER)
    failures = await replay(replayer, histories)
    assert set(failures) == set(histories), failures
    assert all("Nondeterminism" in f for f in failures.values()), failures
