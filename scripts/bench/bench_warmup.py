#!/usr/bin/env python
"""Warm-up end to end: the Table-1 warm set, an idle warm-up of a stated budget, then the Table-1 stream — over HTTP.

    OMP_NUM_THREADS=1 .host/venv/bin/python scripts/bench/bench_warmup.py --out artifacts/warmup_e2e \\
        --warm 24 --stream 300 --workload-seed 7 --warmup-minutes 20 --dense-every 6
    .host/venv/bin/python scripts/bench/bench_warmup.py --out artifacts/warmup_e2e --report

What it does: starts ComfyUI (``tests/harness_server.py``) with a base directory under ``--out`` (kept; the run
resumes: requests already in ``requests.jsonl`` are skipped, a finished warm-up is not repeated), serves the
workload's warm set as the shipped embedded workflow in learning mode (``bench_learn.graphs``: a rule file that does
not exist), then switches the idle-time worker on (``POST /carnator/warmup {"mode": "idle"}``) and leaves the queue
empty for ``--warmup-minutes`` of wall time (``warmup.json``: the worker's status every 30 s and at the end, and the
namespace's ``rule_state``), switches it off, and serves the stream as ``bench_learn`` does (a dense twin every
``--dense-every``-th request, every hit and every audit). With ``--warmup-minutes 0`` it is the same run without
warm-up, the comparison.

The report: kinds on before the stream (provisional or certified), warm-up labels and compute, requests to the
first hit, the stream's speed against dense over its first 100 and 300 requests (every request's server latency —
labelling and audits included — against the dense twins' mean latency), hits, and the hits' excess judged offline
against their dense twins by the embedded checker (``bench_learn.offline_label``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

from repo_package import register_package  # noqa: E402

register_package()

from api_client import ComfyClient  # noqa: E402
from bench_learn import graphs, latency_s, offline_label, run_one, saved  # noqa: E402
from harness_server import ComfyServer  # noqa: E402
from workload import add_learning_run_args, add_workload_args, spec_from_args  # noqa: E402

from carnator.carnator_core.lab.workload import build_workload  # noqa: E402

CACHE_DIR = "learn_e2e_cache"


def _record(rep: dict[str, Any], entry: dict[str, Any], req: Any, i: int) -> dict[str, Any]:
    rs = rep.get("rule_state") or {}
    return {"i": i, "rid": req.rid, "kind": req.kind, "prompt": req.prompt, "seed": req.seed,
            "latency_s": latency_s(entry), "decision": rep["decision"], "mode": rep["mode"],
            "latent": saved(entry), "state": rs.get("state"), "message": rs.get("message"),
            "provisional": rs.get("provisional", []), "confirmed": rs.get("confirmed", []),
            "strata_on": sorted(k for k, v in rs.get("strata", {}).items() if v.get("state") in (
                "certified", "audited", "provisional", "confirmed")),
            "audit": "audit:" in (rep.get("decision_summary") or ""), "t": time.time()}


def serve(args: argparse.Namespace) -> None:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "requests.jsonl"
    done = {json.loads(line)["rid"] for line in log_path.open(encoding="utf-8")} if log_path.exists() else set()
    wl = build_workload(spec_from_args(args))
    (out / "workload.json").write_text(json.dumps({"spec": wl.spec.to_json(), "digest": wl.digest()}, indent=1))
    graph, dense, sampler = graphs(str(Path(args.weights).resolve()), args.budget, args.audit)
    with ComfyServer(out / "comfy", startup_timeout=900) as server:
        client = ComfyClient(server.url, timeout=1800)
        for phase, reqs in (("warm", wl.warm), ("stream", wl.stream)):
            if phase == "stream":
                warm_up(server, out, args.warmup_minutes)
            for i, req in enumerate(reqs):
                if req.rid in done:
                    continue
                entry = run_one(client, graph, req.prompt, req.seed, f"e2e/{req.rid}_c")
                if sampler not in entry["outputs"]:  # ComfyUI's node cache answered the same graph
                    rep = {"decision": "hit", "mode": "node_cache", "rule_state": {}}
                    entry["outputs"]["save"] = {"latents": [{"subfolder": "", "filename": ""}]}
                else:
                    rep = entry["outputs"][sampler]["carnator_report"][0]
                rec = {"phase": phase, **_record(rep, entry, req, i)}
                hit = rep["decision"] == "hit" and rep["mode"] not in ("exact", "node_cache")
                if phase == "stream" and (i % args.dense_every == 0 or hit or rec["audit"]):
                    d = run_one(client, dense, req.prompt, req.seed, f"e2e/{req.rid}_d")
                    rec["dense_latency_s"] = latency_s(d)
                    rec["dense_latent"] = saved(d)
                with log_path.open("a", encoding="utf-8") as f:
                    f.write(json.dumps(rec) + "\n")
                print(f"[{phase} {i + 1}/{len(reqs)}] {req.kind:15s} {rep['decision']:5s} {rec['latency_s'] or 0:.2f}s"
                      f" dense {rec.get('dense_latency_s') or 0:.2f}s | {rec['state']} on: {rec['strata_on']}",
                      flush=True)


def warm_up(server: Any, out: Path, minutes: float) -> None:
    """The idle period: the worker on for ``minutes`` of wall time with the queue empty (skipped when done)."""
    path = out / "warmup.json"
    if path.exists() or minutes <= 0:
        return
    server.post("/carnator/warmup", {"mode": "idle", "max_labels": 0})
    t0 = time.time()
    trace = []
    while time.time() - t0 < 60.0 * minutes:
        time.sleep(min(30.0, max(0.0, 60.0 * minutes - (time.time() - t0))))
        st = server.get("/carnator/warmup")
        trace.append({"t_s": round(time.time() - t0, 1), **{k: st[k] for k in ("labels", "attempts", "no_label",
                                                                                "cost_s", "by_kind", "doing")}})
        print(f"[warm-up {trace[-1]['t_s']:.0f} s] {st['labels']} labels {st['by_kind']} | {st['doing'][:100]}",
              flush=True)
    status = server.post("/carnator/warmup", {"mode": "off"})
    rules = server.get(f"/carnator/rules?directory={CACHE_DIR}")
    path.write_text(json.dumps({"minutes": minutes, "wall_s": round(time.time() - t0, 1), "status": status,
                                "trace": trace, "rules": rules}, indent=1))


def report(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out).resolve()
    rows = [json.loads(line) for line in (out / "requests.jsonl").open(encoding="utf-8")]
    stream = [r for r in rows if r["phase"] == "stream"]
    wu = json.loads((out / "warmup.json").read_text()) if (out / "warmup.json").exists() else None
    summary: dict[str, Any] = {"warm_requests": sum(r["phase"] == "warm" for r in rows), "stream_requests": len(stream)}
    if wu is not None:
        ns = (wu["rules"].get("namespaces") or [{}])[0]
        summary["warmup"] = {"minutes": wu["minutes"], "labels": wu["status"]["labels"],
                             "by_kind": wu["status"]["by_kind"], "cost_s": wu["status"]["cost_s"],
                             "attempts": wu["status"]["attempts"], "no_label": wu["status"]["no_label"],
                             "kinds_on_before_stream": sorted(ns.get("provisional", []) + ns.get("confirmed", [])),
                             "warm_state": (ns.get("warmup") or {}).get("message")}
    first_hit = next((r["i"] + 1 for r in stream if r["decision"] == "hit" and r["mode"] not in ("exact",
                                                                                                 "node_cache")), None)
    summary["requests_to_first_hit"] = first_hit
    dense = [r["dense_latency_s"] for r in stream if r.get("dense_latency_s")]
    for n in (100, 300):
        part = stream[:n]
        if len(part) < n or not dense:
            continue
        served = sum(r["latency_s"] or 0.0 for r in part)
        summary[f"ratio_first_{n}"] = round(statistics.mean(dense) * len(part) / served, 3)
        summary[f"hits_first_{n}"] = sum(r["decision"] == "hit" and r["mode"] not in ("exact", "node_cache")
                                         for r in part)
    hits = [r for r in stream if r["decision"] == "hit" and r["mode"] not in ("exact", "node_cache")]
    if hits:  # each hit judged against its dense twin by the embedded checker (the judge the labels used)
        summary["hits_offline_excess"] = offline_label(out, hits)
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(ap, warm=24, stream=300)
    add_learning_run_args(ap, out="artifacts/warmup_e2e", dense_every=6,
                          dense_help="a dense twin after every k-th stream request")
    ap.add_argument("--warmup-minutes", type=float, default=20.0, help="idle warm-up between warm set and stream")
    ap.add_argument("--report", action="store_true", help="only print the report of what is done so far")
    args = ap.parse_args(argv)
    if not args.report:
        serve(args)
    print(json.dumps(report(args), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
