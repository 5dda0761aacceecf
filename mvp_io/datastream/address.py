"""Where a live datastream listens: ``unix:<path>`` or a loopback ``host:port``, parsed
for the server and its clients (the follower, the dashboard feed) alike."""

from __future__ import annotations

import socket
from typing import Any


def parse_address(address: str) -> tuple[socket.AddressFamily, Any]:
    """``unix:<path>`` (or a path holding ``/``) -> (AF_UNIX, path);
    ``<host>:<port>``, ``[<ipv6>]:<port>`` or ``<port>`` -> (AF_INET/AF_INET6, (host, port)),
    the host defaulting to 127.0.0.1. A ``ValueError`` names what is wrong."""
    if address.startswith("unix:"):
        path = address[len("unix:") :]
        if not path:
            raise ValueError(f"invalid datastream address {address!r}: empty socket path")
        return socket.AF_UNIX, path
    if "/" in address:
        return socket.AF_UNIX, address
    host, sep, port_text = address.rpartition(":")
    if not sep:
        host, port_text = "127.0.0.1", address
    host = host.strip("[]") or "127.0.0.1"
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"invalid datastream address {address!r}: port is not a number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"invalid datastream address {address!r}: port out of range")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return family, (host, port)


def format_address(family: socket.AddressFamily, sockaddr: Any) -> str:
    if family == socket.AF_UNIX:
        return f"unix:{sockaddr}"
    host, port = sockaddr[0], sockaddr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
