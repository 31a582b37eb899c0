"""The four discrepancies between a target Early Signature and a candidate's (docs/ARCHITECTURE.md, step 5).

Contract of :func:`discrepancies` (pure, deterministic, never modifies its inputs):

* Objects are matched **by name** (case-folded, surrounding space stripped). If a name occurs several times on
  one side, the i-th occurrence on the target side is matched with the i-th on the candidate side. A named
  object present on only one side is listed in ``missing_objects``; such a pair is an automatic reject (the
  filter checks :attr:`Discrepancies.missing`), but the axes are still computed over the matched objects so
  that a report can show them.
* ``context``    = mean CIEDE2000 ΔE over the cells of the context (non-object) appearance grid.
* ``size``       = worst object |log((size_t + ε) / (size_c + ε))| with ε = one grid cell (1 / number of mask
                   cells): a size difference below one cell of the token grid is not measurable anyway, and
                   the ε keeps the log finite for an object whose mask came out empty.
* ``shape``      = worst object 1 − soft IoU of the two masks (Σ min / Σ max over the token grid); two empty
                   masks count as identical (0).
* ``appearance`` = worst object CIEDE2000 ΔE between the objects' mean CIELAB colours.
* With no matched object (context-only signatures) the three object axes are 0.

Masks of two signatures may differ in grid shape only if their generation configs differ, which never happens
within a cache namespace; if it does anyway, :class:`SignatureMismatchError` says so instead of broadcasting.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from skimage.color import deltaE_ciede2000

from ..types import ObjectSignature, Signature

#: The four axes, in the order every vector / table in the risk package uses.
AXES: tuple[str, ...] = ("context", "size", "shape", "appearance")


class SignatureMismatchError(ValueError):
    """Two signatures cannot be compared (different grids): they were not made under the same config."""


@dataclass(frozen=True)
class ObjectDiscrepancy:
    """Per-object detail of a matched object pair (target vs candidate)."""

    name: str
    size: float
    shape: float
    appearance: float
    size_target: float
    size_candidate: float


@dataclass(frozen=True)
class Discrepancies:
    """Target-vs-candidate discrepancies. Smaller is more similar; all values are finite and ≥ 0.

    missing_objects: names present on only one side, each as ``"name (target only)"`` /
                     ``"name (candidate only)"``; non-empty means the pair must be rejected.
    objects:         per matched object detail (the axis values are the worst over these).
    """

    context: float
    size: float
    shape: float
    appearance: float
    missing_objects: tuple[str, ...] = ()
    objects: tuple[ObjectDiscrepancy, ...] = ()

    @property
    def missing(self) -> bool:
        return bool(self.missing_objects)

    def vector(self) -> tuple[float, float, float, float]:
        """The four values in :data:`AXES` order."""
        return (self.context, self.size, self.shape, self.appearance)

    def as_dict(self) -> dict[str, float]:
        return dict(zip(AXES, self.vector()))

    def worst_object(self, axis: str) -> str | None:
        """Name of the object that sets the value of an object axis (None for context, other axes, no objects)."""
        if axis not in ("size", "shape", "appearance") or not self.objects:
            return None
        return max(self.objects, key=lambda o: getattr(o, axis)).name


def _key(name: str) -> str:
    return name.strip().casefold()


def _lab(values: object, what: str) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64)
    if arr.shape[-1:] != (3,):
        raise SignatureMismatchError(f"{what} must hold CIELAB triples (last axis 3), got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{what} contains NaN/inf: the signature is corrupt; rebuild it with the Signature Builder")
    return arr


def _context_arrays(target: Signature, cand: Signature) -> tuple[np.ndarray, np.ndarray]:
    t = _lab(target.context_lab, "target context_lab")
    c = _lab(cand.context_lab, "candidate context_lab")
    if t.shape != c.shape:
        raise SignatureMismatchError(
            f"context grids differ: target {t.shape} vs candidate {c.shape}. Signatures are only comparable "
            "within one cache namespace (same model and generation config); this candidate was made under "
            "another config — check the cache namespace."
        )
    return t.reshape(-1, 3), c.reshape(-1, 3)


def _object_pair(t: ObjectSignature, c: ObjectSignature) -> tuple[float, float]:
    """(size, shape) of a matched object pair; appearance is computed in one batched ΔE call by the caller."""
    mt = np.asarray(t.mask, dtype=np.float64)
    mc = np.asarray(c.mask, dtype=np.float64)
    if mt.shape != mc.shape:
        raise SignatureMismatchError(
            f"object {t.name!r}: mask grids differ, target {mt.shape} vs candidate {mc.shape}. Masks live on the "
            "token grid of the generation config, so the two signatures come from different configs — they "
            "must never meet within one cache namespace."
        )
    if not (np.all(np.isfinite(mt)) and np.all(np.isfinite(mc))):
        raise ValueError(f"object {t.name!r}: mask contains NaN/inf; rebuild the signature")
    # Soft IoU over the token grid; masks are in [0, 1] by contract, clip so a slightly-off producer can't
    # yield an IoU outside [0, 1].
    mt = np.clip(mt, 0.0, 1.0)
    mc = np.clip(mc, 0.0, 1.0)
    union = float(np.maximum(mt, mc).sum())
    shape = 0.0 if union <= 0.0 else 1.0 - float(np.minimum(mt, mc).sum()) / union
    eps = 1.0 / max(mt.size, 1)
    st, sc = max(float(t.size), 0.0), max(float(c.size), 0.0)
    size = abs(math.log((st + eps) / (sc + eps)))
    return size, max(0.0, shape)


def discrepancies(target: Signature, cand: Signature) -> Discrepancies:
    """Compute the four discrepancies of ``cand`` against ``target`` (see module docstring for the contract).

    Raises :class:`SignatureMismatchError` if grids differ (signatures from different configs).
    """
    if tuple(target.grid) != tuple(cand.grid):
        raise SignatureMismatchError(
            f"token grids differ: target {tuple(target.grid)} vs candidate {tuple(cand.grid)}. Signatures are "
            "only comparable within one cache namespace (same model and generation config)."
        )
    ctx_t, ctx_c = _context_arrays(target, cand)

    # Match by name, occurrence by occurrence.
    pool: dict[str, list[ObjectSignature]] = {}
    for o in cand.objects:
        pool.setdefault(_key(o.name), []).append(o)
    pairs: list[tuple[ObjectSignature, ObjectSignature]] = []
    missing: list[str] = []
    for o in target.objects:
        bucket = pool.get(_key(o.name))
        if bucket:
            pairs.append((o, bucket.pop(0)))
        else:
            missing.append(f"{o.name} (target only)")
    for bucket in pool.values():
        missing.extend(f"{o.name} (candidate only)" for o in bucket)

    # One ΔE call for context cells and object colours together: skimage's per-call overhead (~0.3 ms) is
    # larger than the arithmetic at these sizes, and the filter runs this for every recalled candidate.
    lab_t = [ctx_t] + [_lab(t.lab, f"target object {t.name!r} lab").reshape(1, 3) for t, _ in pairs]
    lab_c = [ctx_c] + [_lab(c.lab, f"candidate object {c.name!r} lab").reshape(1, 3) for _, c in pairs]
    de = deltaE_ciede2000(np.concatenate(lab_t), np.concatenate(lab_c))
    n_ctx = len(ctx_t)
    context = float(np.mean(de[:n_ctx])) if n_ctx else 0.0
    matched: list[ObjectDiscrepancy] = []
    for i, (t, c) in enumerate(pairs):
        size, shape = _object_pair(t, c)
        matched.append(
            ObjectDiscrepancy(
                name=t.name, size=size, shape=shape, appearance=float(de[n_ctx + i]),
                size_target=max(float(t.size), 0.0), size_candidate=max(float(c.size), 0.0),
            )
        )

    def worst(axis: str) -> float:
        return max((getattr(m, axis) for m in matched), default=0.0)

    return Discrepancies(
        context=context,
        size=worst("size"),
        shape=worst("shape"),
        appearance=worst("appearance"),
        missing_objects=tuple(missing),
        objects=tuple(matched),
    )
