"""The Carnator frontend extension in real headless Chromium against a real ComfyUI server and frontend.

Debian's /usr/bin/chromium (scripts/setup_browser.sh) driven by Playwright (no browser download). The test opens
the ComfyUI UI, loads the example workflows through the frontend's own "Open workflow" file input, checks that the
frontend turns them into exactly the API-format files, queues them with the Run button, waits for the reuse badge
(the extension keeps the last report on the sampler node as ``node.carnatorReport``), and uses the Carnator
sidebar tab (cache stats, purge). Screenshots go to ``artifacts/browser/``; with ``CARNATOR_UPDATE_README_IMG=1``
the badge screenshot also replaces ``docs/img/badge.png`` (the README's picture).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from harness_server import ComfyServer

pytestmark = [pytest.mark.browser, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = ROOT / "artifacts" / "browser"
README_IMG = ROOT / "docs" / "img" / "badge.png"
EMBEDDED_WEIGHTS = ROOT / "carnator_core" / "embedded" / "weights" / "carnator_embedded_v2.safetensors"
EMBEDDED_RULE = ROOT / "rules" / "embedded.json"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]
PAGE_ERRORS: list[str] = []  # uncaught errors in the page (the extension's must be none)
RUN_TIMEOUT_MS = 600_000  # one embedded generation takes seconds; generous for a loaded 2-core machine


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    base = tmp_path_factory.mktemp("comfy-browser")
    settings = base / "user" / "default" / "comfy.settings.json"
    settings.parent.mkdir(parents=True)
    # A returning user: no first-run template browser over the canvas.
    settings.write_text(json.dumps({"Comfy.TutorialCompleted": True}))
    with ComfyServer(base, startup_timeout=600) as s:  # a busy 2-core machine can take minutes
        yield s


@pytest.fixture(scope="module")
def page(server: ComfyServer) -> Any:
    if not CHROMIUM.exists():
        pytest.fail("Debian chromium is not installed: run scripts/setup_browser.sh (make test does)")
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1600, "height": 900})
            # The "Nodes 2.0" banner would cover the top of the canvas.
            context.add_init_script("localStorage.setItem('vueNodesBannerDismissed', 'true')")
            context.set_default_timeout(120_000)  # a busy 2-core machine serves the 48 MB frontend slowly
            pg = context.new_page()
            pg.on("dialog", lambda d: d.accept())  # the panel's purge confirmation
            PAGE_ERRORS[:] = []
            pg.on("pageerror", lambda e: PAGE_ERRORS.append(f"{e}\n{e.stack or ''}"))
            pg.goto(server.url, timeout=600_000)
            pg.wait_for_function("() => window.app?.graph && window.app.extensionManager && window.carnator",
                                 timeout=600_000)
            yield pg
        finally:
            browser.close()


def open_workflow(page: Any, name: str) -> dict[str, Any]:
    """Load workflows/<name>.json through the frontend's own file input (what "Open" and drag-and-drop run);
    returns the API prompt the frontend makes of it."""
    path = ROOT / "workflows" / f"{name}.json"
    types = sorted(n["type"] for n in json.loads(path.read_text(encoding="utf-8"))["nodes"])
    page.set_input_files("#comfy-file-input", str(path))
    page.wait_for_function("(types) => JSON.stringify(app.graph._nodes.map(n => n.type).sort()) === "
                           "JSON.stringify(types)", arg=types, timeout=30_000)
    return page.evaluate("async () => (await app.graphToPrompt()).output")


def run_and_wait_for_badge(page: Any) -> dict[str, Any]:
    page.evaluate("() => app.graph._nodes.forEach(n => { delete n.carnatorReport })")
    page.locator('[data-testid="queue-button"]').first.click()
    page.wait_for_function(
        "() => app.graph._nodes.some(n => n.comfyClass === 'CarnatorJointReuseSampler' && n.carnatorReport)",
        timeout=RUN_TIMEOUT_MS)
    return page.evaluate(
        "() => app.graph._nodes.find(n => n.comfyClass === 'CarnatorJointReuseSampler').carnatorReport")


def executable(prompt: dict[str, Any]) -> dict[str, Any]:
    """A prompt without ``_meta`` (display titles: the frontend localises some node names itself)."""
    return {k: {"class_type": v["class_type"], "inputs": v["inputs"]} for k, v in prompt.items()}


def api_file(name: str) -> dict[str, Any]:
    return executable(json.loads((ROOT / "workflows" / "api" / f"{name}.json").read_text(encoding="utf-8")))


def focus_sampler(page: Any, scale: float = 1.25) -> dict[str, float]:
    """Zoom the canvas onto the sampler; returns the page-pixel rectangle around the node and its badge."""
    return page.evaluate("""(scale) => {
        const n = app.graph._nodes.find(n => n.comfyClass === 'CarnatorJointReuseSampler');
        const ds = app.canvas.ds, title = 30, margin = 16;
        ds.scale = scale;
        ds.offset[0] = -n.pos[0] + 80 / scale;
        ds.offset[1] = -n.pos[1] + 140 / scale;
        app.canvas.setDirty(true, true);
        app.canvas.draw(true, true);
        const r = app.canvas.canvas.getBoundingClientRect();
        const badgeH = 12 + 15 * window.carnator.badgeLines(n.carnatorReport).lines.length;
        const left = (n.pos[0] + ds.offset[0]) * scale + r.left - margin;
        const top = (n.pos[1] - title + ds.offset[1]) * scale + r.top - margin;
        const width = Math.max(n.size[0], 220) * scale + 2 * margin;
        const height = (title + n.size[1] + 8 + badgeH + 6) * scale + 2 * margin;
        return {x: Math.max(0, left), y: Math.max(0, top), width, height};
    }""", scale)


def test_extension_is_served_and_loaded(page: Any) -> None:
    assert page.evaluate("() => Array.isArray(window.carnator.reports)")
    tabs = page.evaluate("() => app.extensionManager.sidebarTab.sidebarTabs.map(t => t.id)")
    assert "carnator-cache" in tabs


def test_warm_then_hit_badge_and_cache_panel(page: Any, server: ComfyServer) -> None:
    missing = [str(p.relative_to(ROOT)) for p in (EMBEDDED_WEIGHTS, EMBEDDED_RULE) if not p.exists()]
    if missing:
        pytest.skip(f"embedded model not shipped yet: {', '.join(missing)} missing")
    # 1. Warm the cache: a dense run, written to the cache.
    prompt = open_workflow(page, "embedded_warm_cache")
    assert executable(prompt) == api_file("embedded_warm_cache"), "the frontend makes another prompt of it"
    report = run_and_wait_for_badge(page)
    assert report["decision"] == "dense", report
    page.screenshot(path=str(ARTIFACTS / "warm_cache.png"))

    # 2. The same request through the full reuse path: the workflow connects the cache to the Early Probe, so the
    #    identical request is answered before the probe, from the stored result, with no model call.
    prompt = open_workflow(page, "embedded")
    assert executable(prompt) == api_file("embedded")
    report = run_and_wait_for_badge(page)
    assert report["decision"] == "hit", f"identical request not reused: {json.dumps(report)[:2000]}"
    badge_text = page.evaluate("""() => {
        const n = app.graph._nodes.find(n => n.comfyClass === 'CarnatorJointReuseSampler');
        return window.carnator.badgeLines(n.carnatorReport).lines.map(l => l.text);
    }""")
    assert badge_text[0] == "HIT · exact repeat (no model call)", badge_text
    assert report["mode"] == "exact" and report["model_calls"] == 0, report
    assert any(t.startswith("entry ") for t in badge_text) and any(t.startswith("saved 100%") for t in badge_text)
    clip = focus_sampler(page)
    time.sleep(0.5)  # one animation frame for the canvas to redraw at the new zoom
    badge = ARTIFACTS / "badge.png"
    page.screenshot(path=str(badge), clip=clip)
    page.screenshot(path=str(ARTIFACTS / "reuse_full.png"))
    assert badge.stat().st_size > 5_000
    if os.environ.get("CARNATOR_UPDATE_README_IMG") == "1":
        from PIL import Image

        README_IMG.parent.mkdir(parents=True, exist_ok=True)
        # A 128-colour palette keeps the committed picture small (the canvas uses few colours).
        Image.open(badge).convert("RGB").quantize(colors=128).save(README_IMG, optimize=True)

    # 3. The cache panel: one entry (the warm run; the hit reuses it), then purge.
    page.locator(".carnator-cache-tab-button").first.click()
    page.wait_for_selector(".carnator-stats tr", timeout=30_000)
    page.wait_for_function("() => Number(document.querySelector('.carnator-panel')?.dataset.entries) >= 1",
                           timeout=30_000)
    text = page.locator(".carnator-stats").inner_text()
    assert "hit rate" in text and "entries" in text
    page.screenshot(path=str(ARTIFACTS / "cache_panel.png"))
    page.locator(".carnator-purge").click()
    page.wait_for_function("() => document.querySelector('.carnator-panel')?.dataset.entries === '0'",
                           timeout=30_000)
    assert server.get("/carnator/cache/stats?directory=carnator_cache")["entries"] == 0
    ours = [e for e in PAGE_ERRORS if "carnator" in e.lower()]
    assert not ours, ours


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "workflows").glob("*.json")))
def test_frontend_turns_each_workflow_into_its_api_file(page: Any, name: str) -> None:
    """Every UI workflow loads in the real frontend (model workflows open its missing-models dialog: the test
    server has no model files) and the frontend's own graphToPrompt gives exactly workflows/api/<name>.json."""
    prompt = open_workflow(page, name)
    page.keyboard.press("Escape")  # close a missing-models dialog, if any
    assert executable(prompt) == api_file(name)
    missing = page.evaluate("() => app.graph._nodes.filter(n => n.has_errors || !n.comfyClass && !n.isVirtualNode)"
                            ".map(n => n.type)")
    assert not missing, f"node types the frontend does not know: {missing}"
