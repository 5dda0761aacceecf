"""The engine's one table of architectures (``general.architecture`` values) and what sets
each apart: which graph under ``models/`` runs it and the traits the loader and the graphs
consult, so that adding an architecture is one row here and, where it needs one, a graph.

The planner's list (mvp_core.engine_support.SUPPORTED_ARCHITECTURES) names the same
architectures in the same order; tests/node/engine/test_arch_table.py holds the two
together (the core does not import the engine).
"""

from __future__ import annotations

from dataclasses import dataclass

LLAMA = "llama"  # the family whose graph is models/llama.py
GEMMA3 = "gemma3"  # models/gemma3.py


@dataclass(frozen=True)
class ArchTraits:
    """What one architecture's files carry and how the engine computes them."""

    family: str  # the graph that runs it: LLAMA or GEMMA3
    # llama.cpp rotates the two halves of each head ("NEOX") for these; adjacent pairs for
    # the others (their converter permuted the q/k rows for that, loader.rope_permutation)
    rope_neox: bool
    # The default path sums products in llama.cpp's own float order (loader.WeightBuilder)
    llamacpp_order: bool
    # One attn_qkv matrix (and ffn_up holding the gate rows, then the up rows): the
    # attention scale cannot go into q's rows, it scales q after the rope or the scores
    fused_qkv: bool = False
    qkv_bias: bool = False  # attn_q/k/v.bias
    qk_norms: bool = False  # per-head attn_q_norm / attn_k_norm before the rope
    post_norms: bool = False  # a norm after attention and after the feed-forward too
    sliding_window: bool = False  # local layers see the last sliding_window positions


ARCHITECTURES: dict[str, ArchTraits] = {
    "llama": ArchTraits(LLAMA, rope_neox=False, llamacpp_order=True),
    "mistral": ArchTraits(LLAMA, rope_neox=False, llamacpp_order=False),
    "qwen2": ArchTraits(LLAMA, rope_neox=True, llamacpp_order=True, qkv_bias=True),
    "qwen3": ArchTraits(LLAMA, rope_neox=True, llamacpp_order=True, qk_norms=True),
    "gemma3": ArchTraits(
        GEMMA3, rope_neox=True, llamacpp_order=True, qk_norms=True, post_norms=True,
        sliding_window=True,
    ),
    "phi3": ArchTraits(LLAMA, rope_neox=True, llamacpp_order=True, fused_qkv=True),
}  # fmt: skip


def traits_of(arch: str) -> ArchTraits | None:
    """The architecture's row (None: the engine does not run it)."""
    return ARCHITECTURES.get(arch)


def fused_qkv_architectures() -> str:
    """The architectures with a fused attn_qkv, as an error message names them."""
    return ", ".join(a for a, t in ARCHITECTURES.items() if t.fused_qkv)
