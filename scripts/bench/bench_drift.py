#!/usr/bin/env python
"""How fast learning mode's audits switch a drifted kind off, and what is served meanwhile: the drift detector of
``carnator_core/learn/sequence.py`` (``DriftDetector``, a Shiryaev–Roberts e-detector) on simulated audit streams.

    .host/venv/bin/python scripts/bench/bench_drift.py [--reps 2000] [--horizon 4000] [--seed 0]

A switched-on kind is audited on a share a of its hits (``LearnSettings.audit_share``, 5 % by default): the
audited hit is served dense and labelled. Each stream has ``pre`` audits at the pre-change rate (none failing, or
2 % failing), then every audit fails (b) with probability p_b (no c). For each jump the table gives the audits to
the switch-off (mean, median; "never" = none within the horizon), and what the kind served meanwhile: hits
E[audits] · (1 − a)/a (between two audits the hits are geometric, independent of the audits' outcomes: Wald), of
which p_b fail (unsafe hits) and p_b − α in excess of what the certificate allows; then the same with the audit
share raised while the kind is young or a drift is suspected (``learner.audit_share_now``, the default): the hits
between two audits are then (1 − a_t)/a_t with a_t the share in force. The false-alarm side: at
excess exactly α, the share of streams alarmed within 300 audits (≤ 300/ARL by Ville) and the mean audits to a
false alarm (≥ the ARL).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import conftest  # noqa: E402,F401  (registers the `carnator` package)

from carnator.carnator_core.learn.learner import LearnSettings  # noqa: E402
from carnator.carnator_core.learn.sequence import DriftDetector  # noqa: E402

JUMPS = (0.08, 0.1, 0.2)
HISTORIES = ((0, 0.0), (1000, 0.0), (1000, 0.02))  # (audits before the jump, their failure rate)


def boosted_hits(xs: np.ndarray, pre: int, at: np.ndarray, s: LearnSettings) -> np.ndarray:
    """Hits served from the jump (audit ``pre``) to the alarm ``at`` when the audit share follows
    ``audit_share_now``: boosted for the first ``young_audits`` audits of the kind (the stream starts at its
    switch-on) and while the detector's statistic is ≥ drift_arl/4 (the same recursion as ``DriftDetector``)."""
    reps, total = xs.shape
    lam = np.asarray(DriftDetector(s.alpha, s.drift_arl).bets)[None, :]
    r = np.zeros((reps, lam.shape[1]))
    hits = np.zeros(reps)
    base, boosted = s.audit_share, min(1.0, s.audit_share * s.audit_boost)
    for t in range(total):
        # the share in force before audit t + 1 is decided on audits 1..t (young: fewer than young_audits so far)
        share = np.where((t < s.young_audits) | (r.mean(axis=1) >= s.drift_arl / 4.0), boosted, base)
        live = (t >= pre) & (t + 1 <= at)  # audits after the jump up to the switch-off
        hits += np.where(live, (1.0 - share) / share, 0.0)
        r = (1.0 + lam * (xs[:, t:t + 1] - s.alpha)) * (r + 1.0)
    return hits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--horizon", type=int, default=4000, help="audits after the jump")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    s = LearnSettings()
    a, alpha, arl = s.audit_share, s.alpha, s.drift_arl
    rng = np.random.default_rng(args.seed)
    print(f"# α = {alpha}, audit share {a}, ARL threshold {arl:g}, {args.reps} streams per row")
    print("| jump to p_b | audits before (their p_b) | audits to switch-off: mean / median | never | hits served "
          "meanwhile | unsafe (b) hits | in excess of α | false alarms before the jump | boosted share: hits / "
          "unsafe hits |")
    print("|---|---|---|---|---|---|---|---|---|")
    for pb in JUMPS:
        for pre, pre_rate in HISTORIES:
            total = pre + args.horizon
            rate = np.where(np.arange(total)[None, :] < pre, pre_rate, pb)
            xs = (rng.random((args.reps, total)) < rate).astype(np.int8)
            at = DriftDetector.first_alarm(xs, alpha, arl)
            early = at <= pre
            delay = (np.minimum(at, total + 1) - pre)[~early]
            never = float((at > total).mean())
            mean = float(delay.mean())
            hits = mean * (1 - a) / a
            boost = float(boosted_hits(xs, pre, at, s)[~early].mean())
            print(f"| {pb} | {pre} ({pre_rate}) | {mean:.0f} / {np.median(delay):.0f} | {never:.3f} | {hits:,.0f} | "
                  f"{pb * hits:,.0f} | {(pb - alpha) * hits:,.0f} | {early.mean():.3f} | {boost:,.0f} / "
                  f"{pb * boost:,.0f} |", flush=True)
    xs = (rng.random((args.reps, 20_000)) < alpha).astype(np.int8)
    at = DriftDetector.first_alarm(xs, alpha, arl)
    print(f"\nat excess exactly α: alarmed within 300 audits {float((at <= 300).mean()):.3f} (bound 300/ARL = "
          f"{300 / arl:.3f}); mean audits to a false alarm ≥ {float(np.minimum(at, 20_000).mean()):.0f} "
          f"(streams of 20,000 audits; {float((at > 20_000).mean()):.3f} never alarmed)")


if __name__ == "__main__":
    main()
