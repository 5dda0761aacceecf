import pytest

from mvp_core.models import ModelSource, ProviderKind, RunRequest
from mvp_core.validation import RunRejectedError, resolve_run_id, validate_request

OK = RunRequest(model=ModelSource(bundled="SmolLM2-135M-Instruct.Q4_1"))


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
        ({"provider": ProviderKind.DOCKER}, "needs worker_image"),
        ({"node_env": {"HF_TOKEN": "x"}}, "looks like a secret"),
    ],
)
def test_invalid_requests_are_rejected_naming_what_is_wrong(change, message):
    with pytest.raises(RunRejectedError, match=message):
        validate_request(OK.model_copy(update=change))


def test_valid_request_passes():
    validate_request(OK)
