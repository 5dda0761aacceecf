"""The Vast.ai provider class: the Provider interface over the API, rental, SSH and tunnel.

Its methods, by phase: preparation (``check``, ``prepare``), ``start``, the node's life
and end (``poll_exited``, ``stop``), and the reaper's sweep (``list_resources``,
``destroy``). Each phase is a short sequence of steps whose work lives in the modules
beside this one.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

from activities.providers.base import (
    NodeStartFailed,
    Progress,
    ProviderUnavailable,
    node_exited,
)
from activities.providers.vastai import records
from activities.providers.vastai.api import NOT_RUNNING, VastApi, VastApiError
from activities.providers.vastai.logpump import (
    close_log_pump,
    ensure_log_pump,
    keep_log_pump_up,
)
from activities.providers.vastai.node_agent import (
    bootstrap,
    remove_node_environment,
    stop_node_agent,
)
from activities.providers.vastai.rental import InstanceUnusable, adopt, rent, wait_running
from activities.providers.vastai.ssh import (
    SshFailed,
    fetch_share_remote,
    fingerprint,
    key_body,
    public_key_of,
    ssh_endpoint,
    upload_models,
    wait_ssh,
)
from activities.providers.vastai.tunnel import close_tunnel, keep_tunnel_up, temporal_for
from activities.providers.vastai.worker_env import identity_path, server_url
from mvp_core import names
from mvp_core.models import (
    NodeExited,
    NodeHandle,
    NodeProvisionSpec,
    ProviderKind,
    ProviderResource,
    StopNodeResult,
    VastAiSettings,
)
from mvp_io.model_store import hub_token

log = logging.getLogger("mvp.provider.vastai")

_STATUS_POLL_S = 5.0  # poll_exited asks the API about an instance at most this often
_POLL_RATE_LIMIT_S = 30.0  # how long one such ask waits out rate limits


class VastAiProvider:
    def __init__(self, *, host: str | None = None) -> None:
        self.host = host or socket.gethostname()
        self.api = VastApi()
        self._last_poll: dict[int, float] = {}

    def sdk(self) -> Any:
        """The ``vastai`` SDK client; ProviderUnavailable without an API key."""
        return self.api.sdk()

    def _destroy(self, instance_id: int) -> None:
        """Destroy the instance within the configured deadline (:meth:`VastApi.destroy`)."""
        self.api.destroy(instance_id)

    # ------------------------------------------------------------------ preparation
    def check(self, spec_gpus: str | None) -> None:
        """An API key, and an account that answers with it."""
        sdk = self.sdk()
        try:
            self.api.call("list ssh keys", sdk.show_ssh_keys)
        except VastApiError as err:
            raise ProviderUnavailable(f"Vast.ai API at {server_url()}: {err}") from None

    def prepare(self, settings: VastAiSettings) -> str:
        """Process spec 7.3: the identity exists, its public key is derived and registered
        on the account if missing, a bootstrap command is set. Returns the key's
        fingerprint (SHA256, as ssh-keygen prints it)."""
        if not (settings.bootstrap_command or "").strip():
            raise ProviderUnavailable(
                "vastai.bootstrap_command is required when the provider is vastai"
            )
        public = public_key_of(identity_path())
        sdk = self.sdk()
        try:
            keys = self.api.call("list ssh keys", sdk.show_ssh_keys)
            rows = keys if isinstance(keys, list) else (keys or {}).get("ssh_keys", [])
            known = {
                key_body(str(k.get("public_key") or k.get("ssh_key") or ""))
                for k in rows
                if isinstance(k, dict)
            }
            if key_body(public) not in known:
                self.api.call("register ssh key", lambda: sdk.create_ssh_key(public), retry=False)
                log.info("registered the SSH identity's public key on the Vast.ai account")
        except VastApiError as err:
            raise ProviderUnavailable(f"Vast.ai SSH key registration: {err}") from None
        return fingerprint(public)

    # ------------------------------------------------------------------ start
    def start(self, spec: NodeProvisionSpec, progress: Progress | None = None) -> NodeHandle:
        try:
            return self._start(spec, progress)
        except VastApiError as err:
            if err.status != 429:
                raise
            # A 429 that leaves VastApi.call is past the start's budget (or the daily
            # search quota): another attempt would only meet the same limit.
            raise NodeStartFailed(f"vastai node {spec.node_id}: {err}") from None

    def _start(self, spec: NodeProvisionSpec, progress: Progress | None) -> NodeHandle:
        """Adopt or rent an instance until one runs and answers SSH (an unusable one is
        destroyed and another offer tried), then upload the models, reach Temporal and
        start the node agent."""
        settings = spec.vastai
        if settings is None:
            raise NodeStartFailed("a vastai node needs the run's vastai settings")
        label = names.node_resource_name(spec.run_id, spec.node_id, spec.nonce)
        phases: dict[str, float] = {}
        record = adopt(self.api, spec, label)
        tried: set[int] = set()
        while True:
            if record is None:
                record = rent(self.api, spec, settings, label, tried, phases)
            try:
                row = wait_running(self.api, record, settings, phases)
                record.public_ip, record.ssh_port = ssh_endpoint(row)
                record.ssh_user = settings.ssh_user
                records.save(record)
                wait_ssh(record, settings, phases)
                break
            except InstanceUnusable as why:
                log.warning("instance %s unusable (%s); destroying it", record.instance_id, why)
                self._destroy(record.instance_id)
                records.forget(label)
                if record.offer_id is not None:
                    tried.add(record.offer_id)
                if len(tried) >= settings.max_offers:
                    raise NodeStartFailed(
                        f"vastai node {spec.node_id}: no usable instance after "
                        f"{len(tried)} offer(s); last: instance {record.instance_id} {why}"
                    ) from None
                record = None
        try:
            share = spec.model_share
            on_instance = set(share.paths) if share is not None else set()
            upload_models(record, [m for m in spec.mounts if m not in on_instance], phases)
            fetched: int | None = None
            if share is not None:  # the instance fetches its own share from the hub
                token = hub_token() if share.pin.needs_token else None
                fetched = fetch_share_remote(record, share, token, phases, progress)
            temporal = temporal_for(record)
            bootstrap(record, spec, settings, row, temporal, phases)
            ensure_log_pump(record)  # its output here as it comes, not at its stop
        except SshFailed as err:
            raise NodeStartFailed(f"vastai node {spec.node_id}: {err}") from None
        record.phases = phases
        records.save(record)
        log.info(
            "%s: instance %s ready in %s",
            label,
            record.instance_id,
            ", ".join(f"{k} {v:.2f} s" for k, v in phases.items()),
        )
        return NodeHandle(
            run_id=spec.run_id,
            node_id=spec.node_id,
            provider=ProviderKind.VASTAI,
            host=self.host,
            log_path=str(records.node_dir(label) / "node.log"),
            resource_name=label,
            address=record.public_ip,
            instance_id=record.instance_id,
            machine_id=record.machine_id,
            share_fetched=fetched,
        )

    # ------------------------------------------------------------------ life and end
    def poll_exited(self, handles: list[NodeHandle]) -> NodeExited | None:
        """An instance the API reports gone or not running; keeps each tunnel up."""
        now = time.monotonic()
        for handle in handles:
            record = records.load(handle.resource_name)
            iid = handle.instance_id or (record.instance_id if record else None)
            if iid is None:
                continue
            if record is not None:
                keep_tunnel_up(handle.resource_name, record)
                keep_log_pump_up(handle.resource_name, record)
            if now - self._last_poll.get(iid, 0.0) < _STATUS_POLL_S:
                continue
            self._last_poll[iid] = now
            try:
                row = self.api.show(iid, now + _POLL_RATE_LIMIT_S)
            except (VastApiError, ProviderUnavailable):
                continue  # the API blinked: not evidence that an instance is gone
            if row is None:
                return node_exited(handle, f"instance {iid} is gone")
            status = row.get("actual_status")
            if status in NOT_RUNNING:
                why = str(row.get("status_msg") or "")[:200]
                return node_exited(handle, f"instance {iid} is {status}: {why}")
        return None

    def complete_bootstrap(self, handle: NodeHandle) -> None:
        """The node has read its environment file (its secrets: edge token, payload key,
        the Temporal connection's certificates): remove it from the rented disk."""
        record = records.load(handle.resource_name)
        if record is None or not record.public_ip or not record.ssh_port:
            raise RuntimeError(f"no SSH record of {handle.resource_name}")
        remove_node_environment(record)

    def stop(self, handle: NodeHandle, grace_s: float) -> StopNodeResult:
        """Ask the node to stop, keep its log, destroy the instance (never stop it)."""
        label = handle.resource_name
        record = records.load(label)
        ids: set[int] = set()
        if record is not None:
            ids.add(record.instance_id)
        if handle.instance_id is not None:
            ids.add(handle.instance_id)
        try:
            ids |= {
                int(r["id"]) for r in self.api.instances() if str(r.get("label") or "") == label
            }
        except VastApiError as err:
            if not ids:
                return StopNodeResult(node_id=handle.node_id, stopped=False, error=f"vastai: {err}")
        if record is not None and record.public_ip and record.ssh_port:
            stop_node_agent(record, grace_s)
        close_tunnel(label)
        close_log_pump(label)
        errors = []
        for iid in sorted(ids):
            try:
                self._destroy(iid)
            except VastApiError as err:
                errors.append(str(err))
        if errors:
            return StopNodeResult(
                node_id=handle.node_id,
                stopped=False,
                error=f"vastai: {'; '.join(errors)[:400]} (the reaper retries the destroy)",
            )
        records.forget(label)
        return StopNodeResult(node_id=handle.node_id, stopped=True)

    # ------------------------------------------------------------------ the reaper's sweep
    def list_resources(self) -> list[ProviderResource]:
        found = []
        for row in self.api.instances():
            label = str(row.get("label") or "")
            parsed = names.parse_resource_name(label)
            if parsed is None:
                continue  # not ours: never touched
            run_id, _, nonce8 = parsed
            found.append(
                ProviderResource(
                    provider=ProviderKind.VASTAI,
                    kind="instance",
                    name=str(int(row["id"])),
                    run_workflow_id=names.run_workflow_id(run_id),
                    nonce8=nonce8,
                    host=self.host,
                    detail=f"{label} {row.get('actual_status')}",
                )
            )
        return found

    def destroy(self, resource: ProviderResource) -> None:
        iid = int(resource.name)
        label = resource.detail.split(" ", 1)[0]
        ours = names.parse_resource_name(label) is not None
        if ours:
            close_tunnel(label)
        self._destroy(iid)
        if ours:
            records.forget(label)
