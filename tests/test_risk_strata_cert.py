"""Per-stratum certificates: fixed-sequence testing over the strata, the rule file's "strata" section (recomputed on
load, never trusted), and the filter refusing a candidate whose stratum did not certify."""
from __future__ import annotations

import dataclasses
import json

import pytest
from test_risk_discrepancy import obj, sig
from test_risk_rule import make_rule

from carnator.carnator_core.risk.bounds import excess_upper_bound
from carnator.carnator_core.risk.certify import (
    STRATA_UNIT_ENTRY,
    CalibrationError,
    LabelledPair,
    StrataCertificate,
    certify_strata,
    fixed_sequence,
    read_pairs_jsonl,
)
from carnator.carnator_core.risk.filter import decide
from carnator.carnator_core.risk.rule import RiskRule, RuleFormatError
from carnator.carnator_core.risk.thresholds import Thresholds
from carnator.carnator_core.types import Candidate, Candidates

TH = Thresholds(context=5.0, size=0.3, shape=0.4, appearance=10.0)


def pair(rid: str, change: str, unsafe: bool = False, better: bool = False, *, ok: bool = True, sim: float = 0.9,
         entry: str = "e") -> LabelledPair:
    """A pair the thresholds accept (ok) or reject (context above its threshold)."""
    return LabelledPair(rid, entry, sim, 1.0 if ok else 50.0, 0.1, 0.1, 1.0, False, unsafe, better=better,
                        change=change)


def test_fixed_sequence_stops_at_the_first_failure():
    counts = {"size": (60, 0, 0), "colour": (60, 1, 0), "motion": (60, 9, 0), "reseed": (80, 0, 0)}
    cert = fixed_sequence(counts, ("size", "colour", "motion", "reseed"), 0.05, 0.1, "excess", 300, 260)
    assert cert.strata["size"].passed and cert.strata["size"].upper_bound == pytest.approx(
        excess_upper_bound(60, 0, 0, 0.1))
    # colour: b = 1 of 60 does not reach 0.05 at n = 60, so the sequence stops there: reseed is never tested
    assert not cert.strata["colour"].passed and cert.strata["colour"].tested
    assert not cert.strata["motion"].tested and not cert.strata["reseed"].tested
    assert cert.certified == ("size",) and cert.covered == 60 and cert.coverage == pytest.approx(0.2)
    # in another order reseed certifies too: the order is part of the procedure, fixed before the data
    cert2 = fixed_sequence(counts, ("reseed", "size", "colour"), 0.05, 0.1, "excess", 300, 260)
    assert cert2.certified == ("reseed", "size")
    # a stratum of the order without data fails (n = 0, U = 1) and stops the sequence
    assert fixed_sequence({"size": (60, 0, 0)}, ("colour", "size"), 0.05, 0.1, "excess", 60, 60).certified == ()
    # strata with data that the order does not list are never certified
    assert fixed_sequence(counts, ("size",), 0.05, 0.1, "excess", 300, 260).strata["reseed"].tested is False


def test_certify_strata_counts_the_rules_choice_and_leaves_exact_repeats_out():
    pairs = []
    for i in range(50):  # 50 size edits, accepted and safe
        pairs.append(pair(f"s1:q{i}", "size"))
    for i in range(50):  # 50 motion edits, accepted; 5 unsafe, 1 better
        pairs.append(pair(f"s2:m{i}", "motion", unsafe=i < 5, better=i == 7))
    for i in range(10):  # rejected by the thresholds: no stratum counts them
        pairs.append(pair(f"s1:r{i}", "colour", unsafe=True, ok=False))
    # an exact-repeat request (with another candidate as well): out of n entirely
    pairs += [pair("s1:x", "exact", entry="a", sim=1.0), pair("s1:x", "rewording", unsafe=True, entry="b", sim=0.8)]
    cert = certify_strata(TH, pairs, order=("size", "motion", "colour"))
    assert cert.n_requests == 110 and cert.accepted == 100
    assert (cert.strata["size"].n, cert.strata["size"].k, cert.strata["size"].c) == (50, 0, 0)
    assert (cert.strata["motion"].n, cert.strata["motion"].k, cert.strata["motion"].c) == (50, 5, 1)
    assert cert.certified == ("size",) and not cert.strata["motion"].passed
    assert cert.runs == {"s1": {"size": (50, 0, 0)}, "s2": {"motion": (50, 5, 1)}}
    with pytest.raises(CalibrationError, match="without a 'change'"):
        certify_strata(TH, [dataclasses.replace(pairs[0], change=None)])


def _rule_with(strata: StrataCertificate) -> RiskRule:
    return dataclasses.replace(make_rule(thresholds=TH), strata=strata)


def test_rule_file_round_trip_and_recomputation(tmp_path):
    cert = fixed_sequence({"size": (60, 0, 0), "reseed": (70, 0, 0), "motion": (40, 4, 0)},
                          ("size", "reseed", "motion"), 0.05, 0.1, "excess", 200, 170)
    rule = _rule_with(cert)
    path = rule.save(tmp_path / "r.json")
    back = RiskRule.load(path)
    assert back.strata is not None and back.strata.certified == ("size", "reseed")
    assert back.strata.to_dict() == cert.to_dict() and back.rule_id == rule.rule_id
    doc = json.loads(path.read_text())
    # a hand-edited bound, verdict or certified list does not load
    for edit in (lambda d: d["strata"]["strata"]["motion"].update(upper_bound=0.01),
                 lambda d: d["strata"]["strata"]["motion"].update(passed=True),
                 lambda d: d["strata"].update(certified=["size", "reseed", "motion"]),
                 lambda d: d["strata"]["strata"]["motion"].update(k=0),  # changes U: recomputed bound mismatch
                 lambda d: d["strata"].update(order=["size", "reseed", "teleport"]),
                 lambda d: d["strata"].update(method="bonferroni")):
        bad = json.loads(json.dumps(doc))
        edit(bad)
        with pytest.raises(RuleFormatError):
            RiskRule.from_json(bad)
    # a rule without the section still loads (certified on average only)
    del doc["strata"]
    assert RiskRule.from_json(doc).strata is None


def _cand(entry_id: str, prompt: str, seed: int, similarity: float = 0.95) -> Candidate:
    return Candidate(entry_id=entry_id, similarity=similarity, prompt=prompt, signature=sig(obj("ball")), seed=seed)


def test_filter_refuses_a_candidate_whose_stratum_did_not_certify():
    rule = _rule_with(fixed_sequence({"reseed": (60, 0, 0), "motion": (60, 9, 0)}, ("reseed", "motion"), 0.05,
                                     0.1, "excess", 120, 120))
    target = sig(obj("ball"))
    prompt = "a big red ball moves to the right in the center, on green grass"
    ns = rule.namespace
    # same prompt, another seed: reseed certified -> accepted, and the verdict names the stratum
    d = decide(target, Candidates(ns, (_cand("a", prompt, 2),)), rule, request=(prompt, 1))
    assert d.accepted and "'reseed'" in d.verdicts[0].reason
    # a motion edit: passes the thresholds, but motion did not certify -> dense, and says why
    moved = prompt.replace("moves to the right", "moves up")
    d = decide(target, Candidates(ns, (_cand("b", moved, 1),)), rule, request=(prompt, 1))
    assert not d.accepted and "'motion'" in d.verdicts[0].reason and "refused" in d.verdicts[0].reason
    assert "REJECT" in d.summary
    # no fall-through: a certified candidate ranked below the refused choice is not served instead
    d = decide(target, Candidates(ns, (_cand("b", moved, 1, 0.99), _cand("a", prompt, 2, 0.9))), rule,
               request=(prompt, 1))
    assert not d.accepted
    # without the request's prompt the filter cannot tell the stratum: refused, with the way out
    d = decide(target, Candidates(ns, (_cand("a", prompt, 2),)), rule)
    assert not d.accepted and "Early Probe" in d.verdicts[0].reason
    # a rule without strata decides as before
    d = decide(target, Candidates(ns, (_cand("b", moved, 1),)), make_rule(thresholds=TH), request=(prompt, 1))
    assert d.accepted


def test_shipped_rule_strata_recompute_from_their_pairs():
    """Each stratum certificate of rules/embedded.json is recomputed from the certification pairs it names."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    rule = RiskRule.load(root / "rules" / "embedded.json")
    if rule.strata is None:
        pytest.fail("rules/embedded.json has no per-stratum certificates")
    files = rule.provenance.get("strata_pairs")
    assert files, "the rule must name the pairs its strata were certified on (provenance.strata_pairs)"
    pairs = []
    for name in files:
        _h, ps = read_pairs_jsonl(root / "rules" / name)
        pairs += ps
    got = certify_strata(rule.thresholds, pairs, order=rule.strata.order, alpha=rule.strata.alpha,
                         delta=rule.strata.delta, label=rule.strata.label,
                         entry_unit=rule.strata.unit == STRATA_UNIT_ENTRY)
    assert got.to_dict() == rule.strata.to_dict()


def test_shipped_rule_withdraws_strata_whose_failures_cluster_on_one_cached_entry():
    """The shipped rule is certified with both bounds per stratum (rules/protocols/attempt21.md): rewording's three
    failures fall on two cached entries of one run, so it passes the request bound but not the entry-unit bound and
    stops the sequence; size and colour hold under both; reseed (no failure) comes after it and is not tested."""
    from pathlib import Path

    rule = RiskRule.load(Path(__file__).resolve().parents[1] / "rules" / "embedded.json")
    assert rule.strata is not None and rule.strata.unit == STRATA_UNIT_ENTRY
    assert rule.strata.certified == ("size", "colour")
    rewording = rule.strata.strata["rewording"]
    assert rewording.upper_bound <= rule.strata.alpha < rewording.entry_upper_bound and not rewording.passed
    assert "cluster on cached entries" in rule.strata.describe("rewording")
    assert not rule.strata.allows("reseed") and not rule.strata.strata["reseed"].tested


def test_design_effect_and_entry_unit_bound_by_hand():
    """Rao–Scott by hand: failures spread one per entry leave the counts alone; the same failures in one entry
    halve the evidence; the bound is Clopper–Pearson at the effective counts and is never below the request bound."""
    from scipy.stats import beta

    from carnator.carnator_core.risk.certify import design_effect, entry_unit_bound

    spread = [(1, 1), (1, 1)] + [(1, 0)] * 98
    burst = [(2, 2)] + [(1, 0)] * 98
    assert design_effect(spread) == pytest.approx(1.0, abs=0.02)
    n, b, m = 100, 2, 99
    p = b / n
    v_clu = m / (m - 1) * ((2 - p * 2) ** 2 + 98 * p ** 2) / n ** 2
    deff = v_clu / (p * (1 - p) / n)
    assert design_effect(burst) == pytest.approx(deff, rel=1e-12) and deff > 1.9
    got_deff, u = entry_unit_bound(burst, 0.1)
    assert u == pytest.approx(beta.ppf(0.9, b / deff + 1, (n - b) / deff), rel=1e-12)
    assert u > beta.ppf(0.9, b + 1, n - b) > entry_unit_bound(spread, 0.1)[1] - 1e-3
    assert design_effect([(5, 0)] * 10) == 1.0 and entry_unit_bound([], 0.1) == (1.0, 1.0)


def test_entry_unit_strata_document_is_recomputed_on_load():
    """A strata document with per-entry clusters is replayed on load: edited clusters or an edited entry bound are
    refused; the fixed sequence stops at the first stratum that fails either bound."""
    clusters = {"size": [(1, 0)] * 60, "reseed": [(3, 3)] + [(1, 0)] * 147}
    cert = fixed_sequence({"size": (60, 0, 0), "reseed": (150, 3, 0)}, ("size", "reseed"), 0.05, 0.1, "excess", 300,
                          250, None, clusters)
    assert cert.certified == ("size",) and cert.strata["reseed"].upper_bound <= 0.05
    d = cert.to_dict()
    assert StrataCertificate.from_dict(d).to_dict() == d
    bad = json.loads(json.dumps(d))
    bad["strata"]["reseed"]["clusters"] = [[1, 1]] * 3 + [[1, 0]] * 147  # spread the burst out by hand
    with pytest.raises(ValueError, match="passed is False"):
        StrataCertificate.from_dict(bad)
    bad = json.loads(json.dumps(d))
    bad["strata"]["reseed"]["clusters"] = [[1, 0]] * 150
    with pytest.raises(ValueError, match="clusters must list"):
        StrataCertificate.from_dict(bad)


def test_runs_heterogeneity_is_fishers_test_for_two_runs_and_enumerates_more(monkeypatch):
    """The exact test reported beside each pooled stratum: Fisher's two-sided p for two runs; for more, every
    allocation of the failures no more likely than the observed one (recomputed by hand here)."""
    from scipy.stats import chi2_contingency, fisher_exact

    from carnator.carnator_core.risk import certify
    from carnator.carnator_core.risk.certify import runs_heterogeneity

    for (n1, b1), (n2, b2) in (((35, 3), (36, 0)), ((40, 2), (38, 2)), ((12, 0), (8, 1)), ((50, 9), (7, 0))):
        p, how = runs_heterogeneity([(n1, b1), (n2, b2)])
        assert how == "exact" and p == pytest.approx(fisher_exact([[b1, n1 - b1], [b2, n2 - b2]])[1], abs=1e-12)
    # three runs of 3, 1 and 2 requests, 2 failures, both in the first: of the C(6, 2) = 15 equally likely ways, the
    # allocations (2,0,0), (1,1,0), (1,0,1), (0,1,1), (0,0,2) have 3, 3, 6, 2, 1 ways; p = (3 + 3 + 2 + 1) / 15
    assert runs_heterogeneity([(3, 2), (1, 0), (2, 0)]) == (pytest.approx(9 / 15), "exact")
    # all failures in one run of four equal runs is rare; spread evenly is not
    assert runs_heterogeneity([(35, 4), (35, 0), (35, 0), (35, 0)])[0] < 0.02
    assert runs_heterogeneity([(35, 1), (35, 1), (35, 1), (35, 1)])[0] == pytest.approx(1.0)
    # nothing to compare: one run with data, or no failure at all
    assert runs_heterogeneity([(35, 2), (0, 0)]) is None and runs_heterogeneity([(35, 0), (30, 0)]) is None
    with pytest.raises(ValueError, match="b = 5 of n = 3"):
        runs_heterogeneity([(3, 5), (4, 0)])
    # too many allocations to enumerate: Pearson's χ², and said so
    monkeypatch.setattr(certify, "_MAX_TABLES", 1)
    table = [(35, 6), (39, 0), (42, 3), (36, 1)]
    p, how = runs_heterogeneity(table)
    assert how == "chi2" and p == pytest.approx(chi2_contingency([[b, n - b] for n, b in table], correction=False)[1])
