"""The Vast.ai settings of a process's environment (mvp_core/vastai_env.py), and the
provider reading them through that one model (activities/providers/vastai/)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import SecretStr

from activities.providers import vastai as provider
from activities.providers.base import ProviderUnavailable
from mvp_core.host_config import HOST_OPERATIONAL_ENV
from mvp_core.vastai_env import (
    DEFAULT_DESTROY_DEADLINE_S,
    DEFAULT_SERVER_URL,
    HOST_OPERATIONAL,
    VastAiEnvError,
    VastAiEnvironment,
    credentials_env,
)


def test_defaults():
    env = VastAiEnvironment.from_env({"HOME": "/home/u"})
    assert env.api_key is None
    assert env.server_url == DEFAULT_SERVER_URL
    assert env.ssh_identity == Path("/home/u/.ssh/id_ed25519")
    assert env.temporal_address is None
    assert env.destroy_deadline_s == DEFAULT_DESTROY_DEADLINE_S == 90.0


def test_every_variable_is_read():
    env = VastAiEnvironment.from_env(
        {
            "HOME": "/home/u",
            "VASTAI_API_KEY": " key-1 ",
            "MVP_VASTAI_SERVER_URL": "http://127.0.0.1:9999/",
            "VAST_URL": "http://ignored",
            "MVP_VASTAI_SSH_IDENTITY": "~/keys/vast",
            "MVP_VASTAI_TEMPORAL_ADDRESS": "temporal.example.com:7233",
            "MVP_VASTAI_DESTROY_DEADLINE_S": "8",
        }
    )
    assert env.api_key is not None and env.api_key.get_secret_value() == "key-1"
    assert env.server_url == "http://127.0.0.1:9999"
    assert env.ssh_identity == Path("/home/u/keys/vast")
    assert env.temporal_address == "temporal.example.com:7233"
    assert env.destroy_deadline_s == 8.0


def test_the_sdk_url_variable_is_the_fallback_and_blank_is_unset():
    env = VastAiEnvironment.from_env({"MVP_VASTAI_SERVER_URL": " ", "VAST_URL": "http://v/"})
    assert env.server_url == "http://v"
    assert VastAiEnvironment.from_env({"VASTAI_API_KEY": "  "}).api_key is None


def test_without_home_the_identity_keeps_its_tilde():
    assert VastAiEnvironment.from_env({}).ssh_identity == Path("~/.ssh/id_ed25519")


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        (
            {"VASTAI_API_KEY": "ab cd"},
            "invalid VASTAI_API_KEY: must be one token without whitespace",
        ),
        (
            {"MVP_VASTAI_DESTROY_DEADLINE_S": "inf"},
            "invalid MVP_VASTAI_DESTROY_DEADLINE_S='inf': expected seconds, a number greater "
            "than 0",
        ),
    ],
)
def test_bad_values_name_the_variable_never_the_key(environ, message):
    with pytest.raises(VastAiEnvError) as info:
        VastAiEnvironment.from_env(environ)
    assert str(info.value) == message and "ab cd" not in str(info.value)


def test_the_host_may_set_the_operational_variables():
    assert set(HOST_OPERATIONAL) <= HOST_OPERATIONAL_ENV
    assert "MVP_VASTAI_SSH_IDENTITY" not in HOST_OPERATIONAL_ENV  # --vastai-ssh-identity


def test_credentials_env_is_read_back_by_the_model():
    env = credentials_env(SecretStr("k-2"), Path("/keys/id"))
    back = VastAiEnvironment.from_env(env)
    assert back.api_key is not None and back.api_key.get_secret_value() == "k-2"
    assert back.ssh_identity == Path("/keys/id")


# --------------------------------------------------------------------------- the provider


def test_the_provider_reads_its_settings_through_the_model(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HOME", "/home/p")
    monkeypatch.setenv("MVP_VASTAI_SERVER_URL", "http://127.0.0.1:1/")
    monkeypatch.setenv("MVP_VASTAI_SSH_IDENTITY", "~/k")
    assert provider.server_url() == "http://127.0.0.1:1"
    assert provider.identity_path() == Path("/home/p/k")


def test_the_provider_without_a_key_is_unavailable(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("VASTAI_API_KEY", raising=False)
    with pytest.raises(ProviderUnavailable, match="VASTAI_API_KEY is required"):
        provider.VastAiProvider(host="h").sdk()


def test_a_bad_destroy_deadline_makes_the_provider_unavailable(monkeypatch: pytest.MonkeyPatch):
    # Before the one model, float("soon") escaped the provider as a bare ValueError.
    monkeypatch.setenv("MVP_VASTAI_DESTROY_DEADLINE_S", "soon")
    with pytest.raises(ProviderUnavailable, match="invalid MVP_VASTAI_DESTROY_DEADLINE_S"):
        provider.VastAiProvider(host="h")._destroy(1)
