"""The process host's TOML config file as pydantic models (process spec 2.1; CONTRACTS
"Configuration of the process host"): one model per table, each key's TOML type, bounds
and value rules declared on its field, unknown tables and keys forbidden.

:func:`read_config_file` parses the text and turns pydantic's errors into the host's
error texts (``docs/host.md`` "The config file"): the first problem in the file's order,
type problems (unknown table or key, wrong TOML type) before value problems. A secret's
value never appears in a text. Rules between keys (a hub model needs its file, the relay's
URL and mode) and rules that need the environment or files belong to the resolver
(:mod:`mvp_core.host_config`).
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
import tomllib
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, ClassVar, Self, TypeVar
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

from mvp_core.models import (
    MAX_DOCKER_CPUS,
    NodeLossPolicy,
    PromptHost,
    ProviderKind,
    VastAiSettings,
)
from mvp_core.validation import _GPUS, _IMAGE_REF

ARG_PIPELINE_STAGES = "--pipeline-stages"
U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration error (spec 10.2): the text is the whole message."""


class RuntimeProfile(StrEnum):
    LOCAL = "local"
    DEPLOY = "deploy"


class RelayMode(StrEnum):
    DEFAULT = "default"
    DISABLED = "disabled"


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SocketAddress(_Frozen):
    """An IP literal and a port (Rust's SocketAddr): no host names."""

    host: str
    port: int = Field(ge=0, le=65535)

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_socket_address(text: str) -> SocketAddress:
    """``a.b.c.d:port`` or ``[v6]:port``; ValueError("invalid socket address syntax")."""
    bad = ValueError("invalid socket address syntax")
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep:
            raise bad
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise bad from None
    else:
        host, sep, port = text.rpartition(":")
        if not sep:
            raise bad
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise bad from None
    if not re.fullmatch(r"[0-9]{1,5}", port) or int(port) > 65535:
        raise bad
    return SocketAddress(host=host, port=int(port))


# --------------------------------------------------------------------------- error texts


def quote(text: str) -> str:
    """A string as Rust's ``{:?}`` shows it (JSON quoting), cut short when long."""
    return json.dumps(text if len(text) <= 120 else text[:117] + "...", ensure_ascii=False)


def show(value: object) -> str:
    """A TOML value as the error texts show it."""
    if isinstance(value, str):
        return quote(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return quote(str(value))


def invalid(name: str, value: object, reason: str) -> ConfigError:
    return ConfigError(f"invalid {name}={show(value)}: {reason}")


_TYPE, _VALUE = 0, 1  # type problems are reported before value problems


def _problem(phase: int, reason: str, value: object = None, *, whole: str = "") -> Exception:
    """A key's problem, for :func:`_config_error` to name: ``invalid <key>=<value>:
    <reason>``, or ``whole`` as the entire text."""
    return PydanticCustomError(
        "mvp_config",
        "{reason}",
        {"phase": phase, "reason": reason, "shown": show(value), "whole": whole},
    )


# --------------------------------------------------------------------------- TOML types


def _string(raw: object) -> str:
    if not isinstance(raw, str):
        raise _problem(_TYPE, "expected a string", raw)
    return raw


def _nonblank(raw: object) -> str:
    text = _string(raw)
    if not text.strip():
        raise _problem(_TYPE, "must not be empty (leave the key out instead)", raw)
    return text


def _text(raw: object) -> str:
    """A non-empty string, stripped."""
    return _nonblank(raw).strip()


def _secret(raw: object) -> SecretStr:
    """A string that is never shown, not even in its own type error."""
    if not isinstance(raw, str):
        raise PydanticCustomError(
            "mvp_config",
            "{reason}",
            {"phase": _TYPE, "reason": "expected a string", "secret": True},
        )
    return SecretStr(raw)


def _integer(top: int) -> Callable[[object], int]:
    def check(raw: object) -> int:
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise _problem(_TYPE, "expected an integer", raw)
        if not 0 <= raw <= top:
            raise _problem(_TYPE, f"expected an integer from 0 to {top}", raw)
        return raw

    return check


def _number(raw: object) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise _problem(_TYPE, "expected a number", raw)
    if not math.isfinite(raw):
        raise _problem(_TYPE, "expected a finite number", raw)
    return float(raw)


def _boolean(raw: object) -> bool:
    if not isinstance(raw, bool):
        raise _problem(_TYPE, "expected true or false", raw)
    return raw


# --------------------------------------------------------------------------- value rules


def _positive(value: T) -> T:
    if value == 0:
        raise _problem(_VALUE, "must be greater than 0", value)
    return value


def _not_negative(value: float) -> float:
    if value < 0:
        raise _problem(_VALUE, "must not be negative", value)
    return value


def _fraction(value: float) -> float:
    if not 0.0 <= value <= 1.0:
        raise _problem(_VALUE, "expected a number from 0 to 1", value)
    return value


def _image(value: str) -> str:
    if not _IMAGE_REF.fullmatch(value):
        raise _problem(_VALUE, "not an image reference ([registry/]name[:tag][@digest])", value)
    return value


def _gpus(value: str) -> str:
    if value and not _GPUS.fullmatch(value):
        raise _problem(_VALUE, 'use "all", a count, or comma-separated device ids', value)
    return value


def _docker_cpus(value: float) -> float:
    if not 0.01 <= value <= MAX_DOCKER_CPUS:
        raise _problem(_VALUE, f"expected a number of CPUs from 0.01 to {MAX_DOCKER_CPUS:g}", value)
    return value


MAX_MIB = 1 << 30  # 1 PiB in MiB
MIN_MIB = 64


def _mib(raw: object) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise _problem(_TYPE, "expected an integer of MiB", raw)
    if not MIN_MIB <= raw <= MAX_MIB:
        raise _problem(_VALUE, f"expected {MIN_MIB} to {MAX_MIB} MiB", raw)
    return raw


def _mib_list(raw: object) -> list[int]:
    """One MiB figure (every node's) or a list (one per stage)."""
    if isinstance(raw, list):
        if not 1 <= len(raw) <= 256:
            raise _problem(_VALUE, "expected 1 to 256 figures", raw)
        return [_mib(v) for v in raw]
    return [_mib(raw)]


def _stages(value: int) -> int:
    if value == 0:
        raise _problem(_VALUE, "", whole=f"{ARG_PIPELINE_STAGES} must be greater than 0")
    return value


def _rpc_addr(value: str) -> SocketAddress:
    try:
        return parse_socket_address(value)
    except ValueError as err:
        raise _problem(_VALUE, str(err), value) from None


E = TypeVar("E", bound=StrEnum)


def _member(kind: type[E], value: str, what: str) -> E:
    """``value`` as a member of ``kind``; else ``unsupported <what> "<v>"; use a or b``."""
    try:
        return kind(value)
    except ValueError:
        choices = " or ".join(m.value for m in kind)
        raise _problem(
            _VALUE, "", whole=f"unsupported {what} {quote(value)}; use {choices}"
        ) from None


def _profile(value: str) -> RuntimeProfile:
    return _member(RuntimeProfile, value, "runtime profile")


def parse_provider(text: str) -> ProviderKind:
    """``--provider``'s and ``[provider].kind``'s value; ConfigError names it."""
    value = text.strip()
    try:
        return ProviderKind(value)
    except ValueError:
        raise ConfigError(
            f"unsupported provider {quote(value)}; use process, docker, or vastai"
        ) from None


def _provider(value: str) -> ProviderKind:
    try:
        return parse_provider(value)
    except ConfigError as err:
        raise _problem(_VALUE, "", whole=str(err)) from None


def _relay_mode(value: str) -> RelayMode:
    return _member(RelayMode, value, "relay.mode")


def _node_loss(value: str) -> NodeLossPolicy:
    return _member(NodeLossPolicy, value, "runtime.on_node_loss")


def _prompt_host(value: str) -> PromptHost:
    return _member(PromptHost, value, "prompt.host")


def _relay_url(value: str) -> str:
    if any(c.isspace() for c in value):
        raise _problem(_VALUE, "a URL has no whitespace", value)
    try:
        parts = urlsplit(value)
        host = parts.hostname
        _ = parts.port  # a bad port raises
    except ValueError as err:
        raise _problem(_VALUE, str(err), value) from None
    if parts.scheme not in ("http", "https") or not host:
        raise _problem(_VALUE, "expected an http:// or https:// URL with a host", value)
    return value


# --------------------------------------------------------------------------- key types

Text = Annotated[str, BeforeValidator(_text)]
PathText = Annotated[str, BeforeValidator(_nonblank)]  # relative to the working directory
Secret = Annotated[SecretStr, BeforeValidator(_secret)]
U32 = Annotated[int, BeforeValidator(_integer(U32_MAX))]
U64 = Annotated[int, BeforeValidator(_integer(U64_MAX))]
PositiveU32 = Annotated[int, BeforeValidator(_integer(U32_MAX)), AfterValidator(_positive)]
PositiveU64 = Annotated[int, BeforeValidator(_integer(U64_MAX)), AfterValidator(_positive)]
NonNegative = Annotated[float, BeforeValidator(_number), AfterValidator(_not_negative)]
Fraction = Annotated[float, BeforeValidator(_number), AfterValidator(_fraction)]
Bool = Annotated[bool, BeforeValidator(_boolean)]
DockerCpus = Annotated[float, BeforeValidator(_number), AfterValidator(_docker_cpus)]
Image = Annotated[str, BeforeValidator(_text), AfterValidator(_image)]


def _then(parse: Callable[[str], T]) -> Callable[[object], T]:
    return lambda raw: parse(_text(raw))


# --------------------------------------------------------------------------- the tables


class RuntimeTable(_Frozen):
    profile: Annotated[RuntimeProfile, BeforeValidator(_then(_profile))] | None = None
    run_id: U64 | None = None
    node_id: U64 | None = None
    stage_index: U32 | None = None
    layer_end_exclusive: U32 | None = None
    pipeline_stages: (
        Annotated[int, BeforeValidator(_integer(U32_MAX)), AfterValidator(_stages)] | None
    ) = None
    # ours (DECISIONS 68): what a node lost while the run serves does to it
    on_node_loss: Annotated[NodeLossPolicy, BeforeValidator(_then(_node_loss))] | None = None
    # ours (DECISIONS 71): each node's memory for its stage, MiB: one, or one per stage
    node_memory_mib: Annotated[list[int], BeforeValidator(_mib_list)] | None = None


class ProviderTable(_Frozen):
    kind: Annotated[ProviderKind, BeforeValidator(_then(_provider))] | None = None


class ImageTable(_Frozen):
    node: Image | None = None


class RelayTable(_Frozen):
    mode: Annotated[RelayMode, BeforeValidator(_then(_relay_mode))] | None = None
    url: Annotated[str, BeforeValidator(_text), AfterValidator(_relay_url)] | None = None


class PromptTable(_Frozen):
    rpc_addr: Annotated[SocketAddress, BeforeValidator(_then(_rpc_addr))] | None = None
    max_active_prompts: PositiveU32 | None = None  # ours (DECISIONS 62)
    host: Annotated[PromptHost, BeforeValidator(_then(_prompt_host))] | None = None  # ours (66)


class ModelTable(_Frozen):
    id: Text | None = None
    gguf_local_path: PathText | None = None
    gguf_repo: Text | None = None
    gguf_file: Text | None = None
    gguf_revision: Text | None = None
    tokenizer_local_path: PathText | None = None
    max_context: PositiveU32 | None = None


class DockerTable(_Frozen):
    # '' is allowed: no GPUs.
    gpus: (
        Annotated[str, BeforeValidator(lambda raw: _string(raw).strip()), AfterValidator(_gpus)]
        | None
    ) = None
    cpus: DockerCpus | None = None
    memory_mib: Annotated[int, BeforeValidator(_mib)] | None = None  # --memory, in MiB


class ObservabilityTable(_Frozen):
    datastream_frame_log: PathText | None = None


class VastAiTable(_Frozen):
    """[vastai]: the run's Vast.ai settings (:class:`mvp_core.models.VastAiSettings`, the
    one model of them) in the TOML's types and key names, and the host's own keys, which
    never enter the run (:attr:`HOST_ONLY`). The table validates into the run's model, so a
    value the run would refuse is a config error naming its key."""

    HOST_ONLY: ClassVar[frozenset[str]] = frozenset({"api_key", "confirm_lease", "ssh_identity"})
    RUN_NAMES: ClassVar[dict[str, str]] = {"poll_interval_secs": "poll_interval_s"}

    image: Image | None = None
    api_key: Secret | None = None
    bootstrap_command: Text | None = None
    disk_gb: PositiveU32 | None = None
    ssh_user: Text | None = None
    confirm_lease: Bool | None = None
    onstart: Text | None = None
    ssh_identity: PathText | None = None
    gpu_name: Text | None = None
    min_gpu_ram_mb: U64 | None = None
    min_down_mbps: NonNegative | None = None
    min_up_mbps: NonNegative | None = None
    min_reliability: Fraction | None = None
    require_verified: Bool | None = None
    poll_interval_secs: PositiveU64 | None = None

    @model_validator(mode="after")
    def _validates_into_the_run(self) -> Self:
        try:
            self.run_settings()
        except ConfigError as err:
            raise _problem(_VALUE, "", whole=str(err)) from None
        return self

    def run_settings(self, **given: Any) -> VastAiSettings:
        """The keys the run carries, as the run's model; ``given`` sets run fields the host
        resolves from elsewhere (the image from image.node). ConfigError names the key."""
        keys = {self.RUN_NAMES.get(k, k): k for k in type(self).model_fields}
        values: dict[str, Any] = {
            run: getattr(self, key)
            for run, key in keys.items()
            if key not in self.HOST_ONLY and getattr(self, key) is not None
        }
        try:
            return VastAiSettings.model_validate({**values, **given})
        except ValidationError as err:
            first = err.errors()[0]
            run = str(first["loc"][0]) if first["loc"] else ""
            key = keys.get(run, run)
            reason = re.sub(r"^(Input|String|Value) should ", "must ", first["msg"])
            value = {**values, **given}.get(run)
            raise invalid(f"vastai.{key}", value, reason) from None


class ConfigFile(_Frozen):
    """The whole file; a table left out is a table with every key left out."""

    runtime: RuntimeTable = RuntimeTable()
    provider: ProviderTable = ProviderTable()
    image: ImageTable = ImageTable()
    relay: RelayTable = RelayTable()
    prompt: PromptTable = PromptTable()
    model: ModelTable = ModelTable()
    docker: DockerTable = DockerTable()
    observability: ObservabilityTable = ObservabilityTable()
    vastai: VastAiTable = VastAiTable()


def tables() -> dict[str, tuple[str, ...]]:
    """Every table and its keys, in the spec's order."""
    return {
        name: tuple(info.annotation.model_fields)  # type: ignore[union-attr]
        for name, info in ConfigFile.model_fields.items()
    }


# --------------------------------------------------------------------------- reading


def read_config_file(text: str, path: Path) -> ConfigFile:
    """The file's text as a :class:`ConfigFile`; ConfigError with the host's text."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"parse config {path}: {err}") from None
    try:
        return ConfigFile.model_validate(doc)
    except ValidationError as err:
        raise _config_error(err, doc, path) from None


def _position(doc: dict[str, Any], loc: tuple[int | str, ...]) -> tuple[int, int]:
    """Where ``loc`` is in the file: (table's index, key's index; -1 for the table)."""
    names = list(doc)
    table = names.index(loc[0]) if loc and loc[0] in doc else len(names)
    body = doc.get(str(loc[0])) if loc else None
    if len(loc) < 2 or not isinstance(body, dict):
        return table, -1
    keys = list(body)
    return table, keys.index(loc[1]) if loc[1] in body else len(keys)


def _config_error(err: ValidationError, doc: dict[str, Any], path: Path) -> ConfigError:
    accepted = tables()

    def phase(e: Any) -> int:
        return int(e["ctx"]["phase"]) if e["type"] == "mvp_config" else _TYPE

    first = min(err.errors(), key=lambda e: (phase(e), _position(doc, tuple(e["loc"]))))
    loc = tuple(str(part) for part in first["loc"])
    if first["type"] == "mvp_config":
        ctx = first["ctx"]
        name = ".".join(loc)
        if ctx.get("secret"):
            return ConfigError(f"invalid {name}: {ctx['reason']}")
        if ctx["whole"]:
            return ConfigError(ctx["whole"])
        return ConfigError(f"invalid {name}={ctx['shown']}: {ctx['reason']}")
    if first["type"] == "extra_forbidden" and len(loc) == 1:
        why = f"unknown table [{loc[0]}]; accepted tables: {', '.join(accepted)}"
    elif first["type"] == "extra_forbidden":
        table = loc[0]
        why = (
            f"unknown key {'.'.join(loc)}; accepted keys of [{table}]: {', '.join(accepted[table])}"
        )
    elif len(loc) == 1:
        why = f"{loc[0]} must be a table ([{loc[0]}])"
    else:  # not reached: every key has its own validator
        why = f"invalid {'.'.join(loc)}: {first['msg']}"
    return ConfigError(f"parse config {path}: {why}")
