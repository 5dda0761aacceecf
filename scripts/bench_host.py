"""The process host's figures (issue 10): time from ``mvp-orchestrator`` start to the
prompt RPC accepting (embedded default, 1 and 2 stages), first-delta latency over the
RPC, and the datastream's cost on decode tokens/s (frame archive on vs off, the same
prompts, rounds interleaved).

    .venv/bin/python scripts/bench_host.py [--stages 1,2] [--rounds 3] [--tokens 64]

Each configuration is a real ``mvp-orchestrator`` process with its own state directory
(its own dev server and worker); tokens/s is what a raw RPC client sees, from the first
delta to ``done``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from temporal.connect import CONFIG_FILE_ENV, without_connection_env

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Once upon a time"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Host:
    def __init__(self, root: Path, stages: int, archive: bool) -> None:
        root.mkdir(parents=True)
        self.port = free_port()
        toml = (
            f'[runtime]\npipeline_stages = {stages}\n[prompt]\nrpc_addr = "127.0.0.1:{self.port}"\n'
        )
        if archive:
            toml += f'[observability]\ndatastream_frame_log = "{root / "frames.jsonl"}"\n'
        (root / "config.toml").write_text(toml)
        # No Temporal settings at all: the host starts its embedded dev server.
        env = {
            k: v for k, v in without_connection_env(os.environ).items() if not k.startswith("MVP_")
        }
        env[CONFIG_FILE_ENV] = os.devnull
        env["MVP_STATE_DIR"] = str(root / "state")
        self.err = root / "stderr.txt"
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "workers.host.main",
                "--runtime-config",
                str(root / "config.toml"),
            ],
            cwd=str(root),
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=open(self.err, "wb"),
        )
        while "prompt RPC on" not in self.err.read_text():
            if self.proc.poll() is not None:
                raise RuntimeError(self.err.read_text())
            time.sleep(0.05)
        self.ready_s = time.monotonic() - self.t0

    def prompt(self, tokens: int) -> tuple[float, float]:
        """(first-delta latency s, decode tok/s after the first delta)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=120) as sock:
            f = sock.makefile("rb")
            sent = time.monotonic()
            req = {"request_id": 1, "prompt_text": PROMPT, "max_tokens": tokens}
            sock.sendall(json.dumps(req).encode() + b"\n")
            first = None
            while True:
                ev = json.loads(f.readline())
                if ev["type"] == "text_delta" and first is None:
                    first = time.monotonic()
                if ev["type"] in ("done", "fault"):
                    end = time.monotonic()
                    break
            f.close()
        assert ev["type"] == "done" and first is not None, ev
        return first - sent, (ev["tokens_generated"] - 1) / max(end - first, 1e-9)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--stages", default="1,2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-host-") as tmp:
        for stages in [int(s) for s in args.stages.split(",")]:
            hosts = {}
            for archive in (False, True):
                hosts[archive] = Host(
                    Path(tmp) / f"s{stages}-{'on' if archive else 'off'}", stages, archive
                )
                # one host at a time owns the RPC port's neighbourhood: both stay up,
                # prompts alternate so drift hits both alike
            try:
                firsts: dict[bool, list[float]] = {False: [], True: []}
                rates: dict[bool, list[float]] = {False: [], True: []}
                for archive in (False, True):
                    hosts[archive].prompt(8)  # warm-up
                for _ in range(args.rounds):
                    for archive in (False, True):
                        first, rate = hosts[archive].prompt(args.tokens)
                        firsts[archive].append(first)
                        rates[archive].append(rate)
            finally:
                for h in hosts.values():
                    h.stop()
            for archive in (False, True):
                rows.append(
                    {
                        "stages": stages,
                        "archive": archive,
                        "ready_s": hosts[archive].ready_s,
                        "first_delta_ms": statistics.median(firsts[archive]) * 1000,
                        "tok_s": statistics.median(rates[archive]),
                    }
                )
    print("| stages | frame archive | start to RPC accepting s | first delta ms | decode tok/s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['stages']} | {'on' if r['archive'] else 'off'} | {r['ready_s']:.1f} | "
            f"{r['first_delta_ms']:.0f} | {r['tok_s']:.1f} |"
        )
    for stages in sorted({r["stages"] for r in rows}):
        off, on = (
            next(r for r in rows if r["stages"] == stages and r["archive"] is a)
            for a in (False, True)
        )
        print(f"stages {stages}: archive on/off decode ratio {on['tok_s'] / off['tok_s']:.3f}")


if __name__ == "__main__":
    main()
