"""The node agent's facts, given by its provider in the environment."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from mvp_core import names


@dataclass(frozen=True)
class NodeConfig:
    run_id: int
    node_id: int
    stage_index: int
    task_queue: str
    readiness_id: str
    run_workflow_id: str
    authorized_orchestrator: str
    namespace: str
    address: str
    identity: str
    # Authenticates this execution's edges; from the provider, never from Temporal.
    edge_token: str = field(default="", repr=False)
    text_token: str = field(default="", repr=False)  # the text stream's (DECISIONS 63)
    readiness_timeout_s: float = 120.0
    # Longer than a control-plane outage the run rides out (60 s): a node leaves on its
    # own only when its run is closed, or when nothing reached it for this long.
    lease_silence_s: float = 120.0
    # The node runs on the host of the orchestrator worker (the process provider's
    # nodes): its early starts leave the admission a core (DECISIONS 103, 104).
    shares_control_host: bool = False

    @classmethod
    def from_env(cls) -> NodeConfig:
        env = os.environ

        def need(key: str) -> str:
            value = env.get(key)
            if not value:
                raise SystemExit(f"mvp-node: missing environment {key}")
            return value

        task_queue = need("MVP_TASK_QUEUE")
        return cls(
            run_id=int(need("MVP_RUN_ID")),
            node_id=int(need("MVP_NODE_ID")),
            stage_index=int(need("MVP_STAGE_INDEX")),
            task_queue=task_queue,
            readiness_id=need("MVP_READINESS_ID"),
            run_workflow_id=need("MVP_RUN_WORKFLOW_ID"),
            authorized_orchestrator=need("MVP_AUTHORIZED_ORCHESTRATOR"),
            namespace=env.get("MVP_TEMPORAL_NAMESPACE", "default"),
            address=env.get("TEMPORAL_ADDRESS", "localhost:7233"),
            identity=f"{task_queue}@{socket.gethostname()}:{os.getpid()}",
            edge_token=need("MVP_EDGE_TOKEN"),
            text_token=env.get("MVP_TEXT_TOKEN", ""),
            lease_silence_s=float(env.get("MVP_LEASE_SILENCE_S", "120")),
            shares_control_host=env.get(names.SHARES_CONTROL_HOST_ENV) == "1",
        )


@dataclass(frozen=True)
class FaultInjection:
    """Test-only misbehaviour. Honoured only when this process's own environment allows
    it (MVP_TEST_FAULTS_ALLOWED=1, which only a provider running under a test harness
    sets); a run request can never switch it on (its node_env may not name MVP_FAULT_*)."""

    exit_before_ready: bool = False
    mute: bool = False
    no_lease_report: bool = False
    # Membership held back: the lease sends LeaseStarted only once this file exists
    # (heartbeating meanwhile), so a run stays in readiness until the test opens the gate.
    lease_gate: str | None = None
    report_identity: str | None = None
    skew_token_out_sequence: bool = False
    text_delay_s: float = 0.0  # a slow node: each piece of text is held this long
    # A slow load: the stage's weights are loaded after this long (a test catches the run
    # in stage provisioning however fast a load from the layout cache is).
    provision_delay_s: float = 0.0
    # A held prompt: every piece of text after the first waits until this file exists (a
    # test observes a prompt while it generates, however fast or loaded the machine).
    text_gate: str | None = None
    # A slow network (benchmarks): peers reach this node's data-plane listener through a
    # delay line adding this much one way (workers/node/dataplane/delay_proxy.py).
    edge_delay_s: float = 0.0
    # Written at start by native code (libc write(2)) to fd 1 and fd 2, past Python's
    # streams: the datastream's capture of native output is tested with it.
    native_write: str | None = None

    @classmethod
    def from_env(cls) -> FaultInjection:
        env = os.environ
        if env.get("MVP_TEST_FAULTS_ALLOWED") != "1":
            return cls()
        return cls(
            exit_before_ready=env.get("MVP_FAULT_EXIT_BEFORE_READY") == "1",
            mute=env.get("MVP_FAULT_MUTE") == "1",
            no_lease_report=env.get("MVP_FAULT_NO_LEASE_REPORT") == "1",
            lease_gate=env.get("MVP_FAULT_LEASE_GATE") or None,
            report_identity=env.get("MVP_FAULT_REPORT_IDENTITY") or None,
            skew_token_out_sequence=env.get("MVP_FAULT_SKEW_OUT_SEQUENCE") == "1",
            text_delay_s=float(env.get("MVP_FAULT_TEXT_DELAY_MS", "0")) / 1000.0,
            provision_delay_s=float(env.get("MVP_FAULT_PROVISION_DELAY_MS", "0")) / 1000.0,
            text_gate=env.get("MVP_FAULT_TEXT_GATE") or None,
            edge_delay_s=float(env.get("MVP_FAULT_EDGE_DELAY_MS", "0")) / 1000.0,
            native_write=env.get("MVP_FAULT_NATIVE_WRITE") or None,
        )
