"""Pipeline edge records: the 40-byte header of CONTRACTS.md and the payload codecs.

Activations travel as float32 rows by default, float16 where a run asks for it
(DECISIONS 53).

Pure stdlib + numpy so that the node's edge threads never import torch. Every decoder
validates eagerly and raises `RecordError` with the offending values: a bad record is a
run fault (DECISIONS 14), and the operator needs to see exactly what arrived.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from mvp_core.constrain import MAX_FORMAT_BYTES
from mvp_core.generation import TokenFeedback, TokenSequenceViolation
from mvp_core.models import MAX_TOP_LOGPROBS, ActivationDtype, EdgeKind

__all__ = [
    "FLAG_ABORT",
    "FLAG_BEGIN",
    "FLAG_EOS",
    "FORMAT_BLOCK_MAX",
    "HEADER_LEN",
    "KNOWN_FLAGS",
    "MAGIC",
    "SAMPLING_HEADER_BYTES",
    "SAMPLING_HEADER_LEN",
    "VERSION",
    "EdgeSpec",
    "RecordError",
    "RecordHeader",
    "RecordOrder",
    "SamplingParams",
    "SequenceChecker",
    "TokenLogprobs",
    "TokenSequenceError",
    "activation_max_extent",
    "activation_spec",
    "decode_activation",
    "decode_begin_payload",
    "decode_header",
    "decode_sampling_header",
    "decode_token_choice",
    "decode_token_out",
    "decode_tokens",
    "encode_activation",
    "encode_begin_payload",
    "encode_header",
    "encode_sampling_header",
    "encode_token_choice",
    "encode_tokens",
    "pipeline_edge_specs",
    "sampling_header_size",
    "token_in_max_extent",
    "token_in_spec",
    "token_out_max_extent",
    "token_out_spec",
]

MAGIC = b"MO01"
VERSION = 1
HEADER_LEN = 40

FLAG_EOS = 1
"""End of sequence: on token-out, the token is the model's EOS token."""
FLAG_BEGIN = 2
"""Begin sequence: the first record of a prompt; the per-object sequence restarts at 0."""
FLAG_ABORT = 4
"""Extension (DECISIONS 19): every stage drops its KV state for the request."""
KNOWN_FLAGS = FLAG_EOS | FLAG_BEGIN | FLAG_ABORT

_HEADER = struct.Struct("<4sHHQQQII")
assert _HEADER.size == HEADER_LEN

_U32_MAX = 0xFFFF_FFFF
_U64_MAX = 0xFFFF_FFFF_FFFF_FFFF

TOKEN_ALIGNMENT = 4
# The rows' little-endian numpy type per wire format (DECISIONS 53: float32 by default).
_ROW_TYPE: dict[ActivationDtype, str] = {
    ActivationDtype.FLOAT32: "<f4",
    ActivationDtype.FLOAT16: "<f2",
}


class RecordError(ValueError):
    """A record (header or payload) that breaks the edge contract; fatal for the edge."""


class TokenSequenceError(RecordError):
    """A token-out record whose sequence differs from the driver's expectation."""


class _EdgePlanLike(Protocol):
    @property
    def edge_id(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def max_extent(self) -> int: ...
    @property
    def alignment(self) -> int: ...
    @property
    def activation_dtype(self) -> ActivationDtype | None: ...


@dataclass(frozen=True, slots=True)
class EdgeSpec:
    """What an edge may carry; both ends derive it from the run plan. ``dtype`` is the
    element type of an activation edge's rows (None: token edges, or a spec that checks
    headers only)."""

    edge_id: int
    kind: EdgeKind
    max_extent: int
    alignment: int
    dtype: ActivationDtype | None = None

    @classmethod
    def from_plan(cls, plan: _EdgePlanLike) -> EdgeSpec:
        """From an `mvp_core.models.EdgePlan` (duck-typed)."""
        kind = EdgeKind(plan.kind)
        dtype = plan.activation_dtype
        if kind is EdgeKind.ACTIVATION and dtype is None and plan.alignment == 2:
            dtype = ActivationDtype.FLOAT16  # a plan committed before the field: float16
        extent = plan.max_extent
        if kind is EdgeKind.TOKEN_OUT:
            # A plan committed before logprobs sized token-out for the token alone (4).
            extent = max(extent, token_out_max_extent(0))
        else:
            # A begin record's sampling header may carry a response format (DECISIONS
            # 89): the plan sizes the rows and the 40-byte header, both ends add this.
            extent += FORMAT_BLOCK_MAX
        return cls(plan.edge_id, kind, extent, plan.alignment, dtype)

    def __post_init__(self) -> None:
        if not 0 < self.edge_id <= _U32_MAX:
            raise ValueError(f"edge id must be in 1..{_U32_MAX}, got {self.edge_id}")
        if self.alignment <= 0:
            raise ValueError(f"edge {self.edge_id}: alignment must be > 0, got {self.alignment}")
        if self.max_extent < 0 or self.max_extent % self.alignment:
            raise ValueError(
                f"edge {self.edge_id}: max extent {self.max_extent} must be >= 0 and a "
                f"multiple of alignment {self.alignment}"
            )
        if self.dtype is not None:
            if self.kind is not EdgeKind.ACTIVATION:
                raise ValueError(
                    f"edge {self.edge_id}: a {self.kind.value} edge carries tokens, not "
                    f"{self.dtype.value} activations"
                )
            if self.alignment != self.dtype.itemsize:
                raise ValueError(
                    f"edge {self.edge_id}: {self.dtype.value} activations need alignment "
                    f"{self.dtype.itemsize}, got {self.alignment}"
                )

    def activation(self) -> ActivationDtype:
        """The rows' element type; ValueError unless this is an activation edge with one."""
        if self.kind is not EdgeKind.ACTIVATION or self.dtype is None:
            raise ValueError(
                f"edge {self.edge_id} ({self.kind.value}) has no activation dtype in its plan"
            )
        return self.dtype

    def check_extent(self, extent: int) -> None:
        """Raise RecordError if `extent` payload bytes may not travel on this edge."""
        if extent > self.max_extent:
            raise RecordError(
                f"edge {self.edge_id}: extent {extent} exceeds the edge's max extent "
                f"{self.max_extent}"
            )
        if extent % self.alignment:
            raise RecordError(
                f"edge {self.edge_id}: extent {extent} is not a multiple of alignment "
                f"{self.alignment}"
            )


@dataclass(frozen=True, slots=True)
class RecordHeader:
    object_id: int
    sequence: int
    extent: int
    flags: int = 0

    @property
    def eos(self) -> bool:
        return bool(self.flags & FLAG_EOS)

    @property
    def begin(self) -> bool:
        return bool(self.flags & FLAG_BEGIN)

    @property
    def abort(self) -> bool:
        return bool(self.flags & FLAG_ABORT)


def _check_flags(flags: int, where: str) -> None:
    if not 0 <= flags <= _U32_MAX:
        raise RecordError(f"{where}flags {flags} out of u32 range")
    unknown = flags & ~KNOWN_FLAGS
    if unknown:
        raise RecordError(
            f"{where}unknown flag bits 0x{unknown:x} in flags 0x{flags:x} "
            f"(known: EOS=1, BEGIN=2, ABORT=4)"
        )


def encode_header(
    object_id: int, sequence: int, extent: int, flags: int = 0, spec: EdgeSpec | None = None
) -> bytes:
    """Pack a header; validates like the receiver would, so a bad send fails locally."""
    where = f"edge {spec.edge_id}: " if spec is not None else ""
    for name, value in (("object_id", object_id), ("sequence", sequence), ("extent", extent)):
        if not 0 <= value <= _U64_MAX:
            raise RecordError(f"{where}{name} {value} out of u64 range")
    _check_flags(flags, where)
    if spec is not None:
        spec.check_extent(extent)
    return _HEADER.pack(MAGIC, VERSION, HEADER_LEN, object_id, sequence, extent, flags, 0)


def decode_header(
    data: bytes | bytearray | memoryview, spec: EdgeSpec | None = None
) -> RecordHeader:
    """Unpack and validate a 40-byte header (against `spec` when given)."""
    where = f"edge {spec.edge_id}: " if spec is not None else ""
    if len(data) != HEADER_LEN:
        raise RecordError(f"{where}record header must be {HEADER_LEN} bytes, got {len(data)}")
    magic, version, header_len, object_id, sequence, extent, flags, reserved = _HEADER.unpack(data)
    if magic != MAGIC:
        raise RecordError(f"{where}bad magic {bytes(magic)!r} (expected {MAGIC!r})")
    if version != VERSION:
        raise RecordError(f"{where}unsupported version {version} (supported: {VERSION})")
    if header_len != HEADER_LEN:
        raise RecordError(f"{where}header length {header_len} (expected {HEADER_LEN})")
    if reserved != 0:
        raise RecordError(f"{where}non-zero reserved field 0x{reserved:08x}")
    _check_flags(flags, where)
    if spec is not None:
        spec.check_extent(extent)
    return RecordHeader(object_id=object_id, sequence=sequence, extent=extent, flags=flags)


# --------------------------------------------------------------------------- ordering


class RecordOrder:
    """Per-object sequence order on one edge: 0, 1, 2, ... restarting at 0 on BEGIN.

    A record of an object not seen yet must carry sequence 0. EOS ends the object (its
    state is dropped, so a later prompt may reuse the id). ABORT is accepted with any
    sequence, because the side aborting may not know how far the edge got, and also
    ends the object.
    """

    __slots__ = ("_edge_id", "_next")

    def __init__(self, edge_id: int) -> None:
        self._edge_id = edge_id
        self._next: dict[int, int] = {}

    def check(self, header: RecordHeader) -> None:
        if header.abort:
            self._next.pop(header.object_id, None)
            return
        expected = 0 if header.begin else self._next.get(header.object_id, 0)
        if header.sequence != expected:
            what = "begin record" if header.begin else "record"
            raise RecordError(
                f"edge {self._edge_id}: out-of-order {what} for object {header.object_id}: "
                f"expected sequence {expected}, got {header.sequence}"
            )
        if header.eos:
            self._next.pop(header.object_id, None)
        else:
            self._next[header.object_id] = expected + 1

    def expected(self, object_id: int) -> int:
        return self._next.get(object_id, 0)


class SequenceChecker:
    """The driver's token-out rule, as a data-plane error: the rule itself is
    mvp_core.generation.TokenFeedback (actor spec 7.3), so it is written once."""

    __slots__ = ("_feedback",)

    def __init__(self, start: int = 0) -> None:
        self._feedback = TokenFeedback(expected=start)

    @property
    def expected(self) -> int:
        return self._feedback.expected

    def check(self, got: int) -> None:
        try:
            self._feedback.consume(got)
        except TokenSequenceViolation as e:
            raise TokenSequenceError(str(e)) from None

    def reset(self, start: int = 0) -> None:
        self._feedback = TokenFeedback(expected=start)


# --------------------------------------------------------------------------- tokens


def encode_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as u32 LE."""
    for i, t in enumerate(tokens):
        if not 0 <= t <= _U32_MAX:
            raise RecordError(f"token id {t} at index {i} out of u32 range")
    return np.asarray(tokens, dtype="<u4").tobytes()


def decode_tokens(payload: bytes | bytearray | memoryview) -> list[int]:
    if len(payload) % 4:
        raise RecordError(f"token payload of {len(payload)} bytes is not a multiple of 4")
    return [int(t) for t in np.frombuffer(payload, dtype="<u4")]


def decode_token_out(payload: bytes | bytearray | memoryview) -> int:
    """A token-out record that carries exactly one u32 token (no logprobs)."""
    if len(payload) != 4:
        raise RecordError(f"token-out payload must be exactly 4 bytes, got {len(payload)}")
    return int(struct.unpack("<I", payload)[0])


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A sampled token's log probability and the step's most likely tokens: (token id,
    logprob) pairs, most likely first, ties by token id. The log-softmax of the step's
    raw logits (before temperature, top-k and top-p)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


_TOKEN_LOGPROB = struct.Struct("<If")  # (u32 token id, f32 logprob)


def encode_token_choice(token: int, logprobs: TokenLogprobs | None = None) -> bytes:
    """A token-out payload: the u32 token; with ``logprobs`` its f32 logprob, then each
    top (u32 id, f32 logprob) pair (DECISIONS 88). 4 bytes without logprobs, as before."""
    if logprobs is None:
        return encode_tokens([token])
    if len(logprobs.top) > MAX_TOP_LOGPROBS:
        raise RecordError(
            f"{len(logprobs.top)} top logprobs in a token-out record; at most {MAX_TOP_LOGPROBS}"
        )
    pairs = [(token, logprobs.logprob), *logprobs.top]
    for t, _ in pairs:
        if not 0 <= t <= _U32_MAX:
            raise RecordError(f"token id {t} out of u32 range")
    return b"".join(_TOKEN_LOGPROB.pack(t, lp) for t, lp in pairs)


def decode_token_choice(
    payload: bytes | bytearray | memoryview, max_top: int = MAX_TOP_LOGPROBS
) -> tuple[int, TokenLogprobs | None]:
    """A token-out payload (``encode_token_choice``): the token, and its logprobs where
    the record carries them (its length says so: 4 bytes is the token alone). More than
    ``max_top`` top pairs, a length of neither form or a NaN logprob is a RecordError."""
    n = len(payload)
    if n == 4:
        return decode_token_out(payload), None
    if n < 8 or n % 8 or n > 8 + 8 * max_top:
        raise RecordError(
            f"token-out payload of {n} bytes: expected 4 (a token) or 8 + 8k with k <= "
            f"{max_top} (a token, its logprob and k top logprobs)"
        )
    pairs = [(int(t), float(lp)) for t, lp in _TOKEN_LOGPROB.iter_unpack(payload)]
    for _, lp in pairs:
        if math.isnan(lp) or lp > 0.0:
            raise RecordError(f"token-out logprob {lp} is not a log probability")
    (token, logprob), *top = pairs
    return token, TokenLogprobs(logprob, tuple(top))


# --------------------------------------------------------------------------- sampling header

# request_id u64 | seed u64 | max_new_tokens u32 | temperature f32 | top_k u32 | top_p f32
# | sampling flags u32 (bit 0 = has_seed, bit 1 = logprobs, bit 2 = response format) |
# top_logprobs u32 (0-20; the field was reserved = 0 before logprobs, DECISIONS 88)
#   -> 40 bytes (a multiple of 8)
# With bit 2 (DECISIONS 89) the format block follows: length u32, the format's canonical
# JSON (UTF-8, 1 to MAX_FORMAT_BYTES bytes), zero bytes to a multiple of 8.
_SAMPLING = struct.Struct("<QQIfIfII")
SAMPLING_HEADER_LEN = _SAMPLING.size
SAMPLING_HEADER_BYTES = SAMPLING_HEADER_LEN  # the name mvp_core.planner refers to
assert SAMPLING_HEADER_LEN == 40
_SAMPLING_HAS_SEED = 1
_SAMPLING_LOGPROBS = 2
_SAMPLING_FORMAT = 4
_SAMPLING_FLAGS = _SAMPLING_HAS_SEED | _SAMPLING_LOGPROBS | _SAMPLING_FORMAT
_U32 = struct.Struct("<I")


def _format_block_len(text_bytes: int) -> int:
    return (4 + text_bytes + 7) // 8 * 8


FORMAT_BLOCK_MAX = _format_block_len(MAX_FORMAT_BYTES)
"""The most a begin record's format block adds to its payload (token-in's sampling
header, and each activation edge's first record, which carries the header on)."""
_F32 = struct.Struct("<f")


def _as_f32(value: float) -> float | None:
    """`value` as the float32 the sampling header carries; None when out of its range."""
    try:
        return float(_F32.unpack(_F32.pack(value))[0])
    except OverflowError:
        return None


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How a prompt's next tokens are chosen: the engine's sampler takes them
    (engine/sampling.py), and token-in's BEGIN record carries them ahead of the prompt
    tokens (DECISIONS 19) with the prompt's request id and token cap.

    Defaults are greedy raw completion (DECISIONS 10). ``temperature`` 0 is greedy;
    ``max_new_tokens`` 0 = no cap beyond EOS and context exhaustion; ``top_k`` 0 and
    ``top_p`` 1.0 disable those cuts. A seed makes the sequence reproducible (its own
    generator, no global RNG state). ``request_id`` and ``max_new_tokens`` travel on the
    wire only: the engine takes a sequence's id and cap as their own arguments.
    ``logprobs``: the last stage reports each sampled token's log probability and the
    step's ``top_logprobs`` most likely tokens (0-20) with it; off, nothing is computed.
    ``response_format``: the canonical JSON of a format the text must have
    (mvp_core.constrain, DECISIONS 89); the last stage masks the logits to it.
    """

    request_id: int = 0
    max_new_tokens: int = 0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    response_format: str | None = None

    def validate(self) -> None:
        if not 0 <= self.request_id <= _U64_MAX:
            raise RecordError(f"sampling header: request_id {self.request_id} out of u64 range")
        if not 0 <= self.max_new_tokens <= _U32_MAX:
            raise RecordError(
                f"sampling header: max_new_tokens {self.max_new_tokens} out of u32 range"
            )
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise RecordError(
                f"sampling header: temperature {self.temperature} must be finite and >= 0"
            )
        # The wire carries float32: a temperature beyond its range would fail to pack (an
        # OverflowError, not a RecordError), and a tiny top_p would arrive as 0, which the
        # receiver rejects; both are refused here, on the side that made them.
        if _as_f32(self.temperature) is None:
            raise RecordError(
                f"sampling header: temperature {self.temperature} is out of float32 range"
            )
        if not 0 <= self.top_k <= _U32_MAX:
            raise RecordError(f"sampling header: top_k {self.top_k} out of u32 range")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise RecordError(f"sampling header: top_p {self.top_p} must be in (0, 1]")
        if _as_f32(self.top_p) == 0.0:
            raise RecordError(
                f"sampling header: top_p {self.top_p} is 0 as a float32; must be in (0, 1]"
            )
        if self.seed is not None and not 0 <= self.seed <= _U64_MAX:
            raise RecordError(f"sampling header: seed {self.seed} out of u64 range")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise RecordError(
                f"sampling header: top_logprobs {self.top_logprobs} outside 0..{MAX_TOP_LOGPROBS}"
            )
        if self.top_logprobs and not self.logprobs:
            raise RecordError(
                f"sampling header: top_logprobs {self.top_logprobs} without the logprobs flag"
            )
        if self.response_format is not None:
            n = len(self.response_format.encode())
            if not 0 < n <= MAX_FORMAT_BYTES:
                raise RecordError(
                    f"sampling header: a response format of {n} bytes (1 to {MAX_FORMAT_BYTES})"
                )


def encode_sampling_header(params: SamplingParams) -> bytes:
    """The 40-byte header, and the format block where ``params`` has a response format."""
    params.validate()
    head = _SAMPLING.pack(
        params.request_id,
        params.seed if params.seed is not None else 0,
        params.max_new_tokens,
        params.temperature,
        params.top_k,
        params.top_p,
        (_SAMPLING_HAS_SEED if params.seed is not None else 0)
        | (_SAMPLING_LOGPROBS if params.logprobs else 0)
        | (_SAMPLING_FORMAT if params.response_format is not None else 0),
        params.top_logprobs,
    )
    if params.response_format is None:
        return head
    text = params.response_format.encode()
    block = _U32.pack(len(text)) + text
    return head + block + bytes(_format_block_len(len(text)) - len(block))


def sampling_header_size(data: bytes | bytearray | memoryview) -> int:
    """How many of ``data``'s first bytes are the sampling header (40, or 40 and the
    format block where its flags say one follows); a RecordError where they cannot be."""
    if len(data) < SAMPLING_HEADER_LEN:
        raise RecordError(
            f"sampling header must be at least {SAMPLING_HEADER_LEN} bytes, got {len(data)}"
        )
    sflags = _U32.unpack_from(data, 32)[0]
    if not sflags & _SAMPLING_FORMAT:
        return SAMPLING_HEADER_LEN
    if len(data) < SAMPLING_HEADER_LEN + 4:
        raise RecordError("sampling header: the format flag without the format's length")
    n = _U32.unpack_from(data, SAMPLING_HEADER_LEN)[0]
    if not 0 < n <= MAX_FORMAT_BYTES:
        raise RecordError(
            f"sampling header: a response format of {n} bytes (1 to {MAX_FORMAT_BYTES})"
        )
    size = SAMPLING_HEADER_LEN + _format_block_len(n)
    if len(data) < size:
        raise RecordError(
            f"sampling header: a response format of {n} bytes, {len(data)} bytes in all"
        )
    return size


def decode_sampling_header(data: bytes | bytearray | memoryview) -> SamplingParams:
    """The header ``encode_sampling_header`` wrote: 40 bytes, with the format block
    where its flag bit 2 says so (an older header never has it: no format)."""
    size = sampling_header_size(data)
    if len(data) != size:
        raise RecordError(f"sampling header must be {size} bytes, got {len(data)}")
    view = memoryview(data)
    request_id, seed, max_new, temperature, top_k, top_p, sflags, top = _SAMPLING.unpack(
        view[:SAMPLING_HEADER_LEN]
    )
    if sflags & ~_SAMPLING_FLAGS:
        raise RecordError(f"sampling header: unknown flag bits 0x{sflags & ~_SAMPLING_FLAGS:x}")
    if not sflags & _SAMPLING_HAS_SEED and seed:
        raise RecordError(f"sampling header: seed {seed} given without the has_seed flag")
    fmt = None
    if sflags & _SAMPLING_FORMAT:
        n = _U32.unpack_from(view, SAMPLING_HEADER_LEN)[0]
        start = SAMPLING_HEADER_LEN + 4
        if any(view[start + n :]):
            raise RecordError("sampling header: non-zero padding after the response format")
        try:
            fmt = bytes(view[start : start + n]).decode()
        except UnicodeDecodeError:
            raise RecordError("sampling header: the response format is not UTF-8") from None
    params = SamplingParams(
        request_id=request_id,
        max_new_tokens=max_new,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed if sflags & _SAMPLING_HAS_SEED else None,
        logprobs=bool(sflags & _SAMPLING_LOGPROBS),
        top_logprobs=top,
        response_format=fmt,
    )
    params.validate()
    return params


def encode_begin_payload(params: SamplingParams, prompt_tokens: Sequence[int]) -> bytes:
    """Token-in BEGIN payload: sampling header, then the prompt's u32 token ids."""
    if not prompt_tokens:
        raise RecordError("begin record needs at least one prompt token")
    return encode_sampling_header(params) + encode_tokens(prompt_tokens)


def decode_begin_payload(
    payload: bytes | bytearray | memoryview,
) -> tuple[SamplingParams, list[int]]:
    if len(payload) < SAMPLING_HEADER_LEN + 4:
        raise RecordError(
            f"begin payload of {len(payload)} bytes is shorter than the sampling header "
            f"({SAMPLING_HEADER_LEN}) plus one token"
        )
    view = memoryview(payload)
    size = sampling_header_size(view)
    if len(payload) < size + 4:
        raise RecordError(
            f"begin payload of {len(payload)} bytes is shorter than its sampling header "
            f"({size}) plus one token"
        )
    return decode_sampling_header(view[:size]), decode_tokens(view[size:])


# --------------------------------------------------------------------------- activations


def encode_activation(arr: npt.NDArray[np.float32] | npt.NDArray[np.float16]) -> memoryview:
    """A `[T, hidden]` float32 (or float16) array as LE bytes; zero-copy when already
    C-contiguous LE."""
    if arr.ndim != 2 or arr.shape[0] == 0:
        raise RecordError(f"activation must be [T>=1, hidden], got shape {arr.shape}")
    if arr.dtype == np.float32:
        le = np.ascontiguousarray(arr, dtype="<f4")
    elif arr.dtype == np.float16:
        le = np.ascontiguousarray(arr, dtype="<f2")
    else:
        raise RecordError(f"activation must be float32 or float16, got {arr.dtype}")
    return le.data.cast("B")


def decode_activation(
    payload: bytes | bytearray | memoryview,
    hidden: int,
    dtype: ActivationDtype = ActivationDtype.FLOAT32,
) -> npt.NDArray[np.float32] | npt.NDArray[np.float16]:
    """Payload -> `[T, hidden]` view of `dtype` (no copy; writable when payload is)."""
    row = hidden * dtype.itemsize
    if hidden <= 0 or len(payload) == 0 or len(payload) % row:
        raise RecordError(
            f"{dtype.value} activation payload of {len(payload)} bytes is not a positive "
            f"multiple of hidden {hidden} * {dtype.itemsize} bytes"
        )
    rows: npt.NDArray[np.float32] | npt.NDArray[np.float16] = np.frombuffer(
        payload, dtype=_ROW_TYPE[dtype]
    ).reshape(-1, hidden)
    return rows


# --------------------------------------------------------------------------- specs


def token_in_max_extent(max_seq_len: int) -> int:
    """Sampling header (and its format block at the most) plus a full-context prompt of
    u32 tokens."""
    return SAMPLING_HEADER_LEN + FORMAT_BLOCK_MAX + max_seq_len * 4


def token_out_max_extent(max_seq_len: int) -> int:
    """One u32 token per record, with its logprob and up to MAX_TOP_LOGPROBS top (id,
    logprob) pairs where its prompt asked for them (as mvp_core.planner plans it:
    TOKEN_OUT_BYTES).

    The contract's generic token object spec (max_seq_len*4) only sizes the ring; a
    longer token-out record is a protocol error, so reject it at the header.
    """
    del max_seq_len
    return 8 + 8 * MAX_TOP_LOGPROBS


def activation_max_extent(
    max_seq_len: int, hidden: int, dtype: ActivationDtype = ActivationDtype.FLOAT32
) -> int:
    """A full-context prompt's rows (as mvp_core.planner plans it), and the format block
    a first record may carry with its sampling header at the most (the nodes' own
    allowance, DECISIONS 89: EdgeSpec.from_plan)."""
    return max_seq_len * hidden * dtype.itemsize + FORMAT_BLOCK_MAX


def token_in_spec(max_seq_len: int) -> EdgeSpec:
    return EdgeSpec(1, EdgeKind.TOKEN_IN, token_in_max_extent(max_seq_len), TOKEN_ALIGNMENT)


def activation_spec(
    edge_id: int,
    max_seq_len: int,
    hidden: int,
    dtype: ActivationDtype = ActivationDtype.FLOAT32,
) -> EdgeSpec:
    return EdgeSpec(
        edge_id,
        EdgeKind.ACTIVATION,
        activation_max_extent(max_seq_len, hidden, dtype),
        dtype.itemsize,
        dtype,
    )


def token_out_spec(edge_id: int, max_seq_len: int) -> EdgeSpec:
    return EdgeSpec(edge_id, EdgeKind.TOKEN_OUT, token_out_max_extent(max_seq_len), TOKEN_ALIGNMENT)


def pipeline_edge_specs(
    stages: int,
    max_seq_len: int,
    hidden: int,
    dtype: ActivationDtype = ActivationDtype.FLOAT32,
) -> list[EdgeSpec]:
    """Edges of an N-stage plan: token-in 1, activations 2..N, token-out N+1."""
    if stages < 2:
        raise ValueError(f"a pipeline with edges needs >= 2 stages, got {stages}")
    return [
        token_in_spec(max_seq_len),
        *(activation_spec(i, max_seq_len, hidden, dtype) for i in range(2, stages + 1)),
        token_out_spec(stages + 1, max_seq_len),
    ]
