"""Per-request quality and safety measures for the serving benchmark, and their summary per method.

Definitions (used by scripts/bench/bench_table1.py and stated in BENCHMARKS.md):

* **checker pass**: ``embedded.checker.check(clip, caption).all_ok`` — every named object found with the named
  colour, size, position and motion, and the named background.
* **PSNR / SSIM vs dense**: between the decoded clip of a method and the decoded clip of the dense method for
  the same request (RGB in [0, 1], data range 1; SSIM per frame with a 7-pixel window, averaged over frames).
  Identical clips have PSNR = inf; summaries report PSNR over cache hits (misses of a cross-request method are
  the dense result itself: the probe + dense resume is bit-identical to KSampler, which the benchmark verifies).
* **background** (what should be unchanged): pixels farther than ``BACKGROUND_MARGIN`` pixels from every named
  object as the checker segments them in the *dense* clip of the same request (:func:`background_mask`).
  PSNR / SSIM over the background (``psnr_bg`` / ``ssim_bg``: SSIM map averaged over background pixels).
* **off fraction**: share of pixels whose largest channel difference from the dense clip exceeds 0.25.
* **artifact score** (no reference): high-frequency energy of the background, ``1000 * mean ||x - box3(x)||^2``
  over background pixels (box3 = 3x3 spatial mean per frame, RGB summed; :func:`artifact_score`). Reuse
  artifacts (rows of short dashes, seams at the region border) raise it; it is judged against the spread of
  dense clips of the same prompt across seeds (the model's own texture), e.g. 3.6 for a dense clip of the
  embedded model and 6.5 for a hit with the artifacts. A hit's excess over its dense clip is split
  (:func:`artifact_split`) into the pixels it kept from the reused clip (another request's dense texture) and
  the pixels it recomputed (what reuse itself drew).
* **unsafe** (docs/CALIBRATION.md, section 2): a cache hit whose output *fails* the checker on an attribute
  (per object: found, colour, size, position, motion; plus background) where the dense output of the same request
  *passes*. Failures the dense output shares are the model's, not the reuse's. The unsafe rate is unsafe hits /
  hits (the quantity the risk certificate bounds).

Contract: pure numpy / scikit-image / the embedded checker (no torch needed beyond array conversion, no ComfyUI).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np

from ..embedded import checker
from ..judge import checker as _checker_judge, pixels

GATED = ("colour", "size", "position", "motion")


as_clip = pixels.as_clip


def psnr(a: Any, b: Any) -> float:
    """PSNR in dB of two clips with data range 1 (inf for identical clips)."""
    x, y = as_clip(a).astype(np.float64), as_clip(b).astype(np.float64)
    mse = float(np.mean((x - y) ** 2))
    return math.inf if mse == 0.0 else 10.0 * math.log10(1.0 / mse)


def ssim(a: Any, b: Any) -> float:
    """Mean per-frame SSIM (scikit-image, RGB, data range 1, 7-pixel window) of two clips."""
    from skimage.metrics import structural_similarity

    x, y = as_clip(a), as_clip(b)
    if x.shape != y.shape:
        raise ValueError(f"clips differ in shape: {x.shape} vs {y.shape}")
    win = min(7, x.shape[1], x.shape[2])
    win -= (win + 1) % 2  # odd
    return float(np.mean([structural_similarity(f, g, channel_axis=-1, data_range=1.0, win_size=win)
                          for f, g in zip(x, y)]))


# Shared with the runtime judges (carnator_core/judge/pixels.py), so the lab's labels and theirs measure alike.
BACKGROUND_MARGIN = pixels.BACKGROUND_MARGIN
background_mask = pixels.background_mask
artifact_score = pixels.artifact_score
_hf_energy = pixels.hf_energy


# The second label's detail check (blur, object interiors, ghosts) is the runtime judge's own
# (carnator_core/judge/checker.py), so learning mode labels with the same definition the lab certifies with.
BLUR_RATIO = _checker_judge.BLUR_RATIO
INTERIOR_RATIO = _checker_judge.INTERIOR_RATIO
INTERIOR_SLACK = _checker_judge.INTERIOR_SLACK
GHOST_PX = _checker_judge.GHOST_PX
GHOST_MARGIN = _checker_judge.GHOST_MARGIN
object_detail = _checker_judge.object_detail
detail_verdict = _checker_judge.detail_verdict


KEPT_TOLERANCE = 0.02  # largest channel difference at which a hit's pixel counts as the reused clip's own


def artifact_split(hit_clip: Any, dense_clip: Any, source_clip: Any, mask: np.ndarray,
                   tol: float = KEPT_TOLERANCE) -> dict[str, float]:
    """Where a hit's background artifact score differs from its dense clip's: on the pixels it kept from the
    reused clip, or on the pixels its own computation produced.

    A hit hands back the reused (source) clip outside its recomputed region, so part of its background texture
    is a dense clip of *another* request — inherited, not made by reuse. ``kept`` = ``mask`` pixels whose 3x3
    neighbourhood equals ``source_clip`` within ``tol`` (largest channel difference), so their energy is the
    reused clip's; ``recomputed`` = the other ``mask`` pixels.
    Returns ``source`` (the reused clip's score over ``mask``), ``kept_share`` (of the mask's pixels), and the
    excess over the dense clip split into ``excess_kept`` + ``excess_recomputed`` (same units as
    :func:`artifact_score`; they sum to ``artifact_score(hit) - artifact_score(dense)`` over ``mask``).
    NaN everywhere for an empty mask."""
    h, d, s = as_clip(hit_clip), as_clip(dense_clip), as_clip(source_clip)
    if not (h.shape == d.shape == s.shape):
        raise ValueError(f"clips differ in shape: hit {h.shape}, dense {d.shape}, source {s.shape}")
    m = np.asarray(mask, bool)
    if m.shape != h.shape[:3]:
        raise ValueError(f"mask shape {m.shape} does not match the clips' {h.shape[:3]}")
    n = int(m.sum())
    if n == 0:
        return {k: math.nan for k in ("source", "kept_share", "excess_kept", "excess_recomputed")}
    from scipy import ndimage

    # A pixel's energy depends on its 3x3 neighbourhood: it is the reused clip's own only where that whole
    # neighbourhood was kept (a recomputed pixel raises its kept neighbours' energy too; that is the reuse's).
    same = np.abs(h - s).max(-1) <= tol
    kept = m & ndimage.minimum_filter(same, size=(1, 3, 3), mode="nearest")
    rec = m & ~kept
    excess = _hf_energy(h) - _hf_energy(d)
    return {"source": artifact_score(s, m), "kept_share": float(kept.sum() / n),
            "excess_kept": float(excess[kept].sum() / n * 1000.0),
            "excess_recomputed": float(excess[rec].sum() / n * 1000.0)}


def token_grid_ratio(clips: Any, cell: int = 4) -> float:
    """How much a model's output steps at its token boundaries: the mean absolute difference between neighbouring
    pixels that straddle a ``cell``-pixel token boundary, divided by that between neighbours inside a token,
    averaged over rows and columns (and over a batch ``[N, T, H, W, 3]`` or one clip ``[T, H, W, 3]``). About 1 for
    a picture with no grid; the per-token block noise of an undertrained embedded model reads 1.8–2.7 (v2 shipped
    1.2). The embedded models' tokens are 4 x 4 pixels (patch 2 x 2 latent cells of 2 x 2 pixels)."""
    x = np.asarray(clips, dtype=np.float64)
    if x.ndim == 4:
        x = x[None]
    if x.ndim != 5 or x.shape[2] <= cell or x.shape[3] <= cell:
        raise ValueError(f"token_grid_ratio needs clips [N, T, H, W, C] larger than one {cell}-pixel cell, got "
                         f"shape {x.shape}")

    def ratio(d: np.ndarray) -> float:
        j = np.arange(1, len(d) + 1)
        inside = d[j % cell != 0].mean()
        return float(d[j % cell == 0].mean() / inside) if inside > 0 else math.nan

    across_columns = np.abs(np.diff(x, axis=3)).mean(axis=(0, 1, 2, 4))
    across_rows = np.abs(np.diff(x, axis=2)).mean(axis=(0, 1, 3, 4))
    return 0.5 * (ratio(across_columns) + ratio(across_rows))


def _masked_psnr(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> float:
    d = (a.astype(np.float64) - b.astype(np.float64))[mask]
    if d.size == 0:
        return math.nan
    mse = float(np.mean(d ** 2))
    return math.inf if mse == 0.0 else 10.0 * math.log10(1.0 / mse)


def _masked_ssim(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> float:
    from skimage.metrics import structural_similarity

    win = min(7, a.shape[1], a.shape[2])
    win -= (win + 1) % 2
    vals = []
    for f, g, m in zip(a, b, mask):
        if not m.any():
            continue
        _, smap = structural_similarity(f, g, channel_axis=-1, data_range=1.0, win_size=win, full=True)
        vals.append(float(smap.mean(-1)[m].mean()))
    return float(np.mean(vals)) if vals else math.nan


def clip_quality(clip: Any, dense_clip: Any, background: Optional[np.ndarray] = None) -> dict[str, float]:
    """Full-reference and no-reference quality of a (reuse) clip against the dense clip of the same request and
    seed: psnr, ssim over the clip; psnr_bg, ssim_bg over ``background`` (see :func:`background_mask`; the
    whole clip when None); off_frac; artifact (score of ``clip``) and artifact_dense (of ``dense_clip``)."""
    x, y = as_clip(clip), as_clip(dense_clip)
    if x.shape != y.shape:
        raise ValueError(f"clips differ in shape: {x.shape} vs {y.shape}")
    bg = np.ones(x.shape[:3], bool) if background is None else np.asarray(background, bool)
    return {
        "psnr": psnr(x, y), "ssim": ssim(x, y),
        "psnr_bg": _masked_psnr(x, y, bg), "ssim_bg": _masked_ssim(x, y, bg),
        "off_frac": float((np.abs(x - y).max(-1) > 0.25).mean()),
        "artifact": artifact_score(x, bg), "artifact_dense": artifact_score(y, bg),
    }


def attribute_verdicts(result: checker.CheckResult) -> dict[str, bool]:
    """Flat {"obj0.found": True, "obj0.colour": False, ..., "background": True} of a checker result; attributes
    the caption does not name are left out."""
    out: dict[str, bool] = {}
    for i, o in enumerate(result.objects):
        out[f"obj{i}.found"] = bool(o.found)
        for attr in GATED:
            v = getattr(o, f"{attr}_ok")
            if v is not None:
                out[f"obj{i}.{attr}"] = bool(v)
    if result.background_ok is not None:
        out["background"] = bool(result.background_ok)
    return out


def regressions(reuse: Mapping[str, bool], dense: Mapping[str, bool]) -> list[str]:
    """Attributes the dense output passes and the reuse output fails (the unsafe evidence)."""
    return sorted(k for k, ok in dense.items() if ok and not reuse.get(k, False))


@dataclass
class RequestRecord:
    """What the benchmark records for one (request, method)."""

    rid: str
    kind: str
    method: str
    latency_s: float
    decision: str  # "hit" | "miss" | "dense"
    entry_id: Optional[str] = None
    candidate_prompt: Optional[str] = None
    similarity: Optional[float] = None
    active_fraction: Optional[float] = None
    compute_fraction: Optional[float] = None
    timings_ms: dict[str, float] = field(default_factory=dict)
    checker_pass: bool = False
    attributes: dict[str, bool] = field(default_factory=dict)
    psnr: Optional[float] = None
    ssim: Optional[float] = None
    regressions: list[str] = field(default_factory=list)
    unsafe: bool = False
    identical_to_dense: Optional[bool] = None
    psnr_bg: Optional[float] = None
    ssim_bg: Optional[float] = None
    off_frac: Optional[float] = None
    artifact: Optional[float] = None
    artifact_dense: Optional[float] = None
    artifact_ref: Optional[list[float]] = None  # artifact scores of dense clips of the same prompt, other seeds
    # A hit's score against its inputs (artifact_split): the reused clip's own score over the same background,
    # the share of the background kept from it, and the excess over the dense clip on kept / recomputed pixels.
    artifact_source: Optional[float] = None
    kept_share: Optional[float] = None
    excess_kept: Optional[float] = None
    excess_recomputed: Optional[float] = None
    discrepancies: Optional[dict[str, float]] = None
    summary: str = ""

    @property
    def hit(self) -> bool:
        return self.decision == "hit"

    def to_json(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        for k in ("psnr", "psnr_bg"):
            if d[k] is not None and math.isinf(d[k]):
                d[k] = "inf"
        return d


def _mean(xs: Iterable[float]) -> float:
    v = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return float(np.mean(v)) if v else math.nan


def summarize(records: Sequence[RequestRecord], dense: Sequence[RequestRecord]) -> dict[str, Any]:
    """Table-1 metrics of one method's records against the dense method's records (same requests).

    hit_rate; mean_latency_s (all requests); hit_latency_s (mean over this method's hits); dense_latency_on_hits_s
    (dense mean over the same requests); speedup (dense mean / method mean, all requests); hit_speedup
    (dense_latency_on_hits_s / hit_latency_s); checker_pass; psnr_hits (mean over hits, inf excluded and counted);
    psnr_all (mean over every request with a finite PSNR: for methods without a cache);
    ssim (mean over all requests); unsafe_rate (unsafe hits / hits); unsafe_of_all (unsafe / requests).
    """
    by_rid = {r.rid: r for r in dense}
    n = len(records)
    hits = [r for r in records if r.hit]
    dense_mean = _mean(by_rid[r.rid].latency_s for r in records)
    mean = _mean(r.latency_s for r in records)
    hit_lat = _mean(r.latency_s for r in hits)
    dense_on_hits = _mean(by_rid[r.rid].latency_s for r in hits)
    finite_psnr = [r.psnr for r in hits if r.psnr is not None and math.isfinite(r.psnr)]
    unsafe = sum(r.unsafe for r in hits)
    return {
        "requests": n,
        "hits": len(hits),
        "hit_rate": len(hits) / n if n else math.nan,
        "mean_latency_s": mean,
        "hit_latency_s": hit_lat,
        "dense_latency_on_hits_s": dense_on_hits,
        "speedup": dense_mean / mean if mean and not math.isnan(mean) else math.nan,
        "hit_speedup": dense_on_hits / hit_lat if hits else math.nan,
        "checker_pass": _mean(float(r.checker_pass) for r in records),
        "psnr_hits": float(np.mean(finite_psnr)) if finite_psnr else (math.inf if hits else math.nan),
        "psnr_hits_identical": sum(1 for r in hits if r.psnr is not None and math.isinf(r.psnr)),
        "psnr_all": _mean(r.psnr for r in records if r.psnr is not None and math.isfinite(r.psnr)),
        "ssim": _mean(r.ssim for r in records),
        "ssim_hits": _mean(r.ssim for r in hits),
        "psnr_bg_hits": _median(r.psnr_bg for r in hits),
        "ssim_bg_hits": _median(r.ssim_bg for r in hits),
        "artifact_hits": _median(r.artifact for r in hits),
        "artifact_inside_spread": sum(1 for r in hits if artifact_inside_spread(r)),
        "excess_kept_hits": _median(r.excess_kept for r in hits),
        "excess_recomputed_hits": _median(r.excess_recomputed for r in hits),
        "compute_hits_median": _median(r.compute_fraction for r in hits),
        "compute_nonrepeat_hits_median": _median(r.compute_fraction for r in hits if r.kind not in ("exact", "repeat")),
        "unsafe": unsafe,
        "unsafe_rate": unsafe / len(hits) if hits else 0.0,
        "unsafe_of_all": unsafe / n if n else math.nan,
        "miss_identical": sum(1 for r in records if not r.hit and r.identical_to_dense),
        "misses": sum(1 for r in records if not r.hit),
        "by_kind": _by_kind(records),
    }


def artifact_inside_spread(r: RequestRecord) -> Optional[bool]:
    """Whether a hit's artifact score is no higher than the highest of the dense clips of its prompt (its own
    seed's dense clip included); None without the scores."""
    ref = [x for x in (r.artifact_ref or []) + [r.artifact_dense] if x is not None and math.isfinite(x)]
    if r.artifact is None or not ref:
        return None
    return bool(r.artifact <= max(ref))


def _median(xs: Iterable[Optional[float]]) -> float:
    v = [float(x) for x in xs if x is not None and math.isfinite(float(x))]
    return float(np.median(v)) if v else math.nan


def _by_kind(records: Sequence[RequestRecord]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    groups: dict[str, list[RequestRecord]] = {}
    for r in records:
        d = out.setdefault(r.kind, {"n": 0, "hits": 0, "unsafe": 0})
        d["n"] += 1
        d["hits"] += int(r.hit)
        d["unsafe"] += int(r.unsafe)
        if r.hit:
            groups.setdefault(r.kind, []).append(r)
    for kind, hits in groups.items():
        inside = [artifact_inside_spread(r) for r in hits]
        out[kind].update({
            "compute_median": _median(r.compute_fraction for r in hits),
            "psnr_median": _median(r.psnr for r in hits),
            "psnr_bg_median": _median(r.psnr_bg for r in hits),
            "artifact_median": _median(r.artifact for r in hits),
            "artifact_inside_spread": sum(1 for x in inside if x),
            "artifact_judged": sum(1 for x in inside if x is not None),
        })
    return dict(sorted(out.items()))


__all__ = ["BACKGROUND_MARGIN", "BLUR_RATIO", "GATED", "GHOST_PX", "INTERIOR_RATIO", "detail_verdict",
           "object_detail", "RequestRecord", "artifact_inside_spread", "artifact_score", "artifact_split",
           "as_clip", "attribute_verdicts", "background_mask", "clip_quality", "psnr", "regressions", "ssim",
           "summarize"]
