"""Confidence bounds the risk certificate is built on.

Two labels are certified (docs/CALIBRATION.md):

* **unsafe rate** ``b/n`` — the share of accepted requests whose reuse output fails a check that the dense output of
  the same request and seed passes. One binomial count: the one-sided Clopper–Pearson bound
  :func:`clopper_pearson_upper`.
* **excess failure rate** ``(b − c)/n`` — ``c`` counts the accepted requests whose reuse output passes where the dense
  output fails. Reuse is charged only for what it adds over the model's own sampling noise: a fresh dense sample at
  another seed, judged as if it were a reuse, has an excess of 0 in expectation (its b and c have the same
  probability), while its b/n alone is the model's failure rate.

For the excess rate each accepted request is one draw of a three-outcome variable (+1 = b, −1 = c, 0 = concordant)
with probabilities (p_b, p_c, 1 − p_b − p_c); the parameter is Δ = p_b − p_c, the nuisance q = p_b + p_c.
:func:`excess_upper_bound` inverts the exact unconditional test of H0: Δ ≥ Δ0 (statistic D = B − C, small D is
evidence against H0; p-value = the largest P(D ≤ d_observed) over every (Δ, q) in H0 — Suissa & Shuster's exact
unconditional approach to paired binary data). The bound is U = sup{Δ0 ≥ 0 : p(Δ0) > δ}, clamped at 0 from below:
with probability ≥ 1 − δ over the draw of the n requests, Δ ≤ U.

Why the clamp is exact rather than approximate: for Δ0 ≥ 0 every q feasible for some Δ ≥ Δ0 is feasible for Δ0
(q ≥ Δ ≥ Δ0), and P(D ≤ d) falls as Δ rises at fixed q (moving probability from the c outcome to the b outcome
makes D stochastically larger), so the supremum over H0 is the supremum over q at Δ = Δ0 — one dimension, which
:func:`_p_value` maximises on a grid plus a bounded refinement. A true Δ < 0 lies below the clamped bound anyway.

:func:`excess_upper_bound_union` is the simpler, looser alternative (Clopper–Pearson upper bound on b/n minus the
lower bound on c/n, each at δ/2, valid by the union bound); it is reported beside the exact one and used to cross-
check it (the exact bound is never above it in the tests). :func:`excess_upper_bound_approx` is a normal
approximation used only to *select* thresholds during calibration, where no guarantee is needed (the certificate
is computed exactly on a disjoint split).
"""
from __future__ import annotations

import math

import numpy as np
from scipy.optimize import minimize_scalar
from scipy.special import gammaln
from scipy.stats import beta as _beta, norm as _norm

__all__ = [
    "EXACT_MAX_N",
    "clopper_pearson_upper",
    "clopper_pearson_lower",
    "excess_upper_bound",
    "excess_upper_bound_union",
    "excess_upper_bound_approx",
]


#: Largest n whose exact excess bound is computed. Its cost grows like n² (an (n+1)² table of outcomes, searched
#: for every bisection step): about 5 s at n = 1,200 and 196 s at n = 4,000 on a 2-core CPU (BENCHMARKS.md,
#: scripts/bench/bound_cost.py). Above it ``excess_upper_bound`` returns the union bound, which is valid at the
#: same confidence and never below the exact one, in constant time. Every shipped rule has n ≤ 1,047.
EXACT_MAX_N = 1200


def _check(k: int, n: int, delta: float, name: str = "k") -> tuple[int, int, float]:
    k, n = int(k), int(n)
    if n < 0 or k < 0 or k > n:
        raise ValueError(f"need 0 ≤ {name} ≤ n, got {name}={k}, n={n}")
    if not 0.0 < float(delta) < 1.0:
        raise ValueError(f"δ must be in (0, 1), got {delta}")
    return k, n, float(delta)


def clopper_pearson_upper(k: int, n: int, delta: float) -> float:
    """One-sided Clopper–Pearson upper confidence bound on a binomial rate, at confidence 1 − δ.

    U = Beta⁻¹(1 − δ; k + 1, n − k); U = 1 when k = n (including n = 0: no evidence at all).
    Example (the seed's certificate): k = 0, n = 50, δ = 0.1 → 0.0450.
    """
    k, n, delta = _check(k, n, delta)
    if k >= n:
        return 1.0
    return float(_beta.ppf(1.0 - delta, k + 1, n - k))


def clopper_pearson_lower(k: int, n: int, delta: float) -> float:
    """One-sided Clopper–Pearson lower confidence bound: L = Beta⁻¹(δ; k, n − k + 1); L = 0 when k = 0."""
    k, n, delta = _check(k, n, delta)
    if k == 0:
        return 0.0
    return float(_beta.ppf(delta, k, n - k + 1))


def _check_bc(n: int, b: int, c: int, delta: float) -> tuple[int, int, int, float]:
    n, b, c = int(n), int(b), int(c)
    if n < 0 or b < 0 or c < 0 or b + c > n:
        raise ValueError(f"need b, c ≥ 0 and b + c ≤ n, got n={n}, b={b}, c={c}")
    if not 0.0 < float(delta) < 1.0:
        raise ValueError(f"δ must be in (0, 1), got {delta}")
    return n, b, c, float(delta)


def excess_upper_bound_union(n: int, b: int, c: int, delta: float) -> float:
    """Clopper–Pearson upper bound on b/n at δ/2 minus the lower bound on c/n at δ/2 (valid by the union bound).

    n = 0 gives 1 (no evidence)."""
    n, b, c, delta = _check_bc(n, b, c, delta)
    if n == 0:
        return 1.0
    return clopper_pearson_upper(b, n, delta / 2) - clopper_pearson_lower(c, n, delta / 2)


def excess_upper_bound_approx(n: np.ndarray | int, b: np.ndarray | int, c: np.ndarray | int,
                              delta: float) -> np.ndarray | float:
    """Normal approximation of :func:`excess_upper_bound` (vectorised), for threshold *selection* only.

    Δ̂ + z₁₋δ · sqrt(((b + c)/n − Δ̂²)/n) + 1/n (a continuity correction); 1 where n = 0. Not a guarantee."""
    n_arr = np.asarray(n, dtype=np.float64)
    d = (np.asarray(b, dtype=np.float64) - np.asarray(c, dtype=np.float64))
    safe_n = np.maximum(n_arr, 1.0)
    est = d / safe_n
    var = np.maximum((np.asarray(b, dtype=np.float64) + np.asarray(c, dtype=np.float64)) / safe_n - est**2, 0.0)
    out = est + _norm.ppf(1.0 - delta) * np.sqrt(var / safe_n) + 1.0 / safe_n
    out = np.where(n_arr > 0, np.minimum(out, 1.0), 1.0)
    return float(out) if out.ndim == 0 else out


def _outcomes(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every (b, c) with b + c ≤ n and its log multinomial coefficient log(n! / (b! c! (n − b − c)!))."""
    b, c = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    keep = (b + c) <= n
    b, c = b[keep].astype(np.float64), c[keep].astype(np.float64)
    logc = gammaln(n + 1.0) - gammaln(b + 1.0) - gammaln(c + 1.0) - gammaln(n - b - c + 1.0)
    return b, c, logc


def _region_prob(n: int, b: np.ndarray, c: np.ndarray, logc: np.ndarray, delta0: float,
                 q: np.ndarray) -> np.ndarray:
    """P((B, C) ∈ region) under p_b = (q + Δ0)/2, p_c = (q − Δ0)/2 for each q; the region is given by its cells."""
    q = np.asarray(q, dtype=np.float64)
    pb = (q + delta0) / 2.0
    pc = (q - delta0) / 2.0
    rest = n - b - c
    with np.errstate(divide="ignore", invalid="ignore"):
        lb, lc, l0 = np.log(pb), np.log(pc), np.log1p(-q)
        out = np.empty(len(q))
        for i in range(len(q)):
            # 0 · log 0 = 0: an outcome kind of probability 0 only allows a count of 0
            t = logc + np.where(b > 0, b * lb[i], 0.0) + np.where(c > 0, c * lc[i], 0.0) \
                + np.where(rest > 0, rest * l0[i], 0.0)
            out[i] = float(np.exp(t).sum())
    return np.minimum(out, 1.0)


def _p_value(n: int, cells: tuple[np.ndarray, np.ndarray, np.ndarray], delta0: float, grid: int = 48) -> float:
    """sup over q ∈ [Δ0, 1] of P_{Δ0, q}(region): a grid (dense near small q), then a bounded refinement around
    the best grid point; the larger of the two is returned."""
    b, c, logc = cells
    if len(b) == 0:
        return 0.0
    lo = max(delta0, 0.0)
    if lo >= 1.0:
        return float(_region_prob(n, b, c, logc, delta0, np.array([1.0]))[0])
    u = np.linspace(0.0, 1.0, grid)
    qs = lo + (1.0 - lo) * u**2  # quadratic spacing: the maximum often sits at small q
    vals = _region_prob(n, b, c, logc, delta0, qs)
    i = int(np.argmax(vals))
    best = float(vals[i])
    a, z = qs[max(i - 1, 0)], qs[min(i + 1, grid - 1)]
    if z > a:
        res = minimize_scalar(lambda x: -float(_region_prob(n, b, c, logc, delta0, np.array([x]))[0]),
                              bounds=(a, z), method="bounded", options={"xatol": 1e-6})
        best = max(best, -float(res.fun))
    return min(best, 1.0)


def excess_upper_bound(n: int, b: int, c: int, delta: float, tol: float = 1e-4) -> float:
    """Exact one-sided upper confidence bound on the excess failure rate Δ = p_b − p_c at confidence 1 − δ.

    The outcomes (b', c') are ordered by the approximate bound :func:`excess_upper_bound_approx` (a studentised
    ordering: D alone would let a large nuisance q explain away b = c = 0); the test of H0: Δ = Δ0 rejects when
    sup_q P_{Δ0, q}(approx(B, C) ≤ approx(b, c)) ≤ δ, and the bound is the largest Δ0 ≥ 0 it does not reject
    (bisection, then a check of a grid above the result so a non-monotone p-value cannot hide a larger
    non-rejected Δ0). Returns a value in [0, 1], rounded up to ``tol``; n = 0 gives 1 (no evidence).
    Cost grows like n²: about a second at n = 600. Above ``EXACT_MAX_N`` the cost is bounded instead: the union
    bound :func:`excess_upper_bound_union` (clamped to [0, 1]) is returned, valid at the same confidence and
    looser, so a rule file claiming a huge n cannot make a rule load take minutes (or exhaust memory).
    """
    n, b, c, delta = _check_bc(n, b, c, delta)
    if n == 0:
        return 1.0
    if n > EXACT_MAX_N:
        return min(1.0, max(0.0, excess_upper_bound_union(n, b, c, delta)))
    bb, cc, logc = _outcomes(n)
    stat = excess_upper_bound_approx(n, bb, cc, delta)
    obs = excess_upper_bound_approx(n, b, c, delta)
    inside = stat <= obs + 1e-12
    cells = (bb[inside], cc[inside], logc[inside])

    def accepted(d0: float) -> bool:  # Δ0 not rejected
        return _p_value(n, cells, d0) > delta

    if not accepted(0.0):
        return 0.0
    lo, hi = 0.0, 1.0
    if accepted(hi):
        return 1.0
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        if accepted(mid):
            lo = mid
        else:
            hi = mid
    for d0 in np.linspace(hi, min(1.0, hi + 0.25), 12)[1:]:
        if accepted(float(d0)):  # non-monotone p-value: restart above the accepted point
            return excess_upper_bound_from(n, cells, delta, float(d0), tol)
    return float(math.ceil(hi / tol) * tol)


def excess_upper_bound_from(n: int, cells: tuple[np.ndarray, np.ndarray, np.ndarray], delta: float, start: float,
                            tol: float) -> float:
    """Bisection above a non-rejected ``start`` (rarely needed; see :func:`excess_upper_bound`)."""
    lo, hi = start, 1.0
    if _p_value(n, cells, hi) > delta:
        return 1.0
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        if _p_value(n, cells, mid) > delta:
            lo = mid
        else:
            hi = mid
    return float(math.ceil(hi / tol) * tol)


def min_accepted_for_certificate(alpha: float, delta: float) -> int:
    """Smallest n for which a certificate can hold at all (k = 0): U(0, n, δ) = 1 − δ^(1/n) ≤ α."""
    if not (0.0 < alpha < 1.0 and 0.0 < delta < 1.0):
        raise ValueError(f"α and δ must be in (0, 1), got α={alpha}, δ={delta}")
    n = max(1, math.ceil(math.log(delta) / math.log1p(-alpha)) - 1)
    while clopper_pearson_upper(0, n, delta) > alpha:  # guard against rounding in the closed form
        n += 1
    return n
