"""Where one decode step's time goes (figures, not a test): every weight product of a
stage timed alone on one row, against the whole step, and the read rate each reaches.

    .venv/bin/python scripts/profile_decode.py MODEL.gguf [--layers 0:32] [--threads 1,2]
        [--reps 20]

A decode step reads every weight once: where a product alone reads its weights at the
host's full rate and the products' sum is the step, the step is bound by memory; where a
product runs below that rate, its kernel is the bound; where the step is longer than its
products, the rest (norms, rope, attention, the activation quantisation, Python) is.
Printed per thread count: the step (median of ``--reps`` decode steps at a short
context), the products by kind (tensor name without its layer) with their time, bytes and
GB/s, and the remainder. The host's read rate for comparison: ``scripts/bench_engine.py
--bandwidth``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from workers.node.engine import native  # noqa: E402
from workers.node.engine.kernels import NativeLinear  # noqa: E402
from workers.node.engine.stage import EngineOptions, load_stage  # noqa: E402


def products(root: Any) -> dict[str, NativeLinear]:
    """Every NativeLinear reachable from ``root``, by attribute path."""
    found: dict[str, NativeLinear] = {}
    seen: set[int] = set()

    def walk(obj: Any, path: str, depth: int) -> None:
        if id(obj) in seen or depth > 8:
            return
        seen.add(id(obj))
        if isinstance(obj, NativeLinear):
            found[path] = obj
            return
        if isinstance(obj, list | tuple):
            for i, item in enumerate(obj):
                walk(item, f"{path}.{i}", depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, torch.Tensor | type):
            for name, value in vars(obj).items():
                walk(value, f"{path}.{name}" if path else name, depth + 1)

    walk(root, "", 0)
    return found


def weight_bytes(lin: NativeLinear) -> int:
    total = 0
    for lay in lin.layouts:
        for value in vars(lay).values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total


def kind_of(path: str) -> str:
    parts = [p for p in path.split(".") if not p.isdigit()]
    return ".".join(parts[-2:])


def timed(fn: Any, reps: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model")
    ap.add_argument("--layers", default="", help="start:end (default: every layer)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    from workers.node.engine.config import arch_config
    from workers.node.engine.gguf_reader import GGUFFile

    f = GGUFFile(args.model)
    n_layers = arch_config(f).n_layers
    f.close()
    start, end = (int(x) for x in args.layers.split(":")) if args.layers else (0, n_layers)
    t0 = time.perf_counter()
    stage = load_stage(args.model, start, end, EngineOptions())
    print(
        f"{Path(args.model).name} layers [{start}, {end}): loaded in {time.perf_counter() - t0:.1f} s"
    )
    prods = products(stage.model)
    print(f"{len(prods)} native products, {sum(map(weight_bytes, prods.values())) / 1e9:.2f} GB")
    with torch.inference_mode():
        for threads in (int(t) for t in args.threads.split(",")):
            native.set_threads(threads)
            session = stage.new_session(512)
            h = torch.zeros(1, stage.cfg.hidden, dtype=torch.float32)
            if stage.is_first:
                session.forward_tokens([1, 2, 3, 4, 5, 6, 7, 8])

            def step(session: Any = session, h: torch.Tensor = h) -> None:
                if stage.is_first:
                    session.forward_tokens([9])
                else:
                    session.forward_hidden(h)

            steps: list[float] = []
            for _ in range(args.reps):
                t = time.perf_counter()
                step()
                steps.append(time.perf_counter() - t)
                if session.position >= 500:
                    break
            step_s = statistics.median(steps)
            native.profile(True)
            n_prof = 0
            for _ in range(args.reps):
                if session.position >= 500:
                    break
                step()
                n_prof += 1
            phases = {k: v / max(n_prof, 1) for k, v in native.profile(False).items()}
            by_kind: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
            for path, lin in prods.items():
                x = torch.randn(1, lin.in_features)
                s = timed(lambda lin=lin, x=x: lin(x), max(5, args.reps // 2))
                row = by_kind[kind_of(path)]
                row[0] += s
                row[1] += weight_bytes(lin)
                row[2] += 1
            total = sum(r[0] for r in by_kind.values())
            print(
                f"\n{threads} thread(s): decode step {step_s * 1e3:.1f} ms; products alone "
                f"{total * 1e3:.1f} ms ({total / step_s:.0%}); rest {max(step_s - total, 0) * 1e3:.1f} ms"
            )
            print(f"  {'product':28} {'count':>5} {'ms':>8} {'MB':>8} {'GB/s':>6}")
            for kind, (s, b, n) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
                print(f"  {kind:28} {int(n):5d} {s * 1e3:8.2f} {b / 1e6:8.1f} {b / s / 1e9:6.1f}")
            whole = sum(r[1] for r in by_kind.values())
            print(
                f"  {'all products':28} {len(prods):5d} {total * 1e3:8.2f} {whole / 1e6:8.1f} "
                f"{whole / total / 1e9:6.1f}; the step reads {whole / step_s / 1e9:.1f} GB/s"
            )
            if phases:
                print_phases(phases, by_kind, step_s)


def print_phases(phases: dict[str, float], by_kind: dict[str, list[float]], step_s: float) -> None:
    """Inside the step (qmm.c's per-phase counters over the same decode steps): each of
    the layers' phases per step, with its weights' read rate where it is a product."""
    weights = {k.split(".")[-1]: b for k, (_, b, _) in by_kind.items() if k.startswith("layers.")}
    print("  inside the step (qmm.c counters, per step):")
    print(f"  {'phase':28} {'ms':>8} {'share':>6} {'GB/s':>6}")
    for name in ("qkv", "attention", "wo", "gate_up", "activation", "down", "prep"):
        s = phases.get(name, 0.0)
        b = weights.get(name)
        rate = f"{b / s / 1e9:6.1f}" if b and s > 0 else f"{'':6}"
        note = " (inside the products above)" if name == "prep" else ""
        print(f"  {name:28} {s * 1e3:8.2f} {s / step_s:6.0%} {rate}{note}")
    layers = phases.get("layers", 0.0)
    print(f"  {'layers (one C call)':28} {layers * 1e3:8.2f} {layers / step_s:6.0%}")
    print(
        f"  {'outside the layers':28} {(step_s - layers) * 1e3:8.2f} "
        f"{(step_s - layers) / step_s:6.0%} (embedding, the head, Python)"
    )


if __name__ == "__main__":
    main()
