"""The second label: the checker sees shape and the per-frame motion track; the detail check sees blur, object
interiors and ghost objects.

Hand-built clips in the v3 geometry (8 frames, 48 x 48): for each new check, a reuse clip the first label passes and
the second fails, and controls that both pass (the dense clip itself, a re-noised copy, every world scene's own
render).
"""
from __future__ import annotations

import numpy as np
import pytest
from scipy import ndimage

from carnator.carnator_core.embedded import checker, world
from carnator.carnator_core.lab import metrics, pairs

FRAME = world.Frame(frames=8, height=48, width=48)
PROMPT_RIGHT = "a big red ball moves to the right in the center, on green grass"
PROMPT_STILL = "a big red ball sits still in the center, on green grass"
NOISE = 0.03  # the same fixed texture on every clip of a test, so the background score has something to compare


def _texture(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, NOISE, (FRAME.frames, FRAME.height, FRAME.width, 3))


def _paint(centres: np.ndarray, shape: str = "ball", colour: str = "red", r: float = 7.0,
           background: str = "grass") -> np.ndarray:
    """A clip with one object of ``shape`` whose area centroid is at ``centres[t]`` in frame t."""
    bg = world.background_image(background, FRAME)
    out = np.broadcast_to(bg, (FRAME.frames, FRAME.height, FRAME.width, 3)).copy()
    col = np.asarray(world.PALETTE[colour], np.float32)
    for t, (cx, cy) in enumerate(centres):
        m = checker.silhouette(shape, float(cx), float(cy), r, FRAME.height, FRAME.width)
        out[t][m] = col
    return np.clip(out + _texture(), 0.0, 1.0).astype(np.float32)


def _straight(x0: float, x1: float, y: float = 24.0) -> np.ndarray:
    xs = np.linspace(x0, x1, FRAME.frames)
    return np.stack([xs, np.full_like(xs, y)], 1)


DENSE_RIGHT = _paint(_straight(20.0, 28.0))
DENSE_STILL = _paint(_straight(24.0, 24.0))


def _label(version: int, dense: np.ndarray, reuse: np.ndarray, prompt: str) -> tuple[bool, dict]:
    lab = pairs.embedded_checker_labeler("request", 1.25, version=version)
    bg = metrics.background_mask(dense, prompt)
    unsafe, diag, _ = pairs.judge_against_dense(lab, lab.reference(dense, prompt), reuse, dense, prompt, bg)
    return unsafe, diag


def _old_passes_new_fails(dense: np.ndarray, reuse: np.ndarray, prompt: str) -> dict:
    old, old_diag = _label(1, dense, reuse, prompt)
    new, new_diag = _label(2, dense, reuse, prompt)
    assert not _label(2, dense, dense, prompt)[0], "control: the dense clip must pass against itself"
    assert not old, f"the first label should pass this clip: {old_diag}"
    assert new, f"the second label should fail this clip: {new_diag}"
    return new_diag


def test_dense_renders_pass_both_labels():
    for d, p in ((DENSE_RIGHT, PROMPT_RIGHT), (DENSE_STILL, PROMPT_STILL)):
        assert checker.check(d, p, strict=True).all_ok
        assert checker.check(d, p).all_ok
        # a copy with other noise of the same strength: as good as dense, passes the second label
        other = np.clip(d - _texture() + _texture(7), 0, 1).astype(np.float32)
        unsafe, diag = _label(2, d, other, p)
        assert not unsafe and not diag["detail_failed"], diag


def test_every_world_scene_render_passes_the_strict_checker():
    rng = np.random.default_rng(3)
    for _ in range(40):
        scene = world.sample_scene(rng, frame=FRAME)
        clip, _ = world.render(scene, FRAME)
        res = checker.check(clip, scene, strict=True)
        assert res.all_ok, [(o.expected, o.measured.get("shape"), o.measured.get("track_motion")) for o in res.objects]


def test_shape_is_checked():
    # a diamond inside the ball's footprint: colour, size, position and motion as named; only the shape is wrong
    reuse = _paint(_straight(20.0, 28.0), shape="diamond")
    diag = _old_passes_new_fails(DENSE_RIGHT, reuse, PROMPT_RIGHT)
    assert diag["reuse_failed"] == ["o0.shape"]
    for shape in world.SHAPES:  # and each shape is read as itself
        clip = _paint(_straight(20.0, 28.0), shape=shape)
        assert checker.check(clip, PROMPT_RIGHT.replace("ball", shape), strict=True).objects[0].shape_ok


def test_motion_is_read_from_the_track_not_the_net_shift():
    # still for six frames, then a jump: the first/last-two-frames shift says "right", the track does not
    jump = np.array([[22.0, 24.0]] * 6 + [[30.0, 24.0]] * 2)
    diag = _old_passes_new_fails(DENSE_RIGHT, _paint(jump), PROMPT_RIGHT)
    assert diag["reuse_failed"] == ["o0.motion"]
    # three times the world's speed (the first label also fails it here, by the background score of the path)
    assert checker.check(_paint(_straight(12.0, 36.0)), PROMPT_RIGHT, strict=True).objects[0].motion_ok is False
    assert checker.check(_paint(_straight(12.0, 36.0)), PROMPT_RIGHT).objects[0].motion_ok is True
    # "still", but the object shakes left and right: no net shift, yet it is not still
    shake = np.stack([24.0 + 3.0 * (-1.0) ** np.arange(FRAME.frames), np.full(FRAME.frames, 24.0)], 1)
    diag = _old_passes_new_fails(DENSE_STILL, _paint(shake), PROMPT_STILL)
    assert diag["reuse_failed"] == ["o0.motion"]


def test_track_reads_each_direction_and_still():
    cases = {"right": _straight(20, 28), "left": _straight(28, 20), "still": _straight(24, 24),
             "down": np.stack([np.full(8, 24.0), np.linspace(20, 28, 8)], 1),
             "up": np.stack([np.full(8, 24.0), np.linspace(28, 20, 8)], 1)}
    for motion, cents in cases.items():
        assert checker.track_motion([tuple(c) for c in cents])["track_motion"] == motion
    # a frame where the object was not found does not break the track
    cents = [tuple(c) for c in _straight(20, 28)]
    cents[3] = None
    assert checker.track_motion(cents)["track_motion"] == "right"


def test_blur_is_seen():
    blurred = ndimage.gaussian_filter(DENSE_RIGHT - _texture(), sigma=(0, 1.6, 1.6, 0)) + _texture()
    blurred = np.clip(blurred, 0, 1).astype(np.float32)
    diag = _old_passes_new_fails(DENSE_RIGHT, blurred, PROMPT_RIGHT)
    assert diag["detail_failed"] == ["blur"] and diag["reuse_failed"] == []


def test_object_interiors_are_seen():
    masks, _, _ = checker.object_masks(DENSE_RIGHT, world.parse_caption(PROMPT_RIGHT))
    inner = ndimage.binary_erosion(masks[0], structure=np.ones((1, 3, 3), bool), iterations=2)
    board = ((np.indices(DENSE_RIGHT.shape[1:3]) // 2).sum(0) % 2)[None] * 0.24 - 0.12  # 2-px checkerboard
    reuse = DENSE_RIGHT.copy()
    reuse[inner] = np.clip(reuse[inner] + np.broadcast_to(board, inner.shape)[inner][:, None], 0, 1)
    diag = _old_passes_new_fails(DENSE_RIGHT, reuse, PROMPT_RIGHT)
    assert diag["detail_failed"] == ["interior"] and diag["reuse_failed"] == []


def test_small_ghost_objects_are_seen():
    ghost = checker.silhouette("ball", 8.0, 8.0, 3.0, FRAME.height, FRAME.width).astype(np.float32)
    ghost = ndimage.gaussian_filter(ghost, 0.7)[None, :, :, None] * 0.6
    reuse = DENSE_RIGHT * (1 - ghost) + np.asarray(world.PALETTE["red"], np.float32) * ghost
    diag = _old_passes_new_fails(DENSE_RIGHT, reuse.astype(np.float32), PROMPT_RIGHT)
    assert diag["detail_failed"] == ["ghost"] and diag["reuse_failed"] == []


def test_strict_is_opt_in_and_version_is_checked():
    # the model's quality gates keep the first reading (shape reported, not gated)
    reuse = _paint(_straight(20.0, 28.0), shape="diamond")
    assert checker.check(reuse, PROMPT_RIGHT).all_ok and not checker.check(reuse, PROMPT_RIGHT, strict=True).all_ok
    with pytest.raises(ValueError, match="request-level"):
        pairs.embedded_checker_labeler("attribute", None, version=2)
    with pytest.raises(ValueError, match="label version"):
        pairs.embedded_checker_labeler("request", 1.25, version=3)
    assert "shape" in pairs.embedded_checker_labeler("request", 1.25, version=2).definition


def test_learning_mode_labels_the_embedded_model_with_the_second_label():
    """The judge learning mode uses on the embedded model (``judge.SECOND_LABEL``, built in the runtime without
    the lab) gives every clip above the verdict the lab's second label gives it: each new check fails the same
    clips, and the controls pass."""
    from carnator.carnator_core.judge import SECOND_LABEL, judge_for
    from carnator.carnator_core.judge.base import JudgeRequest, excess_label

    judge = judge_for(None, "embedded", SECOND_LABEL)
    assert judge.settings == {"artifact_ratio": 1.25, "strict": True, "detail": True, "checker_version": 2}
    blurred = np.clip(ndimage.gaussian_filter(DENSE_RIGHT - _texture(), sigma=(0, 1.6, 1.6, 0)) + _texture(), 0, 1)
    ghost = checker.silhouette("ball", 8.0, 8.0, 3.0, FRAME.height, FRAME.width).astype(np.float32)
    ghost = ndimage.gaussian_filter(ghost, 0.7)[None, :, :, None] * 0.6
    cases = [(DENSE_RIGHT, DENSE_RIGHT, PROMPT_RIGHT), (DENSE_STILL, DENSE_RIGHT, PROMPT_STILL),
             (DENSE_RIGHT, blurred.astype(np.float32), PROMPT_RIGHT),
             (DENSE_RIGHT, (DENSE_RIGHT * (1 - ghost) + np.asarray(world.PALETTE["red"]) * ghost).astype(np.float32),
              PROMPT_RIGHT),
             (DENSE_RIGHT, _paint(_straight(20.0, 28.0), shape="diamond"), PROMPT_RIGHT)]
    seen = []
    for dense, reuse, prompt in cases:
        lab = excess_label(judge, reuse, dense, JudgeRequest(prompt=prompt, seed=0))
        seen.append(lab.b)
        assert lab.b == _label(2, dense, reuse, prompt)[0], prompt
    assert seen == [False, True, True, True, True]
