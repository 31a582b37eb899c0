"""Joint Reuse Sampler mechanics on tiny random-weight models (semantics on the embedded model live in
test_reuse_embedded.py): dense mode equals KSampler through the node, identical-request reuse reproduces the
cached output, partial reuse computes fewer tokens, object-region reuse works on each architecture (objects have
conditioning tokens, so their region comes from captured attention), the model and the inputs are untouched,
EasyCache composes."""
from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.comfy


@pytest.fixture(scope="module")
def env(comfy_env, tmp_path_factory):
    import tiny_models as tm

    d = tmp_path_factory.mktemp("tiny")
    return tm, {name: tm.load_tiny_model(name, d) for name in ("wan21", "wan22", "ltxv")}


def _probe(m, tm, name, seed, steps=8, k=2, context_kv_mb=0.0):
    """Early Probe node on "a red ball" with a text encoder that puts word i at conditioning position i, so
    the object's cross-attention is really captured (its map is not empty)."""
    from carnator.nodes.probe import CarnatorEarlyProbe

    pos, neg = tm.conditioning(name)
    lat = tm.empty_latent(name)
    out = CarnatorEarlyProbe.execute(m, pos, neg, lat, seed, steps, 5.0, "euler", "simple", k, "a red ball",
                                     None, tm.WordTokens(), "ball", context_kv_mb=context_kv_mb)
    probe = out.args[0]
    assert [o.positions for o in probe.objects] == [(2,)], probe.objects  # "ball": word 3 at position 2
    assert probe.object_maps["ball"].sum() > 0
    return probe, pos, neg, lat


def _signature(probe):
    from carnator.carnator_core.types import ObjectSignature, Signature

    mp = probe.object_maps["ball"]
    mask = mp / max(float(mp.max()), 1e-8)
    return Signature((ObjectSignature("ball", mask.astype(np.float32), float(mask.mean()), (50.0, 10.0, 10.0)),),
                     np.zeros((4, 4, 3), np.float32), probe.grid)


def _cached(probe, final, report):
    from carnator.carnator_core.reuse import CachedRun

    return CachedRun("entry-1", final["samples"][0], probe.x0_probe, _signature(probe), report.block_structure)


def _accept(sig):
    from carnator.carnator_core.types import Candidate, Decision

    return Decision(True, Candidate("entry-1", 0.99, "a red ball", sig), (), "signature", summary="test accept")


def _run(m, pos, neg, lat, probe, decision=None, sig=None, mode="dense", cached=None, block_size=8):
    from carnator.carnator_core import reuse

    return reuse.sample(m, pos, neg, lat, probe, decision, cached,
                        reuse.ReuseConfig(mode=mode, block_size=block_size), target_signature=sig)


@pytest.mark.parametrize("name", ["wan21", "wan22", "ltxv"])
def test_dense_mode_node_equals_ksampler_and_inputs_untouched(env, name):
    import nodes as comfy_nodes
    from carnator.nodes.sampler import CarnatorJointReuseSampler

    tm, models = env
    m = models[name]
    probe, pos, neg, lat = _probe(m, tm, name, seed=11)
    pos_before, lat_before = copy.deepcopy(pos), copy.deepcopy(lat)
    ref = comfy_nodes.common_ksampler(m, 11, 8, 5.0, "euler", "simple", pos, neg, lat)[0]["samples"]
    out = CarnatorJointReuseSampler.execute(m, pos, neg, lat, probe, None, None, None, "dense")
    latent, report, summary = out.args
    assert torch.equal(latent["samples"], ref)
    assert report.decision == "dense" and "DENSE" in summary
    assert out.ui["carnator_report"][0]["decision"] == "dense"
    assert torch.equal(pos[0][0], pos_before[0][0]) and torch.equal(lat["samples"], lat_before["samples"])
    assert report.block_structure is not None and report.block_structure.keep.ndim == 4


@pytest.mark.parametrize("mode", ["joint", "latent"])
def test_identical_request_reuse_reproduces_cached_output(env, mode):
    tm, models = env
    m = models["wan21"]
    probe, pos, neg, lat = _probe(m, tm, "wan21", seed=5)
    final, rep = _run(m, pos, neg, lat, probe)
    sig = _signature(probe)
    out, rep2 = _run(m, pos, neg, lat, probe, _accept(sig), sig, mode, _cached(probe, {"samples": final}, rep))
    assert rep2.decision == "hit" and rep2.active_fraction == 0.0
    mse = float(((out - final) ** 2).mean())
    peak = float(final.abs().max()) ** 2
    psnr = 10 * np.log10(peak / max(mse, 1e-20))
    assert psnr >= 35.0, psnr
    assert rep2.model_calls == 0 and rep2.skipped_calls == 8 - 2  # nothing left to compute after the probe
    assert rep2.compute_fraction == pytest.approx(2 / 8)


def test_partial_reuse_computes_fewer_tokens_and_keeps_inactive_tokens_cached(env):
    tm, models = env
    m = models["wan21"]
    probe, pos, neg, lat = _probe(m, tm, "wan21", seed=5)
    final, rep = _run(m, pos, neg, lat, probe)
    # A target whose object moved: its mask covers only the first frame's left half (no recorded structure).
    cached, target_sig = _moved_target(probe, final, rep, structure=False)
    from carnator.carnator_core import reuse

    out, r = reuse.sample(m, pos, neg, lat, probe, _accept(target_sig), cached,
                          reuse.ReuseConfig(mode="joint", block_size=8, dilation=0, x0_threshold=1e9,
                                            context_margin_blocks=0),
                          target_signature=target_sig)
    assert 0 < r.active_fraction < 1
    assert r.token_fraction < 1.0 and r.compute_fraction < 1.0
    # tokens outside the active region end exactly at the cached result
    A = reuse.active_region(target_sig, cached.signature, probe.x0_probe.numpy(), cached.x0_probe.numpy(),
                            (1, 2, 2), reuse.ReuseConfig(dilation=0, x0_threshold=1e9))
    inactive = ~np.repeat(np.repeat(A, 2, 1), 2, 2)
    diff = (out[0] - final[0]).abs().numpy()[:, inactive]
    assert diff.max() < 1e-4, (diff.max(), diff.mean(), inactive.mean())


@pytest.mark.parametrize("name", ["wan21", "wan22", "ltxv"])
def test_object_region_reuse_on_each_architecture(env, name):
    """The object's region comes from the probe's captured cross-attention (the Signature Builder's mask), and
    the cached run shows the object elsewhere: joint reuse recomputes the object's old and new places, keeps
    every other token at the cached result, and calls the model for every step after the probe."""
    from carnator.carnator_core import reuse
    from carnator.carnator_core.adapters import adapter_for
    from carnator.carnator_core.signature import build_signature

    tm, models = env
    m = models[name]
    probe, pos, neg, lat = _probe(m, tm, name, seed=13)
    final, rep = _run(m, pos, neg, lat, probe)
    sig = build_signature(probe)
    mask = np.asarray(sig.objects[0].mask, np.float32)
    T, H, W = probe.grid
    assert 0 < mask.mean() < 0.5, mask.mean()  # a real, partial object support on this architecture
    moved = dataclasses.replace(sig, objects=(dataclasses.replace(sig.objects[0], mask=np.roll(mask, W // 2, 2)),))
    cached = reuse.CachedRun("entry-1", final[0], probe.x0_probe, moved, rep.block_structure)
    config = reuse.ReuseConfig(mode="joint", block_size=8, dilation=0, x0_threshold=1e9, context_margin_blocks=0)
    out, r = reuse.sample(m, pos, neg, lat, probe, _accept(sig), cached, config, target_signature=sig)
    assert r.decision == "hit" and 0 < r.active_fraction < 1 and r.token_fraction < 1.0
    assert r.model_calls == 8 - 2 and r.skipped_calls == 0
    patch = adapter_for(m).patch_of(m)
    A = reuse.active_region(sig, moved, probe.x0_probe.numpy(), cached.x0_probe.numpy(), patch, config)
    assert A.shape == (T, H, W) and A.any() and not A.all()
    _, lt, lh, lw = final.shape[1:]
    inactive = ~np.repeat(np.repeat(np.repeat(A, lt // T, 0), lh // H, 1), lw // W, 2)
    diff = (out[0] - final[0]).abs().numpy()
    assert diff[:, inactive].max() < 1e-4, diff[:, inactive].max()
    assert diff[:, ~inactive].max() > 1e-3  # the active region was recomputed for this request


def test_model_unchanged_after_reuse_runs(env):
    import nodes as comfy_nodes

    tm, models = env
    m = models["wan21"]
    pos, neg = tm.conditioning("wan21")
    before = comfy_nodes.common_ksampler(m, 3, 4, 5.0, "euler", "simple", pos, neg,
                                         tm.empty_latent("wan21"))[0]["samples"]
    probe, pos, neg, lat = _probe(m, tm, "wan21", seed=9)
    final, rep = _run(m, pos, neg, lat, probe)
    sig = _signature(probe)
    _run(m, pos, neg, lat, probe, _accept(sig), sig, "attention", _cached(probe, {"samples": final}, rep))
    after = comfy_nodes.common_ksampler(m, 3, 4, 5.0, "euler", "simple", pos, neg,
                                        tm.empty_latent("wan21"))[0]["samples"]
    assert torch.equal(before, after)
    assert "patches_replace" not in m.model_options.get("transformer_options", {})


def test_composes_with_core_easycache(env, caplog):
    """ComfyUI's own EasyCache on the same MODEL: in one resume, EasyCache skips steps inside the model while
    Carnator reuses the cached run outside the object's region. Outside it the result is the cached run exactly;
    inside it, the result stays as close to Carnator alone as EasyCache alone stays to a plain run (on this
    random-weight model, at this threshold, EasyCache's own error is measured at about 0.2 relative L2, the
    composition's at about 0.15)."""
    import logging
    import re

    from comfy_extras.nodes_easycache import EasyCacheNode

    import nodes as comfy_nodes
    from carnator.carnator_core import reuse
    from carnator.carnator_core.signature import build_signature

    tm, models = env
    plain = models["wan21"]
    steps, k, seed = 12, 2, 21
    probe, pos, neg, lat = _probe(plain, tm, "wan21", seed=seed, steps=steps, k=k)
    final, rep = _run(plain, pos, neg, lat, probe)
    sig = build_signature(probe)
    T, H, W = probe.grid
    obj = sig.objects[0]
    moved = dataclasses.replace(sig, objects=(dataclasses.replace(obj, mask=np.roll(obj.mask, W // 2, 2)),))
    cached = reuse.CachedRun("entry-1", final[0], probe.x0_probe, moved, rep.block_structure)
    config = reuse.ReuseConfig(mode="joint", block_size=8, dilation=0, x0_threshold=1e9, context_margin_blocks=0)
    alone, r_alone = reuse.sample(plain, pos, neg, lat, probe, _accept(sig), cached, config, target_signature=sig)

    eased = EasyCacheNode.execute(plain, 0.7, 0.0, 1.0, False).args[0]
    dense = comfy_nodes.common_ksampler(plain, seed, steps, 5.0, "euler", "simple", pos, neg, lat)[0]["samples"]
    dense_eased = comfy_nodes.common_ksampler(eased, seed, steps, 5.0, "euler", "simple", pos, neg, lat)[0]["samples"]
    easycache_error = float((dense_eased - dense).norm() / dense.norm())
    # The MODEL's fingerprint includes its patches: probe the EasyCache MODEL, as a workflow would.
    probe_e, *_ = _probe(eased, tm, "wan21", seed=seed, steps=steps, k=k)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        both, r_both = reuse.sample(eased, pos, neg, lat, probe_e, _accept(sig), cached, config,
                                    target_signature=sig)
    skipped = [int(m.group(1)) for m in (re.search(r"EasyCache - skipped (\d+)/\d+ steps", rec.getMessage())
                                         for rec in caplog.records) if m]
    assert skipped and skipped[-1] > 0, f"EasyCache skipped no step in the resume: {skipped}"
    assert r_both.decision == "hit" and 0 < r_both.active_fraction < 1 and r_both.token_fraction < 1.0
    assert r_both.active_fraction == r_alone.active_fraction and r_both.model_calls == steps - k
    active = (alone[0] - final[0]).abs() > 1e-6  # where Carnator recomputed (elsewhere: the cached run)
    assert 0 < float(active.float().mean()) < 1
    assert float((both[0] - final[0]).abs()[~active].max()) < 1e-4
    composed_error = float((both[0] - alone[0])[active].norm() / alone[0][active].norm())
    print(f"EasyCache skipped {skipped[-1]} resume steps; relative L2 in the active region vs Carnator alone "
          f"{composed_error:.4f}; EasyCache alone vs a plain run {easycache_error:.4f}")
    assert 0 < easycache_error and 0 < composed_error <= 1.5 * easycache_error, (composed_error, easycache_error)


def test_accepted_decision_without_cache_is_a_clear_error(env):
    from carnator.nodes.sampler import CarnatorJointReuseSampler

    tm, models = env
    m = models["wan21"]
    probe, pos, neg, lat = _probe(m, tm, "wan21", seed=1)
    with pytest.raises(ValueError, match="no cache is connected"):
        CarnatorJointReuseSampler.execute(m, pos, neg, lat, probe, _accept(_signature(probe)), None, None, "joint")


def test_mismatched_latent_is_a_clear_error(env):
    tm, models = env
    m = models["wan21"]
    probe, pos, neg, lat = _probe(m, tm, "wan21", seed=1)
    with pytest.raises(ValueError, match="differs from the probed one"):
        _run(m, pos, neg, {"samples": torch.zeros(1, 16, 3, 8, 12)}, probe)


def test_joint_never_computes_more_than_latent_only(env):
    """Joint = latent-only's token subset (A + margin) with the recorded blocks among those tokens: never more
    tokens or attention pairs than latent-only, and a finite result (rows whose recorded keys all lie outside
    the subset keep their own block)."""
    import torch

    from carnator.carnator_core import reuse
    from carnator.carnator_core.types import ObjectSignature, Signature

    tm, models = env
    m = models["wan21"]
    probe, pos, neg, lat = _probe(m, tm, "wan21", seed=6)
    final, rep = _run(m, pos, neg, lat, probe)
    assert rep.block_structure is not None
    T, H, W = probe.grid
    mask = np.zeros((T, H, W), np.float32)
    mask[:, : H // 2, : W // 2] = 1.0
    sig = Signature((ObjectSignature("ball", mask, float(mask.mean()), (50.0, 10.0, 10.0)),),
                    np.zeros((4, 4, 3), np.float32), probe.grid)
    moved = ObjectSignature("ball", np.roll(mask, W // 2, axis=2), float(mask.mean()), (50.0, 10.0, 10.0))
    target = Signature((moved,), np.zeros((4, 4, 3), np.float32), probe.grid)
    cached = reuse.CachedRun("entry-1", final[0], probe.x0_probe, sig, rep.block_structure)
    reports = {}
    for mode in ("latent", "joint"):
        out, r = reuse.sample(m, pos, neg, lat, probe, _accept(target), cached,
                              reuse.ReuseConfig(mode=mode, block_size=8, dilation=0, x0_threshold=1e9),
                              target_signature=target)
        assert torch.isfinite(out).all()
        reports[mode] = r
    assert 0 < reports["joint"].active_fraction < 1
    assert reports["joint"].token_fraction <= reports["latent"].token_fraction + 1e-9
    assert reports["joint"].attention_fraction <= reports["latent"].attention_fraction + 1e-9
    assert reports["joint"].token_fraction < 1.0


def test_region_above_max_active_continues_dense_and_says_why(env):
    """A changed region larger than ``max_active`` would cost about a dense run: the sampler continues dense
    (bit-identical to KSampler), reports a miss with the reason, and still records the block structure."""
    import nodes as comfy_nodes
    from carnator.carnator_core import reuse
    from carnator.carnator_core.types import ObjectSignature, Signature

    tm, models = env
    m = models["wan21"]
    probe, pos, neg, lat = _probe(m, tm, "wan21", seed=5)
    final, rep = _run(m, pos, neg, lat, probe)
    T, H, W = probe.grid
    left, right = np.zeros((T, H, W), np.float32), np.zeros((T, H, W), np.float32)
    left[:, :, : W // 2], right[:, :, W // 2:] = 1.0, 1.0  # the object moved across the whole clip
    cached = _cached(probe, {"samples": final}, rep)
    cached = type(cached)(cached.entry_id, cached.final_latent, cached.x0_probe,
                          Signature((ObjectSignature("ball", left, 0.5, (50.0, 10.0, 10.0)),),
                                    np.zeros((4, 4, 3), np.float32), probe.grid), None)
    target = Signature((ObjectSignature("ball", right, 0.5, (50.0, 10.0, 10.0)),), np.zeros((4, 4, 3), np.float32),
                       probe.grid)
    cfg = reuse.ReuseConfig(mode="joint", block_size=8, dilation=0, x0_threshold=1e9, max_active=0.6)
    out, r = reuse.sample(m, pos, neg, lat, probe, _accept(target), cached, cfg, target_signature=target)
    ref = comfy_nodes.common_ksampler(m, 5, 8, 5.0, "euler", "simple", pos, neg, lat)[0]["samples"]
    assert r.active_fraction == pytest.approx(1.0)
    assert r.decision == "miss" and "max_active" in r.reason, r
    assert torch.equal(out, ref)
    assert r.model_calls == 8 - 2 and r.compute_fraction == pytest.approx(1.0)
    assert r.block_structure is not None
    # the same request with the gate open reuses (the region is what decided it)
    _, r2 = reuse.sample(m, pos, neg, lat, probe, _accept(target), cached,
                         dataclasses.replace(cfg, max_active=1.0), target_signature=target)
    assert r2.decision == "hit"
    with pytest.raises(ValueError, match="max_active"):
        reuse.ReuseConfig(max_active=1.5).validate()


def _moved_target(probe, final, rep, structure: bool = True):
    """A cached entry whose object sat in the first frame's left half and a target where it moved one token
    (``structure``: keep the dense run's recorded block structure in the entry)."""
    from carnator.carnator_core.types import ObjectSignature, Signature

    T, H, W = probe.grid
    mask = np.zeros((T, H, W), np.float32)
    mask[0, :, : W // 2] = 1.0
    moved = Signature((ObjectSignature("ball", mask, float(mask.mean()), (50.0, 10.0, 10.0)),),
                      np.zeros((4, 4, 3), np.float32), probe.grid)
    cached = _cached(probe, {"samples": final}, rep)
    cached = type(cached)(cached.entry_id, cached.final_latent, cached.x0_probe, moved,
                          cached.structure if structure else None)
    target = Signature((ObjectSignature("ball", np.roll(mask, 1, axis=2), float(mask.mean()), (50.0, 10.0, 10.0)),),
                       np.zeros((4, 4, 3), np.float32), probe.grid)
    return cached, target


def test_probe_context_replaces_the_first_dense_refresh(env):
    """The probe keeps every block's keys/values of its last call; a hit with ``probe_context`` attends to them on
    its first reuse call instead of computing that call densely: exactly one dense call fewer, the same number of
    model calls, the probe's record untouched, and the tokens outside the region still the cached ones."""
    from carnator.carnator_core import reuse

    tm, models = env
    m = models["wan21"]
    probe, pos, neg, lat = _probe(m, tm, "wan21", seed=5, steps=10, k=2, context_kv_mb=64.0)
    n_layers = m.model.diffusion_model.num_layers if hasattr(m.model.diffusion_model, "num_layers") \
        else len(m.model.diffusion_model.blocks)
    n_tokens = int(np.prod(probe.grid))
    assert sorted({layer for layer, _ in probe.context_kv}) == list(range(n_layers))
    for k, v in probe.context_kv.values():
        assert k.device.type == "cpu" and k.shape[1] == n_tokens and k.shape == v.shape
    before = {key: (k.clone(), v.clone()) for key, (k, v) in probe.context_kv.items()}
    final, rep = _run(m, pos, neg, lat, probe)
    cached, target = _moved_target(probe, final, rep)
    runs = {}
    for flag in (False, True):
        cfg = reuse.ReuseConfig(mode="joint", block_size=8, dilation=0, x0_threshold=1e9, context_margin_blocks=0,
                                refreshes=3, probe_context=flag)
        runs[flag] = reuse.sample(m, pos, neg, lat, probe, _accept(target), cached, cfg, target_signature=target)
    (_, r0), (out1, r1) = runs[False], runs[True]
    assert r0.decision == r1.decision == "hit" and 0 < r1.active_fraction < 1
    assert r0.model_calls == r1.model_calls == 10 - 2
    # token_fraction = (dense calls + restricted calls x a) / calls: one dense call became a restricted one
    a = r1.active_fraction
    assert (r0.token_fraction - r1.token_fraction) * r1.model_calls == pytest.approx(1 - a, abs=1e-6)
    assert r1.compute_fraction < r0.compute_fraction
    assert not r1.fallbacks, r1.fallbacks
    for key, (k, v) in probe.context_kv.items():
        assert torch.equal(k, before[key][0]) and torch.equal(v, before[key][1])
    A = reuse.active_region(target, cached.signature, probe.x0_probe.numpy(), cached.x0_probe.numpy(), (1, 2, 2),
                            reuse.ReuseConfig(dilation=0, x0_threshold=1e9))
    inactive = ~np.repeat(np.repeat(A, 2, 1), 2, 2)
    assert (out1[0] - final[0]).abs().numpy()[:, inactive].max() < 1e-4


def test_context_records_written_in_place_never_leak_between_runs(env):
    """A hit writes its subset's fresh keys/values into private copies of the context records (one copy per record,
    not one per layer and call). The same probe serving two hits (two samplers fed by one Early Probe) must give
    bit-identical clips, equal to a hit whose records are copied afresh at every call, and leave the probe's record
    as it was."""
    from carnator.carnator_core import comfy_patch as cp, reuse

    tm, models = env
    m = models["wan21"]
    probe, pos, neg, lat = _probe(m, tm, "wan21", seed=5, steps=10, k=2, context_kv_mb=64.0)
    before = {key: (k.clone(), v.clone()) for key, (k, v) in probe.context_kv.items()}
    final, rep = _run(m, pos, neg, lat, probe)
    cached, target = _moved_target(probe, final, rep)
    cfg = reuse.ReuseConfig(mode="joint", block_size=8, dilation=0, x0_threshold=1e9, context_margin_blocks=0,
                            refreshes=2, probe_context=True)
    out1, r1 = reuse.sample(m, pos, neg, lat, probe, _accept(target), cached, cfg, target_signature=target)
    out2, r2 = reuse.sample(m, pos, neg, lat, probe, _accept(target), cached, cfg, target_signature=target)
    assert r1.decision == r2.decision == "hit" and 0 < r1.active_fraction < 1 and not r1.fallbacks
    assert torch.equal(out1, out2)
    for key, (k, v) in probe.context_kv.items():
        assert torch.equal(k, before[key][0]) and torch.equal(v, before[key][1])
    # Reference: forget ownership before every write, so each call copies the record afresh (the former path).
    original = cp._context_attention

    def fresh_copy(run, *args, **kwargs):
        run.kv_owned.clear()
        return original(run, *args, **kwargs)

    cp._context_attention = fresh_copy
    try:
        out3, r3 = reuse.sample(m, pos, neg, lat, probe, _accept(target), cached, cfg, target_signature=target)
    finally:
        cp._context_attention = original
    assert r3.decision == "hit" and torch.equal(out1, out3)


def _token_counting(base, wrapper, state: dict):
    """``base`` cloned with ``wrapper`` around the diffusion model (it sets ``state["current"]`` to the call index
    of a call that reaches the blocks) and every block patched to record the largest token count it saw per call
    in ``state["tokens"]`` (a dense call computes every token)."""
    import comfy.patcher_extension

    def count_tokens(args, extra):
        i = state.get("current")
        state["tokens"][i] = max(state["tokens"].get(i, 0), int(args["img"].shape[1]))
        return extra["original_block"](args)

    m = base.clone()
    m.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "test-calls", wrapper)
    for i in range(len(m.model.diffusion_model.blocks)):
        m.set_model_patch_replace(count_tokens, "dit", "double_block", i)
    return m


def test_a_refresh_answered_in_front_of_the_blocks_moves_to_the_next_call(env):
    """A model patch in front of the transformer (ComfyUI's EasyCache is one) may answer a model call from its own
    cache without running any block. When it answers a planned refresh call, nothing is recorded there, so the
    next call that reaches the blocks must run densely and record instead; without such a patch every planned
    refresh (and only those) runs densely, as before."""
    from carnator.carnator_core import reuse

    tm, models = env
    base = models["wan21"]
    state = {"calls": 0, "skip": set(), "tokens": {}}

    def answer_some_calls(executor, *args, **kwargs):  # the shape of EasyCache's forward wrapper
        i = state["calls"]
        state["calls"] += 1
        x = args[0]
        if i in state["skip"]:
            return torch.zeros_like(x)
        state["current"] = i
        return executor(*args, **kwargs)

    m = _token_counting(base, answer_some_calls, state)
    probe, pos, neg, lat = _probe(m, tm, "wan21", seed=5, steps=10, k=2)
    final, rep = _run(m, pos, neg, lat, probe)
    cached, target = _moved_target(probe, final, rep)
    n_tokens = int(np.prod(probe.grid))
    cfg = reuse.ReuseConfig(mode="joint", block_size=8, dilation=0, x0_threshold=1e9, context_margin_blocks=0,
                            refreshes=3, probe_context=False)
    planned = sorted(reuse.refresh_plan_calls(10, 2, 3))  # sampler call indices (the probe's 2 calls first)
    assert planned == [2, 4, 7], planned

    def hit(skip: set[int]) -> dict[int, int]:
        # CFG runs cond and uncond in one model call here, so sampler call i is the i-th diffusion-model call.
        state.update(calls=0, skip=set(skip), tokens={}, current=None)
        out, r = reuse.sample(m, pos, neg, lat, probe, _accept(target), cached, cfg, target_signature=target)
        assert r.decision == "hit" and 0 < r.active_fraction < 1 and torch.isfinite(out).all()
        assert state["calls"] == 10 - 2  # the probe's calls are replayed, not run
        return {i + 2: state["tokens"][i] for i in sorted(state["tokens"])}

    plain = hit(set())
    assert [i for i, n in plain.items() if n == n_tokens] == planned, plain
    assert all(0 < n < n_tokens for i, n in plain.items() if i not in planned)
    answered = hit({4 - 2})  # the patch answers the second planned refresh (sampler call 4)
    assert 4 not in answered
    assert [i for i, n in answered.items() if n == n_tokens] == [2, 5, 7], answered


def test_refresh_at_runs_the_dense_refreshes_where_it_places_them(env):
    """A hit with ``refresh_at`` computes every token exactly at the first record and the placed calls, and only
    there; the same number of dense calls as the even spacing, so the same compute, but another clip."""
    from carnator.carnator_core import reuse

    tm, models = env
    state: dict = {"tokens": {}, "calls": 0}

    def count_calls(executor, *args, **kwargs):
        state["current"] = state["calls"]
        state["calls"] += 1
        return executor(*args, **kwargs)

    m = _token_counting(models["wan21"], count_calls, state)
    probe, pos, neg, lat = _probe(m, tm, "wan21", seed=5, steps=10, k=2)
    final, rep = _run(m, pos, neg, lat, probe)
    cached, target = _moved_target(probe, final, rep)
    n_tokens = int(np.prod(probe.grid))
    runs = {}
    for at in ("", "0.6,0.9"):
        cfg = reuse.ReuseConfig(mode="joint", block_size=8, dilation=0, x0_threshold=1e9, context_margin_blocks=0,
                                refreshes=3, refresh_at=at)
        state.update(tokens={}, calls=0)
        out, r = reuse.sample(m, pos, neg, lat, probe, _accept(target), cached, cfg, target_signature=target)
        assert r.decision == "hit" and 0 < r.active_fraction < 1 and not r.fallbacks
        dense = [i + 2 for i, n in sorted(state["tokens"].items()) if n == n_tokens]
        runs[at] = (out, r, dense)
    assert runs[""][2] == [2, 4, 7]
    assert runs["0.6,0.9"][2] == [2, 7, 9]  # 2 + round(0.6 * 8), 2 + min(7, round(0.9 * 8))
    assert runs[""][1].compute_fraction == pytest.approx(runs["0.6,0.9"][1].compute_fraction)
    assert not torch.equal(runs[""][0], runs["0.6,0.9"][0])


def test_probe_context_over_budget_keeps_nothing_and_the_hit_refreshes_densely(env):
    from carnator.carnator_core import reuse
    from carnator.carnator_core.probe import ProbeConfig, run_probe

    tm, models = env
    m = models["wan21"]
    node_probe, pos, neg, lat = _probe(m, tm, "wan21", seed=5, steps=10, k=2, context_kv_mb=64.0)
    kw = dict(seed=5, steps=10, cfg=5.0, sampler_name="euler", scheduler="simple", prompt="a red ball",
              objects=node_probe.objects, object_source="user")
    full = sum(k.numel() * k.element_size() * 2 for k, _ in node_probe.context_kv.values())
    for mb in (0.0, full / 2 ** 20 * 0.9):  # off, and a budget one block short of the whole record
        p = run_probe(m, pos, neg, lat, config=ProbeConfig(probe_steps=2, context_kv_mb=mb), **kw)
        assert dict(p.context_kv) == {}
        assert [torch.equal(a, b) for a, b in zip(p.replay, node_probe.replay)] == [True, True]
    final, rep = _run(m, pos, neg, lat, p)
    cached, target = _moved_target(p, final, rep)
    cfg = dict(mode="joint", block_size=8, dilation=0, x0_threshold=1e9, context_margin_blocks=0, refreshes=3)
    _, r_on = reuse.sample(m, pos, neg, lat, p, _accept(target), cached, reuse.ReuseConfig(**cfg, probe_context=True),
                           target_signature=target)
    _, r_off = reuse.sample(m, pos, neg, lat, p, _accept(target), cached,
                            reuse.ReuseConfig(**cfg, probe_context=False), target_signature=target)
    assert r_on.token_fraction == r_off.token_fraction  # nothing kept: the first reuse call is a dense refresh
    with pytest.raises(ValueError, match="context_kv_mb"):
        ProbeConfig(probe_steps=2, context_kv_mb=-1).resolve_steps(10)
    from carnator.carnator_core.reuse import RULE_CONTEXT_KV_MB
    from carnator.nodes.probe import CarnatorEarlyProbe

    # The node's default budget is the one rules certified with probe_context were labelled under: it keeps them.
    on = CarnatorEarlyProbe.execute(m, pos, neg, lat, 5, 10, 5.0, "euler", "simple", 2, "a red ball", None,
                                    tm.WordTokens(), "ball").args[0]
    assert on.context_kv_mb == RULE_CONTEXT_KV_MB and set(on.context_kv) == set(node_probe.context_kv)
    assert torch.equal(on.replay[-1], node_probe.replay[-1])


def test_reuse_settings_other_than_the_certified_ones_continue_dense_and_say_why(env):
    """A decision made under a rule that records its reuse settings is reused only with exactly those: other
    settings are not what the certificate covers, so the sampler continues dense (bit-identical to KSampler)."""
    import nodes as comfy_nodes
    from carnator.carnator_core import reuse

    tm, models = env
    m = models["wan21"]
    probe, pos, neg, lat = _probe(m, tm, "wan21", seed=5)
    final, rep = _run(m, pos, neg, lat, probe)
    sig = _signature(probe)
    cached = _cached(probe, {"samples": final}, rep)
    certified = reuse.ReuseConfig(mode="joint", block_size=8).to_meta()
    decision = dataclasses.replace(_accept(sig), reuse_config=certified)
    same = reuse.ReuseConfig(mode="joint", block_size=8)
    _, r_same = reuse.sample(m, pos, neg, lat, probe, decision, cached, same, target_signature=sig)
    assert r_same.decision == "hit"
    other = reuse.ReuseConfig(mode="joint", block_size=8, refreshes=2)
    out, r = reuse.sample(m, pos, neg, lat, probe, decision, cached, other, target_signature=sig)
    assert r.decision == "miss" and r.mode == "dense"
    assert "refreshes 2 (certified: 3)" in r.reason and "certified" in r.reason
    ref = comfy_nodes.common_ksampler(m, 5, 8, 5.0, "euler", "simple", pos, neg, lat)[0]["samples"]
    assert torch.equal(out, ref)


def test_a_certified_hit_reading_the_probes_keys_values_needs_a_probe_allowed_to_keep_them(env):
    """A rule certified with ``probe_context`` ran its hits on the probe's keys/values wherever they fit in
    ``RULE_CONTEXT_KV_MB`` (a dense refresh only where they do not). A probe told to keep none (context_kv_mb
    below that) would make the hit compute the other path, which nothing certified: the sampler continues dense,
    bit-identical to KSampler, and says how to fix it; with the budget the same decision is a hit on the probe's
    record (one dense refresh call fewer than the same settings without it)."""
    import nodes as comfy_nodes
    from carnator.carnator_core import reuse

    tm, models = env
    m = models["wan21"]
    kept, pos, neg, lat = _probe(m, tm, "wan21", seed=5, steps=10, k=2, context_kv_mb=reuse.RULE_CONTEXT_KV_MB)
    none, _, _, _ = _probe(m, tm, "wan21", seed=5, steps=10, k=2, context_kv_mb=0.0)
    assert kept.context_kv and not none.context_kv and none.context_kv_mb == 0.0
    final, rep = _run(m, pos, neg, lat, kept)
    cached, target = _moved_target(kept, final, rep)
    cfg = reuse.ReuseConfig(mode="joint", block_size=8, dilation=0, x0_threshold=1e9, context_margin_blocks=0,
                            refreshes=3, probe_context=True)
    decision = dataclasses.replace(_accept(target), reuse_config=cfg.to_meta())
    _, hit = reuse.sample(m, pos, neg, lat, kept, decision, cached, cfg, target_signature=target)
    assert hit.decision == "hit" and not hit.fallbacks, (hit.reason, hit.fallbacks)
    out, miss = reuse.sample(m, pos, neg, lat, none, decision, cached, cfg, target_signature=target)
    assert miss.decision == "miss" and miss.mode == "dense"
    assert "context_kv_mb 0 < 64" in miss.reason and "Early Probe" in miss.reason, miss.reason
    ref = comfy_nodes.common_ksampler(m, 5, 10, 5.0, "euler", "simple", pos, neg, lat)[0]["samples"]
    assert torch.equal(out, ref)
    # Without a rule's settings (custom reuse, no certificate to follow) the hit runs, refreshing densely.
    _, custom = reuse.sample(m, pos, neg, lat, none, _accept(target), cached, cfg, target_signature=target)
    assert custom.decision == "hit" and custom.token_fraction > hit.token_fraction


def test_the_signature_records_the_builder_settings_and_capture_layers_it_was_built_with(env):
    from carnator.carnator_core.request import signature_stage
    from carnator.carnator_core.signature import SignatureConfig
    from carnator.nodes.probe import CarnatorEarlyProbe

    tm, models = env
    m = models["wan21"]
    probe, pos, neg, lat = _probe(m, tm, "wan21", seed=5)
    assert probe.capture_layers == () and signature_stage(probe)[0].config == SignatureConfig().digest()
    cfg = SignatureConfig(smooth_sigma_hw=2.0)
    assert signature_stage(probe, cfg)[0].config == cfg.digest()
    one = CarnatorEarlyProbe.execute(m, pos, neg, lat, 5, 8, 5.0, "euler", "simple", 2, "a red ball", None,
                                     tm.WordTokens(), "ball", capture_layers="1").args[0]
    assert one.capture_layers == (1,) and signature_stage(one)[0].config == SignatureConfig().digest((1,))


def test_node_follows_the_rules_settings_unless_told_custom(env, comfy_dirs):
    """The Joint Reuse Sampler node's ``settings`` input: "certified" (default) reuses with the settings the
    decision's rule was certified with, whatever the tuning inputs say; "custom" uses the inputs, so a rule that
    certified other settings makes the hit continue dense (bit-identical to KSampler) with the reason."""
    import nodes as comfy_nodes
    from carnator.carnator_core.reuse import ReuseConfig
    from carnator.carnator_core.types import Candidate, Decision
    from carnator.nodes.cache import CarnatorCacheLoader, CarnatorCacheWriter
    from carnator.nodes.sampler import CarnatorJointReuseSampler

    tm, models = env
    m = models["wan21"]
    handle = CarnatorCacheLoader.execute(directory="certified").result[0]
    probe, pos, neg, lat = _probe(m, tm, "wan21", seed=5, context_kv_mb=64.0)
    sig = _signature(probe)
    first, report, _ = CarnatorJointReuseSampler.execute(m, pos, neg, lat, probe, None, None, handle, "joint").result
    entry = CarnatorCacheWriter.execute(cache=handle, probe=probe, signature=sig, latent=first,
                                        report=report).result[0]
    certified = ReuseConfig(refreshes=2, probe_context=True, block_size=8).to_meta()
    decision = Decision(True, Candidate(entry, 0.99, "a red ball", sig), (), "signature", summary="test accept",
                        reuse_config=certified)
    _, hit, _ = CarnatorJointReuseSampler.execute(m, pos, neg, lat, probe, decision, sig, handle, "joint").result
    assert hit.decision == "hit" and "certified:" not in hit.reason
    out, custom, _ = CarnatorJointReuseSampler.execute(m, pos, neg, lat, probe, decision, sig, handle, "joint",
                                                       settings="custom").result
    assert custom.decision == "miss" and "refreshes 3 (certified: 2)" in custom.reason
    ref = comfy_nodes.common_ksampler(m, 5, 8, 5.0, "euler", "simple", pos, neg, lat)[0]["samples"]
    assert torch.equal(out["samples"], ref)
    with pytest.raises(ValueError, match="settings must be one of"):
        CarnatorJointReuseSampler.execute(m, pos, neg, lat, probe, decision, sig, handle, "joint", settings="auto")
