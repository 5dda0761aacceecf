"""Node directories under a host's state directory are pruned at the host's start: the
last few runs' stay, and so does any a live node still runs in (issue 21, item 18)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from mvp_core.names import NODE_MODULE, resource_arg
from tests.helpers.waits import wait_until
from workers.host.embedded import prune_node_dirs


def node_dir(state: Path, run_id: int, node_id: int, age_s: float) -> Path:
    d = state / "nodes" / f"mvp-{run_id}-{node_id}-0123abcd"
    d.mkdir(parents=True)
    (d / "node.log").write_text("a node's log\n")
    when = time.time() - age_s
    os.utime(d, (when, when))
    return d


def test_old_runs_go_the_last_few_and_live_nodes_stay(tmp_path: Path):
    state = tmp_path / "state"
    for run_id in range(1, 9):  # run 8 is the newest
        for node_id in (1, 2):
            node_dir(state, run_id, node_id, age_s=3600 + (9 - run_id) * 60)
    (state / "nodes" / "not-a-node-dir").mkdir()
    # A node of old run 1 still runs (marked and in its directory, as a provider starts
    # it): its directory stays, its dead sibling's goes.
    live_dir = state / "nodes" / "mvp-1-1-0123abcd"
    live = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)", NODE_MODULE,
         resource_arg(live_dir.name)],
        cwd=live_dir,
    )  # fmt: skip
    try:
        wait_until(
            lambda: Path(f"/proc/{live.pid}/cwd").resolve() == live_dir.resolve(),
            timeout=10,
            what="the live node in its directory",
        )
        removed = prune_node_dirs(state, keep_runs=5)
    finally:
        live.kill()
        live.wait()
    assert removed == ["mvp-1-2-0123abcd", "mvp-2-1-0123abcd", "mvp-2-2-0123abcd",
                       "mvp-3-1-0123abcd", "mvp-3-2-0123abcd"]  # fmt: skip
    left = sorted(p.name for p in (state / "nodes").iterdir())
    assert left == sorted(
        ["mvp-1-1-0123abcd", "not-a-node-dir"]
        + [f"mvp-{r}-{n}-0123abcd" for r in range(4, 9) for n in (1, 2)]
    )


def test_a_young_directory_stays_whatever_its_run(tmp_path: Path):
    """Another host's worker may be starting that node right now."""
    state = tmp_path / "state"
    node_dir(state, 1, 1, age_s=5)
    node_dir(state, 2, 1, age_s=3600)
    assert prune_node_dirs(state, keep_runs=0) == ["mvp-2-1-0123abcd"]
    assert prune_node_dirs(state, keep_runs=0) == []


def test_no_node_directory_yet_is_nothing_to_do(tmp_path: Path):
    assert prune_node_dirs(tmp_path / "never-used") == []
