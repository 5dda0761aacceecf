"""The run's ``prompt_ends`` query (DECISIONS 78), as the run's prompts answer it: each
key in order, and one answer bounded in the text it carries, whatever the texts."""

from __future__ import annotations

from collections import OrderedDict

import pytest

from mvp_core.models import Done, PromptEnd, PromptOutcome, ServedPrompt
from workflows.run import prompts as run_prompts
from workflows.run.prompts import Prompts


def _served(key: str, text: str) -> ServedPrompt:
    done = Done(request_id=1, final_text=text, tokens_generated=1, elapsed_ms=1, stop_reason="eos")
    return ServedPrompt(workflow_id=key, outcome=PromptOutcome(terminal=done), admitted_ms=0)


def _prompts(served: list[ServedPrompt], open_keys: set[str]) -> Prompts:
    p = Prompts.__new__(Prompts)  # the query's part alone: no workflow around it
    p._served = OrderedDict((s.workflow_id, s) for s in served)
    p._open, p._hosted, p._children, p._closed = set(open_keys), {}, {}, OrderedDict()
    return p


def test_each_key_is_answered_in_order_and_an_answer_holds_a_bounded_text(monkeypatch):
    monkeypatch.setattr(run_prompts, "PROMPT_ENDS_TEXT", 10)
    p = _prompts([_served("a", "x" * 8), _served("b", "y" * 8), _served("c", "z" * 30)], {"o"})
    got = p.ends(["c", "o", "a", "zzz", "b"])
    # The first ended one always (even past the bound); then what fits; the rest "open".
    assert [e.prompt_id if e else None for e in got] == ["c", "o", "a", None, "b"]
    assert got[0] is not None and got[0].terminal is not None
    assert got[1] == PromptEnd(prompt_id="o", open=True)
    assert got[2] == PromptEnd(prompt_id="a", open=True)  # past the bound: asked again
    assert got[4] == PromptEnd(prompt_id="b", open=True)
    again = p.ends(["a", "b"])
    assert again[0] is not None and again[0].terminal is not None  # 8 fits
    assert again[1] == PromptEnd(prompt_id="b", open=True)  # 16 would not


@pytest.mark.parametrize(
    ("bad", "says"),
    [("k", "list of prompt keys"), ([1], "list of prompt keys"), (["k"] * 257, "at most 256")],
)
def test_a_malformed_ask_fails_the_query_by_name(bad, says):
    with pytest.raises(ValueError, match=says):
        _prompts([], set()).ends(bad)
