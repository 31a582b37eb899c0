"""One rule name, several models or configs (nodes/risk.py ``learning_mode_decision`` inside an in-process ComfyUI):
a workflow's Risk Filter names one rule file; once the rule learned for one checkpoint is written under that name,
switching the checkpoint (or steps, resolution, LoRA: the probe's fingerprints) starts learning for the new one
beside it instead of failing "does not apply", and each model × config reads its own learned rule. A plain
calibrated rule for another model is still refused, and the message says how to start learning instead."""
from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
from test_learn_rulefile import CONFIG, MODEL, NS, SETTINGS, build, feed

from carnator.carnator_core.learn import rulefile
from carnator.carnator_core.learn.learner import Learner, rule_namespace
from carnator.carnator_core.types import Candidates

pytestmark = pytest.mark.comfy


@pytest.fixture()
def risk(comfy_env, tmp_path, monkeypatch):
    import folder_paths

    monkeypatch.setattr(folder_paths, "user_directory", str(tmp_path / "user"))
    import carnator.nodes.risk as risk

    return risk


def probe(model: str, config) -> SimpleNamespace:
    return SimpleNamespace(model_fingerprint=model, config=config, answered=None, request_key="r", prompt="p",
                           seed=1)


def test_changing_the_model_learns_beside_the_rule_instead_of_failing(risk, tmp_path) -> None:
    rules = tmp_path / "user" / "carnator" / "rules"
    ln = Learner(tmp_path / "cache", SETTINGS)
    feed(ln, 220, "reseed", np.random.default_rng(2))
    rulefile.save(build(ln), rules / "mine.json")  # learned for MODEL × CONFIG
    a = risk.learning_mode_decision(None, Candidates(NS, ()), probe(MODEL, CONFIG), "mine.json")
    assert a.learning["rule_file"] == "mine.json" and a.learning["note"] == ""
    # another checkpoint, then other steps: each learns under its own name beside mine.json
    for model, config in (("fedcba9876543210" + "11" * 8, CONFIG), (MODEL, dataclasses.replace(CONFIG, steps=30))):
        ns = rule_namespace(model, config.rule_fingerprint())
        d = risk.learning_mode_decision(None, Candidates(ns, ()), probe(model, config), "mine.json")
        assert d.learning["rule_file"] == f"mine.{ns}.json" and d.learning["namespace"] == ns
        assert d.learning["rule_path"] == str((rules / f"mine.{ns}.json").resolve())
        assert "mine.json is the rule learned for another model or config" in d.summary
        assert f"learn under mine.{ns}.json" in d.learning["note"] and d.mode == "learning"
    # once the other model's rule is written there, it is the one read (and applies)
    other = "fedcba9876543210" + "11" * 8
    ns_b = rule_namespace(other, CONFIG.rule_fingerprint())
    doc = build(ln)
    doc["model"]["fingerprint"], doc["learning"]["namespace"] = other, ns_b
    rulefile.seal(doc)
    rulefile.save(doc, rules / f"mine.{ns_b}.json")
    fp_before = risk.CarnatorRiskFilter.fingerprint_inputs(rule_file="mine.json")
    d = risk.learning_mode_decision(None, Candidates(ns_b, ()), probe(other, CONFIG), "mine.json")
    assert d.learning["rule_file"] == f"mine.{ns_b}.json" and d.learning["origin"] == "sealed here"
    # a plain file squatting on that name is never overwritten: refused, saying what to do
    (rules / f"mine.{ns_b}.json").write_text(json.dumps({"not": "a learned rule"}))
    with pytest.raises(risk.RuleError, match="exists and is not a learned rule; .*rename or remove it"):
        risk.learning_mode_decision(None, Candidates(ns_b, ()), probe(other, CONFIG), "mine.json")
    assert risk.CarnatorRiskFilter.fingerprint_inputs(rule_file="mine.json") != fp_before  # re-run on change


def test_a_plain_rule_for_another_model_says_how_to_learn_instead(risk, tmp_path) -> None:
    from test_risk_discrepancy import obj, sig

    from carnator.carnator_core.risk.rule import RuleMismatchError

    rule = json.loads((risk.SHIPPED_RULES / "embedded.json").read_text())
    ns = rule_namespace(MODEL, CONFIG.rule_fingerprint())
    with pytest.raises(RuleMismatchError, match="does not apply .*name a rule_file that does not exist yet .*learning "
                                                "mode starts"):
        risk.CarnatorRiskFilter.execute(Candidates(ns, ()), "embedded.json", "signature", 0.9, False,
                                        signature=sig(obj("dog")), probe=probe(MODEL, CONFIG))
    assert rule["model"]["fingerprint"] != MODEL


def test_an_edited_learned_rule_is_refused_when_the_prompt_is_queued_naming_the_file(risk, tmp_path) -> None:
    rules = tmp_path / "user" / "carnator" / "rules"
    ln = Learner(tmp_path / "cache", SETTINGS)
    feed(ln, 40, "reseed", np.random.default_rng(2))
    path = rulefile.save(build(ln), rules / "mine.json")
    assert risk.CarnatorRiskFilter.validate_inputs(rule_file="mine.json", mode="signature") is True
    doc = json.loads(path.read_text())
    next(e for e in doc["learning"]["events"] if e["kind"] == "fit")["fit"]["thresholds"]["context"] = 9.0
    path.write_text(json.dumps(doc))
    got = risk.CarnatorRiskFilter.validate_inputs(rule_file="mine.json", mode="signature")
    assert isinstance(got, str) and "learned rule 'mine.json' fails its integrity check" in got
