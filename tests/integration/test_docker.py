"""Docker nodes (issue 9): runs on a real, private Docker daemon, each node a container
on its run's own network, with nothing left behind whatever happens to the run."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import docker
import pytest
from temporalio.client import Client
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.planning import PlanningActivities, provider_host
from activities.providers.docker import CREATED_BY, LABEL_CREATED_BY, LABEL_RUN_ID
from activities.provisioning import ProviderActivities
from mvp_core import names
from mvp_core.memory_plan import RUNTIME_BYTES
from mvp_core.models import (
    ModelSource,
    PreparePlanInput,
    ProviderKind,
    RunOutcome,
    RunPhase,
    ShutdownReason,
    SubmitPrompt,
)
from mvp_core.run_records import NodeState
from mvp_io.gguf_files import open_model
from mvp_io.kernel_dirs import PREBUILT_ENV, kernel_dir
from temporal.client import RunHandle
from temporal.connect import connect
from temporal.devserver import start_dev_server
from tests.helpers.dockerd import Dockerd
from tests.helpers.runs import node_output
from tests.helpers.waits import eventually
from tests.integration.conftest import (
    REPO,
    SECRET,
    OrchestratorProcess,
    Runs,
    harness_env,
    orchestrator_with_hub,
    run_failure,
    snapshot,
    wait_closed,
    wait_phase,
    wait_state,
)
from tests.integration.test_reaper import sweep
from tests.integration.test_recovery import kill_and_recover
from workers.host.follow import read_archive

PROMPT = "The capital of France is"
# Prompt-ready of a run of containers: each node loads its stage under its own CPU quota,
# and CI may share the machine with other work; a bound on liveness, not on speed.
READY_S = 240.0
CREATED = {"label": [f"{LABEL_CREATED_BY}={CREATED_BY}"]}


@pytest.fixture
def dclient(dockerd: Dockerd) -> Iterator[docker.DockerClient]:
    """The private daemon; after each test, nothing of ours may be left on it."""
    client = docker.DockerClient(base_url=dockerd.host, timeout=60)
    yield client
    left = [c.name for c in client.containers.list(all=True, filters=CREATED)]
    nets = [n.name for n in client.networks.list(filters=CREATED)]
    for c in client.containers.list(all=True, filters=CREATED):
        c.remove(force=True)
    for n in client.networks.list(filters=CREATED):
        n.remove()
    client.close()
    assert not left and not nets, f"left on the daemon: {left} {nets}"


@pytest.fixture
async def druns(runs: Runs, dclient: docker.DockerClient) -> AsyncIterator[Runs]:
    yield runs


def run_containers(dclient: docker.DockerClient, run_id: int) -> list[object]:
    return list(
        dclient.containers.list(
            all=True,
            filters={"label": [f"{LABEL_CREATED_BY}={CREATED_BY}", f"{LABEL_RUN_ID}={run_id}"]},
        )
    )


def run_networks(dclient: docker.DockerClient, run_id: int) -> list[str]:
    return [
        str(n.name)
        for n in dclient.networks.list(filters=CREATED)
        if (n.attrs.get("Labels") or {}).get(LABEL_RUN_ID) == str(run_id)
    ]


def established(container: object) -> set[tuple[str, int, str, int]]:
    """The container's established TCP connections, read inside it (/proc/net/tcp of its
    network namespace): (local ip, local port, remote ip, remote port)."""
    code, out = container.exec_run(["cat", "/proc/net/tcp"])  # type: ignore[attr-defined]
    assert code == 0, out
    conns = set()
    for line in out.decode().splitlines()[1:]:
        fields = line.split()
        if fields[3] != "01":  # TCP_ESTABLISHED
            continue
        (lip, lport), (rip, rport) = (f.split(":") for f in fields[1:3])
        conns.add((_ip(lip), int(lport, 16), _ip(rip), int(rport, 16)))
    return conns


def _ip(hex_le: str) -> str:
    return str(ipaddress.IPv4Address(bytes.fromhex(hex_le)[::-1]))


async def greedy(client: Client, run_id: int, max_tokens: int = 12) -> str:
    result = await RunHandle(client, run_id).submit(
        SubmitPrompt(request_id=1, prompt_text=PROMPT, max_tokens=max_tokens)
    )
    assert result.type == "done", result
    return result.final_text


async def shutdown(handle: object) -> RunOutcome:
    await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN)  # type: ignore[attr-defined]
    return RunOutcome.model_validate(await handle.result())  # type: ignore[attr-defined]


_PROCESS_TEXT: list[str] = []


async def _process_text(druns: Runs) -> str:
    """The greedy text of a 1-stage run on a local process (once for the module): the
    reference every stage count gives bit for bit (float32 activations, DECISIONS 53)."""
    if not _PROCESS_TEXT:
        process = await druns.start(2900, max_context=512)
        await wait_phase(process, RunPhase.PROMPT_READY, timeout=READY_S)
        _PROCESS_TEXT.append(await greedy(druns.client, 2900))
        await shutdown(process)
    return _PROCESS_TEXT[0]


@pytest.mark.timeout(600)
async def test_docker_pipeline_gives_the_process_text_over_container_addresses(
    druns: Runs, dclient: docker.DockerClient, state_dir: Path
):
    stages = 2
    expected = await _process_text(druns)
    run_id = 2921
    # The documented example (2 stages). Each container limited to one CPU (docker.cpus):
    # the same text, one engine thread; and to 1 GiB (docker.memory), which the run is
    # planned by (each stage fits it). Three containers each limited to its own stage's
    # need (docker.memory_per_stage) serve a larger model from the hub below.
    example = json.loads((REPO / "docs" / "examples" / "run-docker.json").read_text())
    memory = 1 << 30
    limited = {**example, "pipeline_stages": stages, "docker": {"cpus": 1, "memory": memory}}
    kernel_dir().mkdir(parents=True, exist_ok=True)  # lent to the containers (below)
    handle = await druns.start(run_id, **limited)
    state = await wait_phase(handle, RunPhase.PROMPT_READY, timeout=READY_S)
    assert await greedy(druns.client, run_id) == expected
    assert state.plan is not None
    limits = {}
    for stage in state.plan.stages:
        assert stage.memory_need is not None
        assert stage.node_memory == memory and stage.memory_need <= memory
        limits[str(stage.node_id)] = memory

    containers = {c.labels["mvp.node-id"]: c for c in run_containers(dclient, run_id)}  # type: ignore[attr-defined]
    assert len(containers) == stages and len(run_networks(dclient, run_id)) == 1
    # The worker holds HF_TOKEN (the harness gives it one); a container never gets it.
    envs = [c.attrs["Config"]["Env"] for c in containers.values()]  # type: ignore[attr-defined]
    assert not [e for env in envs for e in env if e.startswith("HF_TOKEN=") or SECRET in e]
    assert all(any(e.startswith("MVP_EDGE_TOKEN=") for e in env) for env in envs)
    assert all(c.attrs["HostConfig"]["NanoCpus"] == 10**9 for c in containers.values())  # type: ignore[attr-defined]
    for node_id, c in containers.items():
        assert c.attrs["HostConfig"]["Memory"] == limits[node_id]  # type: ignore[attr-defined]
        assert c.attrs["HostConfig"]["MemorySwap"] == limits[node_id]  # type: ignore[attr-defined]
        # The host's kernel builds, lent read-only (the folder made before the run)
        kernels = str(kernel_dir())
        mounts = c.attrs["Mounts"]  # type: ignore[attr-defined]
        assert [m["RW"] for m in mounts if m["Destination"] == kernels] == [False]
        assert f"{PREBUILT_ENV}={kernels}" in c.attrs["Config"]["Env"]  # type: ignore[attr-defined]
    net = run_networks(dclient, run_id)[0]
    by_stage = sorted(state.nodes, key=lambda n: n.stage_index)
    endpoints = []
    for node in by_stage:
        assert node.handle is not None and node.runtime_ready is not None
        c = containers[str(node.node_id)]
        c.reload()  # type: ignore[attr-defined]
        ip = c.attrs["NetworkSettings"]["Networks"][net]["IPAddress"]  # type: ignore[attr-defined]
        host, _, port = node.runtime_ready.endpoint.rpartition(":")
        assert host == ip == node.handle.address and not ipaddress.ip_address(ip).is_loopback
        endpoints.append((ip, int(port)))
    assert len({ip for ip, _ in endpoints}) == stages  # each node on its own address
    # Each stage's outbound edge, seen inside the sending container: a connection from its
    # own address to the next stage's (the last one's to the head's driver).
    for i, node in enumerate(by_stage):
        conns = established(containers[str(node.node_id)])
        src_ip = endpoints[i][0]
        dst = endpoints[(i + 1) % stages]
        assert any((lip, rip, rport) == (src_ip, dst[0], dst[1]) for lip, _, rip, rport in conns), (
            i,
            conns,
        )

    # Each container's output is on the provider's host as it runs, stdout and stderr
    # apart (node.log, node.err), as a process node's: the run's datastream carries both
    # live (issue 21 defect 10; they used to arrive, merged, when the container stopped).
    found = await RunHandle(druns.client, run_id).datastream(wait_s=30)
    assert found is not None
    for node in by_stage:
        assert node.handle is not None and node.handle.log_path is not None
        assert node.handle.log_path.startswith(str(state_dir))
        out = Path(node.handle.log_path).read_text()
        err = Path(node.handle.log_path).with_name("node.err").read_text()
        assert "serving" in out and " INFO " not in out, out[-2000:]
        assert " INFO " in err and "serving" not in err, err[-2000:]
        channels = {f"mvp.provisioning.logs.node.{node.node_id}.{s}" for s in ("stdout", "stderr")}
        await until_archived(Path(found.archive), channels)

    outcome = await shutdown(handle)
    assert outcome.outcome.value == "operator_stopped"
    assert run_containers(dclient, run_id) == [] and run_networks(dclient, run_id) == []
    # Each container's output outlives it, in the node's log on the provider's host.
    for node in by_stage:
        assert node.handle is not None
        log = node_output(node.handle.log_path)
        assert f"node {node.node_id} stopped" in log
        assert "(1 thread(s))" in log  # its one CPU (docker.cpus), read from its cgroup


HUB_REPO = "mvp-test/llama-20l-1024-GGUF"


@pytest.mark.timeout(900)
async def test_a_model_larger_than_each_node_comes_from_the_hub_in_shares_to_limited_containers(
    druns: Runs,
    dclient: docker.DockerClient,
    orchestrator: OrchestratorProcess,
    session_dir: Path,
    tmp_path: Path,
):
    """Issue 35's run at a realistic shape: a 20-layer, hidden-1024 model (random
    weights, Q4_K_M) in 3 split files on the hub stand-in, on 3 containers each limited
    (``--memory``, docker.memory_per_stage) to its own stage's planned need, which is
    below the model's size: a node that loaded more than its share would be killed. Each
    node's share is fetched on the provider's host (the hub's bytes are the model once),
    and the greedy text equals the 1-stage text of the same model on an unlimited node."""
    from scripts.gguf_split import split_gguf
    from scripts.write_shape import SHAPES, write

    whole = tmp_path / "llama-20l-1024.gguf"
    write(SHAPES["llama-20l-1024"], "llama-20l-1024", whole, "q4_k_m")
    parts = split_gguf(whole, tmp_path / "parts", 3)
    whole.unlink()
    size = sum(p.stat().st_size for p in parts)
    model = {"hf": {"repo": HUB_REPO, "file": parts[0].name}}
    models = session_dir / "docker-hub-models"
    with orchestrator_with_hub(orchestrator, models, token=None) as hub:
        for part in parts:
            hub.add_file(HUB_REPO, part.name, part)
        run_id = 2951
        handle = await druns.start(
            run_id,
            model=model,
            provider="docker",
            pipeline_stages=3,
            max_context=256,
            docker={"cpus": 1, "memory_per_stage": True},
        )
        state = await wait_phase(handle, RunPhase.PROMPT_READY, timeout=READY_S)
        text = await greedy(druns.client, run_id, max_tokens=16)
        assert state.plan is not None and state.plan.hub is not None
        assert [p.file for p in state.plan.hub.parts] == [p.name for p in parts]
        containers = {c.labels["mvp.node-id"]: c for c in run_containers(dclient, run_id)}  # type: ignore[attr-defined]
        assert len(containers) == 3
        shares = {}
        for stage in state.plan.stages:
            assert stage.fetch and stage.memory_need is not None
            # Its memory for weights (the need less a node process's own) is below the
            # model's size: no node could hold the model.
            assert stage.memory_need - RUNTIME_BYTES < size
            c = containers[str(stage.node_id)]
            assert c.attrs["HostConfig"]["Memory"] == stage.memory_need  # type: ignore[attr-defined]
            shares[stage.node_id] = sum(r.size for r in stage.fetch)
        # Each its own tensors and the parts' headers; the tied embedding twice (the head
        # stage's input and the last stage's output), nothing else.
        with open_model(str(parts[0])) as files:
            embd = files.header.tensors["token_embd.weight"].n_bytes
        assert sum(shares.values()) < size + embd + 3 * (1 << 20)
        for node in state.nodes:
            assert node.handle is not None
            assert node.handle.share_bytes == shares[node.node_id] < size
            assert node.handle.share_fetched is not None
            assert node.handle.share_fetched <= node.handle.share_bytes
        # The nodes share their host's cache: every byte of the model crossed the hub once.
        assert {p.name: hub.bytes_sent(p) for p in parts} == {
            p.name: p.stat().st_size for p in parts
        }
        assert (await shutdown(handle)).outcome.value == "operator_stopped"
        # The reference: one stage on a local process, no limit.
        ref = await druns.start(run_id + 1, model=model, max_context=256)
        await wait_phase(ref, RunPhase.PROMPT_READY, timeout=READY_S)
        assert await greedy(druns.client, run_id + 1, max_tokens=16) == text
        await shutdown(ref)
    assert run_containers(dclient, run_id) == [] and run_networks(dclient, run_id) == []


async def until_archived(archive: Path, channels: set[str], timeout_s: float = 30) -> None:
    """Wait until the run's frame archive has a frame on each of ``channels``."""

    def seen() -> set[str]:
        return {f["channel"] for f in read_archive(archive)} if archive.exists() else set()

    await eventually(
        lambda: channels <= seen(),
        timeout=timeout_s,
        what=f"the datastream to carry {sorted(channels)}",
        interval=0.2,
        detail=lambda: f"missing: {sorted(channels - seen())}",
    )


async def test_a_killed_container_faults_the_prompt_and_run_and_leaves_nothing(
    druns: Runs, dclient: docker.DockerClient
):
    run_id = 2931
    handle = await druns.start(
        run_id, pipeline_stages=2, provider="docker", faults={"MVP_FAULT_TEXT_DELAY_MS": "10"}
    )
    state = await wait_phase(handle, RunPhase.PROMPT_READY)
    prompt = asyncio.ensure_future(
        RunHandle(druns.client, run_id).submit(
            SubmitPrompt(request_id=1, prompt_text="Once upon a time", max_tokens=2000),
        )
    )
    await wait_state(
        handle, lambda s: 1 in {p.request_id for p in s.actives()}, "prompt 1 generating"
    )
    tail = next(n for n in state.nodes if n.stage_index == 1)
    victim = next(
        c
        for c in run_containers(dclient, run_id)
        if c.labels["mvp.node-id"] == str(tail.node_id)  # type: ignore[attr-defined]
    )
    t0 = time.monotonic()
    victim.kill()  # type: ignore[attr-defined]
    result = await prompt
    assert result.type == "fault", result
    cause = await run_failure(handle)
    assert time.monotonic() - t0 < 15, time.monotonic() - t0
    assert cause.startswith("prompt serving"), cause
    assert (await snapshot(handle)).torn_down
    assert run_containers(dclient, run_id) == [] and run_networks(dclient, run_id) == []


async def test_a_killed_container_is_replaced_and_its_prompts_end_with_their_text(
    druns: Runs, dclient: docker.DockerClient
):
    """on_node_loss "replace" (DECISIONS 68): the tail's container killed under 2 streaming
    prompts; a new container on the run's network takes its layers, both prompts end with
    the undisturbed text, and the killed container is removed."""
    run_id = 2933

    def kill(node: NodeState) -> None:
        victim = next(
            c
            for c in run_containers(dclient, run_id)
            if c.labels["mvp.node-id"] == str(node.node_id)  # type: ignore[attr-defined]
        )
        victim.kill()  # type: ignore[attr-defined]

    run, after = await kill_and_recover(
        druns, run_id, 1, kill, prompts=2, pipeline_stages=2, provider="docker"
    )
    lost = after.replaced_nodes[-1].node_id
    ids = {c.labels["mvp.node-id"] for c in run_containers(dclient, run_id)}  # type: ignore[attr-defined]
    assert str(lost) not in ids and ids == {str(n.node_id) for n in after.nodes}, ids
    await run.shutdown_and_wait(ShutdownReason.OPERATOR_REQUESTED)
    assert run_containers(dclient, run_id) == [] and run_networks(dclient, run_id) == []


async def test_a_gpu_request_without_a_gpu_driver_is_a_clean_startup_failure(
    druns: Runs, dclient: docker.DockerClient
):
    run_id = 2941
    handle = await druns.start(run_id, provider="docker", docker={"gpus": "all"})
    cause = await run_failure(handle)
    assert cause.startswith("startup ("), cause
    assert "gpus='all'" in cause and "no GPU driver for Docker" in cause, cause
    state = await snapshot(handle)
    assert state.torn_down
    assert run_containers(dclient, run_id) == [] and run_networks(dclient, run_id) == []


async def test_a_docker_run_without_a_daemon_is_rejected_before_provisioning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'no-daemon.sock'}")
    planning = PlanningActivities(ProviderActivities())
    inp = PreparePlanInput(
        run_id=1,
        orchestrator_node_id=0,
        node_id=1,
        model=ModelSource(bundled="SmolLM2-135M-Instruct.Q4_1"),
        tokenizer=None,
        pipeline_stages=1,
        max_context=None,
        provider=ProviderKind.DOCKER,
    )
    with pytest.raises(ApplicationError) as err:
        await ActivityEnvironment().run(planning.prepare_plan, inp)
    assert err.value.type == "PlanningError" and err.value.non_retryable
    assert "provider 'docker' unavailable: no Docker daemon reachable at unix://" in str(err.value)


async def test_a_worker_killed_between_create_and_start_leaves_exactly_one_container(
    tmp_path: Path, dockerd: Dockerd, dclient: docker.DockerClient
):
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({}))
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    server = start_dev_server(
        str(tmp_path / "t.db"), log_file=str(tmp_path / "temporal.log"), ip="0.0.0.0"
    )
    env = {**harness_env(faults), "DOCKER_HOST": dockerd.host}
    crashing = OrchestratorProcess(
        server.address, state_dir, tmp_path, {**env, "MVP_TEST_CRASH_AFTER_LAUNCH": "created"}
    )
    healthy = OrchestratorProcess(server.address, state_dir, tmp_path, env)
    run_id = 2951
    try:
        crashing.start()
        client = await connect(server.address)
        handle = await Runs(client, crashing, faults).start(
            run_id, pipeline_stages=2, provider="docker", default_max_tokens=8
        )
        assert crashing.proc is not None
        crashing.proc.wait(60)  # it created node 2's container, then died before starting it
        made = run_containers(dclient, run_id)
        assert [c.status for c in made] == ["created"]  # type: ignore[attr-defined]
        healthy.start()
        state = await wait_phase(handle, RunPhase.PROMPT_READY, timeout=READY_S)
        now = run_containers(dclient, run_id)
        assert len(now) == 2, now
        assert made[0].id in {c.id for c in now}  # type: ignore[attr-defined]  # reused
        assert all(n.route_owned for n in state.nodes)
        assert (await greedy(client, run_id, 4)) != ""
        outcome = await shutdown(handle)
        assert outcome.outcome.value == "operator_stopped"
        assert run_containers(dclient, run_id) == [] and run_networks(dclient, run_id) == []
    finally:
        crashing.stop()
        healthy.stop()
        server.stop()


@pytest.mark.timeout(600)
async def test_the_reaper_removes_a_terminated_runs_containers_and_network_only(
    druns: Runs, dclient: docker.DockerClient
):
    gone_id, live_id = 2961, 2962
    gone = await druns.start(gone_id, pipeline_stages=2, provider="docker")
    live = await druns.start(live_id, provider="docker")
    gone_state = await wait_phase(gone, RunPhase.PROMPT_READY, timeout=READY_S)
    await wait_phase(live, RunPhase.PROMPT_READY, timeout=READY_S)

    # Two runs, two networks: a container of one cannot reach a node of the other, even
    # at its advertised address (the daemon isolates bridge networks).
    target = gone_state.nodes[0].runtime_ready
    assert target is not None
    ip, _, port = target.endpoint.rpartition(":")
    outsider = run_containers(dclient, live_id)[0]
    probe = f"import socket; socket.create_connection(({ip!r}, {port}), timeout=2)"
    python = outsider.attrs["Config"]["Cmd"][0]  # type: ignore[attr-defined]
    code, out = outsider.exec_run([python, "-c", probe])  # type: ignore[attr-defined]
    assert code != 0 and any(w in out for w in (b"timed out", b"refused", b"unreachable")), out

    await gone.terminate("test: leave the containers behind")
    await wait_closed(gone)
    # Nothing tears them down; their nodes leave by their dead-man switch (the run is
    # closed), which works inside containers too, but the containers stay.
    await eventually(
        lambda: {c.status for c in run_containers(dclient, gone_id)} == {"exited"},  # type: ignore[attr-defined]
        timeout=90,
        what="the left containers to exit",
        interval=0.3,
        detail=lambda: repr([c.status for c in run_containers(dclient, gone_id)]),  # type: ignore[attr-defined]
    )
    assert len(run_containers(dclient, gone_id)) == 2
    report = await sweep(druns.client, names.reaper_schedule_id(provider_host()))
    destroyed = {d.resource.name for d in report.destroyed}
    assert {
        f"mvp-orchestrator-{gone_id}-{n.node_id}-{gone_state.nonce[:8]}" for n in gone_state.nodes
    } <= destroyed
    assert run_containers(dclient, gone_id) == [] and run_networks(dclient, gone_id) == []
    assert len(run_containers(dclient, live_id)) == 1 and len(run_networks(dclient, live_id)) == 1
    assert sum(d.resource.kind == "container" for d in report.destroyed) >= 2
    assert any(d.resource.kind == "network" for d in report.destroyed)
    kept = {d.resource.run_workflow_id for d in report.kept}
    assert names.run_workflow_id(live_id) in kept
    assert names.run_workflow_id(gone_id) not in kept
    again = await sweep(druns.client, names.reaper_schedule_id(provider_host()))
    assert not [d for d in again.destroyed if d.resource.run_workflow_id.endswith(f"-{gone_id}")]

    assert (await shutdown(live)).outcome.value == "operator_stopped"
