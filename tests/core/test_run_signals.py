"""The run's one signal table (mvp_core/run_signals.py): every sender names its signal by
the message it sends, and the run takes each report through its RunState rule."""

from __future__ import annotations

import pytest

from mvp_core import names
from mvp_core.models import CancelPrompt, RequestShutdown, StageReady, WeightsReady
from mvp_core.run_signals import REPORT_RULES, RUN_SIGNALS, signal_name
from mvp_core.run_state import RunState


def test_each_message_names_its_one_signal():
    assert signal_name(RequestShutdown()) == names.SIGNAL_REQUEST_SHUTDOWN
    assert signal_name(CancelPrompt(request_id=3)) == names.SIGNAL_CANCEL_PROMPT
    assert len(set(RUN_SIGNALS.values())) == len(RUN_SIGNALS)  # no message on two signals
    for name, model in RUN_SIGNALS.items():
        assert signal_name(model.model_construct()) == name


def test_a_message_no_signal_carries_is_refused():
    with pytest.raises(KeyError):
        signal_name(RunState(run_id=1, nonce="n", authorized_orchestrator="o"))


def test_every_node_report_goes_to_a_rule_of_the_run_state():
    reports = {
        names.SIGNAL_NODE_RUNTIME_READY,
        names.SIGNAL_LEASE_STARTED,
        names.SIGNAL_WEIGHTS_READY,
        names.SIGNAL_STAGE_READY,
        names.SIGNAL_STAGE_FAULT,
        names.SIGNAL_TOKEN_ENDPOINTS_READY,
        names.SIGNAL_STAGE_STOPPED,
    }
    assert set(REPORT_RULES) == reports
    for _model, rule in REPORT_RULES.values():
        assert getattr(RunState, rule.__name__) is rule
        assert rule.__name__.startswith("on_")
    assert REPORT_RULES[names.SIGNAL_WEIGHTS_READY][0] is WeightsReady
    assert REPORT_RULES[names.SIGNAL_STAGE_READY][0] is StageReady
