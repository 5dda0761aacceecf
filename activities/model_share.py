"""A node's share of a hub model, fetched on its host before the node starts (DECISIONS 72).

Process and Docker nodes run on the provider's host: the start activity fetches the share
there (mvp_io.share_fetch) into this host's model cache, which the node reads (a Docker
node through a read-only mount). A Vast.ai node's share is fetched on its instance, over
the provider's SSH session (activities/providers/vastai/ssh.py: fetch_share_remote).
Progress, wherever the share is fetched (here, or on a Vast.ai instance: DECISIONS 79),
goes to the provider's log, which is the run's datastream (LogLine, stream
Provider), once at the start, every PROGRESS_LOG_S and at the end; and, live, to the
start activity's heartbeat details (``ShareProgress.details``), which the Temporal Web
UI and ``temporal workflow describe`` show under the run's pending activities.
"""

from __future__ import annotations

import logging
import time

from mvp_core.models import ModelShare, NodeProvisionSpec
from mvp_io.model_store import hub_token
from mvp_io.share_fetch import fetch_share

PROGRESS_LOG_S = 5.0

log = logging.getLogger("mvp.provider")


class ShareProgress:
    """A share's fetch as the provider's log shows it."""

    def __init__(self, spec: NodeProvisionSpec, share: ModelShare) -> None:
        self.node_id = spec.node_id
        self.stage_index = spec.stage_index
        self.what = f"node {spec.node_id} (stage {spec.stage_index})"
        self.model = share.pin.describe()
        self.started = time.monotonic()
        self.shown = -PROGRESS_LOG_S
        self.done = 0
        self.total = share.size

    def details(self) -> dict[str, object]:
        """The fetch so far, as the start activity's heartbeat details."""
        return {
            "fetch": {
                "node_id": self.node_id,
                "stage_index": self.stage_index,
                "model": self.model,
                "bytes_held": self.done,
                "bytes_total": self.total,
                "seconds": round(time.monotonic() - self.started, 1),
            }
        }

    def __call__(self, done: int, total: int) -> None:
        self.done, self.total = done, total
        now = time.monotonic()
        if done < total and now - self.shown < PROGRESS_LOG_S:
            return
        self.shown = now
        verb = "has" if done >= total else "fetching"
        log.info(
            "%s %s %.1f of %.1f MB of its share of %s (%.1f s)",
            self.what,
            verb,
            done / 1e6,
            total / 1e6,
            self.model,
            now - self.started,
        )


def fetch_node_share(spec: NodeProvisionSpec, progress: ShareProgress | None = None) -> int:
    """Fetch the share of ``spec``'s node into this host's cache; the bytes fetched now.
    ShareFetchError (the node cannot start as planned) or HubUnreachable (try again)."""
    share = spec.model_share
    if share is None:
        return 0
    token = hub_token() if share.pin.needs_token else None
    if progress is None:
        progress = ShareProgress(spec, share)
    return fetch_share(share.model_dump(mode="json"), token, progress)
