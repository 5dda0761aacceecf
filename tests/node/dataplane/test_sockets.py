"""The edges' socket helpers (workers/node/dataplane/sockets.py): a look for bytes without
waiting works on any descriptor, 1024 and above too (select's FD_SETSIZE limit would
raise there; every edge, text reader and datastream follower looks this way)."""

from __future__ import annotations

import os
import resource
import socket

import pytest

from workers.node.dataplane.sockets import readable_now


def test_a_look_for_bytes_sees_them_and_a_close_on_a_descriptor_past_1024():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1100:
        pytest.fail(f"this host allows {hard} open files: the test needs 1100")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1100), hard))
    held: list[int] = []
    try:
        while len(held) < 1030:  # the next descriptors are past FD_SETSIZE
            held.append(os.open(os.devnull, os.O_RDONLY))
        a, b = socket.socketpair()
        with a, b:
            assert a.fileno() >= 1024
            assert readable_now(a) is False
            b.sendall(b"x")
            assert readable_now(a) is True
            assert a.recv(1) == b"x" and readable_now(a) is False
            b.close()  # the peer's close reads as readable (an empty read says so)
            assert readable_now(a) is True and a.recv(1) == b""
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
