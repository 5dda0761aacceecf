"""Runs last in the integration session: scan everything the session's runs left in
Temporal (histories, search attributes, descriptions, snapshot queries) and in the
orchestrator and node logs for HF_TOKEN and every run's edge token."""

from __future__ import annotations

import base64

from temporalio.client import Client

from tests.helpers.secret_scan import scan
from tests.integration.conftest import EDGE_SECRET, SECRET, OrchestratorProcess


async def test_no_secret_anywhere_the_session_left_a_trace(
    client: Client, orchestrator: OrchestratorProcess
):
    logs = [*orchestrator.log_dir.glob("orchestrator-*.log")]
    logs += [*(orchestrator.state_dir / "nodes").glob("*/node.*")]
    logs += [*(orchestrator.state_dir / "runs").glob("*/frames.jsonl")]
    report = await scan(
        client, secrets=[SECRET], edge_secret=base64.b64decode(EDGE_SECRET), logs=logs
    )
    print(
        f"secret scan: {report.workflows} workflows ({report.histories_bytes} bytes of "
        f"history), {report.queries} snapshot queries, {report.log_files} logs, "
        f"{len(report.edge_tokens)} edge tokens"
    )
    assert report.workflows > 0 and report.log_files > 0
    assert report.findings == []
