"""A run's lifecycle reports, phases and its final outcome."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from mvp_core.models._base import _Model
from mvp_core.models.prompts import PromptTerminal


class LifecycleKind(StrEnum):
    RUN_ACCEPTED = "RunAccepted"
    RUN_REJECTED = "RunRejected"
    RUN_PLANNING_STARTED = "RunPlanningStarted"
    RUN_PLANNING_READY = "RunPlanningReady"
    RUN_PROVISIONING_STARTED = "RunProvisioningStarted"
    RUN_READINESS_STARTED = "RunReadinessStarted"
    RUN_READY = "RunReady"
    PROMPT_ACCEPTED = "PromptAccepted"
    PROMPT_COMPLETED = "PromptCompleted"
    PROMPT_FAULTED = "PromptFaulted"
    # A prompt cancelled, not faulted (DECISIONS 98): by its client (``cancel_prompt``, a
    # stream left, a connection closed) or by the run's shutdown; the detail says which.
    PROMPT_CANCELLED = "PromptCancelled"
    RUN_OPERATOR_STOPPED = "RunOperatorStopped"
    # Stage recovery (DECISIONS 68): a node lost, its replacement starting, the run
    # prompt-ready again on the new pipeline.
    STAGE_LOST = "StageLost"
    STAGE_REPLACING = "StageReplacing"
    STAGE_RECOVERED = "StageRecovered"
    RUN_FAULTED = "RunFaulted"
    RUN_TEARING_DOWN = "RunTearingDown"
    RUN_TORN_DOWN = "RunTornDown"


class LifecycleReport(_Model):
    kind: LifecycleKind
    run_id: int
    detail: str = ""
    request_id: int | None = None


class RunPhase(StrEnum):
    ACCEPTED = "accepted"
    PLANNING = "planning"
    PROVISIONING = "provisioning"
    READINESS = "readiness"
    STAGE_PROVISIONING = "stage_provisioning"
    PROMPT_READY = "prompt_ready"
    RECOVERING = "recovering"  # a lost node is being replaced (DECISIONS 68)
    ROLLING_OVER = "rolling_over"
    TEARING_DOWN = "tearing_down"
    TORN_DOWN = "torn_down"
    REJECTED = "rejected"


class RunOutcomeKind(StrEnum):
    OPERATOR_STOPPED = "operator_stopped"
    FAULTED = "faulted"
    REJECTED = "rejected"


class IgnoredInput(_Model):
    """A signal, report or update payload the run ignored: what it was and why, never its
    content (which may carry secrets or user text)."""

    kind: str
    reason: str


class RunOutcome(_Model):
    run_id: int
    outcome: RunOutcomeKind
    lifecycle: list[LifecycleReport]
    first_fault: str | None = None
    first_stop_error: str | None = None
    later_faults: list[str] = Field(
        default_factory=list,
        description="Faults seen after the run's terminal cause (an operator stop): facts, "
        "not a new outcome",
    )
    prompts_completed: int = 0
    one_shot: PromptTerminal | None = Field(
        default=None,
        description="A one-shot run's prompt: its one terminal event (Done with the text)",
    )
    prompts_faulted: int = 0
    prompts_cancelled: int = 0
