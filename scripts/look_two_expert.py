#!/usr/bin/env python
"""Look at reuse across a split schedule on the embedded model: is a hit that crosses the switch as good as one
on the whole schedule?

    .host/venv/bin/python scripts/look_two_expert.py [--out artifacts/two_expert_look.png] [--threads 2]

The embedded model runs a single-model split (the same MODEL is both stages' model and the probe's
``second_model``, as a step-split workflow does): 20 euler steps split at step 10, probe = first 4 steps. For
each (cached, target) pair of prompts with one seed, the cached prompt is served densely and stored, then the
target is served (a) densely and (b) as a forced hit on that entry (prompt-only filter with threshold 0, joint
mode, the ``max_active`` gate lifted), once on the split schedule and once on the whole schedule. Printed per
pair and schedule: PSNR of the hit's decoded clip against the dense clip of the same request, the embedded
checker's verdict on both, and the hit's active fraction. The PNG shows, per pair, rows: split dense, split hit,
whole dense, whole hit (8 frames each).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import conftest  # noqa: E402  (registers the `carnator` package; knows where the host's ComfyUI is)

_ONE = "a big {c} ball moves to the right in the top left, on green grass"
_TWO = "a big red ball moves to the right in the top left and a small {c} cube stays still in the {p}, on green grass"
PAIRS = [  # (cached, target): one object recoloured (one and two objects), one object moved, the same scene again
    (_ONE.format(c="red"), _ONE.format(c="blue")),
    (_TWO.format(c="blue", p="bottom right"), _TWO.format(c="yellow", p="bottom right")),
    (_TWO.format(c="blue", p="bottom right"), _TWO.format(c="blue", p="bottom left")),
    (_ONE.format(c="red"), _ONE.format(c="red")),
]
SEED, SWITCH = 3, 10


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "artifacts" / "two_expert_look.png"))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    conftest.ensure_comfy_importable()
    import numpy as np
    import torch
    from PIL import Image

    torch.set_num_threads(args.threads)
    from carnator.carnator_core.cache.store import Store
    from carnator.carnator_core.embedded import checker, comfy_glue, config as ecfg
    from carnator.carnator_core.lab.pairs import psnr_db
    from carnator.carnator_core.probe import ProbeConfig
    from carnator.carnator_core.request import RequestSpec, ServeOptions, serve
    from carnator.carnator_core.reuse import ReuseConfig
    from carnator.carnator_core.types import Stage

    model, te, dec = comfy_glue.load_embedded()
    tmp = Path(tempfile.mkdtemp(prefix="carnator-look-"))
    rows_img = []
    for i, (cached_prompt, target_prompt) in enumerate(PAIRS):
        for split in (True, False):
            store = Store.open(tmp / f"s{i}{int(split)}", key_path=tmp / "key")
            stage = Stage(0, SWITCH, True, True) if split else Stage()
            second = model if split else None

            def run(prompt: str, method: str, write: bool, _stage=stage, _second=second, _store=store):
                spec = RequestSpec(prompt, SEED, ecfg.DEFAULT_STEPS, float(ecfg.DEFAULT_CFG), ecfg.DEFAULT_SAMPLER,
                                   ecfg.DEFAULT_SCHEDULER, stage=_stage)
                # max_active 1: the region gate is lifted so that every pair shows the reuse path (on this model an
                # edit redraws most of the scene, which the gate would otherwise send dense)
                opts = ServeOptions(method=method, prompt_threshold=0.0, exact=False, write=write,
                                    probe=ProbeConfig(probe_steps=ecfg.DEFAULT_PROBE_STEP),
                                    reuse=ReuseConfig(max_active=1.0))
                return serve(model, te, te.encode(prompt), te.encode(""), comfy_glue.empty_latent(1), spec, _store,
                             opts, second_model=_second)

            run(cached_prompt, "never", True)
            dense = run(target_prompt, "never", False)
            hit = run(target_prompt, "prompt_only", False)
            d_clip = dec.decode_clips(dense.latent["samples"])[0].numpy()
            h_clip = dec.decode_clips(hit.latent["samples"])[0].numpy()
            ok_d, ok_h = checker.check(d_clip, target_prompt).all_ok, checker.check(h_clip, target_prompt).all_ok
            print(f"pair {i} {'split' if split else 'whole'}: {hit.report.decision} active "
                  f"{hit.report.active_fraction:.0%}, PSNR hit vs dense {psnr_db(h_clip, d_clip):.1f} dB, "
                  f"checker dense {ok_d} hit {ok_h} | {target_prompt!r}")
            for clip in (d_clip, h_clip):
                rows_img.append(np.concatenate(list(clip), axis=1))
        rows_img.append(np.ones_like(rows_img[-1]))  # a white gap between pairs
    grid = (np.clip(np.concatenate(rows_img[:-1], axis=0), 0, 1) * 255).astype(np.uint8)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(grid).resize((grid.shape[1] * 3, grid.shape[0] * 3), Image.NEAREST).save(out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
