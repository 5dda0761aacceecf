"""Every signal a run takes, in one table: its name, the message it carries and, for a
node's report, the ``RunState`` rule that takes it.

The run workflow decodes and dispatches through this table; the senders (the node agent,
the datastream activity, the client) name their signal by the message they send
(``signal_name``), so a report and its handler cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from mvp_core import names
from mvp_core.models import (
    CancelPrompt,
    DatastreamAddress,
    LeaseStarted,
    NodeRuntimeReady,
    RequestShutdown,
    StageFault,
    StageReady,
    StageStopped,
    TokenEndpointsReady,
    WeightsReady,
)
from mvp_core.run_state import RunState

ReportRule = Callable[[RunState, Any], bool]

# A node's reports: each moves the run only through its RunState rule (which filters it
# by run, node, stage, readiness id and pipeline epoch).
REPORT_RULES: dict[str, tuple[type[BaseModel], ReportRule]] = {
    names.SIGNAL_NODE_RUNTIME_READY: (NodeRuntimeReady, RunState.on_runtime_ready),
    names.SIGNAL_LEASE_STARTED: (LeaseStarted, RunState.on_lease_started),
    names.SIGNAL_WEIGHTS_READY: (WeightsReady, RunState.on_weights_ready),
    names.SIGNAL_STAGE_READY: (StageReady, RunState.on_stage_ready),
    names.SIGNAL_STAGE_FAULT: (StageFault, RunState.on_stage_fault),
    names.SIGNAL_TOKEN_ENDPOINTS_READY: (TokenEndpointsReady, RunState.on_token_endpoints_ready),
    names.SIGNAL_STAGE_STOPPED: (StageStopped, RunState.on_stage_stopped),
}

# Every signal of the run: the reports above, and what a client or an activity asks.
RUN_SIGNALS: dict[str, type[BaseModel]] = {
    names.SIGNAL_REQUEST_SHUTDOWN: RequestShutdown,
    names.SIGNAL_CANCEL_PROMPT: CancelPrompt,
    **{name: model for name, (model, _) in REPORT_RULES.items()},
    names.SIGNAL_DATASTREAM_ADDRESS: DatastreamAddress,
}

_NAME_OF = {model: name for name, model in RUN_SIGNALS.items()}


def signal_name(message: BaseModel) -> str:
    """The run signal that carries ``message`` (KeyError: no run signal carries it)."""
    return _NAME_OF[type(message)]
