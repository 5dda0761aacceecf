import json
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError, field_validator

from mvp_core.models import (
    DockerSettings,
    ModelSource,
    ProviderKind,
    RunRequest,
    SubmitPrompt,
    VastAiSettings,
)
from mvp_core.validation import (
    MAX_ERROR_CHARS,
    MAX_ERRORS_SHOWN,
    RunRejectedError,
    describe_invalid,
    parse_request,
    resolve_run_id,
    validate_request,
)

OK = RunRequest(model=ModelSource(bundled="SmolLM2-135M-Instruct.Q4_1"))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, "max_active_prompts: Input should be greater than or equal to 1"),
        (65, "max_active_prompts: Input should be less than or equal to 64"),
        (
            "8x",
            "max_active_prompts: Input should be a valid integer, unable to parse string as an integer",
        ),
    ],
)
def test_max_active_prompts_out_of_range_is_rejected_naming_it(value, message):
    with pytest.raises(RunRejectedError) as err:
        parse_request(
            {"model": {"bundled": "SmolLM2-135M-Instruct.Q4_1"}, "max_active_prompts": value}
        )
    assert str(err.value) == f"invalid run request: {message}"
    assert (
        parse_request({"model": {"bundled": "x"}, "max_active_prompts": 64}).max_active_prompts
        == 64
    )


def test_prompt_host_is_workflow_or_run_and_a_bad_one_is_named():
    ok = {"model": {"bundled": "SmolLM2-135M-Instruct.Q4_1"}}
    assert parse_request(ok).prompt_host.value == "workflow"
    assert parse_request({**ok, "prompt_host": "run"}).prompt_host.value == "run"
    with pytest.raises(RunRejectedError) as err:
        parse_request({**ok, "prompt_host": "thread"})
    assert "prompt_host" in str(err.value) and "'workflow' or 'run'" in str(err.value)


def test_layer_split_is_even_or_balanced_and_a_bad_one_is_named():
    ok = {"model": {"bundled": "SmolLM2-135M-Instruct.Q4_1"}}
    assert parse_request(ok).layer_split.value == "even"
    assert parse_request({**ok, "layer_split": "balanced"}).layer_split.value == "balanced"
    with pytest.raises(RunRejectedError) as err:
        parse_request({**ok, "layer_split": "by-memory"})
    assert "layer_split" in str(err.value) and "'even' or 'balanced'" in str(err.value)


@pytest.mark.parametrize("example", sorted(Path(__file__).parents[2].glob("docs/examples/*.json")))
def test_the_shipped_run_requests_are_valid(example: Path):
    parse_request(json.loads(example.read_text()))


def test_run_id_comes_from_the_workflow_id():
    assert resolve_run_id(OK, "mvp-run-7") == 7
    assert resolve_run_id(OK.model_copy(update={"run_id": 7}), "mvp-run-7") == 7


def test_run_id_different_from_workflow_id_is_rejected():
    with pytest.raises(RunRejectedError, match="does not match"):
        resolve_run_id(OK.model_copy(update={"run_id": 8}), "mvp-run-7")


def test_missing_run_id_is_rejected():
    with pytest.raises(RunRejectedError, match="missing run id"):
        resolve_run_id(OK, "something-else")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"pipeline_stages": 0}, "must be greater than 0"),
        ({"model": ModelSource()}, "missing model source"),
        ({"model": ModelSource(bundled="x", path="/y")}, "missing model source"),
        ({"prompt_queue_capacity": 9}, "between 1 and 8"),
        (
            {"provider": ProviderKind.VASTAI, "vastai": VastAiSettings(image="x")},
            "^vastai.bootstrap_command is required when the provider is vastai$",
        ),
        (
            {"provider": ProviderKind.VASTAI, "vastai": VastAiSettings(bootstrap_command="go")},
            "^vastai.image is required when the provider is vastai$",
        ),
        (
            {
                "provider": ProviderKind.VASTAI,
                "vastai": VastAiSettings(image="a b", bootstrap_command="go"),
            },
            "invalid vastai.image",
        ),
        (
            {
                "provider": ProviderKind.VASTAI,
                "worker_image": "img",
                "vastai": VastAiSettings(image="img", bootstrap_command="go"),
            },
            "worker_image is a docker provider setting",
        ),
        ({"provider": ProviderKind.DOCKER, "worker_image": "bad image!"}, "invalid worker_image"),
        (
            {"provider": ProviderKind.DOCKER, "docker": DockerSettings(gpus="0;rm")},
            "invalid docker.gpus",
        ),
        ({"docker": DockerSettings(gpus="all")}, "docker.gpus is a docker provider setting"),
        ({"docker": DockerSettings(cpus=1)}, "docker.cpus is a docker provider setting"),
        (
            {"docker": DockerSettings(memory=1 << 30)},
            "docker.memory is a docker provider setting",
        ),
        (
            {"docker": DockerSettings(memory_per_stage=True)},
            "docker.memory_per_stage is a docker provider setting",
        ),
        (
            {
                "provider": ProviderKind.DOCKER,
                "docker": DockerSettings(memory=1 << 30, memory_per_stage=True),
            },
            "docker.memory and docker.memory_per_stage: choose one",
        ),
        ({"node_env": {"HF_TOKEN": "x"}}, "looks like a secret"),
        ({"node_env": {"MVP_FAULT_MUTE": "1"}}, "test-only fault injection"),
        ({"node_env": {"mvp_fault_text_delay_ms": "5"}}, "test-only fault injection"),
        ({"node_env": {"MVP_TEST_FAULTS_ALLOWED": "1"}}, "test-only fault injection"),
        ({"node_env": {"MVP_RUN_ID": "9"}}, "set by the provider"),
        ({"node_env": {"TEMPORAL_ADDRESS": "elsewhere:7233"}}, "set by the provider"),
        ({"node_env": {"LD_PRELOAD": "/tmp/x.so"}}, "set by the provider"),
        ({"node_env": {"PYTHONPATH": "/tmp"}}, "set by the provider"),
        ({"node_env": {"PATH": "/tmp"}}, "set by the provider"),
        (
            {"worker_image": "mvp-orchestrator-node:1"},
            "^worker_image is a docker provider setting; a process node runs",
        ),
        (
            {"one_shot": SubmitPrompt(request_id=1, prompt_text="")},
            "^one_shot.prompt_text must not be empty$",
        ),
        (
            {"one_shot": SubmitPrompt(request_id=1, prompt_text="x", messages=[])},
            "^one_shot.messages need one_shot.chat = true$",
        ),
    ],
)
def test_invalid_requests_are_rejected_naming_what_is_wrong(change, message):
    with pytest.raises(RunRejectedError, match=message):
        validate_request(OK.model_copy(update=change))


def test_valid_request_passes():
    validate_request(OK)


def test_malformed_requests_name_every_bad_field_and_never_echo_values():
    raw = {
        "model": {"bundled": "SmolLM2-135M-Instruct.Q4_1"},
        "stream_batch_ms": 5,
        "engine": {"token_path_nice": 50},
        "pipeline_stage": 2,
        "node_env": {"A": 12345},
    }
    with pytest.raises(RunRejectedError) as err:
        parse_request(raw)
    text = str(err.value)
    assert text.startswith("invalid run request: ")
    for part in (
        "stream_batch_ms: Input should be greater than or equal to 25",
        "engine.token_path_nice: Input should be less than or equal to 19",
        "pipeline_stage: Extra inputs are not permitted",
        "node_env.A: Input should be a valid string",
    ):
        assert part in text, text
    assert "12345" not in text
    for bad, kind in ((None, "no input"), ([1], "an array"), ("x", "a string"), (3, "a number")):
        with pytest.raises(RunRejectedError, match=f"expected a JSON object, got {kind}$"):
            parse_request(bad)
    assert parse_request(OK.model_dump(mode="json")) == OK


def test_nodes_ignore_fault_knobs_unless_their_own_environment_allows_them(monkeypatch):
    from workers.node.config import FaultInjection

    monkeypatch.setenv("MVP_FAULT_MUTE", "1")
    monkeypatch.setenv("MVP_FAULT_TEXT_DELAY_MS", "50")
    monkeypatch.delenv("MVP_TEST_FAULTS_ALLOWED", raising=False)
    assert FaultInjection.from_env() == FaultInjection()
    monkeypatch.setenv("MVP_TEST_FAULTS_ALLOWED", "1")
    assert FaultInjection.from_env().mute and FaultInjection.from_env().text_delay_s == 0.05


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (
            {"model": {"bundled": "m"}, "timeouts": {"readiness_s": float("inf")}},
            "timeouts.readiness_s",
        ),
        ({"model": {"bundled": "m"}, "timeouts": {"ack_s": 1e300}}, "timeouts.ack_s"),
    ],
)
def test_unbounded_timeouts_are_rejected_before_anything_starts(raw, field):
    with pytest.raises(RunRejectedError, match=field):
        parse_request(raw)


@pytest.mark.parametrize(
    "change",
    [
        {"request_id": 2**64},
        {"seed": 2**64},
        {"top_k": 2**32},
        {"temperature": float("inf")},
        {"top_p": 1e-50},
        {"logprobs": True, "top_logprobs": 21},
        {"logprobs": True, "top_logprobs": -1},
        {"top_logprobs": 2},  # without logprobs
    ],
)
def test_prompt_values_the_data_plane_cannot_carry_are_invalid(change):
    from pydantic import ValidationError

    from mvp_core.models import SubmitPrompt

    with pytest.raises(ValidationError):
        SubmitPrompt.model_validate({"request_id": 1, "prompt_text": "x", **change})


def test_a_prompts_logprobs_are_off_by_default_and_name_their_field():
    from pydantic import ValidationError

    from mvp_core.models import SubmitPrompt

    plain = SubmitPrompt(request_id=1, prompt_text="x")
    assert (plain.logprobs, plain.top_logprobs) == (False, 0)
    asks = SubmitPrompt(request_id=1, prompt_text="x", logprobs=True, top_logprobs=20)
    assert (asks.logprobs, asks.top_logprobs) == (True, 20)
    with pytest.raises(ValidationError, match="top_logprobs needs logprobs"):
        SubmitPrompt(request_id=1, prompt_text="x", top_logprobs=3)
    with pytest.raises(ValidationError, match="top_logprobs"):
        SubmitPrompt(request_id=1, prompt_text="x", logprobs=True, top_logprobs=21)


def test_a_prompts_response_format_is_checked_and_bounded():
    """DECISIONS 89: a format is compiled when the prompt is validated (in the pure
    core, before the run admits it); its JSON is at most 16 KiB."""
    from pydantic import ValidationError

    from mvp_core.models import ResponseFormat, SubmitPrompt

    assert SubmitPrompt(request_id=1, prompt_text="x").response_format is None
    obj = SubmitPrompt(request_id=1, prompt_text="x", response_format={"type": "json_object"})
    assert obj.response_format == ResponseFormat(type="json_object")
    assert obj.response_format.text() == '{"type":"json_object"}'
    schema = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"const": 1}}}
    fmt = ResponseFormat(type="json_schema", json_schema=schema)
    assert (
        fmt.text()
        == '{"schema":{"properties":{"a":{"const":1},"b":{"type":"string"}},"type":"object"},"type":"json_schema"}'
    )
    for bad, message in [
        ({"type": "json_schema"}, "goes with type json_schema"),
        ({"type": "json_object", "json_schema": {}}, "goes with type json_schema"),
        ({"type": "text"}, "type"),
        ({"type": "json_schema", "json_schema": {"type": "string", "maxLength": 3}},
         "'maxLength' not supported"),
        ({"type": "json_schema", "json_schema": {"enum": ["x" * 1000] * 17}}, "at most 16384"),
    ]:  # fmt: skip
        with pytest.raises(ValidationError, match=message):
            SubmitPrompt(request_id=1, prompt_text="x", response_format=bad)


def test_a_huge_malformed_request_is_refused_in_a_bounded_message():
    raw = {"model": {"bundled": "m"}, **{f"a{i}": 0 for i in range(5000)}}
    with pytest.raises(RunRejectedError) as err:
        parse_request(raw)
    assert len(str(err.value)) < 1000 and "and 4992 more" in str(err.value)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"max_offers": 0}, "vastai.max_offers: Input should be greater than or equal to 1"),
        ({"loading_timeout_s": -1}, "vastai.loading_timeout_s: Input should be greater than 0"),
        (
            {"min_reliability": 1.5},
            "vastai.min_reliability: Input should be less than or equal to 1",
        ),
        (
            {"dataplane_port": 80},
            "vastai.dataplane_port: Input should be greater than or equal to 1024",
        ),
        ({"ssh_user": "root;rm"}, "vastai.ssh_user: String should match pattern"),
    ],
)
def test_bad_vastai_numbers_are_rejected_naming_the_field(bad, message):
    raw = {"model": {"bundled": "x"}, "provider": "vastai", "vastai": bad}
    with pytest.raises(ValidationError) as info:
        RunRequest.model_validate(raw)
    assert describe_invalid(info.value).startswith(message)


def test_a_refusal_is_bounded_each_reason_and_the_fields_it_names():
    """At most MAX_ERRORS_SHOWN fields, each path 80 and each reason MAX_ERROR_CHARS
    characters at most (a reason a validator wrote may be long), never a value."""

    class Wordy(BaseModel):
        text: str

        @field_validator("text")
        @classmethod
        def _never(cls, value: str) -> str:
            raise ValueError("because " * 100)

    with pytest.raises(ValidationError) as info:
        Wordy(text="SECRET-VALUE")
    text = describe_invalid(info.value)
    assert text.startswith("text: Value error, because because") and text.endswith("...")
    assert len(text) == len("text: ") + MAX_ERROR_CHARS and "SECRET" not in text
    with pytest.raises(ValidationError) as info:
        RunRequest.model_validate({f"field_{i}_{'x' * 200}": "SECRET" for i in range(20)})
    text = describe_invalid(info.value)
    assert text.count(": Extra inputs are not permitted") == MAX_ERRORS_SHOWN
    assert text.endswith("; and 12 more") and "SECRET" not in text
    assert len(text) < MAX_ERRORS_SHOWN * (80 + 40)


def test_every_example_run_request_is_valid_and_the_serving_ones_replace_lost_nodes():
    import json
    from pathlib import Path

    from mvp_core.models import NodeLossPolicy, RunRequest

    examples = Path(__file__).resolve().parents[2] / "docs" / "examples"
    found = sorted(examples.glob("run-*.json"))
    assert len(found) >= 5
    for path in found:
        request = RunRequest.model_validate(json.loads(path.read_text()))
        if path.name.startswith("run-serve"):
            assert request.on_node_loss is NodeLossPolicy.REPLACE, path.name  # DECISIONS 68
