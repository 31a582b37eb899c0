"""The one module that patches ComfyUI models. Everything here works on ``model.clone()`` through ModelPatcher
APIs (a PREDICT_NOISE wrapper, ``("dit", "double_block", i)`` block replacements and the
``optimized_attention_override``); no module attribute of the caller's MODEL is ever touched, and all per-run
state lives in a ``_Run`` object created for one sampling call and reset in ``finally``.

Two sampling entry points:

* :func:`probe_sample` runs the *real* schedule (any supported sampler/scheduler) and stops after the first
  ``k`` model calls. It records the sampler-level denoised output of each call (the "replay"), the latent entering
  step ``k``, and the cross-attention of object tokens in the chosen layers.
* :func:`resume_sample` runs the same schedule again from step 0 with the same noise, but answers the first
  ``k`` model calls from the replay instead of the model. For a deterministic sampler this rebuilds exactly the
  state (including multistep history) a plain run has at step ``k`` — so probe + dense resume equals plain
  sampling — and from then on the model is called normally, or with joint reuse (``ReusePlan``).

Both take a ``types.Stage`` (KSamplerAdvanced's start/end steps and switches) and then call ComfyUI's sampler
with exactly the arguments KSamplerAdvanced passes, so a split schedule's stage resumes like that node.

Inside the model nothing raises because reuse is impossible: a block that cannot be restricted falls back to
the original block, and the reason is logged once per run.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import comfy.patcher_extension
import comfy.sample
import comfy.samplers
import numpy as np
import torch

from .adapters import ArchAdapter, adapter_for
from .keys import stable_module_name
from .sparse_attention import (
    BlockRecorder,
    block_cost_ratio,
    block_sparse_attention_bld,
    keep_for_layer,
    plan_token_block_sparse,
    tile_cost_ratio,
    token_block_sparse_attention_bld,
)
from .types import BlockStructure, ObjectTokens, Stage

log = logging.getLogger("carnator")
KEY = "carnator"

# One model call per step, at the schedule's sigmas, and deterministic given (noise, seed): resuming by replaying
# the first k calls reproduces a plain run exactly, and "k probe calls" means "k steps". Which samplers qualify
# is checked, sampler by sampler, by tests/test_resume_samplers.py over every name KSampler offers. Refused:
# samplers that call the model more than once per step or off the schedule (heun, dpm_2, dpmpp_2s/sde, seeds,
# sa_solver_pece, dpm_fast/adaptive) would need the replay split mid-step; the cfg_pp samplers keep each step's
# unconditional prediction through a post-CFG hook, which a replayed call (answered from the recorded denoised
# output, without running CFG) does not run, so their resume would crash or differ.
RESUMABLE_SAMPLERS = (
    "euler", "euler_ancestral", "lms", "dpmpp_2m", "dpmpp_2m_sde", "dpmpp_2m_sde_gpu", "dpmpp_2m_sde_heun",
    "dpmpp_2m_sde_heun_gpu", "dpmpp_3m_sde", "dpmpp_3m_sde_gpu", "ddpm", "lcm", "ipndm", "ipndm_v", "deis",
    "res_multistep", "res_multistep_ancestral", "gradient_estimation", "er_sde", "sa_solver", "ddim", "uni_pc",
    "uni_pc_bh2",
)


class UnsupportedSamplerError(ValueError):
    pass


def check_sampler(sampler_name: str) -> None:
    if sampler_name in RESUMABLE_SAMPLERS:
        return
    if sampler_name.endswith("_cfg_pp"):
        why = ("it keeps each step's unconditional prediction through a post-CFG hook, which a replayed probe "
               "step does not run")
    else:
        why = "it calls the model more than once per step, or off the schedule's sigmas"
    raise UnsupportedSamplerError(
        f"sampler {sampler_name!r} cannot be probed and resumed exactly ({why}). Use one of: "
        f"{', '.join(RESUMABLE_SAMPLERS)}."
    )


class _DenseIsCheaper(Exception):
    """The recorded structure of this layer is nearly dense: plain attention is faster than block-sparse."""


class _ProbeStop(Exception):
    """Raised inside the sampler once the probe has its k calls; caught by probe_sample."""


def compute_sigmas(model: Any, steps: int, sampler_name: str, scheduler: str, denoise: float = 1.0) -> torch.Tensor:
    ks = comfy.samplers.KSampler(model, steps=steps, device="cpu", sampler=sampler_name, scheduler=scheduler,
                                 denoise=denoise, model_options=model.model_options)
    return ks.sigmas.detach().float().cpu()


def sigmas_digest(sigmas: torch.Tensor) -> str:
    return hashlib.sha256(np.round(sigmas.numpy().astype(np.float64), 6).tobytes()).hexdigest()[:16]


def model_fingerprint(model: Any, arch: str) -> str:
    """Digest of the backbone weights (sampled bytes of every tensor), its config and the patches applied
    (LoRA etc.: keys, strengths, shapes and sampled values), so reuse never crosses models or patch sets."""
    h = _weights_hash(model.model.diffusion_model, arch)
    for key in sorted(getattr(model, "patches", {}) or {}):
        h.update(key.encode())
        for p in model.patches[key]:
            h.update(repr(p[0]).encode())  # strength
            v = p[1]
            tensors = v if isinstance(v, (tuple, list)) else (v,)
            for tv in tensors:
                if torch.is_tensor(tv):
                    h.update(str(tuple(tv.shape)).encode())
                    f = tv.detach().reshape(-1)
                    if f.numel():
                        h.update(f[:: max(1, f.numel() // 32)].float().cpu().numpy().tobytes())
                else:
                    h.update(repr(type(tv)).encode())
    ms = model.get_model_object("model_sampling")
    for attr in ("shift", "multiplier"):
        if hasattr(ms, attr):
            h.update(f"{attr}={float(getattr(ms, attr)):.6f}".encode())
    # Function patches change the result as much as weights do (RescaleCFG, CFGZeroStar, model wrappers, attention
    # patches): digest what ModelPatcher holds besides weights, by code identity and captured values.
    opts = dict(getattr(model, "model_options", None) or {})
    topts = {k: v for k, v in (opts.pop("transformer_options", None) or {}).items()
             if k not in _PER_RUN_OPTIONS and not _empty(v)}
    extra = {
        "options": {k: v for k, v in opts.items() if k not in _PER_RUN_OPTIONS and not _empty(v)},
        "transformer_options": topts,
        "wrappers": {k: v for k, v in (getattr(model, "wrappers", None) or {}).items() if v},
        "callbacks": {k: v for k, v in (getattr(model, "callbacks", None) or {}).items() if v},
        # model_sampling is digested above by its values (shift, multiplier)
        "object_patches": {k: type(v).__qualname__ for k, v in (getattr(model, "object_patches", None) or {}).items()
                           if k != "model_sampling"},
    }
    if any(extra.values()):  # a model without function patches keeps the fingerprint it always had
        h.update(_digest_value(extra).encode())
    return h.hexdigest()[:24]


# Weight digests by backbone module (weakly: a module that is gone takes its digest with it, so a new model that
# happens to reuse freed memory can never be taken for it). A serving request fingerprinted its model three times
# (request key, probe, sampler), 13 ms each on the embedded model: ~2 % of a dense request.
_WEIGHT_DIGESTS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, Any]]" = weakref.WeakKeyDictionary()


def _weights_state(dm: torch.nn.Module) -> tuple | None:
    """What identifies the current weights of ``dm`` without reading them: per tensor its name, storage address,
    version counter (every in-place write bumps it), shape and dtype. None when a tensor has no version counter
    (inference-mode tensors): then nothing is remembered."""
    try:
        return tuple((name, t.data_ptr(), t._version, t.shape, t.dtype)
                     for name, t in itertools.chain(dm.named_parameters(), dm.named_buffers()))
    except RuntimeError:
        return None


def _weights_hash(dm: torch.nn.Module, arch: str) -> Any:
    """sha256 over ``arch`` and sampled bytes of every state-dict tensor (a fresh copy of the hash object, to be
    continued by the caller). Recomputed whenever a parameter or buffer was replaced, written in place, reshaped
    or retyped since the last call on this module (``_weights_state``)."""
    state = _weights_state(dm)
    hit = _WEIGHT_DIGESTS.get(dm) if state is not None else None
    if hit is not None and hit[0] == (arch, state):
        return hit[1].copy()
    h = hashlib.sha256(arch.encode())
    for name, t in dm.state_dict().items():
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(str(t.dtype).encode())
        flat = t.detach().reshape(-1)
        if flat.numel():
            idx = torch.linspace(0, flat.numel() - 1, steps=min(64, flat.numel())).long()
            h.update(flat[idx].float().cpu().numpy().tobytes())
    if state is not None:
        _WEIGHT_DIGESTS[dm] = ((arch, state), h.copy())
    return h


# Keys ComfyUI sets on a copy of the options while it samples; never part of the MODEL a node receives.
_PER_RUN_OPTIONS = frozenset({"cond_or_uncond", "sigmas", "sample_sigmas", "uuids", "block_index", "total_blocks"})
_PACKAGE = __name__.rsplit(".", 2)[0]  # this extension's package: its own patches are not part of the model


def _digest_value(v: Any, depth: int = 0) -> str:
    """A description of ``v`` that is stable across processes (no ids or addresses): code identity and the
    values a function captured (closure cells, defaults, partial arguments, bound object attributes)."""
    if depth > 4:
        return "..."
    d = depth + 1
    if v is None or isinstance(v, (bool, int, str)):
        return repr(v)
    if isinstance(v, float):
        return f"{v:.9g}"
    if torch.is_tensor(v):
        f = v.detach().reshape(-1)
        sample = f[:: max(1, f.numel() // 16)].float().cpu().numpy().tobytes() if f.numel() else b""
        return f"tensor{tuple(v.shape)}{v.dtype}:{hashlib.sha256(sample).hexdigest()[:16]}"
    if isinstance(v, dict):
        items = sorted(((_digest_value(k, d), _digest_value(x, d)) for k, x in v.items()))
        return "{" + ",".join(f"{k}:{x}" for k, x in items) + "}"
    if isinstance(v, (list, tuple, set, frozenset)):
        parts = [_digest_value(x, d) for x in v]
        return "[" + ",".join(sorted(parts) if isinstance(v, (set, frozenset)) else parts) + "]"
    if isinstance(v, functools.partial):
        return f"partial({_digest_value(v.func, d)},{_digest_value(v.args, d)},{_digest_value(v.keywords, d)})"
    func = getattr(v, "__func__", None)
    if func is not None and hasattr(v, "__self__"):  # bound method: the function and its object's state
        return f"method({_digest_value(func, d)},{_digest_value(v.__self__, d)})"
    code = getattr(v, "__code__", None)
    if code is not None:  # a Python function: code identity + what it captured
        if (getattr(v, "__module__", "") or "").startswith(_PACKAGE):
            return "carnator"
        cells = tuple(c.cell_contents for c in (getattr(v, "__closure__", None) or ()) if _has_contents(c))
        return (f"fn({stable_module_name(v.__module__)}.{v.__qualname__}:{hashlib.sha256(code.co_code).hexdigest()[:12]},"
                f"{_digest_value(cells, d)},{_digest_value(getattr(v, '__defaults__', None), d)})")
    t = type(v)
    if (t.__module__ or "").startswith(_PACKAGE):
        return "carnator"
    if isinstance(v, torch.nn.Module):
        return f"module({stable_module_name(t.__module__)}.{t.__qualname__})"
    attrs = {k: x for k, x in (vars(v).items() if hasattr(v, "__dict__") else ())
             if not k.startswith("__") and not callable(x) or torch.is_tensor(x)}
    return f"obj({stable_module_name(t.__module__)}.{t.__qualname__},{_digest_value(attrs, d)})"


def _empty(v: Any) -> bool:
    return v is None or (isinstance(v, (dict, list, tuple, set)) and not v)


def _has_contents(cell: Any) -> bool:
    try:
        cell.cell_contents
        return True
    except ValueError:  # an empty cell
        return False


def _cond_rows(transformer_options: dict, batch: int) -> torch.Tensor:
    """Boolean mask over the model batch: rows that belong to the positive (cond) prompt."""
    cou = transformer_options.get("cond_or_uncond") or [0]
    per = max(1, batch // len(cou))
    rows = []
    for c in cou:
        rows += [c == 0] * per
    rows = rows[:batch] + [False] * max(0, batch - len(rows))
    return torch.tensor(rows, dtype=torch.bool)


@dataclass
class CaptureConfig:
    """What the probe records from cross-attention."""

    objects: tuple[ObjectTokens, ...]
    layers: tuple[int, ...]
    heads: int | None = None


@dataclass
class ReusePlan:
    """Joint reuse of one accepted cache entry, from step ``start_call`` on.

    active_tokens:  LongTensor of token indices (flattened T*H*W grid) recomputed for the target (region A).
    token_mask:     float [T, H, W] in {0,1} on the token grid (A); None = all active (attention-only mode).
    cached_x0:      model-space final latent of the cached request [C, T, H, W].
    noise:          the target's noise (same shape as the latent batch) used to re-noise the cached x0.
    sparse_layers:  middle layers where only the needed tokens are computed.
    structure:      recorded block structure of the cached run (None: no attention sparsity).
    restrict_tokens: compute only active tokens (+ needed context) in the middle layers (latent/joint modes).
    kv_context:     restricted layers attend from the subset's queries to *every* token: the subset's keys and
                    values are fresh, the others' come from the last refresh call of this run (recorded per
                    layer and batch composition). Without it, attention sees only the subset (an ablation:
                    on the embedded model it leaves rows of dashes around the region, PSNR ~16 dB vs dense).
    refresh_calls:  model-call indices (0-based, as counted by the sampler) computed densely to record the
                    keys/values of every token in the restricted layers; the first reuse call always is one.
                    Memory: 2 x layers x batch rows x tokens x model width elements in the model's dtype, held for
                    the run (Wan 2.1-1.3B, 480p x 81 frames, CFG batch of 2, bf16: about 12 GB).
    """

    active_tokens: torch.Tensor
    token_mask: torch.Tensor | None
    cached_x0: torch.Tensor
    noise: torch.Tensor
    sparse_layers: tuple[int, ...]
    structure: BlockStructure | None
    restrict_tokens: bool
    context_margin_blocks: int = 0
    block_size: int = 64
    context_tokens: torch.Tensor | None = None  # latent-only mode: active tokens + a 3-D margin around them
    dense_above: float = 0.85  # a layer whose recorded density exceeds this runs dense attention (cheaper)
    kv_context: bool = True
    refresh_calls: frozenset = frozenset()
    # Keys/values recorded at the probe's last call (``Probe.context_kv``): the first context record, so the first
    # reuse call need not be a dense refresh. Read only.
    initial_kv: Mapping | None = None
    # "always": the recorded structure restricts every layer planned at density <= dense_above; "cost": only where
    # the block-sparse tiles are estimated to be cheaper than plain attention (ReuseConfig.sparse_kernel).
    sparse_kernel: str = "always"


@dataclass
class _Run:
    """Per-run mutable state (one sampling call). Reset in ``finally``."""

    adapter: ArchAdapter
    n_tokens: int
    patch: tuple[int, int, int]
    grid: tuple[int, int, int]
    stop_at: int | None = None
    replay: list = field(default_factory=list)
    record_replay: bool = False
    calls: int = 0
    layer: int = -1
    latent_at_stop: torch.Tensor | None = None
    capture: CaptureConfig | None = None
    maps: dict = field(default_factory=dict)
    map_counts: dict = field(default_factory=dict)
    reuse: ReusePlan | None = None
    recorder: BlockRecorder | None = None
    fallbacks: set = field(default_factory=set)
    stats: dict = field(default_factory=lambda: {"model_calls": 0, "replayed_calls": 0, "skipped_calls": 0,
                                                  "token_layer_evals": 0, "token_layer_dense": 0,
                                                  "attn_pairs": 0, "attn_pairs_dense": 0, "record_s": 0.0})
    progress: Callable[[int], None] | None = None
    sigma_to_step: dict = field(default_factory=dict)
    subset_cache: dict = field(default_factory=dict)
    attn_in_block: int = 0  # optimized_attention calls seen in the current block (the first is self-attention)
    refreshing: bool = False  # the current model call is a dense refresh (records keys/values)
    # A planned refresh whose model call never reached the transformer blocks (a model patch in front of them, e.g.
    # ComfyUI's EasyCache, answered that call from its own cache): the next call that reaches them refreshes.
    refresh_pending: bool = False
    block_evals: int = 0  # transformer-block evaluations in the current model call
    kv: dict = field(default_factory=dict)  # (layer, batch composition) -> (keys, values) of every token
    # Records of ``kv`` that are this run's private working copies (written in place by ``_context_attention``).
    kv_owned: set = field(default_factory=set)
    # Probe: keep every block's self-attention keys/values (on the CPU) at this model call, within a byte budget.
    kv_record_call: int | None = None
    kv_budget: int = 0
    kv_over_budget: bool = False
    # Within one model call: the full hidden states the last restricted block returned, the token subset and the
    # subset's hidden states it wrote into them, so that the next restricted block takes its input without a gather
    # and writes its output in place (see ``_block_patch``); and per block argument, its subset gather.
    carry: tuple | None = None
    gathered: dict = field(default_factory=dict)

    def fallback(self, reason: str) -> None:
        if reason not in self.fallbacks:
            self.fallbacks.add(reason)
            log.warning("carnator: falling back to the original block: %s", reason)

    def reset(self) -> None:
        self.replay = list(self.replay) if self.record_replay else []
        self.subset_cache.clear()
        self.kv.clear()
        self.kv_owned.clear()
        self.layer = -1
        self.refresh_pending = False
        self.block_evals = 0
        self.carry = None
        self.gathered.clear()


# ----------------------------------------------------------------------------------------------------------
# patches


def _predict_wrapper(run: _Run):
    def wrapper(executor, x, timestep, model_options={}, seed=None):
        i = run.calls
        if run.stop_at is not None and i >= run.stop_at:
            run.latent_at_stop = x.detach().clone()
            raise _ProbeStop()
        run.calls += 1
        if run.progress is not None:
            run.progress(i)
        if not run.record_replay and i < len(run.replay):
            run.stats["replayed_calls"] += 1
            return run.replay[i].to(device=x.device, dtype=x.dtype)
        plan = run.reuse
        if plan is not None and plan.token_mask is not None:
            # Region-guided latent reuse, as ComfyUI's inpainting does it: outside A the model sees the cached
            # x0 re-noised to this sigma with the target's noise, and its prediction there is the cached x0.
            ms = executor.class_obj.inner_model.model_sampling if hasattr(executor.class_obj, "inner_model") else None
            m = _latent_mask(plan, run, x)
            cached = plan.cached_x0.to(device=x.device, dtype=x.dtype).unsqueeze(0).expand_as(x)
            sigma = timestep.reshape(-1)[:1]
            noise = plan.noise.to(device=x.device, dtype=x.dtype)
            renoised = ms.noise_scaling(sigma.reshape(-1, *([1] * (x.ndim - 1))), noise, cached) if ms is not None \
                else cached
            if plan.active_tokens.numel() == 0:
                run.stats["skipped_calls"] += 1
                return cached.clone()
            x_in = x * m + renoised * (1 - m)
            run.carry = None  # hidden states are chained within one model call only
            run.gathered.clear()
            refresh = bool(plan.kv_context and plan.restrict_tokens and
                           (i in plan.refresh_calls or not run.kv or run.refresh_pending))
            run.refreshing, run.block_evals = refresh, 0
            try:
                out = executor(x_in, timestep, model_options, seed)
            finally:
                run.refreshing = False
            # Without this, a refresh answered by such a patch records nothing, and every later call attends to
            # context keys/values that grow staler with each step (on the embedded model behind EasyCache: hit
            # clips ~4 dB further from dense, with background artifacts). A plain model reaches its blocks on
            # every call, so this never changes what it computes.
            run.refresh_pending = refresh and run.block_evals == 0
            run.stats["model_calls"] += 1
            return out * m + cached * (1 - m)
        out = executor(x, timestep, model_options, seed)
        run.stats["model_calls"] += 1
        if run.record_replay:
            run.replay.append(out.detach().clone())
        return out

    return wrapper


def _latent_mask(plan: ReusePlan, run: _Run, x: torch.Tensor) -> torch.Tensor:
    key = ("latent_mask", tuple(x.shape))
    if key not in run.subset_cache:
        pt, ph, pw = run.patch
        m = plan.token_mask.float()
        m = m.repeat_interleave(pt, 0).repeat_interleave(ph, 1).repeat_interleave(pw, 2)
        m = m[: x.shape[-3], : x.shape[-2], : x.shape[-1]]
        run.subset_cache[key] = m.to(device=x.device, dtype=x.dtype).reshape(1, 1, *m.shape)
    return run.subset_cache[key]


def _gather_arg(value: Any, dim: int, idx: torch.Tensor, n_tokens: int) -> Any:
    if torch.is_tensor(value):
        if value.ndim > dim and value.shape[dim] == n_tokens:
            return value.index_select(dim, idx.to(value.device))
        return value
    if isinstance(value, tuple):
        return tuple(_gather_arg(v, dim, idx, n_tokens) for v in value)
    if isinstance(value, list):
        return [_gather_arg(v, dim, idx, n_tokens) for v in value]
    return value


def _subset_tokens(run: _Run, layer: int, plan: ReusePlan, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens to run through a middle layer: the active ones plus the context their attention needs.

    Returns (subset indices, positions of the active tokens within the subset). Latent and joint modes give
    ``context_tokens`` (A dilated by a margin); joint then restricts attention *within* that subset to the
    recorded blocks (``_subset_attention``), so joint never computes more than latent-only. (Taking instead
    every token of every key block some active query block keeps pulled in nearly the whole sequence whenever
    the recorded structure is not very sparse: density 0.65 on the embedded model gave a token fraction of 1.0.)
    """
    key = ("subset",)  # the same for every layer: one object, so consecutive blocks can tell they share it
    if key in run.subset_cache:
        return run.subset_cache[key]
    active = plan.active_tokens
    ctx = plan.context_tokens if plan.context_tokens is not None else active
    subset = torch.unique(torch.cat([active, ctx]))
    pos = torch.searchsorted(subset, active)
    run.subset_cache[key] = (subset, pos)
    return subset, pos


def _composition(topts: dict, batch: int) -> tuple:
    """Which rows a model call's batch holds (cond/uncond chunks and size): recorded keys/values of one call
    are reused only by calls of the same composition."""
    return (tuple(topts.get("cond_or_uncond") or ()), int(batch))


# Restricted blocks of one model call pass the subset's hidden states on directly (one copy of the full hidden
# states per call instead of a copy, a gather and a scatter per block; the same values). False restores the per-block
# path, for side-by-side measurements (scripts/bench/profile_hit.py --compare-chain).
CHAIN_RESTRICTED_BLOCKS = True


def _block_patch(run: _Run, layer: int, previous: Callable | None):
    def patch(args: dict, extra: dict) -> dict:
        run.layer = layer
        run.attn_in_block = 0
        run.block_evals += 1
        original = (lambda a: previous(a, extra)) if previous is not None else extra["original_block"]
        plan = run.reuse
        try:
            if plan is None or not plan.restrict_tokens or layer not in plan.sparse_layers:
                return original(args)
            img = args["img"]
            n = img.shape[1]
            if n != run.n_tokens:
                run.fallback(f"layer {layer}: {n} tokens in the block, expected {run.n_tokens}")
                return original(args)
            subset, pos = _subset_tokens(run, layer, plan, n)
            # kv_context: the subset attends to every token, the others' keys/values coming from the last dense
            # evaluation of this layer (refresh call). Without such a record (a refresh call, or a batch
            # composition not seen yet) the layer runs densely, which records one.
            no_record = plan.kv_context and (layer, _composition(args["transformer_options"], img.shape[0])) \
                not in run.kv
            if subset.numel() >= n or run.refreshing or no_record:
                run.stats["token_layer_evals"] += n
                run.stats["token_layer_dense"] += n
                return original(args)
            sub_args = dict(args)
            # The previous block was restricted to the same subset and returned ``img`` (see below): its subset rows
            # are that block's output as computed, so it is this block's input as it is, without a gather.
            chained = CHAIN_RESTRICTED_BLOCKS and plan.kv_context and run.carry is not None \
                and run.carry[0] is img and run.carry[1] is subset
            for name, dim in run.adapter.token_dims.items():
                if name not in sub_args:
                    continue
                value = sub_args[name]
                if name == "img" and chained:
                    sub_args[name] = run.carry[2]
                elif name != "img" and CHAIN_RESTRICTED_BLOCKS:
                    # Other per-token arguments (rotary frequencies) are the same tensor in every block of a call:
                    # gathered once per call.
                    hit = run.gathered.get(name)
                    if hit is None or hit[0] is not value or hit[1] is not subset:
                        hit = run.gathered[name] = (value, subset, _gather_arg(value, dim, subset, n))
                    sub_args[name] = hit[2]
                else:
                    sub_args[name] = _gather_arg(value, dim, subset, n)
            topts = dict(args["transformer_options"])
            topts[KEY + "_subset"] = subset
            sub_args["transformer_options"] = topts
            out = original(sub_args)["img"]
            if plan.kv_context:  # every subset token saw its full context: keep all of them
                # The tokens outside the subset pass through every restricted block unchanged: the first restricted
                # block of a call copies the hidden states once, the next ones write their subset rows in place into
                # that copy (this run's own tensor, returned to the model's block loop and read by the next block
                # only), instead of a full copy, a gather and a scatter per block.
                res = img if chained else img.clone()
                res[:, subset.to(img.device)] = out
                run.carry = (res, subset, out) if CHAIN_RESTRICTED_BLOCKS else None
            else:
                res = img.clone()
                res[:, plan.active_tokens.to(img.device)] = out[:, pos.to(img.device)]
            run.stats["token_layer_evals"] += int(subset.numel())
            run.stats["token_layer_dense"] += n
            return {"img": res}
        finally:
            run.layer = -1

    return patch


def _attention_override(run: _Run, previous: Callable | None):
    def override(func, *args, **kwargs):
        q, k, v = args[0], args[1], args[2]
        heads = kwargs.get("heads", args[3] if len(args) > 3 else None)
        topts = kwargs.get("transformer_options") or {}
        layer = run.layer
        fall = (lambda: previous(func, *args, **kwargs)) if previous is not None else (lambda: func(*args, **kwargs))
        skip_reshape = kwargs.get("skip_reshape", False)
        nth = run.attn_in_block
        run.attn_in_block += 1
        if heads is None or skip_reshape or q.ndim != 3:
            return fall()
        if layer >= 0:
            # Inside a transformer block self-attention comes first (Wan, LTX-Video); telling it apart by shapes
            # alone fails when a token subset happens to be as long as the text.
            is_cross = nth > 0 or k.shape[1] != q.shape[1]
        else:
            is_cross = k.shape[1] != q.shape[1] or (topts.get(KEY + "_subset") is None and k.shape[1] != run.n_tokens)
        # --- probe: cross-attention of object tokens -----------------------------------------------------
        cap = run.capture
        if cap is not None and is_cross and layer in cap.layers and q.shape[1] == run.n_tokens:
            _capture_cross(run, q, k, heads, topts)
        if is_cross:
            return fall()
        if run.kv_record_call is not None and run.calls - 1 == run.kv_record_call and layer >= 0 \
                and q.shape[1] == run.n_tokens and topts.get(KEY + "_subset") is None:
            _record_probe_kv(run, layer, k, v, topts)
        # --- dense run: record the self-attention block structure -----------------------------------------
        rec = run.recorder
        if rec is not None and q.shape[1] == run.n_tokens and rec.wants(layer, run.calls - 1):
            t0 = time.perf_counter()
            rows = _cond_rows(topts, q.shape[0])
            rec.observe_bld(layer, run.calls - 1, q[rows][:1], k[rows][:1], heads)
            run.stats["record_s"] += time.perf_counter() - t0
        plan = run.reuse
        subset = topts.get(KEY + "_subset")
        if plan is not None and plan.kv_context and layer in plan.sparse_layers:
            if subset is None and q.shape[1] == run.n_tokens:
                # a dense evaluation of a restricted layer: record every token's keys/values for later calls
                comp = (layer, _composition(topts, q.shape[0]))
                run.kv[comp] = (k.detach(), v.detach())
                run.kv_owned.discard(comp)  # the model's own tensors: copied before they are written
            elif subset is not None:
                try:
                    out = _context_attention(run, plan, layer, q, k, v, heads, subset, topts, args, kwargs,
                                             previous, func)
                except Exception as e:  # never raise inside the model because reuse is impossible
                    run.fallback(f"layer {layer}: attention over recorded context unavailable ({e})")
                    out = None
                if out is not None:
                    return out
        # --- reuse: block-sparse self-attention over the recorded structure --------------------------------
        if plan is not None and plan.structure is not None and layer in plan.sparse_layers and \
                layer in plan.structure.layers:
            try:
                keep = keep_for_layer(plan.structure, layer, device=q.device)
                bs = plan.structure.block_size
                if float(keep.float().mean()) > plan.dense_above:
                    raise _DenseIsCheaper()
                if subset is None and q.shape[1] == plan.structure.n_tokens:
                    if plan.sparse_kernel == "cost" and q.device.type == "cpu" and not _full_tiles_pay(run, keep, bs):
                        raise _DenseIsCheaper()
                    run.stats["attn_pairs"] += int(keep.float().mean().item() * q.shape[1] ** 2)
                    run.stats["attn_pairs_dense"] += q.shape[1] ** 2
                    return block_sparse_attention_bld(q, k, v, heads, keep, bs)
                if subset is not None:
                    out = _subset_attention(run, q, k, v, heads, keep, bs, subset, plan.dense_above,
                                            by_cost=plan.sparse_kernel == "cost")
                    if out is not None:
                        return out
            except _DenseIsCheaper:
                pass
            except Exception as e:  # never raise inside the model because reuse is impossible
                run.fallback(f"layer {layer}: block-sparse attention unavailable ({e})")
        if topts.get(KEY + "_subset") is not None:
            run.stats["attn_pairs"] += q.shape[1] ** 2
            run.stats["attn_pairs_dense"] += run.n_tokens ** 2
        return fall()

    return override


def _full_tiles_pay(run: _Run, keep: torch.Tensor, block_size: int) -> bool:
    """Whether the whole-sequence block-sparse kernel is estimated to be cheaper than dense attention in the current
    layer (``sparse_attention.block_cost_ratio``); decided once per layer and run."""
    key = ("full_pays", run.layer)
    if key not in run.subset_cache:
        run.subset_cache[key] = block_cost_ratio(keep, run.n_tokens, block_size) < 1.0
    return run.subset_cache[key]


def _record_probe_kv(run: _Run, layer: int, k: torch.Tensor, v: torch.Tensor, topts: dict) -> None:
    """Keep one block's keys/values of the probe's last call for a later hit's context, all or nothing: once the
    budget is exceeded every record of this probe is dropped (a hit then refreshes densely, as without them)."""
    if run.kv_over_budget:
        return
    key = (layer, _composition(topts, k.shape[0]))
    used = sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in run.kv.values())
    if used + 2 * k.numel() * k.element_size() > run.kv_budget:
        run.kv.clear()
        run.kv_over_budget = True
        return
    run.kv[key] = (k.detach().to("cpu", copy=True), v.detach().to("cpu", copy=True))


def _context_attention(run: _Run, plan: ReusePlan, layer: int, q, k, v, heads: int, subset: torch.Tensor,
                       topts: dict, args: tuple, kwargs: dict, previous: Callable | None, func: Callable):
    """Self-attention of a token subset's queries over *every* token: the subset's keys/values are fresh, the
    others' are those recorded at this run's last dense evaluation of the layer (same batch composition).

    Over the recorded block structure when the entry has one for this layer (block-sparse kernel with
    ``query_index``; no token-level mask), else plain attention. Returns None when nothing is recorded (the
    caller then falls back to attention among the subset and logs it)."""
    comp = (layer, _composition(topts, q.shape[0]))
    rec = run.kv.get(comp)
    if rec is None or rec[0].shape[0] != k.shape[0]:
        run.fallback(f"layer {layer}: no recorded keys/values for this batch; attention sees the subset only")
        return None
    idx = subset.to(k.device)
    if comp not in run.kv_owned:
        # First use of this record since it was taken: one private, contiguous copy on the model's device and dtype
        # (the probe's record is shared with the Probe value, a refresh's is the model's own tensor). Later calls
        # write the subset's fresh keys/values into it in place. Every call of a run writes the same subset, so the
        # other tokens keep the record's values and the result equals a fresh ``index_copy`` of the record per
        # call, which cost a full [batch, tokens, width] copy of keys and of values per layer and call (at Wan
        # 2.1-1.3B 480p with a CFG batch of 2 in bf16, ~200 MB each; on the embedded model too small to measure).
        rec = run.kv[comp] = (rec[0].to(device=k.device, dtype=k.dtype, memory_format=torch.contiguous_format,
                                        copy=True),
                              rec[1].to(device=v.device, dtype=v.dtype, memory_format=torch.contiguous_format,
                                        copy=True))
        run.kv_owned.add(comp)
    keys = rec[0].index_copy_(1, idx, k)
    values = rec[1].index_copy_(1, idx, v)
    n, s = keys.shape[1], q.shape[1]
    structure = plan.structure
    if structure is not None and layer in structure.layers:
        # Queries = the subset, keys = every token: the token-set block-sparse kernel (no token-level mask; it
        # counts the pairs it computes). None when the structure keeps too much to be worth the tiles.
        all_pos = run.subset_cache.get(("all_pos", n))
        if all_pos is None:
            all_pos = run.subset_cache[("all_pos", n)] = torch.arange(n, device=q.device)
        keep = keep_for_layer(structure, layer, device=q.device)
        out = _subset_attention(run, q, keys, values, heads, keep, structure.block_size, idx, plan.dense_above,
                                k_subset=all_pos, by_cost=plan.sparse_kernel == "cost")
        if out is not None:
            return out
    run.stats["attn_pairs"] += s * n
    run.stats["attn_pairs_dense"] += n * n
    new_args = (q, keys, values) + tuple(args[3:])
    return previous(func, *new_args, **kwargs) if previous is not None else func(*new_args, **kwargs)


def token_tiles_may_pay(device_type: str, keep: torch.Tensor, block_size: int, n_tokens: int,
                        q_pos: torch.Tensor, k_pos: torch.Tensor | None) -> bool:
    """The ``sparse_kernel="cost"`` policy for a token subset's attention: may the token-set block-sparse kernel
    cost less than plain attention over the same keys?

    CPU: the gather kernel's cost model (:func:`~.sparse_attention.tile_cost_ratio` < 1). CUDA: no. Measured on an
    H200 at Wan 2.1-1.3B's 32,760 tokens (``scripts/bench/gpu_bench_wan.py``, BENCHMARKS.md "On a GPU"): the subset's
    queries over every key took 2.3-2.8x as long on the FlexAttention token-set kernel as on plain SDPA at union
    densities 0.35-0.64, and 3.7-5.9x among the subset alone at 0.1-0.5 -- its query tiles straddle the recorded
    blocks (partial tiles, element-wise ``mask_mod``) while SDPA runs the fused flash kernel -- and a whole hit
    call cost 0.65 s against 0.38 s. Other devices: not measured; the density threshold alone decides."""
    if device_type == "cuda":
        return False
    if device_type == "cpu":
        return tile_cost_ratio(keep, block_size, n_tokens, q_pos, k_pos) < 1.0
    return True


def _subset_attention(run: _Run, q, k, v, heads: int, keep: torch.Tensor, bs: int, subset: torch.Tensor,
                      dense_above: float = 1.0, k_subset: torch.Tensor | None = None, by_cost: bool = False):
    """Self-attention among a token subset, restricted to the recorded blocks, on the block-sparse kernel.

    q: [B, S, heads*D], row i = the token at original position ``subset[i]``; k, v: the same tokens, or the
    tokens at ``k_subset`` when the keys are another set (e.g. active tokens plus context supplied from elsewhere;
    every query's own token should be among them). Query i attends key j iff the recorded key block of key j's
    position is kept for the query block of ``subset[i]`` in any head (union over heads), or both lie in the
    same block. The result equals SDPA with that [S, S] boolean mask (float tolerance), but no token-level mask
    is built: :func:`~.sparse_attention.token_block_sparse_attention` maps the subset to the recorded blocks and
    runs one unmasked SDPA tile per group of query blocks that share a key-block set (FlexAttention ``BlockMask``
    on CUDA); the plan is O(blocks^2 + S) and built once per layer and run.

    Returns None when the structure keeps more than ``dense_above`` of the subset's pairs: there is then little
    to skip and the tiles' overhead can exceed it (the former masked SDPA at recorded density 0.98 made joint 14%
    slower per step than latent-only on a random-weight Wan at 8k tokens), so the caller runs plain attention
    among the subset. ``by_cost``: None also where the tiles are not expected to pay
    (:func:`token_tiles_may_pay`: the CPU gather kernel's cost model, decided from block counts before any plan
    is built; on CUDA never, as measured)."""
    key = ("subplan", run.layer, k_subset is not None)  # the context path's keys are another token set
    if key not in run.subset_cache:
        # A query's own block is always kept: its recorded key blocks may all lie outside the subset, and a row
        # with no key would make softmax undefined (NaN).
        kb = (keep.any(0) | torch.eye(keep.shape[-1], dtype=torch.bool, device=keep.device))[None]  # [1, Qb, Kb]
        # The same for every call of this run: decide, build and count once per layer (token_tiles_may_pay: the
        # CPU gather kernel's cost model, never on CUDA, the density threshold alone elsewhere).
        if by_cost and not token_tiles_may_pay(q.device.type, kb, bs, run.n_tokens, subset, k_subset):
            run.subset_cache[key] = None
        else:
            plan = plan_token_block_sparse(kb, bs, run.n_tokens, subset, k_subset, device=q.device)
            run.subset_cache[key] = None if plan.density > dense_above else (kb, plan)
    cached = run.subset_cache[key]
    if cached is None:
        return None
    kb, plan = cached
    backend = run.subset_cache.get("subset_backend", "auto")
    try:
        out = token_block_sparse_attention_bld(q, k, v, heads, kb, bs, run.n_tokens, subset, k_subset, plan=plan,
                                               backend=backend)
    except Exception as e:
        if backend != "auto" or not q.is_cuda:
            raise
        # FlexAttention (the CUDA default) could not run here (e.g. no compiler): the gather kernel gives the same
        # result on the fused SDPA tiles. Decided once per run.
        run.fallback(f"flex block-sparse attention unavailable ({type(e).__name__}: {e}); using the gather kernel")
        run.subset_cache["subset_backend"] = "gather"
        out = token_block_sparse_attention_bld(q, k, v, heads, kb, bs, run.n_tokens, subset, k_subset, plan=plan,
                                               backend="gather")
    run.stats["attn_pairs"] += plan.kept_pairs
    run.stats["attn_pairs_dense"] += run.n_tokens ** 2
    return out


def _capture_cross(run: _Run, q: torch.Tensor, k: torch.Tensor, heads: int, topts: dict) -> None:
    """Accumulate softmax cross-attention mass of each object's tokens over the video tokens (cond rows)."""
    rows = _cond_rows(topts, q.shape[0])
    if not bool(rows.any()):
        return
    qc, kc = q[rows][:1].detach().float(), k[rows][:1].detach().float()
    B, L, HD = qc.shape
    d = HD // heads
    qh = qc.reshape(B, L, heads, d).transpose(1, 2)
    kh = kc.reshape(B, kc.shape[1], heads, d).transpose(1, 2)
    probs = torch.softmax(qh @ kh.transpose(-1, -2) / math.sqrt(d), dim=-1)  # [1, H, L, Lt]
    probs = probs.mean(1)[0]  # [L, Lt]
    for obj in run.capture.objects:
        pos = [p for p in obj.positions if p < probs.shape[1]]
        if not pos:
            continue
        m = probs[:, pos].sum(-1).detach()
        run.maps[obj.name] = run.maps.get(obj.name, 0) + m.cpu()
        run.map_counts[obj.name] = run.map_counts.get(obj.name, 0) + 1


def _install(model: Any, run: _Run, layers: tuple[int, ...]) -> Any:
    """Clone the MODEL and install Carnator's wrapper, block patches and attention override on the clone."""
    m = model.clone()
    m.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.PREDICT_NOISE, KEY, _predict_wrapper(run))
    topts = m.model_options.setdefault("transformer_options", {})
    existing = topts.get("patches_replace", {}).get("dit", {})
    for i in layers:
        m.set_model_patch_replace(_block_patch(run, i, existing.get(("double_block", i))), "dit", "double_block", i)
    previous = topts.get("optimized_attention_override")
    m.model_options["transformer_options"]["optimized_attention_override"] = _attention_override(run, previous)
    return m


# ----------------------------------------------------------------------------------------------------------
# entry points


@dataclass
class ProbeRaw:
    replay: tuple[torch.Tensor, ...]
    latent_at_k: torch.Tensor
    object_maps: dict[str, np.ndarray]
    grid: tuple[int, int, int]
    sigmas: torch.Tensor
    seconds: float
    fallbacks: tuple[str, ...]
    context_kv: dict = field(default_factory=dict)  # (layer, composition) -> (keys, values) at the last call


def prepare_latent(model: Any, latent: dict) -> torch.Tensor:
    samples = latent["samples"]
    return comfy.sample.fix_empty_latent_channels(model, samples)


def make_noise(latent_image: torch.Tensor, seed: int, latent: dict) -> torch.Tensor:
    return comfy.sample.prepare_noise(latent_image, seed, latent.get("batch_index"))


def _stage_args(stage: Stage | None, steps: int) -> dict[str, Any]:
    """``comfy.sample.sample``'s arguments for a stage, exactly as KSamplerAdvanced passes them (none for the whole
    schedule, as KSampler passes none)."""
    if stage is None or stage == Stage():
        return {}
    start, _ = stage.bounds(steps)
    return {"start_step": start, "last_step": int(stage.end_at_step),
            "force_full_denoise": not stage.return_with_leftover_noise}


def _sampling_noise(latent_image: torch.Tensor, seed: int, latent: dict, stage: Stage | None) -> torch.Tensor:
    """The noise the sampler adds: the seed's, or zeros when the stage adds none (KSamplerAdvanced's add_noise
    disabled: the latent carries the previous stage's leftover noise)."""
    if stage is not None and not stage.add_noise:
        return torch.zeros(latent_image.size(), dtype=latent_image.dtype, layout=latent_image.layout, device="cpu")
    return make_noise(latent_image, seed, latent)


def probe_sample(model: Any, positive, negative, latent: dict, seed: int, steps: int, cfg: float,
                 sampler_name: str, scheduler: str, probe_steps: int, capture: CaptureConfig,
                 denoise: float = 1.0, progress: Callable[[int], None] | None = None,
                 stage: Stage | None = None, kv_budget_bytes: int = 0) -> ProbeRaw:
    """Run the first ``probe_steps`` model calls of the real schedule (of ``stage``'s steps of it: a split
    schedule's stage, as KSamplerAdvanced runs it); see the module docstring. ``kv_budget_bytes`` > 0: keep every
    block's self-attention keys/values of the last call when they fit (``ProbeRaw.context_kv``)."""
    check_sampler(sampler_name)
    adapter = adapter_for(model)
    latent_image = prepare_latent(model, latent)
    grid = adapter.token_grid(tuple(latent_image.shape), adapter.patch_of(model))
    run = _Run(adapter=adapter, n_tokens=int(np.prod(grid)), patch=adapter.patch_of(model), grid=grid, stop_at=probe_steps, record_replay=True,
               capture=capture, progress=progress,
               kv_record_call=probe_steps - 1 if kv_budget_bytes > 0 else None, kv_budget=int(kv_budget_bytes))
    m = _install(model, run, tuple(range(adapter.num_layers(model))))
    noise = _sampling_noise(latent_image, seed, latent, stage)
    sigmas = compute_sigmas(model, steps, sampler_name, scheduler, denoise)
    t0 = time.perf_counter()
    try:
        comfy.sample.sample(m, noise, steps, cfg, sampler_name, scheduler, positive, negative, latent_image,
                            denoise=denoise, noise_mask=latent.get("noise_mask"), disable_pbar=True, seed=seed,
                            **_stage_args(stage, steps))
        raise RuntimeError(f"the sampler finished before the probe's {probe_steps} model calls; "
                           f"lower probe steps below the number of steps of its stage ({steps} in all)")
    except _ProbeStop:
        pass
    finally:
        replay = tuple(run.replay)
        maps = {name: (run.maps[name] / run.map_counts[name]).reshape(grid).numpy().astype(np.float32)
                for name in run.maps}
        latent_k = run.latent_at_stop
        context_kv = dict(run.kv)
        run.reset()
    if latent_k is None or len(replay) != probe_steps:
        raise RuntimeError(f"probe recorded {len(replay)} of {probe_steps} model calls")
    return ProbeRaw(replay=replay, latent_at_k=latent_k, object_maps=maps, grid=grid, sigmas=sigmas,
                    seconds=time.perf_counter() - t0, fallbacks=tuple(sorted(run.fallbacks)), context_kv=context_kv)


@dataclass
class ResumeResult:
    samples: torch.Tensor
    stats: dict
    structure: BlockStructure | None
    fallbacks: tuple[str, ...]
    seconds: float


def resume_sample(model: Any, positive, negative, latent: dict, seed: int, steps: int, cfg: float,
                  sampler_name: str, scheduler: str, replay: tuple[torch.Tensor, ...], denoise: float = 1.0,
                  reuse: ReusePlan | None = None, recorder: BlockRecorder | None = None,
                  progress: Callable[[int], None] | None = None, stage: Stage | None = None) -> ResumeResult:
    """Finish a probed request: replay the probe's calls, then dense or joint-reuse sampling to the end (of
    ``stage``: a split schedule's stage, run as KSamplerAdvanced runs it; the second stage of a split schedule has
    no replay).

    Returns the final latent in ComfyUI's LATENT space (as KSampler / KSamplerAdvanced return it).
    """
    check_sampler(sampler_name)
    adapter = adapter_for(model)
    latent_image = prepare_latent(model, latent)
    grid = adapter.token_grid(tuple(latent_image.shape), adapter.patch_of(model))
    run = _Run(adapter=adapter, n_tokens=int(np.prod(grid)), patch=adapter.patch_of(model), grid=grid, replay=list(replay), reuse=reuse,
               recorder=recorder, progress=progress)
    if reuse is not None and reuse.kv_context and reuse.initial_kv:
        # The probe's record (read only: shared with the Probe value); copied on first use, replaced by refreshes.
        run.kv.update(reuse.initial_kv)
    m = _install(model, run, tuple(range(adapter.num_layers(model))))
    noise = _sampling_noise(latent_image, seed, latent, stage)
    if reuse is not None:
        # Tokens outside the active region follow the cached x0 re-noised with the request's own noise: the seed's,
        # also in a stage that adds none (its latent holds that noise, carried over from the first stage).
        reuse.noise = make_noise(latent_image, seed, latent)
    t0 = time.perf_counter()
    try:
        samples = comfy.sample.sample(m, noise, steps, cfg, sampler_name, scheduler, positive, negative,
                                      latent_image, denoise=denoise, noise_mask=latent.get("noise_mask"),
                                      disable_pbar=True, seed=seed, **_stage_args(stage, steps))
        structure = recorder.result() if (recorder is not None and recorder.n_observations) else None
    finally:
        stats = dict(run.stats)
        run.reset()
    return ResumeResult(samples=samples, stats=stats, structure=structure, fallbacks=tuple(sorted(run.fallbacks)),
                        seconds=time.perf_counter() - t0)


def process_latent_in(model: Any, samples: torch.Tensor) -> torch.Tensor:
    return model.model.process_latent_in(samples)


def latent_rgb(model: Any) -> tuple[np.ndarray | None, np.ndarray | None]:
    fmt = model.model.latent_format
    f = getattr(fmt, "latent_rgb_factors", None)
    b = getattr(fmt, "latent_rgb_factors_bias", None)
    return (np.asarray(f, dtype=np.float32) if f is not None else None,
            np.asarray(b, dtype=np.float32) if b is not None else None)


# ----------------------------------------------------------------------------------------------------------
# the generation-native judge: one-step denoising of a finished clip at a few low noise levels


@dataclass
class LevelDenoise:
    """What :func:`denoise_levels` measured at one noise level (model space, batch item 0).

    x0: the clip's clean latent; cond_x0 / alt_x0: the model's x0 prediction of the clip re-noised to ``sigma``
    under the positive conditioning and under the alternative one (the negative slot)."""

    sigma: float
    x0: torch.Tensor
    cond_x0: torch.Tensor
    alt_x0: torch.Tensor


@dataclass
class DenoiseRaw:
    levels: list[LevelDenoise]
    object_maps: dict[str, np.ndarray]  # object name -> cross-attention mass over the token grid, mean of calls
    grid: tuple[int, int, int]
    model_calls: int
    seconds: float
    fallbacks: tuple[str, ...]


def denoise_levels(model: Any, positive, alternative, latent: dict, seed: int, sigmas: tuple[float, ...],
                   capture: CaptureConfig | None = None, models_by_sigma: Callable[[float], Any] | None = None
                   ) -> DenoiseRaw:
    """Re-noise a finished clip's latent (``latent["samples"]``, ComfyUI LATENT space, batch 1) to each noise level
    of ``sigmas`` with the seed's own noise (``comfy.sample.prepare_noise``, as KSampler draws it) and ask the model
    for its x0 prediction under ``positive`` and ``alternative`` in one CFG batch (one model call per level: a
    one-step Euler run from ``sigma`` to 0 through ComfyUI's sampler, so every model patch and wrapper applies as in
    sampling). ``capture`` records the positive prompt's object-token cross-attention over the video tokens in its
    layers (as the Early Probe does). ``models_by_sigma(sigma)`` picks the MODEL per level (a two-expert pair:
    the low-noise expert below its switch); default ``model``. The caller's MODEL is never modified."""
    t0 = time.perf_counter()
    maps: dict[str, Any] = {}
    counts: dict[str, int] = {}
    levels: list[LevelDenoise] = []
    calls = 0
    fallbacks: set[str] = set()
    grid: tuple[int, int, int] = (0, 0, 0)
    sampler = comfy.samplers.sampler_object("euler")
    for sigma in sigmas:
        mdl = models_by_sigma(float(sigma)) if models_by_sigma is not None else model
        adapter = adapter_for(mdl)
        latent_image = prepare_latent(mdl, latent)
        patch = adapter.patch_of(mdl)
        grid = adapter.token_grid(tuple(latent_image.shape), patch)
        run = _Run(adapter=adapter, n_tokens=int(np.prod(grid)), patch=patch, grid=grid, capture=capture)
        m = _install(mdl, run, tuple(range(adapter.num_layers(mdl)) if capture is not None else ()))
        got: list[tuple[torch.Tensor, torch.Tensor]] = []

        def post(args: dict) -> torch.Tensor:
            got.append((args["cond_denoised"][:1].detach().float().cpu(),
                        args["uncond_denoised"][:1].detach().float().cpu()))
            return args["denoised"]

        # cfg 2 (any scale but 1) makes ComfyUI evaluate both conditionings, batched as in sampling
        m.set_model_sampler_post_cfg_function(post, disable_cfg1_optimization=True)
        noise = make_noise(latent_image, seed, latent)
        sig = torch.tensor([float(sigma), 0.0], dtype=torch.float32)
        try:
            comfy.sample.sample_custom(m, noise, 2.0, sampler, sig, positive, alternative, latent_image,
                                       disable_pbar=True, seed=seed)
        finally:
            for name, v in run.maps.items():
                maps[name] = maps.get(name, 0) + v
                counts[name] = counts.get(name, 0) + run.map_counts[name]
            calls += run.stats["model_calls"]
            fallbacks |= run.fallbacks
            run.reset()
        if len(got) != 1:
            raise RuntimeError(f"expected one model evaluation at sigma {sigma}, saw {len(got)}")
        x0 = mdl.model.process_latent_in(latent_image[:1].float()).cpu()
        levels.append(LevelDenoise(float(sigma), x0, got[0][0], got[0][1]))
    object_maps = {n: (maps[n] / counts[n]).reshape(grid).numpy().astype(np.float32) for n in maps}
    return DenoiseRaw(levels, object_maps, grid, calls, time.perf_counter() - t0, tuple(sorted(fallbacks)))
