"""Per-request quality and safety measures for the serving benchmark, and their summary per method.

Definitions (used by scripts/bench_table1.py and stated in BENCHMARKS.md):

* **checker pass**: ``embedded.checker.check(clip, caption).all_ok`` — every named object found with the named
  colour, size, position and motion, and the named background.
* **PSNR / SSIM vs dense**: between the decoded clip of a method and the decoded clip of the dense method for
  the same request (RGB in [0, 1], data range 1; SSIM per frame with a 7-pixel window, averaged over frames).
  Identical clips have PSNR = inf; summaries report PSNR over cache hits (misses of a cross-request method are
  the dense result itself: the probe + dense resume is bit-identical to KSampler, which the benchmark verifies).
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

GATED = ("colour", "size", "position", "motion")


def as_clip(x: Any) -> np.ndarray:
    """A clip [T, H, W, 3] float32 in [0, 1] from a numpy array or torch tensor (clamped)."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().float().numpy()
    a = np.asarray(x, dtype=np.float32)
    if a.ndim != 4 or a.shape[-1] != 3:
        raise ValueError(f"expected a clip [T, H, W, 3], got shape {a.shape}")
    return np.clip(a, 0.0, 1.0)


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
    discrepancies: Optional[dict[str, float]] = None
    summary: str = ""

    @property
    def hit(self) -> bool:
        return self.decision == "hit"

    def to_json(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        for k in ("psnr",):
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
        "unsafe": unsafe,
        "unsafe_rate": unsafe / len(hits) if hits else 0.0,
        "unsafe_of_all": unsafe / n if n else math.nan,
        "miss_identical": sum(1 for r in records if not r.hit and r.identical_to_dense),
        "misses": sum(1 for r in records if not r.hit),
        "by_kind": _by_kind(records),
    }


def _by_kind(records: Sequence[RequestRecord]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for r in records:
        d = out.setdefault(r.kind, {"n": 0, "hits": 0, "unsafe": 0})
        d["n"] += 1
        d["hits"] += int(r.hit)
        d["unsafe"] += int(r.unsafe)
    return dict(sorted(out.items()))


__all__ = ["GATED", "RequestRecord", "as_clip", "attribute_verdicts", "psnr", "regressions", "ssim", "summarize"]
