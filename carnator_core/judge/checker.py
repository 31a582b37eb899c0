"""The embedded world's pixel checker as a judge (:class:`CheckerJudge`).

Ground truth exists only in the embedded world: ``embedded.checker.check`` reads a clip's pixels and says per named
object whether what the caption names is there (colour, size, position, motion, and whatever else the checker
gates). This judge reports that verdict through the judge interface, reading the checker's result *generically*:

- an object passes when its ``all_ok`` is true (the checker decides which attributes gate); every attribute field
  ``<attr>_ok`` that is False becomes a reason ("ball: colour orange, expected red"); an object not found is one
  reason ("cube: not found");
- the scene passes when every result-level ``<name>_ok`` field (the background, and any the checker adds) is not
  False; the clip passes when ``CheckResult.all_ok`` does (so a stricter checker makes a stricter judge without a
  change here);
- in :meth:`CheckerJudge.judge_pair` (the excess label) the reuse clip also fails when its background artifact score
  (``pixels.artifact_score`` over the pixels away from every object the checker segments in the *dense* clip)
  exceeds ``artifact_ratio`` x the dense clip's: reuse artifacts (rows of dashes, seams at a region's border) the
  attribute checks cannot see.

Runtime-safe (numpy / scipy, the embedded package; no ComfyUI, no lab). Deterministic.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..objects import _unique_names
from . import pixels
from .base import JudgeBase, JudgeRequest, Verdict

CHECKER_JUDGE = "embedded-checker"


def _ok_fields(obj: Any) -> dict[str, Any]:
    """``{attr: value}`` of every ``<attr>_ok`` field (dataclass field or property) of a checker result object."""
    names = [f.name for f in dataclasses.fields(obj)] if dataclasses.is_dataclass(obj) else []
    out = {}
    for n in names:
        if n.endswith("_ok") and n != "all_ok":
            out[n[:-3]] = getattr(obj, n)
    return out


def verdict_of(result: Any, object_names: tuple[str, ...] = ()) -> Verdict:
    """The :class:`Verdict` of an ``embedded.checker.CheckResult`` (read generically, see the module doc).
    ``object_names`` names the objects (the request's), else the checker's expected shape names."""
    per_object: dict[str, bool] = {}
    reasons: list[str] = []
    scores: dict[str, float] = {}
    shapes = [getattr(o.expected, "shape", None) or "object" for o in result.objects]
    names = list(object_names[:len(shapes)]) + _unique_names(shapes)[len(object_names):]
    for i, (name, o) in enumerate(zip(names, result.objects)):
        ok = bool(o.all_ok)
        per_object[name] = ok
        scores[f"o{i}.found"] = float(bool(o.found))
        if not o.found:
            reasons.append(f"{name}: not found")
            continue
        for attr, v in _ok_fields(o).items():
            if v is None:
                continue
            scores[f"o{i}.{attr}"] = float(bool(v))
            if v is False and not ok:  # a passing object's other readings (e.g. a shape guess) are not failures
                expected = getattr(o.expected, attr, None)
                # what the gating reading saw: the strict checker reads motion from the track
                keys = ((f"track_{attr}",) if getattr(o, "strict", False) else ()) + (attr, f"{attr}_guess")
                seen = next((o.measured[k] for k in keys if k in o.measured), None)
                reasons.append(f"{name}: {attr} {seen}, expected {expected}")
    scene_fields = {k: v for k, v in _ok_fields(result).items() if v is not None}
    for k, v in scene_fields.items():
        scores[k] = float(bool(v))
        if v is False:
            seen = getattr(result, k, None)
            reasons.append(f"scene: {k} {seen if isinstance(seen, str) else 'fails'}")
    scene = all(bool(v) for v in scene_fields.values()) if scene_fields else None
    return Verdict(passed=bool(result.all_ok), per_object=per_object, scene=scene, reasons=tuple(reasons),
                   scores=scores)


class CheckerJudge(JudgeBase):
    """The embedded pixel checker as a judge.

    artifact_ratio: in :meth:`judge_pair`, the reuse clip fails when its background artifact score exceeds this
                    multiple of the dense clip's (None or 0 = no artifact check; the shipped excess label uses the
                    ratio its pairs file states).
    strict:         the checker's strict reading (``check(..., strict=True)``: shape gated, motion from the per-frame
                    track; the second label's).
    detail:         in :meth:`judge_pair`, ``detail(reuse_clip, dense_clip, prompt) -> [failed checks]`` (the second
                    label's detail check — blur, object interiors, ghosts — lives in the lab, which passes it in:
                    ``lab.pairs.embedded_checker_labeler("request", ratio, version=2).as_judge()``).
    checker_version: the checker's reading (``embedded.checker.CHECKER_VERSIONS``; 1, the default, is every label
                    made before version 2 existed). It segments the clips (attributes and the artifact check's
                    background); ``detail`` is called as given, so pass one of the same reading
                    (:func:`detail_failures` with ``version``; :func:`~carnator_core.judge.judge_for` does). A label
                    of another reading is another label: ``settings`` name it (``checker_version``, absent for 1).
    A request's ``extra["scene"]`` (an ``embedded.world.Scene``) replaces parsing its prompt.
    """

    name = CHECKER_JUDGE

    def __init__(self, artifact_ratio: float | None = None, *, strict: bool = False,
                 detail: Callable[[Any, Any, str], Sequence[str]] | None = None, checker_version: int = 1):
        from ..embedded.checker import CHECKER_VERSIONS

        if artifact_ratio is not None and not (math.isfinite(artifact_ratio) and artifact_ratio > 0):
            raise ValueError(f"artifact_ratio must be a positive number or None, got {artifact_ratio!r}")
        if checker_version not in CHECKER_VERSIONS:
            raise ValueError(f"checker_version must be one of {CHECKER_VERSIONS}, got {checker_version!r}")
        self.artifact_ratio = artifact_ratio or None
        self.strict, self.detail = bool(strict), detail
        self.checker_version = int(checker_version)
        settings: dict[str, Any] = {"artifact_ratio": self.artifact_ratio, "strict": self.strict,
                                    "detail": detail is not None}
        if self.checker_version != 1:  # absent = 1: every record written before version 2 reads as what it was
            settings["checker_version"] = self.checker_version
        self.settings: Mapping[str, Any] = settings

    def _check(self, clip: Any, request: JudgeRequest) -> Any:
        from ..embedded import checker

        kw: dict[str, Any] = {"strict": True} if self.strict else {}
        if self.checker_version != 1:
            kw["version"] = self.checker_version
        return checker.check(pixels.as_clip(clip), request.extra.get("scene") or request.prompt, **kw)

    def judge(self, clip: Any, request: JudgeRequest) -> Verdict:
        return verdict_of(self._check(clip, request), tuple(request.objects))

    def judge_pair(self, ref: Any, reuse_clip: Any, dense_clip: Any, request: JudgeRequest) -> Verdict:
        v = self.judge(reuse_clip, request)
        if self.detail is not None:
            failed = list(self.detail(pixels.as_clip(reuse_clip), pixels.as_clip(dense_clip), request.prompt))
            if failed:
                v = Verdict(passed=False, per_object=v.per_object, scene=v.scene,
                            reasons=v.reasons + tuple(f"detail: {f} (against the dense clip)" for f in failed),
                            scores=v.scores)
        if not self.artifact_ratio:
            return v
        background = pixels.background_mask(dense_clip, request.extra.get("scene") or request.prompt,
                                            version=self.checker_version)
        dense_art = pixels.artifact_score(dense_clip, background)
        reuse_art = pixels.artifact_score(reuse_clip, background)
        # Rounded as the pairs files round them, so a label made here equals the one the lab made.
        failed = math.isfinite(reuse_art) and round(reuse_art, 4) > self.artifact_ratio * dense_art
        scores = {**v.scores, "artifact": reuse_art, "artifact_dense": dense_art}
        if not failed:
            return dataclasses.replace(v, scores=scores)
        reason = f"scene: background artifacts {reuse_art:.2f} > {self.artifact_ratio:g} x dense {dense_art:.2f}"
        return Verdict(passed=False, per_object=v.per_object, scene=False, reasons=v.reasons + (reason,),
                       scores=scores)


# --- what the background score cannot see: blur, object interiors, ghosts (the second label) ---------------------
#: A clip *fails* the detail check (:func:`detail_verdict`) when, against the dense clip of the same request:
#: its objects' edges are less than ``BLUR_RATIO`` as sharp, or their interiors carry more than ``INTERIOR_RATIO``
#: x (+ ``INTERIOR_SLACK``) the high-frequency energy, or more than ``GHOST_PX`` more pixels per frame of
#: foreground stand away from every named object. Set on hand-built clips and the development floor (seed 83;
#: BENCHMARKS.md, "The second label"), never on certification data.
BLUR_RATIO = 0.75
INTERIOR_RATIO = 2.0
INTERIOR_SLACK = 1.0
GHOST_PX = 6.0
GHOST_MARGIN = 2  # px around a named object that still count as the object (soft edges, motion blur)


def _gradient(x: np.ndarray) -> np.ndarray:
    """Per-pixel gradient magnitude [T, H, W] of a clip (central differences, largest over the RGB channels)."""
    gy = np.gradient(x, axis=1)
    gx = np.gradient(x, axis=2)
    return np.sqrt(gx * gx + gy * gy).max(-1)


def object_detail(clip: Any, caption_or_scene: Any, *, version: int = 1) -> dict[str, float]:
    """What a viewer sees of the objects themselves, judged on the clip's own segmentation (checker.object_masks of
    the checker's reading ``version``):

    * ``edge``: sharpness — median over frames and objects of the 90th percentile gradient magnitude on the
      object's boundary band (the mask minus its 1-px erosion, grown by 1 px); NaN without an object;
    * ``interior``: high-frequency energy (x1000, as ``pixels.artifact_score``) inside the objects (masks eroded by
      2 px: flat paint in the world; blotches, seams and noise raise it); NaN when no interior is left;
    * ``ghost_px``: mean per frame of foreground pixels (farther than the checker's FG_THRESHOLD from the
      background) more than ``GHOST_MARGIN`` px from every named object's mask — a faint second object, a trail.
    """
    from scipy import ndimage

    from ..embedded import checker, world

    scene = world.parse_caption(caption_or_scene) if isinstance(caption_or_scene, str) else caption_or_scene
    x = pixels.as_clip(clip).astype(np.float64)
    masks, _, bg = checker.object_masks(x, scene, version=version)
    grad = _gradient(x)
    energy = pixels.hf_energy(x)
    edges, inside = [], np.zeros(x.shape[:3], bool)
    for m in masks:
        for t in range(m.shape[0]):
            if m[t].sum() < checker.MIN_AREA:
                continue
            band = ndimage.binary_dilation(m[t] & ~ndimage.binary_erosion(m[t]), iterations=1)
            edges.append(float(np.percentile(grad[t][band], 90)))
            inside[t] |= ndimage.binary_erosion(m[t], iterations=2)
    fg = np.linalg.norm(x - bg, axis=-1) > checker.FG_THRESHOLD
    near = masks.any(0) if len(masks) else np.zeros(fg.shape, bool)
    if near.any():
        near = ndimage.binary_dilation(near, structure=np.ones((1, 2 * GHOST_MARGIN + 1, 2 * GHOST_MARGIN + 1), bool))
    return {"edge": float(np.median(edges)) if edges else math.nan,
            "interior": float(energy[inside].mean() * 1000.0) if inside.any() else math.nan,
            "ghost_px": float((fg & ~near).sum() / fg.shape[0])}


def detail_verdict(clip_detail: Mapping[str, float], dense_detail: Mapping[str, float]) -> list[str]:
    """Which detail checks a clip fails against the dense clip of the same request ([] = none): "blur",
    "interior", "ghost" (thresholds above). A measure that is NaN on either side is not judged (no object found:
    the checker already fails the clip)."""
    out = []
    e, ed = clip_detail.get("edge", math.nan), dense_detail.get("edge", math.nan)
    if math.isfinite(e) and math.isfinite(ed) and ed > 0 and e < BLUR_RATIO * ed:
        out.append("blur")
    i, idn = clip_detail.get("interior", math.nan), dense_detail.get("interior", math.nan)
    if math.isfinite(i) and math.isfinite(idn) and i > INTERIOR_RATIO * idn + INTERIOR_SLACK:
        out.append("interior")
    if clip_detail.get("ghost_px", 0.0) > dense_detail.get("ghost_px", 0.0) + GHOST_PX:
        out.append("ghost")
    return out


def detail_failures(clip: Any, dense_clip: Any, prompt: str, *, version: int = 1) -> list[str]:
    """The second label's detail check of ``clip`` against ``dense_clip`` of the same request ([] = passes), both
    segmented with the checker's reading ``version``."""
    return list(detail_verdict(object_detail(clip, prompt, version=version),
                               object_detail(dense_clip, prompt, version=version)))


def detail_check(version: int = 1) -> Callable[[Any, Any, str], list[str]]:
    """:func:`detail_failures` of the checker's reading ``version`` (what :class:`CheckerJudge` takes as ``detail``)."""
    return detail_failures if version == 1 else functools.partial(detail_failures, version=version)
