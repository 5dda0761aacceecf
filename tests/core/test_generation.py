import pytest

from mvp_core.generation import (
    StopRule,
    TokenFeedback,
    TokenSequenceViolation,
    effective_max_tokens,
    fixed_address_layout,
)


def test_feedback_injects_next_sequence_only_after_consuming_previous():
    # The driver injects the sequence consume() returns, after consuming the previous one
    # (workers/node/pipeline.py through SequenceChecker): nothing can be injected early.
    fb = TokenFeedback()
    assert fb.injected == 0  # only the prompt record (sequence 0) is out
    assert fb.consume(0) == 1 and fb.injected == 1
    assert fb.consume(1) == 2 and fb.injected == 2
    with pytest.raises(TokenSequenceViolation):
        fb.consume(1)  # a replayed sequence is never fed back twice
    assert fb.injected == 2


def test_sequence_mismatch_is_a_violation_with_the_contract_text():
    fb = TokenFeedback()
    fb.consume(0)
    with pytest.raises(
        TokenSequenceViolation, match="pipeline token sequence violation: expected 1, got 3"
    ):
        fb.consume(3)


def test_eos_stops_and_is_not_counted():
    rule = StopRule(max_new_tokens=10, stop_ids={2}, max_seq_len=100)
    assert rule.accept(5, 1) and not rule.done
    assert not rule.accept(2, 2) and rule.reason == "eos" and rule.generated == 1


def test_max_tokens_stops_after_the_last_token():
    rule = StopRule(max_new_tokens=2, stop_ids={2}, max_seq_len=100)
    rule.accept(5, 1)
    assert rule.accept(6, 2) and rule.reason == "max_tokens" and rule.generated == 2


def test_context_end_stops():
    rule = StopRule(max_new_tokens=None, stop_ids=set(), max_seq_len=4)
    rule.accept(5, 3)
    assert not rule.done
    rule.accept(5, 4)
    assert rule.reason == "context"


def test_max_tokens_absent_or_zero_means_no_cap_unless_run_default():
    assert effective_max_tokens(None, None) is None
    assert effective_max_tokens(0, None) is None
    assert effective_max_tokens(0, 64) == 64
    assert effective_max_tokens(16, 64) == 16


def test_address_layout_is_fixed_only_for_co_located_nodes_unless_chosen():
    assert not fixed_address_layout("auto", 1)
    assert fixed_address_layout("auto", 2)
    assert fixed_address_layout("fixed", 1)
    assert not fixed_address_layout("randomized", 3)
    with pytest.raises(ValueError, match="address_layout must be auto, fixed or randomized"):
        fixed_address_layout("off", 2)
