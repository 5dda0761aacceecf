"""Names shared by workflows, activities, workers and clients.

Task queues, workflow ids, activity, signal, update and query names live here so that
the workflow code (which must not import worker or engine code) can address the node
agent's activities by name, and so that docs and scripts can rely on them.
"""

from __future__ import annotations

import re
from datetime import timedelta

ORCHESTRATOR_TASK_QUEUE = "mvp-orchestrator"
SEARCH_ATTRIBUTE_PHASE = "MvpRunPhase"

RUN_WORKFLOW = "RunWorkflow"
PROMPT_WORKFLOW = "PromptWorkflow"
REAPER_WORKFLOW = "ReaperWorkflow"

# Public surface of the run workflow.
UPDATE_SUBMIT_PROMPT = "submit_prompt"
# ... and the one that answers at admission (DECISIONS 77): no Update held while it runs
UPDATE_ADMIT_PROMPT = "admit_prompt"
# ... several at once, each refused or admitted on its own (DECISIONS 106)
UPDATE_ADMIT_PROMPTS = "admit_prompts"
SIGNAL_REQUEST_SHUTDOWN = "request_shutdown"
SIGNAL_CANCEL_PROMPT = "cancel_prompt"
UPDATE_SHUTDOWN_AND_WAIT = "request_shutdown_and_wait"
QUERY_SNAPSHOT = "snapshot"
# A run-hosted prompt's end, by its key (DECISIONS 66).
QUERY_PROMPT_SERVED = "prompt_served"
QUERY_PROMPT_END = "prompt_end"  # a run-hosted prompt: open, or its terminal event
# ... of many prompts in one query: a client asks once for all it waits on (DECISIONS 78)
QUERY_PROMPT_ENDS = "prompt_ends"
PROMPT_ENDS_PER_QUERY = 256  # the most prompt keys one prompt_ends query may name
ADMISSIONS_PER_UPDATE = 16  # the most prompts one admit_prompts Update may carry
QUERY_PROMPT_STOPS = "prompt_stops"  # ... and the stop strings of one in flight or kept

# Node reports (signals from node agents to the run).
SIGNAL_NODE_RUNTIME_READY = "node_runtime_ready"
SIGNAL_LEASE_STARTED = "lease_started"
SIGNAL_WEIGHTS_READY = "weights_ready"
SIGNAL_STAGE_READY = "stage_ready"
SIGNAL_STAGE_FAULT = "stage_fault"
SIGNAL_STAGE_STOPPED = "stage_stopped"
SIGNAL_TOKEN_ENDPOINTS_READY = "token_endpoints_ready"
# From the run's datastream activity: where its live datastream is served.
SIGNAL_DATASTREAM_ADDRESS = "datastream_address"

# Prompt workflow signals.
SIGNAL_PROMPT_ACTIVATE = "activate"
SIGNAL_PROMPT_CANCEL = "cancel"
SIGNAL_PROMPT_HEAD = "head"  # the head node lost, or its replacement (DECISIONS 68)

# Stream topic carrying PromptEvent items of one prompt.
PROMPT_STREAM_TOPIC = "prompt"

# Node agent activities (run on the node's own task queue).
ACT_NODE_RUNTIME_READY_ACK = "node.runtime_ready_ack"
ACT_NODE_LEASE = "node.lease"
ACT_NODE_PROVISION_STAGE = "node.provision_stage"
ACT_NODE_GENERATE = "node.generate"
ACT_NODE_STOP_GENERATE = "node.stop_generate"
ACT_NODE_STOP_STAGE = "node.stop_stage"

# Orchestrator activities.
ACT_PROVIDER_QUEUE = "orch.provider_queue"
ACT_PREPARE_PLAN = "orch.prepare_plan"
ACT_CHECK_ROUTE = "orch.check_route"
ACT_START_NODE = "provider.start_node"
ACT_STOP_NODE = "provider.stop_node"
ACT_COMPLETE_BOOTSTRAP = "provider.complete_bootstrap"
ACT_WATCH_NODES = "provider.watch_nodes"
# The run's datastream (DECISIONS 58): on the provider queue, beside the providers.
ACT_RUN_DATASTREAM = "provider.run_datastream"

# The reaper (DECISIONS 30): listing and destroying run on the host's provider queue,
# the liveness check of the runs on the shared queue.
ACT_LIST_RESOURCES = "provider.list_resources"
ACT_DESTROY_RESOURCE = "provider.destroy_resource"
ACT_RUN_LIVENESS = "orch.run_liveness"
# The reaper's schedule of a host and the workflows it starts share this prefix (the
# schedule appends a timestamp to each workflow's id).
REAPER_ID_PREFIX = "mvp-reaper-"
REAPER_INTERVAL_ENV = "MVP_REAPER_INTERVAL_S"
REAPER_DEFAULT_INTERVAL_S = 60

# Workflow task timeout of the runs and prompts we start: a worker lost mid-task costs
# this long (the server's default is 10 s). Sticky queues fall back as fast.
WORKFLOW_TASK_TIMEOUT_S = 5
STICKY_SCHEDULE_TO_START_S = 2
# One query (or describe) of a run by a client: a run no worker has answers late.
QUERY_TIMEOUT = timedelta(seconds=5)
# An embedded orchestrator worker says it is ready on this inherited pipe (one line,
# "ready"), not by a line its host would look for in its log.
WORKER_READY_FD_ENV = "MVP_READY_FD"

# Search attribute of a prompt workflow: done, cancelled or faulted.
SEARCH_ATTRIBUTE_PROMPT = "MvpPromptStatus"

# The model a run uses when it names none (mvp_io/model_store.py fetches it; the
# process host's configuration falls back to it with no [model] source set).
DEFAULT_BUNDLED_MODEL = "SmolLM2-135M-Instruct.Q4_1"


def run_workflow_id(run_id: int) -> str:
    """Workflow id of run ``run_id``: the run's durable address."""
    return f"mvp-run-{run_id}"


def run_id_from_workflow_id(workflow_id: str) -> int | None:
    """Inverse of :func:`run_workflow_id`; ``None`` when the id has another shape."""
    prefix = "mvp-run-"
    if not workflow_id.startswith(prefix):
        return None
    tail = workflow_id[len(prefix) :]
    if not tail.isdigit():
        return None
    return int(tail)


def node_task_queue(run_id: int, node_id: int, nonce: str) -> str:
    """A node agent's own task queue; the nonce makes stale nodes unroutable."""
    return f"mvp-node-{run_id}-{node_id}-{nonce[:8]}"


def node_resource_name(run_id: int, node_id: int, nonce: str) -> str:
    """The name a provider gives a node's resource (process mark, container, label): a
    retried start finds the node by it, and teardown can stop a node it has no handle of."""
    return f"mvp-{run_id}-{node_id}-{nonce[:8]}"


# The node agent's module (``python -m workers.node``): how a provider starts a node
# process, and how a scan of the process table recognises one.
NODE_MODULE = "workers.node"
# Bounded and ASCII: names come back from providers (labels, container names) untrusted.
_RESOURCE_NAME = re.compile(r"mvp-([0-9]{1,20})-([0-9]{1,20})-([0-9a-f]{8})")


def resource_arg(name: str) -> str:
    """The command-line mark of a node process: how a retried start finds it."""
    return f"--resource={name}"


def parse_resource_name(name: str) -> tuple[int, int, str] | None:
    """(run_id, node_id, nonce8) of ``mvp-<run_id>-<node_id>-<nonce8>``, else None."""
    match = _RESOURCE_NAME.fullmatch(name)
    if match is None:
        return None
    return int(match[1]), int(match[2]), match[3]


def provider_task_queue(host: str) -> str:
    """Host-affine queue for providers that act on the host where their nodes run."""
    return f"mvp-provider-{host}"


def prompt_workflow_id(run_id: int, request_id: int, unique: str) -> str:
    """Child workflow id of one prompt; ``unique`` is the admitting update's id
    (:func:`update_key`)."""
    return f"mvp-run-{run_id}-prompt-{request_id}-{unique}"


def update_key(update_id: str) -> str:
    """The part of a prompt's id its admitting Update's id gives: its letters, digits and
    dashes, at most 36 ("u" where none). A client that chooses the Update's id knows the
    prompt's id before the run answers (an early start, DECISIONS 103)."""
    cleaned = "".join(c for c in update_id if c.isalnum() or c == "-")
    return cleaned[:36] or "u"


def reaper_schedule_id(host: str) -> str:
    """The Temporal Schedule that runs the reaper of ``host``."""
    return f"{REAPER_ID_PREFIX}{host}"


def reaper_workflow_id(host: str) -> str:
    """Workflow id (prefix) of the reaper runs of ``host``'s schedule."""
    return f"{REAPER_ID_PREFIX}{host}"


# --------------------------------------------------------------------------- patches
# workflow.patched() ids: executions recorded before a change replay the old way.
PATCH_PROMPT_STARTS_ACTIVE = "prompt-starts-active"  # DECISIONS 40
PATCH_WATCH_ENDS_BEFORE_CLOSE = "watch-ends-before-close"  # DECISIONS 54
PATCH_RUN_DATASTREAM = "run-datastream"  # DECISIONS 58
PATCH_SHUTDOWN_WAITS_CLOSE = "shutdown-waits-close"  # DECISIONS 59
PATCH_CANCEL_BEFORE_CHILD_START = "cancel-before-child-start"  # DECISIONS 61
PATCH_STOP_GENERATE = "stop-generate"  # DECISIONS 65
PATCH_COMPLETE_BOOTSTRAP = "complete-bootstrap"  # DECISIONS 84
PATCH_HEAD_LOSS_ENDS_GENERATE = "head-loss-ends-generate"  # DECISIONS 101
PATCH_SIGNAL_ENDED_CHILD = "signal-ended-child"  # DECISIONS 105

# --------------------------------------------------------------------------- metrics
# Our own metrics (OpenTelemetry names; a Prometheus scrape shows them with dots as
# underscores and the unit appended: mvp_prompt_time_to_first_token_milliseconds).
METRIC_PROMPT_READY = "mvp.run.time_to_prompt_ready"  # histogram, ms: run start to ready
METRIC_QUEUE_DEPTH = "mvp.run.prompt_queue_depth"  # gauge: prompts admitted, not ended
METRIC_NODES = "mvp.run.nodes"  # gauge by state: the run's nodes in each state
METRIC_TTFT = "mvp.prompt.time_to_first_token"  # histogram, ms: admitted to first text
METRIC_TOKENS_PER_S = "mvp.prompt.decode_tokens_per_second"  # histogram: one prompt's rate
METRIC_PROMPTS = "mvp.prompt.ended"  # counter by status
METRIC_RECOVERY = "mvp.run.stage_recovery_time"  # histogram, ms: a loss to prompt-ready
METRIC_STAGE_FORWARD = "mvp.stage.forward_time"  # histogram, ms, by stage and phase


# "1" in a node's environment: it runs on the orchestrator worker's host (the process
# provider's nodes), where an early start leaves the admission it overlaps a core
# (workers/node/early.py early_threads, DECISIONS 103 and 104).
SHARES_CONTROL_HOST_ENV = "MVP_SHARES_CONTROL_HOST"
