"""The reaper's rule (DECISIONS 30), pure: which provider resources to destroy.

The reaper sweeps by what each provider reports, never only by our records. A resource
belongs to a run (its ``run_workflow_id``) and to one execution of it (its ``nonce8``).
It is destroyed when its run's workflow does not exist, is closed, or is running another
execution (another nonce). Anything else is kept: a running run of the same execution,
and every doubt (the liveness check failed or timed out, a nonce we cannot read). A
wrong keep costs a leaked resource until the next sweep; a wrong destroy kills a live
run, so doubt always keeps.

The messages of the reaper's workflow and activities live here too.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from mvp_core.models import ProviderResource


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class Liveness(StrEnum):
    ABSENT = "absent"  # no workflow with this id exists
    CLOSED = "closed"  # its latest execution is closed (completed, failed, terminated, ...)
    RUNNING = "running"  # running; ``nonce8`` is its execution's
    UNKNOWN = "unknown"  # the check failed or timed out: never destroy on doubt


class RunLiveness(_Model):
    """What the liveness check found for one run workflow id."""

    state: Liveness
    nonce8: str | None = Field(default=None, description="The running execution's nonce[:8]")
    detail: str = Field(default="", max_length=500)


class ReapDecision(_Model):
    """One resource and why it was destroyed, kept or not destroyed."""

    resource: ProviderResource
    reason: str


class ReapPlan(_Model):
    destroy: list[ReapDecision] = Field(default_factory=list)
    keep: list[ReapDecision] = Field(default_factory=list)


class ReapInput(_Model):
    """The input of one ReaperWorkflow: sweep this host's providers."""

    host: str
    destroy_timeout_s: float = Field(default=60.0, gt=0)


class ResourceListing(_Model):
    """What the providers of one host reported."""

    host: str
    resources: list[ProviderResource] = Field(default_factory=list)
    errors: list[str] = Field(
        default_factory=list, description="Providers that could not list: 'kind: why'"
    )
    unavailable: list[str] = Field(
        default_factory=list, description="Providers this host cannot reach (not swept)"
    )


class LivenessInput(_Model):
    run_workflow_ids: list[str]


class LivenessResult(_Model):
    runs: dict[str, RunLiveness] = Field(default_factory=dict)


class DestroyInput(_Model):
    resource: ProviderResource


class DestroyResult(_Model):
    destroyed: bool
    error: str | None = None


class ReapReport(_Model):
    """The result of one ReaperWorkflow: everything it saw, and what it did."""

    host: str
    listed: int = 0
    destroyed: list[ReapDecision] = Field(default_factory=list)
    kept: list[ReapDecision] = Field(default_factory=list)
    failed: list[ReapDecision] = Field(
        default_factory=list, description="To destroy, but the destroy failed (reason: why)"
    )
    errors: list[str] = Field(default_factory=list, description="Providers that could not list")
    unavailable: list[str] = Field(default_factory=list)


def run_ids_of(resources: list[ProviderResource]) -> list[str]:
    """The run workflow ids whose liveness the decision needs, sorted, once each."""
    return sorted({r.run_workflow_id for r in resources})


def decide_one(resource: ProviderResource, live: RunLiveness | None) -> tuple[bool, str]:
    """(destroy?, why) for one resource given its run's liveness (None: not checked)."""
    run = resource.run_workflow_id
    if live is None:
        return False, f"liveness of {run} was not checked"
    if live.state is Liveness.ABSENT:
        return True, f"run {run} does not exist"
    if live.state is Liveness.CLOSED:
        return True, f"run {run} is closed" + (f" ({live.detail})" if live.detail else "")
    if live.state is Liveness.RUNNING:
        if not live.nonce8 or not resource.nonce8:
            return False, f"run {run} is running and the execution cannot be told apart"
        if live.nonce8[:8] == resource.nonce8[:8]:
            return False, f"run {run} is running this execution ({live.nonce8[:8]})"
        return True, (
            f"run {run} is running another execution "
            f"({live.nonce8[:8]}, the resource's is {resource.nonce8[:8]})"
        )
    return False, f"liveness of {run} unknown" + (f": {live.detail}" if live.detail else "")


def decide(resources: list[ProviderResource], liveness: dict[str, RunLiveness]) -> ReapPlan:
    """Split ``resources`` into those to destroy and those to keep, each with its reason."""
    plan = ReapPlan()
    for resource in resources:
        destroy, reason = decide_one(resource, liveness.get(resource.run_workflow_id))
        (plan.destroy if destroy else plan.keep).append(
            ReapDecision(resource=resource, reason=reason)
        )
    return plan
