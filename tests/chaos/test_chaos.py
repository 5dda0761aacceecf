"""The chaos matrix (docs/reliability.md): each cell kills, restarts or terminates
something real in one phase of a real run and checks the run's documented end state, one
terminal event per admitted prompt, no surviving node process and no node started twice.
``scripts/chaos.py`` runs the same cells and prints them as a table."""

from __future__ import annotations

import pytest

from tests.chaos.cells import CELLS, Cell, KnownGap, Lab, run_cell


def _marks(cell: Cell) -> list[pytest.MarkDecorator]:
    """Each cell bounds itself (Cell.timeout_s; the margin here covers its clean-up). A
    cell that shows a known product gap is an xfail, strict (red once fixed) unless the
    gap depends on a race."""
    marks = [pytest.mark.timeout(cell.timeout_s + 60)]
    if cell.known_gap:
        marks.append(
            pytest.mark.xfail(reason=cell.known_gap, raises=KnownGap, strict=cell.gap_strict)
        )
    return marks


_PARAMS = [pytest.param(c, id=c.name, marks=_marks(c)) for c in CELLS]


@pytest.mark.parametrize("cell", _PARAMS)
async def test_chaos_cell(lab: Lab, cell: Cell) -> None:
    result = await run_cell(lab, cell)
    print(result.report())
    if cell.only_gap(result):
        raise KnownGap(result.report())
    assert result.ok, result.report()
