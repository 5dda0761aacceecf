"""A stand-in for the Hugging Face hub, for tests: two local HTTP servers that speak what
``huggingface_hub`` (2.x) uses for ``get_hf_file_metadata`` and ``hf_hub_download``.

The hub (``standin.url``, what ``HF_ENDPOINT`` points at) answers
``HEAD|GET /{owner}/{name}/resolve/{revision}/{path}`` as huggingface.co does:

- an LFS file: ``302`` to the CDN with ``X-Repo-Commit``, ``X-Linked-Etag`` (the quoted
  sha256), ``X-Linked-Size`` and ``ETag`` (the git id of its pointer file); the library
  does not follow a redirect to another origin, reads the metadata from it, and then
  GETs the CDN without the ``authorization`` header;
- a plain (non-LFS) file: ``200`` with ``X-Repo-Commit``, ``ETag`` (its git blob id) and
  ``Content-Length``, the bytes on GET;
- errors with the hub's ``X-Error-Code`` / ``X-Error-Message`` headers: an unknown repo is
  ``401 RepoNotFound`` without credentials and ``404 RepoNotFound`` with them; a repo that
  needs a token (``require_token``) is ``401 RepoNotFound`` "Invalid username or
  password." without one and ``401`` "Invalid credentials in Authorization header" with
  a wrong one; an unknown revision ``404 RevisionNotFound``; a missing file ``404
  EntryNotFound`` (with ``X-Repo-Commit``).

The CDN (``standin.cdn_url``) serves ``GET|HEAD /blobs/<sha256>`` with ``Range`` support
(``206``), as the signed URLs the hub redirects to do. Switches (set them any time):
``require_token`` (the token every hub request needs), ``truncate_after`` (each CDN
response stops after the file's first N bytes and the connection drops, so resumed
requests get nothing more), ``wrong_hash`` (the CDN serves the file with one byte
changed: the same size, another sha256). Ranges are ``bytes=A-`` and ``bytes=A-B``.
``requests`` records every request (server, method, path, authorization and range
headers) and ``sent`` the content bytes of every response, for the tests' assertions.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import gguf
import numpy as np

CHUNK = 1 << 20


@dataclass(frozen=True)
class Blob:
    """One file's content: bytes in memory or a file on disk, with its hashes."""

    source: bytes | Path
    size: int
    sha256: str
    git_oid: str  # git's blob id of the content (the ETag of a non-LFS file)
    lfs: bool

    def read(self, start: int, end: int) -> bytes:
        if isinstance(self.source, bytes):
            return self.source[start:end]
        with open(self.source, "rb") as f:
            f.seek(start)
            return f.read(end - start)

    @property
    def pointer_oid(self) -> str:
        """The git id of the LFS pointer file the repo holds for an LFS file."""
        pointer = (
            f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\n"
            f"size {self.size}\n"
        ).encode()
        return hashlib.sha1(b"blob %d\0" % len(pointer) + pointer).hexdigest()


def make_blob(content: bytes | Path, lfs: bool = True) -> Blob:
    sha256 = hashlib.sha256()
    if isinstance(content, bytes):
        size = len(content)
        sha256.update(content)
        git = hashlib.sha1(b"blob %d\0" % size + content)
    else:
        size = content.stat().st_size
        git = hashlib.sha1(b"blob %d\0" % size)
        with open(content, "rb") as f:
            while chunk := f.read(CHUNK):
                sha256.update(chunk)
                git.update(chunk)
    return Blob(content, size, sha256.hexdigest(), git.hexdigest(), lfs)


def tiny_gguf(path: Path, name: str = "tiny-standin") -> Path:
    """A small valid GGUF (a few KB), for the cases that need no real model."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_string("general.name", name)
    writer.add_uint32("llama.block_count", 1)
    writer.add_uint32("llama.context_length", 64)
    writer.add_uint32("llama.embedding_length", 8)
    writer.add_tensor("token_embd.weight", np.arange(64, dtype=np.float32).reshape(8, 8))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@dataclass(frozen=True)
class Seen:
    server: str  # "hub" or "cdn"
    method: str
    path: str
    authorization: str | None
    range: str | None


@dataclass(frozen=True)
class Sent:
    """Content bytes one response carried: ``count`` bytes of the blob from ``start``."""

    sha256: str
    start: int
    count: int
    client: str  # the address the request came from


@dataclass
class _Repo:
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit
    commits: dict[str, dict[str, Blob]] = field(default_factory=dict)


_RESOLVE = re.compile(r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<revision>[^/]+)/(?P<file>.+)")


class HubStandin:
    def __init__(self, host: str = "127.0.0.1") -> None:
        """Both servers on ``host`` (loopback; a Docker network's gateway for containers)."""
        self.repos: dict[str, _Repo] = {}
        self.blobs: dict[str, Blob] = {}
        self.require_token: str | None = None
        self.truncate_after: int | None = None
        self.wrong_hash = False
        self.requests: list[Seen] = []
        self.sent: list[Sent] = []
        self._lock = threading.Lock()
        self._hub = ThreadingHTTPServer((host, 0), self._handler("hub"))
        self._cdn = ThreadingHTTPServer((host, 0), self._handler("cdn"))
        self._hub.daemon_threads = self._cdn.daemon_threads = True
        self.url = f"http://{host}:{self._hub.server_address[1]}"
        self.cdn_url = f"http://{host}:{self._cdn.server_address[1]}"
        self._threads = [
            threading.Thread(target=s.serve_forever, daemon=True) for s in (self._hub, self._cdn)
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ content
    def add_file(
        self,
        repo: str,
        file: str,
        content: bytes | Path,
        *,
        revision: str = "main",
        lfs: bool = True,
    ) -> str:
        """A new commit of ``repo`` on ``revision`` holding ``file`` (and the files the
        revision held before); returns the commit id."""
        blob = make_blob(content, lfs)
        with self._lock:
            entry = self.repos.setdefault(repo, _Repo())
            files = dict(entry.commits.get(entry.refs.get(revision, ""), {}))
            files[file] = blob
            commit = secrets.token_hex(20)
            entry.commits[commit] = files
            entry.refs[revision] = commit
            self.blobs[blob.sha256] = blob
        return commit

    def seen(self, server: str, method: str | None = None) -> list[Seen]:
        with self._lock:
            return [
                r
                for r in self.requests
                if r.server == server and (method is None or r.method == method)
            ]

    def bytes_sent(self, content: bytes | Path | None = None, client: str | None = None) -> int:
        """Content bytes served in all (of the file ``content``, to ``client``, where given)."""
        sha = None if content is None else make_blob(content).sha256
        with self._lock:
            return sum(
                s.count
                for s in self.sent
                if (sha is None or s.sha256 == sha) and (client is None or s.client == client)
            )

    def close(self) -> None:
        for server in (self._hub, self._cdn):
            server.shutdown()
            server.server_close()

    def __enter__(self) -> HubStandin:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ HTTP
    def _handler(self, server: str) -> type[BaseHTTPRequestHandler]:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                return  # quiet

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def _serve(self, body: bool) -> None:
                with standin._lock:
                    standin.requests.append(
                        Seen(
                            server,
                            self.command,
                            self.path,
                            self.headers.get("authorization"),
                            self.headers.get("range"),
                        )
                    )
                if server == "hub":
                    standin._resolve(self, body)
                else:
                    standin._blob(self, body)

        return Handler

    def _answer(
        self, h: BaseHTTPRequestHandler, status: int, headers: dict[str, str], body: bytes = b""
    ) -> None:
        h.send_response(status)
        for key, value in headers.items():
            h.send_header(key, value)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if h.command != "HEAD" and body:
            h.wfile.write(body)

    def _error(
        self,
        h: BaseHTTPRequestHandler,
        status: int,
        code: str | None,
        message: str,
        extra: dict[str, str] | None = None,
    ) -> None:
        headers = {"X-Error-Message": message, "Content-Type": "application/json", **(extra or {})}
        if code is not None:
            headers["X-Error-Code"] = code
        self._answer(h, status, headers, b'{"error":"%s"}' % message.encode())

    def _resolve(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = urlsplit(h.path).path
        match = _RESOLVE.fullmatch(path)
        if match is None:
            self._error(h, 404, None, "Not found")
            return
        repo_id = unquote(match["repo"])
        revision = unquote(match["revision"])
        file = unquote(match["file"])
        auth = h.headers.get("authorization")
        with self._lock:
            repo = self.repos.get(repo_id)
            required = self.require_token
        if required is not None and auth != f"Bearer {required}":
            if auth is None:
                self._error(h, 401, "RepoNotFound", "Invalid username or password.")
            else:
                self._error(h, 401, None, "Invalid credentials in Authorization header")
            return
        if repo is None:
            status = 404 if auth else 401
            self._error(h, status, "RepoNotFound", "Repository not found")
            return
        commit = revision if revision in repo.commits else repo.refs.get(revision)
        if commit is None:
            self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return
        blob = repo.commits[commit].get(file)
        if blob is None:
            self._error(h, 404, "EntryNotFound", "Entry not found", {"X-Repo-Commit": commit})
            return
        common = {"X-Repo-Commit": commit, "Accept-Ranges": "bytes"}
        if blob.lfs:
            location = f"{self.cdn_url}/blobs/{blob.sha256}?file={quote(file)}"
            headers = {
                **common,
                "ETag": f'"{blob.pointer_oid}"',
                "X-Linked-Etag": f'"{blob.sha256}"',
                "X-Linked-Size": str(blob.size),
                "Location": location,
            }
            self._answer(h, 302, headers, f"Found. Redirecting to {location}".encode())
            return
        self._content(h, blob, {**common, "ETag": f'"{blob.git_oid}"'}, body)

    def _blob(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        name = urlsplit(h.path).path.removeprefix("/blobs/")
        with self._lock:
            blob = self.blobs.get(name)
        if blob is None:
            self._answer(h, 404, {}, b"NoSuchKey")
            return
        self._content(h, blob, {"ETag": f'"{blob.sha256}"', "Accept-Ranges": "bytes"}, body)

    def _content(
        self, h: BaseHTTPRequestHandler, blob: Blob, headers: dict[str, str], body: bool
    ) -> None:
        start, stop, status = 0, blob.size, 200
        ranged = re.fullmatch(r"bytes=(\d+)-(\d*)", h.headers.get("range") or "")
        if ranged is not None:
            start, status = int(ranged[1]), 206
            if ranged[2]:
                stop = min(int(ranged[2]) + 1, blob.size)
            if start >= blob.size or stop <= start:
                self._answer(h, 416, {"Content-Range": f"bytes */{blob.size}"})
                return
            headers = {**headers, "Content-Range": f"bytes {start}-{stop - 1}/{blob.size}"}
        h.send_response(status)
        for key, value in headers.items():
            h.send_header(key, value)
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(stop - start))
        h.end_headers()
        if not body:
            return
        with self._lock:
            cut = self.truncate_after
            corrupt = self.wrong_hash
        end = stop if cut is None else min(stop, cut)
        pos = start
        try:
            while pos < end:
                chunk = blob.read(pos, min(end, pos + CHUNK))
                if corrupt and pos <= blob.size // 2 < pos + len(chunk):
                    i = blob.size // 2 - pos
                    chunk = chunk[:i] + bytes([chunk[i] ^ 0xFF]) + chunk[i + 1 :]
                h.wfile.write(chunk)
                pos += len(chunk)
            h.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            h.close_connection = True
            return
        finally:
            with self._lock:
                self.sent.append(Sent(blob.sha256, start, pos - start, h.client_address[0]))
        if end < stop:  # truncated: drop the connection mid-body
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
