#!/usr/bin/env python
"""Everything the model card records about one embedded checkpoint, in one run (gate reviews between chunks).

    .host/venv/bin/python scripts/model/checkpoint_report.py --weights runs/v3r_s5016.safetensors \
        --out runs/report_s5016 [--threads 1] [--no-gate]

Writes ``<out>/report.json`` and ``<out>/frames.png`` and prints a summary:

* the quality gate (``comfy_glue.evaluate`` on the 64 one-object and 64 two-object held-out captions, the verdict
  of ``comfy_glue.gate_verdict``) — what ``python -m carnator_core.embedded.comfy_glue --two`` prints;
* word effects at σ 0.9 (``scripts/model/word_effects.py``: how much swapping one attribute word moves the output);
* background quality of the first 16 one-object gate captions (seed 0): the median background artifact score
  (``lab.metrics.artifact_score`` over ``background_mask``; the world's backgrounds are flat, so it is model
  error) and the token grid ratio (``lab.metrics.token_grid_ratio``; 1 = no per-token block pattern);
* how cleanly the model denoises a flat background (``denoise_error``: RMS x0 error on object-free latent
  cells at σ 0.95 / 0.6 / 0.2, and its part inside a token — per-pixel speckle);
* a contact sheet of the four captions of ``scripts/model/look_embedded.py`` (seed 3, frames 0 / 3 / 7).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts" / "model"))

import conftest  # noqa: E402  (registers the `carnator` package; knows where the host's ComfyUI is)


def background_quality(model, version: str, n: int = 16) -> dict:
    from carnator.carnator_core.embedded import codec, comfy_glue
    from carnator.carnator_core.lab import metrics as M

    caps = comfy_glue.gate_captions(n, version=version)
    gen = comfy_glue.generate(caps, 0, model=model, keep_x0=True)
    clips = gen.clips.numpy()
    masks = [M.background_mask(clips[i], c) for i, c in enumerate(caps)]
    arts = [M.artifact_score(clips[i], masks[i]) for i in range(n)]

    def x0_artifact(step: int) -> float:
        rgb = codec.latent_to_rgb(gen.x0_steps[step]).numpy()
        return round(float(np.nanmedian([M.artifact_score(rgb[i], masks[i]) for i in range(n)])), 2)

    # The same measure on the x0 prediction along the way: a model that denoises well removes the early steps'
    # speckle as sigma falls (v2: 26 at step 2 -> 4 at the end); one that cannot keeps it to the end.
    steps = sorted({0, 2, 5, 10, 15, len(gen.x0_steps) - 1})
    return {"artifact_median": round(float(np.nanmedian(arts)), 3),
            "token_grid_ratio": round(M.token_grid_ratio(clips), 4), "captions": n,
            "x0_artifact_by_step": {str(s): x0_artifact(s) for s in steps}}


def denoise_error(model, version: str, n: int = 16, sigmas=(0.95, 0.6, 0.2)) -> dict[str, dict[str, float]]:
    """How cleanly the model removes noise from a flat background: on ``n`` training-like scenes (captioned,
    fixed seeds), the RMS error of the denoised prediction (x0, what every sampler uses) over latent cells with no
    object, split into its per-token mean (a wrong background colour) and the part inside a token (per-pixel
    speckle, noise passed through). v-prediction models must carry all 128 noise values of a token through their
    residual stream to cancel them; at width 128 v3 could not (docs/history/MODEL_CARD_HISTORY.md, "v3's background
    noise")."""
    import torch

    from carnator.carnator_core.embedded import config, train, world

    ver = config.version(version)
    mm = model.model
    rng = np.random.default_rng(7)
    b = train.make_batch(rng, n, 0.0, frame=world.Frame(ver.frames, ver.height, ver.width), p_two=0.5,
                         text_version=version)
    x0 = b["x0"]
    eps = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0))
    background = (b["mask"] < 0.01)[:, None].expand(-1, 12, -1, -1, -1)
    pt, ph, pw = ver.patch_size
    out = {}
    with torch.no_grad():
        for s in sigmas:
            xt = (1 - s) * x0 + s * eps
            den = mm.apply_model(xt, torch.full((n,), float(s)), c_crossattn=b["context"],
                                 c_concat=mm.concat_cond(noise=xt))
            err = (den - x0)[:, :12]  # the 4 zero-padding channels are not decoded
            mean = torch.nn.functional.avg_pool3d(err, (pt, ph, pw))
            mean = mean.repeat_interleave(pt, 2).repeat_interleave(ph, 3).repeat_interleave(pw, 4)
            out[str(s)] = {"rms": round(float(err[background].pow(2).mean().sqrt()), 4),
                           "token_mean_rms": round(float(mean[background].pow(2).mean().sqrt()), 4),
                           "within_token_rms": round(float((err - mean)[background].pow(2).mean().sqrt()), 4)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="folder for report.json and frames.png")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-gate", action="store_true", help="skip the 128-clip gate (minutes); the rest takes ~1 min")
    args = ap.parse_args(argv)
    conftest.ensure_comfy_importable()
    import torch

    torch.set_num_threads(max(1, args.threads))
    import look_embedded
    from word_effects import word_effects

    from carnator.carnator_core.embedded import comfy_glue

    t0 = time.perf_counter()
    model, _, _ = comfy_glue.load_embedded(args.weights)
    ver = comfy_glue.model_version(model)
    meta = {k: v for k, v in model.model.carnator_embedded_meta.items() if k != "config"}
    report: dict = {"weights": str(args.weights), "version": ver.name, "steps": meta.get("steps"), "meta": meta}
    if not args.no_gate:
        report["one_object"] = comfy_glue.evaluate(comfy_glue.gate_captions(version=ver.name), model=model)
        report["two_objects"] = comfy_glue.evaluate(comfy_glue.gate_captions(n_objects=2, version=ver.name),
                                                    model=model)
        report["gate"] = comfy_glue.gate_verdict(report, ver)
    report["word_effects_0.9"] = word_effects(str(args.weights), sigmas=(0.9,))["effects"]["0.9"]
    report["background"] = background_quality(model, ver.name)
    report["background_denoise_error"] = denoise_error(model, ver.name)
    args.out.mkdir(parents=True, exist_ok=True)
    look_embedded.main(["--weights", str(args.weights), "--out", str(args.out / "frames.png"),
                        "--threads", str(args.threads)])
    report["seconds"] = round(time.perf_counter() - t0, 1)
    (args.out / "report.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    keys = ("colour", "size", "position", "motion", "motion_axis", "motion_sign", "shape", "attn_peak_on_object",
            "x0_colour_match", "all_ok")
    for part in ("one_object", "two_objects"):
        if part in report:
            print(f"{part:12s} " + " ".join(f"{k}={report[part][k]:.2f}" for k in keys))
            print(f"{'':12s} attention peak per layer (gate captions; choose layers with "
                  "scripts/model/probe_layers.py): "
                  + " ".join(f"{v:.2f}" for v in report[part]["attn_peak_by_layer"]))
    if "gate" in report:
        print(f"gate: {'PASSES' if report['gate']['passes'] else 'fails'} "
              f"{ {k: v for k, v in report['gate']['checks'].items() if not v} }")
    print("word effects σ 0.9: " + " ".join(f"{k}={v:.3f}" for k, v in report["word_effects_0.9"].items()))
    print(f"background: artifact median {report['background']['artifact_median']:.2f}, token grid ratio "
          f"{report['background']['token_grid_ratio']:.3f}")
    print("background artifact of the x0 prediction by step: " + ", ".join(
        f"{k}: {v:.1f}" for k, v in report["background"]["x0_artifact_by_step"].items()))
    print("background x0 error (rms; within a token): " + ", ".join(
        f"σ {k}: {v['rms']:.3f} ({v['within_token_rms']:.3f})" for k, v in report["background_denoise_error"].items()))
    print(f"wrote {args.out / 'report.json'} and {args.out / 'frames.png'} ({report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
