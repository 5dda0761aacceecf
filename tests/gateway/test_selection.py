"""Which run serves a request when one gateway serves several (workers/gateway/selection.py,
DECISIONS 90): pure functions over what the gateway knows of each run."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workers.gateway.selection import AliasError, RunView, check_alias, listed, rank, resolve

SMOL = "SmolLM2-135M-Instruct.Q4_1"
GEMMA = "gemma-3-270m.Q4_K_M"


def _run(key: str, model: str = SMOL, **kw: object) -> RunView:
    names = {
        SMOL: frozenset({"SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2 135M Instruct"}),
        GEMMA: frozenset({"gemma-3-270m.Q4_K_M.gguf", "Gemma 3 270m"}),
    }.get(model, frozenset())
    return RunView(key=key, model=model, names=names, **kw)  # type: ignore[arg-type]


def test_a_request_goes_to_the_runs_of_the_model_it_names() -> None:
    runs = [_run("mvp-run-1"), _run("mvp-run-2", GEMMA), _run("mvp-run-3")]
    found = resolve(SMOL, runs)
    assert found.model == SMOL and [r.key for r in found.runs] == ["mvp-run-1", "mvp-run-3"]
    assert [r.key for r in resolve(GEMMA, runs).runs] == ["mvp-run-2"]
    assert listed(runs) == [SMOL, GEMMA]  # one entry per model, replicas once


def test_a_model_answers_to_its_file_name_and_general_name_too() -> None:
    runs = [_run("mvp-run-1"), _run("mvp-run-2", GEMMA)]
    assert resolve("Gemma 3 270m", runs).model == GEMMA
    assert resolve("SmolLM2-135M-Instruct.Q4_1.gguf", runs).model == SMOL


def test_an_unknown_name_resolves_to_no_run() -> None:
    found = resolve("gpt-4o", [_run("mvp-run-1")])
    assert found.model is None and not found.runs and not found.ambiguous


def test_an_alias_is_the_id_and_a_name_of_two_models_is_ambiguous() -> None:
    """Two runs of one file under two aliases: each alias names its run, and the file's
    name (which both answer to) names neither: the client is told the ids."""
    smol_names = frozenset({SMOL, "SmolLM2 135M Instruct"})
    fast = RunView(key="mvp-run-1", model="smol-fast", names=smol_names)
    long = RunView(key="mvp-run-2", model="smol-long", names=smol_names)
    assert [r.key for r in resolve("smol-long", [fast, long]).runs] == ["mvp-run-2"]
    found = resolve(SMOL, [fast, long])
    assert found.model is None and found.ambiguous == ("smol-fast", "smol-long")


def test_an_id_wins_over_another_runs_other_name() -> None:
    """A run listed as X serves X, though another run answers to X by a secondary name."""
    plain = _run("mvp-run-1")
    aliased = RunView(key="mvp-run-2", model="smol-b", names=frozenset({SMOL}))
    assert [r.key for r in resolve(SMOL, [plain, aliased]).runs] == ["mvp-run-1"]


def test_the_shortest_queue_goes_first() -> None:
    busy = _run("mvp-run-1", in_flight=3)
    idle = _run("mvp-run-2", in_flight=1)
    assert [r.key for r in rank([busy, idle])] == ["mvp-run-2", "mvp-run-1"]


def test_capacity_counts_a_run_with_free_slots_before_a_full_one() -> None:
    """Four slots, three in flight: the next prompt generates at once; one slot, one in
    flight: it would wait."""
    wide = _run("mvp-run-1", in_flight=3, max_active=4)
    narrow = _run("mvp-run-2", in_flight=1, max_active=1)
    assert [r.key for r in rank([narrow, wide])] == ["mvp-run-1", "mvp-run-2"]
    # Both free: the lighter load first.
    half = _run("mvp-run-3", in_flight=2, max_active=4)
    assert [r.key for r in rank([wide, half])] == ["mvp-run-3", "mvp-run-1"]


def test_a_run_that_is_not_prompt_ready_goes_last_whatever_its_queue() -> None:
    starting = _run("mvp-run-1", ready=False)
    loaded = _run("mvp-run-2", in_flight=5)
    assert [r.key for r in rank([starting, loaded])] == ["mvp-run-2", "mvp-run-1"]


def test_equal_replicas_take_turns() -> None:
    a = _run("mvp-run-1", last_chosen=7)
    b = _run("mvp-run-2", last_chosen=3)
    assert rank([a, b])[0].key == "mvp-run-2"  # chosen less recently
    assert rank([_run("mvp-run-2"), _run("mvp-run-1")])[0].key == "mvp-run-1"  # then by id


@given(
    st.lists(
        st.tuples(st.integers(0, 20), st.integers(1, 8), st.booleans()), min_size=1, max_size=6
    )
)
def test_the_first_choice_has_no_longer_a_wait_than_any_other_ready_replica(rows) -> None:
    runs = [
        _run(f"mvp-run-{i}", in_flight=f, max_active=a, ready=r) for i, (f, a, r) in enumerate(rows)
    ]
    first = rank(runs)[0]
    assert sorted(rank(runs), key=lambda r: r.key) == sorted(runs, key=lambda r: r.key)
    if any(r.ready for r in runs):
        assert first.ready
        wait = max(0, first.in_flight + 1 - first.max_active)
        assert all(wait <= max(0, r.in_flight + 1 - r.max_active) for r in runs if r.ready)


@pytest.mark.parametrize(
    "alias", ["smol", "gpt-4o-mini", "ft:gpt-3.5:org:id", "meta-llama/Llama-3-8B", "a" * 128]
)
def test_an_alias_is_an_openai_style_model_id(alias: str) -> None:
    assert check_alias(alias) == alias


@pytest.mark.parametrize("alias", ["", " smol", "smol b", "-smol", "smol?", "a" * 129, "smøl"])
def test_an_alias_that_could_not_be_a_model_id_is_refused(alias: str) -> None:
    with pytest.raises(AliasError):
        check_alias(alias)
