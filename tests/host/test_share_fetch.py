"""A hub model planned from its headers and fetched by shares (issue 35, DECISIONS 72):
planning reads only each file's header by range requests; each node's host fetches only
its stage's share (headers, its tensors) into a sparse file of its model cache, shared
by the nodes of that host, resumable after a cut, checked against the plan; a stage loads
from that share alone. Against the hub stand-in, on SmolLM2-135M split in 3 parts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.gguf_facts import read_model
from activities.providers.base import NodeStartFailed
from activities.provisioning import ProviderActivities
from mvp_core.gguf_header import GGUFHeader
from mvp_core.models import HubModel, HubPin, ModelShare, NodeProvisionSpec, ProviderKind
from mvp_core.stage_share import share_ranges, stage_tensors
from mvp_io import share_fetch
from mvp_io.gguf_files import open_model
from mvp_io.model_store import (
    DEFAULT_BUNDLED,
    ModelSourceError,
    fetch_bundled,
    pin_hub_model,
)
from mvp_io.share_fetch import HubUnreachable, ShareFetchError, fetch_share
from scripts.gguf_split import split_gguf
from tests.activities.test_datastream_bus import spec as node_spec
from tests.helpers.hub_standin import HubStandin
from workers.node.engine import EngineOptions, load_stage
from workers.node.engine.gguf_reader import GGUFFile

REPO = "acme/smollm-split-GGUF"
TOKEN = "hf_shareFetchTestSecret_51c0e2"
STAGES = [(0, 10), (10, 20), (20, 30)]  # SmolLM2-135M's 30 layers in 3 stages


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return split_gguf(fetch_bundled(DEFAULT_BUNDLED), tmp_path_factory.mktemp("p") / "smollm", 3)


@pytest.fixture(scope="module")
def standin(parts: list[Path]) -> Iterator[HubStandin]:
    with HubStandin() as hub:
        for part in parts:
            hub.add_file(REPO, f"q4/{part.name}", part)
        yield hub


@pytest.fixture
def hub(standin: HubStandin, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> HubStandin:
    standin.require_token = None
    standin.truncate_after = None
    standin.wrong_hash = False
    standin.requests.clear()
    standin.sent.clear()
    monkeypatch.setenv("MVP_MODELS_DIR", str(tmp_path / "planner"))
    monkeypatch.setenv("HF_ENDPOINT", standin.url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return standin


def source(parts: list[Path]) -> HubModel:
    return HubModel(repo=REPO, file=f"q4/{parts[0].name}")


def shares(paths: list[str], pin: HubPin, root: Path) -> list[ModelShare]:
    """Each stage's share, at the same files under ``root`` (another host's cache)."""
    with open_model(paths[0]) as model:
        header = model.header
    node_paths = [str(root / p.file) for p in pin.parts]
    out = []
    for i, (start, end) in enumerate(STAGES):
        ranges = share_ranges(
            header,
            [p.header_bytes for p in pin.parts],
            start,
            end,
            first=i == 0,
            last=i == len(STAGES) - 1,
        )
        out.append(ModelShare(pin=pin, paths=node_paths, ranges=ranges))
    return out


def test_planning_reads_the_headers_alone_and_sees_the_whole_models_facts(
    hub: HubStandin, parts: list[Path]
) -> None:
    paths, pin = pin_hub_model(source(parts))
    total = sum(p.stat().st_size for p in parts)
    assert [Path(p).name for p in paths] == [p.name for p in parts]
    assert [p.size for p in pin.parts] == [p.stat().st_size for p in parts]
    # Only the headers moved: a few MB of a 98 MB model (the tokenizer is in the first).
    assert hub.bytes_sent() < 0.05 * total
    assert all(r.range is not None for r in hub.seen("cdn", "GET"))
    facts, files, _ = read_model(paths[0])
    whole, _, _ = read_model(str(fetch_bundled(DEFAULT_BUNDLED)))
    assert facts == whole and files == paths
    # Sparse: the files have their full size and hold almost nothing on disk.
    assert all(os.stat(p).st_size == q.stat().st_size for p, q in zip(paths, parts, strict=True))
    assert sum(os.stat(p).st_blocks * 512 for p in paths) < 0.1 * total


def test_each_stage_fetches_its_share_alone_and_loads_from_it(
    hub: HubStandin, parts: list[Path], tmp_path: Path
) -> None:
    """Three hosts, one stage each: each fetches exactly its share's bytes; the stage loads
    from them, touching only its own tensors, whose bytes are the whole model's."""
    paths, pin = pin_hub_model(source(parts))
    total = sum(p.stat().st_size for p in parts)
    whole = GGUFFile(str(parts[0]))
    try:
        for i, share in enumerate(shares(paths, pin, tmp_path / "x")):
            host = tmp_path / f"host{i}"
            share = share.model_copy(update={"paths": [str(host / p.file) for p in pin.parts]})
            before = hub.bytes_sent()
            seen = Seen()
            fetched = fetch_share(share.model_dump(mode="json"), None, seen)
            assert fetched == share.size == hub.bytes_sent() - before
            assert seen.calls[0] == (0, share.size) and seen.calls[-1] == (share.size, share.size)
            start, end = STAGES[i]
            tensors = stage_tensors(whole_header(parts), start, end, first=i == 0, last=i == 2)
            mine = {t.name for t in tensors}
            # Its tensors and the headers, and at most the tensors' alignment padding.
            own = sum(t.n_bytes for t in tensors) + sum(p.header_bytes for p in pin.parts)
            assert own <= share.size <= own + 32 * len(tensors) and share.size < 0.6 * total
            stage = load_stage(share.paths[0], start, end, EngineOptions(threads=1))
            try:
                assert set(stage.tensor_names_loaded) <= mine
                f = GGUFFile(share.paths[0])
                try:
                    for name in mine:
                        assert bytes(f.raw(name)) == bytes(whole.raw(name)), name
                finally:
                    f.close()
            finally:
                stage.close()
    finally:
        whole.close()


class Seen:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def __call__(self, done: int, total: int) -> None:
        self.calls.append((done, total))


def whole_header(parts: list[Path]) -> GGUFHeader:
    with open_model(str(parts[0])) as model:
        return model.header


def test_the_nodes_of_one_host_share_its_cache(
    hub: HubStandin, parts: list[Path], tmp_path: Path
) -> None:
    paths, pin = pin_hub_model(source(parts))
    first, second, _ = shares(paths, pin, tmp_path / "host")
    planning = hub.bytes_sent()
    got = [fetch_share(s.model_dump(mode="json")) for s in (first, second, first)]
    assert got[0] == first.size
    # The second node's share less what the first's left in the cache (the headers).
    held = [(r.part, r.start, r.end) for r in first.ranges]
    overlap = sum(
        max(0, min(r.end, e) - max(r.start, s))
        for r in second.ranges
        for p, s, e in held
        if p == r.part
    )
    assert overlap >= sum(p.header_bytes for p in pin.parts)
    assert got[1] == second.size - overlap
    assert got[2] == 0
    assert hub.bytes_sent() - planning == sum(got)


def test_a_cut_fetch_resumes_where_it_stopped(
    hub: HubStandin, parts: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths, pin = pin_hub_model(source(parts))
    share = shares(paths, pin, tmp_path / "host")[1]
    longest = max(share.ranges, key=lambda r: r.size)
    hub.truncate_after = longest.start + longest.size // 2  # every answer stops there
    monkeypatch.setattr(share_fetch, "ATTEMPTS", 2)
    before = hub.bytes_sent()
    with pytest.raises(HubUnreachable, match="kept failing"):
        fetch_share(share.model_dump(mode="json"))
    cut = hub.bytes_sent() - before
    assert 0 < cut < share.size
    hub.truncate_after = None
    assert fetch_share(share.model_dump(mode="json")) == share.size - cut  # only the rest
    record = json.loads(Path(share.paths[longest.part] + ".ranges.json").read_text())
    held = [(a, b) for a, b in record["held"]]
    assert share_fetch.missing(held, longest.start, longest.end) == []


def test_a_file_other_than_the_planned_one_fails_clearly_and_leaves_nothing(
    hub: HubStandin, parts: list[Path], tmp_path: Path
) -> None:
    paths, pin = pin_hub_model(source(parts))
    share = shares(paths, pin, tmp_path / "host")[2]
    # A size other than the hub's: the file changed since planning.
    bigger = pin.model_copy(
        update={"parts": [p.model_copy(update={"size": p.size + 10}) for p in pin.parts]}
    )
    wrong = share.model_copy(update={"pin": bigger}).model_dump(mode="json")
    with pytest.raises(ShareFetchError, match=r"bytes, the plan .*: it changed since planning"):
        fetch_share(wrong)
    # A header other than the one planned: removed, with its record.
    other = pin.model_copy(
        update={"parts": [p.model_copy(update={"header_sha256": "0" * 64}) for p in pin.parts]}
    )
    with pytest.raises(
        ShareFetchError, match=r"header's sha256 .* is not the one read at planning"
    ):
        fetch_share(share.model_copy(update={"pin": other}).model_dump(mode="json"))
    assert not Path(share.paths[0]).exists()
    assert not Path(share.paths[0] + ".ranges.json").exists()
    # A whole file is checked by its sha256: a corrupt download is not kept.
    hub.wrong_hash = True
    whole = ModelShare(
        pin=pin,
        paths=share.paths,
        ranges=[{"part": i, "start": 0, "end": p.size} for i, p in enumerate(pin.parts)],
    )
    with pytest.raises(ShareFetchError, match=r"the file's sha256 .* is not the hub's"):
        fetch_share(whole.model_dump(mode="json"))
    assert not Path(share.paths[0]).exists()
    hub.wrong_hash = False
    assert fetch_share(whole.model_dump(mode="json")) == sum(p.size for p in pin.parts)
    for path, part in zip(whole.paths, parts, strict=True):
        assert Path(path).read_bytes() == part.read_bytes()
        assert json.loads(Path(path + ".ranges.json").read_text())["verified"] is True


def test_the_token_goes_to_the_hub_only_and_a_missing_one_is_named(
    hub: HubStandin, parts: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    _, public = pin_hub_model(source(parts))
    assert public.needs_token is False  # a public repo: the token goes to no node
    hub.require_token = TOKEN
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(ModelSourceError, match="HF_TOKEN"):
        pin_hub_model(source(parts))
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    paths, pin = pin_hub_model(source(parts))
    assert pin.needs_token is True
    share = shares(paths, pin, tmp_path / "host")[0].model_dump(mode="json")
    with pytest.raises(ShareFetchError, match=r"refused access .*HF_TOKEN") as err:
        fetch_share(share, None)
    assert TOKEN not in str(err.value)
    hub.requests.clear()
    assert fetch_share(share, TOKEN) > 0
    assert {r.authorization for r in hub.seen("hub")} == {f"Bearer {TOKEN}"}
    assert hub.seen("cdn") and all(r.authorization is None for r in hub.seen("cdn"))


def test_the_fetcher_runs_as_a_program_with_the_standard_library_alone(
    hub: HubStandin, parts: list[Path], tmp_path: Path
) -> None:
    """What a rented instance runs: the file alone, ``python3 -I`` (no project, no site
    packages), the job and token on stdin, progress and the result as JSON lines."""
    paths, pin = pin_hub_model(source(parts))
    share = shares(paths, pin, tmp_path / "remote")[1]
    script = tmp_path / "share_fetch.py"
    script.write_bytes(Path(share_fetch.__file__).read_bytes())
    job = json.dumps({"share": share.model_dump(mode="json"), "token": None}) + "\n"
    done = subprocess.run(
        [sys.executable, "-I", "-S", str(script)],
        input=job.encode(),
        capture_output=True,
        cwd=tmp_path,
        timeout=120,
        check=False,
    )
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert lines[-1] == {"fetched": share.size}
    assert lines[0] == {"done": 0, "total": share.size}
    broken = json.loads(job)
    broken["share"]["pin"]["parts"][1]["size"] += 1
    failed = subprocess.run(
        [sys.executable, "-I", "-S", str(script)],
        input=(json.dumps(broken) + "\n").encode(),
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert failed.returncode == 1
    last = json.loads(failed.stdout.splitlines()[-1])
    assert last["retry"] is False and "changed since planning" in last["error"]


async def test_a_hub_run_is_planned_with_each_stages_share(
    hub: HubStandin, parts: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The planning activity pins the model from its headers and gives each stage its
    ranges; the run's node specs carry them (RunPlan.share_of). A host that already holds
    the files whole (the host's own download) plans with those instead: no shares."""
    from temporalio.testing import ActivityEnvironment

    import activities.planning as planning
    from mvp_core.models import ModelSource, PreparePlanInput, ProviderKind
    from mvp_io.model_store import fetch_hub_model

    inp = PreparePlanInput(
        run_id=8,
        orchestrator_node_id=0,
        node_id=1,
        model=ModelSource(hf=source(parts)),
        tokenizer=None,
        pipeline_stages=3,
        max_context=None,
        provider=ProviderKind.VASTAI,  # no check of this host's memory
    )
    plan = await ActivityEnvironment().run(planning.plan_run, inp)
    assert plan.hub is not None and [p.file for p in plan.hub.parts] == [
        f"q4/{p.name}" for p in parts
    ]
    assert [Path(p).name for p in plan.model_files] == [p.name for p in parts]
    assert hub.bytes_sent() < 0.05 * sum(p.size for p in plan.hub.parts)
    for stage in plan.stages:
        share = plan.share_of(stage.stage_index)
        assert share is not None and share.ranges == stage.fetch
        assert share.paths == plan.model_files
        # Each file's header is in every share.
        assert all(
            any(r.part == i and r.start == 0 and r.end >= p.header_bytes for r in stage.fetch)
            for i, p in enumerate(plan.hub.parts)
        )
    layers = [s.layers for s in plan.stages]
    assert [(r.start, r.end) for r in layers] == [(0, 10), (10, 20), (20, 30)]

    fetch_hub_model(source(parts))  # the host's whole download
    again = await ActivityEnvironment().run(planning.plan_run, inp)
    assert again.hub is None and all(s.fetch == [] for s in again.stages)
    assert "/ranged/" not in again.model_path and again.share_of(0) is None
    # The hub down: the files this host holds whole still plan the run.
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    offline = await ActivityEnvironment().run(planning.plan_run, inp)
    assert offline.hub is None and offline.model_path == again.model_path


class _StartFails:
    """A provider whose start fails after the fetch (what the test watches is the fetch)."""

    def check(self, spec_gpus: str | None) -> None:
        return None

    def start(self, spec: NodeProvisionSpec, progress: object = None) -> None:
        raise NodeStartFailed("no node in this test")


class _FetchesOnItsHost:
    """A provider whose node fetches its share on its own host (as Vast.ai's does): it
    tells the start's progress as that fetch goes, then fails (the test watches the
    heartbeats)."""

    def __init__(self, total: int) -> None:
        self.total = total

    def check(self, spec_gpus: str | None) -> None:
        return None

    def start(self, spec: NodeProvisionSpec, progress: object = None) -> None:
        assert callable(progress)
        for held in (0, self.total // 2, self.total):
            progress(held, self.total)
            time.sleep(0.6)  # past the activity's 1 s heartbeat between two tellings
        raise NodeStartFailed("no node in this test")


async def test_a_share_fetched_on_the_nodes_own_host_heartbeats_its_progress(
    hub: HubStandin, parts: list[Path], tmp_path: Path
) -> None:
    """A Vast.ai node fetches its share on its instance, during the provider's start: the
    start activity's heartbeats carry that fetch as they carry one made here, and nothing
    is fetched on this host."""
    paths, pin = pin_hub_model(source(parts))
    share = shares(paths, pin, tmp_path / "host")[1]
    spec = node_spec(99103).model_copy(
        update={"node_id": 4, "provider": ProviderKind.VASTAI, "model_share": share}
    )
    beats: list[object] = []
    env = ActivityEnvironment()
    env.on_heartbeat = lambda *details: beats.extend(details)
    acts = ProviderActivities({ProviderKind.VASTAI: _FetchesOnItsHost(share.size)})  # type: ignore[dict-item]
    with pytest.raises(ApplicationError, match="no node in this test"):
        await env.run(acts.start_node, spec)
    fetches = [b["fetch"] for b in beats if isinstance(b, dict) and "fetch" in b]
    assert {(f["node_id"], f["bytes_total"]) for f in fetches} == {(4, share.size)}
    held = [f["bytes_held"] for f in fetches]
    assert held == sorted(held) and held[-1] > 0, held
    assert fetch_share(share.model_dump(mode="json")) == share.size  # not fetched here


def test_a_remote_fetchers_progress_lines_are_read_as_untrusted():
    from activities.providers.vastai.ssh import _progress_line

    assert _progress_line({"done": 3, "total": 10}) == (3, 10)
    for bad in (
        {"done": "3", "total": 10},
        {"done": 11, "total": 10},
        {"done": -1, "total": 10},
        {"done": True, "total": 10},
        {"done": 1.5, "total": 10},
        {"done": 1, "total": 10**400},  # a figure no share has (and no float holds)
        {"fetched": 10},
        {"error": "x"},
    ):
        assert _progress_line(bad) is None, bad


async def test_the_start_activity_heartbeats_the_fetchs_progress(
    hub: HubStandin, parts: list[Path], tmp_path: Path
) -> None:
    """A node's share fetched in its start activity: the activity's heartbeats carry the
    fetch so far (what the Temporal Web UI and ``temporal workflow describe`` show of a
    pending start), and the share is held when the node's start comes."""
    paths, pin = pin_hub_model(source(parts))
    share = shares(paths, pin, tmp_path / "host")[1]
    spec = node_spec(99102).model_copy(
        update={"node_id": 3, "provider": ProviderKind.PROCESS, "model_share": share}
    )
    beats: list[object] = []
    env = ActivityEnvironment()
    env.on_heartbeat = lambda *details: beats.extend(details)
    acts = ProviderActivities({ProviderKind.PROCESS: _StartFails()})  # type: ignore[dict-item]
    with pytest.raises(ApplicationError, match="no node in this test"):
        await env.run(acts.start_node, spec)
    fetches = [b["fetch"] for b in beats if isinstance(b, dict) and "fetch" in b]
    assert fetches, beats
    assert {(f["node_id"], f["stage_index"], f["bytes_total"]) for f in fetches} == {
        (3, 1, share.size)
    }
    assert all(0 <= f["bytes_held"] <= share.size for f in fetches)
    assert fetch_share(share.model_dump(mode="json")) == 0  # held whole before the start
