"""The Vast.ai provider: each node one rented instance, reached over SSH.

Paid instances are the one resource here that costs money while it leaks, so every step
is built around never losing one:

- **Idempotent by label.** Every instance carries the label ``mvp-<run>-<node>-<nonce8>``
  (the node's resource name). A start first adopts its own record, then an instance the
  API reports with its label, and only then rents; a worker killed between the create call
  and the record therefore never rents twice. The instance id is written to the node's
  state file (fsync, rename) before anything else happens to it.
- **Always destroy, never stop** (a stopped instance keeps billing its disk). "No such
  instance" and 404 are success; 5xx are retried with backoff; a destroy that keeps
  failing is returned as a stop error, and the reaper destroys the instance on its next
  sweep because the API still lists it.
- **A rate limit is a wait, not a failure.** Vast.ai answers a request over its rate
  limit with HTTP 429 and ``Retry-After`` (seconds until its token bucket refills). Every
  call waits that long (else backs off) and asks again, the same call on the same offer:
  a 429 says the request was not served, so even a create is safe to repeat. The waits
  stay within the budget of what the call is part of (the activity's start-to-close
  timeout, less a margin; a destroy's own deadline): past it, the call fails with
  :class:`VastRateLimited`, which names the rate limit. The daily search quota (a 429
  ``search_quota_exceeded``, reset at UTC midnight) is not waited out.
- **No silent "nothing there".** The instance list is read from the paged v1 endpoint
  and a page without its ``instances`` key is an error, never an empty account.
- **A create error that carries a contract id** destroys that instance.

Reaching things: the node's data plane listens on a container port that Vast.ai maps to
a public port; the node advertises the instance's public address and that mapped port. A
Temporal address that only this host can reach (loopback) is carried to the instance by
a reverse SSH tunnel that this provider keeps up for the node's life (``poll_exited``
restarts it). The API key and the SSH identity exist only in this worker's environment;
the node's own secrets (edge token, payload key) travel over SSH stdin into a 0600 file,
never on a command line.
"""

from __future__ import annotations

import contextlib
import email.utils
import ipaddress
import json
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psutil
import requests

from activities.heartbeat import activity_deadline
from activities.providers.base import (
    NodeStartFailed,
    ProviderUnavailable,
    harness_crash,
    node_environment,
    state_dir,
)
from activities.providers.pidstart import ProcessStart, recorded_alive, write_record
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
from mvp_core.vastai_env import (
    API_KEY_ENV,
    INSTANCE_ID_ENV,
    SERVER_URL_ENV,
    SSH_IDENTITY_ENV,
    VastAiEnvError,
    VastAiEnvironment,
)
from temporal.connect import temporal_address

log = logging.getLogger("mvp.provider.vastai")

IDENTITY_ENV = SSH_IDENTITY_ENV

REMOTE_NODE_DIR = "/var/lib/mvp/node"
REMOTE_TEMPORAL_PORT = 7233  # the tunnel's end on the instance
_LABEL = re.compile(r"mvp-([0-9]{1,20})-([0-9]{1,20})-([0-9a-f]{8})")
_NOT_RUNNING = ("exited", "unknown", "offline", "stopped", "frozen")
_STATUS_POLL_S = 5.0  # poll_exited asks the API about an instance at most this often
_POLL_RATE_LIMIT_S = 30.0  # how long one such ask waits out rate limits
_API_ATTEMPTS = 8
_API_BACKOFF_S = (0.25, 8.0)
# Rate limits (HTTP 429): one call waits them out for at most this long, and never past
# the end of the activity it runs in less _BUDGET_MARGIN_S (time to report the failure).
_RATE_LIMIT_CALL_S = 300.0
_BUDGET_MARGIN_S = 10.0
_RETRY_AFTER_MAX_S = 120.0  # a longer Retry-After is waited this long, then asked again
_MAX_VANISHED = 20  # offers that vanish between search and create, per node start
_LOCAL_TEMPORAL = ("localhost", "127.0.0.1", "::1", "[::1]", "0.0.0.0")

T = TypeVar("T")


class VastApiError(RuntimeError):
    """An API call failed for good; ``status`` is the HTTP status (0: no answer)."""

    def __init__(self, what: str, status: int, body: dict[str, Any] | None) -> None:
        self.status = status
        self.body = body or {}
        why = self.body.get("msg") or self.body.get("error") or ""
        super().__init__(f"{what}: HTTP {status}{f' ({why})' if why else ''}"[:400])


class VastRateLimited(VastApiError):
    """The API kept answering HTTP 429 until the call's budget ran out."""

    def __init__(self, what: str, tries: int, waited_s: float, retry_after: str | None) -> None:
        self.tries, self.waited_s = tries, waited_s
        told = f"Retry-After {retry_after}" if retry_after is not None else "no Retry-After"
        super().__init__(what, 429, None)
        self.args = (
            f"{what}: Vast.ai rate limit: HTTP 429 to {tries} tries over {waited_s:.1f} s "
            f"({told}), and the budget of this step ends before the next; try again later "
            "or with fewer nodes starting at once",
        )


def only_this_side(host: str) -> bool:
    """Whether a rented host cannot reach ``host``: a loopback, private, link-local or
    unspecified address, or a name that resolves only to such addresses (a laptop's dev
    server, a cluster's internal name). A name that does not resolve here counts as
    reachable: it is the operator's to say (``MVP_VASTAI_TEMPORAL_ADDRESS``)."""
    name = host.strip("[]")
    if name in _LOCAL_TEMPORAL:
        return True
    try:
        found = {a[4][0] for a in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)}
    except (OSError, UnicodeError):
        return False
    try:
        return bool(found) and all(not ipaddress.ip_address(a).is_global for a in found)
    except ValueError:
        return False


def settings() -> VastAiEnvironment:
    """This worker's Vast.ai settings (mvp_core/vastai_env.py); ProviderUnavailable when
    one is unusable."""
    try:
        return VastAiEnvironment.from_env(os.environ)
    except VastAiEnvError as err:
        raise ProviderUnavailable(str(err)) from None


def server_url() -> str:
    return settings().server_url


def identity_path() -> Path:
    return settings().ssh_identity.expanduser()


def public_key_of(identity: Path) -> str:
    """The OpenSSH public key line (``type base64``) of a private key file."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    try:
        data = identity.read_bytes()
    except OSError as err:
        raise ProviderUnavailable(
            f"missing VastAI SSH identity {identity}; create/register one with vastai "
            f"create ssh-key or set {IDENTITY_ENV} ({err.strerror})"
        ) from None
    try:
        key = serialization.load_ssh_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as err:
        # Never the key itself: the loader's words only say what kind of problem it is.
        raise ProviderUnavailable(
            f"VastAI SSH identity {identity} is not an unencrypted OpenSSH private key "
            f"({type(err).__name__})"
        ) from None
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    return public.decode()


def _key_body(line: str) -> str:
    """``type base64`` of a public key line, without its comment."""
    return " ".join(line.split()[:2])


def _backoff() -> Iterator[float]:
    delay, cap = _API_BACKOFF_S
    while True:
        yield delay
        delay = min(delay * 2, cap)


def _body(err: requests.HTTPError) -> dict[str, Any]:
    try:
        found = err.response.json() if err.response is not None else {}
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def _status(err: requests.HTTPError) -> int:
    return err.response.status_code if err.response is not None else 0


def retry_after_s(value: str | None) -> float | None:
    """Seconds a ``Retry-After`` header asks for: delay-seconds or an HTTP date (RFC 9110
    10.2.3); None when absent or unreadable. Never negative, at most _RETRY_AFTER_MAX_S."""
    if value is None or not value.strip():
        return None
    try:
        wait = float(value.strip())
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value.strip())
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            return None
        wait = when.timestamp() - time.time()
    if wait != wait:  # NaN
        return None
    return min(max(wait, 0.0), _RETRY_AFTER_MAX_S)


def _budget_end(deadline: float | None) -> float:
    """Until when (``time.monotonic()``) one call may wait out rate limits."""
    end = time.monotonic() + _RATE_LIMIT_CALL_S
    activity_end = activity_deadline()
    if activity_end is not None:
        end = min(end, activity_end - _BUDGET_MARGIN_S)
    return end if deadline is None else min(end, deadline)


@dataclass
class _Record:
    """A node's instance, as this host recorded it (state file ``instance.json``)."""

    instance_id: int
    label: str
    offer_id: int | None = None
    machine_id: int | None = None  # the host machine of the offer
    public_ip: str | None = None
    ssh_port: int | None = None
    ssh_user: str = "root"
    phases: dict[str, float] = field(default_factory=dict)


class VastAiProvider:
    def __init__(self, *, host: str | None = None) -> None:
        self.host = host or socket.gethostname()
        self._sdk: Any = None
        self._last_poll: dict[int, float] = {}

    # ------------------------------------------------------------------ the API
    def sdk(self) -> Any:
        """The ``vastai`` SDK client; ProviderUnavailable without an API key."""
        if self._sdk is None:
            env = settings()
            if env.api_key is None:
                raise ProviderUnavailable(
                    f"{API_KEY_ENV} is required when the provider is vastai (set it in the "
                    "orchestrator worker's environment)"
                )
            from vastai import VastAI  # the SDK only when a vastai run needs it

            # retry=1: this provider retries itself, with backoff and a deadline.
            self._sdk = VastAI(
                api_key=env.api_key.get_secret_value(),
                server_url=env.server_url,
                retry=1,
                raw=True,
            )
        return self._sdk

    def _call(
        self,
        what: str,
        fn: Callable[[], T],
        *,
        retry: bool = True,
        deadline: float | None = None,
    ) -> T:
        """``fn()`` with 5xx and transport errors retried with backoff (``retry``: a
        create's 5xx may have rented, so it is never repeated blindly). A 429 is always
        asked again, after its ``Retry-After`` (else the backoff), until the budget ends
        (:func:`_budget_end`; ``deadline``, a ``time.monotonic()``, may end it sooner):
        then VastRateLimited."""
        waits = _backoff()
        failures = 0  # 5xx and transport errors; 429s do not count
        limited = 0
        first_limited = 0.0
        end: float | None = None
        while True:
            try:
                return fn()
            except requests.HTTPError as err:
                status = _status(err)
                if status == 429:
                    body = _body(err)
                    if body.get("error") == "search_quota_exceeded":
                        raise VastApiError(
                            f"{what}: the account's daily search quota is spent (it resets "
                            "at 00:00 UTC)",
                            429,
                            body,
                        ) from None
                    header = (
                        err.response.headers.get("Retry-After")
                        if err.response is not None
                        else None
                    )
                    told = retry_after_s(header)
                    wait = told if told is not None else next(waits)
                    now = time.monotonic()
                    if not limited:
                        first_limited, end = now, _budget_end(deadline)
                    limited += 1
                    assert end is not None
                    if now + wait > end:
                        raise VastRateLimited(what, limited, now - first_limited, header) from None
                    log.info("%s: rate limited (HTTP 429); asking again in %.1f s", what, wait)
                    time.sleep(wait)
                    continue
                failures += 1
                if not retry or status < 500 or failures >= _API_ATTEMPTS:
                    raise VastApiError(what, status, _body(err)) from None
            except (requests.ConnectionError, requests.Timeout) as err:
                failures += 1
                if not retry or failures >= _API_ATTEMPTS:
                    raise VastApiError(f"{what}: {type(err).__name__}", 0, None) from None
            time.sleep(next(waits))

    def check(self, spec_gpus: str | None) -> None:
        """An API key, and an account that answers with it."""
        sdk = self.sdk()
        try:
            self._call("list ssh keys", sdk.show_ssh_keys)
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
            keys = self._call("list ssh keys", sdk.show_ssh_keys)
            rows = keys if isinstance(keys, list) else (keys or {}).get("ssh_keys", [])
            known = {
                _key_body(str(k.get("public_key") or k.get("ssh_key") or ""))
                for k in rows
                if isinstance(k, dict)
            }
            if _key_body(public) not in known:
                self._call("register ssh key", lambda: sdk.create_ssh_key(public), retry=False)
                log.info("registered the SSH identity's public key on the Vast.ai account")
        except VastApiError as err:
            raise ProviderUnavailable(f"Vast.ai SSH key registration: {err}") from None
        return _fingerprint(public)

    def _instances(self) -> list[dict[str, Any]]:
        """Every instance of the account, from the paged v1 list; a page without its
        ``instances`` key is an error (an API change must never look like "none")."""
        sdk = self.sdk()
        params: dict[str, Any] = {
            "select_filters": {},
            "order_by": [{"col": "id", "dir": "asc"}],
            "limit": 25,
        }
        rows: list[dict[str, Any]] = []
        for _ in range(10_000):
            page = self._call("list instances", lambda: sdk.show_instances_v1(dict(params)))
            if not isinstance(page, dict) or not isinstance(page.get("instances"), list):
                raise VastApiError("list instances: the answer has no 'instances' list", 200, None)
            rows.extend(r for r in page["instances"] if isinstance(r, dict))
            token = page.get("next_token")
            if not token:
                return rows
            params["after_token"] = token
        raise VastApiError("list instances: more than 10000 pages", 200, None)

    def _show(self, instance_id: int, deadline: float | None = None) -> dict[str, Any] | None:
        row = self._call(
            f"show instance {instance_id}",
            lambda: self.sdk().show_instance(instance_id),
            deadline=deadline,
        )
        return row if isinstance(row, dict) else None

    def _destroy(self, instance_id: int, deadline_s: float | None = None) -> None:
        """DELETE until the API confirms the instance gone; 404 is success. Raises
        VastApiError when it is still there at the deadline."""
        if deadline_s is None:
            deadline_s = settings().destroy_deadline_s
        sdk = self.sdk()
        deadline = time.monotonic() + deadline_s
        waits = _backoff()
        last: VastApiError | None = None
        while True:
            try:
                # One try per round: this loop backs off itself, within the deadline.
                self._call(
                    f"destroy instance {instance_id}",
                    lambda: sdk.destroy_instance(instance_id),
                    retry=False,
                    deadline=deadline,
                )
            except VastApiError as err:
                if err.status != 404:
                    last = err
            try:
                if self._show(instance_id, deadline) is None:
                    log.info("instance %s destroyed", instance_id)
                    return
            except VastApiError as err:
                last = err
            if time.monotonic() > deadline:
                raise last or VastApiError(
                    f"destroy instance {instance_id}: still listed after {deadline_s:.0f} s",
                    0,
                    None,
                )
            time.sleep(next(waits))

    # ------------------------------------------------------------------ records
    def _node_dir(self, label: str) -> Path:
        return state_dir() / "vastai" / label

    def _load(self, label: str) -> _Record | None:
        try:
            raw = json.loads((self._node_dir(label) / "instance.json").read_text())
            return _Record(**raw)
        except (OSError, ValueError, TypeError):
            return None

    def _save(self, record: _Record) -> None:
        node_dir = self._node_dir(record.label)
        node_dir.mkdir(parents=True, exist_ok=True)
        tmp = node_dir / "instance.json.tmp"
        with open(tmp, "w") as f:
            json.dump(record.__dict__, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, node_dir / "instance.json")

    def _forget(self, label: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self._node_dir(label) / "instance.json").unlink()

    # ------------------------------------------------------------------ start
    def start(self, spec: NodeProvisionSpec) -> NodeHandle:
        try:
            return self._start(spec)
        except VastApiError as err:
            if err.status != 429:
                raise
            # A 429 that leaves _call is past the start's budget (or the daily search
            # quota): another attempt would only meet the same limit.
            raise NodeStartFailed(f"vastai node {spec.node_id}: {err}") from None

    def _start(self, spec: NodeProvisionSpec) -> NodeHandle:
        settings = spec.vastai
        if settings is None:
            raise NodeStartFailed("a vastai node needs the run's vastai settings")
        label = names.node_resource_name(spec.run_id, spec.node_id, spec.nonce)
        phases: dict[str, float] = {}
        record = self._adopt(spec, label)
        tried: set[int] = set()
        while True:
            if record is None:
                record = self._rent(spec, settings, label, tried, phases)
            try:
                row = self._wait_running(record, settings, phases)
                record.public_ip, record.ssh_port = _ssh_endpoint(row)
                record.ssh_user = settings.ssh_user
                self._save(record)
                self._wait_ssh(record, settings, phases)
                break
            except _InstanceUnusable as why:
                log.warning("instance %s unusable (%s); destroying it", record.instance_id, why)
                self._destroy(record.instance_id)
                self._forget(label)
                if record.offer_id is not None:
                    tried.add(record.offer_id)
                if len(tried) >= settings.max_offers:
                    raise NodeStartFailed(
                        f"vastai node {spec.node_id}: no usable instance after "
                        f"{len(tried)} offer(s); last: instance {record.instance_id} {why}"
                    ) from None
                record = None
        try:
            self._upload_models(record, spec.mounts, phases)
            temporal = self._temporal_for(record)
            self._bootstrap(record, spec, settings, row, temporal, phases)
        except _SshFailed as err:
            raise NodeStartFailed(f"vastai node {spec.node_id}: {err}") from None
        record.phases = phases
        self._save(record)
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
            log_path=str(self._node_dir(label) / "node.log"),
            resource_name=label,
            address=record.public_ip,
            instance_id=record.instance_id,
            machine_id=record.machine_id,
        )

    def _adopt(self, spec: NodeProvisionSpec, label: str) -> _Record | None:
        """This execution's instance, if a previous attempt rented one: its record, else
        the API's instance with its label. Instances of an older execution of the same
        node are destroyed."""
        own = self._load(label)
        prefix = f"mvp-{spec.run_id}-{spec.node_id}-"
        found: _Record | None = None
        for row in self._instances():
            row_label = str(row.get("label") or "")
            if not row_label.startswith(prefix) or not _LABEL.fullmatch(row_label):
                continue
            iid = int(row["id"])
            if row_label != label:
                log.warning("destroying instance %s of an older execution (%s)", iid, row_label)
                self._destroy(iid)
            elif found is None and (own is None or own.instance_id == iid):
                found = own or _Record(instance_id=iid, label=label)
            else:
                # A second instance of this very label cannot come from this provider's
                # own flow; keep the recorded one and destroy the other.
                log.warning("destroying duplicate instance %s of %s", iid, label)
                self._destroy(iid)
        if found is not None:
            log.info("%s: adopting instance %s", label, found.instance_id)
        elif own is not None:
            self._forget(label)  # recorded, but the API no longer has it
        return found

    def _query(self, s: VastAiSettings) -> dict[str, Any]:
        """The offer filters of CONTRACTS "Providers"."""
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
        return q

    def _rent(
        self,
        spec: NodeProvisionSpec,
        s: VastAiSettings,
        label: str,
        tried: set[int],
        phases: dict[str, float],
    ) -> _Record:
        """Search, then create on the best offer not tried yet; an offer that vanished
        between search and create sends it back to search."""
        sdk = self.sdk()
        env = {f"-p {s.dataplane_port}:{s.dataplane_port}": "1"}
        gone: set[int] = set()
        while True:
            t0 = time.monotonic()
            offers = self._call(
                "search offers",
                lambda: sdk.search_offers(
                    query=self._query(s),
                    order="dph_total",
                    limit=20,
                    storage=s.disk_gb,
                    no_default=True,
                ),
            )
            phases["search"] = phases.get("search", 0.0) + time.monotonic() - t0
            candidates = [
                o
                for o in offers or []
                if isinstance(o, dict) and o.get("id") not in tried and o.get("id") not in gone
            ]
            if not candidates:
                raise NodeStartFailed(
                    f"vastai node {spec.node_id}: no offer matches the run's filters "
                    f"({len(tried)} tried)"
                )
            # A replacement goes to another machine than the node it replaces, where an
            # offer allows (DECISIONS 68); the cheapest first otherwise.
            candidates.sort(key=lambda o: o.get("machine_id") in spec.avoid_machines)
            offer = int(candidates[0]["id"])
            machine = candidates[0].get("machine_id")
            machine_id = machine if isinstance(machine, int) else None
            log.info("%s: trying offer %s (%d candidate(s))", label, offer, len(candidates))
            t0 = time.monotonic()
            try:
                made = self._call(
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
                    self._save(_Record(instance_id=contract, label=label, offer_id=offer))
                    log.warning(
                        "create answered %s but made instance %s; destroying it", err, contract
                    )
                    self._destroy(contract)
                    self._forget(label)
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
                    adopted = self._adopt(spec, label)
                    if adopted is not None:
                        adopted.offer_id, adopted.machine_id = offer, machine_id
                        self._save(adopted)
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
            record = _Record(
                instance_id=contract, label=label, offer_id=offer, machine_id=machine_id
            )
            harness_crash("created")  # the worker dies before the record
            self._save(record)
            phases["create"] = phases.get("create", 0.0) + time.monotonic() - t0
            log.info("%s: rented offer %s as instance %s", label, offer, contract)
            return record

    def _wait_running(
        self, record: _Record, s: VastAiSettings, phases: dict[str, float]
    ) -> dict[str, Any]:
        t0 = time.monotonic()
        deadline = t0 + s.loading_timeout_s
        while True:
            row = self._show(record.instance_id)
            if row is None:
                raise _InstanceUnusable("is gone")
            status = row.get("actual_status")
            if status == "running":
                phases["loading"] = phases.get("loading", 0.0) + time.monotonic() - t0
                return row
            if status in _NOT_RUNNING:
                raise _InstanceUnusable(f"is {status}: {str(row.get('status_msg') or '')[:200]}")
            if time.monotonic() > deadline:
                raise _InstanceUnusable(
                    f"still {status or 'provisioning'} after {s.loading_timeout_s:.0f} s"
                )
            time.sleep(s.poll_interval_s)

    # ------------------------------------------------------------------ SSH
    def _ssh_base(self, record: _Record) -> list[str]:
        known_hosts = self._node_dir(record.label) / "known_hosts"
        return [
            "ssh",
            "-i",
            str(identity_path()),
            "-p",
            str(record.ssh_port),
            "-o", "BatchMode=yes",
            "-o", "IdentitiesOnly=yes",
            # The first key an instance shows is accepted and pinned for the run.
            "-o", "StrictHostKeyChecking=accept-new",
            "-o", f"UserKnownHostsFile={known_hosts}",
            "-o", "ConnectTimeout=10",
            "-o", "ServerAliveInterval=5",
            "-o", "ServerAliveCountMax=3",
            "-o", "LogLevel=ERROR",
            f"{record.ssh_user}@{record.public_ip}",
        ]  # fmt: skip

    def _ssh(
        self, record: _Record, command: str, *, stdin: bytes | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[bytes]:
        try:
            done = subprocess.run(
                [*self._ssh_base(record), command],
                input=stdin if stdin is not None else b"",
                capture_output=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise _SshFailed(f"ssh to instance {record.instance_id} timed out") from None
        return done

    def _ssh_ok(self, record: _Record, command: str, what: str, **kw: Any) -> bytes:
        log.info("%s: %s over SSH", record.label, what)
        done = self._ssh(record, command, **kw)
        if done.returncode != 0:
            why = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["?"]
            raise _SshFailed(f"{what} on instance {record.instance_id}: {why[0][:300]}")
        return done.stdout

    def _wait_ssh(self, record: _Record, s: VastAiSettings, phases: dict[str, float]) -> None:
        """Two steps, each with backoff: the SSH banner on the mapped port, then a real
        command with the identity."""
        t0 = time.monotonic()
        deadline = t0 + s.ssh_timeout_s
        waits = _backoff()
        assert record.public_ip and record.ssh_port
        while True:
            try:
                with socket.create_connection((record.public_ip, record.ssh_port), timeout=5) as c:
                    c.settimeout(5)
                    if c.recv(64).startswith(b"SSH-"):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise _InstanceUnusable(f"no SSH banner at {record.public_ip}:{record.ssh_port}")
            time.sleep(min(next(waits), 2.0))
        while True:
            try:
                done = self._ssh(record, "true", timeout=20)
                if done.returncode == 0:
                    phases["ssh"] = time.monotonic() - t0
                    return
                why = done.stderr.decode(errors="replace").strip()[-200:]
            except _SshFailed as err:
                why = str(err)
            if time.monotonic() > deadline:
                raise _InstanceUnusable(f"SSH login failed: {why}")
            time.sleep(min(next(waits), 2.0))

    def _upload_models(self, record: _Record, paths: list[str], phases: dict[str, float]) -> None:
        """Copy each model file to the same path on the instance unless it holds it
        already (same size and SHA-256): the plan names it by that path."""
        t0 = time.monotonic()
        sent = 0
        for path in sorted(set(paths)):
            local = Path(path)
            size = local.stat().st_size
            digest = _sha256(local)
            q = shlex.quote(path)
            probe = self._ssh_ok(
                record,
                f"if [ -f {q} ] && [ $(stat -c %s {q}) = {size} ]; then sha256sum {q}; fi",
                "model probe",
            )
            if probe.split()[:1] == [digest.encode()]:
                continue
            part = shlex.quote(f"{path}.part")
            done = subprocess.run(
                [*self._ssh_base(record),
                 f"mkdir -p {shlex.quote(str(local.parent))} && cat > {part} && "
                 f"[ $(sha256sum < {part} | cut -d' ' -f1) = {digest} ] && mv {part} {q}"],
                stdin=open(local, "rb"),
                capture_output=True,
                timeout=max(120.0, size / 5e6),
                check=False,
            )  # fmt: skip
            if done.returncode != 0:
                why = done.stderr.decode(errors="replace").strip()[-200:]
                raise _SshFailed(f"model upload of {local.name} failed: {why}")
            sent += size
        phases["upload"] = time.monotonic() - t0
        if sent:
            log.info("uploaded %.1f MB of model to instance %s", sent / 1e6, record.instance_id)

    # ------------------------------------------------------------------ Temporal
    def _temporal_for(self, record: _Record) -> str:
        """Where the node reaches Temporal: as configured when the instance can reach it,
        else through this host's reverse tunnel (its end on the instance's loopback)."""
        configured = settings().temporal_address
        if configured:
            return configured
        address = temporal_address()
        host, _, _port = address.rpartition(":")
        if not only_this_side(host):
            return address
        self._ensure_tunnel(record)
        return f"127.0.0.1:{REMOTE_TEMPORAL_PORT}"

    def _tunnel_file(self, label: str) -> Path:
        return self._node_dir(label) / "tunnel.json"

    def _ensure_tunnel(self, record: _Record) -> None:
        if recorded_alive(self._tunnel_file(record.label)) is not None:
            return
        address = temporal_address()
        host, _, port = address.rpartition(":")
        host = "127.0.0.1" if host in ("localhost", "0.0.0.0") else host.strip("[]")
        base = self._ssh_base(record)
        cmd = [
            *base[:-1],
            "-N",
            "-o", "ExitOnForwardFailure=yes",
            "-R", f"127.0.0.1:{REMOTE_TEMPORAL_PORT}:{host}:{port}",
            base[-1],
        ]  # fmt: skip
        node_dir = self._node_dir(record.label)
        node_dir.mkdir(parents=True, exist_ok=True)
        with open(node_dir / "tunnel.log", "ab") as out:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True
            )
        write_record(
            self._tunnel_file(record.label), proc.pid, ProcessStart.of(psutil.Process(proc.pid))
        )
        # The forward is up once the instance's end accepts connections.
        probe = (
            f"for i in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/{REMOTE_TEMPORAL_PORT}) "
            "2>/dev/null && exit 0; sleep 0.1; done; exit 1"
        )
        done = self._ssh(record, f"bash -c {shlex.quote(probe)}", timeout=30)
        if done.returncode != 0 or proc.poll() is not None:
            tail = (node_dir / "tunnel.log").read_text(errors="replace").strip()[-200:]
            raise _SshFailed(
                f"the Temporal tunnel to instance {record.instance_id} is down: {tail}"
            )
        log.info("%s: Temporal tunnel up (pid %s)", record.label, proc.pid)

    def _close_tunnel(self, label: str) -> None:
        tunnel = recorded_alive(self._tunnel_file(label))
        if tunnel is not None:
            with contextlib.suppress(OSError):
                os.killpg(tunnel.pid, signal.SIGTERM)
        with contextlib.suppress(FileNotFoundError):
            self._tunnel_file(label).unlink()

    # ------------------------------------------------------------------ bootstrap
    def _bootstrap(
        self,
        record: _Record,
        spec: NodeProvisionSpec,
        s: VastAiSettings,
        row: dict[str, Any],
        temporal: str,
        phases: dict[str, float],
    ) -> None:
        """Write the node's environment (0600, over stdin), then start the bootstrap
        command detached in its own session, unless this execution's node runs already."""
        t0 = time.monotonic()
        mapped = _mapped_port(row, s.dataplane_port)
        if mapped is None:
            raise _SshFailed(
                f"instance {record.instance_id} reports no mapping of port {s.dataplane_port}"
            )
        host_env = {
            "MVP_DATAPLANE_HOST": "0.0.0.0",
            "MVP_DATAPLANE_PORT": str(s.dataplane_port),
            "MVP_ADVERTISE_HOST": str(record.public_ip),
            "MVP_ADVERTISE_PORT": str(mapped),
            SERVER_URL_ENV: server_url(),
            INSTANCE_ID_ENV: str(record.instance_id),
            "PYTHONUNBUFFERED": "1",
            "OMP_WAIT_POLICY": "PASSIVE",
            "MVP_BOOTSTRAP_COMMAND": s.bootstrap_command or "",
            "MVP_NODE_RESOURCE": record.label,
        }
        # Certificates travel inline (in the 0600 env file): the instance has none of
        # this host's files.
        env = node_environment(
            spec, REMOTE_NODE_DIR, host_env=host_env, temporal_address=temporal, inline_files=True
        )
        env_file = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted(env.items()))
        d = shlex.quote(REMOTE_NODE_DIR)
        self._ssh_ok(
            record,
            f"umask 077 && mkdir -p {d} && cat > {d}/node.env.part && mv {d}/node.env.part {d}/node.env",
            "writing the node environment",
            stdin=env_file.encode(),
        )
        launch = (
            f"cd {d} && "
            'if [ -f node.pid ] && kill -0 "$(cat node.pid)" 2>/dev/null; then exit 0; fi; '
            ". ./node.env && "
            'nohup setsid sh -c "$MVP_BOOTSTRAP_COMMAND" > node.log 2>&1 < /dev/null & '
            "echo $! > node.pid"
        )
        self._ssh_ok(record, f"sh -c {shlex.quote(launch)}", "starting the node agent")
        phases["bootstrap"] = time.monotonic() - t0

    # ------------------------------------------------------------------ stop
    def stop(self, handle: NodeHandle, grace_s: float) -> StopNodeResult:
        """Ask the node to stop, keep its log, destroy the instance (never stop it)."""
        label = handle.resource_name
        record = self._load(label)
        ids: set[int] = set()
        if record is not None:
            ids.add(record.instance_id)
        if handle.instance_id is not None:
            ids.add(handle.instance_id)
        try:
            ids |= {int(r["id"]) for r in self._instances() if str(r.get("label") or "") == label}
        except VastApiError as err:
            if not ids:
                return StopNodeResult(node_id=handle.node_id, stopped=False, error=f"vastai: {err}")
        if record is not None and record.public_ip and record.ssh_port:
            self._stop_node_agent(record, grace_s)
        self._close_tunnel(label)
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
        self._forget(label)
        return StopNodeResult(node_id=handle.node_id, stopped=True)

    def _stop_node_agent(self, record: _Record, grace_s: float) -> None:
        """Best effort, bounded: SIGTERM the node's session, wait, keep its log here."""
        d = shlex.quote(REMOTE_NODE_DIR)
        wait = max(int(grace_s * 10), 1)
        script = (
            f"cd {d} 2>/dev/null || exit 0; p=$(cat node.pid 2>/dev/null) || exit 0; "
            'kill -TERM -- "-$p" 2>/dev/null; '
            f'for i in $(seq {wait}); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done; '
            'kill -KILL -- "-$p" 2>/dev/null; tail -c 2000000 node.log 2>/dev/null; exit 0'
        )
        with contextlib.suppress(_SshFailed):
            done = self._ssh(record, f"sh -c {shlex.quote(script)}", timeout=grace_s + 20)
            if done.returncode == 0:
                node_dir = self._node_dir(record.label)
                node_dir.mkdir(parents=True, exist_ok=True)
                (node_dir / "node.log").write_bytes(done.stdout)

    def poll_exited(self, handles: list[NodeHandle]) -> NodeExited | None:
        """An instance the API reports gone or not running; keeps each tunnel up."""
        now = time.monotonic()
        for handle in handles:
            record = self._load(handle.resource_name)
            iid = handle.instance_id or (record.instance_id if record else None)
            if iid is None:
                continue
            if record is not None and self._tunnel_file(handle.resource_name).exists():
                with contextlib.suppress(_SshFailed, OSError):
                    if recorded_alive(self._tunnel_file(handle.resource_name)) is None:
                        log.warning("%s: Temporal tunnel down; restarting it", handle.resource_name)
                        self._ensure_tunnel(record)
            if now - self._last_poll.get(iid, 0.0) < _STATUS_POLL_S:
                continue
            self._last_poll[iid] = now
            try:
                row = self._show(iid, now + _POLL_RATE_LIMIT_S)
            except (VastApiError, ProviderUnavailable):
                continue  # the API blinked: not evidence that an instance is gone
            if row is None:
                return NodeExited(
                    run_id=handle.run_id, node_id=handle.node_id, detail=f"instance {iid} is gone"
                )
            status = row.get("actual_status")
            if status in _NOT_RUNNING:
                return NodeExited(
                    run_id=handle.run_id,
                    node_id=handle.node_id,
                    detail=f"instance {iid} is {status}: {str(row.get('status_msg') or '')[:200]}",
                )
        return None

    # ------------------------------------------------------------------ the reaper's sweep
    def list_resources(self) -> list[ProviderResource]:
        found = []
        for row in self._instances():
            label = str(row.get("label") or "")
            m = _LABEL.fullmatch(label)
            if m is None:
                continue  # not ours: never touched
            found.append(
                ProviderResource(
                    provider=ProviderKind.VASTAI,
                    kind="instance",
                    name=str(int(row["id"])),
                    run_workflow_id=names.run_workflow_id(int(m.group(1))),
                    nonce8=m.group(3),
                    host=self.host,
                    detail=f"{label} {row.get('actual_status')}",
                )
            )
        return found

    def destroy(self, resource: ProviderResource) -> None:
        iid = int(resource.name)
        label = resource.detail.split(" ", 1)[0]
        if _LABEL.fullmatch(label):
            self._close_tunnel(label)
        self._destroy(iid)
        if _LABEL.fullmatch(label):
            self._forget(label)


class _InstanceUnusable(Exception):
    """This instance will not serve: destroy it and try another offer."""


class _SshFailed(Exception):
    """An SSH step failed for good."""


def _ssh_endpoint(row: dict[str, Any]) -> tuple[str, int]:
    """The instance's direct SSH endpoint: its public address and the port mapped to its
    container port 22, else the SSH host and port the API names."""
    ip = row.get("public_ipaddr")
    mapped = _mapped_port(row, 22)
    if ip and mapped:
        return str(ip).strip(), mapped
    host, port = row.get("ssh_host"), row.get("ssh_port")
    if host and port:
        return str(host), int(port)
    raise _InstanceUnusable("reports no SSH endpoint")


def _mapped_port(row: dict[str, Any], port: int) -> int | None:
    ports = row.get("ports") or {}
    for binding in ports.get(f"{port}/tcp") or []:
        with contextlib.suppress(KeyError, TypeError, ValueError):
            return int(binding["HostPort"])
    return None


def _sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fingerprint(public: str) -> str:
    import base64
    import hashlib

    raw = base64.b64decode(public.split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(raw).digest()).decode().rstrip("=")
