// Carnator frontend extension (ComfyUI frontend 1.32.x; served from the extension's WEB_DIRECTORY at
// /extensions/carnator/carnator.js and loaded as an ES module).
//
// 1. Reuse badge: after a Carnator Joint Reuse Sampler runs, the server sends
//    ui = {carnator_report: [report]} (nodes/sampler.py); on a requeued graph that ComfyUI's node cache answered,
//    the Cache Writer sends it (mode "node_cache"). The badge under the node shows the decision
//    (HIT / MISS -> dense / DENSE), the candidate entry, each risk axis' discrepancy against its threshold,
//    the active fraction and the estimated saving. The last report stays on the node as `node.carnatorReport`
//    (tests and other extensions read it there) and every report of the session in `window.carnator.reports`.
// 2. Cache panel: a "Carnator" sidebar tab with the cache's entries, bytes, hits and hit rate, and a purge
//    button, backed by GET /carnator/cache/stats and POST /carnator/cache/purge (nodes/routes.py).
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const SAMPLER = "CarnatorJointReuseSampler";
const WRITER = "CarnatorCacheWriter";
const CACHE_LOADER = "CarnatorCacheLoader";
const DEFAULT_DIRECTORY = "carnator_cache";

const COLORS = {
  hit: { bg: "#1f4d2b", fg: "#c8f7d2", pill: "#2e9e4f" },
  miss: { bg: "#4d3a1f", fg: "#ffe2b3", pill: "#c77d1a" },
  dense: { bg: "#2f3340", fg: "#d8dce6", pill: "#5b6478" },
};

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

/** The verdict to show: the accepted entry's, else the most similar candidate's (the one that came closest). */
export function chosenVerdict(report) {
  const verdicts = Array.isArray(report?.verdicts) ? report.verdicts : [];
  if (!verdicts.length) return null;
  const accepted = verdicts.find((v) => v.accepted && (!report.entry_id || v.entry_id === report.entry_id));
  if (accepted) return accepted;
  return [...verdicts].sort((a, b) => (b.similarity ?? -Infinity) - (a.similarity ?? -Infinity))[0];
}

/** Badge text lines for a report: [{text, color?}], first line is the headline. Pure: tested through the UI. */
export function badgeLines(report) {
  const kind = report.decision === "hit" ? "hit" : report.decision === "miss" ? "miss" : "dense";
  // An exact repeat is answered from the cache before the probe ("exact"), or by ComfyUI's own node cache when
  // an identical graph is requeued ("node_cache"): the stored result, no model call.
  const exact = kind === "hit" && (report.mode === "exact" || report.mode === "node_cache");
  if (exact) {
    const t = report.timings_ms || {};
    const source = report.mode === "node_cache" ? "ComfyUI node cache" : `entry ${shortId(report.entry_id)}`;
    return {
      kind,
      lines: [
        { text: "HIT · exact repeat (no model call)", bold: true },
        { text: `${source} · stored result` },
        { text: `saved ${pct(report.saving)} of dense compute · ${seconds(t.total)}` },
      ],
    };
  }
  const head =
    kind === "hit"
      ? `HIT · ${report.mode || "joint"} reuse`
      : kind === "miss"
        ? "MISS → dense resume"
        : "DENSE (no reuse requested)";
  const lines = [{ text: head, bold: true }];
  const verdict = chosenVerdict(report);
  if (verdict) {
    const sim = typeof verdict.similarity === "number" ? ` · sim ${num(verdict.similarity)}` : "";
    lines.push({ text: `${kind === "hit" ? "entry" : "closest"} ${shortId(verdict.entry_id)}${sim}` });
    for (const c of verdict.checks || []) {
      const op = c.passed ? "≤" : ">";
      lines.push({
        text: `${c.passed ? "✓" : "✗"} ${c.axis} ${num(c.value)} ${op} ${num(c.threshold)}`,
        color: c.passed ? "#8fe3a3" : "#ff9a8a",
      });
    }
    if (!verdict.accepted && verdict.reason && !(verdict.checks || []).length) {
      lines.push({ text: String(verdict.reason).slice(0, 60), color: "#ffcf99" });
    }
  } else if (kind !== "dense") {
    lines.push({ text: "no cached candidate" });
  }
  if (kind === "hit") {
    lines.push({ text: `active ${pct(report.active_fraction)} · blocks ${pct(report.block_density)}` });
  }
  const t = report.timings_ms || {};
  lines.push({ text: `saved ${pct(report.saving)} of dense compute · ${seconds(t.total)}` });
  if (kind === "miss" && report.reason) lines.push({ text: String(report.reason).slice(0, 60), color: "#ffcf99" });
  return { kind, lines };
}

// ---------------------------------------------------------------------------------------------------------
// badge drawing (canvas, node-local coordinates: (0, 0) is the top-left of the node body, below the title)

function roundRect(ctx, x, y, w, h, r) {
  ctx.beginPath();
  if (ctx.roundRect) ctx.roundRect(x, y, w, h, r);
  else ctx.rect(x, y, w, h);
}

function drawBadge(node, ctx) {
  const report = node.carnatorReport;
  if (!report || node.flags?.collapsed) return;
  const { kind, lines } = badgeLines(report);
  const colors = COLORS[kind];
  const lineH = 15;
  const pad = 6;
  const w = Math.max(node.size[0], 220);
  const h = pad * 2 + lineH * lines.length;
  const y0 = node.size[1] + 8;
  ctx.save();
  roundRect(ctx, 0, y0, w, h, 6);
  ctx.fillStyle = colors.bg;
  ctx.globalAlpha = 0.95;
  ctx.fill();
  ctx.globalAlpha = 1;
  ctx.strokeStyle = colors.pill;
  ctx.lineWidth = 1.5;
  ctx.stroke();
  ctx.textAlign = "left";
  ctx.textBaseline = "top";
  lines.forEach((line, i) => {
    ctx.font = `${line.bold ? "bold " : ""}12px Arial, sans-serif`;
    ctx.fillStyle = line.color || colors.fg;
    ctx.fillText(line.text, pad + 2, y0 + pad + i * lineH, w - 2 * pad);
  });
  // A pill in the title bar, visible when zoomed out.
  const titleH = window.LiteGraph?.NODE_TITLE_HEIGHT ?? 30;
  const label = kind.toUpperCase();
  ctx.font = "bold 11px Arial, sans-serif";
  const pw = ctx.measureText(label).width + 12;
  roundRect(ctx, node.size[0] - pw - 6, -titleH + 7, pw, titleH - 14, 7);
  ctx.fillStyle = colors.pill;
  ctx.fill();
  ctx.fillStyle = "#fff";
  ctx.textBaseline = "middle";
  ctx.fillText(label, node.size[0] - pw, -titleH / 2);
  ctx.restore();
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
        row("entries", String(s.entries ?? 0)),
        row("bytes", bytes(s.bytes ?? 0)),
        row("hits", String(s.hits ?? 0)),
        row("hit rate", s.hit_rate == null ? "–" : pct(s.hit_rate, 1)),
        ...(s.namespaces != null ? [row("namespaces", String(Array.isArray(s.namespaces) ? s.namespaces.length : s.namespaces))] : []),
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
  },

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData?.name !== SAMPLER && nodeData?.name !== WRITER) return;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (output) {
      const r = onExecuted?.apply(this, arguments);
      const report = output?.carnator_report?.[0];
      if (report) {
        this.carnatorReport = report;
        state.last = report;
        state.reports.push(report);
        state.refreshPanel?.();
        this.setDirtyCanvas?.(true, true);
      }
      return r;
    };
    const onDrawForeground = nodeType.prototype.onDrawForeground;
    nodeType.prototype.onDrawForeground = function (ctx) {
      const r = onDrawForeground?.apply(this, arguments);
      try {
        drawBadge(this, ctx);
      } catch (e) {
        console.error("carnator: badge drawing failed", e);
      }
      return r;
    };
  },
});
