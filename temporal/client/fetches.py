"""Node shares being fetched now, as the run's pending start activities tell them
(DECISIONS 79): a fetch's progress is its start activity's heartbeat details
(activities/model_share.py ShareProgress), which a server keeps for a pending activity
without writing history; the run's snapshot has each node's share figures once it has
started (``NodeHandle.share_bytes``, ``share_fetched``)."""

from __future__ import annotations

from temporalio.client import Client

from mvp_core import names
from mvp_core.names import QUERY_TIMEOUT


def fetch_progress(details: object) -> tuple[int, int, int] | None:
    """(node, bytes held, bytes in all) of a start activity's heartbeat details; None for
    any other details (they are read as untrusted: whole numbers, held within all)."""
    fetch = details.get("fetch") if isinstance(details, dict) else None
    if not isinstance(fetch, dict):
        return None
    values = [fetch.get(k) for k in ("node_id", "bytes_held", "bytes_total")]
    ints = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
    if len(ints) != 3 or not 0 <= ints[1] <= ints[2]:
        return None
    return ints[0], ints[1], ints[2]


async def share_fetches(client: Client, workflow_id: str) -> dict[int, tuple[int, int]]:
    """The shares workflow ``workflow_id``'s nodes are fetching now, by node id: (bytes
    held, bytes in all). One describe; the SDK's RPCError where it fails."""
    desc = await client.get_workflow_handle(workflow_id).describe(rpc_timeout=QUERY_TIMEOUT)
    found: dict[int, tuple[int, int]] = {}
    for pending in desc.raw_description.pending_activities:
        if pending.activity_type.name != names.ACT_START_NODE:
            continue
        payloads = pending.heartbeat_details.payloads
        if not payloads:
            continue
        try:
            details = await client.data_converter.decode(payloads)
        except Exception:  # details this client cannot read (another codec): not shown
            continue
        for d in details:
            got = fetch_progress(d)
            if got is not None:
                found[got[0]] = got[1:]
    return found
