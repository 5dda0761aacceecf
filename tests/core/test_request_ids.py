"""Defect 15: request ids past 2^53 (the Temporal CLI and the Web UI showed three prompts
as the same number). Every minted id is a JavaScript-safe integer; a larger one is
refused on input with a message naming the field and the bound."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from mvp_core.models import SubmitPrompt
from mvp_core.request_ids import MAX_REQUEST_ID, RequestIds

JS_SAFE = 2**53 - 1  # Number.MAX_SAFE_INTEGER


def test_minted_ids_are_javascript_safe_from_any_random_start(monkeypatch):
    import mvp_core.request_ids as request_ids

    assert MAX_REQUEST_ID == JS_SAFE
    # The largest start the random bits can give, and the smallest.
    monkeypatch.setattr(request_ids.secrets, "randbits", lambda k: (1 << k) - 1)
    ids = RequestIds()
    minted = [next(ids) for _ in range(2**request_ids.BLOCK_BITS)]
    assert max(minted) <= JS_SAFE and len(set(minted)) == len(minted)
    monkeypatch.setattr(request_ids.secrets, "randbits", lambda k: 0)
    assert next(RequestIds()) == 1


def test_many_random_starts_stay_below_the_bound():
    for _ in range(2000):
        ids = RequestIds()
        first = next(ids)
        assert 1 <= first <= JS_SAFE and first + 2**16 <= JS_SAFE


def test_the_count_wraps_before_the_bound():
    ids = RequestIds(JS_SAFE - 1)
    assert [next(ids) for _ in range(3)] == [JS_SAFE - 1, JS_SAFE, 1]
    with pytest.raises(ValueError, match="over 9007199254740991"):
        RequestIds(JS_SAFE + 1)


def test_a_prompt_with_an_id_past_2_53_is_refused_naming_it():
    assert SubmitPrompt(request_id=JS_SAFE, prompt_text="x").request_id == JS_SAFE
    with pytest.raises(ValidationError) as err:
        SubmitPrompt(request_id=JS_SAFE + 1, prompt_text="x")
    text = str(err.value)
    assert "request_id" in text and "JavaScript-safe" in text and "9007199254740992" in text
    with pytest.raises(ValidationError, match="request_id must be 0 or more"):
        SubmitPrompt(request_id=-1, prompt_text="x")
