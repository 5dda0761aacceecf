"""The gateway's API keys (workers/gateway/auth.py): where they come from, how a request
presents one, and that a request without the right one never reaches a route."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import pytest

from workers.gateway.app import create_app
from workers.gateway.auth import (
    API_KEYS_ENV,
    ApiKeyError,
    ApiKeys,
    load_keys,
    presented_key,
)
from workers.gateway.service import ServedModel

KEY = "sk-mvp-0123456789abcdef"
OTHER = "sk-mvp-fedcba9876543210"


def test_keys_come_from_a_file_and_the_environment(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text(f"# the team's keys\n\n  {KEY}  \n")
    assert load_keys(f, {API_KEYS_ENV: f" {OTHER} ,, "}) == [KEY, OTHER]
    assert load_keys(None, {}) == []


@pytest.mark.parametrize(
    ("text", "where"),
    [("short\n", "line 1"), (f"# c\n{KEY} x\n", "line 2"), ("# only a comment\n", "no key")],
)
def test_a_bad_key_file_names_where_and_never_the_key(tmp_path: Path, text: str, where: str):
    f = tmp_path / "keys"
    f.write_text(text)
    with pytest.raises(ApiKeyError) as err:
        load_keys(f, {})
    assert where in str(err.value) and "short" not in str(err.value) and KEY not in str(err.value)
    with pytest.raises(ApiKeyError, match="cannot read"):
        load_keys(tmp_path / "missing", {})
    with pytest.raises(ApiKeyError, match=f"{API_KEYS_ENV} item 2"):
        load_keys(None, {API_KEYS_ENV: f"{KEY},tiny"})


def test_a_key_is_presented_as_bearer_or_as_basic_password() -> None:
    basic = base64.b64encode(f"anyone:{KEY}".encode())
    assert presented_key([(b"authorization", f"Bearer {KEY}".encode())]) == KEY.encode()
    assert presented_key([(b"Authorization", b"Basic " + basic)]) == KEY.encode()
    assert presented_key([(b"authorization", b"Basic !!notbase64")]) is None
    assert presented_key([(b"authorization", b"Token abc")]) is None
    assert presented_key([(b"x-api-key", KEY.encode())]) is None
    keys = ApiKeys([KEY, OTHER])
    assert keys.allows(KEY.encode()) and keys.allows(OTHER.encode())
    assert not keys.allows(KEY[:-1].encode()) and not keys.allows(b"")


@pytest.fixture
def gateway(monkeypatch: pytest.MonkeyPatch) -> httpx.AsyncClient:
    app = create_app(client=None, run_id=5, api_keys=[KEY])  # type: ignore[arg-type]
    gw = app.state.gateway
    reached: list[str] = []

    async def served() -> ServedModel:
        reached.append("served")
        return ServedModel("m", frozenset(), 1, 64)

    def stream(prompt: object, **kw: object) -> object:
        raise AssertionError("a refused request reached the run")

    monkeypatch.setattr(gw, "served", served)
    monkeypatch.setattr(gw.run, "stream", stream)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")
    http.reached = reached  # type: ignore[attr-defined]
    return http


async def test_a_request_without_the_right_key_is_refused_before_any_route(
    gateway: httpx.AsyncClient,
) -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    missing = await gateway.post("/v1/completions", json=body)
    assert missing.status_code == 401
    assert missing.json()["error"]["code"] == "missing_api_key"
    assert missing.json()["error"]["type"] == "invalid_request_error"
    assert missing.headers["www-authenticate"].startswith("Bearer")
    wrong = await gateway.post(
        "/v1/completions", json=body, headers={"Authorization": f"Bearer {OTHER}"}
    )
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert OTHER not in wrong.text
    page = await gateway.get("/dashboard")
    assert page.status_code == 401 and page.headers["www-authenticate"].startswith("Basic")
    assert gateway.reached == []  # type: ignore[attr-defined]
    ok = await gateway.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "m"
    basic = base64.b64encode(f"me:{KEY}".encode()).decode()
    assert (
        await gateway.get("/dashboard", headers={"Authorization": f"Basic {basic}"})
    ).status_code == 200
