"""The run's metrics as a port: what the workflows record, and where it goes.

Workflows import only the core and ``temporalio``, so they cannot reach the process's
OpenTelemetry instruments themselves. They call :func:`sink` and record on whatever the
process installed (``temporal.telemetry.setup`` installs its replay-safe recorder); with
metrics off nothing is installed and every call is a no-op.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol


class RunMetrics(Protocol):
    """What a run and its prompts report (names and units: docs/telemetry.md)."""

    def record_prompt_ready(self, run_id: int, elapsed_ms: float) -> None: ...

    def record_run_gauges(self, run_id: int, queued: int, nodes: Mapping[str, int]) -> None: ...

    def record_prompt(
        self, status: str, ttft_ms: float | None = None, tokens_per_s: float | None = None
    ) -> None: ...

    def record_recovery(self, run_id: int, stage_index: int, elapsed_ms: float) -> None: ...


class _Off:
    """Metrics off: every record is dropped."""

    def record_prompt_ready(self, run_id: int, elapsed_ms: float) -> None:
        return None

    def record_run_gauges(self, run_id: int, queued: int, nodes: Mapping[str, int]) -> None:
        return None

    def record_prompt(
        self, status: str, ttft_ms: float | None = None, tokens_per_s: float | None = None
    ) -> None:
        return None

    def record_recovery(self, run_id: int, stage_index: int, elapsed_ms: float) -> None:
        return None


OFF: RunMetrics = _Off()
_sink: RunMetrics = OFF


def install(metrics: RunMetrics) -> None:
    """Make ``metrics`` this process's sink (``OFF`` turns recording off again)."""
    global _sink
    _sink = metrics


def sink() -> RunMetrics:
    return _sink
