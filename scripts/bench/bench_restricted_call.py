#!/usr/bin/env python
"""Where a joint hit's restricted model call spends its time, on the embedded model.

    .host/venv/bin/python scripts/bench/bench_restricted_call.py --json artifacts/restricted_call.json

Two parts, one process, medians:

1. **Serving path** (``--hits``, default on): the Table-1 workload's warm set is served dense into a cache
   (``request.serve``, as ``scripts/bench/bench_table1.py`` does), then the given stream requests are served with the
   shipped rule ``--repeats`` times each, beside their dense twins. Every diffusion-model call is timed, as is every
   transformer block and Carnator's context attention inside it. A call is "restricted" when its blocks ran on a
   token subset. Reported per call: dense and restricted call time, the blocks' share of a restricted call and the
   context attention's share of a block.
2. **One ComfyUI Wan block alone** (``comfy.ldm.wan.model.WanAttentionBlock`` of the shipped weights, a CFG batch
   of 2): its time at S tokens for several S, and at the hit's subset size with self-attention over every token (the
   recorded keys/values of the others written in, as ``comfy_patch._context_attention`` does). The S=1 row is the
   block's fixed per-call cost (its ~40 small ops); the subset row is what a restricted layer costs with no Carnator
   bookkeeping at all — the floor of that design on this model.

Nothing here changes what a hit computes; it says how far a restricted call is from its own floor.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

import bench_table1 as T  # noqa: E402


def median_ms(xs: list[float]) -> float:
    import numpy as np

    return round(float(np.median(xs)) * 1e3, 3) if xs else float("nan")


def time_fn(fn: Callable[[], Any], repeats: int, warmup: int = 10) -> float:
    """Median wall seconds of ``fn`` over ``repeats`` calls."""
    import numpy as np

    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def token_grid() -> tuple[int, int, int]:
    from carnator.carnator_core.embedded import config

    return config.TOKEN_GRID


def block_alone(model: Any, subset: int, repeats: int) -> dict[str, Any]:
    """Part 2: one Wan block of the shipped weights, alone."""
    import torch

    dm = model.model.diffusion_model
    blk = dm.blocks[len(dm.blocks) // 2]
    dim = blk.norm1.normalized_shape[0]
    grid = token_grid()
    n = grid[0] * grid[1] * grid[2]
    freqs = dm.rope_encode(grid[0] * dm.patch_size[0], grid[1] * dm.patch_size[1], grid[2] * dm.patch_size[2],
                           device=torch.device("cpu"), dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    ctx = torch.randn(2, 32, dim, generator=g)
    e0 = torch.randn(2, 1, 6, dim, generator=g)
    rows: dict[str, float] = {}
    with torch.no_grad():
        for s in sorted({n, subset, max(1, subset // 2), 1}, reverse=True):
            x = torch.randn(2, s, dim, generator=g)
            rows[f"block_{s}_tokens_ms"] = round(time_fn(
                lambda: blk(x, e=e0, freqs=freqs[:, :s], context=ctx, context_img_len=None), repeats) * 1e3, 3)
        # The subset's queries over every token: the others' keys/values written in from a record, as a hit does.
        rec_k, rec_v = torch.randn(2, n, dim, generator=g), torch.randn(2, n, dim, generator=g)
        idx = torch.linspace(0, n - 1, subset).long()

        def over_context(func, *args, **kwargs):
            q, k, v = args[:3]
            if k.shape[1] == q.shape[1] == subset:  # self-attention of the subset
                return func(q, rec_k.index_copy(1, idx, k), rec_v.index_copy(1, idx, v), *args[3:], **kwargs)
            return func(*args, **kwargs)

        x = torch.randn(2, subset, dim, generator=g)
        topts = {"optimized_attention_override": over_context}
        rows[f"block_{subset}_tokens_full_context_ms"] = round(time_fn(
            lambda: blk(x, e=e0, freqs=freqs[:, idx], context=ctx, context_img_len=None, transformer_options=topts),
            repeats) * 1e3, 3)
    rows["tokens"] = n
    rows["subset_tokens"] = subset
    return rows


def serving_path(args: argparse.Namespace, tmp: Path) -> tuple[dict[str, Any], Any]:
    """Part 1: time every model call, block and context attention of real hits beside their dense twins (the warm
    cache and the frozen weights copy live in ``tmp``)."""
    import comfy.ldm.wan.model as wan
    import numpy as np

    from carnator.carnator_core import comfy_patch
    from carnator.carnator_core.cache import Store
    from carnator.carnator_core.request import RequestSpec, serve

    ap = argparse.ArgumentParser()
    T.add_workload_args(ap)
    wargs = ap.parse_args(["--warm", str(args.warm), "--stream", str(args.stream)])
    for name, value in dict(weights=None, allow_uncertified=False, methods=["dense", "carnator"], steps=20, cfg=None,
                            probe_steps=None, top_k=5, easycache_threshold=0.2, easycache_start=0.15,
                            easycache_end=0.95, rule=str(T.DEFAULT_RULE), dev_thresholds="8,0.5,1.0,10").items():
        setattr(wargs, name, value)
    wl = T.build_workload(T.spec_from_args(wargs))
    env = T.load_env(wargs, tmp)
    warm = Store.open(tmp / "warm", key_path=tmp / "index.key")
    first = None
    for req in wl.warm:
        r = serve(env.model, env.enc, env.enc.encode(req.prompt), env.enc.encode(""), env.latent(),
                  RequestSpec(req.prompt, req.seed, env.steps, env.cfg), warm,
                  T.serve_options("dense", None, 0.0, env, True))
        first = first or r
    rule, _ = T.resolve_rule(str(T.DEFAULT_RULE), wargs, first.probe, True)
    # The stream's own writes are not made: every repeat sees the same warm cache, so the same decision.
    opts = T.serve_options("carnator", rule, 0.9, env, False)
    reqs = [r for r in wl.stream if r.rid in set(args.requests.split(","))]

    acc: dict[str, list[float]] = collections.defaultdict(list)
    state = {"subset": False, "blocks": 0.0, "ctx": 0.0}
    dm = env.model.model.diffusion_model
    forward, block_forward, context_attention = dm.forward, wan.WanAttentionBlock.forward, \
        comfy_patch._context_attention

    def timed_forward(*a, **k):
        state.update(subset=False, blocks=0.0, ctx=0.0)
        t0 = time.perf_counter()
        y = forward(*a, **k)
        dt = time.perf_counter() - t0
        if state["subset"]:
            acc["restricted_call"].append(dt)
            acc["restricted_blocks"].append(state["blocks"])
            acc["restricted_context_attention"].append(state["ctx"])
        else:
            acc["dense_call"].append(dt)
        return y

    def timed_block(self, x, *a, **k):
        t0 = time.perf_counter()
        y = block_forward(self, x, *a, **k)
        state["blocks"] += time.perf_counter() - t0
        if x.shape[1] < env_tokens:
            state["subset"] = True
            subset_sizes.append(int(x.shape[1]))
        return y

    def timed_context(*a, **k):
        t0 = time.perf_counter()
        try:
            return context_attention(*a, **k)
        finally:
            state["ctx"] += time.perf_counter() - t0

    grid = token_grid()
    env_tokens = grid[0] * grid[1] * grid[2]
    subset_sizes: list[int] = []
    dm.forward = timed_forward
    wan.WanAttentionBlock.forward = timed_block
    comfy_patch._context_attention = timed_context
    try:
        decisions = {}
        for rep in range(args.repeats + 1):  # the first round warms every lazy path and is dropped
            if rep == 1:
                acc.clear()
            for req in reqs:
                T.run_request(env, "dense", req, None, None)
                _, _, res = T.run_request(env, "carnator", req, warm, opts)
                decisions[req.rid] = res.report.decision
    finally:
        dm.forward = forward
        wan.WanAttentionBlock.forward = block_forward
        comfy_patch._context_attention = context_attention
        warm.close()
    layers = len(dm.blocks)
    out = {
        "requests": decisions,
        "dense_call_ms": median_ms(acc["dense_call"]),
        "restricted_call_ms": median_ms(acc["restricted_call"]),
        "restricted_calls": len(acc["restricted_call"]),
        "restricted_over_dense": round(float(np.median(acc["restricted_call"]) / np.median(acc["dense_call"])), 3)
        if acc["restricted_call"] else None,
        "restricted_blocks_ms": median_ms(acc["restricted_blocks"]),
        "restricted_block_ms": round(median_ms(acc["restricted_blocks"]) / layers, 3),
        "context_attention_per_block_ms": round(median_ms(acc["restricted_context_attention"]) / layers, 3),
        "outside_blocks_ms": round(median_ms(acc["restricted_call"]) - median_ms(acc["restricted_blocks"]), 3),
        "layers": layers,
        "subset_tokens_median": int(np.median(subset_sizes)) if subset_sizes else None,
    }
    return out, env.model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warm", type=int, default=24, help="Table-1 workload: warm requests (24)")
    ap.add_argument("--stream", type=int, default=24, help="Table-1 workload: stream requests (24)")
    ap.add_argument("--requests", default="s0004,s0008",
                    help="stream requests to serve (comma separated; Table 1's joint hits s0004, s0008)")
    ap.add_argument("--repeats", type=int, default=5, help="rounds over the requests after one warm-up round (5)")
    ap.add_argument("--block-repeats", type=int, default=200, help="timed calls per block measurement (200)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from carnator.carnator_core.embedded.model import ensure_comfy_importable

    ensure_comfy_importable()
    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="carnator-restricted-") as tmp:
        serving, model = serving_path(args, Path(tmp))
    # the block alone at the subset size the hits above ran their restricted layers on
    subset = serving["subset_tokens_median"]
    if subset is None:
        raise SystemExit(f"none of {args.requests} was served as a joint hit: pick requests Table 1 reports as hits")
    blocks = block_alone(model, subset, args.block_repeats)
    info = {"machine": T.machine(), "args": vars(args), "serving": serving, "block_alone": blocks}
    print(json.dumps(info, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(info, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
