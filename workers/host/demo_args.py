"""What the demo checks and prepares before it starts anything: ``--model`` as a model
source (a bundled name, a GGUF file, or ``hf:OWNER/NAME/FILE.gguf[@REVISION]``), the
model fetched with its download shown, and ``--chat`` refused for a model without a chat
template. A refusal is a :class:`DemoError`, said on stderr before any process starts."""

from __future__ import annotations

import mmap
from pathlib import Path

from pydantic import ValidationError

from mvp_core.gguf_header import parse_header
from mvp_core.models import HubModel, ModelSource
from mvp_core.validation import describe_invalid
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
    raise DemoError(
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
        raise DemoError(
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


def chat_template(path: Path) -> str | None:
    """The GGUF's chat template (metadata ``tokenizer.chat_template``), None without one.
    Only the header is read, through the core's decoder: no engine, no torch."""
    try:
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            value = parse_header(buf, str(path)).metadata.get(CHAT_TEMPLATE_KEY)
    except (OSError, ValueError) as err:  # GGUFError is a ValueError; so is an empty file
        raise DemoError(f"cannot read the GGUF header of {path}: {err}") from None
    return value if isinstance(value, str) and value.strip() else None


def check_chat(path: Path, model: str) -> None:
    """``--chat`` needs a chat template: say so now, before anything is started."""
    if chat_template(path) is None:
        raise DemoError(
            f"--chat: the model {model} has no chat template ({CHAT_TEMPLATE_KEY} in {path}); "
            f"drop --chat for a plain completion, or choose a chat model ({BUNDLED_CHAT})"
        )
