"""A whole run against a Temporal behind TLS and an API key, in a namespace other than
default (docs/temporal-connection.md): a dev server of its own on loopback, nginx in
front of it terminating TLS with a certificate of a CA made here and refusing any
request without ``authorization: Bearer <key>``. The orchestrator worker, the test's
client and the run's node are configured only through envconfig's variables; the node
gets them from its provider. A wrong key, an untrusted CA and a namespace that does not
exist each stop the worker at startup with one line naming the cause, never the key.
Nothing of the key is left in Temporal or in a log."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from temporalio.service import RPCError

from mvp_core import names
from mvp_core.models import Done, RunOutcome, RunPhase, RunRequest, SubmitPrompt, TextDelta
from temporal.client import RunHandle
from temporal.connect import TemporalSettings, connect
from temporal.devserver import start_dev_server
from tests.helpers.runs import start_run, task_failures
from tests.helpers.secret_scan import scan
from tests.helpers.tls_proxy import SERVER_NAME, make_pki, nginx_binary, start_grpc_tls_proxy
from tests.helpers.waits import eventually
from tests.integration.conftest import (
    EDGE_SECRET,
    REPO,
    SECRET,
    OrchestratorProcess,
    harness_env,
    node_pids,
    node_processes,
    snapshot,
    wait_closed,
    wait_phase,
)

pytestmark = pytest.mark.quick

RUN_ID = 3401
NAMESPACE = "mvp-tls"
# A made-up key for a made-up server: the scan below looks for it everywhere.
API_KEY = "mvpTlsTestKey-8c41e07b5d2a4f96"
WRONG_KEY = "mvpTlsWrongKey-1f0e9d8c7b6a"


def _envconfig(proxy_address: str, ca: Path, key: str = API_KEY, namespace: str = NAMESPACE):
    """Everything the worker and the client know of Temporal: envconfig's variables."""
    return {
        "TEMPORAL_ADDRESS": proxy_address,
        "TEMPORAL_NAMESPACE": namespace,
        "TEMPORAL_API_KEY": key,
        "TEMPORAL_TLS_SERVER_CA_CERT_PATH": str(ca),
        "TEMPORAL_TLS_SERVER_NAME": SERVER_NAME,
    }


def _failed_start(env: dict[str, str], state_dir: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "workers.orchestrator"],
        env={
            **os.environ,
            **harness_env(state_dir / "faults.json"),
            **env,
            "MVP_STATE_DIR": str(state_dir),
            "PYTHONUNBUFFERED": "1",
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=str(REPO),
    )


def _outcome(proc: subprocess.Popen[bytes]) -> tuple[int, list[str], str]:
    out, err = proc.communicate(timeout=60)
    lines = [line for line in err.decode(errors="replace").splitlines() if line.strip()]
    return proc.returncode, lines, out.decode(errors="replace") + err.decode(errors="replace")


async def test_a_run_through_tls_and_an_api_key_in_another_namespace(tmp_path: Path):
    nginx_binary()  # a missing nginx fails here, saying how to install it
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({}))
    server = start_dev_server(
        str(tmp_path / "t.db"), log_file=str(tmp_path / "temporal.log"), namespaces=[NAMESPACE]
    )
    pki = make_pki(tmp_path / "pki")
    untrusted = make_pki(tmp_path / "untrusted", label="someone else's")
    proxy = start_grpc_tls_proxy(tmp_path / "nginx", server.address, pki, API_KEY)
    env = _envconfig(proxy.address, pki.ca_cert)
    worker = OrchestratorProcess(proxy.address, state_dir, tmp_path, {**harness_env(faults), **env})
    # The refusals, in parallel with the run.
    refused = {
        "key": _failed_start(_envconfig(proxy.address, pki.ca_cert, key=WRONG_KEY), state_dir),
        "ca": _failed_start(_envconfig(proxy.address, untrusted.ca_cert), state_dir),
        "namespace": _failed_start(
            _envconfig(proxy.address, pki.ca_cert, namespace="mvp-nowhere"), state_dir
        ),
    }
    handle = None
    try:
        worker.start()
        settings = TemporalSettings.load(env, config_file=False)
        assert settings.tls_enabled and settings.namespace == NAMESPACE
        assert API_KEY not in repr(settings) and API_KEY not in settings.describe()
        client = await connect(settings=settings)
        assert client.namespace == NAMESPACE
        request = RunRequest.model_validate(
            {"model": {"bundled": "SmolLM2-135M-Instruct.Q4_1"}, "default_max_tokens": 8}
        )
        handle = await start_run(client, RUN_ID, request)
        state = await wait_phase(handle, RunPhase.PROMPT_READY, timeout=90)

        # The node reached Temporal through the proxy with the settings its provider gave
        # it, and through nothing else.
        (pid,) = node_pids(state)
        node = psutil.Process(pid)
        node_env = node.environ()
        assert node_env["TEMPORAL_ADDRESS"] == proxy.address
        assert node_env["TEMPORAL_NAMESPACE"] == NAMESPACE
        assert node_env["MVP_TEMPORAL_NAMESPACE"] == NAMESPACE
        assert node_env["TEMPORAL_API_KEY"] == API_KEY
        assert node_env["TEMPORAL_TLS"] == "true"
        assert node_env["TEMPORAL_TLS_SERVER_CA_CERT_PATH"] == str(pki.ca_cert)
        assert node_env["TEMPORAL_TLS_SERVER_NAME"] == SERVER_NAME
        peers = {c.raddr.port for c in node.net_connections("tcp") if c.raddr}
        assert proxy.port in peers and server.port not in peers, peers

        events = [
            ev
            async for ev in RunHandle(client, RUN_ID).stream(
                SubmitPrompt(request_id=1, prompt_text="Once upon a time")
            )
        ]
        done = events[-1]
        assert isinstance(done, Done) and done.tokens_generated == 8
        assert "".join(e.text for e in events if isinstance(e, TextDelta)) == done.final_text

        await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN)
        outcome = RunOutcome.model_validate(await handle.result())
        assert outcome.outcome.value == "operator_stopped"
        assert await wait_closed(handle)
        assert (await snapshot(handle)).torn_down
        await eventually(
            lambda: node_processes(state_dir) == [],
            timeout=10,
            what="no node process left",
            interval=0.2,
            detail=lambda: repr(node_processes(state_dir)),
        )

        # Every request of the session went through the proxy with the key: the node's
        # reports (signals) among them, and none was refused.
        access = proxy.access_log.read_text()
        assert "WorkflowService/SignalWorkflowExecution" in access
        assert "WorkflowService/PollActivityTaskQueue" in access
        # One refused request: the wrong key's (the untrusted CA's start never got past
        # the handshake).
        assert access.count('" 204 ') == 1, access

        # The refusals: a non-zero exit, one line naming the cause, never a key.
        for case, proc in refused.items():
            code, lines, everything = _outcome(proc)
            assert code != 0, (case, everything[-2000:])
            assert len(lines) == 1, (case, lines)
            assert API_KEY not in everything and WRONG_KEY not in everything
            assert lines[0].startswith("mvp-orchestrator worker: cannot ")
            assert proxy.address in lines[0] and "API key" in lines[0]
            expected = {
                "key": "the server refused the API key (missing or invalid API key)",
                "ca": "the server's TLS certificate is not signed by a trusted CA",
                "namespace": "namespace mvp-nowhere does not exist there",
            }[case]
            assert expected in lines[0], (case, lines[0])

        # Nothing of the key in what Temporal keeps of the run, nor in any log.
        logs = [*tmp_path.glob("orchestrator-*.log"), *(state_dir / "nodes").glob("*/node.*")]
        logs += [proxy.access_log, proxy.directory / "error.log", tmp_path / "temporal.log"]
        report = await scan(
            client,
            secrets=[API_KEY, WRONG_KEY, SECRET],
            edge_secret=base64.b64decode(EDGE_SECRET),
            logs=logs,
        )
        assert report.workflows >= 2 and report.queries == 1 and report.log_files >= 4
        assert report.edge_tokens  # the run's token was derived and looked for too
        assert report.findings == []
        assert task_failures(tmp_path) == []
    finally:
        for proc in refused.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
        if handle is not None:
            with contextlib.suppress(RPCError):  # closed already, unless the test failed
                await handle.terminate("test clean-up")
        worker.stop()
        for leftover in node_processes(state_dir):
            try:
                leftover.kill()
            except psutil.NoSuchProcess:
                pass
        proxy.stop()
        server.stop()
