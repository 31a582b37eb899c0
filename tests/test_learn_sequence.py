"""The anytime-valid sequence of learning mode (carnator_core/learn/sequence.py), by simulation under continuous
monitoring: a rule whose true excess is ≥ α almost never switches on (≤ δ, over several true excess values and
nuisance rates), a rule with a small excess switches on within a reasonable number of labels, and reference values.
Pure numpy; every simulation is bounded in labels and repetitions (not in wall time)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from carnator_core.learn.sequence import (
    BettingSequence,
    DriftTest,
    family_delta,
    kelly_bet,
    labels_needed,
)
from carnator_core.risk.bounds import min_accepted_for_certificate


def draws(rng: np.random.Generator, n: int, excess: float, q: float) -> np.ndarray:
    """n labels with p_b − p_c = excess and p_b + p_c = q."""
    pb, pc = (q + excess) / 2, (q - excess) / 2
    u = rng.random(n)
    return np.where(u < pb, 1, np.where(u < pb + pc, -1, 0))


def ever_certified(xs: np.ndarray, alpha: float, delta: float) -> int | None:
    """The label at which the test first certifies, checked after every label (continuous monitoring)."""
    s = BettingSequence(alpha, delta)
    for i, x in enumerate(xs):
        s.update(int(x))
        if s.certified:
            return i + 1
    return None


@pytest.mark.parametrize("excess,q", [(0.05, 0.05), (0.05, 0.15), (0.05, 0.4), (0.08, 0.1), (0.15, 0.3)])
def test_a_rule_at_or_above_alpha_rarely_ever_switches_on(excess: float, q: float) -> None:
    alpha, delta, reps, horizon = 0.05, 0.2, 300, 400
    rng = np.random.default_rng(int(1000 * excess + 100 * q))
    wrong = sum(ever_certified(draws(rng, horizon, excess, q), alpha, delta) is not None for _ in range(reps))
    # Ville's inequality: P(ever) ≤ δ. Allow 3 binomial standard errors of sampling noise above δ.
    assert wrong / reps <= delta + 3 * math.sqrt(delta * (1 - delta) / reps), (excess, q, wrong)


def test_the_boundary_case_is_not_trivially_conservative() -> None:
    """At the boundary with no discordance at all except b at rate α the test does bet (it is not a test that
    never certifies): some runs cross, fewer than δ of them."""
    alpha, delta, reps = 0.05, 0.3, 300
    rng = np.random.default_rng(7)
    crossed = sum(ever_certified(draws(rng, 300, 0.05, 0.05), alpha, delta) is not None for _ in range(reps))
    assert 0 < crossed / reps <= delta


@pytest.mark.parametrize("excess,q,within", [(0.0, 0.0, 60), (0.0, 0.04, 600), (0.01, 0.01, 300)])
def test_a_safe_rule_switches_on_in_reasonable_n(excess: float, q: float, within: int) -> None:
    rng = np.random.default_rng(11)
    ns = [ever_certified(draws(rng, within, excess, q), 0.05, 0.1) for _ in range(40)]
    assert sum(n is not None for n in ns) >= 30, ns  # most runs certify within the horizon


def test_reference_values() -> None:
    # No failure at all: the number of labels to a certificate, next to the fixed-n Clopper–Pearson minimum.
    assert labels_needed(0.05, 0.1) == 53
    assert min_accepted_for_certificate(0.05, 0.1) == 45
    assert labels_needed(0.05, 0.01) == 100
    s = BettingSequence(0.05, 0.1).extend([0] * 52)
    assert not s.certified and s.upper > 0.05
    s.update(0)
    assert s.certified and s.upper <= 0.05
    # the upper sequence agrees with the test at α and only shrinks
    s = BettingSequence(0.05, 0.1)
    uppers = [s.update(int(x)).upper for x in [0] * 30 + [1] + [0] * 60]
    assert all(a >= b for a, b in zip(uppers, uppers[1:]))
    assert (uppers[-1] <= 0.05) == s.certified
    # a c label (reuse better than dense) is evidence for safety: it certifies sooner
    with_c = BettingSequence(0.05, 0.1).extend([-1] + [0] * 46)
    assert with_c.certified and with_c.n < labels_needed(0.05, 0.1)
    assert kelly_bet((1.0,), (1.0,), 0.5) == 0.5 and kelly_bet((-1.0,), (1.0,), 0.5) == 0.0


def test_replay_is_deterministic_and_bad_labels_refused() -> None:
    xs = [0, 0, 1, -1, 0, 0, 0, 1]
    a, b = BettingSequence(0.05, 0.1).extend(xs), BettingSequence(0.05, 0.1).extend(xs)
    assert a.to_dict() == b.to_dict()
    with pytest.raises(ValueError, match="−1"):
        BettingSequence(0.05, 0.1).update(2)
    with pytest.raises(ValueError, match="α"):
        BettingSequence(1.5, 0.1)


def test_family_delta_splits_over_strata_fits_and_levels() -> None:
    assert family_delta(0.1, n_strata=10, fit_index=1, n_levels=1) == pytest.approx(0.005)
    assert family_delta(0.1, n_strata=10, fit_index=2, n_levels=2) == pytest.approx(0.00125)
    assert family_delta(0.1, n_strata=10, fit_index=1, n_levels=1, strata="none") == pytest.approx(0.05)
    total = sum(family_delta(0.1, n_strata=10, fit_index=j, n_levels=3) * 10 * 3 for j in range(1, 40))
    assert total <= 0.1


def test_drift_test_fires_on_drift_and_rarely_on_a_fine_rule() -> None:
    rng = np.random.default_rng(3)
    fired = []
    for _ in range(30):
        d = DriftTest(0.05, 0.1)
        for i, x in enumerate(draws(rng, 400, 0.2, 0.2)):
            if d.update(int(x)).drifted:
                fired.append(i + 1)
                break
    assert len(fired) >= 28 and float(np.median(fired)) < 100, fired
    false = 0
    for _ in range(200):
        d = DriftTest(0.05, 0.2)
        for x in draws(rng, 300, 0.05, 0.1):  # exactly at α: H0 (excess ≤ α) holds
            if d.update(int(x)).drifted:
                false += 1
                break
    assert false / 200 <= 0.2 + 3 * math.sqrt(0.2 * 0.8 / 200)
