"""Compare the engine's logits with llama.cpp's, bit for bit, step by step (not a test).

    .venv/bin/python -m scripts.reference.llamacpp_trace [--model smollm2|gemma|M.gguf]
        [--prompt TEXT] [--tokens N] [--threads N] [--tensors OUT.npz]

llama-cpp-python (0.3.36, built as the README says) evaluates the prompt, then feeds its
own greedy tokens back one at a time; the engine's default path does the same. Printed
per step: whether the two logit vectors are bitwise equal, their largest difference and
both argmaxes. With ``--tensors``, llama.cpp's named intermediate tensors of every step
(``attn_norm-0``, ``Qcur-0``, ``kqv_out-0``, ``ffn_out-0``, ``l_out-0``, ...; a matrix
product's input too, keyed ``step|name|op|in|weight``) go to an .npz through llama.cpp's
eval callback: that is how DECISIONS 44's summation orders were found, one op at a time.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
MODELS = {
    "smollm2": Path.home() / ".cache/mvp-orchestrator/models/SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma": Path.home() / ".cache/mvp-orchestrator/models/gemma-3-270m-q4_k_m.gguf",
}


class _Tensor(ctypes.Structure):
    """ggml.h's struct ggml_tensor (ggml 0.25, as vendored by llama-cpp-python 0.3.36)."""


_Tensor._fields_ = [
    ("type", ctypes.c_int),
    ("buffer", ctypes.c_void_p),
    ("ne", ctypes.c_int64 * 4),
    ("nb", ctypes.c_size_t * 4),
    ("op", ctypes.c_int),
    ("op_params", ctypes.c_int32 * 16),
    ("flags", ctypes.c_int32),
    ("src", ctypes.POINTER(_Tensor) * 10),
    ("view_src", ctypes.c_void_p),
    ("view_offs", ctypes.c_size_t),
    ("data", ctypes.c_void_p),
    ("name", ctypes.c_char * 64),
    ("extra", ctypes.c_void_p),
    ("padding", ctypes.c_char * 8),
]
_F32, _F16 = 0, 1


def _array(t: _Tensor) -> np.ndarray[Any, Any] | None:
    """A float32 copy of a contiguous-or-strided F32/F16 tensor, shape [ne3, ne2, ne1, ne0]."""
    if t.type not in (_F32, _F16) or not t.data:
        return None
    size = 4 if t.type == _F32 else 2
    shape = [t.ne[3], t.ne[2], t.ne[1], t.ne[0]]
    strides = [t.nb[3], t.nb[2], t.nb[1], t.nb[0]]
    span = sum(s * (d - 1) for s, d in zip(strides, shape, strict=True)) + size
    raw = np.frombuffer((ctypes.c_char * span).from_address(t.data), dtype=np.uint8)
    view = np.lib.stride_tricks.as_strided(raw, shape=[*shape, size], strides=[*strides, 1])
    return (
        np.ascontiguousarray(view)
        .view(np.float32 if t.type == _F32 else np.float16)[..., 0]
        .astype(np.float32)
    )


def llamacpp_logits(
    model: Path, prompt_ids: list[int], n: int, threads: int, tensors: dict[str, Any] | None
) -> tuple[list[int], list[np.ndarray[Any, Any]]]:
    import llama_cpp
    from llama_cpp import Llama

    step = [0]
    callback = None
    if tensors is not None:

        @ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)  # type: ignore[untyped-decorator,unused-ignore]
        def callback(ptr: int, ask: bool, _: int) -> bool:
            if ask:
                return True
            t = ctypes.cast(ptr, ctypes.POINTER(_Tensor)).contents
            key = f"{step[0]}|{t.name.decode()}|{t.op}"
            a = _array(t)
            if a is not None:
                tensors[key] = a
            src0, src1 = t.src[0], t.src[1]
            if src0 and src1 and src0.contents.name.decode().endswith(".weight"):
                b = _array(src1.contents)
                if b is not None:
                    tensors[f"{key}|in|{src0.contents.name.decode()}"] = b
            return True

        import llama_cpp.llama_cpp as low_level  # the bindings Llama() reads its defaults from

        defaults = low_level.llama_context_default_params

        def with_callback() -> Any:
            p = defaults()
            p.cb_eval = callback
            return p

        low_level.llama_context_default_params = with_callback  # read by Llama()
    llm = Llama(model_path=str(model), n_ctx=512, seed=0, n_threads=threads, verbose=False)
    n_vocab = llm.n_vocab()
    ids: list[int] = []
    out: list[np.ndarray[Any, Any]] = []
    llm.reset()
    llm.eval(prompt_ids)
    for _ in range(n):
        step[0] += 1
        ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        logits = np.ctypeslib.as_array(ptr, shape=(n_vocab,)).copy()
        out.append(logits)
        ids.append(int(logits.argmax()))
        llm.eval([ids[-1]])
    return ids, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 | gemma | a GGUF path")
    ap.add_argument("--prompt", default="The French Revolution began in")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tensors", type=Path, help="also write llama.cpp's tensors here")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from workers.node.engine import EngineOptions, load_stage, read_model_facts
    from workers.node.engine.tokenizer import Tokenizer

    model = MODELS.get(args.model, Path(args.model))
    prompt_ids = Tokenizer.from_gguf(str(model)).encode(args.prompt)
    tensors: dict[str, Any] | None = {} if args.tensors else None
    ids, ref = llamacpp_logits(model, prompt_ids, args.tokens, args.threads, tensors)
    if args.tensors and tensors is not None:
        np.savez(args.tensors, **tensors)
    n_layers = read_model_facts(str(model)).block_count
    opts = EngineOptions(device="cpu", threads=args.threads)
    stage = load_stage(str(model), 0, n_layers, opts)
    session = stage.new_session(len(prompt_ids) + args.tokens)
    logits = session.forward_tokens(prompt_ids)
    print(f"{model.name}: {len(prompt_ids)} prompt tokens, llama.cpp's greedy continuation")
    for step, (token, theirs) in enumerate(zip(ids, ref, strict=True)):
        ours = logits.float().numpy()
        same = bool(np.array_equal(ours, theirs))
        diff = float(np.abs(ours - theirs).max())
        print(
            f"step {step:3}  {'bit-equal' if same else 'differ':9}  max |diff| {diff:.3g}  "
            f"argmax {int(ours.argmax())} / {token}"
        )
        logits = session.forward_tokens([token])
    session.close()
    stage.close()


if __name__ == "__main__":
    main()
