"""The chaos lab: one dev server of its own for every cell that does not restart one
(never the integration session's), a folder per cell under pytest's tmp path."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.chaos.cells import Lab


@pytest.fixture(scope="session")
async def lab(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Lab]:
    async with Lab(tmp_path_factory.mktemp("chaos")) as chaos_lab:
        yield chaos_lab
