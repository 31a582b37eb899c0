"""Joint Reuse Sampler speed, side by side in one process (a benchmark, not a test).

Builds a random-weight ComfyUI WanModel (saved and loaded back through ComfyUI's detection) at a realistic
token count, runs one dense request (which records the attention block structure), then serves a second
request (another seed) as a cache hit with a given active fraction, in each mode: dense, latent, attention,
joint. Reports per-step (one model call) and per-request times, medians of --repeats runs, with the active
fraction, the recorded block density and the counters of what was computed. Every stage the sampler runs is
inside the timed region (probe replay, masking, subset gathering, block-sparse attention).

``--model embedded`` runs the same comparison on the shipped embedded model (its real text conditioning, its
latent geometry and default 20 steps / probe 4 unless given) instead of a random-weight Wan.

Usage (from the repo root, host python):
    .host/venv/bin/python scripts/bench/bench_reuse.py --latent 16,21,30,52 --dim 256 --layers 6 --steps 10 --probe 2
    .host/venv/bin/python scripts/bench/bench_reuse.py --model embedded --repeats 5
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import conftest  # noqa: E402  (registers the `carnator` package, puts ComfyUI on sys.path)

conftest.ensure_comfy_importable()

import numpy as np  # noqa: E402
import torch  # noqa: E402


def build_model(dim: int, layers: int, tmp: Path):
    import comfy.ops
    import comfy.sd
    import tiny_models as tm
    from comfy.ldm.wan.model import WanModel
    from safetensors.torch import save_file

    m = WanModel(model_type="t2v", in_dim=16, dim=dim, ffn_dim=dim * 4, num_heads=dim // 128, num_layers=layers,
                 out_dim=16, operations=comfy.ops.disable_weight_init)
    tm._fill_(m, 0)
    path = tmp / "bench_wan.safetensors"
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(path))
    return comfy.sd.load_diffusion_model(str(path))


def box_signature(grid, frac: float, shift: int = 0):
    from carnator.carnator_core.types import ObjectSignature, Signature

    T, H, W = grid
    mask = np.zeros(grid, np.float32)
    side_h = max(1, int(round(H * np.sqrt(frac))))
    side_w = max(1, int(round(W * np.sqrt(frac))))
    mask[:, :side_h, shift: shift + side_w] = 1.0
    return Signature((ObjectSignature("ball", mask, float(mask.mean()), (50.0, 20.0, 20.0)),),
                     np.zeros((4, 4, 3), np.float32), grid)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("wan", "embedded"), default="wan",
                    help="random-weight Wan of --dim/--layers at --latent, or the shipped embedded model")
    ap.add_argument("--latent", default="16,21,30,52")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--steps", type=int, default=None, help="default: 10 (wan) / the embedded default (20)")
    ap.add_argument("--probe", type=int, default=None, help="default: 2 (wan) / the embedded default (4)")
    ap.add_argument("--active", type=float, default=0.25, help="target active fraction of the cache hit")
    ap.add_argument("--block-size", type=int, default=None, help="default: 128 (wan) / 16 (embedded, 256 tokens)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="dense,latent,attention,joint")
    ap.add_argument("--json", default="")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (1 when another job uses a core)")
    ap.add_argument("--variant", action="append", default=[],
                    help="name:field=value;... an extra hit row: joint mode with these ReuseConfig fields (as "
                         "scripts/bench/bench_hits.py), e.g. 'pkv1:probe_context=1;refreshes=1'; with probe_context "
                         "the "
                         "probe keeps its keys/values (ProbeConfig.context_kv_mb), and its copy is timed in the probe")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    from bench_hits import parse_variant

    variants = [parse_variant(v) for v in args.variant]
    import tiny_models as tm

    from carnator.carnator_core import reuse
    from carnator.carnator_core.probe import ProbeConfig, run_probe
    from carnator.carnator_core.types import Candidate, Decision

    if args.model == "embedded":
        from carnator.carnator_core.embedded import comfy_glue, config as ecfg

        model, te, _dec = comfy_glue.load_embedded()
        prompt = "a big red ball sits still in the middle, on green grass"
        pos, neg = te.encode(prompt), te.encode("")
        shape = tuple(int(x) for x in ecfg.LATENT_SHAPE)
        args.steps = args.steps or ecfg.DEFAULT_STEPS
        args.probe = args.probe or ecfg.DEFAULT_PROBE_STEP
        args.block_size = args.block_size or 16
        cfg_scale = float(ecfg.DEFAULT_CFG)
        args.dim, args.layers = ecfg.DIM, ecfg.NUM_LAYERS
    else:
        shape = tuple(int(x) for x in args.latent.split(","))
        with tempfile.TemporaryDirectory() as tmp:
            model = build_model(args.dim, args.layers, Path(tmp))
        pos, neg = tm.conditioning("wan21")
        prompt = "a ball"
        args.steps = args.steps or 10
        args.probe = args.probe or 2
        args.block_size = args.block_size or 128
        cfg_scale = 5.0
    lat = {"samples": torch.zeros((1,) + shape)}
    kw = dict(steps=args.steps, cfg=cfg_scale, sampler_name="euler", scheduler="simple", prompt=prompt, objects=(),
              object_source="none", config=ProbeConfig(probe_steps=args.probe))
    cfg = reuse.ReuseConfig(mode="dense", block_size=args.block_size, x0_threshold=1e9, dilation=0,
                            context_margin_blocks=1)
    extra = {name: dataclasses.replace(cfg, **{f.name: getattr(v, f.name) for f in dataclasses.fields(v)
                                               if getattr(v, f.name) != getattr(reuse.ReuseConfig(), f.name)},
                                       mode="joint")
             for name, v in variants}
    kv_kw = dict(kw, config=ProbeConfig(probe_steps=args.probe, context_kv_mb=4096.0))
    t0 = time.perf_counter()
    probe_a = run_probe(model, pos, neg, lat, seed=1, **kw)
    final_a, rep_a = reuse.sample(model, pos, neg, lat, probe_a, None, None, cfg)
    warm_s = time.perf_counter() - t0
    grid = probe_a.grid
    n_tokens = int(np.prod(grid))
    sig_cached = box_signature(grid, args.active / 2)
    sig_target = box_signature(grid, args.active / 2, shift=max(1, int(grid[2] * np.sqrt(args.active / 2))))
    cached = reuse.CachedRun("bench", final_a[0], probe_a.x0_probe, sig_cached, rep_a.block_structure)
    decision = Decision(True, Candidate("bench", 0.99, "a ball", sig_cached), (), "signature")
    probe_b = run_probe(model, pos, neg, lat, seed=2, **kw)
    probe_kv = run_probe(model, pos, neg, lat, seed=2, **kv_kw) if any(
        c.probe_context for c in extra.values()) else None
    if probe_kv is not None and probe_kv.context_kv is None:
        raise SystemExit("the probe's keys/values did not fit in 4096 MiB")
    results: dict[str, dict] = {}
    modes = args.modes.split(",") + list(extra)
    for r in range(args.repeats):
        for mode in modes:
            c = extra.get(mode) or reuse.ReuseConfig(**{**cfg.__dict__, "mode": mode})
            t = time.perf_counter()
            if mode in extra:
                out, rep = reuse.sample(model, pos, neg, lat, probe_kv if c.probe_context else probe_b, decision,
                                        cached, c, target_signature=sig_target)
            elif mode == "dense":
                out, rep = reuse.sample(model, pos, neg, lat, probe_b, None, None, c, record=False)
            else:
                out, rep = reuse.sample(model, pos, neg, lat, probe_b, decision, cached, c, target_signature=sig_target)
            dt = time.perf_counter() - t
            res = results.setdefault(mode, {"resume_s": [], "report": None})
            res["resume_s"].append(dt)
            res["report"] = rep.to_meta()
    probe_ms = probe_b.timings["probe_ms"]
    probe_kv_ms = probe_kv.timings["probe_ms"] if probe_kv is not None else None
    dense_resume = statistics.median(results["dense"]["resume_s"]) if "dense" in results else None
    rows = []
    for mode in modes:
        med = statistics.median(results[mode]["resume_s"])
        rep = results[mode]["report"]
        per_call = med / max(rep["model_calls"], 1)
        # a variant that keeps the probe's keys/values pays for that probe (its copy included)
        p_ms = probe_kv_ms if mode in extra and extra[mode].probe_context else probe_ms
        request_s = p_ms / 1000 + med
        rows.append({
            "mode": mode, "resume_s_median": round(med, 3), "request_s": round(request_s, 3),
            "per_model_call_s": round(per_call, 3),
            "speedup_request": round((probe_ms / 1000 + dense_resume) / request_s, 2) if dense_resume else None,
            "speedup_step": None,
            "active_fraction": round(rep["active_fraction"], 3), "block_density": rep["block_density"],
            "token_fraction": round(rep["token_fraction"], 3),
            "attention_fraction": round(rep["attention_fraction"], 3),
            "model_calls": rep["model_calls"], "compute_fraction_est": round(rep["compute_fraction"], 3),
        })
    dense_step = next((r["per_model_call_s"] for r in rows if r["mode"] == "dense"), None)
    for r in rows:
        if dense_step:
            r["speedup_step"] = round(dense_step / r["per_model_call_s"], 2)
    out = {"model": args.model, "tokens": n_tokens, "grid": grid, "latent": shape, "dim": args.dim,
           "layers": args.layers, "steps": args.steps, "probe_steps": args.probe, "block_size": args.block_size,
           "recorded_density": rep_a.block_structure.density if rep_a.block_structure is not None else None,
           "record_ms": rep_a.timings_ms.get("record"), "dense_resume_ms_with_record": rep_a.timings_ms.get("resume"),
           "probe_ms": round(probe_ms, 1),
           "probe_with_kv_ms": round(probe_kv_ms, 1) if probe_kv_ms is not None else None,
           "variants": {n: dataclasses.asdict(c) for n, c in extra.items()},
           "warm_s": round(warm_s, 1), "repeats": args.repeats, "rows": rows}
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
