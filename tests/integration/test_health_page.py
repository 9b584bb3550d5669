"""A running 3-node swarm with metrics on: each node's ``/metrics``, read with a plain
HTTP client, parses with prometheus_client's parser and shows the rounds advancing; the
swarm health page in a real browser (Chromium from Debian, driven by Playwright)
renders the peers and follows the rounds."""

from __future__ import annotations

import shutil
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ARTIFACTS = Path(__file__).resolve().parents[2] / ".artifacts"


def _browser() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("no system Chromium (apt-get install chromium; `make sysdeps` does it)")
    pytest.importorskip("playwright.sync_api", reason="playwright is in the dev extras")
    return path


def _scrape(url: str) -> dict[str, float]:
    """Unlabelled samples of one node's /metrics, by name."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.labels
    }


def test_metrics_and_the_health_page_follow_a_running_swarm(local_swarm):
    from playwright.sync_api import sync_playwright

    chromium = _browser()
    nodes = local_swarm.launch(3, rounds=40, extra=["metrics.port=0"])
    assert wait_until(
        lambda: all(
            n.status.get("state") == "training" and n.status.get("metrics_url") for n in nodes
        ),
        120,
    )
    urls = [n.status["metrics_url"] for n in nodes]
    first_scrape = [_scrape(u) for u in urls]
    for got in first_scrape:
        assert {"atoll_round", "atoll_inner_steps_total", "atoll_sent_bytes_total"} <= set(got)
    url = urls[0]
    others = {n.status["peer_id"] for n in nodes[1:]}
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "health-page.png"
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=chromium,
            args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
        )
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 900})
            page.goto(f"{url}/", timeout=30_000)
            # both other nodes appear, from heartbeats, with the PeerIDs they run with
            page.wait_for_function(
                "document.querySelectorAll('#peers tbody tr.peer').length === 2", timeout=60_000
            )
            titles = page.eval_on_selector_all(
                "#peers tbody tr.peer", "rows => rows.map(r => r.title)"
            )
            assert set(titles) == others
            assert page.inner_text("#peer") == nodes[0].status["peer_id"]
            # the page follows the run: the round moves on, evaluated rounds are plotted
            first = int(page.inner_text("#round"))
            page.wait_for_function(
                f"parseInt(document.getElementById('round').textContent) > {first}",
                timeout=90_000,
            )
            page.wait_for_function(
                "document.querySelectorAll('#plot circle.point').length >= 1", timeout=90_000
            )
            assert page.inner_text("#bpb") != "-"
            assert "none" in page.inner_text("#violations")  # an honest swarm
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000
    # every node's metrics follow the run as well
    assert wait_until(
        lambda: all(
            _scrape(u)["atoll_round"] > before["atoll_round"]
            for u, before in zip(urls, first_scrape)
        ),
        90,
    )
    for u, before in zip(urls, first_scrape):
        later = _scrape(u)
        assert later["atoll_inner_steps_total"] > before["atoll_inner_steps_total"]
        assert later["atoll_sent_bytes_total"] > before["atoll_sent_bytes_total"]
