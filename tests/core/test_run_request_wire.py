"""What a client sends as a run's input (the Web UI shows it as the run's input): no
settings of a provider the run does not use, no ``null`` optional fields (issue 21,
item 18), and the same request back when the worker validates it."""

from __future__ import annotations

import json

from mvp_core.models import DockerSettings, ModelSource, ProviderKind, RunRequest


def test_a_process_run_sends_no_vastai_or_docker_defaults_and_no_null_run_id():
    req = RunRequest(model=ModelSource(bundled="SmolLM2-135M-Instruct.Q4_1"), pipeline_stages=2)
    sent = json.loads(req.model_dump_json())
    assert "vastai" not in sent and "docker" not in sent, sent
    assert "run_id" not in sent and "default_max_tokens" not in sent, sent
    assert sent["provider"] == "process" and sent["pipeline_stages"] == 2
    assert RunRequest.model_validate(sent) == req


def test_the_runs_own_provider_section_and_given_ones_are_sent():
    vast = RunRequest(provider=ProviderKind.VASTAI, run_id=7)
    sent = json.loads(vast.model_dump_json())
    assert "vastai" in sent and "docker" not in sent and sent["run_id"] == 7
    given = RunRequest(docker=DockerSettings())  # given, even with its defaults
    assert "docker" in json.loads(given.model_dump_json())
    assert RunRequest.model_validate_json(vast.model_dump_json()) == vast
