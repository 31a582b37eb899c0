"""The judge interface's pixel judges: the embedded checker as a judge, the tolerance judge, the pairs machinery's
labelers as / with judges, and the default-judge factory. Clips are rendered from the embedded world (ground
truth), so every verdict here is known in advance."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from carnator.carnator_core.embedded import world
from carnator.carnator_core.judge import CheckerJudge, JudgeRequest, ToleranceJudge, excess_label, judge_for
from carnator.carnator_core.judge.checker import verdict_of

SCENE = world.Scene((world.ObjectSpec("ball", "red", "big", "top left", "right"),
                     world.ObjectSpec("cube", "blue", "small", "bottom right", "still")), "grass")
CAPTION = "a big red ball moves to the right in the top left and a small blue cube sits still in the bottom right, " \
          "on green grass"


def _render(scene):
    return world.render(scene)[0]


def _edited(**first):
    return replace(SCENE, objects=(replace(SCENE.objects[0], **first), SCENE.objects[1]))


def test_caption_reads_as_the_scene():
    assert world.parse_caption(CAPTION) == SCENE


def test_checker_judge_passes_the_truth_and_names_what_is_wrong():
    j = CheckerJudge()
    req = JudgeRequest(CAPTION)
    ok = j.judge(_render(SCENE), req)
    assert ok.passed and ok.per_object == {"ball": True, "cube": True} and ok.scene is True and not ok.reasons
    bad = j.judge(_render(_edited(colour="yellow")), req)
    assert not bad.passed and bad.per_object == {"ball": False, "cube": True}
    assert any(r.startswith("ball: colour yellow, expected red") for r in bad.reasons), bad.reasons
    moved = j.judge(_render(_edited(position="bottom left")), req)
    assert not moved.passed and any("position bottom left, expected top left" in r for r in moved.reasons)
    still = j.judge(_render(_edited(motion="still")), req)
    assert not still.passed and any("motion still, expected right" in r for r in still.reasons)
    night = j.judge(_render(replace(SCENE, background="sand")), req)
    assert not night.passed and night.scene is False and any(r.startswith("scene: background") for r in night.reasons)
    # the request's own object names are used when given
    named = j.judge(_render(SCENE), JudgeRequest(CAPTION, objects=("orb", "box")))
    assert set(named.per_object) == {"orb", "box"}


def test_checker_judge_reads_the_checker_result_generically():
    """A field the checker adds (``<name>_ok``) reaches the verdict without a change to the judge."""
    from dataclasses import dataclass

    from carnator.carnator_core.embedded import checker

    res = checker.check(_render(SCENE), CAPTION)

    @dataclass(frozen=True)
    class Extended(checker.CheckResult):
        blur_ok: bool | None = False

        @property
        def all_ok(self) -> bool:
            return super().all_ok and self.blur_ok is not False

    ext = Extended(res.objects, res.background, res.background_ok, res.masks)
    v = verdict_of(ext)
    assert not v.passed and v.scene is False and "scene: blur fails" in v.reasons


def test_excess_label_with_the_checker_judge_b_and_c():
    j = CheckerJudge()
    req = JudgeRequest(CAPTION)
    good, bad = _render(SCENE), _render(_edited(colour="yellow"))
    b = excess_label(j, bad, good, req)
    assert b.b and not b.c and b.judge == "embedded-checker"
    c = excess_label(j, good, bad, req)
    assert c.c and not c.b
    same = excess_label(j, bad, bad, req)
    assert not same.b and not same.c


def _with_background_noise(clip, seed=0, amp=0.06):
    """Speckle on the background only (what a reuse artifact looks like to the artifact score)."""
    from carnator.carnator_core.judge.pixels import background_mask

    rng = np.random.default_rng(seed)
    bg = background_mask(clip, CAPTION)[..., None]
    noisy = clip + bg * rng.normal(0, amp, clip.shape).astype(np.float32)
    return np.clip(noisy, 0, 1).astype(np.float32)


def test_checker_judge_artifact_ratio_in_judge_pair():
    dense = _render(SCENE)
    noisy = _with_background_noise(dense)
    req = JudgeRequest(CAPTION)
    assert CheckerJudge().judge(noisy, req).passed  # the attributes survive the noise
    lab = excess_label(CheckerJudge(artifact_ratio=2.0), noisy, dense, req)
    assert lab.b and any("background artifacts" in r for r in lab.reuse.reasons)
    assert not excess_label(CheckerJudge(artifact_ratio=2.0), dense, dense, req).b
    with pytest.raises(ValueError, match="artifact_ratio"):
        CheckerJudge(artifact_ratio=-1.0)


@pytest.mark.parametrize("ratio,version", [(None, 1), (2.0, 1), (2.0, 2)])
def test_judge_labeler_equals_the_checker_labeler(ratio, version):
    """The pairs machinery labels alike through the old request-level CheckerLabeler and through the checker judge
    (so pair files labelled either way mean the same)."""
    from carnator.carnator_core.lab import metrics
    from carnator.carnator_core.lab.pairs import JudgeLabeler, embedded_checker_labeler, judge_against_dense

    old = embedded_checker_labeler("request", ratio, version=version)
    new = JudgeLabeler(old.as_judge())
    assert isinstance(old.as_judge(), CheckerJudge) and old.as_judge().artifact_ratio == ratio
    assert old.as_judge().strict == (version == 2)
    dense_variants = [_render(SCENE), _render(_edited(colour="yellow"))]
    reuse_variants = dense_variants + [_render(_edited(motion="still")), _with_background_noise(_render(SCENE)),
                                       _render(replace(SCENE, background="sand")), _render(_edited(shape="cube"))]
    seen = set()
    for dense in dense_variants:
        bg = metrics.background_mask(dense, CAPTION)
        ref_old, ref_new = old.reference(dense, CAPTION), new.reference(dense, CAPTION)
        for reuse in reuse_variants:
            u_old, d_old, _ = judge_against_dense(old, ref_old, reuse, dense, CAPTION, bg)
            u_new, d_new, _ = judge_against_dense(new, ref_new, reuse, dense, CAPTION, bg)
            assert (u_old, d_old["better"]) == (u_new, d_new["better"])
            seen.add((u_new, d_new["better"]))
    assert {(True, False), (False, True), (False, False)} <= seen
    assert "embedded-checker" in new.definition


def test_tolerance_judge_equals_the_tolerance_labeler():
    from carnator.carnator_core.lab.pairs import ToleranceLabeler

    dense = _render(SCENE)
    for metric, threshold in (("psnr", 25.0), ("ssim", 0.9)):
        old = ToleranceLabeler(metric, threshold)
        j = old.as_judge()
        assert isinstance(j, ToleranceJudge)
        for amp in (0.0, 0.02, 0.2):
            reuse = _with_background_noise(dense, amp=amp) if amp else dense
            unsafe, _ = old.label(old.reference(dense, CAPTION), reuse, CAPTION)
            assert excess_label(j, reuse, dense, JudgeRequest(CAPTION)).b == unsafe
    with pytest.raises(ValueError, match="psnr"):
        ToleranceJudge("lpips")


def test_judge_for_picks_and_refuses():
    assert isinstance(judge_for(None, "embedded"), CheckerJudge)
    assert judge_for(None, "embedded", {"artifact_ratio": 1.5}).settings["artifact_ratio"] == 1.5
    assert isinstance(judge_for(None, "wan21", {"judge": "tolerance", "threshold": 30}), ToleranceJudge)
    with pytest.raises(ValueError, match="needs encode"):
        judge_for(None, "wan21")
    with pytest.raises(ValueError, match="only the embedded"):
        judge_for(None, "ltxv", {"judge": "checker"})
    with pytest.raises(ValueError, match="unknown native-judge settings"):
        judge_for(None, "wan21", {"sigma": 0.3}, encode=lambda p: p)
    with pytest.raises(ValueError, match="unknown judge"):
        judge_for(None, "wan21", {"judge": "oracle"})
    with pytest.raises(ValueError, match="needs settings\\['weights'\\]"):
        judge_for(None, "wan21", {"judge": "detector"})


def test_judge_for_optional_judge_without_weights_says_so(tmp_path):
    from carnator.carnator_core.judge.optional import OptionalJudgeUnavailable

    with pytest.raises(OptionalJudgeUnavailable, match="never downloads"):
        judge_for(None, "wan21", {"judge": "alignment", "weights": "siglip-base", "models_dir": str(tmp_path)})
