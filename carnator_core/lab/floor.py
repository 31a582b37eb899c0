"""The floor of a label: what a fresh dense sample scores when it is judged as if it were a reuse output.

A certificate bounds how often reuse outputs are worse than the dense output of the same request and seed. A
label is only usable if an output *as good as dense* can pass it: a second dense sample of the same prompt at
another seed is such an output (it is what the model itself would produce), so its labelled excess must come out
with a bound ≤ α at realistic n, or no reuse can ever certify (docs/CALIBRATION.md, "The label's floor").

Procedure (:func:`measure_floor`), per request (prompt, seed s):

1. the dense clip at seed s (the reference: what the user would otherwise have got) and the dense clip at another
   seed s' ≠ s (:func:`other_seed`) — both through the same ``generate(prompt, seed)`` callable;
2. the fresh clip is judged against the dense clip with the pairs labelling's own function
   (:func:`.pairs.judge_against_dense`, the request-level labeler of :func:`.pairs.embedded_checker_labeler`):
   b = fresh fails where dense passes, c = fresh passes where dense fails; "fails" = the checker fails a named
   attribute or the background, or the fresh clip's background artifact score exceeds ``artifact_ratio`` × the
   dense clip's;
3. the same pair with the artifact measure off (checker only, :func:`.pairs.request_outcome` without the artifact
   verdict), so the contribution of each part of "fails" is visible;
4. a diagnostic that is not part of any label: both artifact scores over the pixels that are background in *both*
   clips (the label scores them over the dense clip's background only, where the fresh clip's objects may stand).

:func:`summarize_floor` reports per stratum (all, one-/two-object scenes, and those per request kind): n, b, c,
b/n with its Clopper–Pearson upper bound, and the exact excess upper bound
(:func:`..risk.bounds.excess_upper_bound`), for both labels. Measured figures: BENCHMARKS.md, "The excess label's
floor" (v3; v2 in docs/history/BENCHMARKS_HISTORY.md). Contract: no ComfyUI import here (the generator is passed
in); deterministic given the generator.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from ..risk.bounds import clopper_pearson_upper, excess_upper_bound, excess_upper_bound_union
from .pairs import CheckerLabeler, PairRequest, judge_against_dense, request_outcome

#: The two labels the floor is reported for: the excess label as certified, and its checker part alone.
LABELS: tuple[str, ...] = ("full", "checker")


@dataclass(frozen=True)
class FloorRecord:
    """One request's fresh-as-reuse verdicts.

    b / c: the excess label as certified (checker or artifact); b_checker / c_checker: with the artifact measure
    off. dense_failed / fresh_failed: the checker's failed attributes of each clip. artifact / artifact_dense:
    background artifact scores (over the dense clip's background, as the label uses them); artifact_both /
    artifact_dense_both: the same over the pixels that are background in both clips (diagnostic only).
    """

    request_id: str
    kind: str
    objects: int
    prompt: str
    seed: int
    fresh_seed: int
    b: bool
    c: bool
    b_checker: bool
    c_checker: bool
    artifact_failed: bool
    dense_failed: tuple[str, ...]
    fresh_failed: tuple[str, ...]
    artifact: float | None
    artifact_dense: float | None
    artifact_both: float | None = None
    artifact_dense_both: float | None = None

    @property
    def stratum(self) -> str:
        return f"{self.objects}obj/{self.kind}"

    def to_row(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> "FloorRecord":
        names = set(cls.__dataclass_fields__)
        r = {k: v for k, v in row.items() if k in names}
        r["dense_failed"] = tuple(r.get("dense_failed", ()))
        r["fresh_failed"] = tuple(r.get("fresh_failed", ()))
        return cls(**r)


def other_seed(seed: int, salt: int = 1) -> int:
    """A seed ≠ ``seed`` derived from it (deterministic): the fresh sample's seed."""
    rng = np.random.default_rng([int(seed), int(salt), 0x5EED])
    while True:
        s = int(rng.integers(2**31))
        if s != int(seed):
            return s


def _rounded(x: float | None) -> float | None:
    return None if x is None or not np.isfinite(x) else round(float(x), 4)


def judge_fresh(labeler: CheckerLabeler, dense: np.ndarray, fresh: np.ndarray, prompt: str,
                background: Callable[[np.ndarray, str], np.ndarray] | None = None) -> dict[str, Any]:
    """Judge ``fresh`` as if it were a reuse output of the request whose dense output is ``dense``.

    Returns objects (how many objects the dense clip's verdicts name), b, c (the labeler's request-level
    label, via :func:`.pairs.judge_against_dense`), b_checker, c_checker (artifact measure off), artifact_failed,
    dense_failed, fresh_failed, artifact, artifact_dense, and with ``background`` the both-backgrounds diagnostic.
    Raises ValueError for a labeler that is not at request level (the floor is a property of the excess label).
    """
    if getattr(labeler, "level", None) != "request":
        raise ValueError("the floor is measured for the request-level (excess) label: use "
                         "embedded_checker_labeler('request', artifact_ratio)")
    from .metrics import artifact_score

    ref = labeler.reference(dense, prompt)
    bg = background(dense, prompt) if background is not None else None
    b, diag, art_dense = judge_against_dense(labeler, ref, fresh, dense, prompt, bg)
    b_chk, diag_chk = request_outcome(diag, artifact_failed=False)
    out: dict[str, Any] = {
        "objects": len({a.split(".", 1)[0] for a in ref if a.startswith("o")}),
        "b": bool(b), "c": bool(diag.get("better", False)),
        "b_checker": bool(b_chk), "c_checker": bool(diag_chk["better"]),
        "artifact_failed": bool(diag.get("artifact_failed", False)),
        "dense_failed": tuple(diag.get("dense_failed", ())), "fresh_failed": tuple(diag.get("reuse_failed", ())),
        "artifact": diag.get("artifact"),
        "artifact_dense": _rounded(art_dense if art_dense is not None else diag.get("artifact_dense")),
    }
    if background is not None:
        both = np.asarray(bg, bool) & np.asarray(background(fresh, prompt), bool)
        out["artifact_both"] = _rounded(artifact_score(fresh, both))
        out["artifact_dense_both"] = _rounded(artifact_score(dense, both))
    return out


def measure_floor(requests: Sequence[PairRequest], generate: Callable[[str, int], np.ndarray],
                  labeler: CheckerLabeler, background: Callable[[np.ndarray, str], np.ndarray] | None = None, *,
                  salt: int = 1, skip: Iterable[str] = (),
                  on_record: Callable[[FloorRecord, np.ndarray, np.ndarray], None] | None = None,
                  ) -> list[FloorRecord]:
    """The fresh-as-reuse record of every request (see the module docstring).

    generate: (prompt, seed) -> dense clip [T, H, W, 3] in [0, 1]; called at the request's seed and at
              :func:`other_seed` (``salt``). background: (dense clip, prompt) -> bool [T, H, W], the pixels the
              artifact measure scores (the pairs labelling's ``PairContext.background``); None = the whole clip.
    skip: request ids already measured (a resumed run). on_record(record, dense, fresh) is called after each
    request (to write it out at once). The number of objects of a request is the number of objects its dense
    clip's verdicts name (as the pairs labelling tags its strata).
    """
    done = set(skip)
    out = []
    for req in requests:
        if req.request_id in done:
            continue
        s2 = other_seed(req.seed, salt)
        dense = generate(req.prompt, int(req.seed))
        fresh = generate(req.prompt, s2)
        verdict = judge_fresh(labeler, dense, fresh, req.prompt, background)
        rec = FloorRecord(req.request_id, req.kind, prompt=req.prompt, seed=int(req.seed), fresh_seed=s2, **verdict)
        out.append(rec)
        if on_record is not None:
            on_record(rec, dense, fresh)
    return out


def _stratum_summary(recs: Sequence[FloorRecord], alpha: float, delta: float,
                     artifact_ratio: float | None) -> dict[str, Any]:
    n = len(recs)
    out: dict[str, Any] = {"n": n}
    for label in LABELS:
        sfx = "" if label == "full" else "_checker"
        b = sum(getattr(r, "b" + sfx) for r in recs)
        c = sum(getattr(r, "c" + sfx) for r in recs)
        u = excess_upper_bound(n, b, c, delta)
        out[label] = {
            "b": b, "c": c, "b_rate": round(b / n, 4) if n else None,
            "b_upper": round(clopper_pearson_upper(b, n, delta), 4),
            "excess": round((b - c) / n, 4) if n else None,
            "excess_upper": round(u, 4), "excess_upper_union": round(excess_upper_bound_union(n, b, c, delta), 4),
            "certifies": bool(u <= alpha),
        }
    out["artifact_flagged"] = sum(r.artifact_failed for r in recs)
    # how many the measure would flag if it scored only the pixels that are background in both clips: the rest of
    # the flags come from the fresh clip's objects standing where the dense clip has background
    out["artifact_flagged_both_bg"] = (None if not artifact_ratio else sum(
        1 for r in recs if r.artifact_both is not None and r.artifact_dense_both is not None
        and r.artifact_both > artifact_ratio * r.artifact_dense_both))
    out["b_from_artifact"] = sum(r.b and not r.b_checker for r in recs)  # b only because of the artifact measure
    out["c_lost_to_artifact"] = sum(r.c_checker and not r.c for r in recs)  # fixed a dense failure, flagged
    out["dense_fail_rate"] = round(sum(bool(r.dense_failed) for r in recs) / n, 4) if n else None
    out["fresh_fail_rate"] = round(sum(bool(r.fresh_failed) for r in recs) / n, 4) if n else None
    ratios = [r.artifact / r.artifact_dense for r in recs if r.artifact is not None and r.artifact_dense]
    both = [r.artifact_both / r.artifact_dense_both for r in recs
            if r.artifact_both is not None and r.artifact_dense_both]
    q = (0.5, 0.9, 0.99)
    out["artifact_ratio_quantiles"] = [round(float(x), 3) for x in np.quantile(ratios, q)] if ratios else None
    out["artifact_ratio_both_quantiles"] = [round(float(x), 3) for x in np.quantile(both, q)] if both else None
    return out


def summarize_floor(records: Sequence[FloorRecord], alpha: float = 0.05, delta: float = 0.1,
                    by_kind: bool = True, artifact_ratio: float | None = 1.25) -> dict[str, dict[str, Any]]:
    """Per stratum ("all", "1obj", "2obj", and with ``by_kind`` "1obj/<kind>", ...): n, per label (:data:`LABELS`)
    b, c, b/n, its Clopper–Pearson upper bound at δ, the excess (b − c)/n, its exact upper bound at δ
    (``excess_upper``), the union bound, and whether the exact bound is ≤ α; plus how many fresh clips the
    artifact measure flagged, how many it would flag over the shared background with ``artifact_ratio``
    (``artifact_flagged_both_bg``, diagnostic), how many b exist only because of it (``b_from_artifact``), how
    many c it removed (``c_lost_to_artifact``), the checker failure rates of the dense and fresh clips, and
    quantiles (50/90/99 %) of the fresh/dense artifact ratio over the dense background and over the shared
    background."""
    groups: dict[str, list[FloorRecord]] = {"all": list(records)}
    for r in records:
        groups.setdefault(f"{r.objects}obj", []).append(r)
    if by_kind:
        for r in records:
            groups.setdefault(r.stratum, []).append(r)
    order = sorted(groups, key=lambda k: (k != "all", k.count("/"), k))
    return {k: _stratum_summary(groups[k], alpha, delta, artifact_ratio) for k in order}


__all__ = ["FloorRecord", "LABELS", "judge_fresh", "measure_floor", "other_seed", "summarize_floor"]
