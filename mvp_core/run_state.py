"""The run state machine: pure, deterministic, serialisable.

The workflow feeds it reports and asks it questions; every rule of the actor spec that
decides whether the run advances lives here and is unit-tested without Temporal.
The whole state is a pydantic model, so it is what ``snapshot`` returns and what
continue-as-new carries.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from mvp_core import names
from mvp_core.models import (
    DatastreamAddress,
    IgnoredInput,
    LeaseStarted,
    LifecycleKind,
    LifecycleReport,
    NodeLossPolicy,
    NodeRuntimeReady,
    NodeRuntimeReadyAck,
    PromptHead,
    PromptHost,
    PromptTerminal,
    RecoverySettings,
    RunOutcome,
    RunOutcomeKind,
    RunPhase,
    RunPlan,
    ShutdownReason,
    StageFault,
    StageReady,
    StageStopped,
    TokenEndpointsReady,
    WeightsReady,
)
from mvp_core.run_records import (
    MAX_KIND,
    REJECTION_TEXT,
    NodeState,
    PromptRecord,
    PromptRejection,
    StageRecovery,
    clip_reason,
    is_echo,
)

MAX_PROMPT_REPORTS = 256
MAX_IGNORED_KEPT = 16  # the latest ignored inputs described in the snapshot (all are counted)
MAX_LATER_FAULTS = 8
MAX_RECOVERIES_KEPT = 16  # the latest stage recoveries described in the snapshot
_SERVING = (RunPhase.PROMPT_READY, RunPhase.RECOVERING, RunPhase.ROLLING_OVER)
_PROMPT_REPORTS = frozenset(
    {
        LifecycleKind.PROMPT_ACCEPTED,
        LifecycleKind.PROMPT_COMPLETED,
        LifecycleKind.PROMPT_FAULTED,
        LifecycleKind.PROMPT_CANCELLED,
    }
)


class RunState(BaseModel):
    run_id: int
    nonce: str
    authorized_orchestrator: str
    phase: RunPhase = RunPhase.ACCEPTED
    plan: RunPlan | None = None
    provider_queue: str | None = None
    # Where the run serves its prompts (DECISIONS 66): a client reads a run-hosted
    # prompt's text from the head node only, and its end from the run.
    prompt_host: PromptHost = PromptHost.WORKFLOW
    nodes: list[NodeState] = Field(default_factory=list)
    # The prompts generating now, in activation order: ``active`` the earliest, then
    # ``also_active`` (only a run with max_active_prompts > 1 has any: DECISIONS 62).
    active: PromptRecord | None = None
    also_active: list[PromptRecord] = Field(default_factory=list)
    pending: list[PromptRecord] = Field(default_factory=list)
    # The most prompts generating at once so far in this run (carried across
    # continue-as-new): how far max_active_prompts was used.
    most_active: int = 0
    lifecycle: list[LifecycleReport] = Field(default_factory=list)
    # Reports ever recorded (``lifecycle`` keeps only the latest prompt reports): an
    # observer tells new reports by it, not by the list's length.
    lifecycle_recorded: int = 0
    first_fault: str | None = None
    # The phase the run was in at its first fault (a startup fault's failed phase).
    fault_phase: RunPhase | None = None
    # A one-shot run's prompt, once it ended (actor spec 8): the outcome's one_shot.
    one_shot: PromptTerminal | None = None
    first_stop_error: str | None = None
    provider_stop_error: str | None = None
    later_faults: list[str] = Field(default_factory=list)
    suspected_fault: str | None = None
    shutdown: ShutdownReason | None = None
    prompts_completed: int = 0
    prompts_faulted: int = 0
    prompts_cancelled: int = 0  # (DECISIONS 98: not counted as faulted)
    continued: int = 0
    # Continue-as-new is due; prompts finish first and none is admitted (DECISIONS 13).
    # Neither carried nor in the snapshot (the phase says it): the next run serves.
    rolling_over: bool = Field(default=False, exclude=True)
    ignored_reports: int = 0
    ignored: list[IgnoredInput] = Field(default_factory=list)
    token_endpoints_ready: bool = False
    token_endpoints_stopped: bool = False
    # The run's datastream (its activity's last DatastreamAddress; None before one came).
    datastream: DatastreamAddress | None = None
    # Stage recovery (DECISIONS 68): the policy, the pipeline's epoch (one more per
    # recovery; data-plane reports of an earlier one move nothing), the losses waiting for
    # their replacement, the one being replaced, the latest done, and the nodes replaced.
    node_loss: NodeLossPolicy = NodeLossPolicy.FAIL
    recovery_bound: RecoverySettings = Field(default_factory=RecoverySettings)
    epoch: int = 0
    lost: list[StageRecovery] = Field(default_factory=list)
    recovering: StageRecovery | None = None
    recoveries: list[StageRecovery] = Field(default_factory=list)
    recoveries_done: int = 0
    replaced_nodes: list[NodeState] = Field(default_factory=list)

    # ------------------------------------------------------------------ lifecycle
    def record(self, kind: LifecycleKind, detail: str = "", request_id: int | None = None) -> bool:
        """Append a lifecycle report. RunTornDown is recorded at most once."""
        if kind is LifecycleKind.RUN_TORN_DOWN and self.torn_down:
            return False
        self.lifecycle.append(
            LifecycleReport(kind=kind, run_id=self.run_id, detail=detail, request_id=request_id)
        )
        self.lifecycle_recorded += 1
        if kind in _PROMPT_REPORTS:
            self._trim_prompt_reports()
        return True

    def _trim_prompt_reports(self) -> None:
        """Keep every run-level report but only the latest prompt reports, so that the
        state carried across continue-as-new stays bounded on a long run."""
        prompt_reports = [r for r in self.lifecycle if r.kind in _PROMPT_REPORTS]
        excess = len(prompt_reports) - MAX_PROMPT_REPORTS
        if excess <= 0:
            return
        drop = {id(r) for r in prompt_reports[:excess]}
        self.lifecycle = [r for r in self.lifecycle if id(r) not in drop]

    @property
    def torn_down(self) -> bool:
        return any(r.kind is LifecycleKind.RUN_TORN_DOWN for r in self.lifecycle)

    def fault(self, reason: str) -> bool:
        """The first terminal cause decides the outcome (actor spec 12.4): the first run
        fault is terminal and sticky; a fault after an operator stop, or after the first
        fault, is kept as a fact and changes nothing."""
        reason = clip_reason(reason)
        if self.first_fault is not None or self.shutdown is not None:
            if reason != self.first_fault and len(self.later_faults) < MAX_LATER_FAULTS:
                self.later_faults.append(reason)
            return False
        self.first_fault = reason
        self.fault_phase = self.phase
        self.record(LifecycleKind.RUN_FAULTED, reason)
        return True

    def suspect(self, reason: str) -> bool:
        """A fault reported by a survivor (a stage whose peer closed its edge, a driver
        whose pipeline went quiet) may be the echo of a node that died: it becomes the
        run's fault only if no node is found gone within a short grace
        (``confirm_suspected``), so that the first fault names the node that died."""
        if self.stopping:
            return self.fault(reason)  # kept as a later fact
        if self.suspected_fault is not None:
            kept = reason
            if is_echo(self.suspected_fault) and not is_echo(reason):
                # The first report was a peer seeing the edge close; this one says why.
                kept, self.suspected_fault = self.suspected_fault, reason
            if len(self.later_faults) < MAX_LATER_FAULTS:
                self.later_faults.append(kept)
            return False
        self.suspected_fault = clip_reason(reason)
        return True

    def confirm_suspected(self) -> bool:
        """The grace is over: a suspected fault that nothing explained is the run's fault."""
        reason, self.suspected_fault = self.suspected_fault, None
        return reason is not None and self.fault(reason)

    def request_shutdown(self, reason: ShutdownReason) -> bool:
        """Operator stop: terminal and distinct from a fault. Ignored after a fault."""
        if self.shutdown is not None or self.first_fault is not None:
            return False
        self.shutdown = reason
        self.record(LifecycleKind.RUN_OPERATOR_STOPPED, reason.value)
        return True

    @property
    def stopping(self) -> bool:
        return self.first_fault is not None or self.shutdown is not None

    def stop_error(self, error: str, *, provider: bool = False) -> None:
        """Teardown keeps the first stop error and goes on with the other stops. A failed
        provider stop (a node that may still run) also fails an operator-stopped run
        (process spec 10.13)."""
        if self.first_stop_error is None:
            self.first_stop_error = error
        if provider and self.provider_stop_error is None:
            self.provider_stop_error = error

    def ignore(self, kind: str, reason: str) -> bool:
        """Count and describe an input the run does not act on (never its content)."""
        self.ignored_reports += 1
        self.ignored.append(IgnoredInput(kind=kind[:MAX_KIND], reason=clip_reason(reason)))
        del self.ignored[:-MAX_IGNORED_KEPT]
        return False

    def outcome(self) -> RunOutcome:
        if self.phase is RunPhase.REJECTED:
            kind = RunOutcomeKind.REJECTED
        elif self.first_fault is not None:
            kind = RunOutcomeKind.FAULTED
        else:
            kind = RunOutcomeKind.OPERATOR_STOPPED
        return RunOutcome(
            run_id=self.run_id,
            outcome=kind,
            lifecycle=list(self.lifecycle),
            first_fault=self.first_fault,
            first_stop_error=self.first_stop_error,
            later_faults=list(self.later_faults),
            prompts_completed=self.prompts_completed,
            prompts_faulted=self.prompts_faulted,
            prompts_cancelled=self.prompts_cancelled,
            one_shot=self.one_shot,
        )

    # ------------------------------------------------------------------ planning
    def may_provision(self) -> bool:
        """Provisioning starts only after a committed plan and only if not stopping."""
        return self.plan is not None and not self.stopping and self.phase is not RunPhase.REJECTED

    # ------------------------------------------------------------------ node reports
    def node(self, node_id: int) -> NodeState | None:
        for n in self.nodes:
            if n.node_id == node_id:
                return n
        return None

    def _match(
        self,
        kind: str,
        run_id: int,
        node_id: int | None,
        stage_index: int | None,
        readiness_id: str | None,
    ) -> NodeState | None:
        """The one node a report is about, or None (counted and described as ignored)."""
        if run_id != self.run_id:
            self.ignore(kind, f"run_id {run_id} is not this run ({self.run_id})")
            return None
        candidates = self.nodes
        if node_id is not None:
            candidates = [n for n in candidates if n.node_id == node_id]
        if stage_index is not None:
            candidates = [n for n in candidates if n.stage_index == stage_index]
        if readiness_id is not None:
            candidates = [n for n in candidates if n.readiness_id == readiness_id]
        if len(candidates) != 1:
            self.ignore(
                kind,
                f"no node of this execution matches node {node_id}, stage {stage_index} "
                "and its readiness id",
            )
            return None
        return candidates[0]

    def on_runtime_ready(self, report: NodeRuntimeReady) -> bool:
        """Accept a NodeRuntimeReady only if run, node, stage and readiness id all match."""
        node = self._match(
            "node_runtime_ready",
            report.run_id,
            report.node_id,
            report.stage_index,
            report.readiness_id,
        )
        if node is None:
            return False
        if report.node_actor != node.task_queue:
            return self.ignore("node_runtime_ready", "node_actor is not the node's task queue")
        if node.runtime_ready is None:
            node.runtime_ready = report
        return True

    def on_lease_started(self, report: LeaseStarted) -> bool:
        node = self._match(
            "lease_started", report.run_id, report.node_id, None, report.readiness_id
        )
        if node is None:
            return False
        node.lease_started = True
        return True

    def on_route_checked(self, node_id: int, owned: bool, reason: str = "") -> None:
        node = self.node(node_id)
        if node is not None:
            node.route_owned = owned
            if not owned:
                node.route_failed = clip_reason(reason or "not owned by the node's worker")

    def on_ack(self, ack: NodeRuntimeReadyAck) -> bool:
        node = self._match(
            "runtime_ready_ack", ack.run_id, ack.node_id, ack.stage_index, ack.readiness_id
        )
        if node is None:
            return False
        if not self.barrier_passed(node):
            return self.ignore(
                "runtime_ready_ack", f"node {node.node_id} has not passed its barrier"
            )
        node.acked = True
        return True

    def on_weights_ready(self, report: WeightsReady) -> bool:
        node = self._match(
            "weights_ready", report.run_id, report.node_id, report.stage_index, report.readiness_id
        )
        if node is None:
            return False
        if not node.stage_provisioned:
            return self.ignore("weights_ready", f"stage {node.stage_index} was not provisioned")
        node.weights_ready = True
        return True

    def _stale(self, kind: str, epoch: int) -> bool:
        """A data-plane report of a pipeline other than the run's (one a recovery replaced)."""
        if epoch == self.epoch:
            return False
        self.ignore(kind, f"a report of pipeline epoch {epoch}; the run's is {self.epoch}")
        return True

    def on_stage_ready(self, report: StageReady) -> bool:
        node = self._match(
            "stage_ready", report.run_id, None, report.stage_index, report.readiness_id
        )
        if node is None or self._stale("stage_ready", report.epoch):
            return False
        if not node.stage_provisioned:
            return self.ignore("stage_ready", f"stage {node.stage_index} was not provisioned")
        # Kept even when it overtakes WeightsReady (DECISIONS 3); both gate prompt-ready.
        node.stage_ready = True
        return True

    def on_stage_fault(self, report: StageFault) -> bool:
        node = self._match(
            "stage_fault", report.run_id, None, report.stage_index, report.readiness_id
        )
        if node is None or self._stale("stage_fault", report.epoch):
            return False
        if self.lost or (self.recovering is not None and self.recovering.epoch is None):
            # A survivor seeing the lost node's edges close: the loss explains it. (A fault
            # of the new pipeline, once it is wired, is one.)
            self.ignore("stage_fault", f"stage {report.stage_index}, during stage recovery")
            return False
        node.stage_faulted = True
        self.suspect(f"{self.phase_word()}: stage {report.stage_index} fault: {report.reason}")
        return True

    def on_token_endpoints_ready(self, report: TokenEndpointsReady) -> bool:
        node = self._match(
            "token_endpoints_ready", report.run_id, report.node_id, 0, report.readiness_id
        )
        if node is None or self._stale("token_endpoints_ready", report.epoch):
            return False
        if not node.stage_provisioned:
            return self.ignore("token_endpoints_ready", "the head stage was not provisioned")
        self.token_endpoints_ready = True
        return True

    @property
    def uses_token_endpoints(self) -> bool:
        return self.plan is not None and self.plan.stage_count > 1

    def on_stage_stopped(self, report: StageStopped) -> bool:
        node = self._match(
            "stage_stopped", report.run_id, None, report.stage_index, report.readiness_id
        )
        if node is None:
            return False
        node.stage_stopped = True
        return True

    def on_lease_lost(self, node_id: int, detail: str, at_ms: int = 0) -> None:
        """Membership loss: a startup fault before prompt-ready; while serving, a run
        fault, or the node's replacement (DECISIONS 68)."""
        node = self.node(node_id)
        if node is None:
            self._replaced_gone(node_id, exited=False)
            return
        node.lease_lost = True
        if not self.stopping:
            self._lose(node, f"membership lost for node {node_id}: {detail}", at_ms)

    def on_node_exited(self, node_id: int, detail: str, at_ms: int = 0) -> None:
        node = self.node(node_id)
        if node is None:
            self._replaced_gone(node_id, exited=True)
            return
        node.exited = True
        if not self.stopping:
            self._lose(node, f"node {node_id} exited: {detail}", at_ms)

    def _replaced_gone(self, node_id: int, *, exited: bool) -> None:
        for node in self.replaced_nodes:
            if node.node_id == node_id:
                if exited:
                    node.exited = True
                else:
                    node.lease_lost = True

    def _lose(self, node: NodeState, detail: str, at_ms: int) -> None:
        """A node is lost while the run is not stopping: its replacement is queued when the
        run's policy and bound allow one, else the run faults (the specs' fail-stop)."""
        where = self.phase_word()
        reason = f"{where}: {detail}"
        if self.node_loss is not NodeLossPolicy.REPLACE or self.phase not in _SERVING:
            self.fault(reason)
            return
        if any(r.lost_node_id == node.node_id for r in self.lost):
            return  # seen already (the watch and the lease both report it)
        if self.lost or self.recovering is not None:
            self.fault(f"{reason} (while stage {self._recovering_stage()} was being replaced)")
            return
        bound = self.recovery_bound
        since = at_ms - int(bound.window_s * 1000)
        recent = sum(1 for r in self.recoveries if r.lost_at_ms >= since)
        if recent >= bound.max_replacements:
            self.fault(
                f"{reason} (no replacement left: {bound.max_replacements} within "
                f"{bound.window_s:g} s)"
            )
            return
        self.lost.append(
            StageRecovery(
                stage_index=node.stage_index,
                lost_node_id=node.node_id,
                detail=clip_reason(detail),
                lost_at_ms=at_ms,
            )
        )
        if self.suspected_fault is not None:
            # What a survivor reported (its edge to the lost node closed) is explained.
            if len(self.later_faults) < MAX_LATER_FAULTS:
                self.later_faults.append(self.suspected_fault)
            self.suspected_fault = None
        self.phase = RunPhase.RECOVERING
        self.record(LifecycleKind.STAGE_LOST, f"stage {node.stage_index}: {clip_reason(detail)}")

    def _recovering_stage(self) -> int:
        first = self.recovering or self.lost[0]
        return first.stage_index

    def begin_replacement(self, at_ms: int) -> tuple[NodeState, NodeState]:
        """The next lost node's replacement: (the lost node, its replacement). The lost
        node leaves the run's nodes (its reports are ignored from now on: it never rejoins)
        and a node with a new id, task queue and readiness id takes its stage."""
        rec = self.lost.pop(0)
        index = next(i for i, n in enumerate(self.nodes) if n.node_id == rec.lost_node_id)
        lost = self.nodes[index]
        new_id = max(n.node_id for n in (*self.nodes, *self.replaced_nodes)) + 1
        node = NodeState(
            node_id=new_id,
            stage_index=lost.stage_index,
            task_queue=names.node_task_queue(self.run_id, new_id, self.nonce),
            readiness_id=f"{self.nonce[:8]}-{new_id}-{lost.stage_index}",
        )
        self.nodes[index] = node
        self.replaced_nodes.append(lost)
        if self.plan is not None:
            stage = self.plan.stages[lost.stage_index]
            self.plan.stages[lost.stage_index] = stage.model_copy(update={"node_id": new_id})
        rec.new_node_id, rec.started_at_ms = new_id, at_ms
        self.recovering = rec
        self.record(
            LifecycleKind.STAGE_REPLACING,
            f"stage {lost.stage_index}: node {new_id} replaces node {lost.node_id}",
        )
        return lost, node

    def replacement_joined(self, at_ms: int) -> None:
        if self.recovering is not None:
            self.recovering.joined_at_ms = at_ms

    def next_epoch(self) -> int:
        """A new pipeline: every stage wires its edges again and reports ready anew."""
        self.epoch += 1
        for node in self.nodes:
            node.weights_ready = node.stage_ready = False
        self.token_endpoints_ready = False
        if self.recovering is not None:
            self.recovering.epoch = self.epoch
        return self.epoch

    def recovered(self, at_ms: int, phase: RunPhase = RunPhase.PROMPT_READY) -> None:
        """The run is prompt-ready again on the new pipeline."""
        rec, self.recovering = self.recovering, None
        if rec is None:
            return
        rec.ready_at_ms = at_ms
        self.recoveries.append(rec)
        del self.recoveries[:-MAX_RECOVERIES_KEPT]
        self.recoveries_done += 1
        # Replaced nodes stay described while their stop may be owed, the latest always.
        kept = self.replaced_nodes[-MAX_RECOVERIES_KEPT:]
        self.replaced_nodes = [
            n for n in self.replaced_nodes if not n.provider_stopped or n in kept
        ]
        if not self.lost:
            self.phase = phase
        self.record(
            LifecycleKind.STAGE_RECOVERED,
            f"stage {rec.stage_index} on node {rec.new_node_id} (pipeline {rec.epoch}), "
            f"{rec.seconds(rec.lost_at_ms, at_ms)} s after the loss",
        )

    def is_recovering(self) -> bool:
        """A lost node waits for its replacement, or one is being replaced."""
        return bool(self.lost) or self.recovering is not None

    def head_news(self, head_task_queue: str) -> PromptHead | None:
        """What a prompt admitted to the head at ``head_task_queue`` has not heard of its
        head: that it is being replaced, or which node serves instead (None: nothing)."""
        rec = self.recovering
        head = self.head()
        replacing = rec is not None and rec.stage_index == 0
        if not replacing and head.task_queue == head_task_queue:
            return None
        return PromptHead(
            node_id=head.node_id,
            task_queue=head.task_queue,
            readiness_id=head.readiness_id,
            ready=not replacing,
        )

    def draws_seed(self, temperature: float, seed: int | None) -> bool:
        """Whether the run draws a sampled prompt's seed at admission: where it replaces
        lost nodes, a resume on a replacement head draws the same tokens (DECISIONS 68)."""
        return self.node_loss is NodeLossPolicy.REPLACE and temperature > 0 and seed is None

    # ------------------------------------------------------------------ rolling over
    def resume_carried(self) -> None:
        """The state that continue-as-new carried: serving resumes at once (DECISIONS 13)."""
        self.continued += 1
        self.phase = RunPhase.PROMPT_READY
        self.rolling_over = False

    def should_roll_over(self, suggested: bool) -> bool:
        """Time to roll over (the server suggests continue-as-new), unless the run already
        is, or a stage is being replaced: the recovery finishes first."""
        return suggested and not self.rolling_over and not self.is_recovering()

    def begin_rolling_over(self) -> None:
        """Admit no prompt until the run has continued as new (its phase says so too)."""
        self.rolling_over = True

    def rolled_over(self) -> bool:
        """Rolling over, and every prompt has ended: the run may continue as new."""
        return self.rolling_over and self.prompts_in_flight() == 0 and not self.is_recovering()

    def serving_phase(self) -> RunPhase:
        """The phase a run that serves is in once a recovery is done."""
        return RunPhase.ROLLING_OVER if self.rolling_over else RunPhase.PROMPT_READY

    def phase_word(self) -> str:
        if self.phase in _SERVING:
            return "prompt serving"
        return f"startup ({self.phase.value})"

    # ------------------------------------------------------------------ readiness
    def barrier_passed(self, node: NodeState) -> bool:
        """Runtime readiness (actor spec 6.4): report + membership + route + no failure."""
        return (
            node.runtime_ready is not None
            and node.lease_started
            and not node.lease_lost
            and node.route_owned
            and not node.exited
        )

    def all_barriers_passed(self) -> bool:
        return bool(self.nodes) and all(self.barrier_passed(n) for n in self.nodes)

    def all_acked(self) -> bool:
        return bool(self.nodes) and all(n.acked for n in self.nodes)

    def prompt_ready_allowed(self) -> bool:
        """Prompt-ready (actor spec 6.8): every barrier, ack, stage and weight fact."""
        return (
            not self.stopping
            and self.all_barriers_passed()
            and self.all_acked()
            and all(n.stage_provisioned and n.weights_ready and n.stage_ready for n in self.nodes)
            and (self.token_endpoints_ready or not self.uses_token_endpoints)
        )

    def head(self) -> NodeState:
        return min(self.nodes, key=lambda n: n.stage_index)

    # ------------------------------------------------------------------ prompts
    def admission_rejection(self, request_id: int, capacity: int) -> PromptRejection | None:
        refused = self.serving_rejection()
        if refused is not None:
            return refused
        if self.prompt(request_id) is not None:
            return PromptRejection.DUPLICATE_REQUEST_ID
        if self.prompts_in_flight() >= capacity:
            return PromptRejection.QUEUE_FULL
        return None

    def serving_rejection(self) -> PromptRejection | None:
        """Why the run takes no prompt now, whichever it is; None where it takes some."""
        if self.stopping:
            # A shutdown (or a fault) was asked for, though the phase may not show it yet
            # (in the same workflow task): say so, not "not prompt-ready".
            return PromptRejection.SHUTTING_DOWN
        if self.phase not in (RunPhase.PROMPT_READY, RunPhase.RECOVERING) or self.suspected_fault:
            if self.rolling_over or self.phase is RunPhase.ROLLING_OVER:
                return PromptRejection.ROLLING_OVER
            return PromptRejection.NOT_PROMPT_READY
        if self.rolling_over:
            return PromptRejection.ROLLING_OVER
        return None

    def rejection_text(self, rejection: PromptRejection, request_id: int | None) -> str:
        """The rejection's message: its type, what it means here, and the run's facts. A
        run that is prompt-ready but confirming a fault (its grace) says which, not only
        "not prompt-ready" beside "phase prompt_ready". ``request_id`` None: a refusal of
        every prompt of an ``admit_prompts`` Update (DECISIONS 106)."""
        text = REJECTION_TEXT[rejection]
        if rejection is PromptRejection.NOT_PROMPT_READY and self.suspected_fault:
            text = f"the run is faulting ({self.suspected_fault})"
        which = "" if request_id is None else f"request_id {request_id}, "
        return f"{rejection.value}: {text} ({which}run {self.run_id}, phase {self.phase.value})"

    def prompts_in_flight(self) -> int:
        return len(self.pending) + len(self.actives())

    def actives(self) -> list[PromptRecord]:
        """The prompts generating now, the earliest activated first."""
        return ([self.active] if self.active is not None else []) + self.also_active

    def prompt(self, request_id: int) -> PromptRecord | None:
        for p in (*self.actives(), *self.pending):
            if p.request_id == request_id:
                return p
        return None

    def admit(
        self, request_id: int, workflow_id: str, update_id: str | None = None
    ) -> PromptRecord:
        record = PromptRecord(request_id=request_id, workflow_id=workflow_id, update_id=update_id)
        self.pending.append(record)
        self.record(LifecycleKind.PROMPT_ACCEPTED, workflow_id, request_id)
        return record

    def may_activate(self, max_active: int = 1) -> bool:
        """A pending prompt may start generating now: a slot is free, the run is
        prompt-ready (or rolling over) and not stopping or suspecting a fault."""
        if len(self.actives()) >= max_active or not self.pending:
            return False
        if self.stopping or self.suspected_fault:
            return False
        return self.phase in (RunPhase.PROMPT_READY, RunPhase.ROLLING_OVER)

    def activate_next(self, max_active: int = 1) -> PromptRecord | None:
        """Up to ``max_active`` prompts generate at once, started FIFO; only while
        prompt-ready."""
        if not self.may_activate(max_active):
            return None
        record = self.pending.pop(0)
        record.active = True
        if self.active is None:
            self.active = record
        else:
            self.also_active.append(record)
        self.most_active = max(self.most_active, len(self.actives()))
        return record

    def remove_pending(self, request_id: int) -> PromptRecord | None:
        for i, p in enumerate(self.pending):
            if p.request_id == request_id:
                return self.pending.pop(i)
        return None

    def finish_prompt(
        self, workflow_id: str, ok: bool, detail: str, request_id: int, cancelled: bool = False
    ) -> None:
        """Clear the prompt's state after its one terminal event: completed (``ok``),
        cancelled (its client's cancel or the run's shutdown) or faulted."""
        if self.active is not None and self.active.workflow_id == workflow_id:
            # The next earliest takes its place (a snapshot's ``active`` is the oldest).
            self.active = self.also_active.pop(0) if self.also_active else None
        elif any(p.workflow_id == workflow_id for p in self.also_active):
            self.also_active = [p for p in self.also_active if p.workflow_id != workflow_id]
        else:
            self.pending = [p for p in self.pending if p.workflow_id != workflow_id]
        if ok:
            self.prompts_completed += 1
            self.record(LifecycleKind.PROMPT_COMPLETED, detail, request_id)
        elif cancelled:
            self.prompts_cancelled += 1
            self.record(LifecycleKind.PROMPT_CANCELLED, detail, request_id)
        else:
            self.prompts_faulted += 1
            self.record(LifecycleKind.PROMPT_FAULTED, detail, request_id)

    # ------------------------------------------------------------------ teardown
    def stages_to_stop(self) -> list[NodeState]:
        """StopRun goes to every stage that was provisioned and whose node is not lost."""
        return [n for n in self.nodes if n.stage_provisioned and not n.exited and not n.lease_lost]

    def stage_stops_observed(self) -> bool:
        return all(n.stage_stopped for n in self.stages_to_stop())

    def nodes_to_stop(self) -> list[NodeState]:
        """Every node whose start was attempted: one without a handle (its start never
        reported back) may still have been launched, and is stopped by its name."""
        return [
            n
            for n in (*self.nodes, *self.replaced_nodes)
            if (n.start_attempted or n.handle is not None) and not n.provider_stopped
        ]
