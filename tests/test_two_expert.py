"""Split schedules and two-expert models (Wan 2.2 14B: a high-noise and a low-noise expert), on a tiny two-expert
Wan fixture: two tiny WanModels with different weights, each behind ModelSamplingSD3 shift 8 as the stock Wan 2.2
14B workflow loads them.

* Contract: the Early Probe on the high-noise expert over steps [0, switch) with leftover noise, the Joint Reuse
  Sampler resuming that stage, and the Joint Reuse Sampler (or a plain KSamplerAdvanced) on the low-noise expert
  over [switch, steps) give the plain two-KSamplerAdvanced graph's latents, bit for bit, stage by stage.
* Namespace: the config of a two-expert run covers the switch step and the second expert; an entry written for it
  is never recalled for a single-model request, another switch step or another second expert.
* Reuse: an identical scene on the two-expert config is a hit (empty active region) whose output is the cached one.
* Bad wiring gets a clear error (a stage the probe cannot resume, the wrong second model, a missing second model);
  a first stage's leftover-noise latent is never stored as a finished generation.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.comfy

STEPS, SWITCH, K, SEED, CFG = 6, 3, 2, 42, 3.5
PROMPT = "a red ball"


@pytest.fixture(scope="module")
def env(comfy_env, tmp_path_factory):
    import tiny_models as tm
    from comfy_extras.nodes_model_advanced import ModelSamplingSD3

    def expert(seed: int):
        raw = tm.load_tiny_model("wan21", tmp_path_factory.mktemp(f"expert{seed}"), seed=seed)
        return ModelSamplingSD3().patch(raw, shift=8.0)[0]

    return tm, expert(0), expert(1), expert(2)


def _advanced(model, latent, *, add_noise: bool, start: int, end: int, leftover: bool, sampler="euler"):
    """ComfyUI's own KSamplerAdvanced node."""
    import tiny_models as tm

    import nodes as comfy_nodes

    pos, neg = tm.conditioning("wan21")
    return comfy_nodes.KSamplerAdvanced().sample(model, "enable" if add_noise else "disable", SEED, STEPS, CFG,
                                                 sampler, "simple", pos, neg, latent, start, end,
                                                 "enable" if leftover else "disable")[0]


def _plain_two_stage(tm, high, low, sampler="euler"):
    first = _advanced(high, tm.empty_latent("wan21"), add_noise=True, start=0, end=SWITCH, leftover=True,
                      sampler=sampler)
    final = _advanced(low, first, add_noise=False, start=SWITCH, end=10000, leftover=False, sampler=sampler)
    return first, final


def _spec(sampler="euler", switch=SWITCH, prompt=PROMPT):
    from carnator.carnator_core.request import RequestSpec
    from carnator.carnator_core.types import Stage

    return RequestSpec(prompt, SEED, STEPS, CFG, sampler=sampler, objects="ball",
                       stage=Stage(0, switch, True, True))


@pytest.mark.parametrize("sampler", ["euler", "dpmpp_2m", "uni_pc"])
def test_probe_and_dense_resume_equal_the_two_ksampler_advanced_graph(env, sampler):
    from carnator.carnator_core.probe import ProbeConfig
    from carnator.carnator_core.request import probe_request, reuse_stage
    from carnator.carnator_core.reuse import ReuseConfig
    from carnator.carnator_core.types import Stage

    tm, high, low, _ = env
    pos, neg = tm.conditioning("wan21")
    ref_first, ref_final = _plain_two_stage(tm, high, low, sampler)
    lat = tm.empty_latent("wan21")
    probe = probe_request(high, pos, neg, lat, _spec(sampler), ProbeConfig(probe_steps=K), tm.WordTokens(),
                          second_model=low)
    g = probe.config
    assert (g.start_step, g.end_step, g.add_noise, g.leftover_noise, g.probe_steps) == (0, SWITCH, True, True, K)
    assert g.second_model and g.second_model != probe.model_fingerprint and probe.request_key
    dense = ReuseConfig(mode="dense")
    first, r1 = reuse_stage(high, pos, neg, lat, probe, None, None, dense, stage=Stage(0, SWITCH, True, True))
    assert torch.equal(first, ref_first["samples"]), f"first stage: {(first - ref_first['samples']).abs().max()}"
    # the probe's k calls were replayed: the first stage made only the rest of its calls
    assert (r1.stage, r1.final, r1.replayed_calls, r1.model_calls, r1.steps_total) == ("first", False, K, SWITCH - K,
                                                                                          SWITCH)
    final, r2 = reuse_stage(low, pos, neg, {"samples": first}, probe, None, None, dense,
                            stage=Stage(SWITCH, 10000, False, False))
    assert torch.equal(final, ref_final["samples"]), f"second stage: {(final - ref_final['samples']).abs().max()}"
    assert (r2.stage, r2.final, r2.replayed_calls, r2.model_calls) == ("second", True, 0, STEPS - SWITCH)
    # Carnator's first stage feeds a plain KSamplerAdvanced second stage just as well
    plain_second = _advanced(low, {"samples": first}, add_noise=False, start=SWITCH, end=10000, leftover=False,
                             sampler=sampler)
    assert torch.equal(plain_second["samples"], ref_final["samples"])


def test_nodes_run_the_two_expert_graph_and_refuse_bad_stages(env):
    from carnator.nodes.probe import CarnatorEarlyProbe
    from carnator.nodes.sampler import CarnatorJointReuseSampler

    tm, high, low, other = env
    pos, neg = tm.conditioning("wan21")
    lat = tm.empty_latent("wan21")
    _, ref_final = _plain_two_stage(tm, high, low)
    probe = CarnatorEarlyProbe.execute(high, pos, neg, lat, SEED, STEPS, CFG, "euler", "simple", K, PROMPT,
                                       text_encoder=tm.WordTokens(), objects="ball", add_noise="enable",
                                       start_at_step=0, end_at_step=SWITCH, return_with_leftover_noise="enable",
                                       second_model=low).result[0]
    first = CarnatorJointReuseSampler.execute(high, pos, neg, lat, probe, mode="dense", add_noise="enable",
                                              start_at_step=0, end_at_step=SWITCH,
                                              return_with_leftover_noise="enable").result[0]
    final, report, summary = CarnatorJointReuseSampler.execute(low, pos, neg, first, probe, mode="dense",
                                                               add_noise="disable", start_at_step=SWITCH).result
    assert torch.equal(final["samples"], ref_final["samples"]) and report.stage == "second"
    assert "stage=second" in summary

    with pytest.raises(ValueError, match=r"not one the probe can resume.*start_at_step=3, end_at_step=>= 6"):
        CarnatorJointReuseSampler.execute(low, pos, neg, first, probe, mode="dense", add_noise="disable",
                                          start_at_step=SWITCH + 1)
    with pytest.raises(ValueError, match="differs from the probe's second_model"):
        CarnatorJointReuseSampler.execute(other, pos, neg, first, probe, mode="dense", add_noise="disable",
                                          start_at_step=SWITCH)
    with pytest.raises(ValueError, match="MODEL differs from the one the probe ran on"):
        CarnatorJointReuseSampler.execute(low, pos, neg, lat, probe, mode="dense", add_noise="enable",
                                          start_at_step=0, end_at_step=SWITCH, return_with_leftover_noise="enable")
    with pytest.raises(ValueError, match="connect that model .* to second_model"):
        CarnatorEarlyProbe.execute(high, pos, neg, lat, SEED, STEPS, CFG, "euler", "simple", K, PROMPT,
                                   text_encoder=tm.WordTokens(), end_at_step=SWITCH,
                                   return_with_leftover_noise="enable")
    with pytest.raises(ValueError, match="second_model is connected but"):
        CarnatorEarlyProbe.execute(high, pos, neg, lat, SEED, STEPS, CFG, "euler", "simple", K, PROMPT,
                                   text_encoder=tm.WordTokens(), second_model=low)


def test_queue_time_checks_of_stage_inputs():
    from carnator.nodes.probe import CarnatorEarlyProbe
    from carnator.nodes.sampler import CarnatorJointReuseSampler

    ok = CarnatorEarlyProbe.validate_inputs(steps=20, probe_steps=4, start_at_step=0, end_at_step=10,
                                            return_with_leftover_noise="enable")
    assert ok is True
    assert "probe steps (10) must be fewer than the steps of its stage [0, 10)" in \
        CarnatorEarlyProbe.validate_inputs(steps=20, probe_steps=10, start_at_step=0, end_at_step=10)
    assert "start_at_step (12) must be below end_at_step (10" in \
        CarnatorEarlyProbe.validate_inputs(steps=20, probe_steps=2, start_at_step=12, end_at_step=10)
    assert "start_at_step (25) must be below end_at_step (10000, clipped to steps=20)" in \
        CarnatorEarlyProbe.validate_inputs(steps=20, probe_steps=2, start_at_step=25)
    assert "must be in [0, 10000]" in CarnatorEarlyProbe.validate_inputs(steps=20, probe_steps=2, end_at_step=-1)
    assert CarnatorJointReuseSampler.validate_inputs(start_at_step=10, end_at_step=10000) is True
    assert "start_at_step (10) must be below end_at_step (10)" in \
        CarnatorJointReuseSampler.validate_inputs(start_at_step=10, end_at_step=10)


def test_namespace_covers_the_switch_step_and_the_second_expert(env, comfy_dirs):
    from carnator.carnator_core.cache.store import Store
    from carnator.carnator_core.probe import ProbeConfig
    from carnator.carnator_core.request import RequestSpec, ServeOptions, recall, serve
    from carnator.carnator_core.types import GenConfig, namespace_key

    tm, high, low, other = env
    pos, neg = tm.conditioning("wan21")
    lat = tm.empty_latent("wan21")
    store = Store.open(comfy_dirs / "c", key_path=comfy_dirs / "key")
    opts = ServeOptions(method="prompt_only", prompt_threshold=0.5, probe=ProbeConfig(probe_steps=K))
    written = serve(high, tm.WordTokens(), pos, neg, lat, _spec(), store, opts, second_model=low)
    assert written.entry_id and written.report.stage == "second"
    ns = namespace_key(written.probe.model_fingerprint, written.probe.config)

    def recalled(probe):
        return [c.entry_id for c in recall(store, probe, 5, 0.0).items]

    from carnator.carnator_core.request import probe_request

    same = probe_request(high, pos, neg, lat, _spec(), ProbeConfig(probe_steps=K), tm.WordTokens(), second_model=low)
    assert namespace_key(same.model_fingerprint, same.config) == ns and recalled(same) == [written.entry_id]
    variants = {
        "single model": probe_request(high, pos, neg, lat, RequestSpec(PROMPT, SEED, STEPS, CFG, objects="ball"),
                                      ProbeConfig(probe_steps=K), tm.WordTokens()),
        "switch step": probe_request(high, pos, neg, lat, _spec(switch=SWITCH + 1), ProbeConfig(probe_steps=K),
                                     tm.WordTokens(), second_model=low),
        "second expert": probe_request(high, pos, neg, lat, _spec(), ProbeConfig(probe_steps=K), tm.WordTokens(),
                                       second_model=other),
    }
    for what, probe in variants.items():
        assert namespace_key(probe.model_fingerprint, probe.config) != ns, what
        assert recalled(probe) == [], what
    # a whole-schedule config fingerprints exactly as before the stage fields existed (rules and caches still match)
    whole = variants["single model"].config
    legacy = GenConfig(whole.arch, whole.latent_shape, whole.steps, whole.sampler, whole.scheduler, whole.cfg,
                       whole.sigmas_digest, whole.probe_steps)
    assert whole.fingerprint() == legacy.fingerprint() and "second_model" not in whole.to_meta()
    assert GenConfig.from_meta(written.probe.config.to_meta()) == written.probe.config


def test_identical_scene_on_two_expert_config_is_a_hit_with_the_cached_output(env, comfy_dirs):
    from carnator.carnator_core.cache.store import Store
    from carnator.carnator_core.probe import ProbeConfig
    from carnator.carnator_core.request import ServeOptions, serve

    tm, high, low, _ = env
    pos, neg = tm.conditioning("wan21")
    lat = tm.empty_latent("wan21")
    store = Store.open(comfy_dirs / "c", key_path=comfy_dirs / "key")
    # exact answers off: the recall + reuse path (an exact repeat is answered before it, see the test below)
    opts = ServeOptions(method="prompt_only", prompt_threshold=0.5, probe=ProbeConfig(probe_steps=K), exact=False)
    first = serve(high, tm.WordTokens(), pos, neg, lat, _spec(), store, opts, second_model=low)
    assert first.report.decision == "miss" and first.entry_id
    again = serve(high, tm.WordTokens(), pos, neg, lat, _spec(), store, opts, second_model=low)
    r = again.report
    assert (r.decision, r.entry_id, r.stage) == ("hit", first.entry_id, "second")
    assert r.active_fraction == 0.0 and r.model_calls == 0 and r.skipped_calls == STEPS - SWITCH
    diff = (again.latent["samples"] - first.latent["samples"]).abs().max().item()
    assert diff < 1e-4, diff


def test_partial_hit_reuses_the_entry_on_both_experts(env, comfy_dirs):
    """Another seed of the cached scene: a hit whose active region is recomputed on both experts (the second
    stage too computes only the region, over keys/values refreshed on the low-noise expert itself)."""
    from carnator.carnator_core.cache.store import Store
    from carnator.carnator_core.probe import ProbeConfig
    from carnator.carnator_core.request import ServeOptions, serve
    from carnator.carnator_core.reuse import ReuseConfig

    tm, high, low, _ = env
    pos, neg = tm.conditioning("wan21")
    lat = tm.empty_latent("wan21")
    store = Store.open(comfy_dirs / "c", key_path=comfy_dirs / "key")
    # Random weights disagree everywhere across seeds (x0, context): the region here comes from the object's
    # moved mask alone, and one refresh leaves two of the second stage's three calls restricted to it.
    opts = ServeOptions(method="prompt_only", prompt_threshold=0.5, probe=ProbeConfig(probe_steps=K),
                        reuse=ReuseConfig(x0_threshold=50.0, dilation=0, whole_objects=False, context_delta=1e9,
                                          refreshes=1))
    first = serve(high, tm.WordTokens(), pos, neg, lat, _spec(), store, opts, second_model=low)
    other = serve(high, tm.WordTokens(), pos, neg, lat, dataclasses.replace(_spec(), seed=SEED + 1), store, opts,
                  second_model=low)
    r = other.report
    assert (r.decision, r.entry_id, r.stage) == ("hit", first.entry_id, "second")
    assert 0.0 < r.active_fraction < 1.0, r.active_fraction
    assert r.model_calls == STEPS - SWITCH and r.token_fraction < 1.0, r.summary()
    assert torch.isfinite(other.latent["samples"]).all()


def test_first_stage_output_is_never_stored_as_a_generation(env, comfy_dirs):
    from carnator.carnator_core.cache.store import Store
    from carnator.carnator_core.probe import ProbeConfig
    from carnator.carnator_core.request import probe_request, reuse_stage, signature_stage, write_result
    from carnator.carnator_core.reuse import ReuseConfig
    from carnator.carnator_core.types import Stage

    tm, high, low, _ = env
    pos, neg = tm.conditioning("wan21")
    lat = tm.empty_latent("wan21")
    store = Store.open(comfy_dirs / "c", key_path=comfy_dirs / "key")
    probe = probe_request(high, pos, neg, lat, _spec(), ProbeConfig(probe_steps=K), tm.WordTokens(), second_model=low)
    sig, _ = signature_stage(probe)
    first, r1 = reuse_stage(high, pos, neg, lat, probe, None, None, ReuseConfig(mode="dense"),
                            stage=Stage(0, SWITCH, True, True))
    done = write_result(store, probe, sig, first, r1)
    assert not done.written and "first stage's output" in done.text
    done = write_result(store, probe, sig, first, None)
    assert not done.written and "second stage" in done.text
    assert store.stats().entries == 0


def test_a_probe_on_a_later_stage_resumes_like_ksampler_advanced(env):
    """Any split schedule: the probe may run a stage that starts mid-schedule without adding noise (after a plain
    KSamplerAdvanced first stage); probe + dense resume still equals that stage's KSamplerAdvanced."""
    from carnator.carnator_core.probe import ProbeConfig
    from carnator.carnator_core.request import RequestSpec, probe_request, reuse_stage
    from carnator.carnator_core.reuse import ReuseConfig
    from carnator.carnator_core.types import Stage

    tm, high, low, _ = env
    pos, neg = tm.conditioning("wan21")
    ref_first, ref_final = _plain_two_stage(tm, high, low)
    stage = Stage(SWITCH, 10000, False, False)
    probe = probe_request(low, pos, neg, ref_first, RequestSpec(PROMPT, SEED, STEPS, CFG, objects="ball", stage=stage),
                          ProbeConfig(probe_steps=1), tm.WordTokens())
    g = probe.config
    assert (g.start_step, g.end_step, g.add_noise, g.second_model) == (SWITCH, 0, False, "")
    assert g.conditioning  # the input latent (the first stage's output) is part of the namespace
    out, report = reuse_stage(low, pos, neg, ref_first, probe, None, None, ReuseConfig(mode="dense"), stage=stage)
    assert torch.equal(out, ref_final["samples"])
    assert (report.stage, report.final, report.replayed_calls, report.model_calls) == ("first", True, 1,
                                                                                        STEPS - SWITCH - 1)


def test_two_expert_node_graph_writes_then_hits(env, comfy_dirs):
    """The node graph of the example workflow on the tiny experts: probe (cache connected) -> signature ->
    retriever -> risk filter -> sampler on each expert -> writer fed by the second stage. The first run is a miss
    and is stored with both stages' outputs; the same request again is an exact repeat whose stages return them
    bit for bit with no model call; a writer fed by the first stage stores nothing and says why."""
    from carnator.nodes.cache import CarnatorCacheLoader, CarnatorCacheRetriever, CarnatorCacheWriter
    from carnator.nodes.probe import CarnatorEarlyProbe
    from carnator.nodes.risk import CarnatorRiskFilter
    from carnator.nodes.sampler import CarnatorJointReuseSampler
    from carnator.nodes.signature import CarnatorSignatureBuilder

    tm, high, low, _ = env
    pos, neg = tm.conditioning("wan21")
    lat = tm.empty_latent("wan21")
    handle = CarnatorCacheLoader.execute(directory="two-expert").result[0]
    first_stage = {"add_noise": "enable", "start_at_step": 0, "end_at_step": SWITCH,
                   "return_with_leftover_noise": "enable"}

    def graph():
        probe = CarnatorEarlyProbe.execute(high, pos, neg, lat, SEED, STEPS, CFG, "euler", "simple", K, PROMPT,
                                           text_encoder=tm.WordTokens(), cache=handle, objects="ball",
                                           second_model=low, **first_stage).result[0]
        sig = CarnatorSignatureBuilder.execute(probe).result[0]
        cands = CarnatorCacheRetriever.execute(cache=handle, probe=probe, k=5, min_similarity=0.0).result[0]
        decision = CarnatorRiskFilter.execute(cands, "", "prompt_only", 0.5, False, signature=sig,
                                              probe=probe).result[0]
        mid, r1, _ = CarnatorJointReuseSampler.execute(high, pos, neg, lat, probe, decision, sig, handle, "joint",
                                                       **first_stage).result
        final, r2, _ = CarnatorJointReuseSampler.execute(low, pos, neg, mid, probe, decision, sig, handle, "joint",
                                                         add_noise="disable", start_at_step=SWITCH).result
        return probe, sig, mid, r1, final, r2

    probe, sig, mid, r1, final, r2 = graph()
    assert (r1.decision, r2.decision) == ("miss", "miss")
    refused = CarnatorCacheWriter.execute(cache=handle, probe=probe, signature=sig, latent=mid, report=r1)
    assert refused.result[0] == "" and "first stage's output" in refused.ui.as_dict()["text"][0]
    written = CarnatorCacheWriter.execute(cache=handle, probe=probe, signature=sig, latent=final, report=r2)
    entry_id = written.result[0]
    assert entry_id and r2.block_structure is not None

    with tm.count_calls(high) as calls_high, tm.count_calls(low) as calls_low:
        probe2, _, mid2, h1, again, h2 = graph()
    # an exact repeat: both stages answered from the entry, bit for bit, with no model call
    assert probe2.answered is not None and probe2.answered.entry_id == entry_id
    assert (calls_high, calls_low) == ([], [])
    assert (h1.mode, h1.entry_id, h1.stage, h1.final, h2.mode, h2.stage) == ("exact", entry_id, "first", False,
                                                                              "exact", "second")
    assert torch.equal(mid2["samples"], mid["samples"]) and torch.equal(again["samples"], final["samples"])


def test_exact_repeat_of_a_two_expert_request(env, comfy_dirs):
    """An exact repeat of a split request is answered before the probe: the first stage with the stored first-stage
    output (what KSamplerAdvanced's first stage returns, bit for bit, so a plain second stage works too), the second
    with the stored final latent; no model call. A result whose decision accepted an entry gets no request key."""
    from carnator.carnator_core.cache.store import Store
    from carnator.carnator_core.probe import ProbeConfig
    from carnator.carnator_core.request import ServeOptions, serve

    tm, high, low, other = env
    pos, neg = tm.conditioning("wan21")
    lat = tm.empty_latent("wan21")
    ref_first, ref_final = _plain_two_stage(tm, high, low)
    store = Store.open(comfy_dirs / "c", key_path=comfy_dirs / "key")
    opts = ServeOptions(method="prompt_only", prompt_threshold=0.5, probe=ProbeConfig(probe_steps=K))
    first = serve(high, tm.WordTokens(), pos, neg, lat, _spec(), store, opts, second_model=low)
    assert first.report.decision == "miss" and first.probe.request_key
    assert store.find_request(first.probe.request_key) == first.entry_id
    assert torch.equal(first.latent["samples"], ref_final["samples"])
    with tm.count_calls(high) as calls_high, tm.count_calls(low) as calls_low:
        again = serve(high, tm.WordTokens(), pos, neg, lat, _spec(), store, opts, second_model=low)
    assert again.exact and (calls_high, calls_low) == ([], [])
    assert torch.equal(again.latent["samples"], ref_final["samples"])
    assert torch.equal(again.probe.answered.stage_latent, ref_first["samples"])
    # the key covers the second expert and the switch: neither is answered from this entry
    for what, kwargs in {"second expert": {"second_model": other}, "switch": {}}.items():
        spec = _spec(switch=SWITCH + 1) if what == "switch" else _spec()
        res = serve(high, tm.WordTokens(), pos, neg, lat, spec, store, ServeOptions(
            method="prompt_only", prompt_threshold=0.5, probe=ProbeConfig(probe_steps=K), write=False),
            second_model=kwargs.get("second_model", low))
        assert not res.exact, what
    # Another seed: the filter accepts the entry. Whether the stages then reuse it or the region gate runs them
    # dense, the first stage's output is no certain dense result, so nothing stored for it answers by key.
    other_seed = serve(high, tm.WordTokens(), pos, neg, lat, dataclasses.replace(_spec(), seed=SEED + 5), store,
                       opts, second_model=low)
    assert other_seed.decision.accepted and other_seed.report.first_stage_latent is None
    assert other_seed.probe.request_key and store.find_request(other_seed.probe.request_key) is None
