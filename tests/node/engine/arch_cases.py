"""The architecture x tensor-type matrix that the engine is proven on against llama.cpp
(issue 24): small random-weight GGUF files with the shapes of the models people run,
written the same way, byte for byte, by the tests and by the script that recorded
llama.cpp's logits for them (scripts/reference/arch_logits.py).

Each shape is a scaled-down real model: its GQA ratio, head dim, tied or untied head,
rope base and scaling, and its architecture's own tensors (qwen2's attention biases,
qwen3's and gemma3's q/k norms, gemma3's sliding window and post-norms, phi3's fused
q/k/v and gate/up). Mistral and Llama 3 GGUFs carry ``general.architecture = "llama"``
(llama.cpp's converter writes them so): they are llama files of those shapes.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from gguf import GGMLQuantizationType as QT

from tests.node.engine.tiny_models import TinyModel, TinySpec

DATA = Path(__file__).with_name("data")
RECORD_JSON = DATA / "arch_logits.json"
RECORD_NPZ = DATA / "arch_logits.npz"

# BOS, then plain tokens; 32 greedy steps follow the prompt
PROMPT = [1, 260, 300, 5, 77, 280, 123, 310, 17, 266]
STEPS = 32
CONTEXT = 64

TYPES: tuple[QT, ...] = (
    QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0,
    QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.F16, QT.BF16,
)  # fmt: skip


SHAPES: dict[str, TinySpec] = {
    # SmolLM2 / TinyLlama: head dim 64, 2 query heads per kv head, tied head
    "llama": TinySpec(arch="llama", n_layers=2, hidden=256, n_head=4, n_kv_head=2, head_dim=64, ffn=512),
    # Llama 3.x: rope_freqs factors, base 500000, 4 query heads per kv head, untied
    "llama3": TinySpec(
        arch="llama", n_layers=2, hidden=256, n_head=4, n_kv_head=1, head_dim=64, ffn=512,
        rope_base=500000.0, rope_freq_factors=True, tied=False,
    ),
    # Mistral 7B: head dim 128, 4 query heads per kv head, base 1e6, untied
    "mistral": TinySpec(
        arch="llama", n_layers=2, hidden=512, n_head=4, n_kv_head=1, head_dim=128, ffn=768,
        rope_base=1000000.0, tied=False,
    ),
    # Qwen 2.5: q/k/v biases, NEOX rope, base 1e6, tied
    "qwen2": TinySpec(
        arch="qwen2", n_layers=2, hidden=256, n_head=4, n_kv_head=1, head_dim=64, ffn=512,
        rope_base=1000000.0, eps=1e-6,
    ),
    # Qwen 3: q/k norms, head dim 128 with q wider than the hidden state
    "qwen3": TinySpec(
        arch="qwen3", n_layers=2, hidden=256, n_head=4, n_kv_head=2, head_dim=128, ffn=512,
        rope_base=1000000.0, eps=1e-6,
    ),
    # Gemma 3: q/k norms, post-norms, GELU, 5 sliding-window layers then a global one
    "gemma3": TinySpec(
        arch="gemma3", hidden=256, n_head=2, n_kv_head=1, head_dim=256, ffn=512,
        rope_base=1000000.0, eps=1e-6, sliding_window=4, n_layers=6,
    ),
    # Phi-3 mini: fused q/k/v and gate/up, head dim 96, no GQA, untied
    "phi3": TinySpec(
        arch="phi3", n_layers=2, hidden=768, n_head=8, n_kv_head=8, head_dim=96, ffn=512, tied=False,
    ),
}  # fmt: skip


# Files of several formats, as llama.cpp's quantiser writes them: a fused product then
# holds rows of two formats (q and k in one, v in another), each summed in its own order.
_K_M = {"attn_v": QT.Q6_K, "ffn_down": QT.Q6_K, "output": QT.Q6_K}
MIXES: dict[str, tuple[str, QT, dict[str, QT]]] = {
    "llama-Q4_K_M": ("llama", QT.Q4_K, _K_M),
    "qwen3-Q4_K_M": ("qwen3", QT.Q4_K, _K_M),
    "llama3-Q4_K_M": ("llama3", QT.Q4_K, _K_M),
    "qwen2-Q5_K_M": ("qwen2", QT.Q5_K, _K_M),
    # Gemma 3 270M's own mix: Q5_0 q/k/gate/up, Q8_0 v, Q4_K output projection, Q6_K down
    "gemma3-mix": ("gemma3", QT.Q5_0, {
        "attn_v": QT.Q8_0, "attn_output": QT.Q4_K, "ffn_down": QT.Q6_K, "token_embd": QT.Q6_K,
    }),
    # repacked Q4_0 beside vec_dot Q8_0 in one q/k/v, and a Q6_K head
    "mistral-Q4_0-mix": ("mistral", QT.Q4_0, {"attn_v": QT.Q8_0, "output": QT.Q6_K}),
}  # fmt: skip


def case_names() -> list[str]:
    return [f"{shape}-{t.name}" for shape in SHAPES for t in TYPES] + list(MIXES)


def spec_of(case: str) -> TinySpec:
    if case in MIXES:
        shape, qtype, overrides = MIXES[case]
    else:
        shape, type_name = case.rsplit("-", 1)
        qtype, overrides = QT[type_name], {}
    seed = int.from_bytes(hashlib.sha256(case.encode()).digest()[:4], "little")
    return dataclasses.replace(
        SHAPES[shape], vocab=320, llamacpp_vocab=True, context_length=CONTEXT,
        qtype=qtype, embd_type=qtype, seed=seed, overrides=overrides,
    )  # fmt: skip


def write_case(case: str, folder: Path) -> TinyModel:
    return TinyModel(spec_of(case), folder / f"{case}.gguf")


def file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
