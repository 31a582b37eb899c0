#!/usr/bin/env python
"""How much each kind of prompt word moves the embedded denoiser: a training diagnostic.

    .host/venv/bin/python scripts/word_effects.py --weights runs/v3_latest.safetensors [--weights ...]

For each weights file: one fixed noisy latent per sigma (0.9, 0.6, 0.3; seeded), the denoiser's output for a base
caption and for the caption with one attribute swapped (colour, size, position, motion, shape, background); prints
the mean absolute difference of the outputs per swap (JSON, one object per weights file). A word kind whose swap
moves the output by ~0 is not used by the model (v1's dead text projection gave exactly 0 for size, position and
motion; docs/MODEL_CARD.md). No sampling, seconds per file.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import conftest  # noqa: E402  (registers the `carnator` package, puts ComfyUI on sys.path)

conftest.ensure_comfy_importable()

import torch  # noqa: E402

BASE = "a big red ball sits still in the top left, on green grass"
SWAPS = {"colour": ("red", "blue"), "size": ("big", "small"), "position": ("top left", "bottom right"),
         "motion": ("sits still", "moves to the right"), "shape": ("ball", "cube"),
         "background": ("green grass", "blue sky")}


def word_effects(weights: str, sigmas=(0.9, 0.6, 0.3), seed: int = 0) -> dict:
    from carnator.carnator_core.embedded import comfy_glue as g

    m, _, _ = g.load_embedded(weights)
    ver = g.model_version(m)
    enc = g.EmbeddedTextEncoder(ver.name)
    mm = m.model
    lat = g.empty_latent(1, ver.name)["samples"]
    gen = torch.Generator().manual_seed(seed)
    out = {"weights": weights, "version": ver.name, "step": m.model.carnator_embedded_meta.get("step"),
           "base": BASE, "effects": {}}
    with torch.no_grad():
        for sigma in sigmas:
            s = torch.tensor([float(sigma)])
            x = mm.model_sampling.noise_scaling(s.reshape(-1, 1, 1, 1, 1), torch.randn(lat.shape, generator=gen),
                                                torch.zeros_like(lat))

            def denoise(prompt: str) -> torch.Tensor:
                return mm.apply_model(x, s, c_crossattn=enc.encode(prompt)[0][0], c_concat=mm.concat_cond(noise=x))

            ref = denoise(BASE)
            out["effects"][str(sigma)] = {k: round(float((denoise(BASE.replace(a, b)) - ref).abs().mean()), 5)
                                          for k, (a, b) in SWAPS.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", action="append", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ns = ap.parse_args()
    torch.set_num_threads(ns.threads)
    for w in ns.weights:
        print(json.dumps(word_effects(w)), flush=True)


if __name__ == "__main__":
    main()
