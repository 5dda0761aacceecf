"""engine.address_layout: a node re-execs itself without address-space randomization."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from workers.node.layout import ADDR_NO_RANDOMIZE

REPO = Path(__file__).resolve().parents[2]
PROBE = """
import os, sys
from workers.node.layout import ensure_layout, randomized
note = ensure_layout()
print(os.getpid(), randomized(), note, sys.orig_argv[1:3], flush=True)
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def _probe(layout: str) -> list[str]:
    """[pid as started, pid as it reports itself, randomized, the rest]."""
    env = {**os.environ, "MVP_ADDRESS_LAYOUT": layout, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", PROBE],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return [str(proc.pid), *out.split(maxsplit=2)]


def test_fixed_layout_re_execs_once_in_the_same_process_without_randomization() -> None:
    started, pid, randomized, rest = _probe("fixed")
    assert randomized == "False"
    assert rest.startswith("None ['-c',"), rest  # no note: it took, with the same command
    assert pid == started  # exec keeps the pid: the provider's pid file still holds


def test_randomized_layout_leaves_the_process_alone() -> None:
    assert own_personality_randomized()
    _, _, randomized, rest = _probe("randomized")
    assert randomized == "True" and rest.startswith("None"), rest


def own_personality_randomized() -> bool:
    return not int(Path("/proc/self/personality").read_text(), 16) & ADDR_NO_RANDOMIZE
