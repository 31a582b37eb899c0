"""The anytime-valid sequence of learning mode (carnator_core/learn/sequence.py), by simulation under continuous
monitoring: a rule whose true excess is ≥ α almost never switches on (≤ δ, over several true excess values and
nuisance rates), a rule with a small excess switches on within a reasonable number of labels, and reference values.
Pure numpy; every simulation is bounded in labels and repetitions (not in wall time)."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from carnator_core.learn.learner import STRATA, LearnSettings, build_graph
from carnator_core.learn.sequence import (
    FIXED_FRACTIONS,
    BettingSequence,
    DriftDetector,
    GraphProcedure,
    family_delta,
    fit_share,
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


@pytest.mark.parametrize("excess,q,within", [(0.0, 0.0, 70), (0.0, 0.04, 600), (0.01, 0.01, 300)])
def test_a_safe_rule_switches_on_in_reasonable_n(excess: float, q: float, within: int) -> None:
    rng = np.random.default_rng(11)
    ns = [ever_certified(draws(rng, within, excess, q), 0.05, 0.1) for _ in range(40)]
    assert sum(n is not None for n in ns) >= 30, ns  # most runs certify within the horizon


def test_reference_values() -> None:
    # No failure at all: the number of labels to a certificate, next to the fixed-n Clopper–Pearson minimum.
    assert labels_needed(0.05, 0.1) == 63
    assert min_accepted_for_certificate(0.05, 0.1) == 45
    assert labels_needed(0.05, 0.01) == 116
    assert labels_needed(0.05, 0.1, fixed=()) == 53  # the plug-in gambler alone
    s = BettingSequence(0.05, 0.1).extend([0] * 62)
    assert not s.certified and s.upper > 0.05
    s.update(0)
    assert s.certified and s.upper <= 0.05
    # the upper sequence agrees with the test at α and only shrinks
    s = BettingSequence(0.05, 0.1)
    uppers = [s.update(int(x)).upper for x in [0] * 30 + [1] + [0] * 60]
    assert all(a >= b for a, b in zip(uppers, uppers[1:]))
    assert (uppers[-1] <= 0.05) == s.certified
    # a c label (reuse better than dense) is evidence for safety: it certifies sooner
    with_c = BettingSequence(0.05, 0.1).extend([-1] + [0] * 50)
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


def test_the_drift_detector_fires_on_drift_and_rarely_on_a_fine_rule() -> None:
    """The audits' detector is an e-detector (``DriftDetector``): its false alarms are controlled by the average
    run length (P(alarm within T audits) ≤ T/ARL while the excess is ≤ α), not by a δ over all time — the pooled
    test it replaced (P(ever) ≤ δ) took longer to fire the longer things had gone well."""
    rng = np.random.default_rng(3)
    fired = []
    for _ in range(30):
        d = DriftDetector(0.05)
        for i, x in enumerate(draws(rng, 400, 0.2, 0.2)):
            if d.update(int(x)).drifted:
                fired.append(i + 1)
                break
    assert len(fired) >= 28 and float(np.median(fired)) < 100, fired
    false = 0
    for _ in range(200):
        d = DriftDetector(0.05, arl=1000.0)
        for x in draws(rng, 300, 0.05, 0.1):  # exactly at α: H0 (excess ≤ α) holds
            if d.update(int(x)).drifted:
                false += 1
                break
    assert false / 200 <= 300 / 1000 + 3 * math.sqrt(0.3 * 0.7 / 200)


def test_the_graph_is_a_fallback_procedure_whose_result_does_not_depend_on_the_order_of_offers() -> None:
    def run(offers: list[tuple[str, float]]) -> list[str]:
        g = GraphProcedure(0.1)
        g.add("a", 0.5, {"b": 1.0})
        g.add("b", 0.25, {"c": 1.0})
        g.add("c", 0.25, {"a": 1.0})
        for node, p in offers:
            g.offer(node, p)
        return sorted(g.rejected)

    # a alone at 0.05; b at its own 0.025, or 0.075 once a is rejected; c gets everything after a and b
    assert run([("b", 0.07)]) == []
    assert run([("b", 0.07), ("a", 0.05)]) == ["a", "b"]
    assert run([("a", 0.05), ("b", 0.07), ("c", 0.099)]) == ["a", "b", "c"]
    # cyclic: c rejected at its 0.025 passes it to a (0.075), which then passes everything on to b
    assert run([("a", 0.051), ("b", 0.07), ("c", 0.024)]) == ["a", "b", "c"]
    assert run([("a", 0.08), ("b", 0.07), ("c", 0.024)]) == ["c"]
    offers = [("a", 0.04), ("b", 0.07), ("c", 0.09)]
    for perm in itertools.permutations(offers):
        assert run(list(perm)) == ["a", "b", "c"]
    # running p-values only shrink: a rejection once made stands
    g = GraphProcedure(0.1)
    g.add("a", 1.0)
    g.offer("a", 0.05)
    g.offer("a", 0.9)
    assert g.rejected == ["a"] and g.rejected_level["a"] == pytest.approx(0.1)


@pytest.mark.parametrize("excess,q,reps", [(0.05, 0.05, 200), (0.05, 0.2, 100), (0.1, 0.1, 100)])
def test_the_family_rarely_ever_switches_on_an_unsafe_kind_even_after_safe_kinds_pass_their_level_on(
        excess: float, q: float, reps: int) -> None:
    """Continuous monitoring of the whole learning family (build_graph over the ten strata): two safe kinds lead
    the order, certify and pass their level on to eight kinds whose true excess is ≥ α. P(any unsafe kind ever
    switches on) ≤ δ. (Each kind tested at the whole δ instead — ``strata="none"`` — fails this: 0.415 of 200
    runs at the first setting.)"""
    settings = LearnSettings(delta=0.2)
    order = list(STRATA)
    unsafe = set(order[2:])
    horizon = 1000
    rng = np.random.default_rng(int(100 * excess + 10 * q))
    wrong = 0
    safe_on = 0
    for _ in range(reps):
        g = build_graph(order, settings)
        seqs = {st: BettingSequence(settings.alpha, settings.delta) for st in order}
        kinds = rng.choice(order, size=horizon)
        xs = {st: iter(draws(rng, horizon, excess if st in unsafe else 0.0, q if st in unsafe else 0.0))
              for st in order}
        for st in kinds:
            seqs[st].update(int(next(xs[st])))
            g.offer((st, 1), math.exp(-seqs[st].max_log_capital))
        rejected = {node[0] for node in g.rejected}
        wrong += bool(rejected & unsafe)
        safe_on += set(order[:2]) <= rejected
    assert wrong / reps <= settings.delta + 3 * math.sqrt(settings.delta * (1 - settings.delta) / reps), wrong
    assert safe_on >= 0.9 * reps  # the safe kinds do certify (the test is not vacuous)


def test_the_floor_no_valid_test_escapes() -> None:
    """45 labels without a failure are the least any valid test at α = 0.05, δ = 0.1 certifies on: after 44 a kind
    at exactly α shows no failure with probability 0.95^44 > δ. The head of the learning order needs 86."""
    assert 0.95 ** 44 > 0.1 >= 0.95 ** 45
    assert labels_needed(0.05, 0.1 * 0.5 * fit_share(1)) == 86
    assert labels_needed(0.05, family_delta(0.1, n_strata=10, fit_index=1, n_levels=1)) == 132


def first_certified(xs: np.ndarray, fixed: tuple, level: float) -> int:
    s = BettingSequence(0.05, level, fixed=fixed)
    for i, x in enumerate(xs):
        if s.update(int(x)).certified:
            return i + 1
    return len(xs) + 1


def test_the_mixture_certifies_a_kind_failing_at_two_percent_sooner_than_the_plug_in_alone() -> None:
    """Why the test bets as a mixture: every frequent kind fails 1–3 % of its labels under the second label, and
    the plug-in gambler alone bets near its cap after a clean start, so one failure costs it most of its capital.
    Paired on the same streams at the head's level (δ·3/8), p_b = 2 %: the mixture's median is lower by a clear
    margin (simulated before the change: 212 against 322 labels), and it pays for that with at most 15 more labels
    when nothing fails."""
    rng = np.random.default_rng(5)
    level = 0.1 * 0.5 * fit_share(1)
    plug, mix = [], []
    for _ in range(60):
        xs = np.where(rng.random(1200) < 0.02, 1, 0)
        plug.append(first_certified(xs, (), level))
        mix.append(first_certified(xs, FIXED_FRACTIONS, level))
    assert np.median(mix) < 0.85 * np.median(plug), (np.median(mix), np.median(plug))
    assert sum(m < p for m, p in zip(mix, plug)) > 0.6 * len(mix)
    clean = np.zeros(200, dtype=int)
    assert first_certified(clean, (), level) < first_certified(clean, FIXED_FRACTIONS, level) <= \
        first_certified(clean, (), level) + 15


def test_the_mixture_is_the_mean_of_its_gamblers_capital() -> None:
    """The capital is the mean of the three gamblers' (each a supermartingale from 1 under H0), recomputed here
    from the recorded bets by hand; an early failure costs the plug-in gambler most, the fixed ones little."""
    xs = [0] * 40 + [1] + [0] * 10
    s = BettingSequence(0.05, 0.1).extend(xs)
    lam_plug = s._bets
    parts = [sum(math.log1p(lam * (0.05 - x)) for lam, x in zip(lam_plug, xs))]
    parts += [sum(math.log1p(f / 0.95 * (0.05 - x)) for x in xs) for f in FIXED_FRACTIONS]
    assert s.log_parts == pytest.approx(parts, abs=1e-9)
    assert s.log_capital == pytest.approx(math.log(sum(math.exp(p) for p in parts) / 3), abs=1e-9)
    assert lam_plug[40] > 0.9  # a clean start: the plug-in bets near its cap ...
    assert s.log_parts[0] < s.log_parts[2] < s.log_parts[1]  # ... and the failure costs it most
    with pytest.raises(ValueError, match="fractions"):
        BettingSequence(0.05, 0.1, fixed=(1.2,))
