"""Run the chaos matrix (the cells of tests/chaos) and print it as a table: fault x phase
-> outcome, seconds to RunTornDown, leaked node processes, nodes started twice.

Each cell runs a real run on a real dev server with real orchestrator and node processes;
see docs/reliability.md for what each cell does and the end state it must reach.

    .venv/bin/python scripts/chaos.py                       # every cell (6-8 minutes on 2 cores)
    .venv/bin/python scripts/chaos.py --only orch-kill@planning --only terminate@prompt_ready
    .venv/bin/python scripts/chaos.py --list
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # tests.chaos is not an installed package

from tests.chaos.cells import BY_NAME, CELLS, Cell, Lab, Result, run_cell  # noqa: E402


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _short(outcome: str) -> str:
    """The outcome up to the dead node's name (the rest is in the cell's report)."""
    cut = re.sub(r"(node \d+ exited).*", r"\1", outcome)
    return cut if len(cut) <= 64 else cut[:61] + "..."


def _verdict(r: Result) -> str:
    cell = BY_NAME[r.cell]
    if r.ok:
        return "ok (gap fixed?)" if cell.known_gap and cell.gap_strict else "ok"
    return "known gap" if cell.only_gap(r) else "FAIL"


def _passed(r: Result) -> bool:
    """As expected: ok, or failed only through the cell's documented gap."""
    return r.ok or BY_NAME[r.cell].only_gap(r)


def table(results: list[Result]) -> str:
    """The matrix, one row per cell, problems and notes listed below it."""
    head = ("cell", "outcome", "ok", "torn down s", "recovered s", "leaked", "twice", "cell s")
    rows = [
        (
            r.cell,
            _short(r.outcome),
            _verdict(r),
            _seconds(r.torn_down_s),
            _seconds(r.recovered_s),
            str(len(r.leaked)),
            str(len(r.twice)),
            f"{r.seconds:.0f}",
        )
        for r in results
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)) for row in rows]
    rule = "  ".join("-" * w for w in widths)
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)), rule, *lines]
    for r in results:
        if r.problems or r.notes:
            out.append("")
            out.append(f"{r.cell}: {', '.join(r.prompts) or 'no prompts'}")
            if BY_NAME[r.cell].known_gap:
                out.append(f"  GAP     {BY_NAME[r.cell].known_gap}")
            out += [f"  PROBLEM {p}" for p in r.problems]
            out += [f"  note    {n}" for n in r.notes]
    return "\n".join(out)


async def main(cells: list[Cell], root: Path, verbose: bool) -> list[Result]:
    results = []
    async with Lab(root) as lab:
        for cell in cells:
            print(f"... {cell.name} ({cell.how})", flush=True)
            result = await run_cell(lab, cell)
            results.append(result)
            if verbose or not result.ok:
                print(result.report(), flush=True)
    return results


def cli() -> int:
    parser = argparse.ArgumentParser(
        description="Run the chaos matrix of the reliability suite and print it as a table."
    )
    parser.add_argument(
        "--only",
        action="append",
        metavar="CELL",
        choices=sorted(BY_NAME),
        help="run only this cell (repeatable); --list shows the names",
    )
    parser.add_argument("--list", action="store_true", help="list the cells and exit")
    parser.add_argument("--keep", action="store_true", help="keep the logs folder afterwards")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each cell's report")
    args = parser.parse_args()
    if args.list:
        for c in CELLS:
            print(f"{c.name:36} {c.expected:42} {c.how}")
        return 0
    names = list(dict.fromkeys(args.only)) if args.only else [c.name for c in CELLS]
    chosen = [BY_NAME[n] for n in names]
    root = Path(tempfile.mkdtemp(prefix="mvp-chaos-"))
    t0 = time.monotonic()
    results: list[Result] = []
    try:
        results = asyncio.run(main(chosen, root, args.verbose))
    finally:
        keep = args.keep or not results or not all(_passed(r) for r in results)
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    print()
    print(table(results))
    passed = sum(_passed(r) for r in results)
    print(
        f"\n{passed}/{len(results)} cells as expected (ok, or failing only by a known gap)"
        f" in {time.monotonic() - t0:.0f} s"
    )
    if keep:
        print(f"logs: {root}")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(cli())
