"""What float16 activations cost: a split run's greedy text against the 1-stage text
(not a test; prints one line per stage count and wire format, DECISIONS 53).

    .venv/bin/python -m scripts.reference.activation_dtype [--model smollm2|gemma]

For every prompt of the model's llama.cpp reference (16 prompts), 32 greedy tokens of one
stage, then of 2 and 3 stages (the planner's splits) handing on float32 or float16 rows
in one process (workers.node.engine.generate, the same hand-over as the data plane's).
Counts: leading tokens equal to the 1-stage text, prompts whose 32 tokens are all equal,
and positions equal.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mvp_core.models import ActivationDtype
from mvp_core.planner import stage_layer_ranges
from mvp_io.model_store import DEFAULT_BUNDLED, GEMMA3_BUNDLED, fetch_bundled
from workers.node.engine import (
    EngineOptions,
    SamplingParams,
    Stage,
    generate,
    load_stage,
    read_model_facts,
)

DATA = Path(__file__).resolve().parents[2] / "tests" / "node" / "engine" / "data"
MODELS = {
    "smollm2": (DEFAULT_BUNDLED, DATA / "llamacpp_reference.json"),
    "gemma": (GEMMA3_BUNDLED, DATA / "gemma3_reference.json"),
}
TOKENS = 32


def _greedy(stages: list[Stage], ids: list[int], dtype: ActivationDtype) -> list[int]:
    return list(
        generate(stages, ids, max_new_tokens=TOKENS, max_seq_len=128, sampling=SamplingParams(),
                 stop_ids=[], activation_dtype=dtype)
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    bundled, ref = MODELS[args.model]
    path = str(fetch_bundled(bundled))
    n = read_model_facts(path).block_count
    prompts = [g["prompt_ids"] for g in json.loads(ref.read_text())["generations"]]
    opts = EngineOptions(device="cpu", threads=args.threads)
    whole = load_stage(path, 0, n, opts)
    base = [_greedy([whole], ids, ActivationDtype.FLOAT32) for ids in prompts]
    whole.close()
    total = TOKENS * len(prompts)
    for count in (2, 3):
        stages = [load_stage(path, r.start, r.end, opts) for r in stage_layer_ranges(n, count)]
        for dtype in ActivationDtype:
            lead = same = whole_prompts = 0
            for ids, want in zip(prompts, base, strict=True):
                got = _greedy(stages, ids, dtype)
                kept = next(
                    (i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), len(want)
                )
                lead += kept
                whole_prompts += kept == len(want)
                same += sum(a == b for a, b in zip(got, want, strict=True))
            print(
                f"{bundled} {count} stages {dtype.value}: leading tokens {lead}/{total}, "
                f"prompts identical {whole_prompts}/{len(prompts)}, positions equal {same}/{total}"
            )
        for s in stages:
            s.close()


if __name__ == "__main__":
    main()
