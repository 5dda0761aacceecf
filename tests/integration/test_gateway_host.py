"""Issue 37, "live text to a gateway on any host", proven with gateways that really are on
other hosts (docs/gateway.md, "A gateway on another host: live text"; DECISIONS 80).

This machine has no second host: each is a network namespace joined to it by a veth pair
of its own (tests/helpers/netns.py). A real run of the bundled model (the session's dev
server, a real orchestrator worker, two real local node processes) has its nodes listen
on and advertise this host's end of the first link (``MVP_PROCESS_DATAPLANE_HOST``).
``mvp-gateway`` runs as its own process in each namespace, with an environment of its
own: no edge secret, a state directory and a home of its own, empty; it reaches the dev
server (which listens on every address) and the head node over its link only.

- The near namespace routes to the head node: a streamed chat completion through its
  gateway gets the first piece of text while the prompt is still held open on the node
  (the test-only text gate holds every piece after the first), then the rest, in several
  chunks, the same text as through a gateway on this host with the deployment's secret.
- The far namespace has no route to the head node's address (only to its own end of its
  link, where it reaches the dev server): its gateway says why once, when it starts
  serving the run (``cannot connect to host:port``), and each prompt's text arrives whole
  with its end.
- Neither gateway was given anything through a directory: their state directories stay
  empty, and no secret (the edge secret, the run's tokens, the API key) is in their
  output.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam
from temporalio.client import Client, WorkflowExecutionStatus

from activities.providers.process import DATAPLANE_HOST_ENV
from mvp_core import names
from mvp_core.models import RunPhase, ShutdownReason
from mvp_core.run_state import RunState
from temporal.client import RunHandle
from temporal.devserver import DevServer
from tests.helpers.netns import OtherHost, available, other_host
from tests.helpers.waits import eventually
from tests.integration.conftest import (
    EDGE_SECRET,
    REPO,
    SECRET,
    OrchestratorProcess,
    Runs,
    wait_closed,
    wait_phase,
    wait_state,
)
from tests.integration.test_gateway import serve

pytestmark = pytest.mark.skipif(available() is not None, reason=f"{available()}")

RUN = 3801
MODEL = "SmolLM2-135M-Instruct.Q4_1"
API_KEY = "sk-mvp-netns-5c0ffee5c0ffee"
STORY: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Tell me a story about a lighthouse keeper."}
]
N = 24  # max_tokens


@contextlib.contextmanager
def orchestrator_with(orchestrator: OrchestratorProcess, env: dict[str, str]) -> Iterator[None]:
    """The session's orchestrator worker restarted with ``env`` added, put back after."""
    saved = dict(orchestrator.extra_env)
    orchestrator.stop()
    orchestrator.extra_env = {**saved, **env}
    orchestrator.start()
    try:
        yield
    finally:
        orchestrator.stop()
        orchestrator.extra_env = saved
        orchestrator.start()


class GatewayThere:
    """``mvp-gateway --workflow-id`` as its own process in ``host``'s namespace, with an
    environment of its own (no edge secret, an empty state directory and home), its
    output in a file."""

    def __init__(self, host: OtherHost, temporal: DevServer, root: Path) -> None:
        self.host = host
        self.home = root / host.name
        self.state = self.home / "state"
        self.state.mkdir(parents=True)
        self.log = self.home / "gateway.log"
        env = {
            "PATH": os.environ["PATH"],
            "HOME": str(self.home),
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            "TEMPORAL_ADDRESS": f"{host.host_ip}:{temporal.port}",
            "MVP_STATE_DIR": str(self.state),
            "MVP_GATEWAY_API_KEYS": API_KEY,
        }
        cmd = [sys.executable, "-m", "workers.gateway.main"]
        cmd += ["--workflow-id", names.run_workflow_id(RUN), "--listen", f"{host.ip}:0"]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                host.argv([*cmd, "--log-level", "info"]),
                env=env,
                cwd=REPO,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.url = ""

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def said(self, what: str) -> str | None:
        """The first line of its output holding ``what`` (fails once it has exited)."""
        for line in self.text().splitlines():
            if what in line:
                return line
        if self.proc.poll() is not None:
            raise AssertionError(f"the gateway exited {self.proc.returncode}:\n{self.text()}")
        return None

    async def serving(self) -> AsyncOpenAI:
        line = await eventually(
            lambda: self.said(" is prompt-ready: "),
            timeout=60,
            what=f"the gateway in {self.host.name} to serve the run",
            detail=lambda: self.text()[-2000:],
        )
        self.url = line.split(" at ")[-1].strip()
        assert self.url.startswith(f"http://{self.host.ip}:"), line
        return AsyncOpenAI(base_url=self.url, api_key=API_KEY, max_retries=0, timeout=60)

    def environ(self) -> dict[str, str]:
        raw = Path(f"/proc/{self.proc.pid}/environ").read_bytes()
        return dict(v.split("=", 1) for v in raw.decode().split("\0") if "=" in v)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


@contextlib.asynccontextmanager
async def gateway_in(
    host: OtherHost, temporal: DevServer, root: Path
) -> AsyncIterator[GatewayThere]:
    gateway = GatewayThere(host, temporal, root)
    try:
        yield gateway
    finally:
        await asyncio.to_thread(gateway.stop)


async def chunks(api: AsyncOpenAI) -> AsyncIterator[tuple[str, str | None]]:
    """A streamed greedy chat completion of STORY: each chunk's text and finish reason."""
    stream = await api.chat.completions.create(
        model=MODEL, messages=STORY, max_tokens=N, temperature=0, stream=True
    )
    async for chunk in stream:
        choice = chunk.choices[0]
        yield choice.delta.content or "", choice.finish_reason


async def whole(api: AsyncOpenAI) -> tuple[list[str], str | None]:
    """The text pieces of a streamed completion of STORY, and how it ended."""
    pieces, end = [], None
    async for text, finish in chunks(api):
        if text:
            pieces.append(text)
        end = finish or end
    return pieces, end


def head_endpoint(state: RunState) -> str:
    head = min(state.nodes, key=lambda n: n.stage_index)
    assert head.runtime_ready is not None
    return head.runtime_ready.endpoint


def node_tokens(state: RunState) -> set[str]:
    """The run's edge and text-stream tokens, from its nodes' own environments."""
    found = set()
    for node in state.nodes:
        assert node.handle is not None and node.handle.pid is not None
        raw = Path(f"/proc/{node.handle.pid}/environ").read_bytes().decode()
        env = dict(v.split("=", 1) for v in raw.split("\0") if "=" in v)
        found |= {env["MVP_EDGE_TOKEN"], env["MVP_TEXT_TOKEN"]}
    return found


async def test_a_gateway_on_another_host_streams_live_text_and_one_without_a_route_says_why(
    runs: Runs,
    client: Client,
    orchestrator: OrchestratorProcess,
    temporal_server: DevServer,
    tmp_path: Path,
) -> None:
    gate = tmp_path / "text-open"  # the node holds each prompt's text after its first piece
    with (
        other_host(0) as near,
        other_host(1) as far,
        orchestrator_with(orchestrator, {DATAPLANE_HOST_ENV: near.host_ip}),
    ):
        handle = await runs.start(
            RUN,
            pipeline_stages=2,
            prompt_host="run",  # text only from the head node, or whole with the end
            max_active_prompts=2,
            max_context=512,
            faults={"MVP_FAULT_TEXT_GATE": str(gate)},
        )
        state = await wait_phase(handle, RunPhase.PROMPT_READY, timeout=180)
        endpoint = head_endpoint(state)
        assert endpoint.startswith(f"{near.host_ip}:"), endpoint
        tokens = node_tokens(state)
        async with (
            gateway_in(near, temporal_server, tmp_path) as there,
            gateway_in(far, temporal_server, tmp_path) as cut_off,
        ):
            assert EDGE_SECRET not in str(there.environ())
            api = await there.serving()
            assert there.said("with a key per prompt (no edge secret here"), there.text()
            # Live: the first piece arrives while the node holds the rest (the prompt
            # cannot end before the gate opens), the rest once it opens.
            live: list[str] = []
            end = None
            stream = chunks(api)
            async with asyncio.timeout(60):
                async for text, _ in stream:
                    if text:
                        live.append(text)
                        break
            assert len(live) == 1
            generating = await wait_state(
                handle, lambda s: bool(s.actives()), "the prompt to be generating"
            )
            assert not gate.exists() and len(generating.actives()) == 1
            gate.touch()
            async with asyncio.timeout(60):
                async for text, finish in stream:
                    if text:
                        live.append(text)
                    end = finish or end
            assert end == "length" and len(live) >= 2, live

            # The same prompt through a gateway on this host, with the deployment's secret.
            async with serve(client, RUN) as url:
                async with AsyncOpenAI(base_url=f"{url}/v1", api_key="unused") as here:
                    reference, ref_end = await whole(here)
            assert "".join(live) == "".join(reference) and ref_end == end

            # Without a route to the head node: said once, before any prompt, naming it.
            why = await eventually(
                lambda: cut_off.said("cannot connect to "),
                timeout=60,
                what="the cut-off gateway to say why it reads no live text",
                detail=lambda: cut_off.text()[-2000:],
            )
            assert f"cannot connect to {endpoint}" in why, why
            far_api = await cut_off.serving()
            for _ in range(2):
                async with asyncio.timeout(60):
                    pieces, far_end = await whole(far_api)
                assert pieces == ["".join(live)] and far_end == end, pieces
            assert cut_off.text().count("cannot connect to ") == 1, cut_off.text()
            await far_api.close()
            await api.close()
            assert "cannot connect" not in there.text(), there.text()
        await RunHandle(client, RUN).shutdown_and_wait(ShutdownReason.OPERATOR_REQUESTED)
        assert await wait_closed(handle) is WorkflowExecutionStatus.COMPLETED
    for gateway in (there, cut_off):
        assert gateway.proc.returncode == 0, gateway.text()
        assert not list(gateway.state.rglob("*")), list(gateway.state.rglob("*"))
        said = gateway.text()
        for secret in (EDGE_SECRET, SECRET, API_KEY, *tokens):
            assert secret not in said, gateway.host.name
