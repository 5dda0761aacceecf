"""The typed client of a run: one :class:`RunHandle` for everything a host, the gateway,
the demo or ``mvp-chat`` asks of run ``mvp-run-<run_id>``.

    run = await RunHandle.start(client, 7, request)     # or RunHandle(client, 7) to attach
    await run.wait_prompt_ready()
    async with contextlib.aclosing(run.stream(SubmitPrompt(...))) as events:
        async for event in events:
            if isinstance(event, TextDelta): print(event.text, end="", flush=True)
            else: ...  # Done or Fault, always last, exactly once
    outcome = await run.shutdown_and_wait(ShutdownReason.OPERATOR_REQUESTED)

The prompt is admitted by the run's ``submit_prompt`` Update (its validator rejects a
full queue, a duplicate id, or a run that is not prompt-ready, raising ``PromptRejected``);
its text deltas come from the prompt's own workflow stream, which any client can
subscribe to and re-attach to; the terminal event is the Update's result. A stream owns
its prompt: left before its terminal event (a ``break``, an error, a cancellation, or the
iterator dropped), it cancels the prompt, so that the run's active slot is free for the
next one (DECISIONS 55).

Updates and the query are called by method reference (``RunWorkflow.submit_prompt``);
the run's two client signals (``request_shutdown``, ``cancel_prompt``) are routed by the
run's dynamic signal handler, so each goes by the name the run's signal table gives its
message (``mvp_core.run_signals.signal_name``), from here only.

The modules behind this face: ``lifecycle`` (start, attach, state, readiness,
shutdown), ``prompts`` (submit, stream, cancel), ``text`` (where a prompt's text comes
from), ``lookup`` (find and re-attach), ``updates`` (Update resends), ``errors``.
"""

from mvp_core.names import QUERY_TIMEOUT
from temporal.client.errors import (
    PromptNotFound,
    PromptRejected,
    PromptUnavailable,
    RunClosed,
    RunNotOpen,
)
from temporal.client.handle import RunHandle
from temporal.client.lifecycle import QUERY_FAILED
from temporal.client.lookup import PromptLocation
from temporal.client.prompts import ADMIT_WAIT_S, CANCEL_TIMEOUT_S
from temporal.client.text import PromptEvents

__all__ = [
    "ADMIT_WAIT_S",
    "CANCEL_TIMEOUT_S",
    "QUERY_FAILED",
    "QUERY_TIMEOUT",
    "PromptEvents",
    "PromptLocation",
    "PromptNotFound",
    "PromptRejected",
    "PromptUnavailable",
    "RunClosed",
    "RunHandle",
    "RunNotOpen",
]
