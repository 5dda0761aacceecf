"""Gemma 3 270M through the whole system: a run of the bundled "gemma-3-270m.Q4_K_M" in
two node processes (float32 activations on the data plane between them) gives the
1-stage run's greedy text, and that text is llama.cpp's."""

from __future__ import annotations

import json
from pathlib import Path

from mvp_core import names
from mvp_core.models import Done, RequestShutdown, RunOutcome, RunPhase, SubmitPrompt
from mvp_io.model_store import GEMMA3_BUNDLED, fetch_bundled
from temporal.client import RunHandle
from tests.integration.conftest import Runs, wait_phase
from workers.node.engine.tokenizer import Tokenizer

REF = Path(__file__).parents[1] / "node" / "engine" / "data" / "gemma3_reference.json"
PROMPTS = ["def fibonacci(n):", "Water boils at"]
MAX_TOKENS = 32


async def test_gemma3_two_stages_give_the_one_stage_text(runs: Runs) -> None:
    tok = Tokenizer.from_gguf(fetch_bundled(GEMMA3_BUNDLED))
    generations = {g["prompt"]: g for g in json.loads(REF.read_text())["generations"]}
    model = {"bundled": GEMMA3_BUNDLED}
    pipe = await runs.start(4701, model=model, pipeline_stages=2)
    ref = await runs.start(4702, model=model)
    state = await wait_phase(pipe, RunPhase.PROMPT_READY, timeout=150)
    await wait_phase(ref, RunPhase.PROMPT_READY, timeout=150)
    assert [(s.layers.start, s.layers.end) for s in state.plan.stages] == [(0, 9), (9, 18)]
    assert (state.plan.model_facts.architecture, state.plan.model_facts.name) == (
        "gemma3",
        "Gemma 3 270m",
    )
    for i, text in enumerate(PROMPTS):
        request = SubmitPrompt(request_id=i, prompt_text=text, max_tokens=MAX_TOKENS)
        got = await RunHandle(runs.client, 4701).submit(request)
        want = await RunHandle(runs.client, 4702).submit(request)
        assert isinstance(got, Done) and isinstance(want, Done)
        assert (got.final_text, got.tokens_generated) == (want.final_text, want.tokens_generated)
        assert got.final_text == tok.decode(generations[text]["ids"][:MAX_TOKENS])
    for handle, run_id in ((pipe, 4701), (ref, 4702)):
        await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=run_id))
        outcome = RunOutcome.model_validate(await handle.result())
        assert outcome.lifecycle[-1].kind.value == "RunTornDown"
