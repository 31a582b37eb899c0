"""Does the embedded model read the *sign* of a motion word? Two offline diagnostics (the runtime never imports it).

``gap``: for moving one-object training-distribution scenes, the denoiser's x0 error on the object's cells with
the true caption, with the motion direction flipped (left <-> right, up <-> down; same wording template, same
noise), with the position swapped (top left <-> bottom right ...), and with the t coordinate ramp negated, at
several noise levels. A model that follows the direction word has a large flipped/true ratio (v2: 3.6x at
sigma 0.95); one that only knows the axis has ~1.0. Reads the weights' own text-encoder and coordinate settings.

    python scripts/motion_sign.py gap --weights runs/v3s4_latest.safetensors --threads 2

``probe``: can a warm-started model learn the sign? Fine-tunes the weights on moving one-object clips at
sigma in [--sigma-min, 1] only (where only the caption can place the object) with the given recipe options, and
every 50 steps prints the sign gap (flipped / true - 1) of the live weights at sigma 1 on 32 fixed clips.
It keeps no state (``Trainer(scene_filter=...)`` refuses to save one): a learnability experiment, not training.

    python scripts/motion_sign.py probe --init runs/v3x0_s12000.safetensors --lr 3e-3 --motion-axes 1 \\
        --coord-time-scale 4 --steps 400 --threads 2
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import conftest  # noqa: E402

FLIP = {"left": "right", "right": "left", "up": "down", "down": "up"}
SWAP = {"top left": "bottom right", "bottom right": "top left", "top right": "bottom left", "bottom left": "top right"}


def _clips(world, codec, text, frame, n: int, version: str, motion_axes: float, seed: int = 7,
           corners: bool = True):
    """n moving one-object scenes (``corners``: corner positions only, so the position can be swapped): latents,
    union masks, and the true / direction-flipped / position-swapped conditionings (each caption drawn from the
    same generator state, so only that word differs)."""
    import torch

    rng = np.random.default_rng(seed)
    x0s, masks, conds = [], [], {"true": [], "motion": [], "position": []}
    while len(x0s) < n:
        sc = world.sample_scene(rng, p_two=0.0, frame=frame)
        o = sc.objects[0]
        if o.motion not in FLIP or (corners and o.position not in SWAP):
            continue
        states = [copy.deepcopy(rng), copy.deepcopy(rng)]
        caps = {"true": world.caption(sc, rng),
                "motion": world.caption(world.Scene((replace(o, motion=FLIP[o.motion]),), sc.background), states[0]),
                "position": world.caption(world.Scene((replace(o, position=SWAP.get(o.position, o.position)),),
                                                      sc.background), states[1])}
        rgb, alpha = world.render(sc, frame)
        x0s.append(codec.rgb_to_latent(rgb))
        masks.append(codec.mask_to_latent(alpha.max(axis=0)))
        for k, c in caps.items():
            conds[k].append(text.encode(c, warn=False, version=version, motion_axes=motion_axes).cond)
    return (torch.stack(x0s), torch.stack(masks)[:, None],
            {k: torch.from_numpy(np.stack(v)) for k, v in conds.items()})


def _object_error(x0_hat, x0, mask) -> float:
    return float(((x0_hat - x0) ** 2 * mask).sum() / mask.sum() / x0.shape[1])


def gap(args) -> None:
    import torch

    from carnator.carnator_core.embedded import codec, comfy_glue, text, world

    model, _, _ = comfy_glue.load_embedded(args.weights)
    ver = comfy_glue.model_version(model)
    meta = model.model.carnator_embedded_meta
    pred = meta.get("prediction", "v")
    axes = comfy_glue.text_encoder_for(model).motion_axes
    tscale = model.model.model_config.carnator_time_scale
    dm = model.model.diffusion_model
    frame = world.Frame(ver.frames, ver.height, ver.width)
    x0, mask, conds = _clips(world, codec, text, frame, args.clips, ver.name, axes)
    n = x0.shape[0]
    coords = codec.coord_channels(*x0.shape[2:], scale=ver.coord_scale, octaves=ver.coord_octaves,
                                  time_scale=tscale)[None].expand(n, -1, -1, -1, -1)
    t_neg = coords.clone()
    t_neg[:, 2] = -t_neg[:, 2]
    gen = torch.Generator().manual_seed(0)
    print(f"{args.weights}: version {ver.name}, prediction {pred}, motion_axes {axes}, time scale {tscale}; "
          f"{n} moving one-object clips; x0 MSE on the object's cells")
    print(f"{'sigma':>6} {'true':>8} {'motion flipped':>15} {'position swapped':>17} {'t negated':>10} "
          f"{'flipped/true':>13}")
    for sigma in args.sigmas:
        eps = torch.randn(x0.shape, generator=gen)
        xt = (1.0 - sigma) * x0 + sigma * eps
        ts = torch.full((n,), sigma * 1000.0)
        errs = {}
        for name, cond, co in (("true", conds["true"], coords), ("motion", conds["motion"], coords),
                               ("position", conds["position"], coords), ("t", conds["true"], t_neg)):
            with torch.no_grad():
                out = dm(torch.cat([xt, co], 1), ts, cond)
            errs[name] = _object_error(out if pred == "x0" else xt - sigma * out, x0, mask)
        print(f"{sigma:6.2f} {errs['true']:8.4f} {errs['motion']:15.4f} {errs['position']:17.4f} {errs['t']:10.4f} "
              f"{errs['motion'] / errs['true']:13.2f}")


def probe(args) -> None:
    import torch

    from carnator.carnator_core.embedded import codec, text, train, world

    init = Path(args.init)
    recipe = train.Recipe(version="v3", seed=args.seed, steps=args.steps, lr=args.lr, warmup=args.warmup,
                          prediction="x0", object_share=train.V3_OBJECT_SHARE, p_two=0.0,
                          freeze_text_embedding=True, high_sigma_share=1.0, high_sigma_min=args.sigma_min,
                          coord_time_scale=args.coord_time_scale, motion_axes=args.motion_axes,
                          init=init.as_posix(), init_sha256=train.file_sha256(init))
    t = train.Trainer(recipe, None, threads=args.threads,
                      scene_filter=lambda sc: all(o.motion in FLIP for o in sc.objects))
    x0, mask, conds = _clips(world, codec, text, t.frame, 32, "v3", args.motion_axes, corners=False)
    eps = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0))
    inp = torch.cat([eps, t.coords.expand(x0.shape[0], -1, -1, -1, -1)], 1)
    ts = torch.full((x0.shape[0],), 1000.0)

    def errors() -> tuple[float, float]:
        t.model.eval()
        with torch.no_grad():
            e = tuple(_object_error(t.model(inp, ts, conds[k]), x0, mask) for k in ("true", "motion"))
        t.model.train()
        return e

    start = time.time()
    e = errors()
    print(f"step 0: true {e[0]:.4f} flipped {e[1]:.4f} gap {e[1] / e[0] - 1:.3f}", flush=True)
    losses = []
    while t.step < args.steps:
        losses.append(t.train_step())
        if t.step % 50 == 0:
            e = errors()
            print(f"step {t.step}: loss {np.mean(losses):.4f} true {e[0]:.4f} flipped {e[1]:.4f} "
                  f"gap {e[1] / e[0] - 1:.3f} ({time.time() - start:.0f} s)", flush=True)
            losses.clear()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gap", help="flipped-direction error ratio of a weights file")
    g.add_argument("--weights", type=Path, required=True)
    g.add_argument("--clips", type=int, default=32)
    g.add_argument("--sigmas", type=float, nargs="+", default=[1.0, 0.95, 0.85, 0.7])
    g.add_argument("--threads", type=int, default=1)
    p = sub.add_parser("probe", help="fine-tune on moving clips near sigma 1 and watch the sign gap")
    p.add_argument("--init", type=Path, required=True, help="exported v3 weights (x0 prediction) to start from")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--sigma-min", type=float, default=0.98)
    p.add_argument("--motion-axes", type=float, default=0.0)
    p.add_argument("--coord-time-scale", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="must be the init file's seed (its frozen text projection)")
    p.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    conftest.ensure_comfy_importable()
    import torch

    torch.set_num_threads(max(1, args.threads))
    gap(args) if args.cmd == "gap" else probe(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
