"""A node forks no process while it loads a stage: a child carries the node's command
line (its ``--resource=`` mark) until its exec, and so looks like a second node to the
provider's and the chaos census's scans of processes (a chaos cell once saw the head node
"started twice" during stage provisioning: ``ctypes.util.find_library`` ran ``ldconfig``)."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

from workers.node.engine import loader


def test_trim_heap_starts_no_process(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_child(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"a node started a process: {args!r}")

    monkeypatch.setattr(subprocess.Popen, "__init__", no_child)
    loader.trim_heap()
