"""The Temporal Web UI in a real browser (headless Debian chromium via Playwright).

Filters jobs by state with the search attributes this project registers, asserts the job shows,
and saves a screenshot (``IRIS_SAVE_SCREENSHOTS=1`` writes it to docs/screenshots/ too).
"""

from __future__ import annotations

import os
import shutil
import urllib.parse
from pathlib import Path

import httpx
import pytest
from playwright.async_api import Error as PlaywrightError
from playwright.async_api import Page
from stack import WAITS, Stack, wait_until

from iris.config import PROJECT_ROOT
from iris.jobs import JobState

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


async def shows(page: Page, text: str, timeout: float = 30) -> None:
    """The UI renders summaries and details as markdown in sandboxed iframes: look in every frame."""

    async def found() -> bool:
        for frame in page.frames:
            try:
                if text in await frame.inner_text("body"):
                    return True
            except PlaywrightError:
                continue
        return False

    await wait_until(found, timeout=timeout, interval=0.25, what=f"{text!r} in the Web UI")


def job_page(ui: str, job_id: str) -> str:
    return f"{ui}/namespaces/default/workflows/{urllib.parse.quote(job_id, safe='')}"


@pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason="Debian chromium is not installed (.ci/run installs it)"
)
async def test_jobs_filtered_by_state_in_the_web_ui(stack: Stack, tmp_path: Path) -> None:
    from playwright.async_api import async_playwright

    job_id = await stack.iris.submit(
        ["echo", "ui"],
        name="train-llama-ui",
        device_type="h100",
        gpu_count=8,
        target_cluster="cw-us-east-02a",
    )
    assert (await stack.iris.wait(job_id, timeout_s=60)).state is JobState.SUCCEEDED
    ui = f"http://127.0.0.1:{stack.config.temporal.ui_port}"
    query = 'IrisState="SUCCEEDED" AND IrisPeer="cw-us-east-02a"'
    api = f"{ui}/api/v1/namespaces/default/workflows?query={urllib.parse.quote(query)}"

    async def listed_by_ui_api() -> bool:
        async with httpx.AsyncClient(timeout=10) as http:
            body = (await http.get(api)).json()
        return any(e.get("execution", {}).get("workflowId") == job_id for e in body.get("executions", []))

    await wait_until(listed_by_ui_api, timeout=60, what="the UI's API to list the job")

    shot = tmp_path / "webui-jobs-succeeded.png"
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = await browser.new_page(viewport={"width": 1600, "height": 900})
            await page.goto(
                f"{ui}/namespaces/default/workflows?query={urllib.parse.quote(query)}",
                wait_until="networkidle",
            )
            await page.get_by_text(job_id).first.wait_for(timeout=30_000)
            await page.screenshot(path=str(shot), full_page=True)
            # The job's own page: its static summary reads like the job.
            detail = tmp_path / "webui-job.png"
            await page.goto(job_page(ui, job_id), wait_until="networkidle")
            await page.screenshot(path=str(detail), full_page=True)
            # The static summary reads like the job (the UI shows it under User Metadata).
            await page.get_by_text("User Metadata").first.click()
            await shows(page, "train-llama-ui · h100×8 · interactive")
            # A queued job shows its pending reason as the workflow's current details.
            async with stack.holding():
                waiting = await stack.iris.submit(["true"], name="waiting-ui", **WAITS)

                async def explained() -> bool:
                    return "h100" in (await stack.iris.describe(waiting)).reason

                await wait_until(explained, timeout=60, what="the tick's explanation")
                # A running job's page keeps polling: wait for its load only.
                await page.goto(job_page(ui, waiting), wait_until="load")
                await page.get_by_text("User Metadata").first.click()
                await shows(page, "QUEUED_HANDOFF")
                pending = tmp_path / "webui-pending-reason.png"
                await page.screenshot(path=str(pending), full_page=True)
                await stack.iris.cancel(waiting)
        finally:
            await browser.close()
    assert shot.stat().st_size > 10_000
    if os.environ.get("IRIS_SAVE_SCREENSHOTS"):
        for png in (shot, detail, pending):
            shutil.copy(png, PROJECT_ROOT / "docs" / "screenshots" / png.name)
