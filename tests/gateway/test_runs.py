"""One gateway over several runs (workers/gateway/runs.py, admin.py; DECISIONS 90), with
each run's API replaced by a script: which run a request reaches, a replica that refuses
passing the request on, a run that ends under its requests, and the admin API. The real
runs are in tests/integration/test_gateway_runs.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from temporalio.client import WorkflowExecutionStatus

from mvp_core.errors import ErrorType
from mvp_core.models import Done, SubmitPrompt, TextDelta
from temporal.client import PromptRejected
from workers.gateway import admin
from workers.gateway.app import create_app
from workers.gateway.main import GatewayError, read_run_request, run_specs
from workers.gateway.runs import RunSet, RunSpec
from workers.gateway.service import Gateway, ServedModel

SMOL = "SmolLM2-135M-Instruct.Q4_1"
GEMMA = "gemma-3-270m.Q4_K_M"
KEY = "sk-mvp-0123456789abcdef"


class Runs:
    """Scripted runs behind one app: each prompt is recorded as (run id, request id)."""

    def __init__(self, specs: list[RunSpec], models: dict[int, str], **app: Any) -> None:
        self.app = create_app(client=None, run_id=specs, **app)  # type: ignore[arg-type]
        self.set: RunSet = self.app.state.runs
        self.models = models
        self.served: list[tuple[int, int]] = []
        self.hold: dict[int, asyncio.Event] = {}  # a run's prompts wait for this
        self.refuse: dict[int, str] = {}  # a run refuses every prompt with this kind
        for gateway in self.set.gateways():
            self.fake(gateway)
        self.http = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app), base_url="http://gw"
        )

    def fake(self, gateway: Gateway) -> None:
        run_id = gateway.run_id
        file_id = self.models[run_id]
        served = ServedModel(
            gateway.alias or file_id,
            frozenset({f"{file_id}.gguf", file_id} - {gateway.alias or file_id}),
            100 + run_id,
            64,
        )

        async def served_model() -> ServedModel:
            gateway._served = served  # as the real one caches it
            return served

        async def stream(prompt: SubmitPrompt, **kw: Any) -> AsyncIterator[Any]:
            if run_id in self.refuse:
                raise PromptRejected(self.refuse[run_id], "refused")
            self.served.append((run_id, prompt.request_id))
            kw["on_admitted"]()
            rid = prompt.request_id
            text = f"run {run_id}"
            yield TextDelta(request_id=rid, text=text, tokens=1, prompt_tokens=2)
            if run_id in self.hold:  # a stream has started: its headers are out
                await self.hold[run_id].wait()
            yield Done(
                request_id=rid,
                final_text=text,
                tokens_generated=1,
                elapsed_ms=1,
                stop_reason="eos",
                prompt_tokens=2,
            )

        async def cancel(request_id: int) -> None:
            return None

        gateway.served = served_model  # type: ignore[method-assign]
        gateway.run.stream = stream  # type: ignore[method-assign]
        gateway._cancel = cancel  # type: ignore[method-assign]
        gateway.ready_seen = True

    async def ask(self, model: str, **kw: Any) -> httpx.Response:
        body = {"model": model, "prompt": "hi", "max_tokens": 1, **kw}
        return await self.http.post("/v1/completions", json=body)


def _three() -> Runs:
    """Runs 5 and 7 of SmolLM2 (replicas), run 6 of Gemma."""
    specs = [RunSpec(5), RunSpec(6), RunSpec(7)]
    return Runs(specs, {5: SMOL, 6: GEMMA, 7: SMOL})


async def test_models_lists_each_model_once_with_its_earliest_run() -> None:
    runs = _three()
    r = await runs.http.get("/v1/models")
    assert r.status_code == 200
    data = r.json()["data"]
    assert [(m["id"], m["created"]) for m in data] == [(SMOL, 105), (GEMMA, 106)]
    one = await runs.http.get(f"/v1/models/{GEMMA}.gguf")  # by another of its names
    assert one.status_code == 200 and one.json()["id"] == GEMMA


async def test_each_request_reaches_a_run_of_the_model_it_names() -> None:
    runs = _three()
    r = await runs.ask(GEMMA)
    body = r.json()
    assert r.status_code == 200, body
    assert body["model"] == GEMMA and body["choices"][0]["text"] == "run 6"
    assert body["id"].startswith("cmpl-6-") and runs.served[0][0] == 6
    r = await runs.ask(SMOL)
    assert r.json()["choices"][0]["text"] in ("run 5", "run 7")


async def test_an_unknown_model_is_a_404_naming_it() -> None:
    runs = _three()
    r = await runs.ask("gpt-4o")
    assert r.status_code == 404
    assert r.json()["error"] == {
        "message": "The model `gpt-4o` does not exist or you do not have access to it.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    assert (await runs.http.get("/v1/models/gpt-4o")).status_code == 404
    assert not runs.served


async def test_concurrent_requests_spread_over_replicas_by_their_queues() -> None:
    """Both replicas have one slot: while a prompt holds run 5, the next goes to run 7;
    with both busy, the next waits behind the fewest."""
    runs = _three()
    runs.hold = {5: asyncio.Event(), 7: asyncio.Event()}
    first = asyncio.ensure_future(runs.ask(SMOL))
    while len(runs.served) < 1:
        await asyncio.sleep(0.01)
    second = asyncio.ensure_future(runs.ask(SMOL))
    while len(runs.served) < 2:
        await asyncio.sleep(0.01)
    assert sorted(run for run, _ in runs.served) == [5, 7]
    assert [g.in_flight for g in runs.set.gateways()] == [1, 0, 1]
    runs.hold[5].set()
    assert (await first).status_code == 200
    while runs.set.get(5).in_flight:  # type: ignore[union-attr]
        await asyncio.sleep(0.01)
    third = asyncio.ensure_future(runs.ask(SMOL))  # run 5 is free again, run 7 is not
    while len(runs.served) < 3:
        await asyncio.sleep(0.01)
    assert runs.served[2][0] == 5
    runs.hold[7].set()
    assert all(r.status_code == 200 for r in await asyncio.gather(first, second, third))
    assert [g.in_flight for g in runs.set.gateways()] == [0, 0, 0]


async def test_idle_replicas_take_turns() -> None:
    runs = _three()
    for _ in range(4):
        assert (await runs.ask(SMOL)).status_code == 200
    assert [run for run, _ in runs.served] == [5, 7, 5, 7]


@pytest.mark.parametrize(
    ("kind", "status"),
    [(ErrorType.PROMPT_QUEUE_FULL, 429), (ErrorType.RUN_NOT_PROMPT_READY, 503)],
)
async def test_a_replica_that_refuses_passes_the_request_on(kind: str, status: int) -> None:
    runs = _three()
    runs.refuse = {5: kind}
    r = await runs.ask(SMOL)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "run 7"
    runs.refuse = {5: kind, 7: kind}  # both refuse: the last refusal is the answer
    r = await runs.ask(SMOL)
    assert r.status_code == status
    if status == 503:  # a run refusing as not ready is tried last for a while
        runs.refuse = {}
        await runs.ask(SMOL)
        assert runs.served[-1][0] in (5, 7)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_run_that_ends_gives_its_requests_in_flight_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """Run 6 is terminated under a request: the request gets run_ended (a 503, or the
    stream's last event), the run leaves /v1/models, run 5's request completes."""
    runs = _three()
    closed = {g.run_id: asyncio.Event() for g in runs.set.gateways()}
    for gateway in runs.set.gateways():
        monkeypatch.setattr(gateway, "start", lambda: None)
        monkeypatch.setattr(gateway.run, "wait_closed", closed[gateway.run_id].wait)

        async def describe() -> Any:
            return type("Desc", (), {"status": WorkflowExecutionStatus.TERMINATED})()

        monkeypatch.setattr(gateway.run, "describe", describe)
    runs.set.start()
    runs.hold = {5: asyncio.Event(), 6: asyncio.Event()}
    other = asyncio.ensure_future(runs.ask(SMOL, stream=stream))
    doomed = asyncio.ensure_future(runs.ask(GEMMA, stream=stream))
    while len(runs.served) < 2:
        await asyncio.sleep(0.01)
    closed[6].set()
    r = await doomed
    if stream:
        assert r.status_code == 200
        last = json.loads(r.text.strip().split("\n\n")[-1].removeprefix("data: "))
        error = last["error"]
    else:
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        error = r.json()["error"]
    assert error["code"] == "run_ended" and "mvp-run-6 ended (terminated)" in error["message"]
    models = (await runs.http.get("/v1/models")).json()["data"]
    assert [m["id"] for m in models] == [SMOL]
    assert (await runs.ask(GEMMA)).status_code == 404
    runs.hold[5].set()
    assert (await other).status_code == 200
    assert not runs.set.emptied.is_set()
    closed[5].set()
    closed[7].set()
    await asyncio.wait_for(runs.set.emptied.wait(), 5)
    assert runs.set.last_ended is not None and len(runs.set) == 0
    await runs.set.aclose()


async def test_a_retrieve_goes_to_the_run_its_id_names() -> None:
    runs = _three()
    r = await runs.http.get("/v1/completions/cmpl-9-1")
    assert r.status_code == 404
    assert "belongs to run 9; this gateway serves 5, 6, 7" in r.json()["error"]["message"]


# --------------------------------------------------------------------------- admin API


async def test_a_run_added_through_the_admin_api_serves_and_a_removed_one_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runs = Runs([RunSpec(5)], {5: SMOL, 8: GEMMA, 9: SMOL})

    async def running(_runs: RunSet, spec: RunSpec) -> None:
        return None

    monkeypatch.setattr(admin, "_check_running", running)
    added = await runs.http.post("/admin/runs", json={"workflow_id": "mvp-run-8"})
    assert added.status_code == 201, added.text
    assert added.json()["workflow_id"] == "mvp-run-8"
    runs.fake(runs.set.get(8))  # type: ignore[arg-type]
    aliased = await runs.http.post(
        "/admin/runs", json={"workflow_id": "mvp-run-9", "alias": "smol-b"}
    )
    assert aliased.status_code == 201 and aliased.json()["alias"] == "smol-b"
    runs.fake(runs.set.get(9))  # type: ignore[arg-type]
    ids = [m["id"] for m in (await runs.http.get("/v1/models")).json()["data"]]
    assert ids == [SMOL, GEMMA, "smol-b"]
    assert (await runs.ask(GEMMA)).json()["choices"][0]["text"] == "run 8"
    assert (await runs.ask("smol-b")).json()["choices"][0]["text"] == "run 9"
    listed = (await runs.http.get("/admin/runs")).json()["runs"]
    assert [(e["workflow_id"], e["model"]) for e in listed] == [
        ("mvp-run-5", SMOL),
        ("mvp-run-8", GEMMA),
        ("mvp-run-9", "smol-b"),
    ]
    again = await runs.http.post("/admin/runs", json={"workflow_id": "mvp-run-8"})
    assert again.status_code == 409 and again.json()["error"]["code"] == "run_already_served"
    gone = await runs.http.delete("/admin/runs/mvp-run-8")
    assert gone.status_code == 200 and gone.json()["removed"]["workflow_id"] == "mvp-run-8"
    assert (await runs.ask(GEMMA)).status_code == 404
    assert (await runs.http.delete("/admin/runs/mvp-run-8")).status_code == 404


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        (b"{", None, "invalid_json"),
        (b"[]", None, "invalid_json"),
        (b"{}", "workflow_id", "missing_required_parameter"),
        (b'{"workflow_id": 7}', "workflow_id", "invalid_value"),
        (b'{"workflow_id": "run-7"}', "workflow_id", "invalid_value"),
        (b'{"workflow_id": "mvp-run-7", "alias": "two words"}', "alias", "invalid_value"),
        (b'{"workflow_id": "mvp-run-7", "alias": ""}', "alias", "invalid_value"),
        (b'{"workflow_id": "mvp-run-7", "model": "x"}', "model", "unknown_parameter"),
    ],
)
async def test_bad_admin_input_is_a_400_naming_the_field(
    body: bytes, param: str | None, code: str
) -> None:
    runs = Runs([RunSpec(5)], {5: SMOL})
    r = await runs.http.post("/admin/runs", content=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, code)
    assert len(runs.set) == 1


async def test_the_admin_api_needs_the_gateways_api_key() -> None:
    runs = Runs([RunSpec(5)], {5: SMOL}, api_keys=[KEY])
    for method, path in (("GET", "/admin/runs"), ("DELETE", "/admin/runs/mvp-run-5")):
        r = await runs.http.request(method, path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
    r = await runs.http.post("/admin/runs", json={"workflow_id": "mvp-run-6"})
    assert r.status_code == 401
    assert len(runs.set) == 1
    ok = await runs.http.get("/admin/runs", headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and len(ok.json()["runs"]) == 1


# --------------------------------------------------------------------------- the command


def test_workflow_id_is_repeatable_with_an_alias_each() -> None:
    assert run_specs(["mvp-run-7", "mvp-run-8=smol-b"]) == [RunSpec(7), RunSpec(8, "smol-b")]
    for bad, why in [
        (["run-7"], "invalid --workflow-id 'run-7': use mvp-run-N"),
        (["run-7=x"], "invalid --workflow-id 'run-7=x': use mvp-run-N=ALIAS"),
        (["mvp-run-7="], "invalid alias in --workflow-id 'mvp-run-7=': an alias must not be"),
        (["mvp-run-7=a b"], "invalid alias in --workflow-id 'mvp-run-7=a b': an alias starts"),
        (["mvp-run-7", "mvp-run-7=x"], "--workflow-id mvp-run-7 is given twice"),
    ]:
        with pytest.raises(GatewayError) as err:
            run_specs(bad)
        assert str(err.value).startswith(why), err.value


@pytest.mark.parametrize(
    ("request_json", "why"),
    [
        pytest.param(
            {"pipeline_stage": 2},
            "pipeline_stage: Extra inputs are not permitted",
            id="unknown-field",
        ),
        pytest.param(
            {"pipeline_stages": "two", "max_active_prompts": 0},
            "pipeline_stages: Input should be a valid integer, unable to parse string as an "
            "integer; max_active_prompts: Input should be greater than or equal to 1",
            id="two-bad-fields",
        ),
        pytest.param(
            {"vastai": {"api_key": "sk-vast-SECRET-4711"}, "node_env": {"A": {"B": "tok-X"}}},
            "vastai.api_key: Extra inputs are not permitted; node_env.A: Input should be a "
            "valid string",
            id="values-never-shown",
        ),
        pytest.param([{"pipeline_stages": 2}], "expected a JSON object, got an array", id="array"),
        pytest.param(
            "[1, 2", "not JSON (Expecting ',' delimiter: line 1 column 6 (char 5))", id="json"
        ),
    ],
)
def test_a_bad_run_request_file_names_each_field_with_its_reason(
    tmp_path: Path, request_json: Any, why: str
) -> None:
    """Issue 38 item 13: ``mvp-gateway --run-request FILE`` says what is wrong with each
    field, as a run's rejection does, never a value from the file."""
    path = tmp_path / "rr.json"
    path.write_text(request_json if isinstance(request_json, str) else json.dumps(request_json))
    with pytest.raises(GatewayError) as err:
        read_run_request(path)
    assert str(err.value) == f"invalid run request {path}: {why}"
    assert "SECRET" not in str(err.value) and "tok-X" not in str(err.value)


async def test_a_name_two_aliased_runs_answer_to_is_a_404_listing_their_ids() -> None:
    runs = Runs([RunSpec(5, "smol-fast"), RunSpec(6, "smol-long")], {5: SMOL, 6: SMOL})
    r = await runs.ask(SMOL)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "(smol-fast, smol-long)" in r.json()["error"]["message"]
    assert (await runs.ask("smol-long")).json()["choices"][0]["text"] == "run 6"
