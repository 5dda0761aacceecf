"""Run request validation (actor spec 6.1): a rejected run provisions nothing."""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from mvp_core.models import ModelSource, ProviderKind, RunRequest
from mvp_core.names import run_id_from_workflow_id

MAX_PROMPT_QUEUE = 8
MAX_ERRORS_SHOWN = 8  # a refusal names at most this many bad fields
MAX_ERROR_CHARS = 300  # and says each one's reason in at most this many characters
# Environment a run request may not set for its nodes: how they run and what they reach
# is the provider's (a request could otherwise point a node holding secrets elsewhere).
NODE_ENV_DENIED = frozenset({"PATH", "HOME", "VIRTUAL_ENV", "TMPDIR", "CUDA_VISIBLE_DEVICES"})
NODE_ENV_DENIED_PREFIXES = ("LD_", "PYTHON", "TEMPORAL_", "XDG_")
# Node tuning a run may choose; every other MVP_ key of a node's environment is the
# provider's (identity, edge token) or the test harness's (fault injection).
NODE_ENV_TUNABLES = frozenset({"MVP_SWITCH_INTERVAL", "MVP_LEASE_SILENCE_S"})


class RunRejectedError(ValueError):
    """The request is invalid; the message names what is wrong."""


# An image reference (registry/name:tag@digest), and docker.gpus: all | count | ids.
_IMAGE_REF = re.compile(r"[a-z0-9][a-z0-9._/:@-]{0,254}", re.IGNORECASE)
_GPUS = re.compile(r"all|[0-9]{1,3}|[A-Za-z0-9-]{1,64}(,[A-Za-z0-9-]{1,64}){0,15}")


def describe_invalid(err: ValidationError) -> str:
    """Every field that is wrong, by path, without the values (node_env may hold
    near-secrets): ``engine.token_path_nice: Input should be less than or equal to 19``."""
    errors = err.errors(include_url=False, include_input=False)
    shown = "; ".join(
        f"{'.'.join(str(p) for p in e['loc'])[:80] or 'input'}: {_cut(e['msg'])}"
        for e in errors[:MAX_ERRORS_SHOWN]
    )
    more = len(errors) - MAX_ERRORS_SHOWN
    return shown if more <= 0 else f"{shown}; and {more} more"


def _cut(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def parse_request(raw: Any) -> RunRequest:
    """A run request decoded from JSON (a client, the CLI). Malformed input raises
    RunRejectedError naming what is wrong, so the run is rejected instead of its first
    workflow task failing over and over."""
    if not isinstance(raw, dict):
        raise RunRejectedError(f"invalid run request: expected a JSON object, got {json_kind(raw)}")
    try:
        return RunRequest.model_validate(raw)
    except ValidationError as err:
        raise RunRejectedError(f"invalid run request: {describe_invalid(err)}") from None


def json_kind(value: Any) -> str:
    """What a decoded JSON value is, in words (never the value itself)."""
    if value is None:
        return "no input"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else type(value).__name__


def resolve_run_id(request: RunRequest, workflow_id: str) -> int:
    """DECISIONS 1: run_id comes from the workflow id; a different one in the request rejects."""
    from_id = run_id_from_workflow_id(workflow_id)
    if from_id is None:
        if request.run_id is None:
            raise RunRejectedError(
                f"missing run id: workflow id {workflow_id!r} is not 'mvp-run-<run_id>' "
                "and the request carries no run_id"
            )
        return request.run_id
    if request.run_id is not None and request.run_id != from_id:
        raise RunRejectedError(
            f"run_id {request.run_id} in the request does not match workflow id {workflow_id!r}"
        )
    return from_id


def validate_request(request: RunRequest) -> None:
    """Reject what can be decided without I/O. Planning checks the model itself."""
    if request.pipeline_stages <= 0:
        raise RunRejectedError("--pipeline-stages must be greater than 0")
    if not 1 <= request.prompt_queue_capacity <= MAX_PROMPT_QUEUE:
        raise RunRejectedError(
            f"prompt_queue_capacity={request.prompt_queue_capacity} must be between 1 and "
            f"{MAX_PROMPT_QUEUE}"
        )
    if _sources_set(request.model) != 1:
        raise RunRejectedError(
            "missing model source: set exactly one of model.bundled, model.path or model.hf"
        )
    if request.tokenizer is not None and _sources_set(request.tokenizer) != 1:
        raise RunRejectedError("tokenizer source must set exactly one of bundled, path or hf")
    _validate_provider_settings(request)
    for key in request.node_env:
        _validate_node_env_key(key)
    shot = request.one_shot
    if shot is not None:
        if shot.messages is not None and not shot.chat:
            raise RunRejectedError("one_shot.messages need one_shot.chat = true")
        if not shot.prompt_text and not shot.messages:
            raise RunRejectedError("one_shot.prompt_text must not be empty")


def _validate_provider_settings(request: RunRequest) -> None:
    """The provider sections: Vast.ai's own, the worker image, Docker's GPUs."""
    if request.provider is ProviderKind.VASTAI:
        vast = request.vastai
        if not (vast.bootstrap_command or "").strip():
            raise RunRejectedError(
                "vastai.bootstrap_command is required when the provider is vastai"
            )
        if not vast.image:
            raise RunRejectedError("vastai.image is required when the provider is vastai")
        if not _IMAGE_REF.fullmatch(vast.image):
            raise RunRejectedError(
                "invalid vastai.image: not an image reference ([registry/]name[:tag][@digest])"
            )
        if request.worker_image is not None:
            raise RunRejectedError(
                "worker_image is a docker provider setting; a vastai run names its image in "
                "vastai.image"
            )
    if request.provider is ProviderKind.PROCESS and request.worker_image is not None:
        # A process node is this installation's node agent (DECISIONS 47): an image it
        # would ignore is refused, not dropped (issue 38 item 8).
        raise RunRejectedError(
            "worker_image is a docker provider setting; a process node runs this "
            "installation's node agent (python -m workers.node)"
        )
    if request.worker_image is not None and not _IMAGE_REF.fullmatch(request.worker_image):
        raise RunRejectedError(
            "invalid worker_image: not an image reference ([registry/]name[:tag][@digest])"
        )
    gpus = request.docker.gpus
    if gpus and not _GPUS.fullmatch(gpus):
        raise RunRejectedError(
            "invalid docker.gpus: use 'all', a count, or comma-separated device ids"
        )
    if gpus and request.provider is not ProviderKind.DOCKER:
        raise RunRejectedError(
            f"docker.gpus is a docker provider setting; provider is {request.provider.value!r}"
        )
    per_stage = request.docker.memory_per_stage or None
    for key, value in (
        ("cpus", request.docker.cpus),
        ("memory", request.docker.memory),
        ("memory_per_stage", per_stage),
    ):
        if value is not None and request.provider is not ProviderKind.DOCKER:
            raise RunRejectedError(
                f"docker.{key} is a docker provider setting; provider is {request.provider.value!r}"
            )

    if per_stage and request.docker.memory is not None:
        raise RunRejectedError(
            "docker.memory and docker.memory_per_stage: choose one (one limit for every "
            "container, or each its own stage's planned need)"
        )


def _validate_node_env_key(key: str) -> None:
    """A node_env key a request may set: no fault switch, nothing the provider sets,
    nothing that looks like a secret."""
    if key.upper().startswith(("MVP_FAULT_", "MVP_TEST_")):
        raise RunRejectedError(
            f"node_env key {key!r} is test-only fault injection; a run request cannot switch it on"
        )
    if key.upper() in NODE_ENV_DENIED or key.upper().startswith(NODE_ENV_DENIED_PREFIXES):
        raise RunRejectedError(
            f"node_env key {key!r} is set by the provider (how a node runs and what it "
            "reaches); a run request cannot change it"
        )
    if key.upper().startswith("MVP_") and key not in NODE_ENV_TUNABLES:
        raise RunRejectedError(
            f"node_env key {key!r} is set by the provider; a run request may set only "
            f"{', '.join(sorted(NODE_ENV_TUNABLES))} of the MVP_ keys"
        )
    if any(s in key.upper() for s in ("KEY", "TOKEN", "SECRET", "PASSWORD")):
        raise RunRejectedError(
            f"node_env key {key!r} looks like a secret; secrets are read from the "
            "orchestrator worker's environment, never from the run request"
        )


def _sources_set(source: ModelSource) -> int:
    """How many of a model source's forms are set (a valid source sets one; each form's
    own shape, such as a hub repo id, is checked by the model itself)."""
    return sum(x is not None for x in (source.bundled, source.path, source.hf))
