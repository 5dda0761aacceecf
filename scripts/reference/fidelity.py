"""Greedy agreement with llama.cpp, per reference prompt (not a test; prints a table).

    .venv/bin/python -m scripts.reference.fidelity [--model smollm2|gemma|M.gguf] [--threads N]
        [--json OUT]

For each prompt of the model's llama.cpp reference: how many leading tokens of llama.cpp's
greedy continuation the engine's default path and its float32 path reproduce, next to HF
transformers float32's (recorded by hf_reference.py). The engine runs here; llama.cpp and HF
only as recorded facts:

    smollm2  llamacpp_reference.json (llamacpp_reference.py), hf_reference.json
    gemma    gemma3_reference.json (gemma3_reference.py), gemma3_hf_reference.json

A GGUF path picks the facts of its architecture (llama: smollm2's, gemma3: gemma's).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "engine" / "data"
MODELS = Path.home() / ".cache/mvp-orchestrator/models"


@dataclass(frozen=True)
class Reference:
    """One model's recorded facts: llama.cpp's "generations", HF's "llamacpp_prompts"."""

    model: Path
    llamacpp: Path
    hf: Path


REFERENCES = {
    "smollm2": Reference(
        MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf",
        DATA / "llamacpp_reference.json",
        DATA / "hf_reference.json",
    ),
    "gemma": Reference(
        MODELS / "gemma-3-270m-q4_k_m.gguf",
        DATA / "gemma3_reference.json",
        DATA / "gemma3_hf_reference.json",
    ),
}
ARCHITECTURES = {"llama": "smollm2", "gemma3": "gemma"}


def reference(model: str) -> tuple[Path, Reference]:
    """--model: a name of REFERENCES, or a GGUF path (its architecture's reference facts)."""
    if model in REFERENCES:
        return REFERENCES[model].model, REFERENCES[model]
    from workers.node.engine import read_model_facts

    arch = read_model_facts(model).architecture
    if arch not in ARCHITECTURES:
        raise SystemExit(f"{model}: no reference facts for architecture {arch!r}")
    return Path(model), REFERENCES[ARCHITECTURES[arch]]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def greedy(stage: Any, prompt_ids: list[int], n: int) -> list[int]:
    from workers.node.engine import SamplingParams, generate

    return list(
        generate(
            [stage], prompt_ids, max_new_tokens=n, max_seq_len=len(prompt_ids) + n,
            sampling=SamplingParams(), stop_ids=[],
        )
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help=f"{' | '.join(REFERENCES)} | a GGUF path")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))  # run as a file, too

    from workers.node.engine import EngineOptions, load_stage, read_model_facts

    model, ref_facts = reference(args.model)
    llama = json.loads(ref_facts.llamacpp.read_text())["generations"]
    hf = {}
    if ref_facts.hf.exists():
        hf = {
            c["prompt"]: c for c in json.loads(ref_facts.hf.read_text()).get("llamacpp_prompts", [])
        }
    n_layers = read_model_facts(str(model)).block_count
    paths = {}
    for precision in ("default", "float32"):
        opts = EngineOptions(device="cpu", precision=precision, threads=args.threads)
        paths[precision] = load_stage(str(model), 0, n_layers, opts)
    rows = []
    for gen in llama:
        ref = gen["ids"]
        row = {"prompt": gen["prompt"], "tokens": len(ref)}
        for precision, stage in paths.items():
            row[precision] = common_prefix(greedy(stage, gen["prompt_ids"], len(ref)), ref)
        if gen["prompt"] in hf:
            row["hf_float32"] = common_prefix(hf[gen["prompt"]]["greedy"], ref)
        rows.append(row)
    print(model.name)
    print(f"{'prompt':44} {'default':>8} {'float32':>8} {'HF f32':>7}")
    for r in rows:
        h = r.get("hf_float32", "")
        print(f"{json.dumps(r['prompt'])[:44]:44} {r['default']:8} {r['float32']:8} {h!s:>7}")
    tot = {k: sum(int(r.get(k, 0)) for r in rows) for k in ("default", "float32", "hf_float32")}
    total = sum(r["tokens"] for r in rows)
    print(
        f"{'total of ' + str(total):44} {tot['default']:8} {tot['float32']:8} {tot['hf_float32']:7}"
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
