"""Record header, payload codecs, ordering and the token-out sequence rule."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from mvp_core.models import ActivationDtype, EdgeKind, EdgePlan
from workers.node.dataplane import (
    FLAG_ABORT,
    FLAG_BEGIN,
    FLAG_EOS,
    FORMAT_BLOCK_MAX,
    HEADER_LEN,
    SAMPLING_HEADER_LEN,
    EdgeSpec,
    RecordError,
    RecordHeader,
    RecordOrder,
    SamplingParams,
    SequenceChecker,
    TokenLogprobs,
    TokenSequenceError,
    activation_spec,
    decode_activation,
    decode_begin_payload,
    decode_header,
    decode_sampling_header,
    decode_token_choice,
    decode_token_out,
    decode_tokens,
    encode_activation,
    encode_begin_payload,
    encode_header,
    encode_sampling_header,
    encode_token_choice,
    encode_tokens,
    pipeline_edge_specs,
    sampling_header_size,
    token_in_max_extent,
    token_out_max_extent,
    token_out_spec,
)

SPEC = EdgeSpec(2, EdgeKind.ACTIVATION, max_extent=64, alignment=2)


def raw_header(
    magic=b"MO01", version=1, hlen=40, obj=7, seq=0, extent=8, flags=0, reserved=0
) -> bytes:
    return struct.pack("<4sHHQQQII", magic, version, hlen, obj, seq, extent, flags, reserved)


def test_header_layout_matches_contract() -> None:
    h = encode_header(0x0102030405060708, 9, 10, FLAG_EOS | FLAG_BEGIN)
    assert len(h) == HEADER_LEN == 40
    assert h[0:4] == b"MO01"
    assert h[4:6] == b"\x01\x00" and h[6:8] == b"\x28\x00"
    assert h[8:16] == bytes([8, 7, 6, 5, 4, 3, 2, 1])
    assert h[16:24] == (9).to_bytes(8, "little")
    assert h[24:32] == (10).to_bytes(8, "little")
    assert h[32:36] == (3).to_bytes(4, "little")
    assert h[36:40] == b"\0\0\0\0"
    assert decode_header(h) == RecordHeader(0x0102030405060708, 9, 10, 3)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (raw_header(magic=b"XXXX"), "edge 2: bad magic b'XXXX' (expected b'MO01')"),
        (raw_header(version=2), "edge 2: unsupported version 2 (supported: 1)"),
        (raw_header(hlen=48), "edge 2: header length 48 (expected 40)"),
        (raw_header(extent=66), "edge 2: extent 66 exceeds the edge's max extent 64"),
        (raw_header(extent=7), "edge 2: extent 7 is not a multiple of alignment 2"),
        (raw_header(flags=0x18), "edge 2: unknown flag bits 0x18 in flags 0x18"),
        (raw_header(reserved=5), "edge 2: non-zero reserved field 0x00000005"),
    ],
)
def test_header_validation_errors(raw: bytes, message: str) -> None:
    with pytest.raises(RecordError) as info:
        decode_header(raw, SPEC)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_encode_header_validates_against_spec() -> None:
    with pytest.raises(RecordError, match="extent 66 exceeds"):
        encode_header(1, 0, 66, 0, SPEC)
    with pytest.raises(RecordError, match="unknown flag bits 0x8"):
        encode_header(1, 0, 2, 8, SPEC)
    with pytest.raises(RecordError, match="sequence -1 out of u64 range"):
        encode_header(1, -1, 2, 0, SPEC)


def test_tokens_round_trip() -> None:
    toks = [0, 1, 128000, 2**32 - 1]
    data = encode_tokens(toks)
    assert data == struct.pack("<4I", *toks)
    assert decode_tokens(data) == toks
    assert decode_token_out(struct.pack("<I", 42)) == 42
    with pytest.raises(RecordError, match="exactly 4 bytes, got 8"):
        decode_token_out(data[:8])
    with pytest.raises(RecordError, match="token id -1 at index 0"):
        encode_tokens([-1])
    with pytest.raises(RecordError, match="6 bytes is not a multiple of 4"):
        decode_tokens(b"\0" * 6)


def test_sampling_header_and_begin_payload() -> None:
    p = SamplingParams(
        request_id=99, max_new_tokens=32, temperature=0.7, top_k=40, top_p=0.9, seed=1234
    )
    raw = encode_sampling_header(p)
    assert len(raw) == SAMPLING_HEADER_LEN and SAMPLING_HEADER_LEN % 4 == 0
    back = decode_sampling_header(raw)
    assert back.request_id == 99 and back.seed == 1234 and back.top_k == 40
    assert back.temperature == pytest.approx(0.7) and back.top_p == pytest.approx(0.9)
    greedy = decode_sampling_header(encode_sampling_header(SamplingParams(request_id=1)))
    assert greedy == SamplingParams(request_id=1)  # seed None, temperature 0, no caps
    params, toks = decode_begin_payload(encode_begin_payload(p, [5, 6, 7]))
    assert toks == [5, 6, 7] and params.request_id == 99
    assert token_in_max_extent(512) == SAMPLING_HEADER_LEN + FORMAT_BLOCK_MAX + 512 * 4
    with pytest.raises(RecordError, match="at least one prompt token"):
        encode_begin_payload(p, [])
    with pytest.raises(RecordError, match=r"top_p 0\.0 must be in"):
        encode_sampling_header(SamplingParams(request_id=1, top_p=0.0))
    bad = bytearray(raw)
    bad[36] = 1  # top_logprobs (the field was reserved before logprobs) without the flag
    with pytest.raises(RecordError, match="top_logprobs 1 without the logprobs flag"):
        decode_sampling_header(bad)
    bad[32] |= 8
    with pytest.raises(RecordError, match="sampling header: unknown flag bits 0x8"):
        decode_sampling_header(bad)


def test_sampling_header_carries_a_response_format_in_its_block() -> None:
    fmt = '{"schema":{"enum":["é"]},"type":"json_schema"}'
    p = SamplingParams(request_id=7, seed=5, response_format=fmt)
    raw = encode_sampling_header(p)
    n = len(fmt.encode())
    assert len(raw) == SAMPLING_HEADER_LEN + (4 + n + 7) // 8 * 8 and len(raw) % 8 == 0
    assert struct.unpack_from("<II", raw, 32) == (1 | 4, 0)  # has_seed | format
    assert struct.unpack_from("<I", raw, SAMPLING_HEADER_LEN) == (n,)
    assert sampling_header_size(raw + b"rows") == len(raw)
    assert decode_sampling_header(raw) == p
    params, toks = decode_begin_payload(encode_begin_payload(p, [5, 6]))
    assert (params, toks) == (p, [5, 6])
    # The largest format fits the allowance every edge adds to its planned extent.
    big = SamplingParams(response_format="x" * 16384)
    assert len(encode_sampling_header(big)) == SAMPLING_HEADER_LEN + FORMAT_BLOCK_MAX
    with pytest.raises(RecordError, match="a response format of 16385 bytes"):
        encode_sampling_header(SamplingParams(response_format="x" * 16385))
    with pytest.raises(RecordError, match="sampling header: a response format of 47 bytes"):
        decode_begin_payload(raw[:48])  # cut inside the block
    padded = bytearray(raw)
    padded[-1] = 1
    with pytest.raises(RecordError, match="non-zero padding"):
        decode_sampling_header(padded)
    not_utf8 = bytearray(raw)
    not_utf8[SAMPLING_HEADER_LEN + 4] = 0xFF
    with pytest.raises(RecordError, match="not UTF-8"):
        decode_sampling_header(not_utf8)


def test_sampling_header_carries_logprobs_and_reads_a_header_from_before_them() -> None:
    p = SamplingParams(request_id=7, seed=5, logprobs=True, top_logprobs=20)
    raw = encode_sampling_header(p)
    assert decode_sampling_header(raw) == p
    assert struct.unpack_from("<II", raw, 32) == (3, 20)  # has_seed | logprobs, the count
    only = SamplingParams(request_id=7, logprobs=True)
    assert decode_sampling_header(encode_sampling_header(only)) == only
    # A header from before logprobs (flags has_seed, the reserved field 0): logprobs off.
    old = struct.pack("<QQIfIfII", 7, 5, 0, 0.0, 0, 1.0, 1, 0)
    assert decode_sampling_header(old) == SamplingParams(request_id=7, seed=5)
    assert encode_sampling_header(SamplingParams(request_id=7, seed=5)) == old
    for bad in (SamplingParams(top_logprobs=21, logprobs=True), SamplingParams(top_logprobs=2)):
        with pytest.raises(RecordError, match="top_logprobs"):
            encode_sampling_header(bad)


def test_token_out_carries_logprobs_only_where_asked() -> None:
    assert encode_token_choice(42) == struct.pack("<I", 42)
    assert decode_token_choice(struct.pack("<I", 42)) == (42, None)
    lp = TokenLogprobs(-0.25, ((42, -0.25), (7, -1.5)))
    raw = encode_token_choice(42, lp)
    assert len(raw) == 8 + 2 * 8
    assert decode_token_choice(raw) == (42, lp)
    assert decode_token_choice(encode_token_choice(3, TokenLogprobs(-2.0))) == (
        3,
        TokenLogprobs(-2.0),
    )
    widest = encode_token_choice(1, TokenLogprobs(-1.0, tuple((i, -1.0) for i in range(20))))
    assert len(widest) == token_out_max_extent(0) == 168
    with pytest.raises(RecordError, match="k <= 1"):
        decode_token_choice(raw, max_top=1)  # more than the prompt asked for
    for n in (0, 6, 12, 176):
        with pytest.raises(RecordError, match=f"payload of {n} bytes"):
            decode_token_choice(b"\0" * n)
    with pytest.raises(RecordError, match="not a log probability"):
        decode_token_choice(struct.pack("<If", 1, 0.5))
    with pytest.raises(RecordError, match="21 top logprobs"):
        encode_token_choice(1, TokenLogprobs(-1.0, tuple((i, -1.0) for i in range(21))))


def test_activation_round_trip_zero_copy() -> None:
    arr = np.arange(3 * 8, dtype=np.float32).reshape(3, 8) / 7
    view = encode_activation(arr)  # float32: the default wire format (DECISIONS 53)
    assert view.nbytes == 3 * 8 * 4
    assert np.shares_memory(np.frombuffer(view, dtype=np.float32), arr)
    back = decode_activation(bytearray(view), 8)
    assert back.dtype == np.float32 and back.shape == (3, 8) and np.array_equal(back, arr)
    half = arr.astype(np.float16)
    view16 = encode_activation(half)
    assert view16.nbytes == 3 * 8 * 2
    assert np.shares_memory(np.frombuffer(view16, dtype=np.float16), half)
    back16 = decode_activation(bytearray(view16), 8, ActivationDtype.FLOAT16)
    assert back16.dtype == np.float16 and np.array_equal(back16, half)
    with pytest.raises(RecordError, match="must be float32 or float16, got float64"):
        encode_activation(arr.astype(np.float64))
    with pytest.raises(RecordError, match=r"float32 .* not a positive multiple of hidden 8 \* 4"):
        decode_activation(b"\0" * 48, 8)  # 12 float32s: not whole rows of 8
    with pytest.raises(RecordError, match=r"float16 .* not a positive multiple of hidden 8 \* 2"):
        decode_activation(b"\0" * 10, 8, ActivationDtype.FLOAT16)


def test_an_activation_spec_knows_its_rows_element_type() -> None:
    spec = activation_spec(2, 16, 8)
    assert (spec.dtype, spec.alignment, spec.max_extent) == (
        ActivationDtype.FLOAT32,
        4,
        512 + FORMAT_BLOCK_MAX,
    )
    assert spec.activation() is ActivationDtype.FLOAT32
    with pytest.raises(ValueError, match="float16 activations need alignment 2, got 4"):
        EdgeSpec(2, EdgeKind.ACTIVATION, 64, 4, ActivationDtype.FLOAT16)
    with pytest.raises(ValueError, match="a token_in edge carries tokens, not float32"):
        EdgeSpec(1, EdgeKind.TOKEN_IN, 64, 4, ActivationDtype.FLOAT32)
    with pytest.raises(ValueError, match=r"edge 3 \(token_out\) has no activation dtype"):
        token_out_spec(3, 16).activation()
    old = {"edge_id": 2, "kind": "activation", "src_stage": 0, "dst_stage": 1}
    plan = EdgePlan.model_validate({**old, "max_extent": 256, "alignment": 2})
    # a plan committed before the field carried float16 rows
    assert EdgeSpec.from_plan(plan).dtype is ActivationDtype.FLOAT16


def test_record_order() -> None:
    order = RecordOrder(2)

    def rec(obj: int, seq: int, flags: int = 0) -> RecordHeader:
        return RecordHeader(obj, seq, 0, flags)

    order.check(rec(1, 0, FLAG_BEGIN))
    order.check(rec(1, 1))
    order.check(rec(5, 0))  # another object, independent counter
    with pytest.raises(
        RecordError, match="out-of-order record for object 1: expected sequence 2, got 3"
    ):
        order.check(rec(1, 3))
    order.check(rec(1, 2, FLAG_EOS))
    assert order.expected(1) == 0
    order.check(rec(1, 0, FLAG_BEGIN))
    order.check(rec(1, 1))
    order.check(rec(1, 0, FLAG_BEGIN))  # BEGIN restarts at 0
    with pytest.raises(
        RecordError, match="out-of-order begin record for object 1: expected sequence 0, got 4"
    ):
        order.check(rec(1, 4, FLAG_BEGIN))
    order.check(rec(1, 17, FLAG_ABORT))  # abort: any sequence, drops the object
    assert order.expected(1) == 0


def test_sequence_checker_exact_text() -> None:
    chk = SequenceChecker()
    chk.check(0)
    chk.check(1)
    with pytest.raises(TokenSequenceError) as info:
        chk.check(3)
    assert str(info.value) == "pipeline token sequence violation: expected 2, got 3"
    assert isinstance(info.value, RecordError)


def test_pipeline_edge_specs() -> None:
    specs = pipeline_edge_specs(3, max_seq_len=512, hidden=2048)
    assert [(s.edge_id, s.kind) for s in specs] == [
        (1, EdgeKind.TOKEN_IN),
        (2, EdgeKind.ACTIVATION),
        (3, EdgeKind.ACTIVATION),
        (4, EdgeKind.TOKEN_OUT),
    ]
    assert specs[1].max_extent == 512 * 2048 * 4 + FORMAT_BLOCK_MAX and specs[1].alignment == 4
    half = pipeline_edge_specs(3, max_seq_len=512, hidden=2048, dtype=ActivationDtype.FLOAT16)
    assert [(s.max_extent, s.alignment) for s in half[1:3]] == [
        (512 * 2048 * 2 + FORMAT_BLOCK_MAX, 2)
    ] * 2
    assert specs[0].max_extent == SAMPLING_HEADER_LEN + FORMAT_BLOCK_MAX + 512 * 4
    assert specs[0].alignment == 4
    assert specs[3].max_extent == 8 + 8 * 20 and specs[3].alignment == 4


def test_a_plan_from_before_logprobs_reads_with_the_token_out_extent_of_now() -> None:
    planner = pytest.importorskip("mvp_core.planner")
    old = planner.plan_edges(2, 512, 2048)[-1].model_copy(update={"max_extent": 4})
    assert EdgeSpec.from_plan(old) == token_out_spec(3, 512)


def test_specs_agree_with_the_planner() -> None:
    planner = pytest.importorskip("mvp_core.planner")
    assert planner.SAMPLING_HEADER_BYTES == SAMPLING_HEADER_LEN
    assert planner.TOKEN_OUT_BYTES == token_out_max_extent(0)
    planned = [EdgeSpec.from_plan(p) for p in planner.plan_edges(3, 512, 2048)]
    assert planned == pipeline_edge_specs(3, max_seq_len=512, hidden=2048)
