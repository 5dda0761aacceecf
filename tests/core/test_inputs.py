"""Signal and update payloads are untrusted: typed message or a reason, never a crash."""

import pytest

from mvp_core.inputs import InvalidInput, NotJson, decode_one
from mvp_core.models import CancelPrompt, RequestShutdown, ShutdownReason, SubmitPrompt


def test_no_payload_is_an_operator_shutdown():
    req = decode_one("request_shutdown", RequestShutdown, [], missing_is_default=True)
    assert req.reason is ShutdownReason.OPERATOR_REQUESTED and req.run_id is None
    null = decode_one("request_shutdown", RequestShutdown, [None], missing_is_default=True)
    assert null == req
    # The spec's reply_to is accepted and not used (DECISIONS 82); run_id may be absent.
    spec_shaped = decode_one(
        "request_shutdown",
        RequestShutdown,
        [{"reason": "host_requested", "reply_to": "orchestrator-7/replies"}],
        missing_is_default=True,
    )
    assert spec_shaped.reason is ShutdownReason.HOST_REQUESTED and spec_shaped.run_id is None


@pytest.mark.parametrize(
    ("values", "words"),
    [
        ([], "missing payload"),
        (["hello"], "got a string"),
        ([[1, 2]], "got an array"),
        ([7], "got a number"),
        ([NotJson()], "not JSON"),
        ([{"request_id": 1}, {"request_id": 2}], "got 2"),
        ([{"request_id": "x-secret-x"}], "request_id"),
        ([{"request_id": 1, "extra": 1}], "extra"),
    ],
)
def test_a_malformed_payload_names_what_is_wrong_and_never_its_content(values, words):
    with pytest.raises(InvalidInput) as err:
        decode_one("cancel_prompt", CancelPrompt, values)
    assert words in err.value.reason
    assert "x-secret-x" not in str(err.value) and "hello" not in str(err.value)
    assert err.value.kind == "cancel_prompt"


def test_an_unknown_shutdown_reason_is_refused_naming_the_field():
    with pytest.raises(InvalidInput) as err:
        decode_one("request_shutdown", RequestShutdown, [{"reason": "because-secret"}])
    assert "reason" in err.value.reason and "because-secret" not in err.value.reason


def test_a_valid_prompt_decodes():
    p = decode_one("submit_prompt", SubmitPrompt, [{"request_id": 3, "prompt_text": "hi"}])
    assert p.request_id == 3 and p.prompt_text == "hi"
