"""The node's stage runtime: the loaded stage, its tokenizer, and direct-mode generation.

The engine runs in a worker thread; the asyncio side (Temporal activities, heartbeats,
stream publishing) never blocks on it.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from mvp_core.generation import ChatTemplateRefused, PromptRefused, PromptTooLong
from mvp_core.models import EdgeKind, StageProvision, SubmitPrompt, TokenLogprob
from temporal import telemetry
from workers.node.affinity import Placement, compute_set, cpu_quota
from workers.node.config import FaultInjection
from workers.node.dataplane import (
    DataPlaneServer,
    Edge,
    EdgeClosed,
    EdgeError,
    EdgeGroup,
    EdgeSpec,
)
from workers.node.engine import (
    ContextOverflow,
    EngineOptions,
    LoadObserver,
    SamplingParams,
    Stage,
    load_stage,
    native,
    usable_cores,
    uses_native_kernel,
)
from workers.node.engine.formats import StageFormats
from workers.node.engine.sampling import TokenLogprobs
from workers.node.engine.tokenizer import Tokenizer, TokenizerError
from workers.node.nodestream import StepStats
from workers.node.pipeline import Driver, Endpoint, StageLink
from workers.node.scheduler import Scheduler
from workers.node.textpath import Detokenizer

# Changes to the kernel's thread count, applied in the order asked, one at a time, off the
# asking thread: the kernel takes one between two products (on one thread, a product can
# take milliseconds).
THREAD_CHANGES = ThreadPoolExecutor(1, thread_name_prefix="mvp-engine-threads")

# A token-out record later than this means a stage is stuck: a run fault, never a hang.
RECORD_TIMEOUT_S = 60.0
# A stage leaving its pipeline waits this long for its thread's step in flight to end:
# two pipelines never run the stage's layers at once (they share its buffers).
DETACH_WAIT_S = 120.0


@dataclass
class GenerationResult:
    text: str
    tokens: int
    elapsed_ms: int
    stop_reason: str
    prompt_tokens: int = 0
    # perf_counter() instants: the prompt tokenized, its first token sampled (None: none)
    encoded_at: float = 0.0
    first_token_at: float | None = None
    started_at: float = 0.0
    token_ids: list[int] = dataclasses.field(default_factory=list)  # resumed ones first
    recoveries: int = 0  # pipelines lost under it and replaced (stage recovery)
    cached_tokens: int = 0  # prompt tokens the head stage took from its prefix cache


def _telling_cached(
    link: StageLink | None,
    request_id: int,
    on_cached: Callable[[int], None],
    push: Callable[[int, TokenLogprobs | None], None],
) -> Callable[[int, TokenLogprobs | None], None]:
    """``push``, after telling ``on_cached`` at the first token how many prompt tokens the
    head stage's prefix cache gave (it took the prompt's BEGIN before any token came)."""
    told = False

    def on_token(token: int, logprobs: TokenLogprobs | None) -> None:
        nonlocal told
        if not told:
            told = True
            on_cached(link.reused.get(request_id, 0) if link is not None else 0)
        push(token, logprobs)

    return on_token


class StageRuntime:
    """One provisioned stage of this node."""

    def __init__(
        self, provision: StageProvision, stage: Stage, tokenizer: Tokenizer, load_s: float
    ) -> None:
        self.provision = provision
        self.stage = stage
        self.tokenizer = tokenizer
        self.load_s = load_s
        # Response formats' vocabulary (DECISIONS 89): built at the first prompt that asks.
        self.formats = StageFormats(tokenizer, self.stop_ids)
        self.threads = 0  # the engine's CPU threads (set by load)
        self.native_kernel = False  # its products on the native kernel's pool (load)
        # Its steps and KV slots in use, for the node's datastream (DECISIONS 93).
        self.steps = StepStats(provision.max_active_prompts)
        self.scheduler: Scheduler | None = None  # direct mode: the whole model here
        self._scheduler_lock = threading.Lock()
        self.link: StageLink | None = None
        self.driver: Driver | None = None
        self.group: EdgeGroup | None = None
        # Stage recovery (DECISIONS 68): the pipeline's epoch whose token endpoints are
        # connected; prompts whose pipeline was lost wait on this for the next one.
        self._pipeline = threading.Condition()
        self._ready_epoch = -1
        self._ready_driver: Driver | None = None  # that pipeline's driver
        self._closed = False
        # The token path's cores, shared by every node of this host (see affinity.py).
        engine = provision.engine
        self.placement = Placement(
            compute_set(engine.compute_cpus, many=provision.max_active_prompts > 1),
            engine.token_path_nice,
        )

    @classmethod
    def load(cls, provision: StageProvision, progress: LoadObserver | None = None) -> StageRuntime:
        started = time.perf_counter()
        settings = provision.engine
        # Nodes sharing a host share its cores (DECISIONS 20).
        host_nodes = max(int(os.environ.get("MVP_HOST_NODES", "1")), 1)
        opts = EngineOptions(
            device=settings.device,
            precision=settings.precision,
            fp16_split_points=tuple(settings.fp16_split_points),
        )
        native_kernel = uses_native_kernel(provision.model_path, opts)
        threads = settings.threads or default_threads(
            usable_cores(), host_nodes, cpu_quota(), native_kernel=native_kernel
        )
        opts = dataclasses.replace(opts, threads=threads)
        stage = load_stage(
            provision.model_path,
            provision.layers.start,
            provision.layers.end,
            opts,
            progress=progress,
        )
        tokenizer = Tokenizer.from_gguf(provision.tokenizer_path)
        runtime = cls(provision, stage, tokenizer, time.perf_counter() - started)
        runtime.threads = opts.threads or 0
        runtime.native_kernel = native_kernel
        return runtime

    def narrow_threads(self, n: int | None) -> Future[int] | None:
        """The native kernel's products on ``n`` threads from now on, or (None) on the
        stage's own ``threads`` again: an early start on a host it shares with the
        control plane leaves it a core (DECISIONS 104). Asked of THREAD_CHANGES, so the
        caller (the node's event loop) never waits for the product running now; the
        future is the count then in effect. None where the stage runs no native kernel
        (nothing changes)."""
        if not self.native_kernel or self.threads <= 0:
            return None
        count = self.threads if n is None else max(1, min(n, self.threads))
        return THREAD_CHANGES.submit(native.set_threads, count)

    def edges(self) -> list[Edge]:
        """The data-plane edges of the stage's pipeline now (none in direct mode)."""
        group = self.group
        return [] if group is None else group.edges()

    @property
    def stop_ids(self) -> set[int]:
        ids = set(self.tokenizer.eog_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def attach_pipeline(
        self,
        server: DataPlaneServer,
        *,
        edge_token: str,
        connect_timeout_s: float,
        on_stage_ready: Callable[[], None],
        on_endpoints_ready: Callable[[], None],
        on_fault: Callable[[str], None],
    ) -> None:
        """Join the data plane: expect the inbound edge, connect the outbound one."""
        self.placement.confine_others()  # before the token-path threads start
        prov = self.provision
        epoch = prov.epoch

        def endpoints_ready() -> None:
            with self._pipeline:
                if epoch > self._ready_epoch:
                    self._ready_epoch, self._ready_driver = epoch, driver
                self._pipeline.notify_all()
            on_endpoints_ready()

        if (
            prov.inbound_edge is None
            or prov.outbound_edge is None
            or prov.consumer_endpoint is None
        ):
            self._direct_scheduler()
            on_stage_ready()  # direct mode: no edges to wait for
            return
        self.group = EdgeGroup(f"stage{prov.stage_index}")
        endpoint = prov.consumer_endpoint
        self.link = StageLink(
            self.stage,
            server=server,
            group=self.group,
            inbound=EdgeSpec.from_plan(prov.inbound_edge),
            outbound=EdgeSpec.from_plan(prov.outbound_edge),
            consumer=Endpoint(endpoint.host, endpoint.port),
            token=edge_token,
            max_seq_len=prov.max_seq_len,
            stop_ids=self.stop_ids,
            connect_timeout_s=connect_timeout_s,
            on_ready=on_stage_ready,
            on_fault=on_fault,
            slots=prov.max_active_prompts,
            depth=prov.stage_count,
            sequence_skew=1 if FaultInjection.from_env().skew_token_out_sequence else 0,
            placement=self.placement,
            forward_timer=telemetry.current().forward_timer(prov.stage_index),
            formats=self.formats if self.stage.is_last else None,
            step_stats=self.steps,
        )
        if prov.driver_edges:
            token_in = next(e for e in prov.driver_edges if e.kind is EdgeKind.TOKEN_IN)
            token_out = next(e for e in prov.driver_edges if e.kind is EdgeKind.TOKEN_OUT)
            self.driver = driver = Driver(
                server=server,
                group=self.group,
                token_in=EdgeSpec.from_plan(token_in),
                token_out=EdgeSpec.from_plan(token_out),
                token=edge_token,
                connect_timeout_s=connect_timeout_s,
                record_timeout_s=RECORD_TIMEOUT_S,
                on_ready=endpoints_ready,
                on_fault=on_fault,
                slots=prov.max_active_prompts,
            )
        self.link.start()
        if self.driver is not None:
            self.driver.start()

    def detach_pipeline(self) -> None:
        """Leave the pipeline (its edges close; a new one is wired next: stage recovery).
        The weights stay; prompts the head drives wait for the next pipeline."""
        link, group = self.link, self.group
        self.link = self.driver = self.group = None
        if link is not None:
            link.close_soon()
        if group is not None:
            group.fail(EdgeClosed(f"stage {self.provision.stage_index}: pipeline replaced"))
            group.close()
        if link is not None and not link.close(DETACH_WAIT_S):
            raise RuntimeError(
                f"stage {self.provision.stage_index}: its step in flight did not end within "
                f"{DETACH_WAIT_S:g} s; the stage cannot join a new pipeline"
            )

    def rewire(
        self,
        provision: StageProvision,
        server: DataPlaneServer,
        **attach: Any,
    ) -> None:
        """Join pipeline ``provision.epoch`` with the layers already loaded."""
        old = self.provision
        if (
            provision.layers != old.layers
            or provision.model_path != old.model_path
            or provision.max_seq_len != old.max_seq_len
            or provision.max_active_prompts != old.max_active_prompts
        ):
            raise ValueError(
                f"pipeline {provision.epoch} asks stage {old.stage_index} for other layers or "
                f"another model than it holds (layers [{old.layers.start},{old.layers.end}))"
            )
        self.detach_pipeline()
        self.provision = provision
        self.attach_pipeline(server, **attach)

    def encode(self, prompt: SubmitPrompt) -> list[int]:
        """The prompt's token ids (a chat prompt rendered with the model's template first);
        a prompt this node cannot serve raises PromptRefused of its kind."""
        text = prompt.prompt_text
        if prompt.chat:
            if not self.tokenizer.has_chat_template:
                raise ChatTemplateRefused("chat requested but the model has no chat template")
            conversation = (
                [{"role": m.role, "content": m.content} for m in prompt.messages]
                if prompt.messages
                else [{"role": "user", "content": text}]
            )
            try:
                text = self.tokenizer.apply_chat_template(conversation)
            except TokenizerError as err:
                raise ChatTemplateRefused(
                    f"the model's chat template refused the messages: {err}"
                ) from None
            ids = self.tokenizer.encode(text, add_special=True, parse_special=True)
        else:
            ids = self.tokenizer.encode(text, add_special=True, parse_special=False)
        if not ids:
            raise PromptRefused("the prompt encodes to no tokens", prompt_tokens=0)
        limit = self.provision.max_seq_len
        if len(ids) >= limit:
            raise PromptTooLong(
                f"prompt has {len(ids)} tokens; the planned context holds {limit} "
                f"(prompt plus at least one generated token)",
                prompt_tokens=len(ids),
            )
        return ids

    def run(
        self,
        prompt: SubmitPrompt,
        max_new_tokens: int | None,
        on_text: Callable[[str, int], None],
        should_stop: Callable[[], bool],
        on_encoded: Callable[[int], None] | None = None,
        resume: Sequence[int] = (),
        text_from: int | None = None,
        generated: list[int] | None = None,
        logprobs: list[TokenLogprob | None] | None = None,
        on_cached: Callable[[int], None] | None = None,
    ) -> GenerationResult:
        """Generate in this thread (in-process, or over the pipeline when this node is the
        head of one); ``on_encoded`` gets the prompt's token count once it is encoded,
        ``on_text`` each complete piece of text with the count of tokens generated so far.

        ``resume``: the tokens this prompt generated before, elsewhere (stage recovery):
        the generation goes on after them with the tokens an undisturbed run gives, their
        text is the result's but goes to ``on_text`` no more (its reader has it).
        ``text_from``: the generated tokens whose text the reader has (None: the resumed
        ones): the text of every token after them goes to ``on_text``, resumed or new.
        ``generated``: a list the generated tokens are appended to as they come;
        ``logprobs``: one for their logprobs, where the prompt asks for them (an entry
        per generated token, None for a resumed one). ``on_cached`` gets, before the first
        token's text, how many of the prompt's tokens the head stage took from its prefix
        cache (DECISIONS 91)."""
        started = time.perf_counter()
        ids = self.encode(prompt)
        encoded = time.perf_counter()
        if on_encoded is not None:
            on_encoded(len(ids))
        text = Detokenizer(
            self.tokenizer,
            on_text,
            len(resume) if text_from is None else text_from,
            generated,
            logprobs if prompt.logprobs else None,
        )
        text.prime(resume)
        recoveries = 0
        cached: list[int] = []

        def note_cached(n: int) -> None:
            cached.append(n)
            if on_cached is not None:
                on_cached(n)

        if self.provision.driver_edges:
            with self.placement.applied():
                reason, recoveries = self._run_pipeline(
                    prompt, ids, max_new_tokens, text, should_stop, note_cached
                )
        else:  # the scheduler's thread runs on the token path's cores
            reason = self._run_direct(
                prompt, ids, max_new_tokens, text, should_stop, resume, note_cached
            )
        return GenerationResult(
            text=text.finish(),
            tokens=text.tokens,
            elapsed_ms=int((time.perf_counter() - started) * 1000),
            stop_reason=reason,
            prompt_tokens=len(ids),
            encoded_at=encoded,
            first_token_at=text.first_at,
            started_at=started,
            token_ids=text.ids,
            recoveries=recoveries,
            cached_tokens=cached[-1] if cached else 0,
        )

    def _run_direct(
        self,
        prompt: SubmitPrompt,
        ids: list[int],
        max_new_tokens: int | None,
        text: Detokenizer,
        should_stop: Callable[[], bool],
        resume: Sequence[int],
        on_cached: Callable[[int], None],
    ) -> str:
        """Generate beside the run's other active prompts (scheduler.py); returns why it
        stopped."""
        try:
            return self._direct_scheduler().run(
                ids,
                sampling_of(prompt),
                max_new_tokens=max_new_tokens,
                on_token=text.push,
                should_stop=should_stop,
                resume=resume,
                on_cached=on_cached,
            )
        except ContextOverflow as err:
            raise PromptTooLong(str(err), prompt_tokens=len(ids)) from None

    def _direct_scheduler(self) -> Scheduler:
        """The stage's scheduler (made once, on joining the run or at the first prompt)."""
        with self._scheduler_lock:
            if self.scheduler is None:
                prov = self.provision
                self.scheduler = Scheduler(
                    [self.stage],
                    slots=prov.max_active_prompts,
                    max_seq_len=prov.max_seq_len,
                    stop_ids=self.stop_ids,
                    placement=self.placement,
                    forward_timer=telemetry.current().forward_timer(prov.stage_index),
                    formats=self.formats,
                    step_stats=self.steps,
                )
            return self.scheduler

    def _run_pipeline(
        self,
        prompt: SubmitPrompt,
        ids: list[int],
        max_new_tokens: int | None,
        text: Detokenizer,
        should_stop: Callable[[], bool],
        on_cached: Callable[[int], None],
    ) -> tuple[str, int]:
        """The head's driver runs the token loop over the data plane (DECISIONS 19);
        returns why it stopped, and how many lost pipelines the prompt outlived.

        A run that replaces lost nodes (``recovery_wait_s``, DECISIONS 68) keeps the
        prompt when its pipeline is lost: it waits for the next one and goes on there
        with the tokens it has (re-fed, each checked), so its text is the undisturbed
        run's. A sampled prompt without a seed gets one here, for its resume to draw the
        same tokens."""
        sampling = sampling_of(prompt)
        wait_s = self.provision.recovery_wait_s
        if wait_s is not None and sampling.temperature > 0 and sampling.seed is None:
            sampling = dataclasses.replace(sampling, seed=secrets.randbits(63))
        recoveries = 0
        while True:
            with self._pipeline:
                driver, epoch = self._ready_driver, self._ready_epoch
            try:
                if driver is None:
                    raise EdgeError("the head's token endpoints are not connected")
                on_token = _telling_cached(self.link, prompt.request_id, on_cached, text.push)
                reason = driver.run(
                    prompt.request_id,
                    ids,
                    sampling,
                    max_new_tokens=max_new_tokens,
                    max_seq_len=self.provision.max_seq_len,
                    on_token=on_token,
                    should_stop=should_stop,
                    resume=list(text.ids),
                )
                return reason, recoveries
            except EdgeError:
                if wait_s is None or should_stop():
                    raise
                if not self._next_pipeline(epoch, wait_s, should_stop):
                    if should_stop():
                        return "cancelled", recoveries
                    raise
                recoveries += 1

    def _next_pipeline(self, epoch: int, wait_s: float, should_stop: Callable[[], bool]) -> bool:
        """Wait until a pipeline after ``epoch`` has its token endpoints connected: False
        when none came within ``wait_s``, the prompt was stopped, or the stage closed."""
        deadline = time.monotonic() + wait_s
        with self._pipeline:
            while self._ready_epoch <= epoch and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0 or should_stop():
                    return False
                self._pipeline.wait(min(left, 0.5))
            return not self._closed

    def close(self) -> None:
        with self._pipeline:
            self._closed = True
            self._pipeline.notify_all()
        if self.scheduler is not None:
            self.scheduler.close()
        if self.link is not None:
            self.link.close()
        if self.group is not None:
            self.group.close()
        self.stage.close()


def default_threads(
    cores: int, host_nodes: int, quota: float | None = None, *, native_kernel: bool = False
) -> int:
    """Nodes on one host share its cores (DECISIONS 20). On torch's kernels one core is
    left to the control plane (Temporal, the orchestrator worker, the node's own event
    loop): on 2 cores a 2-thread node decoded at about a third of a 1-thread node's speed,
    because its OpenMP threads stall behind those processes. The engine's own kernel
    (``native_kernel``) shares a product's rows by chunks that whichever thread runs
    takes, so the calling thread never waits on a preempted one: it takes every core
    (2 cores, SmolLM2, 8 streams at once: 131.7 tok/s against 90.0 on one thread). A node
    with a CPU quota of its own (a container's ``--cpus``, ``docker.cpus``) runs as many
    threads as the quota has whole CPUs: more would only be throttled."""
    if quota is not None:
        return max(1, min(cores, int(quota)))
    if native_kernel:
        return max(1, cores // host_nodes)
    return max(1, (cores - 1) // host_nodes) if cores > 1 else 1


def sampling_of(prompt: SubmitPrompt) -> SamplingParams:
    return SamplingParams(
        temperature=prompt.temperature,
        top_k=prompt.top_k,
        top_p=prompt.top_p,
        seed=prompt.seed,
        logprobs=prompt.logprobs,
        top_logprobs=prompt.top_logprobs,
        response_format=None if prompt.response_format is None else prompt.response_format.text(),
    )
