"""Chat-template rendering from the Jinja template stored in GGUF metadata.

Rendering follows what Hugging Face and llama-cpp-python do (sandboxed Jinja with
`trim_blocks`/`lstrip_blocks`, `raise_exception`, `tojson`, `strftime_now`), so the
prompt text matches what the model was fine-tuned on. The sandbox matters: the
template comes from a model file, i.e. from whoever published the model.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template is broken, or it rejected the conversation (`raise_exception`)."""


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's built-in tojson HTML-escapes; chat templates want plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    helpers: dict[str, Callable[..., Any]] = {
        "raise_exception": _raise_exception,
        "strftime_now": _strftime_now,
    }
    env.globals.update(helpers)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from e


def render_chat_template(
    source: str,
    messages: Sequence[Mapping[str, str]],
    *,
    add_generation_prompt: bool,
    bos_token: str,
    eos_token: str,
) -> str:
    """Render `source` for `messages`; raises ChatTemplateError on any template failure."""
    template = _compile(source)
    try:
        return template.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
        )
    except ChatTemplateError:
        raise
    except Exception as e:  # templates can fail in arbitrary ways (TypeError, KeyError...)
        raise ChatTemplateError(f"chat template failed to render: {e!r}") from e
