"""Connecting to Temporal: one place for the connection settings and the data converter.

Every process of the project connects through :func:`connect`. The settings are the
SDK's own environment configuration (``temporalio.envconfig``): a profile of a TOML file
(``TEMPORAL_CONFIG_FILE``, else ``~/.config/temporalio/temporal.toml``; profile
``TEMPORAL_PROFILE``, else ``default``) overridden by ``TEMPORAL_ADDRESS``,
``TEMPORAL_NAMESPACE``, ``TEMPORAL_API_KEY``, ``TEMPORAL_TLS*`` and
``TEMPORAL_GRPC_META_*``, exactly as the ``temporal`` CLI and the other SDKs read them
(docs/temporal-connection.md). Nothing of it is a workflow input: a node gets the
settings of the orchestrator worker that started it in its environment
(:meth:`TemporalSettings.node_env`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import DataConverter, DefaultFailureConverterWithEncodedAttributes
from temporalio.envconfig import ClientConfigProfile, ClientConfigTLS, DataSource
from temporalio.service import RPCError, RPCStatusCode, TLSConfig

from temporal import core_log, telemetry
from temporal.codec import EncryptionCodec, codec_from_env

DEFAULT_ADDRESS = "localhost:7233"
DEFAULT_NAMESPACE = "default"
STARTUP_GRACE_S = 30.0

# The variables temporalio.envconfig reads (besides TEMPORAL_GRPC_META_<NAME>): what a
# process hands on, or takes away, to choose how a child connects.
CONFIG_FILE_ENV = "TEMPORAL_CONFIG_FILE"
PROFILE_ENV = "TEMPORAL_PROFILE"
API_KEY_ENV = "TEMPORAL_API_KEY"
TLS_ENV = "TEMPORAL_TLS"
GRPC_META_PREFIX = "TEMPORAL_GRPC_META_"
CONNECTION_ENV = (
    CONFIG_FILE_ENV,
    PROFILE_ENV,
    "TEMPORAL_ADDRESS",
    "TEMPORAL_NAMESPACE",
    API_KEY_ENV,
    TLS_ENV,
    "TEMPORAL_TLS_SERVER_NAME",
    "TEMPORAL_TLS_SERVER_CA_CERT_PATH",
    "TEMPORAL_TLS_SERVER_CA_CERT_DATA",
    "TEMPORAL_TLS_CLIENT_CERT_PATH",
    "TEMPORAL_TLS_CLIENT_CERT_DATA",
    "TEMPORAL_TLS_CLIENT_KEY_PATH",
    "TEMPORAL_TLS_CLIENT_KEY_DATA",
    "TEMPORAL_TLS_DISABLE_HOST_VERIFICATION",
)
# The bridge takes "true"/"1" and "false"/"0" (any case) and reads every other value,
# "no" and "off" included, as TLS on: anything else is refused here instead.
_TLS_VALUES = {"true": True, "1": True, "false": False, "0": False}
# (what it is, its variables' infix: TEMPORAL_TLS_<infix>_PATH / _DATA, ClientConfigTLS field)
_TLS_FILES = (
    ("server CA certificate", "SERVER_CA_CERT", "server_root_ca_cert"),
    ("client certificate", "CLIENT_CERT", "client_cert"),
    ("client key", "CLIENT_KEY", "client_private_key"),
)


class TemporalConnectError(RuntimeError):
    """Temporal could not be reached with the configured settings. The message is one
    line naming where, how (never a credential) and why."""


class TemporalConfigError(TemporalConnectError):
    """The connection settings themselves are wrong (a profile that is not there, a
    TOML error, a certificate file that cannot be read)."""


def _is_connection_env(name: str) -> bool:
    return name in CONNECTION_ENV or name.startswith(GRPC_META_PREFIX)


def without_connection_env(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without any of envconfig's variables."""
    return {k: v for k, v in environ.items() if not _is_connection_env(k)}


def local_server_env(address: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a child process (an orchestrator worker) that is to use a local
    dev server this process started: plaintext, namespace default, whatever TLS, API key
    or profile this process's own environment names (no configuration file is read)."""
    env = without_connection_env(os.environ if environ is None else environ)
    env.update({"TEMPORAL_ADDRESS": address, CONFIG_FILE_ENV: os.devnull})
    return env


def _first_line(text: str, limit: int = 300) -> str:
    line = next((s.strip() for s in text.splitlines() if s.strip()), "")
    return line[:limit]


@dataclass(frozen=True)
class TemporalSettings:
    """Where and how to connect. ``describe()`` says it without credentials; ``repr``
    leaves them out too."""

    address: str = DEFAULT_ADDRESS
    namespace: str = DEFAULT_NAMESPACE
    api_key: str | None = field(default=None, repr=False)
    tls_enabled: bool = False
    tls: ClientConfigTLS | None = field(default=None, repr=False)
    rpc_metadata: Mapping[str, str] = field(default_factory=dict, repr=False)
    # Whether an address was configured at all (environment or profile), not defaulted.
    address_configured: bool = False

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(
        cls, environ: Mapping[str, str] | None = None, *, config_file: bool = True
    ) -> TemporalSettings:
        """The settings envconfig gives for ``environ`` (this process's environment by
        default): the profile's file unless ``config_file`` is false (a node: its
        environment is all it gets), then the environment over it."""
        env = dict(os.environ if environ is None else environ)
        secrets = _secret_values(env)
        tls_value = env.get(TLS_ENV)
        if tls_value is not None and tls_value.strip().lower() not in _TLS_VALUES:
            raise TemporalConfigError(
                f"Temporal client configuration: {TLS_ENV} must be true or false, not {tls_value!r}"
            )
        named = env.get(CONFIG_FILE_ENV)
        if config_file and named and not Path(named).exists():
            raise TemporalConfigError(
                f"Temporal client configuration: {CONFIG_FILE_ENV} names {named}, "
                "which does not exist"
            )
        try:
            profile = ClientConfigProfile.load(disable_file=not config_file, override_env_vars=env)
        except RuntimeError as err:  # the bridge's ConfigError
            why = _scrub(_first_line(str(err)), secrets)
            where = (
                f" ({CONFIG_FILE_ENV}={named})"
                if named and config_file and named != os.devnull
                else ""
            )
            raise TemporalConfigError(f"Temporal client configuration{where}: {why}") from None
        return cls.from_profile(profile)

    @classmethod
    def from_profile(cls, profile: ClientConfigProfile) -> TemporalSettings:
        # The SDK's rule (ClientConfigProfile.to_client_connect_config), without reading
        # certificate files yet: an API key turns TLS on, a TLS section decides.
        if profile.tls is not None:
            tls_enabled = profile.tls.disabled is not True
        else:
            tls_enabled = bool(profile.api_key)
        return cls(
            address=profile.address or DEFAULT_ADDRESS,
            namespace=profile.namespace or DEFAULT_NAMESPACE,
            api_key=profile.api_key or None,
            tls_enabled=tls_enabled,
            tls=profile.tls,
            rpc_metadata=dict(profile.grpc_meta),
            address_configured=bool(profile.address),
        )

    @classmethod
    def local(cls, address: str) -> TemporalSettings:
        """A dev server this process started: plaintext, namespace default."""
        return cls(address=address, address_configured=True)

    def override(
        self, address: str | None = None, namespace: str | None = None
    ) -> TemporalSettings:
        """These settings with an explicit address or namespace (which win)."""
        changes: dict[str, object] = {}
        if address:
            changes.update(address=address, address_configured=True)
        if namespace:
            changes["namespace"] = namespace
        return dataclasses.replace(self, **changes) if changes else self  # type: ignore[arg-type]

    # ------------------------------------------------------------------ using
    def describe(self) -> str:
        """One line for logs and errors: never a key, a token or certificate data."""
        parts = [self.address, f"namespace {self.namespace}"]
        if self.tls_enabled:
            tls = self.tls or ClientConfigTLS()
            details = []
            if isinstance(tls.server_root_ca_cert, Path):
                details.append(f"CA {tls.server_root_ca_cert}")
            elif tls.server_root_ca_cert is not None:
                details.append("CA inline")
            if tls.server_name:
                details.append(f"server name {tls.server_name}")
            if tls.client_cert is not None:
                details.append("client certificate")
            parts.append(f"TLS ({', '.join(details)})" if details else "TLS")
        if self.api_key:
            parts.append("API key")
        if self.rpc_metadata:
            parts.append(f"gRPC metadata {', '.join(sorted(self.rpc_metadata))}")
        return ", ".join(parts)

    def secrets(self) -> list[str]:
        """The values no message may show."""
        found = [self.api_key or "", *self.rpc_metadata.values()]
        key = self.tls.client_private_key if self.tls else None
        if isinstance(key, (str, bytes)):
            found.append(key if isinstance(key, str) else key.decode(errors="replace"))
        return [s for s in found if len(s) >= 4]

    def tls_config(self) -> bool | TLSConfig:
        """What Client.connect takes as ``tls``, certificate files read now."""
        if not self.tls_enabled:
            return False
        tls = self.tls or ClientConfigTLS()
        values: dict[str, bytes | None] = {}
        for what, _var, attr in _TLS_FILES:
            values[attr] = _read(what, getattr(tls, attr))
        if (values["client_cert"] is None) != (values["client_private_key"] is None):
            raise TemporalConfigError(
                "Temporal client configuration: a TLS client certificate and its key go "
                "together; one of them is missing"
            )
        return TLSConfig(
            domain=tls.server_name,
            server_root_ca_cert=values["server_root_ca_cert"],
            client_cert=values["client_cert"],
            client_private_key=values["client_private_key"],
        )

    def node_env(self, address: str | None = None, *, inline_files: bool = False) -> dict[str, str]:
        """The environment variables that make a node connect the way these settings
        do, through ``address`` when it reaches Temporal elsewhere (a container's
        gateway, a tunnel's end): address, namespace, TLS (file paths as they are, or
        their contents with ``inline_files``, for a node that cannot see this host's
        files), the API key and gRPC metadata (secrets: environment only). A node reads
        its environment and no configuration file."""
        env = {"TEMPORAL_ADDRESS": address or self.address, "TEMPORAL_NAMESPACE": self.namespace}
        env[TLS_ENV] = "true" if self.tls_enabled else "false"
        if self.api_key:
            env[API_KEY_ENV] = self.api_key
        for name, value in self.rpc_metadata.items():
            env[GRPC_META_PREFIX + re.sub(r"[^A-Za-z0-9]", "_", name).upper()] = value
        if not self.tls_enabled:
            return env
        tls = self.tls or ClientConfigTLS()
        server_name = tls.server_name
        if not server_name and address and address != self.address:
            # Reached at another address: the certificate still names the original host.
            server_name = _host_of(self.address)
        if server_name:
            env["TEMPORAL_TLS_SERVER_NAME"] = server_name
        for what, var, attr in _TLS_FILES:
            source: DataSource | None = getattr(tls, attr)
            if source is None:
                continue
            if isinstance(source, Path) and not inline_files:
                env[f"TEMPORAL_TLS_{var}_PATH"] = str(source)
            else:
                data = _read(what, source) or b""
                env[f"TEMPORAL_TLS_{var}_DATA"] = data.decode()
        return env


def _host_of(address: str) -> str:
    host = address.rpartition(":")[0] if ":" in address else address
    return host.strip("[]")


def _read(what: str, source: DataSource | None) -> bytes | None:
    if source is None:
        return None
    if isinstance(source, Path):
        try:
            return source.read_bytes()
        except OSError as err:
            raise TemporalConfigError(
                f"Temporal client configuration: cannot read the TLS {what} {source}: "
                f"{err.strerror or err}"
            ) from None
    return source.encode() if isinstance(source, str) else source


def _secret_values(env: Mapping[str, str]) -> list[str]:
    names = (API_KEY_ENV, "TEMPORAL_TLS_CLIENT_KEY_DATA")
    found = [env.get(n, "") for n in names]
    found += [v for k, v in env.items() if k.startswith(GRPC_META_PREFIX)]
    return [s for s in found if len(s) >= 4]


def _scrub(text: str, secrets: list[str]) -> str:
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, "[redacted]")
    return text


def explain_connect_failure(settings: TemporalSettings, err: BaseException) -> str:
    """The SDK's connection error as one line: where, how, and the cause in words."""
    raw = str(err)
    if "Unauthenticated" in raw or "PermissionDenied" in raw:
        message = re.search(r'message: "([^"]*)"', raw)
        detail = f" ({message.group(1)})" if message and message.group(1) else ""
        why = (
            "the server refused the API key" if settings.api_key else "the server wants credentials"
        ) + detail
        if "PermissionDenied" in raw:
            why = f"permission denied{detail}"
    elif "UnknownIssuer" in raw or "BadSignature" in raw:
        why = (
            "the server's TLS certificate is not signed by a trusted CA; set "
            "TEMPORAL_TLS_SERVER_CA_CERT_PATH to the CA that signed it"
        )
    elif "NotValidForName" in raw:
        why = (
            "the server's TLS certificate is not valid for the name connected to; set "
            "TEMPORAL_TLS_SERVER_NAME to a name it carries"
        )
    elif "Expired" in raw and "InvalidCertificate" in raw:
        why = "the server's TLS certificate has expired"
    elif "InvalidCertificate" in raw:
        why = f"the server's TLS certificate was refused: {_first_line(raw)}"
    elif "InvalidContentType" in raw or "CorruptMessage" in raw:
        why = "the TLS handshake failed: the server does not speak TLS there (TEMPORAL_TLS=false?)"
    elif "ConnectionRefused" in raw:
        why = "connection refused (nothing listens there)"
    elif "dns error" in raw:
        why = "the host name does not resolve"
    elif not settings.tls_enabled and ("connection closed" in raw or "Cancelled" in raw):
        why = "the server closed the connection: does it want TLS (TEMPORAL_TLS=true)?"
    else:
        why = _first_line(raw.removeprefix("Failed client connect: "))
    text = f"cannot connect to Temporal at {settings.describe()}: {why}"
    return _scrub(text, settings.secrets())


def temporal_settings() -> TemporalSettings:
    """This process's settings (environment and profile)."""
    return TemporalSettings.load()


def temporal_address() -> str:
    return temporal_settings().address


def temporal_namespace() -> str:
    return temporal_settings().namespace


def encrypted_data_converter(codec: EncryptionCodec) -> DataConverter:
    """Pydantic on the wire, every payload encrypted, and failure messages and stack
    traces moved into an encrypted payload too: they can quote user input (a pydantic
    validation error echoes the value it rejected)."""
    return dataclasses.replace(
        pydantic_data_converter,
        payload_codec=codec,
        failure_converter_class=DefaultFailureConverterWithEncodedAttributes,
    )


def default_data_converter(
    environ: Mapping[str, str] | None = None, *, lenient: bool = False
) -> DataConverter:
    """Encrypted when ``MVP_PAYLOAD_KEY`` is set (a bad key fails here, at startup).
    ``lenient``: for workflow workers, a payload the key cannot open reaches the
    workflow as undecodable instead of failing its every task (temporal/codec.py)."""
    codec = codec_from_env(environ, lenient=lenient)
    return pydantic_data_converter if codec is None else encrypted_data_converter(codec)


async def connect(
    address: str | None = None,
    namespace: str | None = None,
    identity: str | None = None,
    *,
    data_converter: DataConverter | None = None,
    settings: TemporalSettings | None = None,
) -> Client:
    """A client on ``settings`` (by default this process's envconfig settings), an
    explicit ``address`` or ``namespace`` winning, that speaks pydantic models on the
    wire, encrypted when a key is set. A server that is up but not yet healthy gets
    STARTUP_GRACE_S; any other failure raises :class:`TemporalConnectError` at once."""
    chosen = (settings or TemporalSettings.load()).override(address, namespace)
    tls = chosen.tls_config()
    kwargs: dict[str, Any] = {"identity": identity} if identity else {}
    tel = telemetry.current()  # off: no interceptor, the default runtime
    if tel.tracing:
        kwargs["plugins"] = tel.client_plugins()
    if tel.runtime is not None:
        kwargs["runtime"] = tel.runtime
        await tel.start_exporter()
    else:
        kwargs["runtime"] = core_log.runtime()  # the core's warnings, without bursts
    converter = data_converter or default_data_converter()
    deadline = time.monotonic() + STARTUP_GRACE_S
    while True:
        try:
            return await Client.connect(
                chosen.address,
                namespace=chosen.namespace,
                api_key=chosen.api_key,
                tls=tls,
                rpc_metadata=dict(chosen.rpc_metadata),
                data_converter=converter,
                **kwargs,
            )
        except RuntimeError as err:
            # A server that has just started accepts connections before it is healthy.
            if "not healthy" in str(err) and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
                continue
            raise TemporalConnectError(explain_connect_failure(chosen, err)) from None


async def check_namespace(client: Client, settings: TemporalSettings) -> None:
    """Fail at startup, in one line, when the namespace does not exist or the server
    refuses the credentials for it (a worker would otherwise fail in its pollers)."""
    try:
        await client.workflow_service.describe_namespace(
            DescribeNamespaceRequest(namespace=client.namespace)
        )
    except RPCError as err:
        where = f"cannot use Temporal at {settings.describe()}"
        if err.status == RPCStatusCode.NOT_FOUND:
            raise TemporalConnectError(
                f"{where}: namespace {client.namespace} does not exist there"
            ) from None
        if err.status in (RPCStatusCode.UNAUTHENTICATED, RPCStatusCode.PERMISSION_DENIED):
            why = _scrub(_first_line(err.message), settings.secrets())
            raise TemporalConnectError(
                f"{where}: the server refused access to namespace {client.namespace} ({why})"
            ) from None
        # Anything else (a transient error): the workers' own start says more.
