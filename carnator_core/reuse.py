"""Joint reuse: finish a probed request densely, or by reusing an accepted cache entry.

Accepted decision -> from step k on (``comfy_patch.resume_sample`` replays the probe's k calls first):

* **region-guided latent reuse**: an active region A is derived from evidence (object masks of both signatures
  where they differ or where the object's colour differs, plus where the two x0 predictions at step k disagree,
  dilated). Outside A the model sees the cached final x0 re-noised to the current sigma with the target's noise
  and its prediction there is the cached x0 (ComfyUI's inpainting rule), so inactive tokens follow the cached
  trajectory and end exactly at the cached result.
* **historical sparse-connectivity reuse**: in the middle layers only tokens of A (plus a margin of context
  tokens around it) go through the block, and self-attention among them is restricted to the blocks recorded
  for the cached request (structure, not values). First/last layers stay dense.

Modes: ``joint`` (both: A + margin, recorded blocks among them), ``latent`` (A + margin, full attention among
them), ``attention`` (all tokens, block-sparse attention only), ``dense`` (no reuse; with recording of the
block structure for the cache).
Rejected decision -> plain dense resume (identical to KSampler).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import Any, Callable, ClassVar, Mapping

import numpy as np

from .types import STAGE_END_MAX, BlockStructure, Decision, GenConfig, Probe, Signature, Stage

MODES = ("joint", "latent", "attention", "dense")
SPARSE_KERNELS = ("always", "cost")

# The probe's keys/values budget when a rule's reuse settings read them (``probe_context``): what the labelling
# ran (``request.ServeOptions.following_rule``) and the Early Probe node's default. Every embedded version fits
# (v3: 9.4 MiB); Wan at 480p x 81 frames does not (~12 GiB) and keeps nothing, so its certified hits refresh densely.
RULE_CONTEXT_KV_MB = 64.0


@dataclass(frozen=True)
class ReuseConfig:
    """Knobs of the Joint Reuse Sampler.

    mode:            "joint" | "latent" | "attention" | "dense" (ablations; see module docstring).
    first_dense, last_dense: number of first/last transformer blocks always computed densely. 0 by default: with
                     ``kv_context`` every block gets the context it needs, and a dense outer block after restricted
                     ones would read tokens whose hidden states the restricted blocks did not update (PSNR of a
                     hit vs its dense clip 25.5 dB with 1 + 1 dense outer blocks, 28.5 dB with none).
    mask_threshold:  a token belongs to an object where its soft signature mask is >= this.
    x0_threshold:    a token is active where the per-token mean |x0_target - x0_cached| at step k exceeds this
                     multiple of the typical (median) per-token difference magnitude of the target's x0.
    dilation:        tokens of dilation (space and time) around the evidence, so object borders are recomputed.
    whole_objects:   when any evidence touches an object (its masks differ, its colour differs, or the x0
                     predictions disagree on its support), recompute the whole support of that object in both
                     requests, not only the tokens where the evidence is. Measured on the embedded model v2
                     (rules/README.md): with evidence-only regions, reuses recomputing 10-30% of the tokens failed
                     the checker in a third of the pairs (an object half kept from the cached run).
    mask_iou_same:   an object's thresholded masks in the two signatures with IoU >= this are the same support:
                     the tokens where they differ are attention jitter, not evidence (two wordings of one scene
                     and seed differ by ~3 tokens); > 1 treats every differing token as evidence.
    x0_object_fraction: x0 disagreement is evidence about an object (whole_objects) only when it covers at least
                     this fraction of the object's support (both masks); 0 = any disagreeing token.
    context_delta:   CIELAB ΔE76 by which the median object-free context cell must differ for the background to
                     count as changed (then every cell differing by more is recomputed). On the embedded model a
                     position or colour edit can redraw the whole scene (far context cells 10-12 ΔE apart, x0
                     disagreeing over half the tokens): such regions are the whole clip by design.
    block_size:      tokens per attention block when recording structure in dense runs; 0 = automatic
                     (``auto_block_size``: about 16 blocks per sequence, between 16 and 128 tokens).
    record_mass:     attention mass the recorded key blocks must cover per query block.
    record_steps:    how many representative steps to record at (spread over the schedule after the probe).
    context_margin_blocks: latent and joint modes: tokens of 3-D context margin around the active region.
    kv_context:      latent and joint modes: the active tokens attend to every token in the restricted layers;
                     keys/values of the tokens outside the computed subset come from this run's last dense
                     call (see ``refreshes``). Off = attention among the subset only (an ablation: the
                     lost context leaves rows of dashes around the region on the embedded model).
    refreshes:       with ``kv_context``: how many reuse calls (the first included; the others spread evenly or
                     where ``refresh_at`` places them) run densely to record every token's keys/values for the
                     calls that follow. Measured on the embedded
                     model (same-seed wording + region of 34 % of the tokens, PSNR of the hit vs the dense clip):
                     1 refresh 28.5 dB, 2: 30.5, 3: 31.8, 4: 33.6, every second call 36.6 dB; the recorded context
                     goes stale as the noise level falls.
    refresh_at:      with ``kv_context``: where the dense refresh calls after the first context record run, as
                     comma-separated fractions of the calls after the probe ("0.6,0.9"); one per record after the
                     first (``refreshes`` - 1 of them). "" (the default) = spread evenly, as rules recorded before
                     this setting ran. Why: the recorded context matters most late in the schedule, where
                     the noise level is low and the details form. Measured on the embedded model v3 (forced hits,
                     ``scripts/bench/bench_hits.py``, 16 restricted hits, probe 2, refreshes 3): the two
                     dense refreshes at 0.6 and 0.9 instead of the even calls 8 and 14 of 20 gave +3.0 to +3.7 dB
                     against the dense clip on 16 of 16 hits at the same compute.
    probe_context:   with ``kv_context``: when the probe kept its last call's keys/values
                     (``ProbeConfig.context_kv_mb``), they are the first context record, so of the ``refreshes``
                     records only the later ones are dense refresh calls (same spacing: one dense call fewer per
                     hit). Not used on a split schedule's second stage (another model).
    motion_shift:    an object both requests have is recomputed whole when its first-to-last-frame mask centroid
                     displacement differs between the two signatures by more than this fraction of the token grid's
                     larger side; 0 = off (the default: rules certified before this term ran without it). Measured on
                     the embedded model v3 (4-step probe, 298 query pairs, seeds 101 and 102): a motion edit ("moves
                     down" for "moves up", "stays still" for "rises") shifts it by 0.05-0.20 of the frame while the
                     masks still overlap with IoU >= ``mask_iou_same`` and the x0 predictions agree, so no other
                     term sees the change and the cached motion was kept; same-seed rewordings shift it by <= 0.05
                     (1 of 25 above 0.045), re-rolls by <= 0.03.
    sparse_kernel:   joint mode: where the recorded block structure restricts a layer's attention. "always":
                     in every layer whose planned density is at most 0.85 (what rules recorded before this
                     setting ran: ``ABSENT_MEANS``). "cost" (default): only where the block-sparse tiles are
                     estimated to cost less than plain attention over the same keys
                     (``sparse_attention.tile_cost_ratio`` / ``block_cost_ratio`` on the CPU; on CUDA a token
                     subset's attention never runs the tiles: ``comfy_patch.token_tiles_may_pay``); elsewhere the layer
                     attends to every key, as in latent mode — the more exact computation, and there the cheaper
                     one. Measured (``bench_sparse_attention.py --crossover``): at the embedded model's 576 tokens
                     the tiles cost 4-5.6x plain attention at any density (a joint hit there cost 0.51-0.60 of a
                     dense resume, 0.42-0.48 with this policy); from ~2 000 tokens at densities up to ~0.5 they
                     save.
    max_active:      largest active region (fraction of the tokens) worth reusing: above it the sampler
                     continues densely (bit-identical to KSampler, reported as a miss with the reason), because a
                     region that covers nearly the clip costs about a dense run plus the reuse's own overheads
                     and keeps little of the cached run. Pair labelling marks such candidates as not reusable,
                     so calibration and certification count them as rejected, exactly as serving does.
    """

    mode: str = "joint"
    first_dense: int = 0
    last_dense: int = 0
    mask_threshold: float = 0.5
    x0_threshold: float = 1.0
    dilation: int = 1
    whole_objects: bool = True
    block_size: int = 0
    record_mass: float = 0.9
    record_steps: int = 3
    context_margin_blocks: int = 1
    kv_context: bool = True
    refreshes: int = 3
    refresh_at: str = ""
    probe_context: bool = False
    mask_iou_same: float = 0.75
    x0_object_fraction: float = 0.1
    context_delta: float = 8.0
    max_active: float = 0.6
    motion_shift: float = 0.0
    sparse_kernel: str = "cost"

    # What a recorded config (a rule, a pairs file) that lacks a field ran with: the behaviour before the field
    # existed, where that differs from today's default.
    ABSENT_MEANS: ClassVar[Mapping[str, Any]] = {"sparse_kernel": "always"}

    def __post_init__(self) -> None:
        # One spelling per placement ("0.6, 0.90" -> "0.6,0.9"), so that a config compares equal to the rule that
        # certified it however the placement was typed; an unreadable one is left for validate() to name.
        if isinstance(self.refresh_at, str) and not self.refresh_at.strip():
            object.__setattr__(self, "refresh_at", "")
        elif isinstance(self.refresh_at, str):
            try:
                canon = ",".join(repr(f) for f in refresh_fractions(self.refresh_at))
            except ValueError:
                return
            object.__setattr__(self, "refresh_at", canon)

    def to_meta(self) -> dict[str, Any]:
        """Every field, JSON-ready: what a pairs file and a risk rule record as the settings reuse ran with."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_meta(cls, certified: Mapping[str, Any]) -> "ReuseConfig | None":
        """The config a recorded :meth:`to_meta` describes (fields it does not record take their defaults, or what
        ``ABSENT_MEANS`` says they ran with, as in :meth:`differences`), or None when it records a field this
        version does not have or an invalid value — then no config of this version is the certified one."""
        names = {f.name for f in fields(cls)}
        if any(k not in names for k in certified):
            return None
        try:
            return cls(**{**{k: v for k, v in cls.ABSENT_MEANS.items() if k not in certified},
                          **dict(certified)}).validate()
        except (TypeError, ValueError):
            return None

    def differences(self, certified: Mapping[str, Any]) -> list[str]:
        """The fields in which this config differs from ``certified`` (a recorded :meth:`to_meta`; a field it
        does not record was added later and is compared with its default, or with ``ABSENT_MEANS``; one it records
        that this version does not have is a difference too), as "name value (certified: value)"."""
        names = {f.name for f in fields(self)}
        out = [f"{k} (certified: {certified[k]!r}) is not a setting of this version" for k in sorted(certified)
               if k not in names]
        for f in fields(self):
            want = certified.get(f.name, self.ABSENT_MEANS.get(f.name, f.default))
            have = getattr(self, f.name)
            if have != want and not (isinstance(have, float) and isinstance(want, (int, float))
                                     and abs(have - float(want)) <= 1e-12):
                out.append(f"{f.name} {have!r} (certified: {want!r})")
        return out

    def validate(self) -> "ReuseConfig":
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.block_size < 0 or self.dilation < 0 or self.record_steps < 0:
            raise ValueError("block_size (0 = auto), dilation and record_steps must be >= 0")
        if self.context_delta < 0 or not 0.0 <= self.x0_object_fraction <= 1.0:
            raise ValueError("context_delta must be >= 0 and x0_object_fraction in [0, 1]")
        if not 0.0 <= self.motion_shift <= 1.0:
            raise ValueError(f"motion_shift must be in [0, 1] (a fraction of the frame; 0 = off), got {self.motion_shift}")
        if not 0.0 <= self.max_active <= 1.0:
            raise ValueError(f"max_active must be in [0, 1] (1 = reuse whatever the region), got {self.max_active}")
        if self.sparse_kernel not in SPARSE_KERNELS:
            raise ValueError(f"sparse_kernel must be one of {SPARSE_KERNELS}, got {self.sparse_kernel!r}")
        if self.refreshes < 1:
            raise ValueError(f"refreshes must be >= 1 (the first reuse call records the context), got {self.refreshes}")
        if not isinstance(self.refresh_at, str):
            raise ValueError(f"refresh_at must be a string of fractions such as '0.6,0.9' ('' = even spacing), "
                             f"got {self.refresh_at!r}")
        if self.refresh_at:
            places = refresh_fractions(self.refresh_at)
            if len(places) != self.refreshes - 1:
                raise ValueError(f"refresh_at {self.refresh_at!r} places {len(places)} dense refresh call(s), but "
                                 f"refreshes={self.refreshes} asks for {self.refreshes - 1} after the first record: "
                                 f"give one fraction per refresh after the first, or set refreshes={len(places) + 1}")
        return self


@dataclass(frozen=True)
class CachedRun:
    """What reuse needs from a cache entry (loaded by the node from the store)."""

    entry_id: str
    final_latent: Any  # torch.Tensor [C, T, H, W] LATENT space (as KSampler returned it)
    x0_probe: Any  # torch.Tensor [C, T, H, W] model space
    signature: Signature
    structure: BlockStructure | None


@dataclass(frozen=True)
class RunReport:
    """Per-run report: what was decided, what was computed, and what every stage cost."""

    decision: str  # "hit" | "miss" | "dense"
    mode: str
    entry_id: str | None
    active_fraction: float
    block_density: float | None
    steps_total: int
    steps_probe: int
    model_calls: int
    replayed_calls: int
    skipped_calls: int
    token_fraction: float  # tokens computed / tokens of a dense run, over middle-layer evaluations
    attention_fraction: float  # attention pairs computed / dense pairs, over middle-layer self-attention
    timings_ms: Mapping[str, float]
    block_structure: BlockStructure | None = None
    fallbacks: tuple[str, ...] = ()
    reason: str = ""
    compute_fraction: float = 1.0  # estimated model compute / dense compute (probe included), from counters
    # Which stage of a split schedule this run was ("": the whole schedule; "first": the probe's stage; "second":
    # the stage after the switch, on the second model). ``final``: the run's latent is the finished generation,
    # not a stage's output with leftover noise (only a final latent may be stored in the cache).
    stage: str = ""
    final: bool = True
    # The second stage of a split schedule whose first stage certainly ran dense (no entry was accepted): its input
    # latent, the first stage's output [B, C, T, H, W]; the Cache Writer stores it so an exact repeat of the
    # request can answer both stages. None otherwise.
    first_stage_latent: Any = None
    # A hit's key at the sampler (``request.hit_answer_key``): the Cache Writer keeps the result as an answer-only
    # entry under it, so the same request reusing the same entry the same way is answered at the sampler next
    # time. "" when the run was no hit or its inputs cannot be digested.
    answer_key: str = ""

    @property
    def saving(self) -> float:
        return 1.0 - self.compute_fraction

    def summary(self) -> str:
        t = self.timings_ms
        parts = [f"{self.decision.upper()}" + (f" {self.entry_id}" if self.entry_id else ""), f"mode={self.mode}",
                 f"active={self.active_fraction:.1%}"]
        if self.block_density is not None:
            parts.append(f"density={self.block_density:.1%}")
        parts.append(f"compute={self.compute_fraction:.0%} of dense")
        parts.append(f"calls={self.model_calls}+{self.replayed_calls} replayed+{self.skipped_calls} skipped"
                     f"/{self.steps_total}")
        parts.append("ms: " + " ".join(f"{k}={v:.0f}" for k, v in t.items()))
        if self.stage:
            parts.append(f"stage={self.stage}" + ("" if self.final else " (leftover noise)"))
        if self.fallbacks:
            parts.append("fallbacks: " + "; ".join(self.fallbacks))
        if self.reason:
            parts.append(self.reason)
        return " | ".join(parts)

    def to_meta(self) -> dict[str, Any]:
        return {
            "decision": self.decision, "mode": self.mode, "entry_id": self.entry_id,
            "active_fraction": self.active_fraction, "block_density": self.block_density,
            "steps_total": self.steps_total, "steps_probe": self.steps_probe, "model_calls": self.model_calls,
            "replayed_calls": self.replayed_calls, "skipped_calls": self.skipped_calls,
            "token_fraction": self.token_fraction, "attention_fraction": self.attention_fraction,
            "timings_ms": dict(self.timings_ms), "fallbacks": list(self.fallbacks), "reason": self.reason,
            "has_block_structure": self.block_structure is not None,
            "compute_fraction": self.compute_fraction, "saving": self.saving, "stage": self.stage,
            "final": self.final,
        }


def _token_pool(x: np.ndarray, patch: tuple[int, int, int], grid: tuple[int, int, int]) -> np.ndarray:
    """Mean over channels and over the latent cells of each token: [C, T, H, W] -> [T', H', W']."""
    a = np.abs(x).mean(0) if x.ndim == 4 else x
    pt, ph, pw = patch
    T, H, W = grid
    pad = [(0, T * pt - a.shape[0]), (0, H * ph - a.shape[1]), (0, W * pw - a.shape[2])]
    a = np.pad(a, pad, mode="edge")
    return a.reshape(T, pt, H, ph, W, pw).mean((1, 3, 5))


@dataclass(frozen=True)
class RegionTerms:
    """The evidence behind an active region, term by term (bool [T, H, W] on the token grid unless stated), as
    ``region_terms`` derives it; ``active_region`` composes them, and diagnostics read them one at a time.

    new_objects:  supports of target objects the cached run does not have;
    moved:        symmetric differences of objects whose masks moved (IoU < ``mask_iou_same``; above it the
                  difference is wording-to-wording jitter, not evidence);
    moved_whole:  the whole support (both requests) of those objects;
    x0_objects:   whole supports of objects over which the x0 predictions disagree on at least
                  ``x0_object_fraction`` of the support;
    recoloured:   whole supports of objects whose colour moved more than ``appearance_delta`` (CIELAB ΔE76);
    motion:       whole supports of objects whose motion differs (``motion_shift``; empty when it is 0);
    x0:           tokens where the x0 predictions at step k disagree (``x0_threshold`` × median magnitude);
    context:      coarse cells of a changed background (the median object-free cell moved > ``context_delta``);
    objects:      union of the supports of the objects both requests have;
    x0_ratio:     float: per-token |Δx0| / median |x0| (what ``x0`` thresholds).
    """

    new_objects: np.ndarray
    moved: np.ndarray
    moved_whole: np.ndarray
    x0_objects: np.ndarray
    recoloured: np.ndarray
    motion: np.ndarray
    x0: np.ndarray
    context: np.ndarray
    objects: np.ndarray
    x0_ratio: np.ndarray

    def compose(self, config: ReuseConfig, with_x0: bool = True) -> np.ndarray:
        """The region before dilation: new objects, recoloured objects, moved objects (whole with
        ``whole_objects``, else their changed tokens), objects the x0 disagrees over (``whole_objects``), the
        changed background, objects whose motion differs, and (``with_x0``) the tokens where x0 disagrees."""
        A = self.new_objects | self.recoloured | self.context | self.motion
        if config.whole_objects:
            A = A | self.moved_whole | (self.x0_objects if with_x0 else False)
        else:
            A = A | self.moved
        return A | self.x0 if with_x0 else A


def region_terms(target: Signature, cached: Signature, target_x0: np.ndarray, cached_x0: np.ndarray,
                 patch: tuple[int, int, int], config: ReuseConfig, appearance_delta: float = 8.0) -> RegionTerms:
    """Each term of the evidence for the active region (see ``RegionTerms``). Raises ValueError when the token
    grids differ (the entry is from another config)."""
    grid = tuple(target.grid)
    if tuple(cached.grid) != grid:
        raise ValueError(f"token grids differ ({grid} vs {tuple(cached.grid)}): the entry is from another config")
    empty = np.zeros(grid, dtype=bool)
    new_objects, moved, moved_whole = empty.copy(), empty.copy(), empty.copy()
    x0_objects, recoloured, objects, motion = empty.copy(), empty.copy(), empty.copy(), empty.copy()
    motion_tokens = config.motion_shift * max(grid[1], grid[2])
    t = config.mask_threshold
    diff = _token_pool(np.asarray(target_x0, dtype=np.float32) - np.asarray(cached_x0, dtype=np.float32), patch, grid)
    scale = float(np.median(_token_pool(np.asarray(target_x0, dtype=np.float32), patch, grid))) + 1e-6
    x0_differs = diff > config.x0_threshold * scale
    for obj in target.objects:
        other = cached.get(obj.name)
        mt = object_support(obj.mask, t)
        if other is None:
            new_objects |= mt
            continue
        mc = object_support(other.mask, t)
        both = mt | mc
        objects |= both
        # Two wordings of one scene give cross-attention masks that differ by a few tokens at the border
        # (jitter): masks that overlap this much are the same support, not evidence of a change.
        if mask_iou(mt, mc) < config.mask_iou_same and (mt ^ mc).any():
            moved |= mt ^ mc
            moved_whole |= both
        # x0 disagreement is evidence about an object only where it covers a real part of its support: a few
        # noisy tokens must not recompute the whole object.
        if float((x0_differs & both).sum()) >= max(1.0, config.x0_object_fraction * float(both.sum())):
            x0_objects |= both
        if float(np.linalg.norm(np.subtract(obj.lab, other.lab))) > appearance_delta:
            recoloured |= both
        # A changed motion barely moves the early masks (the object has not travelled yet at the probe's noise
        # level), but it already tilts them: the centroid's drift over the clip is evidence where IoU is not.
        if motion_tokens > 0:
            drift = drift_difference(mt, mc)
            if drift is not None and drift > motion_tokens:
                motion |= both
    # The context (non-object) appearance is evidence too when the background changed (the median object-free
    # cell's colour moved): then every coarse cell whose colour changed is recomputed, or the cached background
    # would be kept under the new request's objects. A few cells next to an object change with its blur alone.
    context = empty.copy()
    ct, cc = np.asarray(target.context_lab, np.float32), np.asarray(cached.context_lab, np.float32)
    if ct.shape == cc.shape and ct.ndim == 3:
        delta = np.linalg.norm(ct - cc, axis=-1)
        changed = delta > config.context_delta
        rows = [(i * grid[1]) // ct.shape[0] for i in range(ct.shape[0] + 1)]
        cols = [(j * grid[2]) // ct.shape[1] for j in range(ct.shape[1] + 1)]
        # judged on the cells no object touches in either request (a moved object changes the cells it left)
        touched = np.zeros(grid, bool)
        for obj in list(target.objects) + list(cached.objects):
            touched |= object_support(obj.mask, t)
        free = np.array([[not touched[:, rows[i]:rows[i + 1], cols[j]:cols[j + 1]].any()
                          for j in range(ct.shape[1])] for i in range(ct.shape[0])])
        if free.any() and float(np.median(delta[free])) > config.context_delta:
            for i, j in zip(*np.nonzero(changed)):
                context[:, rows[i]:rows[i + 1], cols[j]:cols[j + 1]] = True
    return RegionTerms(new_objects=new_objects, moved=moved, moved_whole=moved_whole, x0_objects=x0_objects,
                       recoloured=recoloured, motion=motion, x0=x0_differs, context=context, objects=objects,
                       x0_ratio=diff / scale)


def active_region(target: Signature, cached: Signature, target_x0: np.ndarray, cached_x0: np.ndarray,
                  patch: tuple[int, int, int], config: ReuseConfig, appearance_delta: float = 8.0) -> np.ndarray:
    """The evidence-derived active region A: bool [T, H, W] on the token grid.

    Tokens are active where an object's (thresholded) mask differs between the two signatures (unless the masks
    overlap with IoU >= ``config.mask_iou_same``: jitter), where an object's colour differs by more than
    ``appearance_delta`` (CIELAB ΔE76; the whole object is recomputed), or where the x0 predictions at step k
    disagree; with ``config.whole_objects`` a changed mask, a changed colour, or x0 disagreement over at least
    ``config.x0_object_fraction`` of an object's support activates that object's whole support in both
    requests; when the median over the coarse context cells no object touches differs by more than
    ``config.context_delta`` (a changed background), every cell that does is active in every frame; then dilated
    by ``config.dilation`` tokens. Identical signatures and x0 predictions give an empty region, and so do two
    wordings of one scene with the same seed. ``region_terms`` gives each term on its own.
    """
    from scipy.ndimage import binary_dilation

    A = region_terms(target, cached, target_x0, cached_x0, patch, config, appearance_delta).compose(config)
    if config.dilation > 0 and A.any():
        A = binary_dilation(A, iterations=config.dilation)
    return A


def region_of(model: Any, probe: Probe, target_signature: Signature, cached: CachedRun,
              config: ReuseConfig) -> np.ndarray:
    """The active region ``sample`` derives for reusing ``cached`` under ``probe`` (bool [T, H, W] on the token
    grid; see ``active_region``). A region covering more than ``config.max_active`` of the tokens is not reused
    (the sampler continues dense): pair labelling asks here first and skips that dense continuation, whose output
    is the dense result it already has."""
    from .adapters import adapter_for

    return active_region(target_signature, cached.signature, probe.x0_probe.float().numpy(),
                         cached.x0_probe.float().numpy(), adapter_for(model).patch_of(model), config)


def _device_type(model: Any) -> str:
    """The device type the MODEL computes on ("cpu", "cuda", ...)."""
    dev = getattr(model, "load_device", None)
    return str(getattr(dev, "type", dev or "cpu"))


def attention_reuse_dense(structure: BlockStructure | None, layers: tuple[int, ...], n_tokens: int, device_type: str,
                          sparse_kernel: str, dense_above: float = 0.85) -> str:
    """Why attention-only reuse of ``structure`` would compute every attention pair in every middle layer ("" when
    some layer would run the recorded block-sparse tiles over the whole sequence, as ``comfy_patch`` decides per
    layer: recorded density <= ``dense_above``, and with ``sparse_kernel`` "cost" on the CPU the tiles' estimated
    cost < plain attention, ``sparse_attention.block_cost_ratio``)."""
    from .sparse_attention import block_cost_ratio, keep_for_layer

    if structure is None:
        return "the entry has no recorded block structure"
    used = [la for la in layers if la in structure.layers]
    if not used:
        return "no middle layer was recorded"
    for la in used:
        keep = keep_for_layer(structure, la)
        if float(keep.float().mean()) > dense_above:
            continue
        if sparse_kernel == "cost" and device_type == "cpu" and block_cost_ratio(keep, n_tokens,
                                                                                  structure.block_size) >= 1.0:
            continue
        return ""
    return (f"no recorded layer's block-sparse tiles are applied at {n_tokens} tokens on {device_type}: densities "
            f"above {dense_above:g} or tiles estimated dearer than plain attention")


def certified_settings(config: ReuseConfig, decision: Decision | None) -> ReuseConfig:
    """The settings a sampler set to follow its rule runs with: the reuse settings the accepted decision's rule
    was certified with (``Decision.reuse_config``) when it records them and this version can build them, else
    ``config``. ``config.mode`` "dense" (never reuse) is kept whatever the rule says."""
    if config.mode == "dense" or decision is None or not decision.accepted or not decision.reuse_config:
        return config
    return ReuseConfig.from_meta(decision.reuse_config) or config


def mask_displacement(mask: np.ndarray) -> np.ndarray | None:
    """How far a thresholded object mask (bool [T, H, W]) drifts over the clip: the (row, column) centroid of its
    last non-empty frame minus that of its first, in tokens, scaled to the whole clip when the end frames are
    empty. None when fewer than two frames hold the object (no drift can be read)."""
    m = np.asarray(mask, dtype=np.float32)
    mass = m.sum(axis=(1, 2))
    frames = np.flatnonzero(mass > 0)
    if m.ndim != 3 or len(frames) < 2:
        return None
    rows = np.arange(m.shape[1], dtype=np.float32)
    cols = np.arange(m.shape[2], dtype=np.float32)

    def centroid(t: int) -> np.ndarray:
        return np.array([(m[t].sum(1) * rows).sum(), (m[t].sum(0) * cols).sum()]) / mass[t]

    first, last = int(frames[0]), int(frames[-1])
    return (centroid(last) - centroid(first)) * (m.shape[0] - 1) / (last - first)


def object_support(mask: np.ndarray, threshold: float) -> np.ndarray:
    """An object's support: its (soft) mask thresholded at ``threshold`` × its own peak."""
    return mask >= threshold * max(float(mask.max()), 1e-8)


def drift_difference(a: np.ndarray, b: np.ndarray) -> float | None:
    """How differently two supports (bool [T, H, W]) drift over the clip, in tokens (``mask_displacement``);
    None when either drift cannot be read."""
    da, db = mask_displacement(a), mask_displacement(b)
    return None if da is None or db is None else float(np.linalg.norm(da - db))


def mask_iou(a: np.ndarray, b: np.ndarray) -> float:
    """IoU of two boolean masks (1.0 when both are empty)."""
    union = int(np.logical_or(a, b).sum())
    return 1.0 if union == 0 else float(np.logical_and(a, b).sum()) / union


def auto_block_size(n_tokens: int) -> int:
    """About 16 blocks per sequence, a power of two between 16 and 128 tokens (128 at Wan 480p scale)."""
    target = max(16, min(128, n_tokens // 16))
    return 1 << (target.bit_length() - 1)


def record_plan_steps(steps: int, probe_steps: int, n: int) -> tuple[int, ...]:
    """Representative call indices (after the probe) at which dense runs record their block structure."""
    if n <= 0 or steps <= probe_steps:
        return ()
    return tuple(sorted({int(round(x)) for x in np.linspace(probe_steps, steps - 1, n)}))


def refresh_fractions(text: str) -> tuple[float, ...]:
    """``ReuseConfig.refresh_at`` -> its fractions (strictly increasing, each in (0, 1)); "" -> (). Raises
    ValueError saying what is wrong and what is expected."""
    if not text.strip():
        return ()
    try:
        places = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"refresh_at must be comma-separated fractions of the calls after the probe, e.g. "
                         f"'0.6,0.9', got {text!r}") from None
    if not all(0.0 < f < 1.0 for f in places) or any(b <= a for a, b in zip(places, places[1:])):
        raise ValueError(f"refresh_at fractions must lie in (0, 1) and increase (the first record is the first "
                         f"call after the probe, fraction 0), got {text!r}")
    return places


def refresh_plan_calls(steps: int, probe_steps: int, refreshes: int, probe_record: bool = False,
                       at: str = "") -> frozenset:
    """Model-call indices computed densely to refresh the recorded keys/values: ``refreshes`` records over the
    calls after the probe, the first of them always (it records what the others reuse) — unless ``probe_record``:
    the probe's last call already recorded it, and the first is not a dense call. The records after the first are
    spread evenly, or, with ``at`` (``ReuseConfig.refresh_at``), placed at those fractions of the calls after the
    probe (rounded; never on the first record's call nor past the last call)."""
    n = steps - probe_steps
    if n <= 0:
        return frozenset()
    places = refresh_fractions(at)
    if places:
        later = {probe_steps + min(n - 1, max(1, int(round(f * n)))) for f in places} if n > 1 else set()
        calls = frozenset({probe_steps} | later)
    else:
        k = max(1, min(int(refreshes), n))
        calls = frozenset(probe_steps + (j * n) // k for j in range(k))
    return calls - {probe_steps} if probe_record else calls


def stage_role(gen: GenConfig, stage: Stage | None) -> str:
    """Which stage of the probe's schedule a sampler with KSamplerAdvanced settings ``stage`` runs: "" (the whole
    schedule, or None: the probe's own stage), "first" (the probe's stage of a split schedule) or "second" (the
    rest of the schedule after a probe's stage that returned leftover noise). Raises ValueError for anything else,
    naming the stages that fit."""
    own = gen.probe_stage()
    if stage is None:
        return "first" if gen.split else ""
    try:
        start, end = stage.bounds(gen.steps)
    except ValueError as e:
        raise ValueError(f"sampler: {e}") from None
    mine = (start, end, bool(stage.add_noise), stage.leaves_noise(gen.steps))
    if mine == (gen.start_step, gen.stage_end, gen.add_noise, gen.leftover_noise):
        return "first" if gen.split else ""
    fits = (f"the probe's stage: start_at_step={own.start_at_step}, end_at_step={own.end_at_step}, add_noise="
            f"{'enable' if own.add_noise else 'disable'}, return_with_leftover_noise="
            f"{'enable' if own.return_with_leftover_noise else 'disable'}")
    if gen.leftover_noise:
        fits += (f"; or the rest of the schedule on the second model: start_at_step={gen.stage_end}, end_at_step="
                 f">= {gen.steps}, add_noise=disable")
        if start == gen.stage_end and end == gen.steps and not stage.add_noise:
            return "second"
    raise ValueError(f"the sampler's stage (steps [{start}, {end}) of {gen.steps}, add_noise="
                     f"{'enable' if stage.add_noise else 'disable'}) is not one the probe can resume; use {fits}")


def sample(model: Any, positive, negative, latent: dict, probe: Probe, decision: Decision | None,
           cached: CachedRun | None, config: ReuseConfig = ReuseConfig(), target_signature: Signature | None = None,
           record: bool = True, progress: Callable[[int], None] | None = None,
           upstream_ms: Mapping[str, float] | None = None, stage: Stage | None = None) -> tuple[Any, RunReport]:
    """Finish the request the probe started. Returns (LATENT samples tensor, RunReport).

    Reuse happens only when ``decision.accepted`` and ``cached`` is given and the mode is not "dense";
    otherwise this is a plain dense resume (bit-identical to KSampler) that records the block structure
    (``record``) for the Cache Writer.

    ``stage`` (KSamplerAdvanced's start/end steps and switches; None = the probe's stage) selects what runs, see
    ``stage_role``: the probe's stage (its k calls replayed; on a split schedule it returns what KSamplerAdvanced
    returns for that stage, leftover noise included), or, after a probe's stage that returned leftover noise, the
    rest of the schedule on the second model (``latent`` = the first stage's output; no replay; the MODEL must be
    the one the probe fingerprinted as ``second_model``). Dense, either stage equals its KSamplerAdvanced node bit
    for bit. On a hit both stages reuse the accepted entry's final latent outside the active region (so a hit's
    second stage finishes on the cached run's trajectory too); its recorded block structure, recorded at the
    second stage's steps, is applied in the second stage only (joint/attention mode).
    """
    import torch

    from . import comfy_patch as cp
    from .adapters import adapter_for
    from .sparse_attention import BlockRecorder

    config.validate()
    t0 = time.perf_counter()
    adapter = adapter_for(model)
    gen = probe.config
    samples = cp.prepare_latent(model, latent)
    if tuple(samples.shape[1:]) != tuple(gen.latent_shape):
        raise ValueError(f"latent shape {tuple(samples.shape[1:])} differs from the probed one "
                         f"{tuple(gen.latent_shape)}: connect the same latent to the probe and the sampler")
    role = stage_role(gen, stage)
    fp = cp.model_fingerprint(model, adapter.arch)
    if role == "second":
        if fp != gen.second_model:
            raise ValueError("the MODEL differs from the probe's second_model (weights or patches changed): connect "
                             "the model that finishes the schedule (Wan 2.2 14B: the low-noise expert) to both the "
                             "Early Probe's second_model and this sampler")
    elif fp != probe.model_fingerprint:
        raise ValueError("the MODEL differs from the one the probe ran on (weights or patches changed): connect "
                         "the same MODEL to the Early Probe and the Joint Reuse Sampler")
    # This run's calls: the probe's stage (its first k calls replayed) or the rest of the schedule (none replayed).
    if role == "second":
        n_calls, k_replay, replay = gen.steps - gen.stage_end, 0, ()
    else:
        n_calls, k_replay, replay = gen.stage_end - gen.start_step, gen.probe_steps, probe.replay
    run_stage = gen.probe_stage() if role == "first" else (
        Stage(gen.stage_end, STAGE_END_MAX, False, False) if role == "second" else None)
    n_layers = adapter.num_layers(model)
    mids = adapter.middle_layers(model, config.first_dense, config.last_dense)
    # An accepted decision may have made the first stage of a split schedule a reuse even where this stage runs
    # dense (mode "dense", its entry vanished, the region gate): then the first stage's output is no dense result.
    accepted = bool(decision is not None and decision.accepted)
    use = bool(accepted and cached is not None and config.mode != "dense")
    plan = None
    recorder = None
    active_fraction = 1.0
    reason = ""
    if use and decision.reuse_config is not None:
        # The certificate bounds the risk of reuse as it ran in the labelling: other settings are not certified.
        diffs = config.differences(decision.reuse_config)
        if diffs:
            use = False
            reason = ("the sampler's reuse settings differ from those the risk rule was certified with ("
                      + "; ".join(diffs) + "): continued dense. Use the rule's settings or calibrate a rule for these")
        elif config.probe_context and config.kv_context and role != "second" and not probe.context_kv \
                and probe.context_kv_mb < RULE_CONTEXT_KV_MB:
            # Certified: the probe's keys/values as the first context where they fit in RULE_CONTEXT_KV_MB, a dense
            # refresh only where they do not. A probe that was not allowed to keep them would run the other path.
            use = False
            reason = (f"the risk rule was certified with the Early Probe's keys/values as a hit's first context, and "
                      f"this probe kept none (context_kv_mb {probe.context_kv_mb:g} < {RULE_CONTEXT_KV_MB:g}): "
                      f"continued dense. Set the Early Probe's context_kv_mb to {RULE_CONTEXT_KV_MB:g} or more")
    if use:
        if decision.candidate is not None and decision.candidate.entry_id != cached.entry_id:
            raise ValueError(f"the loaded entry {cached.entry_id} is not the accepted candidate "
                             f"{decision.candidate.entry_id}")
        tsig = target_signature
        if tsig is None:
            raise ValueError("joint/latent reuse needs the target's signature (connect the Signature Builder)")
        structure = cached.structure if config.mode in ("joint", "attention") else None
        if config.mode in ("joint", "attention") and structure is None:
            reason = "entry has no recorded block structure: attention stays dense"
        elif structure is not None and role == "first" and gen.leftover_noise:
            # A split schedule's entry is written from its second stage, so its structure was recorded at the
            # second model's (low-noise) steps; the first stage's high-noise attention is not that sparse (applied
            # there it cost 0.6-2.9 dB PSNR vs dense on the embedded model): this stage attends densely.
            structure = None
            reason = "the entry's block structure is the second stage's: attention in this stage stays dense"
        if config.mode == "attention":
            token_mask = None
            active = torch.arange(int(np.prod(probe.grid)))
            why = attention_reuse_dense(structure, mids, int(np.prod(probe.grid)), _device_type(model),
                                        config.sparse_kernel)
            if why:
                # Attention-only reuse computes every token; where no layer's recorded structure is applied either,
                # it is a dense run (bit-identical to KSampler, a little slower): served and reported as a miss,
                # recording the block structure as any miss does.
                use = False
                reason = f"attention reuse would compute every token and every attention pair ({why}): continued dense"
        else:
            A = region_of(model, probe, tsig, cached, config)
            active_fraction = float(A.mean())
            token_mask = torch.from_numpy(A.astype(np.float32))
            active = torch.from_numpy(np.flatnonzero(A.reshape(-1))).long()
            if active_fraction > config.max_active:
                use = False
                reason = (f"region covers {active_fraction:.0%} of the tokens (> max_active {config.max_active:.0%}): "
                          f"reuse would cost about a dense run; continued dense")
    if use:
        context = None
        if config.mode in ("latent", "joint") and token_mask is not None:
            from scipy.ndimage import binary_dilation

            A3 = token_mask.numpy() > 0
            if config.context_margin_blocks > 0 and A3.any():
                A3 = binary_dilation(A3, iterations=config.context_margin_blocks)
            context = torch.from_numpy(np.flatnonzero(A3.reshape(-1))).long()
        # The probe's last-call keys/values stand for the first refresh: same model and batch (not in a split
        # schedule's second stage, which runs another model).
        initial_kv = probe.context_kv if (config.kv_context and config.probe_context and role != "second"
                                          and probe.context_kv) else None
        final = cached.final_latent if cached.final_latent.ndim == 5 else cached.final_latent.unsqueeze(0)
        cached_x0 = cp.process_latent_in(model, final[:1].float())[0]
        plan = cp.ReusePlan(active_tokens=active, token_mask=token_mask, cached_x0=cached_x0, noise=None,
                            sparse_layers=mids, structure=structure,
                            restrict_tokens=config.mode in ("joint", "latent"),
                            context_margin_blocks=config.context_margin_blocks,
                            block_size=config.block_size or auto_block_size(int(np.prod(probe.grid))),
                            context_tokens=context, kv_context=config.kv_context,
                            refresh_calls=refresh_plan_calls(n_calls, k_replay, config.refreshes,
                                                             probe_record=initial_kv is not None,
                                                             at=config.refresh_at),
                            initial_kv=initial_kv, sparse_kernel=config.sparse_kernel)
    if not use and record:
        n_tokens = int(np.prod(probe.grid))
        recorder = BlockRecorder(block_size=config.block_size or auto_block_size(n_tokens), layers=mids,
                                 steps=record_plan_steps(n_calls, k_replay, config.record_steps),
                                 mass=config.record_mass, head_average=False)
    offset = gen.stage_end if role == "second" else gen.start_step
    step_progress = (lambda i: progress(offset + i)) if progress is not None else None
    res = cp.resume_sample(model, positive, negative, latent, probe.seed, gen.steps, gen.cfg, gen.sampler,
                           gen.scheduler, replay, reuse=plan, recorder=recorder, progress=step_progress,
                           stage=run_stage)
    st = res.stats
    sampler_ms = (time.perf_counter() - t0) * 1000
    timings = dict(upstream_ms or {})
    timings["probe"] = float(probe.timings.get("probe_ms", 0.0)) if role != "second" else 0.0
    timings["resume"] = sampler_ms
    if recorder is not None:
        timings["record"] = st["record_s"] * 1000
    timings["total"] = sum(v for k, v in timings.items() if k != "total")
    dense_tokens = st["token_layer_dense"] or 1
    dense_pairs = st["attn_pairs_dense"] or 1
    # Estimated compute relative to a dense run: the probe's k calls were paid in full; each later model call
    # pays its outer layers densely and its middle layers at the measured token fraction.
    token_fraction = (st["token_layer_evals"] / dense_tokens) if st["token_layer_dense"] else 1.0
    per_call = (n_layers - len(mids) + len(mids) * token_fraction) / max(n_layers, 1)
    compute_fraction = (k_replay + st["model_calls"] * per_call) / max(n_calls, 1)
    if use and plan.token_mask is None and token_fraction >= 1.0 and st["attn_pairs"] >= st["attn_pairs_dense"]:
        # Every token and every attention pair was computed and no latent kept (attention-only reuse where no layer
        # ran the recorded structure): the output is the dense one, and it is no hit.
        use = False
        reason = ("attention reuse computed every token and every attention pair (no layer's recorded structure was "
                  "applied): a dense run, reported as a miss")
    report = RunReport(
        decision="hit" if use else ("miss" if decision is not None else "dense"),
        mode=config.mode if use else "dense", entry_id=cached.entry_id if use else None,
        active_fraction=active_fraction,
        block_density=(plan.structure.density if plan is not None and plan.structure is not None else None),
        steps_total=n_calls, steps_probe=k_replay, model_calls=st["model_calls"],
        replayed_calls=st["replayed_calls"], skipped_calls=st["skipped_calls"],
        token_fraction=token_fraction, compute_fraction=compute_fraction,
        attention_fraction=(st["attn_pairs"] / dense_pairs) if st["attn_pairs_dense"] else 1.0,
        timings_ms=timings, block_structure=res.structure, fallbacks=res.fallbacks,
        reason=reason or (decision.summary if decision is not None and not use else ""),
        stage=role, final=not (role == "first" and gen.leftover_noise),
        first_stage_latent=samples.detach().cpu() if role == "second" and not accepted else None,
    )
    return res.samples, report
