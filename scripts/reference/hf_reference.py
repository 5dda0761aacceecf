"""Produce HF transformers float32 reference facts for the engine tests (offline; CI never runs HF).

    .venv/bin/pip install transformers   # not a project dependency
    .venv/bin/python scripts/reference/hf_reference.py [--model smollm2|gemma|M.gguf] [-o OUT]

--model smollm2 (the default; a path as the first argument, too) writes
tests/node/engine/data/hf_reference.json:

"cases": for each prompt: HF's greedy continuation (16 tokens) and, per step, HF's top-1 id
and the float32 logits of its top-k ids plus a fixed set of probe ids. The test replays the
same tokens through the engine's float32 path and compares (DECISIONS 23).

"llamacpp_prompts": for each prompt of tests/node/engine/data/llamacpp_reference.json (run
scripts/reference/llamacpp_reference.py first), HF's own greedy continuation of the same
prompt ids, as long as llama.cpp's, with its top logits per step. The fidelity test holds
the engine's default path to at least HF float32's agreement with llama.cpp.

--model gemma writes tests/node/engine/data/gemma3_hf_reference.json: "llamacpp_prompts" only,
for the prompts of tests/node/engine/data/gemma3_reference.json (gemma3_reference.py). A GGUF
path picks the files of its architecture (scripts/reference/fidelity.py's REFERENCES).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file, too

from scripts.reference.fidelity import REFERENCES, reference

# "cases" (SmolLM2 only: the probe ids are ids of its vocabulary)
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


def hf_cases(model: Any, tok: Any) -> list[dict[str, Any]]:
    """HF's greedy continuation of each of PROMPTS, with the probe ids' logits per step."""
    cases = []
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
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("gguf", nargs="?", help="a GGUF path (the same as --model PATH)")
    ap.add_argument("--model", help=f"{' | '.join(REFERENCES)} | a GGUF path (default smollm2)")
    ap.add_argument("-o", "--output", help="default: the model's file in tests/node/engine/data")
    ap.add_argument("--llamacpp", help="llama.cpp's generations (default: the model's)")
    args = ap.parse_args()
    if args.gguf and args.model:
        ap.error("give the model once: as an argument or as --model")
    path, ref = reference(args.model or args.gguf or "smollm2")
    output = Path(args.output) if args.output else ref.hf
    llamacpp = Path(args.llamacpp) if args.llamacpp else ref.llamacpp
    with_cases = ref == REFERENCES["smollm2"]

    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(path))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    with torch.inference_mode():
        cases = (
            hf_cases(model, AutoTokenizer.from_pretrained(folder, gguf_file=name))
            if with_cases
            else []
        )
        llama_cases = llamacpp_prompts(model, llamacpp)
    import transformers

    out: dict[str, Any] = {
        "model": path.name,
        "producer": f"transformers {transformers.__version__}, torch {torch.__version__}, float32",
    }
    if with_cases:
        out |= {"steps": STEPS, "cases": cases}
    out["llamacpp_prompts"] = llama_cases
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
