"""Another host, where this machine has no second one: a network namespace joined to this
host by a veth pair of its own (``ip netns``, root only).

A process started in it (:meth:`OtherHost.argv`) has its own network: its own loopback,
and one link to this host, on a /30 of its own (this host ``host_ip``, the namespace
``ip``). It reaches this host's services only where they listen on ``host_ip`` (or on
every address), and nothing else of this host's networks: no default route, so another
namespace's link address is unreachable from it (``Network is unreachable`` at once).
It shares this host's file system and users; what a test means to keep apart (a state
directory, secrets in the environment) it keeps apart itself.

Names are unique to this process (``mvpx<pid>`` ...), and what :func:`other_host` made it
removes again, whatever happens: never a namespace or a link it did not make.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

# Candidate /30s for the links: 10.231.0.0/16 upwards; the first one no address of this
# host is in (another engineer's namespace, a Docker network) is taken.
_POOL = ipaddress.IPv4Network("10.231.0.0/16")


def available() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "ip netns needs root"
    if shutil.which("ip") is None:
        return "no ip command (iproute2)"
    return None


@dataclass(frozen=True)
class OtherHost:
    name: str  # the namespace
    link: str  # this host's end of the veth pair
    host_ip: str  # this host's address on the link
    ip: str  # the namespace's address on the link

    def argv(self, command: list[str]) -> list[str]:
        """``command`` run in the namespace."""
        return [shutil.which("ip") or "ip", "netns", "exec", self.name, *command]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _used_networks() -> list[ipaddress.IPv4Network]:
    out = subprocess.run(
        ["ip", "-o", "-4", "addr", "show"], check=True, capture_output=True, text=True, timeout=30
    ).stdout
    nets = []
    for line in out.splitlines():
        words = line.split()
        if "inet" in words:
            nets.append(ipaddress.IPv4Interface(words[words.index("inet") + 1]).network)
    return nets


def _free_link(index: int) -> ipaddress.IPv4Network:
    """A /30 of the pool that overlaps no network of this host (started at a place of
    this process's own, so that two test processes rarely try the same one)."""
    used = _used_networks()
    subnets = list(_POOL.subnets(new_prefix=30))
    start = (os.getpid() * 8 + index * 2) % len(subnets)
    for k in range(len(subnets)):
        net = subnets[(start + k) % len(subnets)]
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError(f"no free /30 in {_POOL}")


@contextlib.contextmanager
def other_host(index: int = 0) -> Iterator[OtherHost]:
    """A namespace with one link to this host (``index``: one of several of this process),
    removed again on the way out."""
    tag = f"mvpx{os.getpid() % 10**6}{index}"  # an interface name: 15 characters at most
    name, link, peer = f"{tag}-ns", f"{tag}h", f"{tag}n"
    net = _free_link(index)
    host_ip, ip = (str(a) for a in list(net.hosts())[:2])
    made: list[str] = []
    try:
        _ip("netns", "add", name)
        made.append("netns")
        _ip("link", "add", link, "type", "veth", "peer", "name", peer)
        made.append("link")
        _ip("link", "set", peer, "netns", name)
        _ip("addr", "add", f"{host_ip}/30", "dev", link)
        _ip("link", "set", link, "up")
        _ip("-n", name, "addr", "add", f"{ip}/30", "dev", peer)
        _ip("-n", name, "link", "set", peer, "up")
        _ip("-n", name, "link", "set", "lo", "up")
        yield OtherHost(name=name, link=link, host_ip=host_ip, ip=ip)
    finally:
        if "link" in made:
            with contextlib.suppress(subprocess.SubprocessError):
                _ip("link", "del", link)  # its peer goes with it
        if "netns" in made:
            with contextlib.suppress(subprocess.SubprocessError):
                _ip("netns", "del", name)
