"""What the serving benchmarks may report: no withdrawn rule is loaded without the row naming it (nor by default), a
rule that does not apply to a model runs there only when asked for and labelled UNCERTIFIED, the headline speedup is
per request against each request's own dense twin, and a run that computed every token and attention pair is never
a hit (neither in the sampler's report nor in the benchmark's counts)."""
from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "scripts" / "bench"
WITHDRAWN_RULE = ROOT / "rules" / "withdrawn" / "embedded_easycache.json"


@pytest.fixture(scope="module")
def T():
    sys.path.insert(0, str(BENCH))
    import bench_table1

    return bench_table1


def _args(**kw) -> argparse.Namespace:
    base = {"allow_uncertified": False, "allow_withdrawn": False, "easycache_uncertified": False,
            "dev_thresholds": "8,0.5,1.0,10"}
    return argparse.Namespace(**{**base, **kw})


def _probe_for(rule_path: Path, other: bool = False):
    """A stand-in for a probe whose model and config are those ``rule_path`` was made for (``other``: another
    model, as the EasyCache-patched one is for the shipped rule)."""
    from carnator.carnator_core.risk.rule import RiskRule

    rule = RiskRule.load(rule_path, allow_uncertified=True)
    fp = "another-model" if other else rule.model_fingerprint
    return SimpleNamespace(model_fingerprint=fp, config=SimpleNamespace(fingerprint=lambda: rule.config_fingerprint))


def test_no_benchmark_names_a_withdrawn_rule_in_its_code():
    """No benchmark script builds a path into rules/withdrawn/ (a default that loads a withdrawn rule silently)."""
    offenders = []
    for script in sorted(BENCH.glob("*.py")):
        for node in ast.walk(ast.parse(script.read_text(encoding="utf-8"))):
            joined = isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and any(
                isinstance(x, ast.Constant) and x.value == "withdrawn" for x in (node.left, node.right))
            named = isinstance(node, ast.Constant) and isinstance(node.value, str) and re.search(
                r"withdrawn/\S+\.json", node.value)
            if joined or named:
                offenders.append(f"{script.name}:{node.lineno}")
    assert not offenders, offenders


def test_table1_defaults_load_no_withdrawn_rule_and_leave_out_the_unshipped_row(T):
    assert not T.is_withdrawn(T.DEFAULT_RULE) and not T.is_withdrawn(T.DEFAULT_EASYCACHE_RULE)
    assert T.is_withdrawn(WITHDRAWN_RULE)
    assert "carnator_easycache" not in T.DEFAULT_METHODS and "carnator" in T.DEFAULT_METHODS


def test_a_withdrawn_rule_is_refused_unless_asked_for_and_then_named(T):
    probe = _probe_for(WITHDRAWN_RULE)
    with pytest.raises(SystemExit, match="withdrawn"):
        T.resolve_rule(str(WITHDRAWN_RULE), _args(), probe, True)
    with pytest.raises(SystemExit, match="withdrawn"):  # not for the composition row either
        T.resolve_rule(str(WITHDRAWN_RULE), _args(easycache_uncertified=True), probe, True, transfer=True)
    rule, status = T.resolve_rule(str(WITHDRAWN_RULE), _args(allow_withdrawn=True), probe, True)
    assert rule is not None and status["certified"] is False and status["withdrawn"] is True
    assert "WITHDRAWN" in status["summary"] and "CERTIFIED:" not in status["summary"].replace("UNCERTIFIED", "")
    assert "WITHDRAWN" in T.row_rule_label(status) and WITHDRAWN_RULE.name in T.row_rule_label(status)


def test_the_shipped_rule_on_another_model_needs_a_flag_and_is_labelled_uncertified(T):
    shipped = T.DEFAULT_RULE
    rule, status = T.resolve_rule(str(shipped), _args(), _probe_for(shipped), True, transfer=True)
    assert status["certified"] is True and T.row_rule_label(status) == ""  # where it applies, it is the rule
    other = _probe_for(shipped, other=True)
    with pytest.raises(SystemExit, match="easycache-uncertified"):
        T.resolve_rule(str(shipped), _args(), other, True, transfer=True)
    rule, status = T.resolve_rule(str(shipped), _args(easycache_uncertified=True), other, True, transfer=True)
    assert not rule.certificate.passed and rule.model_fingerprint == "another-model"
    assert status["certified"] is False and "UNCERTIFIED" in T.row_rule_label(status)
    assert rule.strata is not None  # the shipped rule's per-stratum refusals still apply


def _rec(M, rid, seconds, decision="hit", compute=0.5):
    return M.RequestRecord(rid=rid, kind="edit", method="m", latency_s=seconds, decision=decision,
                           compute_fraction=compute)


def test_headline_is_per_request_against_each_dense_twin(T):
    from carnator.carnator_core.lab import metrics as M

    dense = [_rec(M, "a", 1.0, "dense", 1.0), _rec(M, "b", 4.0, "dense", 1.0)]
    method = [_rec(M, "a", 0.5), _rec(M, "b", 4.0, "miss", 1.0)]
    assert T.per_request_ratio(method, dense) == pytest.approx(2 / (0.5 + 1.0))
    assert T.sum_ratio(method, dense) == pytest.approx(5.0 / 4.5)
    r = T.per_request_ratios(method, dense)
    assert r["hit_speedup_per_request"] == pytest.approx(2.0) and r["miss_speedup_per_request"] == pytest.approx(1.0)
    assert r["hit_cost_over_estimate_median"] == pytest.approx(1.0)  # 0.5 of dense measured, 0.5 estimated


def _report(**kw):
    from carnator.carnator_core.reuse import RunReport

    base = dict(decision="hit", mode="attention", entry_id="e", active_fraction=1.0, block_density=0.5,
                steps_total=20, steps_probe=2, model_calls=18, replayed_calls=2, skipped_calls=0, token_fraction=1.0,
                attention_fraction=1.0, timings_ms={})
    return RunReport(**{**base, **kw})


def test_a_run_that_computed_everything_is_not_counted_as_a_hit(T):
    assert not T.counts_as_hit(_report())  # attention-only reuse that applied no structure: a dense run
    assert T.counts_as_hit(_report(attention_fraction=0.4))  # the recorded structure was applied
    assert T.counts_as_hit(_report(mode="joint", active_fraction=0.2, token_fraction=0.3))
    assert T.counts_as_hit(_report(mode="joint", active_fraction=0.0, skipped_calls=18, model_calls=0))
    assert T.counts_as_hit(_report(mode="exact", active_fraction=0.0))
    assert not T.counts_as_hit(_report(decision="miss")) and not T.counts_as_hit(None)


def test_attention_reuse_dense_says_where_no_layer_would_apply_the_structure():
    from carnator.carnator_core.reuse import attention_reuse_dense
    from carnator.carnator_core.types import BlockStructure

    nb = 16
    band = np.abs(np.subtract.outer(np.arange(nb), np.arange(nb))) <= 1  # density ~0.18
    s = BlockStructure(keep=band[None, None].repeat(2, 0), layers=(1, 2), block_size=32, n_tokens=nb * 32)
    assert attention_reuse_dense(None, (1, 2), 512, "cpu", "cost")
    assert attention_reuse_dense(s, (5,), 512, "cpu", "cost")  # no middle layer recorded
    assert attention_reuse_dense(s, (1, 2), 512, "cpu", "cost")  # at 512 tokens the tiles cost more on the CPU
    assert attention_reuse_dense(s, (1, 2), 512, "cpu", "always") == ""
    assert attention_reuse_dense(s, (1, 2), 512, "cuda", "cost") == ""  # the whole-sequence kernel runs there
    dense = BlockStructure(keep=np.ones((2, 1, nb, nb), bool), layers=(1, 2), block_size=32, n_tokens=nb * 32)
    assert attention_reuse_dense(dense, (1, 2), 512, "cuda", "always")  # density above 0.85 runs plain attention


@pytest.mark.comfy
def test_attention_only_reuse_that_computes_everything_is_a_miss_equal_to_dense(comfy_env, tmp_path):
    """On the CPU at a tiny model's sequence no recorded layer's tiles pay: attention-only "reuse" would be a dense
    run, so the sampler continues dense (bit-identical to its dense resume), reports a miss and says why."""
    import tiny_models as tm
    from test_sampler import _accept, _cached, _probe, _run, _signature

    m = tm.load_tiny_model("wan21", tmp_path)
    probe, pos, neg, lat = _probe(m, tm, "wan21", seed=9)
    final, rep = _run(m, pos, neg, lat, probe)
    assert rep.block_structure is not None
    sig = _signature(probe)
    out, r = _run(m, pos, neg, lat, probe, _accept(sig), sig, "attention", _cached(probe, {"samples": final}, rep))
    assert r.decision == "miss" and r.mode == "dense" and "every attention pair" in r.reason
    assert r.compute_fraction == pytest.approx(1.0)
    import torch

    assert torch.equal(out, final)


def test_learning_benchmark_reports_the_per_request_ratio_beside_the_sum():
    sys.path.insert(0, str(BENCH))
    import bench_learn

    rows = [{"latency_s": 0.5, "dense_latency_s": 1.0}, {"latency_s": 4.0, "dense_latency_s": 4.0}]
    assert bench_learn.per_request_ratio(rows) == pytest.approx(2 / 1.5)
    assert bench_learn.paired_ratio(rows) == pytest.approx(5.0 / 4.5)
    assert bench_learn.per_request_ratio([]) is None


def test_learning_benchmark_counts_labels_per_cached_entry_and_the_coin(tmp_path):
    """The report's labelling figures read a record the way the learner counts it: pilot labels count for nothing,
    each cached entry once per fit, and the coin's share is the setting's (1/3 at the default budget)."""
    sys.path.insert(0, str(BENCH))
    import bench_learn

    from carnator.carnator_core.learn.labels import Covariate, Label
    from carnator.carnator_core.learn.learner import Learner, LearnSettings, label_draw

    settings = LearnSettings()
    ln = Learner(tmp_path, settings)
    ns, vec = "ns", (0.01, 0.01, 0.01, 0.01)
    made, forced, pilot_labels = [], None, 0
    for i in range(160):
        key, entry = f"k{i}", f"e{i if i < 120 else i - 60}"  # requests 120-159 recall entries 60-99 again
        ln.store.add_covariate(ns, Covariate(key, "reseed", entry, 0.9, vec, False, float(i)))
        st = ln.state(ns)["reseed"]
        labelable = entry not in st.entries
        again = not labelable and forced is None and label_draw(settings.label_share, key)
        if (labelable and label_draw(settings.label_share, key)) or again:
            forced = i if again else forced
            pilot_labels += int(ln.order(ns) is None)
            ln.store.add_label(ns, Label(key, "reseed", entry, 0.9, vec, False, True, 0, t=i + 0.5))
            made.append(entry)
            ln.state(ns)
    assert forced is not None  # a label of an entry its test had counted: made here by hand, never by the runtime
    d = bench_learn.labelling_detail(ln.store, ns, 0.2, 0.05)
    k = d["per_kind"]["reseed"]
    assert k["made"] == len(made) and k["not_counted"]["pilot"] == pilot_labels > 0
    assert k["not_counted"]["entry already counted"] == 1
    assert k["counted_current_fit"] == k["distinct_entries_counted_current_fit"] == len(made) - pilot_labels - 1
    assert k["distinct_entries_of_labels"] == len(set(made))
    assert d["replay_mismatches"] == 1  # the forced label, which the runtime would not have made
    assert d["classified_per_kind"]["reseed"]["entry already counted"] >= 1
    assert d["label_share_setting"] == pytest.approx(1 / 3)
    assert 0.2 < d["coin_share_over_requests_with_a_candidate"] < 0.5


def test_learning_benchmark_ratio_is_over_requests_twinned_for_their_position():
    """Every hit gets a dense twin but only every k-th miss: the ratio over all twinned requests would weigh a hit
    k times a miss. The headline is over the requests twinned for their position, whatever was served."""
    sys.path.insert(0, str(BENCH))
    import bench_learn

    rows = []
    for i in range(60):
        hit = i % 5 in (1, 2)  # 24 hits of 60; of the every-6th requests 4 of 10
        r = {"i": i, "decision": "hit" if hit else "miss", "mode": "joint" if hit else "dense", "audit": False,
             "latency_s": 1.0 if hit else 4.0}
        if hit or i % 6 == 0:
            r["dense_latency_s"] = 4.0
        rows.append(r)
    assert bench_learn.twin_step(rows) == 6
    sample = bench_learn.position_sample(rows)
    assert [r["i"] for r in sample] == list(range(0, 60, 6))
    stream = 60 / (24 * 0.25 + 36 * 1.0)  # every request against a 4 s dense run
    assert bench_learn.per_request_ratio(sample) == pytest.approx(stream)
    twinned = [r for r in rows if r.get("dense_latency_s")]  # 24 hits and 6 misses
    assert bench_learn.per_request_ratio(twinned) == pytest.approx(30 / (24 * 0.25 + 6 * 1.0))  # 2.5, not 1.43
