"""Which offers a node may rent: the run's filters as a search query, and their order.

The filters are those of CONTRACTS "Providers"; the cheapest offer comes first, except
that a replacement goes to another machine than the node it replaces, where an offer
allows (DECISIONS 68).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from activities.providers.vastai.api import VastApi
from mvp_core.models import VastAiSettings


def offer_query(s: VastAiSettings, memory_need: int | None = None) -> dict[str, Any]:
    """The offer filters of CONTRACTS "Providers", and RAM for the stage's planned need
    (``memory_need`` bytes; Vast.ai's ``cpu_ram`` is in MiB)."""
    q: dict[str, Any] = {
        "rentable": {"eq": True},
        "rented": {"eq": False},
        "external": {"eq": False},
        "reliability": {"gte": s.min_reliability},
        "direct_port_count": {"gte": 1},
        "num_gpus": {"eq": 1},
        "inet_down": {"gte": s.min_down_mbps},
    }
    if s.gpu_name:
        q["gpu_name"] = {"eq": s.gpu_name}
    if s.min_gpu_ram_mb is not None:
        q["gpu_ram"] = {"gte": s.min_gpu_ram_mb}
    if s.min_up_mbps is not None:
        q["inet_up"] = {"gte": s.min_up_mbps}
    if s.require_verified:
        q["verified"] = {"eq": True}
    if s.max_dph is not None:
        q["dph_total"] = {"lte": s.max_dph}
    if memory_need is not None:
        q["cpu_ram"] = {"gte": -(-memory_need // (1 << 20))}
    return q


def search_offers(
    api: VastApi,
    s: VastAiSettings,
    skip: Collection[int],
    avoid_machines: Collection[int],
    memory_need: int | None = None,
) -> list[dict[str, Any]]:
    """The offers that match the run's filters, but for those in ``skip`` (tried, or
    gone since an earlier search), in the order to try them."""
    sdk = api.sdk()
    offers = api.call(
        "search offers",
        lambda: sdk.search_offers(
            query=offer_query(s, memory_need),
            order="dph_total",
            limit=20,
            storage=s.disk_gb,
            no_default=True,
        ),
    )
    candidates = [o for o in offers or [] if isinstance(o, dict) and o.get("id") not in skip]
    # A replacement goes to another machine than the node it replaces, where an offer
    # allows (DECISIONS 68); the cheapest first otherwise.
    candidates.sort(key=lambda o: o.get("machine_id") in avoid_machines)
    return candidates
