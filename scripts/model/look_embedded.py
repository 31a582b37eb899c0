#!/usr/bin/env python
"""A contact sheet of embedded-model clips, for looking at a checkpoint (gate reviews, the model card).

    .host/venv/bin/python scripts/model/look_embedded.py --weights runs/v3_s5000.safetensors --out docs/img/x.png \
        [--seed 3] [--frames 0,3,7] [--scale 3] [--caption "..." ...]

One row per caption (default: four captions that exercise colour, size, position, motion and a two-object
scene), the chosen frames left to right, each enlarged ``--scale`` times with nearest-neighbour so the model's
token grid stays visible. Clips come from ``comfy_glue.generate`` (ComfyUI's stock sampling path, default
config). Prints the captions in row order and the clips' token grid ratio (``lab.metrics.token_grid_ratio``:
how much the pictures step at token boundaries).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import conftest  # noqa: E402  (registers the `carnator` package; knows where the host's ComfyUI is)

CAPTIONS = (
    "a big red ball moves to the right in the top left, on green grass",
    "a small yellow cube moves to the right in the bottom right, in a pink room",
    "a big blue triangle falls in the top right, under a blue sky",
    "a red ball rests in the top left and a white cube moves up in the bottom right, on sand",
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", type=Path, default=None, help="embedded weights (default: the shipped ones)")
    ap.add_argument("--out", type=Path, required=True, help="PNG to write")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--frames", default="0,3,7", help="frame indices, comma separated")
    ap.add_argument("--scale", type=int, default=3, help="nearest-neighbour enlargement")
    ap.add_argument("--caption", action="append", default=[], help="a caption (repeatable; default: four)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    try:
        frames = [int(x) for x in args.frames.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--frames takes frame indices like 0,3,7; got {args.frames!r}") from None
    if not frames or args.scale < 1:
        raise SystemExit("--frames needs at least one index and --scale must be >= 1")
    conftest.ensure_comfy_importable()
    import torch
    from PIL import Image

    torch.set_num_threads(max(1, args.threads))
    from carnator.carnator_core.embedded import comfy_glue

    captions = list(args.caption) or list(CAPTIONS)
    model, _te, _dec = comfy_glue.load_embedded(args.weights)
    clips = comfy_glue.generate(captions, seed=args.seed, model=model).clips  # [N, T, H, W, 3] in [0, 1]
    clips = clips.numpy() if hasattr(clips, "numpy") else np.asarray(clips)
    n_frames = clips.shape[1]
    bad = [f for f in frames if not 0 <= f < n_frames]
    if bad:
        raise SystemExit(f"--frames {bad} outside the clip's {n_frames} frames")
    gap = 2
    h, w = clips.shape[2] * args.scale, clips.shape[3] * args.scale
    sheet = np.ones((len(captions) * (h + gap) - gap, len(frames) * (w + gap) - gap, 3), dtype=np.float32)
    for i, clip in enumerate(clips):
        for j, f in enumerate(frames):
            img = np.repeat(np.repeat(clip[f], args.scale, axis=0), args.scale, axis=1)
            sheet[i * (h + gap):i * (h + gap) + h, j * (w + gap):j * (w + gap) + w] = img
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray((np.clip(sheet, 0, 1) * 255).astype(np.uint8)).save(args.out)
    from carnator.carnator_core.lab.metrics import token_grid_ratio

    print(f"wrote {args.out}: rows = captions, columns = frames {frames} (seed {args.seed}); token grid ratio of "
          f"these clips {token_grid_ratio(clips):.3f} (1 = no per-token block pattern; v2 shipped ~1.2)")
    for i, c in enumerate(captions):
        print(f"  row {i}: {c}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
