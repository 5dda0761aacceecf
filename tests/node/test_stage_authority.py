"""A stage takes commands from its run's authority only (actor spec 6.6): a StageProvision
from another orchestrator, another run or readiness, or for another node or stage is
refused, non-retryable, naming what did not match, and loads nothing."""

from __future__ import annotations

from typing import Any

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from mvp_core.errors import ErrorType
from mvp_core.models import LayerRange, StageProvision
from workers.node.activities import NodeActivities
from workers.node.config import NodeConfig
from workers.node.dataplane import DataPlaneServer

CFG = NodeConfig(
    run_id=7,
    node_id=2,
    stage_index=0,
    task_queue="mvp-node-7-2",
    readiness_id="ready-1",
    run_workflow_id="mvp-run-7",
    authorized_orchestrator="mvp-run-7/0123abcd",
    namespace="default",
    address="127.0.0.1:1",
    identity="test",
)


def provision(**changed: Any) -> StageProvision:
    fields: dict[str, Any] = {
        "run_id": 7,
        "authorized_orchestrator": "mvp-run-7/0123abcd",
        "node_id": 2,
        "stage_index": 0,
        "stage_count": 1,
        "layers": LayerRange(start=0, end=30),
        "inbound_edge": None,
        "outbound_edge": None,
        "consumer_endpoint": None,
        "model_name": "m",
        "model_path": "/nonexistent/model.gguf",
        "tokenizer_path": "/nonexistent/model.gguf",
        "max_seq_len": 64,
        "readiness_id": "ready-1",
        "run_workflow_id": "mvp-run-7",
    }
    return StageProvision(**(fields | changed))


@pytest.mark.parametrize(
    ("changed", "says"),
    [
        ({"authorized_orchestrator": "mvp-run-7/ffffffff"}, "unauthorized orchestrator"),
        ({"run_id": 8}, "command for run 8/ready-1 rejected"),
        ({"readiness_id": "ready-0"}, "command for run 7/ready-0 rejected"),
        ({"node_id": 3}, "provision for node 3 stage 0 rejected"),
        ({"stage_index": 1}, "provision for node 2 stage 1 rejected"),
    ],
)
async def test_a_provision_not_from_its_runs_authority_is_refused_by_name(changed, says):
    server = DataPlaneServer()
    try:
        node = NodeActivities(CFG, client=None, server=server)  # type: ignore[arg-type]
        with pytest.raises(ApplicationError) as err:
            await ActivityEnvironment().run(node.provision_stage, provision(**changed))
        assert says in str(err.value), err.value
        assert err.value.type == ErrorType.STAGE_REJECTED and err.value.non_retryable
        assert node.runtime is None  # nothing was loaded
    finally:
        server.close()
