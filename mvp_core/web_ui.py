"""What the Temporal Web UI shows of a run before anyone opens a payload: the one-line
static summary and the static details its starter passes to ``start_workflow`` (stored in
the run's first event; the run's live phase is its current details, set by RunWorkflow).
Ids, names and counts only: never prompt text, node environment or a secret. A payload
key (``MVP_PAYLOAD_KEY``) encrypts these too; the Web UI shows them through the codec
server (docs/security.md)."""

from __future__ import annotations

from mvp_core.models import ProviderKind, RunRequest
from mvp_core.names import SEARCH_ATTRIBUTE_PHASE

_NAME_MAX = 120


def _short(text: str) -> str:
    return text if len(text) <= _NAME_MAX else text[: _NAME_MAX - 3] + "..."


def run_summary(run_id: int, request: RunRequest) -> str:
    """``run 7: SmolLM2-135M-Instruct.Q4_1, 2 stage(s) on process``: ids and names only."""
    model = request.model.display_name() or "the default model"
    return (
        f"run {run_id}: {model[:_NAME_MAX]}, {request.pipeline_stages} stage(s) on "
        f"{request.provider.value}"
    )


def run_details(run_id: int, request: RunRequest) -> str:
    """The run's shape as the Web UI's static details (Temporal markdown, a few lines):
    where its model comes from, its stages and provider, its prompt limits, and where
    its live phase is shown."""
    src = request.model
    if src.hf is not None:
        model = f"{src.hf.file} of {src.hf.repo} (Hugging Face, {src.hf.revision})"
    elif src.path:
        model = f"{src.display_name()} (a file on the provider's host)"
    else:
        model = f"{src.bundled or 'the default model'} (bundled)"
    provider = request.provider.value
    image = (
        request.vastai.image
        if request.provider is ProviderKind.VASTAI
        else request.worker_image
        if request.provider is ProviderKind.DOCKER
        else None
    )
    if image:
        provider += f", image {image}"
    tokens = (
        "until the end (no default cap)"
        if not request.default_max_tokens
        else f"{request.default_max_tokens} by default"
    )
    context = f"at most {request.max_context} tokens" if request.max_context else "the model's own"
    lines = [
        f"**run {run_id}**",
        f"model: {_short(model)}",
        f"stages: {request.pipeline_stages} (activations {request.activation_dtype.value})",
        f"provider: {_short(provider)}",
        f"prompts: up to {request.prompt_queue_capacity} admitted at once; tokens {tokens}; "
        f"context {context}",
        f"phase: live in this run's current details, and in its search attribute "
        f"{SEARCH_ATTRIBUTE_PHASE}",
    ]
    return "\n\n".join(lines)
