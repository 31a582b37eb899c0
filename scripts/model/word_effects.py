#!/usr/bin/env python
"""How much each kind of prompt word moves the embedded denoiser: a training diagnostic.

    .host/venv/bin/python scripts/model/word_effects.py --weights runs/v3_latest.safetensors [--weights ...] \\
        [--attention]

For each weights file: one fixed noisy latent per sigma (0.9, 0.6, 0.3; seeded), the denoiser's output for a base
caption and for the caption with one attribute swapped (colour, size, position, motion, shape, background); prints
the mean absolute difference of the outputs per swap, and for the coordinate channels mirrored left-right
(``coords_mirrored``: does the model read where a token sits at all?) (JSON, one object per weights file). A word
kind whose swap moves the output by ~0 is not used by the model (v1's dead text projection gave exactly 0 for size,
position and motion; docs/MODEL_CARD.md). ``--attention`` adds where each block's cross-attention goes
(``cross_attention_use``: padding sink, object and background words, position words vs coordinates). No sampling,
seconds per file.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import conftest  # noqa: E402  (registers the `carnator` package, puts ComfyUI on sys.path)

conftest.ensure_comfy_importable()

import torch  # noqa: E402

BASE = "a big red ball sits still in the top left, on green grass"
SWAPS = {"colour": ("red", "blue"), "size": ("big", "small"), "position": ("top left", "bottom right"),
         "motion": ("sits still", "moves to the right"), "shape": ("ball", "cube"),
         "background": ("green grass", "blue sky")}


@functools.lru_cache(maxsize=2)
def _load(weights: str):
    """(ModelPatcher, ModelVersion) of a weights file, loaded once per process (both diagnostics use it)."""
    from carnator.carnator_core.embedded import comfy_glue as g

    m, _, _ = g.load_embedded(weights)
    return m, g.model_version(m)


def _noisy(mm, ver, sigma: float, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, sigma tensor): an empty latent of ``ver`` noised to ``sigma`` with ``gen``'s next normal draw."""
    from carnator.carnator_core.embedded import comfy_glue as g

    lat = g.empty_latent(1, ver.name)["samples"]
    s = torch.tensor([float(sigma)])
    x = mm.model_sampling.noise_scaling(s.reshape(-1, 1, 1, 1, 1), torch.randn(lat.shape, generator=gen),
                                        torch.zeros_like(lat))
    return x, s


def word_effects(weights: str, sigmas=(0.9, 0.6, 0.3), seed: int = 0) -> dict:
    from carnator.carnator_core.embedded import comfy_glue as g

    m, ver = _load(weights)
    enc = g.text_encoder_for(m)
    mm = m.model
    gen = torch.Generator().manual_seed(seed)
    out = {"weights": weights, "version": ver.name, "step": m.model.carnator_embedded_meta.get("step"),
           "base": BASE, "effects": {}}
    with torch.no_grad():
        for sigma in sigmas:
            x, s = _noisy(mm, ver, sigma, gen)
            coords = mm.concat_cond(noise=x)

            def denoise(prompt: str, concat: torch.Tensor = coords) -> torch.Tensor:
                return mm.apply_model(x, s, c_crossattn=enc.encode(prompt)[0][0], c_concat=concat)

            ref = denoise(BASE)
            eff = {k: round(float((denoise(BASE.replace(a, b)) - ref).abs().mean()), 5) for k, (a, b) in SWAPS.items()}
            # Does the model read where a token sits? The same input with the coordinate channels mirrored
            # left-right (every channel that varies along x flips; see codec.coord_channels).
            eff["coords_mirrored"] = round(float((denoise(BASE, coords.flip(-1)) - ref).abs().mean()), 5)
            out["effects"][str(sigma)] = eff
    return out


def cross_attention_use(weights: str, sigma: float = 0.9, seed: int = 0) -> dict:
    """Where each block's cross-attention goes, on BASE at one noisy latent: the mean attention mass on the
    zero-padding slots (a *sink*: attention there reads the same constant key/value for every prompt), on the
    object's words and on the background words; and, for the position words ("top", "left"), the best head's
    correlation of its attention map with the token's distance from the right / bottom edge (near 1: queries read
    where a token sits and match it to the position words, as v2's first block does; near 0: they do not)."""
    from carnator.carnator_core.embedded import comfy_glue as g, text as text_mod

    m, ver = _load(weights)
    mm = m.model
    dm = mm.diffusion_model
    enc = text_mod.encode(BASE, warn=False, version=ver.name, motion_axes=g.text_encoder_for(m).motion_axes)
    tok = {w.word.strip(","): w.tokens[0] for w in enc.words if w.tokens}
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = [b.cross_attn.register_forward_pre_hook(
        lambda mod, args, i=i: captured.__setitem__(i, (args[0].detach(), args[1].detach())))
        for i, b in enumerate(dm.blocks)]
    try:
        with torch.no_grad():
            x, s = _noisy(mm, ver, sigma, torch.Generator().manual_seed(seed))
            mm.apply_model(x, s, c_crossattn=torch.from_numpy(enc.cond)[None], c_concat=mm.concat_cond(noise=x))
    finally:
        for h in hooks:
            h.remove()
    t, hh, ww = ver.token_grid
    from_right = torch.linspace(1, -1, ww).view(1, 1, ww).expand(t, hh, ww).reshape(-1)
    from_bottom = torch.linspace(1, -1, hh).view(1, hh, 1).expand(t, hh, ww).reshape(-1)
    obj = [tok[w] for w in ("big", "red", "ball")]
    bg = [tok[w] for w in ("green", "grass")]
    blocks = []
    with torch.no_grad():
        for i in sorted(captured):
            xq, ctx = captured[i]
            ca = dm.blocks[i].cross_attn
            q, k = ca.norm_q(ca.q(xq)), ca.norm_k(ca.k(ctx))
            nh = ca.num_heads
            d = q.shape[-1] // nh
            q = q.view(1, -1, nh, d).transpose(1, 2)
            k = k.view(1, -1, nh, d).transpose(1, 2)
            a = torch.softmax(q @ k.transpose(-1, -2) / d ** 0.5, dim=-1)[0]  # [heads, tokens, text slots]
            mass = a.mean(dim=(0, 1))

            def corr(maps: torch.Tensor, ramp: torch.Tensor) -> float:
                return max(float(torch.corrcoef(torch.stack([h_, ramp]))[0, 1]) for h_ in maps)

            blocks.append({"block": i, "padding": round(float(mass[enc.n_tokens:].sum()), 3),
                           "object_words": round(float(mass[obj].sum()), 3),
                           "background_words": round(float(mass[bg].sum()), 3),
                           "left_vs_x": round(corr(a[:, :, tok["left"]], from_right), 2),
                           "top_vs_y": round(corr(a[:, :, tok["top"]], from_bottom), 2)})
    return {"weights": weights, "version": ver.name, "sigma": sigma, "blocks": blocks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", action="append", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--attention", action="store_true", help="also print where each block's cross-attention goes")
    ns = ap.parse_args()
    torch.set_num_threads(ns.threads)
    for w in ns.weights:
        print(json.dumps(word_effects(w)), flush=True)
        if ns.attention:
            print(json.dumps(cross_attention_use(w)), flush=True)


if __name__ == "__main__":
    main()
