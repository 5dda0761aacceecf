"""Configuration resolver of the process host ``mvp-orchestrator`` (process spec 2.1-2.4,
7.1-7.3, 9.1-9.2, 10.2; CONTRACTS "Configuration of the process host").

Layering: fixed defaults -> TOML (``--runtime-config <path>``, else ``.config/config.toml``
under the working directory when it is a file) -> environment (secrets only) -> the five
accepted process arguments. Provider constraints are checked here, before anything starts.

The TOML file's tables are pydantic models (:mod:`mvp_core.host_toml`); this module
applies the rules between keys and the layers, and resolves one :class:`HostConfig`.
Pure: the caller hands in the arguments, the environment, the working directory and a
:class:`HostFiles` that reads the config file and says whether a file exists, so every rule
is testable without a disk. Every failure is a :class:`ConfigError` whose text is the whole
message (the host prints ``mvp-orchestrator: <error>`` and exits 1); no message carries a
secret value, and :class:`HostConfig` holds its secrets as ``SecretStr``.

``docs/host.md`` "Configuration" documents every table, key, default and error.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal, Protocol

from pydantic import Field, SecretStr, ValidationError

from mvp_core import vastai_env
from mvp_core.host_toml import (
    ARG_PIPELINE_STAGES,
    U32_MAX,
    ConfigError,
    ConfigFile,
    RelayMode,
    RuntimeProfile,
    SocketAddress,
    _Frozen,
    invalid,
    parse_provider,
    parse_socket_address,
    quote,
    read_config_file,
)
from mvp_core.models import (
    DockerSettings,
    HubModel,
    ModelSource,
    NodeLossPolicy,
    PromptHost,
    ProviderKind,
    RunRequest,
    hub_file_problem,
    hub_repo_problem,
    hub_revision_problem,
)
from mvp_core.models import VastAiSettings as VastAiRunSettings
from mvp_core.names import DEFAULT_BUNDLED_MODEL, REAPER_INTERVAL_ENV
from mvp_core.validation import RunRejectedError, describe_invalid, validate_request

__all__ = [
    "ARGUMENTS",
    "HOST_OPERATIONAL_ENV",
    "ConfigError",
    "HostArguments",
    "HostConfig",
    "HostFiles",
    "HubGguf",
    "LocalGguf",
    "RelayConfig",
    "RelayMode",
    "RuntimeProfile",
    "SocketAddress",
    "VastAiSettings",
    "check_environment",
    "parse_arguments",
    "parse_socket_address",
    "resolve_config",
    "to_run_request",
    "vast_worker_env",
]

DEFAULT_CONFIG_PATH = Path(".config") / "config.toml"
DEFAULT_NODE_IMAGE = "swactor-mvp-node:latest"
DEFAULT_DOCKER_GPUS = "all"
DEFAULT_RPC_HOST = "127.0.0.1"
DEFAULT_RPC_PORT = 19777
DEFAULT_MAX_TOKENS = 64
DEFAULT_SSH_IDENTITY = vastai_env.DEFAULT_SSH_IDENTITY  # under $HOME
GGUF_MAGIC = b"GGUF"

ARG_RUNTIME_CONFIG = "--runtime-config"
ARG_PROVIDER = "--provider"
ARG_WORKER_BIN = "--worker-bin"
ARG_VASTAI_SSH_IDENTITY = "--vastai-ssh-identity"
# Ours, beyond the spec's five: the run's live dashboard (DECISIONS 92), loopback only.
ARG_DASHBOARD = "--dashboard"
ARGUMENTS = (
    ARG_RUNTIME_CONFIG,
    ARG_PROVIDER,
    ARG_WORKER_BIN,
    ARG_PIPELINE_STAGES,
    ARG_VASTAI_SSH_IDENTITY,
    ARG_DASHBOARD,
)

VASTAI_API_KEY_ENV = vastai_env.API_KEY_ENV
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
        "MVP_DATASTREAM_BIND",  # where a run's live datastream listens (activities/datastream.py)
        "MVP_MODELS_DIR",  # model cache (mvp_io/model_store.py)
        "MVP_PROVIDER_HOST",  # the provider host's name (activities/planning.py)
        "MVP_DOCKER_TEMPORAL_ADDRESS",  # where containers reach Temporal (docker provider)
        "MVP_PROCESS_DATAPLANE_HOST",  # where process nodes listen (process provider)
        # the Vast.ai API's address, a Temporal address rented hosts reach as it is, how
        # long one provider stop keeps destroying (mvp_core/vastai_env.py)
        *vastai_env.HOST_OPERATIONAL,
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


class HostFiles(Protocol):
    """The file access the resolver needs, supplied by the caller."""

    def read_text(self, path: Path) -> str:
        """The file's text; raises OSError (or UnicodeDecodeError) when it cannot."""
        ...

    def is_file(self, path: Path) -> bool:
        """Whether ``path`` names an existing regular file (following links)."""
        ...

    def read_head(self, path: Path, size: int) -> bytes:
        """The file's first ``size`` bytes (fewer when shorter); raises OSError."""
        ...


# --------------------------------------------------------------------------- typed state


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
    """[relay], as this implementation honours it: no relay (DECISIONS "relay")."""

    mode: RelayMode = RelayMode.DISABLED


class VastAiSettings(_Frozen):
    """The [vastai] table, resolved for a Vast.ai run (present only when the provider is
    vastai): the host's secrets, and ``run``, what the run request carries (the table's
    other keys, validated into the run's own model, with the image and bootstrap command
    resolved). The SSH public key is derived later, by Vast.ai runtime preparation."""

    api_key: SecretStr
    ssh_identity: Path
    run: VastAiRunSettings


class HostConfig(_Frozen):
    """Spec 7.1's Config. ``None`` means "not configured" where the spec has a default
    that this implementation applies differently (image, docker_gpus): see the
    ``*_or_default`` properties for the spec default to display."""

    config_path: Path | None = None
    config_profile: RuntimeProfile = RuntimeProfile.LOCAL
    provider: ProviderKind = ProviderKind.PROCESS
    image: str | None = None
    docker_gpus: str | None = None
    docker_cpus: float | None = None  # [docker].cpus: each node container's CPU limit
    docker_memory: int | None = None  # [docker].memory_mib, in bytes: each container's limit
    node_memory: list[int] | None = None  # [runtime].node_memory_mib, in bytes (DECISIONS 71)
    rpc_bind: SocketAddress = SocketAddress(host=DEFAULT_RPC_HOST, port=DEFAULT_RPC_PORT)
    dashboard: SocketAddress | None = None  # --dashboard: where the run's dashboard listens
    run_id: int = 1
    node_id: int = 1
    stage_index: int = 0
    layer_end_exclusive: int | None = None
    pipeline_stages: int = 1
    on_node_loss: NodeLossPolicy = NodeLossPolicy.FAIL  # [runtime].on_node_loss (DECISIONS 68)
    gguf_source: LocalGguf | HubGguf | None = Field(default=None, discriminator="kind")
    tokenizer_path: Path | None = None
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    max_active_prompts: int = 1  # [prompt].max_active_prompts (DECISIONS 62)
    prompt_host: PromptHost = PromptHost.WORKFLOW  # [prompt].host (DECISIONS 66)
    max_context: int | None = None
    relay: RelayConfig = RelayConfig()
    vastai: VastAiSettings | None = None
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


class HostArguments(_Frozen):
    """The accepted process arguments (spec 2.3), raw; ``None`` = not given."""

    runtime_config: str | None = None
    provider: str | None = None
    worker_bin: str | None = None
    pipeline_stages: str | None = None
    vastai_ssh_identity: str | None = None
    dashboard: str | None = None


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
            raise ConfigError(f"unknown argument {quote(arg)}")
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


def dashboard_argument(text: str) -> SocketAddress:
    """``--dashboard [HOST:]PORT``: a port alone is on 127.0.0.1. Loopback only: the
    dashboard has no authentication here (the gateway's API keys are the gateway's), and
    it shows the run's nodes, hosts and log tails (DECISIONS 92)."""
    text = text.strip()
    if re.fullmatch(r"[0-9]{1,5}", text):
        text = f"{DEFAULT_RPC_HOST}:{text}"
    elif text.startswith("localhost:"):
        text = DEFAULT_RPC_HOST + text.removeprefix("localhost")
    try:
        addr = parse_socket_address(text)
    except ValueError as err:
        raise invalid(ARG_DASHBOARD, text, str(err)) from None
    if not ipaddress.ip_address(addr.host).is_loopback:
        raise ConfigError(
            f"{ARG_DASHBOARD} {addr}: the host's dashboard listens on loopback only (it has "
            "no authentication); reach it through an SSH tunnel, or serve the run with "
            "mvp-gateway --api-key-file"
        )
    return addr


def _stages_argument(text: str) -> int:
    """--pipeline-stages as Rust parses a u32 (its error texts)."""
    if not re.fullmatch(r"\+?[0-9]+", text):
        raise invalid(ARG_PIPELINE_STAGES, text, "invalid digit found in string")
    value = int(text)
    if value > U32_MAX:
        raise invalid(ARG_PIPELINE_STAGES, text, "number too large to fit in target type")
    return value


# --------------------------------------------------------------------------- value rules


def _path(cwd: Path, text: str) -> Path:
    p = Path(text)
    return p if p.is_absolute() else cwd / p


def _looks_remote_image(image: str) -> bool:
    """Whether an image reference names a registry host (a rented host must pull it)."""
    repository = image.split("@", 1)[0]
    first, slash, _ = repository.partition("/")
    return bool(slash) and (first == "localhost" or "." in first or ":" in first)


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


def _load(args: HostArguments, cwd: Path, files: HostFiles) -> tuple[Path | None, ConfigFile]:
    if args.runtime_config is not None:
        path = _path(cwd, args.runtime_config)
    else:
        path = cwd / DEFAULT_CONFIG_PATH
        if not files.is_file(path):
            return None, ConfigFile()
    try:
        text = files.read_text(path)
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"read config {path}: {err}") from None
    return path, read_config_file(text, path)


def _gguf_source(doc: ConfigFile, cwd: Path) -> LocalGguf | HubGguf | None:
    m = doc.model
    local, repo, file, revision = m.gguf_local_path, m.gguf_repo, m.gguf_file, m.gguf_revision
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
                raise invalid(key, text, problem)
        return HubGguf(repo=repo, file=file, revision=revision)
    if file is not None or revision is not None:
        raise ConfigError("model.gguf_file and model.gguf_revision need model.gguf_repo")
    return None


_NO_RELAY = (
    "this implementation has no relay: nodes reach each other directly (the data plane's "
    "TCP) and the run through Temporal"
)


def _relay(doc: ConfigFile) -> RelayConfig:
    """[relay] is the original's Iroh relay. This implementation has none, so only
    ``mode = "disabled"`` (or no [relay]) says what it does; a relay asked for is refused."""
    mode = doc.relay.mode or RelayMode.DEFAULT
    if doc.relay.url is not None:
        if mode is RelayMode.DISABLED:
            raise ConfigError('relay.url is set but relay.mode is "disabled"; remove one')
        raise ConfigError(f"relay.url is not supported: {_NO_RELAY}; leave it out")
    if doc.relay.mode is RelayMode.DEFAULT:
        raise ConfigError(
            f'relay.mode "default" is not supported: {_NO_RELAY}; set relay.mode = '
            '"disabled" or leave [relay] out'
        )
    return RelayConfig()


def _refused_keys(doc: ConfigFile, args: HostArguments) -> None:
    """Spec keys this implementation would accept and then ignore: refused, by name."""
    if args.worker_bin is not None:
        raise ConfigError(
            f"{ARG_WORKER_BIN} is not supported: a process node runs this installation's "
            "node agent (python -m workers.node, with the host's Python); leave it out"
        )
    if doc.model.id is not None:
        raise ConfigError(
            "model.id is not supported: a run names its model by its source "
            "(model.gguf_local_path, or model.gguf_repo with model.gguf_file; neither: the "
            f"bundled {DEFAULT_BUNDLED_MODEL}); leave it out"
        )
    if doc.vastai.confirm_lease:
        raise ConfigError(
            "vastai.confirm_lease = true is not supported: a Vast.ai run rents its "
            "instances without asking (the run's provisioning budget bounds it); leave it "
            "out or set false"
        )


def _ssh_identity(
    args: HostArguments, doc: ConfigFile, environ: Mapping[str, str], cwd: Path
) -> Path:
    if args.vastai_ssh_identity is not None:
        name, text = ARG_VASTAI_SSH_IDENTITY, args.vastai_ssh_identity
    elif doc.vastai.ssh_identity is not None:
        name, text = "vastai.ssh_identity", doc.vastai.ssh_identity
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
    doc: ConfigFile,
    environ: Mapping[str, str],
    cwd: Path,
    files: HostFiles,
) -> VastAiSettings:
    """Spec 7.3's requirements that need no network: the API key (VASTAI_API_KEY over
    vastai.api_key), the bootstrap command, a pullable image, an existing SSH identity;
    and the Vast.ai variables of the environment the host's worker inherits."""
    t = doc.vastai
    api_key = _secret_token(VASTAI_API_KEY_ENV, environ.get(VASTAI_API_KEY_ENV, ""))
    if api_key is None and t.api_key is not None:
        api_key = _secret_token("vastai.api_key", t.api_key.get_secret_value())
    if api_key is None:
        raise ConfigError(
            f"{VASTAI_API_KEY_ENV} or vastai.api_key is required when the provider is vastai"
        )
    try:
        vastai_env.VastAiEnvironment.from_env(
            {k: v for k, v in environ.items() if k != VASTAI_API_KEY_ENV}
        )
    except vastai_env.VastAiEnvError as err:
        raise ConfigError(str(err)) from None
    if t.bootstrap_command is None:
        raise ConfigError("vastai.bootstrap_command is required when the provider is vastai")
    image_name = "vastai.image" if t.image is not None else "image.node"
    image = t.image if t.image is not None else doc.image.node
    if image is None:
        raise ConfigError(
            "vastai.image (or image.node) is required when the provider is vastai: a rented "
            "host pulls the node image from a registry"
        )
    if not _looks_remote_image(image):
        raise invalid(
            image_name,
            image,
            "a rented host pulls the node image, so it must name a registry "
            "(e.g. ghcr.io/org/mvp-node:tag)",
        )
    identity = _ssh_identity(args, doc, environ, cwd)
    if not files.is_file(identity):
        raise ConfigError(
            f"missing VastAI SSH identity {identity}; create/register one with vastai "
            f"create ssh-key or set {ARG_VASTAI_SSH_IDENTITY}"
        )
    return VastAiSettings(
        api_key=api_key,
        ssh_identity=identity,
        run=t.run_settings(image=image, bootstrap_command=t.bootstrap_command),
    )


def _host_file(key: str, path: Path, provider: ProviderKind, files: HostFiles) -> None:
    """A file [model] names on this host: usable by this provider, there, and (for the
    tokenizer, which nodes read from a GGUF's metadata) a GGUF file."""
    if provider is ProviderKind.VASTAI:
        raise ConfigError(
            f"{key} names a file on this host; only the process and docker providers "
            "can use one (a rented host cannot see it)"
        )
    if not files.is_file(path):
        raise ConfigError(f"{key} does not exist or is not a file: {path}")
    if key != "model.tokenizer_local_path":
        return
    try:
        head = files.read_head(path, len(GGUF_MAGIC))
    except OSError as err:
        raise ConfigError(f"read {key} {path}: {err}") from None
    if head != GGUF_MAGIC:
        raise ConfigError(
            f"{key} is not a GGUF file: {path} (a node reads the tokenizer from a GGUF's "
            "metadata; name a .gguf file, or leave the key out to use the model's own)"
        )


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
    dashboard = None if args.dashboard is None else dashboard_argument(args.dashboard)
    check_environment(environ)
    config_path, doc = _load(args, cwd, files)

    profile = doc.runtime.profile or RuntimeProfile.LOCAL
    if args.provider is not None:
        provider = parse_provider(args.provider)
    elif doc.provider.kind is not None:
        provider = doc.provider.kind
    else:
        provider = ProviderKind.VASTAI if profile is RuntimeProfile.DEPLOY else ProviderKind.PROCESS

    stages = doc.runtime.pipeline_stages or 1
    if args.pipeline_stages is not None:
        stages = _stages_argument(args.pipeline_stages)
    if stages == 0:
        raise ConfigError(f"{ARG_PIPELINE_STAGES} must be greater than 0")

    _refused_keys(doc, args)
    rpc_bind = doc.prompt.rpc_addr or SocketAddress(host=DEFAULT_RPC_HOST, port=DEFAULT_RPC_PORT)
    gguf = _gguf_source(doc, cwd)
    tokenizer_text = doc.model.tokenizer_local_path
    tokenizer = _path(cwd, tokenizer_text) if tokenizer_text is not None else None
    frame_log_text = doc.observability.datastream_frame_log
    relay = _relay(doc)
    # HF_TOKEN is kept as a secret (the host redacts it); a hub model is fetched with the
    # HF_TOKEN of the process that fetches it (the host's embedded worker inherits it).
    hf_text = environ.get(HF_TOKEN_ENV, "").strip()
    hf_token = SecretStr(hf_text) if hf_text else None

    # Provider constraints (spec 9.2), before anything starts.
    if isinstance(gguf, LocalGguf):
        _host_file("model.gguf_local_path", gguf.path, provider, files)
    if tokenizer is not None:
        _host_file("model.tokenizer_local_path", tokenizer, provider, files)
    vastai = _vastai(args, doc, environ, cwd, files) if provider is ProviderKind.VASTAI else None

    r = doc.runtime
    return HostConfig(
        config_path=config_path,
        config_profile=profile,
        provider=provider,
        image=doc.image.node,
        docker_gpus=doc.docker.gpus,
        docker_cpus=doc.docker.cpus,
        docker_memory=None if doc.docker.memory_mib is None else doc.docker.memory_mib << 20,
        node_memory=None if r.node_memory_mib is None else [v << 20 for v in r.node_memory_mib],
        rpc_bind=rpc_bind,
        dashboard=dashboard,
        run_id=1 if r.run_id is None else r.run_id,
        node_id=1 if r.node_id is None else r.node_id,
        stage_index=r.stage_index or 0,
        layer_end_exclusive=r.layer_end_exclusive,
        pipeline_stages=stages,
        on_node_loss=r.on_node_loss or NodeLossPolicy.FAIL,
        gguf_source=gguf,
        tokenizer_path=tokenizer,
        max_context=doc.model.max_context,
        max_active_prompts=doc.prompt.max_active_prompts or 1,
        prompt_host=doc.prompt.host or PromptHost.WORKFLOW,
        relay=relay,
        vastai=vastai,
        datastream_frame_log=_path(cwd, frame_log_text) if frame_log_text is not None else None,
        hf_token=hf_token,
    )


# --------------------------------------------------------------------------- run request


def vast_worker_env(cfg: HostConfig) -> dict[str, str]:
    """What the embedded orchestrator worker needs of a vastai configuration."""
    if cfg.provider is not ProviderKind.VASTAI or cfg.vastai is None:
        return {}
    return vastai_env.credentials_env(cfg.vastai.api_key, cfg.vastai.ssh_identity)


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
    cpus = cfg.docker_cpus if cfg.provider is ProviderKind.DOCKER else None
    memory = cfg.docker_memory if cfg.provider is ProviderKind.DOCKER else None
    try:
        request = RunRequest(
            run_id=cfg.run_id,
            node_id=cfg.node_id,
            provider=cfg.provider,
            worker_image=worker_image,
            docker=DockerSettings(gpus=gpus, cpus=cpus, memory=memory),
            vastai=VastAiRunSettings() if vast is None else vast.run,
            model=model,
            tokenizer=tokenizer,
            pipeline_stages=cfg.pipeline_stages,
            on_node_loss=cfg.on_node_loss,
            node_memory=cfg.node_memory,
            default_max_tokens=cfg.default_max_tokens,
            max_context=cfg.max_context,
            max_active_prompts=cfg.max_active_prompts,
            prompt_host=cfg.prompt_host,
        )
    except ValidationError as err:
        raise ConfigError(f"invalid run request: {describe_invalid(err)}") from None
    try:
        validate_request(request)
    except RunRejectedError as err:
        raise ConfigError(str(err)) from None
    return request
