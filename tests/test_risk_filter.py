"""Risk Filter decisions: best passing candidate, reasons per axis, modes, refusals."""
from __future__ import annotations

import dataclasses
import json

import pytest
from test_risk_discrepancy import box_mask, obj, sig
from test_risk_rule import CONFIG, MODEL_FP, make_rule

from carnator.carnator_core.paths import PathNotAllowedError
from carnator.carnator_core.risk.certify import LabelledPair, evaluate
from carnator.carnator_core.risk.discrepancy import SignatureMismatchError, discrepancies
from carnator.carnator_core.risk.filter import UNCERTIFIED_BANNER, decide, decide_with_rule_file
from carnator.carnator_core.risk.rule import RuleError, RuleMismatchError, UncertifiedRuleError
from carnator.carnator_core.risk.thresholds import Thresholds
from carnator.carnator_core.types import Candidate, Candidates, GenConfig, namespace_key

NS = namespace_key(MODEL_FP, CONFIG)
RULE = make_rule(thresholds=Thresholds(context=5.0, size=0.3, shape=0.4, appearance=10.0))
TARGET = sig(obj("dog"), obj("ball", box_mask(y0=5, y1=7, x0=5, x1=7), lab=(70, -10, 40)))


def cand(entry_id: str, similarity: float, signature) -> Candidate:
    return Candidate(entry_id=entry_id, similarity=similarity, prompt=f"prompt of {entry_id}", signature=signature)


def cands(*items: Candidate, namespace: str = NS) -> Candidates:
    return Candidates(namespace=namespace, items=tuple(items))


SAME = TARGET
RECOLOURED = sig(obj("dog", lab=(50, 70, -20)), obj("ball", box_mask(y0=5, y1=7, x0=5, x1=7), lab=(70, -10, 40)))
NO_BALL = sig(obj("dog"))
SLIGHTLY_OFF = sig(obj("dog", lab=(51, 21, 30)), obj("ball", box_mask(y0=5, y1=7, x0=5, x1=7), lab=(70, -10, 40)),
                   context=(61.0, 0.0, 10.0))


def test_accepts_best_passing_candidate_and_explains_every_rejection():
    d = decide(TARGET, cands(cand("recol", 0.99, RECOLOURED), cand("noball", 0.97, NO_BALL),
                             cand("off", 0.95, SLIGHTLY_OFF), cand("same", 0.90, SAME)), RULE)
    assert d.accepted and d.candidate.entry_id == "off" and d.mode == "signature"
    v = {x.entry_id: x for x in d.verdicts}
    assert [x.entry_id for x in d.verdicts] == ["recol", "noball", "off", "same"]  # recall order kept
    # recoloured: fails appearance, and says which object
    ap = next(c for c in v["recol"].checks if c.axis == "appearance")
    assert not ap.passed and ap.threshold == 10.0
    assert not v["recol"].accepted and "appearance" in v["recol"].reason and "'dog'" in v["recol"].reason
    assert "ball (target only)" in v["noball"].reason
    assert v["off"].accepted and v["off"].reason.startswith("accepted")
    assert not v["same"].accepted and "not chosen" in v["same"].reason
    for x in d.verdicts:  # four axes, value vs threshold, always
        assert [c.axis for c in x.checks] == ["context", "size", "shape", "appearance"]
    assert d.summary.startswith("ACCEPT 'off'") and d.rule_id == RULE.rule_id and d.filter_ms >= 0
    json.dumps(d.to_meta())  # JSON-able


def test_rejects_all_with_reasons_in_summary():
    d = decide(TARGET, cands(cand("recol", 0.99, RECOLOURED), cand("noball", 0.97, NO_BALL)), RULE)
    assert not d.accepted and d.candidate is None
    assert d.summary.startswith("REJECT → dense") and "appearance" in d.summary and "target only" in d.summary


def test_empty_candidates():
    d = decide(TARGET, Candidates(namespace=NS, items=(), note="cache empty"), RULE)
    assert not d.accepted and d.verdicts == () and "no candidates recalled (cache empty)" in d.summary


def test_each_axis_rejects_on_its_own():
    variants = {
        "context": sig(obj("dog"), obj("ball", box_mask(y0=5, y1=7, x0=5, x1=7), lab=(70, -10, 40)),
                       context=(30.0, 20.0, 10.0)),
        "size": sig(obj("dog", size=0.5), obj("ball", box_mask(y0=5, y1=7, x0=5, x1=7), lab=(70, -10, 40))),
        "shape": sig(obj("dog", mask=box_mask(x0=4, x1=7)),
                     obj("ball", box_mask(y0=5, y1=7, x0=5, x1=7), lab=(70, -10, 40))),
        "appearance": RECOLOURED,
    }
    for axis, s in variants.items():
        d = decide(TARGET, cands(cand(axis, 0.9, s)), RULE)
        failed = [c.axis for c in d.verdicts[0].checks if not c.passed]
        assert failed == [axis] and not d.accepted, (axis, d.verdicts[0])


def test_similarity_tie_goes_to_smaller_normalised_discrepancy():
    d = decide(TARGET, cands(cand("a", 0.9, SLIGHTLY_OFF), cand("b", 0.9, SAME)), RULE)
    assert d.candidate.entry_id == "b"


def test_min_similarity_check():
    rule = make_rule(thresholds=Thresholds(5.0, 0.3, 0.4, 10.0, min_similarity=0.95))
    d = decide(TARGET, cands(cand("same", 0.9, SAME)), rule)
    assert not d.accepted and "prompt_distance" in d.verdicts[0].reason
    assert decide(TARGET, cands(cand("same", 0.96, SAME)), rule).accepted


def test_prompt_only_and_never_modes():
    c = cands(cand("recol", 0.99, RECOLOURED), cand("same", 0.90, SAME))
    d = decide(TARGET, c, None, mode="prompt_only", prompt_threshold=0.95)
    assert d.accepted and d.candidate.entry_id == "recol"  # accepts what the signature rule rejects
    assert "most similar" in d.verdicts[1].reason and d.rule_id == ""
    assert not decide(None, c, None, mode="prompt_only", prompt_threshold=0.995).accepted
    n = decide(TARGET, c, RULE, mode="never")
    assert not n.accepted and all("never" in v.reason for v in n.verdicts)
    with pytest.raises(ValueError, match="unknown Risk Filter mode"):
        decide(TARGET, c, RULE, mode="sometimes")


def test_refusals():
    c = cands(cand("same", 0.9, SAME))
    with pytest.raises(RuleError, match="needs a certified risk rule"):
        decide(TARGET, c, None)
    with pytest.raises(RuleMismatchError):
        decide(TARGET, cands(cand("same", 0.9, SAME), namespace="elsewhere-123"), RULE)
    other = GenConfig("embedded", (16, 8, 16, 16), 30, "euler", "simple", 5.0, "abc123", 4)
    with pytest.raises(RuleMismatchError, match="generation config"):
        decide(TARGET, c, RULE, model_fingerprint=MODEL_FP, config_fingerprint=other.fingerprint())
    decide(TARGET, c, RULE, model_fingerprint=MODEL_FP, config_fingerprint=CONFIG.fingerprint())
    with pytest.raises(RuleError, match="cannot check"):
        decide(TARGET, cands(cand("same", 0.9, SAME), namespace=""), RULE)
    weak = make_rule(k=3, n=60, thresholds=RULE.thresholds)
    with pytest.raises(UncertifiedRuleError):
        decide(TARGET, c, weak)
    d = decide(TARGET, c, weak, allow_uncertified=True)
    assert d.summary.startswith(UNCERTIFIED_BANNER)
    with pytest.raises(SignatureMismatchError):
        decide(TARGET, cands(cand("x", 0.9, sig(obj(mask=box_mask(grid=(2, 8, 8))), grid=(2, 8, 8)))), RULE)


def test_filter_and_calibration_evaluator_agree():
    """The certificate counts exactly the decisions the filter makes."""
    import numpy as np

    rng = np.random.default_rng(0)
    pool = [SAME, RECOLOURED, NO_BALL, SLIGHTLY_OFF]
    pairs, accepted = [], 0
    for r in range(40):
        items = tuple(
            cand(f"e{j}", float(np.round(rng.uniform(0.8, 1.0), 1)), pool[int(rng.integers(len(pool)))])
            for j in range(int(rng.integers(1, 4)))
        )
        d = decide(TARGET, cands(*items), RULE)
        for it in items:
            dd = discrepancies(TARGET, it.signature)
            unsafe = d.accepted and it.entry_id == d.candidate.entry_id and r % 3 == 0  # label the chosen ones
            pairs.append(LabelledPair.from_discrepancies(f"r{r}", it.entry_id, it.similarity, dd, unsafe))
        accepted += d.accepted
    ev = evaluate(RULE.thresholds, pairs)
    assert ev.n_accepted == accepted
    assert ev.k_unsafe == sum(1 for p in pairs if p.unsafe)


def test_decide_with_rule_file_confines_paths(tmp_path):
    rules = tmp_path / "rules"
    RULE.save(rules / "r.json")
    outside = tmp_path / "outside.json"
    RULE.save(outside)
    c = cands(cand("same", 0.9, SAME))
    d = decide_with_rule_file(TARGET, c, rule_file="r.json", rule_roots=[rules])
    assert d.accepted
    for name in ("../outside.json", str(outside)):
        with pytest.raises(PathNotAllowedError, match="outside|escapes"):
            decide_with_rule_file(TARGET, c, rule_file=name, rule_roots=[rules])
    with pytest.raises(PathNotAllowedError, match="not found"):
        decide_with_rule_file(TARGET, c, rule_file="nope.json", rule_roots=[rules])

    class FakeProbe:  # duck-typed probe: the two attributes the filter reads
        model_fingerprint = MODEL_FP
        config = CONFIG

    assert decide_with_rule_file(TARGET, c, rule_file="r.json", rule_roots=[rules], probe=FakeProbe()).accepted
    with pytest.raises(TypeError, match="CARNATOR_PROBE"):
        decide_with_rule_file(TARGET, c, rule_file="r.json", rule_roots=[rules], probe=object())
    # prompt_only does not need the rule file at all
    assert decide_with_rule_file(None, c, rule_file="", rule_roots=[rules], mode="prompt_only",
                                 prompt_threshold=0.5).accepted


def test_a_rule_for_another_model_names_the_rule_files_that_do_apply(tmp_path):
    """The usual mismatch: the plain model's rule picked for a MODEL patched by EasyCache (another fingerprint).
    The error keeps its explanation and names the certified rule files in the rule folders that apply; files that
    apply to neither, uncertified ones and non-rules are not suggested."""
    shipped, user = tmp_path / "shipped", tmp_path / "user"
    patched_fp = "0123456789abcdef" + MODEL_FP[16:][::-1]  # another model (fingerprint prefix differs)
    RULE.save(shipped / "plain.json")
    dataclasses.replace(RULE, model_fingerprint=patched_fp).save(shipped / "patched.json")
    dataclasses.replace(RULE, model_fingerprint=patched_fp,
                        certificate=make_rule(k=3, n=60).certificate).save(user / "patched_weak.json")
    other_cfg = GenConfig("embedded", (16, 8, 16, 16), 30, "euler", "simple", 5.0, "abc123", 4)
    dataclasses.replace(RULE, config_fingerprint=other_cfg.fingerprint()).save(user / "other_config.json")
    (user / "notes.json").write_text('{"not": "a rule"}')

    class PatchedProbe:
        model_fingerprint = patched_fp
        config = CONFIG

    c = cands(cand("same", 0.9, SAME), namespace=namespace_key(patched_fp, CONFIG))
    for probe in (PatchedProbe(), None):  # from the probe's fingerprints, or from the candidates' namespace
        with pytest.raises(RuleMismatchError) as e:
            decide_with_rule_file(TARGET, c, rule_file="plain.json", rule_roots=[user, shipped], probe=probe)
        msg = str(e.value)
        assert "does not apply" in msg and "calibrate_cli" in msg  # the original explanation stays
        assert "'patched.json'" in msg and "set rule_file" in msg
        for name in ("plain.json", "patched_weak.json", "other_config.json", "notes.json"):
            assert f"'{name}'" not in msg.split("apply to this request:")[-1]
    assert decide_with_rule_file(TARGET, c, rule_file="patched.json", rule_roots=[user, shipped],
                                 probe=PatchedProbe()).accepted
    # a user file of the same name shadows the shipped one: the name is suggested only if the file found first applies
    RULE.save(user / "patched.json")
    with pytest.raises(RuleMismatchError) as e:
        decide_with_rule_file(TARGET, c, rule_file="plain.json", rule_roots=[user, shipped], probe=PatchedProbe())
    assert "set rule_file" not in str(e.value)
    (user / "patched.json").unlink()
    # nothing in reach applies: the plain mismatch error, no suggestion
    (shipped / "patched.json").unlink()
    with pytest.raises(RuleMismatchError) as e:
        decide_with_rule_file(TARGET, c, rule_file="plain.json", rule_roots=[user, shipped], probe=PatchedProbe())
    assert "set rule_file" not in str(e.value)
