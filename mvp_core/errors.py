"""Every error type the project raises across a process boundary, in one enum.

An ``ApplicationError``'s ``type`` (what a client, the gateway or the host reads to decide
what to do) is always one of these values; nobody compares against a string literal.
The values are the wire names recorded in workflow histories: never rename one.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorType(StrEnum):
    # The run workflow's own ends (RunWorkflow's result is an error of these types).
    RUN_REJECTED = "RunRejected"
    RUN_FAULTED = "RunFaulted"
    RUN_STOP_FAILED = "RunStopFailed"
    # Its update validators: a prompt or a shutdown that was not taken.
    INVALID_PROMPT = "InvalidPrompt"
    INVALID_SHUTDOWN = "InvalidShutdown"
    # submit_prompt's typed rejections (DECISIONS 9; mvp_core.run_state.PromptRejection).
    RUN_NOT_PROMPT_READY = "RunNotPromptReady"
    RUN_SHUTTING_DOWN = "RunShuttingDown"
    DUPLICATE_REQUEST_ID = "DuplicateRequestId"
    PROMPT_QUEUE_FULL = "PromptQueueFull"
    RUN_ROLLING_OVER = "RunRollingOver"
    # A prompt the head node refused after encoding it: it does not fit the context.
    PROMPT_TOO_LONG = "PromptTooLong"
    # A chat prompt the head node could not render: the model has no chat template, or
    # its template refused the conversation (e.g. roles that do not alternate).
    CHAT_TEMPLATE_REFUSED = "ChatTemplateRefused"
    # Orchestrator activities.
    PLANNING_ERROR = "PlanningError"
    PROVIDER_UNAVAILABLE = "ProviderUnavailable"
    ROUTE_NOT_POLLED = "RouteNotPolled"
    REAPER_FAILED = "ReaperFailed"
    # Node activities.
    STAGE_REJECTED = "StageRejected"
    STAGE_LOAD_FAILED = "StageLoadFailed"
    STAGE_NOT_READY = "StageNotReady"
    ENGINE_FAULT = "EngineFault"
