"""The shipped risk rule of the embedded model (rules/embedded.json) and the pair-generation machinery behind it.

Fast tests (no model): the embedded request sampler (deterministic, one controlled change per query), the two
labelers (checker and tolerance) on ground-truth renders, and that rows written by ``lab.pairs`` are read by
the calibration's reader.

Slow test (the issue-6 acceptance test): on a *fresh* stream of the embedded world — a warm set and queries
drawn with a seed the calibration never used — the shipped rule's unsafe rate among the reuses it accepts is
≤ α (asserted on the counts: unsafe ≤ ceil(α · accepted), because the stream is small), and the prompt-only
filter (NIRVANA-style, threshold calibrated the same way, from the rule's ``comparison`` section) is measured
on the same stream and reported next to it — not asserted to be worse, because on this model it is not (on 900
fresh requests prompt-only measured 3.9 % unsafe against the rule's 4.66 %). Measured numbers: BENCHMARKS.md
"Risk filter".
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
RULE_PATH = ROOT / "rules" / "embedded.json"
PAIRS_PATH = ROOT / "rules" / "embedded_pairs.jsonl"

# The fresh stream: a seed none of the calibration/certification runs used (0-7, see the rule's provenance), and
# small enough for a few minutes on an idle 2-core machine (30 queries: the strict rule accepts ~14 % of requests,
# so a shorter stream risks accepting nothing). TOP_K must equal the calibration run's --top-k: the rule decides
# among the candidates recall returns, so a different K is different traffic.
FRESH_SEED = 4242
N_WARM = 12
N_QUERIES = 30
TOP_K = 3


# ----------------------------------------------------------------------------------------- fast (no model)


def test_requests_are_drawn_in_the_weights_versions_frame(tmp_path):
    """Scenes for a version's model are drawn in its clip geometry: the default frame is the default version's
    (v3), v2's 32-px frame reproduces the requests every v2 run drew; v3's 48-px frame lets more two-object scenes
    through the no-overlap rule, and no two objects of any v3 request overlap in v3's frame."""
    from carnator.carnator_core.embedded import world
    from carnator.carnator_core.lab import pairs

    assert pairs.embedded_warm_set(30, 60) == pairs.embedded_warm_set(30, 60, pairs.embedded_frame("v3"))
    assert pairs.embedded_warm_set(30, 60) != pairs.embedded_warm_set(30, 60, pairs.embedded_frame("v2"))
    assert pairs.weights_version(None) == "v3"
    assert (pairs.embedded_frame("v2").height, pairs.embedded_frame("v2").width) == (32, 32)
    v3 = pairs.embedded_frame("v3")
    assert (v3.height, v3.width) == (48, 48)
    two = {}
    for name, frame in (("v2", pairs.embedded_frame("v2")), ("v3", v3)):
        warm, scenes = pairs.embedded_warm_set(30, 60, frame)
        qs = pairs.embedded_queries(30, 90, warm, scenes, frame=frame)
        two[name] = sum(len(world.parse_caption(q.prompt).objects) == 2 for q in qs)
        if name == "v3":
            assert not any(world._overlaps(world.parse_caption(q.prompt), v3) for q in qs)
    assert two["v3"] > 2 * two["v2"], two
    bad = tmp_path / "not_weights.safetensors"
    import torch
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(bad), metadata={"config": "{}"})
    with pytest.raises(ValueError, match="not embedded weights of a known version"):
        pairs.weights_version(bad)


def test_embedded_requests_are_deterministic_and_controlled():
    from carnator.carnator_core.embedded import world
    from carnator.carnator_core.lab import pairs

    warm, scenes = pairs.embedded_warm_set(3, 10)
    warm2, _ = pairs.embedded_warm_set(3, 10)
    assert warm == warm2
    assert len({w.request_id for w in warm}) == 10
    for w in warm:
        scene, _ = scenes[w.request_id]
        assert not any(world.is_held_out(o) for o in scene.objects)
        assert world.parse_caption(w.prompt) == scene  # the caption names exactly the scene
    qs = pairs.embedded_queries(3, 27, warm, scenes)
    assert qs == pairs.embedded_queries(3, 27, warm, scenes)
    assert [q.kind for q in qs].count("colour") == 3  # kinds cycle: 27 queries / 9 kinds
    assert pairs.embedded_queries(3, 31, warm, scenes)[:27] == qs  # prefix-stable: a longer run extends a shorter
    by_id = {w.request_id: w for w in warm}
    for q in qs:
        src = by_id[q.source]
        s_src, s_q = world.parse_caption(src.prompt), world.parse_caption(q.prompt)
        if q.kind == "repeat":
            assert (q.prompt, q.seed) == (src.prompt, src.seed)
        elif q.kind == "reseed":
            assert q.prompt == src.prompt and q.seed != src.seed
        elif q.kind == "paraphrase":
            assert s_q == s_src
        elif q.kind == "background":
            assert s_q.background != s_src.background and s_q.objects == s_src.objects
        else:
            attr = {"colour": "colour", "size": "size", "position": "position", "motion": "motion",
                    "object": "shape"}[q.kind]
            a, b = s_src.objects[0], s_q.objects[0]
            assert getattr(a, attr) != getattr(b, attr)
            changed = [f for f in ("shape", "colour", "size", "position", "motion") if getattr(a, f) != getattr(b, f)]
            assert changed == [attr], (q.kind, src.prompt, q.prompt)
            assert s_q.objects[1:] == s_src.objects[1:] and s_q.background == s_src.background


def test_checker_labeler_on_ground_truth_renders():
    from dataclasses import replace

    from carnator.carnator_core.embedded import world
    from carnator.carnator_core.lab import pairs

    lab = pairs.embedded_checker_labeler()
    scene = world.Scene((world.ObjectSpec("ball", "red", "big", "top left", "right"),), "grass")
    prompt = world.caption(scene, np.random.default_rng(0))
    clip, _ = world.render(scene)
    ref = lab.reference(clip, prompt)
    assert all(ref.values()) and "o0.colour" in ref and "background" in ref
    assert lab.label(ref, clip, prompt) == (False, {"broken": [], "dense_failed": [], "reuse_failed": []})
    blue, _ = world.render(replace(scene, objects=(replace(scene.objects[0], colour="blue"),)))
    unsafe, diag = lab.label(ref, blue, prompt)
    assert unsafe and diag["broken"] == ["o0.colour"] and diag["reuse_failed"] == ["o0.colour"]
    # An attribute the dense output already fails is the model's failure, not the reuse's.
    ref_failed = {**ref, "o0.colour": False}
    assert lab.label(ref_failed, blue, prompt)[0] is False
    # The request-level (excess) label on the same renders: b when only the reuse fails, c when only dense does.
    req = pairs.embedded_checker_labeler("request")
    assert req.label(ref, blue, prompt)[0] is True and req.label(ref, blue, prompt)[1]["better"] is False
    unsafe, diag = req.label(ref_failed, clip, prompt)
    assert unsafe is False and diag["better"] is True


def test_tolerance_labeler():
    from carnator.carnator_core.lab import pairs

    rng = np.random.default_rng(0)
    a = rng.random((4, 16, 16, 3)).astype(np.float32)
    assert pairs.psnr_db(a, a) == float("inf")
    b = np.clip(a + 0.01, 0, 1)
    lab = pairs.ToleranceLabeler("psnr", 25.0)
    assert lab.label(lab.reference(a, ""), b, "")[0] is False  # ~40 dB
    c = np.clip(a + 0.2 * rng.standard_normal(a.shape), 0, 1)
    unsafe, diag = lab.label(lab.reference(a, ""), c, "")
    assert unsafe and diag["psnr_db"] < 25.0
    s = pairs.ToleranceLabeler("ssim", 0.9)
    assert s.label(s.reference(a, ""), a, "")[0] is False
    assert s.label(s.reference(a, ""), c, "")[0] is True
    assert "PSNR" in lab.definition and "SSIM" in s.definition
    with pytest.raises(ValueError, match="psnr"):
        pairs.ToleranceLabeler("lpips", 0.1)


def test_rows_round_trip_and_resume(tmp_path):
    from carnator.carnator_core.lab import pairs
    from carnator.carnator_core.risk.certify import read_pairs_jsonl
    from carnator.carnator_core.risk.discrepancy import Discrepancies

    path = tmp_path / "part.jsonl"
    pairs.write_header(path, {"model_fingerprint": "m", "config_fingerprint": "c", "dataset": "t"})
    req = pairs.PairRequest("q0001", "a red ball", 5, "colour", "w0000")
    d = Discrepancies(1.0, 0.1, 0.2, 3.0)
    cand = pairs.CandidateOutcome("abc", 0.9, d, True, True, {"broken": ["o0.colour"]})
    out = pairs.RequestOutcome(req, None, (cand,), {"dense_s": 1.0}, 1.0)
    pairs.append_rows(path, pairs.outcome_rows(out, {"abc": "w0000"}))
    with path.open("a") as fh:
        fh.write('{"request_id": "q0002", "entr')  # a torn write from a crash
    header, rows = pairs.read_rows(path)
    assert header["model_fingerprint"] == "m" and pairs.done_requests(rows) == {"q0001"}
    path.write_text("\n".join(path.read_text().split("\n")[:2]) + "\n")
    h2, ps = read_pairs_jsonl(path)
    assert h2["config_fingerprint"] == "c"
    assert ps[0].entry_id == "w0000" and ps[0].unsafe and ps[0].appearance == 3.0
    unlabelled = pairs.RequestOutcome(req, None, (pairs.CandidateOutcome("abc", 0.9, d, False, None, {}),), {}, 0.0)
    with pytest.raises(ValueError, match="not labelled"):
        pairs.outcome_rows(unlabelled, {})
    # A missing-object candidate skipped under missing="top" is left out and named in the diagnostics.
    dm = Discrepancies(1.0, 0.1, 0.2, 3.0, missing_objects=("cube (candidate only)",))
    mixed = pairs.RequestOutcome(req, None, (pairs.CandidateOutcome("abc", 0.9, d, True, False, {}),
                                             pairs.CandidateOutcome("def", 0.8, dm, False, None, {})), {}, 0.0)
    rows = pairs.outcome_rows(mixed, {"abc": "w0000", "def": "w0001"})
    assert [r["entry_id"] for r in rows] == ["w0000"] and rows[0]["diag"]["skipped_missing"] == ["w0001"]


def test_combine_pairs_files(tmp_path):
    from carnator.carnator_core.lab import pairs
    from carnator.carnator_core.risk.certify import read_pairs_jsonl

    head = {"model_fingerprint": "m", "config_fingerprint": "c", "unsafe_definition": "u", "dataset": "d"}
    row = {"request_id": "q0000", "entry_id": "w0001", "similarity": 0.9, "context": 1.0, "size": 0.1, "shape": 0.2,
           "appearance": 3.0, "missing": False, "unsafe": False}
    for name in ("a", "b"):
        pairs.write_header(tmp_path / f"{name}.jsonl", {**head, "seeds": name})
        pairs.append_rows(tmp_path / f"{name}.jsonl", [row])
    h = pairs.combine_pairs_files([(tmp_path / "a.jsonl", "s0"), (tmp_path / "b.jsonl", "s1")], tmp_path / "ab.jsonl")
    assert h["seeds"] == {"s0": "a", "s1": "b"} and len(h["sources"]) == 2
    h2, ps = read_pairs_jsonl(tmp_path / "ab.jsonl")
    assert sorted(p.request_id for p in ps) == ["s0:q0000", "s1:q0000"] and h2["model_fingerprint"] == "m"
    pairs.write_header(tmp_path / "c.jsonl", {**head, "config_fingerprint": "other"})
    with pytest.raises(ValueError, match="config_fingerprint"):
        pairs.combine_pairs_files([(tmp_path / "a.jsonl", "s0"), (tmp_path / "c.jsonl", "s2")], tmp_path / "x.jsonl")
    pairs.combine_pairs_files([(tmp_path / "a.jsonl", "s0", "calib"), (tmp_path / "b.jsonl", "s1", "cert")],
                              tmp_path / "ab2.jsonl")
    _, ps2 = read_pairs_jsonl(tmp_path / "ab2.jsonl")
    assert {(p.request_id, p.split) for p in ps2} == {("s0:q0000", "calib"), ("s1:q0000", "cert")}
    with pytest.raises(ValueError, match="every file"):
        pairs.combine_pairs_files([(tmp_path / "a.jsonl", "s0", "calib"), (tmp_path / "b.jsonl", "s1")],
                                  tmp_path / "x.jsonl")
    with pytest.raises(ValueError, match="distinct"):
        pairs.combine_pairs_files([(tmp_path / "a.jsonl", "s0"), (tmp_path / "b.jsonl", "s0")], tmp_path / "x.jsonl")


def _one_row_pairs_files(folder, headers: dict) -> list:
    """Pairs files ``<folder>/<name>.jsonl``, one per header, each with the same single labelled row; returns
    (path, prefix, split) sources in order, prefixes s0, s1, ... and the split taken from the name ("cal..." =
    calibration, else certification)."""
    from carnator.carnator_core.lab import pairs

    row = {"request_id": "q0000", "entry_id": "w0001", "similarity": 0.9, "context": 1.0, "size": 0.1, "shape": 0.2,
           "appearance": 3.0, "missing": False, "unsafe": False}
    for name, head in headers.items():
        pairs.write_header(folder / f"{name}.jsonl", head)
        pairs.append_rows(folder / f"{name}.jsonl", [row])
    return [(folder / f"{name}.jsonl", f"s{i}", "calib" if name.startswith("cal") else "cert")
            for i, name in enumerate(headers)]


def test_combine_calibration_from_other_reuse_settings_only_when_asked(tmp_path):
    """Calibration runs labelled with earlier reuse settings combine with certification runs of new ones only on
    request; the header then records the certification files' settings (what the rule runs) and lists the
    calibration files' own. Certification files must still agree, and the split must be given."""
    from carnator.carnator_core.lab import pairs

    head = {"model_fingerprint": "m", "config_fingerprint": "c", "unsafe_definition": "u", "dataset": "d",
            "top_k": 3, "min_similarity": 0.0, "reuse_mode": "joint"}
    old, new = {"refreshes": 3}, {"refreshes": 3, "sparse_kernel": "cost"}
    src = _one_row_pairs_files(tmp_path, {name: {**head, "reuse_config": rc} for name, rc in (
        ("cal", old), ("c1", new), ("c2", new), ("c3", {"refreshes": 2, "sparse_kernel": "cost"}))})
    src, c3 = src[:3], src[3]
    with pytest.raises(ValueError, match="calib-reuse-may-differ"):
        pairs.combine_pairs_files(src, tmp_path / "x.jsonl")
    h = pairs.combine_pairs_files(src, tmp_path / "x.jsonl", calib_reuse_may_differ=True)
    assert h["reuse_config"] == new
    assert [x.get("reuse_config") for x in h["sources"]] == [old, None, None]
    with pytest.raises(ValueError, match="reuse_config"):  # the certification runs disagree
        pairs.combine_pairs_files(src + [c3], tmp_path / "x.jsonl", calib_reuse_may_differ=True)
    with pytest.raises(ValueError, match="split on every file"):
        pairs.combine_pairs_files([(tmp_path / "cal.jsonl", "s0"), (tmp_path / "c1.jsonl", "s1")],
                                  tmp_path / "x.jsonl", calib_reuse_may_differ=True)
    with pytest.raises(ValueError, match="top_k"):  # the recall must still be the same
        pairs.write_header(tmp_path / "k.jsonl", {**head, "top_k": 5, "reuse_config": old})
        pairs.combine_pairs_files([(tmp_path / "k.jsonl", "s9", "calib"), (tmp_path / "c1.jsonl", "s1", "cert")],
                                  tmp_path / "x.jsonl", calib_reuse_may_differ=True)


def test_combine_calibration_from_another_config_only_when_asked(tmp_path):
    """Calibration runs of another generation config (e.g. another probe length) of the same model combine with
    certification runs only on request; the header then carries the certification files' config (the one the
    rule applies to) and lists each calibration file's own. The model, the definition of unsafe and the
    certification files' config must still agree."""
    from carnator.carnator_core.lab import pairs

    head = {"model_fingerprint": "m", "unsafe_definition": "u", "dataset": "d", "top_k": 3, "min_similarity": 0.0,
            "reuse_mode": "joint", "arch": "embedded"}
    files = {"cal": ("c4", {"probe_steps": 4}), "c1": ("c2", {"probe_steps": 2}), "c2": ("c2", {"probe_steps": 2}),
             "c3": ("c4", {"probe_steps": 4})}
    src = _one_row_pairs_files(tmp_path, {name: {**head, "config_fingerprint": fp, "config": meta}
                                          for name, (fp, meta) in files.items()})
    src, c3 = src[:3], src[3]
    with pytest.raises(ValueError, match="calib-config-may-differ"):
        pairs.combine_pairs_files(src, tmp_path / "x.jsonl")
    h = pairs.combine_pairs_files(src, tmp_path / "x.jsonl", calib_config_may_differ=True)
    assert (h["config_fingerprint"], h["config"]) == ("c2", {"probe_steps": 2})
    assert [x.get("config") for x in h["sources"]] == [
        {"config_fingerprint": "c4", "config": {"probe_steps": 4}}, None, None]
    got, rows = pairs.read_rows(tmp_path / "x.jsonl")
    assert got["config_fingerprint"] == "c2" and [r["split"] for r in rows] == ["calib", "cert", "cert"]
    with pytest.raises(ValueError, match="config_fingerprint"):  # the certification runs disagree
        pairs.combine_pairs_files(src + [c3], tmp_path / "x.jsonl", calib_config_may_differ=True)
    with pytest.raises(ValueError, match="split on every file"):
        pairs.combine_pairs_files([(tmp_path / "cal.jsonl", "s0"), (tmp_path / "c1.jsonl", "s1")],
                                  tmp_path / "x.jsonl", calib_config_may_differ=True)
    with pytest.raises(ValueError, match="model_fingerprint"):  # never another model
        pairs.write_header(tmp_path / "m.jsonl", {**head, "model_fingerprint": "other", "config_fingerprint": "c4"})
        pairs.combine_pairs_files([(tmp_path / "m.jsonl", "s9", "calib"), (tmp_path / "c1.jsonl", "s1", "cert")],
                                  tmp_path / "x.jsonl", calib_config_may_differ=True)


# The embedded model's shipped rule (the stock config's), and the records of the rules withdrawn on 2026-12-06
# (attempt 13's 4-step-probe rule, the two for the model behind ComfyUI's EasyCache node and v2's rule: never
# re-tested, not under the second label, not per stratum; rules/README.md, "Withdrawn rules"). Every record still
# loads and matches its pairs.
WITHDRAWN = ROOT / "rules" / "withdrawn"
SHIPPED = [(RULE_PATH, PAIRS_PATH)]
RECORDS = SHIPPED + [(WITHDRAWN / f"{name}.json", WITHDRAWN / f"{name}_pairs.jsonl")
                     for name in ("embedded_probe4", "embedded_easycache", "embedded_easycache_probe4", "embedded_v2")]


@pytest.mark.parametrize("rule_path,pairs_path", RECORDS, ids=lambda p: p.name)
def test_shipped_rule_loads_and_matches_its_pairs(rule_path, pairs_path):
    """Each committed rule loads (bound recomputed from n, k, δ), is for the embedded arch, and was made from its
    committed pairs."""
    import hashlib

    from carnator.carnator_core.risk.rule import RiskRule

    if not rule_path.exists():
        pytest.fail(f"{rule_path} is missing: the embedded model's rules must ship (rules/README.md)")
    rule = RiskRule.load(rule_path, allow_uncertified=True)
    assert rule.arch == "embedded"
    assert rule.provenance["unsafe_definition"]
    digest = hashlib.sha256(pairs_path.read_bytes()).hexdigest()[:16]
    assert rule.provenance["pairs_sha256"] == digest, f"{pairs_path.name} is not the file the rule was made from"


@pytest.mark.parametrize("rule_path", [r for r, _ in SHIPPED], ids=lambda p: p.name)
def test_shipped_rule_is_certified(rule_path):
    from carnator.carnator_core.risk.rule import RiskRule

    rule = RiskRule.load(rule_path)  # raises UncertifiedRuleError when U > α
    assert rule.certificate.passed and rule.certificate.upper_bound <= rule.certificate.alpha


def test_the_stock_config_is_the_shipped_rules():
    """The embedded model's stock probe length is the one rules/embedded.json and rules/embedded_easycache.json were
    certified for (the workflows and the demo probe that long), and the 4-step rules really are for 4 steps."""
    import json

    from carnator.carnator_core.embedded import config as ecfg

    meta = {p.name: json.loads(p.read_text(encoding="utf-8"))["config"]["meta"] for p, _ in RECORDS}
    assert meta["embedded.json"]["probe_steps"] == ecfg.DEFAULT_PROBE_STEP
    assert meta["embedded_probe4.json"]["probe_steps"] == 4
    assert meta["embedded_easycache.json"]["probe_steps"] == ecfg.DEFAULT_PROBE_STEP
    assert meta["embedded_easycache_probe4.json"]["probe_steps"] == 4
    assert meta["embedded.json"]["steps"] == ecfg.DEFAULT_STEPS


# ----------------------------------------------------------------------------------------- slow (the model)


@pytest.fixture(scope="module")
def embedded_ready(comfy_env):
    from carnator.carnator_core.embedded import config as ecfg

    if not ecfg.DEFAULT_WEIGHTS.exists():
        pytest.skip(f"embedded model weights not found at {ecfg.DEFAULT_WEIGHTS}")
    return ecfg


@pytest.mark.slow
@pytest.mark.comfy
def test_shipped_rule_on_fresh_stream(embedded_ready, tmp_path):
    import dataclasses

    import torch

    from carnator.carnator_core.cache.store import Store
    from carnator.carnator_core.lab import pairs
    from carnator.carnator_core.risk.rule import RiskRule

    # certified on average (test_shipped_rule_is_certified); its per-stratum section (attempt 21: size, colour;
    # tests/test_risk_strata_cert.py) is left out here: this checks the thresholds
    rule = dataclasses.replace(RiskRule.load(RULE_PATH), strata=None)
    alpha = rule.certificate.alpha
    # Prompt-only at the threshold calibrated the same way (rule.comparison), or — when no prompt-only threshold
    # qualifies under the calibration constraint, as for the shipped rule — at the rule's own minimum prompt
    # similarity: the same similarity bar without the signature checks (and without the missing-object reject).
    po = rule.comparison.get("prompt_only", {})
    if "threshold" in po:
        po_threshold = float(po["threshold"])
    elif rule.thresholds.min_similarity is not None:
        po_threshold = float(rule.thresholds.min_similarity)
    else:
        po_threshold = 0.9  # the Risk Filter node's default prompt_threshold
    thresholds = {"prompt_only": po_threshold}
    # Not the calibration's seed: a fresh warm set and fresh queries.
    assert str(FRESH_SEED) not in json.dumps(rule.provenance.get("seeds", "")), "fresh seed collides with calibration"

    store = Store.open(tmp_path / "store", key_path=tmp_path / "index.key", durable=False)
    threads = torch.get_num_threads()
    # Two threads, as the quality gate (tests/test_embedded_gate.py): one v3 clip (2304 tokens) takes about half the
    # time of one thread on an idle 2-core machine, with the same bits (the suite runs one process at a time).
    torch.set_num_threads(2)
    try:
        ctx = pairs.embedded_context(store, None, top_k=TOP_K)
        warm, scenes = pairs.embedded_warm_set(FRESH_SEED, N_WARM)
        for req in warm:
            pairs.warm_entry(ctx, req)
        queries = pairs.embedded_queries(FRESH_SEED, N_QUERIES, warm, scenes)
        # measure_stream checks the rule against the probe's model/config fingerprints (RuleMismatchError if the
        # shipped weights were retrained without recalibrating).
        result = pairs.measure_stream(ctx, queries, pairs.embedded_checker_labeler(), rule,
                                      prompt_thresholds=thresholds, progress=print)
    finally:
        torch.set_num_threads(threads)
        store.close()

    summary = result.summary()
    print("\nfresh stream (seed", FRESH_SEED, "):", json.dumps(summary, indent=1))
    n_req, n, k = result.counts("rule")
    assert n_req == N_QUERIES
    assert n >= 1, "the shipped rule accepted no reuse on the fresh stream: the test would be vacuous"
    # Small stream: bound the count, not the rate (k/n ≤ α would demand 0 unsafe for n < 20).
    assert k <= math.ceil(alpha * n), f"rule: {k} unsafe of {n} accepted exceeds ceil(α·n) = {math.ceil(alpha * n)}"
    _, n_po, k_po = result.counts("prompt_only")
    print(f"rule: {k}/{n} unsafe (coverage {n}/{n_req}); prompt-only (threshold {po_threshold:.4g}): "
          f"{k_po}/{n_po} unsafe (coverage {n_po}/{n_req})")
    # Whether prompt-only's unsafe rate is higher on this small stream is reported, not asserted (BENCHMARKS.md
    # has the numbers on a 300-request fresh stream). What must hold: at the rule's own similarity bar, prompt-only
    # accepts whenever the rule does (the rule only adds checks), so it never covers less.
    if rule.thresholds.min_similarity is not None and po_threshold <= rule.thresholds.min_similarity:
        assert n_po >= n
