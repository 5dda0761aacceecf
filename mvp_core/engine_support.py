"""What the engine runs (issue 24): its architectures and tensor types, in the core so
that planning can name what a model needs and the engine lacks before any node starts,
and the engine checks the same table when it loads."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

# general.architecture values the engine's layer path implements.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3")

# GGML tensor types the engine dequantises or multiplies directly (GGML's numbering):
# F32 0, F16 1, Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14, BF16 30.
SUPPORTED_TENSOR_TYPES = frozenset({0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30})
MAX_NAMED = 4  # tensors named in an unsupported-type message (their count is given)
# rope.scaling.type values the engine computes (Llama 3's scaling comes as the
# rope_freqs tensor, which it applies); YaRN and LongRoPE are not implemented.
SUPPORTED_ROPE_SCALING = ("none", "linear")
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def unsupported_architecture(arch: str) -> str | None:
    """Why the engine cannot run ``arch`` (None: it can)."""
    if arch in SUPPORTED_ARCHITECTURES:
        return None
    return (
        f"architecture {arch[:40]!r} is not supported by the engine "
        f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
    )


def unsupported_types(tensors: Iterable[tuple[str, int, str]]) -> str | None:
    """Why the engine cannot load tensors of (name, GGML type, type name) (None: it can):
    every unsupported type named, with the first tensors of each."""
    by_type: dict[str, list[str]] = {}
    for name, ggml_type, type_name in tensors:
        if ggml_type not in SUPPORTED_TENSOR_TYPES:
            by_type.setdefault(type_name, []).append(name)
    if not by_type:
        return None
    parts = []
    for type_name, names in sorted(by_type.items()):
        shown = ", ".join(names[:MAX_NAMED]) + (
            f" and {len(names) - MAX_NAMED} more" if len(names) > MAX_NAMED else ""
        )
        parts.append(f"{type_name} ({len(names)} tensor(s): {shown})")
    return "tensor type(s) not supported by the engine: " + "; ".join(parts)


def unsupported_rope(
    arch: str, metadata: Mapping[str, object], tensor_names: Iterable[str]
) -> str | None:
    """Why the engine cannot compute the model's rope (None: it can)."""
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    if scaling is not None and scaling not in ("", *SUPPORTED_ROPE_SCALING):
        shown = repr(scaling if isinstance(scaling, str) else type(scaling).__name__)[:40]
        return (
            f"rope scaling {shown} is not supported by the engine "
            f"(supported: {', '.join(SUPPORTED_ROPE_SCALING)}, and Llama 3's rope_freqs)"
        )
    if any(name in LONGROPE_TENSORS for name in tensor_names):
        return "LongRoPE (rope_factors_long/short, as Phi-3 128k) is not supported by the engine"
    return None
