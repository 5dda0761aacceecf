"""Tiny random GGUF models written with gguf.GGUFWriter, and an independent reference.

The reference forward is plain numpy in float64 over weights dequantized with
``gguf.quants.dequantize``; it implements rope the way llama.cpp does (adjacent pairs for
llama, half split for qwen), so it shares nothing with the engine but the file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import quants

BLOCK = {
    QT.Q4_0: 32, QT.Q4_1: 32, QT.Q5_0: 32, QT.Q5_1: 32, QT.Q8_0: 32,
    QT.Q4_K: 256, QT.Q5_K: 256, QT.Q6_K: 256,
}  # fmt: skip
_K_BYTES = {QT.Q4_K: 144, QT.Q5_K: 176, QT.Q6_K: 210}


@dataclass
class TinySpec:
    arch: str = "llama"
    n_layers: int = 3
    hidden: int = 256
    n_head: int = 4
    n_kv_head: int = 2
    head_dim: int = 64
    ffn: int = 512
    vocab: int = 320
    qtype: QT = QT.Q4_1
    embd_type: QT = QT.Q8_0
    tied: bool = True
    rope_base: float = 10000.0
    rope_scaling_factor: float | None = None  # linear scaling
    rope_freq_factors: bool = False  # Llama 3 style rope_freqs tensor
    rope_dim: int | None = None  # partial rotary when < head_dim
    eps: float = 1e-5
    seed: int = 0
    context_length: int = 128
    extra_kv: dict[str, int] = field(default_factory=dict)
    # a SentencePiece vocabulary of ``vocab`` tokens, so that llama.cpp loads the file
    # (scripts/reference/arch_logits.py); the engine's forward never reads it
    llamacpp_vocab: bool = False
    sliding_window: int = 0  # gemma3: attention.sliding_window (0: not written)
    # another type for some matrices, by name without "blk.N." and ".weight" (a Q4_K_M
    # file's attn_v and ffn_down in Q6_K): {"attn_v": QT.Q6_K, "output": QT.Q6_K}
    overrides: dict[str, QT] = field(default_factory=dict)
    # realistic dimensions (realistic_cases.py): K-format matrices written as random
    # blocks without their float values or a float64 copy (hundreds of millions of
    # weights); the numpy reference forward is then unavailable
    lean: bool = False


def _random_k_blocks(qtype: QT, n_blocks: int, rng: np.random.Generator, amp: float) -> np.ndarray:
    """Random K-quant blocks with small, finite float16 scales."""
    b = rng.integers(0, 256, (n_blocks, _K_BYTES[qtype]), dtype=np.uint8)

    def f16(values: np.ndarray) -> np.ndarray:
        return values.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)

    if qtype == QT.Q6_K:
        b[:, 192:208] = rng.integers(-20, 20, (n_blocks, 16)).astype(np.int8).view(np.uint8)
        b[:, 208:210] = f16(rng.uniform(0.5, 1.0, n_blocks) * amp / (20 * 32))
    else:
        levels = 16 if qtype == QT.Q4_K else 32
        b[:, 0:2] = f16(rng.uniform(0.5, 1.0, n_blocks) * 2 * amp / (63 * levels))
        b[:, 2:4] = f16(rng.uniform(0.5, 1.0, n_blocks) * amp / 63)
    return b


def quantize(values: np.ndarray, qtype: QT, rng: np.random.Generator) -> np.ndarray:
    """Bytes (or float array) of ``values`` [rows, cols] in ``qtype``."""
    if qtype == QT.F32:
        return values.astype(np.float32)
    if qtype == QT.F16:
        return values.astype(np.float16)
    if qtype in _K_BYTES:
        rows, cols = values.shape
        amp = float(np.abs(values).max())
        blocks = _random_k_blocks(qtype, rows * cols // 256, rng, amp)
        return blocks.reshape(rows, -1)
    return np.asarray(quants.quantize(values.astype(np.float32), qtype))


def spm_vocab(size: int) -> tuple[list[str], list[float], list[int]]:
    """<unk>, <s>, </s>, the 256 byte tokens, <|endoftext|> (llama.cpp looks it up in a
    phi3 vocabulary), then plain pieces up to ``size`` tokens."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["<|endoftext|>"]
    types = [2, 3, 3] + [6] * 256 + [3]
    while len(tokens) < size:
        tokens.append(f"\u2581w{len(tokens)}")
        types.append(1)
    scores = [0.0] * 260 + [-float(i) for i in range(size - 260)]
    return tokens[:size], scores[:size], types[:size]


def dequant(arr: np.ndarray, qtype: QT, shape: tuple[int, ...]) -> np.ndarray:
    if qtype in (QT.F32, QT.F16):
        return arr.astype(np.float64).reshape(shape)
    return quants.dequantize(arr, qtype).astype(np.float64).reshape(shape)


class TinyModel:
    """A written GGUF file plus the float64 weights it holds."""

    def __init__(self, spec: TinySpec, path: Path) -> None:
        self.spec = spec
        self.path = str(path)
        self.w: dict[str, np.ndarray] = {}
        rng = np.random.default_rng(spec.seed)
        arch = spec.arch
        writer = gguf.GGUFWriter(self.path, arch)
        writer.add_string("general.name", f"tiny-{arch}")
        writer.add_uint32(f"{arch}.block_count", spec.n_layers)
        writer.add_uint32(f"{arch}.context_length", spec.context_length)
        writer.add_uint32(f"{arch}.embedding_length", spec.hidden)
        writer.add_uint32(f"{arch}.feed_forward_length", spec.ffn)
        writer.add_uint32(f"{arch}.attention.head_count", spec.n_head)
        writer.add_uint32(f"{arch}.attention.head_count_kv", spec.n_kv_head)
        writer.add_uint32(f"{arch}.attention.key_length", spec.head_dim)
        writer.add_uint32(f"{arch}.attention.value_length", spec.head_dim)
        writer.add_uint32(f"{arch}.rope.dimension_count", spec.rope_dim or spec.head_dim)
        writer.add_float32(f"{arch}.rope.freq_base", spec.rope_base)
        writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", spec.eps)
        if spec.rope_scaling_factor is not None:
            writer.add_string(f"{arch}.rope.scaling.type", "linear")
            writer.add_float32(f"{arch}.rope.scaling.factor", spec.rope_scaling_factor)
        writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
        if spec.llamacpp_vocab:
            tokens, scores, types = spm_vocab(spec.vocab)
            writer.add_tokenizer_model("llama")
            writer.add_token_list(tokens)
            writer.add_token_scores(scores)
            writer.add_token_types(types)
            writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
        if spec.sliding_window:
            writer.add_uint32(f"{arch}.attention.sliding_window", spec.sliding_window)
        for k, v in spec.extra_kv.items():
            writer.add_uint32(k, v)

        def add(name: str, shape: tuple[int, ...], qtype: QT, scale: float = 0.08) -> None:
            if spec.lean and len(shape) == 2:
                qtype = spec.overrides.get(name.split(".")[-2], qtype)
                if qtype not in _K_BYTES or shape[1] % 256:
                    raise ValueError(
                        f"a lean file's matrices are K formats, not {qtype.name} {shape}"
                    )
                # the largest of many normal values is about 5 sigma
                blocks = _random_k_blocks(qtype, shape[0] * shape[1] // 256, rng, 5 * scale)
                blocks = blocks.reshape(shape[0], -1)
                writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=qtype)
                return
            values = rng.standard_normal(shape).astype(np.float32) * scale
            if len(shape) == 1:
                data = values.astype(np.float32)
                writer.add_tensor(name, data)
                self.w[name] = data.astype(np.float64)
                return
            qtype = spec.overrides.get(name.split(".")[-2], qtype)
            data = quantize(values, qtype, rng)
            self.w[name] = dequant(data, qtype, shape)
            if data.dtype == np.uint8:
                writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
            else:
                writer.add_tensor(name, data)

        def add_norm(name: str, size: int) -> None:
            data = (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32)
            writer.add_tensor(name, data)
            self.w[name] = data.astype(np.float64)

        h, hd, qd, kvd = (
            spec.hidden,
            spec.head_dim,
            spec.n_head * spec.head_dim,
            spec.n_kv_head * spec.head_dim,
        )
        add("token_embd.weight", (spec.vocab, h), spec.embd_type, scale=0.5)
        if spec.rope_freq_factors:
            factors = np.linspace(1.0, 4.0, (spec.rope_dim or hd) // 2).astype(np.float32)
            writer.add_tensor("rope_freqs.weight", factors)
            self.w["rope_freqs.weight"] = factors.astype(np.float64)
        for i in range(spec.n_layers):
            p = f"blk.{i}."
            add_norm(p + "attn_norm.weight", h)
            if arch == "phi3":  # fused q/k/v rows and gate/up rows
                add(p + "attn_qkv.weight", (qd + 2 * kvd, h), spec.qtype)
            else:
                add(p + "attn_q.weight", (qd, h), spec.qtype)
                add(p + "attn_k.weight", (kvd, h), spec.qtype)
                add(p + "attn_v.weight", (kvd, h), spec.qtype)
            if arch == "qwen2":
                add(p + "attn_q.bias", (qd,), QT.F32, 0.2)
                add(p + "attn_k.bias", (kvd,), QT.F32, 0.2)
                add(p + "attn_v.bias", (kvd,), QT.F32, 0.2)
            if arch in ("qwen3", "gemma3"):
                add_norm(p + "attn_q_norm.weight", hd)
                add_norm(p + "attn_k_norm.weight", hd)
            add(p + "attn_output.weight", (h, qd), spec.qtype)
            if arch == "gemma3":
                add_norm(p + "post_attention_norm.weight", h)
            add_norm(p + "ffn_norm.weight", h)
            if arch == "phi3":
                add(p + "ffn_up.weight", (2 * spec.ffn, h), spec.qtype)
            else:
                add(p + "ffn_gate.weight", (spec.ffn, h), spec.qtype)
                add(p + "ffn_up.weight", (spec.ffn, h), spec.qtype)
            add(p + "ffn_down.weight", (h, spec.ffn), spec.qtype)
            if arch == "gemma3":
                add_norm(p + "post_ffw_norm.weight", h)
        add_norm("output_norm.weight", h)
        if not spec.tied:
            add("output.weight", (spec.vocab, h), spec.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    # ----- reference forward (float64 numpy) -----

    def _rms(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return np.asarray(x / np.sqrt((x * x).mean(-1, keepdims=True) + self.spec.eps) * w)

    def _rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """x [T, heads, hd]; llama.cpp 'normal' rope for llama, NEOX for qwen."""
        s = self.spec
        rot = s.rope_dim or s.head_dim
        inv = s.rope_base ** (-np.arange(0, rot, 2, dtype=np.float64) / rot)
        if "rope_freqs.weight" in self.w:
            inv = inv / self.w["rope_freqs.weight"]
        if s.rope_scaling_factor is not None:
            inv = inv / s.rope_scaling_factor
        ang = positions[:, None, None] * inv[None, None, :]
        c, sn = np.cos(ang), np.sin(ang)
        out = x.copy()
        if s.arch in ("qwen2", "qwen3"):
            a, b = x[..., : rot // 2], x[..., rot // 2 : rot]
            out[..., : rot // 2] = a * c - b * sn
            out[..., rot // 2 : rot] = b * c + a * sn
        else:
            a, b = x[..., 0:rot:2], x[..., 1:rot:2]
            out[..., 0:rot:2] = a * c - b * sn
            out[..., 1:rot:2] = b * c + a * sn
        return out

    def hidden_after(self, ids: list[int], n_layers: int) -> np.ndarray:
        s, w = self.spec, self.w
        if s.arch not in ("llama", "qwen2", "qwen3"):  # gemma3, phi3: llama.cpp's record
            raise NotImplementedError(f"no numpy reference for {s.arch}")
        t = len(ids)
        x = w["token_embd.weight"][ids]
        pos = np.arange(t, dtype=np.float64)
        g = s.n_head // s.n_kv_head
        for i in range(n_layers):
            p = f"blk.{i}."
            a = self._rms(x, w[p + "attn_norm.weight"])
            q = a @ w[p + "attn_q.weight"].T
            k = a @ w[p + "attn_k.weight"].T
            v = a @ w[p + "attn_v.weight"].T
            if p + "attn_q.bias" in w:
                q, k, v = (
                    q + w[p + "attn_q.bias"],
                    k + w[p + "attn_k.bias"],
                    v + w[p + "attn_v.bias"],
                )
            q = q.reshape(t, s.n_head, s.head_dim)
            k = k.reshape(t, s.n_kv_head, s.head_dim)
            v = v.reshape(t, s.n_kv_head, s.head_dim)
            if p + "attn_q_norm.weight" in w:
                q = self._rms(q, w[p + "attn_q_norm.weight"])
                k = self._rms(k, w[p + "attn_k_norm.weight"])
            q, k = self._rope(q, pos), self._rope(k, pos)
            k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
            scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(s.head_dim)
            scores = scores + np.triu(np.full((t, t), -np.inf), 1)[None]
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            probs = scores / scores.sum(-1, keepdims=True)
            o = np.einsum("hts,shd->thd", probs, v).reshape(t, -1)
            x = x + o @ w[p + "attn_output.weight"].T
            f = self._rms(x, w[p + "ffn_norm.weight"])
            gate, up = f @ w[p + "ffn_gate.weight"].T, f @ w[p + "ffn_up.weight"].T
            x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "ffn_down.weight"].T
        return x

    def logits(self, ids: list[int]) -> np.ndarray:
        """Logits of the last position."""
        x = self.hidden_after(ids, self.spec.n_layers)[-1]
        head = self.w.get("output.weight", self.w["token_embd.weight"])
        return np.asarray(self._rms(x, self.w["output_norm.weight"]) @ head.T)
