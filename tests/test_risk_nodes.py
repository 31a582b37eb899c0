"""The Risk Filter and Calibrate Rule nodes inside an in-process ComfyUI (schema + one execute each)."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.comfy


@pytest.fixture()
def risk_nodes(comfy_env, tmp_path, monkeypatch):
    import folder_paths

    monkeypatch.setattr(folder_paths, "user_directory", str(tmp_path / "user"))
    monkeypatch.setattr(folder_paths, "input_directory", str(tmp_path / "input"))
    monkeypatch.setattr(folder_paths, "output_directory", str(tmp_path / "output"))
    import carnator.nodes.risk as risk

    return risk


def test_schemas(risk_nodes):
    assert {n.define_schema().node_id for n in risk_nodes.NODES} == {"CarnatorRiskFilter", "CarnatorCalibrateRule"}
    for node in risk_nodes.NODES:
        schema = node.define_schema()
        assert schema.node_id.startswith("Carnator") and schema.display_name.startswith("Carnator ")
        assert schema.category == "Carnator"
        for inp in schema.inputs:
            assert inp.tooltip, (schema.node_id, inp.id)
        info = node.GET_NODE_INFO_V1()  # what /object_info serves
        assert info["name"] == schema.node_id and info["category"] == "Carnator"
    f = {i.id: i for i in risk_nodes.CarnatorRiskFilter.define_schema().inputs}
    assert f["prompt_threshold"].as_dict().get("advanced") is True
    assert f["allow_uncertified"].as_dict().get("advanced") is True and f["allow_uncertified"].default is False
    assert f["mode"].options == ["signature", "prompt_only", "never"]


def test_calibrate_then_filter(risk_nodes, tmp_path):
    from test_risk_cli import HEADER
    from test_risk_discrepancy import obj, sig

    from carnator.carnator_core.lab.synthetic import synthetic_pairs
    from carnator.carnator_core.risk.certify import write_pairs_jsonl
    from carnator.carnator_core.types import Candidate, Candidates, Decision, GenConfig

    (tmp_path / "input").mkdir(parents=True)
    write_pairs_jsonl(tmp_path / "input" / "pairs.jsonl", synthetic_pairs(400, seed=11), header=HEADER)
    out = risk_nodes.CarnatorCalibrateRule.execute(
        pairs_file="pairs.jsonl", rule_name="mine", alpha=0.05, delta=0.1, calib_frac=0.5, seed=0,
        constraint="bound", search_similarity=False,
    )
    text = out.result[0]
    assert "certificate HOLDS" in text and (tmp_path / "user" / "carnator" / "rules" / "mine.json").is_file()

    config = GenConfig.from_meta(HEADER["config"])

    class Probe:
        model_fingerprint = HEADER["model_fingerprint"]

    Probe.config = config
    target = sig(obj("dog"))
    cands = Candidates(namespace="", items=(Candidate("e1", 0.9, "a dog", target),))
    res = risk_nodes.CarnatorRiskFilter.execute(
        candidates=cands, rule_file="mine.json", mode="signature", prompt_threshold=0.9,
        allow_uncertified=False, signature=target, probe=Probe(),
    )
    decision, summary = res.result
    assert isinstance(decision, Decision) and decision.accepted and summary == decision.summary
    # The node filters through the stage API's view of Signature Builder settings: a request whose signature was
    # built with settings other than the rule's (here: not the defaults) is rejected, and says why.
    import dataclasses

    from carnator.carnator_core.signature import SignatureConfig

    smooth = dataclasses.replace(target, config=SignatureConfig(smooth_sigma_hw=2.0).digest())
    other = risk_nodes.CarnatorRiskFilter.execute(
        candidates=Candidates(namespace="", items=(Candidate("e1", 0.9, "a dog", smooth),)), rule_file="mine.json",
        mode="signature", prompt_threshold=0.9, allow_uncertified=False, signature=smooth, probe=Probe(),
    ).result[0]
    assert not other.accepted and "Signature Builder settings" in other.verdicts[0].reason
    fp = risk_nodes.CarnatorRiskFilter.fingerprint_inputs(rule_file="mine.json", mode="signature")
    assert isinstance(fp, str) and "mine.json" in fp
    with pytest.raises(Exception, match="outside"):
        risk_nodes.CarnatorRiskFilter.execute(
            candidates=cands, rule_file="/etc/passwd", mode="signature", prompt_threshold=0.9,
            allow_uncertified=False, signature=target, probe=Probe(),
        )


def test_seed_rule_starts_learning_from_another_rules_thresholds_and_is_checked_at_queue_time(risk_nodes):
    """Learning mode's ``seed_rule``: the shipped rule's thresholds go into the learning settings the decision
    carries (what fit 1 starts from); a missing seed is a queue-time error that says what to do; no seed, no
    seed thresholds."""
    from test_risk_cli import HEADER

    from carnator.carnator_core.risk.rule import RiskRule
    from carnator.carnator_core.types import Candidates, GenConfig

    class Probe:
        model_fingerprint = HEADER["model_fingerprint"]
        config = GenConfig.from_meta(HEADER["config"])

    node = risk_nodes.CarnatorRiskFilter
    inputs = dict(candidates=Candidates(namespace="", items=()), rule_file="not_learned_yet.json", mode="signature",
                  prompt_threshold=0.9, allow_uncertified=False, probe=Probe())
    shipped = RiskRule.load(risk_nodes.SHIPPED_RULES / "embedded.json", allow_uncertified=True).thresholds
    seeded = node.execute(**inputs, seed_rule="embedded.json").result[0]
    assert seeded.learning["settings"]["seed_thresholds"] == [shipped.context, shipped.size, shipped.shape,
                                                               shipped.appearance]
    assert node.execute(**inputs, seed_rule="").result[0].learning["settings"]["seed_thresholds"] is None
    assert node.validate_inputs(rule_file="not_learned_yet.json", mode="signature", seed_rule="embedded.json") is True
    why = node.validate_inputs(rule_file="not_learned_yet.json", mode="signature", seed_rule="nowhere.json")
    assert isinstance(why, str) and why.startswith("seed_rule: no rule file 'nowhere.json'") and "leave" in why
    assert "outside" in node.validate_inputs(rule_file="x.json", mode="signature", seed_rule="../../etc/passwd")
