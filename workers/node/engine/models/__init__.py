"""The forward pass of each architecture family, one file per family (as llama.cpp's
``src/models/``), over the shared blocks in ``blocks.py``; ``build_stage_model`` picks
the family from the architecture table (arch_table.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..arch_table import ARCHITECTURES, GEMMA3, LLAMA
from ..config import ArchConfig
from ..loader import WeightBuilder
from .blocks import REFINE_TOP, RopeTables, Segment, StageModel, check_layer_shapes
from .gemma3 import Gemma3StageModel, build_gemma3_stage_model
from .llama import LayerWeights, LlamaStageModel, build_llama_stage_model

# A family's builder: (weights, config, the stage's layers, fp16 split points)
Builder = Callable[[WeightBuilder, ArchConfig, range, tuple[int, ...]], StageModel[Any]]
BUILDERS: dict[str, Builder] = {
    LLAMA: build_llama_stage_model,
    GEMMA3: build_gemma3_stage_model,
}


def build_stage_model(
    b: WeightBuilder, cfg: ArchConfig, span: range, fp16_split_points: tuple[int, ...]
) -> StageModel[Any]:
    """The stage model of the layers in ``span``, by the architecture's family (arch_config
    has refused any architecture the table lacks)."""
    return BUILDERS[ARCHITECTURES[cfg.architecture].family](b, cfg, span, fp16_split_points)


__all__ = [
    "BUILDERS",
    "REFINE_TOP",
    "Gemma3StageModel",
    "LayerWeights",
    "LlamaStageModel",
    "RopeTables",
    "Segment",
    "StageModel",
    "build_stage_model",
    "check_layer_shapes",
]
