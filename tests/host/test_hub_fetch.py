"""Hugging Face model sources fetched into the model cache of the host that runs the
nodes (issue 13), against a local stand-in for the hub (tests/helpers/hub_standin.py)
through the real ``huggingface_hub``: once, checked by size and hash, atomically, with
HF_TOKEN from the environment only, and clear errors for what goes wrong."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import workers.host.main as host_main
from mvp_core.host_config import HostConfig, HubGguf
from mvp_core.models import HubModel, ModelSource
from mvp_io import model_store
from mvp_io.model_store import (
    DownloadCancelled,
    HubUnreachableError,
    ModelSourceError,
    fetch_hub,
    resolve_model,
)
from tests.helpers.hub_standin import HubStandin, tiny_gguf
from workers.host import demo_args as demo
from workers.host import model_fetch
from workers.host.model_fetch import FetchProgress, model_download

REPO = "acme/tiny-GGUF"
FILE = "tiny.gguf"
TOKEN = "hf_hubFetchTestSecret_7d3a91"
SOURCE = HubModel(repo=REPO, file=FILE)


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf").read_bytes()


@pytest.fixture(scope="module")
def standin(gguf_bytes: bytes) -> Iterator[HubStandin]:
    with HubStandin() as hub:
        hub.add_file(REPO, FILE, gguf_bytes)
        hub.add_file(REPO, "plain/tiny.gguf", gguf_bytes, lfs=False)
        yield hub


@pytest.fixture
def hub(standin: HubStandin, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> HubStandin:
    """The stand-in with its switches off, this test's own model cache, no token."""
    import huggingface_hub.constants

    standin.require_token = None
    standin.truncate_after = None
    standin.wrong_hash = False
    standin.requests.clear()
    monkeypatch.setenv("MVP_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("HF_ENDPOINT", standin.url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    # No user-agent extras: the library would look up a registry of "agents" on the hub.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_TELEMETRY", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    return standin


def cache_files(root: Path) -> list[str]:
    """Every file in the model cache but the per-repo lock files."""
    if not root.exists():
        return []
    return sorted(
        str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != ".lock"
    )


class Calls:
    def __init__(self) -> None:
        self.seen: list[tuple[int, int | None]] = []

    def __call__(self, done: int, total: int | None) -> None:
        self.seen.append((done, total))


def test_a_hub_model_is_downloaded_once_and_then_reused(
    hub: HubStandin, tmp_path: Path, gguf_bytes: bytes
):
    calls = Calls()
    path = fetch_hub(SOURCE, calls)
    commit = hub.repos[REPO].refs["main"]
    assert path == tmp_path / "models" / "hf" / "acme--tiny-GGUF" / commit / FILE
    assert path.read_bytes() == gguf_bytes
    assert calls.seen[0] == (0, len(gguf_bytes)) and calls.seen[-1] == (len(gguf_bytes),) * 2
    assert len(hub.seen("cdn", "GET")) == 1
    record = model_store._verified(path, None)
    assert record is not None and record["sha256"] == hashlib.sha256(gguf_bytes).hexdigest()

    # Again: one HEAD shows the hub still names that file; nothing is downloaded.
    again = Calls()
    heads = len(hub.seen("hub", "HEAD"))
    assert fetch_hub(SOURCE, again) == path
    assert again.seen == [] and len(hub.seen("cdn", "GET")) == 1
    assert len(hub.seen("hub", "HEAD")) == heads + 1

    # A commit revision never changes: no request at all.
    before = len(hub.requests)
    assert fetch_hub(HubModel(repo=REPO, file=FILE, revision=commit)) == path
    assert len(hub.requests) == before
    assert cache_files(tmp_path / "models") == [
        f"hf/acme--tiny-GGUF/{commit}/{FILE}",
        f"hf/acme--tiny-GGUF/{commit}/{FILE}.json",
        "hf/acme--tiny-GGUF/refs/main",
    ]


def test_a_new_commit_on_the_revision_is_downloaded(hub: HubStandin, gguf_bytes: bytes):
    first = fetch_hub(SOURCE)
    hub.add_file(REPO, FILE, gguf_bytes + b"\0" * 32)
    second = fetch_hub(SOURCE)
    assert second != first and second.read_bytes() == gguf_bytes + b"\0" * 32
    assert first.read_bytes() == gguf_bytes  # the other commit's file is left as it was
    hub.add_file(REPO, FILE, gguf_bytes)  # back to what the other tests expect


def test_a_file_outside_lfs_is_checked_by_its_git_blob_id(hub: HubStandin, gguf_bytes: bytes):
    source = HubModel(repo=REPO, file="plain/tiny.gguf")
    assert fetch_hub(source).read_bytes() == gguf_bytes
    assert hub.seen("cdn") == []  # served by the hub itself, no redirect


def test_the_token_goes_to_the_hub_only_and_appears_in_no_message(
    hub: HubStandin, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.DEBUG)
    hub.require_token = TOKEN
    with pytest.raises(ModelSourceError) as no_token:
        fetch_hub(SOURCE)
    assert str(no_token.value) == (
        f"Hugging Face model {REPO} file '{FILE}' at revision 'main': the hub needs a token "
        f"for {REPO} (HTTP 401: the repo is private or gated, or does not exist); set "
        "HF_TOKEN in the environment of the orchestrator worker that runs the nodes"
    )
    wrong = "hf_wrongTokenValue_0000"
    monkeypatch.setenv("HF_TOKEN", wrong)
    with pytest.raises(ModelSourceError, match="the hub refused the token in HF_TOKEN") as refused:
        fetch_hub(SOURCE)
    assert wrong not in str(refused.value)

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    path = fetch_hub(SOURCE)
    assert path.is_file()
    assert {r.authorization for r in hub.seen("hub")} == {
        None,
        f"Bearer {wrong}",
        f"Bearer {TOKEN}",
    }
    assert hub.seen("cdn") and all(r.authorization is None for r in hub.seen("cdn"))
    record = (path.parent / f"{path.name}.json").read_text()
    assert TOKEN not in record and wrong not in record
    for text in [r.getMessage() for r in caplog.records]:
        assert TOKEN not in text and wrong not in text


@pytest.mark.parametrize(
    ("source", "token", "message"),
    [
        (
            HubModel(repo=REPO, file=FILE, revision="v9"),
            None,
            f"Hugging Face model {REPO} file '{FILE}' at revision 'v9': revision 'v9' not found "
            f"in {REPO}",
        ),
        (
            HubModel(repo=REPO, file="missing.gguf"),
            None,
            f"Hugging Face model {REPO} file 'missing.gguf' at revision 'main': file "
            f"'missing.gguf' not found in {REPO} at revision 'main'",
        ),
        (
            HubModel(repo="acme/none", file=FILE),
            TOKEN,
            f"Hugging Face model acme/none file '{FILE}' at revision 'main': repo acme/none not "
            "found, or the token in HF_TOKEN has no access to it",
        ),
    ],
)
def test_what_the_hub_does_not_have_is_a_clear_error_and_leaves_nothing(
    hub: HubStandin,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    source: HubModel,
    token: str | None,
    message: str,
):
    if token:
        monkeypatch.setenv("HF_TOKEN", token)
    with pytest.raises(ModelSourceError) as info:
        fetch_hub(source)
    assert str(info.value) == message
    assert cache_files(tmp_path / "models") == []


def test_a_truncated_download_is_rejected_and_nothing_half_written_is_kept(
    hub: HubStandin, tmp_path: Path, gguf_bytes: bytes
):
    hub.truncate_after = 100  # every response stops there: resuming gets nothing more
    with pytest.raises(ModelSourceError) as info:
        fetch_hub(SOURCE)
    assert str(info.value).startswith(
        f"Hugging Face model {REPO} file '{FILE}' at revision 'main': the download was cut "
        "short or incomplete ("
    )
    assert str(info.value).endswith("; nothing was kept")
    assert len(hub.seen("cdn", "GET")) > 1  # the library resumed before it gave up
    assert cache_files(tmp_path / "models") == []
    assert not list((tmp_path / "models").rglob(".download-*"))
    hub.truncate_after = None
    assert fetch_hub(SOURCE).read_bytes() == gguf_bytes


def test_a_download_that_is_not_the_hubs_file_is_rejected_by_its_hash(
    hub: HubStandin, tmp_path: Path
):
    hub.wrong_hash = True  # the same size, one byte changed
    with pytest.raises(
        ModelSourceError, match=r"the download's sha256 [0-9a-f]{64} is not the hub's"
    ):
        fetch_hub(SOURCE)
    with pytest.raises(ModelSourceError, match=r"the download's git blob id [0-9a-f]{40} is not"):
        fetch_hub(HubModel(repo=REPO, file="plain/tiny.gguf"))
    assert cache_files(tmp_path / "models") == []


def test_a_file_that_is_not_a_gguf_is_rejected(hub: HubStandin, tmp_path: Path):
    hub.add_file("acme/html", "page.gguf", b"<!doctype html><title>Sign in</title>")
    with pytest.raises(ModelSourceError, match="the file is not a GGUF file; nothing was kept"):
        fetch_hub(HubModel(repo="acme/html", file="page.gguf"))
    assert cache_files(tmp_path / "models") == []


def test_an_unreachable_hub_is_worth_a_retry_unless_the_cache_has_the_revision(
    hub: HubStandin, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(HubUnreachableError) as info:
        fetch_hub(SOURCE)
    assert str(info.value).startswith(
        f"Hugging Face model {REPO} file '{FILE}' at revision 'main': cannot reach the hub "
        "at http://127.0.0.1:9 ("
    )
    assert not isinstance(info.value, ModelSourceError)  # planning retries it
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    path = fetch_hub(SOURCE)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    caplog.set_level(logging.WARNING, logger="mvp.models")
    assert fetch_hub(SOURCE) == path
    assert "unreachable; using the cached acme/tiny-GGUF/tiny.gguf@main" in caplog.text


def test_offline_mode_is_an_unreachable_hub(hub: HubStandin, monkeypatch: pytest.MonkeyPatch):
    import huggingface_hub.constants

    path = fetch_hub(SOURCE)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(HubUnreachableError, match="offline mode is enabled"):
        fetch_hub(HubModel(repo=REPO, file="plain/tiny.gguf"))
    assert fetch_hub(SOURCE) == path  # the revision's last commit, from the cache


def test_a_cancelled_download_keeps_nothing(hub: HubStandin, tmp_path: Path):
    def cancel(done: int, total: int | None) -> None:
        raise DownloadCancelled("stop")

    with pytest.raises(DownloadCancelled):
        fetch_hub(SOURCE, cancel)
    assert cache_files(tmp_path / "models") == []


def test_a_run_resolves_a_hub_source_and_a_worker_logs_the_download(
    hub: HubStandin, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.INFO, logger="mvp.models")
    path = resolve_model(ModelSource(hf=SOURCE))
    assert Path(path).is_file()
    assert f"downloading {SOURCE.describe()} (" in caplog.text
    assert f"downloaded {SOURCE.describe()} in " in caplog.text


# --------------------------------------------------------------------------- host and demo


class Stream:
    """What FetchProgress needs of the host's datastream."""

    def __init__(self) -> None:
        self.records: list[tuple[str, str, Any]] = []

    def bootstrap(self, phase: str, status: str, detail: Any = None) -> None:
        self.records.append((phase, str(status), detail))


def test_the_host_shows_a_hub_download_on_stderr_and_in_its_datastream(
    hub: HubStandin, gguf_bytes: bytes, capsys: pytest.CaptureFixture[str]
):
    download = model_download(ModelSource(hf=SOURCE))
    assert download is not None
    what, origin, fetch = download
    assert (what, origin) == (f"{REPO} {FILE} at main", hub.url)
    stream = Stream()
    progress = FetchProgress(stream, what, origin, asyncio.Event())  # type: ignore[arg-type]
    fetch(progress)
    progress.finish()
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(
        f"mvp-orchestrator: downloading {REPO} {FILE} at main (once, from {hub.url}, "
    )
    assert err[-1].startswith(f"mvp-orchestrator:   done: {len(gguf_bytes) / 1e6:.1f} MB in ")
    assert [(p, s) for p, s, _ in stream.records] == [
        ("model_fetch", "started"),
        ("model_fetch", "ready"),
    ]
    assert stream.records[0][2]["bytes_total"] == len(gguf_bytes)
    # Cached: the host shows nothing.
    quiet = FetchProgress(stream, what, origin, asyncio.Event())  # type: ignore[arg-type]
    fetch(quiet)
    quiet.finish()
    assert capsys.readouterr().err == "" and len(stream.records) == 2


def test_the_hosts_progress_shows_tenths_and_a_stop_cancels(monkeypatch: pytest.MonkeyPatch):
    lines: list[str] = []
    monkeypatch.setattr(model_fetch, "say", lines.append)
    stop = asyncio.Event()
    progress = FetchProgress(Stream(), "m", "here", stop)  # type: ignore[arg-type]
    mb = 1_000_000
    for done in (0, 5, 12, 19, 35, 100):
        progress(done * mb, 100 * mb)
    assert lines[1:] == ["  12.0 of 100.0 MB (10%)", "  35.0 of 100.0 MB (30%)"]
    stop.set()
    with pytest.raises(DownloadCancelled):
        progress(100 * mb, 100 * mb)


def test_the_demo_takes_a_hub_model_and_shows_its_download(
    hub: HubStandin, capsys: pytest.CaptureFixture[str]
):
    source = demo.model_source(f"hf:{REPO}/{FILE}")
    assert source == ModelSource(hf=SOURCE)
    assert demo.model_source(f"hf:{REPO}/plain/tiny.gguf@v1").hf == HubModel(
        repo=REPO, file="plain/tiny.gguf", revision="v1"
    )
    with pytest.raises(demo.DemoError, match=r"^--model hf:acme/x/\.\./m\.gguf: file: "):
        demo.model_source("hf:acme/x/../m.gguf")
    demo.fetch_model(source)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"downloading {REPO} {FILE} at main (once, from {hub.url}, ")
    assert out[-1].startswith("  done in ")
    demo.fetch_model(source)  # cached: silent
    assert capsys.readouterr().out == ""
    hub.require_token = TOKEN
    with pytest.raises(demo.DemoError, match="the hub needs a token"):
        demo.fetch_model(ModelSource(hf=HubModel(repo=REPO, file=FILE, revision="other")))


def embedded_host(stream: Stream) -> host_main.Host:
    """A host as it is once its embedded dev server and worker run (this host then runs
    the nodes, so it fetches the model itself before it starts the run)."""
    cfg = HostConfig(gguf_source=HubGguf(repo=REPO, file=FILE))
    h = host_main.Host(cfg, stream, "unix:/nowhere")  # type: ignore[arg-type]
    h.server = object()  # type: ignore[assignment]
    return h


async def test_the_embedded_host_fetches_the_model_before_the_run(
    hub: HubStandin, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    stream = Stream()
    assert await embedded_host(stream)._fetch_model() is True
    assert "mvp-orchestrator:   done: " in capsys.readouterr().err
    assert [s for _, s, _ in stream.records] == ["started", "ready"]
    assert len(cache_files(tmp_path / "models")) == 3
    hub.require_token = TOKEN  # without HF_TOKEN: the host exits 1 with the hub's reason
    cfg = HostConfig(gguf_source=HubGguf(repo=REPO, file=FILE, revision="v2"))
    failing = host_main.Host(cfg, stream, "unix:/nowhere")  # type: ignore[arg-type]
    failing.server = object()  # type: ignore[assignment]
    with pytest.raises(host_main.HostError, match="the hub needs a token for acme/tiny-GGUF"):
        await failing._fetch_model()


async def test_a_stop_during_the_hosts_download_starts_no_run_and_keeps_nothing(
    hub: HubStandin, tmp_path: Path
):
    stream = Stream()
    h = embedded_host(stream)
    h.stop.set()
    assert await h._fetch_model() is False
    assert stream.records == []  # stopped at its first report, before it showed anything
    assert cache_files(tmp_path / "models") == []


SPLIT_REPO = "acme/split-GGUF"


@pytest.fixture(scope="module")
def split_parts(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """A small GGUF of three tensors, as three parts (scripts/gguf_split.py: gguf-split's
    format and names)."""
    import gguf
    import numpy as np

    from scripts.gguf_split import split_gguf

    d = tmp_path_factory.mktemp("split")
    writer = gguf.GGUFWriter(d / "three.gguf", "llama")
    writer.add_uint32("llama.block_count", 2)
    for i, name in enumerate(["token_embd.weight", "blk.0.attn_q.weight", "output.weight"]):
        writer.add_tensor(name, np.full((8, 8), i, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return split_gguf(d / "three.gguf", d / "three", 3)


def test_a_split_model_is_fetched_whole_from_one_commit(
    hub: HubStandin, split_parts: list[Path]
) -> None:
    """Naming the first part fetches every part, pinned to the commit the revision named
    for the first, into one folder: the model opens as one (mvp_io.gguf_files)."""
    from mvp_io.gguf_files import open_model

    for part in split_parts:
        hub.add_file(SPLIT_REPO, f"q4/{part.name}", part)
    commit = hub.add_file(SPLIT_REPO, "README.md", b"the parts' commit's child")
    source = HubModel(repo=SPLIT_REPO, file=f"q4/{split_parts[0].name}")
    first = Path(resolve_model(ModelSource(hf=source)))
    assert first.parent.parent.name == commit and first.name == split_parts[0].name
    with open_model(str(first)) as model:
        fetched = [Path(p) for p in model.paths]
    assert [p.name for p in fetched] == [p.name for p in split_parts]
    assert [p.read_bytes() for p in fetched] == [p.read_bytes() for p in split_parts]
    later = [r.path for r in hub.seen("hub") if split_parts[0].name not in r.path]
    assert later and all(f"/resolve/{commit}/q4/" in path for path in later)


def test_a_split_part_the_hub_lacks_or_a_later_part_named_is_refused(
    hub: HubStandin, split_parts: list[Path]
) -> None:
    repo = "acme/split-short-GGUF"
    for part in split_parts[:2]:
        hub.add_file(repo, part.name, part)
    with pytest.raises(ModelSourceError, match=split_parts[2].name):
        resolve_model(ModelSource(hf=HubModel(repo=repo, file=split_parts[0].name)))
    with pytest.raises(ModelSourceError, match="is part 2 of 3 of a split model: name its first"):
        resolve_model(ModelSource(hf=HubModel(repo=repo, file=split_parts[1].name)))


async def test_the_host_leaves_a_hub_model_to_rented_nodes(hub: HubStandin, tmp_path: Path) -> None:
    """A Vast.ai run of a hub model: its instances fetch their shares from the hub
    (DECISIONS 72), so the host downloads nothing before the run."""
    from mvp_core.models import ProviderKind

    cfg = HostConfig.model_validate(
        {
            "gguf_source": HubGguf(repo=REPO, file=FILE),
            "provider": ProviderKind.VASTAI,
            "vastai": {
                "api_key": "vast-key",
                "ssh_identity": tmp_path / "id",
                "run": {"image": "mvp-node:test", "bootstrap_command": "true"},
            },
        }
    )
    stream = Stream()
    h = host_main.Host(cfg, stream, "unix:/nowhere")  # type: ignore[arg-type]
    h.server = object()  # type: ignore[assignment]
    assert await h._fetch_model() is True
    assert stream.records == [] and hub.requests == []
    assert cache_files(tmp_path / "models") == []
