"""A stage boundary: the hidden state as it leaves one stage for the next (DECISIONS 53).

float32 (the default): the rows exactly as the stage computed them, so N stages compute
the 1-stage logits bit for bit at any split; the forward pass between two layers holds
float32 anyway. float16 (a run's opt-in for thin links): half the bytes, rounded. Gemma's
residual stream outgrows float16's range (~1e5 at the BOS position), so a float16 hand-over
is scaled by the architecture's ``float16_scale`` (a power of two: exact) and scaled back
on arrival; ``EngineOptions.fp16_split_points`` applies the same rounding inside one stage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mvp_core.models import ActivationDtype

if TYPE_CHECKING:
    from .stage import Stage

FLOAT16_MAX = 65504.0


class BoundaryOverflow(ValueError):
    """A hidden state beyond float16's range, on a run whose activations travel as float16."""


def to_boundary(stage: Stage, hidden: torch.Tensor, dtype: ActivationDtype) -> torch.Tensor:
    """``hidden`` [T, H] float32 from ``stage`` as it crosses the edge: a CPU tensor of
    ``dtype``; float16 rows carry the stage's ``float16_scale``."""
    if dtype is ActivationDtype.FLOAT32:
        return hidden.to(device="cpu", dtype=torch.float32)
    scaled = hidden * stage.float16_scale if stage.float16_scale != 1.0 else hidden
    rows = scaled.to(device="cpu", dtype=torch.float16)
    if not bool(torch.isfinite(rows).all()) and bool(torch.isfinite(hidden).all()):
        peak = float(scaled.abs().max())
        raise BoundaryOverflow(
            f"the hidden state after layer {stage.layer_end} reaches {peak:.4g}, beyond "
            f"float16's {FLOAT16_MAX:g}: this model needs activation_dtype float32"
        )
    return rows


def from_boundary(stage: Stage, rows: torch.Tensor) -> torch.Tensor:
    """Rows [T, H] from the previous stage's edge as ``stage``'s float32 input."""
    if rows.dtype == torch.float32:
        return rows
    if rows.dtype != torch.float16:
        raise ValueError(f"boundary rows must be float32 or float16, got {rows.dtype}")
    h = rows.to(torch.float32)
    return h * (1.0 / stage.float16_scale) if stage.float16_scale != 1.0 else h
