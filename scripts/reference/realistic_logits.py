"""Record llama.cpp's logits on one realistic-dimension file per architecture family
(tests/node/engine/realistic_cases.py) for the test suite (run offline; CI never builds
llama.cpp).

For every case: the file is written as the tests write it, llama.cpp evaluates the prompt
in one batch and then STEPS greedy steps one token at a time, and of the last position's
logits each time the record keeps the sha256 of the float32 values and the top 5.

Needs llama.cpp's shared library and the llama-cpp-python sources that bind it (see
arch_logits.py; the build recorded is the one README.md's benchmark section builds,
GGML_NATIVE=OFF with this CPU's AVX-512 flags, AMX off, BUILD_SHARED_LIBS=ON):

    PYTHONPATH=.../llama_cpp_python-0.3.36:<diskcache> \\
    LLAMA_CPP_LIB_PATH=.../vendor/llama.cpp/build/bin \\
      .venv/bin/python -m scripts.reference.realistic_logits [--only CASE ...]

Writes tests/node/engine/data/realistic_logits.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file, too

from scripts.reference.arch_logits import record  # llama.cpp's run of a file
from tests.node.engine.arch_cases import file_digest
from tests.node.engine.realistic_cases import (
    CONTEXT,
    PROMPT,
    RECORD,
    SPECS,
    STEPS,
    step_digest,
    top,
    write_case,
)

try:  # an offline tool: --help works without it, a run needs it
    import llama_cpp
except ImportError:
    llama_cpp = None  # type: ignore[assignment,unused-ignore]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="cases to (re)record; the rest are kept")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--build", default="llama.cpp from the llama-cpp-python 0.3.36 sdist, "
                    "GGML_NATIVE=OFF with AVX/AVX2/FMA/F16C/BMI2/AVX-VNNI/AVX-512 F/VBMI/VNNI/BF16, AMX off")  # fmt: skip
    args = ap.parse_args()
    if llama_cpp is None:
        sys.exit("llama-cpp-python is not importable (see this script's docstring)")
    cases = args.only or list(SPECS)
    meta: dict[str, Any] = {"cases": {}}
    if args.only and RECORD.exists():
        meta = json.loads(RECORD.read_text())
    meta.update(
        llama_cpp_python_version=llama_cpp.__version__,
        system_info=llama_cpp.llama_print_system_info().decode(),
        build=args.build,
        cpu=platform.processor() or platform.machine(),
        prompt=PROMPT,
        steps=STEPS,
    )
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            model = write_case(case, Path(tmp))
            rows, tokens = record(model.path, args.threads, PROMPT, STEPS, CONTEXT)
            meta["cases"][case] = {
                "sha256": file_digest(model.path),
                "tokens": tokens,
                "steps": [{"sha256": step_digest(r), "top": top(r)} for r in rows],
            }
            Path(model.path).unlink()
            print(f"{case}: {tokens}", flush=True)
    RECORD.write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    print(f"wrote {RECORD}")


if __name__ == "__main__":
    main()
