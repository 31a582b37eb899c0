#!/usr/bin/env python
"""How many labels learning mode's anytime-valid test needs to certify a kind of change, by its true failure
rate: the plug-in Kelly gambler alone (the test before 2026-12-06) against the mixture of three gamblers that
``carnator_core/learn/sequence.py`` uses now, side by side on the same simulated label streams.

    .host/venv/bin/python scripts/bench/bench_betting.py [--reps 200] [--horizon 1500] [--seed 0]

Labels are i.i.d.: b with probability p_b, c with p_c, else 0. The test runs at the head of the learning order's
level (``learner.first_level(LearnSettings())``, δ·h·3/4 = 0.0375 at α = 0.05, δ = 0.1) and is checked after
every label (continuous monitoring). For each (p_b, p_c) the median and 90th percentile of the label at which the
test first certifies (horizon + 1 when it never does), and, at true excess exactly α, the share of streams that
ever certify (must stay ≤ the level: Ville). The rates 0–3.5 % are those every frequent kind showed under the
embedded model's second label in the first two learning runs.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import conftest  # noqa: E402,F401  (registers the `carnator` package)
from machine import cpu_model  # noqa: E402

from carnator.carnator_core.learn.learner import LearnSettings, first_level  # noqa: E402
from carnator.carnator_core.learn.sequence import FIXED_FRACTIONS, BettingSequence  # noqa: E402

RATES = ((0.0, 0.0), (0.01, 0.0), (0.02, 0.0), (0.02, 0.01), (0.03, 0.0), (0.035, 0.01))


def first_certified(xs: np.ndarray, alpha: float, level: float, fixed: tuple) -> int:
    s = BettingSequence(alpha, level, fixed=fixed)
    for i, x in enumerate(xs):
        if s.update(int(x)).certified:
            return i + 1
    return len(xs) + 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--horizon", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    settings = LearnSettings()
    alpha, level = settings.alpha, first_level(settings)
    variants = {"plug-in alone": (), "mixture": FIXED_FRACTIONS}
    rng = np.random.default_rng(args.seed)
    print(f"# machine: {cpu_model()}; α = {alpha}, level {level:.4f}, {args.reps} streams of {args.horizon} labels")
    print("| p_b | p_c | " + " | ".join(f"{v}: median / p90 labels" for v in variants) + " |")
    print("|---|---|" + "---|" * len(variants))
    for pb, pc in RATES:
        found = {v: [] for v in variants}
        for _ in range(args.reps):
            u = rng.random(args.horizon)
            xs = np.where(u < pb, 1, np.where(u < pb + pc, -1, 0))
            for v, fixed in variants.items():  # the same stream for both: a paired comparison
                found[v].append(first_certified(xs, alpha, level, fixed))
        cells = []
        for v in variants:
            a = np.asarray(found[v])
            med, p90 = int(np.median(a)), int(np.percentile(a, 90))
            cells.append(f"{med if med <= args.horizon else 'never'} / {p90 if p90 <= args.horizon else 'never'}")
        print(f"| {pb:.3f} | {pc:.3f} | " + " | ".join(cells) + " |", flush=True)
    wrong = {v: 0 for v in variants}
    for _ in range(args.reps):
        xs = np.where(rng.random(400) < alpha, 1, 0)  # true excess exactly α: every certificate is wrong
        for v, fixed in variants.items():
            wrong[v] += first_certified(xs, alpha, level, fixed) <= 400
    print("ever certified at true excess = α (≤ the level " f"{level:.4f} by Ville): "
          + ", ".join(f"{v} {wrong[v]}/{args.reps}" for v in variants))


if __name__ == "__main__":
    main()
