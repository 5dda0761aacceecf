"""The node's dead-man switch on a rented instance: it destroys its own instance with
the instance's own key, against a real local HTTP server."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from activities.providers.base import ProviderUnavailable
from activities.providers.vastai import key_body as _key_body
from activities.providers.vastai import only_this_side, public_key_of
from workers.node.self_destroy import container_environ, self_destroy


class _Api(BaseHTTPRequestHandler):
    calls: list[tuple[str, str, str]] = []
    answers: list[int] = []

    def do_DELETE(self) -> None:
        type(self).calls.append((self.command, self.path, self.headers.get("Authorization", "")))
        code = type(self).answers.pop(0) if type(self).answers else 200
        body = json.dumps({"success": code == 200}).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def api() -> Iterator[str]:
    _Api.calls, _Api.answers = [], []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Api)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_it_destroys_its_own_instance_with_the_instance_key(api: str) -> None:
    env = {"MVP_VASTAI_SERVER_URL": api, "CONTAINER_API_KEY": "k1", "CONTAINER_ID": "77"}
    _Api.answers = [500]  # retried
    assert self_destroy("test", env)
    assert _Api.calls == [("DELETE", "/api/v0/instances/77/", "Bearer k1")] * 2


def test_an_instance_gone_already_counts_as_destroyed(api: str) -> None:
    _Api.answers = [404]
    env = {"MVP_VASTAI_SERVER_URL": api, "CONTAINER_API_KEY": "k", "CONTAINER_ID": "5"}
    assert self_destroy("test", env)


def test_off_vastai_or_switched_off_by_the_harness_it_does_nothing(api: str) -> None:
    assert not self_destroy("test", {"MVP_VASTAI_SERVER_URL": api})  # no key, no id
    env = {
        "MVP_VASTAI_SERVER_URL": api,
        "CONTAINER_API_KEY": "k",
        "CONTAINER_ID": "5",
        "MVP_FAULT_NO_SELF_DESTROY": "1",
        "MVP_TEST_FAULTS_ALLOWED": "1",
    }
    assert not self_destroy("test", env)
    assert _Api.calls == []


def test_the_container_environment_is_read_from_nul_separated_entries(tmp_path: Path) -> None:
    f = tmp_path / "environ"
    f.write_bytes(b"CONTAINER_ID=9\0CONTAINER_API_KEY=abc=d\0junk\0")
    assert container_environ(f) == {"CONTAINER_ID": "9", "CONTAINER_API_KEY": "abc=d"}
    assert container_environ(tmp_path / "missing") == {}


def test_the_public_key_is_derived_from_the_identity(tmp_path: Path) -> None:
    key = tmp_path / "id"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    assert _key_body(public_key_of(key)) == _key_body(key.with_suffix(".pub").read_text())
    with pytest.raises(ProviderUnavailable, match=f"missing VastAI SSH identity {tmp_path / 'x'}"):
        public_key_of(tmp_path / "x")
    (tmp_path / "bad").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nnot a key\n")
    with pytest.raises(ProviderUnavailable, match="is not an unencrypted OpenSSH private key"):
        public_key_of(tmp_path / "bad")


@pytest.mark.parametrize(
    ("host", "tunnel"),
    [
        ("localhost", True),
        ("127.0.0.1", True),
        ("[::1]", True),
        ("0.0.0.0", True),
        ("10.1.2.3", True),
        ("192.168.1.20", True),
        ("169.254.0.9", True),
        ("8.8.8.8", False),
        ("[2001:4860:4860::8888]", False),
        ("temporal.does-not-resolve.invalid", False),
    ],
)
def test_a_temporal_address_a_rented_host_cannot_reach_goes_through_the_tunnel(host, tunnel):
    assert only_this_side(host) is tunnel
