"""Calibration (threshold search) and certification (one-sided Clopper–Pearson bound) of a risk rule.

Vocabulary
----------
* A **labelled pair** is one (request, recalled cache entry) with its four discrepancies, its prompt similarity,
  whether the target or the entry names an object the other lacks (``missing``), and whether reusing that entry
  for that request was **unsafe** (the reuse output fails a checker where the dense output passes, or deviates
  from the dense output beyond a stated tolerance; see docs/CALIBRATION.md).
* Pairs are evaluated **per request**, exactly as the online filter decides: among a request's pairs that pass
  the thresholds, the one :func:`.thresholds.select_best` picks is accepted. ``n`` = requests with an accepted
  pair, ``k`` = those whose accepted pair is unsafe, **coverage** = n / number of requests. With one pair per
  request this is the plain pair-level count.
* Calibration and certification use **disjoint sets of requests** (a split never separates a request's pairs).

Calibration (:func:`calibrate`)
------------------------------
Grid search over thresholds placed at observed quantiles of each axis on the calibration split (``levels`` per
axis, 4 axes, optionally a fifth for min prompt similarity). Among threshold settings that satisfy the
constraint, the one with the highest coverage wins (ties: fewer unsafe, then the tighter thresholds). Constraint:

* ``"empirical"`` — unsafe-among-accepted k/n ≤ α and n ≥ ``min_accepted`` (default
  :func:`min_accepted_for_certificate`, the smallest n for which a certificate with k = 0 can hold — 45 for
  α = 0.05, δ = 0.1; fewer accepted pairs could never certify).
* ``"bound"`` (default) — the calibration split's own Clopper–Pearson bound must already hold:
  U(k, n, δ) ≤ α. This implies k/n ≤ α and n ≥ the minimum above, so it satisfies the empirical constraint
  too, and it picks rules that are likely to pass certification on a similar-sized disjoint split. An
  empirical rate just under α (say 4.9 % of 100) practically never certifies: U would be ≈ 9 %.

Every returned rule satisfies k/n ≤ α on the calibration split, re-checked with the exact per-request evaluator
(the vectorised search breaks exact similarity ties slightly differently; a setting that fails the exact
re-check is skipped).

Certification (:func:`certify`)
-------------------------------
Thresholds fixed by calibration are applied to the certification split; with n accepted and k unsafe,
U = Beta⁻¹(1 − δ; k + 1, n − k) (one-sided Clopper–Pearson). The rule is certified iff U ≤ α: with probability
≥ 1 − δ over the draw of the certification requests, the unsafe rate among accepted reuses is ≤ U. Because the
rule is chosen on another split, no multiple-testing correction is needed for the single certified rule.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping, Sequence

import numpy as np
from scipy.stats import beta as _beta

from .discrepancy import AXES, Discrepancies
from .thresholds import Thresholds, prompt_distance, select_best

Constraint = Literal["bound", "empirical"]

#: Recognised values of a pair's optional "split" field.
CALIB_SPLITS = ("calib", "calibration")
CERT_SPLITS = ("cert", "certification", "test")


class CalibrationError(ValueError):
    """No threshold setting satisfies the constraint (or the data cannot be used); the message says why."""


# --------------------------------------------------------------------------------------------- the bound


def clopper_pearson_upper(k: int, n: int, delta: float) -> float:
    """One-sided Clopper–Pearson upper confidence bound on a binomial rate, at confidence 1 − δ.

    U = Beta⁻¹(1 − δ; k + 1, n − k); U = 1 when k = n (including n = 0: no evidence at all).
    Example (the seed's certificate): k = 0, n = 50, δ = 0.1 → 0.0450.
    """
    k, n = int(k), int(n)
    if n < 0 or k < 0 or k > n:
        raise ValueError(f"need 0 ≤ k ≤ n, got k={k}, n={n}")
    if not 0.0 < float(delta) < 1.0:
        raise ValueError(f"δ must be in (0, 1), got {delta}")
    if k >= n:
        return 1.0
    return float(_beta.ppf(1.0 - float(delta), k + 1, n - k))


def _cp_upper_vec(k: np.ndarray, n: np.ndarray, delta: float) -> np.ndarray:
    """Vectorised :func:`clopper_pearson_upper` (same conventions)."""
    k = np.asarray(k, dtype=np.float64)
    n = np.asarray(n, dtype=np.float64)
    out = np.ones(np.broadcast(k, n).shape, dtype=np.float64)
    ok = k < n
    if np.any(ok):
        out[ok] = _beta.ppf(1.0 - delta, k[ok] + 1.0, n[ok] - k[ok])
    return out


def min_accepted_for_certificate(alpha: float, delta: float) -> int:
    """Smallest n for which a certificate can hold at all (k = 0): U(0, n, δ) = 1 − δ^(1/n) ≤ α."""
    if not (0.0 < alpha < 1.0 and 0.0 < delta < 1.0):
        raise ValueError(f"α and δ must be in (0, 1), got α={alpha}, δ={delta}")
    n = max(1, math.ceil(math.log(delta) / math.log1p(-alpha)) - 1)
    while clopper_pearson_upper(0, n, delta) > alpha:  # guard against rounding in the closed form
        n += 1
    return n


# --------------------------------------------------------------------------------------------- pairs


@dataclass(frozen=True)
class LabelledPair:
    """One labelled (request, cache entry) pair; see the module docstring and docs/CALIBRATION.md."""

    request_id: str
    entry_id: str
    similarity: float
    context: float
    size: float
    shape: float
    appearance: float
    missing: bool
    unsafe: bool
    split: str | None = None

    def vector(self) -> tuple[float, float, float, float]:
        return (self.context, self.size, self.shape, self.appearance)

    @classmethod
    def from_discrepancies(
        cls, request_id: str, entry_id: str, similarity: float, d: Discrepancies, unsafe: bool, split: str | None = None
    ) -> "LabelledPair":
        return cls(request_id, entry_id, float(similarity), *d.vector(), missing=d.missing, unsafe=bool(unsafe),
                   split=split)

    def to_row(self) -> dict[str, Any]:
        row: dict[str, Any] = {
            "request_id": self.request_id,
            "entry_id": self.entry_id,
            "similarity": self.similarity,
            **dict(zip(AXES, self.vector())),
            "missing": self.missing,
            "unsafe": self.unsafe,
        }
        if self.split is not None:
            row["split"] = self.split
        return row


def _num(row: Mapping[str, Any], key: str, where: str, nonneg: bool) -> float:
    if key not in row:
        raise CalibrationError(f"{where}: missing field {key!r}")
    v = row[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (nonneg and v < 0):
        need = "a finite number ≥ 0" if nonneg else "a finite number"
        raise CalibrationError(f"{where}: field {key!r} must be {need}, got {v!r}")
    return float(v)


def _flag(row: Mapping[str, Any], key: str, where: str) -> bool:
    if key not in row:
        raise CalibrationError(f"{where}: missing field {key!r}")
    v = row[key]
    if not isinstance(v, bool):
        raise CalibrationError(f"{where}: field {key!r} must be true or false, got {v!r}")
    return v


def pair_from_row(row: Mapping[str, Any], where: str = "row") -> LabelledPair:
    """Validate one JSONL row (format: docs/CALIBRATION.md) into a :class:`LabelledPair`."""
    if not isinstance(row, Mapping):
        raise CalibrationError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for key in ("request_id", "entry_id"):
        if key not in row or not isinstance(row[key], (str, int)) or isinstance(row[key], bool):
            raise CalibrationError(f"{where}: field {key!r} must be a string (or integer) id")
    split = row.get("split")
    if split is not None:
        if not isinstance(split, str) or split.lower() not in CALIB_SPLITS + CERT_SPLITS:
            raise CalibrationError(
                f"{where}: field 'split' must be one of {CALIB_SPLITS + CERT_SPLITS} or absent, got {split!r}")
        split = "calib" if split.lower() in CALIB_SPLITS else "cert"
    return LabelledPair(
        request_id=str(row["request_id"]),
        entry_id=str(row["entry_id"]),
        similarity=_num(row, "similarity", where, nonneg=False),
        context=_num(row, "context", where, nonneg=True),
        size=_num(row, "size", where, nonneg=True),
        shape=_num(row, "shape", where, nonneg=True),
        appearance=_num(row, "appearance", where, nonneg=True),
        missing=_flag(row, "missing", where),
        unsafe=_flag(row, "unsafe", where),
        split=split,
    )


def read_pairs_jsonl(path: str | Path) -> tuple[dict[str, Any], list[LabelledPair]]:
    """Read a labelled-pairs JSONL file: an optional header object (``"type": "header"``) and pair rows.

    Returns (header dict or {}, pairs). Errors name the file and line. Blank lines are ignored.
    """
    path = Path(path)
    if not path.is_file():
        raise CalibrationError(f"pairs file not found: {path}")
    header: dict[str, Any] = {}
    pairs: list[LabelledPair] = []
    seen: set[tuple[str, str]] = set()
    with path.open("r", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            line = line.strip()
            if not line:
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise CalibrationError(
                    f"{where}: not valid JSON ({e.msg}); each line must be one JSON object") from None
            if isinstance(row, dict) and row.get("type") == "header":
                if header or pairs:
                    raise CalibrationError(f"{where}: a header row must be the first row, and only one is allowed")
                header = {k: v for k, v in row.items() if k != "type"}
                continue
            p = pair_from_row(row, where)
            if (p.request_id, p.entry_id) in seen:
                raise CalibrationError(
                    f"{where}: duplicate pair (request_id={p.request_id!r}, entry_id={p.entry_id!r})")
            seen.add((p.request_id, p.entry_id))
            pairs.append(p)
    if not pairs:
        raise CalibrationError(f"{path}: no labelled pairs in the file")
    return header, pairs


def write_pairs_jsonl(path: str | Path, pairs: Iterable[LabelledPair], header: Mapping[str, Any] | None = None) -> None:
    """Write pairs (and an optional header) in the format :func:`read_pairs_jsonl` reads."""
    with Path(path).open("w", encoding="utf-8") as fh:
        if header:
            fh.write(json.dumps({"type": "header", **header}, sort_keys=True) + "\n")
        for p in pairs:
            fh.write(json.dumps(p.to_row(), sort_keys=True) + "\n")


def split_pairs(
    pairs: Sequence[LabelledPair], calib_frac: float = 0.5, seed: int = 0
) -> tuple[list[LabelledPair], list[LabelledPair]]:
    """Split into (calibration, certification) by **request**, never separating a request's pairs.

    If the rows carry a "split" field it is used as is (then every row must carry one, and a request must not
    appear in both). Otherwise requests are shuffled with ``seed`` and the first round(calib_frac · R) go to
    calibration.
    """
    with_split = [p.split is not None for p in pairs]
    if any(with_split):
        if not all(with_split):
            raise CalibrationError("some rows have a 'split' field and some don't: give it on every row or on none")
        calib = [p for p in pairs if p.split == "calib"]
        cert = [p for p in pairs if p.split == "cert"]
        both = {p.request_id for p in calib} & {p.request_id for p in cert}
        if both:
            raise CalibrationError(
                f"{len(both)} request(s) appear in both splits (e.g. {sorted(both)[0]!r}); the certification split "
                "must hold requests the calibration never saw"
            )
    else:
        if not 0.0 < calib_frac < 1.0:
            raise CalibrationError(f"calib_frac must be in (0, 1), got {calib_frac}")
        requests = sorted({p.request_id for p in pairs})
        order = np.random.default_rng(seed).permutation(len(requests))
        n_cal = int(round(calib_frac * len(requests)))
        cal_ids = {requests[i] for i in order[:n_cal]}
        calib = [p for p in pairs if p.request_id in cal_ids]
        cert = [p for p in pairs if p.request_id not in cal_ids]
    if not calib or not cert:
        raise CalibrationError(
            f"both splits need requests: got {len({p.request_id for p in calib})} calibration and "
            f"{len({p.request_id for p in cert})} certification requests; provide more labelled requests"
        )
    return calib, cert


# --------------------------------------------------------------------------------------------- evaluation


@dataclass(frozen=True)
class Evaluation:
    """Outcome of applying a rule to a set of labelled requests (per-request acceptance, like the filter)."""

    n_requests: int
    n_accepted: int
    k_unsafe: int

    @property
    def coverage(self) -> float:
        return self.n_accepted / self.n_requests if self.n_requests else 0.0

    @property
    def unsafe_rate(self) -> float:
        """Unsafe among accepted (0 when nothing is accepted)."""
        return self.k_unsafe / self.n_accepted if self.n_accepted else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "n_requests": self.n_requests,
            "n_accepted": self.n_accepted,
            "k_unsafe": self.k_unsafe,
            "coverage": self.coverage,
            "unsafe_rate": self.unsafe_rate,
        }


def _by_request(pairs: Sequence[LabelledPair]) -> dict[str, list[LabelledPair]]:
    groups: dict[str, list[LabelledPair]] = {}
    for p in pairs:
        groups.setdefault(p.request_id, []).append(p)
    return groups


def evaluate(thresholds: Thresholds, pairs: Sequence[LabelledPair]) -> Evaluation:
    """Exact per-request evaluation of the signature rule (the decision :func:`.filter.decide` makes)."""
    n_acc = k = 0
    groups = _by_request(pairs)
    for group in groups.values():
        passing = []
        for i, p in enumerate(group):
            if p.missing:
                continue
            if all(c.passed for c in thresholds.checks(p.vector(), p.similarity)):
                passing.append((i, p.similarity, thresholds.normalised(p.vector()), p.entry_id))
        best = select_best(passing)
        if best is not None:
            n_acc += 1
            k += int(group[best].unsafe)
    return Evaluation(len(groups), n_acc, k)


def evaluate_prompt_only(threshold: float, pairs: Sequence[LabelledPair]) -> Evaluation:
    """Per-request evaluation of prompt-only acceptance: the most similar candidate, if similarity ≥ threshold
    (ties in similarity broken by entry_id, as the filter does). Signatures and missing objects are ignored."""
    n_acc = k = 0
    groups = _by_request(pairs)
    limit = prompt_distance(threshold)
    for group in groups.values():
        top = select_best((i, p.similarity, 0.0, p.entry_id) for i, p in enumerate(group))
        if top is not None and prompt_distance(group[top].similarity) <= limit:
            n_acc += 1
            k += int(group[top].unsafe)
    return Evaluation(len(groups), n_acc, k)


# --------------------------------------------------------------------------------------------- calibration


@dataclass(frozen=True)
class Calibration:
    """Result of :func:`calibrate`: the chosen thresholds, their calibration-split outcome, and the search."""

    thresholds: Thresholds
    evaluation: Evaluation
    constraint: str
    alpha: float
    delta: float
    min_accepted: int
    levels: int
    search_similarity: bool
    combinations: int
    calib_upper_bound: float

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.evaluation.to_dict(),
            "constraint": self.constraint,
            "alpha": self.alpha,
            "delta": self.delta,
            "min_accepted": self.min_accepted,
            "levels": self.levels,
            "search_similarity": self.search_similarity,
            "combinations": self.combinations,
            "calib_upper_bound": self.calib_upper_bound,
        }


def _levels(values: np.ndarray, levels: int) -> np.ndarray:
    """Up to ``levels`` distinct observed values at evenly spaced quantiles (always incl. min and max)."""
    qs = np.quantile(values, np.linspace(0.0, 1.0, levels), method="lower")
    return np.unique(np.concatenate([qs, [values.min(), values.max()]]))


def _search(
    feats: np.ndarray,
    usable: np.ndarray,
    unsafe: np.ndarray,
    group_idx: np.ndarray,
    starts: np.ndarray,
    grids: list[np.ndarray],
    alpha: float,
    delta: float,
    constraint: str,
    min_accepted: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Evaluate every threshold combination; return (feasible combos [F, D] best first, n_acc [F], k [F], total).

    Rows must be sorted by request, then by descending similarity: the first passing row of a request is the
    accepted one (exact similarity ties are settled later by the exact re-check).
    """
    N, D = feats.shape
    sizes = [len(g) for g in grids]
    total = int(np.prod(sizes))
    batch = max(1, int(2_000_000 // max(N, 1)))
    keep_c: list[np.ndarray] = []
    keep_n: list[np.ndarray] = []
    keep_k: list[np.ndarray] = []
    keep_r: list[np.ndarray] = []
    unsafe_i = unsafe.astype(np.int64)
    for lo in range(0, total, batch):
        flat = np.arange(lo, min(total, lo + batch))
        idx = np.stack(np.unravel_index(flat, sizes), axis=1)  # [B, D] level indices
        thr = np.stack([grids[d][idx[:, d]] for d in range(D)], axis=1)  # [B, D]
        ok = np.broadcast_to(usable, (len(flat), N)).copy()
        for d in range(D):
            ok &= feats[None, :, d] <= thr[:, d : d + 1]
        cs = np.cumsum(ok, axis=1, dtype=np.int32)
        before = np.concatenate([np.zeros((len(flat), 1), np.int32), cs], axis=1)[:, starts]  # [B, G]
        first = ok & ((cs - before[:, group_idx]) == 1)
        n_acc = first.sum(axis=1)
        k = first.astype(np.int64) @ unsafe_i
        # the same expression as Evaluation.unsafe_rate <= alpha, so search and exact re-check agree
        feas = (n_acc >= min_accepted) & (n_acc > 0) & ((k / np.maximum(n_acc, 1)) <= alpha)
        if constraint == "bound" and np.any(feas):
            ub = _cp_upper_vec(k[feas], n_acc[feas], delta)
            sub = np.flatnonzero(feas)
            feas[sub[ub > alpha]] = False
        if np.any(feas):
            keep_c.append(thr[feas])
            keep_n.append(n_acc[feas])
            keep_k.append(k[feas])
            # tightness = mean relative level position; lower = tighter thresholds (more conservative)
            keep_r.append((idx[feas] / np.maximum(np.array(sizes) - 1, 1)).mean(axis=1))
    if not keep_c:
        return np.zeros((0, D)), np.zeros(0, np.int64), np.zeros(0, np.int64), total
    c, n, k, r = (np.concatenate(x) for x in (keep_c, keep_n, keep_k, keep_r))
    order = np.lexsort((r, k, -n))  # most accepted, then fewest unsafe, then tightest
    return c[order], n[order], k[order], total


def _prepare(pairs: Sequence[LabelledPair]) -> tuple[list[LabelledPair], np.ndarray, np.ndarray]:
    rows = sorted(pairs, key=lambda p: (p.request_id, -p.similarity, p.entry_id))
    rid = [p.request_id for p in rows]
    starts = np.array([i for i in range(len(rows)) if i == 0 or rid[i] != rid[i - 1]], dtype=np.int64)
    group_idx = np.cumsum(np.isin(np.arange(len(rows)), starts)) - 1
    return rows, starts, group_idx


def _check_alpha_delta(alpha: float, delta: float) -> None:
    if not 0.0 < alpha < 1.0:
        raise CalibrationError(f"α must be in (0, 1), got {alpha}")
    if not 0.0 < delta < 1.0:
        raise CalibrationError(f"δ must be in (0, 1), got {delta}")


def calibrate(
    pairs: Sequence[LabelledPair],
    alpha: float = 0.05,
    delta: float = 0.1,
    *,
    constraint: Constraint = "bound",
    levels: int = 12,
    search_similarity: bool = False,
    min_accepted: int | None = None,
) -> Calibration:
    """Thresholds maximising coverage on ``pairs`` subject to the constraint (module docstring).

    Guarantee: the returned thresholds give k/n ≤ α on ``pairs`` (exact per-request evaluation) and
    n ≥ ``min_accepted``. Raises :class:`CalibrationError` when no setting qualifies (the message gives the best
    coverage any setting reaches and what to change).
    """
    _check_alpha_delta(alpha, delta)
    if constraint not in ("bound", "empirical"):
        raise CalibrationError(f"constraint must be 'bound' or 'empirical', got {constraint!r}")
    if levels < 2:
        raise CalibrationError(f"levels must be ≥ 2, got {levels}")
    n_min = min_accepted_for_certificate(alpha, delta) if min_accepted is None else int(min_accepted)
    n_min = max(n_min, 1)
    rows, starts, group_idx = _prepare(pairs)
    usable = np.array([not p.missing for p in rows])
    if not usable.any():
        raise CalibrationError("every calibration pair has a named object missing on one side: nothing can be accepted")
    feats = np.array([p.vector() for p in rows], dtype=np.float64)
    sims = np.array([p.similarity for p in rows], dtype=np.float64)
    unsafe = np.array([p.unsafe for p in rows])
    grids = [_levels(feats[usable, d], levels) for d in range(len(AXES))]
    if search_similarity:
        dist = np.array([prompt_distance(s) for s in sims])
        feats = np.concatenate([feats, dist[:, None]], axis=1)
        # +inf distance threshold = "no similarity condition"
        grids.append(np.concatenate([_levels(dist[usable], levels), [np.inf]]))
    combos, n_acc, k, total = _search(
        feats, usable, unsafe, group_idx, starts, grids, alpha, delta, constraint, n_min
    )
    for thr in combos:
        min_sim = None
        if search_similarity and math.isfinite(thr[4]):
            min_sim = 1.0 - float(thr[4])
        th = Thresholds(*(float(v) for v in thr[:4]), min_similarity=min_sim)
        ev = evaluate(th, rows)
        ub = clopper_pearson_upper(ev.k_unsafe, ev.n_accepted, delta)
        ok = ev.n_accepted >= n_min and ev.unsafe_rate <= alpha and (constraint != "bound" or ub <= alpha)
        if ok:
            return Calibration(th, ev, constraint, alpha, delta, n_min, levels, search_similarity, total, ub)
    n_req = len(starts)
    base_rate = float(unsafe.mean()) if len(unsafe) else 0.0
    raise CalibrationError(
        f"no threshold setting satisfies the {constraint!r} constraint at α={alpha}, δ={delta} on "
        f"{n_req} calibration requests ({len(rows)} pairs, {base_rate:.1%} of them unsafe; at least {n_min} "
        f"accepted requests are needed for a certificate to be possible). Label more requests, relax α, or "
        f"(for exploration) use constraint='empirical'."
    )


def calibrate_prompt_only(
    pairs: Sequence[LabelledPair], alpha: float = 0.05, delta: float = 0.1, *, constraint: Constraint = "bound",
    levels: int = 50
) -> tuple[float, Evaluation]:
    """Calibrate the prompt-only (NIRVANA-style) similarity threshold under the same constraint, for comparison.

    Returns (threshold, calibration-split evaluation). Raises :class:`CalibrationError` if none qualifies.
    """
    _check_alpha_delta(alpha, delta)
    n_min = min_accepted_for_certificate(alpha, delta)
    groups = _by_request(pairs)
    sims = np.unique([p.similarity for p in pairs])
    cands = np.unique(np.quantile(sims, np.linspace(0, 1, levels), method="lower"))
    best: tuple[int, int, float, Evaluation] | None = None
    for t in cands[::-1]:  # high to low threshold = growing coverage
        ev = evaluate_prompt_only(float(t), pairs)
        ub = clopper_pearson_upper(ev.k_unsafe, ev.n_accepted, delta)
        ok = ev.n_accepted >= n_min and ev.unsafe_rate <= alpha and (constraint != "bound" or ub <= alpha)
        if ok and (best is None or (ev.n_accepted, -ev.k_unsafe, t) > (best[0], -best[1], best[2])):
            best = (ev.n_accepted, ev.k_unsafe, float(t), ev)
    if best is None:
        raise CalibrationError(
            f"no prompt-similarity threshold satisfies the {constraint!r} constraint at α={alpha}, δ={delta} on "
            f"{len(groups)} requests"
        )
    return best[2], best[3]


# --------------------------------------------------------------------------------------------- certification


@dataclass(frozen=True)
class Certificate:
    """Certification of fixed thresholds on a disjoint split: n accepted, k unsafe, U, α, δ, passed (U ≤ α)."""

    n: int
    k: int
    upper_bound: float
    alpha: float
    delta: float
    n_requests: int = 0
    method: str = field(default="one-sided Clopper-Pearson: U = Beta^-1(1 - delta; k + 1, n - k)")

    @property
    def passed(self) -> bool:
        return self.upper_bound <= self.alpha

    @property
    def coverage(self) -> float:
        return self.n / self.n_requests if self.n_requests else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "k": self.k,
            "upper_bound": self.upper_bound,
            "alpha": self.alpha,
            "delta": self.delta,
            "passed": self.passed,
            "n_requests": self.n_requests,
            "coverage": self.coverage,
            "method": self.method,
        }

    def line(self) -> str:
        """One human-readable line, e.g. for the README and node outputs."""
        verdict = "HOLDS" if self.passed else "FAILS"
        return (
            f"certificate {verdict}: {self.k} unsafe of {self.n} accepted "
            f"({self.n_requests} certification requests, coverage {self.coverage:.1%}); "
            f"U = {self.upper_bound:.4f} {'≤' if self.passed else '>'} α = {self.alpha} at δ = {self.delta}"
        )


def certify(thresholds: Thresholds, pairs_cert: Sequence[LabelledPair], alpha: float = 0.05,
            delta: float = 0.1) -> Certificate:
    """Apply fixed thresholds to the certification split and bound the unsafe rate among accepted reuses."""
    _check_alpha_delta(alpha, delta)
    ev = evaluate(thresholds, pairs_cert)
    return Certificate(
        n=ev.n_accepted,
        k=ev.k_unsafe,
        upper_bound=clopper_pearson_upper(ev.k_unsafe, ev.n_accepted, delta),
        alpha=float(alpha),
        delta=float(delta),
        n_requests=ev.n_requests,
    )
