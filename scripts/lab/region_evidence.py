#!/usr/bin/env python
"""Why a reuse region is as large as it is: the evidence behind ``reuse.active_region``, term by term.

    .host/venv/bin/python scripts/lab/region_evidence.py [--weights W] [--pairs N] [--seed S] [--reuse-set F=V ...]

Draws same-seed request pairs from the embedded world the way the pairs labelling does (a warm request and a
query derived from it by one change of each kind), runs the Early Probe on both (default config), and reports per
kind the median share of the tokens each term of the region activates on its own:

* ``x0``        tokens where the x0 predictions at step k disagree (``x0_threshold`` × median magnitude);
* ``masks``     objects whose masks moved (IoU < ``mask_iou_same``) — their symmetric difference, or the whole
                support with ``whole_objects``;
* ``x0_obj``    objects activated whole because x0 disagrees over ≥ ``x0_object_fraction`` of them;
* ``recolour``  objects activated whole because their colour moved > ΔE 8;
* ``motion``    objects activated whole because their mask's drift over the clip differs (``motion_shift``);
* ``no_x0_undilated`` the region without the x0 terms, before dilation (masks, colours, changed-background
                cells: median object-free cell ΔE > ``context_delta``);
* ``region``    the region itself (``active_region``, after dilation) — what the sampler recomputes;
* ``drift``     the largest difference, over the objects both requests have, of the mask's first-to-last-frame
                centroid drift (``reuse.mask_displacement``), as a fraction of the frame side: what
                ``motion_shift`` thresholds.

Also the median x0 disagreement ratio (per-token |Δx0| / median |x0|) on the background, which says whether the
x0 threshold sits above the model's wording-to-wording jitter. Offline tooling: imports ComfyUI.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import conftest  # noqa: E402  (registers the `carnator` package; knows where the host's ComfyUI is)


def terms(target, cached, tx0: np.ndarray, cx0: np.ndarray, patch, config) -> dict[str, float]:
    """Token share of each evidence term alone (``reuse.region_terms``, what ``reuse.active_region`` composes)."""
    from carnator.carnator_core import reuse as R

    rt = R.region_terms(target, cached, tx0, cx0, patch, config)
    n = float(rt.x0.size)
    region = R.active_region(target, cached, tx0, cx0, patch, config)
    masks = (rt.moved_whole if config.whole_objects else rt.moved) | rt.new_objects
    no_x0 = rt.compose(config, with_x0=False)  # masks, colours and the changed-background cells, undilated
    bg = ~rt.objects
    side = float(max(target.grid[1], target.grid[2]))
    drifts = [0.0]
    for obj in target.objects:
        other = cached.get(obj.name)
        if other is None:
            continue
        d = R.drift_difference(R.object_support(obj.mask, config.mask_threshold),
                               R.object_support(other.mask, config.mask_threshold))
        if d is not None:
            drifts.append(d / side)
    return {"drift": max(drifts), "x0": rt.x0.sum() / n, "masks": masks.sum() / n, "x0_obj": rt.x0_objects.sum() / n,
            "recolour": rt.recoloured.sum() / n, "motion": rt.motion.sum() / n,
            "no_x0_undilated": no_x0.sum() / n, "region": region.sum() / n,
            "x0_ratio_bg_median": float(np.median(rt.x0_ratio[bg])) if bg.any() else float("nan"),
            "x0_ratio_bg_p90": float(np.quantile(rt.x0_ratio[bg], 0.9)) if bg.any() else float("nan")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", type=Path, default=None)
    ap.add_argument("--pairs", type=int, default=6, help="pairs per kind")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default="paraphrase,colour,size,position,motion,object")
    ap.add_argument("--reuse-set", action="append", default=[], metavar="FIELD=VALUE")
    ap.add_argument("--any-seed", action="store_true",
                    help="also pairs whose query drew a new seed (default: same-seed pairs only)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    conftest.ensure_comfy_importable()
    import torch

    torch.set_num_threads(max(1, args.threads))
    from carnator.carnator_core.embedded import comfy_glue, config as ecfg
    from carnator.carnator_core.lab import pairs
    from carnator.carnator_core.probe import ProbeConfig
    from carnator.carnator_core.request import RequestSpec, probe_request, signature_stage

    reuse = pairs.reuse_config_from(args.reuse_set)
    model, enc, _ = comfy_glue.load_embedded(args.weights)
    ver = comfy_glue.model_version(model)
    version = ver.name
    latent = comfy_glue.empty_latent(1, version)
    patch = tuple(model.model.diffusion_model.patch_size)
    kinds = [k for k in args.kinds.split(",") if k]
    frame = pairs.embedded_frame(version)
    warm, scenes = pairs.embedded_warm_set(args.seed, 4 * args.pairs, frame)
    queries = pairs.embedded_queries(args.seed, 12 * args.pairs * len(kinds), warm, scenes, kinds=tuple(kinds),
                                     p_same_seed=0.5 if args.any_seed else 1.0, frame=frame)
    by_id = {w.request_id: w for w in warm}
    cfg = ProbeConfig(probe_steps=ecfg.DEFAULT_PROBE_STEP)
    cache: dict[tuple[str, int], tuple] = {}

    def probe_of(prompt: str, seed: int):
        if (prompt, seed) not in cache:
            spec = RequestSpec(prompt=prompt, seed=seed, steps=ecfg.DEFAULT_STEPS, cfg=ver.cfg)
            p = probe_request(model, enc.encode(prompt), enc.encode(""), latent, spec, cfg, enc)
            sig, _ = signature_stage(p)
            cache[(prompt, seed)] = (sig, p.x0_probe.float().numpy())
        return cache[(prompt, seed)]

    rows: dict[str, list[dict]] = defaultdict(list)
    for q in queries:
        if len(rows[q.kind]) >= args.pairs or q.source not in by_id:
            continue
        src = by_id[q.source]
        if q.seed != src.seed and not args.any_seed:
            continue
        ts, tx = probe_of(q.prompt, q.seed)
        cs, cx = probe_of(src.prompt, src.seed)
        t = terms(ts, cs, tx, cx, patch, reuse)
        rows[q.kind].append(t)
        print(f"{q.kind:>10} " + " ".join(f"{k}={v:.2f}" for k, v in t.items()) + f"  | {q.prompt}", flush=True)
    summary = {k: {name: round(statistics.median(r[name] for r in rs), 3) for name in rs[0]}
               for k, rs in rows.items() if rs}
    for k, rs in rows.items():  # the drift's spread per kind: where a motion_shift threshold separates kinds
        if rs:
            summary[k]["drift_max"] = round(max(r["drift"] for r in rs), 3)
            summary[k]["drift_min"] = round(min(r["drift"] for r in rs), 3)
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
