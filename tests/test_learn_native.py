"""Learning mode labels a real-architecture model (tiny random-weight Wan 2.1 / LTX-Video from ComfyUI's own
classes) with the generation-native judge on the served latents: no VAE, only the text encoder the Early Probe was
given. Plumbing only: random weights explain nothing, so which way a label goes is not asserted; what is pinned is
that a label is made, by which judge, at what model-call cost, and that the model is left untouched; and the clear
reasons when nothing can be labelled."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.comfy

PROMPT = "a red ball and a blue cube"
SOURCE = "a green ball and a blue cube"
STEPS = 10


@pytest.fixture(scope="module")
def env(comfy_env, tmp_path_factory):
    import tiny_models as tm

    d = tmp_path_factory.mktemp("tiny-learn-native")
    return tm, {name: tm.load_tiny_model(name, d) for name in ("wan21", "ltxv")}


def _encoder(tm, name):
    """The tiny models' text encoder stand-in: word token positions (the probe's hook) plus ``encode(text)``, the
    embedded-style API that ``learn.runtime.text_encode_fn`` accepts besides a ComfyUI CLIP."""
    class Encoder(tm.WordTokens):
        def encode(self, prompt: str):
            pos, _ = tm.conditioning(name, seed=1 + sum(prompt.encode()) % 1000)
            return pos

    return Encoder()


def _probe(tm, name, text_encoder, split=False):
    return SimpleNamespace(prompt=PROMPT, seed=5, model_fingerprint=f"tiny-{name}", text_encoder=text_encoder,
                           config=SimpleNamespace(split=split))


def _generate(tm, name, m, enc, prompt):
    import nodes as comfy_nodes

    return comfy_nodes.common_ksampler(m, 5, STEPS, 5.0, "euler", "simple", enc.encode(prompt), enc.encode(""),
                                       tm.empty_latent(name), disable_noise=False)[0]["samples"]


@pytest.mark.parametrize("name", ["wan21", "ltxv"])
def test_a_served_request_is_labelled_by_the_native_judge_on_its_latents(env, name):
    from carnator.carnator_core.judge.native import NativeJudge
    from carnator.carnator_core.learn.runtime import judge_and_decoder, label_counterfactual

    tm, models = env
    m = models[name]
    enc = _encoder(tm, name)
    before = (dict(m.model_options), dict(m.model_options.get("transformer_options", {})), len(m.patches))
    dense, reuse = _generate(tm, name, m, enc, PROMPT), _generate(tm, name, m, enc, SOURCE)
    judge, decode, why_not = judge_and_decoder(m, _probe(tm, name, enc))
    assert why_not == "" and isinstance(judge, NativeJudge), why_not
    with tm.count_calls(m) as calls:
        lab = label_counterfactual(judge, decode, _probe(tm, name, enc), SOURCE, dense, reuse)
    assert lab.judge == judge.name and not (lab.b and lab.c)
    # the reuse clip was held against the dense clip's quantities (judge_pair), object by object
    assert {"d_margin", "margin"} <= set(lab.reuse.scores), lab.reuse.scores
    assert set(lab.reuse.per_object) == {"ball", "cube"}, lab.reuse.per_object
    # the dense clip and the reuse clip: one batched call per noise level each — a label costs well under a dense run
    levels = len(judge.config.sigmas)
    assert len(calls) == 2 * levels and len(calls) <= 0.3 * 2 * STEPS
    after = (dict(m.model_options), dict(m.model_options.get("transformer_options", {})), len(m.patches))
    assert after == before


def test_no_label_without_a_text_encoder_or_for_a_split_stage_and_the_reason_says_what_to_do(env):
    from carnator.carnator_core.learn.runtime import judge_and_decoder, text_encode_fn

    tm, models = env
    judge, decode, why_not = judge_and_decoder(models["wan21"], _probe(tm, "wan21", None))
    assert judge is None and "connect the CLIP to the Early Probe" in why_not
    judge, _, why_not = judge_and_decoder(models["wan21"], _probe(tm, "wan21", _encoder(tm, "wan21"), split=True))
    assert judge is None and "two-expert" in why_not
    assert text_encode_fn(None) is None and text_encode_fn(object()) is None
