"""The OpenAI wire format the gateway speaks: request models, error bodies, and the
response objects and stream chunks, shaped as the ``openai`` package's types read them.

Requests are validated by the models here (extra fields are ignored, as OpenAI's own
clients send fields this server has no use for); options whose effect the run cannot
give (tools, echo, more than 4 choices) are refused with a 400 naming the parameter
rather than silently dropped.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mvp_core.models import ResponseFormat

U32 = 2**32 - 1
U64 = 2**64 - 1
MAX_STOPS = 4  # as OpenAI: up to four stop sequences
MAX_STOP_CHARS = 256
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
OWNED_BY = "mvp-orchestrator"


class ApiError(Exception):
    """An OpenAI-style error response: ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unavailable(message: str, code: str) -> ApiError:
    return ApiError(503, message, type="server_error", code=code, retry_after_s=1)


def model_not_found(model: str) -> ApiError:
    return ApiError(
        404,
        f"The model `{model[:200]}` does not exist or you do not have access to it.",
        code="model_not_found",
        param="model",
    )


# --------------------------------------------------------------------------- requests


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Lenient):
    include_usage: bool | None = None


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[Any] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def template_role(self) -> str:
        """The role the chat template sees: OpenAI's ``developer`` is the system role
        of models that know no other."""
        return "system" if self.role == "developer" else self.role


MAX_CHOICES = 4  # n: each choice is a prompt of its own in the run's batch
_FORMAT_TYPES = ("text", "json_object", "json_schema")
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_CHAT_TOP_LOGPROBS = 20  # OpenAI's bounds: chat top_logprobs 0-20, completions logprobs 0-5
MAX_COMPLETION_LOGPROBS = 5


class _Generation(_Lenient):
    """Fields both endpoints share."""

    model: str = Field(max_length=1000)
    max_tokens: int | None = Field(default=None, ge=1, le=U32)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=0, le=U32)  # an extension, as vLLM and llama.cpp
    seed: int | None = Field(default=None, ge=-(2**63), le=U64)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # Accepted only with the values that ask for nothing the run cannot do.
    n: int | None = None
    response_format: Any = None
    tools: Any = None
    functions: Any = None
    tool_choice: Any = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        for s in stops:
            if not s:
                raise ValueError("a stop sequence must not be empty")
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"a stop sequence has at most {MAX_STOP_CHARS} characters")
        return value

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling(self) -> dict[str, Any]:
        """SubmitPrompt's sampling fields. OpenAI's defaults: temperature 1, top_p 1; a
        seed is taken modulo 2**64 (OpenAI's are signed)."""
        top_p = 1.0 if self.top_p is None else max(self.top_p, 1e-6)
        return {
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": top_p,
            "top_k": self.top_k or 0,
            "seed": None if self.seed is None else self.seed % (U64 + 1),
        }

    def unsupported(self) -> None:
        """A 400 for an option that asks for what the run cannot give."""
        if self.n is not None and not 1 <= self.n <= MAX_CHOICES:
            raise invalid(f"n must be 1 to {MAX_CHOICES}", "n", "invalid_value")
        if self.tools or self.functions:
            param = "tools" if self.tools else "functions"
            raise invalid("tools and functions are not supported", param, "unsupported_parameter")
        if self.tool_choice not in (None, "none", "auto"):
            raise invalid("tools are not supported", "tool_choice", "unsupported_parameter")
        self.format_fields()  # a 400 for a format the run cannot honour

    def format_fields(self) -> dict[str, Any]:
        """SubmitPrompt's ``response_format`` (DECISIONS 89): none for text (the default;
        a run from before formats refuses fields it does not know). A format that is not
        OpenAI's shape, or a schema the constrainer cannot compile, is a 400 naming
        ``response_format``."""
        fmt = self.response_format
        if fmt is None:
            return {}
        if not isinstance(fmt, dict) or fmt.get("type") not in _FORMAT_TYPES:
            raise invalid(
                "response_format must be {'type': 'text'}, {'type': 'json_object'} or "
                "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}",
                "response_format",
                "invalid_value",
            )
        kind = fmt["type"]
        if kind == "text":
            return {}
        if kind == "json_object":
            return {"response_format": {"type": "json_object"}}
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise invalid(
                "response_format json_schema needs json_schema: {'name': ..., 'schema': {...}}",
                "response_format",
                "invalid_value",
            )
        name, schema, strict = spec.get("name"), spec.get("schema"), spec.get("strict")
        if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
            raise invalid(
                "response_format json_schema.name must be 1-64 letters, digits, '_' or '-'",
                "response_format",
                "invalid_value",
            )
        if not isinstance(schema, dict) or not isinstance(strict, bool | None):
            raise invalid(
                "response_format json_schema.schema must be a JSON Schema object "
                "(and strict a boolean)",
                "response_format",
                "invalid_value",
            )
        try:
            checked = ResponseFormat(type="json_schema", json_schema=schema)
        except ValidationError as err:
            detail = str(err.errors(include_url=False)[0]["msg"]).removeprefix("Value error, ")
            raise invalid(
                f"Invalid schema for response_format '{name}': {detail}",
                "response_format",
                "invalid_value",
            ) from None
        return {"response_format": checked.model_dump(mode="json")}


class CompletionRequest(_Generation):
    prompt: str | list[str]
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    top_logprobs: Any = None  # chat's: refused here

    def logprob_fields(self) -> dict[str, Any]:
        """SubmitPrompt's logprob fields: none unless asked (a run from before them
        refuses fields it does not know)."""
        if self.logprobs is None:
            return {}
        return {"logprobs": True, "top_logprobs": self.logprobs}

    def prompt_text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise invalid(
                "one prompt per request (a list must hold exactly one string)",
                "prompt",
                "unsupported_parameter",
            )
        return self.prompt[0]

    def unsupported(self) -> None:
        super().unsupported()
        if self.echo:
            raise invalid("echo is not supported", "echo", "unsupported_parameter")
        if self.best_of not in (None, 1):
            raise invalid("only best_of=1 is supported", "best_of", "unsupported_parameter")
        if self.suffix:
            raise invalid("suffix is not supported", "suffix", "unsupported_parameter")
        if self.top_logprobs is not None:
            raise invalid(
                "top_logprobs is a chat parameter; completions take logprobs (0-5)",
                "top_logprobs",
                "unsupported_parameter",
            )

    def token_limit(self) -> int:
        return COMPLETIONS_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens


class ChatRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1, max_length=10_000)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=U32)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)

    def logprob_fields(self) -> dict[str, Any]:
        """SubmitPrompt's logprob fields: none unless asked (a run from before them
        refuses fields it does not know)."""
        if not self.logprobs:
            return {}
        return {"logprobs": True, "top_logprobs": self.top_logprobs or 0}

    def unsupported(self) -> None:
        super().unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
        for i, m in enumerate(self.messages):
            if m.tool_calls:
                raise invalid(
                    "tool calls are not supported",
                    f"messages.{i}.tool_calls",
                    "unsupported_parameter",
                )

    def token_limit(self) -> int | None:
        """None: the run's default_max_tokens (else until the end token or the context)."""
        return self.max_completion_tokens if self.max_completion_tokens else self.max_tokens


def parse_body(raw: bytes, model: type[_Generation]) -> Any:
    """The request, or a 400 naming the first bad field (never echoing its value)."""
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise invalid(
            "We could not parse the JSON body of your request. (HINT: This likely means you "
            "aren't using your HTTP library correctly.)",
            code="invalid_json",
        ) from None
    if not isinstance(value, dict):
        raise invalid("the request body must be a JSON object", code="invalid_json")
    try:
        request = model.model_validate(value)
    except ValidationError as err:
        first = err.errors(include_url=False, include_input=False)[0]
        loc = [str(p) for p in first["loc"]]
        # Union branches show up as loc entries ('str', 'list[...]'): keep the field path.
        path = [p for p in loc if not p.startswith(("str", "list[", "function-", "literal["))]
        param = ".".join(path) or None
        if first["type"] == "missing":
            message = f"Missing required parameter: '{param}'."
            code = "missing_required_parameter"
        else:
            detail = str(first["msg"]).removeprefix("Value error, ")
            message = f"Invalid value for '{param}': {detail}."
            code = "invalid_value"
        raise invalid(message, param, code) from None
    request.unsupported()
    return request


# --------------------------------------------------------------------------- responses


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
) -> dict[str, Any]:
    """OpenAI's usage; ``prompt_tokens_details.cached_tokens`` where the head node said
    how many prompt tokens its prefix cache gave (DECISIONS 91)."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def model_object(model_id: str, created: int) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": OWNED_BY}


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


SSE_DONE = sse("[DONE]")
