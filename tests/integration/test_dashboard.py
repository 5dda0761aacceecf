"""Issue 12, the dashboard (docs/dashboard.md): the gateway's page in a headless Chromium
(Playwright driving the system's ``chromium``) while one real 2-stage run of the bundled
model starts, serves a prompt through the gateway and stops. What the page rendered is
recorded in the page itself (a MutationObserver), so every change it showed is checked,
not only the moments the test looked. Screenshots go to ``$MVP_DASHBOARD_SCREENSHOTS``
(else the test's tmp dir)."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from playwright.async_api import Page
from playwright.async_api import TimeoutError as PlaywrightTimeout
from temporalio.client import Client, WorkflowExecutionStatus

from mvp_core import names
from mvp_core.models import RequestShutdown, RunPhase
from tests.helpers.browser import chromium
from tests.integration.conftest import Runs, wait_closed
from tests.integration.test_gateway import serve

RUN = 4301
MODEL = "SmolLM2-135M-Instruct.Q4_1"
# Greedy SmolLM2 counts on and on: the prompt lasts its whole max_tokens.
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8,"
TOKENS = 64
CARD = f'[data-run="{names.run_workflow_id(RUN)}"]'
PHASES = [p.value for p in RunPhase]

# Installed before the page loads: every distinct state of the served run's card the
# page rendered, as "status|phase|stage states|active request".
RECORDER = """
window.__seen = [];
new MutationObserver(() => {
  const card = document.querySelector('__CARD__');
  if (!card) return;
  const stages = [...card.querySelectorAll("tr.stage")].map(r => r.dataset.state).join(",");
  const queue = card.querySelector(".queue");
  const entry = [card.dataset.status, card.dataset.phase, stages,
                 queue ? queue.dataset.active : ""].join("|");
  if (window.__seen[window.__seen.length - 1] !== entry) window.__seen.push(entry);
}).observe(document, { subtree: true, childList: true, attributes: true });
""".replace("__CARD__", CARD)


async def shows(
    page: Page, selector: str, *, every: str | None = None, timeout_s: float = 15
) -> None:
    """Wait until the page shows ``selector`` (and, with ``every``, until each element
    of it has that ``data-state``); a timeout names what the page showed instead."""
    try:
        if every is None:
            await page.wait_for_selector(selector, timeout=timeout_s * 1000)
        else:
            await page.wait_for_function(
                "([sel, want]) => { const rows = [...document.querySelectorAll(sel)]; "
                "return rows.length > 0 && rows.every(r => r.dataset.state === want); }",
                arg=[selector, every],
                timeout=timeout_s * 1000,
            )
    except PlaywrightTimeout:
        seen = await page.evaluate("window.__seen")
        now = await page.locator(CARD).all_inner_texts()
        raise AssertionError(
            f"the page never showed {selector} {every or ''}: {seen} {now}"
        ) from None


async def card_text(page: Page, selector: str) -> list[str]:
    texts: list[str] = await page.locator(f"{CARD} {selector}").all_inner_texts()
    return texts


async def row_cells(page: Page, selector: str) -> list[list[str]]:
    """Each matching table row's cells, by the DOM (a row's innerText has tabs between its
    cells only when the browser has laid it out: a loaded machine once gave them joined)."""
    rows: list[list[str]] = await page.locator(f"{CARD} {selector}").evaluate_all(
        "rows => rows.map(r => Array.from(r.cells).map(c => c.textContent.trim()))"
    )
    return rows


async def test_the_page_follows_a_run_that_starts_serves_and_stops(
    client: Client, runs: Runs, tmp_path: Path
):
    shots = Path(os.environ.get("MVP_DASHBOARD_SCREENSHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    requests: list[tuple[str, str]] = []
    async with serve(client, RUN) as url, chromium() as page:
        page.on("request", lambda r: requests.append((r.method, r.url)))
        await page.add_init_script(RECORDER)
        await page.goto(f"{url}/dashboard")
        # Before the run exists the page says so.
        await shows(page, f'{CARD}[data-status="not_found"]')

        # The prompt's text after its first piece is held until the page has shown it
        # generating (a loaded machine once generated all of it between two reads).
        gate = tmp_path / "text-open"
        handle = await runs.start(
            RUN,
            pipeline_stages=2,
            max_context=512,
            default_max_tokens=TOKENS,
            faults={"MVP_FAULT_TEXT_GATE": str(gate)},
        )
        await shows(page, f'{CARD}[data-phase="prompt_ready"]', timeout_s=120)
        await shows(page, f"{CARD} tr.stage", every="ready")
        # Each stage: its node, its layers, this host, its state.
        rows = await row_cells(page, "tr.stage")
        host = socket.gethostname()
        assert len(rows) == 2, rows
        assert rows[0][:4] == ["0", "2", "[0, 15)", host], rows
        assert rows[1][:4] == ["1", "3", "[15, 30)", host], rows

        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            sent = asyncio.ensure_future(
                http.post(
                    "/v1/completions",
                    json={
                        "model": MODEL,
                        "prompt": COUNTING,
                        "max_tokens": TOKENS,
                        "temperature": 0,
                    },
                )
            )
            try:
                await shows(page, f'{CARD} .queue:not([data-active=""])', timeout_s=60)
                active = await page.locator(f"{CARD} .queue").get_attribute("data-active")
                gate.touch()
                r = await sent
            finally:
                sent.cancel()
        assert r.status_code == 200, r.text
        body = r.json()
        request_id = body["id"].rsplit("-", 1)[1]
        assert active == request_id, (active, body["id"])
        assert body["usage"]["completion_tokens"] == TOKENS
        prompt_row = f'{CARD} tr.prompt[data-request="{request_id}"]'
        await shows(page, f"{prompt_row}[data-figures]")
        (cells,) = await row_cells(page, f'tr.prompt[data-request="{request_id}"]')
        assert cells[:3] == [request_id, "done", str(TOKENS)], cells
        assert float(cells[3]) > 0, cells  # tokens/s
        assert cells[4].endswith(("ms", " s")) and cells[6] == "max_tokens", cells
        logs = "\n".join(await card_text(page, ".log pre"))
        assert "stage 0 loaded layers" in logs and "stage 1 loaded layers" in logs, logs
        # The log lines and the run's events come from the run's datastream (DECISIONS
        # 58), followed from the address its snapshot tells.
        sources = await page.locator(f"{CARD} .log .src").evaluate_all(
            "els => els.map(e => e.dataset.source)"
        )
        assert sources == ["datastream", "datastream"], sources
        where = await card_text(page, ".events .where")
        assert where and where[0].startswith("following the run's datastream at "), where
        await shows(page, f'{CARD} .events li[data-channel="mvp.orch.lifecycle"]')
        await page.wait_for_function(
            "([sel, rid]) => [...document.querySelectorAll(sel)]"
            ".some(li => li.textContent.includes('PromptCompleted prompt ' + rid))",
            arg=[f"{CARD} .events li", request_id],
            timeout=15_000,
        )
        await page.wait_for_timeout(600)  # the log tails of the prompt's end
        await page.screenshot(path=str(shots / "serving.png"), full_page=True)

        await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=RUN))
        assert await wait_closed(handle) is WorkflowExecutionStatus.COMPLETED
        await shows(page, f'{CARD}[data-status="completed"][data-phase="torn_down"]')
        await shows(page, f"{CARD} tr.stage", every="stopped")
        # The run's datastream ended with it; what it said stays on the page.
        await page.wait_for_function(
            "sel => (document.querySelector(sel) || {}).textContent?.endsWith(' ended')",
            arg=f"{CARD} .events .where",
            timeout=15_000,
        )
        events = "\n".join(await card_text(page, ".events li"))
        assert "RunTornDown" in events, events
        await page.screenshot(path=str(shots / "stopped.png"), full_page=True)
        seen: list[str] = await page.evaluate("window.__seen")

    entries = [e.split("|") for e in seen]
    assert entries[0][:2] == ["not_found", ""], seen
    phases = [phase for _, phase, _, _ in entries if phase]
    # The page walked the run's phases forward, through startup to serving to stopped.
    assert phases == sorted(phases, key=PHASES.index), seen
    startup = {"accepted", "planning", "provisioning", "readiness", "stage_provisioning"}
    assert startup & set(phases), seen
    assert {"prompt_ready", "torn_down"} <= set(phases), seen
    stage_states = [states for _, _, states, _ in entries if states]
    assert any(s != "ready,ready" for s in stage_states[: stage_states.index("ready,ready")])
    assert stage_states[-1] == "stopped,stopped", seen
    assert request_id in {active for *_, active in entries}, seen  # seen generating
    # It only ever read: the page and its event stream, nothing else.
    paths = {(method, urlsplit(u).path) for method, u in requests}
    assert paths <= {("GET", "/dashboard"), ("GET", "/dashboard/events")}, paths
    assert all(p.stat().st_size > 10_000 for p in (shots / "serving.png", shots / "stopped.png"))
