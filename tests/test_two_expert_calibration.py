"""A risk rule for a two-expert (split-schedule) config, end to end on the tiny two-expert Wan fixture.

The path a real Wan 2.2 14B rule takes, on two tiny Wan experts (different weights, ModelSamplingSD3 shift 8):
warm entries written through ``serve(..., second_model=...)`` (``lab.pairs.warm_entry``), query requests
labelled with the model-agnostic ``ToleranceLabeler`` (PSNR of each candidate's two-stage reuse output vs the dense
output of the same request; ``lab.pairs.label_request``), the pairs file calibrated by the calibration CLI into a
rule, and that rule used by the Risk Filter: accepted for the two-expert config, refused for the single-model
config of the same model, and reaching, through ``serve``, the decision and the label the labelling recorded.

Six queries cannot certify anything: the rule is written with ``--write-uncertified`` (the CLI exits 3) and used
with ``allow_uncertified``; what is pinned is the path, not a certificate.
"""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.comfy

STEPS, SWITCH, K, CFG = 6, 3, 2, 3.5
PSNR_DB = 30.0
WARM = (("w0", "a red ball", 42), ("w1", "a blue ball", 7), ("w2", "a green ball", 11))
# a repeat of each warm request (its own entry is an identical scene) and a new seed of each (every candidate's
# reuse then deviates from the dense output); "split" fixes the calibration / certification halves
QUERIES = (("q0", "repeat", "w0", 42, "calib"), ("q1", "repeat", "w1", 7, "calib"),
           ("q2", "reseed", "w2", 1234, "calib"), ("q3", "repeat", "w2", 11, "cert"),
           ("q4", "reseed", "w0", 99, "cert"), ("q5", "reseed", "w1", 5, "cert"))


@pytest.fixture(scope="module")
def experts(comfy_env, tmp_path_factory):
    import tiny_models as tm
    from comfy_extras.nodes_model_advanced import ModelSamplingSD3

    def expert(seed: int):
        raw = tm.load_tiny_model("wan21", tmp_path_factory.mktemp(f"expert{seed}"), seed=seed)
        return ModelSamplingSD3().patch(raw, shift=8.0)[0]

    return tm, expert(0), expert(1)


def _decode(model):
    """LATENT samples [1, C, T, H, W] -> clip [T, H, W, 3] in [0, 1] with the latent format's RGB factors (what
    ComfyUI's previews show; the tiny fixture has no VAE)."""
    from carnator.carnator_core import comfy_patch as cp

    factors, bias = cp.latent_rgb(model)
    assert factors is not None

    def decode(samples) -> np.ndarray:
        x = samples[0].float().cpu().numpy()  # C, T, H, W
        rgb = np.einsum("cthw,ck->thwk", x, factors) + (bias if bias is not None else 0.0)
        return np.clip((rgb + 1.0) / 2.0, 0.0, 1.0)

    return decode


def _context(tm, high, low, store, *, two_expert: bool = True):
    from carnator.carnator_core.lab.pairs import PairContext
    from carnator.carnator_core.probe import ProbeConfig
    from carnator.carnator_core.request import ServeOptions
    from carnator.carnator_core.reuse import ReuseConfig
    from carnator.carnator_core.types import Stage

    pos, neg = tm.conditioning("wan21")
    # Random weights disagree everywhere across seeds (x0, context): the region comes from the object's mask
    # alone, so a new seed's candidates are reused (and deviate) instead of continuing dense.
    options = ServeOptions(method="never", top_k=3, write=False, probe=ProbeConfig(probe_steps=K),
                           reuse=ReuseConfig(x0_threshold=50.0, dilation=0, whole_objects=False, context_delta=1e9,
                                             refreshes=1))
    def encode(prompt: str):
        # the fixture's conditioning does not depend on the words (the prompt reaches the probe through
        # WordTokens and the object list); the negative prompt ("") gets the fixture's negative conditioning
        return neg if prompt == "" else pos

    return PairContext(model=high, text_encoder=tm.WordTokens(), encode=encode, decode=_decode(high),
                       latent=tm.empty_latent("wan21"), steps=STEPS, cfg=CFG, sampler="euler", scheduler="simple",
                       store=store, options=options, stage=Stage(0, SWITCH, True, True) if two_expert else None,
                       second_model=low if two_expert else None, objects="ball")


def test_two_expert_rule_from_labelled_pairs(experts, comfy_dirs, capsys):
    from carnator.carnator_core.cache.store import Store
    from carnator.carnator_core.lab import calibrate_cli, pairs
    from carnator.carnator_core.request import decide_stage, probe_request, recall, serve, signature_stage
    from carnator.carnator_core.risk.certify import accepted_pairs, read_pairs_jsonl
    from carnator.carnator_core.risk.filter import probe_fingerprints
    from carnator.carnator_core.risk.rule import RiskRule, RuleMismatchError

    tm, high, low = experts
    store = Store.open(comfy_dirs / "c", key_path=comfy_dirs / "key")
    ctx = _context(tm, high, low, store)
    labeler = pairs.ToleranceLabeler("psnr", PSNR_DB)

    # 1. warm entries, written from the second stage of a dense two-expert run
    names: dict[str, str] = {}
    for rid, prompt, seed in WARM:
        entry_id, res = pairs.warm_entry(ctx, pairs.PairRequest(rid, prompt, seed))
        assert res.report.stage == "second" and res.probe.config.second_model
        names[entry_id] = rid
    probe = res.probe

    # 2. label every recalled candidate of each query, through both stages
    path = comfy_dirs / "pairs.jsonl"
    header = pairs.header_for(probe, dataset="tiny two-expert Wan fixture", seeds=[q[3] for q in QUERIES],
                              unsafe_definition=labeler.definition, generator="tests/test_two_expert_calibration.py",
                              extra={"top_k": ctx.options.top_k, "min_similarity": ctx.options.min_similarity})
    pairs.write_header(path, header)
    outcomes = {}
    for rid, kind, source, seed, split in QUERIES:
        prompt = dict((w[0], w[1]) for w in WARM)[source]
        req = pairs.PairRequest(rid, prompt, seed, kind, source)
        out = pairs.label_request(ctx, req, labeler)
        outcomes[rid] = out
        assert out.result.probe.config.second_model == probe.config.second_model
        assert len(out.candidates) == 3 and all(c.labelled for c in out.candidates)
        rows = pairs.outcome_rows(out, names)
        for r in rows:
            r["split"] = split
        pairs.append_rows(path, rows)
    by_id = {(q, names[c.entry_id]): c for q, out in outcomes.items() for c in out.candidates}
    # a repeat reusing its own entry reproduces the dense output; a new seed's reuse deviates beyond the tolerance
    for rid, kind, source, *_ in QUERIES:
        own = by_id[(rid, source)]
        assert own.diag["reused"], (rid, own.diag)
        assert own.unsafe is (kind == "reseed"), (rid, own.diag)

    # the header carries the two-expert config fingerprint the filter checks at serving time
    single_spec = _context(tm, high, low, store, two_expert=False).spec(pairs.PairRequest("s", "a red ball", 42))
    single = probe_request(high, *tm.conditioning("wan21"), tm.empty_latent("wan21"), single_spec, ctx.options.probe,
                           tm.WordTokens())
    file_header, labelled = read_pairs_jsonl(path)
    assert (file_header["model_fingerprint"], file_header["config_fingerprint"]) == probe_fingerprints(probe)
    assert file_header["config_fingerprint"] != probe_fingerprints(single)[1]
    assert file_header["model_fingerprint"] == probe_fingerprints(single)[0]
    stage_meta = file_header["config"]
    assert (stage_meta["end_step"], stage_meta["second_model"]) == (SWITCH, probe.config.second_model)
    assert len(labelled) == 3 * len(QUERIES)

    # 3. calibrate with the CLI: tiny n, so a loose level and the empirical constraint; it cannot certify
    rule_path = comfy_dirs / "two_expert_rule.json"
    rc = calibrate_cli.main(["--pairs", str(path), "--out", str(rule_path), "--alpha", "0.3", "--delta", "0.5",
                             "--constraint", "empirical", "--write-uncertified"])
    report = capsys.readouterr().out
    assert rc == 3, report  # written, not certified
    saved = json.loads(rule_path.read_text(encoding="utf-8"))
    assert saved["config"]["fingerprint"] == file_header["config_fingerprint"]
    assert saved["config"]["meta"]["second_model"] == probe.config.second_model
    with pytest.raises(Exception, match="certif"):
        RiskRule.load(rule_path)
    rule = RiskRule.load(rule_path, allow_uncertified=True)
    assert not rule.certificate.passed

    # what the labelling recorded for each query under this rule: the pair the filter would reuse, if any
    _, accepted = accepted_pairs(rule.thresholds, labelled)
    recorded = {p.request_id: (p.entry_id, p.unsafe) for p in accepted}
    assert {q for q, *_ in QUERIES if q in recorded} == {"q0", "q1", "q3"}, recorded  # the repeats, no new seed
    assert all(recorded[q] == (src, False) for q, kind, src, *_ in QUERIES if kind == "repeat")

    # 4. the Risk Filter: the rule applies to the two-expert config and is refused for the single-model one
    single_sig, _ = signature_stage(single)
    with pytest.raises(RuleMismatchError):
        decide_stage(single_sig, recall(store, single, 3), single, method="carnator", rule=rule,
                     allow_uncertified=True)
    served_opts = replace(ctx.options, method="carnator", rule=rule, allow_uncertified=True, exact=False)
    with pytest.raises(RuleMismatchError):
        serve(high, tm.WordTokens(), *tm.conditioning("wan21"), tm.empty_latent("wan21"), single_spec, store,
              served_opts)

    # 5. served with the rule, each query reaches the labelling's decision, output and label
    for rid, kind, source, seed, _ in QUERIES:
        out = outcomes[rid]
        res = serve(high, tm.WordTokens(), *tm.conditioning("wan21"), tm.empty_latent("wan21"),
                    ctx.spec(out.request), store, served_opts, second_model=low)
        assert res.decision.rule_id == rule.rule_id and "UNCERTIFIED" in res.decision.summary
        got = names[res.decision.candidate.entry_id] if res.decision.accepted else None
        assert got == (recorded[rid][0] if rid in recorded else None), (rid, res.decision.summary)
        assert res.report.stage == "second" and (res.report.decision == "hit") == (rid in recorded)
        dense = out.result.latent["samples"]
        if rid in recorded:
            psnr = pairs.psnr_db(ctx.decode(res.latent["samples"]), ctx.decode(dense))
            assert (psnr < PSNR_DB) is recorded[rid][1]
            assert psnr == pytest.approx(float(by_id[(rid, got)].diag["psnr_db"] or np.inf), abs=1e-3)
        else:
            assert torch.equal(res.latent["samples"], dense), rid  # rejected: the dense two-expert output
