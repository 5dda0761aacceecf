"""How a run's data plane authenticates (DECISIONS 32, 63), shared by the providers that
hand nodes their edge token, the nodes, and the clients that read a prompt's text from
its head node directly.

Every token derives from a host's edge secret (``MVP_EDGE_SECRET``, base64, shared by the
hosts of one deployment; else a random secret in the host's state directory) and the run
execution (its workflow id and nonce): nodes get their tokens in their environment, never
through Temporal. A client on a host that holds the secret derives the text-stream token
the head node checks (``text_stream_token``) from the run's snapshot.

The connection handshake is the data plane's: ``HELLO`` (magic, edge id, token length)
and the token, answered by ``ANSWER`` (status, reason length) and the reason; the text
stream is the reserved edge id ``TEXT_STREAM_EDGE_ID``, a node's own datastream
(DECISIONS 93) ``NODE_DATASTREAM_EDGE_ID`` with ``node_datastream_token``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import struct
from collections.abc import Mapping
from pathlib import Path

EDGE_SECRET_ENV = "MVP_EDGE_SECRET"
TEXT_TOKEN_ENV = "MVP_TEXT_TOKEN"
EDGE_SECRET_FILE = "edge-secret"

HELLO_MAGIC = b"MOH1"
HELLO = struct.Struct("<4sIH")  # magic, edge id, token length; then the token
ANSWER = struct.Struct("<BH")  # status, reason length; then the reason
ANSWER_OK, ANSWER_RETRY, ANSWER_REJECT = 0, 1, 2
MAX_TOKEN_LEN = 1024
TEXT_STREAM_EDGE_ID = 0xFFFF_FFFF  # no plan numbers an edge so
NODE_DATASTREAM_EDGE_ID = 0xFFFF_FFFE  # nor so: a node's own datastream (DECISIONS 93)
# The hello token of a text-stream reader that holds no deployment secret but the key its
# prompt was admitted with (SubmitPrompt.text_key, DECISIONS 80): the node checks that key
# against the prompt's own once the prompt is on it. Public: the key is the credential.
TEXT_READER_TOKEN = "prompt-key"


class EdgeSecretError(ValueError):
    """``MVP_EDGE_SECRET`` is set but unusable; the message says why."""


def state_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """Where providers of this host keep node directories and the host's edge secret:
    ``MVP_STATE_DIR``, else ``$XDG_STATE_HOME/mvp-orchestrator`` (~/.local/state)."""
    root = environ.get("MVP_STATE_DIR")
    if root:
        return Path(root)
    base = environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "mvp-orchestrator"


def configured_secret(environ: Mapping[str, str] = os.environ) -> bytes | None:
    """The secret ``MVP_EDGE_SECRET`` holds, or None when it is not set."""
    configured = environ.get(EDGE_SECRET_ENV)
    if not configured:
        return None
    try:
        raw = base64.b64decode(configured, validate=True)
    except ValueError:
        raise EdgeSecretError(f"{EDGE_SECRET_ENV} is not valid base64") from None
    if len(raw) < 16:
        raise EdgeSecretError(f"{EDGE_SECRET_ENV} must hold at least 16 bytes")
    return raw


def read_edge_secret(environ: Mapping[str, str] = os.environ) -> bytes | None:
    """This host's edge secret as a client reads it: ``MVP_EDGE_SECRET``, else the state
    directory's file; None where neither is there (a client never makes one)."""
    try:
        configured = configured_secret(environ)
    except EdgeSecretError:
        return None
    if configured is not None:
        return configured
    try:
        return (state_dir(environ) / EDGE_SECRET_FILE).read_bytes()
    except OSError:
        return None


def edge_token(secret: bytes, run_workflow_id: str, nonce: str) -> str:
    """The token that authenticates one execution's data-plane edges: every node of the
    execution derives the same one, nothing outside the deployment's hosts can."""
    msg = f"{run_workflow_id}/{nonce}/edges".encode()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()[:32]


def text_stream_token(secret: bytes, run_workflow_id: str, nonce: str) -> str:
    """The token a client shows a run's head node to read its prompts' text: the provider
    hands it to the node (``MVP_TEXT_TOKEN``), a client on a host with the secret derives
    it from the run's snapshot, which shows the nonce's first 8 characters only."""
    msg = f"{run_workflow_id}/{nonce[:8]}/text-stream".encode()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()[:32]


def node_datastream_token(edge_token: str) -> str:
    """The token a follower of a node's own datastream shows (DECISIONS 93): derived from
    the execution's edge token, which the node holds and its run's datastream activity
    derives (``edge_token``), so it needs no handing over; it opens the node's
    observations only, never an edge."""
    return hmac.new(edge_token.encode(), b"node-datastream", hashlib.sha256).hexdigest()[:32]


def hello(edge_id: int, token: str) -> bytes:
    data = token.encode()
    if not 0 < len(data) <= MAX_TOKEN_LEN:
        raise ValueError(f"token must be 1..{MAX_TOKEN_LEN} bytes, got {len(data)}")
    return HELLO.pack(HELLO_MAGIC, edge_id, len(data)) + data
