"""Plumbing of the generation-native judge on tiny random-weight Wan 2.1, Wan 2.2 TI2V, a Wan two-expert pair and
LTX-Video, loaded through ComfyUI's own detection: the calls go through the adapters and comfy_patch, cost one model
call per noise level, read each named object's cross-attention, leave the MODEL untouched, and hold a reuse clip
against the same-seed dense clip. (What the judge is worth is measured on the embedded model, not here: random
weights explain nothing.)"""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.comfy

PROMPT = "a red ball and a blue cube"
SOURCE = "a green ball and a blue cube"


@pytest.fixture(scope="module")
def env(comfy_env, tmp_path_factory):
    import tiny_models as tm

    d = tmp_path_factory.mktemp("tiny-judge")
    return tm, {name: tm.load_tiny_model(name, d) for name in tm.SPECS}


def _encode(tm, name):
    def encode(prompt: str):
        pos, _ = tm.conditioning(name, seed=1 + sum(prompt.encode()) % 1000)
        return pos
    return encode


def _generate(m, tm, name, prompt, seed=5, steps=4):
    import nodes as comfy_nodes

    neg = _encode(tm, name)("")
    return comfy_nodes.common_ksampler(m, seed, steps, 5.0, "euler", "simple", _encode(tm, name)(prompt), neg,
                                       tm.empty_latent(name), disable_noise=False)[0]["samples"]


def _decode(m, samples):
    """A preview decode through the model's latent_rgb_factors (what ComfyUI's previews use): [T, 2H, 2W, 3]."""
    from carnator.carnator_core.comfy_patch import latent_rgb

    f, b = latent_rgb(m)
    z = samples[0].float().numpy()  # [C, T, H, W]
    rgb = np.einsum("cthw,cr->thwr", z, f) + (b if b is not None else 0.0)
    rgb = np.clip((rgb + 1.0) / 2.0, 0, 1).repeat(2, axis=1).repeat(2, axis=2)
    return rgb.astype(np.float32)


def _judge(tm, name, m, **kw):
    from carnator.carnator_core.judge.native import NativeJudge

    return NativeJudge(m, _encode(tm, name), tm.WordTokens(), **kw)


@pytest.mark.parametrize("name", ["wan21", "wan22", "ltxv"])
def test_native_judge_plumbing(env, name):
    from carnator.carnator_core.judge import JudgeRequest, excess_label, judge_for
    from carnator.carnator_core.judge.native import NativeJudge, NativeReference

    tm, models = env
    m = models[name]
    before = (dict(m.model_options), dict(m.model_options.get("transformer_options", {})), len(m.patches))
    dense_lat, other_lat = _generate(m, tm, name, PROMPT), _generate(m, tm, name, SOURCE)
    dense, other = _decode(m, dense_lat), _decode(m, other_lat)
    j = judge_for(m, settings={"sigmas": [0.3, 0.5]}, encode=_encode(tm, name), text_encoder=tm.WordTokens())
    assert isinstance(j, NativeJudge)
    req = JudgeRequest(PROMPT, seed=5, source_prompt=SOURCE, extra={"latent": dense_lat, "reuse_latent": other_lat})
    with tm.count_calls(m) as calls:
        ref = j.reference(dense, req)
    assert len(calls) == 2 and ref.measures.model_calls == 2  # one CFG-batched call per noise level
    assert isinstance(ref, NativeReference) and ref.measures.alt == "source"
    assert set(ref.measures.objects) == {"ball", "cube"}
    for om in ref.measures.objects.values():
        assert 0.0 < om.presence <= 1.0 and 0.0 < om.size <= 1.0 and om.lab is not None
        assert all(0.0 <= c <= 1.0 for c in om.where)
    assert all(e > 0 for e in ref.measures.err_target + ref.measures.err_alt)
    # the same clip held against itself: every difference is zero, so it passes
    same = j.verdict_pair(ref.measures, j.measure(dense, JudgeRequest(PROMPT, seed=5, source_prompt=SOURCE,
                                                                     extra={"latent": dense_lat})))
    assert same.passed and all(abs(v) < 1e-9 for k, v in same.scores.items() if k.split(".")[-1].startswith("d_"))
    # another clip: the differences are measured (random weights: no claim about the verdict)
    lab = excess_label(j, other, dense, req, ref=ref)
    assert lab.dense is ref.verdict and lab.judge == "native"
    assert abs(lab.reuse.scores["d_error"]) > 0 and lab.reuse.scores["ball.d_colour"] > 0
    after = (dict(m.model_options), dict(m.model_options.get("transformer_options", {})), len(m.patches))
    assert after == before  # the caller's MODEL is untouched
    with pytest.raises(ValueError, match="latent"):
        j.measure(dense, JudgeRequest(PROMPT, seed=5))
    # no decoded clip (no VAE at hand): the same model readings from the latent alone, no colours
    bare = j.measure(None, JudgeRequest(PROMPT, seed=5, source_prompt=SOURCE, extra={"latent": dense_lat}))
    assert bare.err_target == ref.measures.err_target and bare.objects["ball"].lab is None
    assert bare.objects["ball"].local == ref.measures.objects["ball"].local
    assert excess_label(j, None, None, req).reuse.scores["d_margin"] == lab.reuse.scores["d_margin"]


def test_native_judge_two_experts_run_each_level_on_its_expert(env, tmp_path_factory):
    import tiny_models as tm

    from carnator.carnator_core.judge import JudgeRequest
    from carnator.carnator_core.judge.native import NativeSettings

    high = tm.load_tiny_model("wan21", tmp_path_factory.mktemp("hi"), seed=11)
    low = tm.load_tiny_model("wan21", tmp_path_factory.mktemp("lo"), seed=12)
    lat = _generate(low, tm, "wan21", PROMPT)
    clip = _decode(low, lat)
    req = JudgeRequest(PROMPT, seed=5, extra={"latent": lat})
    j = _judge(tm, "wan21", high, second_model=low, switch_sigma=0.4, settings=NativeSettings(sigmas=(0.2, 0.3, 0.6)))
    with tm.count_calls(high) as hi_calls, tm.count_calls(low) as lo_calls:
        two = j.measure(clip, req)
    assert (len(hi_calls), len(lo_calls)) == (1, 2)
    # the levels below the switch are the low-noise expert's own: the same numbers as a judge on it alone
    only_low = _judge(tm, "wan21", low, settings=NativeSettings(sigmas=(0.2, 0.3))).measure(clip, req)
    assert two.err_target[:2] == only_low.err_target and two.err_alt[:2] == only_low.err_alt
    with pytest.raises(ValueError, match="switch_sigma"):
        _judge(tm, "wan21", high, second_model=low)


def test_native_judge_costs_under_a_third_of_a_dense_run(env):
    """Model calls per label (the dense clip's reference + one reuse clip) against a dense run of the same request:
    the native judge's default (2 levels) is 4 calls of batch 2; a 20-step CFG run is 20 of batch 2."""
    from carnator.carnator_core.judge import JudgeRequest, excess_label

    tm, models = env
    m = models["wan21"]
    with tm.count_calls(m) as dense_calls:
        lat = _generate(m, tm, "wan21", PROMPT, steps=20)
    clip = _decode(m, lat)
    req = JudgeRequest(PROMPT, seed=5, source_prompt=SOURCE, extra={"latent": lat, "reuse_latent": lat})
    with tm.count_calls(m) as judge_calls:
        excess_label(_judge(tm, "wan21", m), clip, clip, req)
    assert len(dense_calls) == 20 and len(judge_calls) <= 0.3 * len(dense_calls)


def test_native_settings_refuse_bad_values():
    from carnator.carnator_core.judge.native import NativeSettings

    with pytest.raises(ValueError, match="sigmas"):
        NativeSettings(sigmas=(0.0, 0.5))
    with pytest.raises(ValueError, match="support_mass"):
        NativeSettings(support_mass=1.5)
    with pytest.raises(ValueError, match="unknown native-judge thresholds"):
        NativeSettings(thresholds={"d_colr": 3.0})
