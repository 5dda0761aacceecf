"""The benchmark report (not a test): one command runs the benchmarks and writes a Markdown
report with tables and PNG plots, plus the figures as JSON.

    .venv/bin/python scripts/bench_report.py [--out docs/benchmarks] [--quick]
    .venv/bin/python scripts/bench_report.py --from-json docs/benchmarks/figures.json

What runs (each benchmark starts and stops everything it needs; see its own module doc):

- scripts/bench_pipeline.py: 1, 2 and 3 stages as node processes over Temporal (process
  provider): prompt-ready time, decode tok/s in paired interleaved rounds, the time to
  first token in parts, and the same stages in one thread (in-process);
- scripts/bench_engine.py: the engine as 1, 2 and 3 stages in one process (the node's
  thread count) and llama-cpp-python on the same GGUF and prompt ids when installed, at
  that thread count and at 2;
- scripts/bench_gateway.py: one 2-stage run through ``stream_prompt`` straight to the run,
  through ``mvp-gateway`` (streamed and not), and llama-cpp-python's OpenAI server on the
  same GGUF when installed, in interleaved rounds.

``--from-json`` writes the report again from figures already taken (no benchmark runs).
llama-cpp-python is never a dependency of the project: the report says "not installed"
where it is missing.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot: files only, no display

import matplotlib.pyplot as plt

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: scripts/ and the packages importable
    sys.path.insert(0, str(REPO))

from scripts.host_cpu import cpu_model  # noqa: E402

PLOTS = {
    "decode": "decode_tok_s.png",
    "ttft": "ttft_breakdown.png",
    "ready": "prompt_ready.png",
    "gateway": "gateway.png",
}
PARTS = (  # the TTFT breakdown's parts, in order, with their labels
    ("admission", "admission (submit_prompt accepted)"),
    ("dispatch", "dispatch (accepted -> generate started on the head node)"),
    ("prefill", "prefill (node start -> first text at the server)"),
    ("first_delta", "first delta (server -> client)"),
)
NOT_INSTALLED = "not installed"

# How many tokens and rounds: --quick checks that it all works, the default is the report.
SETTINGS = {
    "quick": {"pipeline_tokens": 32, "pipeline_rounds": 1, "engine_tokens": 32,
              "gateway_tokens": 32, "gateway_rounds": 2},
    "full": {"pipeline_tokens": 64, "pipeline_rounds": 5, "engine_tokens": 64,
             "gateway_tokens": 128, "gateway_rounds": 8},
}  # fmt: skip


# --- machine facts -----------------------------------------------------------------------


def _git(*args: str) -> str:
    try:
        out = subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _version(module: str, dist: str) -> str:
    if importlib.util.find_spec(module) is None:
        return NOT_INSTALLED
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "installed (version unknown)"


def machine_facts() -> dict[str, Any]:
    import psutil

    return {
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "git_commit": _git("rev-parse", "--short", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": _version("torch", "torch"),
        "temporalio": _version("temporalio", "temporalio"),
        "llama_cpp_python": _version("llama_cpp", "llama_cpp_python"),
    }


class LoadMeter:
    """The CPU time other processes used while the benchmarks ran: the machine's busy CPU
    time less this process's and its children's (the benchmarks' own servers and nodes
    are children, grandchildren through the orchestrator worker)."""

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        self.load_before = os.getloadavg()[0]
        self._busy0 = self._busy()
        self._own0 = self._own()
        self._t0 = time.monotonic()

    def _busy(self) -> float:
        t = self._psutil.cpu_times()
        return float(sum(t) - t.idle - getattr(t, "iowait", 0.0))

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def result(self) -> dict[str, Any]:
        wall = time.monotonic() - self._t0
        cores = os.cpu_count() or 1
        others = max(0.0, (self._busy() - self._busy0) - (self._own() - self._own0))
        return {
            "wall_s": wall,
            "loadavg_1m_before": self.load_before,
            "loadavg_1m_after": os.getloadavg()[0],
            "other_cpu_s": others,
            "other_cpu_share": others / (wall * cores) if wall > 0 else 0.0,
        }


# --- running the benchmarks --------------------------------------------------------------


def collect(quick: bool) -> dict[str, Any]:
    """Run every benchmark and return its figures (the JSON the report is written from)."""
    from mvp_io.model_store import DEFAULT_BUNDLED, fetch_bundled
    from scripts import bench_engine, bench_gateway, bench_pipeline
    from workers.node.runtime import default_threads

    s = SETTINGS["quick" if quick else "full"]
    model = str(fetch_bundled(DEFAULT_BUNDLED))
    node_threads = default_threads(os.cpu_count() or 1, 1)
    facts = machine_facts()
    meter = LoadMeter()
    print("== pipeline: 1, 2, 3 stages", file=sys.stderr)
    pipeline = bench_pipeline.bench(
        argparse.Namespace(
            provider="process",
            stages=[1, 2, 3],
            delays_ms=[0.0],
            tokens=s["pipeline_tokens"],
            rounds=s["pipeline_rounds"],
            idle_runs=[],
            address_layout="auto",
        )
    )
    print("== engine in one process, llama.cpp when installed", file=sys.stderr)
    have_llama = facts["llama_cpp_python"] != NOT_INSTALLED
    kinds = ["engine1", "engine2", "engine3", *(["llama_cpp"] if have_llama else [])]
    engine = bench_engine.bench(model, node_threads, s["engine_tokens"], kinds)
    if node_threads != 2 and have_llama:
        more = bench_engine.bench(model, 2, s["engine_tokens"], ["llama_cpp"])
        engine["rows"] += more["rows"]
        engine["skipped"].update({f"{k} (2 threads)": v for k, v in more["skipped"].items()})
    print("== gateway vs stream_prompt vs llama.cpp server", file=sys.stderr)
    gw_args = argparse.Namespace(
        rounds=s["gateway_rounds"], tokens=s["gateway_tokens"], stages=2, llama_server="auto"
    )
    gateway = bench_gateway.figures(asyncio.run(bench_gateway.bench(gw_args)), gw_args)
    return {
        "machine": facts,
        "load": meter.result(),
        "settings": {
            **s,
            "quick": quick,
            "node_threads": node_threads,
            "model": model,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset)"),
        },
        "pipeline": pipeline,
        "engine": engine,
        "gateway": gateway,
    }


# --- the report --------------------------------------------------------------------------


def _f(x: Any, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _range(stats: dict[str, float] | None, spec: str) -> str:
    if not stats:
        return "-"
    sep = " to " if "+" in spec else "-"  # signed figures: "-5 to +41", not "-5-+41"
    return f"{stats['median']:{spec}} ({stats['min']:{spec}}{sep}{stats['max']:{spec}})"


def _stage_rows(figures: dict[str, Any]) -> list[dict[str, Any]]:
    """The pipeline's undelayed configurations, one per stage count."""
    rows = [r for r in figures["pipeline"]["configs"] if not r.get("delay_ms")]
    return sorted(rows, key=lambda r: r["stages"])


def _llama_rows(figures: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in figures["engine"]["rows"] if r.get("kind") == "llama_cpp"]


def _engine_by_stages(figures: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {
        int(r["kind"][6:]): r
        for r in figures["engine"]["rows"]
        if str(r.get("kind", "")).startswith("engine")
    }


def llama_status(figures: dict[str, Any]) -> str:
    version = figures["machine"].get("llama_cpp_python", NOT_INSTALLED)
    return (
        f"llama-cpp-python {NOT_INSTALLED}"
        if version == NOT_INSTALLED
        else f"llama-cpp-python {version}"
    )


def markdown(figures: dict[str, Any]) -> str:
    m, load, st = figures["machine"], figures.get("load", {}), figures["settings"]
    pipe, eng, gw = figures["pipeline"], figures["engine"], figures["gateway"]
    rows = _stage_rows(figures)
    engine = _engine_by_stages(figures)
    llama = _llama_rows(figures)
    out: list[str] = [
        "# Benchmark report",
        "",
        f"Written by `scripts/bench_report.py{' --quick' if st.get('quick') else ''}` on "
        f"{m['date_utc']} at commit `{m['git_commit']}`"
        f"{' (with uncommitted changes in the working tree)' if m.get('git_dirty') else ''}. "
        "Figures, not tests: they vary from run to run and from machine to machine.",
        "",
        "## Machine",
        "",
        "| fact | value |",
        "|---|---|",
        f"| CPU | {m['cpu']} |",
        f"| cores | {m['cores']} |",
        f"| memory | {m['memory_gib']} GiB |",
        f"| OS | {m['os']} |",
        f"| Python | {m['python']} |",
        f"| torch | {m['torch']} |",
        f"| temporalio | {m['temporalio']} |",
        f"| llama-cpp-python | {m['llama_cpp_python']} |",
        f"| model | {Path(str(st.get('model', pipe.get('model', '')))).name} |",
        f"| node engine threads | {st.get('node_threads', '-')} |",
        f"| OMP_WAIT_POLICY (every engine: nodes, torch, llama.cpp) | "
        f"{st.get('omp_wait_policy', '-')} |",
    ]
    if load:
        out += [
            f"| load average (1 min) before / after | {load['loadavg_1m_before']:.2f} / "
            f"{load['loadavg_1m_after']:.2f} |",
            f"| benchmarks' wall time | {load['wall_s']:.0f} s |",
            f"| CPU used by other processes meanwhile | {load['other_cpu_s']:.0f} CPU-s "
            f"({load['other_cpu_share'] * 100:.0f}% of all cores) |",
        ]
        if load["other_cpu_share"] >= 0.05:
            out += [
                "",
                f"Other load: processes outside these benchmarks used "
                f"{load['other_cpu_share'] * 100:.0f}% of the machine's CPU time while they ran "
                "(a shared machine). The paired, interleaved rounds spread that drift over "
                "every configuration alike, but absolute figures are lower than on an idle "
                "machine.",
            ]
    out += [
        "",
        "## Decode tokens/s by stage count",
        "",
        f"Greedy decode of SmolLM2-135M Q4_1. Pipeline: {pipe['tokens']}-token prompts, median of "
        f"{pipe['rounds']} interleaved rounds (each round: the 1-stage run, then each multi-stage "
        "run, same prompt). Engine (one process) and llama.cpp: the same "
        f"{eng['prompt_tokens']}-token prompt ids, {eng['tokens']} tokens, per-token decode time "
        f"after prefill. {llama_status(figures)}.",
        "",
        "| stages | pipeline engine tok/s | pipeline client tok/s | vs 1 stage (paired) | "
        "same stages in one thread tok/s | engine bench tok/s | "
        + " | ".join(f"llama.cpp {r['threads']} thr tok/s" for r in llama)
        + (" |" if llama else "llama.cpp |"),
        "|---|---|---|---|---|---|" + "---|" * max(1, len(llama)),
    ]
    for r in rows:
        e = engine.get(r["stages"])
        llama_cells = (
            " | ".join(f"{x['decode_tps']:.1f}" for x in llama) if llama else NOT_INSTALLED
        )
        out.append(
            f"| {r['stages']} | {r['engine_tok_s']:.1f} | {r['client_tok_s']:.1f} | "
            f"{r['paired_ratio_to_1_stage']:.3f}x | {_f(r.get('in_process_tok_s'))} | "
            f"{_f(e['decode_tps'] if e else None)} | {llama_cells} |"
        )
    out += [
        "",
        "- pipeline engine tok/s: `Done.tokens_generated / Done.elapsed_ms` as the head node "
        "reports it (its prompt's encode, prefill and decode); client tok/s: tokens over the "
        "whole `stream_prompt` call, admission included.",
        "- vs 1 stage: the median over rounds of (N-stage / 1-stage engine tok/s of the same "
        "round).",
        "- same stages in one thread: the N stages one after another in this process, placed "
        "like a node's token path (no data plane, no Temporal).",
        "- llama.cpp: llama-cpp-python's `Llama.eval` of one token at a time at that thread "
        "count (the nodes use the engine thread count above; llama.cpp's is shown at 2 too).",
        "",
        f"![decode tokens/s by stage count]({PLOTS['decode']})",
        "",
        "## Time to first token, in parts",
        "",
        "Each part is a median over the rounds (ms); the parts of one prompt add up to its "
        "time to first token as the client sees it (submit_prompt sent -> first TextDelta; "
        '"sum" is the median of those sums, so the parts\' medians need not add up to it). '
        "Client instants are `time.time()`, the others the Temporal server's event times in "
        "the prompt workflow's history: one machine, one clock.",
        "",
    ]
    out += [f"- {label}" for _, label in PARTS]
    out += [
        "",
        "where dispatch ends at the generate activity's ActivityTaskStarted event (split at "
        "its ActivityTaskScheduled: the run's and the prompt workflow's tasks up to scheduling "
        "the generate, then the head node's poll taking it), and prefill "
        "ends at the prompt workflow's first stream-publish signal: it holds the activity's "
        "setup, tokenizing, the prompt through every stage, the first token sampled and "
        "detokenized, and the signal's RPC. First delta is the workflow task that takes the "
        "signal and the client's long poll returning it.",
        "",
    ]
    node_cols = any(
        (r.get("ttft_breakdown_ms") or {}).get("node_prefill_ms") is not None for r in rows
    )
    head = (
        "| stages | admission ms | dispatch ms (to scheduled + schedule-to-start) | prefill ms | "
        "first delta ms | sum ms | client TTFT ms | in one thread: first token ms |"
    )
    if node_cols:
        head += " node: encode / prefill / first publish ms |"
    out += [head, "|---|---|---|---|---|---|---|---|" + ("---|" if node_cols else "")]
    for r in rows:
        b = r.get("ttft_breakdown_ms")
        if not b:
            out.append(f"| {r['stages']} | - | - | - | - | - | {r['first_delta_ms']:.0f} | - |")
            continue
        split = (
            f" ({b['dispatch_to_scheduled']:.0f} + {b['dispatch_schedule_to_start']:.0f})"
            if "dispatch_to_scheduled" in b and "dispatch_schedule_to_start" in b
            else ""
        )
        line = (
            f"| {r['stages']} | {b['admission']:.0f} | {b['dispatch']:.0f}{split} | "
            f"{b['prefill']:.0f} | {b['first_delta']:.0f} | {b['total']:.0f} | "
            f"{b['client_ttft']:.0f} | {_f(r.get('in_process_first_token_ms'), '.0f')} |"
        )
        if node_cols:
            line += (
                f" {_f(b.get('node_encode_ms'), '.1f')} / {_f(b.get('node_prefill_ms'), '.0f')}"
                f" / {_f(b.get('node_first_delta_ms'), '.1f')} |"
            )
        out.append(line)
    out += [
        "",
        '"In one thread: first token" is the engine alone: the same stages in this process, '
        "prompt ids in, first token sampled (no tokenizer, no activity, no stream).",
    ]
    if node_cols:
        out.append(
            '"node:" is the head node\'s own account of the prefill part '
            "(PromptOutcome.timing): tokenizing, encode end -> first token sampled, that "
            "token -> its text published."
        )
    out += [
        "",
        f"![time to first token in parts]({PLOTS['ttft']})",
        "",
        "## Prompt-ready time by stage count",
        "",
        "Run workflow started -> its snapshot query first shows `prompt_ready` (planning, "
        "node processes started, weights loaded, data-plane edges connected), process "
        "provider. The 1-stage run starts first, alone, and pays the session's cold start "
        "(the first node process's imports and page cache); each multi-stage run starts "
        "later while the 1-stage run stays up. The gateway section's run is another sample.",
        "",
        "| stages | prompt-ready s | RSS per node MiB |",
        "|---|---|---|",
    ]
    for r in rows:
        rss = ", ".join(f"{x:.0f}" for x in r.get("rss_mib") or []) or "-"
        out.append(f"| {r['stages']} | {r['prompt_ready_s']:.1f} | {rss} |")
    out += [
        "",
        f"![prompt-ready time by stage count]({PLOTS['ready']})",
        "",
        "## Gateway overhead: gateway vs `stream_prompt` vs llama.cpp's server",
        "",
        f"One {gw['stages']}-stage run (prompt-ready in {gw['prompt_ready_s']:.1f} s); "
        f"{gw['tokens']}-token greedy completions (temperature 0, repeat_penalty 1.0), one "
        f"prompt per round and path, {gw['rounds']} interleaved rounds after one warm-up each; "
        f"median (min-max). llama-cpp-python's server: {gw['llama_cpp']}"
        + (
            f" (`python -m llama_cpp.server --n_threads {gw['llama_threads']}` on loopback, the "
            "same GGUF, the same `openai` client code as the gateway's streamed path)."
            if gw["llama_cpp"] != NOT_INSTALLED and not gw["llama_cpp"].startswith(("its", "left"))
            else "."
        ),
        "",
        "| path | TTFT ms | TTFT vs direct, paired ms | decode tok/s | total ms | tokens |",
        "|---|---|---|---|---|---|",
    ]
    for p in gw["paths"]:
        out.append(
            f"| {p['name']} | {_range(p['ttft_ms'], '.0f')} | "
            f"{_range(p.get('ttft_vs_direct_ms'), '+.0f')} | {_range(p['decode_tok_s'], '.1f')} "
            f"| {_range(p['total_ms'], '.0f')} | {p['tokens']:.0f} |"
        )
    by_key = {p["key"]: p for p in gw["paths"]}
    if "llama_server_stream" not in by_key:
        out.append(f"| llama-cpp-python server | {NOT_INSTALLED} | - | - | - | - |")
    direct, stream = by_key.get("direct"), by_key.get("gateway_stream")
    out += [
        "",
        "- TTFT: request sent -> first text received; decode tok/s: (tokens - 1) / (last text "
        "- first text) as the client sees text arrive (the run flushes its stream every 100 ms, "
        "so the run's paths are coarse; llama.cpp streams one chunk per token); not streamed: "
        "tokens / whole request.",
        "- TTFT vs direct, paired: the median (min-max) over rounds of the path's TTFT less "
        "the direct path's TTFT in the same round (one prompt text per round), robust to the "
        "machine's drift between rounds.",
    ]
    if stream and stream.get("ttft_vs_direct_ms"):
        out.append(
            f"- The gateway adds {stream['ttft_vs_direct_ms']['median']:.0f} ms (paired median) "
            "to the time to first token of `stream_prompt`."
        )
    elif direct and stream and direct["ttft_ms"] and stream["ttft_ms"]:
        added = stream["ttft_ms"]["median"] - direct["ttft_ms"]["median"]
        out.append(f"- The gateway adds {added:.0f} ms to the median time to first token.")
    if direct and direct.get("engine_tok_s"):
        out.append(
            "- The run's own decode on the direct path (Done.elapsed_ms): "
            f"{_range(direct['engine_tok_s'], '.1f')} tok/s."
        )
    out += [
        "",
        f"![gateway vs stream_prompt vs llama.cpp server]({PLOTS['gateway']})",
        "",
        "## Engine in one process (scripts/bench_engine.py)",
        "",
        "| runtime | threads | load s | RSS MB | prefill tok/s | decode tok/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in eng["rows"]:
        out.append(
            f"| {r['name']} | {r['threads']} | {r['load_s']:.3f} | {r['rss_mb']:.0f} | "
            f"{r['prefill_tps']:.0f} | {r['decode_tps']:.1f} |"
        )
    for kind, why in eng.get("skipped", {}).items():
        out.append(f"| {kind} | - | skipped: {why} | - | - | - |")
    if not llama:
        out.append(f"| llama-cpp-python | - | {NOT_INSTALLED} | - | - | - |")
    problems = pipe.get("teardown_problems") or []
    if problems:
        out += ["", "Teardown problems (after the figures were taken):", ""]
        out += [f"- {p}" for p in problems]
    out += [
        "",
        "## Reproduce",
        "",
        "```sh",
        ".venv/bin/python scripts/bench_report.py --out docs/benchmarks   # [--quick]",
        "```",
        "",
        "The figures this report was written from are in `figures.json` beside it "
        "(`--from-json` writes the report again from them).",
        "",
    ]
    return "\n".join(out)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_decode(figures: dict[str, Any], path: Path) -> Path:
    rows = _stage_rows(figures)
    engine = _engine_by_stages(figures)
    stages = [r["stages"] for r in rows]
    series = [
        ("pipeline (node processes, Temporal)", [r["engine_tok_s"] for r in rows]),
        ("same stages in one thread", [r.get("in_process_tok_s") or 0.0 for r in rows]),
        (
            "engine bench (one process)",
            [engine[n]["decode_tps"] if n in engine else 0.0 for n in stages],
        ),
    ]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series):
        xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(stages))]
        bars = ax.bar(xs, values, width, label=label)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    llama = _llama_rows(figures)
    styles = ["--", ":", "-."]
    for i, r in enumerate(llama):
        ax.axhline(
            r["decode_tps"],
            color="black",
            linestyle=styles[i % len(styles)],
            linewidth=1,
            label=f"llama.cpp, {r['threads']} thread{'s' if r['threads'] > 1 else ''} "
            f"({r['decode_tps']:.1f})",
        )
    if not llama:
        ax.plot([], [], " ", label=f"llama.cpp: {NOT_INSTALLED}")
    ax.set_xticks(range(len(stages)), [f"{n} stage{'s' if n > 1 else ''}" for n in stages])
    ax.set_ylabel("decode tokens/s")
    ax.set_title("Decode tokens/s by stage count (SmolLM2-135M Q4_1, greedy)")
    ax.margins(y=0.1)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    return _save(fig, path)


def plot_ttft(figures: dict[str, Any], path: Path) -> Path:
    rows = [r for r in _stage_rows(figures) if r.get("ttft_breakdown_ms")]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    labels = [f"{r['stages']} stage{'s' if r['stages'] > 1 else ''}" for r in rows]
    bottom = [0.0] * len(rows)
    for key, label in PARTS:
        values = [r["ttft_breakdown_ms"][key] for r in rows]
        bars = ax.bar(labels, values, 0.6, bottom=bottom, label=label)
        ax.bar_label(bars, fmt="%.0f", label_type="center", fontsize=8)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for i, (total, r) in enumerate(zip(bottom, rows, strict=True)):
        # The bar stacks each part's median; a prompt's whole TTFT has its own median.
        ttft = r["ttft_breakdown_ms"].get("client_ttft", total)
        ax.text(i, total, f"TTFT median {ttft:.0f} ms", ha="center", va="bottom", fontsize=9)
    if not rows:
        ax.text(0.5, 0.5, "no breakdown measured", transform=ax.transAxes, ha="center")
    ax.set_ylabel("ms (median of each part)")
    ax.set_title("Time to first token, in parts (stream_prompt, direct)")
    ax.margins(y=0.1)
    handles, names = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], names[::-1], fontsize=8, loc="upper center",
              bbox_to_anchor=(0.5, -0.08), ncol=2)  # fmt: skip
    return _save(fig, path)


def plot_ready(figures: dict[str, Any], path: Path) -> Path:
    rows = _stage_rows(figures)
    fig, ax = plt.subplots(figsize=(6, 4))
    bars = ax.bar(
        [f"{r['stages']} stage{'s' if r['stages'] > 1 else ''}" for r in rows],
        [r["prompt_ready_s"] for r in rows],
        0.6,
        color="tab:green",
    )
    ax.bar_label(bars, fmt="%.1f s", fontsize=9)
    ax.set_ylabel("seconds")
    ax.set_title("Run start -> prompt-ready (process provider)")
    ax.margins(y=0.15)
    return _save(fig, path)


def plot_gateway(figures: dict[str, Any], path: Path) -> Path:
    gw = figures["gateway"]
    paths = list(gw["paths"])
    short = {
        "direct": "stream_prompt\n(direct)",
        "gateway_stream": "gateway\nstreamed",
        "gateway_whole": "gateway\nnot streamed",
        "llama_server_stream": "llama.cpp server\nstreamed",
    }
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.5))
    for ax, field, unit in ((left, "ttft_ms", "TTFT ms"), (right, "decode_tok_s", "tokens/s")):
        shown = [p for p in paths if p.get(field)]
        names = [short.get(p["key"], p["key"]) for p in shown]
        mids = [p[field]["median"] for p in shown]
        errs = [
            [m - p[field]["min"] for m, p in zip(mids, shown, strict=True)],
            [p[field]["max"] - m for m, p in zip(mids, shown, strict=True)],
        ]
        colors = ["tab:gray" if p["key"].startswith("llama") else "tab:blue" for p in shown]
        bars = ax.bar(names, mids, 0.6, yerr=errs, capsize=4, color=colors)
        ax.bar_label(
            bars, fmt="%.0f" if field == "ttft_ms" else "%.1f", fontsize=9,
            label_type="center", color="white",
        )  # fmt: skip
        ax.set_ylabel(f"{unit} (median, min-max)")
        ax.tick_params(axis="x", labelsize=8)
        ax.margins(y=0.15)
    left.set_title("Time to first token")
    right.set_title("Decode tokens/s seen by the client")
    missing = (
        ""
        if any(p["key"].startswith("llama") for p in paths)
        else (f"; llama.cpp server: {NOT_INSTALLED}")
    )
    fig.suptitle(
        f"Gateway overhead ({gw['stages']}-stage run, {gw['tokens']}-token completions{missing})"
    )
    return _save(fig, path)


def write_report(figures: dict[str, Any], out: Path) -> list[Path]:
    """Write report.md, the PNG plots and figures.json under ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    written = [
        plot_decode(figures, out / PLOTS["decode"]),
        plot_ttft(figures, out / PLOTS["ttft"]),
        plot_ready(figures, out / PLOTS["ready"]),
        plot_gateway(figures, out / PLOTS["gateway"]),
    ]
    report = out / "report.md"
    report.write_text(markdown(figures))
    data = out / "figures.json"
    data.write_text(json.dumps(figures, indent=2) + "\n")
    return [report, data, *written]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks")
    ap.add_argument("--quick", action="store_true", help="fewer tokens and rounds")
    ap.add_argument("--from-json", type=Path, help="write the report from these figures")
    args = ap.parse_args()
    # Every OpenMP runtime here (torch in this process and the benches' children, llama.cpp)
    # waits passively, as the nodes do: spinning threads stall behind other processes.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if args.from_json:
        figures = json.loads(args.from_json.read_text())
    else:
        figures = collect(args.quick)
    for path in write_report(figures, args.out):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
