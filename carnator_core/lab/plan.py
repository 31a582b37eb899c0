"""Choose how tightly to calibrate *before* certifying: cross-validation on the calibration split only.

Why: the threshold search fits the calibration data; on new traffic (another cache, other requests) the unsafe
rate among accepted requests comes out higher. Calibrating at a tighter level than the certificate's α
(``calib_alpha``) leaves room for that, at the price of coverage. Which level is right depends on how much the
data vary, so it is measured, not guessed: every candidate level is calibrated on all folds but one and
evaluated on the held-out fold (folds = independent runs, e.g. ``s3:q0007`` → run ``s3``, when the request ids
carry such a prefix; otherwise seeded random folds of requests). Pooled over folds, that gives an out-of-sample
unsafe rate and coverage per level, and from them the probability that a certificate of a planned size passes:

    n ≈ cert_requests × coverage,   P(pass) = P(Binomial(n, rate) ≤ k_max(n)),
    k_max(n) = the largest k with Clopper–Pearson U(k, n, δ) ≤ α.

With the excess label (``label="excess"``, the certified quantity (b − c)/n) the held-out rates of b and c give
P(pass) by simulation: (B, C) ~ Multinomial(n, b̂, ĉ), P(pass) = the share of draws whose bound (the normal
approximation the calibration search also uses; the certificate itself is exact) is ≤ α.

The recommended level maximises P(pass) (ties: more coverage). Only calibration rows are read: the certification
split stays unseen, so choosing the level this way costs the certificate nothing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..risk.bounds import excess_upper_bound_approx
from ..risk.certify import CalibrationError, Evaluation, LabelledPair, calibrate, clopper_pearson_upper, evaluate


@dataclass(frozen=True)
class PlanRow:
    """Out-of-sample outcome of calibrating at one level, pooled over the held-out folds."""

    calib_alpha: float
    held_out: Evaluation  # pooled over the held-out folds (folds whose calibration failed are not counted)
    folds_failed: int  # folds where no threshold setting qualified at this level
    planned_n: int  # expected accepted requests in a certificate of the planned size
    k_max: int  # most unsafe a certificate with planned_n accepted may contain (-1: none can pass)
    p_pass: float
    label: str = "unsafe"

    def line(self) -> str:
        h = self.held_out
        failed = f", {self.folds_failed} fold(s) without a qualifying setting" if self.folds_failed else ""
        if self.label == "excess":
            n = max(h.n_accepted, 1)
            return (f"calib α {self.calib_alpha:g}: held-out b = {h.k_unsafe}, c = {h.k_better} of {h.n_accepted} "
                    f"accepted / {h.n_requests} requests (coverage {h.coverage:.1%}, excess "
                    f"{(h.k_unsafe - h.k_better) / n:.2%}, b/n {h.k_unsafe / n:.2%}){failed}; planned certificate "
                    f"n ≈ {self.planned_n}: P(pass) ≈ {self.p_pass:.2f} (simulated)")
        return (
            f"calib α {self.calib_alpha:g}: held-out {h.k_unsafe} unsafe of {h.n_accepted} accepted / "
            f"{h.n_requests} requests (coverage {h.coverage:.1%}, rate {h.unsafe_rate:.2%}){failed}; "
            + (f"planned certificate n ≈ {self.planned_n}, passes if k ≤ {self.k_max}: P(pass) ≈ {self.p_pass:.2f}"
               if self.k_max >= 0 else
               f"planned certificate n ≈ {self.planned_n}: too few accepted for any certificate to pass")
        )


@dataclass(frozen=True)
class Plan:
    rows: tuple[PlanRow, ...]
    folds: tuple[str, ...]
    fold_method: str
    cert_requests: int
    alpha: float
    delta: float

    @property
    def best(self) -> PlanRow:
        return max(self.rows, key=lambda r: (round(r.p_pass, 6), r.held_out.coverage, r.calib_alpha))

    def text(self) -> str:
        head = (
            f"cross-validation over {len(self.folds)} folds ({self.fold_method}); certificate planned on "
            f"{self.cert_requests} requests at α = {self.alpha:g}, δ = {self.delta:g}"
        )
        best = self.best
        tail = (
            f"recommended: --calib-alpha {best.calib_alpha:g}" if best.p_pass > 0
            else "no level is likely to certify: label more requests or improve the reuse itself"
        )
        return "\n".join([head, *(r.line() for r in self.rows), tail])


def k_max_for_certificate(n: int, alpha: float, delta: float) -> int:
    """Largest k with U(k, n, δ) ≤ α; -1 when even k = 0 fails (n too small)."""
    k = -1
    while k + 1 < n and clopper_pearson_upper(k + 1, n, delta) <= alpha:
        k += 1
    return k


def excess_pass_probability(n: int, b_rate: float, c_rate: float, alpha: float, delta: float, *,
                            draws: int = 20000, seed: int = 0) -> float:
    """P(an excess certificate on n accepted requests passes) when b and c occur at these rates: the share of
    simulated (B, C) ~ Multinomial(n, b_rate, c_rate) whose approximate bound is ≤ α (0 when n = 0)."""
    if n <= 0:
        return 0.0
    b, c = min(max(b_rate, 0.0), 1.0), min(max(c_rate, 0.0), 1.0)
    if b + c > 1.0:
        raise ValueError(f"b_rate + c_rate must be ≤ 1, got {b} + {c}")
    x = np.random.default_rng(seed).multinomial(n, [b, c, max(0.0, 1.0 - b - c)], size=draws)
    ub = np.asarray(excess_upper_bound_approx(np.full(draws, n), x[:, 0], x[:, 1], delta), dtype=np.float64)
    return float(np.mean(ub <= alpha))


def binomial_cdf(k: int, n: int, p: float) -> float:
    """P(Binomial(n, p) ≤ k), exact (log-space terms, so large n does not overflow)."""
    if k < 0:
        return 0.0
    if k >= n or p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    lp, lq = math.log(p), math.log1p(-p)
    terms = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq
             for i in range(k + 1)]
    m = max(terms)
    return min(1.0, math.exp(m) * sum(math.exp(t - m) for t in terms))


def _folds(pairs: Sequence[LabelledPair], n_folds: int, seed: int) -> tuple[dict[str, int], tuple[str, ...], str]:
    requests = sorted({p.request_id for p in pairs})
    prefixes = sorted({r.split(":", 1)[0] for r in requests if ":" in r})
    if len(prefixes) >= 2 and all(":" in r for r in requests):
        names = tuple(prefixes)
        return {r: names.index(r.split(":", 1)[0]) for r in requests}, names, "one per run, from the request-id prefix"
    if n_folds < 2:
        raise CalibrationError(f"need at least 2 folds, got {n_folds}")
    if len(requests) < n_folds:
        raise CalibrationError(f"{len(requests)} calibration requests cannot make {n_folds} folds")
    order = np.random.default_rng(seed).permutation(len(requests))
    fold_of = {requests[i]: int(j % n_folds) for j, i in enumerate(order)}
    return fold_of, tuple(f"fold{i}" for i in range(n_folds)), f"{n_folds} seeded random folds of requests"


def plan_calib_alpha(
    calib_pairs: Sequence[LabelledPair],
    calib_alphas: Sequence[float],
    *,
    cert_requests: int,
    alpha: float = 0.05,
    delta: float = 0.1,
    levels: int = 12,
    search_similarity: bool = False,
    n_folds: int = 5,
    seed: int = 0,
    label: str = "unsafe",
) -> Plan:
    """Cross-validate each calibration level (module docstring). ``calib_pairs`` must be calibration rows only."""
    if cert_requests < 1:
        raise CalibrationError(f"cert_requests must be ≥ 1, got {cert_requests}")
    levels_ = sorted({float(a) for a in calib_alphas}, reverse=True)
    if not levels_ or any(not 0.0 < a <= alpha for a in levels_):
        raise CalibrationError(f"calibration levels must be in (0, α={alpha}], got {list(calib_alphas)}")
    fold_of, names, method = _folds(calib_pairs, n_folds, seed)
    by_fold: list[list[LabelledPair]] = [[] for _ in names]
    for p in calib_pairs:
        by_fold[fold_of[p.request_id]].append(p)
    rows = []
    for a in levels_:
        n_req = n_acc = k = kb = failed = 0
        for i, held in enumerate(by_fold):
            train = [p for j, f in enumerate(by_fold) if j != i for p in f]
            try:
                cal = calibrate(train, a, delta, levels=levels, search_similarity=search_similarity, label=label)
            except CalibrationError:
                failed += 1
                continue
            ev = evaluate(cal.thresholds, held)
            n_req, n_acc, k = n_req + ev.n_requests, n_acc + ev.n_accepted, k + ev.k_unsafe
            kb += ev.k_better if label == "excess" else 0
        held = Evaluation(n_req, n_acc, k, kb)
        planned = int(round(cert_requests * held.coverage))
        kmax = k_max_for_certificate(planned, alpha, delta)
        if label == "excess":
            p_pass = excess_pass_probability(planned, k / n_acc, kb / n_acc, alpha, delta) if n_acc else 0.0
        else:
            rate = held.unsafe_rate if n_acc else 1.0  # nothing accepted held out: no evidence of safety
            p_pass = binomial_cdf(kmax, planned, rate)
        rows.append(PlanRow(a, held, failed, planned, kmax, p_pass, label))
    return Plan(tuple(rows), names, method, int(cert_requests), alpha, delta)
