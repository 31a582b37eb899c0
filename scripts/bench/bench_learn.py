#!/usr/bin/env python
"""Learning mode end to end: an empty cache, no rule, the Table-1 workload streamed through a real ComfyUI server.

    nice -n 10 .host/venv/bin/python scripts/bench/bench_learn.py --out artifacts/learn_e2e --stream 300 \
        > artifacts/learn_e2e.log 2>&1 &
    .host/venv/bin/python scripts/bench/bench_learn.py --out artifacts/learn_e2e --report   # the figures so far

What it does: starts ComfyUI (``tests/harness_server.py``: ``main.py --cpu`` on a free loopback port) with a base
directory under ``--out`` (kept: the run is resumable — a restart skips the requests already in
``requests.jsonl``), and queues every stream request of the workload (``carnator_core/lab/workload.py``, no warm
set: the cache starts empty) over HTTP as the shipped ``workflows/api/embedded.json`` with its Risk Filter's rule
file set to a name that does not exist (learning mode) and SaveLatent instead of the preview. Every
``--dense-every``-th request, every hit and every audit is followed by its dense twin (the same request as a stock
KSampler graph, nothing cached), so the dense baseline is measured in the same process under the same load.
Latencies are the server's own (``execution_start`` → ``execution_success`` in ``/history``).

The report (``--report``, also printed at the end): requests until reuse switched on (per stratum), extra compute
spent labelling and auditing (the learning ledger in the cache folder's ``learn.sqlite``), the stream's speed-up
against dense over the whole run and after switch-on, the hits' excess failure measured afterwards by labelling each
served hit against its dense twin with the same judge (the embedded pixel checker), the offline protocol's compute
for the same labels, and when other learning settings would have switched on, replaying the same labels.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

from workload import add_learning_run_args, add_workload_args, register_package, spec_from_args  # noqa: E402

register_package()

from api_client import ComfyClient, set_request  # noqa: E402
from harness_server import ComfyServer  # noqa: E402

from carnator.carnator_core.lab.workload import build_workload  # noqa: E402

WORKFLOW = ROOT / "workflows" / "api" / "embedded.json"
CACHE_DIR = "learn_e2e_cache"
RULE_FILE = "learned_e2e.json"


def latency_s(entry: dict[str, Any]) -> float | None:
    """The server's wall time of one prompt (execution_start → execution_success timestamps, ms)."""
    ts = {ev: data.get("timestamp") for ev, data in entry.get("status", {}).get("messages", [])}
    if ts.get("execution_start") is None or ts.get("execution_success") is None:
        return None
    return (ts["execution_success"] - ts["execution_start"]) / 1000.0


def graphs(weights: str, budget: float, audit: float) -> tuple[dict[str, Any], dict[str, Any], str]:
    """(Carnator graph, dense twin graph, the Carnator sampler's node id), both saving their LATENT."""
    g = json.loads(WORKFLOW.read_text(encoding="utf-8"))
    sampler = next(k for k, n in g.items() if n["class_type"] == "CarnatorJointReuseSampler")
    probe = next(n for n in g.values() if n["class_type"] == "CarnatorEarlyProbe")["inputs"]
    for k in [k for k, n in g.items() if n["class_type"] in ("SaveAnimatedWEBP", "CarnatorEmbeddedDecode")]:
        del g[k]
    for n in g.values():
        t, i = n["class_type"], n["inputs"]
        if t == "CarnatorEmbeddedLoader":
            i["weights_path"] = weights
        elif t == "CarnatorCacheLoader":
            i["directory"] = CACHE_DIR
        elif t == "CarnatorRiskFilter":
            i.update(rule_file=RULE_FILE, mode="signature", learn_budget=budget, audit_share=audit)
    g["save"] = {"class_type": "SaveLatent", "inputs": {"samples": [sampler, 0], "filename_prefix": "e2e/x"}}
    d = {k: json.loads(json.dumps(n)) for k, n in g.items()
         if not (n["class_type"].startswith("Carnator") and not n["class_type"].startswith("CarnatorEmbedded"))
         and k != "save"}
    si = g[sampler]["inputs"]
    d["ks"] = {"class_type": "KSampler", "inputs": {
        "model": si["model"], "positive": si["positive"], "negative": si["negative"],
        "latent_image": si["latent_image"],
        "seed": probe["seed"], "steps": probe["steps"], "cfg": probe["cfg"], "sampler_name": probe["sampler_name"],
        "scheduler": probe["scheduler"], "denoise": 1.0}}
    d["save"] = {"class_type": "SaveLatent", "inputs": {"samples": ["ks", 0], "filename_prefix": "e2e/d"}}
    return g, d, sampler


def run_one(client: ComfyClient, graph: dict[str, Any], prompt: str, seed: int, prefix: str) -> dict[str, Any]:
    g = set_request(graph, prompt, seed)
    g["save"]["inputs"]["filename_prefix"] = prefix
    pid = client.queue(g)
    entry = client.wait_all([pid])[pid]
    if entry.get("status", {}).get("status_str") != "success":
        raise RuntimeError(f"prompt failed: {json.dumps(entry.get('status'))[:2000]}")
    return entry


def saved(entry: dict[str, Any]) -> str:
    (f,) = entry["outputs"]["save"]["latents"]
    return f"{f['subfolder']}/{f['filename']}"


def serve(args: argparse.Namespace) -> None:
    out = Path(args.out).resolve()  # ComfyUI runs from its own folder
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "requests.jsonl"
    done = {json.loads(line)["rid"] for line in log_path.open(encoding="utf-8")} if log_path.exists() else set()
    wl = build_workload(spec_from_args(args))
    (out / "workload.json").write_text(json.dumps({"spec": wl.spec.to_json(), "digest": wl.digest()}, indent=1))
    graph, dense, sampler = graphs(str(Path(args.weights).resolve()), args.budget, args.audit)
    with ComfyServer(out / "comfy", startup_timeout=900) as server:
        client = ComfyClient(server.url, timeout=1800)
        for i, req in enumerate(wl.stream):
            if req.rid in done:
                continue
            entry = run_one(client, graph, req.prompt, req.seed, f"e2e/{req.rid}_c")
            if sampler not in entry["outputs"]:
                # the same graph as the last prompt: ComfyUI's own node cache answered it (no node ran) — an exact
                # repeat answered before Carnator, as a user would see it
                rep = {"decision": "hit", "mode": "node_cache", "rule_state": {}}
                entry["outputs"]["save"] = entry["outputs"].get("save") or {"latents": [{"subfolder": "",
                                                                                         "filename": ""}]}
            else:
                rep = entry["outputs"][sampler]["carnator_report"][0]
            rec = {"i": i, "rid": req.rid, "kind": req.kind, "prompt": req.prompt, "seed": req.seed,
                   "latency_s": latency_s(entry), "decision": rep["decision"], "mode": rep["mode"],
                   "compute_fraction": rep.get("compute_fraction"), "latent": saved(entry),
                   "rule_state": {k: v for k, v in (rep.get("rule_state") or {}).items() if k != "strata"},
                   "strata_on": sorted(k for k, v in (rep.get("rule_state") or {}).get("strata", {}).items()
                                       if v["state"] in ("certified", "audited")),
                   "audit": "audit:" in (rep.get("decision_summary") or ""), "t": time.time()}
            hit = rep["decision"] == "hit" and rep["mode"] not in ("exact", "node_cache")
            if i % args.dense_every == 0 or hit or rec["audit"]:
                d = run_one(client, dense, req.prompt, req.seed, f"e2e/{req.rid}_d")
                rec["dense_latency_s"] = latency_s(d)
                rec["dense_latent"] = saved(d)
            with log_path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")
            rs = rec["rule_state"]
            print(f"[{i + 1}/{len(wl.stream)}] {req.kind:15s} {rep['decision']:5s} {rec['latency_s'] or 0:.2f}s "
                  f"dense {rec.get('dense_latency_s') or 0:.2f}s | {rs.get('state', '-')} {rs.get('labels', '-')}/"
                  f"{rs.get('needed', '-')} {rs.get('label', '')}", flush=True)


# ---------------------------------------------------------------------------------------------------- the report
def offline_label(base: Path, rows: list[dict[str, Any]], look: Path | None = None, look_zeros: int = 6,
                  settings: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Each served (non-exact) hit judged against its dense twin by the embedded checker: first with the run's own
    labels' settings (``settings``; the current second label when None: a run learned under an earlier checker
    reading is judged with that reading, so hits and labels are measured alike), then — when they differ — with the
    current second label too; each hit's clips are decoded once for both. One result per judge.
    ``look``: also write a strip (the dense twin, the hit, their difference; ``look_learn_labels.strip``) of every
    hit the first judge calls b or c and of ``look_zeros`` hits it calls 0 (evenly spaced over the run)."""
    from safetensors.torch import load_file

    from carnator.carnator_core.embedded import codec
    from carnator.carnator_core.judge import SECOND_LABEL, judge_for
    from carnator.carnator_core.judge.base import JudgeRequest, excess_label

    judges = [judge_for(None, "embedded", settings if settings is not None else SECOND_LABEL)]
    current = judge_for(None, "embedded", SECOND_LABEL)
    if dict(current.settings) != dict(judges[0].settings):
        judges.append(current)
    counts = [[0, 0] for _ in judges]  # b, c per judge
    seen: list[tuple[dict[str, Any], list[Any], int, Any]] = []
    for r in rows:
        if not (r["decision"] == "hit" and r["mode"] not in ("exact", "node_cache") and r.get("dense_latent")):
            continue
        clips = []
        for key in ("latent", "dense_latent"):
            lat = load_file(str(base / "comfy" / "output" / r[key]))["latent_tensor"]
            clips.append(codec.latent_to_rgb(lat.float())[0].numpy())
        req = JudgeRequest(prompt=r["prompt"], seed=int(r["seed"]))
        for j, (judge, cnt) in enumerate(zip(judges, counts)):
            lab = excess_label(judge, clips[0], clips[1], req)
            cnt[0], cnt[1] = cnt[0] + int(lab.b), cnt[1] + int(lab.c)
            if j == 0:
                seen.append((r, clips, int(lab.b) - int(lab.c), lab))
    if look is not None and seen:
        from look_learn_labels import frame_indices, save_strip, strip

        zeros = [s for s in seen if s[2] == 0]
        picked = [s for s in seen if s[2] != 0] + zeros[:: max(1, len(zeros) // max(look_zeros, 1))][:look_zeros]
        for r, (hit, dense), x, lab in picked:
            frames = frame_indices(hit.shape[0], 4)
            why = "; ".join(str(v)[:60] for v in lab.reuse.reasons) or "-"
            # (a hit's cached clip is not kept: the first row repeats the dense twin)
            save_strip(look / f"hit_{r['i']:04d}_x{x:+d}.png", strip(dense, dense, hit, frames, 2),
                       f"request {r['i']} x={x:+d} {r['prompt'][:70]} | reuse fails: {why}",
                       rows=("dense", "dense", "hit", "diff"))
    n = len(seen)
    out = [{"hits": n, "b": b, "c": c, "excess": (b - c) / n if n else None, "judge": judge.name,
            "settings": dict(judge.settings)} for judge, (b, c) in zip(judges, counts)]
    if out:  # which hits the first judge calls b or c, and why (its reasons for the hit's and the twin's clip)
        out[0]["flagged"] = [{"i": r["i"], "kind": r["kind"], "prompt": r["prompt"], "x": x,
                              "reuse_fails": [str(v) for v in lab.reuse.reasons],
                              "dense_fails": [str(v) for v in lab.dense.reasons]}
                             for r, _, x, lab in seen if x != 0]
    return out


def replay(store: Any, ns: str) -> dict[str, Any]:
    """When other settings would have switched on, replaying the same labels (the label policy unchanged).

    The record is replayed in time order (covariates and labels by their time stamps) and the state derived after
    each, as ``runtime.observe`` derives it while serving: the pilot then ends at the same label and the fits are
    recorded at the same points, so the default settings reproduce the run's own switch-on. (Before 2026-12-08 it
    added a request's covariates only when a label needed them and derived after labels only: the pilot's last
    label and so the counted labels could differ by one, and a switch-on on the run's last label of the kind was
    not reproduced.)"""
    from carnator.carnator_core.learn.learner import Learner, LearnSettings

    labels = store.labels(ns)
    covs = store.covariates(ns)
    merged = sorted([(c.t, 0, i) for i, c in enumerate(covs)] + [(lab.t, 1, i) for i, lab in enumerate(labels)])
    out = {}
    for name, kw in {"default (graph over the pilot's order, α 0.05, δ 0.1)": {},
                     "Bonferroni over 10 strata, fits halving (the earlier procedure)": {"strata": "bonferroni"},
                     "strata='none' (each stratum at δ, as the offline per-stratum certificate)": {"strata": "none"},
                     "α 0.1, graph": {"alpha": 0.1}}.items():
        ln = Learner(":memory:", LearnSettings(**kw))
        first: dict[str, int] = {}
        n_labels = 0
        for _, what, i in merged:
            if what == 0:
                ln.store.add_covariate(ns, covs[i])
            else:
                ln.store.add_label(ns, labels[i])
                n_labels += 1
            for st, v in ln.state(ns).items():
                if v.on and st not in first:
                    first[st] = n_labels
        out[name] = {"labels": len(labels), "switched_on_after_labels": first}
    return out


def labelling_detail(store: Any, ns: str, budget: float, audit: float) -> dict[str, Any]:
    """What the coin and the cached entry as the unit did, from the record alone (report only; nothing here feeds
    the run). The record is replayed in time order into a fresh learner with the run's settings (as ``replay``
    does), and each served request with a candidate is classified the way ``runtime.observe`` decides a label:
    whether it could be labelled then (its kind not on, not missing, inside the kind's current fit, its cached
    entry not yet counted by that fit's test), whether the coin (``label_draw``) drew it, whether it was labelled.
    Then each kind's shadow labels: made, on how many distinct cached entries, counted by its current fit's test
    (one per entry), and why the others are not counted (the pilot, not reusable, an older judge reading, a fit
    replaced since, an entry already counted)."""
    from carnator.carnator_core.learn.learner import (
        STRATA,
        Fit,
        Learner,
        LearnSettings,
        accepts,
        fit_window,
        label_draw,
        reading_in_force,
        same_label,
    )

    settings = LearnSettings(budget=budget, audit_share=audit)
    covs = store.covariates(ns)
    labels = store.labels(ns)
    audit_keys = {lab.request_key for lab in labels if lab.kind == "audit"}
    labelled = {lab.request_key for lab in labels if lab.kind == "shadow"}
    ln = Learner(":memory:", settings)
    merged = sorted([(c.t, 0, i) for i, c in enumerate(covs)] + [(lab.t, 1, i) for i, lab in enumerate(labels)])
    cls: dict[str, dict[str, int]] = {}
    mismatch = 0
    for _, what, i in merged:
        if what == 1:
            ln.store.add_label(ns, labels[i])
            continue
        cov = covs[i]
        ln.store.add_covariate(ns, cov)
        if cov.request_key in audit_keys:
            continue
        st = ln.state(ns).get(cov.stratum)
        if st is not None and st.on:
            why = "kind on"
        elif cov.stratum not in STRATA:
            why = "not a kind"
        elif cov.missing:
            why = "missing"
        elif st is not None and st.fit is not None and not accepts(st.fit.thresholds, cov.vector, cov.missing):
            why = "outside the current fit"
        elif st is not None and cov.entry_id in st.entries:
            why = "entry already counted"
        else:
            why = "labelable"
        c = cls.setdefault(cov.stratum, {})
        drawn = label_draw(settings.label_share, cov.request_key)
        made = cov.request_key in labelled
        key = why if why != "labelable" else ("labelled" if made else ("drawn, not labelled (budget)" if drawn
                                                                        else "not drawn"))
        c[key] = c.get(key, 0) + 1
        mismatch += int(made and why != "labelable") + int(made and not drawn)
    lab_n = sum(sum(v for k, v in c.items() if k in ("labelled", "not drawn", "drawn, not labelled (budget)"))
                for c in cls.values())
    lab_drawn = sum(c.get("labelled", 0) + c.get("drawn, not labelled (budget)", 0) for c in cls.values())
    plain = [c for c in covs if c.request_key not in audit_keys]
    # each kind's shadow labels against its tests (``Learner._derive``'s counting, read back)
    events = store.events(ns)  # the run's own record (the replay above only classifies the requests)
    fits: dict[str, list[Any]] = {}
    for e in events:
        if e.get("kind") == "fit":
            f = Fit.from_dict(e["fit"])
            fits.setdefault(f.stratum, []).append(f)
    replayed = {st: [f.to_dict() for f in fs] for st, fs in ln.fits(ns).items()}
    mismatch += int(replayed != {st: [f.to_dict() for f in fs] for st, fs in fits.items()})
    order = next(((list(e["order"]), int(e["since"])) for e in events if e.get("kind") == "order"), None)
    since = order[1] if order else None
    latest = reading_in_force(labels)
    per_kind: dict[str, dict[str, Any]] = {}
    counted: dict[tuple[str, int], set[str]] = {}
    for lab in sorted((x for x in labels if x.kind == "shadow"), key=lambda x: x.id):
        k = per_kind.setdefault(lab.stratum, {"made": 0, "entries": set(), "counted_current_fit": 0,
                                              "counted_replaced_fits": 0, "not_counted": {}})
        k["made"] += 1
        k["entries"].add(lab.entry_id)
        fs = fits.get(lab.stratum, [])
        if since is None or lab.id <= since:
            why = "pilot"
        elif not lab.reusable:
            why = "not reusable (region > max_active)"
        elif not same_label(lab, latest):
            why = "older judge reading"
        else:
            why = "outside every fit's window"
            win = fit_window(fs)
            for fit in fs:
                lo, hi = win[fit.index]
                if not lo < lab.id <= hi or not accepts(fit.thresholds, lab.vector, lab.missing):
                    continue
                seen = counted.setdefault((lab.stratum, fit.index), set())
                if lab.entry_id in seen:
                    why = "entry already counted"
                    continue
                seen.add(lab.entry_id)
                why = ""
                k["counted_current_fit" if fit is fs[-1] else "counted_replaced_fits"] += 1
        if why:
            k["not_counted"][why] = k["not_counted"].get(why, 0) + 1
    for st, k in per_kind.items():
        k["distinct_entries_of_labels"] = len(k.pop("entries"))
        k["fits"] = len(fits.get(st, []))
        cur = fits.get(st, [])[-1:] or [None]
        k["distinct_entries_counted_current_fit"] = len(counted.get((st, cur[0].index), ())) if cur[0] else 0
        k["requests_with_candidate"] = sum(c.stratum == st for c in plain)
        k["distinct_entries_recalled"] = len({c.entry_id for c in plain if c.stratum == st})
    return {
        "label_share_setting": settings.label_share,
        "coin_share_over_requests_with_a_candidate": (sum(label_draw(settings.label_share, c.request_key)
                                                          for c in plain) / len(plain)) if plain else None,
        "labelable": lab_n, "labelable_drawn": lab_drawn,
        "coin_share_over_labelable": lab_drawn / lab_n if lab_n else None,
        "requests_with_a_candidate": len(plain),
        "classified_per_kind": cls, "replay_mismatches": mismatch,
        "order": order[0] if order else None, "pilot_last_label_id": since,
        "per_kind": per_kind,
    }


def paired_ratio(rows: list[dict[str, Any]]) -> float | None:
    """Σ dense twin latency / Σ served latency over requests that have a twin (the same server, moments apart)."""
    served = sum(r["latency_s"] for r in rows)
    return sum(r["dense_latency_s"] for r in rows) / served if rows and served else None


def per_request_ratio(rows: list[dict[str, Any]]) -> float | None:
    """n / Σ (served latency / its dense twin's latency) over requests that have a twin: each request against its own
    twin, so a slow stretch of a shared machine weighs its requests no more than any others (the headline; the sum
    ratio ``paired_ratio`` beside it)."""
    ratios = [r["latency_s"] / r["dense_latency_s"] for r in rows if r.get("dense_latency_s")]
    return len(ratios) / sum(ratios) if ratios and sum(ratios) > 0 else None


def twin_step(rows: list[dict[str, Any]]) -> int:
    """The run's ``--dense-every`` read back from its record: the gcd of the positions of the requests that got a
    dense twin for their position alone (neither a hit nor an audit)."""
    import math

    k = 0
    for r in rows:
        if r.get("dense_latency_s") is not None and not r.get("audit") and not (
                r["decision"] == "hit" and r["mode"] not in ("exact", "node_cache")):
            k = math.gcd(k, int(r["i"]))
    return k or 1


def position_sample(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The requests twinned for their position (every ``--dense-every``-th, whatever was served): a sample of the
    stream that does not depend on the outcome. Every hit and audit also has a twin, so the twinned requests as a
    whole over-weight hits (with a twin every 6th request, a hit weighs six times a miss) and their ratio is not the
    stream's; the per-request ratio over this sample is."""
    k = twin_step(rows)
    return [r for r in rows if r.get("dense_latency_s") and r["latency_s"] and r["i"] % k == 0]


def to_switch_on(rows: list[dict[str, Any]], labels: list[Any], on_at: int | None,
                 dense_med: float | None) -> dict[str, Any] | None:
    """What the first certificate cost: the requests served and the shadow labels made up to the request that
    switched reuse on, their compute against the compute served meanwhile, and the same labels offline (a dense
    and a reuse run each)."""
    if not on_at:
        return None
    t_on = rows[on_at - 1]["t"]  # the row's time stamp is taken when the request (and its label) has finished
    before = [lab for lab in labels if lab.kind == "shadow" and lab.t <= t_on]
    label_s = sum(lab.cost_s for lab in before)
    served_s = sum(r["latency_s"] for r in rows[:on_at] if r["latency_s"]) - label_s
    mean = label_s / len(before) if before else 0.0
    offline = len(before) * ((dense_med or 0.0) + mean)
    return {"requests": on_at, "labels": len(before), "b": sum(lab.x == 1 for lab in before),
            "c": sum(lab.x == -1 for lab in before), "label_s": round(label_s, 2), "served_s": round(served_s, 2),
            "extra_share": label_s / served_s if served_s else None, "offline_equivalent_s": round(offline, 2),
            "online_over_offline": label_s / offline if offline else None}


def window_speedup(rows: list[dict[str, Any]], on_at: int | None) -> float | None:
    """After switch-on: the median of the dense twins of that window × its requests / Σ served (every request
    served counts; the twins give only the dense time of the same stretch of a shared machine)."""
    after = [r for r in rows if on_at and r["i"] + 1 > on_at]
    dense = [r["dense_latency_s"] for r in after if r.get("dense_latency_s")]
    served = sum(r["latency_s"] for r in after if r["latency_s"])
    return statistics.median(dense) * len(after) / served if dense and served else None


def report(args: argparse.Namespace) -> dict[str, Any]:
    from carnator.carnator_core.learn.labels import LabelStore

    out = Path(args.out)
    rows = [json.loads(line) for line in (out / "requests.jsonl").open(encoding="utf-8")]
    store = LabelStore(out / "comfy" / "output" / CACHE_DIR)
    (ns,) = store.namespaces() or ("",)
    led = store.ledger(ns)
    labels = store.labels(ns)
    on_at = next((r["i"] + 1 for r in rows if r["strata_on"]), None)
    dense = [r["dense_latency_s"] for r in rows if r.get("dense_latency_s")]
    dense_med = statistics.median(dense) if dense else None

    def speedup(rs: list[dict[str, Any]]) -> float | None:
        served = sum(r["latency_s"] for r in rs if r["latency_s"])
        return (dense_med * len(rs) / served) if rs and dense_med and served else None

    paired = [r for r in rows if r.get("dense_latency_s") and r["latency_s"]]
    sample = position_sample(rows)
    label_s = sum(lab.cost_s for lab in labels if lab.kind == "shadow")
    n_shadow = sum(lab.kind == "shadow" for lab in labels)
    mean_label = label_s / n_shadow if n_shadow else None
    hit_labels = offline_label(out, rows, Path(args.look_hits) if args.look_hits else None,
                               settings=dict(labels[-1].judge_settings) if labels else None)
    summary = {
        "requests": len(rows), "workload": json.loads((out / "workload.json").read_text()),
        "switched_on_at_request": on_at, "strata_on_at_end": rows[-1]["strata_on"] if rows else [],
        "rule_state_at_end": rows[-1]["rule_state"] if rows else {},
        "hits": sum(r["decision"] == "hit" and r["mode"] not in ("exact", "node_cache") for r in rows),
        "exact_answers": sum(r["mode"] in ("exact", "node_cache") for r in rows),
        "audits": sum(lab.kind == "audit" for lab in labels), "shadow_labels": n_shadow,
        "labels_b_c": [sum(lab.x == 1 for lab in labels), sum(lab.x == -1 for lab in labels)],
        "ledger": led, "extra_share": (led["label_s"] + led["audit_s"]) / led["served_s"] if led["served_s"] else None,
        "dense_median_s": dense_med, "dense_twins": len(dense),
        "speedup_whole_run_vs_dense_median": speedup(rows),
        "speedup_after_switch_on": speedup([r for r in rows if on_at and r["i"] + 1 > on_at]) if on_at else None,
        # the headline ratios over the requests twinned for their position (``position_sample``); the ratios over
        # every twinned request (hits and audits always twinned: hits over-weighted) beside them, marked so
        "dense_every_read_back": twin_step(rows),
        "paired_ratio_dense_over_served": paired_ratio(sample),
        "per_request_ratio_vs_dense_twin": per_request_ratio(sample),
        "per_request_ratio_before_switch_on": per_request_ratio([r for r in sample
                                                                 if not on_at or r["i"] + 1 <= on_at]),
        "per_request_ratio_after_switch_on": per_request_ratio([r for r in sample if on_at and r["i"] + 1 > on_at]),
        "twinned_requests_after_switch_on_sampled_by_position": len([r for r in sample if on_at
                                                                      and r["i"] + 1 > on_at]),
        "per_request_ratio_all_twins_hits_overweighted": per_request_ratio(paired),
        "per_request_ratio_after_switch_on_all_twins_hits_overweighted": per_request_ratio(
            [r for r in paired if on_at and r["i"] + 1 > on_at]),
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "mean_label_s": mean_label,
        # the offline protocol labels a request with a dense run and a reuse run (its pairs file), on warm caches
        "offline_equivalent_s": n_shadow * ((dense_med or 0) + (mean_label or 0)),
        "online_label_s": label_s,
        "to_switch_on": to_switch_on(rows, labels, on_at, dense_med),
        "paired_ratio_after_switch_on": paired_ratio([r for r in sample if on_at and r["i"] + 1 > on_at]),
        "speedup_after_switch_on_vs_window_dense_median": window_speedup(rows, on_at),
        "audits_b_c": [sum(lab.x == 1 for lab in labels if lab.kind == "audit"),
                       sum(lab.x == -1 for lab in labels if lab.kind == "audit")],
        "hits_offline_label": hit_labels[0],
        "hits_offline_label_current_judge": hit_labels[1] if len(hit_labels) > 1 else None,
        "replay": replay(store, ns) if labels else {},
        "labelling": labelling_detail(store, ns, args.budget, args.audit) if labels else {},
    }
    (out / "report.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(ap, warm=0, stream=300)
    add_learning_run_args(ap, out="artifacts/learn_e2e", dense_every=3,
                          dense_help="a dense twin after every k-th request (and every hit and audit)")
    ap.add_argument("--report", action="store_true", help="only print the report of the requests done so far")
    ap.add_argument("--look-hits", default="", help="with the report: a folder for strips (dense twin | hit | "
                    "difference) of every hit the offline label calls b or c and of six it calls 0")
    args = ap.parse_args(argv)
    if not args.report:
        serve(args)
    print(json.dumps(report(args), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
