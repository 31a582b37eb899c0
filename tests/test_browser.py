"""The Carnator frontend extension in real headless Chromium against a real ComfyUI server and frontend.

Debian's /usr/bin/chromium (scripts/setup/setup_browser.sh) driven by Playwright (no browser download). Each UI below
is a ComfyUI 0.3.75 server with its own base directory and a fresh browser:

- ``bundled-canvas``: the frontend ComfyUI 0.3.75 bundles (comfyui-frontend-package 1.32.x in the host venv);
- ``new-canvas`` / ``new-vue``: the newest frontend tested (``NEW_FRONTEND``, installed beside the venv by
  scripts/setup/setup_browser.sh and served with ``--front-end-root``), in the classic canvas and in the DOM-based
  "Vue nodes" mode (setting ``Comfy.VueNodes.Enabled``).

The test opens the UI, loads the example workflows through the frontend's own "Open workflow" file input, checks
that the frontend turns them into exactly the API-format files, queues them with the Run button, waits for the
reuse badge (the extension keeps the last report on the sampler node as ``node.carnatorReport`` and shows it in a
DOM widget, ``.carnator-badge``), checks the badge on screen (its lines, its place in the node, its pixels), and
uses the Carnator sidebar tab (cache stats, purge). Screenshots go to ``artifacts/browser/<ui>/``; with
``CARNATOR_UPDATE_README_IMG=1`` the badge screenshots of the newest frontend also replace ``docs/img/badge.png``
(canvas) and ``docs/img/badge_vue.png`` (Vue nodes), the README's pictures.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from harness_server import ComfyServer, started_together

pytestmark = [pytest.mark.browser, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = ROOT / "artifacts" / "browser"
NEW_FRONTEND = "1.58.1"  # keep in step with FRONTEND_VERSION in scripts/setup/setup_browser.sh
NEW_FRONTEND_ROOT = ROOT / ".host" / "frontends" / NEW_FRONTEND / "comfyui_frontend_package" / "static"
README_IMG = {"new-canvas": ROOT / "docs" / "img" / "badge.png", "new-vue": ROOT / "docs" / "img" / "badge_vue.png"}
UIS = ["bundled-canvas", "new-canvas", "new-vue"]
EMBEDDED_WEIGHTS = ROOT / "carnator_core" / "embedded" / "weights" / "carnator_embedded_v3.safetensors"
EMBEDDED_RULE = ROOT / "rules" / "embedded.json"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]
PAGE_ERRORS: list[str] = []  # uncaught errors in the page (the extension's must be none)
RUN_TIMEOUT_MS = 600_000  # one embedded generation takes seconds; generous for a loaded 2-core machine
HIT_BG = (0x1F, 0x4D, 0x2B)  # the badge's background for a hit (KINDS.hit.colors.bg in web/carnator.js)
SAMPLER_JS = "app.graph._nodes.find(n => n.comfyClass === 'CarnatorJointReuseSampler')"


@pytest.fixture(scope="module", params=UIS)
def ui(request: pytest.FixtureRequest) -> str:
    return request.param


def _ui_server(ui: str, tmp_path_factory: pytest.TempPathFactory) -> ComfyServer | None:
    """The (not yet started) server of one UI, with its own base directory; None when its frontend is missing."""
    frontend, mode = ui.split("-")
    extra: list[str] = []
    if frontend == "new":
        if not (NEW_FRONTEND_ROOT / "index.html").exists():
            return None
        extra = ["--front-end-root", str(NEW_FRONTEND_ROOT)]
    base = tmp_path_factory.mktemp(f"comfy-browser-{ui}")
    settings = base / "user" / "default" / "comfy.settings.json"
    settings.parent.mkdir(parents=True)
    # A returning user (no first-run template browser over the canvas), in the mode under test.
    settings.write_text(json.dumps({"Comfy.TutorialCompleted": True, "Comfy.VueNodes.Enabled": mode == "vue"}))
    return ComfyServer(base, extra_args=extra, startup_timeout=600)  # a busy 2-core machine can take minutes


@pytest.fixture(scope="module")
def ui_servers(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Every UI's own server (own base directory and settings, as before), started at once rather than one per UI
    in turn; each UI's tests use only its own server."""
    servers = {ui: _ui_server(ui, tmp_path_factory) for ui in UIS}
    with started_together(*[s for s in servers.values() if s is not None]):
        yield servers


@pytest.fixture(scope="module")
def server(ui: str, ui_servers: dict[str, ComfyServer | None]) -> Any:
    if ui_servers[ui] is None:
        pytest.fail(f"comfyui-frontend-package {NEW_FRONTEND} is not installed: run scripts/setup/setup_browser.sh "
                    "(make test does)")
    return ui_servers[ui]


@pytest.fixture(scope="module")
def page(server: ComfyServer, ui: str) -> Any:
    if not CHROMIUM.exists():
        pytest.fail("Debian chromium is not installed: run scripts/setup/setup_browser.sh (make test does)")
    from playwright.sync_api import sync_playwright

    (ARTIFACTS / ui).mkdir(parents=True, exist_ok=True)
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
            vue = pg.evaluate("() => !!app.extensionManager.setting.get('Comfy.VueNodes.Enabled')")
            assert vue == ui.endswith("-vue"), f"the frontend is not in the mode under test ({ui}): Vue nodes={vue}"
            yield pg
        finally:
            browser.close()


def open_workflow(page: Any, name: str) -> dict[str, Any]:
    """Load workflows/<name>.json through the frontend's own file input (what "Open" and drag-and-drop run);
    returns the API prompt the frontend makes of it."""
    path = ROOT / "workflows" / f"{name}.json"
    workflow = json.loads(path.read_text(encoding="utf-8"))
    want = {"types": sorted(n["type"] for n in workflow["nodes"]), "links": len(workflow["links"])}
    # Mark the nodes on the canvas: when the same workflow is open already, its node types alone would match
    # before the new copy is configured (links not yet connected).
    page.evaluate("() => app.graph._nodes.forEach(n => { n.__carnatorStale = true })")
    page.set_input_files("#comfy-file-input", str(path))
    page.wait_for_function("""(want) => {
        const nodes = app.graph._nodes;
        const linked = nodes.reduce((k, n) => k + (n.inputs || []).filter(i => i.link != null).length, 0);
        return !nodes.some(n => n.__carnatorStale) && linked === want.links
            && JSON.stringify(nodes.map(n => n.type).sort()) === JSON.stringify(want.types);
    }""", arg=want, timeout=30_000)
    return page.evaluate("async () => (await app.graphToPrompt()).output")


def run_and_wait_for_badge(page: Any, server: ComfyServer) -> dict[str, Any]:
    """Queue the open workflow with the Run button; wait for the badge and for the whole prompt to finish (the
    decode and save nodes run after the sampler: their "executed" messages, arriving after the next workflow is
    open, would land on the nodes that have the same ids there)."""
    page.evaluate("() => app.graph._nodes.forEach(n => { delete n.carnatorReport })")
    page.locator('[data-testid="queue-button"]').first.click()
    page.wait_for_function(f"() => {SAMPLER_JS}?.carnatorReport", timeout=RUN_TIMEOUT_MS)
    deadline = time.time() + RUN_TIMEOUT_MS / 1000
    while True:
        queue = server.get("/queue")
        if not queue["queue_running"] and not queue["queue_pending"]:
            break
        if time.time() >= deadline:  # a wait limit for a hung queue, not a speed check
            raise TimeoutError(f"prompt still running after {RUN_TIMEOUT_MS / 1000:.0f} s: {queue}")
        time.sleep(0.25)
    time.sleep(1.0)  # the last websocket messages reach the page
    return page.evaluate(f"() => {SAMPLER_JS}.carnatorReport")


def executable(prompt: dict[str, Any]) -> dict[str, Any]:
    """A prompt without ``_meta`` (display titles: the frontend localises some node names itself)."""
    return {k: {"class_type": v["class_type"], "inputs": v["inputs"]} for k, v in prompt.items()}


def api_file(name: str) -> dict[str, Any]:
    return executable(json.loads((ROOT / "workflows" / "api" / f"{name}.json").read_text(encoding="utf-8")))


def focus_sampler(page: Any, scale: float = 1.25) -> dict[str, float]:
    """Zoom the canvas onto the sampler, at ``scale`` or less so that the whole node (its badge at the bottom
    included) fits the viewport; returns the page-pixel rectangle of the node (title bar included), from the
    canvas' own geometry (the same in both modes: Vue nodes follow the canvas transform)."""
    return page.evaluate(f"""(want) => {{
        const n = {SAMPLER_JS};
        const ds = app.canvas.ds, title = window.LiteGraph?.NODE_TITLE_HEIGHT ?? 30;
        const r0 = app.canvas.canvas.getBoundingClientRect();
        const top = 110;  // page pixels above the node: the menu and tab bars
        const scale = Math.min(want, (r0.height - top - 40) / (title + n.size[1]));
        ds.scale = scale;
        ds.offset[0] = -n.pos[0] + 80 / scale;
        ds.offset[1] = -n.pos[1] + (top + title * scale) / scale;
        app.canvas.setDirty(true, true);
        app.canvas.draw(true, true);
        const r = app.canvas.canvas.getBoundingClientRect();
        return {{x: (n.pos[0] + ds.offset[0]) * scale + r.left, y: (n.pos[1] - title + ds.offset[1]) * scale + r.top,
                width: n.size[0] * scale, height: (title + n.size[1]) * scale}};
    }}""", scale)


def badge_pixels(path: Path, box: dict[str, float]) -> tuple[float, float]:
    """(share of the badge's pixels in the hit background colour, share of bright text pixels) in a screenshot."""
    import numpy as np
    from PIL import Image

    img = np.asarray(Image.open(path).convert("RGB"), dtype=np.int32)
    x0, y0 = int(box["x"]) + 3, int(box["y"]) + 3
    x1, y1 = int(box["x"] + box["width"]) - 3, int(box["y"] + box["height"]) - 3
    crop = img[y0:y1, x0:x1]
    bg = (np.abs(crop - np.array(HIT_BG)).sum(axis=-1) < 40).mean()
    text = (crop.mean(axis=-1) > 150).mean()
    return float(bg), float(text)


def test_extension_is_served_and_loaded(page: Any) -> None:
    assert page.evaluate("() => Array.isArray(window.carnator.reports)")
    tabs = page.evaluate("() => app.extensionManager.sidebarTab.sidebarTabs.map(t => t.id)")
    assert "carnator-cache" in tabs


def test_warm_then_hit_badge_and_cache_panel(page: Any, server: ComfyServer, ui: str) -> None:
    missing = [str(p.relative_to(ROOT)) for p in (EMBEDDED_WEIGHTS, EMBEDDED_RULE) if not p.exists()]
    if missing:
        pytest.fail(f"embedded model missing: {', '.join(missing)}")
    out = ARTIFACTS / ui
    # 1. Warm the cache: a dense run, written to the cache.
    prompt = open_workflow(page, "embedded_warm_cache")
    assert executable(prompt) == api_file("embedded_warm_cache"), "the frontend makes another prompt of it"
    report = run_and_wait_for_badge(page, server)
    assert report["decision"] == "dense", report
    page.screenshot(path=str(out / "warm_cache.png"))

    # 2. The same request through the full reuse path: the workflow connects the cache to the Early Probe, so the
    #    identical request is answered before the probe, from the stored result, with no model call.
    prompt = open_workflow(page, "embedded")
    assert executable(prompt) == api_file("embedded")
    report = run_and_wait_for_badge(page, server)
    assert report["decision"] == "hit", f"identical request not reused: {json.dumps(report)[:2000]}"
    assert report["mode"] == "exact" and report["model_calls"] == 0, report
    lines = page.evaluate(f"() => window.carnator.badgeLines({SAMPLER_JS}.carnatorReport).lines.map(l => l.text)")
    assert lines[0] == "HIT · exact repeat (no model call)", lines
    assert any(t.startswith("entry ") for t in lines) and any(t.startswith("saved 100%") for t in lines), lines

    # The badge on screen: one per sampler, showing exactly those lines, inside the node, painted in hit colours.
    node_box = focus_sampler(page)
    badge = page.locator(".carnator-badge")
    assert badge.count() == 1, f"{badge.count()} badges on the page"
    badge.wait_for(state="visible", timeout=30_000)
    time.sleep(0.5)  # one animation frame for the canvas / Vue nodes to follow the new zoom
    shown = page.evaluate("() => [...document.querySelectorAll('.carnator-badge > div')].map(d => d.textContent)")
    assert shown == lines, shown
    assert page.evaluate("() => document.querySelector('.carnator-badge').dataset.decision") == "hit"
    box = badge.bounding_box()
    assert box and box["width"] > 150 and box["height"] >= 15 * len(lines) * 1.25 * 0.9, box
    slack = 40  # px: the DOM widget's margins and the node's border
    assert (node_box["x"] - slack <= box["x"] and box["x"] + box["width"] <= node_box["x"] + node_box["width"] + slack
            and node_box["y"] <= box["y"] and box["y"] + box["height"] <= node_box["y"] + node_box["height"] + slack
            ), f"badge {box} is not inside the sampler node {node_box}"
    if ui.endswith("-vue"):  # the Vue node is HTML: the badge must be part of it, not drawn over it
        node_id = page.evaluate(f"() => String({SAMPLER_JS}.id)")
        assert page.locator(f'[data-node-id="{node_id}"] .carnator-badge').count() == 1
    # The badge is not a value: a workflow saved now has the sampler's widget values of the file, nothing more.
    saved = page.evaluate("() => app.graph.serialize().nodes"
                          ".find(n => n.type === 'CarnatorJointReuseSampler').widgets_values")
    in_file = next(n for n in json.loads((ROOT / "workflows" / "embedded.json").read_text(encoding="utf-8"))["nodes"]
                   if n["type"] == "CarnatorJointReuseSampler")["widgets_values"]
    assert saved == in_file, (saved, in_file)
    full = out / "reuse_full.png"
    page.screenshot(path=str(full))
    bg, text = badge_pixels(full, box)
    assert bg > 0.5 and text > 0.02, f"badge not painted readably: {bg:.0%} background, {text:.1%} text pixels"
    margin = 16
    clip = {"x": max(0.0, min(node_box["x"], box["x"]) - margin), "y": max(0.0, node_box["y"] - margin),
            "width": max(node_box["width"], box["width"]) + 2 * margin,
            "height": max(node_box["y"] + node_box["height"], box["y"] + box["height"]) - node_box["y"] + 2 * margin}
    shot = out / "badge.png"
    page.screenshot(path=str(shot), clip=clip)
    assert shot.stat().st_size > 5_000
    if os.environ.get("CARNATOR_UPDATE_README_IMG") == "1" and ui in README_IMG:
        from PIL import Image

        README_IMG[ui].parent.mkdir(parents=True, exist_ok=True)
        # A 128-colour palette keeps the committed picture small (the UI uses few colours).
        Image.open(shot).convert("RGB").quantize(colors=128).save(README_IMG[ui], optimize=True)

    # 3. The cache panel: one entry (the warm run; the hit reuses it), then purge.
    page.locator(".carnator-cache-tab-button, [data-testid='carnator-cache-tab-button']").first.click()
    page.wait_for_selector(".carnator-stats tr", timeout=30_000)
    page.wait_for_function("() => Number(document.querySelector('.carnator-panel')?.dataset.entries) >= 1",
                           timeout=30_000)
    text = page.locator(".carnator-stats").inner_text()
    assert "hit rate" in text and "entries" in text
    page.screenshot(path=str(out / "cache_panel.png"))
    page.locator(".carnator-purge").click()
    page.wait_for_function("() => document.querySelector('.carnator-panel')?.dataset.entries === '0'",
                           timeout=30_000)
    assert server.get("/carnator/cache/stats?directory=carnator_cache")["entries"] == 0
    ours = [e for e in PAGE_ERRORS if "carnator" in e.lower()]
    assert not ours, ours


def test_badge_from_the_executed_event_alone_and_a_new_decision(page: Any) -> None:
    """The API's "executed" event alone shows the badge (the node's onExecuted hook switched off, as where a
    frontend does not call it), and a decision the badge does not know yet shows under its own name."""
    open_workflow(page, "embedded_warm_cache")
    report = {"decision": "exact", "mode": "joint", "saving": 0.5, "timings_ms": {"total": 120.0}, "verdicts": []}
    page.evaluate("""(report) => {
        const n = app.graph._nodes.find(n => n.comfyClass === 'CarnatorJointReuseSampler');
        n.onExecuted = undefined;  // only the event listener can deliver it now
        app.api.dispatchEvent(new CustomEvent('executed',
            {detail: {node: String(n.id), display_node: String(n.id), output: {carnator_report: [report]}}}));
    }""", report)
    page.wait_for_function(f"() => {SAMPLER_JS}.carnatorReport?.decision === 'exact'", timeout=30_000)
    badge = page.locator(".carnator-badge")
    badge.wait_for(state="visible", timeout=30_000)
    shown = page.evaluate("() => [...document.querySelectorAll('.carnator-badge > div')].map(d => d.textContent)")
    assert shown == ["EXACT", "no cached candidate", "saved 50% of dense compute · 0.12 s"], shown
    assert page.evaluate("() => document.querySelector('.carnator-badge').dataset.decision") == "exact"


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "workflows").glob("*.json")))
def test_frontend_turns_each_workflow_into_its_api_file(page: Any, name: str) -> None:
    """Every UI workflow loads in the real frontend (model workflows open its missing-models dialog: the test
    server has no model files) and the frontend's own graphToPrompt gives exactly workflows/api/<name>.json."""
    prompt = open_workflow(page, name)
    page.keyboard.press("Escape")  # close a missing-models dialog, if any
    assert executable(prompt) == api_file(name)
    # Not `n.has_errors`: the newest frontend also sets it on loaders whose model file is missing.
    missing = page.evaluate("() => app.graph._nodes.filter(n => !(n.type in LiteGraph.registered_node_types) || "
                            "!n.comfyClass && !n.isVirtualNode).map(n => n.type)")
    assert not missing, f"node types the frontend does not know: {missing}"
