// Carnator frontend extension (ComfyUI frontend 1.32.x as bundled with ComfyUI 0.3.75, and the current frontend
// from `comfyui-frontend-package` 1.58.x in both its classic canvas and its DOM "Vue nodes" mode; served from the
// extension's WEB_DIRECTORY at /extensions/carnator/carnator.js and loaded as an ES module).
//
// 1. Reuse badge: after a Carnator Joint Reuse Sampler runs, the server sends
//    ui = {carnator_report: [report]} (nodes/sampler.py). The badge in the node shows the decision
//    (HIT / MISS -> dense / DENSE), the candidate entry, each risk axis' discrepancy against its threshold,
//    the active fraction and the estimated saving. It is a DOM widget (`addDOMWidget`), not canvas drawing: the
//    canvas' onDrawForeground never runs for nodes the Vue-nodes mode renders as HTML, a DOM widget shows in both.
//    The report arrives through the node's onExecuted and, independently, the API's "executed" event (either
//    alone is enough; the same report object is shown once). The last report stays on the node as
//    `node.carnatorReport` (tests and other extensions read it there) and every report of the session in
//    `window.carnator.reports`.
// 2. Cache panel: a "Carnator" sidebar tab with the cache's entries, bytes, hits and hit rate, and a purge
//    button, backed by GET /carnator/cache/stats and POST /carnator/cache/purge (nodes/routes.py).
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const SAMPLER = "CarnatorJointReuseSampler";
const CACHE_LOADER = "CarnatorCacheLoader";
const DEFAULT_DIRECTORY = "carnator_cache";
const BADGE_WIDGET = "carnator_badge";
const LINE_HEIGHT = 15; // px, badge text lines
const BADGE_PAD = 6; // px, inside the badge's border

// What a decision looks like. A new decision in the report is one entry here (unknown ones show their own name in
// the neutral colours).
// An exact repeat is answered from the cache before the probe (mode "exact"), or by ComfyUI's own node cache when
// an identical graph is requeued (mode "node_cache", reported by the Cache Writer): the stored result, no model call.
const isExact = (r) => r?.decision === "hit" && (r.mode === "exact" || r.mode === "node_cache");

const KINDS = {
  hit: {
    headline: (r) => (isExact(r) ? "HIT · exact repeat (no model call)" : `HIT · ${r.mode || "joint"} reuse`),
    colors: { bg: "#1f4d2b", fg: "#c8f7d2", pill: "#2e9e4f" },
  },
  miss: {
    headline: () => "MISS → dense resume",
    colors: { bg: "#4d3a1f", fg: "#ffe2b3", pill: "#c77d1a" },
  },
  dense: {
    headline: () => "DENSE (no reuse requested)",
    colors: { bg: "#2f3340", fg: "#d8dce6", pill: "#5b6478" },
  },
};
const PASS_COLOR = "#8fe3a3";
const FAIL_COLOR = "#ff9a8a";
const NOTE_COLOR = "#ffcf99";

const state = (window.carnator = window.carnator || { reports: [], last: null });

// ---------------------------------------------------------------------------------------------------------
// formatting

function pct(x, digits = 0) {
  return typeof x === "number" && isFinite(x) ? `${(x * 100).toFixed(digits)}%` : "–";
}

function num(x) {
  if (typeof x !== "number" || !isFinite(x)) return "–";
  const a = Math.abs(x);
  return a >= 100 ? x.toFixed(0) : a >= 10 ? x.toFixed(1) : a >= 0.01 || a === 0 ? x.toFixed(2) : x.toExponential(1);
}

function bytes(n) {
  if (typeof n !== "number" || !isFinite(n)) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i++;
  }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function shortId(id) {
  return id ? String(id).slice(0, 10) : "–";
}

function seconds(ms) {
  return typeof ms === "number" && isFinite(ms) ? `${(ms / 1000).toFixed(ms < 10000 ? 2 : 1)} s` : "–";
}

function note(text) {
  return { text: String(text).slice(0, 60), color: NOTE_COLOR };
}

/** The verdict to show: the accepted entry's, else the most similar candidate's (the one that came closest). */
export function chosenVerdict(report) {
  const verdicts = Array.isArray(report?.verdicts) ? report.verdicts : [];
  if (!verdicts.length) return null;
  const accepted = verdicts.find((v) => v.accepted && (!report.entry_id || v.entry_id === report.entry_id));
  if (accepted) return accepted;
  return [...verdicts].sort((a, b) => (b.similarity ?? -Infinity) - (a.similarity ?? -Infinity))[0];
}

/** The decision's key in KINDS and its look: a missing decision is "dense"; an unknown one keeps its own name. */
export function kindOf(report) {
  const key = report?.decision ? String(report.decision) : "dense";
  if (KINDS[key]) return { key, ...KINDS[key] };
  return { key, headline: () => key.toUpperCase(), colors: KINDS.dense.colors };
}

// The badge's body, in order: each entry maps (report, {kind, verdict}) to a line, a list of lines or nothing.
// A line is {text, color?}. To show a new report field, add an entry.
const BODY = [
  (r, { kind, verdict }) => {
    if (r.mode === "node_cache") return { text: "ComfyUI node cache · stored result" };
    if (!verdict) return kind === "dense" ? null : { text: "no cached candidate" };
    const sim = typeof verdict.similarity === "number" ? ` · sim ${num(verdict.similarity)}` : "";
    return { text: `${kind === "hit" ? "entry" : "closest"} ${shortId(verdict.entry_id)}${sim}` };
  },
  (r, { verdict }) =>
    (verdict?.checks || []).map((c) => ({
      text: `${c.passed ? "✓" : "✗"} ${c.axis} ${num(c.value)} ${c.passed ? "≤" : ">"} ${num(c.threshold)}`,
      color: c.passed ? PASS_COLOR : FAIL_COLOR,
    })),
  (r, { verdict }) =>
    verdict && !verdict.accepted && verdict.reason && !(verdict.checks || []).length ? note(verdict.reason) : null,
  (r, { kind }) =>
    kind === "hit" && !isExact(r)
      ? { text: `active ${pct(r.active_fraction)} · blocks ${pct(r.block_density)}` }
      : null,
  (r) => ({ text: `saved ${pct(r.saving)} of dense compute · ${seconds((r.timings_ms || {}).total)}` }),
  (r, { kind }) => (kind === "miss" && r.reason ? note(r.reason) : null),
  (r) => (r.not_cached ? note(`not cached: ${r.not_cached}`) : null), // Cache Writer: the clip is fine
];

/** Badge text for a report: {kind, colors, lines: [{text, bold?, color?}]}; lines[0] is the headline.
 *  Pure; the DOM badge shows exactly these lines (tests compare them). */
export function badgeLines(report) {
  const k = kindOf(report);
  const ctx = { kind: k.key, verdict: chosenVerdict(report) };
  const lines = [{ text: k.headline(report), bold: true }];
  for (const build of BODY) {
    const out = build(report, ctx);
    if (out) lines.push(...(Array.isArray(out) ? out : [out]));
  }
  return { kind: k.key, colors: k.colors, lines };
}

// ---------------------------------------------------------------------------------------------------------
// the badge: a DOM widget, so that it shows in the canvas and in the Vue-nodes mode alike

function badgeHeight(lineCount) {
  return lineCount ? BADGE_PAD * 2 + 3 + LINE_HEIGHT * lineCount : 0; // + borders, the bar's margin
}

/** Fill the badge element with a report's lines (text only: nothing from the report is parsed as HTML). The
 *  headline sits on a bar in the decision's colour, so the decision reads at a glance and when zoomed out. */
export function renderBadge(element, report) {
  const { kind, colors, lines } = badgeLines(report);
  element.dataset.decision = kind;
  element.dataset.lines = String(lines.length);
  Object.assign(element.style, {
    display: "block", boxSizing: "border-box", width: "100%", height: `${badgeHeight(lines.length)}px`,
    // The Vue-nodes layout stretches widget elements to fill the node (flex-1): keep the badge its own height.
    flex: "0 0 auto", padding: `${BADGE_PAD}px 8px`, background: colors.bg, color: colors.fg,
    border: `1px solid ${colors.pill}`, borderRadius: "6px", font: `12px/${LINE_HEIGHT}px Arial, Helvetica, sans-serif`,
    overflow: "hidden", pointerEvents: "none",
  });
  const rows = lines.map((line, i) => {
    const row = document.createElement("div");
    row.className = i ? "carnator-badge-line" : "carnator-badge-head";
    Object.assign(row.style, { whiteSpace: "nowrap", overflow: "hidden", textOverflow: "ellipsis",
      height: `${LINE_HEIGHT}px` });
    if (line.color) row.style.color = line.color;
    if (line.bold) row.style.fontWeight = "bold";
    if (i === 0) {
      Object.assign(row.style, { background: colors.pill, color: "#fff", margin: `0 -4px 1px`, padding: "0 4px",
        borderRadius: "4px" });
    }
    row.textContent = line.text;
    row.title = line.text;
    return row;
  });
  element.replaceChildren(...rows);
  return lines.length;
}

function badgeWidget(node) {
  const existing = (node.widgets || []).find((w) => w.name === BADGE_WIDGET);
  if (existing) return existing;
  const element = document.createElement("div");
  element.className = "carnator-badge";
  const widget = node.addDOMWidget(BADGE_WIDGET, "carnator_badge", element, {
    serialize: false, // not a value: never in the workflow's widgets_values nor in the API prompt
    hideOnZoom: false, // the decision stays readable when zoomed out
    getValue: () => undefined,
    setValue: () => {},
    getMinHeight: () => badgeHeight(Number(element.dataset.lines || 0)),
    getMaxHeight: () => badgeHeight(Number(element.dataset.lines || 0)),
    // The current frontend's visibility per surface (older frontends ignore it): the node on the canvas and as
    // a Vue node, not the properties panel.
    surfaces: { canvas: "shown", vueNode: "shown", panel: "never" },
  });
  widget.serialize = false;
  widget.element = widget.element || element;
  return widget;
}

/** Show a report on a sampler node (idempotent for the same report object: both delivery paths may call it). */
function showReport(node, report) {
  if (!node || !report || node.carnatorReport === report) return;
  node.carnatorReport = report;
  state.last = report;
  state.reports.push(report);
  try {
    const widget = badgeWidget(node);
    renderBadge(widget.element, report);
    // On the canvas, grow the node to fit the badge (never shrink what the user sized). A Vue node lays out its
    // own HTML; there computeSize also counts the advanced inputs it hides, which would leave a gap.
    const min = window.LiteGraph?.vueNodesMode ? null : node.computeSize?.();
    if (min && node.size) node.setSize([Math.max(node.size[0], min[0], 240), Math.max(node.size[1], min[1])]);
  } catch (e) {
    console.error("carnator: could not show the reuse badge", e);
  }
  state.refreshPanel?.();
  node.setDirtyCanvas?.(true, true);
}

/** The sampler node an "executed" event is about, or null (also for nodes inside a subgraph that the plain id
 *  does not reach: their onExecuted hook delivers the report instead). */
function executedNode(detail) {
  const id = detail?.display_node ?? detail?.node;
  if (id == null) return null;
  const graph = app.rootGraph || app.graph;
  const node = graph?.getNodeById?.(id) ?? graph?.getNodeById?.(Number(id));
  return node && (node.comfyClass === SAMPLER || node.type === SAMPLER) ? node : null;
}

// ---------------------------------------------------------------------------------------------------------
// cache panel

async function fetchJson(path, init) {
  const res = await api.fetchApi(path, init);
  let body = null;
  try {
    body = await res.json();
  } catch {
    body = { error: `HTTP ${res.status}` };
  }
  if (!res.ok) throw new Error(body?.error || `HTTP ${res.status}`);
  return body;
}

function graphCacheDirectories() {
  const dirs = [];
  for (const node of app.graph?._nodes || []) {
    if (node.comfyClass !== CACHE_LOADER && node.type !== CACHE_LOADER) continue;
    const w = (node.widgets || []).find((x) => x.name === "directory");
    if (w && typeof w.value === "string" && w.value.trim() && !dirs.includes(w.value)) dirs.push(w.value);
  }
  return dirs;
}

function el(tag, props = {}, children = []) {
  const e = document.createElement(tag);
  Object.assign(e, props);
  if (props.style && typeof props.style === "object") Object.assign(e.style, props.style);
  for (const c of children) e.append(c);
  return e;
}

function renderPanel(root) {
  root.innerHTML = "";
  root.classList.add("carnator-panel");
  Object.assign(root.style, { padding: "12px", fontSize: "13px", color: "var(--fg-color, #ddd)" });
  const dirInput = el("input", {
    type: "text",
    value: graphCacheDirectories()[0] || DEFAULT_DIRECTORY,
    title: "Cache directory, as in the Carnator Cache node (relative to ComfyUI's output folder)",
    className: "carnator-dir",
    style: { width: "100%", boxSizing: "border-box", marginBottom: "8px", padding: "4px",
      background: "var(--comfy-input-bg, #222)", color: "inherit", border: "1px solid var(--border-color, #444)" },
  });
  const table = el("table", { className: "carnator-stats", style: { width: "100%", borderCollapse: "collapse" } });
  const message = el("div", { className: "carnator-message", style: { margin: "8px 0", minHeight: "1.2em" } });
  const button = (text, cls, onclick) =>
    el("button", {
      textContent: text, className: cls, onclick,
      style: { marginRight: "6px", padding: "4px 10px", cursor: "pointer", background: "var(--comfy-input-bg, #333)",
        color: "inherit", border: "1px solid var(--border-color, #555)", borderRadius: "4px" },
    });

  const row = (k, v) => el("tr", {}, [
    el("td", { textContent: k, style: { padding: "2px 8px 2px 0", opacity: "0.75" } }),
    el("td", { textContent: v, style: { padding: "2px 0", textAlign: "right", fontVariantNumeric: "tabular-nums" } }),
  ]);

  dirInput.addEventListener("input", () => (dirInput.dataset.edited = "1"));

  async function refresh() {
    // Follow the Cache node of the open workflow unless the user typed a directory.
    const fromGraph = graphCacheDirectories()[0];
    if (fromGraph && !dirInput.dataset.edited) dirInput.value = fromGraph;
    message.textContent = "…";
    try {
      const s = await fetchJson(`/carnator/cache/stats?directory=${encodeURIComponent(dirInput.value)}`);
      state.lastStats = s;
      table.replaceChildren(
        // Answer-only entries hold a hit's result for exact repeats; they are never recalled or reused.
        row("entries", String(s.entries ?? 0) + (s.answers ? ` (${s.answers} answers of hits)` : "")),
        row("bytes", bytes(s.bytes ?? 0)),
        row("hits", String(s.hits ?? 0)),
        row("hit rate", s.hit_rate == null ? "–" : pct(s.hit_rate, 1)),
        ...(s.namespaces != null
          ? [row("namespaces", String(Array.isArray(s.namespaces) ? s.namespaces.length : s.namespaces))]
          : []),
        row("this session", sessionLine()),
      );
      message.textContent = s.exists ? "" : "empty: no cache has been written to this directory yet";
      root.dataset.entries = String(s.entries ?? 0);
    } catch (e) {
      message.textContent = `⚠ ${e.message}`;
    }
  }

  async function purge() {
    if (!window.confirm(`Delete every entry of the Carnator cache in "${dirInput.value}"?`)) return;
    try {
      const r = await fetchJson("/carnator/cache/purge", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ directory: dirInput.value }),
      });
      await refresh();
      message.textContent = `purged: ${typeof r.purged === "object" ? JSON.stringify(r.purged) : r.purged}`;
    } catch (e) {
      message.textContent = `⚠ ${e.message}`;
    }
  }

  root.append(
    el("h3", { textContent: "Carnator cache", style: { margin: "0 0 8px 0", fontSize: "15px" } }),
    dirInput,
    el("div", {}, [button("Refresh", "carnator-refresh", refresh), button("Purge…", "carnator-purge", purge)]),
    message,
    table,
  );
  state.refreshPanel = refresh;
  refresh();
}

function sessionLine() {
  const n = state.reports.length;
  const hits = state.reports.filter((r) => r.decision === "hit").length;
  return n ? `${hits}/${n} hits (${pct(hits / n)})` : "no runs yet";
}

// ---------------------------------------------------------------------------------------------------------

state.badgeLines = badgeLines; // for tests and other extensions: the text the badge shows for a report

app.registerExtension({
  name: "carnator.ReuseBadge",

  async setup() {
    const tab = {
      id: "carnator-cache",
      icon: "pi pi-database",
      title: "Carnator",
      tooltip: "Carnator cache: entries, bytes, hit rate, purge",
      label: "Carnator",
      type: "custom",
      render: (root) => renderPanel(root),
    };
    if (app.extensionManager?.registerSidebarTab) {
      app.extensionManager.registerSidebarTab(tab);
    } else {
      console.warn("carnator: this ComfyUI frontend has no sidebar tabs; the cache panel is unavailable");
    }
    api.addEventListener("executed", ({ detail }) => {
      const report = detail?.output?.carnator_report?.[0];
      if (report) showReport(executedNode(detail), report);
    });
  },

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData?.name !== SAMPLER) return;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (output) {
      const r = onExecuted?.apply(this, arguments);
      showReport(this, output?.carnator_report?.[0]);
      return r;
    };
  },
});
