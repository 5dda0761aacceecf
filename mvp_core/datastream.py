"""The process host's datastream, pure part: channels, records, frames, redaction.

The datastream is observational (process spec 8.15, 9.18): nothing here makes state true.
This module builds the JSON records of the contract (CONTRACTS.md "Datastream"), turns a
record into a frame of its stream, redacts secrets, and renders the frame-archive line. It
does no I/O; ``mvp_io/datastream/`` carries the frames to their sinks.

Terms (what the archive line's fields mean here):

- ``source``: the ingestion path of a frame. ``"orchestrator"`` for records the host makes
  itself (bootstrap, prompt, lifecycle, route, membership, provisioning events, captured
  stdio), ``"node_log"`` for lines read from a node's log file (the original's "node
  bootstrap stdio frames"), ``"node_datastream"`` for frames a node or provider hands over
  as such.
- ``stream``: the datastream a frame belongs to. The orchestrator's own stream is
  ``mvp-orchestrator-<run_id>`` (process spec 8.2: tied to the orchestrator and the run);
  a node's log lines are on ``mvp-node-<run_id>-<node_id>``.
- ``channel_id``: a small integer per channel, unique within its stream, given in order of
  first use from 0. The orchestrator stream registers its core channels first, in the
  order of ``CORE_CHANNELS``, so their ids are the same in every run (bootstrap is 0).
- ``position``: the frame's index within its (stream, channel), from 0.
- ``arrival_seq``: given by the sink that writes the line. The archive counts its own lines
  (it continues from the existing file's line count, so the first line of a new file is
  0); a live subscriber sees the datastream's publish sequence, so a gap there means that
  subscriber lost frames.
- ``arrival_unix_ms``: wall-clock milliseconds when the frame was published.

Records where the contract is silent (our choices):

- lifecycle (``mvp.orch.lifecycle``), one per ``LifecycleReport`` of the run, in order:
  ``{"type":"OrchLifecycle","kind","run_id","request_id","detail","index"}`` with
  ``kind`` a ``LifecycleKind`` value, ``detail`` the report's text and ``index`` the
  report's position in the run's lifecycle list (so a host that polls the run can publish
  only new ones, and a reader can spot a gap).
- stage route (``mvp.orch.stage_route``), one per route check:
  ``{"type":"OrchStageRoute","status","run_id","node_id","stage_index","route",
  "identity","owned","pollers","detail"}``; ``status`` ``observed`` (owned) or ``failed``,
  ``route`` the node's task queue, ``identity`` the worker identity expected to poll it.
- membership (``mvp.swim.membership``), one per transition:
  ``{"type":"SwimMembership","run_id","node_id","state","detail"}`` with ``state`` one of
  ``Alive|Suspect|Dead|Left`` (here: Alive when the node's lease starts, Dead when it is
  lost, Left when the node is stopped on purpose).
- datastream health: ``OrchBootstrap`` with phase ``datastream``, status ``observed`` and
  detail ``{"published","drops":{<sink>:n},"final"}``.

A node's own channels (DECISIONS 93): each node publishes them on its data-plane port
(``mvp_core.node_datastream``: header, channel, frame, end); the run's datastream activity
follows every node of the run and passes them on with source ``node_datastream`` on the
node's stream ``mvp-node-<run_id>-<node_id>`` (beside its log lines), keeping the node's
frame positions (a gap: frames the node dropped for a slow follower). Every record has
``run_id``, ``node_id`` and ``stage_index``; none holds prompt text or a secret. At most
one frame per channel per ``NODE_SAMPLE_S`` (load: per ``NODE_LOAD_EVERY_S``), and only
when something changed:

- ``mvp.node.load``, the stage's weights loading (provisioning):
  ``{"type":"NodeLoad",...,"layers":[start,end],"loaded_bytes","total_bytes","status",
  "elapsed_ms"}``; ``total_bytes`` the bytes of the stage's tensors in the model's files
  (``mvp_core.stage_share.stage_tensors``), ``loaded_bytes`` those the loader has taken
  up; ``status`` ``loading``, then ``loaded`` (``loaded_bytes == total_bytes``) or
  ``failed``.
- ``mvp.node.steps``, the stage's forward steps in the last interval:
  ``{"type":"NodeSteps",...,"interval_ms","steps","prefill_steps","busy_ms","mean_ms",
  "max_ms","largest_batch","steps_total"}`` (milliseconds of the forward passes; a
  step runs one record of each prompt it batches).
- ``mvp.node.edges``, the node's data-plane edges:
  ``{"type":"NodeEdges",...,"interval_ms","in_bytes_per_s","out_bytes_per_s","edges":
  [{"edge_id","direction":"in"|"out","bytes"}]}`` (``bytes``: since the edge connected).
- ``mvp.node.kv``, the stage's KV cache slots: ``{"type":"NodeKv",...,"slots_in_use",
  "slots_total"}`` (a slot holds one prompt in flight).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, NamedTuple

from mvp_core.models import LifecycleReport

# --------------------------------------------------------------------------- channels

CHANNEL_BOOTSTRAP = "mvp.orch.bootstrap"
CHANNEL_PROMPT = "mvp.orch.prompt"
CHANNEL_LIFECYCLE = "mvp.orch.lifecycle"
CHANNEL_STAGE_ROUTE = "mvp.orch.stage_route"
CHANNEL_MEMBERSHIP = "mvp.swim.membership"
CHANNEL_PROVISIONING_EVENTS = "mvp.provisioning.events"
CHANNEL_STDIO_STDOUT = "mvp.orch.stdio.stdout"
CHANNEL_STDIO_STDERR = "mvp.orch.stdio.stderr"
NODE_LOG_CHANNEL_PREFIX = "mvp.provisioning.logs.node."

CORE_CHANNELS: tuple[str, ...] = (
    CHANNEL_BOOTSTRAP,
    CHANNEL_PROMPT,
    CHANNEL_LIFECYCLE,
    CHANNEL_STAGE_ROUTE,
    CHANNEL_MEMBERSHIP,
    CHANNEL_PROVISIONING_EVENTS,
    CHANNEL_STDIO_STDOUT,
    CHANNEL_STDIO_STDERR,
)

# A node's own channels (DECISIONS 93): any channel a node declares must start with
# NODE_CHANNEL_PREFIX (a node cannot speak on the run's channels).
NODE_CHANNEL_PREFIX = "mvp.node."
CHANNEL_NODE_LOAD = "mvp.node.load"
CHANNEL_NODE_STEPS = "mvp.node.steps"
CHANNEL_NODE_EDGES = "mvp.node.edges"
CHANNEL_NODE_KV = "mvp.node.kv"
NODE_CHANNELS: tuple[str, ...] = (
    CHANNEL_NODE_LOAD,
    CHANNEL_NODE_STEPS,
    CHANNEL_NODE_EDGES,
    CHANNEL_NODE_KV,
)
NODE_SAMPLE_S = 0.5  # a node's steps, edges and KV channels: at most one frame per this
NODE_LOAD_EVERY_S = 0.25  # ... its load progress (the first and last always)

SOURCE_ORCHESTRATOR = "orchestrator"
SOURCE_NODE_LOG = "node_log"
SOURCE_NODE_DATASTREAM = "node_datastream"


class LogStream(StrEnum):
    STDOUT = "Stdout"
    STDERR = "Stderr"
    PROVIDER = "Provider"


class BootstrapPhase(StrEnum):
    """The bootstrap phases of a run, in the order a run's story tells them (process
    spec 8.4), and the datastream's own health record."""

    CONFIG = "config"
    LOCAL_RUNTIME = "local_runtime"
    MODEL_FETCH = "model_fetch"  # the host's download of the run's model, before the run
    RUN_PLAN = "run_plan"
    PROVIDER_START = "provider_start"
    NODE_RUNTIME_READY = "node_runtime_ready"
    NODE_SWIM = "node_swim"
    NODE_ROUTE = "node_route"
    RUNTIME_READY_ACK = "runtime_ready_ack"
    STAGE_PROVISION = "stage_provision"
    WEIGHTS_LOADED = "weights_loaded"
    PROMPT_RPC = "prompt_rpc"
    PROMPT_LOOP = "prompt_loop"
    SHUTDOWN = "shutdown"
    PROVIDER_STOP = "provider_stop"
    ORCH_EXIT = "orch_exit"
    DATASTREAM = "datastream"


class BootstrapStatus(StrEnum):
    STARTED = "started"
    READY = "ready"
    FAILED = "failed"
    SENT = "sent"
    OBSERVED = "observed"


class ProvisionEventKind(StrEnum):
    PROVISION_START = "ProvisionStart"
    NODE_LIVE = "NodeLive"
    PROVISION_FAILED = "ProvisionFailed"
    NODE_STOPPED = "NodeStopped"


class MembershipState(StrEnum):
    ALIVE = "Alive"
    SUSPECT = "Suspect"
    DEAD = "Dead"
    LEFT = "Left"


def node_log_channel(node_id: int, stream: LogStream | str) -> str:
    """``mvp.provisioning.logs.node.<node_id>.<stdout|stderr|provider>``."""
    return f"{NODE_LOG_CHANNEL_PREFIX}{int(node_id)}.{LogStream(stream).value.lower()}"


def stdio_channel(stream: LogStream | str) -> str:
    """``mvp.orch.stdio.stdout`` or ``mvp.orch.stdio.stderr`` (captured host stdio)."""
    s = LogStream(stream)
    if s is LogStream.PROVIDER:
        raise ValueError("orchestrator stdio is Stdout or Stderr, not Provider")
    return CHANNEL_STDIO_STDOUT if s is LogStream.STDOUT else CHANNEL_STDIO_STDERR


def orchestrator_stream_id(run_id: int) -> str:
    return f"mvp-orchestrator-{int(run_id)}"


def host_stream_id(run_id: int) -> str:
    """The process host's own records (its bootstrap steps, stdio, prompt RPC events),
    beside the run's stream that it forwards (DECISIONS 58)."""
    return f"mvp-host-{int(run_id)}"


def node_stream_id(run_id: int, node_id: int) -> str:
    return f"mvp-node-{int(run_id)}-{int(node_id)}"


# --------------------------------------------------------------------------- records

JsonRecord = dict[str, Any]


def _detail(detail: Any) -> Any:
    return {} if detail is None else detail


def orch_bootstrap(
    phase: BootstrapPhase | str,
    status: BootstrapStatus | str,
    run_id: int,
    node_id: int,
    detail: Any = None,
) -> JsonRecord:
    """``{"type":"OrchBootstrap","phase","status","run_id","node_id","detail"}``; ``detail`` is
    phase-specific JSON (``{}`` when none). An unknown phase or status is a ``ValueError``."""
    return {
        "type": "OrchBootstrap",
        "phase": BootstrapPhase(phase).value,
        "status": BootstrapStatus(status).value,
        "run_id": int(run_id),
        "node_id": int(node_id),
        "detail": _detail(detail),
    }


def orch_prompt_event(
    phase: str,
    status: str,
    run_id: int,
    node_id: int,
    request_id: int | None,
    detail: Any = None,
) -> JsonRecord:
    """``{"type":"OrchPromptEvent","phase","status","run_id","node_id","request_id","detail"}``.

    Statuses used: the bootstrap ones plus ``dropped`` (process spec 8.5: "direct prompt
    event observed/dropped"). Never put prompt or completion text in ``detail``: these
    records are diagnostics, the text is the prompt RPC's."""
    if not status:
        raise ValueError("prompt event status must not be empty")
    return {
        "type": "OrchPromptEvent",
        "phase": str(phase),
        "status": str(status),
        "run_id": int(run_id),
        "node_id": int(node_id),
        "request_id": None if request_id is None else int(request_id),
        "detail": _detail(detail),
    }


def provision_event(
    run_id: int, node_id: int, kind: ProvisionEventKind | str, provider: str, message: str = ""
) -> JsonRecord:
    """``{"event":{"run_id","node_id","kind","provider","message"}}``."""
    return {
        "event": {
            "run_id": int(run_id),
            "node_id": int(node_id),
            "kind": ProvisionEventKind(kind).value,
            "provider": str(provider),
            "message": str(message),
        }
    }


def log_line(run_id: int, node_id: int, stream: LogStream | str, line: str) -> JsonRecord:
    """``{"line":{"run_id","node_id","stream","line"}}``, stream ``Stdout|Stderr|Provider``."""
    return {
        "line": {
            "run_id": int(run_id),
            "node_id": int(node_id),
            "stream": LogStream(stream).value,
            "line": str(line),
        }
    }


def lifecycle_record(report: LifecycleReport, index: int | None = None) -> JsonRecord:
    """``{"type":"OrchLifecycle","kind","run_id","request_id","detail","index"}``."""
    return {
        "type": "OrchLifecycle",
        "kind": report.kind.value,
        "run_id": report.run_id,
        "request_id": report.request_id,
        "detail": report.detail,
        "index": index,
    }


def lifecycle_records(reports: Sequence[LifecycleReport], start: int = 0) -> list[JsonRecord]:
    """Records of ``reports[start:]``, each with its index in ``reports``: a host that polls
    the run's lifecycle publishes ``lifecycle_records(seen, published)`` and adds the count."""
    return [lifecycle_record(r, i) for i, r in enumerate(reports) if i >= start]


def stage_route_record(
    run_id: int,
    node_id: int,
    stage_index: int | None,
    route: str,
    identity: str,
    owned: bool,
    pollers: Iterable[str] = (),
    detail: str = "",
) -> JsonRecord:
    """A route check (``RouteCheck``) of a node's task queue: status ``observed`` when the
    node's worker owns it, else ``failed``."""
    return {
        "type": "OrchStageRoute",
        "status": (BootstrapStatus.OBSERVED if owned else BootstrapStatus.FAILED).value,
        "run_id": int(run_id),
        "node_id": int(node_id),
        "stage_index": None if stage_index is None else int(stage_index),
        "route": str(route),
        "identity": str(identity),
        "owned": bool(owned),
        "pollers": [str(p) for p in pollers],
        "detail": str(detail),
    }


def membership_record(
    run_id: int, node_id: int, state: MembershipState | str, detail: Any = None
) -> JsonRecord:
    """``{"type":"SwimMembership","run_id","node_id","state","detail"}``."""
    return {
        "type": "SwimMembership",
        "run_id": int(run_id),
        "node_id": int(node_id),
        "state": MembershipState(state).value,
        "detail": _detail(detail),
    }


def drops_record(
    run_id: int, node_id: int, published: int, drops: Mapping[str, int], final: bool
) -> JsonRecord:
    """The datastream's own health: how many frames each sink lost (bootstrap channel)."""
    return orch_bootstrap(
        BootstrapPhase.DATASTREAM,
        BootstrapStatus.OBSERVED,
        run_id,
        node_id,
        {"published": int(published), "drops": dict(sorted(drops.items())), "final": final},
    )


class NodeLoadStatus(StrEnum):
    LOADING = "loading"
    LOADED = "loaded"
    FAILED = "failed"


def _node_fields(kind: str, run_id: int, node_id: int, stage_index: int) -> JsonRecord:
    return {
        "type": kind,
        "run_id": int(run_id),
        "node_id": int(node_id),
        "stage_index": int(stage_index),
    }


def node_load_record(
    run_id: int,
    node_id: int,
    stage_index: int,
    layers: tuple[int, int],
    loaded_bytes: int,
    total_bytes: int,
    status: NodeLoadStatus | str,
    elapsed_ms: int,
) -> JsonRecord:
    """``mvp.node.load``: ``{"type":"NodeLoad","run_id","node_id","stage_index","layers",
    "loaded_bytes","total_bytes","status","elapsed_ms"}``."""
    return _node_fields("NodeLoad", run_id, node_id, stage_index) | {
        "layers": [int(layers[0]), int(layers[1])],
        "loaded_bytes": int(loaded_bytes),
        "total_bytes": int(total_bytes),
        "status": NodeLoadStatus(status).value,
        "elapsed_ms": int(elapsed_ms),
    }


def node_steps_record(
    run_id: int,
    node_id: int,
    stage_index: int,
    *,
    interval_ms: int,
    steps: int,
    prefill_steps: int,
    busy_ms: float,
    max_ms: float,
    largest_batch: int,
    steps_total: int,
) -> JsonRecord:
    """``mvp.node.steps``: the forward steps of one interval (``mean_ms`` derived)."""
    return _node_fields("NodeSteps", run_id, node_id, stage_index) | {
        "interval_ms": int(interval_ms),
        "steps": int(steps),
        "prefill_steps": int(prefill_steps),
        "busy_ms": round(float(busy_ms), 3),
        "mean_ms": round(float(busy_ms) / steps, 3) if steps else 0.0,
        "max_ms": round(float(max_ms), 3),
        "largest_batch": int(largest_batch),
        "steps_total": int(steps_total),
    }


def node_edges_record(
    run_id: int,
    node_id: int,
    stage_index: int,
    *,
    interval_ms: int,
    in_bytes_per_s: float,
    out_bytes_per_s: float,
    edges: Iterable[tuple[int, str, int]],
) -> JsonRecord:
    """``mvp.node.edges``: each edge as ``(edge_id, "in"|"out", bytes so far)``."""
    return _node_fields("NodeEdges", run_id, node_id, stage_index) | {
        "interval_ms": int(interval_ms),
        "in_bytes_per_s": round(float(in_bytes_per_s), 1),
        "out_bytes_per_s": round(float(out_bytes_per_s), 1),
        "edges": [{"edge_id": int(e), "direction": str(d), "bytes": int(n)} for e, d, n in edges],
    }


def node_kv_record(
    run_id: int, node_id: int, stage_index: int, slots_in_use: int, slots_total: int
) -> JsonRecord:
    """``mvp.node.kv``: ``{"type":"NodeKv",...,"slots_in_use","slots_total"}``."""
    return _node_fields("NodeKv", run_id, node_id, stage_index) | {
        "slots_in_use": int(slots_in_use),
        "slots_total": int(slots_total),
    }


# --------------------------------------------------------------------------- redaction

REDACTED = "[redacted]"


class RedactPattern(NamedTuple):
    """``prefix`` (kept) then ``secret`` (replaced); the regex only runs on text holding
    one of ``triggers`` (plain substrings; none: always), which keeps long lines cheap."""

    prefix: str
    secret: str
    triggers: tuple[str, ...] = ()


_SECRET_NAME_WORDS = ("TOKEN", "API_KEY", "SECRET", "PASSWORD", "PAYLOAD_KEY")

# Patterns redacted whatever the configured secrets, each a (kept prefix, secret) pair:
# - Hugging Face user access tokens: ``hf_`` and 30+ letters/digits (they are 34).
# - A bearer credential: ``Bearer <token>`` (also ``bearer``, ``BEARER``) keeps the word,
#   hides the token.
# - An assignment of a secret-named variable, ``NAME=value`` or ``NAME: value`` where NAME
#   ends in a secret word (``HF_TOKEN``, ``VASTAI_API_KEY``, ``CONTAINER_API_KEY``,
#   ``MVP_EDGE_TOKEN``, ``MVP_EDGE_SECRET``, ``MVP_PAYLOAD_KEY``, ``*_PASSWORD`` ...):
#   keeps the name, hides the value (upper-case names only, so ``max_tokens: 32`` stays).
DEFAULT_PATTERNS: tuple[RedactPattern, ...] = (
    RedactPattern("", r"(?<![A-Za-z0-9_])hf_[A-Za-z0-9]{30,}", ("hf_",)),
    RedactPattern(
        r"(?<![A-Za-z0-9_])(?:[Bb]earer|BEARER)\s+",
        r"[A-Za-z0-9._~+/=-]{8,}",
        ("earer", "EARER"),
    ),
    RedactPattern(
        r"(?:" + "|".join(_SECRET_NAME_WORDS) + r")\b\"?\s*[=:]\s*\"?",
        r"(?!\[redacted\])[^\s\"',;]{4,}",
        _SECRET_NAME_WORDS,
    ),
)

# Environment variables whose values are secrets wherever they are set.
SECRET_ENV_NAMES: tuple[str, ...] = (
    "HF_TOKEN",
    "VASTAI_API_KEY",
    "CONTAINER_API_KEY",
    "MVP_EDGE_TOKEN",
    "MVP_TEXT_TOKEN",
    "MVP_EDGE_SECRET",
    "MVP_PAYLOAD_KEY",
)
_SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD")
_MIN_ENV_SECRET_LEN = 8


def secret_values_from_env(environ: Mapping[str, str]) -> list[str]:
    """Values to redact found in an environment: every variable of ``SECRET_ENV_NAMES``,
    and any other whose name holds KEY, TOKEN, SECRET or PASSWORD, when the value is at
    least 8 characters (shorter ones, like ``1`` or ``true``, would blank ordinary text)."""
    out: list[str] = []
    for name, value in environ.items():
        upper = name.upper()
        if upper in SECRET_ENV_NAMES or any(w in upper for w in _SECRET_WORDS):
            if len(value) >= _MIN_ENV_SECRET_LEN:
                out.append(value)
    return out


def _keep_prefix(m: re.Match[str]) -> str:
    name = m.lastgroup
    return (m.group(name) if name else "") + REDACTED


_CACHE_MAX_LEN = 64
_CACHE_ENTRIES = 4096


class Redactor:
    """Replaces every given secret, and whatever matches ``patterns``, with ``[redacted]``.

    Records are redacted by structure (every string, keys included) before they are
    serialised, so a secret JSON would escape is still found. Empty secrets are ignored;
    longer secrets are matched first, so one secret inside another leaves no tail."""

    def __init__(
        self,
        secrets: Iterable[str] = (),
        patterns: Iterable[RedactPattern] = DEFAULT_PATTERNS,
    ) -> None:
        self._secrets = sorted({s for s in secrets if s}, key=len, reverse=True)
        self._literal: re.Pattern[str] | None = None
        self._literal_b: re.Pattern[bytes] | None = None
        if self._secrets:
            self._literal = re.compile("|".join(re.escape(s) for s in self._secrets))
            self._literal_b = re.compile(
                b"|".join(re.escape(s.encode("utf-8", "surrogatepass")) for s in self._secrets)
            )
        patterns = list(patterns)
        alternatives = [
            f"(?P<k{i}>{p.prefix})(?:{p.secret})" if p.prefix else f"(?:{p.secret})"
            for i, p in enumerate(patterns)
        ]
        self._patterns = re.compile("|".join(alternatives)) if alternatives else None
        self._always = any(not p.triggers for p in patterns)
        self._triggers = tuple(t for p in patterns for t in p.triggers)
        self._cache: dict[str, str] = {}

    @classmethod
    def from_env(cls, environ: Mapping[str, str], extra: Iterable[str] = ()) -> Redactor:
        return cls([*secret_values_from_env(environ), *extra])

    @property
    def secret_count(self) -> int:
        return len(self._secrets)

    def redact_text(self, value: str) -> str:
        short = len(value) <= _CACHE_MAX_LEN
        if short and (hit := self._cache.get(value)) is not None:
            return hit
        out = value
        if self._literal is not None:  # secrets first, whole, whatever surrounds them
            out = self._literal.sub(REDACTED, out)
        if self._patterns is not None and (self._always or any(t in out for t in self._triggers)):
            out = self._patterns.sub(_keep_prefix, out)
        if short:
            if len(self._cache) >= _CACHE_ENTRIES:
                self._cache.clear()
            self._cache[value] = out
        return out

    def redact_bytes(self, value: bytes) -> bytes:
        """Raw payload bytes: UTF-8 text is redacted as text; other bytes lose every
        secret's UTF-8 encoding (patterns are textual and need text)."""
        try:
            return self.redact_text(value.decode("utf-8")).encode("utf-8")
        except UnicodeDecodeError:
            pass
        if self._literal_b is not None:
            value = self._literal_b.sub(REDACTED.encode(), value)
        return value

    def redact(self, value: Any) -> Any:
        """A copy of a JSON-like value with every string redacted (dict keys too)."""
        if isinstance(value, str):
            return self.redact_text(value)
        if isinstance(value, dict):
            return {
                (self.redact_text(k) if isinstance(k, str) else k): self.redact(v)
                for k, v in value.items()
            }
        if isinstance(value, list | tuple):
            return [self.redact(v) for v in value]
        if isinstance(value, bytes | bytearray):
            return self.redact_bytes(bytes(value))
        return value


# --------------------------------------------------------------------------- frames


@dataclass(frozen=True, slots=True)
class Frame:
    """One published record, ready for any sink: its payload is the record's bytes."""

    seq: int  # the datastream's publish sequence, from 0
    arrival_unix_ms: int
    source: str
    stream: str
    channel: str
    channel_id: int
    position: int
    payload: bytes


class ChannelRegistry:
    """Channel ids and positions per stream (ids in order of first use, from 0)."""

    def __init__(self) -> None:
        self._ids: dict[str, dict[str, int]] = {}
        self._positions: dict[tuple[str, str], int] = {}

    def register(self, stream: str, channels: Iterable[str]) -> None:
        for channel in channels:
            self.channel_id(stream, channel)

    def channel_id(self, stream: str, channel: str) -> int:
        ids = self._ids.setdefault(stream, {})
        if channel not in ids:
            ids[channel] = len(ids)
        return ids[channel]

    def next(self, stream: str, channel: str) -> tuple[int, int]:
        """(channel_id, position) of the next frame on (stream, channel)."""
        cid = self.channel_id(stream, channel)
        key = (stream, channel)
        pos = self._positions.get(key, 0)
        self._positions[key] = pos + 1
        return cid, pos

    def channels(self, stream: str) -> dict[str, int]:
        return dict(self._ids.get(stream, {}))


def encode_record(record: Any) -> bytes:
    """A record's payload bytes: compact JSON, UTF-8. Bytes and text pass as they are;
    anything JSON cannot hold is written as its ``str`` (observation must not fail)."""
    if isinstance(record, bytes | bytearray):
        return bytes(record)
    if isinstance(record, str):
        return record.encode("utf-8", "replace")
    text = json.dumps(record, ensure_ascii=False, separators=(",", ":"), default=str)
    return text.encode("utf-8", "replace")


def encode_payload(payload: bytes) -> dict[str, Any]:
    """``{"encoding":"utf8","value":text}`` for UTF-8, else ``{"encoding":"bytes","value":[..]}``."""
    try:
        return {"encoding": "utf8", "value": payload.decode("utf-8")}
    except UnicodeDecodeError:
        return {"encoding": "bytes", "value": list(payload)}


def frame_line(frame: Frame, arrival_seq: int) -> dict[str, Any]:
    """The frame-archive record, fields in the contract's order."""
    return {
        "arrival_seq": int(arrival_seq),
        "arrival_unix_ms": frame.arrival_unix_ms,
        "source": frame.source,
        "stream": frame.stream,
        "channel": frame.channel,
        "channel_id": frame.channel_id,
        "position": frame.position,
        "payload": encode_payload(frame.payload),
    }


def encode_frame_line(frame: Frame, arrival_seq: int) -> str:
    """One archive line, without its newline."""
    return json.dumps(frame_line(frame, arrival_seq), ensure_ascii=False, separators=(",", ":"))


def decode_payload(line: Mapping[str, Any]) -> Any:
    """The record a frame line carries: JSON when its payload is UTF-8 JSON, else the text,
    else the bytes (for readers: the follow client, tests)."""
    payload = line["payload"]
    if payload["encoding"] == "bytes":
        return bytes(payload["value"])
    value = payload["value"]
    try:
        return json.loads(value)
    except ValueError:
        return value
