"""Check the engine on CUDA: SmolLM2 greedy text on cuda equals the CPU result; print tok/s.

    .venv/bin/python scripts/check_cuda.py [--model M.gguf] [--tokens 32]

Exit status 0 when the texts match, 1 when they differ, 2 when no CUDA device is present.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.node.engine import (
    EngineOptions,
    SamplingParams,
    Stage,
    generate,
    load_stage,
    read_model_facts,
)

DEFAULT_MODEL = str(Path.home() / ".cache/mvp-orchestrator/models/SmolLM2-135M-Instruct.Q4_1.gguf")
PROMPT_IDS = [6403, 1980, 253, 655]  # "Once upon a time" (SmolLM2, no BOS)


def _run(stage: Stage, tokens: int) -> tuple[list[int], float]:
    out: list[int] = []
    first = 0.0
    for tok in generate(
        [stage], PROMPT_IDS, max_new_tokens=tokens, max_seq_len=256,
        sampling=SamplingParams(), stop_ids=[],
    ):  # fmt: skip
        if not out:
            first = time.perf_counter()
        out.append(tok)
    rate = (len(out) - 1) / (time.perf_counter() - first) if len(out) > 1 else 0.0
    return out, rate


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device visible to torch; nothing to check")
        return 2
    n = read_model_facts(args.model).block_count
    texts: dict[str, list[int]] = {}
    for device in ("cpu", "cuda"):
        for precision in ("default", "float32"):
            t0 = time.perf_counter()
            stage = load_stage(args.model, 0, n, EngineOptions(device=device, precision=precision))
            load_s = time.perf_counter() - t0
            _run(stage, 4)  # warm-up (CUDA kernels, allocator)
            ids, rate = _run(stage, args.tokens)
            texts[f"{device}/{precision}"] = ids
            print(
                f"{device:4} {precision:8} load {load_s:.2f}s decode {rate:7.1f} tok/s  ids {ids}"
            )
            stage.close()
    ok = (
        texts["cuda/default"] == texts["cpu/default"]
        and texts["cuda/float32"] == texts["cpu/float32"]
    )
    try:
        from workers.node.engine.tokenizer import Tokenizer

        tok = Tokenizer.from_gguf(args.model)
        for k, v in texts.items():
            print(f"{k:14} {tok.decode(v)!r}")
    except Exception as exc:  # the tokenizer is optional here
        print(f"(no tokenizer: {exc})")
    print("MATCH" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
