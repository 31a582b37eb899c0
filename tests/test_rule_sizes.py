"""Rule files are checked for plausible sizes before any bound is computed, and the exact excess bound's cost is
bounded: a rule file claiming a huge n (n = 4,000 cost 196 s at queue time; n = 10**15 a MemoryError) must not
make loading it a denial of service. Work is bounded by counting: a tripwire on the exact bound's O(n²) table
(``bounds._outcomes``) fails the test if it is built for an n above ``bounds.EXACT_MAX_N`` or at all for a
refused file. Pure core (no ComfyUI)."""
from __future__ import annotations

import dataclasses
import json

import pytest
from test_risk_rule import make_rule

from carnator.carnator_core.risk import bounds, certify
from carnator.carnator_core.risk.certify import Certificate
from carnator.carnator_core.risk.rule import RiskRule, RuleFormatError


@pytest.fixture()
def tripwire(monkeypatch):
    """Records each n the exact bound builds its outcome table for; an n above EXACT_MAX_N fails at once."""
    built: list[int] = []
    real = bounds._outcomes
    limit = getattr(bounds, "EXACT_MAX_N", 1200)

    def outcomes(n: int):
        built.append(int(n))
        assert n <= limit, f"the exact bound's O(n²) table was built for n={n}"
        return real(n)

    monkeypatch.setattr(bounds, "_outcomes", outcomes)
    certify.certificate_bound.cache_clear()
    yield built
    certify.certificate_bound.cache_clear()


def _doc(n: int, k: int, c: int, n_requests: int, upper: float, strata: dict | None = None) -> dict:
    doc = make_rule().to_json()
    cert = {"n": n, "k": k, "c": c, "label": "excess", "upper_bound": upper, "alpha": 0.05, "delta": 0.1,
            "n_requests": n_requests, "passed": upper <= 0.05, "coverage": n / n_requests, "method": "x",
            "unsafe_upper_bound": None}
    if strata is not None:
        cert["strata"] = strata
    doc["certificate"] = cert
    return doc


@pytest.mark.parametrize("field,value", [("n", 10**15), ("n_requests", 10**15), ("k", 10**12), ("c", 10**12)])
def test_implausible_sizes_are_refused_before_any_bound(tripwire, tmp_path, field, value):
    doc = _doc(4000, 40, 30, 5000, 0.01)
    doc["certificate"][field] = value
    if field == "n":
        doc["certificate"]["n_requests"] = value  # consistent otherwise: only the size is wrong
    path = tmp_path / "huge.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(RuleFormatError, match="implausible"):
        RiskRule.load(path, allow_uncertified=True)
    assert tripwire == []


def test_a_large_plausible_certificate_costs_a_constant_time_bound(tripwire, tmp_path):
    """n = 4,000: valid sizes, above EXACT_MAX_N: the union bound (valid at the same confidence, never below
    the exact one) is what the certificate carries, computed in constant time."""
    n, k, c = 4000, 40, 30
    union = bounds.excess_upper_bound_union(n, k, c, 0.1)
    assert bounds.excess_upper_bound(n, k, c, 0.1) == pytest.approx(max(0.0, union), abs=1e-12)
    path = tmp_path / "big.json"
    path.write_text(json.dumps(_doc(n, k, c, 5000, max(0.0, union))))
    rule = RiskRule.load(path, allow_uncertified=True)
    assert rule.certificate.n == n and tripwire == []


def test_strata_are_checked_before_the_top_level_bound(tripwire, tmp_path):
    """Many strata each just under EXACT_MAX_N would each cost the maximum: the total exact work of a rule is
    budgeted (strata count, stratum n ≤ its certificate's n, Σ n² of exact bounds) before anything is computed."""
    m = bounds.EXACT_MAX_N
    one = {"n": m, "k": 0, "c": 0, "label": "excess", "upper_bound": 0.0, "alpha": 0.05, "delta": 0.1,
           "n_requests": m, "passed": False, "coverage": 1.0, "method": "x", "unsafe_upper_bound": None}
    path = tmp_path / "strata.json"
    path.write_text(json.dumps(_doc(60 * m, 0, 0, 60 * m, 0.0, {f"s{i}": dict(one) for i in range(50)})))
    with pytest.raises(RuleFormatError, match="exact bound"):
        RiskRule.load(path, allow_uncertified=True)
    bigger = dict(one, n=61 * m, n_requests=61 * m)
    path.write_text(json.dumps(_doc(60 * m, 0, 0, 60 * m, 0.0, {"s": bigger})))
    with pytest.raises(RuleFormatError, match="stratum"):
        RiskRule.load(path, allow_uncertified=True)
    path.write_text(json.dumps(_doc(60 * m, 0, 0, 60 * m, 0.0, {f"s{i}": dict(one, n=1) for i in range(500)})))
    with pytest.raises(RuleFormatError, match="strata"):
        RiskRule.load(path, allow_uncertified=True)
    # The per-stratum certificates (the rule's "strata" section) count towards the same budget.
    from carnator.carnator_core.risk.strata import STRATA

    doc = _doc(60 * m, 0, 0, 60 * m, 0.0)
    doc["strata"] = {"method": "x", "order": list(STRATA), "alpha": 0.05, "delta": 0.1, "label": "excess",
                     "n_requests": 60 * m, "accepted": 60 * m, "strata": {s: {"n": m, "k": 0, "c": 0} for s in STRATA}}
    path.write_text(json.dumps(doc))
    with pytest.raises(RuleFormatError, match="exact bound"):
        RiskRule.load(path, allow_uncertified=True)
    doc["strata"]["strata"] = {s: {"n": 10**9, "k": 0, "c": 0} for s in STRATA}
    path.write_text(json.dumps(doc))
    with pytest.raises(RuleFormatError, match="implausible"):
        RiskRule.load(path, allow_uncertified=True)
    assert tripwire == []


def test_shipped_sizes_still_load_exactly(tripwire):
    """A certificate at the shipped rules' sizes keeps its exact bound (nothing changes for them)."""
    n, k, c = 150, 2, 1
    cert = Certificate(n=n, k=k, c=c, label="excess", upper_bound=certify.certificate_bound("excess", n, k, c, 0.1),
                       alpha=0.2, delta=0.1, n_requests=200)
    rule = RiskRule.from_json(dataclasses.replace(make_rule(), certificate=cert).to_json())
    assert rule.certificate.upper_bound <= bounds.excess_upper_bound_union(n, k, c, 0.1) and tripwire == [150]
