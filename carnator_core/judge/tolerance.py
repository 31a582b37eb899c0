"""A stated pixel tolerance against the dense clip as a judge (:class:`ToleranceJudge`): the label for any model
when nothing better is available. It cannot judge a clip alone (every clip passes :meth:`judge`), so its excess
label has b = "the reuse clip deviates from the same-seed dense clip beyond the tolerance" and never c.

metric "psnr": fails when PSNR(reuse, dense) < ``threshold`` dB; "ssim": when the mean per-frame SSIM (scikit-image,
colour, 7x7 window) < ``threshold``. Runtime-safe (numpy / scikit-image).
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from . import pixels
from .base import JudgeBase, JudgeRequest, Verdict


def mean_ssim(a: Any, b: Any) -> float:
    """Mean over frames of the SSIM of two clips [T, H, W, 3] in [0, 1] (skimage, colour, 7×7 window)."""
    from skimage.metrics import structural_similarity

    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    win = min(7, a.shape[1], a.shape[2])
    win -= (win + 1) % 2  # odd window
    return float(np.mean([structural_similarity(x, y, data_range=1.0, channel_axis=-1, win_size=win)
                          for x, y in zip(a, b)]))


class ToleranceJudge(JudgeBase):
    """Fails a reuse clip whose distance to the same-seed dense clip exceeds a tolerance stated in advance."""

    name = "tolerance"

    def __init__(self, metric: str = "psnr", threshold: float = 25.0):
        if metric not in ("psnr", "ssim"):
            raise ValueError(f"tolerance metric must be 'psnr' or 'ssim', got {metric!r}")
        if not math.isfinite(threshold):
            raise ValueError(f"tolerance threshold must be a finite number, got {threshold!r}")
        self.metric, self.threshold = metric, float(threshold)
        self.settings: Mapping[str, Any] = {"metric": metric, "threshold": self.threshold}

    def judge(self, clip: Any, request: JudgeRequest) -> Verdict:
        return Verdict(passed=True)

    def judge_pair(self, ref: Any, reuse_clip: Any, dense_clip: Any, request: JudgeRequest) -> Verdict:
        if self.metric == "psnr":
            v = pixels.psnr_db(reuse_clip, dense_clip)
            ok, what = v >= self.threshold, f"PSNR {v:.2f} dB to the dense clip < {self.threshold:g}"
        else:
            v = mean_ssim(reuse_clip, dense_clip)
            ok, what = v >= self.threshold, f"SSIM {v:.4f} to the dense clip < {self.threshold:g}"
        return Verdict(passed=bool(ok), scene=bool(ok), reasons=() if ok else (f"scene: {what}",),
                       scores={self.metric: v})
