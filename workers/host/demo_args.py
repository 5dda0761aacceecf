"""What the demo checks and prepares before it starts anything: every flag's value
(:func:`check_flags`: the run request and the prompt the flags make, built and validated
as the run would, each refusal named by its flag), ``--model`` as a model source (a
bundled name, a GGUF file, or ``hf:OWNER/NAME/FILE.gguf[@REVISION]``), the model fetched
with its download shown, and what the model's header decides (:func:`check_model`:
``--chat`` needs a chat template, ``--stages`` at most its layers). A flag refused is a
:class:`FlagError` (exit status 2, as argparse's own refusals); anything else that stops
the demo first is a :class:`DemoError` (status 1); both are said on stderr before any
process starts."""

from __future__ import annotations

import argparse
import mmap
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from mvp_core.gguf_header import parse_header
from mvp_core.models import (
    HubModel,
    ModelSource,
    RunRequest,
    SubmitPrompt,
)
from mvp_core.validation import RunRejectedError, describe_invalid, validate_request
from mvp_io.model_store import (
    BUNDLED,
    DEFAULT_BUNDLED,
    GEMMA3_BUNDLED,
    HubUnreachableError,
    ModelSourceError,
)
from workers.host.model_fetch import DownloadLine, model_download


class DemoError(Exception):
    """Why the demo cannot go on, in words for stderr; the demo exits with 1."""


class FlagError(DemoError):
    """A flag's value the demo refuses, named as the user typed it (``--stages 0: ...``):
    said before anything starts, as argparse says its own refusals (the usage line, then
    ``python -m workers.host.demo: error: ...``), and the demo exits with 2."""


# The fields of the run request and the prompt that the demo's flags set, and the flag
# (with the args attribute holding what the user typed) each comes from.
FLAG_OF_FIELD = {
    "pipeline_stages": ("--stages", "stages"),
    "default_max_tokens": ("--max-tokens", "max_tokens"),
    "max_tokens": ("--max-tokens", "max_tokens"),
    "max_active_prompts": ("--max-active-prompts", "max_active_prompts"),
    "prompt_host": ("--prompt-host", "prompt_host"),
    "provider": ("--provider", "provider"),
    "model": ("--model", "model"),
    "prompt_text": ("--prompt", "prompt"),
    "chat": ("--chat", "chat"),
}
SHOWN_VALUE_CHARS = 200  # a flag's value quoted in a refusal: past this, cut short


@dataclass(frozen=True)
class DemoPlan:
    """What the demo's flags ask for, checked: the run request and the prompt it sends."""

    source: ModelSource
    request: RunRequest
    prompt: SubmitPrompt


def check_flags(args: argparse.Namespace) -> DemoPlan:
    """Every flag's value, before anything starts (no data directory, dev server, worker
    or run): the run request and the prompt are built here, as the demo sends them, and
    validated as the run validates them. Raises :class:`FlagError` naming each refused
    flag, as the user typed it, with its reason."""
    problems: dict[str, str] = {}  # flag: what is wrong with it, one each
    if args.stages < 1:
        problems["--stages"] = (
            f"{flag_value('--stages', args.stages)}: a run needs 1 stage or more "
            "(1: direct mode, one node holding every layer)"
        )
    if not args.prompt:
        problems["--prompt"] = (
            f"{flag_value('--prompt', args.prompt)}: the prompt must not be empty "
            "(the run refuses an empty prompt)"
        )
    if args.run_id < 0:
        problems["--run-id"] = (
            f"{flag_value('--run-id', args.run_id)}: a run id is 0 or more "
            "(0: one derived from the clock)"
        )
    if not str(args.data_dir).strip():
        problems["--data-dir"] = "--data-dir '': name a directory (default .temporal/demo)"
    source: ModelSource | None = None
    try:
        source = model_source(args.model)
    except FlagError as err:
        problems["--model"] = str(err)
    request = _built(
        RunRequest,
        problems,
        args,
        model=source or ModelSource(),
        pipeline_stages=args.stages,
        default_max_tokens=args.max_tokens,
        max_active_prompts=args.max_active_prompts,
        prompt_host=args.prompt_host,
        provider=args.provider,
    )
    prompt = _built(
        SubmitPrompt,
        problems,
        args,
        request_id=1,
        prompt_text=args.prompt,
        max_tokens=args.max_tokens,
        chat=args.chat,
    )
    if not problems and isinstance(request, RunRequest):
        try:  # the run's own checks: whatever the flags let through that it would refuse
            validate_request(request)
        except RunRejectedError as err:
            problems["run"] = f"the run would be rejected: {err}"
    if problems:
        raise FlagError("; ".join(problems.values()))
    assert source is not None
    assert isinstance(request, RunRequest) and isinstance(prompt, SubmitPrompt)
    return DemoPlan(source=source, request=request, prompt=prompt)


def flag_value(flag: str, value: object) -> str:
    """``--max-tokens -1``: a flag as the user typed it (a long value cut short)."""
    text = str(value)
    if len(text) > SHOWN_VALUE_CHARS:
        text = text[: SHOWN_VALUE_CHARS - 3] + "..."
    return f"{flag} {shlex.quote(text)}"


def _built(
    kind: type[RunRequest] | type[SubmitPrompt],
    problems: dict[str, str],
    args: argparse.Namespace,
    /,
    **fields: Any,
) -> RunRequest | SubmitPrompt | None:
    """``kind(**fields)``, or None with each field error added to ``problems`` under the
    flag that set the field, unless that flag is refused already (--max-tokens sets two
    fields: one line)."""
    try:
        return kind(**fields)
    except ValidationError as err:
        for e in err.errors(include_url=False, include_input=False):
            field = str(e["loc"][0]) if e["loc"] else ""
            flag, attr = FLAG_OF_FIELD.get(field, (field or "input", ""))
            if flag not in problems:
                shown = flag_value(flag, getattr(args, attr)) if attr else flag
                problems[flag] = f"{shown}: {e['msg']}"
        return None


HUB_PREFIX = "hf:"


def model_source(value: str) -> ModelSource:
    """``--model``: a bundled model's name, the path of a GGUF file on this host, or
    ``hf:OWNER/NAME/FILE.gguf[@REVISION]``, a GGUF of a Hugging Face repo."""
    if value.startswith(HUB_PREFIX):
        return ModelSource(hf=hub_model(value.removeprefix(HUB_PREFIX)))
    if value in BUNDLED:
        return ModelSource(bundled=value)
    path = Path(value).expanduser()
    if path.is_file():
        return ModelSource(path=str(path.resolve()))
    raise FlagError(
        f"--model {value!r} is neither a bundled model ({', '.join(sorted(BUNDLED))}), "
        "an existing GGUF file, nor hf:OWNER/NAME/FILE.gguf[@REVISION]"
    )


def hub_model(text: str) -> HubModel:
    """``OWNER/NAME/FILE.gguf[@REVISION]`` (the file may lie in folders of the repo)."""
    spec, at, revision = text.rpartition("@") if "@" in text else (text, "", "")
    owner, _, rest = spec.partition("/")
    name, _, file = rest.partition("/")
    fields = {"repo": f"{owner}/{name}", "file": file} | ({"revision": revision} if at else {})
    try:
        return HubModel.model_validate(fields)
    except ValidationError as err:
        raise FlagError(
            f"--model {HUB_PREFIX}{text}: {describe_invalid(err)} "
            f"(use {HUB_PREFIX}OWNER/NAME/FILE.gguf[@REVISION])"
        ) from None


def fetch_model(source: ModelSource) -> Path:
    """Fetch a bundled or hub model before the run starts, so its download shows here
    (the run's planning then finds it in the same model cache); the GGUF file's path."""
    download = model_download(source)
    if download is None:
        assert source.path is not None
        return Path(source.path)
    what, origin, fetch = download
    line = DownloadLine(what, origin)
    try:
        path = fetch(line)
    except (ModelSourceError, HubUnreachableError) as err:
        raise DemoError(str(err)) from None
    line.finish()
    return path


CHAT_TEMPLATE_KEY = "tokenizer.chat_template"
# What --help says; tests/integration/test_demo.py checks it against the files.
BUNDLED_CHAT = f"{DEFAULT_BUNDLED} has one; {GEMMA3_BUNDLED} (a base model) has none"


def model_metadata(path: Path) -> dict[str, Any]:
    """The GGUF's metadata, from its header only, through the core's decoder: no engine,
    no torch (about 20 ms)."""
    try:
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return dict(parse_header(buf, str(path)).metadata)
    except (OSError, ValueError) as err:  # GGUFError is a ValueError; so is an empty file
        raise DemoError(f"cannot read the GGUF header of {path}: {err}") from None


def chat_template(path: Path, metadata: dict[str, Any] | None = None) -> str | None:
    """The GGUF's chat template (metadata ``tokenizer.chat_template``), None without one."""
    meta = model_metadata(path) if metadata is None else metadata
    value = meta.get(CHAT_TEMPLATE_KEY)
    return value if isinstance(value, str) and value.strip() else None


def layer_count(metadata: dict[str, Any]) -> int | None:
    """The model's layers (``<architecture>.block_count``); None where the header does
    not say (the run's planning then refuses the model, naming why)."""
    value = metadata.get(f"{metadata.get('general.architecture')}.block_count")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_model(path: Path, args: argparse.Namespace) -> None:
    """What the model's header decides of the flags, said before anything is started:
    ``--chat`` needs a chat template, and ``--stages`` at most one stage a layer."""
    meta = model_metadata(path)
    problems: list[str] = []
    if args.chat and chat_template(path, meta) is None:
        problems.append(
            f"--chat: the model {args.model} has no chat template ({CHAT_TEMPLATE_KEY} in "
            f"{path}); drop --chat for a plain completion, or choose a chat model "
            f"({BUNDLED_CHAT})"
        )
    layers = layer_count(meta)
    if layers is not None and args.stages > layers:
        problems.append(
            f"{flag_value('--stages', args.stages)}: the model {args.model} has "
            f"{_count(layers, 'layer')}, so at most {_count(layers, 'stage')} (a stage holds "
            "1 layer or more)"
        )
    if problems:
        raise FlagError("; ".join(problems))


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
