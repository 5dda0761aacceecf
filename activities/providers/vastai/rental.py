"""Renting a node's instance, or adopting the one an earlier attempt rented.

Idempotent by label: a start first adopts its own record, then an instance the API reports
with its label, and only then rents, so a worker killed between the create call and the
record never rents twice. A create error that carries a contract id destroys that
instance; an offer that vanished between search and create sends the start back to
search. The instance is then watched until it runs; one that will not is
:class:`InstanceUnusable`, and the start tries another offer.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from activities.providers.base import NodeStartFailed, harness_crash
from activities.providers.vastai import records
from activities.providers.vastai.api import NOT_RUNNING, VastApi, VastApiError
from activities.providers.vastai.offers import search_offers
from activities.providers.vastai.records import InstanceRecord
from mvp_core import names
from mvp_core.models import NodeProvisionSpec, VastAiSettings

log = logging.getLogger("mvp.provider.vastai")

_MAX_VANISHED = 20  # offers that vanish between search and create, per node start


class InstanceUnusable(Exception):
    """This instance will not serve: destroy it and try another offer."""


def adopt(api: VastApi, spec: NodeProvisionSpec, label: str) -> InstanceRecord | None:
    """This execution's instance, if a previous attempt rented one: its record, else
    the API's instance with its label. Instances of an older execution of the same
    node are destroyed."""
    own = records.load(label)
    prefix = f"mvp-{spec.run_id}-{spec.node_id}-"
    found: InstanceRecord | None = None
    for row in api.instances():
        row_label = str(row.get("label") or "")
        if not row_label.startswith(prefix) or names.parse_resource_name(row_label) is None:
            continue
        iid = int(row["id"])
        if row_label != label:
            log.warning("destroying instance %s of an older execution (%s)", iid, row_label)
            api.destroy(iid)
        elif found is None and (own is None or own.instance_id == iid):
            found = own or InstanceRecord(instance_id=iid, label=label)
        else:
            # A second instance of this very label cannot come from this provider's
            # own flow; keep the recorded one and destroy the other.
            log.warning("destroying duplicate instance %s of %s", iid, label)
            api.destroy(iid)
    if found is not None:
        log.info("%s: adopting instance %s", label, found.instance_id)
    elif own is not None:
        records.forget(label)  # recorded, but the API no longer has it
    return found


def rent(
    api: VastApi,
    spec: NodeProvisionSpec,
    s: VastAiSettings,
    label: str,
    tried: set[int],
    phases: dict[str, float],
) -> InstanceRecord:
    """Search, then create on the best offer not tried yet; an offer that vanished
    between search and create sends it back to search."""
    sdk = api.sdk()
    env = {f"-p {s.dataplane_port}:{s.dataplane_port}": "1"}
    gone: set[int] = set()
    while True:
        t0 = time.monotonic()
        candidates = search_offers(api, s, tried | gone, spec.avoid_machines, spec.memory_need)
        phases["search"] = phases.get("search", 0.0) + time.monotonic() - t0
        if not candidates:
            ram = (
                ""
                if spec.memory_need is None
                else f", {-(-spec.memory_need // (1 << 20))} MiB of RAM or more for its stage"
            )
            raise NodeStartFailed(
                f"vastai node {spec.node_id}: no offer matches the run's filters{ram} "
                f"({len(tried)} tried)"
            )
        offer = int(candidates[0]["id"])
        machine = candidates[0].get("machine_id")
        machine_id = machine if isinstance(machine, int) else None
        log.info("%s: trying offer %s (%d candidate(s))", label, offer, len(candidates))
        t0 = time.monotonic()
        try:
            made = api.call(
                f"create instance on offer {offer}",
                lambda offer=offer: sdk.create_instance(  # type: ignore[misc]
                    offer,
                    image=s.image,
                    disk=s.disk_gb,
                    env=env,
                    label=label,
                    onstart_cmd=s.onstart,
                    ssh=True,
                    direct=True,
                ),
                retry=False,  # a 5xx may have rented it: never create blindly again
            )
        except VastApiError as err:
            if err.status == 429:
                raise  # not the offer's fault: the whole start is out of time
            contract = err.body.get("new_contract")
            if isinstance(contract, int) and contract > 0:
                # It failed, yet an instance exists: record it, then destroy it.
                records.save(InstanceRecord(instance_id=contract, label=label, offer_id=offer))
                log.warning("create answered %s but made instance %s; destroying it", err, contract)
                api.destroy(contract)
                records.forget(label)
                tried.add(offer)
            elif err.status in (400, 404, 410):
                # Rented by someone else since the search: search again, without it.
                gone.add(offer)
                if len(gone) > _MAX_VANISHED:
                    raise NodeStartFailed(
                        f"vastai node {spec.node_id}: {len(gone)} offers vanished before "
                        f"they could be rented; last: {err}"
                    ) from None
                continue
            elif err.status >= 500:
                # No contract in the answer: whether it rented is unknown; ask by label.
                adopted = adopt(api, spec, label)
                if adopted is not None:
                    adopted.offer_id, adopted.machine_id = offer, machine_id
                    records.save(adopted)
                    return adopted
                tried.add(offer)
            else:
                raise NodeStartFailed(f"vastai node {spec.node_id}: {err}") from None
            if len(tried) >= s.max_offers:
                raise NodeStartFailed(
                    f"vastai node {spec.node_id}: no instance after {len(tried)} offer(s): {err}"
                ) from None
            continue
        contract = made.get("new_contract") if isinstance(made, dict) else None
        if not isinstance(contract, int):
            raise NodeStartFailed(f"vastai node {spec.node_id}: create answered {made!r}"[:300])
        record = InstanceRecord(
            instance_id=contract, label=label, offer_id=offer, machine_id=machine_id
        )
        harness_crash("created")  # the worker dies before the record
        records.save(record)
        phases["create"] = phases.get("create", 0.0) + time.monotonic() - t0
        log.info("%s: rented offer %s as instance %s", label, offer, contract)
        return record


def wait_running(
    api: VastApi, record: InstanceRecord, s: VastAiSettings, phases: dict[str, float]
) -> dict[str, Any]:
    """The instance's row once the API reports it running; InstanceUnusable when it is
    gone, will not run, or is not up within the loading timeout."""
    t0 = time.monotonic()
    deadline = t0 + s.loading_timeout_s
    while True:
        row = api.show(record.instance_id)
        if row is None:
            raise InstanceUnusable("is gone")
        status = row.get("actual_status")
        if status == "running":
            phases["loading"] = phases.get("loading", 0.0) + time.monotonic() - t0
            return row
        if status in NOT_RUNNING:
            raise InstanceUnusable(f"is {status}: {str(row.get('status_msg') or '')[:200]}")
        if time.monotonic() > deadline:
            raise InstanceUnusable(
                f"still {status or 'provisioning'} after {s.loading_timeout_s:.0f} s"
            )
        time.sleep(s.poll_interval_s)
