"""Clopper–Pearson bound, calibration under α, certification, splits, pairs files."""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from scipy.stats import beta

from carnator.carnator_core.lab.synthetic import synthetic_pairs
from carnator.carnator_core.risk.certify import (
    CalibrationError,
    LabelledPair,
    _levels,
    calibrate,
    calibrate_prompt_only,
    certify,
    clopper_pearson_upper,
    compare_paired,
    evaluate,
    evaluate_prompt_only,
    min_accepted_for_certificate,
    prompt_only_accepted,
    read_pairs_jsonl,
    sign_test_p,
    split_pairs,
    write_pairs_jsonl,
)
from carnator.carnator_core.risk.thresholds import Thresholds

# ----------------------------------------------------------------------------------------- the bound


def test_seed_reference_value():
    # The seed's certificate: 0 unsafe of 50 accepted, δ = 0.1 → U = 4.50%.
    assert round(clopper_pearson_upper(0, 50, 0.1), 4) == 0.0450


@pytest.mark.parametrize(
    "k,n,delta",
    [(0, 1, 0.1), (0, 10, 0.05), (1, 50, 0.1), (3, 70, 0.1), (5, 100, 0.05), (10, 200, 0.01), (49, 50, 0.1),
     (7, 9, 0.3)],
)
def test_bound_matches_scipy(k, n, delta):
    assert clopper_pearson_upper(k, n, delta) == pytest.approx(beta.ppf(1 - delta, k + 1, n - k), rel=1e-12)


def test_bound_k_zero_closed_form_and_edges():
    for n in (1, 5, 45, 50, 300):
        assert clopper_pearson_upper(0, n, 0.1) == pytest.approx(1 - 0.1 ** (1 / n), rel=1e-10)
    assert clopper_pearson_upper(0, 0, 0.1) == 1.0  # no evidence at all
    assert clopper_pearson_upper(4, 4, 0.1) == 1.0
    for bad in [(-1, 5, 0.1), (6, 5, 0.1), (0, 5, 0.0), (0, 5, 1.0)]:
        with pytest.raises(ValueError):
            clopper_pearson_upper(*bad)


def test_bound_is_monotone():
    us = [clopper_pearson_upper(k, 100, 0.1) for k in range(0, 20)]
    assert all(b > a for a, b in zip(us, us[1:]))
    assert all(clopper_pearson_upper(k, 100, 0.1) >= k / 100 for k in range(0, 100))


def test_min_accepted_for_certificate():
    assert min_accepted_for_certificate(0.05, 0.1) == 45
    for a, d in [(0.05, 0.1), (0.1, 0.05), (0.01, 0.2)]:
        n = min_accepted_for_certificate(a, d)
        assert clopper_pearson_upper(0, n, d) <= a < clopper_pearson_upper(0, n - 1, d)


# ----------------------------------------------------------------------------------------- calibration


def _random_dataset(rng: np.random.Generator, i: int) -> list[LabelledPair]:
    return synthetic_pairs(
        int(rng.integers(30, 160)),
        seed=1000 + i,
        max_candidates=int(rng.integers(1, 5)),
        z_unsafe=float(rng.uniform(0.2, 0.9)),
        steepness=float(rng.uniform(3, 40)),
        noise=float(rng.uniform(0.0, 0.5)),
        p_missing=float(rng.uniform(0.0, 0.3)),
        base_unsafe=float(rng.choice([0.0, 0.0, 0.02, 0.1])),
        similarity_decimals=int(rng.choice([2, 6])),  # 2 decimals → many exact similarity ties
    )


def test_calibration_never_violates_alpha_on_the_calibration_split():
    """Property test over many seeded random datasets: whatever comes back satisfies the constraint exactly."""
    rng = np.random.default_rng(20261129)
    returned = refused = 0
    for i in range(80):
        pairs = _random_dataset(rng, i)
        alpha = float(rng.choice([0.05, 0.1, 0.2]))
        delta = float(rng.choice([0.05, 0.1, 0.2]))
        constraint = ["bound", "empirical"][i % 2]
        try:
            cal = calibrate(pairs, alpha, delta, constraint=constraint, levels=int(rng.integers(3, 9)),
                            search_similarity=bool(i % 3 == 0))
        except CalibrationError:
            refused += 1
            continue
        returned += 1
        ev = evaluate(cal.thresholds, pairs)  # independent re-evaluation
        assert ev == cal.evaluation
        assert ev.n_accepted > 0
        assert ev.k_unsafe / ev.n_accepted <= alpha, (i, ev)
        assert ev.n_accepted >= min_accepted_for_certificate(alpha, delta)
        if constraint == "bound":
            assert clopper_pearson_upper(ev.k_unsafe, ev.n_accepted, delta) <= alpha
    # the loop must exercise both outcomes to mean anything
    assert returned >= 20 and refused >= 3, (returned, refused)


def test_calibration_finds_the_max_coverage_setting_of_its_grid():
    """Brute force over the same grid with the exact evaluator: nothing feasible covers more."""
    pairs = synthetic_pairs(120, seed=7, max_candidates=2)
    alpha, delta, levels = 0.1, 0.1, 4
    cal = calibrate(pairs, alpha, delta, constraint="empirical", levels=levels, min_accepted=10)
    usable = [p for p in pairs if not p.missing]
    grids = [_levels(np.array([p.vector()[d] for p in usable]), levels) for d in range(4)]
    best = 0
    for combo in itertools.product(*grids):
        ev = evaluate(Thresholds(*map(float, combo)), pairs)
        if ev.n_accepted >= 10 and ev.unsafe_rate <= alpha:
            best = max(best, ev.n_accepted)
    assert cal.evaluation.n_accepted == best


def test_exact_recheck_skips_a_setting_whose_similarity_tie_break_differs():
    """Two candidates of one request with equal similarity: the filter breaks the tie by normalised discrepancy.
    The vectorised search does not; the exact re-check must catch the setting where that matters."""
    safe = [LabelledPair(f"s{i}", "e", 0.9, 1, 0.1, 0.1, 1, missing=False, unsafe=False) for i in range(60)]
    wide = LabelledPair("w", "e", 0.9, 1, 0.3, 0.1, 1, missing=False, unsafe=False)
    tie = [
        LabelledPair("t", "a", 0.8, 9, 0.1, 0.1, 1, missing=False, unsafe=False),
        LabelledPair("t", "b", 0.8, 1, 0.3, 0.1, 1, missing=False, unsafe=True),
    ]
    pairs = safe + [wide] + tie
    loose = evaluate(Thresholds(9, 0.3, 0.1, 1), pairs)
    assert (loose.n_accepted, loose.k_unsafe) == (62, 1)  # the filter would pick the unsafe "b" here
    cal = calibrate(pairs, 0.01, 0.1, constraint="empirical", levels=8, min_accepted=10)
    assert cal.evaluation.k_unsafe == 0 and cal.evaluation.n_accepted == 61


def test_calibration_refuses_hopeless_data_with_a_clear_message():
    pairs = synthetic_pairs(60, seed=3, base_unsafe=0.5)
    with pytest.raises(CalibrationError, match="no threshold setting satisfies"):
        calibrate(pairs, 0.05, 0.1)
    all_missing = [LabelledPair("r", "e", 0.9, 0, 0, 0, 0, missing=True, unsafe=False)]
    with pytest.raises(CalibrationError, match="missing on one side"):
        calibrate(all_missing)


def test_missing_object_pairs_are_never_accepted():
    pairs = [
        LabelledPair(f"r{i}", "e", 0.99, 0.0, 0.0, 0.0, 0.0, missing=(i % 2 == 0), unsafe=False) for i in range(200)
    ]
    cal = calibrate(pairs, 0.05, 0.1)
    assert cal.evaluation.n_accepted == 100


def test_per_request_acceptance_takes_the_most_similar_passing_candidate():
    th = Thresholds(10, 1, 1, 10)
    pairs = [
        LabelledPair("r1", "a", 0.95, 50, 0, 0, 0, missing=False, unsafe=True),  # most similar but fails context
        LabelledPair("r1", "b", 0.90, 1, 0, 0, 0, missing=False, unsafe=False),  # chosen
        LabelledPair("r1", "c", 0.80, 1, 0, 0, 0, missing=False, unsafe=True),  # passes, less similar
        LabelledPair("r2", "d", 0.99, 99, 0, 0, 0, missing=False, unsafe=True),  # nothing passes
    ]
    ev = evaluate(th, pairs)
    assert (ev.n_requests, ev.n_accepted, ev.k_unsafe) == (2, 1, 0)
    po = evaluate_prompt_only(0.9, pairs)  # top candidate only: a (unsafe) and d (unsafe)
    assert (po.n_accepted, po.k_unsafe) == (2, 2)


# ----------------------------------------------------------------------------------------- certification


def test_certify_counts_and_bound():
    th = Thresholds(10, 1, 1, 10)
    safe = [LabelledPair(f"s{i}", "e", 0.9, 1, 0.1, 0.1, 1, missing=False, unsafe=False) for i in range(50)]
    rejected = [LabelledPair(f"x{i}", "e", 0.9, 99, 0.1, 0.1, 1, missing=False, unsafe=True) for i in range(20)]
    c = certify(th, safe + rejected, 0.05, 0.1)
    assert (c.n, c.k, c.n_requests) == (50, 0, 70)
    assert round(c.upper_bound, 4) == 0.0450 and c.passed
    bad = certify(th, safe + [LabelledPair("u", "e", 0.9, 1, 0, 0, 0, missing=False, unsafe=True)], 0.05, 0.1)
    assert bad.k == 1 and not bad.passed and bad.upper_bound > 0.05
    assert "FAILS" in bad.line() and "HOLDS" in c.line()


def test_calibrated_rule_holds_on_a_fresh_synthetic_stream_and_prompt_only_is_riskier():
    """Synthetic stand-in for the embedded-world stream test (which needs the real pipeline)."""
    pairs = synthetic_pairs(400, seed=11)
    calib, cert = split_pairs(pairs, 0.5, seed=0)
    cal = calibrate(calib, 0.05, 0.1)
    c = certify(cal.thresholds, cert, 0.05, 0.1)
    assert c.passed, c.line()
    fresh = synthetic_pairs(2000, seed=12345, request_prefix="f")
    ev = evaluate(cal.thresholds, fresh)
    assert ev.unsafe_rate <= 0.05, ev
    # prompt-only at the threshold that gives (at least) the same coverage on the fresh stream: the
    # ceil(coverage · R)-th highest top-candidate similarity
    top: dict[str, float] = {}
    for p in fresh:
        top[p.request_id] = max(top.get(p.request_id, -np.inf), p.similarity)
    ranked = sorted(top.values(), reverse=True)
    t = ranked[int(np.ceil(ev.coverage * len(ranked))) - 1]
    po = evaluate_prompt_only(t, fresh)
    assert po.coverage >= ev.coverage
    assert po.unsafe_rate > ev.unsafe_rate, (po, ev)


def test_calibrate_prompt_only():
    pairs = synthetic_pairs(400, seed=11, prompt_corr=0.95, p_missing=0.0)
    t, ev = calibrate_prompt_only(pairs, 0.05, 0.1)
    assert ev.unsafe_rate <= 0.05 and clopper_pearson_upper(ev.k_unsafe, ev.n_accepted, 0.1) <= 0.05
    assert evaluate_prompt_only(t, pairs) == ev


@pytest.mark.parametrize("worse,better,p", [(6, 1, 8 / 128), (0, 0, 1.0), (3, 0, 1 / 8), (0, 3, 1.0),
                                          (5, 5, 638 / 1024), (12, 2, 106 / 16384)])
def test_sign_test_reference_values(worse, better, p):
    from scipy.stats import binomtest

    assert sign_test_p(worse, better) == pytest.approx(p, rel=1e-12)
    if worse + better:
        assert sign_test_p(worse, better) == pytest.approx(
            binomtest(worse, worse + better, 0.5, alternative="greater").pvalue, rel=1e-12)
    with pytest.raises(ValueError, match="non-negative"):
        sign_test_p(-1, 2)


def test_sign_test_holds_its_level_by_simulation():
    # Under the null (each discordant request equally likely either way) the test rejects at 5 % no more than 5 %
    # of the time; when one side is 4× likelier it rejects most of the time at 20 discordant requests.
    rng = np.random.default_rng(3)
    null = [sign_test_p(int(k), 20 - int(k)) <= 0.05 for k in rng.binomial(20, 0.5, 4000)]
    alt = [sign_test_p(int(k), 20 - int(k)) <= 0.05 for k in rng.binomial(20, 0.8, 4000)]
    assert np.mean(null) <= 0.05 and np.mean(alt) > 0.7


def test_paired_comparison_counts_requests_where_one_policy_is_worse():
    mk = lambda r, e, s, u=False, b=False: LabelledPair(  # noqa: E731
        r, e, s, 0, 0, 0, 0, missing=False, unsafe=u, better=b)
    pairs = [
        mk("r1", "x", 0.99, u=True), mk("r1", "y", 0.90),  # prompt-only takes x (unsafe); the rule takes y
        mk("r2", "x", 0.98, u=True),  # both take it: unsafe for both, no information
        mk("r3", "x", 0.97),  # both take it, safe
        mk("r4", "x", 0.50, b=True),  # only the rule accepts (prompt-only's threshold refuses): c for the rule
        mk("r5", "x", 0.96, u=True),  # only prompt-only accepts (the rule refuses)
    ]
    n, po = prompt_only_accepted(0.95, pairs)
    assert n == 5 and sorted(p.request_id for p in po) == ["r1", "r2", "r3", "r5"]
    rule = [pairs[1], pairs[2], pairs[3], pairs[4]]
    cmp = compare_paired(po, rule, n)
    assert (cmp.a_accepted, cmp.b_accepted, cmp.both_accepted) == (4, 4, 3)
    # prompt-only worse on r1 (unsafe vs safe), r4 (dense 0 vs the rule's better −1) and r5 (unsafe vs dense)
    assert (cmp.a_worse, cmp.b_worse) == (3, 0)
    assert cmp.a_worse_ids == ("r1", "r4", "r5") and cmp.b_worse_ids == ()
    assert cmp.p_one_sided == pytest.approx(1 / 8)
    swapped = compare_paired(rule, po, n)
    assert (swapped.a_worse, swapped.b_worse) == (0, 3) and swapped.p_one_sided == 1.0
    assert evaluate_prompt_only(0.95, pairs).n_accepted == 4
    with pytest.raises(ValueError, match="accepted twice"):
        compare_paired([pairs[0], pairs[0]], rule, n)


# ----------------------------------------------------------------------------------------- splits and files


def test_split_keeps_requests_together_and_is_seeded():
    pairs = synthetic_pairs(100, seed=2, max_candidates=4)
    a1, b1 = split_pairs(pairs, 0.5, seed=5)
    a2, b2 = split_pairs(pairs, 0.5, seed=5)
    a3, _ = split_pairs(pairs, 0.5, seed=6)
    assert a1 == a2 and b1 == b2 and a1 != a3
    ra, rb = {p.request_id for p in a1}, {p.request_id for p in b1}
    assert not ra & rb and len(ra) == 50 and len(rb) == 50
    assert len(a1) + len(b1) == len(pairs)


def test_split_field_is_respected_and_validated():
    mk = lambda r, s: LabelledPair(r, "e", 0.9, 0, 0, 0, 0, missing=False, unsafe=False, split=s)  # noqa: E731
    calib, cert = split_pairs([mk("a", "calib"), mk("b", "cert"), mk("c", "cert")])
    assert [p.request_id for p in calib] == ["a"] and len(cert) == 2
    with pytest.raises(CalibrationError, match="every row or on none"):
        split_pairs([mk("a", "calib"), mk("b", None)])
    with pytest.raises(CalibrationError, match="both splits"):
        split_pairs([mk("a", "calib"), mk("a", "cert")])
    with pytest.raises(CalibrationError, match="both splits need requests"):
        split_pairs([mk("a", "calib")])


def test_pairs_jsonl_round_trip_and_errors(tmp_path):
    pairs = synthetic_pairs(10, seed=1)
    path = tmp_path / "pairs.jsonl"
    write_pairs_jsonl(path, pairs, header={"model_fingerprint": "m", "config_fingerprint": "c"})
    header, back = read_pairs_jsonl(path)
    assert header == {"model_fingerprint": "m", "config_fingerprint": "c"} and back == pairs

    def bad(lines, match):
        p = tmp_path / "bad.jsonl"
        p.write_text("\n".join(lines) + "\n")
        with pytest.raises(CalibrationError, match=match):
            read_pairs_jsonl(p)

    good = json.dumps(pairs[0].to_row())
    bad(["{not json"], r"bad.jsonl:1: not valid JSON")
    bad([good, json.dumps({**pairs[1].to_row(), "unsafe": "yes"})],
        r"bad.jsonl:2: field 'unsafe' must be true or false")
    bad([json.dumps({**pairs[0].to_row(), "shape": -1})], r"'shape' must be a finite number ≥ 0")
    bad([json.dumps({k: v for k, v in pairs[0].to_row().items() if k != "context"})], r"missing field 'context'")
    bad([good, good], "duplicate pair")
    bad([good, json.dumps({"type": "header"})], "header row must be the first")
    bad([json.dumps({**pairs[0].to_row(), "split": "train"})], "'split' must be one of")
    bad([""], "no labelled pairs")
    with pytest.raises(CalibrationError, match="not found"):
        read_pairs_jsonl(tmp_path / "nope.jsonl")


# ----------------------------------------------------------------------------------------- the excess label


def _paired(request_id: str, dist: float, outcome: str, stratum: str | None = None) -> LabelledPair:
    """One request with one candidate at discrepancy ``dist`` on every axis; outcome b / c / 0 (concordant)."""
    return LabelledPair(request_id, "e" + request_id, 0.99, dist, dist, dist, dist, missing=False,
                        unsafe=outcome == "b", better=outcome == "c", stratum=stratum)


def _noise_pairs(n: int, rate: float, seed: int, stratum: str | None = None, far_b: int = 0) -> list[LabelledPair]:
    """Near candidates whose reuse fails like a fresh dense sample (b and c equally likely: the model's own noise),
    plus ``far_b`` far candidates that always break the request (b only)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        u = rng.random()
        outcome = "b" if u < rate else "c" if u < 2 * rate else "0"
        out.append(_paired(f"{stratum}-{seed}-{i}", float(rng.uniform(0, 1)), outcome, stratum))
    for i in range(far_b):
        out.append(_paired(f"{stratum}-{seed}-far{i}", float(rng.uniform(2, 3)), "b", stratum))
    return out


def test_excess_label_certifies_what_the_unsafe_label_charges_with_sampling_noise():
    # 14 % b and 14 % c among near candidates (a fresh dense sample judged as a reuse), far candidates always b
    calib = _noise_pairs(400, 0.14, seed=1, far_b=100)
    cert_pairs = _noise_pairs(400, 0.14, seed=2, far_b=100)
    with pytest.raises(CalibrationError):
        calibrate(calib, alpha=0.05, delta=0.1, label="unsafe")
    cal = calibrate(calib, alpha=0.05, delta=0.1, label="excess")
    assert cal.label == "excess" and cal.thresholds.context < 2.5  # most far (really harmful) candidates stay out
    cert = certify(cal.thresholds, cert_pairs, alpha=0.05, delta=0.1, label="excess")
    assert cert.passed and cert.label == "excess" and cert.c > 0
    assert cert.unsafe_upper_bound > 0.05  # b/n alone would not certify
    assert "excess failure" in cert.line()


def test_excess_certificate_fails_when_reuse_adds_failures():
    calib = _noise_pairs(400, 0.05, seed=3)
    harmful = [_paired(f"h{i}", 0.5, "b" if i % 5 == 0 else "0") for i in range(400)]  # 20 % b, no c
    cal = calibrate(calib, alpha=0.05, delta=0.1, label="excess")
    cert = certify(cal.thresholds, harmful, alpha=0.05, delta=0.1, label="excess")
    assert not cert.passed and cert.upper_bound > 0.15


def test_a_stratum_path_counts_in_each_of_its_prefixes():
    pairs = [_paired(f"p{i}", 0.1, "0", "1obj/paraphrase") for i in range(60)]
    pairs += [_paired(f"c{i}", 0.1, "0", "1obj/colour") for i in range(60)]
    cert = certify(Thresholds(1.0, 1.0, 1.0, 1.0), pairs, alpha=0.05, delta=0.1, label="excess",
                   required_strata=("1obj",))
    assert set(cert.strata) == {"1obj", "1obj/paraphrase", "1obj/colour"}
    assert cert.strata["1obj"].n == 120 and cert.strata["1obj/colour"].n == 60 and cert.passed


def test_strata_each_get_a_certificate_and_a_required_one_must_pass_alone():
    one = _noise_pairs(300, 0.02, seed=4, stratum="1obj")
    two = [_paired(f"t{i}", 0.5, "b" if i % 4 == 0 else "0", "2obj") for i in range(60)]  # a weak stratum
    th = Thresholds(1.0, 1.0, 1.0, 1.0)
    pooled = certify(th, one + two, alpha=0.05, delta=0.1, label="excess", required_strata=("1obj",))
    assert set(pooled.strata) == {"1obj", "2obj"}
    assert pooled.strata["1obj"].passed and not pooled.strata["2obj"].passed
    strict = certify(th, one + two, alpha=0.05, delta=0.1, label="excess", required_strata=("2obj",))
    assert not strict.passed and "required strata failing: 2obj" in strict.line()
    with pytest.raises(CalibrationError, match="no certification requests"):
        certify(th, one, alpha=0.05, delta=0.1, label="excess", required_strata=("2obj",))


def test_excess_certificate_round_trips_and_refuses_hand_edits():
    from carnator.carnator_core.risk.certify import Certificate

    cert = certify(Thresholds(1.0, 1.0, 1.0, 1.0), _noise_pairs(200, 0.05, seed=5, stratum="1obj"),
                   alpha=0.05, delta=0.1, label="excess", required_strata=("1obj",))
    doc = json.loads(json.dumps(cert.to_dict()))
    assert Certificate.from_dict(doc) == cert
    doc["c"] = doc["c"] + 3  # more "better" requests would lower the bound: must not pass unrecomputed
    with pytest.raises(ValueError, match="does not match"):
        Certificate.from_dict(doc)
    doc = json.loads(json.dumps(cert.to_dict()))
    doc["strata"]["1obj"]["upper_bound"] = 0.001
    with pytest.raises(ValueError, match="strata\\['1obj'\\].upper_bound"):
        Certificate.from_dict(doc)


def test_pairs_rows_with_better_and_stratum_round_trip(tmp_path):
    pairs = [_paired("r1", 0.1, "c", "1obj/paraphrase"), _paired("r2", 0.2, "b"), _paired("r3", 0.3, "0")]
    path = tmp_path / "p.jsonl"
    write_pairs_jsonl(path, pairs)
    _, back = read_pairs_jsonl(path)
    assert back == pairs
    row = json.loads(path.read_text().splitlines()[0])
    row["unsafe"] = True
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(CalibrationError, match="cannot both be true"):
        read_pairs_jsonl(path)


def test_a_selected_candidate_the_sampler_did_not_reuse_is_a_miss_not_the_next_candidate(tmp_path):
    """Serving takes the best passing candidate and, when its region exceeds max_active, continues dense: the
    request is a miss (no second candidate is tried). Evaluation, the calibration search and the prompt-only
    baseline all count it so, and the field survives the pairs file."""
    th = Thresholds(10, 1, 1, 10)
    pairs = [
        LabelledPair("r1", "a", 0.95, 1, 0, 0, 0, missing=False, unsafe=False, reusable=False),  # chosen, dense
        LabelledPair("r1", "b", 0.90, 1, 0, 0, 0, missing=False, unsafe=False),  # passes too, never tried
        LabelledPair("r2", "c", 0.99, 1, 0, 0, 0, missing=False, unsafe=False),
    ]
    ev = evaluate(th, pairs)
    assert (ev.n_requests, ev.n_accepted) == (2, 1)
    assert evaluate_prompt_only(0.9, pairs).n_accepted == 1
    path = tmp_path / "p.jsonl"
    write_pairs_jsonl(path, pairs)
    assert json.loads(path.read_text().splitlines()[0])["reusable"] is False
    assert read_pairs_jsonl(path)[1] == pairs
    # the vectorised search agrees with the exact evaluation: half the requests' best candidate is not reusable
    many = [LabelledPair(f"r{i}", "e", 0.99, 0.0, 0.0, 0.0, 0.0, missing=False, unsafe=False, reusable=i % 2 == 0)
            for i in range(200)]
    cal = calibrate(many, 0.05, 0.1)
    assert cal.evaluation.n_accepted == 100
