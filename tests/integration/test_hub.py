"""A run whose model comes from the Hugging Face hub (issue 13): the orchestrator worker,
pointed at a local stand-in for the hub (tests/helpers/hub_standin.py) by ``HF_ENDPOINT``
and holding ``HF_TOKEN`` (the session's SECRET, which the stand-in requires), fetches the
real bundled SmolLM2 GGUF into its model cache while it plans, and real nodes serve a
prompt from it. The token reaches the hub and nothing else: not the CDN, not the run's
history, queries or logs (the session's secret scan covers this module's runs too)."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from mvp_core import names
from mvp_core.models import Done, RunPhase, SubmitPrompt
from mvp_io.model_store import DEFAULT_BUNDLED, fetch_bundled
from temporal.client import RunHandle
from tests.helpers.hub_standin import HubStandin
from tests.helpers.secret_scan import scan
from tests.integration.conftest import (
    EDGE_SECRET,
    SECRET,
    OrchestratorProcess,
    Runs,
    orchestrator_with_hub,
    run_failure,
    snapshot,
    wait_phase,
)

REPO = "mvp-test/SmolLM2-135M-Instruct-GGUF"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def hub(orchestrator: OrchestratorProcess, session_dir: Path) -> Iterator[HubStandin]:
    """The stand-in serving the bundled model, and the session's orchestrator worker
    restarted with ``HF_ENDPOINT`` at it and a model cache of its own (put back after)."""
    with orchestrator_with_hub(orchestrator, session_dir / "hub-models", SECRET) as standin:
        standin.add_file(REPO, FILE, fetch_bundled(DEFAULT_BUNDLED))
        yield standin


async def test_a_run_serves_a_model_fetched_from_the_hub_and_its_token_stays_out(
    hub: HubStandin, runs: Runs, orchestrator: OrchestratorProcess, session_dir: Path
):
    source = {"hf": {"repo": REPO, "file": FILE}}
    handle = await runs.start(1301, model=source)
    state = await wait_phase(handle, RunPhase.PROMPT_READY)
    assert state.plan is not None
    commit = hub.repos[REPO].refs["main"]
    cached = session_dir / "hub-models" / "hf" / "mvp-test--SmolLM2-135M-Instruct-GGUF"
    # Planned from the header alone; the one node's host fetched its share: the whole
    # file, checked by its sha256 (DECISIONS 72).
    assert Path(state.plan.model_path) == cached / commit / "ranged" / FILE
    blob = next(iter(hub.blobs.values()))
    assert state.plan.hub is not None and state.plan.hub.parts[0].sha256 == blob.sha256
    record = json.loads((cached / commit / "ranged" / f"{FILE}.ranges.json").read_text())
    assert record["held"] == [[0, blob.size]] and record["verified"] is True
    assert state.plan.model_facts.block_count == 30  # SmolLM2-135M, read from that file

    reply = await RunHandle(runs.client, 1301).submit(
        SubmitPrompt(request_id=1, prompt_text="The capital of France is", max_tokens=6),
    )
    assert isinstance(reply, Done) and reply.tokens_generated > 0 and reply.final_text.strip()

    # Every byte fetched once (the header at planning, the rest by the node's host), with
    # the token to the hub and without it to the CDN; the one request without it is
    # planning's probe of whether the files need it (they do: the share went with it).
    assert hub.bytes_sent() == blob.size
    assert {r.authorization for r in hub.seen("hub")} == {f"Bearer {SECRET}", None}
    assert [r.method for r in hub.seen("hub") if r.authorization is None] == ["HEAD"]
    assert state.plan.hub is not None and state.plan.hub.needs_token
    assert all(r.authorization is None for r in hub.seen("cdn"))

    # A wrong revision of the same repo: a rejection that names it, nothing provisioned.
    wrong = await runs.start(1302, model={"hf": {**source["hf"], "revision": "v404"}})
    assert await run_failure(wrong) == (
        f"planning failed: Hugging Face model {REPO} file '{FILE}' at revision 'v404': "
        f"revision 'v404' not found in {REPO}"
    )
    assert hub.bytes_sent() == blob.size

    await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN)
    await handle.result()
    worker_logs = [*orchestrator.log_dir.glob("orchestrator-*.log")]
    logs = [*worker_logs, *(orchestrator.state_dir / "nodes").glob("mvp-1301-*/node.*")]
    report = await scan(
        runs.client,
        secrets=[SECRET],
        edge_secret=base64.b64decode(EDGE_SECRET),
        logs=logs,
        query="WorkflowId STARTS_WITH 'mvp-run-130'",
    )
    assert report.workflows >= 3 and report.log_files >= 2 and report.queries >= 1
    assert report.findings == []
    assert SECRET not in (cached / commit / "ranged" / f"{FILE}.ranges.json").read_text()
    # The worker that started the node logged the share it fetched for it.
    text = "".join(p.read_text(errors="replace") for p in worker_logs)
    mb = f"{blob.size / 1e6:.1f}"
    assert f"(stage 0) has {mb} of {mb} MB of its share of {REPO} {FILE} at {commit[:12]}" in text


SPLIT_REPO = "mvp-test/SmolLM2-135M-split-GGUF"


async def test_a_corrupt_file_fails_the_nodes_start_clearly_and_leaves_nothing(
    hub: HubStandin, runs: Runs, session_dir: Path
):
    """The CDN serves the file with one byte changed: planning (the header) cannot tell;
    the node's host, fetching the whole file for its one stage, finds its sha256 is not
    the hub's, keeps nothing of it, and the run faults naming it; no node ever ran."""
    repo = "mvp-test/corrupt-GGUF"
    hub.add_file(repo, FILE, fetch_bundled(DEFAULT_BUNDLED))
    hub.wrong_hash = True
    try:
        handle = await runs.start(1307, model={"hf": {"repo": repo, "file": FILE}})
        message = await run_failure(handle)
    finally:
        hub.wrong_hash = False
    assert "is not the hub's" in message and "nothing of it was kept" in message, message
    assert f"{repo} {FILE}" in message
    state = await snapshot(handle)
    assert all(n.handle is None for n in state.nodes)
    ranged = session_dir / "hub-models" / "hf" / "mvp-test--corrupt-GGUF"
    assert not [p for p in ranged.rglob(FILE)]  # the sparse file and its record: gone


async def test_a_split_hub_model_is_fetched_by_shares_and_a_replacement_keeps_the_text(
    hub: HubStandin, runs: Runs, tmp_path: Path
):
    """SmolLM2 in 3 parts on the hub, 3 nodes (issue 35): planned from the parts' headers,
    each node's host fetching its share into the host's cache; the middle node killed
    under 4 streaming prompts is replaced (DECISIONS 68) and every prompt keeps its
    undisturbed text (kill_and_recover checks each). Every byte of the model crossed the
    hub once: the nodes share their host's cache, so the replacement fetched nothing."""
    from mvp_core.models import ShutdownReason
    from scripts.gguf_split import split_gguf
    from tests.integration.test_recovery import kill_and_recover

    parts = split_gguf(fetch_bundled(DEFAULT_BUNDLED), tmp_path / "smollm", 3)
    for part in parts:
        hub.add_file(SPLIT_REPO, part.name, part)
    before = {p.name: hub.bytes_sent(p) for p in parts}
    model = {"hf": {"repo": SPLIT_REPO, "file": parts[0].name}}
    run, state = await kill_and_recover(
        runs, 1306, killed_stage=1, gate=tmp_path / "text-open", model=model
    )
    assert state.plan is not None and state.plan.hub is not None
    assert [p.file for p in state.plan.hub.parts] == [p.name for p in parts]
    assert all(s.fetch for s in state.plan.stages)
    assert state.recoveries_done == 1 and len(state.replaced_nodes) == 1
    sent = {p.name: hub.bytes_sent(p) - before[p.name] for p in parts}
    assert sent == {p.name: p.stat().st_size for p in parts}
    # The snapshot shows each node's share; the replacement's host had it all cached.
    shares = {s.stage_index: sum(r.size for r in s.fetch) for s in state.plan.stages}
    for node in state.nodes:
        assert node.handle is not None
        assert node.handle.share_bytes == shares[node.stage_index]
    replacement = next(n for n in state.nodes if n.stage_index == 1)
    assert replacement.handle is not None and replacement.handle.share_fetched == 0
    await run.shutdown_and_wait(ShutdownReason.OPERATOR_REQUESTED)
