"""The Vast.ai offer query: the run's filters, and RAM for the stage's planned need."""

from __future__ import annotations

from activities.providers.vastai.offers import offer_query
from mvp_core.models import VastAiSettings


def test_a_stages_need_asks_for_that_much_ram_in_mib_rounded_up() -> None:
    s = VastAiSettings()
    assert "cpu_ram" not in offer_query(s)
    assert offer_query(s, 600 << 20)["cpu_ram"] == {"gte": 600}
    assert offer_query(s, (600 << 20) + 1)["cpu_ram"] == {"gte": 601}
    # The run's own filters stay as they were.
    assert {k: v for k, v in offer_query(s, 1 << 30).items() if k != "cpu_ram"} == offer_query(s)
