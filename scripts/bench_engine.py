"""Benchmark the stage engine (not a test): load time, RSS, prefill and decode tok/s.

    .venv/bin/python scripts/bench_engine.py [--model M.gguf] [--threads N] [--tokens 64]

Each configuration runs in a fresh subprocess so RSS is measured above that process's own
baseline (after imports, before loading weights; DECISIONS 24). Configurations: the engine
as 1, 2 and 3 stages in one process (float16 between stages), plus llama-cpp-python and HF
transformers (float32) when importable, on the same prompt token ids. Each runs with
OMP_WAIT_POLICY=PASSIVE unless set, as the nodes do.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_MODEL = str(Path.home() / ".cache/mvp-orchestrator/models/SmolLM2-135M-Instruct.Q4_1.gguf")
PROMPT = (
    "The history of the city begins with a small settlement on the banks of a wide river. "
    "Farmers and traders arrived from the surrounding hills, built wooden houses and a market, "
    "and within a century the village had become a busy town with stone walls, a harbour and "
    "a council that met every spring to decide on taxes, roads and the price of bread. Over time"
)


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _prompt_ids(model: str) -> list[int]:
    try:
        from workers.engine.tokenizer import Tokenizer

        return list(Tokenizer.from_gguf(model).encode(PROMPT, add_special=False))
    except Exception:
        import llama_cpp

        llm = llama_cpp.Llama(model, vocab_only=True, verbose=False)
        return list(llm.tokenize(PROMPT.encode(), add_bos=False))


def run_engine(
    model: str, n_stages: int, threads: int, tokens: int, ids: list[int]
) -> dict[str, Any]:
    import torch

    from workers.engine import EngineOptions, SamplingParams, generate, load_stage, read_model_facts
    from workers.engine.gguf_reader import GGUFFile

    torch.set_num_threads(threads)
    facts = read_model_facts(model)
    n = facts.block_count
    bounds = [(n * i // n_stages, n * (i + 1) // n_stages) for i in range(n_stages)]
    gc.collect()
    base = _rss()
    opts = EngineOptions(device="cpu", threads=threads)
    f = GGUFFile(model, map_tensors=False)
    stages = []
    load_s = 0.0
    stage_ratios = []
    for a, b in bounds:
        before = _rss()
        t0 = time.perf_counter()
        stages.append(load_stage(model, a, b, opts))
        load_s += time.perf_counter() - t0
        gc.collect()
        own = sum(f.tensors[nm].n_bytes for nm in stages[-1].tensor_names_loaded)
        stage_ratios.append((_rss() - before) / own)
    rss = _rss() - base
    names = set().union(*(s.tensor_names_loaded for s in stages))
    weight_bytes = sum(f.tensors[nm].n_bytes for nm in names)
    # Prefill: the prompt through all stages once (fp16 between stages, as in generate).
    sessions = [s.new_session(len(ids) + tokens + 8) for s in stages]
    with torch.inference_mode():
        for _ in range(2):  # warm-up, then timed
            for s in sessions:
                s.reset()
            t0 = time.perf_counter()
            out = sessions[0].forward_tokens(ids)
            for s in sessions[1:]:
                out = s.forward_hidden(out.to(torch.float16))
            prefill_s = time.perf_counter() - t0
    for s in sessions:
        s.close()
    times: list[float] = []
    last = time.perf_counter()
    for _ in generate(
        stages, ids, max_new_tokens=tokens, max_seq_len=len(ids) + tokens + 8,
        sampling=SamplingParams(), stop_ids=[],
    ):  # fmt: skip
        now = time.perf_counter()
        times.append(now - last)
        last = now
    decode = times[1:]  # the first includes prefill
    rss_after = _rss() - base
    return {
        "name": f"engine {n_stages} stage{'s' if n_stages > 1 else ''}",
        "load_s": load_s,
        "rss_mb": rss / 2**20,
        "rss_run_mb": rss_after / 2**20,
        "weights_mb": weight_bytes / 2**20,
        "rss_ratio": rss / weight_bytes,
        "stage_ratio_max": max(stage_ratios),
        "prefill_tps": len(ids) / prefill_s,
        "decode_tps": len(decode) / sum(decode),
    }


def run_llama_cpp(model: str, threads: int, tokens: int, ids: list[int]) -> dict[str, Any]:
    import llama_cpp

    base = _rss()
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(
        model, n_ctx=len(ids) + tokens + 8, n_threads=threads, n_batch=512, verbose=False
    )
    load_s = time.perf_counter() - t0
    rss = _rss() - base
    for _ in range(2):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        prefill_s = time.perf_counter() - t0
    times: list[float] = []
    tok = int(llm.scores[llm.n_tokens - 1].argmax())
    for _ in range(tokens):
        t0 = time.perf_counter()
        llm.eval([tok])
        tok = int(llm.scores[llm.n_tokens - 1].argmax())
        times.append(time.perf_counter() - t0)
    return {
        "name": f"llama-cpp-python {llama_cpp.__version__}",
        "load_s": load_s,
        "rss_mb": rss / 2**20,
        "prefill_tps": len(ids) / prefill_s,
        "decode_tps": len(times) / sum(times),
    }


def run_hf(model: str, threads: int, tokens: int, ids: list[int]) -> dict[str, Any]:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    base = _rss()
    folder, name = os.path.split(os.path.abspath(model))
    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    load_s = time.perf_counter() - t0
    rss = _rss() - base
    x = torch.tensor([ids])
    with torch.inference_mode():
        for _ in range(2):
            t0 = time.perf_counter()
            out = hf(x, use_cache=True)
            prefill_s = time.perf_counter() - t0
        past = out.past_key_values
        tok = out.logits[0, -1].argmax().view(1, 1)
        times: list[float] = []
        for _ in range(tokens):
            t0 = time.perf_counter()
            out = hf(tok, past_key_values=past, use_cache=True)
            past = out.past_key_values
            tok = out.logits[0, -1].argmax().view(1, 1)
            times.append(time.perf_counter() - t0)
    return {
        "name": f"HF transformers {transformers.__version__} f32",
        "load_s": load_s,
        "rss_mb": rss / 2**20,
        "prefill_tps": len(ids) / prefill_s,
        "decode_tps": len(times) / sum(times),
    }


def _child(args: argparse.Namespace) -> None:
    ids = json.loads(args.ids)
    kind = args.one
    if kind.startswith("engine"):
        res = run_engine(args.model, int(kind[6:]), args.threads, args.tokens, ids)
    elif kind == "llama_cpp":
        res = run_llama_cpp(args.model, args.threads, args.tokens, ids)
    else:
        res = run_hf(args.model, args.threads, args.tokens, ids)
    print("RESULT " + json.dumps(res))


def bench(model: str, threads: int, tokens: int, only: list[str]) -> dict[str, Any]:
    """Run each configuration of ``only`` (engine1, engine2, engine3, llama_cpp, hf) in its
    own subprocess; returns the rows measured and why the others were skipped."""
    Path(model).read_bytes()  # warm the page cache: load times are for a cached file
    ids = _prompt_ids(model)
    env = dict(os.environ)
    env["PYTHONPATH"] = (
        str(Path(__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    )
    # As the process provider starts nodes: OpenMP threads that spin while they wait stall
    # behind every other process of a busy machine (torch's and llama.cpp's alike).
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    for kind in only:
        cmd = [sys.executable, __file__, "--model", model, "--threads", str(threads),
               "--tokens", str(tokens), "--one", kind, "--ids", json.dumps(ids)]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            err = (proc.stderr.strip().splitlines() or ["?"])[-1]
            print(f"{kind}: skipped ({err})", file=sys.stderr)
            skipped[kind] = err
            continue
        rows.append({"kind": kind, "threads": threads, **json.loads(lines[-1][7:])})
    return {
        "model": Path(model).name,
        "threads": threads,
        "tokens": tokens,
        "prompt_tokens": len(ids),
        "rows": rows,
        "skipped": skipped,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens per run")
    ap.add_argument("--only", default="engine1,engine2,engine3,llama_cpp,hf")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        _child(args)
        return
    result = bench(args.model, args.threads, args.tokens, args.only.split(","))
    rows = result["rows"]
    print(f"\nmodel {Path(args.model).name}, threads {args.threads}, prompt "
          f"{result['prompt_tokens']} tokens, decode {args.tokens} tokens greedy")  # fmt: skip
    head = (
        f"{'runtime':34} {'load s':>7} {'RSS MB':>7} {'w MB':>6} {'RSS/w':>6} {'stage max':>9} "
        f"{'prefill t/s':>12} {'decode t/s':>11}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        w = f"{r['weights_mb']:6.1f}" if "weights_mb" in r else f"{'':6}"
        ratio = f"{r['rss_ratio']:6.2f}" if "rss_ratio" in r else f"{'':6}"
        smax = f"{r['stage_ratio_max']:9.2f}" if "stage_ratio_max" in r else f"{'':9}"
        print(f"{r['name']:34} {r['load_s']:7.3f} {r['rss_mb']:7.1f} {w} {ratio} {smax} "
              f"{r['prefill_tps']:12.1f} {r['decode_tps']:11.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
