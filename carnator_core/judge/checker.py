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
import math
from typing import Any, Callable, Mapping, Sequence

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
    A request's ``extra["scene"]`` (an ``embedded.world.Scene``) replaces parsing its prompt.
    """

    name = CHECKER_JUDGE

    def __init__(self, artifact_ratio: float | None = None, *, strict: bool = False,
                 detail: Callable[[Any, Any, str], Sequence[str]] | None = None):
        if artifact_ratio is not None and not (math.isfinite(artifact_ratio) and artifact_ratio > 0):
            raise ValueError(f"artifact_ratio must be a positive number or None, got {artifact_ratio!r}")
        self.artifact_ratio = artifact_ratio or None
        self.strict, self.detail = bool(strict), detail
        self.settings: Mapping[str, Any] = {"artifact_ratio": self.artifact_ratio, "strict": self.strict,
                                            "detail": detail is not None}

    def _check(self, clip: Any, request: JudgeRequest) -> Any:
        from ..embedded import checker

        kw = {"strict": True} if self.strict else {}
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
        background = pixels.background_mask(dense_clip, request.extra.get("scene") or request.prompt)
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
