"""The Vast.ai stand-in (tests/helpers/vast_standin.py) driven by the real ``vastai`` SDK:
its instances are real SSH hosts on the tests' private Docker daemon, its switches inject
the API's failure modes, and its ledger says what a client left behind."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import pytest
import requests
from vastai import VastAI

from tests.helpers.dockerd import Dockerd
from tests.helpers.vast_standin import RateLimit, Switches, VastStandin, matches, vast_standin
from tests.helpers.waits import wait_until

API_KEY = "vast-test-account-0b7e4d2a9c"
REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
# What the Vast.ai provider asks for: one GPU, reliable, with direct ports, free.
QUERY: dict[str, Any] = {
    "reliability": {"gte": 0.95},
    "direct_port_count": {"gte": 1},
    "num_gpus": {"eq": 1},
    "rentable": {"eq": True},
    "rented": {"eq": False},
}
ENV = {"-p 7000:7000": "1", "FOO": "bar"}


@dataclass
class Identity:
    key: Path
    public: str
    dir: Path


@pytest.fixture(scope="module")
def standin(dockerd: Dockerd) -> Iterator[VastStandin]:
    client = docker.DockerClient(base_url=dockerd.host, timeout=60)
    try:
        with vast_standin(client, api_key=API_KEY) as s:
            yield s
        ours: dict[str, str | list[str] | bool] = {"label": [f"vast-standin={s.id}"]}
        left = client.containers.list(all=True, filters=ours) + client.networks.list(filters=ours)
        assert not left, f"close() left {left}"
    finally:
        client.close()


@pytest.fixture(scope="module")
def identity(standin: VastStandin, tmp_path_factory: pytest.TempPathFactory) -> Identity:
    """An SSH identity, registered with the account (so every instance authorizes it)."""
    d = tmp_path_factory.mktemp("vastssh")
    key = d / "id_ed25519"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "test@standin", "-f", str(key)],
        check=True,
    )
    public = (d / "id_ed25519.pub").read_text().strip()
    VastAI(api_key=API_KEY, server_url=standin.url).create_ssh_key(public)
    return Identity(key, public, d)


@pytest.fixture
def vast(standin: VastStandin, identity: Identity) -> Iterator[VastAI]:
    """The SDK on the stand-in; after each test nothing may be left behind (and whatever
    was is destroyed, so that one failure does not spread)."""
    yield VastAI(api_key=API_KEY, server_url=standin.url)
    standin.switches = Switches()
    left = standin.left_behind()
    for rec in left:
        standin.destroy(rec.id)
    assert left == []


def http_error(call: Any, *args: Any, **kwargs: Any) -> requests.Response:
    with pytest.raises(requests.HTTPError) as err:
        call(*args, **kwargs)
    assert err.value.response is not None
    return err.value.response


def wait_status(
    vast: VastAI, iid: int, want: str, timeout: float = 30.0, seen: list[Any] | None = None
) -> dict[str, Any]:
    """The instance's row once its status is ``want``; each status seen on the way is
    appended to ``seen``."""

    def reached() -> dict[str, Any] | None:
        row: dict[str, Any] | None = vast.show_instance(iid)
        assert row is not None, f"instance {iid} vanished"
        if seen is not None and (not seen or seen[-1] != row["actual_status"]):
            seen.append(row["actual_status"])
        return row if row["actual_status"] == want else None

    return wait_until(
        reached,
        timeout=timeout,
        what=f"{iid} to be {want}",
        interval=0.1,
        detail=lambda: repr((vast.show_instance(iid) or {}).get("actual_status")),
    )


def create(vast: VastAI, label: str, n: int = 1, **kwargs: Any) -> list[int]:
    offers = vast.search_offers(query=dict(QUERY), no_default=True)
    assert len(offers) >= n, offers
    made = []
    for offer in offers[:n]:
        answer = vast.create_instance(
            offer["id"], image="vastai/base:standin", env=dict(ENV), label=label, **kwargs
        )
        assert answer["success"] is True, answer
        made.append(int(answer["new_contract"]))
    return made


def running(vast: VastAI, label: str, n: int = 1) -> list[dict[str, Any]]:
    return [wait_status(vast, iid, "running") for iid in create(vast, label, n)]


def ssh(
    identity: Identity, row: dict[str, Any], command: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*ssh_args(identity, row), command],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


def ssh_args(identity: Identity, row: dict[str, Any], *extra: str) -> list[str]:
    """ssh to the instance of ``row`` as root with the registered key; ``extra`` options
    go before the destination. Each instance has a known_hosts file of its own (a later
    instance may get the same port, with another host key)."""
    known = identity.dir / f"known_hosts_{row['id']}"
    return [
        "ssh",
        "-F",
        "/dev/null",
        "-i",
        str(identity.key),
        "-p",
        str(row["ssh_port"]),
        "-o",
        "BatchMode=yes",
        "-o",
        "IdentitiesOnly=yes",
        "-o",
        "StrictHostKeyChecking=accept-new",
        "-o",
        f"UserKnownHostsFile={known}",
        "-o",
        "ConnectTimeout=10",
        "-o",
        "LogLevel=ERROR",
        *extra,
        f"root@{row['ssh_host']}",
    ]


def environ(identity: Identity, row: dict[str, Any]) -> dict[str, str]:
    out = ssh(identity, row, "cat /proc/1/environ")
    assert out.returncode == 0, out.stderr
    return dict(e.split("=", 1) for e in out.stdout.split("\0") if "=" in e)


def host_port(row: dict[str, Any], port: int) -> int:
    return int(row["ports"][f"{port}/tcp"][0]["HostPort"])


def test_keys_search_create_ssh_list_and_destroy(
    vast: VastAI, standin: VastStandin, identity: Identity
):
    keys = vast.show_ssh_keys()
    assert [k["public_key"] for k in keys] == [identity.public]
    assert set(keys[0]) >= {"id", "user_id", "public_key", "created_at"}
    again = identity.public.rsplit(" ", 1)[0] + " another-comment"
    dup = http_error(vast.create_ssh_key, again)
    assert dup.status_code == 400 and dup.json()["error"] == "duplicate_key"

    # The SDK passes a dict query through, adding order (score desc), type and storage.
    offers = vast.search_offers(query=dict(QUERY), no_default=True)
    free = [o for o in standin.offers() if not o["vanished"]]
    expected = sorted((o for o in free if matches(o, QUERY)), key=lambda o: -o["score"])
    assert [o["id"] for o in offers] == [o["id"] for o in expected] and len(offers) >= 2
    cheap = vast.search_offers(query=dict(QUERY), order="dph_total", limit=2, no_default=True)
    assert [o["id"] for o in cheap] == [
        o["id"] for o in sorted(expected, key=lambda o: o["dph_total"])[:2]
    ]
    assert all(o["public_ipaddr"] == standin.public_ip for o in offers)

    t0 = time.monotonic()
    a, b = create(vast, "standin-life", 2, onstart_cmd="echo ran in $CONTAINER_ID > /root/o")
    first = vast.show_instance(a)
    assert first is not None
    if time.monotonic() - t0 < 0.25:
        assert first["actual_status"] is None and first["ssh_port"] is None
    seen: list[Any] = []
    row = wait_status(vast, a, "running", seen=seen)
    assert set(seen) <= {None, "loading", "running"}
    rows = {a: row, b: wait_status(vast, b, "running")}
    for iid, r in rows.items():
        assert r["id"] == iid and r["label"] == "standin-life"
        assert r["ssh_host"] == r["public_ipaddr"] == standin.public_ip
        assert r["ssh_port"] == host_port(r, 22) and host_port(r, 7000) > 0
        assert r["extra_env"] == {"FOO": "bar"}  # the SDK made the pairs a dict
        assert r["image_uuid"] == "vastai/base:standin" and r["intended_status"] == "running"
        assert "CONTAINER_API_KEY" not in str(r)

    # Rented offers no longer match rented=false, and cannot be rented twice.
    taken = {standin.record(a).offer_id, standin.record(b).offer_id}
    assert not taken & {o["id"] for o in vast.search_offers(query=dict(QUERY), no_default=True)}
    busy = http_error(vast.create_instance, standin.record(a).offer_id, image="x", env={})
    assert busy.status_code == 400 and busy.json()["error"] == "no_such_ask"

    # A real SSH host: the registered key logs in, PID 1 has Vast's environment, SSH
    # sessions do not, and this venv's Python runs with the repository at the same path.
    env = environ(identity, rows[a])
    rec = standin.record(a)
    assert env["FOO"] == "bar" and env["CONTAINER_ID"] == str(a)
    assert env["CONTAINER_API_KEY"] == rec.container_api_key and len(rec.container_api_key) == 32
    assert env["VAST_CONTAINERLABEL"] == f"C.{a}" and env["PUBLIC_IPADDR"] == standin.public_ip
    assert env["VAST_TCP_PORT_22"] == str(rows[a]["ssh_port"])
    assert env["VAST_TCP_PORT_7000"] == str(host_port(rows[a], 7000))
    out = ssh(
        identity, rows[a], f"env; cd {REPO} && {PYTHON} -c 'import workers, sys; print(sys.prefix)'"
    )
    assert out.returncode == 0, out.stderr
    assert "FOO=" not in out.stdout and "CONTAINER_API_KEY" not in out.stdout
    assert out.stdout.strip().endswith(sys.prefix)
    onstart = ssh(identity, rows[a], "cat /root/onstart.sh /root/o")  # with PID 1's env
    assert onstart.stdout.splitlines()[-1] == f"ran in {a}", onstart
    known = (identity.dir / f"known_hosts_{a}").read_text()
    assert rec.host_public_key.split()[1] in known

    # The v1 list, one row a page.
    params: dict[str, Any] = {
        "select_filters": {"label": {"eq": "standin-life"}},
        "order_by": [{"col": "id", "dir": "asc"}],
        "limit": 1,
    }
    page = vast.show_instances_v1(dict(params))
    assert [r["id"] for r in page["instances"]] == [a] and page["total_instances"] == 2
    assert isinstance(page["next_token"], str)
    page2 = vast.show_instances_v1({**params, "after_token": page["next_token"]})
    assert [r["id"] for r in page2["instances"]] == [b] and page2["next_token"] is None
    desc = vast.show_instances_v1({**params, "order_by": [{"col": "id", "dir": "desc"}]})
    assert [r["id"] for r in desc["instances"]] == [b]
    for status, n in (("running", 2), ("exited", 0)):
        flt = {"label": {"eq": "standin-life"}, "actual_status": {"in": [status]}}
        got = vast.show_instances_v1({**params, "select_filters": flt, "limit": 25})
        assert len(got["instances"]) == n
    listed = {r["id"]: r for r in vast.show_instances()}
    assert set(listed) == {a, b} and listed[a]["extra_env"] == {"FOO": "bar"}

    for iid in (a, b):
        assert vast.destroy_instance(iid) == {"success": True}
        assert vast.show_instance(iid) is None
    assert standin.left_behind() == [] and vast.show_instances() == []
    ours = standin.docker.containers.list(
        all=True, filters={"label": [f"vast-standin={standin.id}"]}
    )
    assert ours == []  # an account-key destroy removes the container before it answers
    gone = http_error(vast.destroy_instance, a)
    assert gone.status_code == 404 and gone.json()["error"] == "no_such_instance"
    back = {o["id"] for o in vast.search_offers(query=dict(QUERY), no_default=True)}
    assert taken <= back
    assert standin.creates_per_label()["standin-life"] == 2
    billed = standin.billed_seconds(a)
    time.sleep(0.05)
    assert billed == standin.billed_seconds(a) > 0
    assert not [r for r in standin.requests if r[2] == 410 or "stop" in r[1]]


def test_search_semantics_auth_and_bad_requests(vast: VastAI, standin: VastStandin):
    every = {o["id"] for o in standin.offers() if not o["vanished"]}
    search = vast.search_offers
    assert search(query={"no_such_field": {"eq": 1}}, no_default=True) == []
    assert {o["id"] for o in search(query={"no_such_field": {"neq": 1}}, no_default=True)} == every
    gpus = {"gpu_name": {"in": ["RTX 3090", "A100 SXM4"]}}
    assert {o["gpu_name"] for o in search(query=gpus, no_default=True)} <= {"RTX 3090", "A100 SXM4"}
    notin = {"gpu_name": {"notin": ["RTX 4090"]}, "dph_total": {"lt": 1.0}}
    assert all(
        o["gpu_name"] != "RTX 4090" and o["dph_total"] < 1.0
        for o in search(query=notin, no_default=True)
    )
    asc = search(query={}, order="num_gpus-,dph_total", no_default=True)
    assert [(o["num_gpus"], o["dph_total"]) for o in asc] == sorted(
        ((o["num_gpus"], o["dph_total"]) for o in asc), key=lambda t: (-t[0], t[1])
    )
    assert len(search(query={}, limit=3, no_default=True)) == min(3, len(every))
    # The SDK's own defaults: verified, not external, rentable, not rented.
    assert all(o["verified"] for o in search())

    bad = VastAI(api_key="not-the-key", server_url=standin.url, retry=1)
    denied = http_error(bad.show_ssh_keys)
    assert denied.status_code == 401 and denied.json()["error"] == "invalid_api_key"
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = requests.post(f"{standin.url}/api/v0/bundles/", data="{nope", headers=headers, timeout=10)
    assert r.status_code == 400 and r.json()["success"] is False
    r = requests.get(f"{standin.url}/api/v0/nothing/here/", headers=headers, timeout=10)
    assert r.status_code == 404 and r.json()["success"] is False
    r = requests.post(
        f"{standin.url}/api/v0/bundles/", json={"x": {"like": 1}}, headers=headers, timeout=10
    )
    assert r.status_code == 400


def test_the_runs_offer_query_asks_for_the_stages_ram(vast: VastAI, standin: VastStandin):
    """The provider's own query (activities/providers/vastai/offers.py) with a stage's
    planned need: only offers with that much RAM (cpu_ram, MiB) come back."""
    from activities.providers.vastai.offers import offer_query
    from mvp_core.models import VastAiSettings

    settings = VastAiSettings(min_reliability=0.0, min_down_mbps=0)
    every = vast.search_offers(query=offer_query(settings), no_default=True)
    assert every and all("cpu_ram" in o for o in every)
    most = max(o["cpu_ram"] for o in every)
    need = most * (1 << 20)  # bytes: exactly the largest offer's RAM
    fits = vast.search_offers(query=offer_query(settings, need), no_default=True)
    assert fits and all(o["cpu_ram"] >= most for o in fits)
    assert vast.search_offers(query=offer_query(settings, need + 1), no_default=True) == []


def test_rate_limit_burst_answers_429_without_retry_after(vast: VastAI, standin: VastStandin):
    standin.switches.rate_limit_burst = 1
    once = VastAI(api_key=API_KEY, server_url=standin.url, retry=1)
    limited = http_error(once.show_ssh_keys)
    assert limited.status_code == 429 and "Retry-After" not in limited.headers
    assert limited.json()["error"] == "rate_limited"
    assert once.show_ssh_keys()  # the burst is over
    standin.switches.rate_limit_burst = 2
    assert vast.show_ssh_keys()  # the SDK's own retries (3 tries, backoff) get through
    assert [s for m, p, s in standin.requests[-3:]] == [429, 429, 200]
    assert standin.switches.rate_limit_burst == 0


def test_rate_limits_answer_429_with_retry_after_on_the_chosen_calls(
    vast: VastAI, standin: VastStandin
):
    rule = RateLimit(times=1, retry_after="2", method="GET", path=r"^/api/v0/ssh/?$")
    standin.switches.rate_limits = [rule]
    once = VastAI(api_key=API_KEY, server_url=standin.url, retry=1)
    assert once.search_offers(query=dict(QUERY), no_default=True)  # another call: served
    limited = http_error(once.show_ssh_keys)
    assert limited.status_code == 429 and limited.headers["Retry-After"] == "2"
    assert limited.json()["error"] == "rate_limited" and rule.times == 0 and rule.answered == 1
    assert once.show_ssh_keys()  # the rule is spent
    # Before the key is checked, as a rate limiter answers: a wrong key gets a 429 too.
    standin.switches.rate_limits = [RateLimit(times=1, retry_after=None)]
    bad = VastAI(api_key="not-the-key", server_url=standin.url, retry=1)
    limited = http_error(bad.show_ssh_keys)
    assert limited.status_code == 429 and "Retry-After" not in limited.headers
    t, method, path, status = standin.timeline[-1]
    assert (method, path, status) == ("GET", "/api/v0/ssh/", 429) and t <= time.monotonic()


def test_vanished_offer_is_gone_for_good(vast: VastAI, standin: VastStandin):
    # The two-GPU offer: the other tests do not need it.
    offer = vast.search_offers(query={"num_gpus": {"eq": 2}})[0]["id"]
    standin.switches.vanish_offers = 1
    gone = http_error(vast.create_instance, offer, image="x", env={})
    assert gone.status_code == 400
    assert gone.json() == {
        "success": False,
        "error": "no_such_ask",
        "msg": "Instance type no longer available.",
    }
    assert offer not in {o["id"] for o in vast.search_offers(query={}, no_default=True)}
    assert offer not in {o["id"] for o in vast.search_offers()}
    again = http_error(vast.create_instance, offer, image="x", env={})
    assert again.status_code == 400 and again.json()["error"] == "no_such_ask"
    assert all(r.offer_id != offer for r in standin.ledger())


def test_create_error_with_contract_still_makes_the_instance(vast: VastAI, standin: VastStandin):
    before = len(standin.ledger())
    standin.switches.create_error_with_contract = 1
    err = http_error(create, vast, "standin-5xx")
    assert err.status_code == 500
    body = err.json()
    assert body["success"] is False and body["error"] == "internal_error"
    iid = body["new_contract"]
    assert len(standin.ledger()) == before + 1
    rec = standin.record(iid)
    assert rec.create_answered_error and rec.label == "standin-5xx"
    assert [r.id for r in standin.left_behind()] == [iid]
    wait_status(vast, iid, "running")  # a real instance, billed until destroyed
    vast.destroy_instance(iid)


def test_v0_list_is_gone_and_a_v1_page_may_lack_instances(vast: VastAI, standin: VastStandin):
    r = vast.client.get("/instances/", query_args={"owner": "me"})
    assert r.status_code == 410 and r.json()["error"] == "deprecated"
    assert ("GET", "/api/v0/instances/", 410) in standin.requests
    standin.switches.list_without_instances_key = 1
    assert vast.show_instances_v1({"limit": 25}) == {"next_token": None}
    assert "instances" in vast.show_instances_v1({"limit": 25})


def test_stuck_loading_and_exit_on_start(vast: VastAI, standin: VastStandin):
    standin.switches.stuck_loading = 1
    (stuck,) = create(vast, "standin-stuck")
    standin.switches.exit_on_start = 1
    (exits,) = create(vast, "standin-exit")
    seen: list[Any] = []
    wait_status(vast, exits, "exited", seen=seen)
    assert seen[-2:] == ["loading", "exited"] and set(seen) <= {None, "loading", "exited"}
    row = wait_status(vast, stuck, "loading")
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        row = vast.show_instance(stuck) or {}
        assert row["actual_status"] == "loading"
        time.sleep(0.2)
    # The port is published, but no sshd answers behind it (from the host: refused).
    try:
        with socket.create_connection((row["ssh_host"], row["ssh_port"]), timeout=5) as conn:
            conn.settimeout(2)
            data = conn.recv(64)
    except OSError:
        data = b""
    assert not data.startswith(b"SSH-")
    assert standin.record(exits).exit_code == 1 and standin.record(stuck).running_at is None
    assert {r.id for r in standin.left_behind()} == {stuck, exits}
    vast.destroy_instance(stuck)
    vast.destroy_instance(exits)


def test_destroy_failure_leaves_the_instance(vast: VastAI, standin: VastStandin):
    (iid,) = create(vast, "standin-df")
    standin.switches.destroy_failures = 1
    failed = http_error(vast.destroy_instance, iid)
    assert failed.status_code == 500
    assert vast.show_instance(iid) is not None
    assert [r.id for r in standin.left_behind()] == [iid]
    assert vast.destroy_instance(iid) == {"success": True}


def test_stop_is_billed_and_left_behind(vast: VastAI, standin: VastStandin):
    (row,) = running(vast, "standin-stop")
    iid = row["id"]
    vast.stop_instance(iid)
    assert (vast.show_instance(iid) or {})["actual_status"] == "stopped"
    (rec,) = standin.left_behind()
    assert rec.id == iid and rec.status == "stopped" and rec.stop_calls == 1
    assert rec.container_id is not None
    state = standin.docker.api.inspect_container(rec.container_id)["State"]
    assert not state["Running"]
    assert ("PUT", f"/api/v0/instances/{iid}/", 200) in standin.requests
    billed = standin.billed_seconds(iid)
    wait_until(  # still billed while stopped
        lambda: standin.billed_seconds(iid) > billed, timeout=10, what="billing to go on"
    )
    vast.start_instance(iid)
    wait_status(vast, iid, "running")
    vast.destroy_instance(iid)


def test_instance_key_destroys_only_its_own_instance(
    vast: VastAI, standin: VastStandin, identity: Identity
):
    a, b = running(vast, "standin-keys", 2)
    key = environ(identity, a)["CONTAINER_API_KEY"]
    # From inside the instance: the API is reachable, and the key is good for nothing else.
    probe = f"""
import urllib.error, urllib.request
def call(method, path):
    req = urllib.request.Request({standin.url!r} + path, method=method,
                                 headers={{"Authorization": "Bearer {key}"}})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
print(call("GET", "/api/v0/instances/{a["id"]}/?owner=me"),
      call("DELETE", "/api/v0/instances/{b["id"]}/"),
      call("GET", "/api/v0/ssh/"))
"""
    out = ssh(identity, a, f"{PYTHON} -", stdin=probe)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["403", "403", "403"]
    own = VastAI(api_key=key, server_url=standin.url, retry=1)
    forbidden = http_error(own.destroy_instance, b["id"])
    assert forbidden.status_code == 403 and forbidden.json()["error"] == "forbidden"
    assert http_error(own.show_instances_v1, {"limit": 1}).status_code == 403
    assert own.destroy_instance(a["id"]) == {"success": True}
    assert vast.show_instance(a["id"]) is None and vast.show_instance(b["id"]) is not None
    vast.destroy_instance(b["id"])


def test_hairpin_and_reverse_tunnel(vast: VastAI, standin: VastStandin, identity: Identity):
    a, b = running(vast, "standin-net", 2)
    server = (
        f'setsid nohup {PYTHON} -c "import socket\n'
        "s = socket.create_server(('0.0.0.0', 7000))\n"
        "while True:\n c, _ = s.accept(); c.sendall(b'hello from B'); c.close()\" "
        ">/dev/null 2>&1 </dev/null &"
    )
    assert ssh(identity, b, server).returncode == 0
    g = standin.public_ip
    cid = standin.record(b["id"]).container_id
    assert cid is not None
    attrs = standin.docker.containers.get(cid).attrs
    b_ip = attrs["NetworkSettings"]["Networks"][standin.network_name]["IPAddress"]
    connect = f"""
import socket, time
def read(host, port, timeout, tries=1):
    for i in range(tries):
        try:
            with socket.create_connection((host, port), timeout=timeout) as c:
                c.settimeout(timeout)
                data = c.recv(100)
                if data:
                    return data.decode().strip()
        except OSError:
            pass
        time.sleep(0.2)
    return "none"
print(read({g!r}, {host_port(b, 7000)}, 5, tries=25))
print(read({g!r}, {a["ssh_port"]}, 5)[:8])
print(read({b_ip!r}, 7000, 1))
"""
    out = ssh(identity, a, f"{PYTHON} -", stdin=connect)
    assert out.returncode == 0, out.stderr
    # Through G to the peer's and its own mapped ports; not to the peer's container address.
    assert out.stdout.splitlines() == ["hello from B", "SSH-2.0-", "none"]

    # ssh -R: a listener on the instance's loopback that reaches this host.
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                conn.sendall(b"hello from the host")

    threading.Thread(target=serve, daemon=True).start()
    forward = f"127.0.0.1:17233:127.0.0.1:{port}"
    tunnel = subprocess.Popen(
        ssh_args(identity, a, "-N", "-o", "ExitOnForwardFailure=yes", "-R", forward),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        back = """
import socket, time
for i in range(50):
    try:
        with socket.create_connection(("127.0.0.1", 17233), timeout=5) as c:
            c.settimeout(5)
            data = c.recv(100)
            if data:
                print(data.decode())
                break
    except OSError:
        pass
    time.sleep(0.2)
"""
        out = ssh(identity, a, f"{PYTHON} -", stdin=back)
        assert out.stdout.strip() == "hello from the host", (out, tunnel.poll())
    finally:
        tunnel.terminate()
        tunnel.wait(10)
    for row in (a, b):
        vast.destroy_instance(row["id"])
