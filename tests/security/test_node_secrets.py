"""Issue 21, defect 8: a node gets only the secrets it uses, and what a node leaves behind
(its last log line) reaches a fault text, and so the run's history, redacted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from activities.providers.base import last_log_line, log_file_tail, node_environment
from activities.providers.process import ProcessProvider
from mvp_core.models import NodeHandle, NodeProvisionSpec, ProviderKind

HF = "hf_nodeSecretTest0123456789abcdefghij"  # the shape of a real hub token
PAYLOAD_KEY = "cGF5bG9hZC1rZXktZm9yLXRlc3RzLTAxMjM0NTY3"
VAST_KEY = "vast-key-node-secret-test-51c0"


def spec() -> NodeProvisionSpec:
    return NodeProvisionSpec(
        run_id=7,
        node_id=1,
        stage_index=0,
        nonce="0123456789abcdef",
        task_queue="mvp-node-7-1-01234567",
        readiness_id="r",
        authorized_orchestrator="o",
        run_workflow_id="mvp-run-7",
        coordinator_endpoint="",
    )


@pytest.fixture
def worker_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The orchestrator worker's environment: the hub token, the payload key, a
    provider's API key."""
    monkeypatch.setenv("MVP_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("HF_TOKEN", HF)
    monkeypatch.setenv("MVP_PAYLOAD_KEY", PAYLOAD_KEY)
    monkeypatch.setenv("VASTAI_API_KEY", VAST_KEY)


@pytest.mark.usefixtures("worker_env")
@pytest.mark.parametrize(
    "how",
    [
        {},  # process
        {"temporal_address": "172.18.0.1:7233", "inline_files": True},  # docker, vastai
        {"shared_address": True},
    ],
)
def test_a_node_gets_the_payload_key_but_never_the_hub_token(how: dict[str, object]):
    env = node_environment(spec(), "/n", host_env={"PATH": "/usr/bin"}, **how)  # type: ignore[arg-type]
    assert "HF_TOKEN" not in env and HF not in env.values()
    assert "VASTAI_API_KEY" not in env and VAST_KEY not in env.values()
    assert env["MVP_PAYLOAD_KEY"] == PAYLOAD_KEY  # the node encrypts its payloads with it


@pytest.mark.usefixtures("worker_env")
def test_a_node_s_last_log_line_reaches_the_fault_text_redacted(tmp_path: Path):
    """A real node-like process that prints secrets as its last words, then dies: the
    process provider's exit report names the line, with every secret replaced."""
    log = tmp_path / "node.log"
    line = f"boom HF_TOKEN={HF} key {PAYLOAD_KEY} auth Bearer abcdefgh12345678 done"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", f"print('starting'); print({line!r})"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    proc.wait(30)
    handle = NodeHandle(
        run_id=7,
        node_id=1,
        provider=ProviderKind.PROCESS,
        host="h",
        pid=proc.pid,
        log_path=str(log),
        resource_name="mvp-7-1-01234567",
    )
    exited = ProcessProvider().poll_exited([handle])
    assert exited is not None
    detail = exited.detail
    assert detail.startswith(f"process {proc.pid} is gone; last log line: boom "), detail
    for secret in (HF, PAYLOAD_KEY, "abcdefgh12345678"):
        assert secret not in detail
    assert detail.endswith("HF_TOKEN=[redacted] key [redacted] auth Bearer [redacted] done"), detail


@pytest.mark.usefixtures("worker_env")
def test_the_one_log_line_formatter_redacts_before_it_cuts():
    # A secret that straddles the 200-character cut is never left half visible.
    text = "x" * 190 + HF + "\n"
    out = last_log_line("first\n" + text)
    assert HF[:10] not in out and out == "; last log line: " + ("x" * 190 + "[redacted]")[:200]
    assert last_log_line("") == "" and last_log_line("\n \n") == ""
    # A tail read from inside a line drops the cut word: it may be a secret's end.
    assert last_log_line(HF[20:] + " tail words", partial=True) == "; last log line: ...tail words"
    assert last_log_line("cut line\nwhole line\n", partial=True) == "; last log line: whole line"


@pytest.mark.usefixtures("worker_env")
def test_a_long_log_is_read_from_its_end(tmp_path: Path):
    log = tmp_path / "node.log"
    log.write_text("".join(f"line {i}\n" for i in range(5000)) + f"last {HF}\n")
    assert log_file_tail(str(log)) == "; last log line: last [redacted]"
    assert log_file_tail(str(tmp_path / "missing.log")) == ""
    assert log_file_tail(None) == ""
    assert os.environ["HF_TOKEN"] == HF
