"""What the run's Updates accept: a prompt (``submit_prompt``, ``admit_prompt``), several
(``admit_prompts``) and a waiting shutdown (``request_shutdown_and_wait``), decoded from
untrusted arguments into typed messages, and refused in their validators (so a refused
one never enters history) with a typed error that names what was wrong. The prompts of an
``admit_prompts`` Update are answered one by one in its handler: one refused there is in
history with the Update (DECISIONS 106)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from mvp_core import names
    from mvp_core.errors import ErrorType
    from mvp_core.inputs import InvalidInput, decode_one
    from mvp_core.models import PromptAdmissions, RequestShutdown, RunRequest, SubmitPrompt
    from mvp_core.run_records import PromptRejection, prompt_limit
    from mvp_core.run_state import RunState

_P = TypeVar("_P", SubmitPrompt, PromptAdmissions)


def prompt_of(args: Sequence[Any]) -> SubmitPrompt:
    """The update's SubmitPrompt, or a typed InvalidPrompt naming the bad fields."""
    return _decoded(names.UPDATE_SUBMIT_PROMPT, SubmitPrompt, args)


def admissions_of(args: Sequence[Any]) -> PromptAdmissions:
    """The ``admit_prompts`` Update's prompts, or a typed InvalidPrompt naming the bad
    fields (the whole Update is refused: one malformed prompt means a broken client)."""
    return _decoded(names.UPDATE_ADMIT_PROMPTS, PromptAdmissions, args)


def _decoded(name: str, model: type[_P], args: Sequence[Any]) -> _P:
    try:
        return decode_one(name, model, args)
    except InvalidInput as err:
        raise ApplicationError(
            f"InvalidPrompt: {err.reason}", type=ErrorType.INVALID_PROMPT, non_retryable=True
        ) from None


def validate_admissions(state: RunState, args: Sequence[Any]) -> None:
    """Refuse an ``admit_prompts`` Update that is malformed, or when the run takes no
    prompt now (so that a refused one never enters history); each prompt's own refusals
    (a request id in use, a full queue, an empty prompt) are its answer's (DECISIONS 106)."""
    admissions_of(args)
    rejection = state.serving_rejection()
    if rejection is not None:
        raise ApplicationError(
            state.rejection_text(rejection, None),
            type=rejection.value,
            non_retryable=rejection is not PromptRejection.ROLLING_OVER,
        )


def validate_prompt(request: RunRequest, state: RunState, args: Sequence[Any]) -> None:
    """Refuse a prompt the run cannot take now, or one that is malformed."""
    check_prompt(request, state, prompt_of(args))


def check_prompt(request: RunRequest, state: RunState, prompt: SubmitPrompt) -> None:
    """``validate_prompt`` for a prompt already decoded."""
    if prompt.messages is not None and not prompt.chat:
        raise ApplicationError(
            "InvalidPrompt: messages need chat=true (they are rendered with the model's "
            "chat template)",
            type=ErrorType.INVALID_PROMPT,
            non_retryable=True,
        )
    if not prompt.prompt_text and not prompt.messages:
        raise ApplicationError(
            "InvalidPrompt: prompt_text must not be empty",
            type=ErrorType.INVALID_PROMPT,
            non_retryable=True,
        )
    rejection = state.admission_rejection(
        prompt.request_id,
        prompt_limit(request.prompt_queue_capacity, request.max_active_prompts),
    )
    if rejection is not None:
        raise ApplicationError(
            state.rejection_text(rejection, prompt.request_id),
            type=rejection.value,
            non_retryable=rejection is not PromptRejection.ROLLING_OVER,
        )


def shutdown_of(args: Sequence[Any]) -> RequestShutdown:
    """The update's RequestShutdown (empty: an operator stop), or InvalidShutdown."""
    try:
        return decode_one(
            names.UPDATE_SHUTDOWN_AND_WAIT, RequestShutdown, args, missing_is_default=True
        )
    except InvalidInput as err:
        raise ApplicationError(
            f"InvalidShutdown: {err.reason}",
            type=ErrorType.INVALID_SHUTDOWN,
            non_retryable=True,
        ) from None


def validate_shutdown(state: RunState, args: Sequence[Any]) -> None:
    req = shutdown_of(args)
    if req.run_id is not None and req.run_id != state.run_id:
        raise ApplicationError(
            f"InvalidShutdown: run_id {req.run_id} is not this run ({state.run_id})",
            type=ErrorType.INVALID_SHUTDOWN,
            non_retryable=True,
        )
