"""docs/vastai.md's worked example is what the code takes: its run request is
docs/examples/run-vastai.json and a valid RunRequest; its host TOML resolves with the
host's config loader into the same run (less ``max_dph``, which the TOML has no key for)."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from mvp_core.host_config import resolve_config, to_run_request
from mvp_core.models import ProviderKind
from mvp_core.validation import parse_request
from tests.core.test_host_config import CWD, MemoryFiles

pytestmark = pytest.mark.quick

REPO = Path(__file__).resolve().parents[2]
DOC = (REPO / "docs" / "vastai.md").read_text()
EXAMPLE = REPO / "docs" / "examples" / "run-vastai.json"
HOME = "/home/u"


def block(lang: str) -> str:
    section = DOC.split("## A worked example", 1)[1].split("\n## ", 1)[0]
    (found,) = re.findall(rf"```{lang}\n(.*?)```", section, re.S)
    return re.sub(r"^   ", "", found, flags=re.M)  # the list item's indent


def test_the_worked_examples_run_request_is_the_shipped_one_and_valid():
    shown = json.loads(block("json"))
    assert shown == json.loads(EXAMPLE.read_text())
    request = parse_request(shown)  # the run's own check (RunRejectedError otherwise)
    assert request.provider is ProviderKind.VASTAI and request.pipeline_stages == 2
    assert request.vastai.image == "ghcr.io/your-org/mvp-node:0.1"


def test_the_worked_examples_host_toml_resolves_into_the_same_run():
    toml = block("toml")
    tomllib.loads(toml)  # plain TOML first
    path = f"{CWD}/vast.toml"
    identity = f"{HOME}/.ssh/id_ed25519"
    cfg = resolve_config(
        ["--runtime-config", "vast.toml"],
        {"VASTAI_API_KEY": "k" * 32, "HOME": HOME},
        CWD,
        MemoryFiles({path: toml, identity: "key"}),
    )
    assert cfg.provider is ProviderKind.VASTAI and cfg.vastai is not None
    assert str(cfg.vastai.ssh_identity) == identity
    from_toml = to_run_request(cfg)
    from_json = parse_request(json.loads(EXAMPLE.read_text()))
    assert from_toml.model == from_json.model
    assert (from_toml.pipeline_stages, from_toml.max_context) == (2, from_json.max_context)
    assert from_toml.default_max_tokens == from_json.default_max_tokens
    assert from_toml.vastai.model_dump(exclude={"max_dph"}) == from_json.vastai.model_dump(
        exclude={"max_dph"}
    )
