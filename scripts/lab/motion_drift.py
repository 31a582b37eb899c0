#!/usr/bin/env python
"""How differently each labelled pair's objects drift over the clip, read from the two Early Signatures — the
evidence a motion gate in the filter would read (offline; the runtime never imports it).

``measure``: re-runs the probe and signature of every query of a ``make_pairs.py`` run (same seed, warm set and
queries: the run's work folder holds its cache) and recalls its candidates as the labelling did, then writes per
(request, candidate) the largest drift difference over the objects both name (``reuse.drift_difference`` of the
thresholded masks, as a fraction of the token grid's larger side; null where no drift can be read). No sampling
beyond the probe; the labels are not touched.

    .host/venv/bin/python scripts/lab/motion_drift.py measure --work runs/a18/w78 --seed 78 \\
        --out runs/a18/drift_s78.jsonl

``gate``: what a motion gate (refuse a candidate whose drift difference exceeds G) would add to a rule on labelled
pairs that carry those drifts: per G the rule's b, c, coverage and bound, prompt-only at the same coverage, and the
paired sign test between them (as ``rule_report.py``).

    .host/venv/bin/python scripts/lab/motion_drift.py gate --pairs runs/a18/a18.jsonl --rule rules/embedded.json \\
        --drift s78=runs/a18/drift_s78.jsonl ... --gates 0.02,0.03,0.045,0.06
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts" / "lab"))

import conftest  # noqa: E402,F401  (registers the `carnator` package; knows where the host's ComfyUI is)


def measure(args: argparse.Namespace) -> int:
    import make_pairs

    from carnator.carnator_core.request import probe_request, recall, signature_stage
    from carnator.carnator_core.reuse import ReuseConfig, drift_difference, object_support

    run = {"weights": args.weights, "seed": args.seed, "warm": args.warm, "queries": args.queries,
           "kinds": args.kinds, "p_same_seed": 0.5, "work": args.work, "top_k": args.top_k, "reuse_mode": "joint",
           "reuse_set": [], "easycache": ""}
    _warm, queries = make_pairs._requests(run)
    store, ctx = make_pairs._open(run, args.threads)
    threshold = ReuseConfig().mask_threshold
    done = set()
    out = Path(args.out)
    if out.exists():
        done = {json.loads(line)["request_id"] for line in out.read_text().splitlines() if line.strip()}
    t0 = time.perf_counter()
    with out.open("a", encoding="utf-8") as f:
        for i, req in enumerate(queries):
            if req.request_id in done:
                continue
            probe = probe_request(ctx.model, ctx.encode(req.prompt), ctx.negative(), ctx.latent, ctx.spec(req),
                                  ctx.options.probe, ctx.text_encoder)  # no store: labelling probes repeats too
            sig, _ = signature_stage(probe, ctx.options.signature)
            cands = recall(store, probe, ctx.options.top_k, ctx.options.min_similarity)
            grid = tuple(sig.grid)
            side = float(max(grid[1], grid[2]))
            drifts = {}
            for c in cands.items:
                worst = None
                for obj in sig.objects:
                    other = c.signature.get(obj.name)
                    if other is None:
                        continue
                    d = drift_difference(object_support(obj.mask, threshold), object_support(other.mask, threshold))
                    if d is not None:
                        worst = max(worst or 0.0, d / side)
                drifts[c.entry_id] = None if worst is None else round(worst, 5)
            f.write(json.dumps({"request_id": req.request_id, "drift": drifts}) + "\n")
            f.flush()
            if i % 25 == 0:
                print(f"{req.request_id} {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


def gate(args: argparse.Namespace) -> int:
    from rule_report import prompt_only_at  # prompt-only at the rule's coverage, as the report picks it

    from carnator.carnator_core.risk.certify import (
        accepted_pairs,
        certificate_bound,
        compare_paired,
        read_pairs_jsonl,
    )
    from carnator.carnator_core.risk.rule import RiskRule

    drift: dict[tuple[str, str], float | None] = {}
    for item in args.drift:
        prefix, path = item.split("=", 1)
        for line in Path(path).read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                for entry, d in r["drift"].items():
                    drift[(f"{prefix}:{r['request_id']}", entry)] = d
    store_entry = {}
    for line in Path(args.pairs).read_text().splitlines():
        r = json.loads(line)
        if "request_id" in r:
            store_entry[(r["request_id"], r["entry_id"])] = (r.get("diag") or {}).get("store_entry")
    _, pairs = read_pairs_jsonl(args.pairs)
    rule = RiskRule.load(args.rule)
    unknown = sum(1 for p in pairs if (p.request_id, store_entry.get((p.request_id, p.entry_id))) not in drift)
    print(f"{len(pairs)} pairs, {unknown} without a measured drift (they pass every gate)")
    print("| gate (fraction of the frame) | accepted | coverage | b | c | U | prompt-only b, c | paired: prompt-only "
          "worse / rule worse | sign test p |")
    print("|---|---|---|---|---|---|---|---|---|")
    for g in [None] + [float(x) for x in args.gates.split(",")]:
        def passes(p, g=g):
            d = drift.get((p.request_id, store_entry.get((p.request_id, p.entry_id))))
            return g is None or d is None or d <= g

        gated = [p if passes(p) else replace(p, missing=True) for p in pairs]  # a refused candidate, as missing
        n_req, acc = accepted_pairs(rule.thresholds, gated)
        b, c = sum(p.unsafe for p in acc), sum(p.better for p in acc)
        _, po = prompt_only_at(len(acc), pairs)
        cmp = compare_paired(po, acc, n_req)
        u = certificate_bound(rule.certificate.label, len(acc), b, c, rule.certificate.delta) if acc else 1.0
        print(f"| {'none' if g is None else g} | {len(acc)} | {len(acc) / n_req:.3f} | {b} | {c} | {u:.4f} | "
              f"{sum(p.unsafe for p in po)}, {sum(p.better for p in po)} | {cmp.a_worse} / {cmp.b_worse} | "
              f"{cmp.p_one_sided:.4f} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--work", required=True)
    m.add_argument("--seed", type=int, required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--weights", default="carnator_core/embedded/weights/carnator_embedded_v3.safetensors")
    m.add_argument("--warm", type=int, default=60)
    m.add_argument("--queries", type=int, default=350)
    m.add_argument("--top-k", type=int, default=3)
    m.add_argument("--kinds", default="")
    m.add_argument("--threads", type=int, default=1)
    g = sub.add_parser("gate")
    g.add_argument("--pairs", required=True)
    g.add_argument("--rule", required=True)
    g.add_argument("--drift", nargs="+", required=True, metavar="PREFIX=FILE")
    g.add_argument("--gates", default="0.02,0.03,0.045,0.06,0.09")
    args = ap.parse_args(argv)
    if args.cmd == "measure" and not args.kinds:
        from carnator.carnator_core.lab.pairs import QUERY_KINDS

        args.kinds = ",".join(QUERY_KINDS)
    return measure(args) if args.cmd == "measure" else gate(args)


if __name__ == "__main__":
    sys.exit(main())
