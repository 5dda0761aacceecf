"""A prompt's news of its head node (DECISIONS 68) is untrusted input: the ``head``
signal moves a prompt only in a run that replaces lost nodes (a fail-stop run's prompt
hears only that its head is gone), and only to a node the run itself would name."""

from __future__ import annotations

import pytest

from mvp_core import names
from mvp_core.models import NodeLossPolicy, PromptHead, PromptInput, SubmitPrompt
from workflows.prompt import PromptServing

NONCE8 = "abcd1234"


def serving(policy: NodeLossPolicy = NodeLossPolicy.REPLACE) -> PromptServing:
    inp = PromptInput(
        run_id=7,
        readiness_id=f"{NONCE8}-1-0",
        prompt=SubmitPrompt(request_id=1, prompt_text="hi"),
        max_new_tokens=8,
        head_task_queue=names.node_task_queue(7, 1, NONCE8),
        head_node_id=1,
        on_node_loss=policy,
    )
    return PromptServing(inp, "wf")


def news(node_id: int, ready: bool, **over: str) -> PromptHead:
    fields = {
        "task_queue": names.node_task_queue(7, node_id, NONCE8),
        "readiness_id": f"{NONCE8}-{node_id}-0",
        **over,
    }
    return PromptHead(node_id=node_id, ready=ready, **fields)


def test_the_run_s_news_moves_the_prompt_to_the_replacement_head():
    s = serving()
    assert s.move_head(news(4, ready=False)) and s.head_lost
    assert s.move_head(news(4, ready=True))
    assert not s.head_lost and s.head_moves == 1
    assert (s.inp.head_task_queue, s.inp.readiness_id, s.inp.head_node_id) == (
        names.node_task_queue(7, 4, NONCE8),
        f"{NONCE8}-4-0",
        4,
    )
    assert s.move_head(news(4, ready=True)) and s.head_moves == 1  # the same news again


@pytest.mark.parametrize(
    "bad",
    [
        {"task_queue": "some-other-queue"},
        {"task_queue": names.node_task_queue(8, 4, NONCE8)},  # another run's
        {"task_queue": names.node_task_queue(7, 4, "ffff0000")},  # another execution's
        {"readiness_id": f"{NONCE8}-4-1"},  # not a head's
    ],
)
def test_news_of_a_node_the_run_would_not_name_moves_nothing(bad: dict[str, str]):
    s = serving()
    before = s.inp
    assert not s.move_head(news(4, ready=True, **bad))
    assert not s.move_head(news(4, ready=False, **bad))
    assert s.inp == before and not s.head_lost and s.head_moves == 0


def test_a_fail_stop_run_s_prompt_hears_only_that_its_own_head_is_gone():
    """No replacement comes in a fail-stop run: news of one moves nothing, and only the
    loss of the prompt's own head is news (its generate is then not waited for,
    DECISIONS 101)."""
    s = serving(NodeLossPolicy.FAIL)
    assert not s.move_head(news(4, ready=False)) and not s.head_lost
    assert not s.move_head(news(4, ready=True)) and s.head_moves == 0
    assert not s.move_head(news(1, ready=True)) and not s.head_lost
    assert not s.move_head(news(1, ready=False, readiness_id=f"{NONCE8}-1-1"))
    assert s.move_head(news(1, ready=False)) and s.head_lost
    assert s.inp.head_task_queue == names.node_task_queue(7, 1, NONCE8) and s.head_moves == 0
