"""The Temporal connection settings (temporal/connect.py, docs/temporal-connection.md):
envconfig's variables and profiles, what a node gets, and errors that name their cause
without a credential. No server: tests/integration/test_tls.py runs a whole run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from activities.providers.base import node_environment
from mvp_core.models import NodeProvisionSpec
from temporal.connect import (
    CONFIG_FILE_ENV,
    TemporalConfigError,
    TemporalSettings,
    explain_connect_failure,
    local_server_env,
    without_connection_env,
)

pytestmark = pytest.mark.quick

KEY = "tmprl-test-key-0a1b2c3d4e5f"
CA_PEM = "-----BEGIN CERTIFICATE-----\nMIIBfake\n-----END CERTIFICATE-----\n"


def _env(**extra: str) -> dict[str, str]:
    return {CONFIG_FILE_ENV: os.devnull, **extra}


def test_defaults_without_any_setting():
    s = TemporalSettings.load(_env())
    assert (s.address, s.namespace, s.api_key, s.tls_enabled) == (
        "localhost:7233",
        "default",
        None,
        False,
    )
    assert not s.address_configured
    assert s.tls_config() is False


def test_environment_variables_and_no_credential_in_repr_or_describe(tmp_path: Path):
    ca = tmp_path / "ca.pem"
    ca.write_text(CA_PEM)
    s = TemporalSettings.load(
        _env(
            TEMPORAL_ADDRESS="temporal.example:7233",
            TEMPORAL_NAMESPACE="prod",
            TEMPORAL_API_KEY=KEY,
            TEMPORAL_TLS_SERVER_CA_CERT_PATH=str(ca),
            TEMPORAL_TLS_SERVER_NAME="temporal.example",
            TEMPORAL_GRPC_META_X_TENANT="blue-team-token",
        )
    )
    assert (s.address, s.namespace, s.api_key) == ("temporal.example:7233", "prod", KEY)
    assert s.tls_enabled and s.address_configured
    assert s.rpc_metadata == {"x-tenant": "blue-team-token"}
    tls = s.tls_config()
    assert not isinstance(tls, bool)
    assert tls.server_root_ca_cert == CA_PEM.encode() and tls.domain == "temporal.example"
    for text in (repr(s), s.describe()):
        assert KEY not in text and "blue-team-token" not in text
    assert s.describe() == (
        f"temporal.example:7233, namespace prod, TLS (CA {ca}, server name temporal.example), "
        "API key, gRPC metadata x-tenant"
    )


def test_an_api_key_turns_tls_on_unless_tls_is_switched_off():
    assert TemporalSettings.load(_env(TEMPORAL_API_KEY=KEY)).tls_enabled
    off = TemporalSettings.load(_env(TEMPORAL_API_KEY=KEY, TEMPORAL_TLS="false"))
    assert not off.tls_enabled and off.tls_config() is False
    assert TemporalSettings.load(_env(TEMPORAL_TLS="TRUE")).tls_enabled


def test_a_profile_of_a_toml_file_with_the_environment_over_it(tmp_path: Path):
    config = tmp_path / "temporal.toml"
    config.write_text(
        '[profile.default]\naddress = "dev:7233"\n\n'
        '[profile.cloud]\naddress = "ns.acct.tmprl.cloud:7233"\nnamespace = "ns.acct"\n'
        f'api_key = "{KEY}"\n'
    )
    default = TemporalSettings.load({CONFIG_FILE_ENV: str(config)})
    assert default.address == "dev:7233" and not default.tls_enabled
    cloud = TemporalSettings.load(
        {CONFIG_FILE_ENV: str(config), "TEMPORAL_PROFILE": "cloud", "TEMPORAL_NAMESPACE": "other"}
    )
    assert cloud.address == "ns.acct.tmprl.cloud:7233" and cloud.api_key == KEY
    assert cloud.namespace == "other" and cloud.tls_enabled
    # A node reads no file: what it is given is all it uses.
    assert TemporalSettings.load({CONFIG_FILE_ENV: str(config)}, config_file=False).address == (
        "localhost:7233"
    )


def test_explicit_address_and_namespace_win_and_keep_the_rest():
    s = TemporalSettings.load(_env(TEMPORAL_API_KEY=KEY, TEMPORAL_NAMESPACE="prod"))
    o = s.override("10.0.0.5:7233", "other")
    assert (o.address, o.namespace, o.api_key, o.tls_enabled) == (
        "10.0.0.5:7233",
        "other",
        KEY,
        True,
    )
    assert s.override() is s


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"TEMPORAL_TLS": "no"}, "TEMPORAL_TLS must be true or false, not 'no'"),
        ({CONFIG_FILE_ENV: "/nonexistent/t.toml"}, "names /nonexistent/t.toml, which does not"),
        ({"TEMPORAL_PROFILE": "prod"}, "Profile 'prod' not found"),
    ],
)
def test_configuration_errors_name_the_cause(env: dict[str, str], says: str):
    with pytest.raises(TemporalConfigError) as err:
        TemporalSettings.load({CONFIG_FILE_ENV: os.devnull, **env})
    assert says in str(err.value)


def test_a_toml_error_never_quotes_the_line_holding_the_key(tmp_path: Path):
    config = tmp_path / "temporal.toml"
    config.write_text(f'[profile.default]\napi_key = "{KEY}\n')  # unterminated string
    with pytest.raises(TemporalConfigError) as err:
        TemporalSettings.load({CONFIG_FILE_ENV: str(config)})
    assert "TOML parse error" in str(err.value) and KEY not in str(err.value)
    assert "\n" not in str(err.value)


def test_certificate_files_that_cannot_be_read_or_do_not_pair(tmp_path: Path):
    missing = TemporalSettings.load(_env(TEMPORAL_TLS_SERVER_CA_CERT_PATH="/nonexistent/ca.pem"))
    with pytest.raises(TemporalConfigError, match="cannot read the TLS server CA certificate"):
        missing.tls_config()
    cert = tmp_path / "client.pem"
    cert.write_text(CA_PEM)
    lone = TemporalSettings.load(_env(TEMPORAL_TLS_CLIENT_CERT_PATH=str(cert)))
    with pytest.raises(TemporalConfigError, match="go together"):
        lone.tls_config()


def test_what_a_node_gets_reproduces_the_settings(tmp_path: Path):
    ca = tmp_path / "ca.pem"
    ca.write_text(CA_PEM)
    key = tmp_path / "client.key"
    key.write_text("-----BEGIN PRIVATE KEY-----\nsecret-key-bytes\n-----END PRIVATE KEY-----\n")
    cert = tmp_path / "client.pem"
    cert.write_text(CA_PEM)
    s = TemporalSettings.load(
        _env(
            TEMPORAL_ADDRESS="localhost:7233",
            TEMPORAL_NAMESPACE="prod",
            TEMPORAL_API_KEY=KEY,
            TEMPORAL_TLS_SERVER_CA_CERT_PATH=str(ca),
            TEMPORAL_TLS_CLIENT_CERT_PATH=str(cert),
            TEMPORAL_TLS_CLIENT_KEY_PATH=str(key),
            TEMPORAL_GRPC_META_X_TENANT="blue",
        )
    )
    # The process provider: the same paths.
    same = s.node_env()
    assert same == {
        "TEMPORAL_ADDRESS": "localhost:7233",
        "TEMPORAL_NAMESPACE": "prod",
        "TEMPORAL_TLS": "true",
        "TEMPORAL_API_KEY": KEY,
        "TEMPORAL_GRPC_META_X_TENANT": "blue",
        "TEMPORAL_TLS_SERVER_CA_CERT_PATH": str(ca),
        "TEMPORAL_TLS_CLIENT_CERT_PATH": str(cert),
        "TEMPORAL_TLS_CLIENT_KEY_PATH": str(key),
    }
    # Docker / Vast.ai: contents inline, another address, the certificate's name kept.
    inline = s.node_env("172.18.0.1:7233", inline_files=True)
    assert inline["TEMPORAL_TLS_SERVER_CA_CERT_DATA"] == CA_PEM
    assert "secret-key-bytes" in inline["TEMPORAL_TLS_CLIENT_KEY_DATA"]
    assert not any(k.endswith("_PATH") for k in inline)
    assert inline["TEMPORAL_ADDRESS"] == "172.18.0.1:7233"
    assert inline["TEMPORAL_TLS_SERVER_NAME"] == "localhost"
    for given in (same, inline):
        node = TemporalSettings.load(given, config_file=False)
        assert (node.namespace, node.api_key, node.tls_enabled) == ("prod", KEY, True)
        assert node.rpc_metadata == {"x-tenant": "blue"}
        tls = node.tls_config()
        assert not isinstance(tls, bool)
        assert tls.server_root_ca_cert == CA_PEM.encode() and tls.client_cert == CA_PEM.encode()
    plain = TemporalSettings.load(_env(TEMPORAL_ADDRESS="localhost:7233"))
    assert plain.node_env("172.18.0.1:7233") == {
        "TEMPORAL_ADDRESS": "172.18.0.1:7233",
        "TEMPORAL_NAMESPACE": "default",
        "TEMPORAL_TLS": "false",
    }


def test_node_environment_takes_the_connection_from_the_worker_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    for name in list(os.environ):
        if name.startswith("TEMPORAL_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv(CONFIG_FILE_ENV, os.devnull)
    monkeypatch.setenv("TEMPORAL_ADDRESS", "127.0.0.1:7443")
    monkeypatch.setenv("TEMPORAL_API_KEY", KEY)
    monkeypatch.setenv("MVP_STATE_DIR", str(tmp_path))
    spec = NodeProvisionSpec(
        run_id=1,
        node_id=1,
        stage_index=0,
        nonce="0123456789abcdef",
        task_queue="mvp-node-1-1-01234567",
        readiness_id="r",
        authorized_orchestrator="o",
        run_workflow_id="mvp-run-1",
        coordinator_endpoint="c",
        environment={"TEMPORAL_ADDRESS": "evil:7233", "TEMPORAL_TLS": "false", "FOO": "1"},
    )
    env = node_environment(spec, str(tmp_path), host_env={"TEMPORAL_PROFILE": "x", "PATH": "/b"})
    assert env["TEMPORAL_ADDRESS"] == "127.0.0.1:7443" and env["TEMPORAL_TLS"] == "true"
    assert env["TEMPORAL_API_KEY"] == KEY and "TEMPORAL_PROFILE" not in env
    assert env["FOO"] == "1" and env["PATH"] == "/b"
    assert "TEMPORAL_CONFIG_FILE" not in env
    docker = node_environment(spec, "/n", temporal_address="172.18.0.1:7443", inline_files=True)
    assert docker["TEMPORAL_ADDRESS"] == "172.18.0.1:7443"
    assert docker["TEMPORAL_TLS_SERVER_NAME"] == "127.0.0.1"


def test_a_local_dev_server_child_gets_none_of_this_processes_settings():
    env = local_server_env(
        "127.0.0.1:7233",
        {"PATH": "/b", "TEMPORAL_API_KEY": KEY, "TEMPORAL_PROFILE": "cloud", "TEMPORAL_TLS": "1"},
    )
    assert env == {"PATH": "/b", "TEMPORAL_ADDRESS": "127.0.0.1:7233", CONFIG_FILE_ENV: os.devnull}
    assert without_connection_env({"TEMPORAL_GRPC_META_A": "x", "HOME": "/h"}) == {"HOME": "/h"}
    assert TemporalSettings.load(env).describe() == "127.0.0.1:7233, namespace default"


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (
            "Failed client connect: `get_system_info` call error after connection: Status { "
            'code: Unauthenticated, message: "bad key", metadata: MetadataMap { headers: {} }',
            "the server refused the API key (bad key)",
        ),
        (
            "Failed client connect: Server connection error: tonic::transport::Error(Transport, "
            "ConnectError(Custom { kind: InvalidData, error: InvalidCertificate(UnknownIssuer) }))",
            "not signed by a trusted CA",
        ),
        (
            "Failed client connect: Server connection error: ... Os { code: 111, kind: "
            'ConnectionRefused, message: "Connection refused" }',
            "connection refused",
        ),
        (f"Failed client connect: something new, {KEY} included", "something new, [redacted]"),
    ],
)
def test_connection_failures_in_one_line_without_the_key(raw: str, says: str):
    s = TemporalSettings.load(_env(TEMPORAL_ADDRESS="t:7233", TEMPORAL_API_KEY=KEY))
    line = explain_connect_failure(s, RuntimeError(raw))
    assert line.startswith(
        "cannot connect to Temporal at t:7233, namespace default, TLS, API key: "
    )
    assert says in line and KEY not in line and "\n" not in line
