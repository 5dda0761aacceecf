"""``mvp-orchestrator --dashboard``: the host serves the dashboard of the run it hosts
(DECISIONS 92), fed by the run's datastream, from the run's start to the host's exit.
The fed state itself, frame by frame, is tests/gateway/test_dashboard_feed.py."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx

from tests.host.test_host import HostProcess, free_port, hosts  # noqa: F401 (fixture)

DASHBOARD_MARK = "dashboard on "


def read_stream(url: str, frames: list[dict[str, Any]], ended: threading.Event) -> None:
    """Every frame of one event stream until it ends (the host exits)."""
    try:
        with httpx.stream("GET", url, timeout=httpx.Timeout(10.0, read=200.0)) as reply:
            assert reply.status_code == 200
            assert reply.headers["content-type"].startswith("text/event-stream")
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    frames.append(json.loads(line.removeprefix("data: ")))
    except httpx.HTTPError:
        pass  # the server went away with the host
    finally:
        ended.set()


def test_the_host_serves_its_runs_dashboard_fed_by_its_datastream(
    tmp_path: Path,
    hosts: list[HostProcess],  # noqa: F811
) -> None:
    port = free_port()
    host = HostProcess(tmp_path, argv=["--dashboard", str(port)])
    hosts.append(host)
    host.wait_while_running(
        lambda: DASHBOARD_MARK in host.stderr, 120, "the host to print its dashboard's URL"
    )
    url = f"http://127.0.0.1:{port}/dashboard"
    assert f"run mvp-run-1 dashboard on {url}" in host.stderr
    page = httpx.get(url, timeout=10)
    assert page.status_code == 200 and 'new EventSource("dashboard/events")' in page.text

    frames: list[dict[str, Any]] = []
    ended = threading.Event()
    reader = threading.Thread(target=read_stream, args=(url + "/events", frames, ended))
    reader.start()
    host.wait_ready()

    def served() -> dict[str, Any]:
        assert frames, "no frame yet"
        run = frames[-1]["runs"][0]
        assert run["workflow_id"] == "mvp-run-1" and run["served"]
        return run

    def ready_from_stream() -> bool:
        if not frames:
            return False
        run = served()
        stages = run["stages"]
        return (
            run["phase"] == "prompt_ready"
            and run["datastream"].startswith("following the run's datastream")
            and [s["state"] for s in stages] == ["ready"]
            and stages[0]["log"] is not None
            and stages[0]["log"]["source"] == "datastream"
            and any(e["text"].startswith("RunReady") for e in run["events"])
        )

    host.wait_while_running(ready_from_stream, 60, "the dashboard to show the run ready")
    assert len(frames[-1]["runs"]) == 1  # the host shows its own run only

    host.proc.stdin.write(b"stop\n")  # type: ignore[union-attr]
    host.proc.stdin.flush()  # type: ignore[union-attr]
    assert host.finish(120) == 0, host.stderr
    assert ended.wait(30), "the event stream outlived the host"
    reader.join(5)
    last = served()
    # The page keeps the run's end: its last frame came before the server stopped.
    assert last["phase"] == "torn_down", last
    assert last["status"] == "completed", last
    assert any(e["text"].startswith("RunTornDown") for e in last["events"])
    assert host.left_running() == []
