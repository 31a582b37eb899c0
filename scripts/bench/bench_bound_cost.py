#!/usr/bin/env python
"""What a risk rule's certificate bound costs to verify at load (queue) time, by n (justifies EXACT_MAX_N and the
rule-size checks in carnator_core/risk/rule.py).

    .host/venv/bin/python scripts/bench/bench_bound_cost.py [--ns 150,600,1047,1200,1500] [--hostile]

For each n (b = 2 % of n, c = 1.5 % of n, δ = 0.1): the exact excess bound (the cap lifted, for any n) and
what ``excess_upper_bound`` returns since the cap (exact up to ``EXACT_MAX_N``, the union bound above), wall and
CPU seconds each, one run (the exact bound is deterministic; minutes at large n). ``--hostile``: loading rule
documents that claim n = 4,000 and 10**15 labelled requests, and 64 strata at EXACT_MAX_N, and the worst a
plausible file may cost (a certificate and 3 strata at EXACT_MAX_N), through ``RiskRule.from_json``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import conftest  # noqa: E402,F401  (registers the `carnator` package)

from carnator.carnator_core.risk import bounds, certify  # noqa: E402
from carnator.carnator_core.risk.rule import MAX_EXACT_WORK, RiskRule, RuleFormatError  # noqa: E402


def timed(fn, *a):
    """(result, wall s, CPU s of this process): on a shared machine the CPU seconds are the comparable figure."""
    t, cpu = time.perf_counter(), time.process_time()
    out = fn(*a)
    return out, time.perf_counter() - t, time.process_time() - cpu


def exact(n: int, b: int, c: int, delta: float) -> float:
    """The exact bound for any n (the cap lifted), for measuring what the cap avoids."""
    cap = bounds.EXACT_MAX_N
    bounds.EXACT_MAX_N = 10**9
    try:
        return bounds.excess_upper_bound(n, b, c, delta)
    finally:
        bounds.EXACT_MAX_N = cap


def rule_doc(n: int, n_requests: int, strata: dict | None = None) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from test_risk_rule import make_rule

    doc = make_rule().to_json()
    u = certify.certificate_bound("excess", n, 0, 0, 0.1) if n <= 10**6 else 0.0  # (10**15: refused before)
    doc["certificate"] = {"n": n, "k": 0, "c": 0, "label": "excess", "upper_bound": u, "alpha": 0.05,
                          "delta": 0.1, "n_requests": n_requests, "passed": u <= 0.05, "coverage": 1.0,
                          "method": "x", "unsafe_upper_bound": None, **({"strata": strata} if strata else {})}
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ns", default="150,600,1047,1200,1500")
    ap.add_argument("--hostile", action="store_true")
    args = ap.parse_args()
    print(f"EXACT_MAX_N = {bounds.EXACT_MAX_N}, MAX_EXACT_WORK = {MAX_EXACT_WORK:,}")
    print(f"{'n':>6} {'b':>4} {'c':>4} {'exact U':>9} {'wall s':>8} {'CPU s':>8} {'returned U':>10} {'wall s':>8} "
          f"{'CPU s':>8}")
    for n in (int(x) for x in args.ns.split(",") if x.strip()):
        b, c = round(0.02 * n), round(0.015 * n)
        ue, te, ce = timed(exact, n, b, c, 0.1)
        ur, tr, cr = timed(bounds.excess_upper_bound, n, b, c, 0.1)
        print(f"{n:>6} {b:>4} {c:>4} {ue:>9.4f} {te:>8.2f} {ce:>8.2f} {ur:>10.4f} {tr:>8.3f} {cr:>8.3f}", flush=True)
    if args.hostile:
        m = bounds.EXACT_MAX_N
        def one(k: int, bound: bool = True) -> dict:  # distinct counts per stratum: no memo helps a hostile file
            doc = rule_doc(m, m)["certificate"]
            u = certify.certificate_bound("excess", m, k, 0, 0.1) if bound else 0.0  # (refused before it counts)
            return {**doc, "k": k, "upper_bound": u, "passed": u <= 0.05}

        cases = {"n = 4,000": rule_doc(4000, 4000), "n = 10**15": rule_doc(10**15, 10**15),
                 "64 strata at EXACT_MAX_N": rule_doc(64 * m, 64 * m, {f"s{i}": one(i, False) for i in range(64)}),
                 "3 strata at EXACT_MAX_N (the most allowed)": rule_doc(m, m, {f"s{i}": one(i + 1) for i in range(3)})}
        for name, doc in cases.items():
            certify.certificate_bound.cache_clear()
            t, cpu = time.perf_counter(), time.process_time()
            try:
                RiskRule.from_json(json.loads(json.dumps(doc)), allow_uncertified=True)
                what = "loaded"
            except RuleFormatError as e:
                what = "refused: " + str(e)[:90]
            print(f"{name:>44}: {time.perf_counter() - t:8.3f} s wall {time.process_time() - cpu:8.3f} s CPU  {what}",
                  flush=True)


if __name__ == "__main__":
    main()
