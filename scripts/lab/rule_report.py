#!/usr/bin/env python
"""What a calibrated rule does on the labelled requests of one split, per request kind and scene.

    .host/venv/bin/python scripts/lab/rule_report.py --pairs rules/embedded_pairs.jsonl --rule rules/embedded.json

For the requests of ``--split`` (the certification split by default; rows carry their split): how many the rule
accepts (and reuses: a candidate over ``max_active`` is a miss), b (reuse fails where dense passes), c (the reverse),
the excess (b − c)/n and b/n, and the median counter-based compute and active fraction of the accepted hits
(``diag`` of the pairs rows) — per query kind, per scene (one / two objects), for all requests and for the
non-repeat ones. Then prompt-only reuse at the same coverage: the most similar candidate of the requests with the
highest top similarity, as many as the rule accepted (same sampler, so its region gate applies too), with its b
and c, and the two compared on the same requests (requests where prompt-only does worse than the rule, and the
reverse, with the exact one-sided sign test of "prompt-only is no worse"). Then, per axis (the four discrepancies,
the minimum prompt similarity, and "missing object"): the rule's threshold against the range the axis takes over
the split's pairs, how many pairs that axis *alone* rejected (every other check passes), and how many requests it
alone decided (with that check off the rule accepts them, or picks another candidate). An axis whose threshold lies
above every value it takes rejects nothing. With per-stratum certificates in the rule (and a ``change`` on the
rows), the strata table as certified. Reads the pairs and the rule only; nothing is generated.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from repo_package import register_package  # noqa: E402  (the one repo-as-package bootstrap)

register_package()

import numpy as np  # noqa: E402

from carnator.carnator_core.risk.certify import (  # noqa: E402
    AXES,
    accepted_pairs,
    certificate_bound,
    compare_paired,
    prompt_only_accepted,
    read_pairs_jsonl,
    split_pairs,
)
from carnator.carnator_core.risk.rule import RiskRule  # noqa: E402


def _median(xs: list[float]) -> float | None:
    return round(float(np.median(xs)), 3) if xs else None


def _row(name: str, n_req: int, acc: list, diag: dict, label: str, delta: float) -> dict:
    b = sum(p.unsafe for p in acc)
    c = sum(p.better for p in acc)
    n = len(acc)
    d = [diag.get((p.request_id, p.entry_id), {}) for p in acc]
    return {"group": name, "requests": n_req, "accepted": n, "coverage": round(n / n_req, 3) if n_req else None,
            "b": b, "c": c, "excess": round((b - c) / n, 4) if n else None, "b_rate": round(b / n, 4) if n else None,
            "U": round(certificate_bound(label, n, b, c, delta), 4) if n else None,
            "compute_median": _median([x["compute_fraction"] for x in d if "compute_fraction" in x]),
            "active_median": _median([x["active_fraction"] for x in d if "active_fraction" in x])}


def _by_kind(request_ids: tuple[str, ...], kind: dict) -> dict[str, int]:
    """How many of ``request_ids`` fall in each scene/kind stratum ("1obj/position" …)."""
    strata = (kind.get(r, ("?", "?")) for r in request_ids)
    return dict(sorted(Counter(f"{scene}/{k}" for k, scene in strata).items()))


def axis_table(th, pairs: list) -> list[dict]:
    """Per axis: threshold, range over ``pairs`` (min, max; prompt similarity as the similarity itself), pairs that
    axis alone rejects, and requests whose decision (accepted or not, and which candidate) changes when that check
    is switched off."""
    import dataclasses

    rows = []
    n_req, base = accepted_pairs(th, pairs)
    base_choice = {p.request_id: p.entry_id for p in base}
    names = list(AXES) + (["min_similarity"] if th.min_similarity is not None else []) + ["missing"]
    for axis in names:
        alone = 0
        for p in pairs:
            checks = {c.axis: c.passed for c in th.checks(p.vector(), p.similarity)}
            fails = [a for a, ok in checks.items() if not ok] + (["missing"] if p.missing else [])
            key = axis if axis in AXES or axis == "missing" else next(a for a in checks if a not in AXES)
            alone += fails == [key]
        if axis in AXES:
            vals = [getattr(p, axis) for p in pairs if not p.missing]
            thr = getattr(th, axis)
            off = dataclasses.replace(th, **{axis: 1e300})  # the check switched off (thresholds are finite)
        elif axis == "min_similarity":
            vals = [p.similarity for p in pairs]
            thr = th.min_similarity
            off = dataclasses.replace(th, min_similarity=None)
        else:
            vals, thr, off = [float(p.missing) for p in pairs], "reject", None
        if off is not None:
            _, acc_off = accepted_pairs(off, pairs)
        else:  # missing objects are always rejected: count what accepting them would add
            _, acc_off = accepted_pairs(th, [dataclasses.replace(p, missing=False) for p in pairs])
        off_choice = {p.request_id: p.entry_id for p in acc_off}
        decided = sum(1 for r in set(base_choice) | set(off_choice) if base_choice.get(r) != off_choice.get(r))
        lo, hi = (round(float(min(vals)), 4), round(float(max(vals)), 4)) if vals else (None, None)
        can_reject = (axis == "missing" or (hi is not None and (thr < hi if axis in AXES else thr > lo)))
        rows.append({"axis": axis, "threshold": thr if isinstance(thr, str) else round(float(thr), 4),
                     "min": lo, "max": hi, "can_reject": bool(can_reject), "pairs_alone_rejected": alone,
                     "requests_alone_decided": decided})
    return rows


def prompt_only_at(n_target: int, pairs: list) -> tuple[float, list]:
    """The highest prompt-similarity threshold at which prompt-only reuse accepts at least ``n_target``
    requests of ``pairs`` (the lowest similarity if it never does), and the pairs it then reuses."""
    sims = sorted({p.similarity for p in pairs}, reverse=True)
    for t in sims:
        _, acc = prompt_only_accepted(t, pairs)
        if len(acc) >= n_target:
            return t, acc
    return sims[-1], prompt_only_accepted(sims[-1], pairs)[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", required=True)
    ap.add_argument("--rule", required=True)
    ap.add_argument("--split", default="cert", choices=("cert", "calib", "all"))
    ap.add_argument("--json", default=None, help="also write the table here")
    args = ap.parse_args(argv)
    _, pairs = read_pairs_jsonl(args.pairs)
    diag: dict = {}
    kind: dict = {}
    with open(args.pairs, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if r.get("type") == "header" or "request_id" not in r:
                continue
            d = r.get("diag") or {}
            diag[(r["request_id"], r["entry_id"])] = d
            kind[r["request_id"]] = (d.get("kind", "?"), f"{d.get('objects', '?')}obj")
    if args.split != "all":
        calib, cert = split_pairs(pairs)
        pairs = cert if args.split == "cert" else calib
    rule = RiskRule.load(args.rule, allow_uncertified=True)  # a report, not a filter: a failed rule is shown too
    label, delta = rule.certificate.label, float(rule.certificate.delta)
    th = rule.thresholds
    groups: dict = defaultdict(list)
    for p in pairs:
        k, s = kind.get(p.request_id, ("?", "?"))
        for g in ("all", s, k, f"{s}/{k}") + (("non-repeat",) if k != "repeat" else ()):
            groups[g].append(p)
    rows = []
    for g in sorted(groups, key=lambda x: (x not in ("all", "non-repeat"), "/" in x, x)):
        n_req, acc = accepted_pairs(th, groups[g])
        rows.append(_row(g, n_req, acc, diag, label, delta))
    print(f"rule {args.rule} on the {args.split} split of {args.pairs}; U = the rule's {label} bound at δ = {delta} "
          "on these rows' counts")
    print("| requests | n | accepted | coverage | b | c | excess | b/n | U | compute (median) | active (median) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['group']} | {r['requests']} | {r['accepted']} | {r['coverage']} | {r['b']} | {r['c']} | "
              f"{r['excess']} | {r['b_rate']} | {r['U']} | {r['compute_median']} | {r['active_median']} |")
    out = {"rows": rows}
    for g in ("all", "non-repeat"):
        if g not in groups:
            continue
        n_acc = next(r["accepted"] for r in rows if r["group"] == g)
        t, po_acc = prompt_only_at(n_acc, groups[g])
        n_req, rule_acc = accepted_pairs(th, groups[g])
        po_b, po_c = sum(p.unsafe for p in po_acc), sum(p.better for p in po_acc)
        n = max(len(po_acc), 1)
        print(f"prompt-only at the same coverage ({g}): threshold {t}, accepted {len(po_acc)} of {n_req}, "
              f"b = {po_b}, c = {po_c}, excess {(po_b - po_c) / n:.4f}, b/n {po_b / n:.4f}")
        cmp = compare_paired(po_acc, rule_acc, n_req)
        print(f"  paired ({g}): accepted by both {cmp.both_accepted}; prompt-only worse on {cmp.a_worse} requests, "
              f"the rule worse on {cmp.b_worse}; exact one-sided sign test p = {cmp.p_one_sided:.4f}")
        print(f"    prompt-only worse: {_by_kind(cmp.a_worse_ids, kind)}; "
              f"the rule worse: {_by_kind(cmp.b_worse_ids, kind)}")
        out[f"prompt_only_{g}"] = {"threshold": t, "accepted": len(po_acc), "requests": n_req,
                                   "b": po_b, "c": po_c, "both_accepted": cmp.both_accepted,
                                   "prompt_only_worse": cmp.a_worse, "rule_worse": cmp.b_worse,
                                   "sign_test_p": cmp.p_one_sided}
    axes = axis_table(th, groups.get("all", []))
    print(f"per axis on the {args.split} split ({len(groups.get('all', []))} pairs): threshold vs the axis range, "
          "pairs it alone rejected, requests it alone decided")
    print("| axis | threshold | min | max | can reject | pairs rejected by it alone | requests it alone decided |")
    print("|---|---|---|---|---|---|---|")
    for r in axes:
        print(f"| {r['axis']} | {r['threshold']} | {r['min']} | {r['max']} | {'yes' if r['can_reject'] else 'no'} | "
              f"{r['pairs_alone_rejected']} | {r['requests_alone_decided']} |")
    out["axes"] = axes
    if rule.strata is not None:
        st = rule.strata
        print(f"per-stratum certificates ({st.method}, order {', '.join(st.order)}; α = {st.alpha}, δ = {st.delta}): "
              f"certified {', '.join(st.certified) or 'none'}; coverage {st.covered}/{st.n_requests} = "
              f"{st.coverage:.3f}")
        print("| stratum | n | b | c | U | tested | certified |")
        print("|---|---|---|---|---|---|---|")
        for name in list(st.order) + sorted(set(st.strata) - set(st.order)):
            c = st.strata.get(name)
            if c is not None:
                print(f"| {name} | {c.n} | {c.k} | {c.c} | {c.upper_bound:.4f} | {'yes' if c.tested else 'no'} | "
                      f"{'yes' if c.passed else 'no'} |")
        out["strata"] = st.to_dict()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
