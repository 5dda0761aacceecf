"""The node agent's activities, served on the node's own task queue."""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel
from temporalio import activity
from temporalio.client import Client, WorkflowHandle
from temporalio.contrib.workflow_streams import WorkflowStreamClient
from temporalio.exceptions import ApplicationError

from mvp_core import names
from mvp_core.datastream import Redactor
from mvp_core.edge_auth import node_datastream_token
from mvp_core.errors import ErrorType
from mvp_core.generation import PromptRefused
from mvp_core.models import (
    Done,
    Fault,
    GenerateCheckpoint,
    GenerateInput,
    LeaseInput,
    LeaseStarted,
    NodeRuntimeReadyAck,
    PromptOutcome,
    PromptTiming,
    StageFault,
    StageProvision,
    StageReady,
    StageStopped,
    StopGenerateInput,
    StopRun,
    SubmitPrompt,
    TextDelta,
    TokenEndpointsReady,
    TokenLogprob,
    WeightsReady,
)
from mvp_core.run_signals import signal_name
from temporal import telemetry
from workers.node import layout
from workers.node.config import FaultInjection, NodeConfig
from workers.node.dataplane import DataPlaneServer
from workers.node.early import EarlyStarts, early_threads
from workers.node.generation import Generation, start_generation
from workers.node.nodestream import LoadProgress, NodeDatastream, NodeSampler
from workers.node.textpath import NoTemporalText, TextFanout, TextHub

if TYPE_CHECKING:
    # The runtime brings the engine and torch (~0.8 s to import): the agent imports it in
    # the background at boot (``preload_runtime``) while it connects and reports ready.
    from workers.node.runtime import GenerationResult, StageRuntime

# A generate hands the SDK a heartbeat every BEAT_SHARE x its heartbeat timeout, the first
# one too (each costs the server ~3.7 ms of CPU, and a prompt that ends sooner none; the SDK
# sends one it is handed at once when none went in the node worker's throttle, 2 s,
# workers/node/agent.py): with the default 30 s, every 12 s (DECISIONS 101). Its cancel's
# stop is pushed (DECISIONS 65), a lost head is the run's news (DECISIONS 68, 101): the
# heartbeat is the fallback for both, and in a run that replaces lost nodes the
# checkpoint a resume starts from where the heartbeat's timeout found the loss. Without
# a heartbeat timeout: the first after FIRST_BEAT_S, then every HEARTBEAT_EVERY_S.
BEAT_SHARE = 0.4
HEARTBEAT_EVERY_S = 0.5
FIRST_BEAT_S = 2.0
LEASE_GATE_POLL_S = 0.1  # a held-back lease report (fault injection) looks this often
MAX_EARLY_STOPS = 256  # stops remembered for generates not started yet
TEXT_GATHER_S = 0.025  # the finest stream granularity: stream_batch_ms is at least this
MAX_GATHER_S = 1.0  # the coarsest, however many prompts generate
DATASTREAM_END_S = 3.0  # at exit, the node's datastream followers get its end within this
EARLY_END_S = 5.0  # at a stage's stop, its stopped early starts' loops get this to end


class NodeActivities:
    def __init__(self, cfg: NodeConfig, client: Client, server: DataPlaneServer) -> None:
        self.cfg = cfg
        self.client = client
        self.server = server
        self.acked = asyncio.Event()
        self.weights_reported = asyncio.Event()
        self.stopped = asyncio.Event()
        self.runtime: StageRuntime | None = None
        # Every text this node reports goes into the run's history: without the secrets
        # of its environment (payload key, edge token, Temporal API key).
        self.redact = Redactor.from_env(os.environ).redact_text
        self.last_lease_beat = time.monotonic()
        self.leases_running = 0
        self.generating = 0  # generate activities whose token loop runs
        # Prompt workflow id -> its generate's stop (DECISIONS 65); and stops that came
        # before their generate (bounded: a generate that never comes leaves no trace).
        self._stops: dict[str, threading.Event] = {}
        self._early_stops: OrderedDict[str, None] = OrderedDict()
        # Prompts' text straight to clients that read it (DECISIONS 63), on the node's
        # data-plane port, for clients that show the run's text-stream token.
        self.text = TextHub()
        # Prompts a reader with that token starts before their generate (DECISIONS 103):
        # on the head, where nothing generates.
        self._preparing = 0  # generates on their way to their token loop
        self.early = EarlyStarts(
            asyncio.get_running_loop(),
            self._start_early,
            lambda: self.generating == 0 and self._preparing == 0,
            settled=self._early_settled,
        )
        self._narrowed = False  # an early start runs on fewer threads (DECISIONS 104)
        self.text.early = self.early
        if cfg.text_token:
            server.serve_text(cfg.text_token, self.text.serve)
        # The node's own datastream (DECISIONS 93), for followers that show the token
        # derived from the run's edge token: its load, steps, edges and KV slots.
        self.datastream = NodeDatastream(
            cfg.run_id, cfg.node_id, cfg.stage_index, redactor=Redactor.from_env(os.environ)
        )
        self.sampler: NodeSampler | None = None
        if cfg.edge_token:
            server.serve_datastream(node_datastream_token(cfg.edge_token), self.datastream.serve)

    def start_datastream(self) -> None:
        """Sample the stage for the node's datastream (the agent, once it serves)."""
        if self.sampler is None:
            self.sampler = NodeSampler(self.datastream, lambda: self.runtime).start()

    def close_datastream(self, reason: str = "stopped") -> None:
        """The last samples, then the stream's end: followers get it before the node exits
        (bounded: its data plane closes their sockets next)."""
        if self.sampler is not None:
            self.sampler.stop()
        self.datastream.close(reason, wait_s=DATASTREAM_END_S)

    def _start_early(self, prompt: SubmitPrompt, max_new_tokens: int) -> Generation | None:
        """An early start's token loop (DECISIONS 103): on the head, once it has a stage,
        on the threads early_threads gives it (DECISIONS 104)."""
        runtime = self.runtime
        if runtime is None or self.cfg.stage_index != 0:
            return None
        threads = early_threads(self.cfg.shares_control_host, runtime.threads, os.cpu_count() or 1)
        if threads is None:
            return None
        # No early start is held here (EarlyStarts begins one only then): nothing narrowed.
        if threads != runtime.threads and runtime.narrow_threads(threads) is None:
            return None  # it cannot leave the admission a core: not worth starting
        self._narrowed = threads != runtime.threads
        try:
            return start_generation(runtime, prompt, max_new_tokens)
        except BaseException:
            self._early_settled()
            raise

    def _early_settled(self) -> None:
        """The early start held was adopted or stopped: the engine's own threads again."""
        if self._narrowed and self.runtime is not None:
            self.runtime.narrow_threads(None)
        self._narrowed = False

    def _generate_ended(self, key: str, stopped: threading.Event) -> None:
        self.generating -= 1
        if self._stops.get(key) is stopped:
            del self._stops[key]

    @activity.defn(name=names.ACT_NODE_STOP_GENERATE)
    async def stop_generate(self, inp: StopGenerateInput) -> bool:
        """Stop a cancelled prompt's generate at the engine's next step (DECISIONS 65):
        True when it was running here. One that has not started yet ends as soon as it
        does."""
        self._check(inp.run_id, inp.readiness_id)
        stopped = self._stops.get(inp.prompt_workflow_id)
        activity.logger.info(
            "stop %s: %s",
            inp.prompt_workflow_id,
            "its generate stops" if stopped is not None else "no generate running here",
        )
        if stopped is not None:
            stopped.set()
            return True
        self.early.drop(inp.prompt_workflow_id)  # started early, its generate not come
        self._early_stops[inp.prompt_workflow_id] = None
        while len(self._early_stops) > MAX_EARLY_STOPS:
            self._early_stops.popitem(last=False)
        return False

    def _run(self) -> WorkflowHandle[Any, Any]:
        return self.client.get_workflow_handle(self.cfg.run_workflow_id)

    async def _report(self, report: BaseModel) -> None:
        """A report to the node's run, on the signal the run's table names for it."""
        await self._run().signal(signal_name(report), report)

    def _check(self, run_id: int, readiness_id: str, authority: str | None = None) -> None:
        """A stage rejects commands that are not from its run's authority (actor spec 6.6)."""
        cfg = self.cfg
        if run_id != cfg.run_id or readiness_id != cfg.readiness_id:
            raise _fatal(
                f"node {cfg.node_id}: command for run {run_id}/{readiness_id} rejected; this node "
                f"serves run {cfg.run_id}/{cfg.readiness_id}",
                ErrorType.STAGE_REJECTED,
            )
        if authority is not None and authority != cfg.authorized_orchestrator:
            raise _fatal(
                f"node {cfg.node_id}: unauthorized orchestrator {authority!r}",
                ErrorType.STAGE_REJECTED,
            )

    @activity.defn(name=names.ACT_NODE_RUNTIME_READY_ACK)
    async def runtime_ready_ack(self, ack: NodeRuntimeReadyAck) -> NodeRuntimeReadyAck:
        cfg = self.cfg
        self._check(ack.run_id, ack.readiness_id)
        if ack.node_id != cfg.node_id or ack.stage_index != cfg.stage_index:
            raise _fatal("ack for another node", ErrorType.STAGE_REJECTED)
        self.acked.set()
        return NodeRuntimeReadyAck(
            run_id=cfg.run_id,
            node_id=cfg.node_id,
            stage_index=cfg.stage_index,
            readiness_id=cfg.readiness_id,
        )

    @activity.defn(name=names.ACT_NODE_LEASE)
    async def lease(self, inp: LeaseInput) -> None:
        """Membership: runs for the life of the run, heartbeating; its loss is a fault."""
        cfg = self.cfg
        self._check(inp.run_id, inp.readiness_id)
        faults = FaultInjection.from_env()
        gate, reported = faults.lease_gate, faults.no_lease_report
        self.leases_running += 1
        try:
            while True:
                if not reported and (gate is None or await asyncio.to_thread(os.path.exists, gate)):
                    await self._report(
                        LeaseStarted(
                            run_id=cfg.run_id,
                            node_id=cfg.node_id,
                            readiness_id=cfg.readiness_id,
                            worker_identity=cfg.identity,
                        ),
                    )
                    reported = True
                activity.heartbeat()
                self.last_lease_beat = time.monotonic()
                wait = inp.heartbeat_every_s
                if not reported:
                    wait = min(wait, LEASE_GATE_POLL_S)
                await asyncio.sleep(wait)
        except asyncio.CancelledError:
            return
        finally:
            self.leases_running -= 1
            self.last_lease_beat = time.monotonic()

    @activity.defn(name=names.ACT_NODE_PROVISION_STAGE)
    async def provision_stage(self, prov: StageProvision) -> None:
        cfg = self.cfg
        self._check(prov.run_id, prov.readiness_id, prov.authorized_orchestrator)
        if prov.node_id != cfg.node_id or prov.stage_index != cfg.stage_index:
            raise _fatal(
                f"node {cfg.node_id}: provision for node {prov.node_id} stage "
                f"{prov.stage_index} rejected",
                ErrorType.STAGE_REJECTED,
            )
        if self.runtime is None:
            progress = LoadProgress(self.datastream, (prov.layers.start, prov.layers.end))
            task = await _heartbeating("loading", _load_runtime, prov, progress)
            try:
                runtime = task.result()
                progress.done()
                self._join_data_plane(runtime)
            except Exception as err:
                progress.failed()
                raise _fatal(
                    self.redact(f"stage {cfg.stage_index} weight load failed: {err}"),
                    ErrorType.STAGE_LOAD_FAILED,
                ) from None
            print(
                f"stage {cfg.stage_index} loaded layers [{prov.layers.start},{prov.layers.end}) "
                f"in {runtime.load_s:.2f}s ({runtime.threads} thread(s))",
                flush=True,
            )
            self.runtime = runtime
        elif prov.epoch > self.runtime.provision.epoch:
            await self._rewire(self.runtime, prov)
        await self._report(
            WeightsReady(
                run_id=cfg.run_id,
                node_id=cfg.node_id,
                stage_index=cfg.stage_index,
                readiness_id=cfg.readiness_id,
            ),
        )
        self.weights_reported.set()

    async def _rewire(self, runtime: StageRuntime, prov: StageProvision) -> None:
        """Stage recovery (DECISIONS 68): join the run's new pipeline with the weights this
        stage holds; its prompts in flight (on the head) go on there."""
        old = runtime.provision.epoch
        rewire = functools.partial(
            runtime.rewire, prov, self.server, **self._pipeline_reports(prov.epoch)
        )
        task = await _heartbeating("rewiring", rewire)
        try:
            task.result()
        except (ValueError, RuntimeError) as err:
            raise _fatal(
                self.redact(f"node {self.cfg.node_id}: {err}"),
                ErrorType.STAGE_REJECTED,
            ) from None
        print(
            f"stage {self.cfg.stage_index} left pipeline {old} for pipeline {prov.epoch} "
            "(weights kept)",
            flush=True,
        )

    def _join_data_plane(self, runtime: StageRuntime) -> None:
        """StageReady when both edges connect (at once in direct mode); faults by signal."""
        runtime.attach_pipeline(self.server, **self._pipeline_reports(runtime.provision.epoch))

    def _pipeline_reports(self, epoch: int) -> dict[str, Any]:
        """The data plane's reports to the run, each naming pipeline ``epoch``."""
        cfg, loop = self.cfg, asyncio.get_running_loop()

        def send(report: BaseModel) -> None:
            async def deliver() -> None:
                if not isinstance(report, StageFault):
                    await self.weights_reported.wait()  # readiness in the spec's order
                try:
                    await self._report(report)
                except Exception as err:
                    print(f"report {signal_name(report)} not delivered: {err}", flush=True)

            asyncio.run_coroutine_threadsafe(deliver(), loop)

        return {
            "edge_token": cfg.edge_token,
            "connect_timeout_s": cfg.readiness_timeout_s,
            "on_stage_ready": lambda: send(
                StageReady(
                    run_id=cfg.run_id,
                    stage_index=cfg.stage_index,
                    readiness_id=cfg.readiness_id,
                    epoch=epoch,
                ),
            ),
            "on_endpoints_ready": lambda: send(
                TokenEndpointsReady(
                    run_id=cfg.run_id,
                    node_id=cfg.node_id,
                    readiness_id=cfg.readiness_id,
                    epoch=epoch,
                ),
            ),
            "on_fault": lambda reason: send(
                StageFault(
                    run_id=cfg.run_id,
                    stage_index=cfg.stage_index,
                    reason=self.redact(reason),
                    readiness_id=cfg.readiness_id,
                    epoch=epoch,
                ),
            ),
        }

    @activity.defn(name=names.ACT_NODE_GENERATE)
    async def generate(self, inp: GenerateInput) -> PromptOutcome:
        """Encode, run the token loop, publish text deltas, return the terminal event."""
        self._check(inp.run_id, inp.readiness_id)
        runtime = self.runtime
        request_id = inp.prompt.request_id
        if runtime is None:
            raise _fatal(
                "generate before the stage was provisioned",
                ErrorType.STAGE_NOT_READY,
            )
        key = inp.prompt_workflow_id
        if key in self._early_stops:
            self._early_stops.pop(key)
            self.early.drop(key)
            return PromptOutcome(terminal=Fault(request_id=request_id, error="cancelled"))
        entered = time.perf_counter()
        self._preparing += 1  # the head is busy from here on: no early start begins
        try:
            gen = await self._generation(runtime, inp)
        finally:
            self._preparing -= 1
        if gen is None:  # stopped while it waited (DECISIONS 65)
            self._early_stops.pop(key, None)
            return PromptOutcome(terminal=Fault(request_id=request_id, error="cancelled"))
        pipe, stopped = gen.pipe, gen.stopped
        prompt_tokens, cached_tokens = gen.prompt_tokens, gen.cached_tokens
        generated, logprobs, task = gen.generated, gen.logprobs, gen.task

        stream: WorkflowStreamClient | NoTemporalText = (
            WorkflowStreamClient.create(
                activity.client(),
                inp.prompt_workflow_id,
                batch_interval=timedelta(milliseconds=inp.stream_batch_ms),
            )
            if inp.temporal_text
            else NoTemporalText()  # a run-hosted prompt: no workflow stream (DECISIONS 66)
        )
        out = TextFanout(
            self.text,
            inp.prompt_workflow_id,
            stream.topic(names.PROMPT_STREAM_TOPIC, type=TextDelta),
            inp.prompt.text_key,
        )
        gather_s = min(MAX_GATHER_S, max(TEXT_GATHER_S, inp.stream_batch_ms / 4000))
        batch_s = inp.stream_batch_ms / 1000
        self.generating += 1
        self._stops[key] = stopped
        task.add_done_callback(lambda _: self._generate_ended(key, stopped))
        beat_s, first_beat = generate_beats(activity.info().heartbeat_timeout)
        last_beat = time.monotonic() - beat_s + first_beat
        # A resumed prompt's readers have the text of its first tokens (DECISIONS 68).
        published_tokens = len(inp.resume) if inp.text_from is None else inp.text_from
        async with stream:
            try:
                while (text := await pipe.take(quiet_s=1.0)) is not None:
                    if text:
                        out.put(
                            TextDelta(
                                request_id=request_id,
                                text=text,
                                tokens=pipe.tokens_taken - published_tokens,
                                prompt_tokens=prompt_tokens[0]
                                if out.first_at is None and prompt_tokens
                                else None,
                                cached_tokens=cached_tokens[0]
                                if out.first_at is None and cached_tokens
                                else None,
                                logprobs=_taken(logprobs, published_tokens, pipe.tokens_taken),
                            )
                        )
                        published_tokens = pipe.tokens_taken
                    if activity.is_cancelled():  # its CancelledError, should it be lost
                        raise asyncio.CancelledError
                    if time.monotonic() - last_beat > beat_s:
                        _beat(inp, generated)
                        last_beat = time.monotonic()
                    # Let text gather: the stream flushes every batch interval anyway, and
                    # each wake-up of this loop takes the GIL from the token loop. With
                    # several prompts generating, each publishes less often, so the run's
                    # stream traffic (a signal and workflow tasks per flush) stays about
                    # that of one prompt (DECISIONS 62).
                    await asyncio.sleep(
                        min(MAX_GATHER_S, max(gather_s, batch_s * (self.generating - 1)))
                    )
                # The engine's thread ends after its last text: a cancel that comes while
                # it does (the answer to a heartbeat) is the cancel above, not an error.
                await asyncio.wait({task})
            except asyncio.CancelledError:
                stopped.set()
                ended: GenerationResult | None = None
                try:
                    ended = await task
                except Exception:
                    pass
                out.end(done=False)
                await stream.flush()
                if inp.temporal_text or ended is None:
                    raise
                # A run-hosted prompt's text so far goes with its end (no stream holds it):
                # the cancel is answered with the cancelled outcome (the run waits for the
                # generate's end), whichever came first, this cancel or the pushed stop.
                return _cancelled(request_id, ended)
            first_published = out.first_at
            try:
                result = await task
            except PromptRefused as err:
                out.end(done=False)
                await stream.flush()
                refused = Fault(
                    request_id=request_id,
                    error=str(err),
                    kind=err.kind,
                    prompt_tokens=err.prompt_tokens,
                )
                return PromptOutcome(terminal=refused)
            except Exception as err:
                out.end(done=False)
                raise _fatal(
                    self.redact(
                        f"engine fault on stage {self.cfg.stage_index}: {type(err).__name__}: {err}"
                    ),
                    ErrorType.ENGINE_FAULT,
                ) from None
            finished = result.stop_reason in ("eos", "max_tokens", "context")
            done = (
                Done(
                    request_id=request_id,
                    final_text=result.text,
                    tokens_generated=result.tokens,
                    elapsed_ms=result.elapsed_ms,
                    stop_reason=result.stop_reason,
                    prompt_tokens=result.prompt_tokens,
                    cached_tokens=result.cached_tokens,
                    recoveries=result.recoveries,
                )
                if finished
                else None
            )
            # A finished prompt's Done carries its whole text: what a direct reader took
            # need not go to Temporal too; any other end publishes what it owes. Its
            # direct readers get that Done with the end, where it is the run's too (its
            # first generate: a resumed one's says nothing of the run's recoveries), so
            # they need not ask the run for it (DECISIONS 95).
            first = not inp.resume and inp.text_from is None
            out.end(done=finished, terminal=done if first else None)
            await stream.flush()
        if done is None:
            # A run-hosted prompt's text so far goes with its end: no stream holds it.
            return _cancelled(request_id, None if inp.temporal_text else result)
        telemetry.note_prompt_end(result.tokens, result.stop_reason)  # on RunActivity's span
        timing = prompt_timing(result, first_published)
        if timing is not None and gen.started_at < entered:  # started early (DECISIONS 103)
            timing = timing.model_copy(update={"early_ms": (entered - gen.started_at) * 1000})
        return PromptOutcome(terminal=done, timing=timing)

    async def _generation(self, runtime: StageRuntime, inp: GenerateInput) -> Generation | None:
        """The prompt's token loop: the early start of this very prompt where one runs
        (DECISIONS 103), else a new one. On a pipeline's head, whose sequences are keyed
        by request id, a new one waits for the stopped early starts of its request id to
        end first (heartbeating); None where its stop came meanwhile."""
        fresh = not inp.resume and inp.text_from is None  # a resume goes on from its tokens
        key = inp.prompt_workflow_id
        adopted, ending = self.early.take(key, inp.prompt, inp.max_new_tokens, adopt=fresh)
        if adopted is not None:
            return adopted
        if ending and runtime.provision.driver_edges:
            waiting = {g.task for g in ending}
            while waiting:
                _, waiting = await asyncio.wait(waiting, timeout=HEARTBEAT_EVERY_S * 4)
                activity.heartbeat()
            if key in self._early_stops:
                return None
        return start_generation(
            runtime, inp.prompt, inp.max_new_tokens, resume=inp.resume, text_from=inp.text_from
        )

    @activity.defn(name=names.ACT_NODE_STOP_STAGE)
    async def stop_stage(self, cmd: StopRun) -> None:
        cfg = self.cfg
        self._check(cmd.run_id, cmd.readiness_id, cmd.authorized_orchestrator)
        runtime, self.runtime = self.runtime, None
        await self.early.aclose(EARLY_END_S)
        self.text.close()
        if runtime is not None:
            await asyncio.to_thread(runtime.close)
            if self.sampler is not None:  # its last steps, its KV slots freed
                await asyncio.to_thread(self.sampler.sample, runtime)
        await self._report(
            StageStopped(
                run_id=cfg.run_id, stage_index=cfg.stage_index, readiness_id=cfg.readiness_id
            ),
        )
        self.stopped.set()


async def _heartbeating(detail: str, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
    """Run ``fn(*args)`` in a thread, heartbeating ``detail`` every 2 s until it ends;
    returns its finished task (its result or its exception)."""
    task = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    while not task.done():
        activity.heartbeat(detail)
        await asyncio.wait({task}, timeout=2)
    return task


def _fatal(message: str, kind: ErrorType) -> ApplicationError:
    """A failure the run must not retry: the message (already redacted where it may carry
    a secret) under its error type, for the workflow to act on."""
    return ApplicationError(message, type=kind, non_retryable=True)


def generate_beats(timeout: timedelta | None) -> tuple[float, float]:
    """A generate's heartbeat cadence and when its first heartbeat goes, in seconds, for
    its heartbeat timeout (None: the activity has none)."""
    if timeout is None:
        return HEARTBEAT_EVERY_S, FIRST_BEAT_S
    every = max(HEARTBEAT_EVERY_S, BEAT_SHARE * timeout.total_seconds())
    return every, every


def _beat(inp: GenerateInput, generated: list[int]) -> None:
    """The generate's heartbeat; where the run replaces lost nodes, with the tokens so
    far, for the prompt to go on from should this node be lost (DECISIONS 68)."""
    if inp.checkpoint:
        activity.heartbeat(GenerateCheckpoint(tokens=list(generated)))
    else:
        activity.heartbeat()


def _taken(
    logprobs: list[TokenLogprob | None] | None, start: int, end: int
) -> list[TokenLogprob] | None:
    """The logprobs of generated tokens ``start`` to ``end`` (those whose text a delta
    completes; a resumed token has none); None where the prompt did not ask for them."""
    if logprobs is None:
        return None
    return [e for e in logprobs[start:end] if e is not None]


def _cancelled(request_id: int, result: GenerationResult | None) -> PromptOutcome:
    """A stopped prompt's end; with ``result``, the text it had and its tokens (a
    run-hosted prompt's: no stream holds them)."""
    return PromptOutcome(
        terminal=Fault(
            request_id=request_id,
            error="cancelled",
            text=None if result is None else result.text,
            tokens_generated=None if result is None else result.tokens,
        )
    )


def prompt_timing(result: GenerationResult, first_published: float | None) -> PromptTiming | None:
    """The head node's side of a prompt's time (None when it made no token)."""
    first = result.first_token_at
    if first is None:
        return None
    end = result.started_at + result.elapsed_ms / 1000
    decode_s = end - first
    return PromptTiming(
        encode_ms=max(0.0, (result.encoded_at - result.started_at) * 1000),
        prefill_ms=max(0.0, (first - result.encoded_at) * 1000),
        first_delta_ms=0.0
        if first_published is None
        else max(0.0, (first_published - first) * 1000),
        decode_tokens_per_s=(result.tokens - 1) / decode_s
        if result.tokens > 1 and decode_s > 0
        else None,
    )


def _load_runtime(prov: StageProvision, progress: LoadProgress | None = None) -> StageRuntime:
    from workers.node.runtime import StageRuntime  # waits for the boot-time import

    delay = FaultInjection.from_env().provision_delay_s
    if delay:
        time.sleep(delay)
    return StageRuntime.load(prov, progress)


def preload_runtime() -> threading.Thread:
    """Import the runtime (engine, torch) in a background thread; activities that need it
    import it again, which waits for this import to finish. With a fixed address layout
    torch's native libraries are mapped first, here, so they land at the same addresses
    in every node (workers/node/layout.py)."""
    if not layout.randomized():
        layout.map_native_libraries()

    def work() -> None:
        try:
            import workers.node.runtime  # noqa: F401
        except Exception:  # the activity's own import reports it where it matters
            pass

    t = threading.Thread(target=work, name="preload-runtime", daemon=True)
    t.start()
    return t
