// Carnator frontend extension (ComfyUI frontend 1.32.x as bundled with ComfyUI 0.3.75, and the current frontend
// from `comfyui-frontend-package` 1.58.x in both its classic canvas and its DOM "Vue nodes" mode; served from the
// extension's WEB_DIRECTORY at /extensions/carnator/carnator.js and loaded as an ES module).
//
// 1. Compact nodes: the nodes' tuning knobs are V3 inputs marked advanced (nodes/_common.py). The Vue-nodes mode
//    folds such widgets away by itself; on the classic canvas (both frontends) this extension marks the widgets
//    `advanced`, which LiteGraph hides until the node's `showAdvanced` is on, and adds one summary button per node
//    ("certified settings · ▸ 16 tuning inputs") that toggles them. Values are untouched: hidden widgets still
//    serialise into the workflow and the API prompt. A node that opens its inputs (this button, or the Vue nodes'
//    own "Show advanced inputs") moves what is below it down, and back when it folds: nothing is covered. A text
//    box fed by a link (the Early Probe's prompt) keeps one row for its socket, no blank band.
// 2. Reuse badge: after a Carnator Joint Reuse Sampler runs, the server sends ui = {carnator_report: [report]}
//    (nodes/sampler.py). The badge is a DOM widget of a FIXED height (three rows: the decision, a one-line summary,
//    the rule's state), reserved when the node is created, so a report never makes the node grow onto the node
//    below. Each row shows the longest of its forms that fits (never cut; the whole row is its tooltip), and the
//    sampler is never narrower than its shortest forms need. ComfyUI's own node cache answering an unchanged graph
//    reads NOT RUN, never a hit (the one definition of a hit and a lookup: isHit / isLookup, nodes/_history.py).
//    A click opens the full details (every axis with its unit, the whole reason, timings) in a popover that
//    floats above the canvas and closes on the next click or Escape. The report arrives through the node's
//    onExecuted and, independently, the API's "executed" event (either alone is enough; the same report object is
//    shown once). The last report stays on the node as `node.carnatorReport` and every report of the session in
//    `window.carnator.reports`.
// 3. Panel: a "Carnator" sidebar tab: the cache's totals (since purge) and a help that says what counts as a hit and
//    a lookup, then per namespace (named in words: the MODEL's loader and patches, the probe's schedule) the rule's
//    state and learning's progress, hits of lookups since purge and since the server started, the compute they
//    saved (a small plot), and the last requests with their decision and a thumbnail; Purge empties the cache, and
//    ComfyUI then runs the same graph again (the Cache node's change fingerprint follows the cache's purge count).
//    Backed by GET /carnator/cache/stats, GET /carnator/requests, GET /carnator/rules and POST /carnator/cache/purge
//    (nodes/routes.py).
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const SAMPLER = "CarnatorJointReuseSampler";
const CACHE_LOADER = "CarnatorCacheLoader";
const WRITER = "CarnatorCacheWriter";
const DEFAULT_DIRECTORY = "carnator_cache";
const BADGE_WIDGET = "carnator_badge";
const TOGGLE_WIDGET = "carnator_advanced";
const FONT_PX = 13; // badge text; 9.75 px on screen at 75 % zoom
const LINE_HEIGHT = 17; // px per badge row
const BADGE_PAD = 5; // px, inside the badge's border
const BADGE_ROWS = 3; // decision, summary, rule: always three, so the node never changes height for a report
const BADGE_HEIGHT = BADGE_PAD * 2 + 2 + LINE_HEIGHT * BADGE_ROWS;
// The sampler's minimum width: the badge's text then has about 250 px, which every row's shortest form fits.
const MIN_NODE_WIDTH = 300;

const PASS_COLOR = "#8fe3a3";
const FAIL_COLOR = "#ff9a8a";
const NOTE_COLOR = "#ffcf99";
const MUTED_COLOR = "#b9bfcc";

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

function plural(n, word, many = `${word}s`) {
  return `${n} ${n === 1 ? word : many}`;
}

function shortId(id) {
  return id ? String(id).slice(0, 10) : "–";
}

function seconds(ms) {
  return typeof ms === "number" && isFinite(ms) ? `${(ms / 1000).toFixed(ms < 10000 ? 2 : 1)} s` : "–";
}

// ---------------------------------------------------------------------------------------------------------
// what a report says, in words (pure: tests call these through window.carnator)

/** The risk axes as a user reads them: what is compared, and in which unit. */
const AXES = {
  context: { label: "background colour", unit: "ΔE" },
  size: { label: "object size", unit: "|log ratio|" },
  shape: { label: "object shape", unit: "1 − overlap" },
  appearance: { label: "object colour", unit: "ΔE" },
  prompt_distance: { label: "prompt", unit: "1 − similarity" },
};
const OBJECT_AXES = ["size", "shape", "appearance"];

/** The verdict to show: the accepted entry's, else the most similar candidate's (the one that came closest). */
export function chosenVerdict(report) {
  const verdicts = Array.isArray(report?.verdicts) ? report.verdicts : [];
  if (!verdicts.length) return null;
  const accepted = verdicts.find((v) => v.accepted && (!report.entry_id || v.entry_id === report.entry_id));
  if (accepted) return accepted;
  return [...verdicts].sort((a, b) => (b.similarity ?? -Infinity) - (a.similarity ?? -Infinity))[0];
}

/** Object axes that were not compared: no object is named on both sides, so the core reports them as 0 (all three
 *  exactly 0 — matched objects never give that: the masks of two different requests differ). A check may also say
 *  so itself (`compared: false`). */
function notCompared(verdict) {
  const checks = verdict?.checks || [];
  const obj = checks.filter((c) => OBJECT_AXES.includes(c.axis));
  const allZero = obj.length === OBJECT_AXES.length && obj.every((c) => c.value === 0);
  return new Set(checks.filter((c) => c.compared === false || (allZero && OBJECT_AXES.includes(c.axis)))
    .map((c) => c.axis));
}

/** The kinds of change (strata: what differs between the request and the cached clip), as a person names them. */
const KIND_WORDS = {
  reseed: "re-rolls (a new seed)", rewording: "rewordings", colour: "colour edits", size: "size edits",
  position: "position edits", motion: "motion edits", background: "background edits", object: "object swaps",
  count: "changes in the number of objects", mixed: "edits of several kinds at once", exact: "exact repeats",
};

export function kindWords(stratum) {
  return KIND_WORDS[stratum] || `'${stratum}' changes`;
}

/** A verdict the rule refused for its kind of change alone (it passed the thresholds): {stratum, why}, where why
 *  is the certificate's figure ("(b − c)/n = (3 − 1)/40, U = 0.1200 > α = 0.05", or "was never certified …"). */
function refusedKind(verdict) {
  const m = /passes the rule, but stratum '([^']+)'(.*?)\s*— refused/.exec(verdict?.reason || "");
  return m ? { stratum: m[1], why: m[2].replace(/^:\s*/, "").trim() } : null;
}

/** One axis check as a line: "✓ object colour ΔE 3.20 ≤ 6.00", or "· object shape: not compared (…)". */
export function checkLine(c, skipped) {
  const a = AXES[c.axis] || { label: c.axis, unit: "" };
  if (skipped) return { text: `· ${a.label}: not compared (no object named on both sides)`, color: MUTED_COLOR };
  const unit = a.unit ? ` ${a.unit}` : "";
  return {
    text: `${c.passed ? "✓" : "✗"} ${a.label}${unit} ${num(c.value)} ${c.passed ? "≤" : ">"} ${num(c.threshold)}`,
    color: c.passed ? PASS_COLOR : FAIL_COLOR,
  };
}

/** How the request ran: hit (exact / reuse), miss, dense — dense because it was asked to (the sampler's mode = dense,
 *  the filter's mode = never) or because nothing was connected to decide — or not run: ComfyUI's own node cache
 *  handed back the output of an unchanged graph, and no Carnator stage ran (neither a hit nor a lookup). */
export function kindOf(report) {
  const d = report?.decision ? String(report.decision) : "dense";
  if (report?.outcome === "not_run" || report?.mode === "node_cache") return { key: "not_run", sub: "node_cache" };
  if (d === "hit") {
    if (report.mode === "exact") return { key: "hit", sub: "exact" };
    return { key: "hit", sub: "reuse" };
  }
  if (report?.requested_mode === "dense") return { key: "dense", sub: "forced" };
  if (report?.filter_mode === "never") return { key: "dense", sub: "never" };
  if (d === "miss") return { key: "miss", sub: "" };
  if (d === "dense") return { key: "dense", sub: "unfiltered" };
  return { key: d, sub: "" }; // a decision this version does not know: shown under its own name
}

/** The one definition of a hit and of a lookup (the panel's help says it in words, from the server's
 *  /carnator/cache/stats `definitions`; the cache's own counters count the same way): a lookup is a request
 *  Carnator served that searched its cache (the Risk Filter ran, or an exact repeat was found); a hit is a lookup
 *  answered from the cache (an exact repeat, or a reuse of a cached clip). A panel event carries the server's
 *  reading of both (nodes/_history.py); a report is read here the same way. */
export function isHit(r) {
  return kindOf(r).key === "hit";
}

export function isLookup(r) {
  if (typeof r?.lookup === "boolean") return r.lookup;
  const k = kindOf(r).key;
  return k === "hit" || (k !== "not_run" && r?.filter_mode != null);
}

const COLORS = {
  hit: { bg: "#1f4d2b", fg: "#c8f7d2", pill: "#2e9e4f" },
  miss: { bg: "#4d3a1f", fg: "#ffe2b3", pill: "#c77d1a" },
  dense: { bg: "#2f3340", fg: "#d8dce6", pill: "#5b6478" },
  not_run: { bg: "#262a33", fg: "#c3c9d6", pill: "#4a5366" },
  idle: { bg: "#2a2d35", fg: "#aab0bd", pill: "#444a57" },
};

/** A badge row: its text and shorter forms, tried in turn where the row is too narrow for it (the whole text is
 *  the row's tooltip and in the details). */
function row(text, ...short) {
  return { text, short: short.filter((x) => x && x !== text) };
}

function headline(report, k) {
  const saved = `saved ${pct(report.saving)}`;
  if (k.key === "hit") {
    if (k.sub === "exact") return row("HIT · exact repeat · no model call", "HIT · exact repeat");
    return row(`HIT · ${report.mode || "joint"} reuse · ${saved}`, `HIT · ${saved}`);
  }
  if (k.key === "not_run") return row("NOT RUN · ComfyUI reused its output", "NOT RUN · ComfyUI's output");
  if (k.key === "miss") return row("MISS · ran dense");
  if (k.sub === "forced") return row("DENSE · reuse off (mode = dense)", "DENSE · mode = dense");
  if (k.sub === "never") return row("DENSE · Risk Filter mode = never", "DENSE · filter: never");
  if (k.key === "dense") return row("DENSE · no Risk Filter connected", "DENSE · no Risk Filter");
  return row(String(k.key).toUpperCase());
}

/** Short names of the kinds of change, for narrow rows. */
const KIND_SHORT = { reseed: "re-rolls", count: "object counts", mixed: "mixed edits", object: "object swaps",
  background: "backgrounds" };

/** The kinds as list items ("reuse on for size, colour, rewordings"). */
const KIND_NOUN = { reseed: "re-rolls", rewording: "rewordings", object: "object swaps", count: "object counts",
  mixed: "mixed edits" };

function kindNoun(stratum) {
  return KIND_NOUN[stratum] || stratum;
}

function kindShort(stratum) {
  return KIND_SHORT[stratum] || kindWords(stratum);
}

/** Learning progress from a `rule_state`: {pilot: {requests, size} while the pilot runs, or null}, and per kind of
 *  change still learning, in the order they are certified in: {stratum, counted (labels its test counts), made
 *  (labels made of it, counted or not), needed, toGo (about how many more served requests, at the traffic mix the
 *  pilot measured; null when unknown)}. */
export function learningProgress(rs) {
  const pilot = rs?.pilot && !rs.pilot.done ? rs.pilot : null;
  const rates = rs?.requests_per_label || {};
  const on = (x) => x?.state === "certified" || x?.state === "audited";
  const kinds = Object.entries(rs?.strata || {}).filter(([, x]) => x && !on(x))
    .map(([stratum, x]) => {
      const counted = pilot ? 0 : x.sequence?.n ?? 0;
      const needed = Number.isFinite(x.needed) ? x.needed : null;
      const left = needed == null ? null : Math.max(needed - counted, 0);
      const rate = rates[stratum];
      return { stratum, counted, made: x.labels ?? 0, needed, rank: Number.isFinite(x.rank) ? x.rank : 99,
        toGo: !pilot && left != null && typeof rate === "number" && isFinite(rate) ? Math.ceil(left * rate) : null };
    })
    .sort((p, q) => (p.rank < 0 ? 99 : p.rank) - (q.rank < 0 ? 99 : q.rank) || p.stratum.localeCompare(q.stratum));
  const certified = Object.entries(rs?.strata || {}).filter(([, x]) => on(x)).map(([k]) => k);
  return { pilot, kinds, certified, counted: kinds.reduce((t, x) => t + x.counted, 0) };
}

function ruleRow(report) {
  const rs = report?.rule_state;
  if (rs && typeof rs === "object" && rs.state) {
    const s = String(rs.state);
    const prog = learningProgress(rs);
    if (s === "learning" || s === "off") {
      const what = s === "off" ? "off, relearning" : "learning";
      if (prog.pilot) {
        const { requests, size } = prog.pilot;
        return row(`rule: ${what} · pilot: ${requests} of ${size} requests with a candidate`,
          `rule: ${what} · pilot: ${requests} of ${size} requests`, `${what} · pilot ${requests}/${size}`);
      }
      const head = prog.kinds[0];
      if (head && head.needed != null) {
        return row(`rule: ${what} · ${kindWords(head.stratum)}: ${head.counted} of ${head.needed} labels`,
          `rule: ${what} · ${kindShort(head.stratum)}: ${head.counted}/${head.needed} labels`,
          `${what} · ${head.counted}/${head.needed} labels`);
      }
      if (s === "off") return row("rule: off · serving dense");
      const n = Number.isFinite(rs.labels) ? rs.labels : "?";
      const of = Number.isFinite(rs.needed) ? ` of ${rs.needed}` : "";
      return row(`rule: ${what} · ${n}${of} labels (serving dense)`, `rule: ${what} · ${n}${of} labels`);
    }
    const on = prog.certified.length ? prog.certified : null;
    if (s === "certified" || s === "audited") {
      const audited = s === "audited" ? ", audited" : "";
      return row(on ? `rule: certified${audited} · reuse on for ${on.map(kindNoun).join(", ")}`
        : `rule: certified${audited} · reuse on`, `rule: certified${audited} · reuse on`);
    }
    if (s === "provisional") {
      return row("rule: on — warm-up certified, checking on your traffic", "rule: on — warm-up certified, checking",
        "on · warm-up certified");
    }
    if (s === "shipped") return row("rule: shipped, certified · reuse on");
    return row(`rule: ${s}`);
  }
  if (report?.rule_id) {
    // A rule with per-stratum certificates serves only the strata that certified alone; its pooled certificate
    // says nothing about the others. With none certified only exact repeats (answered before the filter) reuse.
    const cs = report.certified_strata;
    if (Array.isArray(cs)) {
      return cs.length
        ? row(`rule: reuse on for ${cs.map(kindNoun).join(", ")}`, `rule: reuse on for ${plural(cs.length, "kind")} ` +
          "of change", `rule: ${cs.length} kinds certified`)
        : row("rule: no kind certified · exact repeats only", "rule: exact repeats only");
    }
    return row(`rule: ${report.rule_id} (certified)`, "rule: certified");
  }
  if (report?.filter_mode === "prompt_only") {
    return row("rule: none · prompt-only baseline, no certificate", "rule: none · prompt only");
  }
  if (report?.mode === "node_cache") return row("rule: not asked (nothing ran)");
  if (report?.mode === "exact") return row("rule: not needed (identical request)", "rule: not needed");
  return row("rule: none connected");
}

/** The rule's state as one line (the badge's third row in full; the panel's card). */
export function ruleLine(report) {
  return ruleRow(report).text;
}

/** The summary row: the one figure that matters for this kind of decision. */
function summaryLine(report, k, verdict) {
  const t = seconds((report.timings_ms || {}).total);
  // The Cache Writer could not keep the clip (full disk, read-only, unreachable): the clip itself is fine.
  if (report.not_cached) return row(`⚠ not cached: ${report.not_cached}`, "⚠ not cached (click for why)");
  if (k.key === "hit" && k.sub === "reuse") {
    return row(`${pct(report.active_fraction)} of tokens recomputed · ${t}`,
      `${pct(report.active_fraction)} recomputed · ${t}`);
  }
  if (k.key === "not_run") return row("graph unchanged: not a Carnator hit", "not a Carnator hit");
  if (k.key === "hit") return row(`entry ${shortId(report.entry_id)} · ${t}`);
  if (k.sub === "forced" || k.sub === "never") {
    const acc = verdict?.accepted ? `filter accepted ${shortId(verdict.entry_id)}, not used · ` : "";
    return row(`${acc}${t}`, verdict?.accepted ? `filter accepted one, not used · ${t}` : "",
      verdict?.accepted ? "accepted, not used" : "");
  }
  if (k.key === "miss") {
    const rs = report.rule_state;
    if (rs?.state === "learning" || rs?.state === "off") {
      const prog = learningProgress(rs);
      if (prog.pilot) return row(`learning (pilot) → ran dense · ${t}`, "learning (pilot) → ran dense");
      const head = prog.kinds[0];
      if (head?.toGo != null) {
        return row(`${kindWords(head.stratum)}: about ${head.toGo} requests to go → ran dense`,
          `${kindShort(head.stratum)}: ~${head.toGo} requests to go → dense`,
          `~${head.toGo} requests to go → dense`);
      }
      return row(`served dense: the rule is ${rs.state} · ${t}`, `the rule is ${rs.state} → dense`);
    }
    if (!verdict) return row(`no cached candidate · ${t}`, "no cached candidate");
    const refused = refusedKind(verdict);
    if (refused) {
      return row(`${kindWords(refused.stratum)} are not certified yet → ran dense`,
        `${kindShort(refused.stratum)} not certified yet → dense`, `${kindShort(refused.stratum)}: not certified`);
    }
    const skipped = notCompared(verdict);
    const failed = (verdict.checks || []).find((c) => !c.passed && !skipped.has(c.axis));
    if (/one side only/.test(verdict.reason || "")) {
      return row("objects differ from the closest entry", "objects differ");
    }
    if (failed) {
      const a = AXES[failed.axis] || { label: failed.axis, unit: "" };
      return row(`${a.label} ${a.unit} ${num(failed.value)} > ${num(failed.threshold)}`.replace(/\s+/g, " "),
        `${a.label} ${num(failed.value)} > ${num(failed.threshold)}`);
    }
    return row(`no cached clip close enough → ran dense · ${t}`, "no cached clip close enough");
  }
  return row(`${t}`);
}

/** Everything the report says, for the details popover: every line in full (wrapped, never cut). */
function detailLines(report, k, verdict) {
  const lines = [];
  if (k.key === "not_run") {
    lines.push({ text: "Nothing in the graph changed since its last run, so ComfyUI handed back the output it kept: " +
      "no Carnator stage ran and the model was not called. Carnator counts it neither as a lookup nor as a hit." });
  }
  if (verdict) {
    const sim = typeof verdict.similarity === "number" ? ` · prompt similarity ${num(verdict.similarity)}` : "";
    lines.push({ text: `${k.key === "hit" ? "entry" : "closest entry"} ${verdict.entry_id}${sim}` });
    const skipped = notCompared(verdict);
    for (const c of verdict.checks || []) lines.push(checkLine(c, skipped.has(c.axis)));
    const refused = refusedKind(verdict);
    if (refused) {
      lines.push({ text: `${kindWords(refused.stratum)} are not certified: ${refused.why || "no certificate"}` +
        (/U = /.test(refused.why) ? " (U: the bound on how much more often reuse fails than a dense run; it must " +
          "be ≤ α)" : ""), color: NOTE_COLOR });
    }
    if (verdict.reason) lines.push({ text: `filter: ${verdict.reason}`, color: NOTE_COLOR });
  } else if (k.key !== "dense") {
    lines.push({ text: "no cached candidate in this namespace" });
  }
  if (k.key === "hit" && k.sub === "reuse") {
    lines.push({ text: `share of tokens recomputed: ${pct(report.active_fraction)}` });
    if (typeof report.block_density === "number") {
      lines.push({ text: `share of attention blocks kept: ${pct(report.block_density)}` });
    }
  }
  if (k.key !== "not_run") {
    lines.push({ text: `share of compute saved: ${pct(report.saving)} · model calls ${report.model_calls ?? "–"}` +
      ` of ${report.steps_total ?? "–"} steps · ${seconds((report.timings_ms || {}).total)}` });
  }
  if (report.reason && !(verdict && report.reason === report.decision_summary)) {
    lines.push({ text: `why: ${report.reason}`, color: NOTE_COLOR });
  }
  const rs = report.rule_state;
  const learning = learningLines(rs);
  if (learning.length) for (const text of learning) lines.push({ text, color: MUTED_COLOR });
  else if (rs && rs.message) lines.push({ text: `rule: ${rs.message}`, color: MUTED_COLOR });
  if (rs && rs.namespace) lines.push({ text: `namespace ${rs.namespace}`, color: MUTED_COLOR });
  for (const f of report.fallbacks || []) lines.push({ text: `fallback: ${f}`, color: NOTE_COLOR });
  if (report.not_cached) lines.push({ text: `not cached (the clip is fine): ${report.not_cached}`, color: NOTE_COLOR });
  return lines;
}

/** Learning's progress in full, one line each (the details popover and the panel's card): the pilot, then per kind
 *  still learning its labels that its test counts, of about how many, and about how many requests to go. */
export function learningLines(rs) {
  if (!rs || !rs.strata || !["learning", "off", "certified", "audited"].includes(String(rs.state))) return [];
  const prog = learningProgress(rs);
  const out = [];
  if (prog.pilot) {
    out.push(`pilot: ${prog.pilot.requests} of ${prog.pilot.size} requests with a candidate — then the kinds of ` +
      "change are put in the order they are certified in, and labels count from there");
  }
  if (prog.certified.length) out.push(`reuse on for ${prog.certified.map(kindWords).join(", ")} (certified)`);
  if (!prog.pilot) {
    for (const x of prog.kinds.slice(0, 4)) {
      const extra = x.made > x.counted ? ` (${x.made - x.counted} more made that its test cannot count: before ` +
        "the order was fixed, or the reuse run could not run)" : "";
      out.push(`${kindWords(x.stratum)}: ${x.counted} of about ${x.needed ?? "?"} labels` +
        (x.toGo != null ? ` · about ${x.toGo} requests to go at this traffic mix` : "") + extra);
    }
    if (prog.kinds.length > 4) out.push(`${prog.kinds.length - 4} more kinds learning after these`);
  }
  return out;
}

/** The badge for a report: {kind, sub, colors, lines: [decision, summary, rule], details: [...]}. Pure; the DOM
 *  badge shows exactly `lines` (one row each, the full text in the details). */
export function badgeLines(report) {
  const k = kindOf(report);
  const verdict = chosenVerdict(report);
  const lines = [
    { ...headline(report, k), bold: true },
    summaryLine(report, k, verdict),
    { ...ruleRow(report), color: MUTED_COLOR },
  ];
  return { kind: k.key, sub: k.sub, colors: COLORS[k.key] || COLORS.dense, lines,
    details: detailLines(report, k, verdict) };
}

// ---------------------------------------------------------------------------------------------------------
// the badge: a DOM widget (shows in the canvas and in the Vue-nodes mode alike) of a fixed height

function styleRow(row, line, i, colors) {
  Object.assign(row.style, { whiteSpace: "nowrap", overflow: "hidden", textOverflow: "ellipsis",
    height: `${LINE_HEIGHT}px`, color: line.color || "" });
  if (line.bold) row.style.fontWeight = "bold";
  if (i === 0) {
    Object.assign(row.style, { background: colors.pill, color: "#fff", margin: "0 -4px 1px", padding: "0 4px",
      borderRadius: "4px" });
  }
}

/** Fill the badge element with a report's rows (text only: nothing from the report is parsed as HTML). */
export function renderBadge(element, report) {
  const view = report ? badgeLines(report) : { kind: "idle", sub: "", colors: COLORS.idle, details: [],
    lines: [{ text: "Carnator · not run yet", bold: true }, { text: "queue the graph: the decision shows here" },
      { text: "click for details after a run", color: MUTED_COLOR }] };
  const { kind, colors, lines } = view;
  element.dataset.decision = kind;
  element.dataset.sub = view.sub || "";
  element.dataset.lines = String(lines.length);
  Object.assign(element.style, {
    display: "block", boxSizing: "border-box", width: "100%", height: `${BADGE_HEIGHT}px`,
    // The Vue-nodes layout stretches widget elements to fill the node (flex-1): keep the badge its own height.
    flex: "0 0 auto", padding: `${BADGE_PAD}px 8px`, background: colors.bg, color: colors.fg,
    border: `1px solid ${colors.pill}`, borderRadius: "6px",
    font: `${FONT_PX}px/${LINE_HEIGHT}px Arial, Helvetica, sans-serif`, overflow: "hidden",
    cursor: report ? "pointer" : "default", pointerEvents: "auto",
  });
  element.title = report ? "Click for the full decision" : "";
  element.replaceChildren(...lines.map((line, i) => {
    const div = document.createElement("div");
    div.className = i ? "carnator-badge-line" : "carnator-badge-head";
    styleRow(div, line, i, colors);
    div.textContent = line.text;
    div.title = line.text; // the whole row, whichever form is shown
    div.dataset.full = line.text;
    div.carnatorForms = [line.text, ...(line.short || [])];
    return div;
  }));
  fitRows(element);
  return lines.length;
}

/** Show each row in the longest of its forms that fits the badge's width (never cut: the shortest forms fit the
 *  node's minimum width). Runs again whenever the badge is laid out anew (zoom, a resized node). */
function fitRows(element) {
  for (const div of element.children) {
    const forms = div.carnatorForms;
    if (!forms || !div.clientWidth) continue; // not laid out yet: the resize observer calls again
    for (const text of forms) {
      if (div.textContent !== text) div.textContent = text;
      if (div.scrollWidth <= div.clientWidth + 1) break;
    }
  }
}

function closeDetails() {
  document.querySelector(".carnator-details")?.remove();
}

/** The full decision of `report`, in a popover next to `anchor` (wrapped text, never cut); a second click, a click
 *  elsewhere, Escape or a canvas move closes it. It floats above the canvas and moves no node. */
function openDetails(anchor, report) {
  const open = document.querySelector(".carnator-details");
  closeDetails();
  if (!report || open?.dataset.for === String(state.reports.indexOf(report))) return;
  const view = badgeLines(report);
  const box = document.createElement("div");
  box.className = "carnator-details";
  box.dataset.for = String(state.reports.indexOf(report));
  const r = anchor.getBoundingClientRect();
  const width = Math.min(480, window.innerWidth - 16);
  Object.assign(box.style, {
    position: "fixed", zIndex: "10000", left: `${Math.max(8, Math.min(r.left, window.innerWidth - width - 8))}px`,
    top: `${Math.min(r.bottom + 4, window.innerHeight - 60)}px`, width: `${width}px`, maxHeight: "60vh",
    overflowY: "auto", boxSizing: "border-box", padding: "8px 10px", background: view.colors.bg, color: view.colors.fg,
    border: `1px solid ${view.colors.pill}`, borderRadius: "6px", boxShadow: "0 6px 24px rgba(0,0,0,.5)",
    font: "13px/18px Arial, Helvetica, sans-serif", whiteSpace: "normal", overflowWrap: "anywhere",
  });
  for (const [i, line] of [...view.lines, ...view.details].entries()) {
    const row = document.createElement("div");
    row.className = i < view.lines.length ? "carnator-details-head" : "carnator-details-line";
    row.textContent = line.text;
    if (line.color) row.style.color = line.color;
    if (line.bold) row.style.fontWeight = "bold";
    box.append(row);
  }
  document.body.append(box);
  const off = (e) => {
    if (e.type === "keydown" && e.key !== "Escape") return;
    if (e.type === "pointerdown" && (box.contains(e.target) || anchor.contains(e.target))) return;
    closeDetails();
    for (const t of ["pointerdown", "keydown", "wheel"]) window.removeEventListener(t, off, true);
  };
  setTimeout(() => { for (const t of ["pointerdown", "keydown", "wheel"]) window.addEventListener(t, off, true); });
}

function badgeWidget(node) {
  const existing = (node.widgets || []).find((w) => w.name === BADGE_WIDGET);
  if (existing) return existing;
  const element = document.createElement("div");
  element.className = "carnator-badge";
  if (typeof ResizeObserver === "function") new ResizeObserver(() => fitRows(element)).observe(element);
  element.addEventListener("click", (e) => {
    e.stopPropagation();
    openDetails(element, node.carnatorReport);
  });
  const widget = node.addDOMWidget(BADGE_WIDGET, "carnator_badge", element, {
    serialize: false, // not a value: never in the workflow's widgets_values nor in the API prompt
    hideOnZoom: false, // the decision stays readable when zoomed out
    getValue: () => undefined,
    setValue: () => {},
    getMinHeight: () => BADGE_HEIGHT,
    getMaxHeight: () => BADGE_HEIGHT,
    // The current frontend's visibility per surface (older frontends ignore it): the node on the canvas and as
    // a Vue node, not the properties panel.
    surfaces: { canvas: "shown", vueNode: "shown", panel: "never" },
  });
  widget.serialize = false;
  widget.element = widget.element || element;
  renderBadge(widget.element, node.carnatorReport || null);
  return widget;
}

/** Show a report on a sampler node (idempotent for the same report object: both delivery paths may call it).
 *  The badge's height never changes, so the node keeps its size; only a node too small for the badge (a workflow
 *  saved before it existed) grows to its minimum. */
function showReport(node, report) {
  if (!node || !report || node.carnatorReport === report) return;
  node.carnatorReport = report;
  state.last = report;
  state.reports.push(report);
  try {
    const widget = badgeWidget(node);
    renderBadge(widget.element, report);
    fitNode(node);
  } catch (e) {
    console.error("carnator: could not show the reuse badge", e);
  }
  state.refreshPanel?.();
  node.setDirtyCanvas?.(true, true);
}

/** Grow a canvas node to its minimum size (never shrink what the user sized). A Vue node lays out its own HTML. */
function fitNode(node) {
  if (window.LiteGraph?.vueNodesMode) return;
  const min = node.computeSize?.();
  if (min && node.size && (node.size[0] < min[0] || node.size[1] < min[1])) {
    node.setSize([Math.max(node.size[0], min[0]), Math.max(node.size[1], min[1])]);
  }
}

/** The sampler node an "executed" event is about, or null (also for nodes inside a subgraph that the plain id
 *  does not reach: their onExecuted hook delivers the report instead). */
function executedNode(detail) {
  const id = detail?.display_node ?? detail?.node;
  if (id == null) return null;
  const graph = app.rootGraph || app.graph;
  const node = graph?.getNodeById?.(id) ?? graph?.getNodeById?.(Number(id));
  if (!node) return null;
  if (node.comfyClass === SAMPLER || node.type === SAMPLER) return node;
  // A requeued identical graph: ComfyUI's node cache answered it, no sampler ran, and the Cache Writer reports
  // the run instead. Show it on the sampler whose LATENT the Writer stored.
  if (node.comfyClass === WRITER || node.type === WRITER) {
    const slot = (node.inputs || []).findIndex((i) => i.name === "latent");
    const src = slot >= 0 ? node.getInputNode?.(slot) : null;
    return src && (src.comfyClass === SAMPLER || src.type === SAMPLER) ? src : null;
  }
  return null;
}

// ---------------------------------------------------------------------------------------------------------
// compact nodes: tuning knobs folded away, one summary button

/** Names of a node definition's inputs marked advanced (V3 `advanced`, sent in the input's options). */
function advancedNames(nodeData) {
  const names = [];
  for (const section of ["required", "optional"]) {
    for (const [name, spec] of Object.entries(nodeData?.input?.[section] || {})) {
      if (Array.isArray(spec) && spec[1] && spec[1].advanced === true) names.push(name);
    }
  }
  return names;
}

function toggleLabel(node) {
  const n = (node.widgets || []).filter((w) => w.advanced && w.name !== TOGGLE_WIDGET).length;
  const what = `${node.comfyClass === SAMPLER ? "tuning" : "advanced"} input${n === 1 ? "" : "s"}`;
  if (node.showAdvanced) return `▾ hide ${n} ${what}`;
  const settings = (node.widgets || []).find((w) => w.name === "settings")?.value;
  const prefix = settings === "certified" ? "certified settings · " : settings === "custom" ? "custom settings · " : "";
  return `${prefix}▸ ${n} ${what}`;
}

/** Whether widget `w` of `node` takes its value from a link (its input socket is connected). */
function isLinked(node, w) {
  return (node.inputs || []).some((i) => i.widget?.name === w.name && i.link != null);
}

/** A DOM widget that a link feeds (the Early Probe's prompt from the Prompt node) shows nothing to edit: it keeps one
 *  row, for its socket, and its text box is not shown. Without this the frontend still lays the box out (hidden on
 *  1.58, an empty box on 1.32) and, in a node taller than its rows, grows it into a blank band. */
function foldLinkedText(node) {
  const ROW = 20;
  for (const w of node.widgets || []) {
    if (!w.element || w.carnatorFoldsLinked) continue;
    w.carnatorFoldsLinked = true;
    const linked = () => {
      const on = isLinked(node, w);
      w.element.style.opacity = on ? "0" : "";
      w.element.style.pointerEvents = on ? "none" : "";
      return on;
    };
    const layout = w.computeLayoutSize;
    if (typeof layout === "function") {
      w.computeLayoutSize = function () {
        return linked() ? { minHeight: ROW, maxHeight: ROW, minWidth: 0 } : layout.apply(this, arguments);
      };
    }
    const own = w.computeSize;
    if (typeof own === "function") {
      w.computeSize = function (width) {
        return linked() ? [width ?? node.size?.[0] ?? 0, ROW] : own.apply(this, arguments);
      };
    }
  }
}

/** Room for a node that grew from `before` to `after` canvas units tall (its tuning inputs shown): every node and
 *  group below it whose span across overlaps it moves down by the growth, so that nothing is covered; when the node
 *  folds again they move back up by as much as they were moved (unless the user moved them meanwhile). */
function makeRoom(node, before, after) {
  const graph = node.graph || app.graph;
  const dy = after - before;
  if (!graph || Math.abs(dy) < 1) return;
  const title = window.LiteGraph?.NODE_TITLE_HEIGHT ?? 30;
  const x0 = node.pos[0], x1 = node.pos[0] + node.size[0], bottom = node.pos[1] + before;
  if (dy < 0) {
    for (const [item, moved, y] of node.carnatorPushed || []) {
      if (Math.abs(item.pos[1] - y) < 0.5) item.pos = [item.pos[0], item.pos[1] - moved];
    }
    for (const [group, grown] of node.carnatorGrown || []) group.size[1] -= grown;
    node.carnatorPushed = node.carnatorGrown = null;
    graph.setDirtyCanvas?.(true, true);
    return;
  }
  const across = (left, width) => left < x1 && left + width > x0;
  const pushed = [];
  for (const other of graph._nodes || []) {
    if (other === node || !across(other.pos[0], other.size[0]) || other.pos[1] - title < bottom - 1) continue;
    other.pos = [other.pos[0], other.pos[1] + dy];
    pushed.push([other, dy, other.pos[1]]);
  }
  const grown = [];
  for (const group of graph._groups || []) {
    const [gx, gy] = group.pos, [gw, gh] = group.size;
    if (!across(gx, gw)) continue;
    if (gy >= bottom - 1) {
      group.pos = [gx, gy + dy];
      pushed.push([group, dy, group.pos[1]]);
    } else if (gy + gh > bottom - title) {  // the node is in it: the group grows with it
      group.size[1] += dy;
      grown.push([group, dy]);
    }
  }
  node.carnatorPushed = [...(node.carnatorPushed || []), ...pushed];
  node.carnatorGrown = [...(node.carnatorGrown || []), ...grown];
  graph.setDirtyCanvas?.(true, true);
}

/** Vue nodes: the frontend's own "Show advanced inputs" button (on any node) grows the node's HTML while its
 *  LiteGraph size stays: measure the node before and after, and make room below it as on the canvas. */
function watchVueAdvanced() {
  document.addEventListener("click", (e) => {
    const button = e.target?.closest?.('[data-testid="advanced-inputs-button"]');
    const element = button?.closest?.("[data-node-id]");
    if (!element || !window.LiteGraph?.vueNodesMode) return;
    const node = app.graph?.getNodeById?.(element.dataset.nodeId);
    if (!node) return;
    const scale = () => app.canvas?.ds?.scale || 1;
    const title = window.LiteGraph?.NODE_TITLE_HEIGHT ?? 30; // the element's height includes the title bar
    const before = element.getBoundingClientRect().height / scale() - title;
    const settle = (tries) => requestAnimationFrame(() => requestAnimationFrame(() => {
      const after = element.getBoundingClientRect().height / scale() - title;
      if (Math.abs(after - before) >= 1) makeRoom(node, before, after);
      else if (tries > 0) setTimeout(() => settle(tries - 1), 50);
    }));
    settle(10);
  }, true);
}

/** Fold a Carnator node's advanced widgets away (canvas) and add the summary button that shows them. */
function compactNode(node, names) {
  if (!names?.length || (node.widgets || []).some((w) => w.name === TOGGLE_WIDGET)) return;
  const folded = (node.widgets || []).filter((w) => names.includes(w.name));
  if (!folded.length) return;
  for (const w of folded) {
    // LiteGraph (1.32 and 1.58) draws an `advanced` widget only while node.showAdvanced is on, but still gives it
    // its row when it lays the widgets out; a zero height (the frontend's own way of hiding a converted widget)
    // gives the row back. Shown, the widget has its usual height.
    w.advanced = true;
    const own = w.computeSize;
    w.computeSize = function (width) {
      if (!node.showAdvanced) return [0, -4];
      return own ? own.call(this, width) : [width ?? node.size?.[0] ?? 0, window.LiteGraph?.NODE_WIDGET_HEIGHT ?? 20];
    };
  }
  const button = node.addWidget("button", TOGGLE_WIDGET, null, () => {
    const before = node.size?.[1];
    if (typeof node.toggleAdvanced === "function") node.toggleAdvanced();
    else node.showAdvanced = !node.showAdvanced;
    if (!node.showAdvanced && node.size && !window.LiteGraph?.vueNodesMode) {
      // Folding gives the space back (toggleAdvanced only ever grows a node).
      const min = node.computeSize();
      if (before && min[1] < node.size[1]) node.setSize([node.size[0], min[1]]);
    }
    if (before != null && node.size) makeRoom(node, before, node.size[1]);
    node.setDirtyCanvas?.(true, true);
  }, {
    serialize: false,
    // The newest frontend's Vue nodes have their own "Show advanced inputs" button: this one is for the canvas.
    surfaces: { canvas: "shown", vueNode: "never", panel: "never" },
  });
  button.serialize = false; // never in widgets_values nor in the API prompt
  // The label follows the node's state (canvas draws read it each frame; the Vue node reads it when it renders).
  Object.defineProperty(button, "label", { get: () => toggleLabel(node), set: () => {}, configurable: true });
  button.tooltip = "Show or hide the tuning inputs. Their values are kept and used either way; with settings = "
    + "certified a hit uses the rule's certified values instead.";
}

// ---------------------------------------------------------------------------------------------------------
// the panel

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
  const { style, dataset, ...rest } = props;
  Object.assign(e, rest);
  if (style) Object.assign(e.style, style);
  if (dataset) Object.assign(e.dataset, dataset);
  for (const c of children) if (c != null) e.append(c);
  return e;
}

const SVG_NS = "http://www.w3.org/2000/svg";
function svg(tag, attrs = {}, children = []) {
  const e = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
  for (const c of children) e.append(c);
  return e;
}

/** A namespace in words, never its hash: the model (its loader and patches such as EasyCache, from the graph that
 *  served it: the requests route's `titles`) and the generation config (the cache's record of it, else the graph's
 *  probe settings). */
function namespaceLabel(ns, stats, title) {
  const c = stats?.config || {};
  const shape = Array.isArray(c.latent_shape) ? c.latent_shape.join("×") : "";
  const parts = [c.arch, shape && `latent ${shape}`, c.steps && `${c.steps} steps`,
    c.sampler && `${c.sampler}/${c.scheduler}`, c.cfg != null && `cfg ${c.cfg}`].filter(Boolean);
  const config = title?.config
    ? [title.config, shape && `latent ${shape}`, c.arch].filter(Boolean).join(" · ") : parts.join(" · ");
  const model = title?.model || (parts.length ? "a model this server has not run since it started" : "");
  return { model: model || "a model and settings this server has not run since it started", config };
}

/** Hits and misses (cumulative) and the compute each request saved (bars), over the last requests, with the
 *  purges as dashed lines. Pure SVG, 100 % wide. */
function historyPlot(events, purges) {
  const W = 300, H = 90, pad = 4;
  const n = events.length;
  const g = svg("svg", { viewBox: `0 0 ${W} ${H}`, width: "100%", class: "carnator-plot",
    role: "img", "aria-label": "hits, misses and compute saved over the last requests" });
  g.append(svg("rect", { x: 0, y: 0, width: W, height: H, fill: "rgba(255,255,255,0.04)", rx: 4 }));
  if (!n) return g;
  const x = (i) => pad + ((W - 2 * pad) * (i + 0.5)) / n;
  const bw = Math.max(1, (W - 2 * pad) / n - 1);
  let hits = 0, misses = 0;
  const hp = [], mp = [];
  events.forEach((e, i) => {
    const kind = kindOf(e).key;
    if (kind === "hit") hits++;
    else if (kind !== "not_run") misses++;
    hp.push([x(i), hits]);
    mp.push([x(i), misses]);
    const s = kind !== "not_run" && typeof e.saving === "number" ? Math.max(0, Math.min(1, e.saving)) : 0;
    g.append(svg("rect", { x: x(i) - bw / 2, y: H - pad - s * (H / 2 - pad), width: bw, height: s * (H / 2 - pad),
      fill: "#2e9e4f", opacity: 0.55, class: "carnator-saved-bar" }));
  });
  const top = Math.max(hits, misses, 1);
  const y = (v) => H / 2 - pad - (v / top) * (H / 2 - 2 * pad) + pad;
  const line = (pts, color, cls) => svg("polyline", { points: pts.map(([a, b]) => `${a},${y(b)}`).join(" "),
    fill: "none", stroke: color, "stroke-width": 2, class: cls });
  g.append(line(hp, "#8fe3a3", "carnator-hits-line"), line(mp, "#ffb35c", "carnator-misses-line"));
  for (const t of purges || []) {
    const i = events.findIndex((e) => e.time > t);
    if (i <= 0) continue;
    const px = (x(i - 1) + x(i)) / 2;
    g.append(svg("line", { x1: px, x2: px, y1: 0, y2: H, stroke: "#ff9a8a", "stroke-dasharray": "3,3",
      class: "carnator-purge-mark" }));
  }
  return g;
}

function requestRow(e) {
  const k = kindOf(e);
  const colors = COLORS[k.key] || COLORS.dense;
  const when = new Date((e.time || 0) * 1000).toLocaleTimeString();
  const thumb = e.thumbnail
    ? el("img", { src: e.thumbnail, alt: "result", className: "carnator-thumb",
      style: { width: "40px", height: "40px", objectFit: "cover", imageRendering: "pixelated", borderRadius: "3px",
        flex: "0 0 auto" } })
    : el("div", { className: "carnator-thumb-none", textContent: "–", style: { width: "40px", height: "40px",
      flex: "0 0 auto", textAlign: "center", lineHeight: "40px", opacity: "0.5" } });
  const head = headline(e, k).text;
  return el("div", { className: "carnator-req", dataset: { decision: k.key },
    style: { display: "flex", gap: "8px", alignItems: "center", padding: "3px 0",
      borderTop: "1px solid rgba(255,255,255,0.06)" } }, [
    thumb,
    el("div", { style: { minWidth: "0", flex: "1 1 auto" } }, [
      el("div", { textContent: head, className: "carnator-req-decision",
        style: { color: colors.fg, background: colors.bg, borderLeft: `3px solid ${colors.pill}`, padding: "0 4px",
          fontSize: "12px", overflowWrap: "anywhere" } }),
      el("div", { textContent: `${when} · seed ${e.seed ?? "–"} · ${e.prompt || ""}`, title: e.prompt || "",
        style: { fontSize: "11px", opacity: "0.8", whiteSpace: "nowrap", overflow: "hidden",
          textOverflow: "ellipsis" } }),
    ]),
  ]);
}

const LISTED = 8; // rows of the request list per namespace

function namespaceCard(ns, stats, events, purges, learned, held, title) {
  const label = namespaceLabel(ns, stats, title);
  // The rule's state: learning mode's record for this namespace (kept in the cache folder) when there is one, else
  // as the last request that went through the Risk Filter saw it (exact repeats need no rule).
  const decided = [...events].reverse().find((e) => e.rule_state || e.rule_id || e.filter_mode);
  const rule = learned ? ruleLine({ rule_state: learned }) : decided ? ruleLine(decided)
    : events.length ? ruleLine(events[events.length - 1]) : "rule: – (no request served since the server started)";
  // The cache's own counters (reset by a purge) and this server's history (kept through a purge): both counted by
  // the one definition of a hit and a lookup (the help above the cards).
  const counts = stats
    ? `cache: ${plural(stats.entries, "entry", "entries")} · ${bytes(stats.bytes)} · ` +
      `${plural(stats.hits, "hit")} of ${plural(stats.lookups, "lookup")} since purge`
    : "cache: no entries (purged, or not written yet)";
  const h = held || { requests: events.length, hits: events.filter(isHit).length,
    lookups: events.filter(isLookup).length, not_run: events.filter((e) => kindOf(e).key === "not_run").length };
  const ran = events.filter((e) => kindOf(e).key !== "not_run");
  const saved = ran.reduce((s, e) => s + (typeof e.saving === "number" ? e.saving : 0), 0);
  const listed = events.slice(-LISTED).reverse();
  return el("div", { className: "carnator-ns", dataset: { namespace: ns },
    style: { margin: "10px 0", padding: "8px", border: "1px solid var(--border-color, #444)", borderRadius: "6px" } },
  [
    el("div", { className: "carnator-ns-title", textContent: label.model, title: `namespace ${ns}`,
      style: { fontWeight: "bold", overflowWrap: "anywhere" } }),
    label.config ? el("div", { className: "carnator-ns-config", textContent: label.config,
      style: { fontSize: "12px", overflowWrap: "anywhere" } }) : null,
    el("div", { className: "carnator-ns-rule", textContent: rule, style: { margin: "2px 0" } }),
    el("div", { className: "carnator-ns-learning", style: { fontSize: "12px", opacity: "0.85" } },
      learningLines(learned || decided?.rule_state).map((text) => el("div", { textContent: text }))),
    el("div", { className: "carnator-ns-counts", textContent: counts, style: { opacity: "0.8", fontSize: "12px" } }),
    el("div", { className: "carnator-ns-recent", style: { fontSize: "12px", margin: "4px 0 2px" },
      textContent: h.requests
        ? `since the server started: ${plural(h.requests, "request")} · ${plural(h.hits, "hit")} of ` +
          `${plural(h.lookups, "lookup")}` +
          (h.not_run ? ` · ${h.not_run} not run (ComfyUI reused its output)` : "") +
          (ran.length ? ` · the last ${plural(ran.length, "run")} saved ${pct(saved / ran.length)} of their compute ` +
            "on average" : "")
        : "no requests served since the server started" }),
    events.length ? historyPlot(events, purges) : null,
    events.length ? el("div", { style: { fontSize: "11px", opacity: "0.7" },
      textContent: `${plural(events.length, "request")} · lines: hits (green), misses and dense runs (orange), ` +
        "cumulative · bars: share of compute saved per request · dashed: purge" }) : null,
    listed.length ? el("div", { className: "carnator-req-title", style: { fontSize: "12px", margin: "6px 0 2px",
      fontWeight: "bold" }, textContent: listed.length === 1 ? "the last request"
      : `last ${listed.length} requests, newest first` }) : null,
    ...listed.map(requestRow),
  ]);
}

/** The panel's help: what each number counts (the definitions come from the server: one text for all). */
function helpBox(definitions) {
  const d = definitions || {};
  const item = (term, text) => el("li", {}, [el("b", { textContent: `${term}: ` }), text || "–"]);
  return el("details", { className: "carnator-help", style: { margin: "6px 0", fontSize: "12px" } }, [
    el("summary", { textContent: "What the numbers mean", style: { cursor: "pointer" } }),
    el("ul", { style: { margin: "4px 0", paddingLeft: "18px" } }, [
      item("lookup", d.lookup),
      item("hit", d.hit),
      item("not run (ComfyUI reused its output)", d.not_run),
      item("since purge", "the cache's own counters: a purge sets them back to 0"),
      item("since the server started", "the requests this ComfyUI process served, per model and settings; a purge " +
        "keeps them, a restart empties them"),
    ]),
  ]);
}

function renderPanel(root) {
  root.innerHTML = "";
  root.classList.add("carnator-panel");
  Object.assign(root.style, { padding: "12px", fontSize: "13px", color: "var(--fg-color, #ddd)", overflowY: "auto",
    height: "100%", boxSizing: "border-box" });
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
  const spaces = el("div", { className: "carnator-namespaces" });
  let help = helpBox(null);
  const button = (text, cls, onclick, title) =>
    el("button", {
      textContent: text, className: cls, onclick, title,
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
      const dir = encodeURIComponent(dirInput.value);
      const [s, h, rules] = await Promise.all([
        fetchJson(`/carnator/cache/stats?directory=${dir}`),
        fetchJson("/carnator/requests?limit=60"),
        // Learning mode's state per namespace; a server without it, or a Redis cache, has none to show.
        fetchJson(`/carnator/rules?directory=${dir}`).catch(() => null),
      ]);
      const learned = new Map((rules?.namespaces || []).filter((r) => r?.namespace).map((r) => [r.namespace, r]));
      state.lastStats = s;
      state.lastRequests = h;
      const answers = s.answers ? ` (${s.answers} of them kept answers of hits, for exact repeats)` : "";
      table.replaceChildren(
        row("entries", String(s.entries ?? 0) + answers),
        row("size", bytes(s.bytes ?? 0)),
        row("hits since purge", `${s.hits ?? 0} of ${plural(s.lookups ?? 0, "lookup")}` +
          (s.hit_rate == null || !s.lookups ? "" : ` (${pct(s.hit_rate, 1)})`)),
      );
      const open = help.open;
      help.replaceWith(help = helpBox(s.definitions || h?.definitions));
      help.open = open;
      const byNs = new Map((Array.isArray(s.namespaces) ? s.namespaces : []).map((n) => [n.namespace, n]));
      const events = h?.namespaces || {};
      const names = [...new Set([...Object.keys(events), ...byNs.keys()])];
      spaces.replaceChildren(...(names.length
        ? names.map((ns) => namespaceCard(ns, byNs.get(ns), events[ns] || [], h?.purges || [], learned.get(ns),
          h?.counts?.[ns], h?.titles?.[ns]))
        : [el("div", { textContent: "no namespace yet: queue a workflow with a Carnator Cache node",
          style: { opacity: "0.7" } })]));
      message.textContent = s.exists ? "" : "empty: no cache has been written to this directory yet";
      root.dataset.entries = String(s.entries ?? 0);
      root.dataset.requests = String(Object.values(events).reduce((k, v) => k + v.length, 0));
    } catch (e) {
      message.textContent = `⚠ ${e.message}`;
    }
  }

  async function purge() {
    if (!window.confirm(`Delete every entry of the Carnator cache in "${dirInput.value}"? The next run of a graph `
      + "computes again (ComfyUI's own node cache is bypassed for it).")) return;
    try {
      const r = await fetchJson("/carnator/cache/purge", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ directory: dirInput.value }),
      });
      await refresh();
      message.textContent = `purged ${typeof r.purged === "object" ? JSON.stringify(r.purged) : r.purged} entries;`
        + " queue again to recompute";
    } catch (e) {
      message.textContent = `⚠ ${e.message}`;
    }
  }

  root.append(
    el("h3", { textContent: "Carnator cache", style: { margin: "0 0 8px 0", fontSize: "15px" } }),
    dirInput,
    el("div", {}, [button("Refresh", "carnator-refresh", refresh),
      button("Purge…", "carnator-purge", purge, "Delete every entry; the next queue recomputes")]),
    message,
    table,
    help,
    spaces,
  );
  state.refreshPanel = refresh;
  refresh();
}

// ---------------------------------------------------------------------------------------------------------

// For tests and other extensions: the text the badge shows for a report, and its details.
Object.assign(state, { badgeLines, ruleLine, kindOf, isHit, isLookup, learningProgress, learningLines, BADGE_HEIGHT });

app.registerExtension({
  name: "carnator.ReuseBadge",

  async setup() {
    const tab = {
      id: "carnator-cache",
      icon: "pi pi-database",
      title: "Carnator",
      tooltip: "Carnator cache: rule state, hits and misses, last requests, purge",
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
      let report = detail?.output?.carnator_report?.[0];
      if (!report) return;
      const node = executedNode(detail);
      // The Cache Writer adds to the run its sampler already reported (e.g. "not cached"): keep the sampler's
      // decision and add the Writer's word. A node-cache answer is a run of its own.
      if (node?.carnatorReport && report.mode !== "node_cache" && detail.node !== String(node.id)) {
        report = { ...node.carnatorReport, not_cached: report.not_cached };
      }
      showReport(node, report);
    });
    watchVueAdvanced();
    // The Cache Writer stores the entry after the sampler reported: refresh the panel when the prompt is done.
    api.addEventListener("execution_success", () => state.refreshPanel?.());
  },

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!String(nodeData?.name || "").startsWith("Carnator")) return;
    const names = advancedNames(nodeData);
    const onNodeCreated = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      const r = onNodeCreated?.apply(this, arguments);
      try {
        compactNode(this, names);
        if (!window.LiteGraph?.vueNodesMode) foldLinkedText(this);
        if (nodeData.name === SAMPLER) badgeWidget(this); // reserve the badge's rows now: a report never grows it
        const min = this.computeSize?.();
        if (min && this.size) this.setSize([Math.max(this.size[0], min[0]), min[1]]);
      } catch (e) {
        console.error("carnator: could not lay out the node", e);
      }
      return r;
    };
    // A saved node taller than its rows (a workflow saved while a text box took room, or by an older version) is
    // fitted to them on the canvas when it has nothing that could use the room (no text box that is not linked).
    const onConfigure = nodeType.prototype.onConfigure;
    nodeType.prototype.onConfigure = function () {
      const r = onConfigure?.apply(this, arguments);
      try {
        if (!window.LiteGraph?.vueNodesMode && !(this.widgets || []).some((w) => w.element && w.name !== BADGE_WIDGET
            && !isLinked(this, w))) {
          const min = this.computeSize?.();
          if (min && this.size && this.size[1] > min[1] + 1) this.setSize([this.size[0], min[1]]);
        }
      } catch (e) {
        console.error("carnator: could not fit the node", e);
      }
      return r;
    };
    if (nodeData.name !== SAMPLER) return;
    // Never narrower than the badge's rows need (LiteGraph's resize and the layout take computeSize as the minimum).
    const computeSize = nodeType.prototype.computeSize;
    nodeType.prototype.computeSize = function () {
      const size = computeSize.apply(this, arguments);
      size[0] = Math.max(size[0], MIN_NODE_WIDTH);
      return size;
    };
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (output) {
      const r = onExecuted?.apply(this, arguments);
      showReport(this, output?.carnator_report?.[0]);
      return r;
    };
  },
});
