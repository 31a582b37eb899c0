#!/usr/bin/env python
"""Certify a rule's fixed thresholds per stratum on labelled pairs, write the rule's "strata" section, and report
coverage per request kind and the paired comparison with prompt-only at the same coverage.

    .host/venv/bin/python scripts/lab/certify_strata.py --rule rules/embedded.json --out rules/embedded.json \\
        --pairs rules/attempt20_s87.jsonl=s87 … rules/attempt20_s90.jsonl=s90 \\
        --combined rules/attempt20_cert_pairs.jsonl [--order size,colour,...] \\
        [--protocol rules/protocols/attempt20.md] [--json artifacts/a20/report.json]

The pairs must carry each row's ``change`` (the stratum: scripts/lab/relabel_pairs.py writes it). They are combined
into ``--combined`` (request ids prefixed per run, ``lab.pairs.combine_pairs_files``), certified with
``risk.certify.certify_strata`` (fixed-sequence testing in ``--order``, at the rule's α and δ, excess label), and the
rule is written to ``--out`` with the strata certificate and ``provenance.strata_pairs`` naming the combined file
(tests recompute the certificate from it). The rule's average certificate and thresholds are not touched.

Report (stdout and ``--json``): per stratum n, b, c, U, tested, certified and each run's counts; per request kind
(the generator's ``diag.kind``) requests, accepted by the thresholds, served (accepted in a certified stratum), b
and c among the served; prompt-only at the same overall coverage (the highest similarity bar that serves at least as
many requests) with its b and c per kind, and per kind the paired comparison (``risk.certify.compare_paired``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import conftest  # noqa: E402,F401  (registers the `carnator` package)

#: The order attempt 20's protocol fixed (rules/protocols/attempt20.md; attempt 19's put mixed, background, object and
#: count before position and motion).
PROTOCOL_ORDER = ("size", "colour", "rewording", "reseed", "position", "motion", "mixed", "background", "object",
                  "count")


def served_pairs(th, pairs, strata) -> tuple[int, list]:
    """(requests, the pairs the filter serves): the rule's choice, kept only when its stratum is certified."""
    from carnator.carnator_core.risk.certify import EXACT, accepted_pairs

    groups = defaultdict(list)
    for p in pairs:
        groups[p.request_id].append(p)
    keep = [p for ps in groups.values() if not any(q.change == EXACT for q in ps) for p in ps]
    n, acc = accepted_pairs(th, keep)
    return n, [p for p in acc if strata.allows(p.change)]


def heterogeneity(per_run: list) -> dict | None:
    """Do the runs have the same b/n? ``risk.certify.runs_heterogeneity`` (exact, Freeman–Halton; Fisher's for two
    runs) on each run's [n, b, c]: the clusters' agreement, for the record (the bound pools them)."""
    from carnator.carnator_core.risk.certify import runs_heterogeneity

    got = runs_heterogeneity([(n, b) for n, b, _ in per_run])
    return None if got is None else {"p": round(got[0], 4), "test": got[1]}


def compare_table(label: str, policy: list, pairs: list, kind: dict, n_req: int) -> dict:
    """Prompt-only at the coverage of ``policy`` (the highest similarity bar serving at least as many requests), per
    request kind: served, b, c of each and the paired comparison (``risk.certify.compare_paired``)."""
    from carnator.carnator_core.risk.certify import compare_paired, prompt_only_accepted

    sims = sorted({p.similarity for p in pairs}, reverse=True)
    bar, po = sims[-1], prompt_only_accepted(sims[-1], pairs)[1]
    for t in sims:
        acc = prompt_only_accepted(t, pairs)[1]
        if len(acc) >= len(policy):
            bar, po = t, acc
            break
    res: dict = {"prompt_only_bar": bar, "policy_served": len(policy), "prompt_only_served": len(po), "by_kind": {}}
    print(f"\n{label}: {len(policy)} requests; prompt-only at the same coverage: similarity ≥ {bar:.4f} serves "
          f"{len(po)}")
    print("| kind | requests | rule served | b | c | prompt-only served | b | c | paired: prompt-only worse / rule "
          "worse | sign test p |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for k in sorted(set(kind.values())):
        ids = {rid for rid, v in kind.items() if v == k}
        s_k = [p for p in policy if p.request_id in ids]
        po_k = [p for p in po if p.request_id in ids]
        cmp = compare_paired(po_k, s_k, len(ids))
        row = {"requests": len(ids), "served": len(s_k), "b": sum(p.unsafe for p in s_k),
               "c": sum(p.better for p in s_k), "prompt_only_served": len(po_k),
               "prompt_only_b": sum(p.unsafe for p in po_k), "prompt_only_c": sum(p.better for p in po_k),
               "prompt_only_worse": cmp.a_worse, "rule_worse": cmp.b_worse, "sign_test_p": round(cmp.p_one_sided, 4)}
        res["by_kind"][k] = row
        print(f"| {k} | {row['requests']} | {row['served']} | {row['b']} | {row['c']} | {row['prompt_only_served']} "
              f"| {row['prompt_only_b']} | {row['prompt_only_c']} | {row['prompt_only_worse']} / {row['rule_worse']} "
              f"| {row['sign_test_p']} |")
    cmp = compare_paired(po, policy, n_req)
    res["paired_all"] = {"prompt_only_worse": cmp.a_worse, "rule_worse": cmp.b_worse, "p": cmp.p_one_sided}
    print(f"all kinds, paired: prompt-only worse on {cmp.a_worse}, the rule worse on {cmp.b_worse}; exact one-sided "
          f"sign test of 'prompt-only is no worse' p = {cmp.p_one_sided:.4f}")
    return res


def main(argv: list[str] | None = None) -> int:
    from carnator.carnator_core.lab.pairs import combine_pairs_files
    from carnator.carnator_core.risk.certify import EXACT, accepted_pairs, certify_strata, read_pairs_jsonl
    from carnator.carnator_core.risk.rule import RiskRule

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rule", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--pairs", nargs="+", required=True, metavar="FILE=PREFIX")
    ap.add_argument("--combined", type=Path, required=True)
    ap.add_argument("--order", default=",".join(PROTOCOL_ORDER))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--entry-unit", action="store_true",
                    help="also require the entry-unit (Rao–Scott over cached entries) bound per stratum: a stratum "
                         "whose failures cluster on one cached entry is refused (risk.certify.entry_unit_bound)")
    ap.add_argument("--protocol", default="rules/protocols/attempt20.md",
                    help="the pre-registered protocol these pairs were made and certified under (recorded in the rule)")
    args = ap.parse_args(argv)
    sources = [tuple(x.rsplit("=", 1)) for x in args.pairs]
    combine_pairs_files(sources, args.combined, generator="scripts/lab/certify_strata.py " + " ".join(
        a for a in (argv if argv is not None else sys.argv[1:])))
    header, pairs = read_pairs_jsonl(args.combined)
    rule = RiskRule.load(args.rule)
    order = tuple(s for s in args.order.split(",") if s)
    strata = certify_strata(rule.thresholds, pairs, order=order, alpha=rule.certificate.alpha,
                            delta=rule.certificate.delta, label="excess", entry_unit=args.entry_unit)
    prov = dict(rule.provenance)
    prov.update({"strata_pairs": [args.combined.name], "strata_protocol": args.protocol,
                 "strata_label": header.get("unsafe_definition", "")})
    new = dataclasses.replace(rule, strata=strata, provenance=prov)
    new.save(args.out)
    RiskRule.load(args.out)  # what the filter will load: recomputed, never trusted

    kind = {}
    for line in args.combined.read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        if r.get("type") != "header":
            kind[r["request_id"]] = r["diag"]["kind"]
    n_req, served = served_pairs(rule.thresholds, pairs, strata)
    _, accepted = accepted_pairs(rule.thresholds, [p for p in pairs if p.change != EXACT])
    out = {"strata": strata.to_dict(), "requests": n_req, "served": len(served), "comparisons": {}}
    print(f"strata ({strata.method}, order {', '.join(order)}; α = {strata.alpha}, δ = {strata.delta}): certified "
          f"{', '.join(strata.certified) or 'none'}; served {strata.covered} of {strata.n_requests} requests "
          f"({strata.coverage:.3f}); accepted by the thresholds {strata.accepted}")
    print("| stratum | n | b | c | U | entries | deff | U (entry unit) | tested | certified | per run [n, b, c] | "
          "runs differ (exact p, b/n) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in list(order) + sorted(set(strata.strata) - set(order)):
        c = strata.strata[name]
        runs = {r: list(d[name]) for r, d in strata.runs.items() if name in d}
        het = heterogeneity(list(runs.values()))
        out.setdefault("heterogeneity", {})[name] = het
        ent = ("—", "—", "—") if c.clusters is None else (
            len(c.clusters), f"{c.deff:.2f}", f"{c.entry_upper_bound:.4f}")
        print(f"| {name} | {c.n} | {c.k} | {c.c} | {c.upper_bound:.4f} | {ent[0]} | {ent[1]} | {ent[2]} | "
              f"{'yes' if c.tested else 'no'} | "
              f"{'yes' if c.passed else 'no'} | {runs} | {het['p'] if het is not None else '—'} |")
    # The pre-registered comparison is the served set (certified strata only); the thresholds' own accepted set
    # (the rule as it ran before strata) is compared the same way beside it.
    for label, policy in (("served (certified strata)", served), ("accepted by the thresholds", accepted)):
        out["comparisons"][label] = compare_table(label, policy, pairs, kind, n_req)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out} (rule id {new.rule_id}) and {args.combined}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
