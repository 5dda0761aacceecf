"""The node processes of a state directory, found in the host's process table.

The process provider adopts and reaps its nodes by them, and the process host prunes
node directories that no live node uses; both must agree on what counts as one of ours.
"""

from __future__ import annotations

from pathlib import Path

import psutil

from mvp_core.names import NODE_MODULE, parse_resource_name, resource_arg

_RESOURCE_PREFIX = resource_arg("")


def marked_node_processes(nodes_root: Path) -> dict[str, psutil.Process]:
    """The live node processes of this state directory, by resource name: marked on
    their command line and running in their node directory. Nodes of another state
    directory (another deployment or test session on this host) are not ours."""
    root = nodes_root.resolve()
    found: dict[str, psutil.Process] = {}
    for proc in psutil.process_iter(["cmdline", "cwd", "status"]):
        try:
            cmd = proc.info["cmdline"] or []
            if NODE_MODULE not in cmd or proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            marks = [a[len(_RESOURCE_PREFIX) :] for a in cmd if a.startswith(_RESOURCE_PREFIX)]
            cwd = Path(proc.info["cwd"] or "/")
            for name in marks:
                if parse_resource_name(name) and cwd.parent == root and cwd.name == name:
                    found[name] = proc
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found
