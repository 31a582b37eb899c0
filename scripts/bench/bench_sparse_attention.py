"""Benchmark block-sparse attention and block-structure recording on the CPU.

Everything is measured side by side in one process: a warm-up round, then ``--repeats`` rounds in which every
variant runs once (round-robin, so load from other processes hits all variants alike); the median and minimum
over rounds are reported.

Attention (per config x sequence length):
  dense            F.scaled_dot_product_attention over all tokens
  dense_active@f   SDPA of the active queries only (fraction f of the tokens) over all keys
  gather@d,f       block_sparse_attention(backend="gather") at block density d with active fraction f
                   (strategy "grouped"; "padded" too at f = 1). Keep pattern: Bernoulli(d) per (head, query
                   block, key block) plus the diagonal. Active region: a centred box covering fraction f of every
                   frame of a (T, H, W) token grid. Index plans are built once per layer and reused across
                   steps, so plan time is reported separately.
Recording: record_block_structure (mean-pooled query; 8 sampled queries; mean-pooled keys) vs one dense call,
and on synthetic local (video-like) attention the recorded density vs the *true* attention mass it keeps.
FlexAttention on CPU (--flex): eager and torch.compile'd flex vs gather at one shape, with compile time.

Usage:
  .host/venv/bin/python scripts/bench/bench_sparse_attention.py                 # full run (~10+ min on 2 cores)
  .host/venv/bin/python scripts/bench/bench_sparse_attention.py --quick         # smoke run (<1 min)
  .host/venv/bin/python scripts/bench/bench_sparse_attention.py --flex --json runs/bench_sparse.json
  # the hit-path kernel at Wan length with Sparse VideoGen-like masks (~5 min on 2 cores)
  .host/venv/bin/python scripts/bench/bench_sparse_attention.py --structured-only --repeats 3 --threads 2

Structured masks (--structured): 32,760 tokens (Wan 2.1 480p x 81 frames: a 21 x 30 x 52 grid), per-head block
patterns as in Sparse VideoGen -- "spatial" heads attend their own frame and `radius` frames either side,
"temporal" heads the same rows (+- radius) in every frame, both plus a local window of blocks -- tuned to block
densities 0.2-0.5. token_block_sparse_attention (the hit path's kernel) over the whole sequence and over a hit's
token subset, next to dense SDPA, the former gather kernel, the former hit path (SDPA with the subset's [S, S]
boolean mask) and unmasked SDPA among the subset.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]


def _import_core():
    """Import carnator_core as package ``carnator`` (as ComfyUI and the tests do) without importing ComfyUI."""
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))
    from repo_package import register_package

    register_package()
    from carnator.carnator_core import sparse_attention

    return sparse_attention


sa = _import_core()

CONFIGS = {"wan": (12, 128), "small": (4, 64)}  # heads x head_dim; Wan 2.1 1.3B: dim 1536 = 12 x 128


def token_grid(n_tokens: int) -> tuple[int, int, int]:
    """A (T, H, W) grid with T*H*W == n_tokens and a video-like aspect (frames of H x W tokens)."""
    table = {4096: (16, 16, 16), 8192: (8, 32, 32), 2048: (8, 16, 16), 1024: (4, 16, 16), 32760: (21, 30, 52)}
    if n_tokens in table:
        return table[n_tokens]
    return (1, 1, n_tokens)


def active_index(grid: tuple[int, int, int], frac: float) -> torch.Tensor:
    """Token positions of a centred box covering ``frac`` of every frame (the active region A), sorted."""
    T, H, W = grid
    if frac >= 1.0:
        return torch.arange(T * H * W)
    side = math.sqrt(frac)
    h, w = max(1, round(H * side)), max(1, round(W * side))
    h0, w0 = (H - h) // 2, (W - w) // 2
    m = torch.zeros(T, H, W, dtype=torch.bool)
    m[:, h0 : h0 + h, w0 : w0 + w] = True
    return m.reshape(-1).nonzero().squeeze(1)


def random_keep(H: int, nb: int, density: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(H, nb, nb, generator=g) < density) | torch.eye(nb, dtype=torch.bool)


def run_round_robin(variants: dict[str, Callable[[], object]], repeats: int) -> dict[str, dict[str, float]]:
    """Warm up every variant once, then `repeats` rounds of one call each; ms median/min per variant."""
    for fn in variants.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {k: {"median_ms": round(statistics.median(v), 2), "min_ms": round(min(v), 2)} for k, v in times.items()}


def bench_attention(config: str, L: int, densities, actives, bs: int, repeats: int, strategies) -> dict:
    H, D = CONFIGS[config]
    g = torch.Generator().manual_seed(L + H)
    q, k, v = (torch.randn(1, H, L, D, generator=g) for _ in range(3))
    nb = sa.n_blocks(L, bs)
    grid = token_grid(L)
    variants: dict[str, Callable[[], object]] = {"dense": lambda: F.scaled_dot_product_attention(q, k, v)}
    meta: dict[str, dict] = {"dense": {"density": 1.0, "active": 1.0}}
    idx = {f: active_index(grid, f) for f in actives}
    for f in actives:
        if f < 1.0:
            qa = q[:, :, idx[f]].contiguous()
            variants[f"dense_active@{f:g}"] = lambda qa=qa: F.scaled_dot_product_attention(qa, k, v)
            meta[f"dense_active@{f:g}"] = {"density": 1.0, "active": len(idx[f]) / L}
    plan_ms = {}
    for d in densities:
        keep = random_keep(H, nb, d, seed=int(d * 1000) + L)
        for f in actives:
            qi = None if f >= 1.0 else idx[f]
            qa = q if qi is None else q[:, :, qi].contiguous()
            for strat in strategies:
                if strat != "grouped" and f < 1.0:
                    continue
                t0 = time.perf_counter()
                plan = sa.plan_block_sparse(keep, bs, L, qi, strategy=strat)
                plan_ms[f"{strat}@{d:g},{f:g}"] = round((time.perf_counter() - t0) * 1e3, 1)
                name = f"gather_{strat}@{d:g},{f:g}"
                variants[name] = lambda qa=qa, qi=qi, keep=keep, plan=plan: sa.block_sparse_attention(
                    qa, k, v, keep, bs, qi, backend="gather", plan=plan
                )
                meta[name] = {"density": round(plan.density, 4), "active": (L if qi is None else len(qi)) / L,
                              "groups": len(plan.groups)}
    res = run_round_robin(variants, repeats)
    dense_ms = res["dense"]["median_ms"]
    for name, r in res.items():
        r.update(meta[name])
        r["speedup_vs_dense"] = round(dense_ms / r["median_ms"], 2)
    return {"config": config, "heads": H, "head_dim": D, "tokens": L, "block_size": bs, "results": res,
            "plan_build_ms": plan_ms}


def structured_qk(H: int, grid, D: int, seed: int = 0, sharp: float = 10.0, sigma: float = 2.0):
    """Synthetic local attention (same construction as tests/test_sparse_attention.py): random Fourier features
    of a Gaussian kernel of width sigma tokens on the (T, H, W) grid, logit ~ sharp * kernel + feature noise."""
    g = torch.Generator().manual_seed(seed)
    T, Hh, W = grid
    pos = torch.stack(torch.meshgrid(torch.arange(T), torch.arange(Hh), torch.arange(W), indexing="ij"), -1)
    pos = pos.reshape(-1, 3).float()
    nf = D // 2
    freqs = torch.randn(H, 3, nf, generator=g) / sigma
    ang = torch.einsum("lc,hcf->hlf", pos, freqs)
    feat = torch.cat([ang.cos(), ang.sin()], -1) * math.sqrt(sharp * math.sqrt(D) / nf)
    q = feat + 0.1 * torch.randn(feat.shape, generator=g)
    k = feat + 0.1 * torch.randn(feat.shape, generator=g)
    return q[None], k[None]


ESTIMATORS = {
    "pooled_q": dict(sample_queries=0),
    "sampled_q4": dict(sample_queries=4),
    "sampled_q8": dict(sample_queries=8),
    "sampled_q16": dict(sample_queries=16),
    "pooled_q_pooled_k": dict(sample_queries=0, key_pooling="mean"),
}


def bench_record_cost(config: str, L: int, bs: int, repeats: int) -> dict:
    H, D = CONFIGS[config]
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, H, L, D, generator=g) for _ in range(3))
    variants = {"dense_attention": lambda: F.scaled_dot_product_attention(q, k, v)}
    for name in ("pooled_q", "sampled_q8", "pooled_q_pooled_k"):
        kw = ESTIMATORS[name]
        variants[f"record_{name}"] = lambda kw=kw: sa.record_block_structure(q, k, bs, mass=0.9, **kw)
    res = run_round_robin(variants, repeats)
    dense = res["dense_attention"]["median_ms"]
    for r in res.values():
        r["fraction_of_dense_call"] = round(r["median_ms"] / dense, 4)
    return {"config": config, "tokens": L, "block_size": bs, "results": res}


def bench_record_accuracy(L: int, bs: int, masses=(0.8, 0.9, 0.95), sharps=(6.0, 10.0, 14.0)) -> list[dict]:
    """Recorded density vs the true attention mass kept (mean and 5th percentile over queries)."""
    H, D = 4, 64
    grid = token_grid(L)
    out = []
    for sharp in sharps:
        q, k = structured_qk(H, grid, D, seed=1, sharp=sharp)
        nb = sa.n_blocks(L, bs)
        tb = torch.zeros(H, L, nb)
        for h in range(H):  # exact per-token attention, one head at a time (L x L)
            p = torch.softmax(q[0, h] @ k[0, h].T / math.sqrt(D), -1)
            tb[h] = F.pad(p, (0, nb * bs - L)).reshape(L, nb, bs).sum(-1)
        oracle = {m: float(sa.select_blocks(tb.reshape(H, nb, bs, nb).mean(2), m).float().mean()) for m in masses}
        for est, kw in ESTIMATORS.items():
            for m in masses:
                keep = sa.record_block_structure(q, k, bs, mass=m, **kw)
                cov = (tb * keep.repeat_interleave(bs, 1)[:, :L]).sum(-1)
                out.append({"sharp": sharp, "estimator": est, "mass": m,
                            "density": round(float(keep.float().mean()), 3), "oracle_density": round(oracle[m], 3),
                            "true_mass_mean": round(float(cov.mean()), 3),
                            "true_mass_p05": round(float(cov.quantile(0.05)), 3)})
    return out


def bench_flex_cpu(config: str, L: int, bs: int, density: float, repeats: int) -> dict:
    H, D = CONFIGS[config]
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, H, L, D, generator=g) for _ in range(3))
    keep = random_keep(H, sa.n_blocks(L, bs), density, seed=5)
    bm = sa.build_flex_block_mask(keep, bs, L)
    plan = sa.plan_block_sparse(keep, bs, L)
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    t0 = time.perf_counter()
    ref = sa.block_sparse_attention(q, k, v, keep, bs, backend="gather", plan=plan)
    t0 = time.perf_counter()
    eager = sa.block_sparse_attention(q, k, v, keep, bs, backend="flex", block_mask=bm, flex_compiled=False)
    eager_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    comp = sa.block_sparse_attention(q, k, v, keep, bs, backend="flex", block_mask=bm, flex_compiled=True)
    compile_s = time.perf_counter() - t0
    err = float((comp - ref).abs().max())
    res = run_round_robin(
        {
            "dense": lambda: F.scaled_dot_product_attention(q, k, v),
            "gather": lambda: sa.block_sparse_attention(q, k, v, keep, bs, backend="gather", plan=plan),
            "flex_compiled": lambda: sa.block_sparse_attention(q, k, v, keep, bs, backend="flex", block_mask=bm,
                                                               flex_compiled=True),
        },
        repeats,
    )
    return {"config": config, "tokens": L, "density": round(plan.density, 4),
            "flex_eager_one_call_ms": round(eager_ms, 1), "flex_first_call_incl_compile_s": round(compile_s, 1),
            "max_abs_diff_compiled_vs_gather": err,
            "eager_max_abs_diff": float((eager - ref).abs().max()), "results": res}


# ---------------------------------------------------------------------------------------------------------------
# Structured (Sparse VideoGen-like) masks at Wan length: the hit-path kernel vs dense SDPA
# ---------------------------------------------------------------------------------------------------------------


def _block_tables(grid: tuple[int, int, int], bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per block of ``bs`` raster-order tokens on a (T, H, W) grid: which frames, which rows (h) and which
    columns (w) it covers, as float incidence tables [nb, T], [nb, H], [nb, W]."""
    T, Hh, W = grid
    L = T * Hh * W
    nb = sa.n_blocks(L, bs)
    p = torch.arange(L)
    blk = p // bs
    tabs = []
    for coord, n in ((p // (Hh * W), T), ((p // W) % Hh, Hh), (p % W, W)):
        t = torch.zeros(nb, n)
        t[blk, coord] = 1.0
        tabs.append(t)
    return tabs[0], tabs[1], tabs[2]


def _dilate(table: torch.Tensor, r: int) -> torch.Tensor:
    if r <= 0:
        return table
    return (F.max_pool1d(table[None], 2 * r + 1, stride=1, padding=r)[0] > 0).float()


def svg_head_keep(kind: str, grid: tuple[int, int, int], bs: int, radius: int, band: int) -> torch.Tensor:
    """A block pattern [nb, nb] as Sparse VideoGen's head types, on raster-ordered video tokens.

    ``spatial``: a query attends the tokens of its own frame and of ``radius`` frames either side (tokens of a
    block that straddles frames: any of its frames). ``temporal``: a query attends the tokens of every frame whose
    row lies within ``radius`` rows of its own (same spatial position across frames, widened). Both add a local
    window of ``band`` blocks either side of the diagonal (which is always kept).
    """
    tf, th, _ = _block_tables(grid, bs)
    if kind == "spatial":
        keep = (_dilate(tf, radius) @ tf.T) > 0
    elif kind == "temporal":
        keep = (_dilate(th, radius) @ th.T) > 0
    else:
        raise ValueError(kind)
    nb = keep.shape[0]
    i = torch.arange(nb)
    return keep | ((i[:, None] - i[None, :]).abs() <= band)


def svg_keep(grid: tuple[int, int, int], bs: int, density: float, heads: int) -> tuple[torch.Tensor, list[dict]]:
    """Per-head patterns [heads, nb, nb] alternating spatial / temporal heads, each the widest radius whose
    density stays <= ``density`` plus the narrowest local band that reaches it."""
    rows, meta = [], []
    for h in range(heads):
        kind = ("spatial", "temporal")[h % 2]
        radius = 0
        while float(svg_head_keep(kind, grid, bs, radius + 1, 0).float().mean()) <= density and radius < 64:
            radius += 1
        band = 0
        keep = svg_head_keep(kind, grid, bs, radius, band)
        while float(keep.float().mean()) < density and band < keep.shape[0]:
            band += 1 if band < 8 else max(1, band // 4)
            keep = svg_head_keep(kind, grid, bs, radius, band)
        rows.append(keep)
        meta.append({"kind": kind, "radius": radius, "band": band, "density": round(float(keep.float().mean()), 3)})
    return torch.stack(rows), meta


def bench_structured(L: int, heads: int, dim: int, densities, active: float, bs: int, repeats: int,
                     old_gather: bool = True, masked_subset: bool = True, flex_density: float | None = None) -> dict:
    """32k-token attention with Sparse VideoGen-like per-head patterns: dense SDPA vs the token-set kernel
    (``token_block_sparse_attention``, gather backend) over the whole sequence, and on a hit's token subset
    (active box + 1-token margin; queries = keys = subset) vs the old hit path (SDPA with the [S, S] mask) and vs
    unmasked SDPA among the subset. Round-robin rounds, medians; plans are built once (as per layer in a run)."""
    grid = token_grid(L)
    if grid[0] * grid[1] * grid[2] != L:
        raise ValueError(f"no video grid for {L} tokens; use one of {sorted(k for k in (2048, 4096, 8192, 32760))}")
    g = torch.Generator().manual_seed(L)
    q, k, v = (torch.randn(1, heads, L, dim, generator=g) for _ in range(3))
    variants: dict[str, Callable[[], object]] = {"dense_sdpa": lambda: F.scaled_dot_product_attention(q, k, v)}
    meta: dict[str, dict] = {"dense_sdpa": {"density": 1.0, "tokens": L}}
    # The hit's subset: a centred box of `active` of every frame, dilated by one token in (t, h, w).
    T, Hh, W = grid
    box = torch.zeros(T, Hh, W, dtype=torch.bool)
    box.view(-1)[active_index(grid, active)] = True
    sub_mask = F.max_pool3d(box[None, None].float(), 3, stride=1, padding=1)[0, 0] > 0
    subset = sub_mask.reshape(-1).nonzero().squeeze(1)
    S = int(subset.numel())
    qs, ks, vs = (x[:, :, subset].contiguous() for x in (q, k, v))
    variants["subset_sdpa_unmasked"] = lambda: F.scaled_dot_product_attention(qs, ks, vs)
    meta["subset_sdpa_unmasked"] = {"density": 1.0, "tokens": S}
    arange = torch.arange(L)
    patterns, plans_ms, checks = {}, {}, {}

    def timed_plan(key: str, keep: torch.Tensor, positions: torch.Tensor):
        """The kernel's plan for these query/key positions, its build time recorded under ``key``."""
        t0 = time.perf_counter()
        plan = sa.plan_token_block_sparse(keep, bs, L, positions)
        plans_ms[key] = round((time.perf_counter() - t0) * 1e3, 1)
        return plan

    def add_kernel(name: str, qkv: tuple, keep: torch.Tensor, positions: torch.Tensor, plan, tokens: int) -> None:
        """A variant: the token-set kernel (gather backend) on ``qkv`` with a plan built beforehand."""
        variants[name] = lambda: sa.token_block_sparse_attention(*qkv, keep, bs, L, positions, backend="gather",
                                                                 plan=plan)
        meta[name] = {"density": round(plan.density, 4), "tokens": tokens, "sdpa_calls": plan.n_calls}

    for d in densities:
        keep, pmeta = svg_keep(grid, bs, d, heads)
        patterns[f"{d:g}"] = pmeta
        add_kernel(f"kernel_full@{d:g}", (q, k, v), keep, arange, timed_plan(f"full@{d:g}", keep, arange), L)
        plain = sa.plan_token_block_sparse(keep, bs, L, arange, super_rows=0)  # without super-tiles
        add_kernel(f"kernel_full_no_super_tiles@{d:g}", (q, k, v), keep, arange, plain, L)
        if old_gather:
            oplan = sa.plan_block_sparse(keep, bs, L)
            name = f"old_gather_full@{d:g}"
            variants[name] = lambda keep=keep, oplan=oplan: sa.block_sparse_attention(
                q, k, v, keep, bs, backend="gather", plan=oplan)
            meta[name] = {"density": round(oplan.density, 4), "tokens": L, "sdpa_calls": len(oplan.groups)}
        splan = timed_plan(f"subset@{d:g}", keep, subset)
        add_kernel(f"kernel_subset@{d:g}", (qs, ks, vs), keep, subset, splan, S)
        if masked_subset:
            sb = subset // bs
            mask = keep[:, sb[:, None], sb[None, :]][None]  # the old hit path's token-level mask, per head
            name = f"old_masked_subset@{d:g}"
            variants[name] = lambda mask=mask: F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)
            meta[name] = {"density": round(float(mask.float().mean()), 4), "tokens": S,
                          "mask_mb": round(mask.numel() / 2**20, 1)}
            # The kernel equals the masked reference (float32 tolerance) on these inputs.
            ref = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)
            out = sa.token_block_sparse_attention(qs, ks, vs, keep, bs, L, subset, plan=splan)
            checks[f"subset@{d:g}_max_abs_vs_masked"] = float((out - ref).abs().max())
            del ref, out
        if flex_density is not None and abs(d - flex_density) < 1e-9 and sa.flex_available():
            # Compiled FlexAttention on the CPU (the CUDA default), over the full sequence and the subset; the
            # first call of each compiles (timed apart; the subset's new length recompiles with dynamic shapes).
            warnings.filterwarnings("ignore", message=".*flex_attention.*")
            for tag, args_ in (("full", (q, k, v, arange)), ("subset", (qs, ks, vs, subset))):
                fq, fk, fv, fpos = args_
                fplan = sa.plan_token_block_sparse(keep, bs, L, fpos)
                t0 = time.perf_counter()
                fo = sa.token_block_sparse_attention(fq, fk, fv, keep, bs, L, fpos, backend="flex", plan=fplan,
                                                     flex_compiled=True)
                checks[f"flex_{tag}@{d:g}_first_call_s"] = round(time.perf_counter() - t0, 1)
                go = sa.token_block_sparse_attention(fq, fk, fv, keep, bs, L, fpos, backend="gather", plan=fplan)
                checks[f"flex_{tag}@{d:g}_max_abs_vs_gather"] = float((fo - go).abs().max())
                name = f"flex_compiled_{tag}@{d:g}"
                variants[name] = lambda fq=fq, fk=fk, fv=fv, fpos=fpos, fplan=fplan: sa.token_block_sparse_attention(
                    fq, fk, fv, keep, bs, L, fpos, backend="flex", plan=fplan, flex_compiled=True)
                meta[name] = {"density": round(fplan.density, 4), "tokens": int(fpos.numel())}
    res = run_round_robin(variants, repeats)
    dense_ms = res["dense_sdpa"]["median_ms"]
    sub_ms = res["subset_sdpa_unmasked"]["median_ms"]
    for name, r in res.items():
        r.update(meta[name])
        r["speedup_vs_dense"] = round(dense_ms / r["median_ms"], 2)
        if "subset" in name:
            r["speedup_vs_subset_unmasked"] = round(sub_ms / r["median_ms"], 2)
    return {"tokens": L, "grid": list(grid), "heads": heads, "head_dim": dim, "block_size": bs,
            "subset_tokens": S, "active": active, "patterns": patterns, "plan_build_ms": plans_ms,
            "checks": checks, "results": res}


# ---------------------------------------------------------------------------------------------------------------
# The joint hit at Wan depth: the kernel vs the former masked path inside the real sampler
# ---------------------------------------------------------------------------------------------------------------


def _old_subset_attention(run, q, k, v, heads: int, keep: torch.Tensor, bs: int, subset: torch.Tensor,
                          dense_above: float = 1.0, k_subset=None):
    """The hit path's former implementation (SDPA with a dense [S, S] boolean mask), kept here only to measure
    the kernel against it in one process."""
    key = ("submask", run.layer)
    if key not in run.subset_cache:
        kb = keep.any(0)
        sb = (subset // bs).to(kb.device)
        mask = kb[sb][:, sb] | (sb[:, None] == sb[None, :])
        kept = int(mask.sum().item())
        run.subset_cache[key] = None if kept > dense_above * mask.numel() else (mask, kept)
    cached = run.subset_cache[key]
    if cached is None:
        return None
    mask, kept = cached
    run.stats["attn_pairs"] += kept
    run.stats["attn_pairs_dense"] += run.n_tokens ** 2
    B, S, HD = q.shape
    d = HD // heads
    qh, kh, vh = (t.reshape(B, -1, heads, d).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask.to(q.device))
    return out.transpose(1, 2).reshape(B, S, HD)


def bench_wan_hit(latent: str, dim: int, layers: int, steps: int, probe_steps: int, active: float, density: float,
                  bs: int, repeats: int, modes: list[str]) -> dict:
    """A joint cache hit on a random-weight ComfyUI Wan (scripts/bench/bench_reuse.py's model and box regions) whose
    cached block structure is a Sparse VideoGen-like spatial pattern of the given density in every middle layer
    (a random-weight model records a near-dense 0.98, which the hit path rightly skips). Per mode the resume of
    the same hit is timed, rotating the order of modes every round: ``joint`` (this kernel), ``joint_old_mask``
    (the former [S, S]-masked SDPA, patched in for the measurement), ``latent`` (unmasked attention among the
    subset) and ``dense``. The cached latent is the probe's x0 (the output is not judged here, only time)."""
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    import bench_reuse as br  # makes ComfyUI importable (CPU)
    import numpy as np
    import tiny_models as tm

    from carnator.carnator_core import comfy_patch as cp, reuse
    from carnator.carnator_core.probe import ProbeConfig, run_probe
    from carnator.carnator_core.types import BlockStructure, Candidate, Decision

    shape = tuple(int(x) for x in latent.split(","))
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        model = br.build_model(dim, layers, Path(tmp))
    pos, neg = tm.conditioning("wan21")
    lat = {"samples": torch.zeros((1,) + shape)}
    kw = dict(steps=steps, cfg=5.0, sampler_name="euler", scheduler="simple", prompt="a ball", objects=(),
              object_source="none", config=ProbeConfig(probe_steps=probe_steps))
    cfg = reuse.ReuseConfig(mode="dense", block_size=bs, x0_threshold=1e9, dilation=0, context_margin_blocks=1)
    probe_b = run_probe(model, pos, neg, lat, seed=2, **kw)
    grid = probe_b.grid
    keep, pmeta = svg_keep(tuple(grid), bs, density, 1)
    mids = reuse.middle_layers(layers, cfg)
    nb = keep.shape[-1]
    structure = BlockStructure(keep=np.broadcast_to(keep.numpy()[None], (len(mids), 1, nb, nb)).copy(),
                               layers=tuple(mids), block_size=bs, n_tokens=int(np.prod(grid)))
    sig_cached = br.box_signature(grid, active / 2)
    sig_target = br.box_signature(grid, active / 2, shift=max(1, int(grid[2] * np.sqrt(active / 2))))
    cached = reuse.CachedRun("bench", probe_b.x0_probe.clone(), probe_b.x0_probe, sig_cached, structure)
    decision = Decision(True, Candidate("bench", 0.99, "a ball", sig_cached), (), "signature")
    new_impl = cp._subset_attention
    times: dict[str, list[float]] = {m: [] for m in modes}
    reports: dict[str, dict] = {}
    try:
        for rnd in range(repeats):
            # Rotate the order every round, so a load that changes during the run does not favour one mode.
            for mode in modes[rnd % len(modes):] + modes[:rnd % len(modes)]:
                cp._subset_attention = _old_subset_attention if mode == "joint_old_mask" else new_impl
                c = reuse.ReuseConfig(**{**cfg.__dict__, "mode": "joint" if mode.startswith("joint") else mode})
                t0 = time.perf_counter()
                if mode == "dense":
                    _, rep = reuse.sample(model, pos, neg, lat, probe_b, None, None, c, record=False)
                else:
                    _, rep = reuse.sample(model, pos, neg, lat, probe_b, decision, cached, c,
                                          target_signature=sig_target)
                times[mode].append(time.perf_counter() - t0)
                reports[mode] = rep.to_meta()
                print(f"[bench] wan hit {mode}: {times[mode][-1]:.1f} s", file=sys.stderr, flush=True)
    finally:
        cp._subset_attention = new_impl
    probe_s = probe_b.timings["probe_ms"] / 1000
    rows = {}
    for mode in modes:
        med = statistics.median(times[mode])
        rep = reports[mode]
        rows[mode] = {"resume_s": round(med, 2), "request_s": round(probe_s + med, 2),
                      "per_step_s": round(med / max(rep["model_calls"], 1), 3), "model_calls": rep["model_calls"],
                      "token_fraction": round(rep["token_fraction"], 3),
                      "attention_fraction": round(rep["attention_fraction"], 4), "fallbacks": rep["fallbacks"]}
    ref = "dense" if "dense" in rows else "latent" if "latent" in rows else modes[0]
    for r in rows.values():
        r[f"speedup_step_vs_{ref}"] = round(rows[ref]["per_step_s"] / r["per_step_s"], 2)
        r[f"speedup_request_vs_{ref}"] = round(rows[ref]["request_s"] / r["request_s"], 2)
    return {"latent": list(shape), "grid": list(grid), "tokens": int(np.prod(grid)), "dim": dim, "layers": layers,
            "steps": steps, "probe_steps": probe_steps, "probe_s": round(probe_s, 2), "block_size": bs,
            "structure": pmeta, "repeats": repeats, "rows": rows}


def _banded_keep(nb: int, density: float, heads: int, seed: int) -> torch.Tensor:
    """Per-head block patterns of about ``density``: a diagonal band (local attention, as recorded structures
    are) topped up with random blocks, plus the diagonal."""
    g = torch.Generator().manual_seed(seed)
    i = torch.arange(nb)
    band = (i[:, None] - i[None, :]).abs() <= max(0, int(density * nb / 2))
    extra = max(0.0, density - float(band.float().mean()))
    return band[None] | (torch.rand(heads, nb, nb, generator=g) < extra) | torch.eye(nb, dtype=torch.bool)[None]


def bench_crossover(tokens, densities, subset: float, heads: int, dim: int, repeats: int) -> list[dict]:
    """Where the block-sparse tiles pay, against the cost model ``ReuseConfig.sparse_kernel="cost"`` decides by.

    Per sequence length (block size as the hit path picks it) and block density: (1) the token-set kernel of a
    joint hit (queries = a random ``subset`` of the tokens, keys = every token, one pattern: the union over heads)
    against plain SDPA of the same queries over every key; (2) the whole-sequence kernel of a refresh call
    (every query, per-head patterns) against dense SDPA. Batch 2 (CFG). Ratios of medians, round-robin."""
    import torch.nn.functional as F

    from carnator.carnator_core.reuse import auto_block_size

    rows = []
    for L in tokens:
        bs = auto_block_size(L)
        nb = sa.n_blocks(L, bs)
        B, H, D = 2, heads, dim
        g = torch.Generator().manual_seed(L)
        s = max(1, int(subset * L))
        sub = torch.sort(torch.randperm(L, generator=g)[:s]).values
        allpos = torch.arange(L)
        q, k, v = (torch.randn(B, L, H * D, generator=g) for _ in range(3))
        qs = q[:, sub].contiguous()
        bh = lambda x: x.view(B, -1, H, D).transpose(1, 2)  # noqa: E731
        for d in densities:
            keep = _banded_keep(nb, d, H, seed=int(1000 * d) + L)
            kb = keep.any(0, keepdim=True)
            plan = sa.plan_token_block_sparse(kb, bs, L, sub, allpos)
            variants = {
                "subset_tiles": lambda: sa.token_block_sparse_attention_bld(qs, k, v, H, kb, bs, L, sub, allpos,
                                                                            plan=plan, backend="gather"),
                "subset_plain": lambda: F.scaled_dot_product_attention(bh(qs), bh(k), bh(v)),
                "full_tiles": lambda: sa.block_sparse_attention_bld(q, k, v, H, keep, bs, backend="gather"),
                "full_dense": lambda: F.scaled_dot_product_attention(bh(q), bh(k), bh(v)),
            }
            t = run_round_robin(variants, repeats)
            row = {"tokens": L, "block_size": bs, "subset_tokens": s,
                   "subset_density": round(plan.density, 3), "subset_sdpa_calls": plan.n_calls,
                   "subset_measured": round(t["subset_tiles"]["median_ms"] / t["subset_plain"]["median_ms"], 2),
                   "subset_model": round(sa.tile_cost_ratio(kb, bs, L, sub, allpos), 2),
                   "full_density": round(float(keep.float().mean()), 3),
                   "full_measured": round(t["full_tiles"]["median_ms"] / t["full_dense"]["median_ms"], 2),
                   "full_model": round(sa.block_cost_ratio(keep, L, bs), 2), "ms": t}
            print(f"[crossover] L={L} d={d}: subset tiles/plain {row['subset_measured']} (model "
                  f"{row['subset_model']}), full tiles/dense {row['full_measured']} (model {row['full_model']})",
                  file=sys.stderr, flush=True)
            rows.append(row)
    return rows


def machine() -> dict:
    def sh(cmd: str) -> str:
        try:
            return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:
            return ""

    return {"nproc": sh("nproc"), "cpu": sh("lscpu | grep 'Model name' | sed 's/.*: *//'"), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "python": platform.python_version(), "loadavg_start": os.getloadavg()}


def markdown(result: dict) -> str:
    lines = []
    xo = result.get("crossover")
    if xo:
        lines.append("\n**Where block-sparse tiles pay** (kernel time / plain SDPA time, median of rounds; model = "
                     "`tile_cost_ratio` / `block_cost_ratio`; the tiles run where the model says < 1)\n")
        lines.append("| tokens | block | subset density | subset: measured | model | full density | full: measured | "
                     "model |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for r in xo:
            lines.append(f"| {r['tokens']} | {r['block_size']} | {r['subset_density']} | {r['subset_measured']} | "
                         f"{r['subset_model']} | {r['full_density']} | {r['full_measured']} | {r['full_model']} |")
    wh = result.get("wan_hit")
    if wh:
        st = wh["structure"][0]
        lines.append(f"\n**Joint hit at Wan depth**: random-weight Wan, {wh['layers']} blocks of width {wh['dim']}, "
                     f"{wh['tokens']} tokens, {wh['steps']} steps (probe {wh['probe_steps']}: {wh['probe_s']} s), "
                     f"cached structure: {st['kind']} r={st['radius']} band={st['band']} (density {st['density']}), "
                     f"block {wh['block_size']}; medians of {wh['repeats']} rounds\n")
        ref = next(k for k in wh["rows"]["joint"] if k.startswith("speedup_step_vs_"))[len("speedup_step_vs_"):]
        lines.append(f"| mode | resume s | request s | per step s | step speedup vs {ref} | request speedup vs "
                     f"{ref} | token fraction | attention pairs |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for mode, r in wh["rows"].items():
            lines.append(f"| {mode} | {r['resume_s']} | {r['request_s']} | {r['per_step_s']} | "
                         f"{r['speedup_step_vs_' + ref]} | {r['speedup_request_vs_' + ref]} | {r['token_fraction']} | "
                         f"{r['attention_fraction']} |")
    st = result.get("structured")
    if st:
        pats = "; ".join(f"{d}: " + ", ".join(f"{p['kind']} r={p['radius']} band={p['band']} ({p['density']})"
                                           for p in ps) for d, ps in st["patterns"].items())
        lines.append(f"\n**Structured masks: {st['heads']} heads x {st['head_dim']}, {st['tokens']} tokens "
                     f"(grid {'x'.join(map(str, st['grid']))}), block {st['block_size']}; hit subset "
                     f"{st['subset_tokens']} tokens (active {st['active']} + 1-token margin)** (ms, median / min "
                     "of rounds; speedup = dense SDPA median / variant median)\n")
        lines.append(f"Patterns per target density (head kind, radius, local band, realised density): {pats}\n")
        lines.append("| variant | tokens | density | SDPA calls | median ms | min ms | speedup vs dense | "
                     "vs subset unmasked |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for name, r in st["results"].items():
            lines.append(f"| {name} | {r['tokens']} | {r['density']} | {r.get('sdpa_calls', 1)} | {r['median_ms']} | "
                         f"{r['min_ms']} | {r['speedup_vs_dense']} | {r.get('speedup_vs_subset_unmasked', '')} |")
        if st["checks"]:
            lines.append("\nchecks: " + ", ".join(f"{k} {v:.2g}" for k, v in st["checks"].items()))
    for a in result["attention"]:
        lines.append(f"\n**{a['config']}: {a['heads']} heads x {a['head_dim']}, {a['tokens']} tokens, "
                     f"block {a['block_size']}** (ms, median / min of rounds; "
                     "speedup = dense median / variant median)\n")
        lines.append("| variant | density | active | median ms | min ms | speedup |")
        lines.append("|---|---|---|---|---|---|")
        for name, r in a["results"].items():
            lines.append(f"| {name} | {r['density']} | {r['active']:.3f} | {r['median_ms']} | {r['min_ms']} | "
                         f"{r['speedup_vs_dense']} |")
    if result.get("record_cost"):
        lines.append("\n**Recording cost per call** (one self-attention call's q, k)\n")
        lines.append("| config | tokens | variant | median ms | fraction of one dense attention call |")
        lines.append("|---|---|---|---|---|")
        for rc in result["record_cost"]:
            for name, r in rc["results"].items():
                lines.append(f"| {rc['config']} | {rc['tokens']} | {name} | {r['median_ms']} | "
                             f"{r['fraction_of_dense_call']} |")
    if result.get("record_accuracy"):
        lines.append("\n**Recording accuracy on synthetic local attention** (4 heads x 64, density = recorded "
                     "block density, oracle = density of the exact per-query-block selection, true mass = attention "
                     "mass of each query inside its kept blocks)\n")
        lines.append("| sharp | estimator | mass | density | oracle density | true mass mean | true mass p05 |")
        lines.append("|---|---|---|---|---|---|---|")
        for r in result["record_accuracy"]:
            lines.append(f"| {r['sharp']} | {r['estimator']} | {r['mass']} | {r['density']} | {r['oracle_density']} | "
                         f"{r['true_mass_mean']} | {r['true_mass_p05']} |")
    if result.get("flex_cpu"):
        fx = result["flex_cpu"]
        lines.append(f"\n**FlexAttention on CPU** ({fx['config']}, {fx['tokens']} tokens, density {fx['density']}): "
                     f"eager one call {fx['flex_eager_one_call_ms']} ms; first compiled call (compile) "
                     f"{fx['flex_first_call_incl_compile_s']} s; max |compiled - gather| "
                     f"{fx['max_abs_diff_compiled_vs_gather']:.2e}\n")
        lines.append("| variant | median ms | min ms |")
        lines.append("|---|---|---|")
        for name, r in fx["results"].items():
            lines.append(f"| {name} | {r['median_ms']} | {r['min_ms']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--configs", nargs="+", default=["wan", "small"], choices=sorted(CONFIGS))
    ap.add_argument("--densities", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    ap.add_argument("--active", type=float, nargs="+", default=[1.0, 0.5, 0.25])
    ap.add_argument("--strategies", nargs="+", default=["grouped", "padded"], choices=["grouped", "padded"])
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on an oversubscribed machine every multi-threaded op can stall "
                         "for a scheduler time slice, which swamps op-count-heavy variants; see BENCHMARKS.md)")
    ap.add_argument("--flex", action="store_true", help="also measure eager/compiled flex_attention on CPU")
    ap.add_argument("--flex-config", default="wan", choices=sorted(CONFIGS))
    ap.add_argument("--flex-tokens", type=int, default=4096)
    ap.add_argument("--no-accuracy", action="store_true", help="skip the recording-accuracy study")
    ap.add_argument("--structured", action="store_true",
                    help="also run the structured-mask kernel benchmark (Sparse VideoGen-like heads, hit-path kernel)")
    ap.add_argument("--structured-only", action="store_true", help="run only the structured-mask benchmark")
    ap.add_argument("--structured-tokens", type=int, default=32760, help="32760 = Wan 2.1 480p x 81 frames")
    ap.add_argument("--structured-heads", type=int, default=2)
    ap.add_argument("--structured-dim", type=int, default=64)
    ap.add_argument("--structured-densities", type=float, nargs="+", default=[0.2, 0.3, 0.4, 0.5])
    ap.add_argument("--structured-active", type=float, default=0.25, help="active fraction of the hit's subset")
    ap.add_argument("--structured-flex", type=float, default=None, metavar="DENSITY",
                    help="also time compiled FlexAttention on the CPU at this one density (compiles for minutes)")
    ap.add_argument("--wan-hit", action="store_true",
                    help="time a joint hit in the real sampler on a random-weight Wan with a structured cached "
                         "structure: this kernel vs the former [S, S]-masked path vs latent-only vs dense")
    ap.add_argument("--wan-latent", default="16,21,30,52", help="Wan latent C,T,H,W (8,190 tokens by default)")
    ap.add_argument("--wan-dim", type=int, default=256)
    ap.add_argument("--wan-layers", type=int, default=30, help="30 = Wan 2.1 1.3B's depth")
    ap.add_argument("--wan-steps", type=int, default=4)
    ap.add_argument("--wan-probe", type=int, default=1)
    ap.add_argument("--wan-density", type=float, default=0.3)
    ap.add_argument("--wan-modes", default="dense,latent,joint,joint_old_mask")
    ap.add_argument("--crossover", action="store_true",
                    help="only the tiles-vs-plain crossover the hit path's cost model is fitted to")
    ap.add_argument("--crossover-tokens", type=int, nargs="+", default=[576, 1152, 2304, 4608, 8192])
    ap.add_argument("--crossover-densities", type=float, nargs="+", default=[0.3, 0.5, 0.7])
    ap.add_argument("--quick", action="store_true", help="smoke run: small config, 1024 tokens, 2 repeats")
    ap.add_argument("--json", type=Path, help="also write the JSON result here")
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.configs, args.repeats, args.block_size = [1024], ["small"], 2, 64
        args.structured_tokens, args.structured_densities = 2048, [0.3]
    if args.structured_only:
        args.structured, args.tokens, args.no_accuracy, args.flex = True, [], True, False
    if args.crossover:
        args.tokens, args.no_accuracy, args.flex, args.structured, args.wan_hit = [], True, False, False, False
    if args.wan_hit and not args.structured:
        args.tokens, args.no_accuracy, args.flex = [], True, False
    torch.set_num_threads(args.threads)
    result: dict = {"machine": machine(),
                    "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                    "attention": [], "record_cost": []}
    t_start = time.time()

    def save() -> None:
        # After every section, so a long run on a shared machine leaves its finished sections behind.
        result["machine"]["loadavg_end"] = os.getloadavg()
        result["wall_s"] = round(time.time() - t_start, 1)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=1))

    for L in args.tokens:
        for config in args.configs:
            print(f"[bench] attention {config} L={L} ...", file=sys.stderr, flush=True)
            result["attention"].append(
                bench_attention(config, L, args.densities, args.active, args.block_size, args.repeats, args.strategies)
            )
            print(f"[bench] record cost {config} L={L} ...", file=sys.stderr, flush=True)
            result["record_cost"].append(bench_record_cost(config, L, args.block_size, args.repeats))
            save()
    if args.crossover:
        print("[bench] crossover ...", file=sys.stderr, flush=True)
        result["crossover"] = bench_crossover(args.crossover_tokens, args.crossover_densities, 0.3, 2, 64,
                                              args.repeats)
        save()
    if args.structured:
        print(f"[bench] structured masks L={args.structured_tokens} ...", file=sys.stderr, flush=True)
        result["structured"] = bench_structured(
            args.structured_tokens, args.structured_heads, args.structured_dim, args.structured_densities,
            args.structured_active, args.block_size, args.repeats, flex_density=args.structured_flex)
        save()
    if args.wan_hit:
        print("[bench] joint hit at Wan depth ...", file=sys.stderr, flush=True)
        result["wan_hit"] = bench_wan_hit(args.wan_latent, args.wan_dim, args.wan_layers, args.wan_steps,
                                          args.wan_probe, args.structured_active, args.wan_density, args.block_size,
                                          args.repeats, args.wan_modes.split(","))
        save()
    if not args.no_accuracy:
        print("[bench] record accuracy ...", file=sys.stderr, flush=True)
        result["record_accuracy"] = bench_record_accuracy(1024 if args.quick else 4096, args.block_size)
        save()
    if args.flex:
        print("[bench] flex on CPU ...", file=sys.stderr, flush=True)
        result["flex_cpu"] = bench_flex_cpu(args.flex_config, args.flex_tokens, args.block_size, 0.25, args.repeats)
        save()
    print(json.dumps(result, indent=1))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
