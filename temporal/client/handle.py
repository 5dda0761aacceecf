"""The one typed handle of a run, put together from its parts: the run's lifecycle
(``lifecycle.py``), its prompts' submission and streams (``prompts.py``), and finding
and re-attaching to a prompt (``lookup.py``), over where a prompt's text comes from
(``text.py``)."""

from __future__ import annotations

from temporal.client.lookup import PromptLookup
from temporal.client.prompts import PromptCalls


class RunHandle(PromptCalls, PromptLookup):
    """Run ``mvp-run-<run_id>`` as a client sees it. ``RunHandle(client, run_id)`` attaches
    to a run that exists (or will); :meth:`start` starts one. Cheap: it holds the client,
    the workflow handle and the cancels it has sent."""
