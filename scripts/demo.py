#!/usr/bin/env python
"""`make demo`: Carnator serving a request stream through a real ComfyUI server's API queue, with an HTML report.

What it does, from a fresh clone (``make demo`` sets up the local ComfyUI host first):

1. starts a real ComfyUI server (``tests/harness_server.py``: ``main.py --cpu`` on a free loopback port, with its
   own temporary base directory and Carnator linked into ``custom_nodes``) and lists the Carnator nodes it loaded;
2. warms a Carnator cache: the warm set of the embedded-world workload (``carnator_core/lab/workload.py``) goes
   through ``POST /prompt`` as the ``workflows/api/embedded_warm_cache.json`` graph (Early Probe -> dense Joint
   Reuse Sampler with attention-structure recording -> Cache Writer -> decode -> SaveAnimatedWEBP);
3. serves the stream through ``POST /prompt`` as the ``workflows/api/embedded.json`` graph (probe -> signature ->
   retrieval -> Risk Filter -> Joint Reuse Sampler -> Cache Writer), all requests queued at once the way an API
   client would, and prints one line per request (decision, reused entry, active fraction, latency) from
   ``/history`` (the sampler's ``carnator_report`` UI output and the execution timestamps);
4. prints a summary table and writes ``artifacts/demo/report.html`` (clips = the server's animated WebP files,
   plots = matplotlib PNGs: latency per request by decision, hit rate over the stream).

The risk rule: the shipped certified rule ``rules/embedded.json`` when it exists and applies to the weights in
use; otherwise an UNCERTIFIED development rule (``--dev-thresholds``) is written to the server's user rules folder
and every decision is marked UNCERTIFIED (the demo says so loudly; such a run shows the mechanics, not a
certified risk level).

    .host/venv/bin/python scripts/demo.py            # 8 warm + 16 stream requests (the `make demo` default)
    .host/venv/bin/python scripts/demo.py --quick    # 2 warm + 3 stream (tests/test_demo.py)
"""
from __future__ import annotations

import argparse
import html
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import urllib.parse
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))  # workload.py: the workload flags the benchmarks share

from workload import add_workload_args, register_package, spec_from_args  # noqa: E402

register_package()

from api_client import ComfyClient, set_request  # noqa: E402
from harness_server import ComfyServer  # noqa: E402

from carnator.carnator_core.embedded import config as ecfg  # noqa: E402
from carnator.carnator_core.lab.workload import Request, build_workload, describe  # noqa: E402

WARM_WORKFLOW = ROOT / "workflows" / "api" / "embedded_warm_cache.json"
STREAM_WORKFLOW = ROOT / "workflows" / "api" / "embedded.json"
SHIPPED_RULE = ROOT / "rules" / "embedded.json"
DEFAULT_WEIGHTS = ROOT / "carnator_core" / "embedded" / "weights" / "carnator_embedded_v3.safetensors"
CACHE_DIR = "carnator_demo_cache"
DEV_RULE = "embedded-demo-dev.json"


# ---------------------------------------------------------------------------------------------------- graphs
def fallback_graph(stream: bool) -> dict[str, Any]:
    """The API-format graph built from the node ids, for a checkout whose workflows/api/ files are missing.
    Widget values the graph leaves out take the nodes' defaults (the server fills them in)."""
    g: dict[str, Any] = {
        "1": {"class_type": "CarnatorEmbeddedLoader", "inputs": {"weights_path": ""}},
        "2": {"class_type": "PrimitiveStringMultiline", "inputs": {"value": ""}, "_meta": {"title": "Prompt"}},
        "3": {"class_type": "CarnatorEmbeddedTextEncode", "inputs": {"text_encoder": ["1", 1], "text": ["2", 0]}},
        "4": {"class_type": "CarnatorEmbeddedTextEncode", "inputs": {"text_encoder": ["1", 1], "text": ""}},
        "5": {"class_type": "CarnatorEmbeddedEmptyLatent", "inputs": {"batch_size": 1}},
        "6": {"class_type": "CarnatorEarlyProbe", "inputs": {
            "model": ["1", 0], "positive": ["3", 0], "negative": ["4", 0], "latent_image": ["5", 0], "seed": 0,
            "steps": 20, "cfg": ecfg.DEFAULT_CFG, "sampler_name": "euler", "scheduler": "simple",
            "probe_steps": ecfg.DEFAULT_PROBE_STEP, "prompt": ["2", 0], "text_encoder": ["1", 1]}},
        "7": {"class_type": "CarnatorSignatureBuilder", "inputs": {"probe": ["6", 0]}},
        "8": {"class_type": "CarnatorCacheLoader", "inputs": {"directory": CACHE_DIR}},
        "11": {"class_type": "CarnatorJointReuseSampler", "inputs": {
            "model": ["1", 0], "positive": ["3", 0], "negative": ["4", 0], "latent_image": ["5", 0],
            "probe": ["6", 0], "signature": ["7", 0], "cache": ["8", 0], "mode": "joint"}},
        "12": {"class_type": "CarnatorCacheWriter", "inputs": {
            "cache": ["8", 0], "probe": ["6", 0], "signature": ["7", 0], "latent": ["11", 0], "report": ["11", 1]}},
        "13": {"class_type": "CarnatorEmbeddedDecode", "inputs": {"decoder": ["1", 2], "samples": ["11", 0]}},
        "14": {"class_type": "SaveAnimatedWEBP", "inputs": {
            "images": ["13", 0], "filename_prefix": "carnator/embedded", "fps": 8.0, "lossless": False,
            "quality": 90, "method": "default"}},
    }
    if stream:
        g["9"] = {"class_type": "CarnatorCacheRetriever", "inputs": {"cache": ["8", 0], "probe": ["6", 0]}}
        g["10"] = {"class_type": "CarnatorRiskFilter", "inputs": {
            "candidates": ["9", 0], "signature": ["7", 0], "probe": ["6", 0], "rule_file": "embedded.json",
            "mode": "signature", "allow_uncertified": False}}
        g["11"]["inputs"]["decision"] = ["10", 0]
    else:
        g["11"]["inputs"]["mode"] = "dense"
    return g


def load_graph(path: Path, stream: bool) -> tuple[dict[str, Any], str]:
    if path.exists():
        return json.loads(path.read_text(encoding="utf-8")), str(path.relative_to(ROOT))
    return fallback_graph(stream), "built from node ids (workflow file missing)"


def nodes_of(graph: dict[str, Any], class_type: str) -> list[dict[str, Any]]:
    return [n for n in graph.values() if n.get("class_type") == class_type]


def configure(graph: dict[str, Any], req: Request, weights: str, rule_file: str, allow_uncertified: bool
              ) -> dict[str, Any]:
    """A copy of ``graph`` serving ``req``: prompt, seed, frozen weights, the demo's cache, rule, file prefix."""
    g = set_request(graph, req.prompt, req.seed)
    for n in nodes_of(g, "CarnatorEmbeddedLoader"):
        n["inputs"]["weights_path"] = weights
    for n in nodes_of(g, "CarnatorCacheLoader"):
        n["inputs"]["directory"] = CACHE_DIR
    for n in nodes_of(g, "CarnatorRiskFilter"):
        n["inputs"].update({"rule_file": rule_file, "mode": "signature", "allow_uncertified": allow_uncertified})
    for n in nodes_of(g, "SaveAnimatedWEBP"):
        n["inputs"]["filename_prefix"] = f"carnator_demo/{req.rid}"
    return g


def dense_twin(graph: dict[str, Any], rid: str) -> dict[str, Any]:
    """The same request as a plain ComfyUI graph — KSampler instead of the Carnator path, nothing written to the
    cache — for the per-request dense reference. Queued right after its Carnator twin, so both are measured under
    the same load; its KSampler node is new to ComfyUI's node cache, so it always samples."""
    g = json.loads(json.dumps(graph))
    sampler_id = next(k for k, n in g.items() if n.get("class_type") == "CarnatorJointReuseSampler")
    probe = next(n for n in g.values() if n.get("class_type") == "CarnatorEarlyProbe")["inputs"]
    si = g[sampler_id]["inputs"]
    ks = {"class_type": "KSampler", "_meta": {"title": "dense twin"}, "inputs": {
        "model": si["model"], "positive": si["positive"], "negative": si["negative"],
        "latent_image": si["latent_image"], "seed": probe["seed"], "steps": probe["steps"], "cfg": probe["cfg"],
        "sampler_name": probe["sampler_name"], "scheduler": probe["scheduler"], "denoise": 1.0}}
    for n in g.values():  # everything that read the Carnator sampler's LATENT reads the KSampler's
        for key, v in n.get("inputs", {}).items():
            if isinstance(v, list) and len(v) == 2 and v[0] == sampler_id and v[1] == 0:
                n["inputs"][key] = ["dense_twin", 0]
    g = {k: n for k, n in g.items()
         if not (n.get("class_type", "").startswith("Carnator") and not n.get("class_type", "").startswith(
             "CarnatorEmbedded"))}
    g["dense_twin"] = ks
    for n in nodes_of(g, "SaveAnimatedWEBP"):
        n["inputs"]["filename_prefix"] = f"carnator_demo/{rid}_dense"
    return g


# ---------------------------------------------------------------------------------------------------- results
def _latency_s(entry: dict[str, Any]) -> Optional[float]:
    """Server-side wall time of one prompt: execution_start -> execution_success timestamps (ms) in /history."""
    ts = {ev: data.get("timestamp") for ev, data in entry.get("status", {}).get("messages", [])}
    if ts.get("execution_start") is None or ts.get("execution_success") is None:
        return None
    return (ts["execution_success"] - ts["execution_start"]) / 1000.0


def parse_result(req: Request, entry: dict[str, Any], base_dir: Path, clips_dir: Path) -> dict[str, Any]:
    """One request's row for the report: decision, entry, fractions, latency, clip (copied next to the report)."""
    outputs = entry.get("outputs", {})
    report: dict[str, Any] = {}
    written = None
    clip = None
    for out in outputs.values():
        if out.get("carnator_report"):
            report = out["carnator_report"][0]
        for text in out.get("text", []):
            m = re.search(r"stored entry ([0-9a-f]{16})", str(text))
            if m:
                written = m.group(1)
        for item in out.get("images", []):
            if str(item.get("filename", "")).endswith(".webp"):
                src = base_dir / (item.get("type") or "output") / item.get("subfolder", "") / item["filename"]
                if src.exists():
                    clips_dir.mkdir(parents=True, exist_ok=True)
                    clip = f"clips/{req.rid}.webp"
                    shutil.copyfile(src, clips_dir / f"{req.rid}.webp")
    return {
        "rid": req.rid, "phase": req.phase, "kind": req.kind, "prompt": req.prompt, "seed": req.seed,
        "parent": req.parent, "decision": report.get("decision", "?"), "reused": report.get("entry_id"),
        "written": written, "active_fraction": report.get("active_fraction"),
        "compute_fraction": report.get("compute_fraction"), "timings_ms": report.get("timings_ms", {}),
        "summary": report.get("decision_summary") or report.get("reason", ""), "latency_s": _latency_s(entry),
        "clip": clip,
    }


def serve_phase(client: ComfyClient, graph: dict[str, Any], reqs: tuple[Request, ...], weights: str,
                rule_file: str, allow_uncertified: bool, base_dir: Path, clips_dir: Path,
                show: Any, twins: bool = False) -> list[dict[str, Any]]:
    """Queue every request of a phase at once (ComfyUI runs them in order), then read each from /history.

    ``twins``: after each request, queue its dense twin (:func:`dense_twin`); the row gets ``dense_latency_s``
    and ``dense_clip``."""
    queued = []
    for r in reqs:
        g = configure(graph, r, weights, rule_file, allow_uncertified)
        queued.append((client.queue(g), client.queue(dense_twin(g, r.rid)) if twins else None, r))
    rows: list[dict[str, Any]] = []
    # Print each request as soon as it (and its twin) finishes (ComfyUI runs the queue in order).
    for pid, twin_id, req in queued:
        done = client.wait_all([pid] + ([twin_id] if twin_id else []))
        row = parse_result(req, done[pid], base_dir, clips_dir)
        if twin_id:
            twin = parse_result(replace(req, rid=f"{req.rid}_dense"), done[twin_id], base_dir, clips_dir)
            row["dense_latency_s"], row["dense_clip"] = twin["latency_s"], twin["clip"]
        rows.append(row)
        show(row)
    return rows


# ---------------------------------------------------------------------------------------------------- the rule
def _certificate_line(c: dict[str, Any]) -> str:
    """A rule file's certificate as one line (the filter's own wording: ``Certificate.line``); a file whose
    certificate does not parse says so instead of failing the demo."""
    from carnator.carnator_core.risk.certify import Certificate

    try:
        return Certificate.from_dict(c).line()
    except (ValueError, TypeError, KeyError) as e:
        return f"certificate unreadable ({e})"


def choose_rule(server: ComfyServer, base_dir: Path, dev_thresholds: str) -> tuple[str, bool, str]:
    """(rule_file, allow_uncertified, description). Needs the warm cache (for the model/config fingerprints)."""
    stats = server.get("/carnator/cache/stats?" + urllib.parse.urlencode({"directory": CACHE_DIR}))
    spaces = stats.get("namespaces") or []
    if not spaces:
        raise RuntimeError(f"the warm-up wrote no cache entries (cache stats: {json.dumps(stats)[:2000]})")
    ns = spaces[0]
    model_fp, config_fp = ns["model_fingerprint"], ns["namespace"].split("-", 1)[1]
    why = f"{SHIPPED_RULE.relative_to(ROOT)} not found (the certified rule for the embedded model)"
    if SHIPPED_RULE.exists():
        rule = json.loads(SHIPPED_RULE.read_text(encoding="utf-8"))
        same = (rule.get("model", {}).get("fingerprint") == model_fp
                and rule.get("config", {}).get("fingerprint") == config_fp)
        certified = bool(rule.get("certificate", {}).get("passed"))
        c = rule.get("certificate", {})
        if same and certified:
            return "embedded.json", False, f"certified rule rules/embedded.json: {_certificate_line(c)}"
        if same:
            # The shipped rule is for these weights and this config but its certificate fails: use it, marked.
            return "embedded.json", True, (f"UNCERTIFIED shipped rule rules/embedded.json: {_certificate_line(c)} "
                                           "(rules/README.md)")
        why = ("rules/embedded.json is not certified" if not certified else
               "rules/embedded.json was calibrated for other weights/config than the ones in use")
    c, s, sh, a = (float(x) for x in dev_thresholds.split(","))
    dev = {
        "format": "carnator-risk-rule", "schema_version": 1,
        "thresholds": {"context": c, "size": s, "shape": sh, "appearance": a, "min_similarity": None},
        "certificate": {"n": 0, "k": 0, "upper_bound": 1.0, "alpha": 0.05, "delta": 0.1, "passed": False,
                        "n_requests": 0},
        "model": {"fingerprint": model_fp, "arch": "embedded"},
        "config": {"fingerprint": config_fp, "meta": ns.get("config", {})},
        "provenance": {"note": "UNCERTIFIED development rule written by scripts/demo.py (" + why + ")"},
    }
    rules_dir = base_dir / "user" / "carnator" / "rules"
    rules_dir.mkdir(parents=True, exist_ok=True)
    (rules_dir / DEV_RULE).write_text(json.dumps(dev, indent=2) + "\n", encoding="utf-8")
    return DEV_RULE, True, f"UNCERTIFIED development rule (thresholds {dev['thresholds']}): {why}"


# ---------------------------------------------------------------------------------------------------- output
def fmt_row(row: dict[str, Any]) -> str:
    lat = row["latency_s"]
    act = row["active_fraction"]
    dec = str(row["decision"]).upper()
    what = (f"reuses {row['reused']}" if row["decision"] == "hit"
            else (f"stored {row['written']}" if row["written"] else ""))
    return (f"{row['rid']} {row['kind']:16s} {dec:5s} {what:24s} "
            f"active={'-' if act is None or row['decision'] != 'hit' else f'{act:.0%}':>4s} "
            f"compute={'-' if row['compute_fraction'] is None else format(row['compute_fraction'], '.0%'):>4s} "
            f"latency={'-' if lat is None else f'{lat:.2f}s':>7s}"
            + (f" (dense twin {row['dense_latency_s']:.2f}s)" if row.get("dense_latency_s") else "")
            + f"  {row['prompt']}")


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def mean(xs: list[float]) -> Optional[float]:
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else None

    def ratio(rs: list[dict[str, Any]]) -> list[float]:
        return [r["dense_latency_s"] / r["latency_s"] for r in rs
                if r.get("dense_latency_s") and r.get("latency_s")]

    stream = [r for r in rows if r["phase"] == "stream"]
    hits = [r for r in stream if r["decision"] == "hit"]
    misses = [r for r in stream if r["decision"] != "hit"]
    warm = [r for r in rows if r["phase"] == "warm"]
    # Every stream request has a dense twin (the same request through a plain KSampler graph, queued right after
    # it): speedups compare the same requests measured the same way, never requests run at other times.
    paired = [r for r in stream if r.get("dense_latency_s") and r.get("latency_s")]
    return {"warm": len(warm), "stream": len(stream), "hits": len(hits),
            "hit_rate": len(hits) / len(stream) if stream else None,
            "mean_latency_s": mean([r["latency_s"] for r in stream]),
            "mean_hit_latency_s": mean([r["latency_s"] for r in hits]),
            "mean_miss_latency_s": mean([r["latency_s"] for r in misses]),
            "mean_dense_twin_latency_s": mean([r.get("dense_latency_s") for r in stream]),
            "median_hit_speedup_vs_dense_twin": statistics.median(ratio(hits)) if ratio(hits) else None,
            "median_miss_speedup_vs_dense_twin": statistics.median(ratio(misses)) if ratio(misses) else None,
            "stream_speedup_vs_dense": (sum(r["dense_latency_s"] for r in paired) / sum(r["latency_s"] for r in paired)
                                        if paired else None),
            "mean_active_fraction_hits": mean([r["active_fraction"] for r in hits]),
            "mean_compute_fraction_hits": mean([r["compute_fraction"] for r in hits])}


def summary_table(s: dict[str, Any]) -> str:
    def f(x: Any, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    return "\n".join([
        "| warm (dense) | stream | hits | hit rate | mean latency (s) | hit latency (s) | miss latency (s) "
        "| dense twin latency (s) | hit speedup vs its dense twin (median) | miss vs twin (median) "
        "| stream vs dense | active / compute on hits |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        f"| {s['warm']} | {s['stream']} | {s['hits']} | {f(s['hit_rate'], '.0%')} | {f(s['mean_latency_s'], '.2f')} "
        f"| {f(s['mean_hit_latency_s'], '.2f')} | {f(s['mean_miss_latency_s'], '.2f')} "
        f"| {f(s['mean_dense_twin_latency_s'], '.2f')} | {f(s['median_hit_speedup_vs_dense_twin'], '.2f')}× "
        f"| {f(s['median_miss_speedup_vs_dense_twin'], '.2f')}× | {f(s['stream_speedup_vs_dense'], '.2f')}× "
        f"| {f(s['mean_active_fraction_hits'], '.0%')} / {f(s['mean_compute_fraction_hits'], '.0%')} |",
    ])


def make_plots(rows: list[dict[str, Any]], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"hit": "#2e7d32", "miss": "#c62828", "dense": "#546e7a"}
    names = []
    fig, ax = plt.subplots(figsize=(9, 3.6))
    for i, r in enumerate(rows):
        dec = r["decision"] if r["phase"] == "stream" else "dense"
        ax.bar(i, r["latency_s"] or 0.0, color=colours.get(dec, "#999999"))
    from matplotlib.patches import Patch

    handles = [Patch(color=colours["dense"], label="warm-up (dense, recorded)"),
               Patch(color=colours["hit"], label="stream: cache hit"),
               Patch(color=colours["miss"], label="stream: miss (dense fallback)")]
    n_warm = sum(r["phase"] == "warm" for r in rows)
    ax.axvline(n_warm - 0.5, color="black", lw=0.8, ls="--")
    ax.set_xticks(range(len(rows)), [r["rid"] for r in rows], rotation=90, fontsize=7)
    ax.set_ylabel("latency (s, server side)")
    ax.set_title("Latency per request by decision")
    ax.legend(handles=handles, fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "latency.png", dpi=110)
    plt.close(fig)
    names.append("latency.png")

    stream = [r for r in rows if r["phase"] == "stream"]
    fig, ax = plt.subplots(figsize=(9, 3.0))
    hits = 0
    rate = []
    for i, r in enumerate(stream, 1):
        hits += r["decision"] == "hit"
        rate.append(hits / i)
    ax.plot(range(1, len(stream) + 1), rate, marker="o", color="#2e7d32")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("stream request")
    ax.set_ylabel("cumulative hit rate")
    ax.set_title("Hit rate over the stream")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "hit_rate.png", dpi=110)
    plt.close(fig)
    names.append("hit_rate.png")
    return names


def write_html(out: Path, rows: list[dict[str, Any]], s: dict[str, Any], plots: list[str],
               info: dict[str, Any]) -> Path:
    by_entry = {r["written"]: r for r in rows if r.get("written")}
    e = html.escape
    banner = "" if not info["uncertified"] else (
        '<p class="warn"><b>UNCERTIFIED development rule.</b> ' + e(info["rule"]) +
        ' This run shows the mechanics only; it bounds no risk.</p>')
    body = []
    for r in rows:
        clip = f'<img src="{e(r["clip"])}" width="128">' if r["clip"] else "(no clip)"
        if r.get("dense_clip"):
            clip += f'<br><img src="{e(r["dense_clip"])}" width="128" title="dense twin (plain KSampler)"><br>' \
                    '<small>dense twin</small>'
        dlat = "" if r.get("dense_latency_s") is None else f" / {r['dense_latency_s']:.2f}"
        src = by_entry.get(r["reused"]) if r["decision"] == "hit" else None
        reused = ""
        if src is not None:
            reused = (f'<img src="{e(src["clip"])}" width="96" title="{e(src["prompt"])}"><br>'
                      f'{e(src["rid"])}: {e(src["prompt"])}') if src["clip"] else e(src["rid"])
        act = "" if r["active_fraction"] is None or r["decision"] != "hit" else f"{r['active_fraction']:.0%}"
        comp = "" if r["compute_fraction"] is None else f"{r['compute_fraction']:.0%}"
        lat = "" if r["latency_s"] is None else f"{r['latency_s']:.2f}"
        body.append(
            f'<tr class="{e(str(r["decision"]))}"><td>{e(r["rid"])}<br><small>{e(r["kind"])}</small></td>'
            f'<td>{e(r["prompt"])}<br><small>seed {r["seed"]}</small></td><td>{clip}</td>'
            f'<td><b>{e(str(r["decision"]).upper())}</b></td><td>{reused}</td><td>{act}</td><td>{comp}</td>'
            f'<td>{lat}{dlat}</td><td><small>{e(r["summary"][:400])}</small></td></tr>')
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Carnator demo report</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 24px; }}
table {{ border-collapse: collapse; }} td, th {{ border: 1px solid #ccc; padding: 4px 6px; vertical-align: top; }}
tr.hit td {{ background: #e8f5e9; }} tr.miss td {{ background: #fff3f3; }}
img {{ image-rendering: pixelated; }} .warn {{ background: #fff3cd; padding: 8px; border: 1px solid #e0b000; }}
</style></head><body>
<h1>Carnator demo: cross-request reuse through the ComfyUI API queue</h1>
<p>ComfyUI {e(info['comfyui'])} on {e(info['machine'])}; embedded model; {s['warm']} warm-up requests then a stream of
{s['stream']} (workload digest {e(info['workload']['digest'])}). Rule: {e(info['rule'])}.
Workflows: {e(info['graphs'])}. Total wall time {info['seconds']:.0f} s.</p>
{banner}
<h2>Summary</h2>
{markdown_to_html(summary_table(s))}
<p>Latency is server-side (execution start to success in <code>/history</code>), every stage included (probe,
signature, retrieval, filter, sampling or dense fallback, cache write, decode, WebP encoding). Every stream request
is followed in the queue by its <i>dense twin</i>: the same request through a plain KSampler graph (nothing cached),
so each speedup compares the same request measured the same way, under the same load; its clip is shown under the
request's (what the user would otherwise have got).</p>
<h2>Plots</h2>
{''.join(f'<img src="{e(p)}" style="max-width:100%;image-rendering:auto"><br>' for p in plots)}
<h2>Requests</h2>
<table><tr><th>request</th><th>prompt</th><th>clip</th><th>decision</th><th>reused entry (its clip)</th>
<th>active</th><th>compute</th><th>latency (s) / dense twin</th><th>filter</th></tr>
{''.join(body)}
</table></body></html>
"""
    path = out / "report.html"
    path.write_text(page, encoding="utf-8")
    return path


def markdown_to_html(table: str) -> str:
    lines = [ln for ln in table.splitlines() if ln.strip() and not set(ln.replace("|", "").strip()) <= {"-"}]
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cells[0])
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in cells[1:])
    return f"<table><tr>{head}</tr>{rows}</table>"


# ---------------------------------------------------------------------------------------------------- main
def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(ap, warm=8, stream=16)
    ap.set_defaults(mix="0,0.2,0.15,0.65")  # no exact repeats: ComfyUI's own output cache would answer them
    ap.add_argument("--quick", action="store_true", help="2 warm + 3 stream requests (for tests)")
    ap.add_argument("--out", type=Path, default=ROOT / "artifacts" / "demo", help="report folder")
    ap.add_argument("--weights", type=Path, default=DEFAULT_WEIGHTS, help="embedded weights (copied first)")
    ap.add_argument("--dev-thresholds", default="8,0.5,1.0,10",
                    help="context,size,shape,appearance of the UNCERTIFIED rule used when no certified one applies")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the queue")
    ap.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for the server to start")
    args = ap.parse_args(argv)
    if args.quick:
        args.warm, args.stream = 2, 3
    t_start = time.time()
    wl = build_workload(spec_from_args(args))
    out = args.out
    if out.exists():
        shutil.rmtree(out)
    (out / "clips").mkdir(parents=True)
    warm_graph, warm_src = load_graph(WARM_WORKFLOW, stream=False)
    stream_graph, stream_src = load_graph(STREAM_WORKFLOW, stream=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="carnator-demo-") as tmp:
        base = Path(tmp)
        weights = base / "models" / "carnator_embedded_demo.safetensors"
        weights.parent.mkdir(parents=True)
        shutil.copyfile(args.weights, weights)  # a checkpoint written meanwhile must not change the model mid-demo
        # A generous start-up limit: on a busy machine ComfyUI's import of torch and its nodes is slow.
        with ComfyServer(base, log_path=out / "server.log", startup_timeout=args.startup_timeout) as server:
            info = server.get("/object_info")
            ours = sorted((name, spec.get("display_name", name)) for name, spec in info.items()
                          if spec.get("python_module", "").endswith("carnator") or name.startswith("Carnator"))
            version = server.get("/system_stats")["system"]["comfyui_version"]
            print(f"ComfyUI {version} on {server.url}: {len(info)} node types, {len(ours)} from Carnator")
            for name, display in ours:
                print(f"  {name:32s} {display}")
            print(f"\nworkload: {json.dumps(describe(wl))}")
            client = ComfyClient(server.url, timeout=args.timeout)

            def show(row: dict[str, Any]) -> None:
                print(fmt_row(row), flush=True)

            print(f"\n== warm-up: {len(wl.warm)} requests through POST /prompt ({warm_src}) ==", flush=True)
            rows += serve_phase(client, warm_graph, wl.warm, str(weights), "embedded.json", False, base,
                                out / "clips", show)
            rule_file, uncertified, rule_desc = choose_rule(server, base, args.dev_thresholds)
            print(("\n!! " if uncertified else "\n") + f"risk rule: {rule_desc}", flush=True)
            print(f"\n== stream: {len(wl.stream)} requests through POST /prompt ({stream_src}) ==", flush=True)
            rows += serve_phase(client, stream_graph, wl.stream, str(weights), rule_file, uncertified, base,
                                out / "clips", show, twins=True)
            stats = server.get("/carnator/cache/stats?" + urllib.parse.urlencode({"directory": CACHE_DIR}))
    s = summary(rows)
    print("\n" + summary_table(s))
    print(f"cache: {stats.get('entries')} entries, {stats.get('lookups')} lookups, {stats.get('hits')} hits")
    plots = make_plots(rows, out)
    meta = {"comfyui": version, "machine": f"{os.cpu_count()} CPUs", "workload": describe(wl), "rule": rule_desc,
            "uncertified": uncertified, "graphs": f"warm: {warm_src}; stream: {stream_src}",
            "seconds": time.time() - t_start}
    report = write_html(out, rows, s, plots, meta)
    (out / "results.json").write_text(json.dumps({"summary": s, "rows": rows, "meta": meta}, indent=1) + "\n",
                                      encoding="utf-8")
    print(f"\nreport: {report}  ({meta['seconds']:.0f}s in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
