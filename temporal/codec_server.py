"""A codec server, so the Temporal Web UI and CLI can show encrypted payloads:
``python -m temporal.codec_server --port 8081 [--origin http://localhost:8233]``.

It speaks Temporal's remote codec protocol: ``POST /encode`` and ``POST /decode`` with
``{"payloads": [...]}`` in protobuf JSON, answered in the same shape. It decrypts for
anyone who can reach it, so it binds to 127.0.0.1 and answers browsers only from the
configured UI origins. Request bodies are never logged. See docs/payload-codec.md.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.protobuf import json_format
from temporalio.api.common.v1 import Payload, Payloads

from temporal.codec import EncryptionCodec, PayloadKeyError, required_codec_from_env

DEFAULT_PORT = 8081
DEFAULT_ORIGINS = ("http://localhost:8233", "http://127.0.0.1:8233")
MAX_BODY_BYTES = 32 * 1024 * 1024
ALLOW_HEADERS = "Content-Type, X-Namespace, Authorization"

log = logging.getLogger("mvp.codec_server")


def payloads_from_json(body: bytes) -> list[Payload]:
    """Parse ``{"payloads": [...]}``; errors never quote the body (it is user data)."""
    try:
        doc = json.loads(body)
        if not isinstance(doc, dict):
            raise ValueError("not an object")
        msg = json_format.ParseDict(doc, Payloads())
    except (ValueError, json_format.ParseError):
        raise ValueError(
            'body must be JSON {"payloads": [...]} of protobuf-JSON payloads'
        ) from None
    return list(msg.payloads)


def payloads_to_json(payloads: Sequence[Payload]) -> bytes:
    # Built by hand: MessageToDict drops an empty list, and the UI expects the key.
    return json.dumps({"payloads": [json_format.MessageToDict(p) for p in payloads]}).encode()


class CodecHandler(BaseHTTPRequestHandler):
    """The codec endpoint; ``make_handler`` gives it its operations and UI origins."""

    ops: dict[str, Callable[[Payload], Payload]] = {}
    allowed: frozenset[str] = frozenset()
    server_version = "mvp-codec"
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        log.info("%s %s", self.address_string(), format % args)

    def _origin_ok(self) -> bool:
        """No Origin (CLI, curl) is fine; a browser must come from a UI origin."""
        origin = self.headers.get("Origin")
        return origin is None or origin.rstrip("/") in self.allowed

    def _reply(self, status: HTTPStatus, body: bytes = b"", kind: str = "") -> None:
        self.send_response(status)
        origin = self.headers.get("Origin")
        if origin is not None and origin.rstrip("/") in self.allowed:
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Access-Control-Allow-Credentials", "true")
            self.send_header("Access-Control-Allow-Methods", "POST, OPTIONS")
            self.send_header("Access-Control-Allow-Headers", ALLOW_HEADERS)
            self.send_header("Access-Control-Max-Age", "600")
        self.send_header("Vary", "Origin")
        if kind:
            self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body:
            self.wfile.write(body)

    def _error(self, status: HTTPStatus, message: str) -> None:
        self._reply(status, json.dumps({"error": message}).encode(), "application/json")

    def _op(self) -> str | None:
        path = self.path.split("?", 1)[0].rstrip("/")
        name = path.rsplit("/", 1)[-1]
        return name if name in self.ops else None

    def do_OPTIONS(self) -> None:
        if not self._origin_ok():
            self._error(HTTPStatus.FORBIDDEN, "origin not allowed")
        elif self._op() is None:
            self._error(HTTPStatus.NOT_FOUND, "use /encode or /decode")
        else:
            self._reply(HTTPStatus.NO_CONTENT)

    def do_POST(self) -> None:
        op = self._op()
        if not self._origin_ok():
            self._error(HTTPStatus.FORBIDDEN, "origin not allowed")
            return
        if op is None:
            self._error(HTTPStatus.NOT_FOUND, "use /encode or /decode")
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._error(HTTPStatus.LENGTH_REQUIRED, "Content-Length required")
            return
        if length < 0 or length > MAX_BODY_BYTES:
            self.close_connection = True
            self._error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "body too large")
            return
        body = self.rfile.read(length)
        # X-Namespace is accepted and logged; one key serves every namespace.
        namespace = self.headers.get("X-Namespace", "")
        try:
            payloads = payloads_from_json(body)
            out = [self.ops[op](p) for p in payloads]
        except ValueError as err:  # PayloadDecryptError names key ids, never data
            self._error(HTTPStatus.BAD_REQUEST, str(err))
            return
        log.info("%s %d payloads (namespace %r)", op, len(out), namespace)
        self._reply(HTTPStatus.OK, payloads_to_json(out), "application/json")


def make_handler(codec: EncryptionCodec, origins: Sequence[str]) -> type[BaseHTTPRequestHandler]:
    ops: dict[str, Callable[[Payload], Payload]] = {
        "encode": codec.encrypt,
        "decode": codec.decrypt,
    }
    allowed = frozenset(o.rstrip("/") for o in origins)
    return type("CodecHandler", (CodecHandler,), {"ops": ops, "allowed": allowed})


def make_server(
    codec: EncryptionCodec,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    origins: Sequence[str] = DEFAULT_ORIGINS,
) -> ThreadingHTTPServer:
    """A bound server (port 0 picks a free one); the caller runs ``serve_forever``."""
    server = ThreadingHTTPServer((host, port), make_handler(codec, origins))
    server.daemon_threads = True
    return server


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m temporal.codec_server", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument(
        "--origin",
        action="append",
        help="Web UI origin allowed by CORS (repeatable; default http://localhost:8233 "
        "and http://127.0.0.1:8233)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        codec = required_codec_from_env("the codec server")
    except PayloadKeyError as err:
        print(err, file=sys.stderr)
        return 2
    origins = args.origin or list(DEFAULT_ORIGINS)
    server = make_server(codec, args.host, args.port, origins)
    if not _is_loopback(args.host):
        log.warning("listening on %s: anyone who can reach it can decrypt payloads", args.host)
    host, port = server.server_address[:2]
    print(
        f"codec server on http://{host!s}:{port} (key {codec.key_id}), "
        f"UI origins {', '.join(origins)}",
        flush=True,
    )

    def stop(signum: int, frame: object) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
