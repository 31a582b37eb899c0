"""The embedded model's fixed, invertible pixel <-> latent map (no learned VAE).

latent = pixel-unshuffle x2 of (2 * rgb - 1), 12 channels zero-padded to ``LATENT_CHANNELS`` (16):
a clip [T, 32, 32, 3] in [0, 1] becomes a latent [16, T, 16, 16] (ComfyUI video layout C, T, H, W).
Channel ``c`` of the first 12 holds colour ``c // 4`` at sub-pixel ``(c % 4) // 2, c % 2``; channels 12-15
are always zero for real clips (the model learns to keep them near zero; decoding ignores them).

Contract: ``latent_to_rgb(rgb_to_latent(x)) == x`` up to float rounding for x in [0, 1]. Batched inputs
([B, ...]) are accepted by both functions. Torch only; no ComfyUI.
"""
from __future__ import annotations

import math
from typing import Union

import numpy as np
import torch

from .config import LATENT_CHANNELS, UNSHUFFLE

ArrayLike = Union[np.ndarray, torch.Tensor]


def _as_tensor(x: ArrayLike) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x


def rgb_to_latent(rgb: ArrayLike) -> torch.Tensor:
    """[T, H, W, 3] (or [B, T, H, W, 3]) in [0, 1] -> float32 latent [16, T, H/2, W/2] (or batched)."""
    x = _as_tensor(rgb).float()
    batched = x.dim() == 5
    if not batched:
        x = x[None]
    b, t, h, w, _ = x.shape
    x = (x * 2.0 - 1.0).permute(0, 1, 4, 2, 3).reshape(b * t, 3, h, w)
    x = torch.nn.functional.pixel_unshuffle(x, UNSHUFFLE)  # [b*t, 12, h/2, w/2]
    c = x.shape[1]
    x = x.reshape(b, t, c, h // UNSHUFFLE, w // UNSHUFFLE).permute(0, 2, 1, 3, 4)
    pad = torch.zeros(b, LATENT_CHANNELS - c, t, h // UNSHUFFLE, w // UNSHUFFLE, dtype=x.dtype)
    out = torch.cat([x, pad], dim=1).contiguous()
    return out if batched else out[0]


def latent_to_rgb(latent: ArrayLike) -> torch.Tensor:
    """Latent [C, T, h, w] (or [B, C, T, h, w]) -> RGB [T, 2h, 2w, 3] (or batched) clamped to [0, 1].

    Any latent works, including noisy or x0-predicted ones (the Early Signature decodes those too).
    """
    z = _as_tensor(latent).float()
    batched = z.dim() == 5
    if not batched:
        z = z[None]
    b, _, t, h, w = z.shape
    c = 3 * UNSHUFFLE * UNSHUFFLE
    x = z[:, :c].permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
    x = torch.nn.functional.pixel_shuffle(x, UNSHUFFLE)  # [b*t, 3, 2h, 2w]
    x = x.reshape(b, t, 3, h * UNSHUFFLE, w * UNSHUFFLE).permute(0, 1, 3, 4, 2)
    out = ((x + 1.0) * 0.5).clamp(0.0, 1.0).contiguous()
    return out if batched else out[0]


def mask_to_latent(mask: ArrayLike) -> torch.Tensor:
    """Pixel mask [T, H, W] (or [B, T, H, W]) -> latent-grid mask [T, H/2, W/2] (max over each 2x2 cell)."""
    m = _as_tensor(mask).float()
    batched = m.dim() == 4
    if not batched:
        m = m[None]
    b, t, h, w = m.shape
    out = torch.nn.functional.max_pool2d(m.reshape(b * t, 1, h, w), UNSHUFFLE).reshape(
        b, t, h // UNSHUFFLE, w // UNSHUFFLE)
    return out if batched else out[0]


def coord_channels(frames: int, height: int, width: int, *, scale: float = 1.0, octaves: int = 0,
                   time_scale: float = 1.0) -> torch.Tensor:
    """[3 + 4 * octaves, T, h, w] fixed coordinate channels (latent grid), fed to the denoiser as concat
    conditioning so it knows where each token sits (see config.COORD_CHANNELS): x, y, t ramps in
    [-scale, scale] (the t ramp further multiplied by ``time_scale``), then per octave k sin/cos(pi 2^k x) and
    sin/cos(pi 2^k y) in [-scale, scale] (``ModelVersion.coord_scale`` / ``coord_octaves``; v2: 1.0 and 0;
    ``time_scale`` is a property of a weights file, ``train.Recipe.coord_time_scale``, 1.0 unless its metadata
    says otherwise)."""
    t = torch.linspace(-1.0, 1.0, frames).view(frames, 1, 1).expand(frames, height, width)
    y = torch.linspace(-1.0, 1.0, height).view(1, height, 1).expand(frames, height, width)
    x = torch.linspace(-1.0, 1.0, width).view(1, 1, width).expand(frames, height, width)
    chans = [x, y, t * time_scale]
    for k in range(octaves):
        f = math.pi * 2.0 ** k
        chans += [torch.sin(f * x), torch.cos(f * x), torch.sin(f * y), torch.cos(f * y)]
    return (torch.stack(chans) * scale).contiguous()
