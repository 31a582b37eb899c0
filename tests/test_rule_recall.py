"""The recall a rule was certified on (top-K, minimum similarity) is recorded in the rule, survives its JSON,
comes from the pairs header at calibration, is enforced by the filter and used by ``request.serve``."""
from __future__ import annotations

import dataclasses

import pytest
from test_risk_discrepancy import box_mask, obj, sig
from test_risk_filter import RULE, SAME, TARGET, cand, cands

from carnator.carnator_core.request import recall_limits
from carnator.carnator_core.risk.filter import decide
from carnator.carnator_core.risk.pipeline import _recall_from
from carnator.carnator_core.risk.rule import RiskRule, RuleFormatError

K2 = dataclasses.replace(RULE, recall_k=2, recall_min_similarity=0.5)


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
