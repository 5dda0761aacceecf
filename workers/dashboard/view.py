"""What the dashboard shows of a run, shaped from the run's own observations.

Pure functions over the run's ``snapshot`` (``RunState``), its status in Temporal, the
figures of its finished prompts, the tails of its node logs and the nodes' own figures
(their datastream channels); ``workers.dashboard.observer``
gathers those and streams the result. Ids, names, counts, timings and log lines only:
never a prompt's text, the execution nonce or anything else the page does not show.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, Field

from mvp_core import datastream as ds
from mvp_core.models import LifecycleKind, PromptOutcome, PromptStatus, ServedPrompt
from mvp_core.run_records import NodeCondition, NodeState
from mvp_core.run_state import RunState

RECENT_PROMPTS = 8  # finished prompts shown per run, newest last
MAX_TEXT = 300  # a fault or error text as shown

RunStatus = Literal[
    "running",
    "completed",
    "failed",
    "canceled",
    "terminated",
    "timed_out",
    "continued_as_new",
    "not_found",
    "unreachable",
]


# A stage's state is its node's condition (mvp_core.run_state), as the metrics say it.
StageState = NodeCondition


def stage_state(node: NodeState | None) -> StageState:
    return StageState.PLANNED if node is None else node.condition()


class LogTail(BaseModel):
    """The last lines of a node's log, or why there are none."""

    lines: list[str] = Field(default_factory=list)
    note: str | None = None
    # Where they were read: the run's datastream (its node log channels, with the node's
    # stderr and its provider's progress), or the node's log file on this host.
    source: Literal["datastream", "file"] = "file"


class FeedEvent(BaseModel):
    """One of the run's events from its datastream, as the page shows it."""

    at_ms: int  # when the datastream published it (epoch ms)
    channel: str  # e.g. mvp.orch.bootstrap
    text: str


class NodeFigures(BaseModel):
    """A node's latest figures from its own channels (DECISIONS 93; the served run's
    datastream): its load, its last steps' mean, its KV slots, its edges' rates."""

    load_status: str | None = None  # loading, loaded, failed
    loaded_mb: float | None = None
    load_total_mb: float | None = None
    step_ms: float | None = None  # the mean forward step of its last busy interval
    steps_per_s: float | None = None
    kv_in_use: int | None = None
    kv_total: int | None = None
    in_kb_s: float | None = None
    out_kb_s: float | None = None


def _number(record: Mapping[str, Any], key: str) -> float | None:
    value = record.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def node_figures(prev: NodeFigures | None, channel: str, record: Any) -> NodeFigures | None:
    """``prev`` with a record of a node's own channel taken in (None: not one)."""
    if not isinstance(record, dict):
        return None
    got = (prev or NodeFigures()).model_copy()
    kind = record.get("type")
    if channel == ds.CHANNEL_NODE_LOAD and kind == "NodeLoad":
        loaded, total = _number(record, "loaded_bytes"), _number(record, "total_bytes")
        got.load_status = clip(str(record.get("status")), 16)
        got.loaded_mb = None if loaded is None else round(loaded / 1e6, 1)
        got.load_total_mb = None if total is None else round(total / 1e6, 1)
    elif channel == ds.CHANNEL_NODE_STEPS and kind == "NodeSteps":
        steps, interval = _number(record, "steps"), _number(record, "interval_ms")
        got.step_ms = _number(record, "mean_ms")
        got.steps_per_s = round(steps * 1000 / interval, 1) if steps and interval else None
    elif channel == ds.CHANNEL_NODE_KV and kind == "NodeKv":
        in_use, total = _number(record, "slots_in_use"), _number(record, "slots_total")
        got.kv_in_use = None if in_use is None else int(in_use)
        got.kv_total = None if total is None else int(total)
    elif channel == ds.CHANNEL_NODE_EDGES and kind == "NodeEdges":
        rate_in, rate_out = _number(record, "in_bytes_per_s"), _number(record, "out_bytes_per_s")
        got.in_kb_s = None if rate_in is None else round(rate_in / 1e3, 1)
        got.out_kb_s = None if rate_out is None else round(rate_out / 1e3, 1)
    else:
        return None
    return got


class StageView(BaseModel):
    stage_index: int
    node_id: int
    layer_start: int | None = None
    layer_end: int | None = None  # exclusive
    host: str | None = None
    provider: str | None = None
    pid: int | None = None
    share_mb: float | None = None  # a hub model: the node's share, and what its host fetched
    fetched_mb: float | None = None
    # while the share is fetched (its start activity's heartbeat): how much is held so far
    fetching_mb: float | None = None
    state: StageState
    log: LogTail | None = None
    own: NodeFigures | None = None  # the node's own channels (served run, DECISIONS 93)


class PromptFigures(BaseModel):
    """A finished prompt's figures, from its workflow's history and result."""

    status: PromptStatus
    tokens: int | None = None
    elapsed_ms: int | None = None  # the head node's own generation time (Done.elapsed_ms)
    stop_reason: str | None = None
    ttft_ms: int | None = None  # admission to its first text reaching Temporal or a reader
    queued_ms: int | None = None  # admission to its generation being scheduled
    decode_tokens_per_s: float | None = None  # the head node's decode rate (its timing)


def figures(
    outcome: PromptOutcome | None,
    *,
    started_ms: int | None,
    scheduled_ms: int | None,
    first_text_ms: int | None,
) -> PromptFigures:
    """A prompt's figures from its outcome and the times (epoch ms) of its workflow's
    start, its generate activity's scheduling and its first published text."""
    status = outcome.status if outcome is not None else PromptStatus.FAULTED
    out = PromptFigures(status=status)
    if outcome is not None and outcome.terminal.type == "done":
        out.tokens = outcome.terminal.tokens_generated
        out.elapsed_ms = outcome.terminal.elapsed_ms
        out.stop_reason = outcome.terminal.stop_reason
        if outcome.timing is not None:
            out.decode_tokens_per_s = outcome.timing.decode_tokens_per_s
    if started_ms is not None:
        if first_text_ms is not None:
            out.ttft_ms = max(0, first_text_ms - started_ms)
        if scheduled_ms is not None:
            out.queued_ms = max(0, scheduled_ms - started_ms)
    if out.ttft_ms is None and outcome is not None and outcome.timing is not None:
        # Its text went to its readers directly (DECISIONS 63), not through Temporal:
        # the workflow's queue wait plus the head node's own encode, prefill, first delta.
        t = outcome.timing
        queued = outcome.queued_ms if outcome.queued_ms is not None else out.queued_ms or 0
        out.ttft_ms = round(queued + t.encode_ms + t.prefill_ms + t.first_delta_ms)
    return out


def served_figures(served: ServedPrompt) -> PromptFigures:
    """A run-hosted prompt's figures (DECISIONS 66): its outcome, its admission time and
    its queue wait as its run measured them."""
    queued = served.outcome.queued_ms
    return figures(
        served.outcome,
        started_ms=served.admitted_ms,
        scheduled_ms=None if queued is None else served.admitted_ms + round(queued),
        first_text_ms=None,
    )


class PromptView(BaseModel):
    request_id: str  # as text: request ids pass 2**53, past what a JavaScript number holds
    status: str  # done, cancelled or faulted
    tokens: int | None = None
    tokens_per_s: float | None = None
    ttft_ms: int | None = None
    queued_ms: int | None = None
    stop_reason: str | None = None
    error: str | None = None


class RecoveryView(BaseModel):
    """One stage recovery (DECISIONS 68): the lost node, its replacement, and the seconds
    from the loss to the replacement joining and to prompt-ready again."""

    stage_index: int
    lost_node_id: int
    new_node_id: int | None
    detail: str
    joined_s: float | None = None
    ready_s: float | None = None


class QueueView(BaseModel):
    active: str | None = None  # request id (as text, as in PromptView): the earliest
    also_active: list[str] = Field(default_factory=list)  # the others generating now
    pending: list[str] = Field(default_factory=list)  # request ids, FIFO order


class RunView(BaseModel):
    workflow_id: str
    run_id: int | None
    served: bool  # the run this gateway serves
    status: RunStatus
    phase: str | None = None
    stopping: bool = False
    shutdown: str | None = None
    fault: str | None = None
    model: str | None = None
    stage_count: int | None = None
    max_seq_len: int | None = None
    prompts_completed: int = 0
    prompts_faulted: int = 0
    prompts_cancelled: int = 0
    continued: int = 0
    recoveries_done: int = 0  # stage recoveries (DECISIONS 68)
    recovering: str | None = None  # the stage being replaced now, and how far it is
    recoveries: list[RecoveryView] = Field(default_factory=list)  # the latest, oldest first
    queue: QueueView = Field(default_factory=QueueView)
    stages: list[StageView] = Field(default_factory=list)
    recent: list[PromptView] = Field(default_factory=list)
    # The served run's last datastream events, oldest first, and where its datastream is
    # followed from (or why it is not).
    events: list[FeedEvent] = Field(default_factory=list)
    datastream: str | None = None
    note: str | None = None  # why what is shown may be stale or missing


class Observation(BaseModel):
    """One frame of the dashboard's stream."""

    served: str  # the workflow id of the run this gateway serves
    runs: list[RunView]


class FinishedPrompt(BaseModel):
    request_id: int
    workflow_id: str | None  # None when its PromptAccepted report was trimmed away
    ok: bool
    detail: str
    cancelled: bool = False  # a PromptCancelled report (DECISIONS 98)


_ENDS = (
    LifecycleKind.PROMPT_COMPLETED,
    LifecycleKind.PROMPT_FAULTED,
    LifecycleKind.PROMPT_CANCELLED,
)


def finished_prompts(state: RunState, limit: int = RECENT_PROMPTS) -> list[FinishedPrompt]:
    """The run's latest finished prompts, oldest first, from its lifecycle reports (a
    request id can come back once its prompt ended: each end pairs with the admission
    before it)."""
    admitted: dict[int, str] = {}
    done: list[FinishedPrompt] = []
    for report in state.lifecycle:
        rid = report.request_id
        if rid is None:
            continue
        if report.kind is LifecycleKind.PROMPT_ACCEPTED:
            admitted[rid] = report.detail
        elif report.kind in _ENDS:
            done.append(
                FinishedPrompt(
                    request_id=rid,
                    workflow_id=admitted.pop(rid, None),
                    ok=report.kind is LifecycleKind.PROMPT_COMPLETED,
                    detail=report.detail,
                    cancelled=report.kind is LifecycleKind.PROMPT_CANCELLED,
                )
            )
    return done[-limit:] if limit > 0 else []


def prompt_view(prompt: FinishedPrompt, figs: PromptFigures | None) -> PromptView:
    if figs is None:
        status = (
            PromptStatus.DONE
            if prompt.ok
            else PromptStatus.CANCELLED
            if prompt.cancelled
            else PromptStatus.FAULTED
        ).value
        return PromptView(
            request_id=str(prompt.request_id), status=status, error=clip(prompt.detail) or None
        )
    rate = None
    if figs.decode_tokens_per_s is not None:  # decode alone, as the node measured it
        rate = round(figs.decode_tokens_per_s, 1)
    elif figs.tokens and figs.elapsed_ms:  # a node that reports no timing
        rate = round(figs.tokens * 1000 / figs.elapsed_ms, 1)
    return PromptView(
        request_id=str(prompt.request_id),
        status=figs.status.value,
        tokens=figs.tokens,
        tokens_per_s=rate,
        ttft_ms=figs.ttft_ms,
        queued_ms=figs.queued_ms,
        stop_reason=figs.stop_reason,
        error=None if prompt.ok else clip(prompt.detail) or None,
    )


def _mb(n: int | None) -> float | None:
    return None if n is None else round(n / 1e6, 1)


def stage_views(
    state: RunState,
    logs: Mapping[int, LogTail],
    fetches: Mapping[int, tuple[int, int]] | None = None,
    conditions: Mapping[int, StageState] | None = None,
    own: Mapping[int, NodeFigures] | None = None,
) -> list[StageView]:
    """One row per planned stage (before the plan: per node the run knows); ``fetches``:
    the shares being fetched now, by node (bytes held, bytes in all); ``conditions``: a
    node's state where the run's datastream told more than the snapshot (by node);
    ``own``: each node's figures from its own channels (by node)."""
    fetches = fetches or {}
    conditions = conditions or {}
    own = own or {}
    by_stage = {n.stage_index: n for n in state.nodes}
    rows: list[StageView] = []
    planned = state.plan.stages if state.plan is not None else []
    indices = [s.stage_index for s in planned] or sorted(by_stage)
    layers = {s.stage_index: s.layers for s in planned}
    node_ids = {s.stage_index: s.node_id for s in planned}
    for index in indices:
        node = by_stage.get(index)
        handle = node.handle if node is not None else None
        node_id = node.node_id if node is not None else node_ids[index]
        span = layers.get(index)
        fetching = fetches.get(node_id) if handle is None else None
        share = handle.share_bytes if handle is not None else None
        rows.append(
            StageView(
                stage_index=index,
                node_id=node_id,
                layer_start=span.start if span is not None else None,
                layer_end=span.end if span is not None else None,
                host=handle.host if handle is not None else None,
                provider=handle.provider.value if handle is not None else None,
                pid=handle.pid if handle is not None else None,
                share_mb=_mb(fetching[1] if fetching is not None else share),
                fetched_mb=_mb(handle.share_fetched) if handle is not None else None,
                fetching_mb=_mb(fetching[0]) if fetching is not None else None,
                state=conditions.get(node_id) or stage_state(node),
                log=logs.get(node_id),
                own=own.get(node_id),
            )
        )
    return rows


def run_view(
    workflow_id: str,
    run_id: int | None,
    status: RunStatus,
    state: RunState | None,
    *,
    served: bool,
    figures_of: Mapping[str, PromptFigures],
    logs: Mapping[int, LogTail],
    note: str | None = None,
    fetches: Mapping[int, tuple[int, int]] | None = None,
    conditions: Mapping[int, StageState] | None = None,
    own: Mapping[int, NodeFigures] | None = None,
) -> RunView:
    view = RunView(workflow_id=workflow_id, run_id=run_id, served=served, status=status, note=note)
    if state is None:
        return view
    plan = state.plan
    view.run_id = state.run_id
    view.phase = state.phase.value
    view.stopping = state.stopping
    view.shutdown = state.shutdown.value if state.shutdown is not None else None
    view.fault = clip(state.first_fault) if state.first_fault else None
    if plan is not None:
        view.model = plan.model_path.replace("\\", "/").rsplit("/", 1)[-1].removesuffix(".gguf")
        view.stage_count = plan.stage_count
        view.max_seq_len = plan.max_seq_len
    view.prompts_completed = state.prompts_completed
    view.prompts_faulted = state.prompts_faulted
    view.prompts_cancelled = state.prompts_cancelled
    view.continued = state.continued
    view.recoveries_done = state.recoveries_done
    view.recoveries = [
        RecoveryView(
            stage_index=r.stage_index,
            lost_node_id=r.lost_node_id,
            new_node_id=r.new_node_id,
            detail=clip(r.detail),
            joined_s=r.seconds(r.lost_at_ms, r.joined_at_ms),
            ready_s=r.seconds(r.lost_at_ms, r.ready_at_ms),
        )
        for r in state.recoveries[-RECENT_RECOVERIES:]
    ]
    view.recovering = recovering_text(state)
    view.queue = QueueView(
        active=str(state.active.request_id) if state.active is not None else None,
        also_active=[str(p.request_id) for p in state.also_active],
        pending=[str(p.request_id) for p in state.pending],
    )
    view.stages = stage_views(state, logs, fetches, conditions, own)
    view.recent = [
        prompt_view(p, figures_of.get(p.workflow_id) if p.workflow_id else None)
        for p in finished_prompts(state)
    ]
    return view


RECENT_RECOVERIES = 4


def recovering_text(state: RunState) -> str | None:
    """The stage recovery under way, in words (None: none)."""
    rec = state.recovering or (state.lost[0] if state.lost else None)
    if rec is None:
        return None
    if rec.new_node_id is None:
        return f"stage {rec.stage_index}: node {rec.lost_node_id} lost, its replacement next"
    step = "loading and wiring the pipeline" if rec.joined_at_ms else "starting"
    return (
        f"stage {rec.stage_index}: node {rec.new_node_id} replacing node "
        f"{rec.lost_node_id} ({step})"
    )


def clip(text: str | None, limit: int = MAX_TEXT) -> str:
    if not text:
        return ""
    return text if len(text) <= limit else text[: limit - 1] + "…"
