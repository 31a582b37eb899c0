"""Thresholds of a risk rule and the one selection rule shared by the filter and by calibration.

Keeping the acceptance test and the "which passing candidate wins" rule in one place is what makes the
certificate mean something: calibration and certification evaluate exactly the decision the online filter makes
(:func:`select_best` is called by both :mod:`.filter` and :mod:`.certify`).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from ..types import AxisCheck
from .discrepancy import AXES

#: AxisCheck name used for the (optional) prompt-similarity condition. Expressed as a distance
#: (1 − similarity ≤ 1 − min_similarity) so that every AxisCheck reads "value ≤ threshold".
PROMPT_AXIS = "prompt_distance"


def prompt_distance(similarity: float) -> float:
    """Similarity as a distance; the single expression used everywhere so float rounding can't disagree."""
    return 1.0 - float(similarity)


@dataclass(frozen=True)
class Thresholds:
    """Maximum allowed discrepancy per axis (a candidate passes an axis when value ≤ threshold), and an
    optional minimum prompt similarity. All four axis thresholds are finite and ≥ 0."""

    context: float
    size: float
    shape: float
    appearance: float
    min_similarity: float | None = None

    def __post_init__(self) -> None:
        # Accept any real number (numpy scalars included) but store plain floats, so JSON and equality behave.
        for axis in AXES:
            v = getattr(self, axis)
            if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ValueError(f"threshold {axis!r} must be a finite number ≥ 0, got {v!r}")
            object.__setattr__(self, axis, float(v))
        ms = self.min_similarity
        if ms is not None:
            if not isinstance(ms, numbers.Real) or isinstance(ms, bool) or not math.isfinite(ms):
                raise ValueError(f"min_similarity must be a finite number or null, got {ms!r}")
            object.__setattr__(self, "min_similarity", float(ms))

    def vector(self) -> tuple[float, float, float, float]:
        return (self.context, self.size, self.shape, self.appearance)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {a: float(v) for a, v in zip(AXES, self.vector())}
        d["min_similarity"] = None if self.min_similarity is None else float(self.min_similarity)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Thresholds":
        missing = [a for a in AXES if a not in d]
        if missing:
            raise ValueError(f"thresholds lack axes {missing}; a rule needs all of {list(AXES)}")
        ms = d.get("min_similarity")
        return cls(*(d[a] for a in AXES), min_similarity=None if ms is None else ms)  # type: ignore[arg-type]

    def checks(self, values: Sequence[float], similarity: float) -> tuple[AxisCheck, ...]:
        """AxisChecks for a 4-vector of discrepancies (AXES order) and, if set, the prompt-similarity bound."""
        out = [AxisCheck(axis=a, value=float(v), threshold=float(t)) for a, v, t in zip(AXES, values, self.vector())]
        if self.min_similarity is not None:
            out.append(AxisCheck(PROMPT_AXIS, prompt_distance(similarity), prompt_distance(self.min_similarity)))
        return tuple(out)

    def normalised(self, values: Sequence[float]) -> float:
        """Mean of value / threshold over the four axes: the tie-break between equally similar candidates.

        A zero threshold contributes 0 for a zero value and +inf otherwise (such a value fails anyway).
        """
        total = 0.0
        for v, t in zip(values, self.vector()):
            total += (0.0 if v <= 0 else math.inf) if t <= 0 else float(v) / t
        return total / len(AXES)


def prompt_check(similarity: float, threshold: float) -> AxisCheck:
    """The prompt-only mode's single check (NIRVANA-style: similarity ≥ threshold)."""
    return AxisCheck(PROMPT_AXIS, prompt_distance(similarity), prompt_distance(threshold))


def select_best(items: Iterable[tuple[int, float, float, str]]) -> int | None:
    """Pick the winner among *passing* candidates.

    items: (index, similarity, normalised discrepancy, entry_id) of candidates that passed every check.
    Highest similarity wins; ties go to the smallest normalised discrepancy, then the smallest entry_id (so the
    choice never depends on input order). Returns the winner's index, or None if there is none.
    """
    best: tuple[float, float, str] | None = None
    best_idx: int | None = None
    for idx, sim, norm, eid in items:
        key = (-float(sim), float(norm), str(eid))
        if best is None or key < best:
            best, best_idx = key, idx
    return best_idx
