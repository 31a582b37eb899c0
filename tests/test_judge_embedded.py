"""The native judge on the embedded model, where the truth is known: a clip that carries another scene (the same seed's
dense clip of an edited caption) fails with the edited object (or the scene) named, while the request's own dense
clip and a fresh seed's dense clip pass; the excess label holds it against the dense clip. Three generations, twelve
judge calls."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.comfy

TARGET = "a big red ball moves to the right in the top left and a small blue cube sits still in the bottom right, " \
         "on green grass"
STILL = TARGET.replace("moves to the right", "sits still")  # a motion edit reused from a still scene
SAND = TARGET.replace("on green grass", "on a sandy beach")


@pytest.fixture(scope="module")
def env(comfy_env):
    from carnator.carnator_core.embedded import codec, comfy_glue
    from carnator.carnator_core.judge.native import NativeJudge

    model, enc, _ = comfy_glue.load_embedded()
    clips = {p: comfy_glue.generate([p], seed=3, model=model).clips[0].numpy() for p in (TARGET, STILL, SAND)}
    fresh = comfy_glue.generate([TARGET], seed=4, model=model).clips[0].numpy()
    judge = NativeJudge(model, enc.encode, enc, vae_encode=lambda c: codec.rgb_to_latent(c)[None])
    return judge, clips, fresh


def test_native_judge_names_what_a_wrong_scene_clip_carries(env):
    from carnator.carnator_core.judge import CheckerJudge, JudgeRequest, excess_label

    judge, clips, fresh = env
    dense = clips[TARGET]
    assert CheckerJudge().judge(dense, JudgeRequest(TARGET)).passed  # the request's dense clip is right
    still = excess_label(judge, clips[STILL], dense, JudgeRequest(TARGET, seed=3, source_prompt=STILL))
    assert still.b and still.reuse.per_object == {"ball": False, "cube": True}, still.reuse.reasons
    assert still.reuse.scene is True
    sand = excess_label(judge, clips[SAND], dense, JudgeRequest(TARGET, seed=3, source_prompt=SAND))
    assert sand.b and sand.reuse.scene is False and all(sand.reuse.per_object.values()), sand.reuse.reasons
    # a legitimate difference: the same request at another seed, held against this seed's dense clip
    again = excess_label(judge, fresh, dense, JudgeRequest(TARGET, seed=3))
    assert not again.b and again.reuse.passed, again.reuse.reasons
    itself = excess_label(judge, dense, dense, JudgeRequest(TARGET, seed=3, source_prompt=STILL))
    assert not itself.b and itself.reuse.scores["d_margin"] == 0.0
