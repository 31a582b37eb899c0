#!/usr/bin/env python
"""Cache hits side by side: what a hit costs and how it looks, per reuse variant, on the embedded model.

    .host/venv/bin/python scripts/bench/bench_hits.py --warm 8 --queries 24 \\
        --variant "before:kv_context=False;first_dense=1;last_dense=1;mask_iou_same=1.01;x0_object_fraction=0" \\
        --variant "after:" --json artifacts/hits.json

One process: a warm set of dense requests is written to a cache (``lab.pairs.embedded_warm_set``), then queries
derived from them by one controlled change each (``lab.pairs.embedded_queries``: paraphrase, colour, size,
position, motion, background, object, reseed; same seed with probability ``--p-same-seed``). Each query is served
once as serving does (``request.serve``: probe, signature, retrieval, dense resume = the reference clip), then
reused from *its source entry* (forced as accepted, as the pairs labelling does) under every ``--variant``
(``ReuseConfig`` fields, ``name:field=value;...``), each with the same probe. Per hit: the counter-based compute
fraction (``RunReport.compute_fraction``, probe included), active fraction, the checker verdicts against the dense
clip (unsafe: an attribute dense passes and the hit fails; gain: the reverse), and ``lab.metrics.clip_quality``
(PSNR/SSIM over the clip and the background, off-pixel fraction, artifact score). The artifact score's reference
is the spread over dense clips of the same prompt with ``--ref-seeds`` other seeds plus the query's own; the
closeness reference of a same-seed paraphrase is the PSNR between its dense clip and the source entry's (two dense
wordings). Summaries are medians per (variant, kind). Nothing here is timed: compute is counted. ``--easycache``
runs all of it on the EasyCache-patched model (Carnator + EasyCache against EasyCache alone, as E-attempts label).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import conftest  # noqa: E402  (registers the `carnator` package, puts ComfyUI on sys.path)

conftest.ensure_comfy_importable()

import numpy as np  # noqa: E402
import torch  # noqa: E402


def parse_variant(text: str):
    from carnator.carnator_core.lab.pairs import reuse_config_from

    name, _, body = text.partition(":")
    try:
        return name, reuse_config_from([item for item in body.split(";") if item])
    except ValueError as exc:
        raise SystemExit(f"--variant {text!r}: {exc}") from None


def med(xs):
    v = [float(x) for x in xs if x is not None and math.isfinite(float(x))]
    return round(float(np.median(v)), 4) if v else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warm", type=int, default=8)
    ap.add_argument("--queries", type=int, default=24)
    ap.add_argument("--seed", type=int, default=15)
    ap.add_argument("--kinds", default="paraphrase,colour,size,position,motion,background,object,reseed")
    ap.add_argument("--p-same-seed", type=float, default=0.75)
    ap.add_argument("--ref-seeds", type=int, default=2)
    ap.add_argument("--variant", action="append", default=[], help="name:field=value;... (ReuseConfig)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--probe-steps", type=int, default=None,
                    help="probe length of every request (default: the embedded model's stock probe)")
    ap.add_argument("--weights", type=Path, default=None, help="embedded weights (default: the shipped ones)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--png", type=Path, default=None, help="write dense | hit | |diff| frames of each hit here")
    ap.add_argument("--easycache", default="", metavar="THRESHOLD,START,END",
                    help="run everything (warm entries, dense references, artifact references, hits) on the model "
                         "patched by ComfyUI's EasyCache node with these settings, as make_pairs.py --easycache "
                         "labels Carnator + EasyCache against EasyCache alone (e.g. 0.2,0.15,0.95)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from carnator.carnator_core import reuse
    from carnator.carnator_core.cache.store import Store
    from carnator.carnator_core.embedded import checker, comfy_glue
    from carnator.carnator_core.lab import metrics as M, pairs
    from carnator.carnator_core.request import serve
    from carnator.carnator_core.types import Decision

    variants = [parse_variant(v) for v in (args.variant or ["default:"])]
    tmp = Path(tempfile.mkdtemp(prefix="carnator-hits-"))
    store = Store.open(tmp / "cache", key_path=tmp / "key")
    try:
        easy = pairs.parse_easycache(args.easycache)
    except ValueError as exc:
        raise SystemExit(f"--easycache: {exc}") from None
    ctx = pairs.embedded_context(store, args.weights, easycache=easy)
    if args.probe_steps is not None:  # warm entries, queries and hits all probe this long
        ctx = dataclasses.replace(ctx, options=dataclasses.replace(
            ctx.options, probe=dataclasses.replace(ctx.options.probe, probe_steps=args.probe_steps)))
    frame = pairs.embedded_frame(comfy_glue.model_version(ctx.model).name)  # scenes in the weights' geometry
    warm, scenes = pairs.embedded_warm_set(args.seed, args.warm, frame)
    entry = {}
    dense_clip_of = {}
    for w in warm:
        eid, res = pairs.warm_entry(ctx, w)
        entry[w.request_id] = eid
        dense_clip_of[w.request_id] = ctx.decode(res.latent["samples"])
    queries = pairs.embedded_queries(args.seed, args.queries, warm, scenes, kinds=args.kinds.split(","),
                                     p_same_seed=args.p_same_seed, frame=frame)
    verdicts = lambda clip, prompt: pairs._verdicts(checker.check(clip, prompt))  # noqa: E731
    rows = []
    serve_opts = dataclasses.replace(ctx.options, method="never", write=False)
    if any(cfg.probe_context for _, cfg in variants):  # the probe keeps its keys/values for those variants
        serve_opts = dataclasses.replace(serve_opts, probe=dataclasses.replace(serve_opts.probe, context_kv_mb=256.0))
    for q in queries:
        pos, neg = ctx.encode(q.prompt), ctx.negative()
        res = serve(ctx.model, ctx.text_encoder, pos, neg, ctx.latent, ctx.spec(q), ctx.store, serve_opts)
        dense = ctx.decode(res.latent["samples"])
        bg = M.background_mask(dense, q.prompt)
        ref_scores = [M.artifact_score(dense, bg)]
        for j in range(args.ref_seeds):
            g = comfy_glue.generate([q.prompt], seed=(q.seed + 7919 * (j + 1)) % (2 ** 31), model=ctx.model)
            ref_scores.append(M.artifact_score(g.clips[0].numpy(), bg))
        d_ver = verdicts(dense, q.prompt)
        src_eid = entry[q.source]
        cand = next((c for c in res.candidates.items if c.entry_id == src_eid), None)
        if cand is None:  # the source was not recalled (top-K): label it anyway, as a forced candidate
            from carnator.carnator_core.types import Candidate

            e = ctx.store.load(src_eid, count_hit=False)
            cand = Candidate(src_eid, 0.0, e.prompt, e.signature, e.seed)
        cached = ctx.store.load(src_eid, count_hit=False).cached_run()
        same_seed = next(w for w in warm if w.request_id == q.source).seed == q.seed
        kind = q.kind + ("" if q.kind in ("reseed", "repeat") else (":same-seed" if same_seed else ":new-seed"))
        wordings_psnr = M.psnr(dense_clip_of[q.source], dense)
        for name, cfg in variants:
            dec = Decision(True, cand, (), "signature", summary="bench_hits: source forced as accepted")
            samples, rep = reuse.sample(ctx.model, pos, neg, ctx.latent, res.probe, dec, cached, cfg,
                                        target_signature=res.signature, record=False)
            clip = ctx.decode(samples)
            r_ver = verdicts(clip, q.prompt)
            broken = sorted(a for a, ok in d_ver.items() if ok and not r_ver.get(a, False))
            gained = sorted(a for a, ok in d_ver.items() if not ok and r_ver.get(a, False))
            qual = M.clip_quality(clip, dense, bg)
            row = {"variant": name, "query": q.request_id, "kind": kind, "prompt": q.prompt, "seed": q.seed,
                   "source_prompt": cand.prompt, "compute": rep.compute_fraction, "active": rep.active_fraction,
                   "token_fraction": rep.token_fraction, "unsafe": bool(broken), "gain": bool(gained),
                   "broken": broken, "wordings_psnr": wordings_psnr, "artifact_ref": ref_scores,
                   "inside_spread": bool(qual["artifact"] <= max(ref_scores)), **qual}
            rows.append(row)
            print(f"{q.request_id} {kind:22s} {name:10s} compute={rep.compute_fraction:.2f} "
                  f"active={rep.active_fraction:.2f} psnr={qual['psnr']:.1f} bg={qual['psnr_bg']:.1f} "
                  f"art={qual['artifact']:.2f} ref={min(ref_scores):.2f}-{max(ref_scores):.2f} "
                  f"{'UNSAFE ' + ','.join(broken) if broken else ''}", flush=True)
            if args.png is not None:
                from PIL import Image

                args.png.mkdir(parents=True, exist_ok=True)
                diff = np.repeat(np.abs(clip - dense).max(-1, keepdims=True), 3, -1)
                img = np.concatenate([np.concatenate(list(x), 1) for x in (dense, clip, np.clip(2 * diff, 0, 1))], 0)
                Image.fromarray((img * 255).astype(np.uint8)).save(args.png / f"{q.request_id}_{name}.png")
    summary = {}
    for name, _ in variants:
        vrows = [r for r in rows if r["variant"] == name]
        groups = {"ALL non-repeat": vrows, **{k: [r for r in vrows if r["kind"] == k]
                                              for k in sorted({r["kind"] for r in vrows})}}
        summary[name] = {k: {"n": len(g), "compute": med(r["compute"] for r in g),
                             "active": med(r["active"] for r in g), "psnr": med(r["psnr"] for r in g),
                             "psnr_bg": med(r["psnr_bg"] for r in g), "ssim_bg": med(r["ssim_bg"] for r in g),
                             "off_frac": med(r["off_frac"] for r in g), "artifact": med(r["artifact"] for r in g),
                             "inside_spread": sum(r["inside_spread"] for r in g),
                             "unsafe": sum(r["unsafe"] for r in g), "gain": sum(r["gain"] for r in g),
                             "wordings_psnr": med(r["wordings_psnr"] for r in g)}
                         for k, g in groups.items() if g}
    print(json.dumps(summary, indent=1))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "variants": {n: dataclasses.asdict(c) for n, c in variants},
                                         "summary": summary, "rows": rows}, indent=1, default=str))
    store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
