"""The engine's architecture table (workers/node/engine/arch_table.py) against the
planner's list of what the engine runs (mvp_core/engine_support.py: the core does not
import the engine, so this test holds the two together) and against the files the tests
write with llama.cpp's tensor names (tests/node/engine/arch_cases.py): the same
architectures on both sides, and each row's traits the tensors its files carry."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from mvp_core.engine_support import SUPPORTED_ARCHITECTURES, unsupported_architecture
from tests.node.engine.arch_cases import SHAPES
from tests.node.engine.tiny_models import TinyModel, TinySpec
from workers.node.engine.arch_table import ARCHITECTURES
from workers.node.engine.config import arch_config
from workers.node.engine.gguf_reader import GGUFError, GGUFFile
from workers.node.engine.models import BUILDERS

# Mistral GGUFs carry general.architecture "llama" (arch_cases.py); a file that names
# "mistral" has llama's tensors
CASES: dict[str, TinySpec] = {
    **SHAPES,
    "mistral-named": dataclasses.replace(SHAPES["mistral"], arch="mistral"),
}


def test_the_engine_and_the_planner_name_the_same_architectures() -> None:
    """In the same order too: both error messages list them."""
    assert tuple(ARCHITECTURES) == SUPPORTED_ARCHITECTURES
    assert all(unsupported_architecture(a) is None for a in ARCHITECTURES)
    assert "gpt2" not in ARCHITECTURES and unsupported_architecture("gpt2") is not None


def test_every_family_has_its_graph() -> None:
    assert {t.family for t in ARCHITECTURES.values()} == set(BUILDERS)


def test_the_cases_cover_every_architecture() -> None:
    assert {s.arch for s in CASES.values()} == set(ARCHITECTURES)


@pytest.mark.parametrize("case", sorted(CASES))
def test_traits_are_the_tensors_the_files_carry(case: str, tmp_path: Path) -> None:
    spec = CASES[case]
    model = TinyModel(spec, tmp_path / "m.gguf")
    f = GGUFFile(model.path, map_tensors=False)
    try:
        traits = ARCHITECTURES[f.architecture]
        names = set(f.tensors)
        assert traits.fused_qkv == ("blk.0.attn_qkv.weight" in names)
        assert traits.fused_qkv == ("blk.0.ffn_gate.weight" not in names)
        assert traits.qkv_bias == ("blk.0.attn_q.bias" in names)
        assert traits.qk_norms == ("blk.0.attn_q_norm.weight" in names)
        assert traits.post_norms == ("blk.0.post_attention_norm.weight" in names)
        assert traits.sliding_window == (spec.sliding_window > 0)
        cfg = arch_config(f)
        assert (cfg.architecture, cfg.rope_neox) == (spec.arch, traits.rope_neox)
    finally:
        f.close()


def test_an_architecture_outside_the_table_is_refused_with_the_planners_list(
    tmp_path: Path,
) -> None:
    model = TinyModel(dataclasses.replace(SHAPES["llama"], arch="gpt2x"), tmp_path / "m.gguf")
    f = GGUFFile(model.path, map_tensors=False)
    try:
        with pytest.raises(GGUFError, match=", ".join(SUPPORTED_ARCHITECTURES)):
            arch_config(f)
    finally:
        f.close()
