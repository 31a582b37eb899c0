#!/usr/bin/env python
"""Where a computing hit's time goes, call by call, beside the same request's dense run.

    .host/venv/bin/python scripts/profile_hit_calls.py [--rounds 2] [--json artifacts/hit_calls.json]

One process, the Table-1 workload (scripts/workload.py flags) and the shipped rule, the warm set served dense
into one store that then stays frozen (as ``scripts/bench_reuse_settings.py``). For every stream request the rule
answers with a hit that computes something, ``--rounds`` times: the dense KSampler run, then the hit, back to back.
Per run it times every model call (the backbone's ``forward_orig``) and, inside the hit's restricted calls, every
transformer block twice: the block itself and Carnator's block patch around it (token gathers, the write-back of
the subset, the context attention's bookkeeping). Printed per request and as medians:

* model calls of the hit by kind -- probe (dense), dense refresh, restricted -- against the dense run's calls;
* a restricted block (tokens in the subset) against a dense block, and the patch's own share;
* the hit's wall time outside its model calls against the dense run's.

Instrumentation wraps ComfyUI's ``WanModel.forward_orig`` and ``WanAttentionBlock.forward`` for this process
only (a measurement, not a serving path); timings are wall clock on a shared CPU, so read ratios and medians.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_table1 as T  # noqa: E402  (registers the `carnator` package; the Table-1 environment and helpers)
from workload import add_workload_args, spec_from_args  # noqa: E402


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(ap)
    ap.add_argument("--rule", default=str(T.DEFAULT_RULE))
    ap.add_argument("--rounds", type=int, default=2, help="dense/hit pairs per computing hit")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=ROOT / "artifacts" / "hit_calls.json")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")

    import torch

    torch.set_num_threads(args.threads)
    wl = T.build_workload(spec_from_args(args))
    tmp = Path(tempfile.mkdtemp(prefix="carnator-hit-calls-"))
    rows: list[dict[str, Any]] = []
    try:
        env, rule, status, warm = T.frozen_stream_setup(args, tmp, wl)
        import comfy.ldm.wan.model as wan

        from carnator.carnator_core import comfy_patch as cp

        calls: list[tuple[float, int, int]] = []  # (seconds, first and end index into ``blocks``)
        blocks: list[tuple[int, float]] = []
        patches: list[float] = []
        forward_orig, block_forward, block_patch = wan.WanModel.forward_orig, wan.WanAttentionBlock.forward, \
            cp._block_patch

        def timed_forward(self, *a, **k):
            t0, b0 = time.perf_counter(), len(blocks)
            out = forward_orig(self, *a, **k)
            calls.append((time.perf_counter() - t0, b0, len(blocks)))
            return out

        def timed_block(self, x, *a, **k):
            t0 = time.perf_counter()
            out = block_forward(self, x, *a, **k)
            blocks.append((int(x.shape[1]), time.perf_counter() - t0))
            return out

        def timed_patch(run, layer, previous):
            patch = block_patch(run, layer, previous)

            def wrapper(a, extra):
                t0 = time.perf_counter()
                out = patch(a, extra)
                patches.append(time.perf_counter() - t0)
                return out
            return wrapper

        wan.WanModel.forward_orig, wan.WanAttentionBlock.forward, cp._block_patch = \
            timed_forward, timed_block, timed_patch
        opts = T.serve_options("carnator", rule, 0.0, env, False)
        hits = []
        for req in wl.stream:
            if req.kind == "exact":
                continue
            _, _, res = T.run_request(env, "carnator", req, warm, opts)
            if res.report.decision == "hit" and res.report.compute_fraction > res.report.steps_probe / \
                    max(res.report.steps_total, 1) + 1e-6:
                hits.append(req)
        print(f"rule {status['summary']}; {len(hits)} computing hits of {len(wl.stream)} stream requests", flush=True)
        for rnd in range(args.rounds):
            for req in hits:
                calls.clear(), blocks.clear()
                _, dense_s, _ = T.run_request(env, "dense", req, None, None)
                d_calls = [t for t, _, _ in calls]
                n_full = max(n for n, _ in blocks)  # the sequence length: a dense run's every block
                d_blocks = [t for n, t in blocks if n == n_full]
                calls.clear(), blocks.clear(), patches.clear()
                _, hit_s, res = T.run_request(env, "carnator", req, warm, opts)
                rep = res.report
                k = rep.steps_probe
                h_calls = [t for t, _, _ in calls]
                # a resumed call is restricted when its blocks ran on a token subset, a dense refresh otherwise
                kinds = ["probe" if i < k else
                         ("restricted" if any(n < n_full for n, _ in blocks[b0:b1]) else "refresh")
                         for i, (_, b0, b1) in enumerate(calls)]
                # The block patch of a restricted block wraps exactly one block call of fewer tokens.
                pairs = [(n, b, p) for (n, b), p in zip(blocks, patches) if n < n_full]
                dense_resume = [t for t, kind in zip(h_calls, kinds) if kind == "refresh"]
                restricted = [t for t, kind in zip(h_calls, kinds) if kind == "restricted"]
                row = {"rid": req.rid, "kind": req.kind, "round": rnd, "tokens": n_full,
                       "compute": rep.compute_fraction,
                       "active": rep.active_fraction, "hit_vs_dense": hit_s / dense_s,
                       "dense_call_ms": 1000 * _med(d_calls), "probe_call_ms": 1000 * _med(h_calls[:k]),
                       "refresh_calls": len(dense_resume), "restricted_calls": len(restricted),
                       "restricted_call_ms": 1000 * _med(restricted),
                       "dense_block_ms": 1000 * _med(d_blocks),
                       "subset_tokens": int(_med([n for n, _, _ in pairs])) if pairs else 0,
                       "restricted_block_ms": 1000 * _med([b for _, b, _ in pairs]),
                       "patch_ms": 1000 * _med([p - b for _, b, p in pairs]),
                       "outside_calls_ms": {"dense": 1000 * (dense_s - sum(d_calls)),
                                            "hit": 1000 * (hit_s - sum(h_calls))}}
                rows.append(row)
                print(json.dumps({k2: (round(v, 3) if isinstance(v, float) else v) for k2, v in row.items()
                                  if k2 != "outside_calls_ms"}) + f" outside calls ms: dense "
                      f"{row['outside_calls_ms']['dense']:.0f}, hit {row['outside_calls_ms']['hit']:.0f}", flush=True)
        warm.close()
        wan.WanModel.forward_orig, wan.WanAttentionBlock.forward, cp._block_patch = \
            forward_orig, block_forward, block_patch
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not rows:
        raise SystemExit("no computing hits on this stream: nothing to profile")
    summary = {
        "hit_vs_dense": _med([r["hit_vs_dense"] for r in rows]),
        "restricted_call_vs_dense_call": _med([r["restricted_call_ms"] / r["dense_call_ms"] for r in rows]),
        "token_share_of_restricted_blocks": _med([r["subset_tokens"] / r["tokens"] for r in rows]),
        "restricted_block_vs_dense_block": _med([r["restricted_block_ms"] / r["dense_block_ms"] for r in rows]),
        "patch_share_of_restricted_block": _med([r["patch_ms"] / (r["restricted_block_ms"] + r["patch_ms"])
                                                 for r in rows]),
        "outside_calls_ms_dense": _med([r["outside_calls_ms"]["dense"] for r in rows]),
        "outside_calls_ms_hit": _med([r["outside_calls_ms"]["hit"] for r in rows]),
    }
    print("medians: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()))
    T.write_stream_report(args.json, wl, status, summary, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
