"""Historical sparse-connectivity reuse: record attention block structure, run block-sparse attention.

Pure torch (no ComfyUI import). Two halves:

* **Recording** (dense runs): :func:`record_block_structure` estimates, per query block, which key blocks carry
  the attention mass, *without* the full ``L x L`` softmax: a few evenly spaced queries per block (default 8;
  or the block's mean query) are scored against the keys, their softmax is summed per key block and averaged,
  and the smallest set of key blocks reaching ``mass`` is kept (the diagonal block always). :class:`BlockRecorder`
  accumulates this over a few (layer, step) observations into a :class:`~.types.BlockStructure` for the cache.
* **Block-sparse attention** (reuse runs): :func:`block_sparse_attention` computes attention restricted to the
  kept blocks, optionally for an active subset of query tokens only (``query_index``). It is exactly equal (up to
  float rounding) to dense attention with a ``-inf`` additive mask outside the kept blocks. Backends: a
  gather-based kernel (CPU default), FlexAttention with a ``BlockMask`` (CUDA default, compiled), and the dense
  masked reference.
* **Block-sparse attention between token sets** (the reuse hit path): :func:`token_block_sparse_attention` takes
  queries and keys as two token sets given by their original positions (e.g. queries = the active tokens, keys
  = active + supplied context), maps them to the recorded blocks, groups query blocks with the same key-block
  set and runs one unmasked SDPA per group (or FlexAttention on CUDA). Nothing of size [Lq, Lk] is built.

Conventions used throughout:

* Tensors are ``[B, H, L, D]`` ("document layout"); ComfyUI's ``optimized_attention`` layout ``[B, L, H*D]`` is
  served by :func:`block_sparse_attention_bld`.
* Tokens are tiled into blocks of ``block_size`` consecutive positions; ``n_blocks = ceil(n_tokens /
  block_size)`` and the last block may be partial. ``keep`` is bool ``[Hk, Qb, Kb]`` (or ``[Qb, Kb]``) with
  ``Hk`` either 1 (one pattern shared by all heads) or ``H`` (one pattern per head); ``keep[h, i, j]`` means
  queries of block ``i`` attend to keys of block ``j``.
* Query block of a query token = its *sequence position* // block_size. With ``query_index`` the rows of ``q``
  are the tokens at positions ``query_index`` (the active region), while ``k``/``v`` cover the whole sequence.
"""
from __future__ import annotations

import hashlib
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Literal

import numpy as np
import torch
import torch.nn.functional as F

from .types import BlockStructure

Backend = Literal["auto", "gather", "flex", "dense_masked"]
Strategy = Literal["grouped", "padded"]

__all__ = [
    "n_blocks",
    "estimate_block_mass",
    "select_blocks",
    "record_block_structure",
    "BlockRecorder",
    "keep_for_layer",
    "keep_to_dense_mask",
    "BlockSparsePlan",
    "plan_block_sparse",
    "clear_plan_cache",
    "block_sparse_attention",
    "block_sparse_attention_bld",
    "build_flex_block_mask",
    "flex_available",
    "TokenBlockPlan",
    "plan_token_block_sparse",
    "build_token_flex_block_mask",
    "token_block_sparse_attention",
    "token_block_sparse_attention_bld",
    "tile_cost_ratio",
    "block_cost_ratio",
]


def n_blocks(n_tokens: int, block_size: int) -> int:
    """Number of blocks tiling ``n_tokens`` (the last one may be partial)."""
    return (int(n_tokens) + int(block_size) - 1) // int(block_size)


def _plan_device(device: torch.device | str | None, fallback: torch.device) -> torch.device:
    """The device a plan is built for, with its index: ``"cuda"`` means the current CUDA device, and a plan must
    compare equal to the ``cuda:N`` its tensors report (``torch.device("cuda") != torch.device("cuda:0")``)."""
    dev = torch.device(device) if device is not None else torch.device(fallback)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _check_block_size(block_size: int) -> int:
    if int(block_size) != block_size or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    return int(block_size)


# ---------------------------------------------------------------------------------------------------------------
# Recording
# ---------------------------------------------------------------------------------------------------------------


def _as_bhld(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() == 3:
        return x.unsqueeze(0)
    if x.dim() != 4:
        raise ValueError(f"{name} must be [B, H, L, D] or [H, L, D], got shape {tuple(x.shape)}")
    return x


def _block_sum_last(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Sum the last dimension over consecutive blocks (last block partial): [..., L] -> [..., ceil(L/bs)]."""
    L = x.shape[-1]
    nb = n_blocks(L, block_size)
    pad = nb * block_size - L
    if pad:
        x = F.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], nb, block_size).sum(-1)


def _query_representatives(q: torch.Tensor, block_size: int, sample_queries: int) -> torch.Tensor:
    """Representative queries per block: [B, H, L, D] -> [B, H, Qb, S, D] (S = 1 for the mean-pooled query)."""
    B, H, L, D = q.shape
    nb = n_blocks(L, block_size)
    if sample_queries <= 0:
        pad = nb * block_size - L
        qp = F.pad(q, (0, 0, 0, pad)) if pad else q
        sums = qp.reshape(B, H, nb, block_size, D).sum(3)
        counts = torch.full((nb,), float(block_size), device=q.device, dtype=sums.dtype)
        counts[-1] = L - (nb - 1) * block_size  # the partial last block averages over its real tokens only
        return (sums / counts[:, None]).unsqueeze(3)
    # Evenly spaced rows inside each block (deterministic: recording must be reproducible), clipped to the real
    # length of the partial last block.
    s = int(sample_queries)
    starts = torch.arange(nb, device=q.device) * block_size
    lens = torch.clamp(L - starts, max=block_size)
    offs = (torch.arange(s, device=q.device, dtype=torch.float32) + 0.5) / s  # in (0, 1)
    rows = starts[:, None] + (offs[None, :] * lens[:, None].float()).long().clamp(max=block_size - 1)
    rows = torch.minimum(rows, (starts + lens - 1)[:, None])
    return q[:, :, rows.reshape(-1), :].reshape(B, H, nb, s, D)


def _block_indicators(n_tokens: int, block_size: int, width: int, part: int, device, dtype) -> torch.Tensor:
    """[L, width]: column c is 1 on the keys of block ``part * width + c`` (0 beyond the last block); kept in the
    plan cache (locked, bounded) since every recorded call of a run asks for the same ones."""

    def build() -> torch.Tensor:
        blk = torch.arange(n_tokens, device=device) // block_size - part * width
        t = torch.zeros(n_tokens, width, device=device, dtype=dtype)
        ok = (blk >= 0) & (blk < width)
        t[ok.nonzero().squeeze(1), blk[ok]] = 1
        return t

    return _cached_key(("indicators", n_tokens, block_size, width, part, str(device), str(dtype)), build)


def _block_mass_fused(q: torch.Tensor, k: torch.Tensor, block_size: int, sample_queries: int,
                      scale: float) -> torch.Tensor:
    """float32 [B, H, Qb, Kb]: per representative query, its attention mass per key block, as attention whose
    values are block indicators (value width = q's head dim, so the fused kernels apply; several calls when there
    are more key blocks than that), averaged over each block's representatives."""
    B, H, L, D = q.shape
    reps = _query_representatives(q, block_size, sample_queries)  # [B, H, Qb, S, D]
    Qb, S = reps.shape[2], reps.shape[3]
    r = reps.reshape(B, H, Qb * S, D)
    nb = n_blocks(L, block_size)
    width = D
    parts = []
    for part in range(n_blocks(nb, width)):
        ind = _block_indicators(L, block_size, width, part, q.device, q.dtype)
        v = ind.expand(B, H, L, width)
        if q.is_cuda:  # the fused CUDA kernels want real strides, not a broadcast view
            v = v.contiguous()
        parts.append(F.scaled_dot_product_attention(r, k, v, scale=scale).float())
    mass = torch.cat(parts, dim=-1)[..., :nb]  # [B, H, Qb*S, nb]
    return mass.reshape(B, H, Qb, S, nb).mean(3)


@torch.no_grad()
def estimate_block_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    block_size: int,
    *,
    sample_queries: int = 0,
    key_pooling: Literal["none", "mean"] = "none",
    head_average: bool = False,
    scale: float | None = None,
    max_chunk_elems: int = 1 << 24,
    fused: bool | None = None,
) -> torch.Tensor:
    """Estimated attention probability mass per (query block, key block), without the full softmax.

    q, k: [B, H, L, D] (or [H, L, D]) of one self-attention call (same L). For each query block a representative
    query (``sample_queries=0``: the mean of the block's queries; ``n > 0``: the mean of the softmax rows of ``n``
    evenly spaced queries of the block) is scored against all keys (``key_pooling="none"``) or against the
    mean-pooled key of each block (``"mean"``, with ``log(block length)`` added so a block counts for its size).
    The softmax is summed per key block and averaged over the batch (and over heads if ``head_average``).

    Returns float32 [Hh, Qb, Kb], Hh = 1 if head_average else H; every row sums to 1.
    Cost: O(Qb * S * L * D) per head with all keys (1/block_size of the dense QK^T for S = 1).

    ``fused`` (``key_pooling="none"`` only; None = on CUDA): the same quantity as one fused attention call whose
    values are the key blocks' indicator vectors -- softmax(q k^T) @ onehot(block of key) is each row's mass per
    key block -- in q's dtype, so no [rows, L] score matrix is written. On an H200 at 32,760 tokens the unfused
    float32 estimate was 16.7 ms of a layer's 17.6 ms recording (BENCHMARKS.md "On a GPU"). In bfloat16 the masses
    carry ~3 significant digits, so a block at the edge of the ``mass`` threshold may be selected differently
    than by the float32 path; the CPU (where the certified rules were recorded) keeps the float32 path.
    """
    block_size = _check_block_size(block_size)
    q = _as_bhld(q, "q")
    k = _as_bhld(k, "k")
    if q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"record expects self-attention q and k of the same shape [B, H, L, D], got q {tuple(q.shape)} and "
            f"k {tuple(k.shape)}"
        )
    B, H, L, D = q.shape
    scale = (1.0 / math.sqrt(D)) if scale is None else float(scale)
    if fused is None:
        fused = q.is_cuda and key_pooling == "none"
    if fused:
        if key_pooling != "none":
            raise ValueError("fused block-mass estimation supports key_pooling='none' only")
        out = _block_mass_fused(q, k, block_size, sample_queries, scale).mean(0)
        return out.mean(0, keepdim=True) if head_average else out
    reps = _query_representatives(q.float(), block_size, sample_queries)  # [B, H, Qb, S, D]
    Qb, S = reps.shape[2], reps.shape[3]
    kf = k.float()
    if key_pooling == "mean":
        nb = n_blocks(L, block_size)
        pad = nb * block_size - L
        kp = F.pad(kf, (0, 0, 0, pad)) if pad else kf
        counts = torch.full((nb,), float(block_size), device=k.device)
        counts[-1] = L - (nb - 1) * block_size
        keys = kp.reshape(B, H, nb, block_size, D).sum(3) / counts[:, None]
        bias = counts.log()  # a block of n similar keys holds ~n times the mass of one
    elif key_pooling == "none":
        keys, bias = kf, None
    else:
        raise ValueError(f"key_pooling must be 'none' or 'mean', got {key_pooling!r}")
    out = torch.empty(B, H, Qb, n_blocks(L, block_size), device=q.device, dtype=torch.float32)
    # Chunk over heads, and over query blocks when one head is too big, so the [Qb*S, L] score matrix stays
    # bounded in memory at long sequence lengths (32k tokens: 256 blocks x 8 samples x 32k keys per head).
    n_keys = keys.shape[2]
    per_block = B * S * n_keys
    qc = max(1, min(Qb, int(max_chunk_elems // max(per_block, 1))))
    hc = max(1, int(max_chunk_elems // max(per_block * Qb, 1))) if qc == Qb else 1
    for h0 in range(0, H, hc):
        h1 = min(H, h0 + hc)
        for b0 in range(0, Qb, qc):
            b1 = min(Qb, b0 + qc)
            r = reps[:, h0:h1, b0:b1].reshape(B, h1 - h0, (b1 - b0) * S, D)
            logits = torch.matmul(r, keys[:, h0:h1].transpose(-1, -2)) * scale
            if bias is not None:
                logits = logits + bias
            p = torch.softmax(logits, dim=-1)
            if key_pooling == "none":
                p = _block_sum_last(p, block_size)
            out[:, h0:h1, b0:b1] = p.reshape(B, h1 - h0, b1 - b0, S, -1).mean(3)
    out = out.mean(0)
    if head_average:
        out = out.mean(0, keepdim=True)
    return out


@torch.no_grad()
def select_blocks(
    probs: torch.Tensor,
    mass: float = 0.9,
    max_density: float | None = None,
    keep_diagonal: bool = True,
) -> torch.Tensor:
    """Per query block, the smallest set of key blocks whose summed probability reaches ``mass``.

    probs: [..., Qb, Kb], rows summing to 1. Ties are broken towards the lower key block index (stable sort).
    ``max_density`` (0, 1] caps the number of key blocks per query block at ``ceil(max_density * Kb)`` (the cap
    wins over ``mass``); the diagonal block (``keep_diagonal``, needs Qb == Kb) is then added on top, so a row
    may hold one block more than the cap. Returns bool of the same shape.
    """
    if not 0.0 < mass <= 1.0:
        raise ValueError(f"mass must be in (0, 1], got {mass}")
    Kb = probs.shape[-1]
    sp, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    before = torch.cumsum(sp, dim=-1) - sp  # mass of strictly higher-ranked blocks
    # A block is needed while the blocks ranked above it do not reach `mass`; the small tolerance keeps a row
    # whose float cumsum lands a hair below 1.0 from dragging in zero-probability blocks when mass == 1.
    take = before < (mass - 1e-6 if mass < 1.0 else 1.0 - 1e-6)
    take[..., 0] = True
    if max_density is not None:
        if not 0.0 < max_density <= 1.0:
            raise ValueError(f"max_density must be in (0, 1], got {max_density}")
        cap = max(1, math.ceil(max_density * Kb))
        take[..., cap:] = False
    keep = torch.zeros_like(take).scatter_(-1, order, take)
    if keep_diagonal:
        Qb = probs.shape[-2]
        if Qb != Kb:
            raise ValueError(f"keep_diagonal needs a square block grid, got {Qb} query x {Kb} key blocks")
        keep |= torch.eye(Qb, dtype=torch.bool, device=keep.device)
    return keep


@torch.no_grad()
def record_block_structure(
    q: torch.Tensor,
    k: torch.Tensor,
    block_size: int,
    mass: float = 0.9,
    max_density: float | None = None,
    sample_queries: int = 8,
    *,
    key_pooling: Literal["none", "mean"] = "none",
    head_average: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Which key blocks carry the attention mass of each query block, for one self-attention call.

    q, k: [B, H, L, D] (or [H, L, D]). Returns bool [H, Qb, Kb] ([1, Qb, Kb] with ``head_average``) on q's
    device: per query block the smallest set of key blocks whose estimated block-pooled probability mass is
    ``>= mass`` (see :func:`estimate_block_mass` for the estimate and :func:`select_blocks` for the selection),
    plus the diagonal block. The batch (e.g. cond + uncond) is averaged before selection.

    Default estimator: 8 sampled queries per block (1/16 of the dense QK^T work at block 128). Measured on
    synthetic local attention (BENCHMARKS.md) it matches the density of the exact selection, while the mean-pooled
    query (``sample_queries=0``, 1/(2*block) of the work) gives a flatter distribution: it keeps more of the true
    mass but at 2-4x the density, which forfeits most of the sparsity.
    """
    probs = estimate_block_mass(
        q, k, block_size, sample_queries=sample_queries, key_pooling=key_pooling, head_average=head_average, scale=scale
    )
    return select_blocks(probs, mass=mass, max_density=max_density, keep_diagonal=True)


class BlockRecorder:
    """Accumulates recorded block structure over a few (layer, step) observations of a dense run.

    Usage (from an attention override, per self-attention call)::

        rec = BlockRecorder(block_size=128, layers=range(5, 25), steps=(3, 10, 20))
        if rec.wants(layer, step):
            rec.observe(layer, step, q, k)          # or rec.observe_bld(layer, step, q, k, heads)
        ...
        structure = rec.result()                    # types.BlockStructure for the Cache Writer

    ``layers``/``steps``: which observations to take (None = any). ``combine``: ``"union"`` keeps a block if any
    observation of that layer kept it; ``"frequency"`` keeps it if at least ``min_frequency`` of that layer's
    observations did (the diagonal is always kept). All observations must share n_tokens and head count.
    ``seconds`` is the wall time spent inside observe (on CUDA without synchronisation: an underestimate).
    """

    def __init__(
        self,
        block_size: int = 128,
        layers: Iterable[int] | None = None,
        steps: Iterable[int] | None = None,
        *,
        mass: float = 0.9,
        max_density: float | None = None,
        sample_queries: int = 8,
        key_pooling: Literal["none", "mean"] = "none",
        head_average: bool = False,
        combine: Literal["union", "frequency"] = "union",
        min_frequency: float = 0.5,
    ) -> None:
        self.block_size = _check_block_size(block_size)
        self.layers = None if layers is None else frozenset(int(x) for x in layers)
        self.steps = None if steps is None else frozenset(int(x) for x in steps)
        if combine not in ("union", "frequency"):
            raise ValueError(f"combine must be 'union' or 'frequency', got {combine!r}")
        if not 0.0 < min_frequency <= 1.0:
            raise ValueError(f"min_frequency must be in (0, 1], got {min_frequency}")
        self.mass = float(mass)
        self.max_density = max_density
        self.sample_queries = int(sample_queries)
        self.key_pooling = key_pooling
        self.head_average = bool(head_average)
        self.combine = combine
        self.min_frequency = float(min_frequency)
        self._counts: dict[int, torch.Tensor] = {}
        self._n_obs: dict[int, int] = {}
        self._steps_seen: set[int] = set()
        self._n_tokens: int | None = None
        self._n_heads: int | None = None
        self.seconds = 0.0

    def wants(self, layer: int, step: int) -> bool:
        """True if an observation at (layer, step) is part of the recording plan."""
        return (self.layers is None or int(layer) in self.layers) and (self.steps is None or int(step) in self.steps)

    @torch.no_grad()
    def observe(self, layer: int, step: int, q: torch.Tensor, k: torch.Tensor) -> None:
        """Record one self-attention call; q, k: [B, H, L, D]."""
        t0 = time.perf_counter()
        q = _as_bhld(q, "q")
        L = q.shape[2]
        if self._n_tokens is None:
            self._n_tokens = L
        elif L != self._n_tokens:
            raise ValueError(
                f"BlockRecorder got {L} tokens at layer {layer} step {step} but {self._n_tokens} before: one "
                "recorder records one request (one latent shape); make a new BlockRecorder per run"
            )
        keep = record_block_structure(
            q,
            k,
            self.block_size,
            mass=self.mass,
            max_density=self.max_density,
            sample_queries=self.sample_queries,
            key_pooling=self.key_pooling,
            head_average=self.head_average,
        )
        if self._n_heads is None:
            self._n_heads = keep.shape[0]
        elif keep.shape[0] != self._n_heads:
            raise ValueError(f"BlockRecorder got {keep.shape[0]} head patterns, expected {self._n_heads}")
        layer = int(layer)
        cnt = keep.to("cpu", torch.int32)
        if layer in self._counts:
            self._counts[layer] += cnt
            self._n_obs[layer] += 1
        else:
            self._counts[layer] = cnt
            self._n_obs[layer] = 1
        self._steps_seen.add(int(step))
        self.seconds += time.perf_counter() - t0

    def observe_bld(self, layer: int, step: int, q: torch.Tensor, k: torch.Tensor, heads: int) -> None:
        """Record one call in ComfyUI's layout: q, k [B, L, heads*D]."""
        self.observe(layer, step, _bld_to_bhld(q, heads), _bld_to_bhld(k, heads))

    @property
    def n_observations(self) -> int:
        return sum(self._n_obs.values())

    def result(self) -> BlockStructure:
        """The accumulated structure: keep bool [n_layers, Hh, Qb, Kb], layers sorted ascending."""
        if not self._counts:
            raise ValueError(
                "BlockRecorder has no observations: no self-attention call matched its layers/steps "
                f"(layers={sorted(self.layers) if self.layers is not None else 'any'}, "
                f"steps={sorted(self.steps) if self.steps is not None else 'any'})"
            )
        layers = tuple(sorted(self._counts))
        rows = []
        for layer in layers:
            c, n = self._counts[layer], self._n_obs[layer]
            if self.combine == "union":
                keep = c > 0
            else:
                keep = c >= math.ceil(self.min_frequency * n - 1e-9)
            keep |= torch.eye(keep.shape[-1], dtype=torch.bool)
            rows.append(keep.numpy())
        return BlockStructure(
            keep=np.ascontiguousarray(np.stack(rows, axis=0)),
            layers=layers,
            block_size=self.block_size,
            n_tokens=int(self._n_tokens or 0),
            steps=tuple(sorted(self._steps_seen)),
        )


def keep_for_layer(structure: BlockStructure, layer: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The recorded bool [Hh, Qb, Kb] pattern of one layer as a torch tensor (KeyError-style message if absent)."""
    try:
        i = structure.layers.index(int(layer))
    except ValueError:
        raise ValueError(f"layer {layer} was not recorded; recorded layers: {list(structure.layers)}") from None
    return torch.from_numpy(np.ascontiguousarray(structure.keep[i])).to(device=device, dtype=torch.bool)


# ---------------------------------------------------------------------------------------------------------------
# Block-sparse attention
# ---------------------------------------------------------------------------------------------------------------


def _bld_to_bhld(x: torch.Tensor, heads: int) -> torch.Tensor:
    B, L, HD = x.shape
    if HD % heads:
        raise ValueError(f"last dim {HD} is not divisible by heads={heads}")
    return x.view(B, L, heads, HD // heads).transpose(1, 2)


def _normalize_keep(keep: torch.Tensor, n_heads: int | None, n_tokens: int, block_size: int) -> torch.Tensor:
    if keep.dtype != torch.bool:
        raise ValueError(f"keep must be a bool tensor, got {keep.dtype}")
    if keep.dim() == 2:
        keep = keep.unsqueeze(0)
    if keep.dim() != 3:
        raise ValueError(f"keep must be [Hk, Qb, Kb] or [Qb, Kb], got shape {tuple(keep.shape)}")
    nb = n_blocks(n_tokens, block_size)
    if keep.shape[1] != nb or keep.shape[2] != nb:
        raise ValueError(
            f"keep covers {keep.shape[1]}x{keep.shape[2]} blocks but {n_tokens} tokens in blocks of {block_size} "
            f"need {nb}x{nb}: the recorded structure is for a different latent shape or block size"
        )
    if n_heads is not None and keep.shape[0] not in (1, n_heads):
        raise ValueError(f"keep has {keep.shape[0]} head patterns; expected 1 (shared) or {n_heads} (per head)")
    return keep


def keep_to_dense_mask(
    keep: torch.Tensor, block_size: int, n_tokens: int, query_index: torch.Tensor | None = None
) -> torch.Tensor:
    """Token-level bool mask [Hk, Lq, n_tokens] (True = attend) equivalent to a block pattern. O(Lq * L) memory."""
    block_size = _check_block_size(block_size)
    keep = _normalize_keep(keep, None, n_tokens, block_size)
    kpos = torch.arange(n_tokens, device=keep.device)
    qpos = kpos if query_index is None else query_index.to(keep.device).long()
    return keep[:, (qpos // block_size)[:, None], (kpos // block_size)[None, :]]


@dataclass
class _Group:
    q_rows: torch.Tensor  # [G, m] flat rows (pattern head * Lq + row) to gather queries from; padding clamped
    # Key blocks are stored per block, not per token (plan memory O(H * Qb * Kb)); rows are expanded per chunk.
    k_start: torch.Tensor  # [G, n] first flat key row (pattern head * L + block * bs) of each gathered block
    k_end: torch.Tensor  # [G, n] last valid flat key row of the item's head (pattern head * L + L - 1)
    k_valid: torch.Tensor | None  # [G, n] bool: block is real (not padding); None if all real and no partial block
    m: int
    n: int
    has_partial: bool  # some gathered block is the partial last block (its tail is masked)


@dataclass
class BlockSparsePlan:
    """Precomputed gather indices for one (keep, block_size, n_tokens, query_index): reusable across steps.

    Build with :func:`plan_block_sparse`. ``dense`` means every needed block is kept (plain SDPA is exact).
    """

    block_size: int
    n_tokens: int
    n_queries: int
    n_pattern_heads: int
    device: torch.device
    groups: list[_Group] = field(default_factory=list)
    # [Hk * Lq]: where each (pattern head, q row) lands in the concatenation of all groups' padded outputs.
    out_perm: torch.Tensor | None = None
    dense: bool = False
    density: float = 1.0  # fraction of (query row, key) pairs computed, over active rows

    def compatible(self, n_heads: int, n_queries: int, n_tokens: int, device: torch.device) -> bool:
        return (
            self.n_tokens == n_tokens
            and self.n_queries == n_queries
            and self.n_pattern_heads in (1, n_heads)
            and n_heads % self.n_pattern_heads == 0
            and torch.device(device) == self.device
        )


@torch.no_grad()
def plan_block_sparse(
    keep: torch.Tensor,
    block_size: int,
    n_tokens: int,
    query_index: torch.Tensor | None = None,
    *,
    strategy: Strategy = "grouped",
    device: torch.device | str | None = None,
) -> BlockSparsePlan:
    """Index plan for the gather kernel.

    Work items are (pattern head, query block) pairs that have at least one query row. ``"grouped"`` batches
    items with the same number of kept key blocks (and the same "includes the partial last key block" flag) into
    one SDPA call without a mask; ``"padded"`` pads every item to the maximum kept count and masks the padding.
    Query rows of an item are padded to the item group's maximum row count; padded rows are computed and
    discarded (``out_perm`` never selects them).
    """
    block_size = _check_block_size(block_size)
    device = _plan_device(device, keep.device)
    keep = _normalize_keep(keep, None, n_tokens, block_size).to("cpu")
    Hk, Qb, Kb = keep.shape
    L = int(n_tokens)
    if query_index is None:
        qpos = torch.arange(L)
    else:
        qpos = query_index.detach().to("cpu").long().reshape(-1)
        if qpos.numel() and (int(qpos.min()) < 0 or int(qpos.max()) >= L):
            raise ValueError(f"query_index must hold positions in [0, {L}), got range [{int(qpos.min())}, {int(qpos.max())}]")
    Lq = int(qpos.numel())
    plan = BlockSparsePlan(block_size=block_size, n_tokens=L, n_queries=Lq, n_pattern_heads=Hk, device=device)
    if Lq == 0:
        plan.density = 0.0
        return plan
    qblk = qpos // block_size
    rows_per_block = torch.bincount(qblk, minlength=Qb)  # [Qb]
    used = rows_per_block > 0
    n_kept = keep.sum(-1)  # [Hk, Qb]
    empty = (n_kept == 0) & used[None, :]
    if bool(empty.any()):
        h, i = [int(x) for x in empty.nonzero()[0]]
        raise ValueError(
            f"keep has no key block for query block {i} (head pattern {h}) although it has query rows: every "
            "query needs at least one key (recorded structures always keep the diagonal block)"
        )
    # Fraction of computed (row, key) pairs, for reporting.
    block_len = torch.full((Kb,), block_size)
    block_len[-1] = L - (Kb - 1) * block_size
    keys_per_qblock = (keep.long() * block_len).sum(-1).float()  # [Hk, Qb]
    plan.density = float((keys_per_qblock * rows_per_block[None].float()).sum() / (Hk * Lq * L))
    if bool(keep[:, used].all()):
        plan.dense = True
        return plan

    # Rows of q per query block, in q's row order (stable).
    order = torch.argsort(qblk, stable=True)
    starts = torch.zeros(Qb + 1, dtype=torch.long)
    starts[1:] = torch.cumsum(rows_per_block, 0)
    partial_last = (L % block_size) != 0
    last_kept = keep[:, :, Kb - 1] if partial_last else torch.zeros(Hk, Qb, dtype=torch.bool)

    items_h, items_i = used[None, :].expand(Hk, Qb).nonzero(as_tuple=True)
    cnt = n_kept[items_h, items_i]
    has_last = last_kept[items_h, items_i]
    if strategy == "grouped":
        keys = cnt * 2 + has_last.long()
        if query_index is not None:
            # Active rows per block vary (a region's border cuts blocks): also bucket by row count (steps of
            # bs/8) so padded query rows stay below ~1/8 of a block per item.
            quantum = max(1, block_size // 8)
            rows_bucket = (rows_per_block[items_i] + quantum - 1) // quantum
            keys = keys * (block_size // quantum + 2) + rows_bucket
        group_keys = torch.unique(keys).tolist()
        selections = [(keys == gk).nonzero(as_tuple=True)[0] for gk in group_keys]
    elif strategy == "padded":
        selections = [torch.arange(items_h.numel())]
    else:
        raise ValueError(f"strategy must be 'grouped' or 'padded', got {strategy!r}")

    out_perm = torch.empty(Hk * Lq, dtype=torch.long)
    offset = 0  # rows of the concatenated group outputs written so far
    for sel in selections:
        hs, qs = items_h[sel], items_i[sel]
        G = int(sel.numel())
        m = int(rows_per_block[qs].max())
        n = int(cnt[sel].max())
        # Query rows: the q-rows of each item's block, padded by repeating the first row (result discarded).
        j = torch.arange(m)
        valid_rows = j[None, :] < rows_per_block[qs][:, None]
        src = starts[qs][:, None] + torch.where(valid_rows, j[None, :], torch.zeros_like(j)[None, :])
        rows = order[src]  # [G, m] row numbers in q
        flat_rows = hs[:, None] * Lq + rows
        slot = offset + torch.arange(G * m).view(G, m)
        out_perm[flat_rows[valid_rows]] = slot[valid_rows]
        offset += G * m
        # Kept key blocks per item, kept ones first (ascending index), padded with the first kept block (masked).
        kk = keep[hs, qs]  # [G, Kb]
        kb_sorted = torch.argsort((~kk).to(torch.int8), dim=-1, stable=True)[:, :n]
        kb_valid = torch.arange(n)[None, :] < kk.sum(-1)[:, None]
        kb_sorted = torch.where(kb_valid, kb_sorted, kb_sorted[:, :1])
        has_partial = bool(partial_last and bool(((kb_sorted == Kb - 1) & kb_valid).any()))
        plan.groups.append(
            _Group(
                q_rows=flat_rows.to(device),
                k_start=(hs[:, None] * L + kb_sorted * block_size).to(device),
                k_end=(hs[:, None] * L + (L - 1)).expand(G, n).contiguous().to(device),
                k_valid=None if (bool(kb_valid.all()) and not has_partial) else kb_valid.to(device),
                m=m,
                n=n,
                has_partial=has_partial,
            )
        )
    plan.out_perm = out_perm.to(device)
    return plan


# Plans / block masks depend only on (keep, block_size, n_tokens, query/key positions): callers that rebuild `keep`
# per call (e.g. from a BlockStructure at every step) hit this content-keyed LRU instead of re-planning (tens to
# hundreds of ms at 4-32k tokens). Entries are small: O(H * Qb * Kb) block indices plus O(tokens) row indices.
# ComfyUI runs prompts on a worker thread and a server may run several samplers: every access holds _CACHE_LOCK.
# The (possibly slow) build runs outside the lock; if two threads build the same entry the first one stored wins,
# so every caller of one key gets the same object.
_CACHE_SIZE = 64
_PLAN_CACHE: "OrderedDict[tuple, object]" = OrderedDict()
_CACHE_LOCK = threading.Lock()


def _content_key(*tensors: torch.Tensor | None) -> tuple:
    key = []
    for t in tensors:
        if t is None:
            key.append(None)
            continue
        a = t.detach().to("cpu").contiguous()
        key.append((tuple(a.shape), str(a.dtype), hashlib.blake2b(a.numpy().tobytes(), digest_size=16).hexdigest()))
    return tuple(key)


def _cached_key(key: tuple, build: Callable[[], object]):
    with _CACHE_LOCK:
        hit = _PLAN_CACHE.get(key)
        if hit is not None:
            _PLAN_CACHE.move_to_end(key)
            return hit
    value = build()
    with _CACHE_LOCK:
        hit = _PLAN_CACHE.get(key)
        if hit is not None:  # another thread stored it while we built: share that one
            _PLAN_CACHE.move_to_end(key)
            return hit
        _PLAN_CACHE[key] = value
        while len(_PLAN_CACHE) > _CACHE_SIZE:
            _PLAN_CACHE.popitem(last=False)
    return value


def _cached(kind: str, keep: torch.Tensor, query_index: torch.Tensor | None, extra: tuple, build: Callable[[], object]):
    return _cached_key((kind, *extra, *_content_key(keep, query_index)), build)


def clear_plan_cache() -> None:
    """Drop cached gather plans and flex block masks (they are rebuilt on demand)."""
    with _CACHE_LOCK:
        _PLAN_CACHE.clear()


def _sdpa(q, k, v, mask, scale):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _gather_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockSparsePlan, scale: float, chunk_bytes: int
) -> torch.Tensor:
    """Gather kernel on [B, H, Lq, D] / [B, H, L, D] inputs; see plan_block_sparse for the work items."""
    B, H, Lq, D = q.shape
    L = k.shape[2]
    Hk = plan.n_pattern_heads
    Hg = H // Hk
    N = B * Hg
    # Flatten to [N, Hk*len, D]: heads sharing one pattern (Hg) become batch rows, pattern heads (Hk) are folded
    # into the row index, so one index_select gathers any (head, row) set. A view when Hk == H or Hk == 1.
    def flat(x: torch.Tensor, n: int) -> torch.Tensor:
        return x.reshape(B, Hk, Hg, n, D).transpose(1, 2).reshape(N, Hk * n, x.shape[-1])

    qf, kf, vf = flat(q, Lq), flat(k, L), flat(v, L)
    outs = []
    elem = q.element_size()
    ar = torch.arange(plan.block_size, device=q.device)
    bs = plan.block_size
    for g in plan.groups:
        G = g.q_rows.shape[0]
        n_keys = g.n * bs
        per_item = N * (g.m + 2 * n_keys) * D * elem
        step = max(1, int(chunk_bytes // max(per_item, 1)))
        for a in range(0, G, step):
            b = min(G, a + step)
            gq = qf.index_select(1, g.q_rows[a:b].reshape(-1)).view(N, b - a, g.m, D)
            rows = g.k_start[a:b, :, None] + ar  # [c, n, bs]
            mask = None
            if g.k_valid is not None:
                valid = g.k_valid[a:b, :, None].expand(-1, -1, bs)
                if g.has_partial:
                    valid = valid & (rows <= g.k_end[a:b, :, None])
                mask = valid.reshape(1, b - a, 1, n_keys)
            if g.has_partial:
                rows = torch.minimum(rows, g.k_end[a:b, :, None])
            kr = rows.reshape(-1)
            gk = kf.index_select(1, kr).view(N, b - a, n_keys, D)
            gv = vf.index_select(1, kr).view(N, b - a, n_keys, D)
            outs.append(_sdpa(gq, gk, gv, mask, scale).reshape(N, (b - a) * g.m, D))
    # One permuting gather back to (pattern head, row) order: measured faster on CPU than index_copy_ per group.
    out = torch.cat(outs, dim=1).index_select(1, plan.out_perm)
    return out.view(B, Hg, Hk, Lq, D).transpose(1, 2).reshape(B, H, Lq, D)


def flex_available() -> bool:
    """True if torch.nn.attention.flex_attention (with BlockMask.from_kv_blocks) can be imported."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except Exception:  # pragma: no cover - depends on the torch build
        return False
    return hasattr(BlockMask, "from_kv_blocks")


@torch.no_grad()
def _tile_lists(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention's ``BlockMask`` lists of a bool [H, Qt, Kt] tile map: (count [1, H, Qt], kept tile indices
    first [1, H, Qt, Kt]), int32."""
    num = b.sum(-1).to(torch.int32)
    idx = torch.argsort((~b).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num[None], idx[None]


def build_flex_block_mask(
    keep: torch.Tensor,
    block_size: int,
    n_tokens: int,
    query_index: torch.Tensor | None = None,
    device: torch.device | str | None = None,
):
    """A FlexAttention ``BlockMask`` equal to ``keep`` (tiles of ``block_size`` x ``block_size``).

    Without ``query_index`` the q tiles are the query blocks: kept blocks are "full" (no per-element mask work in
    the compiled kernel) except the partial last key block. With ``query_index`` q tile t holds q rows
    [t*bs, (t+1)*bs), which may span several query blocks: the tile lists the union of their kept key blocks, as
    "full" blocks when the tile lies in one query block and as partial ones (exact ``mask_mod``) otherwise. The
    ``mask_mod`` encodes ``keep`` element-wise, which is what eager (uncompiled) flex_attention evaluates: eager
    mode ignores block sparsity and would otherwise compute dense attention.
    """
    from torch.nn.attention.flex_attention import BlockMask

    block_size = _check_block_size(block_size)
    device = _plan_device(device, keep.device)
    keep = _normalize_keep(keep, None, n_tokens, block_size).to(device)
    Hk, Qb, Kb = keep.shape
    L = int(n_tokens)
    qpos = torch.arange(L, device=device) if query_index is None else query_index.to(device).long().reshape(-1)
    Lq = int(qpos.numel())
    qblk = (qpos // block_size).contiguous()
    n_tiles = n_blocks(Lq, block_size)
    tile = torch.arange(Lq, device=device) // block_size
    pair = torch.unique(tile * Qb + qblk)  # distinct (tile, query block) pairs
    p_tile, p_qb = pair // Qb, pair % Qb
    union = torch.zeros(Hk, n_tiles, Kb, dtype=torch.int32, device=device)
    union.index_add_(1, p_tile, keep[:, p_qb].to(torch.int32))
    union = union > 0
    single = torch.bincount(p_tile, minlength=n_tiles) == 1  # tile inside one query block
    full = union & single[None, :, None]
    if L % block_size:
        full[:, :, Kb - 1] = False  # the partial last key block keeps the bounds check of mask_mod
    partial = union & ~full

    kv_num, kv_idx = _tile_lists(partial)
    full_num, full_idx = _tile_lists(full)
    keep_c = keep.contiguous()
    shared = Hk == 1
    # Compiled kernels may evaluate mask_mod on the padding rows of the last q tile: keep the lookup in bounds.
    pad = n_tiles * block_size - Lq
    if pad and Lq:
        qblk = torch.cat([qblk, qblk[-1:].expand(pad)])

    def mask_mod(b, h, q_idx, kv_idx):
        hh = h * 0 if shared else h
        return keep_c[hh, qblk[q_idx], kv_idx // block_size] & (kv_idx < L)

    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=(block_size, block_size),
        mask_mod=mask_mod,
        seq_lengths=(Lq, L),
    )


_COMPILED_FLEX: dict[str, Callable] = {}


def _flex_fn(compiled: bool, dynamic: bool | None = False) -> Callable:
    """flex_attention, eager or compiled. ``dynamic=False``: one compiled kernel per shape (the full-sequence path,
    whose shapes are fixed per model); ``None``: torch's automatic dynamic shapes, i.e. the first shape change
    recompiles once with symbolic lengths (the token-set path, whose lengths change with every request's region)."""
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention
    name = str(dynamic)
    with _CACHE_LOCK:
        fn = _COMPILED_FLEX.get(name)
        if fn is None:
            fn = _COMPILED_FLEX[name] = torch.compile(flex_attention, dynamic=dynamic)
    return fn


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor,
    block_size: int,
    query_index: torch.Tensor | None = None,
    *,
    backend: Backend = "auto",
    plan: BlockSparsePlan | None = None,
    block_mask=None,
    flex_compiled: bool | None = None,
    strategy: Strategy = "grouped",
    scale: float | None = None,
    chunk_bytes: int = 64 << 20,
) -> torch.Tensor:
    """Attention restricted to kept blocks: [B, H, Lq, D] x [B, H, L, D] -> [B, H, Lq, D].

    Equal (float tolerance) to softmax(q k^T * scale + M) v with M = 0 where ``keep[h, pos(q)//bs, pos(k)//bs]``
    and -inf elsewhere; pos(q) is the row index, or ``query_index[row]`` when given (then q holds only those rows
    and k/v the whole sequence). keep: bool [Hk, Qb, Kb] / [Qb, Kb], Hk in {1, H}. Every query block that has
    rows must keep at least one key block (ValueError otherwise).

    backend: ``"gather"`` (gather the kept key blocks of each query block, SDPA per group of equal size; CPU
    default), ``"flex"`` (FlexAttention with a BlockMask; compiled on CUDA, eager elsewhere unless
    ``flex_compiled``), ``"dense_masked"`` (the reference: dense SDPA with a token-level mask), ``"auto"``
    (flex on CUDA when available, gather otherwise). ``plan`` / ``block_mask``: precomputed by
    :func:`plan_block_sparse` / :func:`build_flex_block_mask` for the same arguments; when omitted they come
    from a small LRU keyed by the *content* of keep/query_index (so rebuilding keep per call is cheap).
    """
    block_size = _check_block_size(block_size)
    q, k, v = _as_bhld(q, "q"), _as_bhld(k, "k"), _as_bhld(v, "v")
    B, H, Lq, D = q.shape
    L = k.shape[2]
    if k.shape[:2] != (B, H) or v.shape[:3] != k.shape[:3] or k.shape[-1] != D:
        raise ValueError(f"k and v must be [B, H, L, D] matching q's B, H; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if query_index is None and Lq != L:
        raise ValueError(
            f"q has {Lq} rows but k has {L}: pass query_index (the positions of q's rows) when q holds only the "
            "active tokens"
        )
    if query_index is not None and query_index.numel() != Lq:
        raise ValueError(f"query_index has {query_index.numel()} entries but q has {Lq} rows")
    if v.shape[-1] != D:
        # SDPA supports a different value dim; the gather kernel's output buffer assumes D_v == D.
        raise ValueError(f"value head dim {v.shape[-1]} differs from query head dim {D}; not supported")
    keep = _normalize_keep(keep, H, L, block_size)
    scale = (1.0 / math.sqrt(D)) if scale is None else float(scale)
    if Lq == 0:
        return q.new_empty(B, H, 0, D)

    if backend == "auto":
        backend = "flex" if (q.is_cuda and flex_available()) else "gather"
    if backend == "dense_masked":
        mask = keep_to_dense_mask(keep.to(q.device), block_size, L, query_index)  # [Hk, Lq, L]
        if bool((~mask.any(-1)).any()):
            raise ValueError("keep leaves a query row without any key block: every query needs at least one key")
        return _sdpa(q, k, v, mask.unsqueeze(0), scale)
    if backend == "gather":
        if plan is None:
            plan = _cached(
                "plan", keep, query_index, (block_size, L, strategy, str(q.device)),
                lambda: plan_block_sparse(keep, block_size, L, query_index, strategy=strategy, device=q.device),
            )
        elif not plan.compatible(H, Lq, L, q.device):
            raise ValueError("the given plan was built for other shapes/device than these q/k/v; rebuild it")
        if plan.dense:
            return _sdpa(q, k, v, None, scale)
        return _gather_attention(q, k, v, plan, scale, chunk_bytes)
    if backend == "flex":
        if not flex_available():
            raise RuntimeError("backend='flex' needs torch.nn.attention.flex_attention (torch >= 2.5); use 'gather'")
        if block_mask is None:
            block_mask = _cached(
                "flex", keep, query_index, (block_size, L, str(q.device)),
                lambda: build_flex_block_mask(keep, block_size, L, query_index, device=q.device),
            )
        compiled = q.is_cuda if flex_compiled is None else bool(flex_compiled)
        return _flex_fn(compiled)(q, k, v, block_mask=block_mask, scale=scale)
    raise ValueError(f"backend must be one of 'auto', 'gather', 'flex', 'dense_masked'; got {backend!r}")


def block_sparse_attention_bld(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    heads: int,
    keep: torch.Tensor,
    block_size: int,
    query_index: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """ComfyUI ``optimized_attention`` layout: q [B, Lq, heads*D], k/v [B, L, heads*D] -> [B, Lq, heads*D].

    Same semantics and keyword options as :func:`block_sparse_attention`.
    """
    B, Lq, HD = q.shape
    out = block_sparse_attention(
        _bld_to_bhld(q, heads),
        _bld_to_bhld(k, heads),
        _bld_to_bhld(v, heads),
        keep,
        block_size,
        query_index,
        **kwargs,
    )
    return out.transpose(1, 2).reshape(B, Lq, HD)


# ---------------------------------------------------------------------------------------------------------------
# Block-sparse attention between two token sets (the reuse hit path)
# ---------------------------------------------------------------------------------------------------------------
#
# On a cache hit the middle layers compute attention among a token *subset* (the active region and the context
# its attention needs), and the queries and the keys may be different sets (active tokens; active + supplied
# context). A subset is not block-aligned in sequence order, so blocks are defined by the tokens' *original*
# positions: query/key token p belongs to block p // block_size of the recorded structure. Each query block
# attends to the key tokens of its kept key blocks that are present in the key set. Query blocks with the same
# kept-and-present key-block set share one dense SDPA call (their query rows concatenated, their key rows
# gathered once): no padding and no mask, so every tile runs on the fused SDPA kernel, and the plan is
# O(blocks^2 + tokens) -- no [Lq, Lk] mask is ever built.


@dataclass
class _TokenGroup:
    """Query rows that share one key-row set. A row set is a (start, length) slice when it is contiguous in the
    tensor (then a view is used instead of a gather) and an index tensor otherwise."""

    q_rows: torch.Tensor | tuple[int, int]
    k_rows: torch.Tensor | tuple[int, int]
    m: int
    n: int
    # A super-tile: several query-block groups whose key sets share ``k_rows`` (the common keys), computed as one
    # tall tile; each member's own remaining keys are (row offset in the tile, rows, key rows, n), merged by
    # log-sum-exp. None: a plain group (every query's keys are exactly ``k_rows``).
    residuals: list[tuple[int, int, torch.Tensor | tuple[int, int], int]] | None = None


@dataclass
class TokenBlockPlan:
    """Precomputed groups for :func:`token_block_sparse_attention` (one keep pattern, block size, sequence length
    and query/key position sets); reusable across steps and batch/heads. Build with :func:`plan_token_block_sparse`.

    ``kept_pairs``: (query, key) pairs attended, summed over pattern heads; ``density`` = kept_pairs /
    (pattern heads * n_queries * n_keys); ``dense``: every query attends every key (plain SDPA is exact)."""

    block_size: int
    n_tokens: int
    n_queries: int
    n_keys: int
    n_pattern_heads: int
    device: torch.device
    heads: list[list[_TokenGroup]] = field(default_factory=list)
    kept_pairs: int = 0
    density: float = 1.0
    dense: bool = False
    # Flex backend state, built on first use and kept with the plan (callers that hold a plan per layer then
    # pay for the block mask once): (q sort permutation or None, k sort permutation or None, BlockMask).
    flex: tuple | None = field(default=None, repr=False)

    @property
    def n_calls(self) -> int:
        """SDPA calls per attention call (one per group, plus one per super-tile member with own keys)."""
        return sum(1 + len(g.residuals or ()) for gs in self.heads for g in gs)

    def compatible(self, n_heads: int, n_queries: int, n_keys: int, device: torch.device) -> bool:
        return (
            self.n_queries == n_queries
            and self.n_keys == n_keys
            and n_heads % self.n_pattern_heads == 0
            and torch.device(device) == self.device
        )


def _positions(pos: torch.Tensor, n_tokens: int, name: str) -> torch.Tensor:
    p = pos.detach().to("cpu").long().reshape(-1)
    if p.numel() and (int(p.min()) < 0 or int(p.max()) >= n_tokens):
        raise ValueError(f"{name} must hold token positions in [0, {n_tokens}), got range [{int(p.min())}, "
                         f"{int(p.max())}]")
    return p


def _rows(order: torch.Tensor, starts: torch.Tensor, blocks: torch.Tensor, identity: bool, device):
    """Tensor rows of the tokens of ``blocks`` (ascending), as a slice when contiguous in the tensor."""
    if identity:
        a, b = starts[blocks], starts[blocks + 1]
        if bool((a[1:] == b[:-1]).all()):  # consecutive ranges: one slice of the (position-sorted) tensor
            return (int(a[0]), int(b[-1] - a[0]))
    idx = torch.cat([order[int(s):int(e)] for s, e in zip(starts[blocks].tolist(), starts[blocks + 1].tolist())])
    if idx.numel() and bool((idx[1:] - idx[:-1] == 1).all()):
        return (int(idx[0]), int(idx.numel()))
    return idx.to(device)


@torch.no_grad()
def plan_token_block_sparse(
    keep: torch.Tensor,
    block_size: int,
    n_tokens: int,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor | None = None,
    *,
    device: torch.device | str | None = None,
    super_rows: int | None = None,
) -> TokenBlockPlan:
    """Groups for block-sparse attention from query tokens at positions ``q_pos`` to key tokens at ``k_pos``.

    keep: bool [Hk, Qb, Kb] / [Qb, Kb] over the blocks of the *original* sequence (``n_tokens`` positions in
    blocks of ``block_size``). ``k_pos`` None = the same tokens as ``q_pos``. Positions need not be sorted or
    block-aligned; each set must be free of duplicates for the result to be meaningful (not checked).
    Per pattern head, query blocks with at least one query are grouped by their set of kept key blocks that hold
    at least one key; a query block whose set is empty raises ValueError (its rows would have no key). Cost
    O(Hk * Qb * Kb + Lq + Lk) on the CPU; memory: the row indices (O(Lq + Lk) per group set) only.

    ``super_rows`` (default: 768 on the CPU, 0 elsewhere): consecutive groups (in position order) whose key sets
    share at least half of each one's keys are stacked into super-tiles of up to about that many query rows: the
    shared keys run as one tall SDPA tile and each group's remaining keys as a small one, merged exactly by
    log-sum-exp. Why: the CPU's fused SDPA splits queries into chunks of 32 rows below 192 query rows and of 256
    from 768 on; a 128-row tile against thousands of keys ran at about half the FLOP rate of dense SDPA.
    """
    block_size = _check_block_size(block_size)
    L = int(n_tokens)
    keep = _normalize_keep(keep, None, L, block_size).to("cpu")
    device = _plan_device(device, keep.device)
    Hk, Qb, Kb = keep.shape
    qp = _positions(q_pos, L, "q_pos")
    kp = qp if k_pos is None else _positions(k_pos, L, "k_pos")
    Lq, Lk = int(qp.numel()), int(kp.numel())
    plan = TokenBlockPlan(block_size=block_size, n_tokens=L, n_queries=Lq, n_keys=Lk, n_pattern_heads=Hk,
                          device=device)
    if Lq == 0:
        plan.density = 0.0
        return plan
    if Lk == 0:
        raise ValueError("k_pos is empty: every query needs at least one key")

    def layout(p: torch.Tensor):
        blk = p // block_size
        order = torch.argsort(p, stable=True)  # position order: a block's tokens are one range of it
        counts = torch.bincount(blk, minlength=Qb)
        starts = torch.zeros(Qb + 1, dtype=torch.long)
        starts[1:] = torch.cumsum(counts, 0)
        identity = bool((order == torch.arange(p.numel())).all())
        return order, counts, starts, identity

    q_order, q_cnt, q_starts, q_id = layout(qp)
    k_order, k_cnt, k_starts, k_id = layout(kp)
    eff, kept = _kept_pairs(keep, q_cnt, k_cnt)
    used = q_cnt > 0
    n_eff = eff.sum(-1)
    empty = (n_eff == 0) & used[None, :]
    if bool(empty.any()):
        h, i = [int(x) for x in empty.nonzero()[0]]
        raise ValueError(
            f"query block {i} (head pattern {h}) has {int(q_cnt[i])} queries but none of its kept key blocks "
            "holds a key: every query needs at least one key (keep each query's own block and include its tokens "
            "in the key set)"
        )
    plan.kept_pairs = int(kept)
    plan.density = float(kept) / float(Hk * Lq * Lk)
    plan.dense = plan.kept_pairs == Hk * Lq * Lk
    if plan.dense:
        return plan
    if super_rows is None:
        super_rows = 768 if device.type == "cpu" else 0
    used_idx = used.nonzero(as_tuple=True)[0]

    def n_keys(bset: torch.Tensor) -> int:
        return int(k_cnt[bset].sum())

    for h in range(Hk):
        rows = eff[h, used_idx]  # [U, Kb]
        sets, inverse = torch.unique(rows, dim=0, return_inverse=True)
        exact = []  # (query blocks, key-block set, rows, keys), in position order
        for s in range(sets.shape[0]):
            qbs = used_idx[inverse == s]
            exact.append((qbs, sets[s], int(q_cnt[qbs].sum()), n_keys(sets[s])))
        exact.sort(key=lambda t: int(t[0][0]))
        groups = []
        i = 0
        while i < len(exact):
            members, common, M = [exact[i]], exact[i][1], exact[i][2]
            j = i + 1
            while super_rows and M < super_rows and j < len(exact):
                cand = common & exact[j][1]
                if 2 * n_keys(cand) < max(exact[j][3], max(t[3] for t in members)):
                    break
                members.append(exact[j])
                common, M, j = cand, M + exact[j][2], j + 1
            qbs = torch.cat([t[0] for t in members])
            qr = _rows(q_order, q_starts, qbs, q_id, device)
            kr = _rows(k_order, k_starts, common.nonzero(as_tuple=True)[0], k_id, device)
            g = _TokenGroup(q_rows=qr, k_rows=kr, m=M, n=n_keys(common))
            if len(members) > 1:
                g.residuals, off = [], 0
                for t in members:
                    own = t[1] & ~common
                    if bool(own.any()):
                        g.residuals.append((off, t[2], _rows(k_order, k_starts, own.nonzero(as_tuple=True)[0],
                                                             k_id, device), n_keys(own)))
                    off += t[2]
            groups.append(g)
            i = j
        plan.heads.append(groups)
    return plan


# Cost model of the gather kernels, in units of dense SDPA work ((query, key) pairs), for deciding where a
# recorded structure is worth its tiles (ReuseConfig.sparse_kernel = "cost"): each group of query blocks with one
# kept key-block set costs a fixed overhead of about TILE_CALL_PAIRS pairs (SDPA call, row gathers, log-sum-exp
# merges), and a kept pair about TILE_PAIR_COST dense pairs (small gathered tiles run below the fused kernel's
# rate; the whole-sequence kernel pads its groups: BLOCK_PAIR_COST). Fitted on the 2-core development CPU with
# `scripts/bench/bench_sparse_attention.py --crossover` (BENCHMARKS.md, "Where block-sparse tiles pay"). Both estimates
# use block counts only (O(Hk * Qb * Kb)): no plan is built to decide, so a short sequence pays nothing for them.
TILE_CALL_PAIRS = 20_000
TILE_PAIR_COST = 1.5
BLOCK_PAIR_COST = 1.8


def _kept_pairs(keep: torch.Tensor, q_cnt: torch.Tensor, k_cnt: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Kept key blocks that hold keys (``keep`` [Hk, Qb, Kb] masked by the key blocks' token counts ``k_cnt``) and
    the (query, key) pairs they make, summed over pattern heads (``q_cnt``: the query blocks' token counts)."""
    eff = keep & (k_cnt > 0)[None, None, :]
    return eff, int((q_cnt[None, :, None] * eff.long() * k_cnt[None, None, :]).sum())


def _block_counts(pos: torch.Tensor, n_tokens: int, block_size: int, n_blocks_: int) -> torch.Tensor:
    return torch.bincount(_positions(pos, n_tokens, "positions") // block_size, minlength=n_blocks_)


def tile_cost_ratio(keep: torch.Tensor, block_size: int, n_tokens: int, q_pos: torch.Tensor,
                    k_pos: torch.Tensor | None = None) -> float:
    """Estimated cost of :func:`token_block_sparse_attention` (gather backend) relative to plain SDPA of the same
    queries over the same keys: ``TILE_PAIR_COST`` x the kept fraction of pairs + ``TILE_CALL_PAIRS`` per group
    (distinct kept-and-present key-block set of the query blocks present, per pattern head) / all pairs.
    Arguments as :func:`plan_token_block_sparse`. 0 for an empty query or key set."""
    block_size = _check_block_size(block_size)
    keep = _normalize_keep(keep, None, int(n_tokens), block_size).to("cpu")
    Hk, Qb, Kb = keep.shape
    q_cnt = _block_counts(q_pos, n_tokens, block_size, Qb)
    k_cnt = q_cnt if k_pos is None else _block_counts(k_pos, n_tokens, block_size, Kb)
    pairs = int(q_cnt.sum()) * int(k_cnt.sum())
    if pairs == 0:
        return 0.0
    eff, kept = _kept_pairs(keep, q_cnt, k_cnt)
    used = (q_cnt > 0).nonzero(as_tuple=True)[0]
    groups = sum(int(torch.unique(eff[h, used], dim=0).shape[0]) for h in range(Hk))
    return TILE_PAIR_COST * kept / (Hk * pairs) + groups * TILE_CALL_PAIRS / pairs


def block_cost_ratio(keep: torch.Tensor, n_tokens: int, block_size: int) -> float:
    """Estimated cost of :func:`block_sparse_attention` (gather backend, every query over every key) relative to
    dense SDPA: ``BLOCK_PAIR_COST`` x block density + ``TILE_CALL_PAIRS`` per distinct kept key-block set of each
    pattern head / all pairs."""
    keep = _normalize_keep(keep, None, int(n_tokens), _check_block_size(block_size)).to("cpu")
    groups = sum(int(torch.unique(keep[h], dim=0).shape[0]) for h in range(keep.shape[0]))
    return BLOCK_PAIR_COST * float(keep.float().mean()) + groups * TILE_CALL_PAIRS / max(1, int(n_tokens) ** 2)


def _take(x: torch.Tensor, rows) -> torch.Tensor:
    if isinstance(rows, tuple):
        return x.narrow(2, rows[0], rows[1])
    return x.index_select(2, rows)


def _token_gather_attention(q, k, v, plan: TokenBlockPlan, scale: float, chunk_elems: int) -> torch.Tensor:
    B, H, Lq, _ = q.shape
    out = q.new_empty(B, H, Lq, v.shape[-1])
    Hk = plan.n_pattern_heads
    Hg = H // Hk
    for h, groups in enumerate(plan.heads):
        hs = slice(h * Hg, (h + 1) * Hg)
        qh, kh, vh, oh = q[:, hs], k[:, hs], v[:, hs], out[:, hs]
        for g in groups:
            gk, gv = _take(kh, g.k_rows), _take(vh, g.k_rows)
            if g.residuals is not None:
                _super_tile(qh, kh, vh, oh, g, gk, gv, scale)
                continue
            # Query chunks bound the score tile of SDPA's non-fused (math) path; the fused kernels tile anyway.
            step = max(plan.block_size, chunk_elems // max(1, B * Hg * g.n))
            for a in range(0, g.m, step):
                c = min(step, g.m - a)
                if isinstance(g.q_rows, tuple):
                    rows = (g.q_rows[0] + a, c)
                else:
                    rows = g.q_rows if c == g.m else g.q_rows[a:a + c]
                o = F.scaled_dot_product_attention(_take(qh, rows), gk, gv, scale=scale)
                if isinstance(rows, tuple):
                    oh.narrow(2, rows[0], rows[1]).copy_(o)
                else:
                    oh.index_copy_(2, rows, o)
    return out


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attention_lse(q, k, v, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output and its row log-sum-exp (at least float32): the CPU's fused kernel when it serves these
    inputs, else the exact math (which materialises one [rows, keys] score tile)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    if _FLASH_CPU is not None and q.device.type == "cpu":
        try:
            o, lse = _FLASH_CPU(q, k, v, scale=scale)
            return o, lse.to(acc)
        except (RuntimeError, TypeError, NotImplementedError):
            pass
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    lse = torch.logsumexp(s, -1)
    return torch.matmul(torch.softmax(s, -1), v.to(acc)).to(v.dtype), lse


def _super_tile(qh, kh, vh, oh, g: _TokenGroup, gk, gv, scale: float) -> None:
    """One super-tile: all its queries against the shared keys, each member's queries against its own remaining
    keys, merged exactly: out = sum_i exp(lse_i - lse) * out_i with lse = logaddexp over the parts."""
    gq = _take(qh, g.q_rows)
    o, lse = _attention_lse(gq, gk, gv, scale)
    o = o.to(lse.dtype)
    for off, m, k_rows, _n in g.residuals:
        o_r, l_r = _attention_lse(gq.narrow(2, off, m), _take(kh, k_rows), _take(vh, k_rows), scale)
        l_s = lse.narrow(-1, off, m)
        tot = torch.logaddexp(l_s, l_r)
        seg = o.narrow(2, off, m)
        seg.copy_(seg * (l_s - tot).exp().unsqueeze(-1) + o_r.to(o.dtype) * (l_r - tot).exp().unsqueeze(-1))
    o = o.to(oh.dtype)
    if isinstance(g.q_rows, tuple):
        oh.narrow(2, g.q_rows[0], g.q_rows[1]).copy_(o)
    else:
        oh.index_copy_(2, g.q_rows, o)


@torch.no_grad()
def build_token_flex_block_mask(
    keep: torch.Tensor,
    block_size: int,
    n_tokens: int,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor | None = None,
    device: torch.device | str | None = None,
):
    """A FlexAttention ``BlockMask`` for query tokens at ``q_pos`` and key tokens at ``k_pos``, both
    **ascending** (position order, so a flex tile covers few original blocks).

    Flex tiles are ``block_size`` consecutive rows of q / of k; tile (t, u) is listed when some (query block,
    key block) pair it covers is kept and "full" when all are (and the kv tile is not the padded last one).
    ``mask_mod`` evaluates ``keep[h, q_pos[q] // bs, k_pos[k] // bs]`` through O(Lq + Lk) lookup tables, never a
    token-level mask. The tile lists are built with O(tiles x blocks) incidence products.
    """
    from torch.nn.attention.flex_attention import BlockMask

    block_size = _check_block_size(block_size)
    L = int(n_tokens)
    keep = _normalize_keep(keep, None, L, block_size)
    device = _plan_device(device, keep.device)
    keep = keep.to(device)
    Hk, Qb, Kb = keep.shape
    qp = q_pos.to(device).long().reshape(-1)
    kp = qp if k_pos is None else k_pos.to(device).long().reshape(-1)
    Lq, Lk = int(qp.numel()), int(kp.numel())
    for name, p in (("q_pos", qp), ("k_pos", kp)):
        if p.numel() > 1 and bool((p[1:] < p[:-1]).any()):
            raise ValueError(f"{name} must be ascending for the flex block mask (sort the tokens first)")
    qblk, kblk = qp // block_size, kp // block_size
    nqt, nkt = n_blocks(Lq, block_size), n_blocks(Lk, block_size)

    def incidence(blk: torch.Tensor, n_tiles: int, nb: int) -> torch.Tensor:
        inc = torch.zeros(n_tiles, nb, dtype=torch.float32, device=device)
        tile = torch.arange(blk.numel(), device=device) // block_size
        inc[tile, blk] = 1.0
        return inc

    tq, tk = incidence(qblk, nqt, Qb), incidence(kblk, nkt, Kb)
    kf = keep.float()
    any_kept = (tq @ kf @ tk.T) > 0  # [Hk, nqt, nkt]
    any_dropped = (tq @ (1.0 - kf) @ tk.T) > 0
    full = any_kept & ~any_dropped
    if Lk % block_size:
        full[:, :, nkt - 1] = False  # the padded last kv tile keeps mask_mod's bounds check
    partial = any_kept & ~full

    kv_num, kv_idx = _tile_lists(partial)
    full_num, full_idx = _tile_lists(full)
    keep_c = keep.contiguous()
    shared = Hk == 1
    # Compiled kernels may evaluate mask_mod on the padding rows of the last tiles: keep the lookups in bounds.
    qpad, kpad = nqt * block_size - Lq, nkt * block_size - Lk
    qlut = torch.cat([qblk, qblk[-1:].expand(qpad)]) if qpad and Lq else qblk
    klut = torch.cat([kblk, kblk[-1:].expand(kpad)]) if kpad and Lk else kblk

    def mask_mod(b, h, q_idx, kv_idx):
        hh = h * 0 if shared else h
        return keep_c[hh, qlut[q_idx], klut[kv_idx]] & (kv_idx < Lk)

    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(block_size, block_size), mask_mod=mask_mod,
        seq_lengths=(Lq, Lk),
    )


TokenBackend = Literal["auto", "gather", "flex", "dense_masked"]


def token_block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor,
    block_size: int,
    n_tokens: int,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor | None = None,
    *,
    backend: TokenBackend = "auto",
    plan: TokenBlockPlan | None = None,
    block_mask=None,
    flex_compiled: bool | None = None,
    scale: float | None = None,
    chunk_elems: int = 1 << 26,
) -> torch.Tensor:
    """Block-sparse attention between two token sets: q [B, H, Lq, D], k/v [B, H, Lk, D] -> [B, H, Lq, Dv].

    Row r of q is the token at original position ``q_pos[r]``, row c of k/v the token at ``k_pos[c]`` (None: the
    same set as q, e.g. self-attention among a token subset). Query r attends key c iff
    ``keep[h, q_pos[r] // block_size, k_pos[c] // block_size]``; the result equals (float tolerance) dense SDPA
    with that token-level boolean mask (backend ``"dense_masked"``, the O(Lq * Lk) reference). keep: bool
    [Hk, Qb, Kb] / [Qb, Kb] over the blocks of the original ``n_tokens``-token sequence, Hk dividing H (head
    group j = heads [j*H/Hk, (j+1)*H/Hk) uses pattern j). Every query must keep at least one present key
    (ValueError otherwise; keeping the diagonal and putting the queries' own tokens in the key set ensures it).

    backend: ``"gather"`` (:func:`plan_token_block_sparse` groups, one unmasked SDPA per group: CPU default),
    ``"flex"`` (FlexAttention with :func:`build_token_flex_block_mask` over position-sorted tokens; compiled with
    automatic dynamic shapes on CUDA, eager elsewhere unless ``flex_compiled``; eager flex evaluates every
    (query, key) pair and is for checks only), ``"auto"`` (flex on CUDA when available, gather otherwise).
    ``plan`` / ``block_mask``: precomputed for the same arguments; when omitted they come from the content-keyed
    LRU shared with :func:`block_sparse_attention`.
    """
    block_size = _check_block_size(block_size)
    q, k, v = _as_bhld(q, "q"), _as_bhld(k, "k"), _as_bhld(v, "v")
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    if k.shape[:2] != (B, H) or v.shape[:3] != k.shape[:3] or k.shape[-1] != D:
        raise ValueError(f"k and v must be [B, H, Lk, D] matching q's B, H, D; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q_pos.numel() != Lq:
        raise ValueError(f"q_pos has {q_pos.numel()} entries but q has {Lq} rows")
    if k_pos is None and Lk != Lq:
        raise ValueError(f"k has {Lk} rows but q has {Lq}: pass k_pos when the keys are another token set")
    if k_pos is not None and k_pos.numel() != Lk:
        raise ValueError(f"k_pos has {k_pos.numel()} entries but k has {Lk} rows")
    keep = _normalize_keep(keep, None, n_tokens, block_size)
    if H % keep.shape[0]:
        raise ValueError(f"keep has {keep.shape[0]} head patterns, which does not divide {H} heads")
    scale = (1.0 / math.sqrt(D)) if scale is None else float(scale)
    if Lq == 0:
        return q.new_empty(B, H, 0, v.shape[-1])
    if backend == "auto":
        backend = "flex" if (q.is_cuda and flex_available()) else "gather"
    if backend == "dense_masked":
        kp = q_pos if k_pos is None else k_pos
        qb = (q_pos.to(keep.device).long() // block_size)
        kb = (kp.to(keep.device).long() // block_size)
        mask = keep[:, qb[:, None], kb[None, :]]  # [Hk, Lq, Lk]: the reference, O(Lq * Lk)
        if bool((~mask.any(-1)).any()):
            raise ValueError("keep leaves a query without any key: every query needs at least one key")
        mask = mask.to(q.device).repeat_interleave(H // keep.shape[0], 0)
        return _sdpa(q, k, v, mask.unsqueeze(0), scale)
    if plan is None:
        plan = _cached_key(
            ("token_plan", block_size, int(n_tokens), str(q.device), *_content_key(keep, q_pos, k_pos)),
            lambda: plan_token_block_sparse(keep, block_size, n_tokens, q_pos, k_pos, device=q.device),
        )
    elif not plan.compatible(H, Lq, Lk, q.device) or plan.n_tokens != int(n_tokens):
        raise ValueError("the given plan was built for other shapes/device than these q/k/v; rebuild it")
    if plan.dense:
        return _sdpa(q, k, v, None, scale)
    if backend == "gather":
        return _token_gather_attention(q, k, v, plan, scale, chunk_elems)
    if backend == "flex":
        if not flex_available():
            raise RuntimeError("backend='flex' needs torch.nn.attention.flex_attention (torch >= 2.5); use 'gather'")
        if plan.flex is None or (block_mask is None and plan.flex[2] is None):
            plan.flex = _token_flex_setup(keep, block_size, n_tokens, q_pos, k_pos, q.device, block_mask is None)
        qperm, kperm, bm = plan.flex
        bm = bm if block_mask is None else block_mask
        qs = q if qperm is None else q.index_select(2, qperm)
        ks, vs = (k, v) if kperm is None else (k.index_select(2, kperm), v.index_select(2, kperm))
        compiled = q.is_cuda if flex_compiled is None else bool(flex_compiled)
        out = _flex_fn(compiled, dynamic=None)(qs, ks, vs, block_mask=bm, scale=scale)
        return out if qperm is None else torch.empty_like(out).index_copy_(2, qperm, out)
    raise ValueError(f"backend must be one of 'auto', 'gather', 'flex', 'dense_masked'; got {backend!r}")


def _token_flex_setup(keep, block_size: int, n_tokens: int, q_pos, k_pos, device, with_mask: bool = True):
    """Sort permutations (None when already ascending) and the BlockMask over the position-sorted tokens (None
    unless ``with_mask``: the caller brings its own)."""
    qp = q_pos.detach().long().reshape(-1)
    kp = qp if k_pos is None else k_pos.detach().long().reshape(-1)

    def perm(p: torch.Tensor):
        order = torch.argsort(p, stable=True)
        ident = bool((order == torch.arange(p.numel(), device=p.device)).all())
        return (None if ident else order.to(device)), p[order]

    qperm, qsp = perm(qp)
    kperm, ksp = perm(kp)
    bm = build_token_flex_block_mask(keep, block_size, n_tokens, qsp, ksp, device=device) if with_mask else None
    return qperm, kperm, bm


def token_block_sparse_attention_bld(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    heads: int,
    keep: torch.Tensor,
    block_size: int,
    n_tokens: int,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """ComfyUI ``optimized_attention`` layout: q [B, Lq, heads*D], k/v [B, Lk, heads*D] -> [B, Lq, heads*D].

    Same semantics and keyword options as :func:`token_block_sparse_attention`.
    """
    B, Lq, HD = q.shape
    out = token_block_sparse_attention(
        _bld_to_bhld(q, heads), _bld_to_bhld(k, heads), _bld_to_bhld(v, heads), keep, block_size, n_tokens,
        q_pos, k_pos, **kwargs,
    )
    return out.transpose(1, 2).reshape(B, Lq, out.shape[1] * out.shape[-1])
