#!/usr/bin/env python
"""A partial hit's cost against its compute estimate, and where the difference goes, on the embedded model.

    OMP_NUM_THREADS=1 .host/venv/bin/python scripts/bench/profile_hit.py --threads 1 --rounds 3 \
        --json artifacts/profile_hit.json [--profile cprofile|torch] [--workload-seed 0]

One process: the workload's warm set (scripts/bench/workload.py flags) served dense into one store that stays frozen,
then every stream request the shipped rule serves as a hit that recomputes a region is served ``--rounds`` times,
each time beside its dense twin (KSampler path), the two in an order alternating per round. Per hit: the sampler's
compute estimate (``RunReport.compute_fraction``), the measured t_hit / t_dense (medians over rounds) and their ratio,
and the hit's time split into what the request path reports (text encoding, probe, signature, retrieval, filter,
resume) with the resume's model calls split into dense (replayed probe calls excluded) and restricted ones.
``--profile`` profiles the last round's hits (cProfile's cumulative top, or torch.profiler's operator table), with
one torch thread this says where a restricted call's time goes. The machine's load is recorded per round.
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

import bench_table1 as T  # noqa: E402
from workload import add_workload_args, spec_from_args  # noqa: E402


def write_strip(env: Any, folder: Path, rid: str, dense: Any, hit: Any) -> dict[str, Any]:
    """Decode a hit and its dense twin (evaluation only, not timed) and write dense | hit | 2 x |diff| frames."""
    import numpy as np
    from PIL import Image

    from carnator.carnator_core.lab import metrics as M

    d, h = env.dec.decode_clips(dense)[0].numpy(), env.dec.decode_clips(hit)[0].numpy()
    folder.mkdir(parents=True, exist_ok=True)
    diff = np.repeat(np.abs(h - d).max(-1, keepdims=True), 3, -1)
    img = np.concatenate([np.concatenate(list(x), 1) for x in (d, h, np.clip(2 * diff, 0, 1))], 0)
    path = folder / f"{rid}.png"
    Image.fromarray((np.clip(img, 0, 1) * 255).astype(np.uint8)).save(path)
    return {"png": str(path), "psnr_vs_dense": round(float(M.psnr(h, d)), 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(ap)
    ap.add_argument("--rule", default=str(T.DEFAULT_RULE))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per hit (after one untimed warm-up round)")
    ap.add_argument("--requests", default="", help="comma-separated stream ids (default: every restricted hit)")
    ap.add_argument("--profile", choices=("", "cprofile", "torch"), default="")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--compare-chain", action="store_true",
                    help="also serve each hit with comfy_patch.CHAIN_RESTRICTED_BLOCKS off (the per-block gather and "
                         "scatter), in the same rounds, and check that both give the same latent")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--png", type=Path, default=None,
                    help="write each hit's frames beside its dense twin's here (rows: dense | hit | 2 x |diff|), with "
                         "the PSNR of the hit against the twin")
    args = ap.parse_args(argv)

    from carnator.carnator_core.embedded.model import ensure_comfy_importable

    ensure_comfy_importable()
    import torch

    torch.set_num_threads(args.threads)
    import comfy.ldm.wan.model as wan

    from carnator.carnator_core import comfy_patch as cp
    from carnator.carnator_core.lab.workload import build_workload

    wl = build_workload(spec_from_args(args))
    out: dict[str, Any] = {"machine": T.machine(), "args": {k: str(v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory(prefix="carnator-profile-hit-") as tmp:
        env, rule, status, warm = T.frozen_stream_setup(args, Path(tmp), wl)
        opts = T.serve_options("carnator", rule, 0.9, env, False)
        # Pick the restricted hits (an untimed pass; the cache is frozen, so decisions repeat).
        wanted = set(filter(None, args.requests.split(",")))
        hits = []
        for req in wl.stream:
            if wanted and req.rid not in wanted:
                continue
            _, _, res = T.run_request(env, "carnator", req, warm, opts)
            rep = res.report
            if rep.decision == "hit" and rep.mode not in ("exact", "node_cache") and rep.model_calls > 0:
                hits.append((req, rep))
        print(f"{len(hits)} restricted hits: {[r.rid for r, _ in hits]}", flush=True)

        dm = env.model.model.diffusion_model
        n_tokens = None
        calls: dict[str, list[float]] = collections.defaultdict(list)
        state = {"subset": False}
        forward, block_forward = dm.forward, wan.WanAttentionBlock.forward

        def timed_forward(*a, **k):
            state["subset"] = False
            t0 = time.perf_counter()
            y = forward(*a, **k)
            calls["restricted" if state["subset"] else "dense"].append(time.perf_counter() - t0)
            return y

        def timed_block(self, x, *a, **k):
            if n_tokens is not None and x.shape[1] < n_tokens:
                state["subset"] = True
            return block_forward(self, x, *a, **k)

        from carnator.carnator_core.embedded import config as ecfg

        g = ecfg.TOKEN_GRID
        n_tokens = g[0] * g[1] * g[2]
        rows = []
        prof_text = []
        for req, rep0 in hits:
            t_hit, t_dense, timings, per_call = [], [], collections.defaultdict(list), collections.defaultdict(list)
            t_off, same = [], []
            loads = []
            methods = ["dense", "carnator"] + (["carnator_nochain"] if args.compare_chain else [])
            for rnd in range(args.rounds + 1):
                order = methods[rnd % len(methods):] + methods[:rnd % len(methods)]
                loads.append(round(os.getloadavg()[0], 2))
                outs = {}
                for m in order:
                    if m == "dense":
                        outs[m], sec, _ = T.run_request(env, "dense", req, None, None)
                        if rnd:
                            t_dense.append(sec)
                        continue
                    if m == "carnator_nochain":
                        cp.CHAIN_RESTRICTED_BLOCKS = False
                        try:
                            outs[m], sec, _ = T.run_request(env, "carnator", req, warm, opts)
                        finally:
                            cp.CHAIN_RESTRICTED_BLOCKS = True
                        if rnd:
                            t_off.append(sec)
                        continue
                    calls.clear()
                    dm.forward, wan.WanAttentionBlock.forward = timed_forward, timed_block
                    prof = None
                    if args.profile and rnd == args.rounds:
                        prof = cProfile.Profile() if args.profile == "cprofile" else torch.profiler.profile(
                            activities=[torch.profiler.ProfilerActivity.CPU])
                        prof.enable() if args.profile == "cprofile" else prof.__enter__()
                    try:
                        outs[m], sec, res = T.run_request(env, "carnator", req, warm, opts)
                    finally:
                        if prof is not None:
                            if args.profile == "cprofile":
                                prof.disable()
                            else:
                                prof.__exit__(None, None, None)
                        dm.forward, wan.WanAttentionBlock.forward = forward, block_forward
                    if prof is not None:
                        if args.profile == "cprofile":
                            s = io.StringIO()
                            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(args.top)
                            prof_text.append(f"== {req.rid}\n" + s.getvalue())
                        else:
                            prof_text.append(f"== {req.rid}\n" + prof.key_averages().table(
                                sort_by="self_cpu_time_total", row_limit=args.top))
                    if rnd:
                        t_hit.append(sec)
                if args.png is not None and rnd == args.rounds:
                    row_png = write_strip(env, args.png, req.rid, outs["dense"], outs["carnator"])
                if "carnator_nochain" in outs:
                    same.append(bool(torch.equal(outs["carnator"], outs["carnator_nochain"])))
                if rnd:
                    for k, v in res.timings_ms.items():
                        timings[k].append(float(v))
                    for k in ("dense", "restricted"):
                        per_call[k + "_n"].append(len(calls[k]))
                        per_call[k + "_s"].append(sum(calls[k]))
            rep = res.report
            med = statistics.median
            meas = med(t_hit) / med(t_dense)
            row = {"rid": req.rid, "kind": req.kind, "active_fraction": round(rep.active_fraction, 4),
                   "token_fraction": round(rep.token_fraction, 4), "compute_estimate": round(rep.compute_fraction, 4),
                   "t_hit_s": round(med(t_hit), 4), "t_dense_s": round(med(t_dense), 4),
                   "measured": round(meas, 4), "measured_over_estimate": round(meas / rep.compute_fraction, 3),
                   "timings_ms": {k: round(med(v), 1) for k, v in timings.items()},
                   "dense_calls": med(per_call["dense_n"]), "dense_calls_s": round(med(per_call["dense_s"]), 4),
                   "restricted_calls": med(per_call["restricted_n"]),
                   "restricted_calls_s": round(med(per_call["restricted_s"]), 4), "load1": loads}
            if args.png is not None:
                row.update(row_png)
            if t_off:
                row.update({"t_hit_nochain_s": round(med(t_off), 4),
                            "measured_nochain": round(med(t_off) / med(t_dense), 4),
                            "nochain_over_estimate": round(med(t_off) / med(t_dense) / rep.compute_fraction, 3),
                            "chain_speedup": round(med(t_off) / med(t_hit), 3), "same_latent": all(same)})
            rows.append(row)
            print(json.dumps(row), flush=True)
        warm.close()
    out["rule"] = status
    out["hits"] = rows
    if rows:
        ratios = [r["measured_over_estimate"] for r in rows]
        out["summary"] = {"hits": len(rows), "measured_over_estimate_median": statistics.median(ratios),
                          "max": max(ratios), "min": min(ratios)}
        if args.compare_chain:
            off = [r["nochain_over_estimate"] for r in rows]
            out["summary"].update({"nochain_over_estimate_median": statistics.median(off),
                                   "chain_speedup_median": statistics.median(r["chain_speedup"] for r in rows),
                                   "same_latent": all(r["same_latent"] for r in rows)})
        print(json.dumps(out["summary"]))
    out["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    for t in prof_text:
        print(t)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**out, "profile": prof_text}, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
