"""Where a prompt's text comes from: the run's head node, read directly where this host
holds the deployment's edge secret (DECISIONS 63) or with the key the prompt was admitted
with (DECISIONS 80), followed from a replacement head when a run-hosted prompt's head is
lost (DECISIONS 68); else the prompt workflow's stream.
Either way the reader gets the deltas once each, then the one terminal event."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable
from datetime import timedelta
from typing import Any, cast

from pydantic import TypeAdapter
from temporalio.contrib.workflow_streams import WorkflowStreamClient
from temporalio.service import RPCError

from mvp_core import names
from mvp_core.models import (
    Done,
    Fault,
    PromptEvent,
    PromptHost,
    SubmitPrompt,
    TextDelta,
    TokenLogprob,
)
from temporal.client.ends import EndHint, PromptEnds
from temporal.text_stream import (
    TextNotYet,
    TextStreamError,
    TextStreamRefused,
    TextStreamTarget,
    TextStreamUnreachable,
    probe,
    read_text,
    target_of,
)

_EVENT: TypeAdapter[TextDelta | Done | Fault] = TypeAdapter(PromptEvent)
PromptEvents = AsyncGenerator[TextDelta | Done | Fault, None]
FIRST = asyncio.FIRST_COMPLETED
# A prompt's result is in while its text stream says nothing: what the head node still
# sends within this long is read (its end line normally comes before the result).
DIRECT_GRACE_S = 2.0
# A run-hosted prompt's direct stream that broke (its head node lost, DECISIONS 68) is
# read again from the replacement head, at most this many times, while the prompt runs.
DIRECT_RESUMES = 3
NEW_HEAD_POLL_S = 0.3
# A keyed reader told to ask again (its prompt queued, the node busy) waits this long
# before it does, doubling up to the second figure, while its prompt runs.
ASK_AGAIN_S = (0.25, 5.0)
log = logging.getLogger("mvp.client")


class EarlyText:
    """A prompt's text stream opened before the run admits it, its request carrying the
    prompt for the head node to start at once (DECISIONS 103): read as the prompt's
    direct stream once the run admitted it under ``key``, closed otherwise."""

    def __init__(self, key: str, target: TextStreamTarget, prompt: SubmitPrompt) -> None:
        self.key = key
        self.target = target
        self.on_terminal: Callable[[Done], None] | None = None
        self.deltas = read_text(
            target,
            key,
            on_terminal=self._told,
            early={"prompt": prompt.model_dump(mode="json"), "max_new_tokens": prompt.max_tokens},
        )
        # Its first step opens the connection and sends the request, now.
        self.step: asyncio.Future[TextDelta] | None = asyncio.ensure_future(anext(self.deltas))

    def _told(self, done: Done) -> None:
        if self.on_terminal is not None:
            self.on_terminal(done)

    async def close(self) -> None:
        """Closed (more than once is harmless): where the prompt was not admitted under
        its key, or its reader is done, the head node stops what it started unless the
        prompt's generate adopted it."""
        step, self.step = self.step, None
        if step is not None and not step.done():
            step.cancel()
        with contextlib.suppress(BaseException):
            if step is not None:
                await step
        with contextlib.suppress(Exception):
            await self.deltas.aclose()


class _Read:
    """The text a reader has had (from any stream), and the generated tokens it held."""

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.tokens = 0
        self.direct_end = False  # the head node's stream came to its end line
        self.terminal: Done | None = None  # ... with the prompt's Done (DECISIONS 95)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def add(self, delta: TextDelta) -> None:
        self.pieces.append(delta.text)
        self.tokens += delta.tokens or 0


def cut(delta: TextDelta, skip: int) -> tuple[TextDelta | None, int]:
    """``delta`` less the first ``skip`` characters, which the reader has from another
    stream (None: all of it), and what is left to skip."""
    if not skip:
        return delta, 0
    n = min(skip, len(delta.text))
    if n == len(delta.text):
        return None, skip - n
    update: dict[str, Any] = {"text": delta.text[n:]}
    if delta.logprobs is not None:
        # The logprobs of the tokens whose text the reader has are its too (DECISIONS 88).
        update["logprobs"] = [e for e, end in _token_ends(delta) if end > n]
    return delta.model_copy(update=update), skip - n


def _token_ends(delta: TextDelta) -> list[tuple[TokenLogprob, int]]:
    """Each logprob entry of ``delta`` with where its token's text ends in the delta."""
    out, at = [], 0
    for entry in delta.logprobs or ():
        at += len(entry.token)
        out.append((entry, at))
    return out


class PromptText(PromptEnds):
    """A prompt's events, from the head node or the prompt workflow's stream."""

    async def _events(
        self,
        child_id: str,
        result_task: asyncio.Future[Any],
        poll_cooldown_ms: int,
        start: int = 0,
        hint: EndHint | None = None,
        key: str | None = None,
        early: EarlyText | None = None,
    ) -> PromptEvents:
        """The prompt's text deltas (from the head node where this host can read it
        directly, else from the prompt workflow's stream), then its terminal event: the
        stream's, or else the result's, after any text the deltas missed (a Done holds
        the whole text). ``start``: the deltas already seen of the workflow's stream.
        ``hint``: told whether a direct stream is open and when its text has ended, for
        the wait on the result (DECISIONS 77). ``key``: the prompt's ``text_key``, with
        which a handle without the deployment's secret reads it directly (DECISIONS 80).
        ``early``: its direct stream, opened before its admission (DECISIONS 103)."""
        hint = hint or EndHint()
        read = _Read()
        target: TextStreamTarget | None = None
        try:
            if early is not None:
                target = early.target
            elif not result_task.done():
                target = await self._text_target(key)
        finally:
            hint.streaming = target is not None
            hint.decided.set()
        if target is not None:
            async for delta in self._from_head(target, child_id, result_task, key, read, early):
                yield delta
            if read.direct_end:
                hint.terminal = read.terminal
                hint.text_ended.set()
        hint.streaming = False
        hint.stream_closed.set()  # a wait on its end line looks at the run now
        terminal: Done | Fault | None = None
        if not read.direct_end and not await self._hosts_prompts():
            skip = len(read.text)
            async for event in self._follow(child_id, result_task, poll_cooldown_ms, start):
                if not isinstance(event, TextDelta):
                    terminal = event
                    break
                piece, skip = cut(event, skip)
                if piece is None:
                    continue
                read.add(piece)
                yield piece
        result = terminal if terminal is not None else cast(Done | Fault, await result_task)
        rest = _rest(result, read.text, read.tokens)
        if rest is not None:
            yield rest
        yield result

    async def _from_head(
        self,
        target: TextStreamTarget | None,
        child_id: str,
        result_task: asyncio.Future[Any],
        key: str | None,
        read: _Read,
        early: EarlyText | None = None,
    ) -> AsyncGenerator[TextDelta, None]:
        """The prompt's deltas from its head node (``read.direct_end``: to its end line),
        from a replacement head where the run replaces it (DECISIONS 68); nothing more
        once the stream cannot be read there."""
        resumes = 0
        again = ASK_AGAIN_S[0]
        while target is not None:
            skip = len(read.text)  # a new head's stream starts from the first text
            opened, early = early, None  # an early stream is the first try only
            try:
                async for got in self._direct(target, child_id, result_task, key, read, opened):
                    delta, skip = cut(got, skip)
                    if delta is None:
                        continue
                    read.add(delta)
                    yield delta
                read.direct_end = True
                self.direct_streams += 1
            except TextStreamRefused as err:
                if target.token is not None:
                    log.info("%s: this host's secret is not the run's: %s", self.workflow_id, err)
                    self._secret = None  # never again: prompts admitted from now on use keys
                    self._target = None
                else:
                    log.info("%s: text from Temporal: %s", child_id, err)
            except TextNotYet:  # still queued, or a busy node: ask again while it runs
                await asyncio.wait({result_task}, timeout=again)
                again = min(again * 2, ASK_AGAIN_S[1])
                if not result_task.done():
                    continue
            except TextStreamError as err:
                if opened is not None and not read.text:
                    # An early start the head did not take with the request (a node
                    # before DECISIONS 103, its request line then too long): read plainly.
                    log.info("%s: text stream with an early start: %s", child_id, err)
                    continue
                self._target = None  # asked again next time (the head may have moved)
                if resumes < DIRECT_RESUMES and await self._hosts_prompts():
                    # A run-hosted prompt has no Temporal stream: its text goes on from
                    # the replacement head, should its head be replaced (DECISIONS 68).
                    resumes += 1
                    target = await self._new_head(target, result_task)
                    if target is not None:
                        log.info("%s: text from the new head: %s", child_id, err)
                        continue
                self._tell_why(child_id, err)
            return

    async def check_text_route(self) -> bool:
        """Whether this handle can read prompts' text from the run's head node, asked
        before any prompt (once the run is prompt-ready, its head's endpoint known):
        where it cannot connect there, why is said now (the one warning a first prompt
        would give, :meth:`_tell_why`). False: not known yet (the run's state could not
        be read, or has no head endpoint): ask again; True otherwise (it can, it reads
        no text directly, or why it cannot has been said)."""
        if not self._direct_text or self._told_why:
            return True
        state = await self.shared_snapshot()
        target = None if state is None else target_of(state, self.workflow_id, self._secret)
        if target is None:
            return False
        try:
            await probe(target)
        except TextStreamUnreachable as err:
            self._tell_why(self.workflow_id, err)
        except TextStreamError as err:  # it answers, or half: a prompt's read says more
            log.info("%s: text stream probe: %s", self.workflow_id, err)
        return True

    def _tell_why(self, child_id: str, err: TextStreamError) -> None:
        """A direct stream that could not be read: said once per handle as a warning (a
        head node this host cannot reach: text comes from Temporal or with the end), then
        quietly."""
        if isinstance(err, TextStreamUnreachable) and not self._told_why:
            self._told_why = True
            log.warning(
                "%s: prompts' text cannot be read from the head node here (%s): it comes "
                "from Temporal, or whole with each end for a run-hosted prompt",
                self.workflow_id,
                err,
            )
        else:
            log.info("%s: text from Temporal: %s", child_id, err)

    async def _new_head(
        self, old: TextStreamTarget, result_task: asyncio.Future[Any]
    ) -> TextStreamTarget | None:
        """The head node's text stream once another node is the head (a stage recovery
        replaced it); None if the prompt ends first."""
        while not result_task.done():
            state = await self.shared_snapshot()
            if state is not None:
                target = target_of(state, self.workflow_id, self._secret)
                if target is not None and (target.host, target.port) != (old.host, old.port):
                    self._target = target
                    return target
            await asyncio.wait({result_task}, timeout=NEW_HEAD_POLL_S)
        return None

    async def _text_target(self, key: str | None = None) -> TextStreamTarget | None:
        """The run's head node text stream, where this host can read it: with the
        deployment's secret, or the prompt's ``key`` (cached)."""
        if not self._direct_text or (self._secret is None and key is None):
            return None
        if self._target is None:
            state = await self.shared_snapshot()
            if state is not None:
                self._prompt_host = state.prompt_host
                self._target = target_of(state, self.workflow_id, self._secret)
        return self._target

    async def _hosts_prompts(self) -> bool:
        """The run serves its prompts itself (DECISIONS 66): they have no workflow, so no
        Temporal text stream (their text comes from the head node or with their end)."""
        if self._prompt_host is None:
            state = await self.shared_snapshot()
            if state is None:
                return False
            self._prompt_host = state.prompt_host
        return self._prompt_host is PromptHost.RUN

    async def _direct(
        self,
        target: TextStreamTarget,
        child_id: str,
        result_task: asyncio.Future[Any],
        key: str | None = None,
        read: _Read | None = None,
        early: EarlyText | None = None,
    ) -> AsyncGenerator[TextDelta, None]:
        """The head node's deltas of the prompt until its end line (its Done, where the
        line carries one, to ``read.terminal``). A prompt that ends without generating
        (cancelled in the queue, refused) never opens there: once its result is in, what
        the node still sends within DIRECT_GRACE_S is taken, no more."""

        def told(done: Done) -> None:
            if read is not None:
                read.terminal = done

        step: asyncio.Future[TextDelta] | None = None
        if early is not None:  # opened before the admission (DECISIONS 103)
            early.on_terminal = told
            deltas, step, early.step = early.deltas, early.step, None  # its step is ours
        else:
            deltas = read_text(target, child_id, key=key, on_terminal=told)
        try:
            while True:
                if step is None:
                    step = asyncio.ensure_future(anext(deltas))
                done, _ = await asyncio.wait({step, result_task}, return_when=FIRST)
                if step not in done:
                    done, _ = await asyncio.wait({step}, timeout=DIRECT_GRACE_S)
                    if step not in done:
                        step.cancel()
                        with contextlib.suppress(BaseException):
                            await step
                        raise TextStreamError("the prompt ended without its text stream")
                try:
                    delta = step.result()
                except StopAsyncIteration:
                    return
                step = None
                yield delta
        finally:
            if step is not None and not step.done():
                step.cancel()  # the generator runs in it: let it stop before closing it
                with contextlib.suppress(BaseException):
                    await step
            with contextlib.suppress(Exception):
                await deltas.aclose()

    async def _follow(
        self,
        child_id: str,
        result_task: asyncio.Future[Any],
        poll_cooldown_ms: int,
        start: int = 0,
    ) -> PromptEvents:
        """The events of the prompt workflow's stream up to its terminal event; nothing
        more once the prompt has ended without one reaching the stream."""
        stream = WorkflowStreamClient.create(self.client, child_id)
        attempts = 0
        while True:
            try:
                async for item in stream.subscribe(
                    [names.PROMPT_STREAM_TOPIC],
                    from_offset=start,
                    result_type=None,
                    poll_cooldown=timedelta(milliseconds=poll_cooldown_ms),
                ):
                    event = _EVENT.validate_python(item.data)
                    yield event
                    if not isinstance(event, TextDelta):
                        return
                return
            except RPCError:
                # The child is started by the Update handler a moment after acceptance.
                attempts += 1
                if result_task.done() or attempts > 200:
                    return
                await asyncio.sleep(0.02)


def _rest(result: Done | Fault, so_far: str, tokens: int) -> TextDelta | None:
    """The text of ``result`` that the deltas (``so_far``, holding ``tokens`` generated
    tokens) missed, as one more delta; None when they missed none. A Done holds the whole
    text; a run-hosted prompt's Fault what it had (DECISIONS 66)."""
    whole = result.final_text if isinstance(result, Done) else result.text
    if whole is None or not whole.startswith(so_far) or len(whole) == len(so_far):
        return None
    # The tokens it holds, so that a usage summed from the deltas is whole.
    total = result.tokens_generated  # None: a node that does not say
    return TextDelta(
        request_id=result.request_id,
        text=whole[len(so_far) :],
        tokens=None if total is None else max(0, total - tokens),
    )
