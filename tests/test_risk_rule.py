"""Rule files: JSON round trip, validation, refusal of uncertified and mismatched rules."""
from __future__ import annotations

import dataclasses
import json

import pytest

from carnator.carnator_core.risk.certify import Certificate, clopper_pearson_upper
from carnator.carnator_core.risk.rule import (
    RiskRule,
    RuleFormatError,
    RuleMismatchError,
    UncertifiedRuleError,
)
from carnator.carnator_core.risk.thresholds import Thresholds
from carnator.carnator_core.types import GenConfig, namespace_key

CONFIG = GenConfig("embedded", (16, 8, 16, 16), 20, "euler", "simple", 5.0, "abc123", 4)
MODEL_FP = "f00dfeedcafebeef0123456789abcdef"


def make_rule(k: int = 0, n: int = 50, n_requests: int = 70, **kw) -> RiskRule:
    cert = Certificate(n=n, k=k, upper_bound=clopper_pearson_upper(k, n, 0.1), alpha=0.05, delta=0.1,
                       n_requests=n_requests)
    return RiskRule(
        thresholds=kw.pop("thresholds", Thresholds(8.0, 0.4, 0.5, 12.0)),
        certificate=cert,
        model_fingerprint=MODEL_FP,
        config_fingerprint=CONFIG.fingerprint(),
        arch="embedded",
        config_meta=CONFIG.to_meta(),
        provenance={"dataset": "synthetic", "seeds": [1, 2], "command": "test"},
        **kw,
    )


def test_round_trip(tmp_path):
    rule = make_rule(thresholds=Thresholds(8.0, 0.4, 0.5, 12.0, min_similarity=0.7))
    path = rule.save(tmp_path / "r.json")
    back = RiskRule.load(path)
    assert back == rule
    assert back.rule_id == rule.rule_id and back.rule_id.startswith("rule-")
    assert back.source == str(path)
    doc = json.loads(path.read_text())
    assert doc["certificate"]["passed"] is True and round(doc["certificate"]["upper_bound"], 4) == 0.0450
    assert doc["format"] == "carnator-risk-rule" and doc["schema_version"] == 1


def test_rule_id_changes_with_content():
    assert make_rule().rule_id != make_rule(thresholds=Thresholds(8.0, 0.4, 0.5, 12.5)).rule_id


def test_uncertified_rule_is_refused_with_clear_message(tmp_path):
    rule = make_rule(k=3, n=60)
    assert not rule.certificate.passed
    path = rule.save(tmp_path / "weak.json")
    with pytest.raises(UncertifiedRuleError) as e:
        RiskRule.load(path)
    msg = str(e.value)
    assert "not certified" in msg and "> α = 0.05" in msg and "3 unsafe of 60" in msg and "allow_uncertified" in msg
    assert not RiskRule.load(path, allow_uncertified=True).certificate.passed


def test_mismatched_model_or_config_is_refused():
    rule = make_rule()
    rule.check_applicable(MODEL_FP, CONFIG.fingerprint())  # no error
    rule.check_namespace(namespace_key(MODEL_FP, CONFIG))
    other_cfg = GenConfig("embedded", (16, 8, 16, 16), 30, "euler", "simple", 5.0, "abc123", 4)
    with pytest.raises(RuleMismatchError) as e:
        rule.check_applicable(MODEL_FP, other_cfg.fingerprint())
    msg = str(e.value)
    assert "generation config" in msg and "calibrated for" in msg and "calibrate_cli" in msg
    assert "'steps': 20" in msg  # says what it was calibrated for
    with pytest.raises(RuleMismatchError, match="model 'other'"):
        rule.check_applicable("other", CONFIG.fingerprint())
    with pytest.raises(RuleMismatchError, match="namespace"):
        rule.check_namespace(namespace_key(MODEL_FP, other_cfg))


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda d: d.__setitem__("format", "something-else"), "'format' must be"),
        (lambda d: d.__setitem__("schema_version", 99), "schema_version 99 is not supported"),
        (lambda d: d["thresholds"].pop("shape"), "lack axes"),
        (lambda d: d["thresholds"].__setitem__("size", -1), "'size' must be a finite number"),
        (lambda d: d["certificate"].__setitem__("upper_bound", 0.01), "does not match"),
        (lambda d: d["certificate"].__setitem__("passed", False), "certificate.passed"),
        (lambda d: d["certificate"].__setitem__("k", 60), "k ≤ n"),
        (lambda d: d["certificate"].__setitem__("n", "50"), "integer"),
        (lambda d: d["model"].__setitem__("fingerprint", ""), "model.fingerprint"),
        (lambda d: d.pop("config"), "section 'config'"),
    ],
)
def test_invalid_rule_documents_are_refused(tmp_path, mutate, match):
    doc = make_rule().to_json()
    mutate(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(RuleFormatError, match=match) as e:
        RiskRule.load(path)
    assert "bad.json" in str(e.value) and "Re-create it" in str(e.value)


def test_corrupted_or_missing_file(tmp_path):
    path = tmp_path / "r.json"
    make_rule().save(path)
    path.write_text(path.read_text()[:100])  # truncated
    with pytest.raises(RuleFormatError, match="not valid JSON"):
        RiskRule.load(path)
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(RuleFormatError, match="not valid JSON"):
        RiskRule.load(path)
    with pytest.raises(RuleFormatError, match="not found"):
        RiskRule.load(tmp_path / "missing.json")


def test_rule_made_with_other_signature_code_is_refused(monkeypatch):
    """The config fingerprint covers the signature/reuse semantics version: a rule certified with other
    signature code (other discrepancy scales) is refused like a rule for another config."""
    from carnator.carnator_core import types

    rule = make_rule()
    rule.check_applicable(MODEL_FP, CONFIG.fingerprint())
    monkeypatch.setattr(types, "SIGNATURE_VERSION", types.SIGNATURE_VERSION + 1)
    assert CONFIG.fingerprint() != rule.config_fingerprint
    with pytest.raises(RuleMismatchError, match="generation config"):
        rule.check_applicable(MODEL_FP, CONFIG.fingerprint())


def test_hostile_rule_files_give_rule_errors(tmp_path):
    """A deeply nested document or a path the OS refuses are RuleFormatErrors, not RecursionError / OSError."""
    path = tmp_path / "deep.json"
    path.write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(RuleFormatError, match="nests too deeply"):
        RiskRule.load(path)
    with pytest.raises(RuleFormatError, match="not found|cannot be read"):
        RiskRule.load(tmp_path / ("r" * 5000 + ".json"))


def test_loading_a_rule_again_does_not_recompute_its_exact_bound_but_still_checks_it(tmp_path, monkeypatch):
    """The Risk Filter node loads its rule file for every request: the exact excess bound (~0.1 s at n ≈ 150,
    once more per stratum) is computed once per (label, n, k, c, δ), yet every load still compares the file's
    upper_bound with it, so a file edited after the first load is refused."""
    from carnator.carnator_core.risk import certify

    calls = []
    real = certify.excess_upper_bound

    def counting(*a, **kw):
        calls.append(a)
        return real(*a, **kw)

    monkeypatch.setattr(certify, "excess_upper_bound", counting)
    certify.certificate_bound.cache_clear()
    n, k, c = 60, 2, 1
    cert = Certificate(n=n, k=k, c=c, label="excess", upper_bound=certify.certificate_bound("excess", n, k, c, 0.1),
                       alpha=0.2, delta=0.1, n_requests=80)
    rule = dataclasses.replace(make_rule(), certificate=cert)
    path = rule.save(tmp_path / "excess.json")
    for _ in range(3):
        assert RiskRule.load(path).certificate.upper_bound == cert.upper_bound
    assert len(calls) == 1, f"the exact bound was computed {len(calls)} times for one certificate loaded 3 times"
    doc = json.loads(path.read_text())
    doc["certificate"]["upper_bound"] = cert.upper_bound / 2
    path.write_text(json.dumps(doc))
    with pytest.raises(RuleFormatError, match="does not match"):
        RiskRule.load(path)
