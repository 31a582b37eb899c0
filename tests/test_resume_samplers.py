"""The resume contract over every sampler ComfyUI's KSampler offers.

For each name in ``comfy.samplers.KSampler.SAMPLERS`` a plain run (tiny random-weight Wan 2.1, few steps) is
observed from outside — does it call the model once per step, at the schedule's sigmas (the probe's "k steps"
and the reuse plan's step index rely on it), and does the sampler hook the post-CFG step — and the
sampler must then be exactly one of:

* resumable (listed in ``comfy_patch.RESUMABLE_SAMPLERS``): probe + dense resume equals plain sampling bit for
  bit, the probe's k calls are replayed and the resume makes exactly ``steps - k`` model calls; or
* refused by the probe with ``UnsupportedSamplerError``, a message that names the sampler, says why, and lists
  the samplers that work.

The list is checked against what the samplers do: a sampler with one on-schedule call per step and no hook
must be resumable (else the list is missing it), and one that is listed must behave as above (else the list
claims too much) — so a ComfyUI update that changes a sampler fails here instead of in a user's workflow.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.comfy

STEPS, K, SEED, CFG = 6, 2, 42, 5.0


@pytest.fixture(scope="module")
def env(comfy_env, tmp_path_factory):
    import tiny_models as tm

    return tm, tm.load_tiny_model("wan21", tmp_path_factory.mktemp("tiny"))


def _samplers() -> list[str]:
    """Every sampler name the host's KSampler offers (read at collection: the parameters are the host's list)."""
    from conftest import ensure_comfy_importable

    try:
        ensure_comfy_importable()
        import comfy.samplers
    except Exception as e:
        # No host: one case that then fails in the comfy_env fixture, rather than a collection error that would
        # stop every other test of the suite.
        return [f"<ComfyUI not importable: {type(e).__name__}>"]
    return list(comfy.samplers.KSampler.SAMPLERS)


def _plain_observed(tm, model, sampler: str) -> tuple[torch.Tensor, bool, bool]:
    """A plain KSampler run plus what it did: (latent, one model call per step at the schedule's sigmas, did the
    sampler add a post-CFG hook)."""
    import comfy.patcher_extension

    import nodes as comfy_nodes
    from carnator.carnator_core.comfy_patch import compute_sigmas

    seen = {"sigmas": [], "post_cfg": False}
    base_hooks = len(model.model_options.get("sampler_post_cfg_function", []))

    def count(executor, x, timestep, model_options={}, seed=None):
        seen["sigmas"].append(float(timestep.reshape(-1)[0]))
        seen["post_cfg"] |= len(model_options.get("sampler_post_cfg_function", [])) > base_hooks
        return executor(x, timestep, model_options, seed)

    m = model.clone()
    m.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.PREDICT_NOISE, "carnator-test-count", count)
    pos, neg = tm.conditioning("wan21")
    out = comfy_nodes.common_ksampler(m, SEED, STEPS, CFG, sampler, "simple", pos, neg, tm.empty_latent("wan21"),
                                      disable_noise=False)[0]["samples"]
    schedule = compute_sigmas(model, STEPS, sampler, "simple").tolist()[:STEPS]
    # The SDE samplers call the model at a first sigma a hair below the schedule's (0.99999 for 1.0 here).
    on_schedule = len(seen["sigmas"]) == STEPS and all(abs(a - b) <= 1e-4 * max(1.0, abs(b))
                                                       for a, b in zip(seen["sigmas"], schedule))
    return out, on_schedule, seen["post_cfg"]


def _probe(tm, model, sampler: str):
    from carnator.carnator_core.probe import ProbeConfig, run_probe

    pos, neg = tm.conditioning("wan21")
    return run_probe(model, pos, neg, tm.empty_latent("wan21"), seed=SEED, steps=STEPS, cfg=CFG,
                     sampler_name=sampler, scheduler="simple", prompt="x", objects=(), object_source="none",
                     config=ProbeConfig(probe_steps=K))


@pytest.mark.parametrize("sampler", _samplers())
def test_every_sampler_resumes_exactly_or_is_refused(env, sampler):
    from carnator.carnator_core import reuse
    from carnator.carnator_core.comfy_patch import RESUMABLE_SAMPLERS, UnsupportedSamplerError

    tm, model = env
    ref, one_call_per_step, post_cfg = _plain_observed(tm, model, sampler)
    if sampler not in RESUMABLE_SAMPLERS:
        assert not (one_call_per_step and not post_cfg), (
            f"{sampler} calls the model once per step, at the schedule's sigmas, and has no post-CFG hook: it "
            "should be resumable — add it to comfy_patch.RESUMABLE_SAMPLERS")
        with pytest.raises(UnsupportedSamplerError) as err:
            _probe(tm, model, sampler)
        msg = str(err.value)
        assert repr(sampler) in msg and "cannot be probed and resumed exactly" in msg and "euler" in msg
        return
    assert one_call_per_step, f"{sampler} does not call the model once per step at the schedule's sigmas; " \
                              "the probe's k means k steps of the schedule"
    assert not post_cfg, f"{sampler} keeps state through a post-CFG hook that a replayed call does not run"
    probe = _probe(tm, model, sampler)
    pos, neg = tm.conditioning("wan21")
    out, report = reuse.sample(model, pos, neg, tm.empty_latent("wan21"), probe, None, None,
                               reuse.ReuseConfig(mode="dense"))
    assert torch.equal(out, ref), f"{sampler}: probe + dense resume differs from plain, max diff " \
                                  f"{(out - ref).abs().max().item()}"
    assert report.replayed_calls == K and report.model_calls == STEPS - K


def test_refusal_says_why():
    from carnator.carnator_core.comfy_patch import UnsupportedSamplerError, check_sampler

    for name, why in (("heun", "more than once per step"), ("euler_cfg_pp", "post-CFG"),
                      ("dpm_adaptive", "more than once per step")):
        with pytest.raises(UnsupportedSamplerError, match=why):
            check_sampler(name)
