"""The codec server over a real HTTP socket on 127.0.0.1 (the UI and CLI protocol)."""

from __future__ import annotations

import base64
import http.client
import json
import secrets
import threading
from collections.abc import Iterator

import pytest
from google.protobuf import json_format
from temporalio.api.common.v1 import Payload
from temporalio.contrib.pydantic import pydantic_data_converter

from temporal.codec import ENCODING, EncryptionCodec, key_id
from temporal.codec_server import make_server

UI = "http://localhost:8233"
PROMPT = "Wombat-Kilimanjaro-9023 my private question"


@pytest.fixture
def codec() -> EncryptionCodec:
    return EncryptionCodec(secrets.token_bytes(32))


@pytest.fixture
def port(codec: EncryptionCodec) -> Iterator[int]:
    server = make_server(codec, "127.0.0.1", 0, [UI])
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()
    thread.join(5)


def _post(port: int, path: str, body: bytes, headers: dict[str, str] | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def _json_payloads(*payloads: Payload) -> bytes:
    return json.dumps({"payloads": [json_format.MessageToDict(p) for p in payloads]}).encode()


def _parse(body: bytes) -> list[Payload]:
    return [json_format.ParseDict(d, Payload()) for d in json.loads(body)["payloads"]]


def _plain(text: str) -> Payload:
    return pydantic_data_converter.payload_converter.to_payloads([text])[0]


def test_encode_then_decode_over_http(port: int, codec: EncryptionCodec):
    plain = [_plain(PROMPT), _plain("second")]
    status, headers, body = _post(port, "/encode", _json_payloads(*plain))
    assert status == 200 and headers["Content-Type"] == "application/json"
    sealed = _parse(body)
    assert [p.metadata["encoding"] for p in sealed] == [ENCODING, ENCODING]
    assert PROMPT.encode() not in body
    assert base64.b64encode(PROMPT.encode()) not in body
    assert [codec.decrypt(p) for p in sealed] == plain  # the server used our key
    status, _, body = _post(
        port, "/decode", _json_payloads(*sealed), {"X-Namespace": "default", "Origin": UI}
    )
    assert status == 200
    assert _parse(body) == plain


def test_decode_passes_unencrypted_payloads_and_answers_an_empty_list(port: int):
    status, _, body = _post(port, "/decode", _json_payloads(_plain("old history")))
    assert status == 200 and _parse(body) == [_plain("old history")]
    status, _, body = _post(port, "/decode", b'{"payloads": []}')
    assert status == 200 and json.loads(body) == {"payloads": []}


def test_cors_preflight_and_headers_for_the_ui_origin(port: int, codec: EncryptionCodec):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(
        "OPTIONS",
        "/decode",
        headers={
            "Origin": UI,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type,x-namespace",
        },
    )
    resp = conn.getresponse()
    resp.read()
    conn.close()
    assert resp.status == 204
    assert resp.getheader("Access-Control-Allow-Origin") == UI
    assert "POST" in resp.getheader("Access-Control-Allow-Methods", "")
    allowed = resp.getheader("Access-Control-Allow-Headers", "").lower()
    assert "x-namespace" in allowed and "content-type" in allowed
    [sealed] = [codec.encrypt(_plain(PROMPT))]
    status, headers, _ = _post(port, "/decode", _json_payloads(sealed), {"Origin": UI})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == UI


def test_other_origins_are_refused(port: int, codec: EncryptionCodec):
    sealed = codec.encrypt(_plain(PROMPT))
    status, headers, body = _post(
        port, "/decode", _json_payloads(sealed), {"Origin": "http://evil.example"}
    )
    assert status == 403 and "Access-Control-Allow-Origin" not in headers
    assert PROMPT.encode() not in body


def test_bad_requests_do_not_echo_their_body(port: int):
    status, _, body = _post(port, "/decode", PROMPT.encode())
    assert status == 400 and PROMPT.encode() not in body
    status, _, body = _post(port, "/decode", json.dumps({"payloads": [{"dat": PROMPT}]}).encode())
    assert status == 400 and PROMPT.encode() not in body
    status, _, _ = _post(port, "/nothing", b"{}")
    assert status == 404


def test_wrong_key_is_a_400_naming_the_key_ids(port: int, codec: EncryptionCodec):
    other_key = secrets.token_bytes(32)
    sealed = EncryptionCodec(other_key).encrypt(_plain(PROMPT))
    status, _, body = _post(port, "/decode", _json_payloads(sealed))
    assert status == 400
    msg = json.loads(body)["error"]
    assert (
        f"payload encrypted with key {key_id(other_key)}, this process has key {codec.key_id}"
        in msg
    )
    assert PROMPT not in msg
