"""The provider interface: one class per kind (process, docker, vastai)."""

from __future__ import annotations

from typing import Protocol

from mvp_core.models import NodeExited, NodeHandle, NodeProvisionSpec, StopNodeResult

# Secrets a provider passes from its own environment into node environments. They never
# travel in workflow or activity payloads (ARCHITECTURE "Rules").
SECRET_ENV_PASSTHROUGH = ("HF_TOKEN",)


class Provider(Protocol):
    def start(self, spec: NodeProvisionSpec) -> NodeHandle:
        """Start a node; idempotent per (run_id, node_id, nonce)."""
        ...

    def stop(self, handle: NodeHandle, grace_s: float) -> StopNodeResult:
        """Stop a node; idempotent, "not found" is success."""
        ...

    def poll_exited(self, handles: list[NodeHandle]) -> NodeExited | None:
        """Report the first node whose runtime is gone, if any."""
        ...
