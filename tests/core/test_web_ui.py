"""The run's static summary and details for the Temporal Web UI (mvp_core/web_ui.py):
its shape in ids, names and counts, never the node environment or prompt text."""

from __future__ import annotations

from mvp_core.models import RunRequest
from mvp_core.web_ui import run_details, run_summary


def request(**fields: object) -> RunRequest:
    return RunRequest.model_validate({"model": {"bundled": "SmolLM2-135M-Instruct.Q4_1"}, **fields})


def test_the_summary_is_one_line_of_run_model_stages_and_provider():
    assert run_summary(7, request(pipeline_stages=2)) == (
        "run 7: SmolLM2-135M-Instruct.Q4_1, 2 stage(s) on process"
    )
    assert "\n" not in run_summary(7, request(model={"path": "/m/" + "x" * 300 + ".gguf"}))


def test_the_details_name_the_models_source_stages_provider_and_limits():
    text = run_details(7, request(pipeline_stages=3, default_max_tokens=64, max_context=2048))
    assert text.splitlines()[0] == "**run 7**"
    assert "model: SmolLM2-135M-Instruct.Q4_1 (bundled)" in text
    assert "stages: 3 (activations float32)" in text and "provider: process" in text
    assert "up to 8 admitted at once; tokens 64 by default; context at most 2048 tokens" in text
    assert "MvpRunPhase" in text
    hub = run_details(
        8,
        request(
            model={"hf": {"repo": "acme/m-GGUF", "file": "q/m.Q4.gguf", "revision": "v2"}},
            provider="vastai",
            vastai={"image": "ghcr.io/acme/node:1"},
        ),
    )
    assert "model: q/m.Q4.gguf of acme/m-GGUF (Hugging Face, v2)" in hub
    assert "provider: vastai, image ghcr.io/acme/node:1" in hub
    assert "tokens until the end (no default cap)" in hub
    docker = run_details(9, request(provider="docker", worker_image="acme/node:3"))
    assert "provider: docker, image acme/node:3" in docker
    local = run_details(10, request(model={"path": "/home/u/models/private/m.gguf"}))
    assert "model: m.gguf (a file on the provider's host)" in local and "/home/u" not in local


def test_the_details_carry_no_node_environment():
    text = run_details(7, request(node_env={"MY_SETTING": "value-123"}))
    assert "MY_SETTING" not in text and "value-123" not in text
