"""The engine against llama.cpp at realistic dimensions (issue 36): one random-weight
file per architecture family of hidden 2048, 16 layers and a 100k-262k vocabulary in
Q4_K_M (realistic_cases.py), at 1 and 2 threads and split in 2 stages, bit for bit the
logits llama.cpp computed for it (data/realistic_logits.json: each step's sha256 and
top 5, recorded by scripts/reference/realistic_logits.py from llama.cpp's build with
GGML_NATIVE=OFF and this CPU's AVX-512 flags)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.node.engine.arch_cases import file_digest
from tests.node.engine.conftest import native_kernel
from tests.node.engine.realistic_cases import (
    CONTEXT,
    PROMPT,
    RECORD,
    SPECS,
    STEPS,
    spec_of,
    step_digest,
    top,
    write_case,
)
from workers.node.engine import EngineOptions, load_stage, native
from workers.node.engine.arch_table import ARCHITECTURES


@pytest.fixture(scope="module")
def record() -> dict[str, Any]:
    return dict(json.loads(RECORD.read_text()))


@pytest.fixture(scope="module", autouse=True)
def _native() -> Iterator[None]:
    with native_kernel():
        yield


def test_every_exact_family_is_recorded_at_realistic_dimensions(record: dict[str, Any]) -> None:
    exact = {name for name, traits in ARCHITECTURES.items() if traits.llamacpp_order}
    assert {spec_of(c).arch for c in SPECS} == exact
    assert sorted(record["cases"]) == sorted(SPECS)
    assert record["prompt"] == PROMPT and record["steps"] == STEPS
    for case in SPECS:
        spec = spec_of(case)
        assert spec.hidden >= 2048 and spec.vocab >= 100_000 and spec.n_layers >= 16, case
        assert len(record["cases"][case]["steps"]) == STEPS + 1


def _run(
    path: str, n_layers: int, tokens: list[int], threads: int, stages: int
) -> list[np.ndarray]:
    """The last position's logits of the prompt and of each token, through ``stages``
    stages (the hidden state handed over as float32)."""
    bounds = [(n_layers * i // stages, n_layers * (i + 1) // stages) for i in range(stages)]
    # no layout cache: each load writes hundreds of MB nobody maps again
    opts = EngineOptions(device="cpu", threads=threads, layout_cache=False)
    loaded = [load_stage(path, a, b, opts) for a, b in bounds]
    try:
        sessions = [s.new_session(CONTEXT) for s in loaded]
        rows = []
        for ids in [PROMPT] + [[t] for t in tokens]:
            out: torch.Tensor = sessions[0].forward_tokens(ids)
            for s in sessions[1:]:
                out = s.forward_hidden(out)
            rows.append(out.numpy().reshape(-1, out.shape[-1])[-1])
        for session in sessions:
            session.close()
        return rows
    finally:
        for stage in loaded:
            stage.close()


@pytest.mark.parametrize("case", list(SPECS))
def test_the_engine_computes_llamacpps_logits_at_realistic_dimensions(
    tmp_path: Path, case: str, record: dict[str, Any]
) -> None:
    assert native.library() is not None, native.why_not()
    want = record["cases"][case]
    model = write_case(case, tmp_path)
    try:
        # the file is the one llama.cpp read (else the writer changed, not the engine)
        assert file_digest(model.path) == want["sha256"]
        for threads, stages in ((1, 1), (2, 1), (2, 2)):
            rows = _run(model.path, model.spec.n_layers, want["tokens"], threads, stages)
            assert len(rows) == STEPS + 1
            for i, row in enumerate(rows):
                assert row.shape == (model.spec.vocab,)
                if step_digest(row) != want["steps"][i]["sha256"]:
                    pytest.fail(
                        f"{case} at {threads} threads, {stages} stages: step {i} differs "
                        f"from llama.cpp's; top 5 {top(row)} against {want['steps'][i]['top']}"
                    )
    finally:
        Path(model.path).unlink(missing_ok=True)  # hundreds of MB each
