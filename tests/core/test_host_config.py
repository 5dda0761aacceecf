"""The process host's configuration resolver (mvp_core/host_config.py): pure, so every rule
runs here against an in-memory file system."""

from __future__ import annotations

from pathlib import Path

import pytest

from mvp_core.host_config import (
    ARGUMENTS,
    HOST_OPERATIONAL_ENV,
    ConfigError,
    HostConfig,
    HubGguf,
    LocalGguf,
    RelayMode,
    RuntimeProfile,
    SocketAddress,
    resolve_config,
    to_run_request,
    vast_worker_env,
)
from mvp_core.host_toml import VastAiTable
from mvp_core.models import ModelSource, ProviderKind
from mvp_core.models import VastAiSettings as VastAiRunSettings
from mvp_core.names import DEFAULT_BUNDLED_MODEL
from mvp_core.validation import validate_request
from mvp_io.model_store import DEFAULT_BUNDLED

CWD = Path("/work/run")
DEFAULT_TOML = CWD / ".config" / "config.toml"
HOME = "/home/u"
IDENTITY = f"{HOME}/.ssh/id_ed25519"
SECRET = "sekret-vast-key-123"


class MemoryFiles:
    """HostFiles over a dict of path -> text; ``unreadable`` paths exist but raise."""

    def __init__(self, files: dict[str, str] | None = None, unreadable: tuple[str, ...] = ()):
        self.files = dict(files or {})
        self.unreadable = set(unreadable)
        self.reads: list[Path] = []

    def read_text(self, path: Path) -> str:
        self.reads.append(path)
        if str(path) in self.unreadable:
            raise PermissionError(13, "Permission denied", str(path))
        try:
            return self.files[str(path)]
        except KeyError:
            raise FileNotFoundError(2, "No such file or directory", str(path)) from None

    def is_file(self, path: Path) -> bool:
        return str(path) in self.files or str(path) in self.unreadable

    def read_head(self, path: Path, size: int) -> bytes:
        return self.read_text(path).encode()[:size]


def resolve(
    toml: str | None = None,
    argv: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    files: dict[str, str] | None = None,
) -> HostConfig:
    every = dict(files or {})
    if toml is not None:
        every[str(DEFAULT_TOML)] = toml
    return resolve_config(list(argv), env if env is not None else {}, CWD, MemoryFiles(every))


def error_of(*args: object, **kwargs: object) -> str:
    with pytest.raises(ConfigError) as info:
        resolve(*args, **kwargs)  # type: ignore[arg-type]
    return str(info.value)


# A Vast.ai configuration that resolves: provider, key, bootstrap, a registry image and the
# default SSH identity under HOME.
VAST = f"""
[provider]
kind = "vastai"
[vastai]
api_key = "{SECRET}"
bootstrap_command = "/opt/mvp/node --join"
image = "registry.example.com/team/mvp-node:1"
"""
VAST_ENV = {"HOME": HOME}
VAST_FILES = {IDENTITY: "-----BEGIN OPENSSH PRIVATE KEY-----"}


def vast(extra: str = "", **kwargs: object) -> HostConfig:
    env = {**VAST_ENV, **kwargs.pop("env", {})}  # type: ignore[dict-item]
    files = {**VAST_FILES, **kwargs.pop("files", {})}  # type: ignore[dict-item]
    return resolve(VAST + extra, env=env, files=files, **kwargs)  # type: ignore[arg-type]


def vast_error(extra: str = "", **kwargs: object) -> str:
    with pytest.raises(ConfigError) as info:
        vast(extra, **kwargs)
    return str(info.value)


# --------------------------------------------------------------------------- defaults


def test_defaults_without_config_file():
    cfg = resolve()
    assert cfg.config_path is None
    assert cfg.config_profile is RuntimeProfile.LOCAL
    assert cfg.provider is ProviderKind.PROCESS
    assert cfg.image is None and cfg.image_or_default == "swactor-mvp-node:latest"
    assert cfg.docker_gpus is None and cfg.docker_gpus_or_default == "all"
    assert cfg.rpc_bind == SocketAddress(host="127.0.0.1", port=19777)
    assert str(cfg.rpc_bind) == "127.0.0.1:19777"
    assert (cfg.run_id, cfg.node_id, cfg.stage_index) == (1, 1, 0)
    assert cfg.layer_end_exclusive is None
    assert cfg.pipeline_stages == 1
    assert cfg.default_max_tokens == 64
    assert cfg.dashboard is None
    assert cfg.max_context is None
    assert cfg.gguf_source is None and cfg.tokenizer_path is None
    # no relay: this implementation has none (DECISIONS "the spec's keys that would do nothing")
    assert cfg.relay.mode is RelayMode.DISABLED
    assert cfg.vastai is None
    assert cfg.datastream_frame_log is None
    assert cfg.hf_token is None


def test_default_config_path_is_read_when_present():
    files = MemoryFiles({str(DEFAULT_TOML): "[runtime]\nrun_id = 9\n"})
    cfg = resolve_config([], {}, CWD, files)
    assert cfg.config_path == DEFAULT_TOML and cfg.run_id == 9
    assert files.reads == [DEFAULT_TOML]


def test_default_config_path_is_ignored_when_absent():
    files = MemoryFiles({str(CWD / "config.toml"): "[runtime]\nrun_id = 9\n"})
    cfg = resolve_config([], {}, CWD, files)
    assert cfg.config_path is None and cfg.run_id == 1
    assert files.reads == []


def test_unreadable_default_config_is_an_error():
    files = MemoryFiles(unreadable=(str(DEFAULT_TOML),))
    with pytest.raises(ConfigError) as info:
        resolve_config([], {}, CWD, files)
    assert (
        str(info.value)
        == f"read config {DEFAULT_TOML}: [Errno 13] Permission denied: '{DEFAULT_TOML}'"
    )


def test_explicit_config_path_missing_is_an_error():
    path = CWD / "other.toml"
    assert error_of(argv=("--runtime-config", "other.toml")) == (
        f"read config {path}: [Errno 2] No such file or directory: '{path}'"
    )


def test_explicit_config_path_replaces_the_default():
    cfg = resolve(
        "[runtime]\nrun_id = 9\n",
        argv=("--runtime-config=/etc/mvp/host.toml",),
        files={"/etc/mvp/host.toml": "[runtime]\nrun_id = 5\n"},
    )
    assert cfg.config_path == Path("/etc/mvp/host.toml") and cfg.run_id == 5


def test_invalid_toml_is_a_parse_error():
    message = error_of("[runtime\nrun_id = 1\n")
    assert message.startswith(f"parse config {DEFAULT_TOML}: ")


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        (
            "[bogus]\nx = 1\n",
            "unknown table [bogus]; accepted tables: runtime, provider, image, relay, prompt, "
            "model, docker, observability, vastai",
        ),
        (
            "[runtime]\nmax_tokens = 12\n",
            "unknown key runtime.max_tokens; accepted keys of [runtime]: profile, run_id, "
            "node_id, stage_index, layer_end_exclusive, pipeline_stages",
        ),
        (
            "[docker]\ncached_model_host_path = '/m.gguf'\n",
            "unknown key docker.cached_model_host_path",
        ),
        ("[runtime.sub]\nx = 1\n", "unknown key runtime.sub"),
        ("runtime = 3\n", "runtime must be a table ([runtime])"),
        ("dashboard = true\n", "unknown table [dashboard]"),
    ],
)
def test_unknown_tables_and_keys_are_errors(toml, message):
    assert error_of(toml).startswith(f"parse config {DEFAULT_TOML}: {message}")


def test_the_first_problem_in_the_file_is_named_type_problems_first():
    toml = '[model]\nmax_context = 0\n[runtime]\nrun_id = "x"\nnode_id = "y"\n'
    assert error_of(toml) == 'invalid runtime.run_id="x": expected an integer'
    toml = "[model]\nmax_context = 0\n[vastai]\ndisk_gb = 0\n"
    assert error_of(toml) == "invalid model.max_context=0: must be greater than 0"
    assert error_of("[runtime]\nrun_id = -1\n[bogus]\n").startswith(
        "invalid runtime.run_id=-1: expected an integer from 0"
    )


# --------------------------------------------------------------------------- every key


def _local(path: str) -> dict[str, str]:
    return {path: "x"}


VALID_KEYS = [
    # (toml, files, check)
    ('[runtime]\nprofile = "local"', {}, lambda c: c.config_profile is RuntimeProfile.LOCAL),
    ("[runtime]\nrun_id = 42", {}, lambda c: c.run_id == 42),
    ("[runtime]\nrun_id = 0", {}, lambda c: c.run_id == 0),
    ("[runtime]\nrun_id = 18446744073709551615", {}, lambda c: c.run_id == 2**64 - 1),
    ("[runtime]\nnode_id = 7", {}, lambda c: c.node_id == 7),
    ("[runtime]\nstage_index = 2", {}, lambda c: c.stage_index == 2),
    ("[runtime]\nlayer_end_exclusive = 24", {}, lambda c: c.layer_end_exclusive == 24),
    ("[runtime]\npipeline_stages = 3", {}, lambda c: c.pipeline_stages == 3),
    ('[provider]\nkind = "docker"', {}, lambda c: c.provider is ProviderKind.DOCKER),
    ('[provider]\nkind = " process "', {}, lambda c: c.provider is ProviderKind.PROCESS),
    ('[image]\nnode = "ghcr.io/acme/node:1"', {}, lambda c: c.image == "ghcr.io/acme/node:1"),
    ('[relay]\nmode = "disabled"', {}, lambda c: c.relay.mode is RelayMode.DISABLED),
    (
        '[prompt]\nrpc_addr = "0.0.0.0:0"',
        {},
        lambda c: c.rpc_bind == SocketAddress(host="0.0.0.0", port=0),
    ),
    ('[prompt]\nrpc_addr = "[::1]:19000"', {}, lambda c: str(c.rpc_bind) == "[::1]:19000"),
    ("[prompt]\nmax_active_prompts = 8", {}, lambda c: c.max_active_prompts == 8),
    ('[prompt]\nhost = "run"', {}, lambda c: c.prompt_host.value == "run"),
    ('[runtime]\non_node_loss = "replace"', {}, lambda c: c.on_node_loss.value == "replace"),
    ("", {}, lambda c: c.on_node_loss.value == "fail"),
    ("", {}, lambda c: c.prompt_host.value == "workflow"),
    (
        '[model]\ngguf_local_path = "models/m.gguf"',
        _local("/work/run/models/m.gguf"),
        lambda c: c.gguf_source == LocalGguf(path=Path("/work/run/models/m.gguf")),
    ),
    (
        '[model]\ngguf_repo = "org/repo"\ngguf_file = "m.gguf"\ngguf_revision = "main"',
        {},
        lambda c: c.gguf_source == HubGguf(repo="org/repo", file="m.gguf", revision="main"),
    ),
    (
        '[model]\ngguf_repo = "org/repo"\ngguf_file = "m.gguf"',
        {},
        lambda c: c.gguf_source == HubGguf(repo="org/repo", file="m.gguf"),
    ),
    (
        '[model]\ntokenizer_local_path = "/models/tokenizer.gguf"',
        {"/models/tokenizer.gguf": "GGUF\x03"},
        lambda c: c.tokenizer_path == Path("/models/tokenizer.gguf"),
    ),
    ("[model]\nmax_context = 512", {}, lambda c: c.max_context == 512),
    ('[docker]\ngpus = "0,1"', {}, lambda c: c.docker_gpus == "0,1"),
    ('[docker]\ngpus = "all"', {}, lambda c: c.docker_gpus == "all"),
    ("[docker]\ncpus = 1", {}, lambda c: c.docker_cpus == 1.0),
    ("[docker]\ncpus = 0.5", {}, lambda c: c.docker_cpus == 0.5),
    ("[docker]\nmemory_mib = 1024", {}, lambda c: c.docker_memory == 1 << 30),
    ("[runtime]\nnode_memory_mib = 2048", {}, lambda c: c.node_memory == [2 << 30]),
    (
        "[runtime]\nnode_memory_mib = [2048, 1024]",
        {},
        lambda c: c.node_memory == [2 << 30, 1 << 30],
    ),
    ('[docker]\ngpus = ""', {}, lambda c: c.docker_gpus == "" and c.docker_gpus_or_default == ""),
    (
        '[observability]\ndatastream_frame_log = "logs/frames.jsonl"',
        {},
        lambda c: c.datastream_frame_log == Path("/work/run/logs/frames.jsonl"),
    ),
]


@pytest.mark.parametrize(("toml", "files", "check"), VALID_KEYS)
def test_every_key_accepts_a_valid_value(toml, files, check):
    assert check(resolve(toml + "\n", files=files))


INVALID_KEYS = [
    ('[runtime]\nprofile = "prod"', 'unsupported runtime profile "prod"; use local or deploy'),
    ("[runtime]\nprofile = 1", "invalid runtime.profile=1: expected a string"),
    ('[runtime]\nrun_id = "abc"', 'invalid runtime.run_id="abc": expected an integer'),
    (
        "[runtime]\nrun_id = -1",
        "invalid runtime.run_id=-1: expected an integer from 0 to 18446744073709551615",
    ),
    ("[runtime]\nnode_id = true", "invalid runtime.node_id=true: expected an integer"),
    (
        "[runtime]\nstage_index = 4294967296",
        "invalid runtime.stage_index=4294967296: expected an integer from 0 to 4294967295",
    ),
    (
        "[runtime]\nlayer_end_exclusive = 1.5",
        "invalid runtime.layer_end_exclusive=1.5: expected an integer",
    ),
    ("[runtime]\npipeline_stages = 0", "--pipeline-stages must be greater than 0"),
    (
        "[prompt]\nmax_active_prompts = 0",
        "invalid prompt.max_active_prompts=0: must be greater than 0",
    ),
    ('[prompt]\nhost = "child"', 'unsupported prompt.host "child"; use workflow or run'),
    (
        '[runtime]\non_node_loss = "retry"',
        'unsupported runtime.on_node_loss "retry"; use fail or replace',
    ),
    (
        '[runtime]\npipeline_stages = "many"',
        'invalid runtime.pipeline_stages="many": expected an integer',
    ),
    ('[provider]\nkind = "mock"', 'unsupported provider "mock"; use process, docker, or vastai'),
    (
        '[provider]\nkind = "Docker"',
        'unsupported provider "Docker"; use process, docker, or vastai',
    ),
    ("[provider]\nkind = []", "invalid provider.kind=an array: expected a string"),
    (
        '[image]\nnode = "bad image!"',
        'invalid image.node="bad image!": not an image reference ([registry/]name[:tag][@digest])',
    ),
    (
        '[image]\nnode = " "',
        'invalid image.node=" ": must not be empty (leave the key out instead)',
    ),
    ('[relay]\nmode = "off"', 'unsupported relay.mode "off"; use default or disabled'),
    (
        '[relay]\nurl = "ftp://relay.example.com"',
        'invalid relay.url="ftp://relay.example.com": expected an http:// or https:// URL with a host',
    ),
    (
        '[relay]\nurl = "https://relay example.com"',
        'invalid relay.url="https://relay example.com": a URL has no whitespace',
    ),
    (
        '[relay]\nmode = "disabled"\nurl = "https://relay.example.com"',
        'relay.url is set but relay.mode is "disabled"; remove one',
    ),
    (
        '[prompt]\nrpc_addr = "localhost:19777"',
        'invalid prompt.rpc_addr="localhost:19777": invalid socket address syntax',
    ),
    (
        '[prompt]\nrpc_addr = "127.0.0.1:70000"',
        'invalid prompt.rpc_addr="127.0.0.1:70000": invalid socket address syntax',
    ),
    (
        '[prompt]\nrpc_addr = "127.0.0.1"',
        'invalid prompt.rpc_addr="127.0.0.1": invalid socket address syntax',
    ),
    (
        '[prompt]\nrpc_addr = "::1:19000"',
        'invalid prompt.rpc_addr="::1:19000": invalid socket address syntax',
    ),
    ("[prompt]\nrpc_addr = 19777", "invalid prompt.rpc_addr=19777: expected a string"),
    ("[model]\nid = 5", "invalid model.id=5: expected a string"),
    (
        '[model]\ngguf_local_path = "models/none.gguf"',
        "model.gguf_local_path does not exist or is not a file: /work/run/models/none.gguf",
    ),
    ("[model]\ngguf_local_path = {}", "invalid model.gguf_local_path=a table: expected a string"),
    (
        '[model]\ngguf_local_path = "/m.gguf"\ngguf_repo = "org/repo"\ngguf_file = "m.gguf"',
        "model.gguf_local_path and model.gguf_repo are both set; choose one",
    ),
    (
        '[model]\ngguf_repo = "org/repo"',
        "model.gguf_repo needs model.gguf_file (the GGUF in the repo)",
    ),
    (
        '[model]\ngguf_file = "m.gguf"',
        "model.gguf_file and model.gguf_revision need model.gguf_repo",
    ),
    (
        '[model]\ngguf_revision = "main"',
        "model.gguf_file and model.gguf_revision need model.gguf_repo",
    ),
    (
        '[model]\ntokenizer_local_path = "tok.json"',
        "model.tokenizer_local_path does not exist or is not a file: /work/run/tok.json",
    ),
    ("[model]\nmax_context = 0", "invalid model.max_context=0: must be greater than 0"),
    (
        "[model]\nmax_context = -5",
        "invalid model.max_context=-5: expected an integer from 0 to 4294967295",
    ),
    (
        '[docker]\ngpus = "0;rm"',
        'invalid docker.gpus="0;rm": use "all", a count, or comma-separated device ids',
    ),
    ("[docker]\ngpus = 2", "invalid docker.gpus=2: expected a string"),
    (
        "[docker]\ncpus = 0.0",
        "invalid docker.cpus=0.0: expected a number of CPUs from 0.01 to 1024",
    ),
    ('[docker]\ncpus = "1"', 'invalid docker.cpus="1": expected a number'),
    ("[docker]\nmemory_mib = 8", "invalid docker.memory_mib=8: expected 64 to 1073741824 MiB"),
    (
        '[runtime]\nnode_memory_mib = "8GiB"',
        'invalid runtime.node_memory_mib="8GiB": expected an integer of MiB',
    ),
    (
        "[runtime]\nnode_memory_mib = []",
        "invalid runtime.node_memory_mib=an array: expected 1 to 256 figures",
    ),
    (
        "[observability]\ndatastream_frame_log = 1",
        "invalid observability.datastream_frame_log=1: expected a string",
    ),
    # [vastai] values are checked whatever the provider
    (
        '[vastai]\nimage = "bad image!"',
        'invalid vastai.image="bad image!": not an image reference ([registry/]name[:tag][@digest])',
    ),
    ("[vastai]\napi_key = 5", "invalid vastai.api_key: expected a string"),
    (
        '[vastai]\nbootstrap_command = ""',
        'invalid vastai.bootstrap_command="": must not be empty (leave the key out instead)',
    ),
    ("[vastai]\ndisk_gb = 0", "invalid vastai.disk_gb=0: must be greater than 0"),
    ("[vastai]\nssh_user = 1", "invalid vastai.ssh_user=1: expected a string"),
    (
        '[vastai]\nconfirm_lease = "yes"',
        'invalid vastai.confirm_lease="yes": expected true or false',
    ),
    ("[vastai]\nonstart = false", "invalid vastai.onstart=false: expected a string"),
    ("[vastai]\nssh_identity = 1", "invalid vastai.ssh_identity=1: expected a string"),
    ("[vastai]\ngpu_name = 4090", "invalid vastai.gpu_name=4090: expected a string"),
    (
        "[vastai]\nmin_gpu_ram_mb = -1",
        "invalid vastai.min_gpu_ram_mb=-1: expected an integer from 0 to 18446744073709551615",
    ),
    ("[vastai]\nmin_down_mbps = -1.0", "invalid vastai.min_down_mbps=-1.0: must not be negative"),
    ('[vastai]\nmin_down_mbps = "fast"', 'invalid vastai.min_down_mbps="fast": expected a number'),
    ("[vastai]\nmin_down_mbps = nan", "invalid vastai.min_down_mbps=nan: expected a finite number"),
    ("[vastai]\nmin_up_mbps = -0.5", "invalid vastai.min_up_mbps=-0.5: must not be negative"),
    (
        "[vastai]\nmin_reliability = 1.5",
        "invalid vastai.min_reliability=1.5: expected a number from 0 to 1",
    ),
    ("[vastai]\nrequire_verified = 1", "invalid vastai.require_verified=1: expected true or false"),
    (
        "[vastai]\npoll_interval_secs = 0",
        "invalid vastai.poll_interval_secs=0: must be greater than 0",
    ),
]


@pytest.mark.parametrize(("toml", "message"), INVALID_KEYS)
def test_every_key_rejects_an_invalid_value(toml, message):
    assert error_of(toml + "\n") == message


VALID_VASTAI_KEYS = [
    ('image = "ghcr.io/acme/node:2"', lambda v: v.run.image == "ghcr.io/acme/node:2"),
    ('api_key = "other-key"', lambda v: v.api_key.get_secret_value() == "other-key"),
    ('bootstrap_command = "boot --now"', lambda v: v.run.bootstrap_command == "boot --now"),
    ("disk_gb = 80", lambda v: v.run.disk_gb == 80),
    ('ssh_user = "ubuntu"', lambda v: v.run.ssh_user == "ubuntu"),
    ("confirm_lease = false", lambda v: v.api_key.get_secret_value() == SECRET),
    ('onstart = "echo preparing"', lambda v: v.run.onstart == "echo preparing"),
    ('ssh_identity = "~/.ssh/vast"', lambda v: v.ssh_identity == Path(f"{HOME}/.ssh/vast")),
    ('ssh_identity = "keys/vast"', lambda v: v.ssh_identity == Path("/work/run/keys/vast")),
    ('gpu_name = "RTX 4090"', lambda v: v.run.gpu_name == "RTX 4090"),
    ("min_gpu_ram_mb = 24000", lambda v: v.run.min_gpu_ram_mb == 24000),
    ("min_down_mbps = 250.5", lambda v: v.run.min_down_mbps == 250.5),
    ("min_down_mbps = 100", lambda v: v.run.min_down_mbps == 100.0),
    ("min_up_mbps = 50.25", lambda v: v.run.min_up_mbps == 50.25),
    ("min_reliability = 0.99", lambda v: v.run.min_reliability == 0.99),
    ("require_verified = true", lambda v: v.run.require_verified is True),
    ("poll_interval_secs = 30", lambda v: v.run.poll_interval_s == 30),
]


@pytest.mark.parametrize(("line", "check"), VALID_VASTAI_KEYS)
def test_every_vastai_key_accepts_a_valid_value(line, check):
    files = {f"{HOME}/.ssh/vast": "k", "/work/run/keys/vast": "k"}
    # a later line of the same key would be a TOML error: replace the base's line instead
    key = line.split(" = ")[0]
    base = "\n".join(ln for ln in VAST.splitlines() if not ln.startswith(f"{key} = "))
    cfg = resolve(f"{base}\n{line}\n", env=VAST_ENV, files={**VAST_FILES, **files})
    assert cfg.vastai is not None and check(cfg.vastai)


def test_vastai_defaults():
    cfg = vast()
    v = cfg.vastai
    assert v is not None
    assert v.api_key.get_secret_value() == SECRET
    assert v.ssh_identity == Path(IDENTITY)
    # the keys left out are the run's own defaults
    assert v.run == VastAiRunSettings(
        image="registry.example.com/team/mvp-node:1", bootstrap_command="/opt/mvp/node --join"
    )


def test_every_vastai_key_the_run_carries_is_a_field_of_the_runs_model():
    """The table is the run's model in TOML: each key but the host's own names a field."""
    run_keys = {
        VastAiTable.RUN_NAMES.get(k, k) for k in VastAiTable.model_fields
    } - VastAiTable.HOST_ONLY
    assert run_keys <= set(VastAiRunSettings.model_fields)
    assert VastAiTable.HOST_ONLY <= set(VastAiTable.model_fields)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        # TOML-valid values the run's model refuses: refused when the file is read, naming
        # the key as the file spells it (before, only the run request refused them)
        ('ssh_user = "Root!"', 'invalid vastai.ssh_user="Root!": must match pattern'),
        (
            "poll_interval_secs = 61",
            "invalid vastai.poll_interval_secs=61: must be less than or equal to 60",
        ),
        ("disk_gb = 20000", "invalid vastai.disk_gb=20000: must be less than or equal to 10000"),
        (
            f'gpu_name = "{"G" * 101}"',
            f'invalid vastai.gpu_name="{"G" * 101}": must have at most 100 characters',
        ),
    ],
)
def test_a_vastai_value_the_run_refuses_is_a_config_error_naming_its_key(line, message):
    assert error_of(f"{VAST}{line}\n").startswith(message)


def test_vastai_table_is_absent_unless_the_provider_is_vastai():
    assert resolve(VAST.replace('kind = "vastai"', 'kind = "process"')).vastai is None


# --------------------------------------------------------------------------- Vast.ai rules


def test_vastai_api_key_from_environment_wins():
    cfg = vast(env={"VASTAI_API_KEY": "env-key"})
    assert cfg.vastai is not None and cfg.vastai.api_key.get_secret_value() == "env-key"


def test_empty_vastai_api_key_environment_falls_back_to_the_config():
    cfg = vast(env={"VASTAI_API_KEY": "  "})
    assert cfg.vastai is not None and cfg.vastai.api_key.get_secret_value() == SECRET


def test_vastai_api_key_only_from_environment():
    toml = VAST.replace(f'api_key = "{SECRET}"\n', "")
    cfg = resolve(toml, env={**VAST_ENV, "VASTAI_API_KEY": "env-key"}, files=VAST_FILES)
    assert cfg.vastai is not None and cfg.vastai.api_key.get_secret_value() == "env-key"


def test_vastai_api_key_required():
    toml = VAST.replace(f'api_key = "{SECRET}"\n', "")
    with pytest.raises(ConfigError) as info:
        resolve(toml, env=VAST_ENV, files=VAST_FILES)
    assert (
        str(info.value)
        == "VASTAI_API_KEY or vastai.api_key is required when the provider is vastai"
    )


@pytest.mark.parametrize(
    ("env", "toml_key", "message"),
    [
        (
            {"VASTAI_API_KEY": "ab cd"},
            SECRET,
            "invalid VASTAI_API_KEY: must be one token without whitespace",
        ),
        ({}, "ab cd", "invalid vastai.api_key: must be one token without whitespace"),
    ],
)
def test_malformed_vastai_api_key_is_an_error_without_its_value(env, toml_key, message):
    toml = VAST.replace(SECRET, toml_key)
    with pytest.raises(ConfigError) as info:
        resolve(toml, env={**VAST_ENV, **env}, files=VAST_FILES)
    assert str(info.value) == message
    assert "ab cd" not in str(info.value)


def test_vastai_api_key_environment_is_not_parsed_for_other_providers():
    assert resolve(env={"VASTAI_API_KEY": "ab cd"}).provider is ProviderKind.PROCESS


def test_vastai_bootstrap_command_required():
    toml = VAST.replace('bootstrap_command = "/opt/mvp/node --join"\n', "")
    with pytest.raises(ConfigError) as info:
        resolve(toml, env=VAST_ENV, files=VAST_FILES)
    assert str(info.value) == "vastai.bootstrap_command is required when the provider is vastai"


def test_vastai_image_falls_back_to_image_node():
    toml = VAST.replace('image = "registry.example.com/team/mvp-node:1"\n', "")
    cfg = resolve(toml + '[image]\nnode = "ghcr.io/acme/node:3"\n', env=VAST_ENV, files=VAST_FILES)
    assert cfg.vastai is not None and cfg.vastai.run.image == "ghcr.io/acme/node:3"


def test_vastai_image_required():
    toml = VAST.replace('image = "registry.example.com/team/mvp-node:1"\n', "")
    with pytest.raises(ConfigError) as info:
        resolve(toml, env=VAST_ENV, files=VAST_FILES)
    assert str(info.value).startswith(
        "vastai.image (or image.node) is required when the provider is vastai"
    )


@pytest.mark.parametrize(
    "image", ["swactor-mvp-node:latest", "team/mvp-node:latest", "node@sha256:ab"]
)
def test_vastai_image_must_name_a_registry(image):
    toml = VAST.replace("registry.example.com/team/mvp-node:1", image)
    with pytest.raises(ConfigError) as info:
        resolve(toml, env=VAST_ENV, files=VAST_FILES)
    assert str(info.value).startswith(f'invalid vastai.image="{image}": a rented host pulls')


@pytest.mark.parametrize(
    "image", ["localhost:5000/team/node:1", "ghcr.io/a/b@sha256:ab", "r.example.com:5000/n"]
)
def test_vastai_registry_images(image):
    cfg = resolve(
        VAST.replace("registry.example.com/team/mvp-node:1", image), env=VAST_ENV, files=VAST_FILES
    )
    assert cfg.vastai is not None and cfg.vastai.run.image == image


def test_missing_vastai_ssh_identity():
    assert vast_error(files={}, env={"HOME": "/home/v"}) == (
        "missing VastAI SSH identity /home/v/.ssh/id_ed25519; create/register one with "
        "vastai create ssh-key or set --vastai-ssh-identity"
    )


def test_vastai_ssh_identity_needs_home_when_not_configured():
    with pytest.raises(ConfigError) as info:
        resolve(VAST, env={}, files=VAST_FILES)
    assert str(info.value) == (
        "vastai.ssh_identity or --vastai-ssh-identity is required because HOME is unset"
    )


def test_vastai_ssh_identity_tilde_needs_home():
    with pytest.raises(ConfigError) as info:
        resolve(VAST, argv=("--vastai-ssh-identity", "~/.ssh/k"), env={}, files=VAST_FILES)
    assert str(info.value) == "--vastai-ssh-identity uses ~/ but HOME is unset"


def test_vastai_ssh_identity_argument_wins_over_the_config():
    cfg = vast(
        'ssh_identity = "/keys/toml"\n',
        argv=("--vastai-ssh-identity", "/keys/arg"),
        files={"/keys/arg": "k"},
    )
    assert cfg.vastai is not None and cfg.vastai.ssh_identity == Path("/keys/arg")


def test_multi_stage_vastai_is_allowed():
    # DECISIONS 29: a deliberate deviation from process spec 9.2.
    assert vast(argv=("--pipeline-stages", "3")).pipeline_stages == 3


def test_deploy_profile_defaults_to_vastai():
    toml = VAST.replace('[provider]\nkind = "vastai"\n', '[runtime]\nprofile = "deploy"\n')
    cfg = resolve(toml, env=VAST_ENV, files=VAST_FILES)
    assert cfg.config_profile is RuntimeProfile.DEPLOY and cfg.provider is ProviderKind.VASTAI


@pytest.mark.parametrize("key", ["gguf_local_path", "tokenizer_local_path"])
def test_host_local_model_files_are_refused_for_vastai(key):
    message = vast_error(f'[model]\n{key} = "/m/file"\n', files={"/m/file": "x"})
    assert message == (
        f"model.{key} names a file on this host; only the process and docker providers can "
        "use one (a rented host cannot see it)"
    )


def test_secrets_never_show():
    cfg = vast(env={"HF_TOKEN": "hf_secret_token"})
    assert cfg.hf_token is not None and cfg.hf_token.get_secret_value() == "hf_secret_token"
    shown = repr(cfg) + str(cfg) + cfg.model_dump_json()
    assert SECRET not in shown and "hf_secret_token" not in shown


# --------------------------------------------------------------------------- keys that would do nothing

NO_RELAY = (
    "this implementation has no relay: nodes reach each other directly (the data plane's "
    "TCP) and the run through Temporal"
)


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        # Defect 12: these spec keys were accepted, kept in HostConfig and used by nothing.
        (
            '[model]\nid = "smollm2-135m"',
            "model.id is not supported: a run names its model by its source "
            "(model.gguf_local_path, or model.gguf_repo with model.gguf_file; neither: the "
            f"bundled {DEFAULT_BUNDLED_MODEL}); leave it out",
        ),
        (
            '[relay]\nmode = "default"',
            f'relay.mode "default" is not supported: {NO_RELAY}; set relay.mode = "disabled" '
            "or leave [relay] out",
        ),
        (
            '[relay]\nurl = "https://relay.example.com"',
            f"relay.url is not supported: {NO_RELAY}; leave it out",
        ),
        (
            '[relay]\nmode = "default"\nurl = "https://relay.example.com"',
            f"relay.url is not supported: {NO_RELAY}; leave it out",
        ),
        (
            "[vastai]\nconfirm_lease = true",
            "vastai.confirm_lease = true is not supported: a Vast.ai run rents its instances "
            "without asking (the run's provisioning budget bounds it); leave it out or set "
            "false",
        ),
    ],
)
def test_spec_keys_that_would_do_nothing_are_refused(toml, message):
    assert error_of(toml + "\n") == message


def test_confirm_lease_is_refused_for_a_vastai_run_too():
    assert vast_error("confirm_lease = true\n").startswith("vastai.confirm_lease = true is not")


def test_what_the_implementation_does_is_accepted():
    cfg = resolve('[relay]\nmode = "disabled"\n[vastai]\nconfirm_lease = false\n')
    assert cfg.relay.mode is RelayMode.DISABLED


# --------------------------------------------------------------------------- tokenizer file


@pytest.mark.parametrize("provider", ["process", "docker"])
@pytest.mark.parametrize("content", ["", "{}", '{"model": {"type": "BPE"}}', "GGU"])
def test_a_tokenizer_that_is_not_a_gguf_fails_at_configuration(provider, content):
    # Defect 12: a tokenizer.json was accepted here and failed at stage provisioning.
    toml = f'[provider]\nkind = "{provider}"\n[model]\ntokenizer_local_path = "tok.json"\n'
    assert error_of(toml, files={"/work/run/tok.json": content}) == (
        "model.tokenizer_local_path is not a GGUF file: /work/run/tok.json (a node reads the "
        "tokenizer from a GGUF's metadata; name a .gguf file, or leave the key out to use "
        "the model's own)"
    )


def test_an_unreadable_tokenizer_fails_at_configuration():
    toml = '[model]\ntokenizer_local_path = "/t/tok.gguf"\n'
    files = MemoryFiles({str(DEFAULT_TOML): toml}, unreadable=("/t/tok.gguf",))
    with pytest.raises(ConfigError) as info:
        resolve_config([], {}, CWD, files)
    assert str(info.value) == (
        "read model.tokenizer_local_path /t/tok.gguf: [Errno 13] Permission denied: '/t/tok.gguf'"
    )


# --------------------------------------------------------------------------- Vast.ai environment


@pytest.mark.parametrize("value", ["soon", "0", "-3", "nan"])
def test_a_bad_vastai_destroy_deadline_fails_at_configuration(value):
    assert vast_error(env={"MVP_VASTAI_DESTROY_DEADLINE_S": value}) == (
        f"invalid MVP_VASTAI_DESTROY_DEADLINE_S={value!r}: expected seconds, a number "
        "greater than 0"
    )


def test_vastai_operational_variables_are_accepted():
    cfg = vast(
        env={
            "MVP_VASTAI_DESTROY_DEADLINE_S": "30",
            "MVP_VASTAI_SERVER_URL": "http://127.0.0.1:9/",
            "MVP_VASTAI_TEMPORAL_ADDRESS": "temporal.example.com:7233",
        }
    )
    assert cfg.vastai is not None


# --------------------------------------------------------------------------- arguments


def test_every_argument_is_accepted_in_both_forms():
    files = {"/work/run/h.toml": "", "/work/run/k": "k"}
    for form in ("space", "equals"):

        def arg(name: str, value: str) -> tuple[str, ...]:
            return (name, value) if form == "space" else (f"{name}={value}",)  # noqa: B023

        argv = (
            *arg("--runtime-config", "h.toml"),
            *arg("--provider", "process"),
            *arg("--pipeline-stages", "4"),
            *arg("--vastai-ssh-identity", "k"),
        )
        cfg = resolve(argv=argv, files=files)
        assert cfg.config_path == Path("/work/run/h.toml")
        assert cfg.provider is ProviderKind.PROCESS
        assert cfg.pipeline_stages == 4


def test_the_arguments_are_the_five_of_the_spec():
    assert ARGUMENTS[:5] == (
        "--runtime-config",
        "--provider",
        "--worker-bin",
        "--pipeline-stages",
        "--vastai-ssh-identity",
    )
    assert ARGUMENTS[5:] == ("--dashboard",)  # ours (DECISIONS 92)


def test_the_dashboard_listens_on_loopback_only():
    assert resolve(argv=["--dashboard", "8080"]).dashboard == SocketAddress(
        host="127.0.0.1", port=8080
    )
    assert str(resolve(argv=["--dashboard=[::1]:0"]).dashboard) == "[::1]:0"
    with pytest.raises(ConfigError, match="loopback only"):
        resolve(argv=["--dashboard", "0.0.0.0:8080"])
    with pytest.raises(ConfigError, match="invalid --dashboard"):
        resolve(argv=["--dashboard", "example.org:80"])


@pytest.mark.parametrize(
    "arg", ["--foo", "--foo=bar", "positional", "-h", "--help", "--", "--provider-x", "--run-id"]
)
def test_unknown_arguments(arg):
    assert error_of(argv=(arg, "1")) == f'unknown argument "{arg}"'


@pytest.mark.parametrize("name", ARGUMENTS)
@pytest.mark.parametrize("shape", ["end", "equals", "flag-next", "empty"])
def test_missing_argument_values(name, shape):
    argv = {
        "end": (name,),
        "equals": (f"{name}=",),
        "flag-next": (name, "--provider", "process"),
        "empty": (name, ""),
    }[shape]
    assert error_of(argv=argv) == f"missing value after {name}"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--provider", "mock"), 'unsupported provider "mock"; use process, docker, or vastai'),
        (("--provider=vast-ai",), 'unsupported provider "vast-ai"; use process, docker, or vastai'),
        (("--pipeline-stages", "0"), "--pipeline-stages must be greater than 0"),
        (
            ("--pipeline-stages", "many"),
            'invalid --pipeline-stages="many": invalid digit found in string',
        ),
        (
            ("--pipeline-stages=-1",),
            'invalid --pipeline-stages="-1": invalid digit found in string',
        ),
        (
            ("--pipeline-stages", "99999999999"),
            'invalid --pipeline-stages="99999999999": number too large to fit in target type',
        ),
    ],
)
def test_invalid_argument_values(argv, message):
    assert error_of(argv=argv) == message


def test_pipeline_stages_plus_sign_parses_like_rust():
    assert resolve(argv=("--pipeline-stages", "+2")).pipeline_stages == 2


def test_a_repeated_argument_keeps_its_last_value():
    assert resolve(argv=("--pipeline-stages", "2", "--pipeline-stages=5")).pipeline_stages == 5


def test_a_value_starting_with_dashes_needs_the_equals_form():
    cfg = resolve(argv=("--runtime-config=--odd",), files={"/work/run/--odd": ""})
    assert cfg.config_path == Path("/work/run/--odd")


WORKER_BIN_REFUSED = (
    "--worker-bin is not supported: a process node runs this installation's node agent "
    "(python -m workers.node, with the host's Python); leave it out"
)


@pytest.mark.parametrize("provider", ["process", "docker"])
@pytest.mark.parametrize("form", ["space", "equals"])
def test_worker_bin_is_refused_not_checked_and_ignored(provider, form):
    # Defect 9: it was checked against the file system, then ignored (nodes run
    # python -m workers.node). An existing file is refused as well as a missing one.
    files = {"/work/run/bin/node": "x"}
    arg = ("--worker-bin", "bin/node") if form == "space" else ("--worker-bin=bin/node",)
    assert error_of(argv=("--provider", provider, *arg), files=files) == WORKER_BIN_REFUSED
    assert error_of(argv=("--provider", provider, "--worker-bin", "/opt/none")) == (
        WORKER_BIN_REFUSED
    )


def test_arguments_are_checked_before_the_config_file_is_read():
    files = MemoryFiles({str(DEFAULT_TOML): "[runtime\n"})
    with pytest.raises(ConfigError, match='unknown argument "--bogus"'):
        resolve_config(["--bogus"], {}, CWD, files)
    assert files.reads == []


# --------------------------------------------------------------------------- precedence


def test_arguments_override_the_config_file():
    toml = '[provider]\nkind = "docker"\n[runtime]\npipeline_stages = 2\n'
    cfg = resolve(toml)
    assert (cfg.provider, cfg.pipeline_stages) == (ProviderKind.DOCKER, 2)
    cfg = resolve(toml, argv=("--provider", "process", "--pipeline-stages", "3"))
    assert (cfg.provider, cfg.pipeline_stages) == (ProviderKind.PROCESS, 3)


def test_provider_argument_overrides_the_profile_default():
    cfg = resolve('[runtime]\nprofile = "deploy"\n', argv=("--provider=docker",))
    assert cfg.config_profile is RuntimeProfile.DEPLOY and cfg.provider is ProviderKind.DOCKER


def test_a_bad_config_value_is_an_error_even_when_an_argument_overrides_it():
    toml = '[provider]\nkind = "mock"\n'
    assert error_of(toml, argv=("--provider", "process")) == (
        'unsupported provider "mock"; use process, docker, or vastai'
    )
    assert error_of("[runtime]\npipeline_stages = 0\n", argv=("--pipeline-stages", "2")) == (
        "--pipeline-stages must be greater than 0"
    )


def test_environment_overrides_the_config_file_for_secrets_only():
    # VASTAI_API_KEY over [vastai].api_key (above); other variables configure nothing
    cfg = resolve("[runtime]\nrun_id = 3\n", env={"RUN_ID": "9", "PATH": "/bin"})
    assert cfg.run_id == 3


# --------------------------------------------------------------------------- environment


@pytest.mark.parametrize(
    "name",
    [
        "MVP_PIPELINE_STAGES",
        "MVP_RUNTIME_CONFIG",
        "MVP_NODE_PROVIDER",
        "MVP_FAULT_MUTE",
        "MVP_RUN_ID",
    ],
)
def test_unsupported_mvp_variables_are_rejected(name):
    assert error_of(env={name: "topsecretvalue"}) == (
        f"unsupported environment variable {name}; the process host is configured through "
        "its TOML config and arguments (docs/host.md)"
    )


def test_several_unsupported_variables_are_named_in_order():
    message = error_of(env={"MVP_B": "1", "MVP_A": "2"})
    assert message.startswith("unsupported environment variables MVP_A, MVP_B;")


@pytest.mark.parametrize(
    "name", [*sorted(HOST_OPERATIONAL_ENV), "MVP_TEST_FAULTS_FILE", "MVP_TEST_CRASH_AFTER_LAUNCH"]
)
def test_operational_mvp_variables_are_allowed(name):
    assert resolve(env={name: "1"}).provider is ProviderKind.PROCESS


def test_hf_token_is_kept_as_a_secret():
    assert resolve(env={"HF_TOKEN": " "}).hf_token is None
    token = resolve(env={"HF_TOKEN": "hf_x"}).hf_token
    assert token is not None and token.get_secret_value() == "hf_x"


# --------------------------------------------------------------------------- run request


def test_run_request_of_the_defaults():
    request = to_run_request(resolve())
    validate_request(request)
    assert request.provider is ProviderKind.PROCESS
    assert request.model == ModelSource(bundled=DEFAULT_BUNDLED_MODEL)
    assert request.tokenizer is None
    assert request.worker_image is None and request.docker.gpus is None
    assert (request.run_id, request.node_id, request.pipeline_stages) == (1, 1, 1)
    assert request.default_max_tokens == 64 and request.max_context is None


def test_bundled_default_is_the_model_store_default():
    assert DEFAULT_BUNDLED_MODEL == DEFAULT_BUNDLED


def test_run_request_carries_the_configured_values():
    toml = """
[runtime]
run_id = 42
node_id = 7
pipeline_stages = 2
on_node_loss = "replace"
[model]
gguf_local_path = "m.gguf"
tokenizer_local_path = "/t/tokenizer.gguf"
max_context = 256
"""
    cfg = resolve(toml, files={"/work/run/m.gguf": "x", "/t/tokenizer.gguf": "GGUF"})
    request = to_run_request(cfg)
    assert (request.run_id, request.node_id, request.pipeline_stages) == (42, 7, 2)
    assert request.model == ModelSource(path="/work/run/m.gguf")
    assert request.tokenizer == ModelSource(path="/t/tokenizer.gguf")
    assert request.max_context == 256
    assert request.on_node_loss.value == "replace"


@pytest.mark.parametrize(
    ("toml", "image", "gpus"),
    [
        ('[provider]\nkind = "docker"\n', None, None),
        (
            '[provider]\nkind = "docker"\n[image]\nnode = "acme/node:1"\n[docker]\ngpus = "all"\n',
            "acme/node:1",
            "all",
        ),
        ('[provider]\nkind = "docker"\n[docker]\ngpus = ""\n', None, None),
        # the process provider has no image and no GPUs
        ('[image]\nnode = "acme/node:1"\n[docker]\ngpus = "0"\n', None, None),
    ],
)
def test_run_request_image_and_gpus_only_when_configured(toml, image, gpus):
    request = to_run_request(resolve(toml))
    assert request.worker_image == image and request.docker.gpus == gpus


def test_run_request_memory_from_the_config():
    docker = to_run_request(resolve('[provider]\nkind = "docker"\n[docker]\nmemory_mib = 1024\n'))
    assert docker.docker.memory == 1 << 30
    assert to_run_request(resolve("[docker]\nmemory_mib = 1024\n")).docker.memory is None
    nodes = to_run_request(resolve("[runtime]\nnode_memory_mib = [4096, 2048]\n"))
    assert nodes.node_memory == [4 << 30, 2 << 30]


def test_run_request_cpus_only_for_the_docker_provider():
    docker = to_run_request(resolve('[provider]\nkind = "docker"\n[docker]\ncpus = 1.5\n'))
    assert docker.docker.cpus == 1.5
    assert to_run_request(resolve("[docker]\ncpus = 1\n")).docker.cpus is None


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[runtime]\nstage_index = 1\n", "runtime.stage_index: a run plans its stages itself"),
        ("[runtime]\nlayer_end_exclusive = 12\n", "runtime.layer_end_exclusive is not supported"),
        (
            "[prompt]\nmax_active_prompts = 65\n",
            "invalid run request: max_active_prompts: Input should be less than or equal to 64",
        ),
    ],
)
def test_run_request_refuses_what_a_run_cannot_honour(toml, message):
    with pytest.raises(ConfigError) as info:
        to_run_request(resolve(toml))
    assert str(info.value).startswith(message)


def test_run_request_carries_max_active_prompts():
    assert to_run_request(resolve()).max_active_prompts == 1
    assert to_run_request(resolve("[prompt]\nmax_active_prompts = 8\n")).max_active_prompts == 8


def test_run_request_for_vastai_carries_the_settings_and_no_secret():
    cfg = vast()
    request = to_run_request(cfg)
    assert request.provider is ProviderKind.VASTAI and request.worker_image is None
    assert cfg.vastai is not None
    assert request.vastai == cfg.vastai.run
    key = cfg.vastai.api_key.get_secret_value()
    assert key not in request.model_dump_json()
    env = vast_worker_env(cfg)
    assert env == {"VASTAI_API_KEY": key, "MVP_VASTAI_SSH_IDENTITY": str(cfg.vastai.ssh_identity)}
    assert vast_worker_env(resolve()) == {}
