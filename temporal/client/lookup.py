"""Finding a prompt again by its request id, and re-attaching to it from any client:
in flight (the run's snapshot), finished in a PromptWorkflow (visibility), or finished
in the run itself (its ``prompt_served`` query, DECISIONS 66)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, cast

from temporalio.client import WorkflowUpdateFailedError
from temporalio.service import RPCError, RPCStatusCode

from mvp_core import names
from mvp_core.models import Done, Fault, PromptHost, PromptOutcome, ServedPrompt, TextDelta
from temporal.client.errors import PromptNotFound, PromptUnavailable
from temporal.client.text import PromptEvents, PromptText
from temporal.client.updates import drop
from workflows.run import RunWorkflow


@dataclass(frozen=True)
class PromptLocation:
    """A prompt located by its request id (RunHandle.locate)."""

    workflow_id: str
    request_id: int
    hosted: bool = False  # served by the run itself (DECISIONS 66)
    update_id: str | None = None  # a hosted one in flight: its Update
    served: ServedPrompt | None = None  # a hosted one that ended


class PromptLookup(PromptText):
    """Where a prompt is, what the run kept of it, and its events again."""

    async def find_prompt(self, request_id: int) -> str | None:
        """The workflow id (a run-hosted prompt: its key) of this run's prompt
        ``request_id``: one in flight from the run's own snapshot, else the newest finished
        one (a request id can be used again once its prompt ended)."""
        found = await self.locate(request_id)
        return found.workflow_id if found is not None else None

    async def locate(self, request_id: int) -> PromptLocation | None:
        """Where prompt ``request_id`` is: in flight (the snapshot), finished in a
        PromptWorkflow (visibility), or finished in the run itself (the run's query).
        None: the run answered and has no such prompt; PromptUnavailable: it could not
        answer now (no worker has it: try again)."""
        state = await self.try_snapshot()  # None: a closed run, or one no worker has now
        if state is not None:
            self._prompt_host = state.prompt_host
            record = state.prompt(request_id)
            hosted = state.prompt_host is PromptHost.RUN
            if record is not None:
                return PromptLocation(
                    record.workflow_id, request_id, hosted, update_id=record.update_id
                )
            if hosted:
                return await self._served(request_id)
        prefix = names.prompt_workflow_id(self.run_id, request_id, "")
        query = f"WorkflowType = '{names.PROMPT_WORKFLOW}' AND WorkflowId STARTS_WITH '{prefix}'"
        newest: tuple[Any, str] | None = None
        async for wf in self.client.list_workflows(query):
            if newest is None or wf.start_time > newest[0]:
                newest = (wf.start_time, wf.id)
        if newest is not None:
            return PromptLocation(newest[1], request_id)
        if state is not None:
            return None
        try:  # a closed run that served its prompts itself answers for its last ones
            return await self._served(request_id)
        except PromptUnavailable:
            if self._prompt_host is PromptHost.RUN:
                raise  # it may well have it: say so, not "no such prompt"
            return None

    async def _served(self, request_id: int) -> PromptLocation | None:
        served = await self.served(request_id)
        if served is None:
            return None
        return PromptLocation(served.workflow_id, request_id, True, served=served)

    async def served(self, request_id: int) -> ServedPrompt | None:
        """The newest run-hosted prompt ``request_id`` that ended, as the run keeps it
        (DECISIONS 66; a closed run answers too, while a worker replays it); None: not
        kept. PromptUnavailable: the run cannot answer now."""
        served = await self._ask(names.QUERY_PROMPT_SERVED, request_id, ServedPrompt)
        return served if isinstance(served, ServedPrompt) else None

    async def hosted_stops(self, request_id: int) -> list[str]:
        """The stop strings of run-hosted prompt ``request_id`` (in flight or kept)."""
        stops = await self._ask(names.QUERY_PROMPT_STOPS, request_id, list[str])
        return list(stops) if isinstance(stops, list) else []

    async def _ask(self, query: str, request_id: int, result_type: Any) -> Any:
        """One of the run's prompt queries: None where there is no such run;
        PromptUnavailable when the run cannot answer."""
        try:
            return await self._ask_run(query, request_id, result_type, f"prompt {request_id}")
        except PromptNotFound:
            return None

    async def attach(self, request_id: int, *, poll_cooldown_ms: int = 20) -> PromptEvents:
        """Re-attach to a prompt, running or finished, from any client: the whole text so
        far, then the rest as it is generated, then its one terminal event. Raises
        PromptNotFound when the run never admitted ``request_id``. A viewer: leaving it
        early cancels nothing."""
        found = await self.locate(request_id)
        if found is None:
            raise PromptNotFound(f"run {self.run_id} has no prompt {request_id}")
        ended = self._hosted_terminal(found) if found.hosted else self._prompt_terminal(found)
        result_task = asyncio.ensure_future(ended)
        try:
            async for event in self._events(found.workflow_id, result_task, poll_cooldown_ms):
                yield event
                if not isinstance(event, TextDelta):
                    return
        finally:
            drop(result_task)

    async def _prompt_terminal(self, found: PromptLocation) -> Done | Fault:
        raw = await self.client.get_workflow_handle(found.workflow_id).result()
        return PromptOutcome.model_validate(raw).terminal

    async def _hosted_terminal(self, found: PromptLocation) -> Done | Fault:
        """A run-hosted prompt's end: kept by the run, or, still open, what the run's
        ``prompt_end`` answers (DECISIONS 77) or its ``submit_prompt`` Update's result."""
        if found.served is not None:
            return found.served.outcome.terminal
        if found.update_id is None:  # admitted by admit_prompt: the run answers for it
            return await self.prompt_end(found.workflow_id, found.request_id, hosted=True)
        if found.update_id is not None:
            update = self.workflow.get_update_handle_for(RunWorkflow.submit_prompt, found.update_id)
            try:
                return cast(Done | Fault, await update.result())
            except WorkflowUpdateFailedError as err:
                raise PromptNotFound(f"prompt {found.workflow_id}: {err.cause or err}") from None
            except RPCError as err:
                if err.status is not RPCStatusCode.NOT_FOUND:
                    raise PromptUnavailable(f"prompt {found.workflow_id}: {err}") from None
                # Ended, and the run continued as new since: what it kept of the prompt.
        served = await self._served(found.request_id)
        if served is None or served.served is None or served.workflow_id != found.workflow_id:
            raise PromptNotFound(f"prompt {found.workflow_id}: no longer kept by its run")
        return served.served.outcome.terminal
