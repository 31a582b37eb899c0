"""The calibration CLI end to end on synthetic labelled pairs (the embedded-model pairs come later)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from carnator.carnator_core.lab.calibrate_cli import main
from carnator.carnator_core.lab.synthetic import synthetic_pairs
from carnator.carnator_core.paths import PathNotAllowedError
from carnator.carnator_core.risk.certify import write_pairs_jsonl
from carnator.carnator_core.risk.pipeline import calibrate_rule_in_dirs
from carnator.carnator_core.risk.rule import RiskRule, UncertifiedRuleError
from carnator.carnator_core.types import GenConfig

ROOT = Path(__file__).resolve().parents[1]
CONFIG = GenConfig("embedded", (16, 8, 16, 16), 20, "euler", "simple", 5.0, "abc123", 4)
HEADER = {
    "model_fingerprint": "m" * 32,
    "config_fingerprint": CONFIG.fingerprint(),
    "arch": "embedded",
    "config": CONFIG.to_meta(),
    "dataset": "synthetic (tests)",
    "seeds": [11],
    "unsafe_definition": "synthetic ground truth",
}


def test_cli_writes_certified_rule(tmp_path, capsys):
    pairs = tmp_path / "pairs.jsonl"
    write_pairs_jsonl(pairs, synthetic_pairs(400, seed=11), header=HEADER)
    out = tmp_path / "rules" / "r.json"
    rc = main(["--pairs", str(pairs), "--out", str(out), "--alpha", "0.05", "--delta", "0.1", "--seed", "0"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert text.startswith("CERTIFIED") and "certificate HOLDS" in text and "prompt-only baseline" in text
    rule = RiskRule.load(out)
    assert rule.certificate.passed and rule.model_fingerprint == "m" * 32 and rule.config_meta["steps"] == 20
    p = rule.provenance
    assert p["dataset"] == "synthetic (tests)"
    assert p["split"]["calib_requests"] == 200 and p["split"]["cert_requests"] == 200
    assert p["command"].startswith("python -m carnator_core.lab.calibrate_cli") and len(p["pairs_sha256"]) == 16
    rule.check_applicable("m" * 32, CONFIG.fingerprint())


def test_cli_does_not_write_a_failing_rule_unless_asked(tmp_path, capsys):
    # plenty of low-risk pairs in calibration, a bad certification split: calibration passes, certification fails
    rows = [p.__class__(**{**p.__dict__, "split": "calib"}) for p in synthetic_pairs(300, seed=1, request_prefix="c")]
    rows += [p.__class__(**{**p.__dict__, "split": "cert"}) for p in synthetic_pairs(300, seed=2, request_prefix="t",
                                                                                      base_unsafe=0.15)]
    pairs = tmp_path / "pairs.jsonl"
    write_pairs_jsonl(pairs, rows, header=HEADER)
    out = tmp_path / "r.json"
    rc = main(["--pairs", str(pairs), "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 3 and "certificate FAILS" in text and "NOT written" in text and not out.exists()
    rc = main(["--pairs", str(pairs), "--out", str(out), "--write-uncertified"])
    assert rc == 3 and out.exists()
    with pytest.raises(UncertifiedRuleError):
        RiskRule.load(out)


def test_cli_input_errors(tmp_path, capsys):
    pairs = tmp_path / "pairs.jsonl"
    write_pairs_jsonl(pairs, synthetic_pairs(50, seed=1))  # no header
    assert main(["--pairs", str(pairs), "--out", str(tmp_path / "r.json")]) == 2
    assert "no model_fingerprint" in capsys.readouterr().err
    write_pairs_jsonl(pairs, synthetic_pairs(50, seed=1), header=HEADER)
    assert main(["--pairs", str(pairs), "--out", str(tmp_path / "r.json"), "--model-fingerprint", "other"]) == 2
    assert "pairs file header says" in capsys.readouterr().err


def test_module_entry_point_runs(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    write_pairs_jsonl(pairs, synthetic_pairs(300, seed=11), header=HEADER)
    res = subprocess.run(
        [sys.executable, "-m", "carnator_core.lab.calibrate_cli", "--pairs", str(pairs),
         "--out", str(tmp_path / "r.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert res.returncode in (0, 3), res.stderr
    assert "certificate" in res.stdout


def test_calibrate_rule_in_dirs_confines_names(tmp_path):
    pairs_dir, rules_dir = tmp_path / "pairs", tmp_path / "rules"
    pairs_dir.mkdir()
    write_pairs_jsonl(pairs_dir / "p.jsonl", synthetic_pairs(400, seed=11), header=HEADER)
    rep = calibrate_rule_in_dirs("p.jsonl", [pairs_dir], "mine", rules_dir)
    assert rep.written == (rules_dir / "mine.json").resolve()
    assert json.loads(rep.written.read_text())["certificate"]["passed"]
    with pytest.raises(PathNotAllowedError):
        calibrate_rule_in_dirs("p.jsonl", [pairs_dir], "../escape", rules_dir)
    with pytest.raises(PathNotAllowedError):
        calibrate_rule_in_dirs(str(tmp_path / "elsewhere.jsonl"), [pairs_dir], "x", rules_dir)


def test_cli_calib_alpha_calibrates_tighter_and_certifies_at_alpha(tmp_path, capsys):
    pairs = tmp_path / "pairs.jsonl"
    write_pairs_jsonl(pairs, synthetic_pairs(400, seed=11), header=HEADER)
    loose, tight = tmp_path / "loose.json", tmp_path / "tight.json"
    assert main(["--pairs", str(pairs), "--out", str(loose), "--write-uncertified"]) in (0, 3)
    assert main(["--pairs", str(pairs), "--out", str(tight), "--calib-alpha", "0.035", "--write-uncertified"]) in (0, 3)
    capsys.readouterr()
    a, b = RiskRule.load(loose, allow_uncertified=True), RiskRule.load(tight, allow_uncertified=True)
    assert b.certificate.alpha == a.certificate.alpha == 0.05  # the certificate stays at --alpha
    assert b.provenance["calib_alpha"] == 0.035 and a.provenance["calib_alpha"] == 0.05
    # the search respected the tighter level on its own split
    assert b.calibration["alpha"] == 0.035 and b.calibration["calib_upper_bound"] <= 0.035
    assert b.calibration["n_accepted"] <= a.calibration["n_accepted"]
    rc = main(["--pairs", str(pairs), "--out", str(tmp_path / "bad.json"), "--calib-alpha", "0.1"])
    assert rc == 2 and "calib_alpha must be in" in capsys.readouterr().err


def _runs(n_runs: int, per_run: int, split: str, seed: int) -> list:
    """Pairs of ``n_runs`` independent runs, request ids ``<run>:q<i>`` like scripts/lab/make_pairs.py --combine."""
    import dataclasses

    out = []
    for r in range(n_runs):
        run = f"{split}{r}"
        for p in synthetic_pairs(per_run, seed=seed + r, request_prefix=f"{run}:q"):
            out.append(dataclasses.replace(p, entry_id=f"{run}:{p.entry_id}", split=split))
    return out


def test_plan_helpers_match_references():
    from scipy.stats import binom

    from carnator.carnator_core.lab.plan import binomial_cdf, k_max_for_certificate

    for k, n, p in ((0, 50, 0.02), (3, 168, 0.017), (7, 242, 0.056), (20, 400, 0.05), (5, 5, 0.3)):
        assert binomial_cdf(k, n, p) == pytest.approx(float(binom.cdf(k, n, p)), rel=1e-9, abs=1e-12)
    assert binomial_cdf(-1, 10, 0.1) == 0.0
    # U(0, 45) = 0.0499 ≤ 0.05 < U(0, 44); U(1, 50) = 0.0756 > 0.05
    assert k_max_for_certificate(44, 0.05, 0.1) == -1
    assert k_max_for_certificate(45, 0.05, 0.1) == 0
    assert k_max_for_certificate(50, 0.05, 0.1) == 0
    assert k_max_for_certificate(168, 0.05, 0.1) == 4
    from carnator.carnator_core.lab.plan import PlanRow
    from carnator.carnator_core.risk.certify import Evaluation

    assert "too few accepted for any certificate" in PlanRow(0.02, Evaluation(100, 3, 0), 0, 2, -1, 0.0).line()
    assert "passes if k ≤ 0: P(pass) ≈ 0.50" in PlanRow(0.02, Evaluation(100, 30, 1), 0, 60, 0, 0.5).line()


def test_cli_plan_cross_validates_on_calibration_rows_only(tmp_path, capsys):
    import dataclasses

    calib = _runs(4, 150, "calib", seed=30)
    cert = _runs(1, 200, "cert", seed=90)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_pairs_jsonl(a, calib + cert, header=HEADER)
    # same calibration rows; certification labels inverted: planning must not read them
    write_pairs_jsonl(b, calib + [dataclasses.replace(p, unsafe=not p.unsafe) for p in cert], header=HEADER)
    outs = []
    for f in (a, b):
        assert main(["--pairs", str(f), "--plan", "0.05,0.03", "--levels", "6"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]
    text = outs[0]
    assert "4 folds (one per run" in text and "planned on 200 requests" in text
    assert text.count("held-out") == 2
    assert "recommended: --calib-alpha" in text or "no level is likely" in text
    assert not list(tmp_path.glob("*.json"))  # planning writes nothing

    from carnator.carnator_core.lab.plan import plan_calib_alpha

    plan = plan_calib_alpha(calib, [0.05, 0.03], cert_requests=200, levels=6)
    for row in plan.rows:
        assert row.folds_failed or row.held_out.n_requests == 600  # every held-out request once
        assert 0.0 <= row.p_pass <= 1.0
    assert plan.best in plan.rows


def test_cli_plan_errors(tmp_path, capsys):
    pairs = tmp_path / "pairs.jsonl"
    write_pairs_jsonl(pairs, synthetic_pairs(60, seed=3), header=HEADER)
    assert main(["--pairs", str(pairs), "--plan", "0.2"]) == 2
    assert "calibration levels must be in (0, α=0.05]" in capsys.readouterr().err
    assert main(["--pairs", str(pairs), "--plan", "x"]) == 2
    assert "comma-separated levels" in capsys.readouterr().err
    assert main(["--pairs", str(pairs)]) == 2
    assert "--out is required" in capsys.readouterr().err
    only_calib = tmp_path / "calib_only.jsonl"  # planning before any certification data exist
    write_pairs_jsonl(only_calib, _runs(2, 40, "calib", seed=5), header=HEADER)
    assert main(["--pairs", str(only_calib), "--plan", "0.05"]) == 2
    assert "give --cert-requests" in capsys.readouterr().err
    assert main(["--pairs", str(only_calib), "--plan", "0.05", "--cert-requests", "100", "--levels", "4"]) == 0
    assert "2 folds" in capsys.readouterr().out


def test_cli_certifies_the_excess_label_with_a_required_stratum(tmp_path, capsys):
    # the same synthetic pairs, with the dense output failing too on some requests: half of each request's
    # "unsafe" labels become concordant failures, and some safe ones become "better" (reuse fixed a dense failure)
    rows = []
    for i, p in enumerate(synthetic_pairs(400, seed=11)):
        stratum = "1obj" if i % 3 else "2obj"
        better = (not p.unsafe) and i % 17 == 0
        rows.append(p.__class__(**{**p.__dict__, "better": better, "stratum": stratum}))
    pairs = tmp_path / "pairs.jsonl"
    write_pairs_jsonl(pairs, rows, header=HEADER)
    out = tmp_path / "r.json"
    rc = main(["--pairs", str(pairs), "--out", str(out), "--label", "excess", "--require-stratum", "1obj"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "label excess" in text and "excess failure (b − c)/n" in text
    rule = RiskRule.load(out)
    cert = rule.certificate
    assert cert.label == "excess" and cert.c > 0 and cert.required_strata == ("1obj",)
    assert set(cert.strata) == {"1obj", "2obj"} and cert.strata["1obj"].passed
    assert cert.unsafe_upper_bound >= cert.upper_bound  # b/n alone is never the easier bound here
    rc = main(["--pairs", str(pairs), "--out", str(tmp_path / "x.json"), "--label", "excess",
               "--require-stratum", "3obj"])
    assert rc == 2 and "required strata ['3obj'] have no certification requests" in capsys.readouterr().err


def test_plan_for_the_excess_label_simulates_b_and_c():
    from carnator.carnator_core.lab.plan import PlanRow, excess_pass_probability, plan_calib_alpha
    from carnator.carnator_core.risk.certify import Evaluation

    # equal b and c rates (a fresh dense sample) at n = 300 usually certify; b alone at 8 % never does
    assert excess_pass_probability(300, 0.14, 0.14, 0.05, 0.1) > 0.5
    assert excess_pass_probability(300, 0.08, 0.0, 0.05, 0.1) < 0.01
    assert excess_pass_probability(300, 0.0, 0.0, 0.05, 0.1) == 1.0
    assert excess_pass_probability(0, 0.0, 0.0, 0.05, 0.1) == 0.0
    with pytest.raises(ValueError, match="≤ 1"):
        excess_pass_probability(10, 0.7, 0.6, 0.05, 0.1)
    line = PlanRow(0.03, Evaluation(100, 40, 3, 2), 0, 80, 0, 0.7, "excess").line()
    assert "b = 3, c = 2 of 40 accepted" in line and "P(pass) ≈ 0.70 (simulated)" in line
    rows = []
    for i, p in enumerate(_runs(3, 120, "calib", seed=7)):
        rows.append(p.__class__(**{**p.__dict__, "better": (not p.unsafe) and i % 13 == 0}))
    plan = plan_calib_alpha(rows, [0.05, 0.03], cert_requests=300, levels=5, label="excess")
    assert all(r.label == "excess" for r in plan.rows)
    assert any(r.held_out.k_better > 0 for r in plan.rows if r.held_out.n_accepted)


def test_rule_report_counts_what_the_rule_accepts_per_kind(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "scripts" / "lab"))
    import rule_report

    from carnator.carnator_core.risk.certify import evaluate, read_pairs_jsonl, split_pairs

    rows = synthetic_pairs(300, seed=4)
    pairs = tmp_path / "pairs.jsonl"
    write_pairs_jsonl(pairs, rows, header=HEADER)
    out = tmp_path / "r.json"
    assert main(["--pairs", str(pairs), "--out", str(out), "--write-uncertified"]) in (0, 3)
    capsys.readouterr()
    # give every row a kind and a compute figure, as scripts/lab/make_pairs.py's diag does
    lines = pairs.read_text().splitlines()
    with_diag = []
    for line in lines:
        r = json.loads(line)
        if "request_id" in r:
            i = int("".join(ch for ch in r["request_id"] if ch.isdigit()))
            r["diag"] = {"kind": "repeat" if i % 3 == 0 else "colour", "objects": 1, "compute_fraction": 0.5,
                         "active_fraction": 0.2}
        with_diag.append(json.dumps(r))
    pairs.write_text("\n".join(with_diag) + "\n")
    table = tmp_path / "t.json"
    assert rule_report.main(["--pairs", str(pairs), "--rule", str(out), "--json", str(table)]) == 0
    text = capsys.readouterr().out
    assert "| all |" in text and "| non-repeat |" in text and "prompt-only at the same coverage" in text
    got = {r["group"]: r for r in json.loads(table.read_text())["rows"]}
    _, cert = split_pairs(read_pairs_jsonl(pairs)[1])
    ev = evaluate(RiskRule.load(out, allow_uncertified=True).thresholds, cert)
    assert (got["all"]["requests"], got["all"]["accepted"], got["all"]["b"]) == (ev.n_requests, ev.n_accepted,
                                                                              ev.k_unsafe)
    assert got["repeat"]["accepted"] + got["colour"]["accepted"] == ev.n_accepted
    assert got["all"]["compute_median"] == (0.5 if ev.n_accepted else None)
    # the paired comparison: its discordant requests account for the difference of the two policies' b − c
    # (synthetic pairs are never "better", so a request's two scores differ by exactly one)
    po = json.loads(table.read_text())["prompt_only_all"]
    assert po["accepted"] >= got["all"]["accepted"]
    assert po["prompt_only_worse"] - po["rule_worse"] == (po["b"] - po["c"]) - (got["all"]["b"] - got["all"]["c"])
    assert 0.0 < po["sign_test_p"] <= 1.0 and "paired (all)" in text
    from carnator.carnator_core.risk.certify import certificate_bound

    label = RiskRule.load(out, allow_uncertified=True).certificate.label  # "unsafe" here, the CLI's default
    assert got["all"]["U"] == round(certificate_bound(label, ev.n_accepted, ev.k_unsafe, ev.k_better, 0.1), 4)


def test_rule_report_axis_table_counts_what_each_axis_alone_rejects():
    sys.path.insert(0, str(ROOT / "scripts" / "lab"))
    import rule_report

    from carnator.carnator_core.risk.certify import LabelledPair
    from carnator.carnator_core.risk.thresholds import Thresholds

    th = Thresholds(context=10.0, size=1.0, shape=2.0, appearance=50.0, min_similarity=0.5)

    def p(rid, entry, sim, context=1.0, size=0.1, shape=0.2, appearance=5.0, missing=False):
        return LabelledPair(rid, entry, sim, context, size, shape, appearance, missing, False)

    pairs = [p("q1", "a", 0.9, context=20.0), p("q1", "b", 0.8),  # context alone rejects a; the rule picks b
             p("q2", "a", 0.9, context=20.0, size=3.0),  # two axes: neither alone
             p("q3", "a", 0.4),  # similarity alone
             p("q4", "a", 0.9, missing=True), p("q4", "b", 0.7, appearance=60.0)]  # missing alone; appearance alone
    rows = {r["axis"]: r for r in rule_report.axis_table(th, pairs)}
    assert [rows[a]["pairs_alone_rejected"] for a in ("context", "size", "shape", "appearance", "min_similarity",
                                                      "missing")] == [1, 0, 0, 1, 1, 1]
    # with context off q1 picks a (more similar) instead of b; with size off nothing changes (q2 still fails context)
    assert rows["context"]["requests_alone_decided"] == 1 and rows["size"]["requests_alone_decided"] == 0
    assert rows["shape"]["can_reject"] is False and rows["shape"]["max"] == 0.2  # threshold 2.0 above every value
    assert rows["context"]["can_reject"] is True and rows["min_similarity"]["requests_alone_decided"] == 1
