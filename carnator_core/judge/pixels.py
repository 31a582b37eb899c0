"""Pixel measures the judges share with the offline lab (runtime-safe: numpy / scipy only, no ComfyUI).

* :func:`hf_energy` / :func:`artifact_score`: high-frequency energy of a clip (x1000), the artifact measure of
  the excess label (reuse artifacts, rows of dashes and seams, raise it; ``lab.metrics`` documents the figures).
* :func:`background_mask`: the embedded world's background — pixels farther than ``margin`` from every named
  object the pixel checker segments in a clip.
* :func:`psnr_db`: PSNR of two clips in [0, 1].

``lab/metrics.py`` re-exports these, so the lab's labels and the runtime judges measure alike.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

BACKGROUND_MARGIN = 2  # pixels around each segmented object that count as the object's (soft edges, motion blur)


def as_clip(x: Any) -> np.ndarray:
    """A clip [T, H, W, 3] float32 in [0, 1] from a numpy array or torch tensor (clamped). ValueError for another
    shape."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().float().numpy()
    a = np.asarray(x, dtype=np.float32)
    if a.ndim != 4 or a.shape[-1] != 3:
        raise ValueError(f"expected a clip [T, H, W, 3], got shape {a.shape}")
    return np.clip(a, 0.0, 1.0)


def hf_energy(clip: Any) -> np.ndarray:
    """Per-pixel high-frequency energy [T, H, W]: squared RGB distance to the 3x3 spatial mean of each frame."""
    from scipy import ndimage

    x = as_clip(clip).astype(np.float64)
    return ((x - ndimage.uniform_filter(x, size=(1, 3, 3, 1), mode="nearest")) ** 2).sum(-1)


def artifact_score(clip: Any, mask: Optional[np.ndarray] = None) -> float:
    """High-frequency energy (x1000) of a clip over ``mask`` pixels (all when None): mean over the masked pixels
    of the squared RGB distance to the 3x3 spatial mean of each frame. NaN for an empty mask."""
    e = hf_energy(clip)
    sel = e if mask is None else e[np.asarray(mask, bool)]
    return float(sel.mean() * 1000.0) if sel.size else math.nan


def background_mask(dense_clip: Any, caption_or_scene: Any, margin: int = BACKGROUND_MARGIN, *,
                    version: int = 1) -> np.ndarray:
    """bool [T, H, W]: pixels farther than ``margin`` from every named object the embedded checker finds in the
    dense clip of the request (what reuse should leave as dense would have it); ``version``: the checker's reading
    (``embedded.checker.CHECKER_VERSIONS``)."""
    from scipy import ndimage

    from ..embedded import checker, world

    scene = world.parse_caption(caption_or_scene) if isinstance(caption_or_scene, str) else caption_or_scene
    x = as_clip(dense_clip)
    masks, _, _ = checker.object_masks(x, scene, version=version)
    objects = masks.any(0) if len(masks) else np.zeros(x.shape[:3], bool)
    if margin > 0 and objects.any():
        objects = ndimage.binary_dilation(objects, structure=np.ones((1, 2 * margin + 1, 2 * margin + 1), bool))
    return ~objects


def psnr_db(a: Any, b: Any) -> float:
    """PSNR (dB) of two clips with values in [0, 1], over all pixels of all frames (inf when identical)."""
    mse = float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
    return float("inf") if mse <= 0.0 else float(10.0 * np.log10(1.0 / mse))
