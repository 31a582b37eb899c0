"""Contracts of the Early Probe: probe + dense resume equals plain sampling; the MODEL is
untouched; bad input gets a clear error. Runs on tiny random-weight Wan 2.1 / Wan 2.2 TI2V / LTXV models loaded
through ComfyUI's own detection."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.comfy


@pytest.fixture(scope="module")
def env(comfy_env, tmp_path_factory):
    import tiny_models as tm

    d = tmp_path_factory.mktemp("tiny")
    return tm, {name: tm.load_tiny_model(name, d) for name in tm.SPECS}, d


def _plain(m, tm, name, sampler, steps=6, seed=42, cfg=5.0):
    import nodes as comfy_nodes

    pos, neg = tm.conditioning(name)
    return comfy_nodes.common_ksampler(m, seed, steps, cfg, sampler, "simple", pos, neg, tm.empty_latent(name),
                                       disable_noise=False)[0]["samples"]


def _probe_resume(m, tm, name, sampler, k=2, steps=6, seed=42, cfg=5.0):
    from carnator.carnator_core import reuse
    from carnator.carnator_core.probe import ProbeConfig, run_probe
    from carnator.carnator_core.types import ObjectTokens

    pos, neg = tm.conditioning(name)
    probe = run_probe(m, pos, neg, tm.empty_latent(name), seed=seed, steps=steps, cfg=cfg, sampler_name=sampler,
                      scheduler="simple", prompt="a red ball", objects=(ObjectTokens("ball", ("red", "ball"), (1, 2)),),
                      object_source="user", config=ProbeConfig(probe_steps=k))
    out, report = reuse.sample(m, pos, neg, tm.empty_latent(name), probe, None, None, reuse.ReuseConfig(mode="dense"))
    return probe, out, report


@pytest.mark.parametrize("name,sampler", [("wan21", "euler"), ("wan21", "dpmpp_2m"), ("wan21", "uni_pc"),
                                          ("wan22", "euler"), ("wan22", "dpmpp_2m"), ("ltxv", "euler"),
                                          ("ltxv", "dpmpp_2m")])
def test_probe_plus_dense_resume_equals_plain_ksampler(env, name, sampler):
    tm, models, _ = env
    m = models[name]
    ref = _plain(m, tm, name, sampler)
    probe, out, report = _probe_resume(m, tm, name, sampler)
    assert torch.equal(out, ref), f"max diff {(out - ref).abs().max().item()}"
    # the probe's k calls were replayed, not recomputed: a miss costs no extra model calls
    assert report.replayed_calls == 2 and report.model_calls == 6 - 2
    assert probe.grid == tm_grid(tm, name) and probe.object_maps["ball"].shape == probe.grid
    assert probe.object_maps["ball"].sum() > 0


def tm_grid(tm, name):
    c, t, h, w = tm.SPECS[name].latent_shape
    return (t, h // 2, w // 2) if name != "ltxv" else (t, h, w)


def test_model_untouched_after_probe_and_resume(env):
    tm, models, _ = env
    m = models["wan21"]
    before_opts = repr(sorted(m.model_options.get("transformer_options", {}).keys()))
    before_wrappers = repr(m.wrappers)
    before = _plain(m, tm, "wan21", "euler", seed=7)
    _probe_resume(m, tm, "wan21", "euler", seed=3)
    after = _plain(m, tm, "wan21", "euler", seed=7)
    assert torch.equal(before, after)
    assert repr(sorted(m.model_options.get("transformer_options", {}).keys())) == before_opts
    assert repr(m.wrappers) == before_wrappers
    assert "patches_replace" not in m.model_options.get("transformer_options", {})


def test_probe_steps_must_be_fewer_than_steps(env):
    from carnator.carnator_core.probe import ProbeConfig, ProbeConfigError, run_probe

    tm, models, _ = env
    pos, neg = tm.conditioning("wan21")
    with pytest.raises(ProbeConfigError, match=r"probe steps \(6\) must be fewer than the total steps \(6\)"):
        run_probe(models["wan21"], pos, neg, tm.empty_latent("wan21"), seed=1, steps=6, cfg=5.0,
                  sampler_name="euler", scheduler="simple", prompt="x", objects=(), object_source="none",
                  config=ProbeConfig(probe_steps=6))


def test_two_call_sampler_is_refused_clearly(env):
    from carnator.carnator_core.comfy_patch import UnsupportedSamplerError
    from carnator.carnator_core.probe import ProbeConfig, run_probe

    tm, models, _ = env
    pos, neg = tm.conditioning("wan21")
    with pytest.raises(UnsupportedSamplerError, match="heun.*cannot be probed and resumed exactly"):
        run_probe(models["wan21"], pos, neg, tm.empty_latent("wan21"), seed=1, steps=6, cfg=5.0,
                  sampler_name="heun", scheduler="simple", prompt="x", objects=(), object_source="none",
                  config=ProbeConfig(probe_steps=2))


def test_non_t2v_model_is_refused_clearly(env, tmp_path):
    import comfy.ops
    import comfy.sd
    from comfy.ldm.wan.model import WanModel
    from safetensors.torch import save_file

    from carnator.carnator_core.adapters import UnsupportedModelError
    from carnator.carnator_core.probe import ProbeConfig, run_probe

    tm, _, _ = env
    model = WanModel(model_type="i2v", in_dim=36, dim=256, ffn_dim=256, num_heads=2, num_layers=1,
                     operations=comfy.ops.manual_cast)
    path = tmp_path / "tiny_i2v.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    m = comfy.sd.load_diffusion_model(str(path))
    pos, neg = tm.conditioning("wan21")
    with pytest.raises(UnsupportedModelError, match="Wan text-to-video"):
        run_probe(m, pos, neg, tm.empty_latent("wan21"), seed=1, steps=6, cfg=5.0, sampler_name="euler",
                  scheduler="simple", prompt="x", objects=(), object_source="none", config=ProbeConfig(probe_steps=2))


def test_image_latent_is_refused_clearly(env):
    from carnator.carnator_core.probe import ProbeConfig, ProbeConfigError, run_probe

    tm, models, _ = env
    pos, neg = tm.conditioning("wan21")
    with pytest.raises(ProbeConfigError, match=r"needs \[B, C, T, H, W\]"):
        run_probe(models["wan21"], pos, neg, {"samples": torch.zeros(1, 16, 8, 8)}, seed=1, steps=6, cfg=5.0,
                  sampler_name="euler", scheduler="simple", prompt="x", objects=(), object_source="none",
                  config=ProbeConfig(probe_steps=2))


def test_probe_length_by_sigma_follows_the_schedule(env):
    from carnator.carnator_core.comfy_patch import compute_sigmas
    from carnator.carnator_core.probe import ProbeConfig, ProbeConfigError

    tm, models, _ = env
    sig = compute_sigmas(models["wan21"], 10, "euler", "simple").tolist()
    k = ProbeConfig(probe_sigma=0.9).resolve_steps(10, sig)
    assert sig[k] <= 0.9 < sig[k - 1]
    with pytest.raises(ProbeConfigError, match="no step of this schedule reaches"):
        ProbeConfig(probe_sigma=1e-9).resolve_steps(10, sig)
