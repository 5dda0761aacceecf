"""How long a stage takes to load, and what memory it holds and peaks at (issue 36; not in
CI).

    python scripts/bench_load.py MODEL.gguf [--layers 0:16] [--threads 1] [--rounds 2]

Each measurement is a fresh process (nothing of an earlier load in it) with the file in
the page cache (read once before), and reports the wall time of ``load_stage``, the
process's peak RSS while loading, and after one decode step (every weight page touched)
its RSS split into anonymous memory and file pages. Three ways, in this order:

- **build**: the layout cache off (what every load did before the cache);
- **build + store**: an empty cache: the layouts built, written, then mapped;
- **mapped**: the same cache again, as a node's restart, a stage replacement or a
  second node of these layers on the host loads them.

The cache directory is a temporary one, removed after. Name the CPU beside the figures
(printed first).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: scripts/ and the packages importable
    sys.path.insert(0, str(REPO))

from scripts.host_cpu import cpu_model  # noqa: E402


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def _child(model: str, start: int, end: int, threads: int, cache: bool) -> dict[str, Any]:
    import torch

    from workers.node.engine import EngineOptions, load_stage

    opts = EngineOptions(device="cpu", threads=threads, layout_cache=cache)
    t0 = time.perf_counter()
    stage = load_stage(model, start, end, opts)
    load_s = time.perf_counter() - t0
    # VmHWM: this process's own peak (ru_maxrss would keep that of the process that
    # started it, the benchmark's, where that was higher: a mapped load's "peak" was it)
    peak_load = _status_mb("VmHWM")
    session = stage.new_session(64)
    with torch.inference_mode():
        if stage.is_first:
            session.forward_tokens([1, 2, 3])
        else:
            session.forward_hidden(torch.zeros(3, stage.cfg.hidden))
    return {
        "load_s": load_s,
        "peak_while_loading_mb": peak_load,
        "held_mb": _status_mb("VmRSS"),
        "anon_mb": _status_mb("RssAnon"),
        "file_mb": _status_mb("RssFile"),
    }


def _measure(args: argparse.Namespace, cache_dir: Path | None) -> dict[str, Any]:
    env = dict(os.environ)
    env["MVP_LAYOUT_CACHE"] = str(cache_dir) if cache_dir is not None else "off"
    start, end = args.layers
    cmd = [sys.executable, __file__, args.model, "--child", f"{start}:{end}"]
    cmd += ["--threads", str(args.threads), "--cache", "1" if cache_dir else "0"]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def _in_docker(args: argparse.Namespace, limit_mb: float) -> dict[str, Any] | str:
    """The build (no layout cache, as every Docker node loads) in a container of this
    host's node image limited to ``limit_mb`` of memory and no swap, on a private Docker
    daemon: its figures, or why it failed (a container killed for memory: "OOM")."""
    from activities.providers.docker import DockerProvider
    from tests.helpers.dockerd import start_dockerd

    daemon = start_dockerd(Path(tempfile.mkdtemp(prefix="bl", dir="/tmp")))
    os.environ["DOCKER_HOST"] = daemon.host
    try:
        provider = DockerProvider()
        tag, mounts, python = provider.host_image()
        model_dir = os.path.realpath(Path(args.model).parent)
        binds = {m: {"bind": m, "mode": "ro"} for m in [*mounts, model_dir]}
        start, end = args.layers
        limit = int(limit_mb * 2**20)
        container = provider.client().containers.run(
            tag,
            [python, str(Path(__file__).resolve()), os.path.realpath(args.model), "--child",
             f"{start}:{end}", "--threads", str(args.threads), "--cache", "0"],
            environment={"MVP_LAYOUT_CACHE": "off", "HOME": "/root", "PYTHONUNBUFFERED": "1"},
            volumes=binds, mem_limit=limit, memswap_limit=limit, network_mode="none",
            detach=True,
        )  # fmt: skip
        try:
            status = container.wait(timeout=600)
            container.reload()
            oom = bool(container.attrs["State"].get("OOMKilled"))
            out = container.logs(stdout=True, stderr=False).decode(errors="replace")
            if oom or status.get("StatusCode") != 0:
                err = container.logs(stdout=False, stderr=True).decode(errors="replace")
                return "OOM" if oom else f"exit {status.get('StatusCode')}: {err[-300:]}"
            return dict(json.loads(out.strip().splitlines()[-1]))
        finally:
            container.remove(force=True)
    finally:
        daemon.stop()
        os.environ.pop("DOCKER_HOST", None)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("model")
    ap.add_argument("--layers", default=None, help="START:END (default: every layer)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2, help="mapped loads to time")
    ap.add_argument(
        "--docker-limit", type=float, default=0.0,
        help="also load in a Docker container limited to this many times the build's held "
        "RSS (e.g. 1.2; a private daemon, this host's node image)",
    )  # fmt: skip
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        start, end = (int(x) for x in args.child.split(":"))
        got = _child(args.model, start, end, args.threads, args.cache == "1")
        print(json.dumps(got))
        return
    from workers.node.engine.config import read_model_facts

    n_layers = read_model_facts(args.model).block_count
    if args.layers:
        a, b = args.layers.split(":")
        args.layers = (int(a), int(b))
    else:
        args.layers = (0, n_layers)
    size = Path(args.model).stat().st_size
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores)")
    print(f"model: {args.model} ({size / 1e9:.2f} GB), layers {args.layers}, {args.threads} thr")
    with open(args.model, "rb") as f:  # into the page cache
        while f.read(1 << 24):
            pass
    tmp = Path(tempfile.mkdtemp(prefix="bench-load-"))
    rows = []
    try:
        rows.append(("build", _measure(args, None)))
        rows.append(("build + store", _measure(args, tmp)))
        for _ in range(args.rounds):
            rows.append(("mapped", _measure(args, tmp)))
        stored = sum(p.stat().st_size for p in tmp.iterdir())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.docker_limit:
        limit_mb = args.docker_limit * rows[0][1]["held_mb"]
        in_docker = _in_docker(args, limit_mb)
        if isinstance(in_docker, str):
            print(f"in Docker, --memory {limit_mb:.0f} MB ({args.docker_limit}x held): {in_docker}")
        else:
            rows.append((f"build in Docker, --memory {limit_mb:.0f} MB", in_docker))
    print(f"layouts stored: {stored / 1e6:.0f} MB")
    print("| load | time | peak RSS while loading | RSS after a step (anonymous + file) |")
    print("|---|---|---|---|")
    for name, r in rows:
        print(
            f"| {name} | {r['load_s']:.2f} s | {r['peak_while_loading_mb']:.0f} MB | "
            f"{r['held_mb']:.0f} MB ({r['anon_mb']:.0f} + {r['file_mb']:.0f}) |"
        )


if __name__ == "__main__":
    main()
