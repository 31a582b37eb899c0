"""The pairs labelling's two labels: per attribute (the first) and per request (the excess label's b and c)."""
from __future__ import annotations

import numpy as np
import pytest

from carnator.carnator_core.lab.pairs import CheckerLabeler, request_outcome


def _labeler(level: str, verdicts: dict[str, dict[str, bool]]) -> CheckerLabeler:
    """A checker that reads a clip's verdicts from its first pixel value (0 = dense, 1 = reuse)."""
    return CheckerLabeler(lambda clip, prompt: verdicts["dense" if clip.flat[0] == 0 else "reuse"], "test", level)


DENSE, REUSE = np.zeros((1, 2, 2, 3)), np.ones((1, 2, 2, 3))


@pytest.mark.parametrize("dense,reuse,attr_unsafe,b,c", [
    ({"o0.colour": True, "o0.size": True}, {"o0.colour": True, "o0.size": False}, True, True, False),
    ({"o0.colour": True, "o0.size": False}, {"o0.colour": True, "o0.size": True}, False, False, True),
    # both fail, on different attributes: the first label charges the reuse, the excess label does not
    ({"o0.colour": True, "o0.size": False}, {"o0.colour": False, "o0.size": True}, True, False, False),
    ({"o0.colour": True}, {"o0.colour": True}, False, False, False),
])
def test_attribute_and_request_labels(dense, reuse, attr_unsafe, b, c):
    v = {"dense": dense, "reuse": reuse}
    lab = _labeler("attribute", v)
    unsafe, diag = lab.label(lab.reference(DENSE, "p"), REUSE, "p")
    assert unsafe is attr_unsafe and "better" not in diag
    lab = _labeler("request", v)
    unsafe, diag = lab.label(lab.reference(DENSE, "p"), REUSE, "p")
    assert (unsafe, diag["better"]) == (b, c)
    assert not (unsafe and diag["better"])


def test_an_artifact_makes_the_reuse_clip_fail():
    diag = {"reuse_failed": [], "dense_failed": []}
    assert request_outcome(diag, artifact_failed=False)[0] is False
    unsafe, out = request_outcome(diag, artifact_failed=True)
    assert unsafe and out["artifact_failed"] and not out["better"]
    # a reuse that fixed a dense failure but added artifacts is not "better"
    unsafe, out = request_outcome({"reuse_failed": [], "dense_failed": ["o0.size"]}, artifact_failed=True)
    assert not unsafe and not out["better"]


def test_unknown_level_is_refused():
    with pytest.raises(ValueError, match="level must be"):
        CheckerLabeler(lambda c, p: {}, "x", "pixels")


def test_token_grid_ratio_sees_block_noise_and_not_a_smooth_picture():
    from carnator.carnator_core.lab.metrics import token_grid_ratio

    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:48, 0:48] / 48.0
    smooth = np.repeat(np.stack([yy, xx, 0.5 * (yy + xx)], -1)[None], 8, 0)  # [T, H, W, 3] gradients
    assert abs(token_grid_ratio(smooth) - 1.0) < 0.05
    blocks = np.kron(rng.random((8, 12, 12, 3)), np.ones((1, 4, 4, 1)))  # one random colour per 4x4 token
    noisy = np.clip(smooth + 0.3 * blocks + 0.01 * rng.standard_normal(smooth.shape), 0, 1)
    assert token_grid_ratio(noisy) > 3.0
    assert token_grid_ratio(noisy[None].repeat(2, 0)) == pytest.approx(token_grid_ratio(noisy))
    with pytest.raises(ValueError, match="larger than one 4-pixel cell"):
        token_grid_ratio(np.zeros((8, 4, 4, 3)))
