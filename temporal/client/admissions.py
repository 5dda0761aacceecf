"""Prompts' admissions, many in one Update where many wait (DECISIONS 106).

A handle keeps at most ADMISSIONS_AT_ONCE admissions in flight (under the server's
default limit on a workflow's Updates in flight, ``history.maxInFlightUpdates``, 10). A
prompt that finds one free goes at once in an ``admit_prompt`` Update of its own, as
before: a lone prompt waits for nothing. Prompts that come while all are busy wait, and
the next sender to be free takes every waiting one (up to ADMISSIONS_PER_UPDATE) in one
``admit_prompts`` Update: a burst of 64 is admitted in a few workflow tasks instead of
one task for every few prompts, and the server handles a few Updates, not 64.

Each prompt still gets its own answer: admitted with the id its key gives, or refused
with its own reason (PromptRejected). A run whose worker predates ``admit_prompts`` is
sent each prompt alone from then on."""

from __future__ import annotations

import asyncio
import contextvars
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any

from mvp_core.models import AdmissionAnswer, PromptAdmission, PromptAdmitted, SubmitPrompt
from mvp_core.names import ADMISSIONS_PER_UPDATE, UPDATE_ADMIT_PROMPTS
from temporal.client.errors import PromptRejected, PromptUnavailable, copy_error

# Admissions of one handle in flight at once: below the server's default limit on a
# workflow's Updates in flight (history.maxInFlightUpdates, 10), so that a burst of
# prompts from one gateway or host waits here a workflow task or two, never in the SDK's
# retries of the server's refusal (~15 s). Each admission is one workflow task long.
ADMISSIONS_AT_ONCE = 8
# The most bytes of prompts (as JSON) one admit_prompts Update carries: the server warns
# of payloads past 256 KB and refuses requests past 2 MB. A prompt larger than this goes
# alone, in an admit_prompt Update of its own, as it would have before.
ADMISSION_BYTES = 256 * 1024

SendOne = Callable[[SubmitPrompt, str], Coroutine[Any, Any, PromptAdmitted]]
SendMany = Callable[[list[PromptAdmission]], Coroutine[Any, Any, list[AdmissionAnswer]]]
# A prompt in line: its admission, its caller's future, and its caller's context (the
# trace an Update sent for it belongs to).
_Waiting = tuple[PromptAdmission, "asyncio.Future[PromptAdmitted]", contextvars.Context]


class Admissions:
    """Admits a handle's prompts: ``one`` sends a prompt alone (``admit_prompt``),
    ``many`` several (``admit_prompts``); either raises PromptRejected for a refusal of
    what it sent as a whole."""

    def __init__(
        self,
        one: SendOne,
        many: SendMany,
        *,
        at_once: int = ADMISSIONS_AT_ONCE,
        per_update: int = ADMISSIONS_PER_UPDATE,
    ) -> None:
        if at_once <= 0 or per_update <= 0:
            raise ValueError("at_once and per_update must be positive")
        self._one, self._many = one, many
        self._at_once, self._per_update = at_once, per_update
        self._waiting: deque[_Waiting] = deque()
        self._senders: set[asyncio.Task[None]] = set()  # held: a task is not collected
        self._sending = 0  # senders that will look at the line again
        self.many_known = True  # False: the run's worker has no admit_prompts
        self.updates = 0  # Updates sent (for tests and figures)

    async def admit(self, prompt: SubmitPrompt, key: str) -> PromptAdmitted:
        """Admit ``prompt`` with ``key`` (what its id is made of: names.update_key) in the
        next Update that is free; raises PromptRejected where the run refuses it. A caller
        that leaves before its prompt was sent takes it out of the line."""
        future: asyncio.Future[PromptAdmitted] = asyncio.get_running_loop().create_future()
        waiting = (PromptAdmission(prompt=prompt, key=key), future, contextvars.copy_context())
        self._waiting.append(waiting)
        if self._sending < self._at_once:
            # Counted now, and uncounted by the sender itself as it finds the line empty:
            # a prompt never waits in a line that no sender will look at again.
            self._sending += 1
            task = asyncio.create_task(self._send_all())
            self._senders.add(task)
            task.add_done_callback(self._senders.discard)
        return await future

    async def _send_all(self) -> None:
        """Send what waits, a batch at a time, until nothing does."""
        try:
            while True:
                batch = self._next_batch()
                if not batch:
                    return
                try:
                    if len(batch) == 1:
                        await self._send_one(batch[0])
                    else:
                        await self._send_many(batch)
                except BaseException:  # cancelled (the loop closing): no caller waits on
                    _fail(batch, PromptUnavailable("the admission was given up"))
                    raise
        finally:
            self._sending -= 1

    def _next_batch(self) -> list[_Waiting]:
        """The next prompts in line whose callers still wait: up to ``per_update`` of them
        and ADMISSION_BYTES of their JSON (one larger than that alone)."""
        batch: list[_Waiting] = []
        size = 0
        most = self._per_update if self.many_known else 1
        while self._waiting and len(batch) < most:
            item = self._waiting[0]
            if item[1].done():  # its caller left before it was sent
                self._waiting.popleft()
                continue
            n = len(item[0].model_dump_json())
            if batch and size + n > ADMISSION_BYTES:
                break
            self._waiting.popleft()
            batch.append(item)
            size += n
        return batch

    async def _send_one(self, item: _Waiting) -> None:
        admission, future, context = item
        self.updates += 1
        try:
            # In its caller's context: the Update is part of that request's trace.
            admitted = await asyncio.create_task(
                self._one(admission.prompt, admission.key), context=context.copy()
            )
        except Exception as err:  # its own error, as it was raised
            if not future.done():
                future.set_exception(err)
            return
        if not future.done():
            future.set_result(admitted)

    async def _send_many(self, batch: list[_Waiting]) -> None:
        self.updates += 1
        try:
            # In the first caller's context: the Update is part of that request's trace.
            answers = await asyncio.create_task(
                self._many([admission for admission, _, _ in batch]), context=batch[0][2].copy()
            )
            if len(answers) != len(batch):
                raise PromptUnavailable(
                    f"the run answered {len(answers)} admissions for {len(batch)} prompts"
                )
        except PromptRejected as err:
            if _unknown_update(err):
                # A worker from before DECISIONS 106: nothing was admitted. Each goes alone.
                self.many_known = False
                self._waiting.extendleft(reversed(batch))
                return
            _fail(batch, err)
            return
        except Exception as err:
            _fail(batch, err)
            return
        for (_, future, _), answer in zip(batch, answers, strict=True):
            if future.done():
                continue
            if answer.admitted is not None:
                future.set_result(answer.admitted)
            else:
                future.set_exception(
                    PromptRejected(answer.refused_type or "Rejected", answer.refused or "refused")
                )


def _unknown_update(err: PromptRejected) -> bool:
    """The worker's refusal of an Update it has no handler for."""
    text = str(err)
    return "expected but not found" in text and UPDATE_ADMIT_PROMPTS in text


def _fail(batch: list[_Waiting], err: Exception) -> None:
    """Each caller of ``batch`` gets ``err``: the first the error itself, the others a copy
    of the same type (the SDK's RPCError, say, which the gateway answers by its status)."""
    first = True
    for _, future, _ in batch:
        if not future.done():
            future.set_exception(err if first else copy_error(err))
            first = False
