"""Fetch a node's share of a hub model: byte ranges of its files, by HTTP range requests,
into the host's model cache (DECISIONS 72).

A share (``mvp_core.models.ModelShare`` as JSON) names the hub, the repo and the commit
pinned at planning, each file's size, ETag, sha256 and header digest, the path each file
takes on this host, and the ranges of them the node's stage needs. Each file is kept
*sparse* at its path: the full size, with only the fetched ranges written (the rest are
holes that take no disk), so the engine maps it as it maps any GGUF and reads only its
own tensors. Beside it:

- ``<path>.ranges.json`` records which ranges are held (and for which commit, size and
  ETag); it is rewritten only after the bytes it names are synced to disk, so a fetch cut
  at any point resumes where the record ends, and a cache of another upload is reset;
- ``<path>.lock`` is held (``flock``) while a fetcher works on the file: nodes of one
  host share the cache and never fetch the same bytes twice.

Checked: every answer is a 206 for exactly the range asked, of a file of the planned
size; each file's header has the sha256 recorded at planning; a file held whole has the
sha256 the hub states for it (an LFS file's). A file that fails a check is removed with
its record: nothing corrupt stays in the cache.

This module uses the standard library only: the Vast.ai provider sends this very file to
a rented instance and runs it there with ``python3`` before anything is installed (the
token, where the hub needs one, on its standard input, never on a command line or disk).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import http.client
import json
import os
import re
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any
from urllib.parse import quote, urlsplit

CHUNK = 1 << 20
SYNC_EVERY = 32 << 20  # bytes written between records of progress (a cut loses at most this)
ATTEMPTS = 6  # tries of one range without progress before the hub counts as unreachable
TIMEOUT_S = 30.0
PROGRESS_EVERY_S = 0.5
RECORD_FORMAT = 1
USER_AGENT = "mvp-orchestrator/share-fetch"
_CONTENT_RANGE = re.compile(r"bytes ([0-9]+)-([0-9]+)/([0-9]+)")

Progress = Callable[[int, int], None]
"""Told the bytes of the share held so far and the share's size: at the start, about
twice a second while bytes come, and at the end."""

Span = tuple[int, int]


class ShareFetchError(Exception):
    """The share cannot be fetched as planned (refused, missing, changed or corrupt): another
    try would meet the same answer. The message names the repo, file and commit."""


class HubUnreachable(ConnectionError):
    """The hub could not be reached or kept failing (network, timeout, 5xx, 429) after
    ATTEMPTS tries without progress: worth another try later (what was fetched is kept)."""


def file_url(endpoint: str, repo: str, commit: str, file: str) -> str:
    """The hub's URL of ``file`` of ``repo`` at ``commit`` (what ``hf_hub_url`` builds)."""
    return f"{endpoint.rstrip('/')}/{repo}/resolve/{commit}/{quote(file)}"


# --------------------------------------------------------------------------- spans
def missing(held: list[Span], start: int, end: int) -> list[Span]:
    """The parts of ``[start, end)`` that ``held`` (sorted, disjoint) does not cover."""
    gaps: list[Span] = []
    pos = start
    for lo, hi in held:
        if hi <= pos:
            continue
        if lo >= end:
            break
        if lo > pos:
            gaps.append((pos, min(lo, end)))
        pos = max(pos, hi)
        if pos >= end:
            break
    if pos < end:
        gaps.append((pos, end))
    return gaps


def add_span(held: list[Span], start: int, end: int) -> list[Span]:
    """``held`` with ``[start, end)`` added, merged (sorted, disjoint, touching ones joined)."""
    out: list[Span] = []
    for lo, hi in sorted([*held, (start, end)]):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


# --------------------------------------------------------------------------- the cache file
class CacheFile:
    """One sparse file of the cache, locked for this fetcher while it is open."""

    def __init__(self, path: str, key: dict[str, Any]) -> None:
        self.path = path
        self.key = key  # commit, file, size, etag: what the held bytes belong to
        self.size = int(key["size"])
        self.record_path = path + ".ranges.json"
        directory = os.path.dirname(path) or "."
        os.makedirs(directory, exist_ok=True)
        self._lock = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        self.fd = -1
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX)
            self.held, self.verified = self._load()
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            # Never shortened while its size is right: a node of this host may have it
            # mapped (its path names one commit's file: whatever bytes it holds are that
            # file's or holes, and what the record does not name is fetched again).
            if os.fstat(self.fd).st_size != self.size:
                # Made now, or of another size: the record (if any) names bytes that are
                # not there.
                self.held, self.verified = [], False
                os.ftruncate(self.fd, self.size)  # the rest are holes until fetched
        except OSError as err:
            self._close()
            raise ShareFetchError(f"cannot use the model cache file {path}: {err}") from None
        except BaseException:
            self._close()
            raise

    def _load(self) -> tuple[list[Span], bool]:
        try:
            with open(self.record_path) as f:
                record = json.load(f)
        except (OSError, ValueError):
            return [], False
        if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT:
            return [], False
        if any(record.get(k) != v for k, v in self.key.items()):
            return [], False  # another commit or upload at this path: start over
        held: list[Span] = []
        for item in record.get("held", []):
            if (
                isinstance(item, list)
                and len(item) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) for x in item)
                and 0 <= item[0] < item[1] <= self.size
            ):
                held = add_span(held, item[0], item[1])
        return held, record.get("verified") is True and held == [(0, self.size)]

    def save(self) -> None:
        """Record what is held, once those bytes are on disk."""
        os.fdatasync(self.fd)
        record = {
            "format": RECORD_FORMAT,
            **self.key,
            "held": [list(s) for s in self.held],
            "verified": self.verified,
        }
        tmp = f"{self.record_path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, self.record_path)

    def mark(self, start: int, end: int) -> None:
        if end > start:
            self.held = add_span(self.held, start, end)
            self.save()

    def read(self, start: int, end: int) -> bytes:
        return os.pread(self.fd, end - start, start)

    def digest(self, start: int, end: int) -> str:
        h = hashlib.sha256()
        pos = start
        while pos < end:
            chunk = os.pread(self.fd, min(CHUNK * 8, end - pos), pos)
            if not chunk:
                break
            h.update(chunk)
            pos += len(chunk)
        return h.hexdigest()

    def discard(self) -> None:
        """Remove the file and its record (it failed a check): nothing of it is kept."""
        self.held, self.verified = [], False
        for p in (self.record_path, self.path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)

    def _close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        os.close(self._lock)  # releases the lock

    def close(self) -> None:
        self._close()

    def __enter__(self) -> CacheFile:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- HTTP
class _SameHostAuth(urllib.request.HTTPRedirectHandler):
    """Redirects as urllib follows them, the token kept where one stays on the same host
    (the hub's own, such as a renamed repo's) and dropped where it leaves it (the CDN)."""

    def __init__(self, token: str | None) -> None:
        self.token = token

    def redirect_request(
        self,
        req: urllib.request.Request,
        fp: Any,
        code: int,
        msg: str,
        headers: Any,
        newurl: str,
    ) -> urllib.request.Request | None:
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        same = urlsplit(newurl).netloc == urlsplit(req.full_url).netloc
        if new is not None and self.token and same:
            new.add_unredirected_header("Authorization", f"Bearer {self.token}")
        return new


class _Fetcher:
    """Range requests to one file of the hub (the token to the hub only: a redirect to its
    CDN goes without it, as huggingface_hub does)."""

    def __init__(self, pin: dict[str, Any], file: str, size: int, token: str | None) -> None:
        self.url = file_url(pin["endpoint"], pin["repo"], pin["commit"], file)
        self.what = f"{pin['repo']} {file} at {pin['commit'][:12]}"
        self.size = size
        self.token = token
        self.opener = urllib.request.build_opener(_SameHostAuth(token))

    def _scrub(self, text: str) -> str:
        return text.replace(self.token, "***") if self.token else text

    def open(self, start: int, end: int) -> Any:
        req = urllib.request.Request(
            self.url, headers={"Range": f"bytes={start}-{end - 1}", "User-Agent": USER_AGENT}
        )
        if self.token:
            # Not carried over a redirect (urllib drops "unredirected" headers): the CDN's
            # signed URL needs none, and the token goes nowhere but the hub.
            req.add_unredirected_header("Authorization", f"Bearer {self.token}")
        try:
            resp = self.opener.open(req, timeout=TIMEOUT_S)
        except urllib.error.HTTPError as err:
            code = err.code
            err.close()
            if code >= 500 or code in (408, 429):
                raise HubUnreachable(f"{self.what}: the hub answered HTTP {code}") from None
            if code in (401, 403):
                hint = "" if self.token else " (a private or gated repo needs HF_TOKEN)"
                raise ShareFetchError(
                    f"{self.what}: the hub refused access (HTTP {code}){hint}"
                ) from None
            if code == 404:
                raise ShareFetchError(f"{self.what}: not found on the hub (HTTP 404)") from None
            if code == 416:
                raise ShareFetchError(
                    f"{self.what}: bytes {start}-{end - 1} are past the end of the hub's file "
                    f"(the plan says {self.size} bytes: the file changed)"
                ) from None
            raise ShareFetchError(f"{self.what}: the hub answered HTTP {code}") from None
        except (urllib.error.URLError, OSError) as err:
            why = getattr(err, "reason", err)
            raise HubUnreachable(
                f"{self.what}: cannot reach the hub ({self._scrub(str(why))})"
            ) from None
        if resp.status == 200 and start == 0 and end == self.size:
            length = resp.headers.get("Content-Length")
            if length is not None and length.strip() == str(self.size):
                return resp  # the whole file, as a server may answer a range of all of it
        if resp.status != 206:
            resp.close()
            raise ShareFetchError(
                f"{self.what}: the hub answered HTTP {resp.status} to a range request, not 206"
            )
        got = _CONTENT_RANGE.fullmatch(resp.headers.get("Content-Range", "").strip())
        if got is None or (int(got[1]), int(got[2]) + 1) != (start, end):
            resp.close()
            raise ShareFetchError(
                f"{self.what}: the hub sent {resp.headers.get('Content-Range')!r} for bytes "
                f"{start}-{end - 1}"
            )
        if int(got[3]) != self.size:
            resp.close()
            raise ShareFetchError(
                f"{self.what}: the hub's file has {int(got[3])} bytes, the plan {self.size}: "
                "it changed since planning"
            )
        return resp


def _write_all(cache: CacheFile, data: bytes, pos: int) -> None:
    """``data`` at ``pos`` of the cache file, all of it (a short write is written on)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(cache.fd, view, pos)
        if n <= 0:
            raise OSError(f"wrote nothing at byte {pos}")
        view, pos = view[n:], pos + n


def _on_disk(cache: CacheFile, what: str, step: Callable[[], None]) -> None:
    """A write or sync of the cache file: a local failure (a full disk, an I/O error) is a
    ShareFetchError naming the file, not a network error to retry."""
    try:
        step()
    except OSError as err:
        raise ShareFetchError(
            f"{what}: cannot write the model cache file {cache.path}: {err}"
        ) from None


def _copy_range(
    fetcher: _Fetcher, cache: CacheFile, start: int, end: int, count: Callable[[int], None]
) -> None:
    """Bytes ``[start, end)`` into the cache, resuming after a cut; HubUnreachable after
    ATTEMPTS failures in a row without a byte of progress; ShareFetchError where the hub's
    answer or this host's disk is at fault."""
    pos = start
    failures = 0
    while pos < end:
        marked = pos
        try:
            resp = fetcher.open(pos, end)
            try:
                while pos < end:
                    chunk = resp.read(min(CHUNK, end - pos))
                    if not chunk:
                        raise ConnectionError("the connection closed mid-range")
                    _on_disk(cache, fetcher.what, partial(_write_all, cache, chunk, pos))
                    pos += len(chunk)
                    failures = 0
                    count(len(chunk))
                    if pos - marked >= SYNC_EVERY:
                        _on_disk(cache, fetcher.what, partial(cache.mark, marked, pos))
                        marked = pos
            finally:
                resp.close()
        except (OSError, http.client.HTTPException) as err:  # unreachable, timeouts, cuts
            _on_disk(cache, fetcher.what, partial(cache.mark, marked, pos))
            failures += 1
            if failures >= ATTEMPTS:
                if isinstance(err, HubUnreachable):
                    raise
                raise HubUnreachable(
                    f"{fetcher.what}: the download of bytes {pos}-{end - 1} kept failing "
                    f"({fetcher._scrub(str(err))}); {pos - start} bytes of the range are kept"
                ) from None
            time.sleep(min(0.25 * 2**failures, 4.0))
            continue
        _on_disk(cache, fetcher.what, partial(cache.mark, marked, pos))


# --------------------------------------------------------------------------- shares
def _grouped(share: dict[str, Any]) -> Iterator[tuple[int, list[Span]]]:
    by_part: dict[int, list[Span]] = {}
    for r in share["ranges"]:
        by_part.setdefault(int(r["part"]), []).append((int(r["start"]), int(r["end"])))
    for part in sorted(by_part):
        yield part, sorted(by_part[part])


def _key(pin: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
    """What a cache file's held bytes belong to (its record names it): a commit's file."""
    return {
        "commit": pin["commit"],
        "file": part["file"],
        "size": int(part["size"]),
        "etag": part["etag"],
    }


def fetch_share(
    share: dict[str, Any], token: str | None = None, progress: Progress | None = None
) -> int:
    """Make every range of ``share`` (a ``ModelShare`` as JSON) held at its path, checked;
    return the bytes fetched now (0 when the cache held them all). Raises ShareFetchError
    or HubUnreachable, naming the file."""
    pin = share["pin"]
    total = sum(int(r["end"]) - int(r["start"]) for r in share["ranges"])
    done = fetched = 0
    shown = 0.0

    def count(n: int, force: bool = False) -> None:
        nonlocal done, fetched, shown
        done += n
        fetched += n
        now = time.monotonic()
        if progress is not None and (force or now - shown >= PROGRESS_EVERY_S):
            shown = now
            progress(done, total)

    count(0, force=True)
    for index, spans in _grouped(share):
        part = pin["parts"][index]
        fetcher = _Fetcher(pin, part["file"], int(part["size"]), token)
        with CacheFile(share["paths"][index], _key(pin, part)) as cache:
            for start, end in spans:
                gaps = missing(cache.held, start, end)
                done += (end - start) - sum(hi - lo for lo, hi in gaps)  # held already
                for lo, hi in gaps:
                    _copy_range(fetcher, cache, lo, hi, count)
            check(cache, part, fetcher.what)
    count(0, force=True)
    return fetched


def check(cache: CacheFile, part: dict[str, Any], what: str) -> None:
    """The file's header is the one planned and, held whole, the file is the hub's (its
    sha256); else it is removed and ShareFetchError says which check failed."""
    header = int(part["header_bytes"])
    if missing(cache.held, 0, header):
        return  # the header is not part of this share (a caller fetching a prefix)
    got = cache.digest(0, header)
    if got != part["header_sha256"]:
        cache.discard()
        raise ShareFetchError(
            f"{what}: its header's sha256 {got} is not the one read at planning "
            f"({part['header_sha256']}): the hub's file changed or the download is corrupt; "
            "nothing of it was kept"
        )
    if cache.held == [(0, cache.size)] and part.get("sha256") and not cache.verified:
        got = cache.digest(0, cache.size)
        if got != part["sha256"]:
            cache.discard()
            raise ShareFetchError(
                f"{what}: the file's sha256 {got} is not the hub's {part['sha256']}; "
                "nothing of it was kept"
            )
        cache.verified = True
        cache.save()


def fetch_prefix(
    pin: dict[str, Any], part: dict[str, Any], path: str, end: int, token: str | None = None
) -> bytes:
    """The first ``end`` bytes of one file (fetched into its cache file where not held):
    how planning reads a header without fetching the model. ``part`` needs ``file``,
    ``size`` and ``etag``."""
    end = min(end, int(part["size"]))
    fetcher = _Fetcher(pin, part["file"], int(part["size"]), token)
    with CacheFile(path, _key(pin, part)) as cache:
        for lo, hi in missing(cache.held, 0, end):
            _copy_range(fetcher, cache, lo, hi, lambda _n: None)
        return cache.read(0, end)


# --------------------------------------------------------------------------- as a program
def main() -> int:
    """``python3 share_fetch.py``: one JSON object on stdin, ``{"share": ..., "token": ...}``;
    progress as JSON lines on stdout, ``{"done": n, "total": t}``, then ``{"fetched": n}``
    (exit 0) or ``{"error": text, "retry": bool}`` (exit 1)."""
    job = json.loads(sys.stdin.readline())

    def say(obj: dict[str, Any]) -> None:
        try:
            sys.stdout.write(json.dumps(obj) + "\n")
            sys.stdout.flush()
        except BrokenPipeError:
            # The provider's SSH session is gone: stop (the lock goes with the process;
            # what was fetched is recorded, and the next attempt resumes it).
            os._exit(3)

    try:
        fetched = fetch_share(
            job["share"], job.get("token") or None, lambda d, t: say({"done": d, "total": t})
        )
    except ShareFetchError as err:
        say({"error": str(err), "retry": False})
        return 1
    except HubUnreachable as err:
        say({"error": str(err), "retry": True})
        return 1
    say({"fetched": fetched})
    return 0


if __name__ == "__main__":
    sys.exit(main())
