"""A handle's admissions (temporal/client/admissions.py, DECISIONS 106), against stand-in
senders: a lone prompt goes alone at once; prompts that come while every sender is busy
go together, at most ADMISSIONS_PER_UPDATE in one Update and never more Updates in flight
than allowed; each caller gets its own answer; a worker without ``admit_prompts`` gets
each prompt alone; a caller that leaves before its prompt was sent is never sent."""

from __future__ import annotations

import asyncio
import contextvars

import pytest
from temporalio.service import RPCError, RPCStatusCode

from mvp_core.errors import ErrorType
from mvp_core.models import AdmissionAnswer, PromptAdmission, PromptAdmitted, SubmitPrompt
from temporal.client import admissions
from temporal.client.admissions import Admissions
from temporal.client.errors import PromptRejected, PromptUnavailable


class Run:
    """Answers Updates when released (each at once, ``gate`` set); refuses request ids in
    ``refuse``."""

    def __init__(self, *, knows_many: bool = True, refuse: frozenset[int] = frozenset()) -> None:
        self.knows_many, self.refuse = knows_many, refuse
        self.sent: list[list[int]] = []  # request ids of each Update, in order
        self.in_flight = self.most_in_flight = 0
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail_with: Exception | None = None

    async def _hold(self, ids: list[int]) -> None:
        self.sent.append(ids)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await self.gate.wait()
        finally:
            self.in_flight -= 1

    def _admitted(self, prompt: SubmitPrompt, key: str) -> PromptAdmitted:
        return PromptAdmitted(request_id=prompt.request_id, prompt_id=f"p-{key}", hosted=True)

    async def one(self, prompt: SubmitPrompt, key: str) -> PromptAdmitted:
        await self._hold([prompt.request_id])
        if self.fail_with is not None:
            raise self.fail_with
        if prompt.request_id in self.refuse:
            raise PromptRejected(ErrorType.PROMPT_QUEUE_FULL.value, "full")
        return self._admitted(prompt, key)

    async def many(self, items: list[PromptAdmission]) -> list[AdmissionAnswer]:
        await self._hold([i.prompt.request_id for i in items])
        if not self.knows_many:
            raise PromptRejected(
                "RuntimeError",
                "Update handler for 'admit_prompts' expected but not found, and there is "
                "no dynamic handler. known updates: [admit_prompt submit_prompt]",
            )
        if self.fail_with is not None:
            raise self.fail_with
        return [
            AdmissionAnswer(
                refused_type=ErrorType.PROMPT_QUEUE_FULL.value,
                refused=f"full {i.prompt.request_id}",
            )
            if i.prompt.request_id in self.refuse
            else AdmissionAnswer(admitted=self._admitted(i.prompt, i.key))
            for i in items
        ]


def _prompt(request_id: int, text: str | None = None) -> SubmitPrompt:
    return SubmitPrompt(request_id=request_id, prompt_text=text or f"p{request_id}")


async def _admit_all(adm: Admissions, ids: range) -> list[PromptAdmitted | BaseException]:
    return await asyncio.gather(
        *(adm.admit(_prompt(i), f"k{i}") for i in ids), return_exceptions=True
    )


async def test_a_lone_prompt_goes_alone_at_once():
    run = Run()
    adm = Admissions(run.one, run.many)
    for i in range(3):  # one after another: each alone
        got = await adm.admit(_prompt(i), f"k{i}")
        assert got.prompt_id == f"p-k{i}"
    assert run.sent == [[0], [1], [2]]


async def test_prompts_behind_busy_senders_go_together_each_with_its_own_answer():
    run = Run(refuse=frozenset({17}))
    run.gate.clear()
    adm = Admissions(run.one, run.many, at_once=2, per_update=4)
    first = []
    for i in range(2):  # one at a time: each sender takes one and waits on the run
        first.append(asyncio.ensure_future(adm.admit(_prompt(i), f"k{i}")))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    rest = asyncio.ensure_future(_admit_all(adm, range(2, 20)))
    await asyncio.sleep(0.01)
    run.gate.set()
    got = await asyncio.gather(*first) + await rest
    assert run.sent[:2] == [[0], [1]]
    assert all(len(ids) <= 4 for ids in run.sent) and len(run.sent) == 2 + 18 // 4 + 1
    assert sorted(i for ids in run.sent for i in ids) == list(range(20))  # each once
    assert run.most_in_flight == 2
    for i, answer in enumerate(got):
        if i == 17:
            assert isinstance(answer, PromptRejected) and str(answer) == "full 17"
        else:
            assert isinstance(answer, PromptAdmitted) and answer.prompt_id == f"p-k{i}"


async def test_a_worker_without_admit_prompts_gets_each_prompt_alone_from_then_on():
    run = Run(knows_many=False)
    run.gate.clear()
    adm = Admissions(run.one, run.many, at_once=1, per_update=8)
    head = asyncio.ensure_future(adm.admit(_prompt(0), "k0"))
    await asyncio.sleep(0)
    rest = asyncio.ensure_future(_admit_all(adm, range(1, 6)))
    await asyncio.sleep(0.01)
    run.gate.set()
    got = [await head, *await rest]
    assert [a.prompt_id for a in got if isinstance(a, PromptAdmitted)] == [
        f"p-k{i}" for i in range(6)
    ]
    assert not adm.many_known
    assert run.sent == [[0], [1, 2, 3, 4, 5], [1], [2], [3], [4], [5]]


async def test_a_caller_that_leaves_before_its_prompt_was_sent_is_not_sent():
    run = Run()
    run.gate.clear()
    adm = Admissions(run.one, run.many, at_once=1)
    head = asyncio.ensure_future(adm.admit(_prompt(0), "k0"))
    await asyncio.sleep(0)
    gone = asyncio.ensure_future(adm.admit(_prompt(1), "k1"))
    kept = asyncio.ensure_future(adm.admit(_prompt(2), "k2"))
    await asyncio.sleep(0)
    gone.cancel()
    run.gate.set()
    assert (await head).prompt_id == "p-k0" and (await kept).prompt_id == "p-k2"
    assert run.sent == [[0], [2]]


@pytest.mark.parametrize("error", [PromptUnavailable("the server is away"), RuntimeError("boom")])
async def test_an_update_that_fails_fails_each_of_its_callers_with_its_own_error(error):
    run = Run()
    run.gate.clear()
    run.fail_with = error
    adm = Admissions(run.one, run.many, at_once=1)
    head = asyncio.ensure_future(adm.admit(_prompt(0), "k0"))
    await asyncio.sleep(0)
    rest = asyncio.ensure_future(_admit_all(adm, range(1, 4)))
    await asyncio.sleep(0.01)
    run.gate.set()
    with pytest.raises(type(error)):
        await head
    errors = await rest
    assert [type(e) for e in errors] == [type(error)] * 3
    assert len({id(e) for e in errors}) == 3  # one error object each
    assert run.sent == [[0], [1, 2, 3]]
    run.fail_with = None  # the handle goes on
    assert (await adm.admit(_prompt(9), "k9")).prompt_id == "p-k9"


async def test_one_sender_admits_prompt_after_prompt_and_strands_none():
    """A sender that finds the line empty stops counting at once: the next prompt starts
    a sender of its own, though the last one's task has not ended yet."""
    run = Run()
    adm = Admissions(run.one, run.many, at_once=1)
    for i in range(5):
        got = await asyncio.wait_for(adm.admit(_prompt(i), f"k{i}"), 5)
        assert got.prompt_id == f"p-k{i}"
    # Many at once, each as soon as the one before it is answered.
    got = await asyncio.wait_for(_admit_all(adm, range(5, 40)), 5)
    assert [a.prompt_id for a in got if isinstance(a, PromptAdmitted)] == [
        f"p-k{i}" for i in range(5, 40)
    ]


@pytest.mark.parametrize("alone", [True, False])
async def test_the_servers_refusal_reaches_each_caller_with_its_status(alone):
    """The gateway answers RESOURCE_EXHAUSTED as 429 server_limit by the RPCError's status."""
    run = Run()
    run.gate.clear()
    run.fail_with = RPCError("too many", RPCStatusCode.RESOURCE_EXHAUSTED, b"")
    adm = Admissions(run.one, run.many, at_once=1)
    head = asyncio.ensure_future(adm.admit(_prompt(0), "k0"))
    await asyncio.sleep(0)
    rest = asyncio.ensure_future(_admit_all(adm, range(1, 1 if alone else 4)))
    await asyncio.sleep(0.01)
    run.gate.set()
    errors = [await asyncio.gather(head, return_exceptions=True), *await rest]
    flat = [e[0] if isinstance(e, list) else e for e in errors]
    assert len(flat) == (1 if alone else 4)
    for e in flat:
        assert isinstance(e, RPCError) and e.status is RPCStatusCode.RESOURCE_EXHAUSTED


async def test_prompts_past_the_byte_bound_go_in_another_update_a_large_one_alone(monkeypatch):
    one = len(PromptAdmission(prompt=_prompt(1, "a" * 200), key="k1").model_dump_json())
    monkeypatch.setattr(admissions, "ADMISSION_BYTES", 2 * one + 10)  # two such, not three
    run = Run()
    run.gate.clear()
    adm = Admissions(run.one, run.many, at_once=1)
    head = asyncio.ensure_future(adm.admit(_prompt(0), "k0"))
    await asyncio.sleep(0)
    texts = {1: "a" * 200, 2: "b" * 200, 3: "c" * 200, 4: "d" * 2000, 5: "e"}
    rest = asyncio.ensure_future(
        asyncio.gather(*(adm.admit(_prompt(i, t), f"k{i}") for i, t in texts.items()))
    )
    await asyncio.sleep(0.01)
    run.gate.set()
    await head
    assert [a.prompt_id for a in await rest] == [f"p-k{i}" for i in texts]
    # Each Update's prompts in order, within the bound; the 2,000-character one alone.
    assert run.sent == [[0], [1, 2], [3], [4], [5]]


TRACE: contextvars.ContextVar[str] = contextvars.ContextVar("trace", default="none")


async def test_an_update_is_sent_in_its_first_callers_context():
    """An Update belongs to its caller's trace (the gateway request's span): a prompt sent
    alone in its own caller's context, a batch in its first caller's."""
    seen: list[tuple[str, list[int]]] = []

    async def one(prompt: SubmitPrompt, key: str) -> PromptAdmitted:
        seen.append((TRACE.get(), [prompt.request_id]))
        await gate.wait()
        return PromptAdmitted(request_id=prompt.request_id, prompt_id=key, hosted=True)

    async def many(items: list[PromptAdmission]) -> list[AdmissionAnswer]:
        seen.append((TRACE.get(), [i.prompt.request_id for i in items]))
        return [
            AdmissionAnswer(
                admitted=PromptAdmitted(
                    request_id=i.prompt.request_id, prompt_id=i.key, hosted=True
                )
            )
            for i in items
        ]

    gate = asyncio.Event()
    adm = Admissions(one, many, at_once=1)

    async def traced(rid: int) -> PromptAdmitted:
        TRACE.set(f"request {rid}")
        return await adm.admit(_prompt(rid), f"k{rid}")

    head = asyncio.ensure_future(traced(0))
    await asyncio.sleep(0)
    rest = asyncio.ensure_future(asyncio.gather(traced(1), traced(2)))
    await asyncio.sleep(0.01)
    gate.set()
    await head
    await rest
    assert seen == [("request 0", [0]), ("request 1", [1, 2])]


def test_bounds_must_be_positive():
    run = Run()
    with pytest.raises(ValueError, match="positive"):
        Admissions(run.one, run.many, at_once=0)
