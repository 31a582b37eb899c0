#!/usr/bin/env python
"""What Carnator's own bookkeeping costs in a restricted model call, with and without chaining the restricted blocks.

    OMP_NUM_THREADS=1 .host/venv/bin/python scripts/bench/bench_block_patch.py [--wan]

1. The block patches of one restricted call (``comfy_patch._block_patch`` of 8 layers, the embedded model's depth)
   around a stand-in block that only copies its input (so what is timed is the patch: the subset's gather, the copy
   of the hidden states, the scatter back, the Python), per call, with ``comfy_patch.CHAIN_RESTRICTED_BLOCKS`` off
   (the per-block path) and on; medians of ``--repeats`` calls, the two alternating.
2. The tensor work alone per block (gather of the subset and the rotary frequencies, full copy, scatter; against the
   chained in-place scatter) at the embedded model's shape (2 x 576 x 128, a 123-token subset) and, with ``--wan``,
   at Wan 2.1-1.3B's (2 x 32,760 x 1,536 float32, a 9,996-token subset; ~1.2 GB of memory).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from repo_package import register_package  # noqa: E402

register_package()


def med_ms(fn, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def patches(repeats: int) -> dict[str, float]:
    import torch

    from carnator.carnator_core import comfy_patch as cp
    from carnator.carnator_core.adapters import ADAPTERS

    n, d, s, layers = 576, 128, 123, 8
    g = torch.Generator().manual_seed(0)
    sub = torch.sort(torch.randperm(n, generator=g)[:s]).values
    plan = cp.ReusePlan(active_tokens=sub, token_mask=torch.ones(4, 12, 12), cached_x0=None, noise=None,
                        sparse_layers=tuple(range(layers)), structure=None, restrict_tokens=True, context_tokens=sub,
                        kv_context=True)
    run = cp._Run(adapter=ADAPTERS["wan21"], n_tokens=n, patch=(2, 2, 2), grid=(4, 12, 12))
    run.reuse = plan
    topts = {"cond_or_uncond": [0, 1], "patches_replace": {"dit": {}}, "wrappers": {}}
    for la in range(layers):
        run.kv[(la, cp._composition(topts, 2))] = (None, None)  # a record exists: the layers run restricted
    img = torch.randn(2, n, d, generator=g)
    args = {"img": img, "txt": torch.randn(2, 32, d, generator=g), "vec": torch.randn(2, 1, 6, d, generator=g),
            "pe": torch.randn(1, n, 1, 32, 2, 2, generator=g), "transformer_options": topts}

    def stand_in(a):
        return {"img": a["img"] + 0}

    def one_call(chain: bool):
        cp.CHAIN_RESTRICTED_BLOCKS = chain
        blocks = [cp._block_patch(run, la, None) for la in range(layers)]

        def call():
            run.carry = None
            run.gathered.clear()
            x = img
            for p in blocks:
                x = p({**args, "img": x}, {"original_block": stand_in})["img"]
        return call

    out = {"per_block_path_ms": [], "chained_ms": []}
    try:
        for _ in range(3):  # alternating rounds
            out["per_block_path_ms"].append(med_ms(one_call(False), repeats))
            out["chained_ms"].append(med_ms(one_call(True), repeats))
    finally:
        cp.CHAIN_RESTRICTED_BLOCKS = True
    x = img[:, :s]
    out["stand_in_blocks_alone_ms"] = [med_ms(lambda: [stand_in({"img": x}) for _ in range(layers)], repeats)]
    return {k: round(statistics.median(v), 4) for k, v in out.items()}


def tensor_work(b: int, n: int, d: int, s: int, repeats: int) -> dict[str, float]:
    import torch

    g = torch.Generator().manual_seed(1)
    img = torch.randn(b, n, d, generator=g)
    sub = torch.sort(torch.randperm(n, generator=g)[:s]).values
    out = torch.randn(b, s, d, generator=g)
    freqs = torch.randn(1, n, 1, 32, 2, 2, generator=g)
    res = img.clone()

    def per_block():
        img.index_select(1, sub)
        freqs.index_select(1, sub)
        r = img.clone()
        r[:, sub] = out

    def chained():
        res[:, sub] = out

    a, c = [], []
    for _ in range(2):
        a.append(med_ms(per_block, repeats))
        c.append(med_ms(chained, repeats))
    return {"shape": [b, n, d], "subset": s, "per_block_ms": round(statistics.median(a), 4),
            "chained_ms": round(statistics.median(c), 4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=1000)
    ap.add_argument("--wan", action="store_true", help="also the tensor work at Wan 2.1-1.3B's shape (~1.2 GB)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    from carnator.carnator_core.embedded.model import ensure_comfy_importable

    ensure_comfy_importable()
    import torch

    out = {"threads": torch.get_num_threads(), "nproc": os.cpu_count(), "loadavg_start": os.getloadavg(),
           "patches_of_one_restricted_call": patches(args.repeats),
           "tensor_work_per_block": [tensor_work(2, 576, 128, 123, args.repeats)]}
    if args.wan:
        out["tensor_work_per_block"].append(tensor_work(2, 32760, 1536, 9996, 5))
    out["loadavg_end"] = os.getloadavg()
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
