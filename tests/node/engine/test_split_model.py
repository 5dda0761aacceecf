"""A split GGUF (llama.cpp's gguf-split format, written here by scripts/gguf_split.py) is
one model: the planner's facts, the tokenizer and every stage read it as the single file,
each tensor from its own part; a part missing, a later part given, or parts of different
splits are refused naming the file."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from activities.gguf_facts import read_model_facts
from mvp_core.planner import PlanningError
from mvp_io.gguf_files import open_model
from scripts.gguf_split import split_gguf
from tests.node.engine.conftest import ONCE_CONTINUATION, ONCE_UPON_A_TIME, THREADS
from workers.node.engine import EngineOptions, Stage, load_stage
from workers.node.engine.gguf_reader import GGUFError, GGUFFile
from workers.node.engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def parts(smollm_path: str, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return split_gguf(Path(smollm_path), tmp_path_factory.mktemp("split") / "smollm", 3)


def test_the_parts_hold_every_tensor_once_with_the_same_bytes(
    smollm_path: str, parts: list[Path]
) -> None:
    assert [p.name for p in parts] == [f"smollm-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    whole, split = GGUFFile(smollm_path), GGUFFile(str(parts[0]))
    try:
        assert split.paths == [str(p) for p in parts]
        assert list(split.tensors) == list(whole.tensors)
        assert {t.part for t in split.tensors.values()} == {0, 1, 2}
        for name in whole.tensors:
            assert bytes(split.raw(name)) == bytes(whole.raw(name)), name
        assert {k: v for k, v in split.metadata.items() if not k.startswith("split.")} == (
            whole.metadata
        )
    finally:
        whole.close()
        split.close()


def test_the_planner_and_the_tokenizer_see_the_single_file(
    smollm_path: str, parts: list[Path]
) -> None:
    assert read_model_facts(str(parts[0])) == read_model_facts(smollm_path)
    text = "Once upon a time"
    assert Tokenizer.from_gguf(parts[0]).encode(text) == Tokenizer.from_gguf(smollm_path).encode(
        text
    )
    with open_model(str(parts[0])) as split, open_model(smollm_path) as single:
        assert split.paths == [str(p) for p in parts] and single.paths == [smollm_path]


def test_stages_of_a_split_model_compute_the_single_files_logits(
    parts: list[Path], smollm_default: Stage
) -> None:
    """Two stages over the parts: the same logits, bit for bit, as the single file; each
    stage touched only its own layers' tensors (whatever part holds them)."""
    opts = EngineOptions(device="cpu", threads=THREADS)
    ids = ONCE_UPON_A_TIME + ONCE_CONTINUATION[:4]
    first, last = load_stage(str(parts[0]), 0, 15, opts), load_stage(str(parts[0]), 15, 30, opts)
    try:
        got = last.new_session(32).forward_hidden(first.new_session(32).forward_tokens(ids))
        assert torch.equal(got, smollm_default.new_session(32).forward_tokens(ids))
        late = tuple(f"blk.{i}." for i in range(15, 30))
        assert not any(n.startswith((*late, "output")) for n in first.tensor_names_loaded)
        # (the last stage reads token_embd too: SmolLM2's output head is tied to it)
        early = tuple(f"blk.{i}." for i in range(15))
        assert not any(n.startswith(early) for n in last.tensor_names_loaded)
    finally:
        first.close()
        last.close()


def test_a_missing_or_foreign_part_or_a_later_part_is_refused_naming_it(
    parts: list[Path], smollm_path: str, tmp_path: Path
) -> None:
    for p in parts:
        shutil.copy(p, tmp_path / p.name)
    first, second, third = (tmp_path / p.name for p in parts)
    with pytest.raises(GGUFError, match=f"^{second} is part 2 of 3 of a split model: give the"):
        open_model(str(second))
    # A part of another split of the same model (two parts: other tensors, other counts).
    other = split_gguf(Path(smollm_path), tmp_path / "other", 2)
    shutil.copy(other[1], third)
    with pytest.raises(GGUFError, match=f"^{third}: expected part 3 of 3, it says part 2 of 2"):
        open_model(str(first))
    third.unlink()
    with pytest.raises(GGUFError, match=f"^split part 3 of 3 is missing: {third}$"):
        open_model(str(first))
    # The planner says the same, as a planning error (the run is rejected before any node).
    with pytest.raises(PlanningError, match=f"split part 3 of 3 is missing: {third}"):
        read_model_facts(str(first))
    # A part cut short: its tensors are refused when read, naming the part.
    with open(second, "r+b") as fh:
        fh.truncate(second.stat().st_size // 2)
    shutil.copy(parts[2], third)
    f = GGUFFile(str(first))
    try:
        late = next(n for n, t in f.tensors.items() if t.part == 1 and t.offset > 20_000_000)
        with pytest.raises(GGUFError, match=f"^{second}: tensor {late} extends past the end"):
            f.raw(late)
    finally:
        f.close()


def test_a_model_with_its_own_alignment_splits_into_parts_that_read_back(tmp_path: Path) -> None:
    """general.alignment other than 32: every part pads its data to it (the header says
    so), and the joined model reads every tensor's bytes back."""
    import gguf
    import numpy as np

    from scripts.gguf_split import split_gguf

    writer = gguf.GGUFWriter(tmp_path / "m.gguf", "llama")
    writer.add_custom_alignment(64)
    arrays = {f"blk.{i}.w": np.full((3, 5), i, dtype=np.float32) for i in range(3)}
    for name, a in arrays.items():
        writer.add_tensor(name, a)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    parts = split_gguf(tmp_path / "m.gguf", tmp_path / "m", 3)
    f = GGUFFile(str(parts[0]))
    try:
        assert f.metadata["general.alignment"] == 64
        for name, a in arrays.items():
            assert bytes(f.raw(name)) == a.tobytes(), name
            assert f.tensors[name].offset % 64 == 0
    finally:
        f.close()
