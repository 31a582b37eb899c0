"""Train the embedded model (ComfyUI WanModel) on the procedural world with rectified-flow matching.

Run from the repository root with the host python:

    .host/venv/bin/python -m carnator_core.embedded.train --freeze-text-embedding \\
        --out carnator_core/embedded/weights/carnator_embedded_v2.safetensors --minutes 125 --steps 20000 --seed 0

(the command that made the shipped v2 weights; docs/MODEL_CARD.md has its measured time and quality).

Recipe (why each choice, see docs/MODEL_CARD.md): scenes rendered on the fly from a seeded generator
(held-out attribute combinations never drawn); x_t = (1 - s) x0 + s eps, the model predicts the velocity
eps - x0 at timestep 1000 s (ComfyUI's discrete-flow convention, so stock samplers apply it unchanged);
s from a logit-normal distribution pushed towards high noise with the inference shift (layout is decided
at high noise); the loss is up-weighted on object pixels (objects cover ~10% of a clip but carry every
prompt attribute); AdamW with linear warm-up and cosine decay driven by progress = max(step / steps,
elapsed / budget), so a run always finishes its schedule; an EMA copy of the weights is what gets saved
(fp16 safetensors with the config, seed and progress in the metadata), every ``--ckpt-minutes``.

Training runs in this process on the CPU. ``--threads auto`` re-measures whether 1 or 2 intra-op threads
is faster every few hundred steps (on a machine shared with other jobs, 2 threads can be 3x slower than 1).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch

if __package__ in (None, ""):
    raise SystemExit("run as a module from the repository root: python -m carnator_core.embedded.train ...")

from . import codec, config, text, world
from .model import build_wan


def make_batch(rng: np.random.Generator, batch: int, p_drop: float) -> dict[str, torch.Tensor]:
    """Render ``batch`` fresh training clips: latents [B,16,T,h,w], contexts [B,L,D], object masks."""
    rgbs, masks, conds = [], [], []
    for _ in range(batch):
        scene = world.sample_scene(rng)
        rgb, alpha = world.render(scene)
        prompt = "" if rng.random() < p_drop else world.caption(scene, rng)
        rgbs.append(rgb)
        masks.append(alpha.max(axis=0))
        conds.append(text.encode(prompt, warn=False).cond)
    x0 = codec.rgb_to_latent(np.stack(rgbs))
    mask = codec.mask_to_latent(np.stack(masks))
    return {"x0": x0, "mask": mask, "context": torch.from_numpy(np.stack(conds))}


def sample_sigmas(gen: torch.Generator, n: int, shift: float) -> torch.Tensor:
    """Logit-normal(0, 1) times, then the discrete-flow shift (more mass at high noise)."""
    u = torch.sigmoid(torch.randn(n, generator=gen))
    return shift * u / (1.0 + (shift - 1.0) * u)


def save_weights(ema: dict[str, torch.Tensor], path: Path, meta: dict) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in ema.items()}
    save_file(tensors, str(tmp), metadata={k: json.dumps(v) for k, v in meta.items()})
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=config.DEFAULT_WEIGHTS)
    p.add_argument("--minutes", type=float, default=80.0, help="wall-clock budget (the schedule ends with it)")
    p.add_argument("--steps", type=int, default=100000, help="step budget (the schedule ends with it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--ema", type=float, default=0.998)
    p.add_argument("--object-weight", type=float, default=4.0, help="extra loss weight on object pixels")
    p.add_argument("--p-drop", type=float, default=0.1, help="caption dropout (for classifier-free guidance)")
    p.add_argument("--threads", default="auto", help="1, 2 or auto")
    p.add_argument("--ckpt-minutes", type=float, default=5.0)
    p.add_argument("--log", type=Path, default=Path("runs/embedded_train.jsonl"))
    p.add_argument("--init", type=Path, default=None,
                   help="start from these weights (fine-tuning); text_embedding is re-initialised if frozen")
    p.add_argument("--freeze-text-embedding", action="store_true",
                   help="keep WanModel.text_embedding at its random init: trained, its GELU dies for every "
                        "token that is not useful early (size/position/motion words), which then never recover")
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)
    auto_threads = args.threads == "auto"
    threads = 1 if auto_threads else int(args.threads)
    torch.set_num_threads(threads)

    model = build_wan(init=True)
    if args.init is not None:
        from safetensors.torch import load_file

        fresh_text = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("text_embedding.")}
        state = {k: v.float() for k, v in load_file(str(args.init)).items()}
        if args.freeze_text_embedding:
            state.update(fresh_text)
        model.load_state_dict(state)
    if args.freeze_text_embedding:
        for p_ in model.text_embedding.parameters():
            p_.requires_grad_(False)
    model.train()
    params = [p_ for p_ in model.parameters() if p_.requires_grad]
    decay = [p_ for p_ in params if p_.dim() >= 2]
    no_decay = [p_ for p_ in params if p_.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
    coords = codec.coord_channels(*config.LATENT_SHAPE[1:])[None]
    args.log.parent.mkdir(parents=True, exist_ok=True)
    log = args.log.open("a")
    budget_s = args.minutes * 60.0
    start = time.time()
    last_ckpt = start
    step = 0
    losses: list[float] = []
    step_times: dict[int, list[float]] = {1: [], 2: []}
    meta_base = {"config": config.model_config(), "seed": args.seed, "init": str(args.init) if args.init else None,
                 "freeze_text_embedding": bool(args.freeze_text_embedding), "batch": args.batch, "lr": args.lr,
                 "shift": config.SHIFT, "object_weight": args.object_weight, "p_drop": args.p_drop,
                 "format": "carnator-embedded-v1"}
    print(f"training: {sum(p_.numel() for p_ in params) / 1e6:.2f} M params, budget {args.minutes} min / "
          f"{args.steps} steps", flush=True)

    while True:
        elapsed = time.time() - start
        progress = max(step / args.steps, elapsed / budget_s)
        if progress >= 1.0:
            break
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for g in opt.param_groups:
            g["lr"] = lr
        t0 = time.time()
        b = make_batch(rng, args.batch, args.p_drop)
        x0 = b["x0"]
        sigma = sample_sigmas(gen, args.batch, config.SHIFT)
        eps = torch.randn(x0.shape, generator=gen)
        s = sigma.view(-1, 1, 1, 1, 1)
        xt = (1.0 - s) * x0 + s * eps
        inp = torch.cat([xt, coords.expand(args.batch, -1, -1, -1, -1)], dim=1)
        out = model(inp, sigma * 1000.0, b["context"])
        w = 1.0 + args.object_weight * b["mask"][:, None]
        loss = (w * (out - (eps - x0)) ** 2).mean() / w.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        d = min(args.ema, (1.0 + step) / (10.0 + step))
        with torch.no_grad():
            for k, v in model.state_dict().items():
                ema[k].mul_(d).add_(v.detach(), alpha=1.0 - d)
        dt = time.time() - t0
        losses.append(float(loss.detach()))
        if auto_threads:
            # Every 300 steps spend 10 steps on the other thread count; keep whichever is faster.
            step_times[threads].append(dt)
            phase = step % 300
            if phase == 290 or phase == 0:
                if phase == 0 and len(step_times[1]) >= 5 and len(step_times[2]) >= 5:
                    best = min((1, 2), key=lambda n: float(np.median(step_times[n][-10:])))
                    threads = best
                elif phase == 290:
                    threads = 3 - threads
                torch.set_num_threads(threads)
        if step % 25 == 0:
            rec = {"step": step, "min": round((time.time() - start) / 60, 2), "loss": round(float(np.mean(losses)), 5),
                   "lr": round(lr, 7), "s_per_step": round(dt, 3), "threads": threads}
            losses.clear()
            log.write(json.dumps(rec) + "\n")
            log.flush()
            print(rec, flush=True)
        if time.time() - last_ckpt >= args.ckpt_minutes * 60:
            save_weights(ema, args.out, {**meta_base, "steps": step,
                                         "minutes": round((time.time() - start) / 60, 2), "final": False})
            last_ckpt = time.time()
    save_weights(ema, args.out, {**meta_base, "steps": step, "minutes": round((time.time() - start) / 60, 2),
                                 "final": True})
    print(f"done: {step} steps in {(time.time() - start) / 60:.1f} min -> {args.out}", flush=True)


if __name__ == "__main__":
    main()
