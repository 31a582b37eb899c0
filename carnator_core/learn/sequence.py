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
separate detector, :class:`DriftDetector`).

The bets are a *mixture* of three gamblers, each with a third of the starting capital (the average of
supermartingales that start at 1 is one, so Ville applies to the sum): K_t = (K_t^plug + K_t^0.7 + K_t^0.45) / 3.

* the plug-in gambler bets the Kelly fraction for level α: the growth-optimal λ ∈ [0, λ_max(α)] for the three
  outcomes with probabilities estimated from labels 1..t−1 plus ``PRIOR_WEIGHT`` pseudo-labels at
  p_b = ``PRIOR_B``·α. With no failure its bets reach λ_max and it grows fastest (53 labels at α = 0.05, δ = 0.1
  alone; 45 is the fixed-n floor) — but a failure at the cap costs it ln(1 − c_max) ≈ −3, most of its capital;
* two fixed gamblers bet the constant fractions ``FIXED_FRACTIONS`` = (0.7, 0.45) of 1/(1 − α): a failure costs
  them ln 0.3 and ln 0.55, and their growth is what remains when labels fail at 1–3 %, the rate every frequent
  kind of change showed under the embedded model's second label (BENCHMARKS.md, learning mode end to end).

Chosen on simulated i.i.d. labels before the run that uses it (``scripts/bench/bench_betting.py``, 200 paired
streams): at the head of the learning order (δ·3/8) the median / 90th percentile of the labels to a certificate
are 86 / 86 with no failure (the plug-in alone: 73 / 73), 140 / 212 at p_b = 1 % (73 / 281), 212 / 521 at 2 %
(311 / 734) and 577 / 1,432 at 3 % (930 / never within 1,500): slower when nothing fails, much faster when a kind
fails now and then, which is every kind here.
Every gambler's bet is predictable (a function of labels 1..t−1 only), so the validity argument is unchanged.

The upper confidence sequence U_t is read off a grid of levels m (step ``GRID_STEP``): a level is excluded once its
capital has crossed 1/δ; U_t = the smallest grid level above every level not excluded. For the true Δ, the grid
level just below it is a true null, excluded with probability ≤ δ, so P(∃t: Δ > U_t) ≤ δ.

The b-rate alone: Δ = p_b − p_c lets c cancel b one for one, so a judge that over-calls dense failures (many c)
could certify a kind whose reuse fails often (p_b = 0.20, p_c = 0.18 certified within 2,000 labels in 6 of 40
simulated streams, ``tests/test_learn_validity.py``). Each (stratum, fit) therefore runs a second test beside it,
the same mixture of gamblers on the indicators 1{X = +1} against H0': p_b ≥ β (``b_ceiling``, 0.1 by default),
and switches on only when *both* have rejected at its level. The hypothesis it certifies is "Δ < α and p_b < β";
its null is the union "Δ ≥ α or p_b ≥ β", and an intersection-union test rejects it with probability at most the
level of the test whose null holds — so each test runs at the whole level (no split of δ), and the node's running
p-value offered to the graph is the larger of the two (``p_value``), which still only shrinks. With no failure the
b-rate test (β > α) certifies before the excess test, so a kind that rarely fails needs no more labels than before.

Multiplicity: the switch-on decisions are a family of tests, one per (stratum, fit) — a stratum's thresholds may be
refitted (after a drift, or when a fit shows an excess) and each fit is its own hypothesis. The family-wise error,
P(some switched-on (stratum, fit) has true excess ≥ α) ≤ δ, is controlled in one of three ways (``strata``):

* ``"graph"`` (the default): a sequentially rejective graphical procedure (Bretz, Maurer, Brannath & Posch 2009)
  over the (stratum, fit) hypotheses, strata in an *order fixed by the pilot* (below). Stratum k of the order has
  the weight h(1 − h)^(k−1) (h = ``head_weight``, ½ by default; the last the rest); fit j of a stratum the share
  ``fit_share(j)`` (3/4 for the first fit, the rest halving: refits are the exception). When a hypothesis is
  rejected (a stratum certifies) its level passes on to the next stratum of the order (cyclic), so a chain of kinds
  that certify each get most of δ — a fallback procedure (Wiens 1996) with the fits inside. The first kind of the
  order needs as many labels as a single test at δ · h · 3/4 (86 at α = 0.05, δ = 0.1 with no failure; the second
  then 81), not the 132 of a Bonferroni split over ten kinds and a halving over fits; if the first never certifies,
  the second still starts at δ/4 · 3/4 (102).
* ``"bonferroni"``: δ/|STRATA| per stratum, fit j the share 2^−j (the procedure before the graph).
* ``"none"``: each stratum at the whole δ, as the offline per-stratum certificate (no family-wise guarantee; said so
  in the rule's record).

Why the graph stays valid under continuous monitoring: each hypothesis' *ever* p-value 1/sup_t K_t is super-uniform
under its null (Ville). The graphical procedure is valid for any p-values and monotone (smaller p-values never
remove a rejection), and the running p-values min(1, 1/max_{s≤t} K_s) only shrink with t — so the rejections made
at any time t are a subset of what the procedure makes on the ever p-values, whose family-wise error is ≤ δ.
The order must not depend on the labels the tests use: it is fixed at the end of a *pilot* (the first ``pilot``
served requests with a candidate) from the pilot's covariates and labels, and every test counts only labels after
the pilot. Given what was seen up to then, the graph is fixed, so the guarantee holds conditionally and hence
overall. A hypothesis created later (a refit) starts its capital at 1 when it is created and counts only labels
made after that (its thresholds come from covariates, never from its own outcomes), which keeps its capital a
supermartingale from then on; the hypothesis it replaces counts no label after it (``learner.fit_window``).

What a hypothesis' labels are a sample of — the requests of its stratum inside its fit while it is current, one
label per cached entry, drawn by a coin independent of the queue, the request's risk and every outcome, under the
judge reading in force — is the learner's (``learner`` module docstring, "The guarantee"); this module only needs
that each counted label's conditional mean given the past is ≥ m under H0(m).

The floor no procedure escapes: with no failure at all, a kind needs ln δ / ln(1 − α) ≈ 45 accepted labels of its
own before any valid test at α = 0.05, δ = 0.1 can certify it (after n labels without failure a kind whose true
excess is exactly α would have shown none with probability 0.95^n, which is above δ until n = 45).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

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
FIXED_FRACTIONS = (0.7, 0.45)  # the fixed gamblers' bets, as fractions of 1/(1 − α) (module docstring)


def kelly_bet(values: Sequence[float], probs: Sequence[float], cap: float) -> float:
    """argmax over λ ∈ [0, cap] of Σ p_i log(1 + λ v_i): the growth-optimal bet when the factor's payoffs are
    ``values`` with probabilities ``probs`` (concave in λ: bisection on the derivative; plain floats, it runs once
    per label). Memoised: the plug-in bets depend on the label counts only, and every derivation of the state
    replays every test from its first label, so the same bets recur (the result is the same bisection's)."""
    return _kelly_bet(tuple(float(v) for v in values), tuple(float(p) for p in probs), float(cap))


@functools.lru_cache(maxsize=1 << 16)
def _kelly_bet(values: tuple, probs: tuple, cap: float) -> float:
    pairs = [(v, p) for v, p in zip(values, probs) if p > 0.0]

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


def _log_mean_exp(values: Sequence[float]) -> float:
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values) / len(values))


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
    With ``b_ceiling`` = β it also runs the b-rate test (module docstring, "The b-rate alone"): the same three
    gamblers betting against H0': p_b ≥ β on the indicators 1{x = +1}, and ``certified`` needs both tests to have
    rejected at the same δ. Deterministic: the same labels in the same order give the same state (a rule file's
    record is re-checked by replaying its labels)."""

    alpha: float
    delta: float
    c_max: float = C_MAX
    fixed: tuple = FIXED_FRACTIONS    # the fixed gamblers' fractions (() = the plug-in gambler alone)
    b_ceiling: float | None = None    # β of the b-rate test (None: the excess test alone)
    n: int = 0
    b: int = 0
    c: int = 0
    log_capital: float = 0.0          # log K_t(α), the mixture's
    max_log_capital: float = 0.0      # log sup_s K_s(α)
    log_parts: list = field(default_factory=list)   # log K_t^j(α) per gambler (plug-in, then the fixed ones)
    _bets: list = field(default_factory=list, repr=False)  # the plug-in gambler's λ_t
    _xs: list = field(default_factory=list, repr=False)
    _upper_memo: tuple = field(default=(-1, 0.0, 1.0), repr=False, compare=False)  # (n, δ, U_t) last computed
    b_test: "BettingSequence | None" = field(default=None, repr=False)  # the b-rate test (``b_ceiling``)

    def __post_init__(self) -> None:
        _check_level(self.alpha, self.delta)
        if not 0.0 < self.c_max < 1.0:
            raise ValueError(f"c_max must be in (0, 1), got {self.c_max}")
        self.fixed = tuple(float(f) for f in self.fixed)
        if not all(0.0 < f < 1.0 for f in self.fixed):
            raise ValueError(f"fixed bet fractions must be in (0, 1), got {self.fixed}")
        if not self.log_parts:
            self.log_parts = [0.0] * (1 + len(self.fixed))
        if self.b_ceiling is not None and self.b_test is None:
            if not self.alpha <= float(self.b_ceiling) < 1.0:
                raise ValueError(f"the b-rate ceiling must be in [α, 1), got {self.b_ceiling}")
            self.b_test = BettingSequence(float(self.b_ceiling), self.delta, self.c_max, self.fixed)

    @property
    def threshold(self) -> float:
        return math.log(1.0 / self.delta)

    def gambler_bets(self, lam_plug: float, alpha: float | None = None) -> list[float]:
        """The three gamblers' bets for level ``alpha`` (α by default): the plug-in's, then the fixed ones."""
        a = self.alpha if alpha is None else alpha
        return [lam_plug] + [f / (1.0 - a) for f in self.fixed]

    def update(self, x: int) -> "BettingSequence":
        if x not in OUTCOMES:
            raise ValueError(f"a label outcome is −1 (c), 0 or +1 (b), got {x!r}")
        pb, pc, p0 = _plug_in(self.n, self.b, self.c, PRIOR_B * self.alpha)
        a = self.alpha
        lam = kelly_bet((a - 1.0, a + 1.0, a), (pb, pc, p0), self.c_max / (1.0 - a))
        self._bets.append(lam)
        self._xs.append(int(x))
        self.log_parts = [lp + math.log1p(bet * (a - x)) for lp, bet in zip(self.log_parts, self.gambler_bets(lam))]
        self.log_capital = _log_mean_exp(self.log_parts)
        self.max_log_capital = max(self.max_log_capital, self.log_capital)
        self.n += 1
        self.b += int(x == 1)
        self.c += int(x == -1)
        if self.b_test is not None:
            self.b_test.update(int(x == 1))
        return self

    def extend(self, xs: Iterable[int]) -> "BettingSequence":
        for x in xs:
            self.update(int(x))
        return self

    @property
    def excess_certified(self) -> bool:
        """K_s(α) ≥ 1/δ at some s ≤ t: H0: Δ ≥ α rejected (valid under continuous monitoring)."""
        return self.max_log_capital >= self.threshold

    @property
    def b_certified(self) -> bool:
        """The b-rate test's capital has reached 1/δ (H0': p_b ≥ β rejected); True without a b-rate test."""
        return self.b_test is None or self.b_test.max_log_capital >= self.threshold

    @property
    def certified(self) -> bool:
        """Both H0: Δ ≥ α and (with ``b_ceiling``) H0': p_b ≥ β rejected at δ, each at some s ≤ t."""
        return self.excess_certified and self.b_certified

    @property
    def p_value(self) -> float:
        """The running p-value of the union null (Δ ≥ α or p_b ≥ β): the larger of the two tests' 1/sup K; it only
        shrinks with t, and under either null it is ≤ u with probability ≤ u (Ville on the test whose null
        holds)."""
        top = self.max_log_capital if self.b_test is None else min(self.max_log_capital,
                                                                   self.b_test.max_log_capital)
        return math.exp(-top)

    @property
    def upper(self) -> float:
        """U_t: the smallest grid level (step ``GRID_STEP``) such that it and every level above it has been
        excluded at some s ≤ t (1 with no labels). Every level m is tested by the same three gamblers with the
        same bets, each capped at c_max/(1 − m) so that every factor stays > 0; each gambler's factor grows with
        m, hence so does the mixture, so the excluded levels form an upper interval and U_t ≤ α exactly when the
        test at α has certified."""
        if not self._xs:
            return 1.0
        n, delta, value = self._upper_memo
        if n == self.n and delta == self.delta:  # read several times per derivation (messages, the record)
            return value
        value = self._upper()
        self._upper_memo = (self.n, self.delta, value)
        return value

    def _upper(self) -> float:
        # Every level's exclusion is monotone in the level (``upper``'s docstring), so the first excluded grid
        # level is found by bisection: about log2(800) ≈ 10 levels evaluated instead of all 800 (the state is
        # derived after every served request, and the full grid cost 0.45 s at 2,000 labels).
        grid = np.unique(np.concatenate([np.arange(-1.0, 1.0 + 1e-12, GRID_STEP), [self.alpha]]))
        xs = np.asarray(self._xs, dtype=np.float64)
        bets = [np.asarray(self._bets)] + [np.full(1, f / (1.0 - self.alpha)) for f in self.fixed]

        def excluded(i: int) -> bool:
            m = float(grid[i])
            cap = self.c_max / (1.0 - m) if m < 1.0 else math.inf
            parts = np.stack([np.cumsum(np.log1p(np.minimum(lam, cap) * (m - xs))) for lam in bets])
            top_part = parts.max(axis=0)
            mix = top_part + np.log(np.exp(parts - top_part).mean(axis=0))
            return bool((mix >= self.threshold - 1e-12).any())

        lo, hi = 0, len(grid)  # the first excluded index lies in [lo, hi] (hi: none is)
        while lo < hi:
            mid = (lo + hi) // 2
            if excluded(mid):
                hi = mid
            else:
                lo = mid + 1
        return float(grid[lo]) if lo < len(grid) else 1.0

    def _upper_full_grid(self) -> float:
        """U_t over every grid level at once (the definition; ``_upper`` must agree with it)."""
        grid = np.unique(np.concatenate([np.arange(-1.0, 1.0 + 1e-12, GRID_STEP), [self.alpha]]))
        xs = np.asarray(self._xs, dtype=np.float64)[:, None]
        with np.errstate(divide="ignore"):
            cap = (self.c_max / (1.0 - grid))[None, :]
        bets = [np.asarray(self._bets)[:, None]] + [np.full((1, 1), f / (1.0 - self.alpha)) for f in self.fixed]
        parts = np.stack([np.cumsum(np.log1p(np.minimum(lam, cap) * (grid[None, :] - xs)), axis=0) for lam in bets])
        top_part = parts.max(axis=0)
        mix = top_part + np.log(np.exp(parts - top_part).mean(axis=0))
        excluded = (mix >= self.threshold - 1e-12).any(axis=0)
        kept = np.flatnonzero(~excluded)
        if len(kept) == 0:
            return float(grid[0])
        top = int(kept[-1])
        return float(grid[top + 1]) if top + 1 < len(grid) else 1.0

    @staticmethod
    def first_certified(xs: np.ndarray, alpha: float, delta: float, b_ceiling: float | None = None,
                        c_max: float = C_MAX, fixed: tuple = FIXED_FRACTIONS) -> np.ndarray:
        """For each row of ``xs`` (streams × labels, outcomes −1/0/+1) the label at which the test (with the b-rate
        test at ``b_ceiling``, as ``update`` runs it) has first certified (T + 1: never within the row) — the same
        bets and capitals as ``update``, vectorised (simulations): every bet is a function of the counts before its
        label, so all are computed at once (the Kelly bisection once per distinct (n, b, c)) and the capitals are
        running sums. Changes nothing of the scalar test."""
        xs = np.asarray(xs, dtype=np.int64)
        reps, horizon = xs.shape
        threshold = math.log(1.0 / delta)
        tests = [(float(alpha), xs)]
        if b_ceiling is not None:
            tests.append((float(b_ceiling), (xs == 1).astype(np.int64)))
        ever = np.ones((reps, horizon), dtype=bool)
        for a, ys in tests:
            before = np.zeros((reps, 1), dtype=np.int64)
            b = np.concatenate([before, np.cumsum(ys == 1, axis=1)[:, :-1]], axis=1)
            c = np.concatenate([before, np.cumsum(ys == -1, axis=1)[:, :-1]], axis=1)
            n = np.broadcast_to(np.arange(horizon, dtype=np.int64)[None, :], (reps, horizon))
            lam = _kelly_vector(n, b, c, a, c_max)
            y = ys.astype(np.float64)
            parts = np.stack([np.cumsum(np.log1p(bet * (a - y)), axis=1)
                              for bet in [lam] + [np.full((reps, horizon), f / (1.0 - a)) for f in fixed]])
            top = parts.max(axis=0)
            mix = top + np.log(np.exp(parts - top).sum(axis=0) / parts.shape[0])
            ever &= np.maximum.accumulate(mix, axis=1) >= threshold
        hit = ever.any(axis=1)
        return np.where(hit, ever.argmax(axis=1) + 1, horizon + 1)

    def to_dict(self) -> dict:
        return {"n": self.n, "b": self.b, "c": self.c, "alpha": self.alpha, "delta": self.delta,
                "log_capital": round(self.log_capital, 6), "max_log_capital": round(self.max_log_capital, 6),
                "fixed": list(self.fixed), "log_parts": [round(v, 6) for v in self.log_parts],
                "log_threshold": round(self.threshold, 6), "upper": round(self.upper, 6),
                "certified": self.certified, "method": METHOD,
                **({"b_ceiling": self.b_ceiling, "b_log_capital": round(self.b_test.log_capital, 6),
                    "b_max_log_capital": round(self.b_test.max_log_capital, 6), "b_certified": self.b_certified}
                   if self.b_test is not None else {})}


def _kelly_vector(n: np.ndarray, b: np.ndarray, c: np.ndarray, alpha: float, c_max: float) -> np.ndarray:
    """The plug-in gambler's bet (``update``: ``kelly_bet`` on ``_plug_in``'s rates) for each (n, b, c) of the
    arrays, the bisection of ``_kelly_bet`` run once per distinct triple, in the same floating-point operations."""
    base = int(max(n.max(initial=0), b.max(initial=0), c.max(initial=0))) + 1
    keys, inverse = np.unique((n * base + b) * base + c, return_inverse=True)
    un, ub, uc = keys // (base * base), (keys // base) % base, keys % base
    w = PRIOR_WEIGHT
    pb = (ub + w * (PRIOR_B * alpha)) / (un + w)
    pc = uc / (un + w)
    p0 = np.maximum(1.0 - pb - pc, 0.0)
    values = (alpha - 1.0, alpha + 1.0, alpha)
    cap = c_max / (1.0 - alpha)

    def slope(lam: np.ndarray) -> np.ndarray:
        total = np.zeros_like(pb)
        for v, p in zip(values, (pb, pc, p0)):
            total = total + np.where(p > 0.0, p * v / (1.0 + lam * v), 0.0)
        return total

    zero = np.zeros_like(pb)
    lo, hi = zero.copy(), np.full_like(pb, cap)
    for _ in range(30):
        mid = 0.5 * (lo + hi)
        up = slope(mid) > 0.0
        lo, hi = np.where(up, mid, lo), np.where(up, hi, mid)
    lam = np.where(slope(zero) <= 0.0, 0.0, np.where(slope(np.full_like(pb, cap)) >= 0.0, cap, lo))
    return lam[inverse.reshape(n.shape)]


METHOD = ("betting test supermartingale of H0: (b − c)/n ≥ α, the mean of three gamblers' capital (predictable "
          f"plug-in Kelly bets; fixed bets {', '.join(map(str, FIXED_FRACTIONS))} of 1/(1 − α)), every bet capped at "
          f"{C_MAX}/(1 − m), Ville's inequality (carnator_core/learn/sequence.py)")


DRIFT_FRACTIONS = (0.95, 0.6, 0.3, 0.15)  # the drift detector's bets, as fractions of 1/(1 + α)
DRIFT_ARL = 1000.0  # its threshold c: on audits whose excess is ≤ α, a false alarm comes after ≥ c audits on average


@dataclass
class DriftDetector:
    """The audits' drift detector: a Shiryaev–Roberts e-detector (Shin, Ramdas & Rinaldo 2024, "E-detectors: a
    nonparametric framework for sequential change detection") of a rise of the excess above α, on a switched-on
    rule's audited hits, restarted at every audit so that its delay does not grow with a clean history.

    For each bet λ_k = f_k/(1 + α) (``DRIFT_FRACTIONS``) and each start j ≤ t, Π_{i=j..t} (1 + λ_k (X_i − α)) is a
    betting e-process for H0: "every audit's excess is ≤ α" (a non-negative supermartingale from 1: every factor is
    > 0 and has conditional mean ≤ 1 under H0). The statistic sums them over the start points and averages over the
    bets: R_t = mean_k R_t^k, R_t^k = (1 + λ_k (X_t − α)) (R_{t−1}^k + 1), R_0 = 0. Under H0, R_t − t is a
    supermartingale, so the alarm time τ = inf{t: R_t ≥ c} has E[τ] ≥ c (the average run length to a false alarm
    is at least ``arl`` audits), and P(τ ≤ T) ≤ T/c for every horizon T (Ville's inequality applied to
    R_t − t + T, non-negative up to T). No bound can keep the chance of a false alarm ever below δ *and* a delay
    that does not grow with the history: the alarm is a switch-off (the safe side), and its control is the ARL.

    After a jump the bets that match it grow at their rate from wherever R stands: a clean history leaves R near
    its small stationary level (each R^k ≈ f/(1 − f) with f = 1 − λ_k α), never far below 1, so the delay is that
    of a fresh start (the pooled test this replaces took 490 audits after 1,000 clean ones, against 38 without)."""

    alpha: float
    arl: float = DRIFT_ARL
    fractions: tuple = DRIFT_FRACTIONS
    n: int = 0
    b: int = 0
    c: int = 0
    stats: list = field(default_factory=list)  # R_t^k per bet
    alarm_at: int = 0                          # the audit at which R first reached the threshold (0: never)
    peak: float = 0.0                          # max_s R_s

    def __post_init__(self) -> None:
        _check_level(self.alpha, 0.5)
        self.fractions = tuple(float(f) for f in self.fractions)
        if not all(0.0 < f < 1.0 for f in self.fractions) or not self.fractions:
            raise ValueError(f"drift bet fractions must be in (0, 1), got {self.fractions}")
        if not self.arl >= 1.0:
            raise ValueError(f"the drift threshold (ARL) must be ≥ 1, got {self.arl}")
        if not self.stats:
            self.stats = [0.0] * len(self.fractions)

    @property
    def bets(self) -> list[float]:
        return [f / (1.0 + self.alpha) for f in self.fractions]

    @property
    def statistic(self) -> float:
        return sum(self.stats) / len(self.stats)

    def update(self, x: int) -> "DriftDetector":
        if x not in OUTCOMES:
            raise ValueError(f"a label outcome is −1 (c), 0 or +1 (b), got {x!r}")
        self.stats = [(1.0 + lam * (x - self.alpha)) * (r + 1.0) for lam, r in zip(self.bets, self.stats)]
        self.n += 1
        self.b += int(x == 1)
        self.c += int(x == -1)
        self.peak = max(self.peak, self.statistic)
        if not self.alarm_at and self.statistic >= self.arl:
            self.alarm_at = self.n
        return self

    @property
    def drifted(self) -> bool:
        """The statistic has reached the threshold at some audit (a switch-off once raised stands)."""
        return self.alarm_at > 0

    @staticmethod
    def first_alarm(xs: np.ndarray, alpha: float, arl: float = DRIFT_ARL,
                    fractions: tuple = DRIFT_FRACTIONS) -> np.ndarray:
        """For each row of ``xs`` (streams × audits, outcomes −1/0/+1) the audit at which the detector first
        alarms (T + 1: never) — the same recursion as ``update``, vectorised over streams (simulations)."""
        xs = np.asarray(xs, dtype=np.float64)
        reps, horizon = xs.shape
        lam = np.asarray(fractions, dtype=np.float64)[None, :] / (1.0 + alpha)
        r = np.zeros((reps, lam.shape[1]))
        out = np.full(reps, horizon + 1)
        for t in range(horizon):
            r = (1.0 + lam * (xs[:, t:t + 1] - alpha)) * (r + 1.0)
            fresh = (r.mean(axis=1) >= arl) & (out > horizon)
            out[fresh] = t + 1
        return out

    def to_dict(self) -> dict:
        return {"n": self.n, "b": self.b, "c": self.c, "alpha": self.alpha, "arl": self.arl,
                "statistic": round(self.statistic, 6), "peak": round(self.peak, 6), "alarm_at": self.alarm_at,
                "drifted": self.drifted, "method": DRIFT_METHOD}


DRIFT_METHOD = ("Shiryaev–Roberts e-detector of excess > α on the audits (mean over bets "
                f"{', '.join(map(str, DRIFT_FRACTIONS))} of 1/(1 + α)); alarm at R ≥ the ARL threshold "
                "(carnator_core/learn/sequence.py)")


def fit_share(index: int, strata: str = "graph") -> float:
    """The share of its stratum's level that fit ``index`` (1, 2, ...) gets: 2^−j under "bonferroni"/"none", and
    under "graph" 3/4 for the first fit and 1/4 · 2^−(j−1) for fit j ≥ 2 (they sum to 1)."""
    if index < 1:
        raise ValueError(f"fits are numbered from 1, got {index}")
    if strata != "graph":
        return 0.5 ** index
    return 0.75 if index == 1 else 0.25 * 0.5 ** (index - 1)


class GraphProcedure:
    """A sequentially rejective graphical multiple-testing procedure (Bretz et al. 2009, Algorithm 1) with
    Bonferroni-type local levels, fed p-values one at a time.

    Nodes are hashable keys with initial weights w (Σ w ≤ 1) and a transition matrix g (row sums ≤ 1, g_ii = 0).
    ``offer(node, p)`` rejects the node when p ≤ its current level δ·w_node, then passes its level on
    (w_k += w_j g_jk), updates the transitions (g_ik = (g_ik + g_ij g_jk) / (1 − g_ij g_ji)), and rejects every
    further node whose last offered p-value is within its grown level. The final rejected set does not depend on
    the order of the offers (Bretz et al., Theorem 1), which is what lets running p-values be offered as labels
    arrive. ``add(node, weight, out)`` adds a node later (a refit): its weight must come from the unused total,
    so Σ w over every node ever added stays ≤ 1."""

    def __init__(self, delta: float):
        _check_level(0.5, delta)
        self.delta = float(delta)
        self.weight: dict = {}
        self.g: dict = {}
        self.rejected: list = []
        self.rejected_level: dict = {}  # node -> its level when it was rejected
        self._p: dict = {}

    def add(self, node, weight: float, out: Mapping | None = None, into: Mapping | None = None) -> None:
        """Add ``node`` with ``weight`` and transitions ``out`` (node → share) and ``into`` (node → share of
        that node's transitions that go to the new one; renormalised so a row never exceeds 1)."""
        if node in self.weight:
            raise ValueError(f"node {node!r} is already in the graph")
        self.weight[node] = float(weight)
        self.g[node] = {k: float(v) for k, v in (out or {}).items() if k != node and v > 0}
        for src, share in (into or {}).items():
            if src in self.g and src not in self.rejected and share > 0:
                self.g[src][node] = float(share)
                tot = sum(self.g[src].values())
                if tot > 1.0:
                    self.g[src] = {k: v / tot for k, v in self.g[src].items()}

    def level(self, node) -> float:
        return self.delta * self.weight.get(node, 0.0)

    def offer(self, node, p: float) -> list:
        """Offer the node's current p-value; returns the nodes rejected by it (possibly a cascade), in order."""
        self._p[node] = min(float(p), self._p.get(node, 1.0))
        # After every offer no node is within its level (the loop below rejects them all), and levels change only
        # when a node is rejected: so only the offered node can have become ready (the state is derived after
        # every request, with one offer per label, over every (stratum, fit) node)
        if node in self.rejected or self._p[node] > self.level(node):
            return []
        out = []
        while True:
            ready = [j for j in self.weight if j not in self.rejected and self._p.get(j, 1.0) <= self.level(j)]
            if not ready:
                return out
            j = ready[0]
            self.rejected_level[j] = self.level(j)
            self._reject(j)
            out.append(j)

    def _reject(self, j) -> None:
        self.rejected.append(j)
        alive = [k for k in self.weight if k not in self.rejected]
        gj = self.g.get(j, {})
        for k in alive:
            self.weight[k] += self.weight[j] * gj.get(k, 0.0)
        self.weight[j] = 0.0
        new = {}
        for src in alive:
            gl = self.g.get(src, {})
            glj, row = gl.get(j, 0.0), {}
            denom = 1.0 - glj * gj.get(src, 0.0)
            for k in alive:
                if k == src:
                    continue
                v = gl.get(k, 0.0) + glj * gj.get(k, 0.0)
                v = v / denom if denom > 1e-12 else 0.0
                if v > 0:
                    row[k] = v
            new[src] = row
        self.g = new


def family_delta(delta: float, *, n_strata: int, fit_index: int, n_levels: int, strata: str = "bonferroni") -> float:
    """The δ share of one (stratum, fit, level) test (module docstring, "Multiplicity")."""
    if fit_index < 1:
        raise ValueError(f"fits are numbered from 1, got {fit_index}")
    share = (1.0 / n_strata if strata == "bonferroni" else 1.0) * 0.5 ** fit_index / max(n_levels, 1)
    return float(delta) * share


@functools.lru_cache(maxsize=1024)
def labels_needed(alpha: float, delta: float, c_max: float = C_MAX, fixed: tuple = FIXED_FRACTIONS) -> int:
    """Labels without a single failure after which the test certifies (the floor of any certificate here;
    memoised: the badge asks for it on every derivation)."""
    seq = BettingSequence(alpha, delta, c_max, fixed)
    for n in range(1, 100_000):
        seq.update(0)
        if seq.certified:
            return n
    raise ValueError("no certificate within 100 000 labels")  # pragma: no cover - α, δ in (0, 1)


def run_stream(xs: Sequence[int], alpha: float, delta: float) -> BettingSequence:
    """The sequence after ``xs`` (in order)."""
    return BettingSequence(alpha, delta).extend(xs)
