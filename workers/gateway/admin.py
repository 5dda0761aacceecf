"""The gateway's admin API (DECISIONS 90): which runs it serves, changed while it serves.

- ``GET /admin/runs``: the runs served, each with its model id and what choosing among
  replicas knows of it;
- ``POST /admin/runs`` ``{"workflow_id": "mvp-run-N", "alias": "..."}`` (``alias``
  optional): serve a run that exists and is running; 201 with its entry;
- ``DELETE /admin/runs/{workflow_id}``: serve it no longer (the run goes on; its requests
  in flight finish).

It is guarded by the gateway's API keys as ``/v1`` is (``auth.protected``). Bad input is
a 400 naming the field; a run served already a 409; errors in OpenAI's shape.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from temporalio.client import WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from mvp_core import names
from workers.gateway.runs import RunAlreadyServed, RunSet, RunSpec
from workers.gateway.selection import AliasError, check_alias
from workers.gateway.service import Gateway
from workers.gateway.wire import ApiError, invalid, unavailable

MAX_ADMIN_BODY = 4096


class AddRun(BaseModel):
    """``POST /admin/runs``'s body."""

    model_config = ConfigDict(extra="forbid", strict=True)
    workflow_id: str = Field(max_length=200)
    alias: str | None = None


def parse_add(raw: bytes) -> RunSpec:
    """The run to add, or a 400 naming the field that is wrong."""
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise invalid("the body must be a JSON object", code="invalid_json") from None
    if not isinstance(value, dict):
        raise invalid("the body must be a JSON object", code="invalid_json")
    try:
        body = AddRun.model_validate(value)
    except ValidationError as err:
        first = err.errors(include_url=False, include_input=False)[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        if first["type"] == "missing":
            raise invalid(
                f"Missing required parameter: '{param}'.", param, "missing_required_parameter"
            ) from None
        if first["type"] == "extra_forbidden":
            raise invalid(
                f"Unknown parameter: '{param}' (workflow_id, alias).", param, "unknown_parameter"
            ) from None
        raise invalid(
            f"Invalid value for '{param}': {first['msg']}.", param, "invalid_value"
        ) from None
    run_id = names.run_id_from_workflow_id(body.workflow_id)
    if run_id is None:
        raise invalid(
            "Invalid value for 'workflow_id': a run's workflow id is mvp-run-N.",
            "workflow_id",
            "invalid_value",
        )
    if body.alias is not None:
        try:
            check_alias(body.alias)
        except AliasError as err:
            raise invalid(f"Invalid value for 'alias': {err}.", "alias", "invalid_value") from None
    return RunSpec(run_id, body.alias)


def entry(gateway: Gateway) -> dict[str, Any]:
    served = gateway.known()
    return {
        "workflow_id": gateway.workflow_id,
        "run_id": gateway.run_id,
        "model": served.id if served is not None else gateway.alias,
        "alias": gateway.alias,
        "ready": gateway.ready,
        "in_flight": gateway.in_flight,
        "max_active_prompts": gateway.max_active,
    }


async def _check_running(runs: RunSet, spec: RunSpec) -> None:
    """A 400 unless the run exists and runs (a 503 when Temporal cannot say)."""
    wid = spec.workflow_id
    try:
        desc = await runs.client.get_workflow_handle(wid).describe()
    except RPCError as err:
        if err.status is RPCStatusCode.NOT_FOUND:
            raise invalid(f"no run {wid}", "workflow_id", "run_not_found") from None
        raise unavailable(f"cannot describe run {wid}: {err.message}", "run_unreachable") from None
    if desc.status is not WorkflowExecutionStatus.RUNNING:
        status = desc.status.name.lower() if desc.status else "closed"
        raise invalid(f"run {wid} has ended ({status})", "workflow_id", "run_not_running")


def admin_routes(runs: RunSet) -> list[Route]:
    async def list_runs(request: Request) -> Response:
        return JSONResponse({"runs": [entry(g) for g in runs.gateways()]})

    async def add_run(request: Request) -> Response:
        raw = await request.body()
        if len(raw) > MAX_ADMIN_BODY:
            raise ApiError(413, f"request body over {MAX_ADMIN_BODY} bytes", code="body_too_large")
        spec = parse_add(raw)
        if runs.get(spec.run_id) is not None:
            raise _served_already(spec.workflow_id)
        await _check_running(runs, spec)
        try:
            gateway = runs.add(spec)
        except RunAlreadyServed:
            raise _served_already(spec.workflow_id) from None
        alias = f" as {spec.alias!r}" if spec.alias else ""
        runs.notify(f"serving run {spec.workflow_id}{alias} (added through the admin API)")
        return JSONResponse(entry(gateway), status_code=201)

    async def remove_run(request: Request) -> Response:
        wid = request.path_params["workflow_id"]
        gateway = runs.remove(wid)
        if gateway is None:
            raise ApiError(404, f"this gateway does not serve {wid[:200]}", code="run_not_served")
        runs.notify(f"no longer serving run {wid} (removed through the admin API; it goes on)")
        return JSONResponse({"removed": entry(gateway)})

    return [
        Route("/admin/runs", list_runs, methods=["GET"]),
        Route("/admin/runs", add_run, methods=["POST"]),
        Route("/admin/runs/{workflow_id}", remove_run, methods=["DELETE"]),
    ]


def _served_already(wid: str) -> ApiError:
    return ApiError(
        409, f"this gateway serves {wid} already", param="workflow_id", code="run_already_served"
    )
