"""Record llama.cpp's logits on the architecture x type matrix (tests/node/engine/
arch_cases.py) for the test suite (run offline; CI never builds llama.cpp).

For every case: the random-weight GGUF is written as the tests write it, llama.cpp
evaluates the prompt in one batch and then 32 greedy steps one token at a time, and the
last position's logits of the prompt and of every step are kept (float32, 33 x vocab).

Needs llama.cpp's library and the llama-cpp-python sources that bind it. The recorded
build is llama.cpp's native one, what a user of this CPU would build (docs/models.md):

    pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 && tar xf ...
    cd llama_cpp_python-0.3.36/vendor/llama.cpp && cmake -B build -DGGML_NATIVE=ON \\
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF \\
      -DBUILD_SHARED_LIBS=ON && cmake --build build -j2 --target llama
    PYTHONPATH=.../llama_cpp_python-0.3.36 LLAMA_CPP_LIB_PATH=.../vendor/llama.cpp/build/bin \\
      .venv/bin/python -m scripts.reference.arch_logits   (needs diskcache in the venv)

Writes tests/node/engine/data/arch_logits.json (the build, each file's sha256, llama.cpp's
greedy tokens) and arch_logits.npz (the logits).

Usage: python -m scripts.reference.arch_logits [--only CASE ...]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file, too

from tests.node.engine.arch_cases import (
    CONTEXT,
    PROMPT,
    RECORD_JSON,
    RECORD_NPZ,
    STEPS,
    case_names,
    file_digest,
    write_case,
)

try:  # an offline tool: --help works without it, a run needs it
    import llama_cpp
    from llama_cpp import Llama
except ImportError:
    llama_cpp = None  # type: ignore[assignment,unused-ignore]


def record(
    path: str,
    threads: int,
    prompt: list[int] = PROMPT,
    steps: int = STEPS,
    context: int = CONTEXT,
) -> tuple[np.ndarray, list[int]]:
    """llama.cpp's last-position logits [1 + steps, vocab] after ``prompt`` in one batch
    and each greedy step, and its greedy tokens."""
    llm = Llama(
        model_path=path, n_ctx=context, n_batch=context, n_threads=threads,
        logits_all=False, verbose=False,
    )  # fmt: skip
    n_vocab = llm.n_vocab()
    rows: list[np.ndarray] = []
    tokens: list[int] = []
    llm.eval(prompt)
    for step in range(steps + 1):
        ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        logits = np.ctypeslib.as_array(ptr, shape=(n_vocab,)).copy()
        rows.append(logits)
        if step == steps:
            break
        token = int(np.argmax(logits))
        tokens.append(token)
        llm.eval([token])
    llm.close()
    return np.stack(rows).astype(np.float32), tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="cases to (re)record; the rest are kept")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if llama_cpp is None:
        sys.exit("llama-cpp-python is not importable (see this script's docstring)")
    cases = args.only or case_names()
    meta: dict[str, Any] = {"cases": {}}
    arrays: dict[str, np.ndarray] = {}
    if args.only and RECORD_JSON.exists():
        meta = json.loads(RECORD_JSON.read_text())
        with np.load(RECORD_NPZ) as old:
            arrays = {k: old[k] for k in old.files}
    meta.update(
        llama_cpp_python_version=llama_cpp.__version__,
        system_info=llama_cpp.llama_print_system_info().decode(),
        build="llama.cpp from the llama-cpp-python 0.3.36 sdist, GGML_NATIVE=ON, AMX off",
        cpu=platform.processor() or platform.machine(),
        prompt=PROMPT,
        steps=STEPS,
    )
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            model = write_case(case, Path(tmp))
            logits, tokens = record(model.path, args.threads)
            meta["cases"][case] = {"sha256": file_digest(model.path), "tokens": tokens}
            arrays[case] = logits
            print(f"{case}: {tokens[:8]}...", flush=True)
    RECORD_JSON.write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    np.savez_compressed(RECORD_NPZ, **arrays)  # type: ignore[arg-type]
    print(f"wrote {RECORD_JSON} and {RECORD_NPZ}")


if __name__ == "__main__":
    main()
