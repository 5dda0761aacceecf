"""``mvp-orchestrator`` as a user runs it (issue 10): a real process on the embedded
default (its own dev server and worker), real nodes on the bundled model, the prompt
RPC through raw sockets, stop words and signals, the frame archive, mvp-chat in tmux."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.helpers.waits import wait_until

REPO = Path(__file__).resolve().parents[2]
SECRET = "hf_hostTestSecret_9c2e4a7b1d0f"
READY_MARK = "prompt RPC on "


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class HostProcess:
    """One ``mvp-orchestrator`` with its own state directory, config and archive."""

    def __init__(
        self,
        root: Path,
        stages: int = 1,
        extra_toml: str = "",
        env: dict[str, str] | None = None,
        argv: list[str] | None = None,
        port: int | None = None,
    ):
        self.root = root
        self.port = free_port() if port is None else port
        self.archive = root / "archive" / "frames.jsonl"
        self.config = root / "config.toml"
        self.config.write_text(
            f"[runtime]\npipeline_stages = {stages}\nrun_id = 1\n"
            f'[prompt]\nrpc_addr = "127.0.0.1:{self.port}"\n'
            f'[observability]\ndatastream_frame_log = "{self.archive}"\n' + extra_toml
        )
        environ = {k: v for k, v in os.environ.items() if not k.startswith("MVP_")}
        environ.pop("TEMPORAL_ADDRESS", None)
        environ.update({"MVP_STATE_DIR": str(root / "state"), "HF_TOKEN": SECRET, **(env or {})})
        self.stderr_path = root / "stderr.txt"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "workers.host.main",
                "--runtime-config",
                str(self.config),
                *(argv or []),
            ],
            cwd=str(root),
            env=environ,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=open(self.stderr_path, "wb"),
        )
        self.descendants: set[int] = set()

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 120.0) -> None:
        self.wait_while_running(
            lambda: READY_MARK in self.stderr, timeout, "the host to say it is ready"
        )

    def wait_while_running(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        """Until ``ready()``, noting the host's descendants on the way; the host exiting
        first fails at once, with its stderr."""

        def check() -> bool:
            assert self.proc.poll() is None, self.stderr
            self._note_descendants()
            return ready()

        wait_until(check, timeout=timeout, what=what, interval=0.1, detail=lambda: self.stderr)
        self._note_descendants()

    def _note_descendants(self) -> None:
        try:
            self.descendants |= {
                p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)
            }
        except psutil.NoSuchProcess:
            pass

    def node_processes(self) -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter(["cmdline", "cwd", "status"]):
            try:
                if (
                    "workers.node" in (p.info["cmdline"] or [])
                    and str(p.info["cwd"] or "").startswith(str(self.root))
                    and p.info["status"] != psutil.STATUS_ZOMBIE
                ):
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return found

    def finish(self, timeout: float = 60.0) -> int:
        code = self.proc.wait(timeout)
        return code

    def left_running(self) -> list[int]:
        """What the host started and left behind (its worker, dev server, nodes)."""
        alive = []
        for pid in self.descendants | {p.pid for p in self.node_processes()}:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                continue
        return alive

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for pid in self.left_running():
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def records(self) -> list[dict[str, Any]]:
        out = []
        for line in self.archive.read_text().splitlines():
            frame = json.loads(line)
            payload = frame["payload"]
            assert payload["encoding"] == "utf8"
            out.append({"frame": frame, "record": json.loads(payload["value"]), "line": line})
        return out


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[list[HostProcess]]:
    started: list[HostProcess] = []
    yield started
    for host in started:
        host.kill()


class Client:
    """A raw prompt-RPC connection."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.file = self.sock.makefile("rb")

    def send(self, obj: object | bytes) -> None:
        data = obj if isinstance(obj, bytes) else json.dumps(obj).encode() + b"\n"
        self.sock.sendall(data)

    def event(self) -> dict[str, Any] | None:
        line = self.file.readline()
        return json.loads(line) if line else None

    def answer(self) -> tuple[list[str], dict[str, Any]]:
        deltas: list[str] = []
        while True:
            ev = self.event()
            assert ev is not None, "connection closed before the terminal event"
            if ev["type"] == "text_delta":
                deltas.append(ev["text"])
            else:
                return deltas, ev

    def close(self) -> None:
        self.file.close()  # the socket's fd stays open while its file object is
        self.sock.close()


def prompt(
    request_id: int, text: str = "The capital of France is", max_tokens: int = 8
) -> dict[str, Any]:
    return {"request_id": request_id, "prompt_text": text, "max_tokens": max_tokens}


def assert_clean_exit(host: HostProcess, code: int) -> list[dict[str, Any]]:
    assert code == 0, host.stderr
    wait_until(
        lambda: host.left_running() == [],
        timeout=10,
        what="nothing the host started left running",
        interval=0.2,
        detail=lambda: repr(host.left_running()),
    )
    records = host.records()
    kinds = [r["record"].get("kind") for r in records if r["record"].get("type") == "OrchLifecycle"]
    assert kinds[0] == "RunAccepted" and kinds[-1] == "RunTornDown", kinds
    assert SECRET not in host.archive.read_text()
    return records


def test_the_prompt_rpc_serves_each_connection_on_its_own_and_stdin_stop_ends_it(
    tmp_path: Path, hosts: list[HostProcess]
):
    # A 2048-token context: d's prompt below runs its 2000 tokens (about 30 s on one
    # core), far longer than its cancel can take on a busy machine (with the default 512,
    # it ran out of context in a few seconds and once finished before its cancel came).
    host = HostProcess(tmp_path, stages=1, extra_toml="[model]\nmax_context = 2048\n")
    hosts.append(host)
    t0 = time.monotonic()
    host.wait_ready()
    ready_s = time.monotonic() - t0

    # Deltas, then exactly one done, whose text is the deltas'.
    a = Client(host.port)
    a.send(prompt(7))
    deltas, done = a.answer()
    assert done["type"] == "done" and done["request_id"] == 7, done
    assert "".join(deltas) == done["final_text"] and done["tokens_generated"] == 8

    # A malformed line: a protocol error for that connection only (it is closed).
    b = Client(host.port)
    a.send(prompt(8))
    b.send(b"{not json\n")
    fault = b.event()
    assert (
        fault is not None
        and fault["type"] == "fault"
        and fault["error"].startswith("protocol error")
    )
    assert b.event() is None  # closed
    deltas, done = a.answer()
    assert done["type"] == "done" and done["request_id"] == 8

    # A second request while one is in flight: that connection's protocol error.
    c = Client(host.port)
    c.send(prompt(1, max_tokens=32))
    c.send(prompt(2))
    events = []
    while (ev := c.event()) is not None:
        events.append(ev)
    assert any(
        e["type"] == "fault" and e["request_id"] == 2 and "already in flight" in e["error"]
        for e in events
    ), events

    # A client that goes away mid-prompt cancels it: the next prompt starts at once.
    d = Client(host.port)
    d.send(prompt(1, text="Once upon a time", max_tokens=2000))  # outlasts the disconnect
    first = d.event()
    assert first is not None and first["type"] == "text_delta"
    d.close()
    gone = time.monotonic()
    e = Client(host.port)
    e.send(prompt(1))  # the same id as d's, on another connection: no collision
    _, done = e.answer()
    assert done["type"] == "done", done
    assert time.monotonic() - gone < 15  # not after d's 2000 tokens

    # Five connections at once: each gets its own complete answer, in admission order.
    clients = [Client(host.port) for _ in range(5)]
    answers: dict[int, tuple[list[str], dict[str, Any]]] = {}

    def ask(i: int) -> None:
        clients[i].send(prompt(1, text=f"Count to {i + 2}:", max_tokens=6))
        answers[i] = clients[i].answer()

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(answers) == list(range(5))
    for deltas, done in answers.values():
        assert done["type"] == "done" and "".join(deltas) == done["final_text"]

    assert host.proc.stdin is not None
    host.proc.stdin.write(b"  STOP \n")
    host.proc.stdin.flush()
    records = assert_clean_exit(host, host.finish())
    # The five: in the order the run admitted them (its lifecycle), they finished.
    five = {
        r["record"]["request_id"]
        for r in records
        if r["record"].get("type") == "OrchPromptEvent" and r["record"]["detail"]["connection"] > 5
    }
    life = [r["record"] for r in records if r["record"].get("type") == "OrchLifecycle"]
    accepted = [
        x["request_id"] for x in life if x["kind"] == "PromptAccepted" and x["request_id"] in five
    ]
    completed = [
        x["request_id"] for x in life if x["kind"] == "PromptCompleted" and x["request_id"] in five
    ]
    assert len(accepted) == 5 and completed == accepted
    # d's prompt (connection 4), and not another, was cancelled by its disconnect.
    d_ids = {
        r["record"]["request_id"]
        for r in records
        if r["record"].get("type") == "OrchPromptEvent" and r["record"]["detail"]["connection"] == 4
    }
    cancelled = {x["request_id"]: x["detail"] for x in life if x["kind"] == "PromptCancelled"}
    assert len(d_ids) == 1 and "cancelled" in cancelled[next(iter(d_ids))], (d_ids, cancelled)
    print(f"\n[figure] mvp-orchestrator start to RPC accepting, 1 stage: {ready_s:.1f} s")


def test_a_two_stage_archive_holds_the_whole_session_in_order_and_sigint_ends_it(
    tmp_path: Path, hosts: list[HostProcess]
):
    host = HostProcess(tmp_path, stages=2)
    hosts.append(host)
    t0 = time.monotonic()
    host.wait_ready()
    ready_s = time.monotonic() - t0
    a = Client(host.port)
    sent = time.monotonic()
    # The secret in a prompt: prompt text never enters the datastream (nor could the
    # secret, whatever carried it: the host redacts it).
    a.send(prompt(1, text=f"My token is {SECRET}. The capital of France is", max_tokens=12))
    first = a.event()
    first_s = time.monotonic() - sent
    assert first is not None and first["type"] == "text_delta"
    _, done = a.answer()
    assert done["type"] == "done"
    host.proc.send_signal(signal.SIGINT)
    records = assert_clean_exit(host, host.finish())

    frames = [r["frame"] for r in records]
    assert [f["arrival_seq"] for f in frames] == list(range(len(frames)))
    assert all(
        set(f)
        == {
            "arrival_seq",
            "arrival_unix_ms",
            "source",
            "stream",
            "channel",
            "channel_id",
            "position",
            "payload",
        }
        for f in frames
    )
    boot = [r["record"]["phase"] for r in records if r["record"].get("type") == "OrchBootstrap"]
    assert boot[0] == "config" and "orch_exit" in boot
    order = [
        "config",
        "local_runtime",
        "run_plan",
        "provider_start",
        "node_runtime_ready",
        "node_swim",
        "node_route",
        "runtime_ready_ack",
        "stage_provision",
        "weights_loaded",
        "prompt_rpc",
        "prompt_loop",
        "shutdown",
        "provider_stop",
        "orch_exit",
    ]
    firsts = [boot.index(p) for p in order]
    assert firsts == sorted(firsts), list(zip(order, firsts, strict=True))
    life = [r["record"]["kind"] for r in records if r["record"].get("type") == "OrchLifecycle"]
    assert life == [
        "RunAccepted",
        "RunPlanningStarted",
        "RunPlanningReady",
        "RunProvisioningStarted",
        "RunReadinessStarted",
        "RunReady",
        "PromptAccepted",
        "PromptCompleted",
        "RunOperatorStopped",
        "RunTearingDown",
        "RunTornDown",
    ], life
    phases = [r["record"]["phase"] for r in records if r["record"].get("type") == "OrchPromptEvent"]
    assert phases == ["received", "admitted", "first_delta", "done"], phases
    lines = [r for r in records if "line" in r["record"]]
    for node_id in (2, 3):
        mine = [
            r
            for r in lines
            if r["frame"]["channel"] == f"mvp.provisioning.logs.node.{node_id}.stdout"
        ]
        assert any(f"node {node_id} stage" in r["record"]["line"]["line"] for r in mine), node_id
        assert any(f"node {node_id} stopped" in r["record"]["line"]["line"] for r in mine), node_id
    events = [r["record"]["event"]["kind"] for r in records if "event" in r["record"]]
    assert events.count("NodeLive") == 2 and events.count("NodeStopped") == 2
    # Each node's own channels (DECISIONS 93), forwarded by the host from the run's
    # datastream, on the node's stream, each channel in order.
    for node_id in (2, 3):
        own = [
            r["frame"]
            for r in records
            if r["frame"]["source"] == "node_datastream"
            and r["frame"]["stream"] == f"mvp-node-1-{node_id}"  # run_id = 1
        ]
        channels = {f["channel"] for f in own}
        assert channels == {"mvp.node.load", "mvp.node.steps", "mvp.node.edges", "mvp.node.kv"}
        for channel in channels:
            positions = [f["position"] for f in own if f["channel"] == channel]
            assert positions == sorted(set(positions)), (node_id, channel, positions)
    print(
        f"\n[figure] mvp-orchestrator start to RPC accepting, 2 stages: {ready_s:.1f} s; "
        f"first delta over the RPC: {first_s * 1000:.0f} ms"
    )


def test_a_provider_failure_at_start_exits_1_with_one_line_and_leaves_nothing(
    tmp_path: Path, hosts: list[HostProcess]
):
    host = HostProcess(
        tmp_path,
        extra_toml='[provider]\nkind = "docker"\n',
        env={"DOCKER_HOST": f"unix://{tmp_path / 'no-daemon.sock'}"},
    )
    hosts.append(host)
    code = host.finish(90)
    assert code == 1
    lines = [line for line in host.stderr.splitlines() if line.startswith("mvp-orchestrator: ")]
    assert lines[-1].startswith(
        "mvp-orchestrator: run rejected: planning failed: provider 'docker' unavailable"
    ), host.stderr
    assert host.left_running() == []
    boot = [r["record"] for r in host.records() if r["record"].get("type") == "OrchBootstrap"]
    assert boot[-2]["phase"] == "orch_exit" and boot[-2]["status"] == "failed"


def test_a_prompt_rpc_that_cannot_bind_exits_1_after_a_clean_teardown(
    tmp_path: Path, hosts: list[HostProcess]
):
    """Process spec: an RPC bind failure is a startup failure of the prompt_rpc phase:
    the run is torn down (nothing left), a prompt_rpc failed record is in the archive,
    and the host exits 1 with one line naming the address. (And its native output is in
    its datastream.)"""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    native = "native-write-0123"  # written by libc to fds 1 and 2, past Python's streams
    env = {"MVP_TEST_HOST_NATIVE_WRITE": native}
    try:
        host = HostProcess(tmp_path, port=port, env=env)
        hosts.append(host)
        code = host.finish(240)
    finally:
        taken.close()
    assert code == 1, host.stderr
    lines = [line for line in host.stderr.splitlines() if line.startswith("mvp-orchestrator: ")]
    assert lines[-1].startswith(f"mvp-orchestrator: prompt RPC cannot bind 127.0.0.1:{port}")
    wait_until(lambda: host.left_running() == [], timeout=10, what="nothing left", interval=0.2)
    records = host.records()
    boot = [r["record"] for r in records if r["record"].get("type") == "OrchBootstrap"]
    assert [b["status"] for b in boot if b["phase"] == "prompt_rpc"] == ["failed"], boot
    kinds = [r["record"].get("kind") for r in records if r["record"].get("type") == "OrchLifecycle"]
    assert kinds[-1] == "RunTornDown", kinds
    assert READY_MARK not in host.stderr
    # The host's own output is captured at the file descriptor (issue 38 item 6): native
    # writes reach the datastream on their stream, and the terminal as before.
    stdio = {
        (r["record"]["line"]["stream"], r["record"]["line"]["line"])
        for r in records
        if r["frame"]["channel"].startswith("mvp.orch.stdio.")
    }
    assert ("Stdout", f"{native} on stdout") in stdio and ("Stderr", f"{native} on stderr") in stdio
    assert f"{native} on stderr" in host.stderr
    assert any(line.startswith("mvp-orchestrator: prompt RPC cannot bind") for _, line in stdio)


def test_a_provider_stop_that_fails_exits_1_naming_the_node(
    tmp_path: Path, hosts: list[HostProcess]
):
    """Process spec 10.13: a controlled shutdown (here the prompt RPC's shutdown control)
    succeeds only if the provider stop does; the run ends RunStopFailed and the host
    exits 1 with the node and the error."""
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"1": {"MVP_FAULT_PROVIDER_STOP": "1"}}))
    host = HostProcess(tmp_path, env={"MVP_TEST_FAULTS_FILE": str(faults)})
    hosts.append(host)
    host.wait_ready()
    # Stopped through the prompt RPC's shutdown control, answered before the stop.
    control = Client(host.port)
    control.send({"control": "shutdown"})
    assert control.event() == {"type": "shutdown_accepted"}
    control.close()
    code = host.finish(120)
    assert code == 1, host.stderr
    lines = [line for line in host.stderr.splitlines() if line.startswith("mvp-orchestrator: ")]
    assert "provider stop node 1: injected provider stop failure" in lines[-1], host.stderr
    wait_until(lambda: host.left_running() == [], timeout=10, what="nothing left", interval=0.2)


def test_a_configuration_error_starts_nothing(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MVP_")}
    env["MVP_STATE_DIR"] = str(tmp_path / "state")
    for argv, message in [
        (["--bogus"], 'mvp-orchestrator: unknown argument "--bogus"'),
        (["--pipeline-stages", "0"], "mvp-orchestrator: --pipeline-stages must be greater than 0"),
        (
            ["--provider", "mock"],
            'mvp-orchestrator: unsupported provider "mock"; use process, docker, or vastai',
        ),
    ]:
        out = subprocess.run(
            [sys.executable, "-m", "workers.host.main", *argv],
            cwd=str(tmp_path),
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 1 and out.stderr.strip() == message, out.stderr
    assert not (tmp_path / "state").exists()  # no server, no node, not even a directory


def test_spec_keys_that_would_do_nothing_stop_the_host_before_anything_starts(tmp_path: Path):
    # Defects 9 and 12: --worker-bin was checked then ignored; a tokenizer.json passed the
    # configuration and failed at stage provisioning. Both are configuration errors now,
    # read from the real file system (the host's PathFiles).
    env = {k: v for k, v in os.environ.items() if not k.startswith("MVP_")}
    env["MVP_STATE_DIR"] = str(tmp_path / "state")
    (tmp_path / "node-bin").write_text("#!/bin/sh\n")
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    (tmp_path / "tok.toml").write_text('[model]\ntokenizer_local_path = "tokenizer.json"\n')
    cases = [
        (["--worker-bin", "node-bin"], "mvp-orchestrator: --worker-bin is not supported: "),
        (
            ["--runtime-config", "tok.toml"],
            "mvp-orchestrator: model.tokenizer_local_path is not a GGUF file: "
            f"{tmp_path / 'tokenizer.json'} (",
        ),
    ]
    for argv, start in cases:
        out = subprocess.run(
            [sys.executable, "-m", "workers.host.main", *argv],
            cwd=str(tmp_path),
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 1 and out.stderr.strip().startswith(start), out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not (tmp_path / "state").exists()


def test_help_prints_the_usage_and_exits_0(tmp_path: Path):
    # DECISIONS: -h/--help alone is the one argument beyond the spec's five.
    for flag in ("-h", "--help"):
        out = subprocess.run(
            [sys.executable, "-m", "workers.host.main", flag],
            cwd=str(tmp_path),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0 and out.stdout.startswith("usage: mvp-orchestrator "), out
        assert "--worker-bin" not in out.stdout and out.stderr == ""


def test_a_stop_during_startup_exits_0_with_nothing_left(tmp_path: Path, hosts: list[HostProcess]):
    # DECISIONS 50. Planning is held (the harness's MVP_FAULT_PLAN_DELAY_S), so the stop
    # lands in startup whatever the machine's speed.
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"1": {"MVP_FAULT_PLAN_DELAY_S": "300"}}))
    host = HostProcess(tmp_path, env={"MVP_TEST_FAULTS_FILE": str(faults)})
    hosts.append(host)
    host.wait_while_running(
        lambda: host.archive.exists() and "RunPlanningStarted" in host.archive.read_text(),
        120,
        "RunPlanningStarted in the archive",
    )
    assert host.proc.stdin is not None
    host.proc.stdin.write(b"stop\n")
    host.proc.stdin.flush()
    records = assert_clean_exit(host, host.finish(120))
    assert READY_MARK not in host.stderr
    boot = [r["record"] for r in records if r["record"].get("type") == "OrchBootstrap"]
    assert not any(b["phase"] == "prompt_rpc" for b in boot), boot
    assert [b["status"] for b in boot if b["phase"] == "orch_exit"] == ["ready"], boot


def test_mvp_chat_in_a_terminal_streams_two_prompts_and_ctrl_d_exits(
    tmp_path: Path, hosts: list[HostProcess]
):
    host = HostProcess(tmp_path, stages=1)
    hosts.append(host)
    host.wait_ready()
    session = f"mvpchat{os.getpid()}"
    chat = f"{sys.executable} -m workers.host.chat --rpc 127.0.0.1:{host.port} --raw --max-tokens 6; echo EXITED=$?; sleep 30"
    tmux = ["tmux", "-L", session]
    subprocess.run(
        [*tmux, "new-session", "-d", "-s", session, "-x", "120", "-y", "30", "-c", str(REPO), chat],
        check=True,
    )
    try:

        def screen() -> str:
            return subprocess.run(
                [*tmux, "capture-pane", "-p", "-t", session], capture_output=True, text=True
            ).stdout

        def wait_for(pred: Callable[[str], bool]) -> str:
            def shown() -> str:
                text = screen()
                return text if pred(text) else ""

            return wait_until(
                shown, timeout=60, what="the chat's screen", interval=0.2, detail=screen
            )

        wait_for(lambda s: "prompt:>" in s)  # (the pane drops trailing spaces)
        subprocess.run(
            [*tmux, "send-keys", "-t", session, "The capital of France is", "Enter"], check=True
        )
        wait_for(lambda s: s.count("prompt:>") >= 2 and "Paris" in s)
        subprocess.run([*tmux, "send-keys", "-t", session, "Once upon a time", "Enter"], check=True)
        text = wait_for(lambda s: s.count("prompt:>") >= 3)
        assert "error:" not in text, text
        subprocess.run([*tmux, "send-keys", "-t", session, "C-d"], check=True)
        text = wait_for(lambda s: "EXITED=" in s)
        assert "EXITED=0" in text and "Traceback" not in text, text
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
    host.proc.send_signal(signal.SIGTERM)
    assert_clean_exit(host, host.finish())


def test_mvp_chat_over_the_rpc_uses_the_chat_template_and_shows_the_stop_reason(
    tmp_path: Path, hosts: list[HostProcess]
):
    """As the README says of mvp-chat, over the RPC too: each line under the model's chat
    template (unless --raw), each reply ending with its token count and stop reason;
    --max-tokens 0 is until the end, as in the demo. And the RPC's done says why."""
    host = HostProcess(tmp_path, stages=1)
    hosts.append(host)
    host.wait_ready()
    chat = subprocess.run(
        [sys.executable, "-m", "workers.host.chat", "--rpc", f"127.0.0.1:{host.port}",
         "--max-tokens", "0"],
        cwd=REPO,
        input="What is 2 + 2?\n",
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert chat.returncode == 0, chat.stderr
    # The bundled SmolLM2 answers this one well under its template (a plain completion
    # of the question runs on to the cap).
    # Its words depend on the kernel (llama.cpp's arithmetic with AVX-512 VNNI or AVX2,
    # DECISIONS 64; torch's elsewhere): "The answer is 4." or "The answer to this classic math problem is 4."
    assert re.search(r"The answer .*\b4\b", chat.stdout), chat.stdout
    assert re.search(r"\[\d+ tokens, stopped by eos, \d+ ms\]", chat.stdout), chat.stdout

    client = Client(host.port)
    client.send(prompt(3, max_tokens=4))
    _, done = client.answer()
    assert done["type"] == "done" and done["stop_reason"] == "max_tokens", done
    client.close()

    assert host.proc.stdin is not None
    host.proc.stdin.write(b"stop\n")
    host.proc.stdin.flush()
    assert_clean_exit(host, host.finish())
    # 'stop' on stdin answers with one line.
    assert "mvp-orchestrator: 'stop' on stdin: shutting down run mvp-run-1" in host.stderr
    assert "datastream: mvp-follow unix:" in host.stderr, host.stderr


def test_otel_console_does_not_stop_the_embedded_dev_server(
    tmp_path: Path, hosts: list[HostProcess]
):
    """OTEL_* is for our processes; the dev server the host starts never sees it (it
    exits 1 on console, and the host with it)."""
    host = HostProcess(tmp_path, stages=1, env={"OTEL_TRACES_EXPORTER": "console"})
    hosts.append(host)
    host.wait_ready()
    host.proc.send_signal(signal.SIGTERM)
    assert_clean_exit(host, host.finish())


def test_an_embedded_dev_server_that_dies_while_serving_is_started_again_and_the_run_goes_on(
    tmp_path: Path, hosts: list[HostProcess]
):
    """The run lives in the dev server's database, the nodes and the worker reconnect by
    themselves: the host starts its server again on the same port, prompts keep being
    served, and the session still ends clean."""
    host = HostProcess(tmp_path, stages=1)
    hosts.append(host)
    host.wait_ready()
    a = Client(host.port)
    a.send(prompt(1, text="The capital of France is", max_tokens=8))
    before, done = a.answer()
    assert done["type"] == "done"

    def servers() -> list[psutil.Process]:
        found = []
        for p in psutil.Process(host.proc.pid).children():
            try:
                if "start-dev" in p.cmdline():
                    found.append(p)
            except psutil.Error:  # the killed one, gone or not yet reaped
                pass
        return found

    (first,) = servers()
    first.kill()
    # The host says it starts the server again before the new process exists: waited
    # for until it does (however loaded the machine).
    host.wait_while_running(
        lambda: (
            "starting it again on the same port" in host.stderr
            and [p.pid for p in servers()] not in ([], [first.pid])
        ),
        60,
        "the server's restart",
    )
    assert "exited with -9" in host.stderr
    (second,) = servers()
    assert second.pid != first.pid
    a.send(prompt(2, text="The capital of France is", max_tokens=8))
    after, done = a.answer()
    assert done["type"] == "done", done
    assert "".join(after) == "".join(before)  # greedy: the same text from the same run
    host.proc.send_signal(signal.SIGINT)
    assert_clean_exit(host, host.finish())
