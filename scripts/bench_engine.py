"""Benchmark the stage engine (not a test): load time, RSS, prefill and decode tok/s.

    .venv/bin/python scripts/bench_engine.py [--models smollm2,gemma3 | --model M.gguf]
        [--threads 1,2] [--rounds 3] [--tokens 64]
        [--only engine1,engine2,engine3,llama_bench,llama_cpp] [--stage-rss 1,2,3] [--json OUT]

By default: both bundled models (SmolLM2 135M Q4_1, Gemma 3 270M Q4_K_M), at 1 and 2
threads, the engine as 1, 2 and 3 stages in one process (float16 between stages) side by
side with llama.cpp: its C++ ``llama-bench`` (the native build, where it is built: set
LLAMA_BENCH to it or put it on PATH; docs/benchmarks/engine.md says how) and
llama-cpp-python when it is installed, in interleaved rounds (every configuration once
per round, in a rotated order, so drifting machine load hits all alike). Printed per
model and thread count: medians over the rounds, and each engine configuration's paired
ratio to each llama.cpp (the median of its per-round ratios), then the engine at its best
thread count against llama.cpp at its own best. HF transformers (float32) joins with
``--only ...,hf``. Then every stage of a 1-, 2- and 3-stage split alone in a process, as
a node runs it: its RSS against its weights and KV cache.

Each configuration runs in a fresh subprocess so RSS is measured above that process's own
baseline (after imports, before loading weights; DECISIONS 24); the engine's with
OMP_WAIT_POLICY=PASSIVE unless set, as the nodes do, llama.cpp's with its own default.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
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


def _hwm() -> int:
    """This process's peak RSS in bytes (VmHWM of /proc/self/status)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _prompt_ids(model: str) -> list[int]:
    try:
        from workers.node.engine.tokenizer import Tokenizer

        return list(Tokenizer.from_gguf(model).encode(PROMPT, add_special=False))
    except Exception:
        import llama_cpp

        llm = llama_cpp.Llama(model, vocab_only=True, verbose=False)
        return list(llm.tokenize(PROMPT.encode(), add_bos=False))


def run_engine(
    model: str, n_stages: int, threads: int, tokens: int, ids: list[int]
) -> dict[str, Any]:
    import torch

    from workers.node.engine import (
        EngineOptions,
        SamplingParams,
        generate,
        load_stage,
        read_model_facts,
    )
    from workers.node.engine.gguf_reader import GGUFFile

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
    # this process's peak so far (VmHWM: not ru_maxrss, which keeps the peak of the
    # process that started it), above the baseline: the imports before it stayed below it
    peak = _hwm() - base
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
        "peak_load_mb": peak / 2**20,
        "weights_mb": weight_bytes / 2**20,
        "rss_ratio": rss / weight_bytes,
        "stage_ratio_max": max(stage_ratios),
        "prefill_tps": len(ids) / prefill_s,
        "decode_tps": len(decode) / sum(decode),
    }


def run_stage_memory(
    model: str, index: int, n_stages: int, tokens: int, ids: list[int]
) -> dict[str, Any]:
    """One stage of an n-stage split alone in this process, as a node runs it: its RSS
    above the process's baseline (after imports) once it has loaded its layers, run the
    prompt and ``tokens`` decode steps, against its own tensors' bytes and its KV cache's
    (float32, allocated for the prompt and the decode)."""
    import torch

    from workers.node.engine import EngineOptions, load_stage, read_model_facts
    from workers.node.engine.gguf_reader import GGUFFile

    facts = read_model_facts(model)
    n = facts.block_count
    a, b = n * index // n_stages, n * (index + 1) // n_stages
    gc.collect()
    base = _rss()
    stage = load_stage(model, a, b, EngineOptions(device="cpu", threads=1))
    f = GGUFFile(model, map_tensors=False)
    weights = sum(f.tensors[nm].n_bytes for nm in stage.tensor_names_loaded)
    max_seq = len(ids) + tokens + 8
    session = stage.new_session(max_seq)
    cfg = stage.cfg
    kv = 2 * (b - a) * cfg.n_kv_head * max_seq * cfg.head_dim * 4
    with torch.inference_mode():
        if stage.is_first:
            session.forward_tokens(ids)
            for _ in range(tokens):
                session.forward_tokens([ids[-1]])
        else:
            gen = torch.Generator().manual_seed(0)
            session.forward_hidden(torch.randn(len(ids), cfg.hidden, generator=gen))
            for _ in range(tokens):
                session.forward_hidden(torch.randn(1, cfg.hidden, generator=gen))
    gc.collect()
    rss = _rss() - base
    return {
        "stage": index,
        "stages": n_stages,
        "layers": f"{a}-{b - 1}",
        "weights_mb": weights / 2**20,
        "kv_mb": kv / 2**20,
        "rss_mb": rss / 2**20,
        "overhead_mb": (rss - weights - kv) / 2**20,
    }


def stage_memory(model: str, splits: list[int], tokens: int) -> list[dict[str, Any]]:
    """Every stage of each n-stage split, each in its own process (run_stage_memory)."""
    ids = _prompt_ids(model)
    rows = []
    for n in splits:
        for i in range(n):
            cmd = [sys.executable, __file__, "--model", model, "--tokens", str(tokens), "--threads", "1",
                   "--one", f"stage:{i}:{n}", "--ids", json.dumps(ids)]  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                err = (proc.stderr.strip().splitlines() or ["?"])[-1]
                raise RuntimeError(f"stage {i} of {n}: {err}")
            rows.append({"model": Path(model).name, **json.loads(lines[-1][7:])})
    return rows


def summarize_memory(rows: list[dict[str, Any]]) -> list[str]:
    out = ["\nPer-stage RSS (each stage alone in a process, above its baseline after imports)"]
    head = (f"{'model':34} {'split':>5} {'layers':>7} {'weights MB':>10} {'KV MB':>6} "
            f"{'RSS MB':>7} {'RSS - weights - KV':>18}")  # fmt: skip
    out += [head, "-" * len(head)]
    for r in rows:
        out.append(
            f"{r['model']:34} {r['stage'] + 1:>2}/{r['stages']:<2} {r['layers']:>7} "
            f"{r['weights_mb']:10.1f} {r['kv_mb']:6.1f} {r['rss_mb']:7.1f} "
            f"{r['overhead_mb']:15.1f} MB"
        )
    return out


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
    import numpy as np

    n_vocab = llm.n_vocab()

    def last_argmax() -> int:  # greedy, from the last position's logits
        ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.ctypeslib.as_array(ptr, shape=(n_vocab,)).argmax())

    times: list[float] = []
    tok = last_argmax()
    for _ in range(tokens):
        t0 = time.perf_counter()
        llm.eval([tok])
        tok = last_argmax()
        times.append(time.perf_counter() - t0)
    return {
        "name": f"llama-cpp-python {llama_cpp.__version__}",
        "load_s": load_s,
        "rss_mb": rss / 2**20,
        "prefill_tps": len(ids) / prefill_s,
        "decode_tps": len(times) / sum(times),
    }


def llama_bench_path() -> str | None:
    """llama.cpp's C++ ``llama-bench`` (its native build: see docs/benchmarks/engine.md):
    $LLAMA_BENCH, else on PATH."""
    found = os.environ.get("LLAMA_BENCH") or shutil.which("llama-bench")
    return found if found and os.access(found, os.X_OK) else None


def run_llama_bench(model: str, threads: int, tokens: int, ids: list[int]) -> dict[str, Any]:
    """The C++ llama-bench, as a user of llama.cpp's best build measures it: prefill of the
    prompt's length (pp), then decode of ``tokens`` after that many positions (tg at depth
    len(ids), as the engine decodes after its prompt), 3 repetitions each after its own
    warm-up; RSS is the peak of its processes (no baseline to subtract: it is C++)."""
    exe = llama_bench_path()
    if exe is None:
        raise RuntimeError("llama-bench not found (set LLAMA_BENCH; docs/benchmarks/engine.md)")
    n = len(ids)

    def one(extra: list[str]) -> dict[str, Any]:
        cmd = [exe, "-m", model, "-t", str(threads), "-r", "3", "-o", "json", *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
        rows: list[dict[str, Any]] = json.loads(proc.stdout)
        return rows[0]

    pp = one(["-p", str(n), "-n", "0"])
    tg = one(["-p", "0", "-n", str(tokens), "-d", str(n)])
    peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {
        "name": f"llama-bench {pp.get('build_commit', '?')}",
        "load_s": float("nan"),
        "rss_mb": peak_kb / 1024,
        "prefill_tps": float(pp["avg_ts"]),
        "decode_tps": float(tg["avg_ts"]),
        "flash_attn": pp.get("flash_attn"),
        "repack": pp.get("repack"),
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
    if kind.startswith("stage:"):
        _, i, n = kind.split(":")
        res = run_stage_memory(args.model, int(i), int(n), args.tokens, ids)
    elif kind.startswith("engine"):
        res = run_engine(args.model, int(kind[6:]), args.threads, args.tokens, ids)
    elif kind == "llama_cpp":
        res = run_llama_cpp(args.model, args.threads, args.tokens, ids)
    elif kind == "llama_bench":
        res = run_llama_bench(args.model, args.threads, args.tokens, ids)
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
    # llama.cpp (llama-cpp-python and llama-bench) runs with its own default (active
    # OpenMP waits: its best on an idle machine; 2 threads measured 18 tok/s passive
    # against 50 active on SmolLM2, llama-bench 52 against 135).
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    for kind in only:
        cmd = [sys.executable, __file__, "--model", model, "--threads", str(threads),
               "--tokens", str(tokens), "--one", kind, "--ids", json.dumps(ids)]  # fmt: skip
        run_env = dict(env)
        if kind not in ("llama_cpp", "llama_bench"):
            run_env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=run_env, timeout=900)
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


BUNDLED = {"smollm2": "SmolLM2-135M-Instruct.Q4_1", "gemma3": "gemma-3-270m.Q4_K_M"}


def _bundled_path(key: str) -> str:
    from mvp_io.model_store import fetch_bundled

    return str(fetch_bundled(BUNDLED[key]))


def _median(xs: list[float]) -> float:
    ys = sorted(xs)
    m = len(ys) // 2
    return ys[m] if len(ys) % 2 else (ys[m - 1] + ys[m]) / 2


def paired(
    models: list[str], threads: list[int], rounds: int, tokens: int, only: list[str]
) -> dict[str, Any]:
    """Every (model, threads, configuration) once per round, rotated; returns the rows."""
    runs: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    cells = [(m, t, k) for m in models for t in threads for k in only]
    for r in range(rounds):
        shift = r % max(1, len(only))
        order = [(m, t, only[(only.index(k) + shift) % len(only)]) for m, t, k in cells]
        for model, t, kind in order:
            if kind in skipped:
                continue
            res = bench(model, t, tokens, [kind])
            if res["skipped"]:
                skipped.update(res["skipped"])
                continue
            for row in res["rows"]:
                runs.append({"round": r, "model": Path(model).name, **row})
            print(f"round {r + 1}/{rounds} {Path(model).name} {t} thr {kind}: "
                  f"decode {res['rows'][0]['decode_tps']:.1f} tok/s", file=sys.stderr)  # fmt: skip
    return {"tokens": tokens, "rounds": rounds, "runs": runs, "skipped": skipped}


# References an engine row is paired with: (kind, column label)
REFERENCES = (("llama_bench", "bench"), ("llama_cpp", "py"))


def read_bandwidth(threads: int, size_mb: int = 1024, rounds: int = 3) -> float:
    """This host's memory read rate in GB/s with ``threads`` threads: each sums its share
    of a ``size_mb`` array (far beyond any cache; numpy drops the GIL in the sum), best
    of ``rounds``. The ceiling a decode step's weight reads can reach."""
    import threading

    import numpy as np

    # Bytes, reduced by max: one vector compare per 64 bytes keeps the sum from being
    # the bound (an int64 or float sum is, on one core of this VM: 10-12 against 14 GB/s).
    data = np.ones(size_mb * (1 << 20), dtype=np.uint8)  # touched: resident
    shares = np.array_split(data, threads)
    best = 0.0
    for _ in range(rounds):
        barrier = threading.Barrier(threads + 1)

        def run(share: Any, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            share.max()

        workers = [threading.Thread(target=run, args=(sh,)) for sh in shares]
        for w in workers:
            w.start()
        barrier.wait()
        t0 = time.perf_counter()
        for w in workers:
            w.join()
        best = max(best, data.nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def weight_bytes(model: str) -> int:
    """The bytes of a GGUF's tensors: what one decode token reads (every matrix once)."""
    import mmap

    from mvp_core.gguf_header import parse_header

    with open(model, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        start = parse_header(buf, model).data_start
    return Path(model).stat().st_size - start


def _peak_held(rows: list[dict[str, Any]]) -> str:
    """An engine configuration's peak RSS while loading and RSS after its run (every
    weight page touched), medians; blank for the references."""
    if not all("peak_load_mb" in x and "rss_run_mb" in x for x in rows):
        return ""
    peak = _median([x["peak_load_mb"] for x in rows])
    return f"{peak:.0f}/{_median([x['rss_run_mb'] for x in rows]):.0f}"


def summarize(result: dict[str, Any]) -> list[str]:
    """Medians per (model, threads, kind), paired ratios against each llama.cpp reference
    present (the C++ llama-bench, llama-cpp-python), best threads against best threads."""
    runs = result["runs"]
    out: list[str] = []
    by: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in runs:
        by.setdefault((r["model"], r["threads"], r["kind"]), []).append(r)
    refs = [(k, label) for k, label in REFERENCES if any(r["kind"] == k for r in runs)]
    for model in dict.fromkeys(r["model"] for r in runs):
        out.append(
            f"\n{model}: medians of {result['rounds']} rounds, {result['tokens']} decode tokens"
        )
        head = f"{'configuration':26} {'thr':>3} {'load s':>7} {'RSS MB':>7} "
        head += f"{'peak/held MB':>13} {'prefill t/s':>11} {'decode t/s':>10}"
        for _, label in refs:
            head += f" {'pre/' + label:>9} {'dec/' + label:>9}"
        out += [head, "-" * len(head)]
        best: dict[tuple[str, str], tuple[float, int]] = {}
        for (m, t, kind), rows in by.items():
            if m != model:
                continue
            dec = _median([x["decode_tps"] for x in rows])
            pre = _median([x["prefill_tps"] for x in rows])
            line = (
                f"{rows[0]['name']:26} {t:3d} {_median([x['load_s'] for x in rows]):7.2f} "
                f"{_median([x['rss_mb'] for x in rows]):7.1f} {_peak_held(rows):>13} "
                f"{pre:11.1f} {dec:10.1f}"
            )
            for ref_kind, _ in refs:
                cells = ["", ""]
                ref = {x["round"]: x for x in by.get((m, t, ref_kind), [])}
                pairs = [(x, ref[x["round"]]) for x in rows if x["round"] in ref]
                if kind not in dict(REFERENCES) and pairs:
                    rp = _median([a["prefill_tps"] / b["prefill_tps"] for a, b in pairs])
                    rd = _median([a["decode_tps"] / b["decode_tps"] for a, b in pairs])
                    cells = [f"{rp:.2f}x", f"{rd:.2f}x"]
                line += f" {cells[0]:>9} {cells[1]:>9}"
            out.append(line)
            for what, v in (("decode", dec), ("prefill", pre)):
                if v > best.get((kind, what), (0.0, 0))[0]:
                    best[(kind, what)] = (v, t)
        for kind in dict.fromkeys(k for k, _ in best):
            if kind in dict(REFERENCES):
                continue
            for ref_kind, _ in refs:
                if (ref_kind, "decode") not in best:
                    continue
                parts = []
                for what in ("decode", "prefill"):
                    (v, t), (lv, lt) = best[(kind, what)], best[(ref_kind, what)]
                    parts.append(f"{what} {v:.1f} ({t} thr) vs {lv:.1f} ({lt} thr) = {v / lv:.2f}x")
                out.append(f"best threads, {kind} vs {ref_kind}: " + "; ".join(parts))
    bandwidth = result.get("bandwidth_gbs") or {}
    if bandwidth:
        out.append(
            "\nread bandwidth: "
            + ", ".join(f"{t} thr {bw:.1f} GB/s" for t, bw in sorted(bandwidth.items()))
        )
        for (m, t, _kind), rows in by.items():
            bw = bandwidth.get(str(t)) or bandwidth.get(t)
            weights = result.get("weight_bytes", {}).get(m)
            if bw and weights:
                dec = _median([x["decode_tps"] for x in rows])
                out.append(
                    f"  {m} {rows[0]['name']} {t} thr: decode reads "
                    f"{dec * weights / 1e9:.1f} GB/s of weights = {dec * weights / 1e9 / bw:.0%} "
                    "of the read bandwidth"
                )
    for kind, why in result["skipped"].items():
        out.append(f"{kind}: skipped ({why})")
    return out


def shape_file(spec: str, where: Path) -> str:
    """The random-weight GGUF of ``SHAPE[:QUANT]`` (write_shape.py's shapes and quants;
    Q4_K_M by default) under ``where``, written the first time (under a temporary name,
    then renamed: a stopped write leaves no file that looks whole)."""
    shape, _, quant = spec.partition(":")
    quant = quant or "q4_k_m"
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import write_shape

    if shape not in write_shape.SHAPES:
        raise SystemExit(f"--shapes: no shape {shape!r} (one of {sorted(write_shape.SHAPES)})")
    if quant not in ("q4_0", "q8_0", "q4_k_m"):
        raise SystemExit(f"--shapes: no quant {quant!r} (q4_0, q8_0 or q4_k_m)")
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"{shape}-{quant}.gguf"
    if not path.exists():
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        t0 = time.perf_counter()
        try:
            write_shape.write(write_shape.SHAPES[shape], shape, tmp, quant)
            tmp.rename(path)
        finally:
            tmp.unlink(missing_ok=True)
        print(
            f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB, {time.perf_counter() - t0:.0f} s)"
        )
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", help="one GGUF file (instead of --models)")
    ap.add_argument("--models", default="smollm2,gemma3", help="bundled: smollm2, gemma3")
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens per run")
    ap.add_argument("--only", default="engine1,engine2,engine3,llama_bench,llama_cpp")
    ap.add_argument(
        "--stage-rss", default="1,2,3",
        help="splits whose every stage's RSS is measured alone in a process ('' for none)",
    )  # fmt: skip
    ap.add_argument(
        "--bandwidth", action="store_true",
        help="also measure the host's read bandwidth and each decode's share of it",
    )  # fmt: skip
    ap.add_argument(
        "--shapes", default="",
        help="random-weight GGUFs of real models' shapes instead of --models, written once "
        "into --shape-dir (scripts/write_shape.py): SHAPE[:QUANT],... e.g. "
        "llama-3.2-1b:q4_k_m,llama-3.2-1b:q4_0,llama-3.2-1b:q8_0,qwen2.5-3b,llama-3.1-8b",
    )  # fmt: skip
    ap.add_argument(
        "--shape-dir", type=Path, default=Path.home() / ".cache/mvp-orchestrator/shapes",
        help="where --shapes are kept (outside the repository)",
    )  # fmt: skip
    ap.add_argument("--json", type=Path, help="also write every run here")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        args.threads = int(args.threads)
        args.model = args.model or DEFAULT_MODEL
        _child(args)
        return
    if args.shapes:
        models = [shape_file(x, args.shape_dir) for x in args.shapes.split(",") if x]
    elif args.model:
        models = [args.model]
    else:
        models = [_bundled_path(k) for k in args.models.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    result = paired(models, threads, args.rounds, args.tokens, args.only.split(","))
    if args.bandwidth:
        result["bandwidth_gbs"] = {str(t): read_bandwidth(t) for t in threads}
        result["weight_bytes"] = {Path(m).name: weight_bytes(m) for m in models}
    print("\n".join(summarize(result)))
    splits = [int(x) for x in args.stage_rss.split(",") if x]
    if splits:
        result["stage_memory"] = [
            row for m in models for row in stage_memory(m, splits, args.tokens)
        ]
        print("\n".join(summarize_memory(result["stage_memory"])))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
