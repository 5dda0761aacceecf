"""A node's place in a pipeline: stage links and the head node's driver.

Threads with blocking sockets, next to the engine: per token, a stage receives one record,
runs its layers and sends one record. Every edge of a node belongs to one EdgeGroup, so
any error closes all of them and the peers see EOF within milliseconds (DECISIONS 20).

Record conventions (CONTRACTS, DECISIONS 19):
- token-in BEGIN (sequence 0): sampling header + prompt token ids; then one fed-back
  token per record, sequences 1, 2, ...; ABORT (empty) resets every stage's KV state.
- activation BEGIN carries the same sampling header ahead of the rows (float32, or float16
  where the run asks for it: the edge's plan says which), so the last stage can sample;
  later records carry the rows only. Sequences mirror token-in.
- token-out: one u32 token with the sequence of the record it answers; the first of a
  prompt has BEGIN, the model's end-of-generation token has EOS.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from time import perf_counter

import torch

from mvp_core.generation import StopRule
from temporal.telemetry import ForwardTimer
from workers.node.affinity import Placement
from workers.node.dataplane import (
    FLAG_ABORT,
    FLAG_BEGIN,
    FLAG_EOS,
    SAMPLING_HEADER_LEN,
    DataPlaneServer,
    EdgeGroup,
    EdgeReceiver,
    EdgeSender,
    EdgeSpec,
    EdgeTimeout,
    SequenceChecker,
    connect_edge,
    decode_activation,
    decode_begin_payload,
    decode_sampling_header,
    decode_token_out,
    decode_tokens,
    encode_activation,
    encode_begin_payload,
    encode_sampling_header,
    encode_tokens,
)
from workers.node.dataplane import SamplingParams as WireSampling
from workers.node.engine import Sampler, SamplingParams, Stage
from workers.node.engine.boundary import from_boundary, to_boundary

log = logging.getLogger("mvp.pipeline")
IDLE_POLL_S = 1.0


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
        sequence_skew: int = 0,
        placement: Placement | None = None,
        forward_timer: ForwardTimer | None = None,
    ) -> None:
        self.stage = stage
        self.forward_timer = forward_timer  # None: telemetry off, nothing per token
        self.placement = placement or Placement()  # token-path cores and priority
        self.sequence_skew = sequence_skew  # fault injection: break the token-out order
        self.group = group
        self.outbound_spec = outbound
        self.consumer = consumer
        self.token = token
        self.max_seq_len = max_seq_len
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

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

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
        stage = self.stage
        session = stage.new_session(self.max_seq_len)
        sampler: Sampler | None = None
        header = b""
        timer = self.forward_timer
        try:
            while not self._stop.is_set():
                try:
                    hdr, payload = inbound.recv(IDLE_POLL_S)
                except EdgeTimeout as idle:
                    if idle.partial:
                        raise
                    continue
                if hdr.abort:
                    session.reset()
                    if not stage.is_last:
                        out.send(hdr.object_id, hdr.sequence, b"", FLAG_ABORT)
                    continue
                if hdr.begin:
                    session.reset()
                t0 = perf_counter() if timer is not None and timer.wants(hdr.begin) else None
                if stage.is_first:
                    if hdr.begin:
                        wire, ids = decode_begin_payload(payload)
                        header = encode_sampling_header(wire)
                    else:
                        ids = decode_tokens(payload)
                    result = session.forward_tokens(ids)
                else:
                    body = memoryview(payload)
                    if hdr.begin:
                        header = bytes(body[:SAMPLING_HEADER_LEN])
                        wire = decode_sampling_header(header)
                        body = body[SAMPLING_HEADER_LEN:]
                    assert self.inbound_dtype is not None
                    rows = decode_activation(body, self.hidden, self.inbound_dtype)
                    result = session.forward_hidden(from_boundary(stage, torch.from_numpy(rows)))
                if t0 is not None:
                    assert timer is not None
                    timer.record(perf_counter() - t0, hdr.begin)
                if stage.is_last:
                    if hdr.begin:
                        sampler = Sampler(_engine_sampling(decode_sampling_header(header)))
                    if sampler is None:
                        raise RuntimeError("token record before the prompt's BEGIN record")
                    token = sampler.sample(result)
                    flags = (FLAG_BEGIN if hdr.begin else 0) | (
                        FLAG_EOS if token in self.stop_ids else 0
                    )
                    seq = hdr.sequence + (self.sequence_skew if hdr.sequence else 0)
                    out.send(hdr.object_id, seq, encode_tokens([token]), flags)
                else:
                    assert self.outbound_dtype is not None
                    act = encode_activation(to_boundary(stage, result, self.outbound_dtype).numpy())
                    if hdr.begin:
                        out.send(hdr.object_id, hdr.sequence, header + bytes(act), FLAG_BEGIN)
                    else:
                        out.send(hdr.object_id, hdr.sequence, act)
        finally:
            session.close()


def _engine_sampling(wire: WireSampling) -> SamplingParams:
    return SamplingParams(
        temperature=wire.temperature, top_k=wire.top_k, top_p=wire.top_p, seed=wire.seed
    )


class Driver:
    """The head node's token endpoints: sends token-in, consumes token-out in order."""

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
        self.lock = threading.Lock()  # one prompt at a time on the data plane
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
            self.on_ready()
        except BaseException as err:
            self.on_fault(f"token endpoints: {type(err).__name__}: {err}")

    def run(
        self,
        request_id: int,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        max_new_tokens: int | None,
        max_seq_len: int,
        on_token: Callable[[int], None],
        should_stop: Callable[[], bool],
    ) -> str:
        """Drive one prompt through the pipeline; returns why it stopped."""
        tin, tout = self._tin, self._tout
        if tin is None or tout is None:
            raise RuntimeError("token endpoints are not connected")
        wire = WireSampling(
            request_id=request_id,
            max_new_tokens=max_new_tokens or 0,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            seed=sampling.seed,
        )
        with self.lock, self.group.guard():
            seq = 0
            tin.send(request_id, seq, encode_begin_payload(wire, prompt_ids), FLAG_BEGIN)
            checker = SequenceChecker()
            # EOS arrives as the record's flag, so the rule itself needs no stop ids.
            rule = StopRule(max_new_tokens=max_new_tokens, stop_ids=(), max_seq_len=max_seq_len)
            try:
                while True:
                    hdr, payload = tout.recv(self.record_timeout_s)
                    checker.check(hdr.sequence)
                    if hdr.object_id != request_id:
                        raise RuntimeError(
                            f"token-out record for object {hdr.object_id} while "
                            f"request {request_id} is active"
                        )
                    token = decode_token_out(payload)
                    if hdr.eos:
                        return "eos"
                    on_token(token)
                    rule.accept(token, len(prompt_ids) + rule.generated + 1)
                    if rule.reason is not None:
                        return rule.reason
                    if should_stop():
                        return "cancelled"
                    seq += 1
                    tin.send(request_id, seq, encode_tokens([token]))
            finally:
                if not self.group.failed:
                    # Free every stage's KV state for the request (DECISIONS 19).
                    tin.send(request_id, seq + 1, b"", FLAG_ABORT)
