"""A scanner for secrets in everything Temporal and the logs keep of a test session.

It reads every workflow of a namespace (histories, search attributes, and the
``snapshot`` query of every run), plus log files, and reports each place where one of
the given secrets occurs. The edge tokens to look for are derived from each run's
execution nonce (read from its ``provider.start_node`` inputs) and the harness's edge
secret, exactly as the provider derives them, with each one's node-datastream token.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf.json_format import MessageToJson
from temporalio.client import Client
from temporalio.service import RPCError

from activities.providers.base import edge_token
from mvp_core import names
from mvp_core.edge_auth import node_datastream_token


@dataclass
class ScanReport:
    workflows: int = 0
    histories_bytes: int = 0
    queries: int = 0
    log_files: int = 0
    edge_tokens: set[str] = field(default_factory=set)
    findings: list[str] = field(default_factory=list)


def _nonces(history_json: str) -> set[str]:
    """Execution nonces from start_node inputs (NodeProvisionSpec.nonce)."""
    found: set[str] = set()
    history = json.loads(history_json)
    for event in history.get("events", []):
        attrs = event.get("activityTaskScheduledEventAttributes")
        if not attrs or attrs.get("activityType", {}).get("name") != names.ACT_START_NODE:
            continue
        for payload in attrs.get("input", {}).get("payloads", []):
            try:
                spec = json.loads(base64.b64decode(payload.get("data", "")))
            except ValueError:
                continue
            if isinstance(spec, dict) and isinstance(spec.get("nonce"), str):
                found.add(spec["nonce"])
    return found


async def scan(
    client: Client,
    *,
    secrets: Iterable[str],
    edge_secret: bytes,
    logs: Iterable[Path] = (),
    query: str = "",
) -> ScanReport:
    report = ScanReport()
    texts: list[tuple[str, str]] = []
    run_ids: list[tuple[str, str]] = []
    async for wf in client.list_workflows(query):
        report.workflows += 1
        handle = client.get_workflow_handle(wf.id, run_id=wf.run_id)
        history = (await handle.fetch_history()).to_json()
        report.histories_bytes += len(history)
        texts.append((f"history of {wf.id}/{wf.run_id}", history))
        texts.append(
            (f"search attributes of {wf.id}", json.dumps(wf.search_attributes, default=str))
        )
        desc = await handle.describe()
        texts.append((f"description of {wf.id}", MessageToJson(desc.raw_description)))
        for nonce in _nonces(history):
            token = edge_token(edge_secret, wf.id, nonce)
            report.edge_tokens.add(token)
            report.edge_tokens.add(node_datastream_token(token))  # DECISIONS 93
        if wf.workflow_type == names.RUN_WORKFLOW:
            run_ids.append((wf.id, wf.run_id or ""))
    for wf_id, run_id in run_ids:
        try:
            result = await client.get_workflow_handle(wf_id, run_id=run_id).query(
                names.QUERY_SNAPSHOT
            )
        except RPCError:
            continue  # a run whose history a query cannot replay here (e.g. rejected early)
        except Exception:
            continue
        report.queries += 1
        texts.append((f"snapshot of {wf_id}/{run_id}", json.dumps(result, default=str)))
    for path in logs:
        try:
            texts.append((f"log {path}", path.read_text(errors="replace")))
            report.log_files += 1
        except OSError:
            continue
    needles = [s for s in secrets if s] + sorted(report.edge_tokens)
    for where, text in texts:
        for needle in needles:
            if needle in text:
                report.findings.append(f"{needle[:6]}... in {where}")
    return report
