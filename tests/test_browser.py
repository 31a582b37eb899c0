"""The Carnator frontend extension in real headless Chromium against a real ComfyUI server and frontend.

Debian's /usr/bin/chromium (scripts/setup/setup_browser.sh) driven by Playwright (no browser download). Each UI below
is a ComfyUI 0.3.75 server with its own base directory and a fresh browser:

- ``bundled-canvas``: the frontend ComfyUI 0.3.75 bundles (comfyui-frontend-package 1.32.x in the host venv);
- ``new-canvas`` / ``new-vue``: the newest frontend tested (``NEW_FRONTEND``, installed beside the venv by
  scripts/setup/setup_browser.sh and served with ``--front-end-root``), in the classic canvas and in the DOM-based
  "Vue nodes" mode (setting ``Comfy.VueNodes.Enabled``).

The tests open the UI, load the example workflows through the frontend's own "Open workflow" file input, check
that the frontend turns them into exactly the API-format files, and queue them with the Run button. What they pin:

- compact nodes: how many widgets each Carnator node shows in the default view (tuning knobs folded away), and
  that the summary button (canvas) or the frontend's own "advanced inputs" button (Vue nodes) shows them;
- the badge (a DOM widget, ``.carnator-badge``; the last report is ``node.carnatorReport``): its rows for every
  kind of decision, its fixed height, its size at 75 % zoom, the full details on click (never cut);
- no two nodes of any example workflow overlap (bounding boxes from the page) after a hit, a miss and a forced
  dense run — real runs of the embedded workflows, injected reports for the model workflows (the test server has
  no model files);
- the Carnator sidebar panel: per namespace the rule, the last requests with decision and thumbnail, and a purge
  after which the same graph really runs again;
- what a person reads: ComfyUI's node cache as NOT RUN (never a hit), one definition of a hit and a lookup across
  badge, panel, routes and the cache's counters (stated in the panel's help, counts "since purge"), a refused kind
  of change in words, learning's progress from the first request (the pilot), no badge row cut at 75-100 % zoom or
  at the node's minimum width, tuning inputs that open without covering a node in every workflow, no blank band in
  the Early Probe, namespace cards named in words.

Screenshots go to ``artifacts/browser/<ui>/``; with ``CARNATOR_UPDATE_README_IMG=1`` the newest frontend's badge
screenshots replace ``docs/img/badge.png`` (canvas) and ``docs/img/badge_vue.png`` (Vue nodes), and its panel
screenshot ``docs/img/panel.png``: the README's pictures.
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
README_PANEL = ROOT / "docs" / "img" / "panel.png"  # from new-canvas
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
def ui_servers(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The own server of every UI this session's selected tests use (own base directory and settings), started at
    once rather than one per UI in turn; each UI's tests use only its own server."""
    wanted = {getattr(item, "callspec", None) and item.callspec.params.get("ui") for item in request.session.items}
    servers = {ui: _ui_server(ui, tmp_path_factory) for ui in UIS if ui in wanted}
    with started_together(*[s for s in servers.values() if s is not None]):
        yield servers


@pytest.fixture(scope="module")
def server(ui: str, ui_servers: dict[str, ComfyServer | None]) -> Any:
    if ui_servers.get(ui) is None:
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
    close_panel(page)  # the canvas whole, whatever an earlier test left open
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


PANEL_TAB = ".carnator-cache-tab-button, [data-testid='carnator-cache-tab-button']"


def close_panel(page: Any) -> None:
    """Close the Carnator sidebar tab if it is open (its tab button toggles it)."""
    if page.locator(".carnator-panel").count() and page.locator(".carnator-panel").first.is_visible():
        page.locator(PANEL_TAB).first.click()
        page.wait_for_function("() => !document.querySelector('.carnator-panel')?.offsetParent", timeout=30_000)


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


# --- page geometry ---------------------------------------------------------------------------------------------
def node_boxes(page: Any) -> list[dict[str, Any]]:
    """Every node's rectangle on the page (title bar included), in page pixels: the node's own HTML element in the
    Vue-nodes mode, the canvas' geometry of the node (what LiteGraph draws) on the classic canvas."""
    return page.evaluate("""() => {
        const vue = !!window.LiteGraph?.vueNodesMode, ds = app.canvas.ds;
        const title = window.LiteGraph?.NODE_TITLE_HEIGHT ?? 30, r = app.canvas.canvas.getBoundingClientRect();
        return app.graph._nodes.map(n => {
            if (vue) {
                const e = document.querySelector(`[data-node-id="${n.id}"]`);
                if (!e) return {id: String(n.id), type: n.type, missing: true};
                const b = e.getBoundingClientRect();
                return {id: String(n.id), type: n.type, x: b.x, y: b.y, width: b.width, height: b.height};
            }
            return {id: String(n.id), type: n.type, x: (n.pos[0] + ds.offset[0]) * ds.scale + r.left,
                    y: (n.pos[1] - title + ds.offset[1]) * ds.scale + r.top,
                    width: n.size[0] * ds.scale, height: (n.size[1] + title) * ds.scale};
        });
    }""")


def overlapping_pairs(boxes: list[dict[str, Any]]) -> list[tuple[str, str, float, float]]:
    """(node a, node b, overlap width, overlap height) for every pair that overlaps by more than a pixel."""
    out = []
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            w = min(a["x"] + a["width"], b["x"] + b["width"]) - max(a["x"], b["x"])
            h = min(a["y"] + a["height"], b["y"] + b["height"]) - max(a["y"], b["y"])
            if w > 1 and h > 1:
                out.append((f"{a['type']}#{a['id']}", f"{b['type']}#{b['id']}", round(w, 1), round(h, 1)))
    return out


def fit_whole_graph(page: Any) -> None:
    """Zoom and pan so that every node is on screen (Vue nodes are HTML only while they are in view)."""
    page.evaluate("""() => {
        const ns = app.graph._nodes, title = window.LiteGraph?.NODE_TITLE_HEIGHT ?? 30;
        const x0 = Math.min(...ns.map(n => n.pos[0])), y0 = Math.min(...ns.map(n => n.pos[1] - title));
        const x1 = Math.max(...ns.map(n => n.pos[0] + n.size[0])), y1 = Math.max(...ns.map(n => n.pos[1] + n.size[1]));
        const r = app.canvas.canvas.getBoundingClientRect(), ds = app.canvas.ds;
        const top = 110, scale = Math.min((r.width - 120) / (x1 - x0), (r.height - top - 60) / (y1 - y0), 1);
        ds.scale = scale;
        ds.offset[0] = -x0 + 60 / scale;
        ds.offset[1] = -y0 + top / scale;
        app.canvas.setDirty(true, true);
        app.canvas.draw(true, true);
    }""")
    time.sleep(0.8)  # Vue nodes follow the new transform on the next frames


def assert_no_overlap(page: Any, what: str, shot: Path | None = None) -> None:
    fit_whole_graph(page)
    boxes = node_boxes(page)
    missing = [b for b in boxes if b.get("missing")]
    assert not missing, f"{what}: nodes without an element on the page: {missing}"
    if shot is not None:
        page.screenshot(path=str(shot))
    pairs = overlapping_pairs(boxes)
    assert not pairs, f"{what}: overlapping nodes {pairs}"


def sampler_ids(page: Any) -> list[str]:
    return page.evaluate("() => app.graph._nodes.filter(n => n.comfyClass === 'CarnatorJointReuseSampler')"
                         ".map(n => String(n.id))")


def inject_report(page: Any, node_id: str, report: dict[str, Any]) -> None:
    """Deliver a report to a sampler as the server does: the API's "executed" event."""
    page.evaluate("""([id, report]) => app.api.dispatchEvent(new CustomEvent('executed',
        {detail: {node: id, display_node: id, output: {carnator_report: [report]}}}))""", [node_id, report])
    page.wait_for_function("([id, r]) => app.graph.getNodeById(id)?.carnatorReport?.decision === r.decision "
                           "&& JSON.stringify(app.graph.getNodeById(id).carnatorReport) === JSON.stringify(r)",
                           arg=[node_id, report], timeout=30_000)


def badge_rows(page: Any, node_id: str) -> list[str]:
    """The rows of the badge of sampler ``node_id`` on the page, in full (a narrow row shows a shorter form of it,
    ``shown_rows``; the full text is its tooltip)."""
    return page.evaluate("""(id) => {
        const w = app.graph.getNodeById(id).widgets.find(w => w.name === 'carnator_badge');
        const vue = document.querySelector(`[data-node-id="${id}"] .carnator-badge`);
        const e = vue || w.element;
        return [...e.children].map(d => d.title || d.textContent);
    }""", node_id)


def shown_rows(page: Any, node_id: str) -> list[dict[str, Any]]:
    """What each badge row shows: its text, its full text (tooltip) and whether it is cut (wider than its box)."""
    return page.evaluate("""(id) => {
        const w = app.graph.getNodeById(id).widgets.find(w => w.name === 'carnator_badge');
        const e = document.querySelector(`[data-node-id="${id}"] .carnator-badge`) || w.element;
        return [...e.children].map(d => ({text: d.textContent, full: d.title, width: d.clientWidth,
                                          cut: d.scrollWidth > d.clientWidth + 1}));
    }""", node_id)


def badge_element_box(page: Any, node_id: str) -> dict[str, float]:
    return page.evaluate("""(id) => {
        const w = app.graph.getNodeById(id).widgets.find(w => w.name === 'carnator_badge');
        const e = document.querySelector(`[data-node-id="${id}"] .carnator-badge`) || w.element;
        const b = e.getBoundingClientRect();
        return {x: b.x, y: b.y, width: b.width, height: b.height};
    }""", node_id)


def shown_widgets(page: Any, node_id: str) -> list[str]:
    """The widgets a node shows (names, in order): Vue nodes' widget rows on the page; on the canvas, the widgets
    LiteGraph draws that take a row (a hidden widget has no row)."""
    return page.evaluate("""(id) => {
        const n = app.graph.getNodeById(id);
        if (window.LiteGraph?.vueNodesMode) {
            const e = document.querySelector(`[data-node-id="${id}"]`);
            const rows = [...e.querySelectorAll('[data-testid="node-widget"]')].map(r => r.dataset.widgetName);
            const badge = e.querySelector('.carnator-badge') && !rows.includes('carnator_badge');
            return rows.concat(badge ? ['carnator_badge'] : []);
        }
        return (n.widgets || []).filter(w => n.isWidgetVisible(w) && (w.computedHeight ?? 1) > 0).map(w => w.name);
    }""", node_id)


# --- reports of every kind (what the server sends; values from real runs' reports) --------------------------------
LONG_REASON = ("rejected: object size 0.41 > 0.30 — size (worst object 'ball'); the request asks for a big ball where "
               "the cached run drew a small one, so reusing its background would keep a small ball's shadow and "
               "outline around the changed region; continuing dense instead")
CHECKS_PASS = [{"axis": "context", "value": 1.21, "threshold": 4.0, "passed": True},
               {"axis": "size", "value": 0.05, "threshold": 0.3, "passed": True},
               {"axis": "shape", "value": 0.12, "threshold": 0.4, "passed": True},
               {"axis": "appearance", "value": 3.2, "threshold": 6.0, "passed": True}]
REPORTS_HIT = {"decision": "hit", "mode": "joint", "entry_id": "3f2a91c0d4e5b6a7", "active_fraction": 0.23,
               "block_density": 0.41, "saving": 0.62, "model_calls": 9, "steps_total": 20,
               "timings_ms": {"total": 840.0}, "requested_mode": "joint", "filter_mode": "signature",
               "rule_id": "embedded-v3", "reason": "",
               "verdicts": [{"entry_id": "3f2a91c0d4e5b6a7", "similarity": 0.97, "accepted": True,
                             "reason": "accepted: passes all 4 checks; best of 1 passing by similarity",
                             "checks": CHECKS_PASS}]}
REPORTS: dict[str, dict[str, Any]] = {
    "hit": REPORTS_HIT,
    "exact": {"decision": "hit", "mode": "exact", "entry_id": "3f2a91c0d4e5b6a7", "saving": 1.0, "model_calls": 0,
              "steps_total": 20, "timings_ms": {"total": 12.0}, "requested_mode": "joint",
              "reason": "exact repeat of entry 3f2a91c0d4e5b6a7: stored result, no model call", "verdicts": []},
    "miss": {"decision": "miss", "mode": "dense", "saving": 0.0, "model_calls": 16, "steps_total": 20,
             "timings_ms": {"total": 1840.0}, "requested_mode": "joint", "filter_mode": "signature",
             "rule_id": "embedded-v3", "reason": LONG_REASON, "decision_summary": LONG_REASON,
             "verdicts": [{"entry_id": "0123456789abcdef", "similarity": 0.93, "accepted": False, "reason": LONG_REASON,
                           "checks": [CHECKS_PASS[0], {"axis": "size", "value": 0.41, "threshold": 0.3,
                                                       "passed": False}, *CHECKS_PASS[2:]]}]},
    "miss_objects": {"decision": "miss", "mode": "dense", "saving": 0.0, "model_calls": 16, "steps_total": 20,
                     "timings_ms": {"total": 1790.0}, "requested_mode": "joint", "filter_mode": "signature",
                     "rule_id": "embedded-v3", "reason": "no candidate passes",
                     "verdicts": [{"entry_id": "0123456789abcdef", "similarity": 0.71, "accepted": False,
                                   "reason": "rejected: named object on one side only: triangle (target only), "
                                             "ball (candidate only)",
                                   "checks": [CHECKS_PASS[0],
                                              *[{"axis": a, "value": 0.0, "threshold": t, "passed": True}
                                                for a, t in (("size", 0.3), ("shape", 0.4), ("appearance", 6.0))]]}]},
    "forced_dense": {"decision": "miss", "mode": "dense", "saving": 0.0, "model_calls": 16, "steps_total": 20,
                     "timings_ms": {"total": 1700.0}, "requested_mode": "dense", "filter_mode": "signature",
                     "rule_id": "embedded-v3", "reason": "ACCEPT 3f2a91c0d4e5b6a7 (sim 0.97)",
                     "verdicts": [{"entry_id": "3f2a91c0d4e5b6a7", "similarity": 0.97, "accepted": True,
                                   "reason": "accepted: passes all 4 checks", "checks": CHECKS_PASS}]},
    "not_cached": {"decision": "dense", "mode": "dense", "saving": 0.0, "model_calls": 20, "steps_total": 20,
                   "timings_ms": {"total": 2010.0}, "requested_mode": "dense", "reason": "", "verdicts": [],
                   "not_cached": "the cache folder's disk is full (12 KiB free)"},
    "unfiltered": {"decision": "dense", "mode": "dense", "saving": 0.0, "model_calls": 20, "steps_total": 20,
                   "timings_ms": {"total": 2010.0}, "requested_mode": "joint", "reason": "", "verdicts": []},
    # The shipped rule after its per-stratum test: every candidate's stratum refused (only exact repeats reuse).
    "strata_none": {"decision": "miss", "mode": "dense", "saving": 0.0, "model_calls": 18, "steps_total": 20,
                    "timings_ms": {"total": 1800.0}, "requested_mode": "joint", "filter_mode": "signature",
                    "rule_id": "embedded-v3", "certified_strata": [], "reason": "stratum 'reseed' refused",
                    "verdicts": [{"entry_id": "3f2a91c0d4e5b6a7", "similarity": 0.97, "accepted": False,
                                  "reason": "rejected: passes the rule, but stratum 'reseed' — refused, served dense",
                                  "checks": CHECKS_PASS}]},
    "strata_some": {**REPORTS_HIT, "certified_strata": ["size", "colour"]},
    "learning": {"decision": "miss", "mode": "dense", "saving": 0.0, "model_calls": 16, "steps_total": 20,
                 "timings_ms": {"total": 1650.0}, "requested_mode": "joint", "filter_mode": "signature",
                 "reason": "no rule for this model yet: serving dense while learning", "verdicts": [],
                 "rule_state": {"state": "learning", "labels": 37, "needed": 120, "namespace": "a1b2c3d4-e5f6",
                                "message": "learning: 37 of about 120 labels; reuse switches on once certified"}},
}
EXPECTED_ROWS = {
    "hit": ["HIT · joint reuse · saved 62%", "23% of tokens recomputed · 0.84 s",
            "rule: embedded-v3 (certified)"],
    "exact": ["HIT · exact repeat · no model call", "entry 3f2a91c0d4 · 0.01 s",
              "rule: not needed (identical request)"],
    "miss": ["MISS · ran dense", "object size |log ratio| 0.41 > 0.30", "rule: embedded-v3 (certified)"],
    "miss_objects": ["MISS · ran dense", "objects differ from the closest entry", "rule: embedded-v3 (certified)"],
    "forced_dense": ["DENSE · reuse off (mode = dense)", "filter accepted 3f2a91c0d4, not used · 1.70 s",
                     "rule: embedded-v3 (certified)"],
    "not_cached": ["DENSE · reuse off (mode = dense)", "⚠ not cached: the cache folder's disk is full (12 KiB free)",
                   "rule: none connected"],
    "unfiltered": ["DENSE · no Risk Filter connected", "2.01 s", "rule: none connected"],
    "strata_none": ["MISS · ran dense", "re-rolls (a new seed) are not certified yet → ran dense",
                    "rule: no kind certified · exact repeats only"],
    "strata_some": ["HIT · joint reuse · saved 62%", "23% of tokens recomputed · 0.84 s",
                    "rule: reuse on for size, colour"],
    "learning": ["MISS · ran dense", "served dense: the rule is learning · 1.65 s",
                 "rule: learning · 37 of 120 labels (serving dense)"],
}


# --- the tests ------------------------------------------------------------------------------------------------------
def test_extension_is_served_and_loaded(page: Any) -> None:
    assert page.evaluate("() => Array.isArray(window.carnator.reports)")
    tabs = page.evaluate("() => app.extensionManager.sidebarTab.sidebarTabs.map(t => t.id)")
    assert "carnator-cache" in tabs


# What each Carnator node of workflows/embedded.json shows by default (linked widgets are sockets, not rows). On the
# canvas the summary button `carnator_advanced` shows the folded ones; Vue nodes have the frontend's own button.
DEFAULT_VIEW = {
    "CarnatorEmbeddedLoader": [],
    "CarnatorEmbeddedEmptyLatent": ["batch_size"],
    "CarnatorEarlyProbe": ["seed", "control_after_generate", "steps", "cfg", "sampler_name", "scheduler", "objects"],
    "CarnatorSignatureBuilder": [],
    "CarnatorCacheLoader": ["directory"],
    "CarnatorCacheRetriever": [],
    "CarnatorRiskFilter": ["rule_file", "mode"],
    "CarnatorJointReuseSampler": ["mode", "settings", "carnator_badge"],
    "CarnatorCacheWriter": [],
    "CarnatorEmbeddedDecode": [],
}


def test_compact_nodes_in_the_default_view(page: Any, ui: str) -> None:
    """Each Carnator node shows what a user sets; its tuning knobs are folded away until asked for, and the summary
    button (canvas) or the frontend's own advanced-inputs button (Vue nodes) shows them."""
    open_workflow(page, "embedded")
    fit_whole_graph(page)
    counts: dict[str, dict[str, int]] = {}
    for node_id, type_, total in page.evaluate("() => app.graph._nodes.filter(n => n.type in LiteGraph."
                                               "registered_node_types && n.type.startsWith('Carnator'))"
                                               ".map(n => [String(n.id), n.type, (n.widgets || []).length])"):
        shown = [w for w in shown_widgets(page, node_id) if w != "carnator_advanced"]
        # The prompt the Early Probe reads is linked from the Prompt node: a socket on the canvas of 1.58, a greyed
        # row on 1.32's canvas; either way not a value to set here.
        shown = [w for w in shown if not (type_ == "CarnatorEarlyProbe" and w == "prompt")]
        if type_ == "CarnatorEmbeddedTextEncode":
            continue  # the text widgets are linked or the negative prompt: stock-like nodes
        want = DEFAULT_VIEW[type_]
        if ui.endswith("-vue"):  # a Vue node draws the seed's control_after_generate inside the seed's row
            want = [w for w in want if w != "control_after_generate"]
        assert shown == want, (type_, shown)
        counts[type_] = {"shown": len(shown), "widgets": total}
    (ARTIFACTS / ui / "widget_counts.json").write_text(json.dumps(counts, indent=1))
    sampler = sampler_ids(page)[0]
    if ui.endswith("-vue"):
        node = page.locator(f'[data-node-id="{sampler}"]')
        before = node.bounding_box()
        node.locator('[data-testid="advanced-inputs-button"]').first.click()
        page.wait_for_function("(id) => document.querySelectorAll(`[data-node-id=\"${id}\"] "
                               "[data-testid=\"node-widget\"]`).length > 10", arg=sampler, timeout=30_000)
        assert "refresh_at" in shown_widgets(page, sampler)
        node.locator('[data-testid="advanced-inputs-button"]').first.click()
        page.wait_for_function("(id) => document.querySelectorAll(`[data-node-id=\"${id}\"] "
                               "[data-testid=\"node-widget\"]`).length < 5", arg=sampler, timeout=30_000)
        time.sleep(0.5)
        after = node.bounding_box()
        assert abs(after["height"] - before["height"]) < 4, (before, after)
        return
    # Canvas: a real click on the summary button shows the 16 tuning inputs, a second one folds them again.
    label = page.evaluate("(id) => app.graph.getNodeById(id).widgets.find(w => w.name === 'carnator_advanced').label",
                          sampler)
    assert label == "certified settings · ▸ 16 tuning inputs", label
    height = page.evaluate("(id) => app.graph.getNodeById(id).size[1]", sampler)
    for want_open in (True, False):
        xy = page.evaluate("""(id) => {
            const n = app.graph.getNodeById(id), w = n.widgets.find(w => w.name === 'carnator_advanced');
            const ds = app.canvas.ds, r = app.canvas.canvas.getBoundingClientRect();
            return [(n.pos[0] + n.size[0] / 2 + ds.offset[0]) * ds.scale + r.left,
                    (n.pos[1] + w.y + 10 + ds.offset[1]) * ds.scale + r.top];
        }""", sampler)
        page.mouse.click(*xy)
        page.wait_for_function("([id, open]) => !!app.graph.getNodeById(id).showAdvanced === open",
                               arg=[sampler, want_open], timeout=30_000)
        page.evaluate("() => app.canvas.draw(true, true)")
        shown = shown_widgets(page, sampler)
        assert ("refresh_at" in shown) == want_open, shown
    assert page.evaluate("(id) => app.graph.getNodeById(id).size[1]", sampler) <= height + 1


def test_badge_text_for_each_decision_kind(page: Any, ui: str) -> None:
    """Each kind of decision reads as what happened (DENSE when forced, "not compared" for an axis that did not
    apply, labels with units, the rule's state), the badge keeps its height (the node never grows onto the next),
    is readable at 75 % zoom, and a click shows the whole decision (the long reason in full)."""
    open_workflow(page, "embedded")
    sampler = sampler_ids(page)[0]
    height0 = None
    for kind, report in REPORTS.items():
        inject_report(page, sampler, report)
        rows = badge_rows(page, sampler)
        assert rows == EXPECTED_ROWS[kind], (kind, rows)
        assert rows == page.evaluate("(r) => window.carnator.badgeLines(r).lines.map(l => l.text)", report)
        focus_sampler(page, 0.75)
        time.sleep(0.5)
        box = badge_element_box(page, sampler)
        height0 = height0 or box["height"]
        assert abs(box["height"] - height0) < 1.5, (kind, box, height0)
        assert_no_overlap(page, f"{ui} after a {kind} report")
    # At 75 % zoom: rows at least 12 px tall, text of at least 9.5 px, no row of a hit cut.
    focus_sampler(page, 0.75)
    time.sleep(0.5)
    inject_report(page, sampler, REPORTS["hit"])
    metrics = page.evaluate("""(id) => {
        const w = app.graph.getNodeById(id).widgets.find(w => w.name === 'carnator_badge');
        const e = document.querySelector(`[data-node-id="${id}"] .carnator-badge`) || w.element;
        const head = e.children[0], b = head.getBoundingClientRect(), scale = b.height / head.offsetHeight;
        return {rowPx: b.height, fontPx: parseFloat(getComputedStyle(head).fontSize) * scale,
                cut: [...e.children].filter(r => r.scrollWidth > r.clientWidth + 1).map(r => r.textContent)};
    }""", sampler)
    assert metrics["rowPx"] >= 12 and metrics["fontPx"] >= 9.5 and metrics["cut"] == [], metrics
    out = ARTIFACTS / ui
    page.screenshot(path=str(out / "badge_75.png"))
    # The whole decision on click: the long reason in full, each axis with its unit.
    inject_report(page, sampler, REPORTS["miss"])
    focus_sampler(page, 0.75)
    time.sleep(0.5)
    b = badge_element_box(page, sampler)
    page.mouse.click(b["x"] + b["width"] / 2, b["y"] + b["height"] / 2)
    page.wait_for_selector(".carnator-details", timeout=30_000)
    details = page.locator(".carnator-details").inner_text()
    assert LONG_REASON in details.replace("\n", " "), details
    assert "✗ object size |log ratio| 0.41 > 0.30" in details and "background colour ΔE 1.21 ≤ 4.00" in details
    assert "share of compute saved: 0%" in details, details
    page.screenshot(path=str(out / "badge_details.png"))
    page.keyboard.press("Escape")
    page.wait_for_selector(".carnator-details", state="detached", timeout=30_000)
    inject_report(page, sampler, REPORTS["miss_objects"])
    b = badge_element_box(page, sampler)
    page.mouse.click(b["x"] + b["width"] / 2, b["y"] + b["height"] / 2)
    page.wait_for_selector(".carnator-details", timeout=30_000)
    details = page.locator(".carnator-details").inner_text()
    for label in ("object size", "object shape", "object colour"):
        assert f"{label}: not compared" in details, details
    assert "0.00" not in details, details
    page.keyboard.press("Escape")
    inject_report(page, sampler, REPORTS["learning"])
    assert "learning: 37 of about 120 labels" in page.evaluate(
        "(r) => window.carnator.badgeLines(r).details.map(l => l.text).join('\\n')", REPORTS["learning"])
    for state_, words in (("certified", "rule: certified · reuse on"),
                          ("audited", "rule: certified, audited · reuse on"), ("off", "rule: off · serving dense")):
        r = {**REPORTS["hit"], "rule_state": {"state": state_, "labels": 120, "needed": 120, "message": "",
                                              "namespace": "a1b2"}}
        inject_report(page, sampler, r)
        assert badge_rows(page, sampler)[2] == words
    ours = [e for e in PAGE_ERRORS if "carnator" in e.lower()]
    assert not ours, ours


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "workflows").glob("*.json")))
def test_no_overlap_with_every_badge_in_each_workflow(page: Any, ui: str, name: str) -> None:
    """Every example workflow: after a hit, a miss and a forced dense report on each of its samplers, no two nodes
    overlap on the page (the embedded workflows also run for real in the next test)."""
    open_workflow(page, name)
    page.keyboard.press("Escape")  # close a missing-models dialog, if any
    assert_no_overlap(page, f"{name} as loaded")
    for kind in ("hit", "miss", "forced_dense"):
        for node_id in sampler_ids(page):
            inject_report(page, node_id, {**REPORTS[kind], "steps_total": 20 + int(node_id)})
        assert_no_overlap(page, f"{name} after a {kind} on every sampler")


def set_widget(page: Any, node_type: str, name: str, value: Any) -> None:
    page.evaluate("""([type, name, value]) => {
        const n = app.graph._nodes.find(n => n.type === type), w = n.widgets.find(w => w.name === name);
        w.value = value;
        w.callback?.(value);
        app.graph.setDirtyCanvas(true, true);
    }""", [node_type, name, value])


def test_real_runs_badges_no_overlap_panel_and_purge(page: Any, server: ComfyServer, ui: str) -> None:
    """The embedded workflows queued with the Run button: a dense warm-up, the exact repeat (hit), an unrelated
    prompt (miss), the sampler's mode = dense (forced dense), a requeue that ComfyUI's node cache answers, then the
    panel's purge, after which the same graph really runs again."""
    missing = [str(p.relative_to(ROOT)) for p in (EMBEDDED_WEIGHTS, EMBEDDED_RULE) if not p.exists()]
    if missing:
        pytest.fail(f"embedded model missing: {', '.join(missing)}")
    out = ARTIFACTS / ui
    # 1. Warm the cache: a dense run (the sampler's mode is dense in this workflow), written to the cache.
    prompt = open_workflow(page, "embedded_warm_cache")
    assert executable(prompt) == api_file("embedded_warm_cache"), "the frontend makes another prompt of it"
    report = run_and_wait_for_badge(page, server)
    assert report["decision"] == "dense", report
    sampler = sampler_ids(page)[0]
    assert badge_rows(page, sampler)[0] == "DENSE · reuse off (mode = dense)"  # the warm-up graph's sampler mode
    assert_no_overlap(page, "warm-up (dense)", out / "warm_cache.png")

    # 2. The same request through the full reuse path: answered before the probe, from the stored result.
    prompt = open_workflow(page, "embedded")
    assert executable(prompt) == api_file("embedded")
    report = run_and_wait_for_badge(page, server)
    assert (report["decision"], report["mode"], report["model_calls"]) == ("hit", "exact", 0), report
    sampler = sampler_ids(page)[0]
    rows = badge_rows(page, sampler)
    assert rows == page.evaluate("(r) => window.carnator.badgeLines(r).lines.map(l => l.text)", report)
    assert rows[0] == "HIT · exact repeat · no model call", rows
    assert_no_overlap(page, "exact hit", out / "hit.png")
    # The badge on screen: inside the node, painted in hit colours; its pictures for the README.
    node_box = focus_sampler(page)
    time.sleep(0.5)
    box = badge_element_box(page, sampler)
    slack = 40  # px: the DOM widget's margins and the node's border
    assert (node_box["x"] - slack <= box["x"] and box["x"] + box["width"] <= node_box["x"] + node_box["width"] + slack
            and node_box["y"] <= box["y"] and box["y"] + box["height"] <= node_box["y"] + node_box["height"] + slack
            ), f"badge {box} is not inside the sampler node {node_box}"
    if ui.endswith("-vue"):  # the Vue node is HTML: the badge must be part of it, not drawn over it
        assert page.locator(f'[data-node-id="{sampler}"] .carnator-badge').count() == 1
    # The badge and the summary button are not values: the saved workflow has the file's widget values.
    saved = page.evaluate("() => app.graph.serialize().nodes"
                          ".find(n => n.type === 'CarnatorJointReuseSampler').widgets_values")
    in_file = next(n for n in json.loads((ROOT / "workflows" / "embedded.json").read_text(encoding="utf-8"))["nodes"]
                   if n["type"] == "CarnatorJointReuseSampler")["widgets_values"]
    assert saved == in_file, (saved, in_file)
    full = out / "reuse_full.png"
    page.screenshot(path=str(full))
    bg, text = badge_pixels(full, box)
    assert bg > 0.3 and text > 0.02, f"badge not painted readably: {bg:.0%} background, {text:.1%} text pixels"
    margin = 16
    clip = {"x": max(0.0, node_box["x"] - margin), "y": max(0.0, node_box["y"] - margin),
            "width": node_box["width"] + 2 * margin, "height": node_box["height"] + 2 * margin}
    shot = out / "badge.png"
    page.screenshot(path=str(shot), clip=clip)
    if os.environ.get("CARNATOR_UPDATE_README_IMG") == "1" and ui in README_IMG:
        save_readme_image(shot, README_IMG[ui])

    # 3. An unrelated prompt (other objects): a miss, continued dense.
    set_widget(page, "PrimitiveStringMultiline", "value", "a small white cube sits still in the lower right, "
                                                          "on a dark night")
    report = run_and_wait_for_badge(page, server)
    assert report["decision"] == "miss" and report["model_calls"] > 0, report
    assert badge_rows(page, sampler)[0] == "MISS · ran dense"
    assert_no_overlap(page, "miss", out / "miss.png")

    # 4. The sampler's mode = dense: DENSE, whatever the filter said.
    set_widget(page, "CarnatorJointReuseSampler", "mode", "dense")
    report = run_and_wait_for_badge(page, server)
    assert report["requested_mode"] == "dense" and report["model_calls"] > 0, report
    assert badge_rows(page, sampler)[0] == "DENSE · reuse off (mode = dense)"
    assert_no_overlap(page, "forced dense", out / "dense.png")

    # 5. The same graph again: ComfyUI's own node cache answers it (nothing runs): not a Carnator hit.
    report = run_and_wait_for_badge(page, server)
    assert (report["mode"], report["model_calls"]) == ("node_cache", 0), report
    assert badge_rows(page, sampler)[0] == "NOT RUN · ComfyUI reused its output"

    # 6. The panel: this namespace with its rule, the requests with decisions and thumbnails; then purge.
    open_panel(page)
    page.wait_for_function("() => Number(document.querySelector('.carnator-panel')?.dataset.entries) >= 1 && "
                           "Number(document.querySelector('.carnator-panel')?.dataset.requests) >= 5",
                           timeout=30_000)
    card = page.locator(".carnator-ns").first
    assert "rule:" in card.locator(".carnator-ns-rule").inner_text()
    decisions = page.evaluate("() => [...document.querySelectorAll('.carnator-ns .carnator-req')]"
                              ".map(r => r.dataset.decision)")
    assert {"hit", "miss", "dense"} <= set(decisions), decisions
    thumbs = page.evaluate("() => [...document.querySelectorAll('.carnator-ns img.carnator-thumb')]"
                           ".map(i => [i.naturalWidth, i.naturalHeight])")
    assert thumbs and all(w >= 32 and h >= 32 for w, h in thumbs), thumbs
    assert page.locator(".carnator-ns .carnator-plot polyline").count() == 2
    page.screenshot(path=str(out / "cache_panel.png"))
    if os.environ.get("CARNATOR_UPDATE_README_IMG") == "1" and ui == "new-canvas":
        panel_box = page.locator(".carnator-panel").bounding_box()
        last = page.locator(".carnator-ns").last.bounding_box()  # down to the last namespace card, not the void
        panel_box["height"] = min(panel_box["height"], last["y"] + last["height"] + 12 - panel_box["y"])
        page.screenshot(path=str(out / "panel.png"), clip=panel_box)
        save_readme_image(out / "panel.png", README_PANEL)
    page.locator(".carnator-purge").click()
    page.wait_for_function("() => document.querySelector('.carnator-panel')?.dataset.entries === '0'",
                           timeout=30_000)
    assert server.get("/carnator/cache/stats?directory=carnator_cache")["entries"] == 0

    # 7. The same graph after the purge: it runs (the Cache node's fingerprint followed the purge) and refills.
    report = run_and_wait_for_badge(page, server)
    assert report["mode"] != "node_cache" and report["model_calls"] > 0, report
    assert server.get("/carnator/cache/stats?directory=carnator_cache")["entries"] >= 1
    page.wait_for_function("() => Number(document.querySelector('.carnator-panel')?.dataset.entries) >= 1",
                           timeout=30_000)
    assert page.locator(".carnator-ns .carnator-purge-mark").count() >= 1
    page.screenshot(path=str(out / "cache_panel_after_purge.png"))
    ours = [e for e in PAGE_ERRORS if "carnator" in e.lower()]
    assert not ours, ours


def open_badge_details(page: Any, node_id: str) -> None:
    """Click the badge of sampler ``node_id`` until its details show (a Vue node may still be moving to a new canvas
    transform when the first click lands)."""
    for attempt in range(3):
        time.sleep(0.5)
        b = badge_element_box(page, node_id)
        page.mouse.click(b["x"] + b["width"] / 2, b["y"] + b["height"] / 2)
        try:
            page.wait_for_selector(".carnator-details", timeout=5_000)
            return
        except Exception as e:  # noqa: BLE001 — the click missed: measure again
            if attempt == 2:
                at = page.evaluate("([x, y]) => { const e = document.elementFromPoint(x, y); return e && "
                                   "(e.tagName + '.' + e.className + ' in ' + e.parentElement?.className); }",
                                   [b["x"] + b["width"] / 2, b["y"] + b["height"] / 2])
                page.screenshot(path=str(ARTIFACTS / "badge_click_missed.png"))
                raise AssertionError(f"clicking the badge at {b} opened no details; the element there: {at}") from e


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def open_panel(page: Any) -> None:
    """Open the Carnator sidebar tab (its button), unless it is open."""
    if not (page.locator(".carnator-panel").count() and page.locator(".carnator-panel").first.is_visible()):
        page.locator(PANEL_TAB).first.click()
    page.wait_for_selector(".carnator-panel", state="visible", timeout=30_000)


def wait_for_panel(page: Any, condition: str, arg: Any = None) -> None:
    """Refresh the panel until ``condition`` (a JS expression over ``panel`` and ``arg``) holds."""
    page.wait_for_function(f"""(arg) => {{
        const panel = document.querySelector('.carnator-panel');
        if (!panel) return false;
        if ({condition}) return true;
        window.carnator.refreshPanel?.();
        return false;
    }}""", arg=arg, timeout=60_000, polling=1000)


def test_requeue_is_not_run_and_one_definition_of_hits(page: Any, server: ComfyServer, ui: str) -> None:
    """A dense warm-up, its exact repeat through the full graph (a hit) and a requeue of that unchanged graph, which
    ComfyUI's own node cache answers: the badge says NOT RUN (ComfyUI reused its output), never a hit; the badge,
    the panel, its request list, GET /carnator/requests and the cache's counters (GET /carnator/cache/stats) count
    one hit and one lookup, by the one definition the panel's help states; the cache's counters say "since purge"
    and the request list shows as many rows as its title says."""
    import secrets

    directory = f"counts_{secrets.token_hex(4)}"  # a cache of its own: its counters start at 0
    seed = 7_000 + secrets.randbelow(10**6)  # a request of its own in the server's history
    open_workflow(page, "embedded_warm_cache")
    set_widget(page, "CarnatorCacheLoader", "directory", directory)
    set_widget(page, "CarnatorEarlyProbe", "seed", seed)
    reports_ = [run_and_wait_for_badge(page, server)]
    assert reports_[0]["decision"] == "dense", reports_[0]
    open_workflow(page, "embedded")
    set_widget(page, "CarnatorCacheLoader", "directory", directory)
    set_widget(page, "CarnatorEarlyProbe", "seed", seed)
    reports_.append(run_and_wait_for_badge(page, server))
    assert (reports_[1]["decision"], reports_[1]["mode"]) == ("hit", "exact"), reports_[1]
    reports_.append(run_and_wait_for_badge(page, server))  # the unchanged graph again
    assert (reports_[2]["mode"], reports_[2]["model_calls"]) == ("node_cache", 0), reports_[2]
    sampler = sampler_ids(page)[0]
    rows = badge_rows(page, sampler)
    assert rows == ["NOT RUN · ComfyUI reused its output", "graph unchanged: not a Carnator hit",
                    "rule: not asked (nothing ran)"], rows
    open_badge_details(page, sampler)
    details = page.locator(".carnator-details").inner_text()
    assert "neither as a lookup nor as a hit" in details and "saved" not in details, details
    page.keyboard.press("Escape")

    # The cache's counters: the exact repeat is the one hit and the one lookup (the warm-up had no Risk Filter,
    # the node cache ran nothing); the badge's reading of the three reports is the same.
    stats = server.get(f"/carnator/cache/stats?directory={directory}")
    assert (stats["hits"], stats["lookups"], stats["counted_since"]) == (1, 1, "purge"), stats
    assert page.evaluate("(rs) => [rs.filter(window.carnator.isHit).length, rs.filter(window.carnator.isLookup)"
                         ".length]", reports_) == [1, 1]
    listed = server.get("/carnator/requests?limit=200")
    ns, ours = next((ns, [e for e in ev if e.get("seed") == seed]) for ns, ev in listed["namespaces"].items()
                    if any(e.get("seed") == seed for e in ev))
    assert [(e["outcome"], e["lookup"]) for e in ours] == [("dense", False), ("hit", True), ("not_run", False)], ours
    counts = listed["counts"][ns]
    held = [e for e in listed["namespaces"][ns]]
    assert counts == {"requests": len(held), "hits": sum(e["outcome"] == "hit" for e in held),
                      "lookups": sum(e["lookup"] for e in held),
                      "not_run": sum(e["outcome"] == "not_run" for e in held)}, (counts, held)

    # The panel says the same, with the span each count covers and the definitions in its help.
    open_panel(page)
    wait_for_panel(page, "panel.querySelector('.carnator-dir')?.value === arg && "
                         "[...panel.querySelectorAll('.carnator-ns .carnator-req')].length > 0", directory)
    wait_for_panel(page, "panel.querySelector(`.carnator-ns[data-namespace=\"${arg}\"] .carnator-req`)"
                         "?.dataset.decision === 'not_run'", ns)
    card = page.locator(f'.carnator-ns[data-namespace="{ns}"]')
    mine = next(n for n in stats["namespaces"] if n["namespace"] == ns)
    assert card.locator(".carnator-ns-counts").inner_text().endswith(
        f"{plural(mine['hits'], 'hit')} of {plural(mine['lookups'], 'lookup')} since purge")
    recent = card.locator(".carnator-ns-recent").inner_text()
    counts = server.get("/carnator/requests?limit=60")["counts"][ns]
    assert recent.startswith(f"since the server started: {plural(counts['requests'], 'request')} · "
                             f"{plural(counts['hits'], 'hit')} of {plural(counts['lookups'], 'lookup')} · "
                             f"{counts['not_run']} not run (ComfyUI reused its output)"), (recent, counts)
    table = page.locator(".carnator-stats").inner_text()
    assert "hits since purge\t1 of 1 lookup" in table, table
    title = card.locator(".carnator-req-title").inner_text()
    listed_rows = card.locator(".carnator-req")
    assert title == f"last {listed_rows.count()} requests, newest first" and listed_rows.count() >= 3, title
    newest = listed_rows.first
    assert newest.get_attribute("data-decision") == "not_run"
    assert newest.locator(".carnator-req-decision").inner_text() == "NOT RUN · ComfyUI reused its output"
    page.locator(".carnator-help summary").click()
    help_text = page.locator(".carnator-help").inner_text()
    for text in stats["definitions"].values():
        assert text in help_text, (text, help_text)
    page.screenshot(path=str(ARTIFACTS / ui / "panel_counts.png"))
    ours_ = [e for e in PAGE_ERRORS if "carnator" in e.lower()]
    assert not ours_, ours_


def test_a_refused_kind_reads_in_words(page: Any, server: ComfyServer, ui: str) -> None:
    """A motion edit of a cached request, which the shipped rule refuses for its kind of change alone (it passes the
    thresholds): the badge says so in words on the badge itself, and a click shows the rule's reason (the certificate's
    figure, or that the fixed sequence stopped before motion)."""
    import secrets

    directory = f"kinds_{secrets.token_hex(4)}"
    open_workflow(page, "embedded")
    set_widget(page, "CarnatorCacheLoader", "directory", directory)
    text = "a big red ball moves to the right in the top left, on green grass"
    set_widget(page, "PrimitiveStringMultiline", "value", text)
    first = run_and_wait_for_badge(page, server)
    assert first["decision"] == "miss" and first["model_calls"] > 0, first  # an empty cache: computed, stored
    set_widget(page, "PrimitiveStringMultiline", "value", text.replace("moves to the right", "moves up"))
    report = run_and_wait_for_badge(page, server)
    assert report["decision"] == "miss" and report["model_calls"] > 0, report
    assert any("stratum 'motion'" in v["reason"] and "refused" in v["reason"] for v in report["verdicts"]), report
    sampler = sampler_ids(page)[0]
    rows = badge_rows(page, sampler)
    assert rows[:2] == ["MISS · ran dense", "motion edits are not certified yet → ran dense"], rows
    focus_sampler(page, 0.75)
    time.sleep(0.5)
    shown = shown_rows(page, sampler)
    assert not any(r["cut"] for r in shown), shown
    assert shown[1]["text"].startswith("motion edits") and "not certified" in shown[1]["text"], shown
    open_badge_details(page, sampler)
    details = page.locator(".carnator-details").inner_text()
    from carnator.carnator_core.risk.rule import RiskRule

    # the rule's own reason, in its words: the certificate's figure, or that the fixed sequence stopped before it
    why = RiskRule.load(ROOT / "rules" / "embedded.json").strata.describe("motion").split("'motion'", 1)[1]
    assert f"motion edits are not certified: {why.lstrip(': ')}" in details, (why, details)
    page.screenshot(path=str(ARTIFACTS / ui / "badge_refused_kind.png"))
    page.keyboard.press("Escape")
    ours = [e for e in PAGE_ERRORS if "carnator" in e.lower()]
    assert not ours, ours


STRATA_STATE = {  # a learner's per-kind record after its pilot (the fields web/carnator.js reads)
    "colour": {"state": "learning", "labels": 19, "needed": 86, "rank": 0, "sequence": {"n": 12}},
    "reseed": {"state": "learning", "labels": 9, "needed": 86, "rank": 1, "sequence": {"n": 5}},
    "size": {"state": "certified", "labels": 90, "needed": 86, "rank": 2, "sequence": {"n": 86}},
}
LONG_ROWS = {  # the longest rows each kind of report gives, besides REPORTS
    "five_kinds": {**REPORTS_HIT, "certified_strata": ["size", "colour", "rewording", "reseed", "position"]},
    "refused_count": {**REPORTS["strata_none"], "verdicts": [{
        **REPORTS["strata_none"]["verdicts"][0],
        "reason": "rejected: passes the rule, but stratum 'count': (b − c)/n = (9 − 1)/61, U = 0.2100 > α = 0.05 — "
                  "refused, served dense"}]},
    "pilot": {**REPORTS["learning"], "rule_state": {
        "state": "learning", "labels": 0, "needed": 86, "labels_total": 4, "namespace": "a1b2", "message": "",
        "strata": {"colour": {"state": "learning", "labels": 4, "needed": 86, "rank": -1, "sequence": None}},
        "pilot": {"requests": 23, "size": 60, "done": False}, "requests_per_label": {}}},
    "learning_kinds": {**REPORTS["learning"], "rule_state": {
        "state": "learning", "labels": 12, "needed": 86, "labels_total": 118, "namespace": "a1b2", "message": "",
        "strata": STRATA_STATE, "pilot": {"requests": 60, "size": 60, "done": True},
        "requests_per_label": {"colour": 4.2, "reseed": 7.5, "size": 3.1}}},
    "off": {**REPORTS["learning"], "rule_state": {
        "state": "off", "labels": 12, "needed": 212, "labels_total": 118, "namespace": "a1b2", "message": "",
        "strata": {**STRATA_STATE, "colour": {**STRATA_STATE["colour"], "state": "off", "needed": 212,
                                              "sequence": {"n": 123}}},
        "pilot": {"requests": 60, "size": 60, "done": True}, "requests_per_label": {"colour": 14.2}}},
}


def test_learning_progress_in_words(page: Any) -> None:
    """Learning's progress as the badge and the details give it, from a learner's rule_state: the pilot's requests
    with a candidate, then per kind the labels its test counts (not the ones it cannot) and about how many requests
    remain at the traffic mix the pilot measured."""
    open_workflow(page, "embedded")
    sampler = sampler_ids(page)[0]
    inject_report(page, sampler, LONG_ROWS["pilot"])
    rows = badge_rows(page, sampler)
    assert rows[1:] == ["learning (pilot) → ran dense · 1.65 s",
                        "rule: learning · pilot: 23 of 60 requests with a candidate"], rows
    inject_report(page, sampler, LONG_ROWS["learning_kinds"])
    rows = badge_rows(page, sampler)
    # colour: first in the order, 12 counted of 86, (86 − 12) · 4.2 = 310.8 → about 311 requests
    assert rows[1:] == ["colour edits: about 311 requests to go → ran dense",
                        "rule: learning · colour edits: 12 of 86 labels"], rows
    details = page.evaluate("(r) => window.carnator.badgeLines(r).details.map(l => l.text)",
                            LONG_ROWS["learning_kinds"])
    assert "reuse on for size edits (certified)" in details, details
    assert any(d.startswith("colour edits: 12 of about 86 labels · about 311 requests to go at this traffic mix (7 "
                            "more made that its test cannot count") for d in details), details
    assert any(d.startswith("re-rolls (a new seed): 5 of about 86 labels · about 608 requests to go") for d in details)


def test_learning_shows_the_pilot_from_the_first_request(page: Any, server: ComfyServer, ui: str) -> None:
    """The EasyCache workflow learns its rule: from its first request the badge and the panel show the pilot's
    progress, as GET /carnator/rules counts it (served requests with a cached candidate, of the pilot's 60)."""
    import secrets

    directory = f"learn_{secrets.token_hex(4)}"  # a cache, and so a learning record, of its own
    open_workflow(page, "embedded_easycache")
    set_widget(page, "CarnatorCacheLoader", "directory", directory)
    sampler = sampler_ids(page)[0]
    seen = []
    for seed in (101, 102):  # the second request has the first as its cached candidate
        set_widget(page, "CarnatorEarlyProbe", "seed", seed)
        report = run_and_wait_for_badge(page, server)
        assert report["rule_state"]["state"] == "learning", report
        learned = server.get(f"/carnator/rules?directory={directory}")["namespaces"]
        pilot = next(r["pilot"] for r in learned if r["namespace"] == report["rule_state"]["namespace"])
        assert pilot["size"] == 60 and not pilot["done"], pilot
        assert report["rule_state"]["pilot"] == pilot, (report["rule_state"], pilot)
        rows = badge_rows(page, sampler)
        assert rows[2] == f"rule: learning · pilot: {pilot['requests']} of 60 requests with a candidate", rows
        assert rows[1].startswith("learning (pilot) → ran dense"), rows
        assert not any(r["cut"] for r in shown_rows(page, sampler))
        seen.append(pilot["requests"])
    assert seen == [0, 1], seen  # the first request had no candidate; the second had the first
    open_panel(page)
    wait_for_panel(page, "panel.querySelector('.carnator-dir')?.value === arg.dir && [...panel.querySelectorAll("
                         "'.carnator-ns-learning')].some(e => e.textContent.includes(arg.text))",
                   {"dir": directory, "text": "pilot: 1 of 60 requests with a candidate"})
    page.screenshot(path=str(ARTIFACTS / ui / "panel_learning.png"))


def test_card_titles_tell_namespaces_apart_in_words(page: Any, server: ComfyServer, ui: str) -> None:
    """The plain embedded model and the same model behind EasyCache are two namespaces: their panel cards say which
    is which in words (the loader, the EasyCache patch, the probe's schedule), before and after a purge, and never
    show a namespace's hash."""
    import re
    import secrets

    directory = f"titles_{secrets.token_hex(4)}"
    spaces = []
    for name in ("embedded", "embedded_easycache"):
        open_workflow(page, name)
        set_widget(page, "CarnatorCacheLoader", "directory", directory)
        set_widget(page, "CarnatorEarlyProbe", "seed", 300 + len(spaces))
        run_and_wait_for_badge(page, server)
        spaces.append({n["namespace"] for n in server.get(f"/carnator/cache/stats?directory={directory}")
                       ["namespaces"]} - set().union(*spaces))
    plain, patched = (next(iter(x)) for x in spaces)
    open_panel(page)
    hexes = re.compile(r"[0-9a-f]{12,}")
    for when in ("before", "after"):
        wait_for_panel(page, "panel.querySelector('.carnator-dir')?.value === arg.dir && arg.ns.every(ns => "
                             "panel.querySelector(`.carnator-ns[data-namespace=\"${ns}\"] .carnator-ns-title`))",
                       {"dir": directory, "ns": [plain, patched]})
        titles = {ns: page.locator(f'.carnator-ns[data-namespace="{ns}"]').locator(
            ".carnator-ns-title, .carnator-ns-config").all_inner_texts() for ns in (plain, patched)}
        assert titles[plain] != titles[patched], titles
        assert "EasyCache" in " ".join(titles[patched]) and "EasyCache" not in " ".join(titles[plain]), titles
        for ns, words in titles.items():
            text = " ".join(words)
            assert "Embedded Model Loader" in text and "probe 2 of 20 steps" in text, (when, text)
            assert not hexes.search(text) and ns[:8] not in text, (when, text)
        if when == "before":
            page.screenshot(path=str(ARTIFACTS / ui / "panel_titles.png"))
            page.locator(".carnator-purge").click()
            page.wait_for_function("() => document.querySelector('.carnator-panel')?.dataset.entries === '0'",
                                   timeout=30_000)


def test_badge_rows_whole_at_75_and_100_percent_and_at_the_minimum_width(page: Any, ui: str) -> None:
    """No badge row is cut, whatever the report: at 75 % and 100 % zoom at the workflow's width each row shows in
    full or in a shorter form of itself (the whole row is its tooltip), and at the node's minimum width too."""
    open_workflow(page, "embedded")
    sampler = sampler_ids(page)[0]
    width0 = page.evaluate("(id) => app.graph.getNodeById(id).size[0]", sampler)
    cases = {**REPORTS, **LONG_ROWS}
    for label, width in (("default", None), ("minimum", "min")):
        if width == "min":
            page.evaluate("(id) => { const n = app.graph.getNodeById(id); n.setSize([1, n.size[1]]); "
                          "n.setSize([n.computeSize()[0], n.size[1]]); app.canvas.setDirty(true, true); }", sampler)
            w = page.evaluate("(id) => app.graph.getNodeById(id).size[0]", sampler)
            assert 280 <= w < width0, w  # narrower than as loaded, never narrower than its rows need
        for zoom in (0.75, 1.0):
            for kind, report in cases.items():
                inject_report(page, sampler, report)
                focus_sampler(page, zoom)
                time.sleep(0.3)
                shown = shown_rows(page, sampler)
                full = page.evaluate("(r) => window.carnator.badgeLines(r).lines"
                                     ".map(l => [l.text, ...(l.short || [])])", report)
                assert [r["full"] for r in shown] == [f[0] for f in full], (kind, shown)
                assert all(r["text"] in f for r, f in zip(shown, full)), (kind, shown, full)
                assert not any(r["cut"] for r in shown), (label, zoom, kind, shown)
            page.screenshot(path=str(ARTIFACTS / ui / f"badge_rows_{label}_{int(zoom * 100)}.png"))
    ours = [e for e in PAGE_ERRORS if "carnator" in e.lower()]
    assert not ours, ours


def save_readme_image(shot: Path, dest: Path) -> None:
    from PIL import Image

    dest.parent.mkdir(parents=True, exist_ok=True)
    # A 128-colour palette keeps the committed picture small (the UI uses few colours).
    Image.open(shot).convert("RGB").quantize(colors=128).save(dest, optimize=True)


def toggle_advanced(page: Any, node_id: str) -> None:
    """A real click on a node's advanced-inputs button: the summary button on the canvas, the frontend's own
    button in Vue nodes (the whole graph in view)."""
    page.evaluate("() => { app.canvas.deselectAll?.(); app.canvas.setDirty(true, true); }")  # no toolbox over it
    fit_whole_graph(page)
    if page.evaluate("() => !!window.LiteGraph?.vueNodesMode"):
        element = page.locator(f'[data-node-id="{node_id}"]')
        before = element.bounding_box()["height"]
        element.locator('[data-testid="advanced-inputs-button"]').first.click(timeout=30_000)
        page.wait_for_function("([id, h]) => Math.abs(document.querySelector(`[data-node-id=\"${id}\"]`)"
                               ".getBoundingClientRect().height - h) > 2", arg=[node_id, before], timeout=30_000)
        time.sleep(1.0)  # the room below is made once the node has its new height
        return
    was = page.evaluate("(id) => !!app.graph.getNodeById(id).showAdvanced", node_id)
    xy = page.evaluate("""(id) => {
        const n = app.graph.getNodeById(id), w = n.widgets.find(w => w.name === 'carnator_advanced');
        const ds = app.canvas.ds, r = app.canvas.canvas.getBoundingClientRect();
        return [(n.pos[0] + n.size[0] / 2 + ds.offset[0]) * ds.scale + r.left,
                (n.pos[1] + w.y + 10 + ds.offset[1]) * ds.scale + r.top];
    }""", node_id)
    page.mouse.click(*xy)
    try:
        page.wait_for_function("([id, was]) => !!app.graph.getNodeById(id).showAdvanced !== was",
                               arg=[node_id, was], timeout=30_000)
    except Exception as e:
        where = page.evaluate("""([id, x, y]) => {
            const n = app.graph.getNodeById(id), w = n.widgets.find(w => w.name === 'carnator_advanced');
            const e = document.elementFromPoint(x, y);
            return {type: n.type, pos: n.pos, size: n.size, wy: w.y, last_y: w.last_y, scale: app.canvas.ds.scale,
                    at: e && (e.tagName + '.' + e.className)};
        }""", [node_id, *xy])
        raise AssertionError(f"the click at {xy} did not toggle node {node_id}: {where}") from e
    page.evaluate("() => app.canvas.draw(true, true)")


#: Where opening the tuning inputs covered the next node (the Cache Writer in ``embedded``, the low-noise sampler in
#: ``wan22_t2v_14b``): checked on every UI; the other workflows on the 1.58.1 canvas, whose layout code is the
#: same for every workflow (each workflow on each UI costs 15-40 s of the suite's time).
TUNING_ON_EVERY_UI = ("embedded", "wan22_t2v_14b")


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "workflows").glob("*.json")))
def test_tuning_inputs_open_without_covering_any_node(page: Any, ui: str, name: str) -> None:
    """Every node's advanced inputs opened, one after the other, with real clicks: what is below a node that grows
    moves down, so no two nodes overlap; folded again, every node is back where the workflow put it."""
    if ui != "new-canvas" and name not in TUNING_ON_EVERY_UI:
        pytest.skip(f"{name}: checked on the 1.58.1 canvas; on {ui} only {', '.join(TUNING_ON_EVERY_UI)}")
    open_workflow(page, name)
    page.keyboard.press("Escape")  # close a missing-models dialog, if any
    fit_whole_graph(page)
    ids = page.evaluate("""() => app.graph._nodes.filter(n => window.LiteGraph?.vueNodesMode
        ? !!document.querySelector(`[data-node-id="${n.id}"] [data-testid="advanced-inputs-button"]`)
        : (n.widgets || []).some(w => w.name === 'carnator_advanced')).map(n => String(n.id))""")
    assert len(ids) >= 5, ids
    loaded = page.evaluate("() => Object.fromEntries(app.graph._nodes.map(n => [n.id, [...n.pos]]))")
    for node_id in ids:
        toggle_advanced(page, node_id)
    assert_no_overlap(page, f"{name} with every node's advanced inputs open",
                      ARTIFACTS / ui / f"advanced_open_{name}.png")
    for node_id in reversed(ids):
        toggle_advanced(page, node_id)
    assert_no_overlap(page, f"{name} folded again")
    back = page.evaluate("() => Object.fromEntries(app.graph._nodes.map(n => [n.id, [...n.pos]]))")
    moved = {k: (loaded[k], v) for k, v in back.items() if max(abs(a - b) for a, b in zip(loaded[k], v)) > 1}
    assert not moved, moved


def test_early_probe_shows_no_blank_band(page: Any, ui: str) -> None:
    """The Early Probe's prompt comes from the Prompt node (a link): on the canvas it keeps one row for its socket,
    no text box and no blank band between or below the rows; in Vue nodes no row of the probe is taller than a row."""
    open_workflow(page, "embedded")
    fit_whole_graph(page)
    probe = page.evaluate("() => String(app.graph._nodes.find(n => n.type === 'CarnatorEarlyProbe').id)")
    if ui.endswith("-vue"):
        rows = page.evaluate("""(id) => {
            const e = document.querySelector(`[data-node-id="${id}"]`), s = app.canvas.ds.scale;
            return [...e.querySelectorAll('[data-testid="node-widget"]')].map(r => [r.dataset.widgetName,
                r.getBoundingClientRect().height / s]);
        }""", probe)
        assert rows and all(h <= 48 for _, h in rows), rows
        return
    layout = page.evaluate("""(id) => {
        const n = app.graph.getNodeById(id);
        app.canvas.draw(true, true);
        const rows = (n.widgets || []).filter(w => (w.computedHeight ?? 0) > 0 && !(w.advanced && !n.showAdvanced))
            .map(w => ({name: w.name, y: w.y ?? w.last_y, h: w.computedHeight,
                        box: w.element ? getComputedStyle(w.element).opacity !== '0' && w.element.offsetHeight : 0}));
        return {height: n.size[1], rows: rows.sort((a, b) => a.y - b.y)};
    }""", probe)
    rows = layout["rows"]
    prompt = next(r for r in rows if r["name"] == "prompt")
    assert prompt["h"] <= 24 and not prompt["box"], prompt  # a socket's row, no text box shown
    gaps = [b["y"] - (a["y"] + a["h"]) for a, b in zip(rows, rows[1:])]
    below = layout["height"] - (rows[-1]["y"] + rows[-1]["h"])
    assert max(gaps) <= 6 and below <= 16, (gaps, below, layout)
    page.screenshot(path=str(ARTIFACTS / ui / "early_probe.png"))


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
    assert badge_rows(page, sampler_ids(page)[0]) == ["EXACT", "0.12 s", "rule: none connected"]
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
