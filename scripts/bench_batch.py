"""Benchmark continuous batching in the stage engine (figures, not a test).

    .venv/bin/python scripts/bench_batch.py [--models smollm2,gemma3] [--threads 1,2]
        [--batches 1,4,8,16] [--tokens 32] [--rounds 3]

Aggregate decode tok/s of one whole-model stage (session.BatchSession) with B sequences
decoding at once, each step one forward over B rows (greedy choice included), against the
single-sequence path (StageSession, one token per call). Each (model, threads) runs in a
fresh subprocess (the kernel's thread pool only grows); the figure per batch size is the
median over ``--rounds``. Printed as a table: tok/s, and the speed-up over the
single-sequence rate (B x would be perfect scaling; decode is memory-bound, so the
weights read once per step serve every row).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODELS = Path.home() / ".cache/mvp-orchestrator/models"
BUNDLED = {
    "smollm2": MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3": MODELS / "gemma-3-270m-q4_k_m.gguf",
}
PROMPT_LEN = 8
WARMUP = 4  # untimed decode steps first (page faults, buffers, the pool's threads)


def _child(model: str, threads: int, batches: list[int], tokens: int, rounds: int) -> None:
    import torch

    from workers.node.engine import EngineOptions, load_stage

    path = str(BUNDLED.get(model, model))
    stage = load_stage(path, 0, _layers(path), EngineOptions("cpu", threads=threads))
    max_seq = PROMPT_LEN + WARMUP + tokens + 8
    out: dict[str, object] = {"model": model, "threads": threads}

    def prompt(i: int) -> list[int]:
        return [(37 * i + 11 * k) % 1000 + 10 for k in range(PROMPT_LEN)]

    # the single-sequence path
    rates = []
    for _ in range(rounds):
        s = stage.new_session(max_seq)
        tok = int(torch.argmax(s.forward_tokens(prompt(0))))
        for _ in range(WARMUP):
            tok = int(torch.argmax(s.forward_tokens([tok])))
        t0 = time.perf_counter()
        for _ in range(tokens):
            tok = int(torch.argmax(s.forward_tokens([tok])))
        rates.append(tokens / (time.perf_counter() - t0))
        s.close()
    out["single"] = statistics.median(rates)
    for b in batches:
        rates = []
        for _ in range(rounds):
            bs = stage.new_batch_session(b, max_seq)
            slots = [bs.acquire() for _ in range(b)]
            logits = bs.forward([(s, prompt(i)) for i, s in enumerate(slots)])
            nxt = {s: int(torch.argmax(logits[s])) for s in slots}
            for _ in range(WARMUP):
                logits = bs.forward([(s, [nxt[s]]) for s in slots])
                nxt = {s: int(torch.argmax(logits[s])) for s in slots}
            t0 = time.perf_counter()
            for _ in range(tokens):
                logits = bs.forward([(s, [nxt[s]]) for s in slots])
                nxt = {s: int(torch.argmax(logits[s])) for s in slots}
            rates.append(b * tokens / (time.perf_counter() - t0))
            bs.close()
        out[str(b)] = statistics.median(rates)
    print(json.dumps(out))


def _layers(path: str) -> int:
    from workers.node.engine import read_model_facts

    return read_model_facts(path).block_count


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", default="smollm2,gemma3", help="bundled names or GGUF paths")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--tokens", type=int, default=32, help="decode steps per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "THREADS"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    batches = [int(x) for x in a.batches.split(",")]
    if a.child:
        _child(a.child[0], int(a.child[1]), batches, a.tokens, a.rounds)
        return
    rows = []
    for model in a.models.split(","):
        for threads in (int(x) for x in a.threads.split(",")):
            cmd = [sys.executable, __file__, "--child", model, str(threads), "--batches",
                   a.batches, "--tokens", str(a.tokens), "--rounds", str(a.rounds)]  # fmt: skip
            env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
            res = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            if res.returncode != 0:
                print(f"{model} threads={threads}: failed\n{res.stderr[-2000:]}", file=sys.stderr)
                continue
            rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    head = f"{'model':<10} {'thr':>3} {'single':>8} " + " ".join(
        f"{'B=' + str(b):>15}" for b in batches
    )
    print("aggregate decode tok/s (x: over the single-sequence path)")
    print(head)
    for r in rows:
        single = float(r["single"])
        cells = " ".join(
            f"{float(r[str(b)]):>8.1f} ({float(r[str(b)]) / single:>4.1f}x)" for b in batches
        )
        print(f"{r['model']:<10} {r['threads']:>3} {single:>8.1f} {cells}")


if __name__ == "__main__":
    main()
