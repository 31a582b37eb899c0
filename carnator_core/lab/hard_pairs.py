"""Request/candidate pairs of the kinds where the reuse region cannot repair a wrong candidate, and whether the
signature's axes separate safe from unsafe reuses on them.

Why: on the embedded model the reuse region (``reuse.active_region``) recomputes every object whose mask, colour or
x0 prediction differs, so an ordinary wrong candidate is repaired and the per-object axes of the signature add
nothing measurable. The axes can only earn their place where the region cannot see the difference. From how the
region is computed, those are (the *hard* kinds, :data:`HARD_KINDS`):

* ``motion_reverse`` / ``motion_start`` — the first object's motion reversed (left <-> right, up <-> down) or
  started/stopped (still <-> moving), at the same clip-average position: at the probe's noise level the masks barely
  move (IoU above ``mask_iou_same``) and the shipped reuse settings have no motion term (``motion_shift`` 0).
* ``position_overlap`` — one big object moved between the centre and a corner: the two supports overlap, so the
  masks may stay above ``mask_iou_same``.
* ``touch_colour`` / ``touch_motion`` — two big objects that touch or overlap (which the world's sampler never
  draws), the first recoloured or its motion changed: the dilated region of the edited object cuts through the
  other one.
* ``big_colour`` — two big objects (not touching), the first recoloured: a large region, near ``max_active``.
* ``colour_near`` — the first object recoloured to the nearest palette colour (blue <-> purple is ΔE2000 16):
  the region's recolour term needs ΔE76 > 8 on the probe's blurry x0.
* ``background_near`` — the background changed to the nearest one (grass <-> wall is ΔE2000 24, below the shipped
  context threshold 28.15).

and ordinary kinds as controls (:data:`CONTROL_KINDS`): a colour, position or size edit drawn as the calibration
pairs draw them (``pairs._edit``) and a rewording (same scene, another caption). Lighting is not in this world's
vocabulary (``night`` is a background), so no lighting kind exists.

Every pair keeps the candidate's seed (same-seed pairs: with another seed the x0 predictions disagree everywhere
and the region covers the clip). Pairs are drawn per (seed, kind, index) from their own random stream, so a run of
n pairs per kind is a prefix of a run of more.

Analysis (:func:`separation`): per axis the AUC of the axis value for unsafe (b) against not-unsafe reuses, the
one-sided Mann-Whitney p value of "unsafe pairs have larger values", and what a threshold at the shipped rule's
value rejects. Pure numpy/scipy; imports neither torch nor ComfyUI.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

HARD_KINDS: tuple[str, ...] = ("motion_reverse", "motion_start", "position_overlap", "touch_colour", "touch_motion",
                               "big_colour", "colour_near", "background_near")
CONTROL_KINDS: tuple[str, ...] = ("control_colour", "control_position", "control_size", "control_rewording")
KINDS: tuple[str, ...] = HARD_KINDS + CONTROL_KINDS

_REVERSE = {"left": "right", "right": "left", "up": "down", "down": "up"}


@dataclass(frozen=True)
class DesignedPair:
    """One designed pair: the candidate (cached) request and the target request, same seed.

    pair_id: "<kind>:<index>" (stable across runs of any length).
    """

    pair_id: str
    kind: str
    candidate_prompt: str
    target_prompt: str
    seed: int
    candidate_scene: Any
    target_scene: Any

    @property
    def hard(self) -> bool:
        return self.kind in HARD_KINDS


def _lab(rgb: Sequence[float]) -> np.ndarray:
    from skimage.color import rgb2lab

    return rgb2lab(np.asarray([[rgb]], dtype=np.float64))[0, 0]


def nearest(name: str, table: Mapping[str, Sequence[float]], allowed: Iterable[str]) -> str | None:
    """The entry of ``table`` (name -> RGB) among ``allowed`` nearest to ``name`` in CIEDE2000 (None if none)."""
    from skimage.color import deltaE_ciede2000

    ref = _lab(table[name])
    best = sorted((float(deltaE_ciede2000(ref, _lab(table[o]))), o) for o in allowed if o != name)
    return best[0][1] if best else None


def _valid(scene: Any) -> bool:
    """Every object a held-in combination with a visible colour, distinct positions and colours."""
    from ..embedded import world

    objs = scene.objects
    return (all(not world.is_held_out(o) and world.compatible(o.colour, scene.background) for o in objs)
            and len({o.position for o in objs}) == len(objs) and len({o.colour for o in objs}) == len(objs))


def _big_pair(rng: np.random.Generator, frame: Any, touching: bool) -> Any | None:
    """Two big objects that touch/overlap in some frame (``touching``) or never do."""
    from ..embedded import world

    scene = world.sample_scene(rng, n_objects=2, frame=frame) if not touching else None
    if touching:
        bg = world.BACKGROUNDS[int(rng.integers(len(world.BACKGROUNDS)))]
        a = world.sample_object(rng, bg)
        b = world.sample_object(rng, bg, avoid_colours=[a.colour], avoid_positions=[a.position])
        scene = world.Scene((a, b), bg)
    scene = replace(scene, objects=tuple(replace(o, size="big") for o in scene.objects))
    if world._overlaps(scene, frame) != touching:
        return None
    return scene


def _design(kind: str, rng: np.random.Generator, frame: Any) -> tuple[Any, Any, bool] | None:
    """(candidate scene, target scene, reworded) for one draw of ``kind``, or None when this draw does not fit."""
    from ..embedded import world
    from .pairs import _edit

    def first_changed(scene: Any, **kw: Any) -> Any:
        return replace(scene, objects=(replace(scene.objects[0], **kw), *scene.objects[1:]))

    if kind.startswith("control_"):
        scene = world.sample_scene(rng, frame=frame)
        if kind == "control_rewording":
            return scene, scene, True
        edited = _edit(kind.removeprefix("control_"), scene, rng, frame)
        return None if edited is None else (scene, edited, False)
    if kind in ("motion_reverse", "motion_start"):
        scene = world.sample_scene(rng, frame=frame)
        m = scene.objects[0].motion
        if kind == "motion_reverse":
            if m == "still":
                return None
            new = _REVERSE[m]
        else:
            new = "still" if m != "still" else str(world.MOTIONS[1 + int(rng.integers(len(world.MOTIONS) - 1))])
        target = first_changed(scene, motion=new)
        return None if world._overlaps(target, frame) else (scene, target, False)
    if kind == "position_overlap":
        scene = world.sample_scene(rng, n_objects=1, frame=frame)
        scene = first_changed(scene, size="big", position="center")
        corner = ("top left", "top right", "bottom left", "bottom right")[int(rng.integers(4))]
        other = first_changed(scene, position=corner)
        # the object's footprint over the clip at one place overlaps its footprint at the other
        if not (world.object_alpha(scene.objects[0], frame).max(0) * world.object_alpha(other.objects[0], frame).max(0)
                ).any():
            return None
        return (scene, other, False) if rng.random() < 0.5 else (other, scene, False)
    if kind in ("touch_colour", "touch_motion", "big_colour"):
        scene = _big_pair(rng, frame, touching=kind != "big_colour")
        if scene is None:
            return None
        first = scene.objects[0]
        if kind == "touch_motion":
            target = first_changed(scene, motion=str(world.MOTIONS[int(rng.integers(len(world.MOTIONS)))]))
            if target == scene or not world._overlaps(target, frame):
                return None
            return scene, target, False
        taken = {o.colour for o in scene.objects}
        options = [c for c in world.COLOURS if c not in taken and world.compatible(c, scene.background)]
        if not options:
            return None
        return scene, first_changed(scene, colour=options[int(rng.integers(len(options)))]), False
    if kind == "colour_near":
        scene = world.sample_scene(rng, frame=frame)
        first = scene.objects[0]
        allowed = [c for c in world.COLOURS if c not in {o.colour for o in scene.objects}
                   and world.compatible(c, scene.background)]
        c = nearest(first.colour, world.PALETTE, allowed)
        return None if c is None else (scene, first_changed(scene, colour=c), False)
    if kind == "background_near":
        scene = world.sample_scene(rng, frame=frame)
        allowed = [b for b in world.BACKGROUNDS if all(world.compatible(o.colour, b) for o in scene.objects)]
        b = nearest(scene.background, world.BACKGROUND_RGB, allowed)
        return None if b is None else (scene, replace(scene, background=b), False)
    raise ValueError(f"unknown pair kind {kind!r}; expected one of {KINDS}")


def design_pair(seed: int, kind: str, index: int, frame: Any = None) -> DesignedPair:
    """The ``index``-th pair of ``kind`` for run seed ``seed`` (its own random stream: prefix-stable). Both
    scenes are valid world scenes (held-in combinations, visible colours); edits keep the caption template, a
    rewording draws another caption of the same scene."""
    from ..embedded import world

    if kind not in KINDS:
        raise ValueError(f"unknown pair kind {kind!r}; expected one of {KINDS}")
    frame = frame if frame is not None else world.DEFAULT_FRAME
    rng = np.random.default_rng([seed, KINDS.index(kind), index])
    for _ in range(2000):
        got = _design(kind, rng, frame)
        if got is None:
            continue
        cand, target, reworded = got
        if not (_valid(cand) and _valid(target)):
            continue
        cap = int(rng.integers(2**31))
        cap_t = int(rng.integers(2**31)) if reworded else cap
        cp = world.caption(cand, np.random.default_rng(cap))
        tp = world.caption(target, np.random.default_rng(cap_t))
        if cp == tp:
            continue
        return DesignedPair(f"{kind}:{index:02d}", kind, cp, tp, int(rng.integers(2**31)), cand, target)
    raise RuntimeError(f"could not design a {kind!r} pair")  # pragma: no cover - every kind admits many scenes


# --------------------------------------------------------------------------------------------- analysis


def auc(unsafe_values: Sequence[float], safe_values: Sequence[float]) -> float | None:
    """P(an unsafe pair's value > a safe pair's) + ½ P(tie): the Mann-Whitney AUC; None if a side is empty."""
    u = np.asarray(unsafe_values, dtype=np.float64)
    s = np.asarray(safe_values, dtype=np.float64)
    if not len(u) or not len(s):
        return None
    gt = (u[:, None] > s[None, :]).sum()
    eq = (u[:, None] == s[None, :]).sum()
    return float((gt + 0.5 * eq) / (len(u) * len(s)))


def mann_whitney_p(unsafe_values: Sequence[float], safe_values: Sequence[float]) -> float | None:
    """One-sided p value of "unsafe pairs take larger values" (scipy's Mann-Whitney U, exact where it can be)."""
    from scipy.stats import mannwhitneyu

    if not len(unsafe_values) or not len(safe_values):
        return None
    return float(mannwhitneyu(unsafe_values, safe_values, alternative="greater").pvalue)


#: The pre-registered criterion (docs/protocol): an axis *separates* on a set of reused pairs when it has at least
#: ``MIN_UNSAFE`` unsafe pairs, AUC >= ``MIN_AUC`` and one-sided Mann-Whitney p <= ``ALPHA`` / (columns judged)
#: (Bonferroni over the columns judged: the four axes and the prompt similarity).
MIN_UNSAFE = 5
MIN_AUC = 0.75
ALPHA = 0.05


def separation(rows: Sequence[Mapping[str, Any]], thresholds: Mapping[str, float],
               axes: Sequence[str] = ("context", "size", "shape", "appearance")) -> dict[str, Any]:
    """How the pairs ``rows`` split and how each axis separates them.

    rows: pair rows (``unsafe`` = b, ``better`` = c, ``reusable``: the sampler reused rather than continuing dense,
    and one value per axis). Only reused pairs can be unsafe, so the axes are judged on those. ``thresholds``: the
    shipped rule's value per axis (a pair is rejected on an axis when its value exceeds it).
    """
    reused = [r for r in rows if r.get("reusable", True)]
    b = [r for r in reused if r["unsafe"]]
    ok = [r for r in reused if not r["unsafe"]]
    out: dict[str, Any] = {"pairs": len(rows), "reused": len(reused), "b": len(b),
                           "c": sum(bool(r.get("better")) for r in reused), "axes": {}}
    for ax in axes:
        ub = [float(r[ax]) for r in b]
        us = [float(r[ax]) for r in ok]
        a = auc(ub, us)
        p = mann_whitney_p(ub, us)
        t = thresholds.get(ax)
        res = {"auc": None if a is None else round(a, 3), "p": None if p is None else round(p, 4),
               "b_median": round(float(np.median(ub)), 3) if ub else None,
               "safe_median": round(float(np.median(us)), 3) if us else None,
               "threshold": t,
               "rejects_b": None if t is None else sum(v > t for v in ub),
               "rejects_safe": None if t is None else sum(v > t for v in us),
               # how much of the safe reuses a threshold catching half the unsafe ones would reject as well
               "safe_rejected_at_half_b": (round(sum(v >= float(np.median(ub)) for v in us) / len(us), 3)
                                           if ub and us else None)}
        res["separates"] = bool(len(ub) >= MIN_UNSAFE and a is not None and a >= MIN_AUC
                                and p is not None and p <= ALPHA / len(axes))
        out["axes"][ax] = res
    return out


__all__ = ["ALPHA", "CONTROL_KINDS", "DesignedPair", "HARD_KINDS", "KINDS", "MIN_AUC", "MIN_UNSAFE", "auc",
           "design_pair", "mann_whitney_p", "nearest", "separation"]
