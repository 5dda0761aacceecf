"""A handle's prompts' ends are asked for together (DECISIONS 78): one query in flight,
naming every prompt looked for meanwhile, within PROMPT_ENDS_PER_QUERY keys; a failed
query fails exactly the looks it carried."""

from __future__ import annotations

import asyncio

import pytest

from mvp_core.models import PromptEnd
from mvp_core.names import PROMPT_ENDS_PER_QUERY
from temporal.client.endboard import EndBoard
from temporal.client.errors import PromptUnavailable


class Run:
    """Answers prompt_ends as a run would, one query at a time, each held until released."""

    def __init__(self) -> None:
        self.asked: list[list[str]] = []
        self.release = asyncio.Event()
        self.in_flight = 0
        self.most_in_flight = 0
        self.fail_next: Exception | None = None

    async def ask(self, keys: list[str]) -> list[PromptEnd | None]:
        self.asked.append(list(keys))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await self.release.wait()
            if self.fail_next is not None:
                err, self.fail_next = self.fail_next, None
                raise err
            return [
                None if k.startswith("gone") else PromptEnd(prompt_id=k, open=True) for k in keys
            ]
        finally:
            self.in_flight -= 1


async def test_looks_made_while_a_query_is_out_share_the_next_one():
    run = Run()
    board = EndBoard(run.ask)
    first = asyncio.ensure_future(board.look("p0"))
    await asyncio.sleep(0)  # the first query is out, holding p0 alone
    rest = [asyncio.ensure_future(board.look(f"p{i}")) for i in range(1, 64)]
    again = asyncio.ensure_future(board.look("p5"))  # the same prompt twice: one key
    gone = asyncio.ensure_future(board.look("gone-1"))
    await asyncio.sleep(0)
    run.release.set()
    answers = await asyncio.gather(first, *rest, again, gone)
    assert run.asked[0] == ["p0"]
    assert len(run.asked) == 2 and len(run.asked[1]) == 64  # p1..p63 and gone-1
    assert run.most_in_flight == 1 and board.queries == 2
    assert [a.prompt_id for a in answers[:64] if a is not None] == [f"p{i}" for i in range(64)]
    assert answers[64] is not None and answers[64].prompt_id == "p5"
    assert answers[65] is None


async def test_more_looks_than_one_query_may_name_go_in_several():
    run = Run()
    run.release.set()
    board = EndBoard(run.ask)
    n = PROMPT_ENDS_PER_QUERY * 2 + 3
    answers = await asyncio.gather(*(board.look(f"p{i}") for i in range(n)))
    assert all(a is not None and a.prompt_id == f"p{i}" for i, a in enumerate(answers))
    assert [len(keys) for keys in run.asked] == [PROMPT_ENDS_PER_QUERY] * 2 + [3]


async def test_a_failed_query_fails_its_looks_only_and_the_board_goes_on():
    run = Run()
    board = EndBoard(run.ask)
    run.fail_next = PromptUnavailable("no worker has the run")
    carried = [asyncio.ensure_future(board.look(f"p{i}")) for i in range(3)]
    await asyncio.sleep(0)
    later = asyncio.ensure_future(board.look("p9"))  # the next query's
    run.release.set()
    for look in carried:
        with pytest.raises(PromptUnavailable, match="no worker"):
            await look
    end = await later
    assert end is not None and end.prompt_id == "p9"
    assert await board.look("p1") is not None  # asked again: answered


async def test_a_look_given_up_leaves_the_others_answered():
    run = Run()
    board = EndBoard(run.ask)
    leaving = asyncio.ensure_future(board.look("p0"))
    staying = asyncio.ensure_future(board.look("p0"))
    await asyncio.sleep(0)
    leaving.cancel()
    run.release.set()
    end = await staying
    assert end is not None and end.prompt_id == "p0"
    assert leaving.cancelled()


async def test_an_answer_of_the_wrong_length_is_no_answer():
    async def short(keys: list[str]) -> list[PromptEnd | None]:
        return [None]

    board = EndBoard(short)
    looks = [asyncio.ensure_future(board.look(k)) for k in ("a", "b")]
    for look in looks:
        with pytest.raises(PromptUnavailable, match="answered 1 ends for 2 prompts"):
            await look


async def test_a_query_cancelled_under_its_looks_fails_them_rather_than_leaving_them():
    started = asyncio.Event()

    async def stuck(keys: list[str]) -> list[PromptEnd | None]:
        started.set()
        await asyncio.Event().wait()
        return []

    board = EndBoard(stuck)
    look = asyncio.ensure_future(board.look("p0"))
    await started.wait()
    assert board._asking is not None
    board._asking.cancel()
    with pytest.raises(PromptUnavailable, match="given up"):
        await asyncio.wait_for(look, 5)
