"""Block-structure recording and block-sparse attention (carnator_core.sparse_attention). Pure torch, no ComfyUI.

The reference for every backend is written here independently of the module: float64 softmax(q k^T * scale + M) v
with M = -inf outside the kept blocks, the token-level mask built by repeat_interleave of the block pattern.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from carnator.carnator_core import sparse_attention as sa
from carnator.carnator_core.types import BlockStructure


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _qkv(B: int, H: int, L: int, D: int, seed: int = 0):
    g = _gen(seed)
    return tuple(torch.randn(B, H, L, D, generator=g) for _ in range(3))


def _random_keep(Hk: int, nb: int, density: float, seed: int = 0) -> torch.Tensor:
    keep = torch.rand(Hk, nb, nb, generator=_gen(seed)) < density
    return keep | torch.eye(nb, dtype=torch.bool)


def _reference(q, k, v, keep, bs, query_index=None):
    """Dense masked attention in float64, mask from the block pattern by repeat_interleave (not the module's helper)."""
    L = k.shape[2]
    keep3 = keep if keep.dim() == 3 else keep[None]
    tok = keep3.repeat_interleave(bs, dim=1).repeat_interleave(bs, dim=2)[:, :L, :L]  # [Hk, L, L]
    if query_index is not None:
        tok = tok[:, query_index]
    s = torch.matmul(q.double(), k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~tok[None], float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.double()).float()


def _structured_qk(H: int, grid: tuple[int, int, int], D: int, seed: int = 0, sharp: float = 10.0, sigma: float = 2.0):
    """q, k [1, H, L, D] whose attention is mostly local on a (T, Hh, W) token grid, like video self-attention:
    random Fourier features of a Gaussian kernel of width ``sigma`` tokens, so q_i . k_j / sqrt(D) ~
    sharp * exp(-|p_i - p_j|^2 / (2 sigma^2)) plus the random-feature noise (which spreads some mass far away)."""
    g = _gen(seed)
    T, Hh, W = grid
    pos = torch.stack(torch.meshgrid(torch.arange(T), torch.arange(Hh), torch.arange(W), indexing="ij"), -1)
    pos = pos.reshape(-1, 3).float()
    nf = D // 2
    freqs = torch.randn(H, 3, nf, generator=g) / sigma
    ang = torch.einsum("lc,hcf->hlf", pos, freqs)  # [H, L, nf]
    feat = torch.cat([ang.cos(), ang.sin()], -1) * math.sqrt(sharp * math.sqrt(D) / nf)
    q = feat + 0.1 * torch.randn(feat.shape, generator=g)
    k = feat + 0.1 * torch.randn(feat.shape, generator=g)
    return q[None], k[None]


# ---------------------------------------------------------------------------------------------------------------
# block-sparse attention
# ---------------------------------------------------------------------------------------------------------------

CASES = [
    # B, H, L, D, block_size, pattern heads (Hk)
    (1, 2, 256, 16, 64, 2),  # divisible, per-head patterns
    (2, 4, 200, 8, 64, 4),  # partial last block (200 = 3*64 + 8)
    (1, 4, 130, 16, 32, 1),  # partial last block of 2 tokens, one pattern shared by all heads
]


@pytest.mark.parametrize("strategy", ["grouped", "padded"])
@pytest.mark.parametrize("B,H,L,D,bs,Hk", CASES[:3])
@pytest.mark.parametrize("density", [0.2, 0.6])
def test_gather_equals_dense_masked_reference(B, H, L, D, bs, Hk, strategy, density):
    q, k, v = _qkv(B, H, L, D, seed=L + H)
    keep = _random_keep(Hk, sa.n_blocks(L, bs), density, seed=B + bs)
    ref = _reference(q, k, v, keep, bs)
    out = sa.block_sparse_attention(q, k, v, keep, bs, backend="gather", strategy=strategy)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    masked = sa.block_sparse_attention(q, k, v, keep, bs, backend="dense_masked")
    torch.testing.assert_close(masked, ref, atol=2e-5, rtol=1e-4)
    # The sparse result really differs from dense attention (the test would catch a kernel ignoring keep).
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert (out - dense).abs().max() > 1e-2


@pytest.mark.parametrize("strategy", ["grouped", "padded"])
@pytest.mark.parametrize("B,H,L,D,bs,Hk", CASES[:3])
def test_query_index_subset(B, H, L, D, bs, Hk, strategy):
    q, k, v = _qkv(B, H, L, D, seed=7)
    keep = _random_keep(Hk, sa.n_blocks(L, bs), 0.35, seed=3)
    qi = torch.randperm(L, generator=_gen(5))[: L // 3]  # unsorted active positions
    if not bool((qi == L - 1).any()):
        qi = torch.cat([qi, torch.tensor([L - 1])])  # include the partial last block
    ref_full = _reference(q, k, v, keep, bs)
    out = sa.block_sparse_attention(q[:, :, qi], k, v, keep, bs, qi, backend="gather", strategy=strategy)
    torch.testing.assert_close(out, ref_full[:, :, qi], atol=2e-5, rtol=1e-4)
    masked = sa.block_sparse_attention(q[:, :, qi], k, v, keep, bs, qi, backend="dense_masked")
    torch.testing.assert_close(masked, ref_full[:, :, qi], atol=2e-5, rtol=1e-4)


def test_all_true_keep_equals_sdpa():
    B, H, L, D, bs = 2, 3, 150, 16, 32
    q, k, v = _qkv(B, H, L, D, seed=11)
    keep = torch.ones(H, sa.n_blocks(L, bs), sa.n_blocks(L, bs), dtype=torch.bool)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    torch.testing.assert_close(sa.block_sparse_attention(q, k, v, keep, bs, backend="gather"), sdpa(q, k, v))
    qi = torch.arange(0, L, 7)
    torch.testing.assert_close(
        sa.block_sparse_attention(q[:, :, qi], k, v, keep, bs, qi, backend="gather"), sdpa(q[:, :, qi], k, v)
    )


def test_all_needed_blocks_kept_uses_dense_path_and_is_exact():
    # Query block 0 has no active rows, so dropping its keys changes nothing: the plan is dense.
    B, H, L, D, bs = 1, 2, 128, 8, 32
    q, k, v = _qkv(B, H, L, D, seed=2)
    keep = torch.ones(1, 4, 4, dtype=torch.bool)
    keep[0, 0, 1:] = False
    qi = torch.arange(40, 128)
    plan = sa.plan_block_sparse(keep, bs, L, qi)
    assert plan.dense
    out = sa.block_sparse_attention(q[:, :, qi], k, v, keep, bs, qi, plan=plan)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q[:, :, qi], k, v))


def test_bld_adapter_matches_bhld_layout():
    B, H, L, D, bs = 2, 4, 96, 8, 32
    q, k, v = _qkv(B, H, L, D, seed=4)
    keep = _random_keep(H, 3, 0.3, seed=9)
    qi = torch.tensor([5, 40, 41, 95, 0])
    ref = sa.block_sparse_attention(q[:, :, qi], k, v, keep, bs, qi, backend="gather")

    def bld(x):
        return x.transpose(1, 2).reshape(B, x.shape[2], H * D)

    out = sa.block_sparse_attention_bld(bld(q[:, :, qi]), bld(k), bld(v), H, keep, bs, qi)
    assert out.shape == (B, len(qi), H * D)
    torch.testing.assert_close(out, bld(ref))


def test_plan_reuse_and_density():
    B, H, L, D, bs = 1, 2, 256, 8, 64
    q, k, v = _qkv(B, H, L, D, seed=8)
    keep = _random_keep(H, 4, 0.3, seed=1)
    plan = sa.plan_block_sparse(keep, bs, L)
    # density = kept (query, key) pairs / all pairs; with L divisible it is the block density.
    assert plan.density == pytest.approx(float(keep.float().mean()))
    a = sa.block_sparse_attention(q, k, v, keep, bs, plan=plan)
    b = sa.block_sparse_attention(q * 2, k, v, keep, bs, plan=plan)
    torch.testing.assert_close(a, _reference(q, k, v, keep, bs), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(b, _reference(q * 2, k, v, keep, bs), atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="rebuild"):
        sa.block_sparse_attention(q[:, :, :10], k, v, keep, bs, torch.arange(10), plan=plan)


def test_invalid_inputs_have_clear_errors():
    B, H, L, D, bs = 1, 2, 128, 8, 32
    q, k, v = _qkv(B, H, L, D)
    keep = torch.ones(H, 4, 4, dtype=torch.bool)
    keep[1, 2] = False  # query block 2 of head 1 attends to nothing
    with pytest.raises(ValueError, match="no key block"):
        sa.block_sparse_attention(q, k, v, keep, bs, backend="gather")
    with pytest.raises(ValueError, match="different latent shape"):
        sa.block_sparse_attention(q, k, v, torch.ones(H, 5, 5, dtype=torch.bool), bs)
    with pytest.raises(ValueError, match="1 \\(shared\\) or 2"):
        sa.block_sparse_attention(q, k, v, torch.ones(3, 4, 4, dtype=torch.bool), bs)
    with pytest.raises(ValueError, match="query_index"):
        sa.block_sparse_attention(q[:, :, :5], k, v, torch.ones(1, 4, 4, dtype=torch.bool), bs)
    with pytest.raises(ValueError, match=r"\[0, 128\)"):
        sa.block_sparse_attention(q[:, :, :1], k, v, torch.ones(1, 4, 4, dtype=torch.bool), bs, torch.tensor([128]))
    with pytest.raises(ValueError, match="backend"):
        sa.block_sparse_attention(q, k, v, torch.ones(1, 4, 4, dtype=torch.bool), bs, backend="nope")


@pytest.mark.slow
@pytest.mark.skipif(not sa.flex_available(), reason="torch has no flex_attention")
def test_flex_block_mask_equals_reference_eager():
    """Slow: "eager" flex_attention still traces with dynamo (measured 14 s for the first call, 3.5 s per new
    shape on this CPU). It evaluates the mask_mod densely (ignoring block sparsity), so this pins the
    element-wise semantics of the BlockMask; the block lists are pinned by test_flex_block_lists (fast) and by
    the compiled test."""
    for B, H, L, D, bs, Hk in (CASES[1], CASES[2]):  # per-head / shared patterns, both with a partial block
        q, k, v = _qkv(B, H, L, D, seed=21)
        keep = _random_keep(Hk, sa.n_blocks(L, bs), 0.3, seed=22)
        ref = _reference(q, k, v, keep, bs)
        out = sa.block_sparse_attention(q, k, v, keep, bs, backend="flex", flex_compiled=False)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
        qi = torch.randperm(L, generator=_gen(1))[: L // 2]
        out = sa.block_sparse_attention(q[:, :, qi], k, v, keep, bs, qi, backend="flex", flex_compiled=False)
        torch.testing.assert_close(out, ref[:, :, qi], atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(not sa.flex_available(), reason="torch has no flex_attention")
def test_flex_block_lists_cover_exactly_the_kept_blocks():
    """The compiled kernel only visits listed blocks: the (partial | full) lists must equal keep per q tile."""
    L, bs, H = 200, 64, 3
    keep = _random_keep(H, 4, 0.4, seed=3)
    bm = sa.build_flex_block_mask(keep, bs, L)
    listed = bm.to_dense()[0].bool()  # [H, q tiles, kv blocks], partial and full together
    assert torch.equal(listed, keep)
    # Sorted active positions: tiles that fall inside one query block list exactly that block's row.
    qi = torch.cat([torch.arange(0, 64), torch.arange(128, 150)])
    bm = sa.build_flex_block_mask(keep, bs, L, qi)
    listed = bm.to_dense()[0].bool()
    assert torch.equal(listed[:, 0], keep[:, 0])
    assert torch.equal(listed[:, 1], keep[:, 2])


@pytest.mark.slow
@pytest.mark.skipif(not sa.flex_available(), reason="torch has no flex_attention")
def test_flex_compiled_on_cpu_matches_reference():
    """Compiled flex on CPU (inductor; the first compile takes tens of seconds) visits only the listed blocks, so
    this pins the block lists (full and partial) as the kernel uses them, with and without active queries."""
    B, H, L, D, bs = 1, 2, 256, 16, 64
    q, k, v = _qkv(B, H, L, D, seed=31)
    keep = _random_keep(H, 4, 0.3, seed=32)
    ref = _reference(q, k, v, keep, bs)
    out = sa.block_sparse_attention(q, k, v, keep, bs, backend="flex", flex_compiled=True)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    qi = torch.randperm(L, generator=_gen(2))[:100].sort().values  # q tiles spanning several query blocks
    out = sa.block_sparse_attention(q[:, :, qi], k, v, keep, bs, qi, backend="flex", flex_compiled=True)
    torch.testing.assert_close(out, ref[:, :, qi], atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# recording
# ---------------------------------------------------------------------------------------------------------------


def test_select_blocks_is_the_smallest_set_reaching_mass():
    probs = torch.softmax(torch.randn(3, 7, 7, generator=_gen(0)) * 2, -1)
    for mass in (0.5, 0.8, 0.95, 1.0):
        keep = sa.select_blocks(probs, mass=mass, keep_diagonal=False)
        kept = (probs * keep).sum(-1)
        assert bool((kept >= mass - 1e-5).all())
        # Minimal: dropping the least probable kept block falls below mass (kept blocks are the top ones).
        smallest = torch.where(keep, probs, torch.full_like(probs, 2.0)).min(-1).values
        assert bool((kept - smallest < mass).all() | (keep.sum(-1) == 1).all())
        assert bool((probs.masked_fill(keep, -1).max(-1).values <= smallest + 1e-7).all())
    keep = sa.select_blocks(probs, mass=0.99, max_density=0.3)
    assert int(keep.sum(-1).max()) <= math.ceil(0.3 * 7) + 1
    assert bool(keep.diagonal(dim1=-2, dim2=-1).all())


def _pooled_reference(q, k, bs):
    """Mean-pooled query per block (partial block over its real tokens) x all keys, softmax, summed per key block."""
    B, H, L, D = q.shape
    nb = sa.n_blocks(L, bs)
    rep = torch.stack([q[:, :, i * bs : min(L, (i + 1) * bs)].mean(2) for i in range(nb)], 2)  # [B, H, nb, D]
    p = torch.softmax(rep.double() @ k.double().transpose(-1, -2) / math.sqrt(D), -1)  # [B, H, nb, L]
    return torch.stack([p[..., j * bs : min(L, (j + 1) * bs)].sum(-1) for j in range(nb)], -1).mean(0).float()


def test_record_keeps_mass_of_estimated_attention_and_diagonal():
    q, k = _structured_qk(H=3, grid=(4, 10, 10), D=32, seed=1)  # L = 400, bs 64 -> partial last block
    bs = 64
    torch.testing.assert_close(
        sa.estimate_block_mass(q, k, bs, sample_queries=0), _pooled_reference(q, k, bs), atol=1e-5, rtol=1e-4
    )
    for s in (0, 8):
        probs = sa.estimate_block_mass(q, k, bs, sample_queries=s)
        torch.testing.assert_close(probs.sum(-1), torch.ones(3, 7))
        for mass in (0.7, 0.9):
            keep = sa.record_block_structure(q, k, bs, mass=mass, sample_queries=s)
            assert keep.shape == (3, 7, 7) and keep.dtype == torch.bool
            assert bool(((probs * keep).sum(-1) >= mass - 1e-5).all())
            assert bool(keep.diagonal(dim1=-2, dim2=-1).all())
    avg = sa.record_block_structure(q, k, bs, mass=0.9, head_average=True)
    assert avg.shape == (1, 7, 7)


def test_sampled_queries_are_the_block_rows_softmax_mean():
    q, k = _structured_qk(H=2, grid=(1, 5, 20), D=16, seed=4)  # L = 100, bs 32: blocks of 32, 32, 32, 4
    bs = 32
    probs = sa.estimate_block_mass(q, k, bs, sample_queries=4)
    p = torch.softmax(q[0].double() @ k[0].double().transpose(-1, -2) / 4.0, -1)  # [H, L, L]
    pb = torch.stack([p[..., j * bs : min(100, (j + 1) * bs)].sum(-1) for j in range(4)], -1)  # [H, L, Kb]
    rows = [[4, 12, 20, 28], [36, 44, 52, 60], [68, 76, 84, 92], [96, 97, 98, 99]]  # evenly spaced, partial last
    expect = torch.stack([pb[:, r].mean(1) for r in rows], 1).float()
    torch.testing.assert_close(probs, expect, atol=1e-5, rtol=1e-4)


def test_record_on_local_attention_is_sparse_and_covers_true_mass():
    """On local (video-like) attention the recorded structure is sparse yet keeps most of the *true* mass."""
    q, k = _structured_qk(H=2, grid=(8, 16, 16), D=32, seed=2)  # L = 2048
    bs = 64
    true = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(32), -1)[0]  # [H, L, L]
    true_blocks = true.reshape(2, 2048, 32, bs).sum(-1)  # [H, L, Kb]
    def measure(**kw):
        keep = sa.record_block_structure(q, k, bs, mass=0.9, **kw)
        per_query_keep = keep.repeat_interleave(bs, dim=1)  # [H, L, Kb]
        return float(keep.float().mean()), float((true_blocks * per_query_keep).sum(-1).mean())

    # Sampled queries track the per-token attention: sparse, close to the requested mass.
    density, coverage = measure(sample_queries=8)
    assert density < 0.35 and coverage > 0.85, (density, coverage)
    # The mean-pooled query is flatter than its tokens' attention: conservative (denser, more mass kept).
    density_pooled, coverage_pooled = measure(sample_queries=0)
    assert density_pooled > density and coverage_pooled > 0.9, (density_pooled, coverage_pooled)


def test_block_recorder_union_frequency_and_structure():
    bs = 32
    obs = [_structured_qk(H=2, grid=(2, 8, 10), D=16, seed=s) for s in range(3)]  # L = 160
    singles = [sa.record_block_structure(q, k, bs, mass=0.8) for q, k in obs]
    rec = sa.BlockRecorder(bs, layers=[3, 5], steps=[0, 2], mass=0.8)
    assert rec.wants(3, 0) and not rec.wants(4, 0) and not rec.wants(3, 1)
    rec.observe(5, 0, *obs[0])
    rec.observe(5, 2, *obs[1])
    rec.observe(3, 2, *obs[2])
    st = rec.result()
    assert isinstance(st, BlockStructure)
    assert st.layers == (3, 5) and st.steps == (0, 2) and st.block_size == bs and st.n_tokens == 160
    assert st.keep.shape == (2, 2, 5, 5) and st.keep.dtype == np.bool_
    assert np.array_equal(st.keep[1], (singles[0] | singles[1]).numpy())
    assert np.array_equal(st.keep[0], singles[2].numpy())
    assert rec.n_observations == 3 and rec.seconds > 0
    freq = sa.BlockRecorder(bs, mass=0.8, combine="frequency", min_frequency=1.0)
    freq.observe(5, 0, *obs[0])
    freq.observe(5, 1, *obs[1])
    both = (singles[0] & singles[1]) | torch.eye(5, dtype=torch.bool)
    assert np.array_equal(freq.result().keep[0], both.numpy())
    # The structure feeds block_sparse_attention directly.
    keep5 = sa.keep_for_layer(st, 5)
    q, k = obs[0]
    out = sa.block_sparse_attention(q, k, k, keep5, bs)
    torch.testing.assert_close(out, _reference(q, k, k, keep5, bs), atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="not recorded"):
        sa.keep_for_layer(st, 4)


def test_block_recorder_errors():
    rec = sa.BlockRecorder(16)
    with pytest.raises(ValueError, match="no observations"):
        rec.result()
    rec.observe(0, 0, *_qkv(1, 2, 48, 8)[:2])
    with pytest.raises(ValueError, match="one recorder records one request"):
        rec.observe(0, 1, *_qkv(1, 2, 64, 8)[:2])
    rec.observe_bld(1, 0, torch.randn(1, 48, 16), torch.randn(1, 48, 16), heads=2)
    assert rec.result().keep.shape == (2, 2, 3, 3)


def test_record_flops_are_a_small_fraction_of_dense_attention():
    """Cost is pinned by counted FLOPs (deterministic; wall-clock cost is in scripts/bench/bench_sparse_attention.py):
    the estimate scores Qb * S representative queries against the L keys instead of L queries."""
    from torch.utils.flop_counter import FlopCounterMode

    q, k, v = _qkv(1, 4, 1024, 32, seed=3)
    bs = 64

    def flops(fn) -> int:
        with FlopCounterMode(display=False) as counter:
            fn()
        return counter.get_total_flops()

    dense = flops(lambda: torch.softmax(q @ k.transpose(-1, -2), -1) @ v)  # = 4 * B * H * L^2 * D
    assert dense == 4 * 4 * 1024**2 * 32
    for s in (0, 8):
        rec = flops(lambda: sa.record_block_structure(q, k, bs, sample_queries=s))
        assert 0 < rec <= dense * max(s, 1) / bs, (s, rec, dense)


def test_plans_are_cached_by_content():
    sa.clear_plan_cache()
    B, H, L, D, bs = 1, 2, 128, 8, 32
    q, k, v = _qkv(B, H, L, D, seed=12)
    keep = _random_keep(H, 4, 0.3, seed=13)
    a = sa.block_sparse_attention(q, k, v, keep, bs)
    b = sa.block_sparse_attention(q, k, v, keep.clone(), bs)  # equal content, new tensor: cache hit
    assert len(sa._PLAN_CACHE) == 1
    torch.testing.assert_close(a, b)
    other = keep.clone()
    other[0, 0, 1] = ~other[0, 0, 1]
    c = sa.block_sparse_attention(q, k, v, other, bs)
    assert len(sa._PLAN_CACHE) == 2
    torch.testing.assert_close(c, _reference(q, k, v, other, bs), atol=2e-5, rtol=1e-4)
    sa.clear_plan_cache()


def test_estimate_is_independent_of_memory_chunking():
    q, k = _structured_qk(H=3, grid=(2, 8, 10), D=16, seed=9)  # L = 160
    for s in (0, 4):
        whole = sa.estimate_block_mass(q, k, 32, sample_queries=s)
        tiny = sa.estimate_block_mass(q, k, 32, sample_queries=s, max_chunk_elems=100)  # one block per chunk
        torch.testing.assert_close(whole, tiny)


# ---------------------------------------------------------------------------------------------------------------
# block-sparse attention between token sets (the reuse hit path)
# ---------------------------------------------------------------------------------------------------------------


def _token_reference(q, k, v, keep, bs, q_pos, k_pos):
    """float64 softmax with the token-level mask keep[h, q_pos // bs, k_pos // bs], built by repeat_interleave of
    the block pattern over the whole sequence and then indexed (independent of the module's helpers)."""
    keep3 = keep if keep.dim() == 3 else keep[None]
    L = int(max(int(q_pos.max()), int(k_pos.max()))) + 1
    tok = keep3.repeat_interleave(bs, dim=1).repeat_interleave(bs, dim=2)[:, :L, :L]
    tok = tok[:, q_pos][:, :, k_pos]  # [Hk, Lq, Lk]
    tok = tok.repeat_interleave(q.shape[1] // keep3.shape[0], 0)
    s = torch.matmul(q.double(), k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~tok[None], float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.double()).float()


def _token_sets(L: int, kind: str, seed: int):
    g = _gen(seed)
    if kind == "all":
        return torch.arange(L), None
    if kind == "sorted_subset":  # the hit path today: queries = keys = a sorted subset
        return torch.sort(torch.randperm(L, generator=g)[: L // 3]).values, None
    if kind == "unsorted_subset":
        return torch.randperm(L, generator=g)[: L // 2], None
    # queries = active tokens, keys = active + context, in arbitrary order
    qp = torch.randperm(L, generator=g)[: L // 4]
    extra = torch.randperm(L, generator=g)[: L // 3]
    kp = torch.unique(torch.cat([qp, extra]))
    return qp, kp[torch.randperm(kp.numel(), generator=g)]


@pytest.mark.parametrize("kind", ["all", "sorted_subset", "unsorted_subset", "queries_and_context"])
@pytest.mark.parametrize("B,H,L,D,bs,Hk", CASES)
@pytest.mark.parametrize("density", [0.15, 0.5])
def test_token_kernel_equals_dense_mask_reference(B, H, L, D, bs, Hk, kind, density):
    qp, kp = _token_sets(L, kind, seed=L + Hk)
    kpos = qp if kp is None else kp
    nb = sa.n_blocks(L, bs)
    keep = _random_keep(Hk, nb, density, seed=bs + Hk)
    g = _gen(L)
    q = torch.randn(B, H, qp.numel(), D, generator=g)
    k, v = (torch.randn(B, H, kpos.numel(), D, generator=g) for _ in range(2))
    if kp is not None:
        # Every query's own token is among the keys (as on the hit path): its own (diagonal) block has a key.
        assert bool(torch.isin(qp, kp).all())
    ref = _token_reference(q, k, v, keep, bs, qp, kpos)
    out = sa.token_block_sparse_attention(q, k, v, keep, bs, L, qp, kp, backend="gather")
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    masked = sa.token_block_sparse_attention(q, k, v, keep, bs, L, qp, kp, backend="dense_masked")
    torch.testing.assert_close(masked, ref, atol=2e-5, rtol=1e-4)
    # The pattern removes pairs, so the result differs from unmasked attention among the same tokens.
    assert (out - torch.nn.functional.scaled_dot_product_attention(q, k, v)).abs().max() > 1e-2
    plan = sa.plan_token_block_sparse(keep, bs, L, qp, kp)
    qb, kb = qp // bs, kpos // bs
    assert plan.kept_pairs == int(keep[:, qb[:, None], kb[None, :]].sum())


def test_token_kernel_bld_layout_and_all_true_keep():
    B, H, L, D, bs = 2, 3, 150, 8, 32
    qp = torch.sort(torch.randperm(L, generator=_gen(1))[:70]).values
    g = _gen(2)
    q, k, v = (torch.randn(B, qp.numel(), H * D, generator=g) for _ in range(3))
    nb = sa.n_blocks(L, bs)
    keep = _random_keep(1, nb, 0.3, seed=4)
    out = sa.token_block_sparse_attention_bld(q, k, v, H, keep, bs, L, qp)
    to = lambda x: x.view(B, -1, H, D).transpose(1, 2)  # noqa: E731
    ref = _token_reference(to(q), to(k), to(v), keep, bs, qp, qp).transpose(1, 2).reshape(B, -1, H * D)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    full = torch.ones(1, nb, nb, dtype=torch.bool)
    plan = sa.plan_token_block_sparse(full, bs, L, qp)
    assert plan.dense and plan.density == 1.0 and plan.n_calls == 0
    sdpa = torch.nn.functional.scaled_dot_product_attention
    torch.testing.assert_close(sa.token_block_sparse_attention(to(q), to(k), to(v), full, bs, L, qp, plan=plan),
                               sdpa(to(q), to(k), to(v)))


def test_token_kernel_builds_no_token_mask(monkeypatch):
    """The gather kernel's SDPA calls get no mask at all, and each call is one group's dense tile: query blocks
    are grouped by their key-block set, so a frame pattern (blocks attend the blocks of their own frame) gives
    one call per frame, each exactly that frame's queries against that frame's keys."""
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, *a, **kw):
        calls.append((attn_mask, tuple(q.shape), tuple(k.shape)))
        return real(q, k, v, attn_mask, *a, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    L, bs, H, D = 512, 32, 2, 8
    nb = sa.n_blocks(L, bs)
    i = torch.arange(nb)
    frames = (i[:, None] // 4) == (i[None, :] // 4)  # "spatial head": 4 blocks per frame
    qp = torch.sort(torch.randperm(L, generator=_gen(3))[:300]).values
    q, k, v = (torch.randn(1, H, qp.numel(), D, generator=_gen(s)) for s in range(3))
    plan = sa.plan_token_block_sparse(frames, bs, L, qp)
    assert plan.n_calls == nb // 4  # one tile per frame
    out = sa.token_block_sparse_attention(q, k, v, frames, bs, L, qp, plan=plan)
    assert len(calls) == nb // 4 and all(m is None for m, _, _ in calls)
    # Each tile is exactly one frame's queries against that frame's keys: sum of tiles = kept pairs.
    assert sum(qs[2] * ks[2] for _, qs, ks in calls) == plan.kept_pairs == int(
        frames[(qp // bs)[:, None], (qp // bs)[None, :]].sum())
    torch.testing.assert_close(out, _token_reference(q, k, v, frames, bs, qp, qp), atol=2e-5, rtol=1e-4)


def test_token_kernel_errors_are_clear():
    L, bs = 128, 32
    q = torch.randn(1, 2, 10, 8)
    qp = torch.arange(10)
    keep = torch.eye(4, dtype=torch.bool)
    with pytest.raises(ValueError, match="q_pos has 9 entries"):
        sa.token_block_sparse_attention(q, q, q, keep, bs, L, qp[:9])
    with pytest.raises(ValueError, match="pass k_pos"):
        sa.token_block_sparse_attention(q, q[:, :, :5], q[:, :, :5], keep, bs, L, qp)
    with pytest.raises(ValueError, match=r"positions in \[0, 128\)"):
        sa.plan_token_block_sparse(keep, bs, L, qp + 200)
    with pytest.raises(ValueError, match="covers 4x4 blocks"):
        sa.plan_token_block_sparse(keep, bs, 300, qp)
    # Queries of block 0 whose only kept key block (0) holds no key: a row without keys is refused.
    with pytest.raises(ValueError, match="none of its kept key blocks holds a key"):
        sa.plan_token_block_sparse(keep, bs, L, qp, torch.arange(40, 60))


def test_plan_cache_is_thread_safe_and_shares_one_build():
    """Two threads that miss the same key at the same time both build, but both get the first stored object;
    many threads hammering the LRU keep it bounded and consistent."""
    import threading

    sa.clear_plan_cache()
    barrier = threading.Barrier(2)
    got = [None, None]

    def build():
        barrier.wait(timeout=10)  # both threads are inside build() before either stores
        return object()

    def worker(j):
        got[j] = sa._cached_key(("race",), build)

    ts = [threading.Thread(target=worker, args=(j,)) for j in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=20)
    assert got[0] is not None and got[0] is got[1]

    errors = []
    keep = _random_keep(1, 4, 0.3, seed=1)

    def hammer(j):
        try:
            for n in range(200):
                qp = torch.arange((j * 7 + n) % 100, 128)
                sa._cached_key(("p", (j + n) % 80), lambda: sa.plan_token_block_sparse(keep, 32, 128, qp))
        except Exception as e:  # pragma: no cover - the failure being tested
            errors.append(e)

    ts = [threading.Thread(target=hammer, args=(j,)) for j in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
    assert not errors and len(sa._PLAN_CACHE) <= sa._CACHE_SIZE
    sa.clear_plan_cache()


@pytest.mark.skipif(not sa.flex_available(), reason="torch has no flex_attention")
def test_token_flex_block_mask_lists_exactly_the_needed_tiles():
    """Flex tiles of sorted token sets: listed iff some kept (query block, key block) pair falls in the tile,
    'full' iff all pairs in it are kept -- checked against the token-level mask pooled per tile."""
    L, bs = 300, 16
    nb = sa.n_blocks(L, bs)
    keep = _random_keep(2, nb, 0.3, seed=8)
    qp = torch.sort(torch.randperm(L, generator=_gen(1))[:100]).values
    kp = torch.sort(torch.unique(torch.cat([qp, torch.randperm(L, generator=_gen(2))[:90]]))).values
    bm = sa.build_token_flex_block_mask(keep, bs, L, qp, kp)
    tok = keep[:, (qp // bs)[:, None], (kp // bs)[None, :]]  # [2, Lq, Lk]
    nqt, nkt = sa.n_blocks(qp.numel(), bs), sa.n_blocks(kp.numel(), bs)
    padded = torch.zeros(2, nqt * bs, nkt * bs, dtype=torch.bool)
    padded[:, : qp.numel(), : kp.numel()] = tok
    tiles = padded.view(2, nqt, bs, nkt, bs)
    want_any = tiles.any(4).any(2)
    dense = bm.to_dense()[0].bool()  # [Hk, nqt, nkt]: listed tiles (partial or full)
    assert torch.equal(dense, want_any)
    full = torch.zeros_like(want_any)
    for h in range(2):
        for t in range(nqt):
            for j in bm.full_kv_indices[0, h, t, : int(bm.full_kv_num_blocks[0, h, t])].tolist():
                full[h, t, j] = True
    for h in range(2):
        for t in range(nqt):
            rows = slice(t * bs, min((t + 1) * bs, qp.numel()))
            for j in range(nkt):
                cols = slice(j * bs, (j + 1) * bs)
                all_kept = bool(tok[h, rows, cols].all()) and (j + 1) * bs <= kp.numel()
                assert bool(full[h, t, j]) == all_kept, (h, t, j)


@pytest.mark.skipif(not sa.flex_available(), reason="torch has no flex_attention")
def test_token_flex_eager_equals_reference():
    import warnings

    L, bs, H, D = 200, 16, 2, 8
    keep = _random_keep(1, sa.n_blocks(L, bs), 0.3, seed=6)
    qp, kp = _token_sets(L, "queries_and_context", seed=3)  # unsorted: the flex path sorts and unsorts
    g = _gen(4)
    q = torch.randn(1, H, qp.numel(), D, generator=g)
    k, v = (torch.randn(1, H, kp.numel(), D, generator=g) for _ in range(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = sa.token_block_sparse_attention(q, k, v, keep, bs, L, qp, kp, backend="flex", flex_compiled=False)
    torch.testing.assert_close(out, _token_reference(q, k, v, keep, bs, qp, kp), atol=2e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# the hit path in ComfyUI (comfy_patch._subset_attention and a joint-reuse run on a tiny Wan)
# ---------------------------------------------------------------------------------------------------------------


def _old_subset_mask(keep: torch.Tensor, bs: int, q_sub: torch.Tensor, k_sub: torch.Tensor) -> torch.Tensor:
    """The hit path's former token-level mask: union over heads, plus 'same block' (the contract to keep)."""
    kb = keep.any(0)
    qb, kb_ = q_sub // bs, k_sub // bs
    return kb[qb][:, kb_] | (qb[:, None] == kb_[None, :])


@pytest.mark.comfy
@pytest.mark.parametrize("with_context", [False, True])
def test_subset_attention_equals_masked_reference_without_a_token_mask(comfy_env, monkeypatch, with_context):
    from types import SimpleNamespace

    from carnator.carnator_core import comfy_patch as cp

    L, bs, H, D, B = 400, 16, 3, 8, 2
    nb = sa.n_blocks(L, bs)
    keep = torch.rand(H, nb, nb, generator=_gen(1)) < 0.08  # sparse per head; diagonal not forced
    sub = torch.sort(torch.randperm(L, generator=_gen(2))[:150]).values
    ksub = torch.unique(torch.cat([sub, torch.randperm(L, generator=_gen(3))[:60]])) if with_context else None
    kpos = sub if ksub is None else ksub
    g = _gen(4)
    q = torch.randn(B, sub.numel(), H * D, generator=g)
    k, v = (torch.randn(B, kpos.numel(), H * D, generator=g) for _ in range(2))
    masks = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*a, **kw):
        masks.append(kw.get("attn_mask", a[3] if len(a) > 3 else None))
        return real(*a, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    run = SimpleNamespace(layer=3, subset_cache={}, n_tokens=L, stats={"attn_pairs": 0, "attn_pairs_dense": 0})
    out = cp._subset_attention(run, q, k, v, H, keep, bs, sub, 0.85, k_subset=ksub)
    assert out is not None and masks and all(m is None for m in masks)
    mask = _old_subset_mask(keep, bs, sub, kpos)
    assert run.stats["attn_pairs"] == int(mask.sum()) and run.stats["attn_pairs_dense"] == L * L
    to = lambda x: x.view(B, -1, H, D).transpose(1, 2).double()  # noqa: E731
    s = (to(q) @ to(k).transpose(-1, -2)) / math.sqrt(D)
    ref = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ to(v)
    torch.testing.assert_close(out, ref.transpose(1, 2).reshape(B, -1, H * D).float(), atol=2e-5, rtol=1e-4)
    # Above the density threshold the caller runs unmasked SDPA instead (None), decided once per layer.
    run2 = SimpleNamespace(layer=3, subset_cache={}, n_tokens=L, stats={"attn_pairs": 0, "attn_pairs_dense": 0})
    assert cp._subset_attention(run2, q, k, v, H, torch.ones_like(keep), bs, sub, 0.85, k_subset=ksub) is None


def _tiny_wan_joint_hit(tmp_path):
    """A tiny Wan, its probe, and an accepted candidate whose recorded structure is a band of blocks (sparse)."""
    from types import SimpleNamespace

    import tiny_models as tm

    from carnator.carnator_core import reuse
    from carnator.carnator_core.types import BlockStructure, Candidate, Decision, ObjectSignature, Signature
    from carnator.nodes.probe import CarnatorEarlyProbe

    m = tm.load_tiny_model("wan21", tmp_path)
    pos, neg = tm.conditioning("wan21")
    lat = tm.empty_latent("wan21")
    probe = CarnatorEarlyProbe.execute(m, pos, neg, lat, 6, 8, 5.0, "euler", "simple", 2, "a red ball",
                                       None, None, "ball").args[0]
    T, Hh, W = probe.grid
    mask = np.zeros((T, Hh, W), np.float32)
    mask[:, : Hh // 2, : W // 2] = 1.0
    sig = Signature((ObjectSignature("ball", mask, float(mask.mean()), (50.0, 10.0, 10.0)),),
                    np.zeros((4, 4, 3), np.float32), probe.grid)
    target = Signature((ObjectSignature("ball", np.roll(mask, W // 2, axis=2), float(mask.mean()),
                                        (50.0, 10.0, 10.0)),), np.zeros((4, 4, 3), np.float32), probe.grid)
    n_tokens, bs = T * Hh * W, 4
    nb = sa.n_blocks(n_tokens, bs)
    layers = (1, 2)  # the tiny Wan's middle layers (4 blocks, first/last dense)
    band = (np.abs(np.arange(nb)[:, None] - np.arange(nb)[None, :]) <= 1)
    structure = BlockStructure(keep=np.broadcast_to(band, (len(layers), 1, nb, nb)).copy(), layers=layers,
                               block_size=bs, n_tokens=n_tokens)
    cached = reuse.CachedRun("entry-1", probe.x0_probe.clone(), probe.x0_probe, sig, structure)
    decision = Decision(True, Candidate("entry-1", 0.99, "a red ball", target), (), "signature",
                        summary="test accept")
    return SimpleNamespace(m=m, pos=pos, neg=neg, lat=lat, probe=probe, target=target, cached=cached,
                           decision=decision, n_tokens=n_tokens, bs=bs, nb=nb, layers=layers)


@pytest.mark.comfy
def test_joint_hit_path_runs_the_block_sparse_kernel_and_never_a_dense_mask(comfy_env, monkeypatch, tmp_path):
    """A joint hit on a tiny Wan whose cached structure is sparse: every middle-layer self-attention among the
    subset goes through the token-set kernel, and no SDPA call anywhere in the model gets a mask larger than
    O(blocks^2) (the former path passed an [S, S] boolean mask)."""
    from carnator.carnator_core import reuse

    h = _tiny_wan_joint_hit(tmp_path)
    m, pos, neg, lat, probe, target, cached, decision = (h.m, h.pos, h.neg, h.lat, h.probe, h.target, h.cached,
                                                          h.decision)
    n_tokens, bs, nb, layers = h.n_tokens, h.bs, h.nb, h.layers
    kernel_calls = []
    real_kernel = sa.token_block_sparse_attention

    def kernel_spy(*a, **kw):
        k_pos = a[7] if len(a) > 7 else kw.get("k_pos")
        kernel_calls.append((a[6].numel(), None if k_pos is None else k_pos.numel()))  # q_pos: the subset
        return real_kernel(*a, **kw)

    big_masks = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def sdpa_spy(*a, **kw):
        am = kw.get("attn_mask", a[3] if len(a) > 3 else None)
        if am is not None and am.numel() > nb * nb:
            big_masks.append(tuple(am.shape))
        return real_sdpa(*a, **kw)

    monkeypatch.setattr(sa, "token_block_sparse_attention", kernel_spy)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa_spy)
    out, r = reuse.sample(m, pos, neg, lat, probe, decision, cached,
                          reuse.ReuseConfig(mode="joint", block_size=bs, dilation=0, x0_threshold=1e9,
                                            sparse_kernel="always"),
                          target_signature=target)
    assert torch.isfinite(out).all() and r.decision == "hit" and not r.fallbacks, r.fallbacks
    assert 0 < r.token_fraction < 1
    # 8 steps - 2 probe steps = 6 model calls; the dense refresh calls that record the context keys/values run
    # plain attention, every other call reaches the kernel in the 2 recorded layers: queries = the subset, keys =
    # every token (the subset's fresh, the others' recorded).
    refresh = reuse.refresh_plan_calls(8, 2, reuse.ReuseConfig().refreshes)
    assert 0 < len(refresh) < 6
    assert len(kernel_calls) == (6 - len(refresh)) * len(layers), kernel_calls
    assert all(0 < nq < n_tokens and nk == n_tokens for nq, nk in kernel_calls), kernel_calls
    assert big_masks == []
    assert r.attention_fraction < r.token_fraction ** 2  # the band removed pairs among the subset


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["all", "unsorted_subset", "queries_and_context"])
def test_token_super_tiles_merge_exactly(kind, dtype):
    """A banded pattern: neighbouring query blocks share most key blocks, so the plan stacks them into
    super-tiles (shared keys in one tall tile, each block's own keys apart, merged by log-sum-exp). The result
    equals the masked reference, and equals the plan without super-tiles."""
    L, bs, H, D = 700, 16, 2, 8
    nb = sa.n_blocks(L, bs)
    i = torch.arange(nb)
    band = ((i[:, None] - i[None, :]).abs() <= 6)[None].expand(2, nb, nb).clone()
    band[1] |= (i[:, None] % 5) == (i[None, :] % 5)  # second head: plus a strided pattern
    qp, kp = _token_sets(L, kind, seed=9)
    kpos = qp if kp is None else kp
    g = _gen(5)
    q = torch.randn(1, H, qp.numel(), D, generator=g, dtype=dtype)
    k, v = (torch.randn(1, H, kpos.numel(), D, generator=g, dtype=dtype) for _ in range(2))
    tiled = sa.plan_token_block_sparse(band, bs, L, qp, kp, super_rows=64)
    plain = sa.plan_token_block_sparse(band, bs, L, qp, kp, super_rows=0)
    assert any(gr.residuals for gs in tiled.heads for gr in gs)  # super-tiles were formed
    assert sum(len(gs) for gs in tiled.heads) < sum(len(gs) for gs in plain.heads)
    assert tiled.kept_pairs == plain.kept_pairs
    ref = _token_reference(q, k, v, band, bs, qp, kpos)  # float64 math, rounded to float32
    out = sa.token_block_sparse_attention(q, k, v, band, bs, L, qp, kp, plan=tiled)
    torch.testing.assert_close(out.float(), ref, atol=2e-5, rtol=1e-4)
    # float64 takes the exact-math path of the merge: tiled and plain agree to float64 rounding.
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(out, sa.token_block_sparse_attention(q, k, v, band, bs, L, qp, kp, plan=plain),
                               **tol)


def test_tile_cost_model_is_the_documented_formula_and_sends_short_sequences_to_plain_attention():
    """The cost model ReuseConfig.sparse_kernel="cost" decides by: hand-computed values, and its verdicts where
    `bench_sparse_attention.py --crossover` measured them (576 tokens: tiles never pay; 8 192 tokens: a sparse
    band pays, a nearly dense one does not)."""
    eye = torch.eye(2, dtype=torch.bool)[None]
    # 8 tokens in blocks of 4; queries 0, 1, 4 (2 in block 0, 1 in block 1), keys = all 8
    r = sa.tile_cost_ratio(eye, 4, 8, torch.tensor([0, 1, 4]), torch.arange(8))
    assert r == pytest.approx(sa.TILE_PAIR_COST * 12 / 24 + 2 * sa.TILE_CALL_PAIRS / 24)
    assert sa.block_cost_ratio(eye, 8, 4) == pytest.approx(sa.BLOCK_PAIR_COST * 0.5 + 2 * sa.TILE_CALL_PAIRS / 64)
    assert sa.tile_cost_ratio(eye, 4, 8, torch.tensor([], dtype=torch.long), torch.arange(8)) == 0.0

    def band(nb, w):
        i = torch.arange(nb)
        return ((i[:, None] - i[None, :]).abs() <= w)[None]

    g = _gen(3)
    for L, bs, w, pays in ((576, 32, 1, False), (576, 32, 8, False), (8192, 128, 10, True), (8192, 128, 60, False)):
        nb = sa.n_blocks(L, bs)
        sub = torch.sort(torch.randperm(L, generator=g)[: int(0.3 * L)]).values
        assert (sa.tile_cost_ratio(band(nb, w), bs, L, sub, torch.arange(L)) < 1.0) is pays, (L, w)
        assert (sa.block_cost_ratio(band(nb, w), L, bs) < 1.0) is pays, (L, w)


def test_sparse_kernel_setting_is_validated_and_absent_means_always():
    from carnator.carnator_core.reuse import ReuseConfig

    with pytest.raises(ValueError, match="sparse_kernel must be one of"):
        ReuseConfig(sparse_kernel="fast").validate()
    old = {k: v for k, v in ReuseConfig().to_meta().items() if k != "sparse_kernel"}  # a rule from before
    assert ReuseConfig.from_meta(old).sparse_kernel == "always"
    assert ReuseConfig(sparse_kernel="cost").differences(old) == ["sparse_kernel 'cost' (certified: 'always')"]


@pytest.mark.comfy
def test_cost_policy_runs_plain_attention_where_tiles_do_not_pay_and_the_kernel_where_they_do(
        comfy_env, monkeypatch, tmp_path):
    """sparse_kernel="cost" on a tiny Wan (a few dozen tokens: the tiles cannot pay): no block-sparse kernel runs
    and the hit equals latent-mode reuse bit for bit (every token attends to every key); where the cost model says
    the tiles pay (forced), the same hit runs the kernel and equals sparse_kernel="always"."""
    import dataclasses

    from carnator.carnator_core import comfy_patch as cp, reuse

    h = _tiny_wan_joint_hit(tmp_path)
    calls = []
    real_token, real_block = sa.token_block_sparse_attention, sa.block_sparse_attention
    monkeypatch.setattr(sa, "token_block_sparse_attention", lambda *a, **kw: calls.append("token") or
                        real_token(*a, **kw))
    monkeypatch.setattr(sa, "block_sparse_attention", lambda *a, **kw: calls.append("block") or
                        real_block(*a, **kw))
    base = reuse.ReuseConfig(mode="joint", block_size=h.bs, dilation=0, x0_threshold=1e9, sparse_kernel="always")

    def hit(cfg):
        calls.clear()
        out, r = reuse.sample(h.m, h.pos, h.neg, h.lat, h.probe, h.decision, h.cached, cfg, target_signature=h.target)
        assert r.decision == "hit" and not r.fallbacks, r.fallbacks
        return out, list(calls)

    always, always_calls = hit(base)
    assert "token" in always_calls
    cost, cost_calls = hit(dataclasses.replace(base, sparse_kernel="cost"))
    latent, _ = hit(dataclasses.replace(base, mode="latent"))
    assert cost_calls == [] and torch.equal(cost, latent)
    assert not torch.equal(always, latent)  # the band restricts attention: the policy decided something
    monkeypatch.setattr(cp, "tile_cost_ratio", lambda *a, **kw: 0.5)
    monkeypatch.setattr(cp, "block_cost_ratio", lambda *a, **kw: 0.5)
    forced, forced_calls = hit(dataclasses.replace(base, sparse_kernel="cost"))
    assert forced_calls == always_calls and torch.equal(forced, always)


@pytest.mark.comfy
def test_cost_policy_on_cuda_never_runs_the_token_set_kernel(comfy_env):
    """On CUDA the token-set kernel measured slower than plain SDPA at every density (H200, 32k tokens): "cost"
    sends a subset's attention to plain attention there even where the CPU cost model says the tiles pay."""
    from carnator.carnator_core import comfy_patch as cp

    L, bs = 8192, 128
    nb = sa.n_blocks(L, bs)
    i = torch.arange(nb)
    band = ((i[:, None] - i[None, :]).abs() <= 10)[None]
    sub = torch.sort(torch.randperm(L, generator=_gen(5))[: int(0.3 * L)]).values
    assert sa.tile_cost_ratio(band, bs, L, sub, torch.arange(L)) < 1.0  # pays on the CPU ...
    assert cp.token_tiles_may_pay("cpu", band, bs, L, sub, torch.arange(L))
    assert not cp.token_tiles_may_pay("cuda", band, bs, L, sub, torch.arange(L))  # ... never on CUDA
    dense = torch.ones(1, nb, nb, dtype=torch.bool)
    assert not cp.token_tiles_may_pay("cpu", dense, bs, L, sub, torch.arange(L))


def test_a_plan_built_for_bare_cuda_names_the_current_device(monkeypatch):
    """``device="cuda"`` must resolve to ``cuda:<current>``: tensors on the GPU report ``cuda:0`` and a plan stored
    as bare ``cuda`` was refused as "built for another device" by every call on the lent H200 (2026-12-04)."""
    monkeypatch.setattr(sa.torch.cuda, "current_device", lambda: 3)
    assert sa._plan_device("cuda", torch.device("cpu")) == torch.device("cuda", 3)
    assert sa._plan_device("cuda:1", torch.device("cpu")) == torch.device("cuda", 1)
    assert sa._plan_device(None, torch.device("cpu")) == torch.device("cpu")
    keep = torch.ones(1, 2, 2, dtype=torch.bool)
    plan = sa.plan_token_block_sparse(keep, 4, 8, torch.arange(8), device="cpu")
    assert plan.compatible(1, 8, 8, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("sample_queries,head_average", [(8, False), (3, True), (0, False)])
def test_fused_block_mass_equals_the_softmax_estimate(dtype, sample_queries, head_average):
    """The fused estimate (attention over block indicators, the CUDA default) is the same quantity as the float32
    softmax-and-block-sum one: a partial last block, and more key blocks than the head dim (several value parts)."""
    g = _gen(11)
    B, H, L, D, bs = 2, 3, 101, 8, 4  # 26 blocks > D = 8: four indicator parts; the last block holds 1 token
    q = torch.randn(B, H, L, D, generator=g, dtype=dtype) * 2
    k = torch.randn(B, H, L, D, generator=g, dtype=dtype) * 2
    ref = sa.estimate_block_mass(q, k, bs, sample_queries=sample_queries, head_average=head_average, fused=False)
    out = sa.estimate_block_mass(q, k, bs, sample_queries=sample_queries, head_average=head_average, fused=True)
    assert out.dtype == torch.float32 and out.shape == ref.shape == (1 if head_average else H, 26, 26)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(out.sum(-1), torch.ones_like(out.sum(-1)), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="key_pooling='none' only"):
        sa.estimate_block_mass(q, k, bs, key_pooling="mean", fused=True)
