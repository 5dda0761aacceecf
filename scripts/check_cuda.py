"""Check the engine on CUDA: SmolLM2 greedy text on cuda equals the CPU result; print tok/s
and each stage's device memory against its GGUF bytes (the default precision keeps
quantised weights quantised on the device: kernels.QuantLinear).

    .venv/bin/python scripts/check_cuda.py [--model M.gguf] [--tokens 32] [--stages 2]

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
    ap.add_argument("--stages", type=int, default=2, help="stages for the memory figures")
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
    device_memory(args.model, n, args.stages)
    print("MATCH" if ok else "MISMATCH")
    return 0 if ok else 1


def device_memory(model: str, n: int, stages: int) -> None:
    """Each of ``stages`` even stages loaded alone on the GPU at the default precision:
    device memory after loading, and at its peak over a 256-position prefill, against the
    GGUF bytes of the stage's tensors."""
    from mvp_core.stage_share import stage_tensors
    from mvp_io.gguf_files import open_model

    with open_model(model) as files:
        header = files.header
    bounds = [round(i * n / stages) for i in range(stages + 1)]
    for i in range(stages):
        a, b = bounds[i], bounds[i + 1]
        gguf = sum(
            t.n_bytes for t in stage_tensors(header, a, b, first=i == 0, last=i == stages - 1)
        )
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        stage = load_stage(model, a, b, EngineOptions(device="cuda"))
        held = torch.cuda.memory_allocated() - base
        session = stage.new_session(256)
        if i == 0:
            session.forward_tokens(list(range(1, 129)))
        peak = torch.cuda.max_memory_allocated() - base
        print(
            f"stage {i} layers {a}-{b - 1}: GGUF {gguf / 1e6:.1f} MB, on the device "
            f"{held / 1e6:.1f} MB after loading ({held / gguf:.2f}x), peak {peak / 1e6:.1f} MB"
        )
        session.close()
        stage.close()


if __name__ == "__main__":
    sys.exit(main())
