"""GGUF header decoding (mvp_core.gguf_header) and the planner's facts read through it."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from activities.gguf_facts import read_model_facts
from mvp_core.gguf_header import GGUFError, LazyArray, decode_array, parse_header
from mvp_core.planner import PlanningError
from tests.node.engine.tiny_models import TinyModel, TinySpec


def _write(path: Path, kv: dict[str, int | str | list[str]]) -> bytes:
    w = gguf.GGUFWriter(str(path), str(kv.get("general.architecture", "llama")))
    for key, value in kv.items():
        if key == "general.architecture":
            continue
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_uint32(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def test_header_matches_gguf_py_and_skips_large_arrays(tmp_path: Path) -> None:
    model = TinyModel(TinySpec(arch="llama", qtype=QT.Q4_1), tmp_path / "m.gguf")
    data = Path(model.path).read_bytes()
    header = parse_header(data, model.path)
    ref = gguf.GGUFReader(model.path)
    assert header.metadata["general.architecture"] == "llama"
    assert header.metadata["llama.block_count"] == 3
    assert {t.name: (int(t.tensor_type), int(t.data_offset)) for t in ref.tensors} == {
        name: (info.ggml_type, info.offset) for name, info in header.tensors.items()
    }
    tokens = [f"t{i}" for i in range(5000)]
    data = _write(tmp_path / "v.gguf", {"tokenizer.ggml.tokens": tokens, "llama.block_count": 1})
    ref_arr = parse_header(data).metadata["tokenizer.ggml.tokens"]
    assert isinstance(ref_arr, LazyArray) and ref_arr.count == 5000
    assert decode_array(data, ref_arr) == tokens


def test_large_arrays_decode_as_item_by_item_and_a_cut_anywhere_is_named(
    tmp_path: Path,
) -> None:
    """The one-pass paths for large arrays (strings, scalars; a node decodes a vocabulary
    at every start) give what decoding item by item gives, bools and odd UTF-8 included,
    and a header cut inside any array is a truncation error, never a short list."""
    from mvp_core.gguf_header import GGUFTruncated, _Decoder

    w = gguf.GGUFWriter(str(tmp_path / "a.gguf"), "llama")
    tokens = [f"t{i}\u0120\u65e5" if i % 3 else "" for i in range(5000)]
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.scores", [i / 7 for i in range(5000)])
    w.add_array("tokenizer.ggml.token_type", [i % 6 for i in range(5000)])
    w.add_array("x.flags", [bool(i % 2) for i in range(5000)])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = (tmp_path / "a.gguf").read_bytes()
    arrays = {k: v for k, v in parse_header(data).metadata.items() if isinstance(v, LazyArray)}
    assert len(arrays) == 4
    for ref in arrays.values():
        dec = _Decoder(data, ref.offset)
        assert decode_array(data, ref) == [dec.value(ref.item_type) for _ in range(ref.count)]
    assert decode_array(memoryview(data), arrays["tokenizer.ggml.tokens"]) == tokens
    end = max(r.offset for r in arrays.values())
    for cut in (9, 5_000, 20_000, end + 3):
        with pytest.raises(GGUFTruncated):
            parse_header(data[:cut])
    for ref in arrays.values():
        with pytest.raises(GGUFTruncated):
            decode_array(data[: ref.offset + 100], ref)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b"GGUX" + b[4:], "m.gguf is not a GGUF file"),
        (lambda b: b[:4] + struct.pack("<I", 7) + b[8:], "unsupported GGUF version 7"),
        (lambda b: b[:40], "unexpected end of file in GGUF header"),
        (lambda b: b"", "m.gguf is not a GGUF file"),
    ],
)
def test_bad_headers_are_named(tmp_path: Path, mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    data = _write(tmp_path / "m.gguf", {"llama.block_count": 2, "general.name": "x"})
    with pytest.raises(GGUFError, match=message):
        parse_header(mutate(data), "m.gguf")


def test_zero_alignment_is_rejected(tmp_path: Path) -> None:
    data = _write(tmp_path / "m.gguf", {"general.alignment": 0})
    with pytest.raises(GGUFError, match=r"general\.alignment 0 is not a positive integer"):
        parse_header(data, "m.gguf")


def test_planner_facts(tmp_path: Path) -> None:
    model = TinyModel(TinySpec(arch="qwen2", qtype=QT.Q4_K), tmp_path / "m.gguf")
    facts = read_model_facts(model.path)
    assert (facts.architecture, facts.block_count) == ("qwen2", 3)
    assert (
        facts.embedding_length
        == gguf.GGUFReader(model.path).get_field("qwen2.embedding_length").contents()
    )
    # The work per token the balanced split weighs, from gguf's own reading of the table.
    reader = gguf.GGUFReader(model.path)
    shapes = {t.name: int(t.n_elements) for t in reader.tensors if len(t.shape) > 1}
    assert facts.layer_work == [
        sum(n for name, n in shapes.items() if name.startswith(f"blk.{i}.")) for i in range(3)
    ]
    assert facts.output_work == shapes.get("output.weight", shapes["token_embd.weight"])
    assert all(facts.layer_work) and facts.output_work


def test_planner_facts_without_a_tensor_table_have_no_work_figures(tmp_path: Path) -> None:
    _write(tmp_path / "m.gguf", {"general.architecture": "llama", "llama.block_count": 4,
                                 "llama.embedding_length": 8, "llama.context_length": 16})  # fmt: skip
    facts = read_model_facts(str(tmp_path / "m.gguf"))
    assert (facts.block_count, facts.layer_work, facts.output_work) == (4, None, None)


def test_planner_facts_errors_name_the_file_and_key(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    _write(path, {"llama.block_count": 4, "llama.embedding_length": 64})
    with pytest.raises(PlanningError, match=rf"GGUF {path} is missing llama.context_length"):
        read_model_facts(str(path))
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(
        PlanningError, match=r"cannot read GGUF metadata of .*empty\.gguf: .*not a GGUF"
    ):
        read_model_facts(str(tmp_path / "empty.gguf"))
    path.write_bytes(path.read_bytes()[:30])
    with pytest.raises(PlanningError, match="unexpected end of file"):
        read_model_facts(str(path))
    with pytest.raises(PlanningError, match=r"cannot read GGUF metadata of .*missing\.gguf"):
        read_model_facts(str(tmp_path / "missing.gguf"))


def test_work_figures_from_a_table_no_model_has_are_left_out_not_a_crash() -> None:
    """The tensor table is untrusted: names that only look like a layer's, shapes of many
    or huge dimensions give no figures (so no balanced split), never an error or a hang."""
    from activities.gguf_facts import _work
    from mvp_core.gguf_header import GGUFHeader, TensorInfo

    def header(**shapes: tuple[int, ...]) -> GGUFHeader:
        tensors = {
            name.replace("_", "."): TensorInfo(name.replace("_", "."), shape, 0, 0)
            for name, shape in shapes.items()
        }
        return GGUFHeader(3, {}, tensors)

    ok = header(blk_0_w=(4, 8), blk_1_w=(4, 8), blk_1_n=(8,), output_weight=(16, 8))
    assert _work(ok, 2) == ([32, 32], 128)
    # A digit that int() refuses, a layer number past the count, an 8,000-digit one.
    odd = {"blk.\u2460.w": (4, 8), "blk.7.w": (4, 8), "blk." + "9" * 8000 + ".w": (4, 8)}
    table = GGUFHeader(3, {}, {**ok.tensors, **{n: TensorInfo(n, s, 0, 0) for n, s in odd.items()}})
    assert _work(table, 2) == ([32, 32], 128)
    # A million dimensions, or one past 2**40: not a matrix of any model.
    huge = header(blk_0_w=(2,) * 1_000_000, blk_1_w=(4, 8), output_weight=(16, 8))
    assert _work(huge, 2) == (None, None)
    assert _work(header(blk_0_w=(4, 1 << 41), output_weight=(16, 8)), 1) == (None, None)
    assert _work(header(blk_0_w=(4, 8)), 1) == (None, None)  # no head


def test_planning_names_an_architecture_or_tensor_type_the_engine_lacks(tmp_path: Path) -> None:
    """Issue 24: what the engine cannot run is a planning error naming it, before any
    node starts (it was a weight-load fault on the node)."""
    path = tmp_path / "phi.gguf"
    _write(
        path,
        {
            "general.architecture": "phi2",
            "phi2.block_count": 2,
            "phi2.embedding_length": 64,
            "phi2.context_length": 128,
        },
    )
    with pytest.raises(
        PlanningError, match=r"architecture 'phi2' is not supported by the engine \(supported: "
    ):
        read_model_facts(str(path))

    path = tmp_path / "q51.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key in ("block_count", "embedding_length", "context_length"):
        w.add_uint32(f"llama.{key}", 64 if key != "block_count" else 1)
    # IQ4_NL: 18 bytes a block of 32 (not the engine's).
    w.add_tensor("blk.0.attn_q.weight", np.zeros((64, 36), np.uint8), raw_dtype=QT.IQ4_NL)
    w.add_tensor("blk.0.attn_k.weight", np.zeros((64, 36), np.uint8), raw_dtype=QT.IQ4_NL)
    w.add_tensor("token_embd.weight", np.zeros((64, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(PlanningError) as err:
        read_model_facts(str(path))
    assert "tensor type(s) not supported by the engine: IQ4_NL (2 tensor(s): " in str(err.value)
    assert "blk.0.attn_q.weight" in str(err.value) and "token_embd" not in str(err.value)


def test_the_core_s_table_is_the_engine_s() -> None:
    from mvp_core.engine_support import SUPPORTED_TENSOR_TYPES
    from workers.node.engine.quants import SUPPORTED_TYPES

    assert {int(t) for t in SUPPORTED_TYPES} == SUPPORTED_TENSOR_TYPES
