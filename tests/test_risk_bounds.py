"""The bounds the certificate rests on: reference values, an independent brute-force inversion, and simulated
coverage (the bound must hold with probability ≥ 1 − δ, including where b and c are both frequent — the model's
own sampling noise — which is where a label that counts only b certifies nothing)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import beta, multinomial

from carnator.carnator_core.risk.bounds import (
    clopper_pearson_lower,
    clopper_pearson_upper,
    excess_upper_bound,
    excess_upper_bound_approx,
    excess_upper_bound_union,
)


def test_clopper_pearson_reference_values():
    assert clopper_pearson_upper(0, 50, 0.1) == pytest.approx(0.0450, abs=5e-5)  # the seed's certificate
    assert clopper_pearson_upper(2, 173, 0.1) == pytest.approx(0.030470653944720875, rel=1e-9)  # shipped rule
    assert clopper_pearson_lower(0, 50, 0.05) == 0.0
    assert clopper_pearson_lower(10, 100, 0.05) == pytest.approx(beta.ppf(0.05, 10, 91), rel=1e-12)
    assert clopper_pearson_upper(5, 5, 0.1) == 1.0


def test_union_bound_is_the_difference_of_two_half_delta_bounds():
    assert excess_upper_bound_union(300, 10, 4, 0.1) == pytest.approx(
        clopper_pearson_upper(10, 300, 0.05) - clopper_pearson_lower(4, 300, 0.05), rel=1e-12)


def test_exact_bound_with_no_discordant_request_is_clopper_pearson():
    # b = c = 0: the worst case is q = Δ0 (every discordant request a b), i.e. the binomial bound with k = 0
    assert excess_upper_bound(50, 0, 0, 0.1) == pytest.approx(clopper_pearson_upper(0, 50, 0.1), abs=2e-4)
    assert excess_upper_bound(0, 0, 0, 0.1) == 1.0


@pytest.mark.parametrize("n,b,c", [(300, 42, 42), (600, 80, 80), (300, 10, 2), (173, 2, 0), (40, 6, 1)])
def test_exact_bound_is_never_looser_than_the_union_bound(n, b, c):
    assert excess_upper_bound(n, b, c, 0.1) <= excess_upper_bound_union(n, b, c, 0.1) + 2e-4


def test_floor_of_a_fresh_dense_sample_certifies_at_realistic_n():
    # a fresh dense sample judged as a reuse: b ≈ c ≈ p(1 − p) n; with p = 17 % at n = 300 the exact bound holds
    # at α = 5 % where the union bound (and b/n alone) cannot
    n, b, c = 300, 42, 42
    assert excess_upper_bound(n, b, c, 0.1) <= 0.05
    assert excess_upper_bound_union(n, b, c, 0.1) > 0.05
    assert clopper_pearson_upper(b, n, 0.1) > 0.05


def _brute_force_upper(n: int, b: int, c: int, delta: float, step: float = 0.005) -> float:
    """Independent inversion on a (Δ0, q) grid with scipy's multinomial pmf (small n only)."""
    outcomes = [(i, j) for i in range(n + 1) for j in range(n + 1 - i)]
    stat = np.array([excess_upper_bound_approx(n, i, j, delta) for i, j in outcomes])
    region = [o for o, s in zip(outcomes, stat) if s <= excess_upper_bound_approx(n, b, c, delta) + 1e-12]
    counts = np.array([[i, j, n - i - j] for i, j in region])
    best = 0.0
    for d0 in np.arange(0.0, 0.8 + 1e-9, step):
        qs = np.linspace(d0, 1.0, 150)
        # the same pmf for all 150 q at once (scipy broadcasts counts [R, 1, 3] against probabilities [1, 150, 3]):
        # the largest over q of the region's probability, as one call per q gave it, ~20x faster
        probs = np.stack([(qs + d0) / 2, (qs - d0) / 2, 1 - qs], axis=1)
        p = multinomial.pmf(counts[:, None, :], n, probs[None, :, :]).sum(axis=0).max()
        if p > delta:
            best = d0
    return best


@pytest.mark.parametrize("n,b,c", [(12, 2, 1), (15, 0, 0), (10, 3, 3)])
def test_exact_bound_matches_a_brute_force_inversion(n, b, c):
    u = excess_upper_bound(n, b, c, 0.1)
    ref = _brute_force_upper(n, b, c, 0.1)
    assert ref - 1e-9 <= u <= ref + 0.005 + 2e-4  # the grid's last accepted Δ0 ≤ the bound ≤ the next grid step


@pytest.mark.parametrize("pb,pc,n", [(0.05, 0.0, 60), (0.15, 0.15, 60), (0.3, 0.25, 40), (0.08, 0.02, 80)])
def test_exact_bound_covers_the_true_excess_in_simulation(pb, pc, n):
    delta = 0.1
    rng = np.random.default_rng(1234)
    draws = rng.multinomial(n, [pb, pc, 1 - pb - pc], size=300)
    memo: dict[tuple[int, int], float] = {}
    covered = 0
    for b, c, _ in draws:
        key = (int(b), int(c))
        if key not in memo:
            memo[key] = excess_upper_bound(n, *key, delta)
        covered += int(pb - pc <= memo[key] + 1e-12)
    rate = covered / len(draws)
    # 1 − δ minus three binomial standard errors of the simulation itself
    assert rate >= (1 - delta) - 3 * math.sqrt(delta * (1 - delta) / len(draws)), rate


def test_bad_counts_are_refused_with_a_clear_message():
    with pytest.raises(ValueError, match="b \\+ c ≤ n"):
        excess_upper_bound(10, 8, 5, 0.1)
    with pytest.raises(ValueError, match="δ must be in"):
        excess_upper_bound(10, 1, 1, 1.5)
