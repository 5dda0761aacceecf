"""Run policies shared by the run request and the prompts' inputs."""

from __future__ import annotations

from enum import StrEnum


class NodeLossPolicy(StrEnum):
    """What a run does when a node is lost while it serves (DECISIONS 68)."""

    FAIL = "fail"  # the specs' fail-stop: the run faults and tears down
    REPLACE = "replace"  # a new node takes the lost one's layers; prompts continue
