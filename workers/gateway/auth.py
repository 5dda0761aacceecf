"""API keys: who may use the gateway (docs/gateway.md "API keys").

Keys come from a file (``--api-key-file``: one per line, ``#`` comments and blank lines
ignored) and from ``MVP_GATEWAY_API_KEYS`` (comma-separated), never from the command line,
where ``ps`` would show them. With any key configured, every request to ``/v1/*``, to the
admin API (``/admin``) and to the dashboard must carry one: ``Authorization: Bearer
<key>`` (OpenAI's clients send their ``api_key`` so), or HTTP Basic with the key as the
password (what a browser asks for on the dashboard). A missing or wrong key is a 401 with OpenAI's error body; ``/health``
stays open (a load balancer's probe). Each presented key is compared with every
configured one in constant time; no key ever goes into a log line, a span or an error.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import os
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

API_KEYS_ENV = "MVP_GATEWAY_API_KEYS"
MIN_KEY_CHARS = 16
MAX_KEY_CHARS = 512
REALM = "mvp-gateway"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


class ApiKeyError(ValueError):
    """A key source that cannot be used; the message names where, never the key."""


def _checked(key: str, where: str) -> str:
    if not MIN_KEY_CHARS <= len(key) <= MAX_KEY_CHARS:
        raise ApiKeyError(
            f"{where}: an API key has {MIN_KEY_CHARS} to {MAX_KEY_CHARS} characters "
            f"(this one has {len(key)})"
        )
    if not all(33 <= ord(c) <= 126 for c in key):
        raise ApiKeyError(f"{where}: an API key is printable ASCII without spaces")
    return key


def load_keys(file: Path | None, environ: Mapping[str, str] | None = None) -> list[str]:
    """The configured keys, from ``file`` and the environment (either may be absent)."""
    env = os.environ if environ is None else environ
    keys: list[str] = []
    if file is not None:
        try:
            text = file.read_text()
        except (OSError, UnicodeDecodeError) as err:
            raise ApiKeyError(f"cannot read the API key file {file}: {err}") from None
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(_checked(line, f"{file} line {number}"))
        if not keys:
            raise ApiKeyError(f"the API key file {file} holds no key")
    for i, part in enumerate(env.get(API_KEYS_ENV, "").split(","), 1):
        if part.strip():
            keys.append(_checked(part.strip(), f"{API_KEYS_ENV} item {i}"))
    return keys


class ApiKeys:
    """The configured keys, compared in constant time."""

    def __init__(self, keys: Sequence[str]) -> None:
        if not keys:
            raise ValueError("no API keys")
        self._keys = [k.encode() for k in keys]

    def allows(self, presented: bytes) -> bool:
        found = False
        for key in self._keys:  # every key, whichever matches: no early answer
            found |= hmac.compare_digest(key, presented)
        return found


def presented_key(headers: Sequence[tuple[bytes, bytes]]) -> bytes | None:
    """The key an ``Authorization`` header carries: Bearer, or Basic's password."""
    for name, value in headers:
        if name.lower() != b"authorization":
            continue
        scheme, _, rest = value.strip().partition(b" ")
        rest = rest.strip()
        if scheme.lower() == b"bearer" and rest:
            return rest
        if scheme.lower() == b"basic" and rest:
            try:
                decoded = base64.b64decode(rest, validate=True)
            except (binascii.Error, ValueError):
                return None
            _, sep, password = decoded.partition(b":")
            return password if sep and password else None
        return None
    return None


def protected(path: str) -> bool:
    return path in ("/v1", "/admin") or path.startswith(("/v1/", "/admin/", "/dashboard"))


def _refusal(missing: bool, browser: bool) -> tuple[dict[str, Any], list[tuple[bytes, bytes]]]:
    if missing:
        message = (
            "missing API key: send it as 'Authorization: Bearer <key>' (the openai "
            "client's api_key)"
        )
    else:
        message = "invalid API key"
    body = {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": None,
            "code": "missing_api_key" if missing else "invalid_api_key",
        }
    }
    challenge = f'Basic realm="{REALM}"' if browser else f'Bearer realm="{REALM}"'
    return body, [(b"www-authenticate", challenge.encode())]


class ApiKeyMiddleware:
    """ASGI middleware: a request to a protected path without a configured key is
    answered 401 before any route runs (nothing reaches the run)."""

    def __init__(self, app: App, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not protected(str(scope.get("path", ""))):
            await self.app(scope, receive, send)
            return
        key = presented_key(scope.get("headers") or [])
        if key is not None and self.keys.allows(key):
            await self.app(scope, receive, send)
            return
        browser = str(scope.get("path", "")).startswith("/dashboard")
        body, headers = _refusal(key is None, browser)
        payload = json.dumps(body).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                    *headers,
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})
