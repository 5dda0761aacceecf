"""A split GGUF (llama.cpp's gguf-split) read as one model: the rules that find its parts
and check they belong together, on headers built here (the files: tests/node/engine/
test_split_model.py)."""

from __future__ import annotations

from typing import Any

import pytest

from mvp_core.gguf_header import (
    SPLIT_COUNT,
    SPLIT_NO,
    SPLIT_TENSORS,
    GGUFError,
    GGUFHeader,
    TensorInfo,
    join_split,
    split_of,
    split_part_paths,
)

PATHS = split_part_paths("/m/llama-8b-Q4_K_M-00001-of-00003.gguf", 3)


def _part(no: int, names: list[str], count: int = 3, total: Any = 5, **meta: Any) -> GGUFHeader:
    keys: dict[str, Any] = {SPLIT_NO: no, SPLIT_COUNT: count, SPLIT_TENSORS: total, **meta}
    tensors = {n: TensorInfo(n, (4, 32), 0, 64 * i) for i, n in enumerate(names)}
    return GGUFHeader(3, keys, tensors, 96)


def _parts() -> list[GGUFHeader]:
    return [
        _part(0, ["token_embd.weight", "blk.0.attn_q.weight"], arch="llama"),
        _part(1, ["blk.1.attn_q.weight", "blk.2.attn_q.weight"]),
        _part(2, ["output.weight"]),
    ]


def test_the_parts_are_named_as_gguf_split_names_them() -> None:
    assert PATHS == [
        "/m/llama-8b-Q4_K_M-00001-of-00003.gguf",
        "/m/llama-8b-Q4_K_M-00002-of-00003.gguf",
        "/m/llama-8b-Q4_K_M-00003-of-00003.gguf",
    ]
    for wrong in ("/m/model.gguf", "/m/m-00002-of-00003.gguf", "/m/m-00001-of-00004.gguf"):
        with pytest.raises(GGUFError, match="the other parts cannot be found"):
            split_part_paths(wrong, 3)


def test_joined_parts_are_one_model_with_the_first_parts_metadata() -> None:
    joined = join_split(_parts(), PATHS)
    assert joined.metadata["arch"] == "llama"
    assert list(joined.tensors) == [
        "token_embd.weight",
        "blk.0.attn_q.weight",
        "blk.1.attn_q.weight",
        "blk.2.attn_q.weight",
        "output.weight",
    ]
    assert [t.part for t in joined.tensors.values()] == [0, 0, 1, 1, 2]
    # Each offset stays the one in its own part's file.
    assert joined.tensors["blk.2.attn_q.weight"].offset == 64


def test_a_model_in_one_file_is_no_split() -> None:
    assert split_of(GGUFHeader(3, {"general.architecture": "llama"})) is None
    assert split_of(GGUFHeader(3, {SPLIT_COUNT: 1, SPLIT_NO: 0})) is None
    assert split_of(_part(2, [])) == (2, 3)


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        ({SPLIT_COUNT: "3"}, "split.count '3' is not an integer"),
        ({SPLIT_COUNT: True}, "split.count True is not an integer"),
        ({SPLIT_COUNT: 0}, "split.count 0 is not 1..99999"),
        ({SPLIT_COUNT: 100_000}, "split.count 100000 is not 1..99999"),
        ({SPLIT_COUNT: 3}, "split.no None is not a part of 3"),
        ({SPLIT_COUNT: 3, SPLIT_NO: 3}, "split.no 3 is not a part of 3"),
        ({SPLIT_COUNT: 3, SPLIT_NO: -1}, "split.no -1 is not a part of 3"),
    ],
)
def test_split_keys_that_are_not_a_split_are_refused(meta: dict[str, Any], message: str) -> None:
    with pytest.raises(GGUFError, match=f"^m.gguf: {message}"):
        split_of(GGUFHeader(3, meta), "m.gguf")


def test_parts_that_do_not_belong_together_are_refused_naming_the_part() -> None:
    parts = _parts()
    swapped = [parts[0], parts[2], parts[1]]
    with pytest.raises(GGUFError, match=f"^{PATHS[1]}: expected part 2 of 3, it says part 3 of 3"):
        join_split(swapped, PATHS)
    whole = [parts[0], GGUFHeader(3, {}, {}, 0), parts[2]]
    with pytest.raises(GGUFError, match=f"^{PATHS[1]}: expected part 2 of 3, it says no split"):
        join_split(whole, PATHS)
    other = [parts[0], _part(1, ["blk.1.attn_q.weight"], total=9), parts[2]]
    with pytest.raises(GGUFError, match=f"^{PATHS[1]}: split.tensors.count differs"):
        join_split(other, PATHS)
    twice = [parts[0], _part(1, ["blk.0.attn_q.weight", "blk.2.attn_q.weight"]), parts[2]]
    with pytest.raises(
        GGUFError, match=f"^tensor blk.0.attn_q.weight is in two parts: {PATHS[0]} and {PATHS[1]}"
    ):
        join_split(twice, PATHS)
    short = [parts[0], _part(1, ["blk.1.attn_q.weight"]), parts[2]]
    with pytest.raises(GGUFError, match=r"the parts hold 4 tensors, split\.tensors\.count says 5"):
        join_split(short, PATHS)
    with pytest.raises(GGUFError, match="needs its parts"):
        join_split(parts[:1], PATHS[:1])
