"""Many prompts' ends in one query (DECISIONS 78): a server buffers one query per busy
workflow by default (``history.MaxBufferedQueryCount``) and refuses the rest, so a
handle asks for every prompt it waits on at once, one query at a time."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from mvp_core.models import PromptEnd
from mvp_core.names import PROMPT_ENDS_PER_QUERY
from temporal.client.errors import PromptUnavailable, copy_error

Ask = Callable[[list[str]], Awaitable[list[PromptEnd | None]]]


class EndBoard:
    """Looks for prompts' ends together: each ``look`` joins the next query, which names
    every prompt looked for since the last one was sent (at most PROMPT_ENDS_PER_QUERY,
    the rest the query after); one query is in flight at a time. A query that fails
    fails the looks it carried, each of which retries on its own schedule."""

    def __init__(self, ask: Ask) -> None:
        self._ask = ask
        self._waiting: dict[str, list[asyncio.Future[PromptEnd | None]]] = {}
        self._asking: asyncio.Task[None] | None = None
        self.queries = 0  # queries sent (for tests and figures)

    async def look(self, prompt_id: str) -> PromptEnd | None:
        """What the run says of ``prompt_id`` in the next query: open, ended, or None
        (not known to the run); the query's error where it failed."""
        future: asyncio.Future[PromptEnd | None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(prompt_id, []).append(future)
        if self._asking is None or self._asking.done():
            self._asking = asyncio.create_task(self._ask_all())
        return await future

    async def _ask_all(self) -> None:
        while self._waiting:
            keys = list(self._waiting)[:PROMPT_ENDS_PER_QUERY]
            batch = {key: self._waiting.pop(key) for key in keys}
            self.queries += 1
            try:
                answers = await self._ask(keys)
                if len(answers) != len(keys):
                    raise PromptUnavailable(
                        f"the run answered {len(answers)} ends for {len(keys)} prompts"
                    )
            except Exception as err:  # handed to each look: one query, many callers
                _fail(batch, err)
                continue
            except BaseException:  # cancelled (the loop closing): no look waits for ever
                _fail(batch, PromptUnavailable("the look was given up"))
                raise
            for key, answer in zip(keys, answers, strict=True):
                for future in batch[key]:
                    if not future.done():
                        future.set_result(answer)


def _fail(batch: dict[str, list[asyncio.Future[PromptEnd | None]]], err: Exception) -> None:
    for futures in batch.values():
        for future in futures:
            if not future.done():
                future.set_exception(copy_error(err))
