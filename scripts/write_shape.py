"""Write a random-weight GGUF of a real model's shape, tensor by tensor (never the whole
model in memory), for benchmarks at the sizes people run (not in CI).

    python scripts/write_shape.py llama-3.1-8b OUT.gguf [--quant q4_k_m] [--split 3]

Shapes: llama-3.2-1b, qwen2.5-3b, llama-3.1-8b (their published hidden size, layers,
heads, KV heads, feed-forward width and vocabulary; tied heads where the model ties
them). ``--quant q4_0``: every matrix Q4_0 (``q4_1``, ``q8_0`` likewise); ``q4_k_m``:
llama.cpp's Q4_K_M mix (Q4_K, with Q6_K for the output head and for attn_v and ffn_down in
llama.cpp's ``use_more_bits`` layers); ``q5_k_m``: its Q5_K_M mix (the same with Q5_K). Block scales are small positive float16 values and codes are
random, so the arithmetic is a real model's and the text is noise. A SentencePiece-style
vocabulary of the shape's size lets the engine's tokenizer load. ``--split N`` writes the
model as gguf-split's N parts instead (scripts/gguf_split.py), removing the single file.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: scripts/ and tests/ importable
    sys.path.insert(0, str(REPO))

import gguf  # noqa: E402
from gguf import GGMLQuantizationType as QT  # noqa: E402

from scripts.gguf_split import split_gguf  # noqa: E402
from tests.node.engine.tiny_models import spm_vocab  # noqa: E402


@dataclass(frozen=True)
class Shape:
    arch: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    rope_base: float = 500000.0
    context: int = 8192


SHAPES = {
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 8192, 128256, tied=True),
    "qwen2.5-3b": Shape(
        "qwen2", 2048, 36, 16, 2, 11008, 151936, tied=True, qkv_bias=True, rope_base=1e6
    ),
    "llama-3.1-8b": Shape("llama", 4096, 32, 32, 8, 14336, 128256, tied=False),
    # The tests' realistic shape (issue 35): 20 layers, hidden 1024, ~150 MB in Q4_K_M.
    "llama-20l-1024": Shape("llama", 1024, 20, 16, 4, 2816, 32000, tied=True, context=2048),
}

# (elements per block, bytes per block, byte offsets of float16 scales in a block)
BLOCKS = {
    QT.Q4_0: (32, 18, (0,)),
    QT.Q4_1: (32, 20, (0, 2)),
    QT.Q8_0: (32, 34, (0,)),
    QT.Q4_K: (256, 144, (0, 2)),
    QT.Q5_K: (256, 176, (0, 2)),
    QT.Q6_K: (256, 210, (208,)),
}


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's rule for the layers whose attn_v and ffn_down Q4_K_M keeps in Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def plan(s: Shape, quant: str) -> list[tuple[str, tuple[int, int] | tuple[int], QT | None]]:
    hd = s.hidden // s.heads

    def q(name: str, layer: int = -1) -> QT:
        if quant == "q4_0":
            return QT.Q4_0
        if quant == "q8_0":
            return QT.Q8_0
        if quant == "q4_1":
            return QT.Q4_1
        if name == "output.weight":
            return QT.Q6_K
        if name in ("attn_v.weight", "ffn_down.weight") and use_more_bits(layer, s.layers):
            return QT.Q6_K
        return QT.Q5_K if quant == "q5_k_m" else QT.Q4_K

    out: list[tuple[str, tuple[int, int] | tuple[int], QT | None]] = [
        ("token_embd.weight", (s.vocab, s.hidden), q("token_embd.weight"))
    ]
    for i in range(s.layers):
        p = f"blk.{i}."
        out.append((p + "attn_norm.weight", (s.hidden,), None))
        out.append((p + "attn_q.weight", (s.heads * hd, s.hidden), q("attn_q.weight", i)))
        out.append((p + "attn_k.weight", (s.kv_heads * hd, s.hidden), q("attn_k.weight", i)))
        out.append((p + "attn_v.weight", (s.kv_heads * hd, s.hidden), q("attn_v.weight", i)))
        if s.qkv_bias:
            out.append((p + "attn_q.bias", (s.heads * hd,), None))
            out.append((p + "attn_k.bias", (s.kv_heads * hd,), None))
            out.append((p + "attn_v.bias", (s.kv_heads * hd,), None))
        out.append((p + "attn_output.weight", (s.hidden, s.heads * hd), q("attn_output", i)))
        out.append((p + "ffn_norm.weight", (s.hidden,), None))
        out.append((p + "ffn_gate.weight", (s.ffn, s.hidden), q("ffn_gate.weight", i)))
        out.append((p + "ffn_up.weight", (s.ffn, s.hidden), q("ffn_up.weight", i)))
        out.append((p + "ffn_down.weight", (s.hidden, s.ffn), q("ffn_down.weight", i)))
    out.append(("output_norm.weight", (s.hidden,), None))
    if not s.tied:
        out.append(("output.weight", (s.vocab, s.hidden), q("output.weight")))
    return out


def blocks(rng: np.random.Generator, rows: int, cols: int, qt: QT) -> np.ndarray:
    per, size, scales = BLOCKS[qt]
    b = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    for at in scales:
        d = (0.002 * (1 + rng.random((rows, cols // per)))).astype(np.float16)
        b[:, :, at : at + 2] = d.view(np.uint8).reshape(rows, cols // per, 2)
    if qt == QT.Q6_K:  # int8 scales: small, positive
        b[:, :, 192:208] = rng.integers(1, 32, (rows, cols // per, 16), dtype=np.uint8)
    return b.reshape(rows, -1)


def write(shape: Shape, name: str, path: Path, quant: str) -> None:
    rng = np.random.default_rng(0)
    hd = shape.hidden // shape.heads
    w = gguf.GGUFWriter(str(path), shape.arch)
    w.add_string("general.name", f"{name}-shape-{quant}")
    for key, value in {
        "block_count": shape.layers,
        "context_length": shape.context,
        "embedding_length": shape.hidden,
        "feed_forward_length": shape.ffn,
        "attention.head_count": shape.heads,
        "attention.head_count_kv": shape.kv_heads,
        "attention.key_length": hd,
        "attention.value_length": hd,
        "rope.dimension_count": hd,
    }.items():
        w.add_uint32(f"{shape.arch}.{key}", value)
    w.add_float32(f"{shape.arch}.rope.freq_base", shape.rope_base)
    w.add_float32(f"{shape.arch}.attention.layer_norm_rms_epsilon", 1e-5)
    tokens, scores, types = spm_vocab(shape.vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    tensors = plan(shape, quant)
    for tname, dims, qt in tensors:
        if qt is None:
            w.add_tensor_info(tname, dims, np.dtype(np.float32), 4 * dims[0])
        else:
            rows, cols = dims  # type: ignore[misc]
            per, size, _ = BLOCKS[qt]
            nbytes = rows * cols // per * size
            w.add_tensor_info(
                tname, (rows, cols // per * size), np.dtype(np.uint8), nbytes, raw_dtype=qt
            )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for tname, dims, qt in tensors:
        if qt is None:
            scale = 0.0 if tname.endswith(".bias") else 1.0
            w.write_tensor_data((scale + 0.05 * rng.standard_normal(dims)).astype(np.float32))
        else:
            w.write_tensor_data(blocks(rng, dims[0], dims[1], qt))  # type: ignore[misc]
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out", type=Path)
    ap.add_argument(
        "--quant", choices=["q4_0", "q4_1", "q8_0", "q4_k_m", "q5_k_m"], default="q4_k_m"
    )
    ap.add_argument("--split", type=int, default=1, help="write N gguf-split parts")
    args = ap.parse_args()
    write(SHAPES[args.shape], args.shape, args.out, args.quant)
    print(f"{args.out}: {args.out.stat().st_size / 1e9:.2f} GB")
    if args.split > 1:
        prefix = args.out.with_suffix("")
        parts = split_gguf(args.out, prefix, args.split)
        args.out.unlink()
        for p in parts:
            print(f"{p}: {p.stat().st_size / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
