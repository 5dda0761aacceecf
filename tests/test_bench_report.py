"""The benchmark report's writer (scripts/bench_report.py) on a small figures dict: its
Markdown tables carry the figures' rows and columns, and its plots are real PNG images.
No benchmark runs here and no timing is asserted: the figures are made up."""

from __future__ import annotations

import copy
import json
import struct
from pathlib import Path
from typing import Any

import pytest

from scripts.bench_report import (
    NOT_INSTALLED,
    PLOTS,
    markdown,
    plot_decode,
    plot_gateway,
    write_report,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _stats(median: float, lo: float, hi: float) -> dict[str, float]:
    return {"median": median, "min": lo, "max": hi}


def _config(stages: int, tok_s: float, ready_s: float, parts: tuple[float, ...]) -> dict[str, Any]:
    admission, dispatch, prefill, first = parts
    return {
        "stages": stages,
        "delay_ms": 0.0,
        "engine_tok_s": tok_s,
        "client_tok_s": tok_s - 5,
        "paired_ratio_to_1_stage": tok_s / 30.5,
        "in_process_tok_s": tok_s + 3,
        "in_process_first_token_ms": 41.0 + stages,
        "prompt_ready_s": ready_s,
        "first_delta_ms": sum(parts),
        "rss_mib": [400.0 - 10 * i for i in range(stages)],
        "ttft_breakdown_ms": {
            "admission": admission,
            "dispatch": dispatch,
            "prefill": prefill,
            "first_delta": first,
            "dispatch_to_scheduled": dispatch - 20,
            "dispatch_schedule_to_start": 20.0,
            "total": sum(parts),
            "client_ttft": sum(parts),
            "samples": 3,
        },
    }


@pytest.fixture(scope="module")
def figures() -> dict[str, Any]:
    return {
        "machine": {
            "date_utc": "2031-02-03 04:05 UTC",
            "git_commit": "abc1234",
            "git_dirty": False,
            "cpu": "Test CPU 9000",
            "cores": 2,
            "memory_gib": 24.0,
            "os": "Linux 6.1",
            "python": "3.11.9",
            "torch": "2.5.0",
            "temporalio": "1.20.0",
            "llama_cpp_python": "0.3.36",
        },
        "load": {
            "wall_s": 321.0,
            "loadavg_1m_before": 1.25,
            "loadavg_1m_after": 2.5,
            "other_cpu_s": 128.0,
            "other_cpu_share": 0.2,
        },
        "settings": {"quick": False, "node_threads": 1, "model": "/m/SmolLM2.Q4_1.gguf"},
        "pipeline": {
            "model": "SmolLM2",
            "tokens": 64,
            "rounds": 5,
            "configs": [
                _config(1, 30.5, 8.75, (31.0, 142.0, 175.0, 52.0)),
                _config(2, 27.25, 11.5, (33.0, 139.0, 204.0, 55.0)),
                _config(3, 24.75, 14.25, (35.0, 144.0, 231.0, 57.0)),
            ],
            "teardown_problems": [],
        },
        "engine": {
            "model": "SmolLM2.Q4_1.gguf",
            "threads": 1,
            "tokens": 64,
            "prompt_tokens": 71,
            "rows": [
                {
                    "kind": "engine1",
                    "threads": 1,
                    "name": "engine 1 stage",
                    "load_s": 0.5,
                    "rss_mb": 120.0,
                    "prefill_tps": 400.0,
                    "decode_tps": 33.25,
                },
                {
                    "kind": "engine2",
                    "threads": 1,
                    "name": "engine 2 stages",
                    "load_s": 0.6,
                    "rss_mb": 125.0,
                    "prefill_tps": 390.0,
                    "decode_tps": 32.5,
                },
                {
                    "kind": "llama_cpp",
                    "threads": 1,
                    "name": "llama-cpp-python 0.3.36",
                    "load_s": 0.1,
                    "rss_mb": 90.0,
                    "prefill_tps": 900.0,
                    "decode_tps": 61.75,
                },
                {
                    "kind": "llama_cpp",
                    "threads": 2,
                    "name": "llama-cpp-python 0.3.36",
                    "load_s": 0.1,
                    "rss_mb": 91.0,
                    "prefill_tps": 1500.0,
                    "decode_tps": 77.25,
                },
            ],
            "skipped": {"engine3": "out of memory"},
        },
        "gateway": {
            "stages": 2,
            "tokens": 128,
            "rounds": 5,
            "prompts": ["a", "b"],
            "prompt_ready_s": 9.5,
            "llama_cpp": "0.3.36",
            "llama_threads": 2,
            "paths": [
                {
                    "key": "direct",
                    "name": "`stream_prompt` (direct, streamed)",
                    "ttft_ms": _stats(410.0, 380.0, 455.0),
                    "decode_tok_s": _stats(26.5, 25.0, 28.0),
                    "total_ms": _stats(5100.0, 5000.0, 5300.0),
                    "tokens": 128,
                    "engine_tok_s": _stats(27.0, 26.0, 28.0),
                },
                {
                    "key": "gateway_stream",
                    "name": "gateway `/v1/completions`, streamed",
                    "ttft_ms": _stats(437.0, 400.0, 470.0),
                    "decode_tok_s": _stats(26.0, 24.5, 27.5),
                    "total_ms": _stats(5200.0, 5100.0, 5350.0),
                    "tokens": 128,
                    "engine_tok_s": None,
                    "ttft_vs_direct_ms": _stats(24.0, -5.0, 41.0),
                },
                {
                    "key": "gateway_whole",
                    "name": "gateway `/v1/completions`, not streamed",
                    "ttft_ms": None,
                    "decode_tok_s": _stats(24.0, 23.0, 25.0),
                    "total_ms": _stats(5333.0, 5200.0, 5400.0),
                    "tokens": 128,
                    "engine_tok_s": None,
                },
                {
                    "key": "llama_server_stream",
                    "name": "llama-cpp-python server, streamed",
                    "ttft_ms": _stats(23.0, 20.0, 30.0),
                    "decode_tok_s": _stats(70.5, 66.0, 72.0),
                    "total_ms": _stats(1900.0, 1850.0, 2000.0),
                    "tokens": 128,
                    "engine_tok_s": None,
                    "ttft_vs_direct_ms": _stats(-385.0, -420.0, -350.0),
                },
            ],
        },
    }


@pytest.fixture(scope="module")
def written(figures: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One report, written once for the module's tests."""
    out = tmp_path_factory.mktemp("report")
    names = {p.name for p in write_report(figures, out)}
    assert names == {"report.md", "figures.json", *PLOTS.values()}
    return out


def _table(report: str, header_start: str) -> list[list[str]]:
    """The rows (cells) of the Markdown table whose header starts with ``header_start``."""
    lines = report.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    assert set(rows[1][0]) <= set("-"), f"no separator under {header_start!r}"
    return [rows[0], *rows[2:]]


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path.name} is not a PNG"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    width, height = struct.unpack(">II", data[16:24])
    assert data[-8:-4] == b"IEND", f"{path.name} ends without IEND"
    return width, height


def test_report_tables_carry_every_figure(figures: dict[str, Any], written: Path) -> None:
    report = (written / "report.md").read_text()

    decode = _table(report, "| stages | pipeline engine tok/s")
    assert decode[0][-2:] == ["llama.cpp 1 thr tok/s", "llama.cpp 2 thr tok/s"]
    assert [row[0] for row in decode[1:]] == ["1", "2", "3"]
    assert decode[2][1] == "27.2" and decode[2][-2:] == ["61.8", "77.2"]
    assert decode[3][5] == "-"  # engine3 was skipped: no engine bench figure

    ttft = _table(report, "| stages | admission ms")
    assert ttft[0][1] == "admission ms" and ttft[0][3:5] == ["prefill ms", "first delta ms"]
    assert ttft[0][2].startswith("dispatch ms")
    assert ttft[3][1:6] == ["35", "144 (124 + 20)", "231", "57", "467"]

    ready = _table(report, "| stages | prompt-ready s")
    assert [row[:2] for row in ready[1:]] == [["1", "8.8"], ["2", "11.5"], ["3", "14.2"]]
    assert ready[3][2] == "400, 390, 380"

    gateway = _table(report, "| path | TTFT ms")
    assert [row[0] for row in gateway[1:]] == [p["name"] for p in figures["gateway"]["paths"]]
    assert gateway[0][1:4] == ["TTFT ms", "TTFT vs direct, paired ms", "decode tok/s"]
    assert gateway[1][2] == "-"  # the direct path is the reference
    assert gateway[2][1:4] == ["437 (400-470)", "+24 (-5 to +41)", "26.0 (24.5-27.5)"]
    assert gateway[3][1:3] == ["-", "-"]  # not streamed: no first token of its own
    assert gateway[4][1:] == [
        "23 (20-30)",
        "-385 (-420 to -350)",
        "70.5 (66.0-72.0)",
        "1900 (1850-2000)",
        "128",
    ]
    # The paired figure, not the difference of the medians (27 ms).
    assert "The gateway adds 24 ms (paired median)" in report

    engine = _table(report, "| runtime | threads")
    assert ["engine3", "-", "skipped: out of memory", "-", "-", "-"] in engine
    assert "abc1234" in report and "Test CPU 9000" in report
    assert "20% of the machine's CPU time" in report  # other load is said
    assert json.loads((written / "figures.json").read_text()) == figures


def test_plots_are_pngs_of_real_size(written: Path) -> None:
    for name in PLOTS.values():
        path = written / name
        width, height = _png_size(path)
        assert width >= 400 and height >= 300, f"{name} is {width}x{height}"
        assert path.stat().st_size > 10_000, f"{name} is only {path.stat().st_size} bytes"
        assert f"]({name})" in (written / "report.md").read_text()


def test_llama_cpp_missing_is_said(figures: dict[str, Any], tmp_path: Path) -> None:
    missing = copy.deepcopy(figures)
    missing["machine"]["llama_cpp_python"] = NOT_INSTALLED
    missing["engine"]["rows"] = [r for r in missing["engine"]["rows"] if r["kind"] != "llama_cpp"]
    missing["gateway"]["llama_cpp"] = NOT_INSTALLED
    missing["gateway"]["paths"] = missing["gateway"]["paths"][:3]
    report = markdown(missing)
    decode = _table(report, "| stages | pipeline engine tok/s")
    assert decode[0][-1] == "llama.cpp" and decode[1][-1] == NOT_INSTALLED
    gateway = _table(report, "| path | TTFT ms")
    assert gateway[-1][:2] == ["llama-cpp-python server", NOT_INSTALLED]
    _png_size(plot_decode(missing, tmp_path / "decode.png"))
    _png_size(plot_gateway(missing, tmp_path / "gateway.png"))
