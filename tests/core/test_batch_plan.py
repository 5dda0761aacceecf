"""The node's one batching decision (workers/node/batch_plan.py), without torch: which
rows run now, in which order, and what waits."""

from __future__ import annotations

import subprocess
import sys

from mvp_core.batch_plan import Capacity, Entry, Kind, Row, plan_step


def keys(plan_rows: tuple[Row, ...]) -> list[object]:
    return [r.key for r in plan_rows]


def test_a_stage_runs_a_one_in_depth_share_of_the_prompts_in_flight_rounded_up() -> None:
    queue = [Entry(k) for k in "abcde"]
    plan = plan_step(queue, Capacity(depth=2))
    assert plan.taken == 3 and keys(plan.rows) == ["a", "b", "c"]  # ceil(5 / 2), in order


def test_prompts_in_flight_count_toward_the_share_though_none_of_their_records_waits() -> None:
    plan = plan_step([Entry("a"), Entry("b")], Capacity(depth=3), in_flight=["a", "x", "y", "z"])
    assert keys(plan.rows) == ["a", "b"]  # 6 prompts in flight over 3 stages: 2 a step
    plan = plan_step([Entry("a"), Entry("b")], Capacity(depth=3), in_flight=["a", "x"])
    assert plan.taken == 1 and keys(plan.rows) == ["a"]  # 3 prompts over 3 stages: 1 a step


def test_a_second_record_of_a_prompt_waits_for_the_next_step_and_nothing_overtakes_it() -> None:
    queue = [Entry("a"), Entry("b"), Entry("a"), Entry("c")]
    plan = plan_step(queue, Capacity())
    assert plan.taken == 2 and keys(plan.rows) == ["a", "b"]  # "c" waits behind the second "a"


def test_an_abort_is_taken_without_running_rows_and_without_using_the_share() -> None:
    queue = [Entry("a", Kind.ABORT), Entry("b"), Entry("c", Kind.ABORT), Entry("d"), Entry("e")]
    plan = plan_step(queue, Capacity(depth=3))  # 5 prompts: 2 rows a step
    assert plan.taken == 4 and keys(plan.rows) == ["b", "d"]
    assert all(r.kind is Kind.NEXT for r in plan.rows)


def test_an_abort_of_a_prompt_that_runs_in_this_step_waits_for_the_next() -> None:
    plan = plan_step([Entry("a"), Entry("a", Kind.ABORT), Entry("b")], Capacity())
    assert plan.taken == 1 and keys(plan.rows) == ["a"]


def test_the_share_ends_the_step_even_before_an_abort() -> None:
    plan = plan_step([Entry("a"), Entry("b", Kind.ABORT)], Capacity(depth=2))
    assert plan.taken == 1  # one row is the whole share: the abort waits its turn


def test_joining_prompts_are_admitted_first_come_while_a_slot_is_free() -> None:
    queue = [Entry(k, Kind.BEGIN) for k in "abcd"]
    plan = plan_step(queue, Capacity(free_slots=2))
    assert plan.admitted == ["a", "b"] and plan.taken == 2
    assert plan_step(queue, Capacity(free_slots=0)).admitted == []
    assert plan_step(queue, Capacity()).admitted == ["a", "b", "c", "d"]  # the loop checks


def test_running_prompts_do_not_need_a_free_slot_but_a_begin_behind_them_does() -> None:
    queue = [Entry("a"), Entry("b", Kind.BEGIN), Entry("c")]
    plan = plan_step(queue, Capacity(free_slots=0))
    assert plan.taken == 1 and keys(plan.rows) == ["a"] and plan.admitted == []


def test_a_prompt_goes_in_by_chunks_and_samples_only_after_its_last() -> None:
    queue = [Entry("long", prompt_left=150), Entry("short", prompt_left=22), Entry("decode")]
    rows = plan_step(queue, Capacity(chunk=64)).rows
    assert [(r.prompt_tokens, r.samples) for r in rows] == [(64, False), (22, True), (0, True)]
    exact = plan_step([Entry("p", prompt_left=64)], Capacity(chunk=64)).rows[0]
    assert (exact.prompt_tokens, exact.samples) == (64, True)


def test_without_a_chunk_size_a_prompt_goes_in_whole() -> None:
    row = plan_step([Entry("p", prompt_left=1000)], Capacity()).rows[0]
    assert (row.prompt_tokens, row.samples) == (1000, True)


def test_in_a_single_process_every_active_sequence_runs_in_join_order() -> None:
    queue = [Entry(i, prompt_left=i % 3) for i in range(7)]
    plan = plan_step(queue, Capacity(chunk=2))
    assert plan.taken == 7 and keys(plan.rows) == list(range(7))


def test_nothing_waiting_plans_nothing() -> None:
    plan = plan_step([], Capacity(depth=4), in_flight=["a"])
    assert plan.taken == 0 and plan.rows == () and plan.admitted == []


def test_the_plan_imports_no_torch() -> None:
    code = "import sys, mvp_core.batch_plan; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
