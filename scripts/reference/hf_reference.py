"""Produce HF transformers float32 reference facts for the engine tests (offline; CI never runs HF).

    .venv/bin/pip install transformers   # not a project dependency
    .venv/bin/python scripts/reference/hf_reference.py [MODEL.gguf] [-o tests/engine/data/hf_reference.json]

For each prompt: HF's greedy continuation (16 tokens) and, per step, HF's top-1 id and the
float32 logits of its top-k ids plus a fixed set of probe ids. The test replays the same
tokens through the engine's float32 path and compares (DECISIONS 23).

"llamacpp_prompts": for each prompt of tests/engine/data/llamacpp_reference.json (run
scripts/reference/llamacpp_reference.py first), HF's own greedy continuation of the same
prompt ids, as long as llama.cpp's, with its top logits per step. The fidelity test holds
the engine's default path to at least HF float32's agreement with llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch

DEFAULT_MODEL = str(Path.home() / ".cache/mvp-orchestrator/models/SmolLM2-135M-Instruct.Q4_1.gguf")
PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "def fibonacci(n):",
    "In 1969, the first astronauts",
    "Water boils at a temperature of",
    "The three primary colors are",
]
STEPS = 16
TOP_K = 12
PROBE_IDS = [0, 1, 2, 28, 30, 253, 260, 282, 314, 2240, 10000, 30000, 49151]
LLAMA_TOP = 5


def llamacpp_prompts(model: Any, path: Path) -> list[dict[str, Any]]:
    """HF's greedy continuation of each llama.cpp reference prompt (same ids, same length)."""
    out = []
    for gen in json.loads(path.read_text())["generations"]:
        seq = list(gen["prompt_ids"])
        top_logits = []
        for _ in range(len(gen["ids"])):
            logits = model(torch.tensor([seq])).logits[0, -1].float()
            top = torch.topk(logits, LLAMA_TOP)
            top_logits.append(
                [[int(i), round(float(v), 5)] for i, v in zip(top.indices, top.values, strict=True)]
            )
            seq.append(int(top.indices[0]))
        greedy = seq[len(gen["prompt_ids"]) :]
        agree = next(
            (i for i, (a, b) in enumerate(zip(greedy, gen["ids"], strict=False)) if a != b),
            len(greedy),
        )
        print(f"{gen['prompt']!r}: HF keeps {agree}/{len(greedy)} of llama.cpp's tokens")
        out.append(
            {"prompt": gen["prompt"], "prompt_ids": gen["prompt_ids"], "greedy": greedy,
             "top_logits": top_logits}
        )  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    ap.add_argument("-o", "--output", default="tests/engine/data/hf_reference.json")
    ap.add_argument("--llamacpp", default="tests/engine/data/llamacpp_reference.json")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(args.model))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    cases = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = tok(prompt, add_special_tokens=False)["input_ids"]
            seq = list(ids)
            steps = []
            for _ in range(STEPS):
                logits = model(torch.tensor([seq])).logits[0, -1].float()
                top = torch.topk(logits, TOP_K).indices.tolist()
                probe = sorted(set(top) | set(PROBE_IDS))
                steps.append(
                    {
                        "top1": int(top[0]),
                        "ids": probe,
                        "logits": [round(float(logits[i]), 5) for i in probe],
                    }
                )
                seq.append(int(top[0]))
            cases.append(
                {
                    "prompt": prompt,
                    "prompt_ids": ids,
                    "greedy": seq[len(ids) :],
                    "text": tok.decode(seq[len(ids) :]),
                    "steps": steps,
                }
            )
            print(f"{prompt!r} -> {cases[-1]['text']!r}")
        llama_cases = llamacpp_prompts(model, Path(args.llamacpp))
    import transformers

    out = {
        "model": os.path.basename(args.model),
        "producer": f"transformers {transformers.__version__}, torch {torch.__version__}, float32",
        "steps": STEPS,
        "cases": cases,
        "llamacpp_prompts": llama_cases,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(out, separators=(",", ":")) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
