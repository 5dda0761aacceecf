"""A node's place in a pipeline: stage links and the head node's driver.

Threads with blocking sockets, next to the engine. A run's active prompts share the
pipeline (DECISIONS 62): each record belongs to one prompt (its object id is the
prompt's request id), a stage holds one KV cache slot per prompt in flight, and it runs
the records that have come in as one batch (one forward over all their rows, each row
computed as it is alone), then sends one record per prompt. A batch takes at most a
1/N share of the prompts in flight on an N-stage pipeline (the rest wait their turn), so
the prompts go round in N groups: while stage k works on one group's tokens, stage k+1
works on another's, and with N or more prompts active every stage is busy. Every edge of a node belongs to one EdgeGroup, so any error closes all of them
and the peers see EOF within milliseconds (DECISIONS 20).

Record conventions (CONTRACTS, DECISIONS 19):
- token-in BEGIN (sequence 0): sampling header + prompt token ids; then one fed-back
  token per record, sequences 1, 2, ...; ABORT (empty) frees the prompt's KV cache slot
  on every stage.
- activation BEGIN carries the same sampling header ahead of the rows (float32, or float16
  where the run asks for it: the edge's plan says which), so the last stage can sample;
  later records carry the rows only. Sequences mirror token-in.
- token-out: one u32 token with the sequence of the record it answers; the first of a
  prompt has BEGIN, the model's end-of-generation token has EOS. Where the prompt's
  sampling header has the logprobs flag, the token's f32 logprob and its top_logprobs
  (u32 id, f32 logprob) pairs follow it (DECISIONS 88).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from time import monotonic, perf_counter

import torch

from mvp_core.batch_plan import Capacity, Entry, Kind, plan_step
from mvp_core.generation import StopRule
from temporal.telemetry import ForwardTimer
from workers.node.affinity import Placement
from workers.node.dataplane import (
    FLAG_ABORT,
    FLAG_BEGIN,
    FLAG_EOS,
    DataPlaneServer,
    EdgeError,
    EdgeGroup,
    EdgeReceiver,
    EdgeSender,
    EdgeSpec,
    EdgeTimeout,
    RecordError,
    RecordHeader,
    SequenceChecker,
    connect_edge,
    decode_activation,
    decode_begin_payload,
    decode_sampling_header,
    decode_token_choice,
    decode_tokens,
    encode_activation,
    encode_begin_payload,
    encode_sampling_header,
    encode_token_choice,
    encode_tokens,
    sampling_header_size,
)
from workers.node.engine import Sampler, SamplingParams, Stage
from workers.node.engine.boundary import from_boundary, to_boundary
from workers.node.engine.formats import StageFormats
from workers.node.engine.prefix_cache import PrefixCache, ids_bytes, reuse_bounds
from workers.node.engine.sampling import TokenLogprobs, check_resume
from workers.node.engine.session import BatchSession, NoFreeSlot
from workers.node.nodestream import StepStats

log = logging.getLogger("mvp.pipeline")
IDLE_POLL_S = 1.0
RECORD_READ_S = 5.0  # the rest of a record whose first bytes have come
REUSED_KEPT = 1024  # prompts whose reused prefix length the first stage remembers


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int


class StageLink:
    """inbound edge -> this stage's layers -> outbound edge, served by one thread."""

    def __init__(
        self,
        stage: Stage,
        *,
        server: DataPlaneServer,
        group: EdgeGroup,
        inbound: EdgeSpec,
        outbound: EdgeSpec,
        consumer: Endpoint,
        token: str,
        max_seq_len: int,
        stop_ids: Collection[int],
        connect_timeout_s: float,
        on_ready: Callable[[], None],
        on_fault: Callable[[str], None],
        slots: int = 1,
        depth: int = 1,
        sequence_skew: int = 0,
        placement: Placement | None = None,
        forward_timer: ForwardTimer | None = None,
        formats: StageFormats | None = None,
        prefix_budget: int | None = None,
        step_stats: StepStats | None = None,
    ) -> None:
        self.stage = stage
        self.step_stats = step_stats  # the node's datastream: steps, KV slots (DECISIONS 93)
        self.formats = formats  # the last stage's vocabulary for response formats
        # The stage's prefix cache in bytes (None: the node's setting; 0: none), while
        # serving (its stats: what it holds and did; DECISIONS 91), and on the first
        # stage the prompt tokens each prompt's BEGIN took from it (by object id).
        self.prefix_budget = prefix_budget
        self.prefix: PrefixCache | None = None
        self.reused: OrderedDict[int, int] = OrderedDict()  # the latest REUSED_KEPT
        # The pipeline's stages: a step takes at most 1/depth of the prompts in flight,
        # so that the others are on the other stages meanwhile (every stage busy).
        self.depth = max(1, depth)
        self.largest_batch = 0  # the most prompts one step has run (a test reads it)
        self.forward_timer = forward_timer  # None: telemetry off, nothing per token
        self.placement = placement or Placement()  # token-path cores and priority
        self.sequence_skew = sequence_skew  # fault injection: break the token-out order
        self.group = group
        self.outbound_spec = outbound
        self.consumer = consumer
        self.token = token
        self.max_seq_len = max_seq_len
        self.slots = slots  # prompts in flight at once: one KV cache slot each
        self.stop_ids = frozenset(stop_ids)
        self.connect_timeout_s = connect_timeout_s
        self.on_ready = on_ready
        self.on_fault = on_fault
        self.hidden = stage.facts.embedding_length
        # The rows' element type on each activation edge, as the plan committed it.
        self.inbound_dtype = None if stage.is_first else inbound.activation()
        self.outbound_dtype = None if stage.is_last else outbound.activation()
        self._stop = threading.Event()
        # Expect the inbound edge now, so the upstream may connect as soon as it loads.
        self._inbound = server.expect(inbound, token)
        self._thread = threading.Thread(
            target=self._main, name=f"stage-{stage.layer_start}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def close_soon(self) -> None:
        """Stop without a fault report; its edges closing next end the thread."""
        self._stop.set()

    def close(self, timeout_s: float = 5.0) -> bool:
        """Stop, and wait up to ``timeout_s`` for the thread: False if it still runs."""
        self._stop.set()
        self._thread.join(timeout=timeout_s)
        return not self._thread.is_alive()

    def _main(self) -> None:
        self.placement.adopt()
        try:
            with self.group.guard():
                out = connect_edge(
                    self.consumer.host,
                    self.consumer.port,
                    self.outbound_spec,
                    self.token,
                    self.connect_timeout_s,
                )
                self.group.add(out)
                inbound = self._inbound.result(self.connect_timeout_s)
                self.group.add(inbound)
                self.on_ready()
                self._serve(inbound, out)
        except BaseException as err:
            if not self._stop.is_set():
                log.error(
                    "stage [%d,%d) failed: %s", self.stage.layer_start, self.stage.layer_end, err
                )
                first = self.group.first_error or err  # the cause, not "closed locally"
                self.on_fault(f"{type(first).__name__}: {first}")

    def _serve(self, inbound: EdgeReceiver, out: EdgeSender) -> None:
        session = self.stage.new_batch_session(
            self.slots,
            self.max_seq_len,
            prefix_budget=self.prefix_budget,
            keep_rows=not self.stage.is_last,
        )
        self.prefix = session.prefix
        flows: dict[int, _Flow] = {}  # object id -> the prompt's slot, header, sampler
        backlog: deque[tuple[RecordHeader, bytearray]] = deque()  # come in, not yet run
        try:
            while not self._stop.is_set():
                if not backlog:
                    try:
                        backlog.append(inbound.recv(IDLE_POLL_S))
                    except EdgeTimeout as idle:
                        if idle.partial:
                            raise
                        continue
                while len(backlog) < 4 * self.slots and inbound.ready():
                    backlog.append(inbound.recv(RECORD_READ_S))
                # A step runs one record per prompt, of at most a 1/depth share of the
                # prompts in flight: the rest run on the other stages meanwhile.
                plan = plan_step(
                    [Entry(hdr.object_id, _kind(hdr)) for hdr, _ in backlog],
                    Capacity(depth=self.depth),
                    in_flight=flows.keys(),
                )
                batch: list[_Work] = []
                for _ in range(plan.taken):
                    hdr, payload = backlog.popleft()
                    if hdr.abort:
                        flow = flows.pop(hdr.object_id, None)
                        if flow is not None:
                            session.release(flow.slot)
                        if not self.stage.is_last:
                            out.send(hdr.object_id, hdr.sequence, b"", FLAG_ABORT)
                        continue
                    batch.append(self._work(session, flows, hdr, payload))
                if batch:
                    self._step(session, batch, out)
                if self.step_stats is not None:
                    self.step_stats.slots_in_use = len(flows)
        finally:
            if self.step_stats is not None:
                self.step_stats.slots_in_use = 0
            if self.prefix is not None:
                log.info("stage [%d,%d) prefix cache: %s", self.stage.layer_start,
                         self.stage.layer_end, self.prefix.stats)  # fmt: skip
            session.close()

    def _work(
        self,
        session: BatchSession,
        flows: dict[int, _Flow],
        hdr: RecordHeader,
        payload: bytearray,
    ) -> _Work:
        """One record's rows, and its prompt's state (a BEGIN takes a KV cache slot)."""
        stage = self.stage
        if hdr.begin:
            old = flows.pop(hdr.object_id, None)
            if old is not None:
                session.release(old.slot)
            try:
                slot = session.acquire()
            except NoFreeSlot:
                raise RuntimeError(
                    f"stage [{stage.layer_start},{stage.layer_end}): prompt {hdr.object_id} "
                    f"begins while all {self.slots} KV cache slots hold a prompt"
                ) from None
            flows[hdr.object_id] = _Flow(slot)
        flow = flows.get(hdr.object_id)
        if flow is None:
            raise RuntimeError(f"record for prompt {hdr.object_id} before its BEGIN record")
        rows: Sequence[int] | torch.Tensor
        keys: bytes | memoryview = b""  # what the prefix cache keys a BEGIN's rows by
        width = 0
        if stage.is_first:
            if hdr.begin:
                wire, rows = decode_begin_payload(payload)
                flow.header = encode_sampling_header(wire)
                keys, width = ids_bytes(rows), 4
            else:
                rows = decode_tokens(payload)
        else:
            body = memoryview(payload)
            if hdr.begin:
                size = sampling_header_size(body)
                flow.header = bytes(body[:size])
                body = body[size:]
            assert self.inbound_dtype is not None
            act = decode_activation(body, self.hidden, self.inbound_dtype)
            rows = from_boundary(stage, torch.from_numpy(act))
            keys, width = body, self.hidden * self.inbound_dtype.itemsize
        if stage.is_last and hdr.begin:
            flow.sampler = Sampler(decode_sampling_header(flow.header), formats=self.formats)
        work = _Work(hdr.object_id, hdr.sequence, hdr.begin, flow, rows)
        if hdr.begin and session.prefix is not None:
            self._reuse(session, work, keys, width)
        return work

    def _reuse(self, session: BatchSession, w: _Work, keys: bytes | memoryview, width: int) -> None:
        """A prompt's BEGIN starts at the longest prefix of its rows that this stage's
        prefix cache holds (keyed by what it receives: the token ids on the first stage,
        the rows on a later one; the prompt goes in as one chunk) and computes the rest
        (DECISIONS 91). Each stage decides alone: rows for every position travel on, so
        a stage without the prefix (a replacement, an eviction) computes it all."""
        assert session.prefix is not None
        n = len(w.rows)
        limit, _, upto = reuse_bounds(n, None)
        digests = session.prefix.chain(keys, width)
        w.keep = _Keep(digests, keys, width, upto)
        length = session.prefix.match(digests, keys, width, limit)
        if self.stage.is_first:
            self.reused[w.object_id] = length
            while len(self.reused) > REUSED_KEPT:
                self.reused.popitem(last=False)
        if length:
            w.keep.head = session.load_prefix(w.flow.slot, digests, length)
            if session.keep_rows and w.keep.head is None:
                raise RuntimeError("prefix cache: a reused prefix without its output rows")
            w.rows = w.rows[length:]

    def _step(self, session: BatchSession, batch: list[_Work], out: EdgeSender) -> None:
        """One forward over the batch's rows; one record out per prompt."""
        stage, timer, stats = self.stage, self.forward_timer, self.step_stats
        self.largest_batch = max(self.largest_batch, len(batch))
        prefill = any(w.begin for w in batch)
        sampled = timer is not None and timer.wants(prefill)
        t0 = perf_counter() if sampled or stats is not None else 0.0
        result = session.forward([(w.flow.slot, w.rows) for w in batch])
        if sampled or stats is not None:
            took = perf_counter() - t0
            if sampled:
                assert timer is not None
                timer.record(took, prefill)
            if stats is not None:
                stats.record(took, prefill, len(batch))
        for w in batch:
            got = result[w.flow.slot]
            if w.keep is not None:  # a prompt's rows: the prefix cache keeps its blocks
                keep = w.keep
                if keep.head is not None and not stage.is_last:
                    got = torch.cat([keep.head, got])  # the next stage gets every row
                rows = None if stage.is_last else got
                session.store_prefix(
                    w.flow.slot, keep.digests, keep.keys, keep.width, keep.upto, rows
                )
            if stage.is_last:
                if w.flow.sampler is None:
                    raise RuntimeError(f"token record for prompt {w.object_id} before its BEGIN")
                token, logprobs = w.flow.sampler.choose(got)
                flags = (FLAG_BEGIN if w.begin else 0) | (FLAG_EOS if token in self.stop_ids else 0)
                seq = w.sequence + (self.sequence_skew if w.sequence else 0)
                out.send(w.object_id, seq, encode_token_choice(token, logprobs), flags)
            else:
                assert self.outbound_dtype is not None
                act = encode_activation(to_boundary(stage, got, self.outbound_dtype).numpy())
                if w.begin:
                    out.send(w.object_id, w.sequence, w.flow.header + bytes(act), FLAG_BEGIN)
                else:
                    out.send(w.object_id, w.sequence, act)


def _kind(hdr: RecordHeader) -> Kind:
    """What a record asks of the stage's batching (batch_plan.py)."""
    if hdr.abort:
        return Kind.ABORT
    return Kind.BEGIN if hdr.begin else Kind.NEXT


@dataclass
class _Flow:
    """A prompt on a stage: its KV cache slot, its sampling header (ahead of its first
    activation rows) and, on the last stage, its sampler."""

    slot: int
    header: bytes = b""
    sampler: Sampler | None = None


@dataclass
class _Keep:
    """A prompt's keys for the prefix cache (``width`` bytes a position, their block
    digests), the positions it may store, and the output rows of its reused prefix."""

    digests: list[bytes]
    keys: bytes | memoryview
    width: int
    upto: int
    head: torch.Tensor | None = None


@dataclass
class _Work:
    object_id: int
    sequence: int
    begin: bool
    flow: _Flow
    rows: Sequence[int] | torch.Tensor
    keep: _Keep | None = None


class ResumeDiverged(RuntimeError):
    """A resumed prompt's pipeline did not give back a token it had generated before."""


class Driver:
    """The head node's token endpoints: sends token-in, consumes token-out in order.

    Several prompts run at once (up to ``slots``): each ``run`` sends its own records
    (object id: its request id) and waits for its own token-out records, which a reader
    thread hands to it; the sequence rule holds per prompt."""

    def __init__(
        self,
        *,
        server: DataPlaneServer,
        group: EdgeGroup,
        token_in: EdgeSpec,
        token_out: EdgeSpec,
        token: str,
        connect_timeout_s: float,
        record_timeout_s: float,
        on_ready: Callable[[], None],
        on_fault: Callable[[str], None],
        slots: int = 1,
    ) -> None:
        self.server = server
        self.group = group
        self.token_in_spec = token_in
        self.token = token
        self.connect_timeout_s = connect_timeout_s
        self.record_timeout_s = record_timeout_s
        self.on_ready = on_ready
        self.on_fault = on_fault
        # The sequence rule is checked here, with the contract's words, not by the edge.
        self._token_out = server.expect(token_out, token, check_order=False)
        self._tin: EdgeSender | None = None
        self._tout: EdgeReceiver | None = None
        self._slots = threading.BoundedSemaphore(slots)  # a KV cache slot per prompt
        self._send_lock = threading.Lock()
        self._waiting: dict[int, queue.SimpleQueue[_Answer]] = {}
        self._waiting_lock = threading.Lock()
        self._thread = threading.Thread(target=self._connect, name="driver", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _connect(self) -> None:
        try:
            with self.group.guard():
                self._tin = connect_edge(
                    self.server.host,
                    self.server.port,
                    self.token_in_spec,
                    self.token,
                    self.connect_timeout_s,
                )
                self.group.add(self._tin)
                self._tout = self._token_out.result(self.connect_timeout_s)
                self.group.add(self._tout)
        except BaseException as err:
            self.on_fault(f"token endpoints: {type(err).__name__}: {err}")
            return
        threading.Thread(
            target=self._read, args=(self._tout,), name="driver-token-out", daemon=True
        ).start()
        self.on_ready()

    def _read(self, tout: EdgeReceiver) -> None:
        """Hand each token-out record to the prompt waiting for it; on a data-plane error
        every waiting prompt gets it."""
        try:
            with self.group.guard():
                while not self.group.failed:
                    try:
                        hdr, payload = tout.recv(IDLE_POLL_S)
                    except EdgeTimeout as idle:
                        if idle.partial:
                            raise
                        continue
                    with self._waiting_lock:
                        waiting = self._waiting.get(hdr.object_id)
                    if waiting is None:
                        raise RuntimeError(
                            f"token-out record for object {hdr.object_id}, which no prompt "
                            "is waiting for"
                        )
                    waiting.put((hdr, payload))
        except BaseException as err:
            first = self.group.first_error or err
            with self._waiting_lock:
                for waiting in self._waiting.values():
                    waiting.put(first)

    def _send(self, object_id: int, sequence: int, payload: bytes, flags: int = 0) -> None:
        tin = self._tin
        if tin is None:
            raise RuntimeError("token endpoints are not connected")
        with self._send_lock:
            tin.send(object_id, sequence, payload, flags)

    def run(
        self,
        request_id: int,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        max_new_tokens: int | None,
        max_seq_len: int,
        on_token: Callable[[int, TokenLogprobs | None], None],
        should_stop: Callable[[], bool],
        resume: Sequence[int] = (),
    ) -> str:
        """Drive one prompt through the pipeline beside the others; returns why it
        stopped. ``on_token`` gets each token and, where ``sampling`` asks for them, its
        logprobs (the last stage's, on its token-out record).

        ``resume``: the tokens the prompt already generated on an earlier pipeline (stage
        recovery). They are fed back as they were the first time, one record each, so
        every stage computes the rows it computed then, and each answer must be the
        recorded token again (a seeded sampler draws as a function of seed and index):
        ResumeDiverged where one is not. They count toward ``max_new_tokens`` and do not
        go to ``on_token``: only the tokens after them do."""
        if self._tin is None or self._tout is None:
            raise RuntimeError("token endpoints are not connected")
        check_resume(len(resume), sampling, max_new_tokens)
        if max_new_tokens is not None and len(resume) == max_new_tokens:
            return "max_tokens"  # it had all it asked for
        wire = dataclasses.replace(
            sampling, request_id=request_id, max_new_tokens=max_new_tokens or 0
        )
        answers: queue.SimpleQueue[_Answer] = queue.SimpleQueue()
        with self._slots:
            with self._waiting_lock:
                if request_id in self._waiting:
                    raise RuntimeError(f"request {request_id} is already on the data plane")
                self._waiting[request_id] = answers
            seq = 0
            try:
                with self.group.guard():
                    self.group.raise_if_failed()
                    self._send(request_id, seq, encode_begin_payload(wire, prompt_ids), FLAG_BEGIN)
                    checker = SequenceChecker()
                    # EOS arrives as the record's flag, so the rule itself needs no stop ids.
                    rule = StopRule(
                        max_new_tokens=max_new_tokens, stop_ids=(), max_seq_len=max_seq_len
                    )
                    while True:
                        hdr, payload = self._answer(answers, request_id)
                        checker.check(hdr.sequence)
                        token, logprobs = decode_token_choice(payload, sampling.top_logprobs)
                        if (logprobs is None) is sampling.logprobs:
                            raise RecordError(
                                f"token-out record for request {request_id} "
                                f"{'lacks' if sampling.logprobs else 'has'} logprobs"
                            )
                        if seq < len(resume):
                            if hdr.eos or token != resume[seq]:
                                break  # this prompt's fault, not the pipeline's: below
                        elif hdr.eos:
                            return "eos"
                        else:
                            on_token(token, logprobs)
                        rule.accept(token, len(prompt_ids) + rule.generated + 1)
                        if rule.reason is not None:
                            return rule.reason
                        if should_stop():
                            return "cancelled"
                        seq += 1
                        self._send(request_id, seq, encode_tokens([token]))
                got = "the end of generation" if hdr.eos else f"token {token}"
                raise ResumeDiverged(
                    f"request {request_id} resumed: the pipeline gave {got} where the first "
                    f"run gave token {resume[seq]} (generated token {seq + 1} of the "
                    f"{len(resume)} resumed)"
                )
            finally:
                with self._waiting_lock:
                    self._waiting.pop(request_id, None)
                if not self.group.failed:
                    # Free the prompt's KV cache slot on every stage (DECISIONS 19). Its
                    # token-out record answered, none of its records is in flight.
                    self._send(request_id, seq + 1, b"", FLAG_ABORT)

    def _answer(self, answers: queue.SimpleQueue[_Answer], request_id: int) -> _Record:
        deadline = monotonic() + self.record_timeout_s
        while True:
            try:
                got = answers.get(timeout=min(IDLE_POLL_S, max(deadline - monotonic(), 0.0)))
                break
            except queue.Empty:
                self.group.raise_if_failed()  # the reader may have ended before we waited
                if monotonic() >= deadline:
                    raise EdgeTimeout(
                        f"no token-out record for request {request_id} within "
                        f"{self.record_timeout_s:g} s"
                    ) from None
        if isinstance(got, BaseException):
            raise EdgeError(f"data plane failed: {got}")
        return got


_Record = tuple[RecordHeader, bytearray]
_Answer = _Record | BaseException
