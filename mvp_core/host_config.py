"""Configuration resolver of the process host ``mvp-orchestrator`` (process spec 2.1-2.4,
7.1-7.3, 9.1-9.2, 10.2; CONTRACTS "Configuration of the process host").

Layering: fixed defaults -> TOML (``--runtime-config <path>``, else ``.config/config.toml``
under the working directory when it is a file) -> environment (secrets only) -> the five
accepted process arguments. Provider constraints are checked here, before anything starts.

Pure: the caller hands in the arguments, the environment, the working directory and a
:class:`HostFiles` that reads the config file and says whether a file exists, so every rule
is testable without a disk. Every failure is a :class:`ConfigError` whose text is the whole
message (the host prints ``mvp-orchestrator: <error>`` and exits 1); no message carries a
secret value, and :class:`HostConfig` holds its secrets as ``SecretStr``.

``docs/host.md`` "Configuration" documents every table, key, default and error.
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError

from mvp_core.models import (
    DockerSettings,
    HubModel,
    ModelSource,
    ProviderKind,
    RunRequest,
    hub_file_problem,
    hub_repo_problem,
    hub_revision_problem,
)
from mvp_core.models import VastAiSettings as VastAiRunSettings
from mvp_core.names import DEFAULT_BUNDLED_MODEL, REAPER_INTERVAL_ENV
from mvp_core.validation import (
    _GPUS,
    _IMAGE_REF,
    RunRejectedError,
    describe_invalid,
    validate_request,
)

DEFAULT_CONFIG_PATH = Path(".config") / "config.toml"
DEFAULT_NODE_IMAGE = "swactor-mvp-node:latest"
DEFAULT_DOCKER_GPUS = "all"
DEFAULT_RPC_HOST = "127.0.0.1"
DEFAULT_RPC_PORT = 19777
DEFAULT_MAX_TOKENS = 64
DEFAULT_SSH_IDENTITY = Path(".ssh") / "id_ed25519"  # under $HOME

ARG_RUNTIME_CONFIG = "--runtime-config"
ARG_PROVIDER = "--provider"
ARG_WORKER_BIN = "--worker-bin"
ARG_PIPELINE_STAGES = "--pipeline-stages"
ARG_VASTAI_SSH_IDENTITY = "--vastai-ssh-identity"
ARGUMENTS = (
    ARG_RUNTIME_CONFIG,
    ARG_PROVIDER,
    ARG_WORKER_BIN,
    ARG_PIPELINE_STAGES,
    ARG_VASTAI_SSH_IDENTITY,
)

VASTAI_API_KEY_ENV = "VASTAI_API_KEY"
HF_TOKEN_ENV = "HF_TOKEN"
# MVP_ variables the process host's own parts read at run time. They configure where this
# installation keeps state and how it reaches Temporal, never the run (identity, provider,
# image, model, shape are TOML and arguments only, spec 2.2). Every other MVP_ variable in
# the host's environment is an "unsupported environment variable" configuration error.
HOST_OPERATIONAL_ENV = frozenset(
    {
        "MVP_PAYLOAD_KEY",  # payload codec key (a secret; temporal/codec.py)
        "MVP_EDGE_SECRET",  # edge token secret (a secret; activities/providers/base.py)
        "MVP_STATE_DIR",  # provider state files (activities/providers/base.py)
        "MVP_MODELS_DIR",  # model cache (activities/models_store.py)
        "MVP_PROVIDER_HOST",  # the provider host's name (activities/planning.py)
        "MVP_DOCKER_TEMPORAL_ADDRESS",  # where containers reach Temporal (docker provider)
        "MVP_VASTAI_SERVER_URL",  # the Vast.ai API (a stand-in, a proxy)
        "MVP_VASTAI_TEMPORAL_ADDRESS",  # a Temporal address rented hosts reach as it is
        "MVP_VASTAI_DESTROY_DEADLINE_S",  # how long one provider stop keeps destroying
        REAPER_INTERVAL_ENV,  # the reaper schedule (workers/orchestrator/reaper_schedule.py)
        "MVP_MAX_CACHED_WORKFLOWS",  # the orchestrator worker's cache (workers/orchestrator/worker.py)
        "MVP_SWITCH_INTERVAL",  # passed through to nodes by the providers
        "MVP_TEMPORAL_DB",  # the bundled dev server (temporal/dev-server)
        "MVP_TEMPORAL_PORT",
        "MVP_TEMPORAL_IP",
        "MVP_CONTROL_PLANE_NICE",
    }
)
# The test harness's knobs (fault files, crash points); nodes honour faults only when their
# provider sets MVP_TEST_FAULTS_ALLOWED in their own environment (DECISIONS 31).
HOST_OPERATIONAL_ENV_PREFIXES = ("MVP_TEST_",)

_U32 = 2**32 - 1
_U64 = 2**64 - 1


class ConfigError(ValueError):
    """A configuration error (spec 10.2): the text is the whole message."""


class HostFiles(Protocol):
    """The file access the resolver needs, supplied by the caller."""

    def read_text(self, path: Path) -> str:
        """The file's text; raises OSError (or UnicodeDecodeError) when it cannot."""
        ...

    def is_file(self, path: Path) -> bool:
        """Whether ``path`` names an existing regular file (following links)."""
        ...


# --------------------------------------------------------------------------- typed state


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


class LocalGguf(_Frozen):
    """[model].gguf_local_path: a GGUF file on this host (the spec's cached model)."""

    kind: Literal["local"] = "local"
    path: Path


class HubGguf(_Frozen):
    """[model].gguf_repo/gguf_file/gguf_revision: a Hugging Face GGUF (revision absent:
    main), fetched into the model cache of the host that runs the nodes."""

    kind: Literal["hub"] = "hub"
    repo: str
    file: str
    revision: str | None = None


class RelayConfig(_Frozen):
    mode: RelayMode = RelayMode.DEFAULT
    url: str | None = None


class VastAiSettings(_Frozen):
    """The [vastai] table, resolved for a Vast.ai run (present only when the provider is
    vastai). The SSH public key is derived later, by Vast.ai runtime preparation."""

    api_key: SecretStr
    image: str
    bootstrap_command: str
    ssh_identity: Path
    disk_gb: int | None = None
    ssh_user: str | None = None
    confirm_lease: bool = False
    onstart: str | None = None
    gpu_name: str | None = None
    min_gpu_ram_mb: int | None = None
    min_down_mbps: float | None = None
    min_up_mbps: float | None = None
    min_reliability: float | None = None
    require_verified: bool | None = None
    poll_interval_secs: int | None = None


class HostConfig(_Frozen):
    """Spec 7.1's Config. ``None`` means "not configured" where the spec has a default
    that this implementation applies differently (image, docker_gpus): see the
    ``*_or_default`` properties for the spec default to display."""

    config_path: Path | None = None
    config_profile: RuntimeProfile = RuntimeProfile.LOCAL
    provider: ProviderKind = ProviderKind.PROCESS
    image: str | None = None
    docker_gpus: str | None = None
    rpc_bind: SocketAddress = SocketAddress(host=DEFAULT_RPC_HOST, port=DEFAULT_RPC_PORT)
    run_id: int = 1
    node_id: int = 1
    stage_index: int = 0
    layer_end_exclusive: int | None = None
    pipeline_stages: int = 1
    model_id: str | None = None
    gguf_source: LocalGguf | HubGguf | None = Field(default=None, discriminator="kind")
    tokenizer_path: Path | None = None
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    dashboard: bool = False
    max_context: int | None = None
    relay: RelayConfig = RelayConfig()
    vastai: VastAiSettings | None = None
    worker_bin: Path | None = None
    datastream_frame_log: Path | None = None
    hf_token: SecretStr | None = None

    @property
    def image_or_default(self) -> str:
        """[image].node, else the spec default (the docker provider then builds its own
        host image instead, DECISIONS 33)."""
        return self.image or DEFAULT_NODE_IMAGE

    @property
    def docker_gpus_or_default(self) -> str:
        """[docker].gpus, else the spec default (not requested unless set, DECISIONS 33)."""
        return DEFAULT_DOCKER_GPUS if self.docker_gpus is None else self.docker_gpus


# --------------------------------------------------------------------------- arguments


@dataclass(frozen=True)
class HostArguments:
    """The accepted process arguments (spec 2.3), raw; ``None`` = not given."""

    runtime_config: str | None = None
    provider: str | None = None
    worker_bin: str | None = None
    pipeline_stages: str | None = None
    vastai_ssh_identity: str | None = None


def parse_arguments(argv: Sequence[str]) -> HostArguments:
    """``argv`` without the program name. ``--name value`` and ``--name=value``; a value may
    not be empty, and in the two-token form may not start with ``--`` (use ``=`` for
    that); a repeated argument's last value wins."""
    values: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, inline = arg.partition("=")
        if name not in ARGUMENTS:
            raise ConfigError(f"unknown argument {_quote(arg)}")
        if eq:
            value = inline
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            i += 1
            value = argv[i]
        else:
            value = ""
        if not value.strip():
            raise ConfigError(f"missing value after {name}")
        values[name.removeprefix("--").replace("-", "_")] = value
        i += 1
    return HostArguments(**values)


# --------------------------------------------------------------------------- TOML schema


class _Kind(StrEnum):
    TEXT = "text"  # a non-empty string, stripped
    PATH = "path"  # a non-empty string, relative to the working directory
    SECRET = "secret"  # a string, never shown
    GPUS = "gpus"  # a string, '' allowed
    U32 = "u32"
    U64 = "u64"
    FLOAT = "float"
    BOOL = "bool"


_T, _P, _S, _G = _Kind.TEXT, _Kind.PATH, _Kind.SECRET, _Kind.GPUS
_U32K, _U64K, _F, _B = _Kind.U32, _Kind.U64, _Kind.FLOAT, _Kind.BOOL

TOML_SCHEMA: Mapping[str, Mapping[str, _Kind]] = {
    "runtime": {
        "profile": _T,
        "run_id": _U64K,
        "node_id": _U64K,
        "stage_index": _U32K,
        "layer_end_exclusive": _U32K,
        "pipeline_stages": _U32K,
    },
    "provider": {"kind": _T},
    "image": {"node": _T},
    "relay": {"mode": _T, "url": _T},
    "prompt": {"rpc_addr": _T},
    "model": {
        "id": _T,
        "gguf_local_path": _P,
        "gguf_repo": _T,
        "gguf_file": _T,
        "gguf_revision": _T,
        "tokenizer_local_path": _P,
        "max_context": _U32K,
    },
    "docker": {"gpus": _G},
    "observability": {"datastream_frame_log": _P},
    "vastai": {
        "image": _T,
        "api_key": _S,
        "bootstrap_command": _T,
        "disk_gb": _U32K,
        "ssh_user": _T,
        "confirm_lease": _B,
        "onstart": _T,
        "ssh_identity": _P,
        "gpu_name": _T,
        "min_gpu_ram_mb": _U64K,
        "min_down_mbps": _F,
        "min_up_mbps": _F,
        "min_reliability": _F,
        "require_verified": _B,
        "poll_interval_secs": _U64K,
    },
}


@dataclass
class _Values:
    """The TOML's values by ``table.key``, typed."""

    texts: dict[str, str] = field(default_factory=dict)
    ints: dict[str, int] = field(default_factory=dict)
    floats: dict[str, float] = field(default_factory=dict)
    bools: dict[str, bool] = field(default_factory=dict)
    secrets: dict[str, SecretStr] = field(default_factory=dict)


def _quote(text: str) -> str:
    """A string as Rust's ``{:?}`` shows it (JSON quoting), cut short when long."""
    return json.dumps(text if len(text) <= 120 else text[:117] + "...", ensure_ascii=False)


def _show(value: object) -> str:
    if isinstance(value, str):
        return _quote(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return _quote(str(value))


def _invalid(name: str, value: object, reason: str) -> ConfigError:
    return ConfigError(f"invalid {name}={_show(value)}: {reason}")


def _typed(values: _Values, name: str, kind: _Kind, raw: object) -> None:
    if kind is _Kind.SECRET:
        if not isinstance(raw, str):
            raise ConfigError(f"invalid {name}: expected a string")
        values.secrets[name] = SecretStr(raw)
    elif kind in (_Kind.TEXT, _Kind.PATH, _Kind.GPUS):
        if not isinstance(raw, str):
            raise _invalid(name, raw, "expected a string")
        if kind is not _Kind.GPUS and not raw.strip():
            raise _invalid(name, raw, "must not be empty (leave the key out instead)")
        values.texts[name] = raw if kind is _Kind.PATH else raw.strip()
    elif kind in (_Kind.U32, _Kind.U64):
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise _invalid(name, raw, "expected an integer")
        top = _U32 if kind is _Kind.U32 else _U64
        if not 0 <= raw <= top:
            raise _invalid(name, raw, f"expected an integer from 0 to {top}")
        values.ints[name] = raw
    elif kind is _Kind.FLOAT:
        if isinstance(raw, bool) or not isinstance(raw, int | float):
            raise _invalid(name, raw, "expected a number")
        if not math.isfinite(raw):
            raise _invalid(name, raw, "expected a finite number")
        values.floats[name] = float(raw)
    else:
        if not isinstance(raw, bool):
            raise _invalid(name, raw, "expected true or false")
        values.bools[name] = raw


def _read_toml(text: str, path: Path) -> _Values:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"parse config {path}: {err}") from None
    values = _Values()
    for table, body in doc.items():
        keys = TOML_SCHEMA.get(table)
        if keys is None:
            raise ConfigError(
                f"parse config {path}: unknown table [{table}]; accepted tables: "
                f"{', '.join(TOML_SCHEMA)}"
            )
        if not isinstance(body, dict):
            raise ConfigError(f"parse config {path}: {table} must be a table ([{table}])")
        for key, raw in body.items():
            kind = keys.get(key)
            if kind is None:
                raise ConfigError(
                    f"parse config {path}: unknown key {table}.{key}; accepted keys of "
                    f"[{table}]: {', '.join(keys)}"
                )
            _typed(values, f"{table}.{key}", kind, raw)
    return values


# --------------------------------------------------------------------------- value parsers


def _path(cwd: Path, text: str) -> Path:
    p = Path(text)
    return p if p.is_absolute() else cwd / p


def _provider(text: str) -> ProviderKind:
    value = text.strip()
    try:
        return ProviderKind(value)
    except ValueError:
        raise ConfigError(
            f"unsupported provider {_quote(value)}; use process, docker, or vastai"
        ) from None


def _profile(text: str) -> RuntimeProfile:
    try:
        return RuntimeProfile(text)
    except ValueError:
        raise ConfigError(
            f"unsupported runtime profile {_quote(text)}; use local or deploy"
        ) from None


def _stages_argument(text: str) -> int:
    """--pipeline-stages as Rust parses a u32 (its error texts)."""
    if not re.fullmatch(r"\+?[0-9]+", text):
        raise _invalid(ARG_PIPELINE_STAGES, text, "invalid digit found in string")
    value = int(text)
    if value > _U32:
        raise _invalid(ARG_PIPELINE_STAGES, text, "number too large to fit in target type")
    return value


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


def _relay_url(text: str) -> str:
    if any(c.isspace() for c in text):
        raise _invalid("relay.url", text, "a URL has no whitespace")
    try:
        parts = urlsplit(text)
        host = parts.hostname
        _ = parts.port  # a bad port raises
    except ValueError as err:
        raise _invalid("relay.url", text, str(err)) from None
    if parts.scheme not in ("http", "https") or not host:
        raise _invalid("relay.url", text, "expected an http:// or https:// URL with a host")
    return text


def _looks_remote_image(image: str) -> bool:
    """Whether an image reference names a registry host (a rented host must pull it)."""
    repository = image.split("@", 1)[0]
    first, slash, _ = repository.partition("/")
    return bool(slash) and (first == "localhost" or "." in first or ":" in first)


def _image(name: str, text: str) -> str:
    if not _IMAGE_REF.fullmatch(text):
        raise _invalid(name, text, "not an image reference ([registry/]name[:tag][@digest])")
    return text


def _secret_token(name: str, text: str) -> SecretStr | None:
    """A secret from the environment or TOML: stripped; empty = absent; whitespace inside
    is malformed. The error never shows the value."""
    value = text.strip()
    if not value:
        return None
    if any(c.isspace() or not c.isprintable() for c in value):
        raise ConfigError(f"invalid {name}: must be one token without whitespace")
    return SecretStr(value)


def check_environment(environ: Mapping[str, str]) -> None:
    """Spec 2.2: unsupported MVP_* variables are configuration errors (named, never their
    values). The allowed ones are :data:`HOST_OPERATIONAL_ENV` and the test harness's
    :data:`HOST_OPERATIONAL_ENV_PREFIXES`."""
    unsupported = sorted(
        k
        for k in environ
        if k.startswith("MVP_")
        and k not in HOST_OPERATIONAL_ENV
        and not k.startswith(HOST_OPERATIONAL_ENV_PREFIXES)
    )
    if unsupported:
        noun = "variable" if len(unsupported) == 1 else "variables"
        raise ConfigError(
            f"unsupported environment {noun} {', '.join(unsupported)}; the process host "
            "is configured through its TOML config and arguments (docs/host.md)"
        )


# --------------------------------------------------------------------------- resolution


def _load(args: HostArguments, cwd: Path, files: HostFiles) -> tuple[Path | None, _Values]:
    if args.runtime_config is not None:
        path = _path(cwd, args.runtime_config)
    else:
        path = cwd / DEFAULT_CONFIG_PATH
        if not files.is_file(path):
            return None, _Values()
    try:
        text = files.read_text(path)
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"read config {path}: {err}") from None
    return path, _read_toml(text, path)


def _gguf_source(v: _Values, cwd: Path) -> LocalGguf | HubGguf | None:
    local = v.texts.get("model.gguf_local_path")
    repo = v.texts.get("model.gguf_repo")
    file = v.texts.get("model.gguf_file")
    revision = v.texts.get("model.gguf_revision")
    if local is not None and repo is not None:
        raise ConfigError("model.gguf_local_path and model.gguf_repo are both set; choose one")
    if local is not None:
        if file is not None or revision is not None:
            raise ConfigError(
                "model.gguf_file and model.gguf_revision belong to model.gguf_repo; "
                "model.gguf_local_path names the file itself"
            )
        return LocalGguf(path=_path(cwd, local))
    if repo is not None:
        if file is None:
            raise ConfigError("model.gguf_repo needs model.gguf_file (the GGUF in the repo)")
        for key, text, problem in (
            ("model.gguf_repo", repo, hub_repo_problem(repo)),
            ("model.gguf_file", file, hub_file_problem(file)),
            ("model.gguf_revision", revision, revision and hub_revision_problem(revision)),
        ):
            if problem:
                raise _invalid(key, text, problem)
        return HubGguf(repo=repo, file=file, revision=revision)
    if file is not None or revision is not None:
        raise ConfigError("model.gguf_file and model.gguf_revision need model.gguf_repo")
    return None


def _relay(v: _Values) -> RelayConfig:
    mode_text = v.texts.get("relay.mode")
    url = v.texts.get("relay.url")
    try:
        mode = RelayMode(mode_text or RelayMode.DEFAULT)
    except ValueError:
        raise ConfigError(
            f"unsupported relay.mode {_quote(mode_text or '')}; use default or disabled"
        ) from None
    if url is not None:
        _relay_url(url)
        if mode is RelayMode.DISABLED:
            raise ConfigError('relay.url is set but relay.mode is "disabled"; remove one')
    return RelayConfig(mode=mode, url=url)


def _ssh_identity(args: HostArguments, v: _Values, environ: Mapping[str, str], cwd: Path) -> Path:
    if args.vastai_ssh_identity is not None:
        name, text = ARG_VASTAI_SSH_IDENTITY, args.vastai_ssh_identity
    elif "vastai.ssh_identity" in v.texts:
        name, text = "vastai.ssh_identity", v.texts["vastai.ssh_identity"]
    else:
        home = environ.get("HOME", "")
        if not home:
            raise ConfigError(
                f"vastai.ssh_identity or {ARG_VASTAI_SSH_IDENTITY} is required because HOME "
                "is unset"
            )
        return Path(home) / DEFAULT_SSH_IDENTITY
    if text.startswith("~/"):
        home = environ.get("HOME", "")
        if not home:
            raise ConfigError(f"{name} uses ~/ but HOME is unset")
        return Path(home) / text[2:]
    return _path(cwd, text)


def _vastai(
    args: HostArguments,
    v: _Values,
    environ: Mapping[str, str],
    cwd: Path,
    files: HostFiles,
) -> VastAiSettings:
    """Spec 7.3's requirements that need no network: the API key (VASTAI_API_KEY over
    vastai.api_key), the bootstrap command, a pullable image, an existing SSH identity."""
    api_key = _secret_token(VASTAI_API_KEY_ENV, environ.get(VASTAI_API_KEY_ENV, ""))
    if api_key is None and "vastai.api_key" in v.secrets:
        api_key = _secret_token("vastai.api_key", v.secrets["vastai.api_key"].get_secret_value())
    if api_key is None:
        raise ConfigError(
            f"{VASTAI_API_KEY_ENV} or vastai.api_key is required when the provider is vastai"
        )
    bootstrap = v.texts.get("vastai.bootstrap_command")
    if bootstrap is None:
        raise ConfigError("vastai.bootstrap_command is required when the provider is vastai")
    image_name = "vastai.image" if "vastai.image" in v.texts else "image.node"
    image = v.texts.get(image_name)
    if image is None:
        raise ConfigError(
            "vastai.image (or image.node) is required when the provider is vastai: a rented "
            "host pulls the node image from a registry"
        )
    if not _looks_remote_image(image):
        raise _invalid(
            image_name,
            image,
            "a rented host pulls the node image, so it must name a registry "
            "(e.g. ghcr.io/org/mvp-node:tag)",
        )
    identity = _ssh_identity(args, v, environ, cwd)
    if not files.is_file(identity):
        raise ConfigError(
            f"missing VastAI SSH identity {identity}; create/register one with vastai "
            f"create ssh-key or set {ARG_VASTAI_SSH_IDENTITY}"
        )
    return VastAiSettings(
        api_key=api_key,
        image=image,
        bootstrap_command=bootstrap,
        ssh_identity=identity,
        disk_gb=v.ints.get("vastai.disk_gb"),
        ssh_user=v.texts.get("vastai.ssh_user"),
        confirm_lease=v.bools.get("vastai.confirm_lease", False),
        onstart=v.texts.get("vastai.onstart"),
        gpu_name=v.texts.get("vastai.gpu_name"),
        min_gpu_ram_mb=v.ints.get("vastai.min_gpu_ram_mb"),
        min_down_mbps=v.floats.get("vastai.min_down_mbps"),
        min_up_mbps=v.floats.get("vastai.min_up_mbps"),
        min_reliability=v.floats.get("vastai.min_reliability"),
        require_verified=v.bools.get("vastai.require_verified"),
        poll_interval_secs=v.ints.get("vastai.poll_interval_secs"),
    )


def _check_values(v: _Values) -> None:
    """Value rules of single keys beyond their TOML type (checked even when an argument
    overrides the key: a config file with a bad value is a bad config file)."""
    if "runtime.profile" in v.texts:
        _profile(v.texts["runtime.profile"])
    if "provider.kind" in v.texts:
        _provider(v.texts["provider.kind"])
    if v.ints.get("runtime.pipeline_stages") == 0:
        raise ConfigError(f"{ARG_PIPELINE_STAGES} must be greater than 0")
    if v.ints.get("model.max_context") == 0:
        raise _invalid("model.max_context", 0, "must be greater than 0")
    for key in ("vastai.disk_gb", "vastai.poll_interval_secs"):
        if v.ints.get(key) == 0:
            raise _invalid(key, 0, "must be greater than 0")
    for key in ("vastai.min_down_mbps", "vastai.min_up_mbps"):
        value = v.floats.get(key)
        if value is not None and value < 0:
            raise _invalid(key, value, "must not be negative")
    reliability = v.floats.get("vastai.min_reliability")
    if reliability is not None and not 0.0 <= reliability <= 1.0:
        raise _invalid("vastai.min_reliability", reliability, "expected a number from 0 to 1")
    for key in ("image.node", "vastai.image"):
        if key in v.texts:
            _image(key, v.texts[key])
    gpus = v.texts.get("docker.gpus")
    if gpus and not _GPUS.fullmatch(gpus):
        raise _invalid("docker.gpus", gpus, 'use "all", a count, or comma-separated device ids')
    if "prompt.rpc_addr" in v.texts:
        try:
            parse_socket_address(v.texts["prompt.rpc_addr"])
        except ValueError as err:
            raise _invalid("prompt.rpc_addr", v.texts["prompt.rpc_addr"], str(err)) from None


def resolve_config(
    argv: Sequence[str],
    environ: Mapping[str, str],
    cwd: Path,
    files: HostFiles,
) -> HostConfig:
    """Spec 7.1: defaults -> TOML -> environment -> arguments, then the provider's
    constraints (spec 9.2). ``argv`` excludes the program name; ``cwd`` is absolute.
    Raises :class:`ConfigError`."""
    args = parse_arguments(argv)
    check_environment(environ)
    config_path, v = _load(args, cwd, files)
    _check_values(v)

    profile = _profile(v.texts.get("runtime.profile", RuntimeProfile.LOCAL.value))
    if args.provider is not None:
        provider = _provider(args.provider)
    elif "provider.kind" in v.texts:
        provider = _provider(v.texts["provider.kind"])
    else:
        provider = ProviderKind.VASTAI if profile is RuntimeProfile.DEPLOY else ProviderKind.PROCESS

    stages = v.ints.get("runtime.pipeline_stages", 1)
    if args.pipeline_stages is not None:
        stages = _stages_argument(args.pipeline_stages)
    if stages == 0:
        raise ConfigError(f"{ARG_PIPELINE_STAGES} must be greater than 0")

    worker_bin = _path(cwd, args.worker_bin) if args.worker_bin is not None else None

    rpc_text = v.texts.get("prompt.rpc_addr")
    rpc_bind = (
        parse_socket_address(rpc_text)
        if rpc_text is not None
        else SocketAddress(host=DEFAULT_RPC_HOST, port=DEFAULT_RPC_PORT)
    )
    gguf = _gguf_source(v, cwd)
    tokenizer_text = v.texts.get("model.tokenizer_local_path")
    tokenizer = _path(cwd, tokenizer_text) if tokenizer_text is not None else None
    frame_log_text = v.texts.get("observability.datastream_frame_log")
    relay = _relay(v)
    # HF_TOKEN is kept as a secret (the host redacts it); a hub model is fetched with the
    # HF_TOKEN of the process that fetches it (the host's embedded worker inherits it).
    hf_text = environ.get(HF_TOKEN_ENV, "").strip()
    hf_token = SecretStr(hf_text) if hf_text else None

    # Provider constraints (spec 9.2), before anything starts.
    if (
        provider is ProviderKind.PROCESS
        and worker_bin is not None
        and not files.is_file(worker_bin)
    ):
        raise ConfigError(f"local process worker binary does not exist: {worker_bin}")
    host_files = (
        ("model.gguf_local_path", gguf.path if isinstance(gguf, LocalGguf) else None),
        ("model.tokenizer_local_path", tokenizer),
    )
    for key, local in host_files:
        if local is None:
            continue
        if provider is ProviderKind.VASTAI:
            raise ConfigError(
                f"{key} names a file on this host; only the process and docker providers "
                "can use one (a rented host cannot see it)"
            )
        if not files.is_file(local):
            raise ConfigError(f"{key} does not exist or is not a file: {local}")
    vastai = _vastai(args, v, environ, cwd, files) if provider is ProviderKind.VASTAI else None

    return HostConfig(
        config_path=config_path,
        config_profile=profile,
        provider=provider,
        image=v.texts.get("image.node"),
        docker_gpus=v.texts.get("docker.gpus"),
        rpc_bind=rpc_bind,
        run_id=v.ints.get("runtime.run_id", 1),
        node_id=v.ints.get("runtime.node_id", 1),
        stage_index=v.ints.get("runtime.stage_index", 0),
        layer_end_exclusive=v.ints.get("runtime.layer_end_exclusive"),
        pipeline_stages=stages,
        model_id=v.texts.get("model.id"),
        gguf_source=gguf,
        tokenizer_path=tokenizer,
        max_context=v.ints.get("model.max_context"),
        relay=relay,
        vastai=vastai,
        worker_bin=worker_bin,
        datastream_frame_log=_path(cwd, frame_log_text) if frame_log_text is not None else None,
        hf_token=hf_token,
    )


# --------------------------------------------------------------------------- run request


def vast_run_settings(vast: VastAiSettings) -> VastAiRunSettings:
    """The [vastai] table's non-secret part, as the run carries it (the API key and the
    SSH identity stay in the orchestrator worker's environment: ``vast_worker_env``)."""
    fields: dict[str, Any] = {
        "image": vast.image,
        "bootstrap_command": vast.bootstrap_command,
        "onstart": vast.onstart,
        "gpu_name": vast.gpu_name,
        "min_gpu_ram_mb": vast.min_gpu_ram_mb,
        "min_up_mbps": vast.min_up_mbps,
        "disk_gb": vast.disk_gb,
        "ssh_user": vast.ssh_user,
        "min_down_mbps": vast.min_down_mbps,
        "min_reliability": vast.min_reliability,
        "require_verified": vast.require_verified,
        "poll_interval_s": vast.poll_interval_secs,
    }
    return VastAiRunSettings(**{k: v for k, v in fields.items() if v is not None})


def vast_worker_env(cfg: HostConfig) -> dict[str, str]:
    """What the embedded orchestrator worker needs of a vastai configuration."""
    if cfg.provider is not ProviderKind.VASTAI or cfg.vastai is None:
        return {}
    return {
        "VASTAI_API_KEY": cfg.vastai.api_key.get_secret_value(),
        "MVP_VASTAI_SSH_IDENTITY": str(cfg.vastai.ssh_identity),
    }


def to_run_request(cfg: HostConfig) -> RunRequest:
    """The run the host starts for ``cfg``, already passing ``validate_request`` (its
    refusal becomes a ConfigError with the same text, so nothing starts). Raises
    ConfigError for configured values this release's runs cannot honour."""
    if cfg.stage_index != 0:
        raise ConfigError(
            "runtime.stage_index: a run plans its stages itself (stage 0 first); leave it out "
            "or set 0"
        )
    if cfg.layer_end_exclusive is not None:
        raise ConfigError(
            "runtime.layer_end_exclusive is not supported in this release: a run plans each "
            "stage's layers from the GGUF (use runtime.pipeline_stages)"
        )
    if isinstance(cfg.gguf_source, LocalGguf):
        model = ModelSource(path=str(cfg.gguf_source.path))
    elif isinstance(cfg.gguf_source, HubGguf):
        hub = cfg.gguf_source
        model = ModelSource(
            hf=HubModel(repo=hub.repo, file=hub.file, revision=hub.revision or "main")
        )
    else:
        model = ModelSource(bundled=DEFAULT_BUNDLED_MODEL)
    tokenizer = ModelSource(path=str(cfg.tokenizer_path)) if cfg.tokenizer_path else None
    worker_image = cfg.image if cfg.provider is ProviderKind.DOCKER else None
    vast = cfg.vastai if cfg.provider is ProviderKind.VASTAI else None
    gpus = (cfg.docker_gpus or None) if cfg.provider is ProviderKind.DOCKER else None
    try:
        request = RunRequest(
            run_id=cfg.run_id,
            node_id=cfg.node_id,
            provider=cfg.provider,
            worker_image=worker_image,
            docker=DockerSettings(gpus=gpus),
            vastai=VastAiRunSettings() if vast is None else vast_run_settings(vast),
            model=model,
            tokenizer=tokenizer,
            pipeline_stages=cfg.pipeline_stages,
            default_max_tokens=cfg.default_max_tokens,
            max_context=cfg.max_context,
        )
    except ValidationError as err:
        raise ConfigError(f"invalid run request: {describe_invalid(err)}") from None
    try:
        validate_request(request)
    except RunRejectedError as err:
        raise ConfigError(str(err)) from None
    return request
