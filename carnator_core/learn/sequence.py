"""Anytime-valid upper confidence sequences for the excess failure rate of a learned rule.

Each label of a request the rule accepts is one outcome X ∈ {−1, 0, +1}: +1 = b (the reuse clip fails where the
dense clip of the same request passes), −1 = c (the reuse clip passes where dense fails), 0 = the two agree. The
certified quantity is the excess failure rate Δ = E[X] = p_b − p_c (the offline certificate's quantity,
``risk/bounds.py``), here bounded while labels arrive one by one and the bound is looked at after every label.

The test (betting, Waudby-Smith & Ramdas 2023; the hedged capital process of "Estimating means of bounded random
variables by betting", one-sided) — for a level m, H0(m): Δ ≥ m (every label's conditional mean given the past is
≥ m). A gambler starts with capital 1 and before label t bets a *predictable* fraction λ_t ∈ [0, λ_max(m)] (it
depends only on labels 1..t−1) that X_t falls below m:

    K_t(m) = Π_{i ≤ t} (1 + λ_i (m − X_i)),      λ_max(m) = c_max / (1 − m)  (c_max < 1 keeps every factor > 0).

Under H0(m), E[1 + λ_t (m − X_t) | past] = 1 + λ_t (m − E[X_t | past]) ≤ 1, so K(m) is a non-negative
supermartingale and Ville's inequality gives P(sup_t K_t(m) ≥ 1/δ) ≤ δ — whatever the stopping time, however
often one looks (continuous monitoring). The rule is certified at level α once K_t(α) ≥ 1/δ has happened
(*ever*: the event is already δ-controlled, so a certificate once earned stands; drift is watched by a second,
separate test, :class:`DriftTest`).

λ_t is the plug-in Kelly bet for level α, used for every level m: the growth-optimal λ ∈ [0, λ_max(α)] for the
three outcomes with probabilities estimated from labels 1..t−1 plus ``PRIOR_WEIGHT`` pseudo-labels at
p_b = ``PRIOR_B``·α (a prior that keeps the first bets below the cap: an early failure at the cap would cost most of
the capital). With no failure at all the bets reach λ_max and K grows like (1 + c_max α/(1 − α))^n: at α = 0.05,
δ = 0.1 a certificate takes about 53 labels (the fixed-n Clopper–Pearson certificate needs 45).

The upper confidence sequence U_t is read off a grid of levels m (step ``GRID_STEP``): a level is excluded once its
capital has crossed 1/δ; U_t = the smallest grid level above every level not excluded. For the true Δ, the grid
level just below it is a true null, excluded with probability ≤ δ, so P(∃t: Δ > U_t) ≤ δ.

Multiplicity (``family_delta``): the switch-on decisions are a family of tests — one per stratum, per fit of the
thresholds, per level of the threshold grid — and the family-wise error is controlled by splitting δ:

* strata: Bonferroni over :data:`STRATA` (δ/|STRATA| each; ``strata="none"`` gives each stratum the whole δ,
  as the offline per-stratum certificate does, and is said so in the rule's record);
* fits: alpha-spending over refits, fit j (1, 2, ...) gets the share 2^−j (at most ``max_fits`` fits);
* the threshold grid of one fit: Bonferroni over its G levels (1/G each).

P(some switched-on (stratum, fit, level) has true excess ≥ α) ≤ Σ shares · δ ≤ δ. The fits are made from the
discrepancies of served requests alone (no label outcome enters them), so each fit's test may use every label,
earlier ones too: given the covariates, the outcomes are what they are under any such fit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

GRID_STEP = 0.0025  # resolution of the reported upper bound U_t
C_MAX = 0.95        # largest fraction of the allowed bet (keeps every factor ≥ 1 − C_MAX > 0)
OUTCOMES = (-1, 0, 1)


def _check_level(alpha: float, delta: float) -> None:
    if not 0.0 < float(alpha) < 1.0:
        raise ValueError(f"α must be in (0, 1), got {alpha}")
    if not 0.0 < float(delta) < 1.0:
        raise ValueError(f"δ must be in (0, 1), got {delta}")


PRIOR_WEIGHT = 5.0   # pseudo-labels behind the bets' plug-in estimate of (p_b, p_c)
PRIOR_B = 0.6        # the prior p_b, as a fraction of α (the test's bets) or a multiple of it (the drift test's)


def kelly_bet(values: Sequence[float], probs: Sequence[float], cap: float) -> float:
    """argmax over λ ∈ [0, cap] of Σ p_i log(1 + λ v_i): the growth-optimal bet when the factor's payoffs are
    ``values`` with probabilities ``probs`` (concave in λ: bisection on the derivative; plain floats, it runs once
    per label)."""
    pairs = [(float(v), float(p)) for v, p in zip(values, probs) if p > 0.0]

    def slope(lam: float) -> float:
        return sum(p * v / (1.0 + lam * v) for v, p in pairs)

    if slope(0.0) <= 0.0:
        return 0.0
    if slope(cap) >= 0.0:
        return float(cap)
    lo, hi = 0.0, float(cap)
    for _ in range(30):
        mid = 0.5 * (lo + hi)
        if slope(mid) > 0.0:
            lo = mid
        else:
            hi = mid
    return lo


def _plug_in(n: int, b: int, c: int, prior_b: float) -> tuple[float, float, float]:
    """(p_b, p_c, p_0) estimated from the past labels with ``PRIOR_WEIGHT`` pseudo-labels of p_b = prior_b."""
    w = PRIOR_WEIGHT
    pb = (b + w * prior_b) / (n + w)
    pc = c / (n + w)
    return pb, pc, max(1.0 - pb - pc, 0.0)


@dataclass
class BettingSequence:
    """The anytime-valid test of H0: Δ ≥ α and the upper confidence sequence of Δ, updated one label at a time.

    ``update(x)`` takes x ∈ {−1, 0, +1}. ``certified`` is True once K(α) ≥ 1/δ has happened; ``upper`` is U_t.
    Deterministic: the same labels in the same order give the same state (a rule file's record is re-checked by
    replaying its labels)."""

    alpha: float
    delta: float
    c_max: float = C_MAX
    n: int = 0
    b: int = 0
    c: int = 0
    log_capital: float = 0.0          # log K_t(α)
    max_log_capital: float = 0.0      # log sup_s K_s(α)
    _bets: list = field(default_factory=list, repr=False)
    _xs: list = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        _check_level(self.alpha, self.delta)
        if not 0.0 < self.c_max < 1.0:
            raise ValueError(f"c_max must be in (0, 1), got {self.c_max}")

    @property
    def threshold(self) -> float:
        return math.log(1.0 / self.delta)

    def update(self, x: int) -> "BettingSequence":
        if x not in OUTCOMES:
            raise ValueError(f"a label outcome is −1 (c), 0 or +1 (b), got {x!r}")
        pb, pc, p0 = _plug_in(self.n, self.b, self.c, PRIOR_B * self.alpha)
        a = self.alpha
        lam = kelly_bet((a - 1.0, a + 1.0, a), (pb, pc, p0), self.c_max / (1.0 - a))
        self._bets.append(lam)
        self._xs.append(int(x))
        self.log_capital += math.log1p(lam * (self.alpha - x))
        self.max_log_capital = max(self.max_log_capital, self.log_capital)
        self.n += 1
        self.b += int(x == 1)
        self.c += int(x == -1)
        return self

    def extend(self, xs: Iterable[int]) -> "BettingSequence":
        for x in xs:
            self.update(int(x))
        return self

    @property
    def certified(self) -> bool:
        """K_s(α) ≥ 1/δ at some s ≤ t: H0: Δ ≥ α rejected (valid under continuous monitoring)."""
        return self.max_log_capital >= self.threshold

    @property
    def upper(self) -> float:
        """U_t: the smallest grid level (step ``GRID_STEP``) such that it and every level above it has been
        excluded at some s ≤ t (1 with no labels). The same bets serve every level m (capped at c_max/(1 − m)
        below α so that every factor stays > 0); each level's factor grows with m, so the excluded levels form an
        upper interval and U_t ≤ α exactly when the test at α has certified."""
        if not self._xs:
            return 1.0
        grid = np.unique(np.concatenate([np.arange(-1.0, 1.0 + 1e-12, GRID_STEP), [self.alpha]]))
        lam = np.minimum(np.asarray(self._bets)[:, None], self.c_max / (1.0 - grid)[None, :])
        steps = np.log1p(lam * (grid[None, :] - np.asarray(self._xs, dtype=np.float64)[:, None]))
        excluded = (np.cumsum(steps, axis=0) >= self.threshold - 1e-12).any(axis=0)
        kept = np.flatnonzero(~excluded)
        if len(kept) == 0:
            return float(grid[0])
        top = int(kept[-1])
        return float(grid[top + 1]) if top + 1 < len(grid) else 1.0

    def to_dict(self) -> dict:
        return {"n": self.n, "b": self.b, "c": self.c, "alpha": self.alpha, "delta": self.delta,
                "log_capital": round(self.log_capital, 6), "max_log_capital": round(self.max_log_capital, 6),
                "log_threshold": round(self.threshold, 6), "upper": round(self.upper, 6),
                "certified": self.certified, "method": METHOD}


METHOD = ("betting test supermartingale of H0: (b − c)/n ≥ α, predictable plug-in Kelly bets capped at "
          f"{C_MAX}/(1 − m), Ville's inequality (carnator_core/learn/sequence.py)")


@dataclass
class DriftTest:
    """The audit's anytime-valid test of H0: Δ ≤ α on a switched-on rule's audited hits: capital
    Π (1 + λ_i (X_i − α)), λ ≤ c_max/(1 + α) predictable. Crossing 1/δ says the excess has drifted above α
    (P(false alarm ever) ≤ δ while the rule is in fact fine)."""

    alpha: float
    delta: float
    c_max: float = C_MAX
    n: int = 0
    b: int = 0
    c: int = 0
    log_capital: float = 0.0

    def __post_init__(self) -> None:
        _check_level(self.alpha, self.delta)

    def update(self, x: int) -> "DriftTest":
        if x not in OUTCOMES:
            raise ValueError(f"a label outcome is −1 (c), 0 or +1 (b), got {x!r}")
        pb, pc, p0 = _plug_in(self.n, self.b, self.c, min(0.5, 2.0 * self.alpha))
        a = self.alpha
        lam = kelly_bet((1.0 - a, -1.0 - a, -a), (pb, pc, p0), self.c_max / (1.0 + a))
        self.log_capital += math.log1p(lam * (x - self.alpha))
        self.n += 1
        self.b += int(x == 1)
        self.c += int(x == -1)
        return self

    @property
    def drifted(self) -> bool:
        return self.log_capital >= math.log(1.0 / self.delta)

    def to_dict(self) -> dict:
        return {"n": self.n, "b": self.b, "c": self.c, "alpha": self.alpha, "delta": self.delta,
                "log_capital": round(self.log_capital, 6), "drifted": self.drifted}


def family_delta(delta: float, *, n_strata: int, fit_index: int, n_levels: int, strata: str = "bonferroni") -> float:
    """The δ share of one (stratum, fit, level) test (module docstring, "Multiplicity")."""
    if fit_index < 1:
        raise ValueError(f"fits are numbered from 1, got {fit_index}")
    share = (1.0 / n_strata if strata == "bonferroni" else 1.0) * 0.5 ** fit_index / max(n_levels, 1)
    return float(delta) * share


def labels_needed(alpha: float, delta: float, c_max: float = C_MAX) -> int:
    """Labels without a single failure after which the test certifies (the floor of any certificate here)."""
    seq = BettingSequence(alpha, delta, c_max)
    for n in range(1, 100_000):
        seq.update(0)
        if seq.certified:
            return n
    raise ValueError("no certificate within 100 000 labels")  # pragma: no cover - α, δ in (0, 1)


def run_stream(xs: Sequence[int], alpha: float, delta: float) -> BettingSequence:
    """The sequence after ``xs`` (in order)."""
    return BettingSequence(alpha, delta).extend(xs)
