"""RunWorkflow: the run authority of the actor spec, wired to Temporal.

Thin by design: every decision is a rule of the pure ``RunState``; each phase of the
run is a module of this package that turns those decisions into activities, signals,
child workflows and timers. ``run`` is the table of contents.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from temporalio import workflow
from temporalio.common import RawValue
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from mvp_core import names
    from mvp_core.errors import ErrorType
    from mvp_core.models import (
        AdmissionAnswers,
        CancelPrompt,
        DatastreamAddress,
        Fault,
        LifecycleKind,
        PromptAdmitted,
        PromptEnd,
        PromptTerminal,
        RequestShutdown,
        RunOutcome,
        RunPhase,
        RunRequest,
        ServedPrompt,
        ShutdownReason,
        SubmitPrompt,
    )
    from mvp_core.run_state import RunState
    from mvp_core.validation import RunRejectedError, resolve_run_id, validate_request
    from workflows.run import admission, signals
    from workflows.run.carry import RunCarry, decode_start
    from workflows.run.context import (
        WORKFLOW_TASK_TIMEOUT,
        Rejected,
        RunContext,
        Stopping,
        describe,
    )
    from workflows.run.datastream import RunDatastream
    from workflows.run.faults import Suspicion
    from workflows.run.membership import Membership
    from workflows.run.planning import plan
    from workflows.run.prompts import Prompts
    from workflows.run.recovery import Recovery
    from workflows.run.serve import ServeEnd, serve
    from workflows.run.startup import Startup
    from workflows.run.teardown import Teardown


@workflow.defn(name=names.RUN_WORKFLOW, failure_exception_types=[Exception])
class RunWorkflow:
    @workflow.init
    def __init__(self, start: RawValue) -> None:
        # The input arrives raw (a RunRequest, or the RunCarry of continue-as-new) so that
        # a malformed request is rejected, naming its bad fields (carry.py).
        self._rejection: str | None = None
        decoded: RunRequest | RunCarry
        try:
            decoded = decode_start(start)
        except RunRejectedError as err:
            decoded, self._rejection = RunRequest(), str(err)
        self._carry = decoded if isinstance(decoded, RunCarry) else None
        request = decoded.request if isinstance(decoded, RunCarry) else decoded
        self._request = request
        self._state = self._carry.state if self._carry is not None else self._new_state(request)
        if self._carry is not None:
            # Serving resumes at once; leases restart in run() (DECISIONS 13).
            self._state.resume_carried()
        ctx = self._ctx = RunContext(request, self._state)
        served: Sequence[ServedPrompt] = self._carry.served if self._carry is not None else ()
        self._suspicion = Suspicion(ctx)
        self._datastream = RunDatastream(ctx)
        self._membership = Membership(ctx, on_loss=self._on_loss)
        self._startup = Startup(ctx, self._membership)
        self._prompts = Prompts(ctx, served, on_run_fault=self._suspicion.suspect)
        self._one_shot: asyncio.Task[None] | None = None  # a one-shot run's prompt
        self._teardown = Teardown(ctx, self._membership, self._prompts)
        self._recovery = Recovery(
            ctx, self._startup, self._membership, self._prompts, self._teardown.stop_node
        )

    def _new_state(self, request: RunRequest) -> RunState:
        run_id = -1
        try:
            run_id = resolve_run_id(request, workflow.info().workflow_id)
            if self._rejection is None:
                validate_request(request)
        except RunRejectedError as err:
            self._rejection = self._rejection or str(err)
        nonce = workflow.uuid4().hex
        return RunState(
            run_id=run_id if run_id >= 0 else (request.run_id or 0),
            nonce=nonce,
            authorized_orchestrator=f"{workflow.info().workflow_id}/{nonce[:8]}",
            prompt_host=request.prompt_host,
            node_loss=request.on_node_loss,
            recovery_bound=request.recovery,
        )

    # ------------------------------------------------------------------ the run
    @workflow.run
    async def run(self, start: RawValue) -> RunOutcome:
        """Plan, start up, serve; then continue as new, or tear down and end."""
        state = self._state
        if self._carry is None:
            if self._rejection is not None:
                return self._reject(self._rejection)
            state.record(LifecycleKind.RUN_ACCEPTED)
            self._ctx.view.set_phase(RunPhase.ACCEPTED)
        end = ServeEnd.STOP
        try:
            if self._carry is None:
                await plan(self._ctx, on_provider_queue=self._datastream.start)
                await self._startup.run()
                if self._request.one_shot is not None:
                    self._one_shot = asyncio.create_task(
                        self._serve_one_shot(self._request.one_shot)
                    )
            else:
                self._resume()
            end = await serve(self._ctx)
        except Rejected as rejected:
            await self._datastream.stop()
            return self._reject(str(rejected))  # planning provisioned nothing: no teardown
        except Stopping:
            pass
        except asyncio.CancelledError:
            state.request_shutdown(ShutdownReason.HOST_REQUESTED)
        except Exception as err:
            state.fault(f"{state.phase_word()}: {describe(err)}")
        await self._recovery.stop()
        if end is ServeEnd.CONTINUE_AS_NEW:
            await self._membership.cancel()
            await self._datastream.stop()  # the continued run starts its own
            workflow.continue_as_new(
                RunCarry(request=self._request, state=state, served=self._prompts.kept()),
                task_timeout=WORKFLOW_TASK_TIMEOUT,
            )
        await asyncio.shield(asyncio.ensure_future(self._teardown.run()))
        await self._datastream.stop()  # after RunTornDown: it publishes it, then closes
        self._ctx.closing = True
        return self._end()

    async def _serve_one_shot(self, prompt: SubmitPrompt) -> None:
        """A one-shot run (actor spec 8, the terminal prompt-serving policy): its prompt
        is served once the run is prompt-ready, then the run shuts itself down; the
        prompt's terminal event is the outcome's ``one_shot``. A prompt the run would
        refuse (the validator's reasons) ends as a Fault saying why."""
        state = self._state
        try:
            admission.validate_prompt(self._request, state, [prompt.model_dump(mode="json")])
        except ApplicationError as err:
            state.one_shot = Fault(
                request_id=prompt.request_id, error=f"one-shot prompt refused: {err.message}"
            )
        else:
            state.one_shot = await self._prompts.one_shot(prompt)
        state.request_shutdown(ShutdownReason.ONE_SHOT_DONE)

    def _resume(self) -> None:
        """After continue-as-new: leases, the watch and the datastream start again at once."""
        state = self._state
        if state.is_recovering():
            # Never carried (a run does not continue as new while it recovers): a carry
            # that has one cannot be finished here.
            state.fault("prompt serving: a stage recovery was cut off by continue-as-new")
        self._datastream.start()
        for node in state.nodes:
            self._membership.start_lease(node, self._request.timeouts.lease_heartbeat_s * 3)
        self._membership.start_watch()
        if state.suspected_fault is not None:
            self._suspicion.start_grace()  # its timer did not cross continue-as-new
        self._ctx.view.set_phase(RunPhase.PROMPT_READY)

    def _on_loss(self) -> None:
        """Membership lost a node: recovery decides (RunState faulted already where the
        run does not replace nodes)."""
        self._recovery.on_loss()

    def _end(self) -> RunOutcome:
        """The run's outcome, or its failure: a fault, or a stop that may leave a node."""
        state = self._state
        outcome = state.outcome()
        if state.first_fault is not None:
            raise ApplicationError(
                state.first_fault, outcome, type=ErrorType.RUN_FAULTED, non_retryable=True
            )
        if state.provider_stop_error is not None:
            # Operator stop, but a node may still run (process spec 10.13).
            raise ApplicationError(
                f"operator stop: {state.provider_stop_error}",
                outcome,
                type=ErrorType.RUN_STOP_FAILED,
                non_retryable=True,
            )
        return outcome

    def _reject(self, reason: str) -> RunOutcome:
        """RunRejected: the workflow fails with the reason; nothing was provisioned."""
        state = self._state
        state.phase = RunPhase.REJECTED
        state.record(LifecycleKind.RUN_REJECTED, reason)
        self._ctx.view.set_phase(RunPhase.REJECTED)
        raise ApplicationError(
            reason, state.outcome(), type=ErrorType.RUN_REJECTED, non_retryable=True
        )

    # ------------------------------------------------------------------ prompts
    @workflow.update(name=names.UPDATE_SUBMIT_PROMPT)
    async def submit_prompt(self, *args: Any) -> PromptTerminal:
        self._ctx.busy_handlers += 1
        try:
            return await self._prompts.serve(args)
        finally:
            self._ctx.busy_handlers -= 1

    @submit_prompt.validator
    def _validate_prompt(self, *args: Any) -> None:
        admission.validate_prompt(self._request, self._state, args)

    @workflow.update(name=names.UPDATE_ADMIT_PROMPT)
    def admit_prompt(self, *args: Any) -> PromptAdmitted:
        """Admit a prompt and answer at once (DECISIONS 77): it is served on without an
        Update in flight, its end the PromptWorkflow's result or ``prompt_end``'s."""
        return self._prompts.admit(args)

    @admit_prompt.validator
    def _validate_admission(self, *args: Any) -> None:
        admission.validate_prompt(self._request, self._state, args)

    @workflow.update(name=names.UPDATE_ADMIT_PROMPTS)
    def admit_prompts(self, *args: Any) -> AdmissionAnswers:
        """Admit several prompts in their order, each as ``admit_prompt`` would alone, and
        answer for each at once (DECISIONS 106): a client with many prompts to admit
        sends one Update for them, not one each."""
        return self._prompts.admit_all(
            admission.admissions_of(args),
            lambda prompt: admission.check_prompt(self._request, self._state, prompt),
        )

    @admit_prompts.validator
    def _validate_admissions(self, *args: Any) -> None:
        admission.validate_admissions(self._state, args)

    @workflow.query(name=names.QUERY_PROMPT_END)
    def prompt_end(self, prompt_id: str) -> PromptEnd | None:
        """Run-hosted prompt ``prompt_id`` (its key, ``PromptAdmitted.prompt_id``): open, or
        its terminal event while the run keeps it; None where the run knows none."""
        return self._prompts.end(prompt_id)

    @workflow.query(name=names.QUERY_PROMPT_ENDS)
    def prompt_ends(self, prompt_ids: Any) -> list[PromptEnd | None]:
        """``prompt_end`` for each of ``prompt_ids`` (at most PROMPT_ENDS_PER_QUERY), in
        order: one query for all the prompts a client waits on (DECISIONS 78; a server
        buffers one query per busy workflow by default, and refuses the rest). Taken as
        it comes and checked: a malformed ask fails this query alone, saying why."""
        return self._prompts.ends(prompt_ids)

    @workflow.query(name=names.QUERY_PROMPT_SERVED)
    def prompt_served(self, request_id: int) -> ServedPrompt | None:
        """The latest run-hosted prompt ``request_id`` that ended, while the run keeps it
        (DECISIONS 66); None for one still open, one of a PromptWorkflow, or one too old."""
        return self._prompts.served(request_id)

    @workflow.query(name=names.QUERY_PROMPT_STOPS)
    def prompt_stops(self, request_id: int) -> list[str] | None:
        """The stop strings of run-hosted prompt ``request_id`` (a re-attach cuts its text
        where the original response was); None if unknown."""
        return self._prompts.stops(request_id)

    # ------------------------------------------------------------------ shutdown
    def _request_shutdown(self, req: RequestShutdown) -> None:
        if req.run_id is not None and req.run_id != self._state.run_id:
            signals.ignore(
                self._state,
                names.SIGNAL_REQUEST_SHUTDOWN,
                f"run_id {req.run_id} is not this run ({self._state.run_id})",
            )
            return
        self._state.request_shutdown(req.reason)

    @workflow.update(name=names.UPDATE_SHUTDOWN_AND_WAIT)
    async def request_shutdown_and_wait(self, *args: Any) -> RunOutcome:
        self._request_shutdown(admission.shutdown_of(args))
        if workflow.patched(names.PATCH_SHUTDOWN_WAITS_CLOSE):
            # Answered with the workflow's own completion: a caller that stops its worker
            # next (the demo, a host) never leaves the run open on its datastream's end.
            await workflow.wait_condition(lambda: self._ctx.closing)
        else:
            await workflow.wait_condition(lambda: self._state.torn_down)
        return self._state.outcome()

    @request_shutdown_and_wait.validator
    def _validate_shutdown(self, *args: Any) -> None:
        admission.validate_shutdown(self._state, args)

    # ------------------------------------------------------------------ signals and view
    @workflow.signal(dynamic=True)
    async def on_signal(self, name: str, args: Sequence[RawValue]) -> None:
        """Every signal of the run (signals.py): none can fail the run."""
        self._ctx.busy_handlers += 1
        try:
            await self._on_signal(name, args)
        finally:
            self._ctx.busy_handlers -= 1

    async def _on_signal(self, name: str, args: Sequence[RawValue]) -> None:
        message = signals.decode_signal(name, args)
        if isinstance(message, str):
            signals.ignore(self._state, name, message)
            return
        if signals.apply_report(self._state, name, message):
            pass
        elif isinstance(message, RequestShutdown):
            self._request_shutdown(message)
        elif isinstance(message, CancelPrompt):
            if not await self._prompts.cancel(message):
                signals.ignore(
                    self._state,
                    names.SIGNAL_CANCEL_PROMPT,
                    f"no active or pending prompt {message.request_id}",
                )
        elif isinstance(message, DatastreamAddress):
            self._datastream_address(message)
        self._ctx.view.observe()  # a node report moves a node to another state
        if self._state.suspected_fault is not None:
            self._suspicion.start_grace()

    def _datastream_address(self, report: DatastreamAddress) -> None:
        """Where the run's datastream is served now (observation only, DECISIONS 58)."""
        if report.run_id != self._state.run_id:
            signals.ignore(
                self._state,
                names.SIGNAL_DATASTREAM_ADDRESS,
                f"run_id {report.run_id} is not this run",
            )
            return
        self._state.datastream = report

    @workflow.query(name=names.QUERY_SNAPSHOT)
    def snapshot(self) -> RunState:
        """The run's state; the full execution nonce stays inside (its first 8 characters,
        in queue names and readiness ids, are shown)."""
        return self._state.model_copy(update={"nonce": self._state.nonce[:8]})
