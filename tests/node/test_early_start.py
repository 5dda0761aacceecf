"""Early starts (DECISIONS 103): a reader with the run's text-stream token hands the head
node the prompt it is about to submit; an idle head starts it, the prompt's generate
adopts it when it comes with the same prompt, and anything else stops it. The node half
(workers/node/early.py behind workers/node/textpath.py) over a real loopback socket, with
the token loop's start recorded instead of run (tests/integration/test_run_hosted.py runs
real ones)."""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace
from typing import Any

import pytest
from temporalio.testing import ActivityEnvironment

from mvp_core.edge_auth import TEXT_READER_TOKEN
from mvp_core.models import GenerateInput, StopGenerateInput, SubmitPrompt, TextDelta
from temporal.text_stream import TextStreamTarget, read_text
from tests.helpers.waits import eventually
from tests.node.conftest import TOKEN, answer_to
from tests.node.test_stage_authority import CFG
from workers.node.activities import NodeActivities
from workers.node.dataplane import DataPlaneServer
from workers.node.early import EarlyStarts, early_threads
from workers.node.engine import native
from workers.node.generation import Generation
from workers.node.runtime import StageRuntime
from workers.node.textpath import TextPipe, TextRequestError

KEY = "mvp-run-7-prompt-1-abc"
PROMPT = SubmitPrompt(request_id=1, prompt_text="Once upon a time", max_tokens=8)
START = {"prompt": PROMPT.model_dump(mode="json"), "max_new_tokens": 8}


class Starts:
    """The token loop's start, recorded: each start a generation whose loop ends when it
    is stopped, or (``linger``) only once ``release`` is set, as a pipeline head's loop
    that waits for its next record does."""

    def __init__(self, linger: bool = False) -> None:
        self.started: list[tuple[SubmitPrompt, int]] = []
        self.generations: list[Generation] = []
        self.release = threading.Event()
        self.linger = linger

    def __call__(self, prompt: SubmitPrompt, max_new_tokens: int) -> Generation:
        loop = asyncio.get_running_loop()
        stopped = threading.Event()
        ends = self.release if self.linger else stopped
        task = asyncio.ensure_future(asyncio.to_thread(ends.wait, 30))
        self.started.append((prompt, max_new_tokens))
        gen = Generation(prompt, max_new_tokens, TextPipe(loop), stopped, task)  # type: ignore[arg-type]
        self.generations.append(gen)
        return gen


def _early(starts: Starts, idle: bool = True, hold_s: float = 30.0) -> EarlyStarts:
    return EarlyStarts(asyncio.get_running_loop(), starts, lambda: idle, hold_s=hold_s)


async def _stopped(gen: Generation) -> None:
    await eventually(gen.stopped.is_set, timeout=10, what="the early start stopped")
    await asyncio.wait_for(gen.task, 10)


async def test_a_reader_with_the_token_starts_its_prompt_and_reads_it_once_its_generate_opened_it(
    text_node,
):
    server, hub = text_node
    starts = Starts()
    hub.early = early = _early(starts)
    target = TextStreamTarget(server.host, server.port, TOKEN)
    deltas = read_text(target, KEY, early=START)
    first = asyncio.ensure_future(anext(deltas))
    await eventually(lambda: starts.started, timeout=10, what="the prompt started early")
    assert starts.started == [(PROMPT, 8)] and early.started == 1
    assert not first.done()  # nothing is published before its generate opens it
    adopted, stale = early.take(KEY, PROMPT, 8)  # the generate, with this very prompt
    assert adopted is starts.generations[0] and stale == [] and early.adopted == 1
    hub.open(KEY)
    hub.put(KEY, TextDelta(request_id=1, text="Once", tokens=1))
    hub.end(KEY)
    assert (await asyncio.wait_for(first, 10)).text == "Once"
    with pytest.raises(StopAsyncIteration):
        await anext(deltas)
    # Its reader went after the adoption: the adopted loop runs on (the run's now).
    await asyncio.sleep(0.2)
    assert not adopted.stopped.is_set() and early.dropped == 0
    adopted.stop()


async def test_an_early_start_whose_reader_leaves_before_its_generate_is_stopped(text_node):
    server, hub = text_node
    starts = Starts()
    hub.early = early = _early(starts)
    deltas = read_text(TextStreamTarget(server.host, server.port, TOKEN), KEY, early=START)
    step = asyncio.ensure_future(anext(deltas))
    await eventually(lambda: starts.started, timeout=10, what="the prompt started early")
    step.cancel()  # the client's admission was refused: it closes the stream
    with pytest.raises(asyncio.CancelledError):
        await step
    await deltas.aclose()
    await _stopped(starts.generations[0])  # the node notices within its 1 s idle check
    assert early.dropped == 1 and early.take(KEY, PROMPT, 8)[0] is None


async def test_an_early_start_nobody_adopts_in_time_is_stopped():
    starts = Starts()
    early = _early(starts, hold_s=0.05)
    early.offer(KEY, START)
    await eventually(lambda: starts.generations, timeout=10, what="the prompt started early")
    await _stopped(starts.generations[0])
    assert (early.started, early.adopted, early.dropped) == (1, 0, 1)
    assert early.take(KEY, PROMPT, 8)[0] is None  # its generate starts its own


async def test_a_generate_that_may_not_adopt_the_early_start_stops_it_and_waits_for_its_end():
    """Another prompt or cap under its id (a seed drawn at admission), a resume (it goes
    on from its tokens), or another prompt id with its request id (a pipeline keys its
    sequences by request id): the early start stops, and its generate waits for it."""
    for key, prompt, cap, adopt in [
        (KEY, PROMPT.model_copy(update={"seed": 5}), 8, True),
        (KEY, PROMPT, 9, True),
        (KEY, PROMPT, 8, False),
        ("mvp-run-7-prompt-1-other", PROMPT.model_copy(update={"prompt_text": "x"}), 8, True),
    ]:
        starts = Starts()
        early = _early(starts)
        early.offer(KEY, START)
        await eventually(lambda s=starts: s.generations, timeout=10, what="an early start")
        adopted, ending = early.take(key, prompt, cap, adopt=adopt)
        assert adopted is None and ending == [starts.generations[0]]
        await _stopped(ending[0])
        assert (early.adopted, early.dropped) == (0, 1)
        # Once its loop ended, a generate of that request id waits for nothing.
        await eventually(
            lambda e=early, k=key, p=prompt, c=cap: e.take(k, p, c) == (None, []),
            timeout=10,
            what="nothing left to wait for",
        )


async def test_a_busy_head_or_one_already_holding_an_early_start_starts_nothing_more():
    starts = Starts()
    early = _early(starts, idle=False)
    early.offer(KEY, START)
    await asyncio.sleep(0.05)
    assert starts.started == [] and early.take(KEY, PROMPT, 8) == (None, [])
    early = _early(starts)
    early.offer(KEY, START)
    early.offer("another", START | {"prompt": PROMPT.model_dump(mode="json") | {"request_id": 2}})
    await asyncio.sleep(0.05)
    assert len(starts.started) == 1  # one at a time
    await early.aclose(10)
    assert starts.generations[0].task.done()


@pytest.mark.parametrize(
    ("start", "says"),
    [
        ({"prompt": {"request_id": 1}, "max_new_tokens": 8}, "start.prompt"),
        ({"prompt": START["prompt"], "max_new_tokens": 0}, "start.max_new_tokens"),
        ({"prompt": START["prompt"]}, "start.max_new_tokens: Field required"),
        (START | {"extra": 1}, "start.extra"),
        ("go", "start"),
    ],
)
async def test_a_bad_start_is_refused_by_name_and_starts_nothing(start: Any, says: str):
    starts = Starts()
    early = _early(starts)
    with pytest.raises(TextRequestError, match=says.replace(".", r"\.")):
        early.offer(KEY, start)
    await asyncio.sleep(0.05)
    assert starts.started == []


def test_a_keyed_reader_may_not_start_its_prompt(text_node):
    """A keyed reader (a client without the deployment's secret): its prompt's key lets it
    read its text, not start work on the head."""
    server, hub = text_node
    keyed = {"prompt_workflow_id": KEY, "from": 0, "start": START, "key": "0" * 32}
    hub.open(KEY, reader_key="0" * 32)
    assert b"start needs the run's text-stream token" in answer_to(
        server, TEXT_READER_TOKEN, json.dumps(keyed).encode() + b"\n"
    )
    # ... whose request line stays within 4096 bytes.
    assert b"longer than 4096 bytes" in answer_to(server, TEXT_READER_TOKEN, b"x" * 5000)


@pytest.mark.parametrize("early", [True, False])
async def test_a_start_that_cannot_be_taken_is_said_and_the_reader_reads_all_the_same(
    text_node, caplog, early: bool
):
    """A start is advice: a bad one is logged with what is wrong, a node without early
    starts (a later stage's) ignores it, and either way the reader reads its prompt."""
    server, hub = text_node
    starts = Starts()
    if early:
        hub.early = _early(starts)
    bad = {"prompt": START["prompt"], "max_new_tokens": -1}
    target = TextStreamTarget(server.host, server.port, TOKEN)
    reading = asyncio.ensure_future(_all(read_text(target, KEY, early=bad if early else START)))
    await eventually(lambda: hub.readers(KEY), timeout=10, what="the node to count a reader")
    hub.open(KEY)
    hub.put(KEY, TextDelta(request_id=1, text="Once", tokens=1))
    hub.end(KEY)
    assert [d.text for d in await asyncio.wait_for(reading, 10)] == ["Once"]
    assert starts.started == []
    if early:
        assert "early start refused: start.max_new_tokens" in caplog.text


async def _all(deltas) -> list[TextDelta]:  # type: ignore[no-untyped-def]
    return [d async for d in deltas]


async def test_a_stopped_early_start_whose_loop_runs_on_keeps_the_next_from_starting():
    """A pipeline head keys its sequences by request id: while a stopped early start's
    loop still runs, no other begins (the same request id could come again)."""
    starts = Starts(linger=True)
    early = _early(starts)
    early.offer(KEY, START)
    await eventually(lambda: starts.generations, timeout=10, what="an early start")
    early.drop(KEY)  # its reader left; its loop waits for its next record
    early.offer("mvp-run-7-prompt-1-again", START)
    await asyncio.sleep(0.05)
    assert len(starts.started) == 1
    starts.release.set()
    await asyncio.wait_for(starts.generations[0].task, 10)
    await eventually(lambda: not early._ending, timeout=10, what="the loop's end seen")
    early.offer("mvp-run-7-prompt-1-again", START)
    await eventually(lambda: len(starts.started) == 2, timeout=10, what="the next start")
    early.drop("mvp-run-7-prompt-1-again")


async def test_another_prompts_generate_stops_the_held_early_start():
    """The head is busy once any generate comes: a held early start of another prompt
    (the run queued it) stops at once, not at the hold's end, so it holds no slot an
    admitted prompt needs; its generate waits for nothing of another request id."""
    starts = Starts()
    early = _early(starts)
    early.offer(KEY, START)
    await eventually(lambda: starts.generations, timeout=10, what="an early start")
    other = PROMPT.model_copy(update={"request_id": 2})
    adopted, ending = early.take("mvp-run-7-prompt-2-xyz", other, 8)
    assert adopted is None and ending == []
    await _stopped(starts.generations[0])
    assert early.dropped == 1


async def test_a_loop_that_failed_is_not_adopted():
    starts = Starts()
    early = _early(starts)
    early.offer(KEY, START)
    await eventually(lambda: starts.generations, timeout=10, what="an early start")
    gen = starts.generations[0]
    failed: asyncio.Future[object] = asyncio.get_running_loop().create_future()
    failed.set_exception(RuntimeError("request 1 is already on the data plane"))
    gen.stop()
    await gen.task
    gen.task = failed  # type: ignore[assignment]
    assert early.take(KEY, PROMPT, 8) == (None, [gen])


async def test_a_reader_that_leaves_stops_only_the_start_it_made():
    starts = Starts()
    early = _early(starts)
    first = early.offer(KEY, START)
    await eventually(lambda: starts.generations, timeout=10, what="an early start")
    second = early.offer(KEY, START)  # another connection for the same prompt: none begun
    early.left(KEY, second)
    await asyncio.sleep(0.05)
    assert not starts.generations[0].stopped.is_set()
    early.left(KEY, first)
    await _stopped(starts.generations[0])


async def test_a_stop_pushed_while_a_pipeline_heads_generate_waits_for_an_early_loop_is_kept():
    """A generate on a pipeline's head waits for a stopped early start of its request id
    to end; a stop pushed meanwhile (DECISIONS 65) ends it cancelled, no loop started."""
    server = DataPlaneServer()
    try:
        node = NodeActivities(CFG, client=None, server=server)  # type: ignore[arg-type]
        starts = Starts(linger=True)
        node.early._start = starts  # type: ignore[method-assign]
        node.early.offer(KEY, START)
        await eventually(lambda: starts.generations, timeout=10, what="an early start")
        runtime = SimpleNamespace(provision=SimpleNamespace(driver_edges=["token edges"]))
        inp = GenerateInput(
            run_id=7,
            readiness_id="ready-1",
            prompt_workflow_id="mvp-run-7-prompt-1-other",  # admitted under another id
            prompt=PROMPT,
            max_new_tokens=8,
        )
        env = ActivityEnvironment()
        waiting = asyncio.ensure_future(env.run(node._generation, runtime, inp))
        await asyncio.sleep(0.1)
        assert not waiting.done() and starts.generations[0].stopped.is_set()
        stop = StopGenerateInput(
            run_id=7, readiness_id="ready-1", prompt_workflow_id=inp.prompt_workflow_id
        )
        assert await env.run(node.stop_generate, stop) is False  # no loop of it runs yet
        starts.release.set()
        assert await asyncio.wait_for(waiting, 10) is None
    finally:
        server.close()


@pytest.mark.parametrize(
    ("shares", "threads", "cores", "early"),
    [
        (False, 2, 2, 2),  # a host of its own: the admission runs elsewhere
        (False, 0, 2, 0),  # (0: its threads as they are)
        (True, 1, 2, 1),  # a 2-stage run's head on a 2-core host: a core is left
        (True, 2, 2, 1),  # a 1-stage run's head on every core: one core left, until adopted
        (True, 0, 8, 7),  # not known: taken as every core (a stage of 0 narrows nothing)
        (True, 7, 8, 7),
        (True, 4, 4, 3),
        (True, 1, 1, None),  # one core: nothing to leave the admission
    ],
)
def test_a_head_on_the_control_planes_host_starts_early_leaving_the_admission_a_core(
    shares: bool, threads: int, cores: int, early: int | None
):
    assert early_threads(shares, threads, cores) == early


async def test_the_head_is_told_once_the_early_start_it_held_is_adopted_or_stopped():
    """The node restores its engine threads then (DECISIONS 104): after an adoption, a
    generate that adopts nothing, and a drop (the stop_generate of a prompt whose
    generate never came, a reader gone, a hold run out)."""
    settled: list[int] = []
    starts = Starts()
    early = EarlyStarts(
        asyncio.get_running_loop(),
        starts,
        lambda: True,
        settled=lambda: settled.append(len(starts.generations)),
    )
    early.offer(KEY, START)
    await eventually(lambda: starts.generations, timeout=10, what="the first early start")
    assert settled == []  # held: its threads stay narrowed
    assert early.take(KEY, PROMPT, 8)[0] is starts.generations[0]
    assert settled == [1]
    starts.generations[0].stop()
    early.offer(KEY, START)
    await eventually(lambda: len(starts.generations) == 2, timeout=10, what="the second")
    early.drop(KEY)
    await _stopped(starts.generations[1])
    assert settled == [1, 2]
    assert early.take("another", PROMPT, 8)[0] is None  # a generate that adopts nothing
    assert settled == [1, 2, 2]


def test_an_early_start_s_threads_narrow_the_native_kernel_s_pool_and_come_back():
    if native.library() is None:
        pytest.fail("the native kernel did not build here")
    before = native.threads()

    def narrow(stage: Any, n: int | None) -> int | None:
        change = StageRuntime.narrow_threads(stage, n)
        return None if change is None else change.result(30)

    try:
        stage: Any = SimpleNamespace(native_kernel=True, threads=2)
        assert narrow(stage, 1) == 1 and native.threads() == 1
        assert narrow(stage, 5) == 2 and native.threads() == 2  # at most its own
        narrow(stage, 1)
        assert narrow(stage, None) == 2 and native.threads() == 2
        torch_path: Any = SimpleNamespace(native_kernel=False, threads=2)
        assert narrow(torch_path, 1) is None and native.threads() == 2
    finally:
        native.set_threads(max(1, before))


class NarrowingRuntime:
    """A stage whose thread changes are recorded (the node's side of DECISIONS 104)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.changes: list[int | None] = []

    def narrow_threads(self, n: int | None) -> Any:
        self.changes.append(n)
        return SimpleNamespace()  # a change asked for (its future, unread here)


@pytest.mark.parametrize("fails", [False, True])
async def test_a_head_on_the_control_plane_s_host_narrows_for_its_early_start_and_widens_after(
    monkeypatch: pytest.MonkeyPatch, fails: bool
):
    """Its engine on every core of a 2-core host: the early start runs on one, and the
    head has both again once the start is adopted, or at once where it failed to start."""
    import dataclasses
    import os

    import workers.node.activities as node_activities

    starts = Starts()

    def start(runtime: Any, prompt: SubmitPrompt, max_new_tokens: int) -> Generation:
        if fails:
            raise RuntimeError("no KV slot")
        return starts(prompt, max_new_tokens)

    monkeypatch.setattr(node_activities, "start_generation", start)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    server = DataPlaneServer()
    try:
        cfg = dataclasses.replace(CFG, shares_control_host=True)
        node = NodeActivities(cfg, client=None, server=server)  # type: ignore[arg-type]
        runtime = NarrowingRuntime(threads=2)
        node.runtime = runtime  # type: ignore[assignment]
        node.early.offer(KEY, START)
        if fails:
            await eventually(lambda: len(runtime.changes) == 2, timeout=10, what="widened")
            assert runtime.changes == [1, None] and not starts.generations
            assert not node._narrowed
            return
        await eventually(lambda: starts.generations, timeout=10, what="the early start")
        assert runtime.changes == [1] and node._narrowed
        adopted, _ = node.early.take(KEY, PROMPT, 8)  # its generate came
        assert adopted is starts.generations[0]
        assert runtime.changes == [1, None] and not node._narrowed
        adopted.stop()
        # A head with a core to spare (a 2-stage run's: one thread) narrows nothing.
        runtime.threads, runtime.changes = 1, []
        node.early.offer("another", {**START})
        await eventually(lambda: len(starts.generations) == 2, timeout=10, what="a second")
        node.early.take("another", PROMPT, 8)[0].stop()  # type: ignore[union-attr]
        assert runtime.changes == [] and not node._narrowed
    finally:
        server.close()
