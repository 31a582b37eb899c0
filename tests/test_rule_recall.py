"""The recall a rule was certified on (top-K, minimum similarity) is recorded in the rule, survives its JSON,
comes from the pairs header at calibration, is enforced by the filter and used by ``request.serve``."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from test_risk_discrepancy import box_mask, obj, sig
from test_risk_filter import RULE, SAME, TARGET, cand, cands

from carnator.carnator_core.request import recall_limits
from carnator.carnator_core.risk.filter import decide
from carnator.carnator_core.risk.pipeline import _recall_from
from carnator.carnator_core.risk.rule import RiskRule, RuleFormatError

K2 = dataclasses.replace(RULE, recall_k=2, recall_min_similarity=0.5)
ROOT = Path(__file__).resolve().parents[1]


def test_recall_is_recorded_and_round_trips():
    data = K2.to_json()
    assert data["recall"] == {"k": 2, "min_similarity": 0.5}
    back = RiskRule.from_json(data)
    assert (back.recall_k, back.recall_min_similarity) == (2, 0.5) and back.rule_id == K2.rule_id
    assert "recall" not in RULE.to_json()  # older rules keep their content and id
    for bad in ({"k": 0}, {"k": "3"}, {"k": 3, "min_similarity": "x"}, "top-3"):
        with pytest.raises(RuleFormatError, match="recall"):
            RiskRule.from_json({**data, "recall": bad})


def test_filter_only_considers_the_certified_recall():
    far = sig(obj("dog"), obj("ball", box_mask(y0=5, y1=7, x0=5, x1=7), lab=(70, -10, 40)))
    items = cands(cand("a", 0.9, sig(obj("cat"))), cand("b", 0.8, sig(obj("cat"))), cand("c", 0.7, SAME),
                  cand("low", 0.4, far))
    d_all = decide(TARGET, items, RULE)
    assert d_all.accepted and d_all.candidate.entry_id == "c"  # without a recorded recall, rank 3 is used
    d = decide(TARGET, items, K2)
    assert not d.accepted
    v = {x.entry_id: x for x in d.verdicts}
    assert [x.entry_id for x in d.verdicts] == ["a", "b", "c", "low"]
    assert "top-2" in v["c"].reason and "recall minimum" in v["low"].reason
    wide = dataclasses.replace(RULE, recall_k=3, recall_min_similarity=0.5)
    assert decide(TARGET, items, wide).candidate.entry_id == "c"


def test_recall_comes_from_the_pairs_header_and_drives_serve():
    assert _recall_from({"top_k": 3, "min_similarity": 0.0}) == {"recall_k": 3, "recall_min_similarity": 0.0}
    assert _recall_from({"top_k": 3}) == {"recall_k": 3, "recall_min_similarity": -1.0}  # older pairs: no floor
    assert _recall_from({}) == {}
    assert recall_limits(K2, 5, 0.0) == (2, 0.5)
    assert recall_limits(RULE, 5, 0.0) == (5, 0.0) and recall_limits(None, 4, -1.0) == (4, -1.0)


def test_reuse_settings_are_recorded_checked_and_passed_to_the_decision():
    from carnator.carnator_core.reuse import ReuseConfig

    meta = ReuseConfig().to_meta()
    ruled = dataclasses.replace(K2, reuse_config=meta)
    data = ruled.to_json()
    assert data["reuse"] == meta and "reuse" not in K2.to_json()  # older rules keep their content and id
    back = RiskRule.from_json(data)
    assert back.reuse_config == meta and back.rule_id == ruled.rule_id
    for bad, words in (({**meta, "refreshes": [3]}, "scalar values; not so: \\['refreshes'\\]"), ({}, "non-empty"),
                       ("joint", "reuse must be a non-empty object")):
        with pytest.raises(RuleFormatError, match=words):
            RiskRule.from_json({**data, "reuse": bad})
    items = cands(cand("c", 0.9, SAME))
    assert decide(TARGET, items, ruled).reuse_config == meta
    assert decide(TARGET, items, K2).reuse_config is None  # not recorded: not enforced
    assert decide(TARGET, items, None, mode="prompt_only", prompt_threshold=0.5).reuse_config is None
    assert _recall_from({"top_k": 3, "min_similarity": 0.0, "reuse_config": meta})["reuse_config"] == meta
    assert _recall_from({"reuse_config": meta}) == {"reuse_config": meta}
    # differences: exact field-by-field; a field the record lacks (added later) is compared with its default
    assert ReuseConfig().differences(meta) == []
    assert ReuseConfig(refreshes=2).differences(meta) == ["refreshes 2 (certified: 3)"]
    older = {k: v for k, v in meta.items() if k != "probe_context"}
    assert ReuseConfig().differences(older) == []
    assert ReuseConfig(probe_context=True).differences(older) == ["probe_context True (certified: False)"]
    assert ReuseConfig().differences({**meta, "refreshs": 2}) == [
        "refreshs (certified: 2) is not a setting of this version"]


def test_combined_pairs_keep_the_recall_and_reuse_settings_they_were_made_with(tmp_path):
    from carnator.carnator_core.lab import pairs
    from carnator.carnator_core.reuse import ReuseConfig

    head = {"model_fingerprint": "m", "config_fingerprint": "c", "unsafe_definition": "u", "dataset": "d",
            "top_k": 3, "min_similarity": 0.0, "reuse_config": ReuseConfig().to_meta()}
    row = {"request_id": "q0", "entry_id": "w0", "similarity": 0.9, "context": 1.0, "size": 0.1, "shape": 0.2,
           "appearance": 3.0, "missing": False, "unsafe": False}
    for name, extra in (("a", {}), ("b", {}), ("k5", {"top_k": 5}), ("r2", {"reuse_config": ReuseConfig(
            refreshes=2).to_meta()})):
        pairs.write_header(tmp_path / f"{name}.jsonl", {**head, **extra})
        pairs.append_rows(tmp_path / f"{name}.jsonl", [row])
    h = pairs.combine_pairs_files([(tmp_path / "a.jsonl", "s0"), (tmp_path / "b.jsonl", "s1")], tmp_path / "ab.jsonl")
    assert (h["top_k"], h["min_similarity"], h["reuse_config"]) == (3, 0.0, ReuseConfig().to_meta())
    assert _recall_from(h)["recall_k"] == 3 and _recall_from(h)["reuse_config"]["refreshes"] == 3
    for other, key in (("k5", "top_k"), ("r2", "reuse_config")):
        with pytest.raises(ValueError, match=key):
            pairs.combine_pairs_files([(tmp_path / "a.jsonl", "s0"), (tmp_path / f"{other}.jsonl", "s1")],
                                      tmp_path / "x.jsonl")


def test_serve_follows_the_reuse_settings_the_rule_was_certified_with():
    """``request.serve`` (Table 1, calibration streams, API users) runs a hit with the rule's recorded reuse
    settings, not its own defaults — otherwise a rule certified with, e.g., the probe's keys/values would see
    every hit continue dense for "other settings" — and the probe keeps the keys/values those settings read.
    Rules that record nothing, records this version cannot build, and other methods leave the options alone."""
    from carnator.carnator_core.probe import ProbeConfig
    from carnator.carnator_core.request import RULE_CONTEXT_KV_MB, ServeOptions
    from carnator.carnator_core.reuse import ReuseConfig

    meta = ReuseConfig(probe_context=True, refreshes=3, context_margin_blocks=0).to_meta()
    ruled = dataclasses.replace(K2, reuse_config=meta)
    base = ServeOptions(method="carnator", rule=ruled, probe=ProbeConfig(probe_steps=4))
    got = base.following_rule()
    assert got.hit_reuse.to_meta() == meta and got.reuse_mode == "joint"
    assert got.probe.context_kv_mb == RULE_CONTEXT_KV_MB and got.probe.probe_steps == 4
    assert base.reuse == ReuseConfig() and base.probe.context_kv_mb == 0  # the caller's options untouched
    big = dataclasses.replace(base, probe=ProbeConfig(probe_steps=4, context_kv_mb=4096.0))
    assert big.following_rule().probe.context_kv_mb == 4096.0  # a larger budget is kept
    latent = dataclasses.replace(K2, reuse_config={**ReuseConfig().to_meta(), "mode": "latent"})
    assert dataclasses.replace(base, rule=latent).following_rule().hit_reuse.mode == "latent"
    assert dataclasses.replace(base, rule=K2).following_rule() == dataclasses.replace(base, rule=K2)
    unknown = dataclasses.replace(K2, reuse_config={**meta, "refreshs": 2})
    assert dataclasses.replace(base, rule=unknown).following_rule().reuse == ReuseConfig()
    prompt_only = dataclasses.replace(base, method="prompt_only")
    assert prompt_only.following_rule() == prompt_only


def test_a_rule_certified_before_the_motion_term_runs_without_it():
    """A rule certified before the motion term and the sparse-kernel policy existed (attempt 11's reuse record,
    kept here verbatim) records neither: it builds a config with the term off and the structure applied wherever
    it is not nearly dense, and a sampler set otherwise on that rule's hit is a difference, not a match."""
    from carnator.carnator_core.reuse import ReuseConfig

    attempt11 = {"block_size": 0, "context_delta": 8.0, "context_margin_blocks": 0, "dilation": 1, "first_dense": 0,
                 "kv_context": True, "last_dense": 0, "mask_iou_same": 0.75, "mask_threshold": 0.5,
                 "max_active": 0.6, "mode": "joint", "probe_context": True, "record_mass": 0.9, "record_steps": 3,
                 "refreshes": 3, "whole_objects": True, "x0_object_fraction": 0.1, "x0_threshold": 1.0}
    old = ReuseConfig.from_meta(attempt11)
    assert old.motion_shift == 0.0 and old.sparse_kernel == "always"
    assert old.differences(attempt11) == []
    assert "motion_shift 0.045 (certified: 0.0)" in ReuseConfig(motion_shift=0.045).differences(attempt11)
    with_term = ReuseConfig(motion_shift=0.045).to_meta()
    assert ReuseConfig.from_meta(with_term).motion_shift == 0.045 and ReuseConfig().differences(with_term) == [
        "motion_shift 0.0 (certified: 0.045)"]


def test_signatures_built_with_other_builder_settings_than_the_rules_are_not_compared():
    """The thresholds bound discrepancies of signatures built with the Signature Builder settings the rule was
    calibrated with (recorded in the rule; none recorded = the defaults, as every rule so far). Through the stage
    API a request whose signature was built otherwise is rejected with the reason, and so is a candidate built
    with other settings than the request's; a signature that records none (stored before they were recorded)
    counts as the defaults."""
    from carnator.carnator_core.request import decide_stage, signature_settings
    from carnator.carnator_core.signature import SignatureConfig, settings_digest
    from carnator.carnator_core.types import Probe

    default, smooth = SignatureConfig().digest(), SignatureConfig(smooth_sigma_hw=2.0).digest()
    assert default != smooth and settings_digest(TARGET) == default  # TARGET records none
    built = dataclasses.replace(TARGET, config=default)
    other = dataclasses.replace(TARGET, config=smooth)
    back = type(TARGET).from_parts(other.to_meta(), other.to_tensors())
    assert back.config == smooth and "config" not in TARGET.to_meta()  # stored signatures keep their content
    probe = Probe.__new__(Probe)  # decide_stage reads only the fingerprints
    object.__setattr__(probe, "model_fingerprint", RULE.model_fingerprint)
    object.__setattr__(probe, "config", _Cfg(RULE.config_fingerprint))

    def run(target, items, rule=RULE):
        return decide_stage(target, cands(*items), probe, method="carnator", rule=rule)

    assert run(built, [cand("old", 0.9, TARGET)]).accepted  # "" and the defaults are the same settings
    d = run(other, [cand("c", 0.9, other)])
    assert not d.accepted and "other than the rule's" in d.verdicts[0].reason
    d = run(built, [cand("c", 0.9, other), cand("ok", 0.8, built)])
    v = {x.entry_id: x for x in d.verdicts}
    assert d.candidate.entry_id == "ok" and "not comparable" in v["c"].reason
    ruled = dataclasses.replace(RULE, signature_config=SignatureConfig(smooth_sigma_hw=2.0).to_meta())
    assert signature_settings(ruled).rule == smooth
    assert run(other, [cand("c", 0.9, other)], ruled).accepted
    assert not run(built, [cand("c", 0.9, built)], ruled).accepted
    data = ruled.to_json()
    assert RiskRule.from_json(data).signature_config == ruled.signature_config and "signature" not in RULE.to_json()
    with pytest.raises(RuleFormatError, match="signature must be"):
        RiskRule.from_json({**data, "signature": "smooth"})
    with pytest.raises(RuleFormatError, match="Signature Builder settings"):
        signature_settings(dataclasses.replace(RULE, signature_config={"smoothness": 2.0}))
    # the probe's requested capture layers are part of the settings (the object maps come from them)
    layered = SignatureConfig().digest((1, 2))
    assert layered not in (default, smooth) and SignatureConfig().digest(()) == default
    by_layers = dataclasses.replace(RULE, signature_config={**SignatureConfig().to_meta(), "capture_layers": [1, 2]})
    assert signature_settings(by_layers).rule == layered
    assert not run(built, [cand("c", 0.9, built)], by_layers).accepted
    # direct callers of the filter that pass no settings keep the former behaviour
    assert decide(other, cands(cand("c", 0.9, other)), RULE).accepted


class _Cfg:
    def __init__(self, fp: str) -> None:
        self._fp = fp

    def rule_fingerprint(self) -> str:
        return self._fp
