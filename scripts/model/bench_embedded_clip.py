#!/usr/bin/env python
"""Embedded model versions side by side: tokens, object share of the clip, parameters, FLOPs, seconds per clip
and per training step.

    .host/venv/bin/python scripts/model/bench_embedded_clip.py [--repeats 3] [--threads 1] [--v3-weights PATH]

One process, variants in rotating order, medians of ``--repeats``:

* geometry (no timing): tokens per clip; the share of the clip an object covers, in pixels (alpha > 0.5) and
  in tokens (a token counts when an object covers at least one of its pixels, as a recompute region does),
  plus that token region dilated by one token in space (how Carnator grows a region before recomputing it),
  over ``--scenes`` random training scenes per version; parameters; analytic FLOPs per clip
  (``comfy_glue.clip_flops``, what the gate test bounds).
* ``clip``: one clip with the default settings (20 steps, CFG 5, euler/simple) through the stock sampling path,
  batch 1. Timing does not depend on the weight values, so a version without trained weights yet is timed
  on its initialised WanModel (written to a temporary weights file and loaded the normal way).
* ``train_step``: one training step of the version's recipe (batch 8, forward + backward + AdamW + EMA,
  including rendering the batch).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import conftest  # noqa: E402  (registers the `carnator` package; knows where the host's ComfyUI is)


def object_share(version, scenes: int, seed: int = 0) -> dict[str, float]:
    """Median per-object share of the clip (pixels, tokens, tokens dilated by one) over random scenes."""
    import numpy as np
    from scipy import ndimage

    from carnator.carnator_core.embedded import config, world

    frame = world.Frame(version.frames, version.height, version.width)
    rng = np.random.default_rng(seed)
    pt, ph, pw = version.patch_size[0], version.patch_size[1] * config.UNSHUFFLE, \
        version.patch_size[2] * config.UNSHUFFLE
    px, tok, dil = [], [], []
    for _ in range(scenes):
        scene = world.sample_scene(rng, p_two=version.p_two, frame=frame)
        _, alpha = world.render(scene, frame)
        for a in alpha:
            px.append(float((a > 0.5).mean()))
            t, h, w = a.shape
            cells = (a > 0).reshape(t // pt, pt, h // ph, ph, w // pw, pw).any(axis=(1, 3, 5))
            tok.append(float(cells.mean()))
            grown = np.stack([ndimage.binary_dilation(c, np.ones((3, 3), bool)) for c in cells])
            dil.append(float(grown.mean()))
    return {"pixels": statistics.median(px), "tokens": statistics.median(tok), "tokens_dilated": statistics.median(dil),
            "tokens_p90": float(np.quantile(tok, 0.9)), "tokens_dilated_p90": float(np.quantile(dil, 0.9))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--scenes", type=int, default=400)
    ap.add_argument("--v3-weights", type=Path, default=None, help="trained v3 weights (default: initialised)")
    ap.add_argument("--no-train-step", action="store_true")
    args = ap.parse_args()
    conftest.ensure_comfy_importable()
    import torch

    torch.set_num_threads(args.threads)
    from carnator.carnator_core.embedded import comfy_glue, config, train
    from carnator.carnator_core.embedded.model import build_wan

    tmp = Path(tempfile.mkdtemp(prefix="carnator-bench-embedded-"))
    weights = {"v2": config.version("v2").weights_path, "v3": args.v3_weights}
    report: dict[str, dict] = {}
    models = {}
    trainers = {}
    for name in ("v2", "v3"):
        v = config.version(name)
        path = weights[name]
        if path is None or not Path(path).exists():
            torch.manual_seed(0)
            m = build_wan(init=True, **v.model_config())
            path = tmp / f"{name}_init.safetensors"
            train.save_weights(m.state_dict(), path, {"config": v.model_config(), "seed": 0, "version": name,
                                                      "note": "initialised, for timing only"})
        models[name], _, _ = comfy_glue.load_embedded(path)
        n_params = sum(p.numel() for p in models[name].model.diffusion_model.parameters())
        report[name] = {"tokens": v.tokens, "token_grid": v.token_grid, "frame": [v.frames, v.height, v.width],
                        "blocks": v.num_layers, "dense_first_last_share": 2 / v.num_layers,
                        "params_M": round(n_params / 1e6, 3), "clip_GFLOP": round(comfy_glue.clip_flops(v) / 1e9, 1),
                        "object_share": object_share(v, args.scenes), "weights": str(weights[name] or "initialised")}
        if not args.no_train_step:
            trainers[name] = train.Trainer(train.Recipe(version=name,
                                                        object_share=train.V3_OBJECT_SHARE if name != "v2" else None,
                                                        freeze_text_embedding=True), None, threads=args.threads)
    clip_s: dict[str, list[float]] = {"v2": [], "v3": []}
    step_s: dict[str, list[float]] = {"v2": [], "v3": []}
    for name in ("v2", "v3"):  # warm-up (first call allocates)
        comfy_glue.generate(["a big red ball moves to the right in the top left, on green grass"], seed=99,
                            model=models[name])
    for r in range(args.repeats):
        order = ("v2", "v3") if r % 2 == 0 else ("v3", "v2")
        for name in order:
            t0 = time.perf_counter()
            comfy_glue.generate(["a big red ball moves to the right in the top left, on green grass"], seed=r,
                                model=models[name])
            clip_s[name].append(time.perf_counter() - t0)
            if name in trainers:
                t0 = time.perf_counter()
                trainers[name].train_step()
                step_s[name].append(time.perf_counter() - t0)
    for name in ("v2", "v3"):
        report[name]["clip_s_median"] = round(statistics.median(clip_s[name]), 3)
        if step_s[name]:
            report[name]["train_step_s_median"] = round(statistics.median(step_s[name]), 3)
    report["ratio_v3_over_v2"] = {"clip_s": round(report["v3"]["clip_s_median"] / report["v2"]["clip_s_median"], 2)}
    if step_s["v2"]:
        report["ratio_v3_over_v2"]["train_step_s"] = round(
            report["v3"]["train_step_s_median"] / report["v2"]["train_step_s_median"], 2)
    report["threads"] = args.threads
    report["repeats"] = args.repeats
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
