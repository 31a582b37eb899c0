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

import functools
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping, Sequence

import numpy as np
from scipy.stats import beta as _beta

from .bounds import (
    clopper_pearson_upper,
    excess_upper_bound,
    excess_upper_bound_approx,
    min_accepted_for_certificate,
)
from .discrepancy import AXES, Discrepancies
from .strata import EXACT, STRATA
from .thresholds import Thresholds, prompt_distance, select_best

Constraint = Literal["bound", "empirical"]

#: Recognised values of a pair's optional "change" field: a stratum, or "exact" (never certified).
CHANGE_NAMES: tuple[str, ...] = STRATA + (EXACT,)

#: Recognised values of a pair's optional "split" field.
CALIB_SPLITS = ("calib", "calibration")
CERT_SPLITS = ("cert", "certification", "test")


class CalibrationError(ValueError):
    """No threshold setting satisfies the constraint (or the data cannot be used); the message says why."""


# --------------------------------------------------------------------------------------------- the bound

#: What a certificate bounds (module :mod:`.bounds`): "excess" = (b − c)/n, reuse charged only for failures it adds
#: over the dense output of the same request and seed; "unsafe" = b/n (the first label; kept so older rule files
#: still verify).
LABELS = ("excess", "unsafe")

_METHODS = {
    "unsafe": "one-sided Clopper-Pearson: U = Beta^-1(1 - delta; k + 1, n - k)",
    "excess": "exact unconditional paired bound on (b - c)/n (risk/bounds.py: excess_upper_bound)",
}


@functools.lru_cache(maxsize=1024)
def certificate_bound(label: str, n: int, k: int, c: int, delta: float) -> float:
    """The certified upper bound for a label: U on b/n ("unsafe") or on (b − c)/n ("excess").

    Memoised: a pure function of its arguments, and the exact excess bound costs ~0.1 s at n ≈ 150. Every rule
    load re-verifies its certificate and strata with it (the Risk Filter node loads the rule file per request),
    which cost ~0.3 s of every request's latency before the memo.
    """
    if label == "unsafe":
        return clopper_pearson_upper(k, n, delta)
    if label == "excess":
        return excess_upper_bound(n, k, c, delta)
    raise ValueError(f"unknown certificate label {label!r}: use one of {LABELS}")


def _vec_bound(label: str, n: np.ndarray, k: np.ndarray, c: np.ndarray, delta: float) -> np.ndarray:
    """Vectorised bound for the calibration search: exact for "unsafe", the normal approximation for "excess"
    (selection only; the certificate is always exact)."""
    if label == "unsafe":
        return _cp_upper_vec(k, n, delta)
    return np.asarray(excess_upper_bound_approx(n, k, c, delta), dtype=np.float64)


def _cp_upper_vec(k: np.ndarray, n: np.ndarray, delta: float) -> np.ndarray:
    """Vectorised :func:`clopper_pearson_upper` (same conventions)."""
    k = np.asarray(k, dtype=np.float64)
    n = np.asarray(n, dtype=np.float64)
    out = np.ones(np.broadcast(k, n).shape, dtype=np.float64)
    ok = k < n
    if np.any(ok):
        out[ok] = _beta.ppf(1.0 - delta, k[ok] + 1.0, n[ok] - k[ok])
    return out


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
    better: bool = False  # c: the reuse output passes where the dense output of the same request fails
    stratum: str | None = None  # e.g. "1obj/paraphrase": certificates are also reported per stratum
    # False: the sampler did not reuse this candidate (its changed region exceeded ``ReuseConfig.max_active``, so
    # it continued dense). Serving picks the best passing candidate and then continues dense, so a request whose
    # selected candidate is not reusable is a miss: it never counts as accepted (and never tries the next one).
    reusable: bool = True
    # What changed against the candidate (risk.strata.stratum_of: "reseed", "colour", ...; "exact" for an exact
    # repeat). Per-stratum certificates (:func:`certify_strata`) group by it. None = not recorded.
    change: str | None = None

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
        if self.better:
            row["better"] = True
        if self.stratum is not None:
            row["stratum"] = self.stratum
        if not self.reusable:
            row["reusable"] = False
        if self.change is not None:
            row["change"] = self.change
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
    better = _flag(row, "better", where) if "better" in row else False
    reusable = _flag(row, "reusable", where) if "reusable" in row else True
    unsafe = _flag(row, "unsafe", where)
    if better and unsafe:
        raise CalibrationError(f"{where}: 'unsafe' (reuse fails where dense passes) and 'better' (reuse passes where "
                               "dense fails) cannot both be true")
    stratum = row.get("stratum")
    if stratum is not None and (not isinstance(stratum, str) or not stratum or len(stratum) > 200):
        raise CalibrationError(f"{where}: field 'stratum' must be a non-empty string (≤ 200 characters) or absent")
    change = row.get("change")
    if change is not None and change not in CHANGE_NAMES:
        raise CalibrationError(f"{where}: field 'change' must be one of {CHANGE_NAMES} (risk.strata) or absent, got "
                               f"{change!r}")
    return LabelledPair(
        request_id=str(row["request_id"]),
        entry_id=str(row["entry_id"]),
        similarity=_num(row, "similarity", where, nonneg=False),
        context=_num(row, "context", where, nonneg=True),
        size=_num(row, "size", where, nonneg=True),
        shape=_num(row, "shape", where, nonneg=True),
        appearance=_num(row, "appearance", where, nonneg=True),
        missing=_flag(row, "missing", where),
        unsafe=unsafe,
        split=split,
        better=better,
        stratum=stratum,
        reusable=reusable,
        change=change,
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
    k_better: int = 0

    @property
    def coverage(self) -> float:
        return self.n_accepted / self.n_requests if self.n_requests else 0.0

    @property
    def unsafe_rate(self) -> float:
        """Unsafe among accepted (0 when nothing is accepted)."""
        return self.k_unsafe / self.n_accepted if self.n_accepted else 0.0

    @property
    def excess_rate(self) -> float:
        """(b − c)/n among accepted (0 when nothing is accepted)."""
        return (self.k_unsafe - self.k_better) / self.n_accepted if self.n_accepted else 0.0

    def rate(self, label: str) -> float:
        return self.excess_rate if label == "excess" else self.unsafe_rate

    def to_dict(self) -> dict[str, Any]:
        return {
            "n_requests": self.n_requests,
            "n_accepted": self.n_accepted,
            "k_unsafe": self.k_unsafe,
            "k_better": self.k_better,
            "coverage": self.coverage,
            "unsafe_rate": self.unsafe_rate,
            "excess_rate": self.excess_rate,
        }


def _by_request(pairs: Sequence[LabelledPair]) -> dict[str, list[LabelledPair]]:
    groups: dict[str, list[LabelledPair]] = {}
    for p in pairs:
        groups.setdefault(p.request_id, []).append(p)
    return groups


def accepted_pairs(thresholds: Thresholds, pairs: Sequence[LabelledPair]) -> tuple[int, list[LabelledPair]]:
    """(number of requests, the pair the signature rule reuses for each accepted request) — the decision
    :func:`.filter.decide` makes followed by the sampler's ``max_active`` gate (a non-reusable choice is a miss)."""
    groups = _by_request(pairs)
    out = []
    for group in groups.values():
        passing = []
        for i, p in enumerate(group):
            if p.missing:
                continue
            if all(c.passed for c in thresholds.checks(p.vector(), p.similarity)):
                passing.append((i, p.similarity, thresholds.normalised(p.vector()), p.entry_id))
        best = select_best(passing)
        if best is not None and group[best].reusable:
            out.append(group[best])
    return len(groups), out


def evaluate(thresholds: Thresholds, pairs: Sequence[LabelledPair]) -> Evaluation:
    """Exact per-request evaluation of the signature rule (the decision :func:`.filter.decide` makes)."""
    n_req, acc = accepted_pairs(thresholds, pairs)
    return Evaluation(n_req, len(acc), sum(int(p.unsafe) for p in acc), sum(int(p.better) for p in acc))


def prompt_only_accepted(threshold: float, pairs: Sequence[LabelledPair]) -> tuple[int, list[LabelledPair]]:
    """(number of requests, the pair prompt-only acceptance reuses for each accepted request): the most similar
    candidate, if similarity ≥ threshold (ties in similarity broken by entry_id, as the filter does) and the
    sampler's ``max_active`` gate lets it reuse. Signatures and missing objects are ignored."""
    groups = _by_request(pairs)
    limit = prompt_distance(threshold)
    out = []
    for group in groups.values():
        top = select_best((i, p.similarity, 0.0, p.entry_id) for i, p in enumerate(group))
        if top is not None and prompt_distance(group[top].similarity) <= limit and group[top].reusable:
            out.append(group[top])
    return len(groups), out


def evaluate_prompt_only(threshold: float, pairs: Sequence[LabelledPair]) -> Evaluation:
    """Per-request evaluation of prompt-only acceptance (:func:`prompt_only_accepted`)."""
    n_req, acc = prompt_only_accepted(threshold, pairs)
    return Evaluation(n_req, len(acc), sum(int(p.unsafe) for p in acc), sum(int(p.better) for p in acc))


@dataclass(frozen=True)
class PairedComparison:
    """Two acceptance policies judged on the same requests (McNemar-style, per request).

    A request's score under a policy is +1 if the policy reuses and the reuse is unsafe (b), −1 if the reuse is
    better than dense (c), 0 if it is neither or the policy serves the request dense — so a policy's summed scores
    are its b − c. ``a_worse`` counts requests whose score under A is higher than under B, ``b_worse`` the
    reverse; requests where both agree carry no information about which policy is safer. ``p_one_sided`` is the
    exact sign test of "A is no worse than B": P(X ≥ a_worse) for X ~ Binomial(a_worse + b_worse, 1/2)."""

    requests: int
    a_accepted: int
    b_accepted: int
    both_accepted: int
    a_worse: int
    b_worse: int
    p_one_sided: float
    a_worse_ids: tuple[str, ...] = ()  # the discordant requests themselves (sorted), for a report by kind
    b_worse_ids: tuple[str, ...] = ()


def sign_test_p(worse: int, better: int) -> float:
    """Exact one-sided sign test: P(X ≥ worse) for X ~ Binomial(worse + better, 1/2); 1.0 when no request is
    discordant."""
    if worse < 0 or better < 0:
        raise ValueError(f"sign_test_p: counts must be non-negative, got {worse} and {better}")
    d = worse + better
    return sum(math.comb(d, i) for i in range(worse, d + 1)) / 2 ** d if d else 1.0


def compare_paired(accepted_a: Sequence[LabelledPair], accepted_b: Sequence[LabelledPair],
                   n_requests: int) -> PairedComparison:
    """Compare two policies' accepted pairs on the same requests (one pair per accepted request, as
    :func:`prompt_only_accepted` and :func:`accepted_pairs` return them); see :class:`PairedComparison`."""

    def scores(acc: Sequence[LabelledPair]) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in acc:
            if p.request_id in out:
                raise ValueError(f"compare_paired: request {p.request_id!r} is accepted twice by one policy")
            out[p.request_id] = int(p.unsafe) - int(p.better)
        return out

    sa, sb = scores(accepted_a), scores(accepted_b)
    ids = sorted(set(sa) | set(sb))
    a_ids = tuple(r for r in ids if sa.get(r, 0) > sb.get(r, 0))
    b_ids = tuple(r for r in ids if sb.get(r, 0) > sa.get(r, 0))
    return PairedComparison(n_requests, len(sa), len(sb), len(set(sa) & set(sb)), len(a_ids), len(b_ids),
                            sign_test_p(len(a_ids), len(b_ids)), a_ids, b_ids)


#: Above this many tables the heterogeneity test is not enumerated (the χ² approximation is used and said).
_MAX_TABLES = 2_000_000


def runs_heterogeneity(per_run: Sequence[tuple[int, int]]) -> tuple[float, str] | None:
    """p of "every run has the same failure rate", from each run's (n, b) — the clusters' agreement, reported beside
    a certificate that pools the runs (docs/CALIBRATION.md: the unit of independence).

    Exact conditional test (Freeman–Halton, the k-run form of Fisher's): given the runs' sizes and the total number
    of failures B, under equal rates the failures fall on the runs multivariate-hypergeometrically; p is the
    probability of every allocation no more likely than the observed one (for two runs it equals Fisher's two-sided
    p). Returns ``(p, "exact")``, or ``(p, "chi2")`` from Pearson's χ² when the allocations are too many to
    enumerate; ``None`` when fewer than two runs have data or nobody failed (B = 0: nothing to compare).
    """
    runs = [(int(n), int(b)) for n, b in per_run if n > 0]
    if len(runs) < 2:
        return None
    for n, b in runs:
        if not 0 <= b <= n:
            raise ValueError(f"runs_heterogeneity: a run has b = {b} of n = {n}")
    total_n, total_b = sum(n for n, _ in runs), sum(b for _, b in runs)
    if total_b == 0 or total_b == total_n:
        return None
    if math.comb(total_b + len(runs) - 1, len(runs) - 1) > _MAX_TABLES:
        from scipy.stats import chi2_contingency

        table = [[b, n - b] for n, b in runs]
        return float(chi2_contingency(table, correction=False)[1]), "chi2"
    # log-probabilities of allocations: sum_i log C(n_i, b_i) - log C(N, B)
    logc = [[math.lgamma(n + 1) - math.lgamma(b + 1) - math.lgamma(n - b + 1) for b in range(n + 1)] for n, _ in runs]
    norm = math.lgamma(total_n + 1) - math.lgamma(total_b + 1) - math.lgamma(total_n - total_b + 1)
    observed = sum(logc[i][b] for i, (_, b) in enumerate(runs))
    tol = 1e-7  # relative: allocations as likely as the observed one (up to rounding) count, as in Fisher's test
    p = 0.0

    def walk(i: int, left: int, acc: float) -> None:
        nonlocal p
        if i == len(runs) - 1:
            if left <= runs[i][0]:
                lp = acc + logc[i][left]
                if lp <= observed + tol * abs(observed) + 1e-12:
                    p += math.exp(lp - norm)
            return
        for b in range(min(left, runs[i][0]) + 1):
            walk(i + 1, left - b, acc + logc[i][b])

    walk(0, total_b, 0.0)
    return min(1.0, p), "exact"


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
    label: str = "unsafe"

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.evaluation.to_dict(),
            "label": self.label,
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
    better: np.ndarray | None = None,
    label: str = "unsafe",
    reusable: np.ndarray | None = None,
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
    better_i = (np.zeros(N, bool) if better is None or label == "unsafe" else better).astype(np.int64)
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
        if reusable is not None:  # the selected candidate continues dense: a miss, not an acceptance
            first &= reusable[None, :]
        n_acc = first.sum(axis=1)
        k = first.astype(np.int64) @ unsafe_i
        kb = first.astype(np.int64) @ better_i
        # the same expression as Evaluation.rate(label) <= alpha, so search and exact re-check agree
        feas = (n_acc >= min_accepted) & (n_acc > 0) & (((k - kb) / np.maximum(n_acc, 1)) <= alpha)
        if constraint == "bound" and np.any(feas):
            ub = _vec_bound(label, n_acc[feas], k[feas], kb[feas], delta)
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
    label: str = "unsafe",
) -> Calibration:
    """Thresholds maximising coverage on ``pairs`` subject to the constraint (module docstring).

    ``label`` chooses the certified quantity (:data:`LABELS`): "unsafe" = b/n, "excess" = (b − c)/n; with
    "excess" the "bound" constraint searches with the normal approximation and re-checks the chosen setting with
    the exact bound.

    Guarantee: the returned thresholds give rate ≤ α on ``pairs`` (exact per-request evaluation) and
    n ≥ ``min_accepted``. Raises :class:`CalibrationError` when no setting qualifies (the message gives the best
    coverage any setting reaches and what to change).
    """
    _check_alpha_delta(alpha, delta)
    if label not in LABELS:
        raise CalibrationError(f"label must be one of {LABELS}, got {label!r}")
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
    better = np.array([p.better for p in rows])
    reusable = np.array([p.reusable for p in rows])
    grids = [_levels(feats[usable, d], levels) for d in range(len(AXES))]
    if search_similarity:
        dist = np.array([prompt_distance(s) for s in sims])
        feats = np.concatenate([feats, dist[:, None]], axis=1)
        # +inf distance threshold = "no similarity condition"
        grids.append(np.concatenate([_levels(dist[usable], levels), [np.inf]]))
    combos, n_acc, k, total = _search(
        feats, usable, unsafe, group_idx, starts, grids, alpha, delta, constraint, n_min, better, label, reusable
    )
    for thr in combos:
        min_sim = None
        if search_similarity and math.isfinite(thr[4]):
            min_sim = 1.0 - float(thr[4])
        th = Thresholds(*(float(v) for v in thr[:4]), min_similarity=min_sim)
        ev = evaluate(th, rows)
        if label == "unsafe":
            ev = replace(ev, k_better=0)
        ok = ev.n_accepted >= n_min and ev.rate(label) <= alpha
        ub = certificate_bound(label, ev.n_accepted, ev.k_unsafe, ev.k_better, delta) if ok else 1.0
        if ok and (constraint != "bound" or ub <= alpha):
            return Calibration(th, ev, constraint, alpha, delta, n_min, levels, search_similarity, total, ub, label)
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
    levels: int = 50, label: str = "unsafe",
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
        if label == "unsafe":
            ev = replace(ev, k_better=0)
        ok = ev.n_accepted >= n_min and ev.rate(label) <= alpha
        if ok and constraint == "bound":
            ok = certificate_bound(label, ev.n_accepted, ev.k_unsafe, ev.k_better, delta) <= alpha
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
    """Certification of fixed thresholds on a disjoint split.

    n accepted requests, k = b of them unsafe (reuse fails where dense passes), c of them better (reuse passes
    where dense fails); ``upper_bound`` is U for the certified ``label`` (:func:`certificate_bound`), and
    ``unsafe_upper_bound`` the Clopper–Pearson bound on b/n reported beside it. ``strata``: the same certificate
    restricted to each stratum (scene kind, request kind); ``required_strata`` must each pass on their own for the
    certificate to pass.
    """

    n: int
    k: int
    upper_bound: float
    alpha: float
    delta: float
    n_requests: int = 0
    method: str = field(default=_METHODS["unsafe"])
    c: int = 0
    label: str = "unsafe"
    unsafe_upper_bound: float | None = None
    strata: Mapping[str, "Certificate"] = field(default_factory=dict)
    required_strata: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        if self.upper_bound > self.alpha:
            return False
        return all(name in self.strata and self.strata[name].passed for name in self.required_strata)

    @property
    def coverage(self) -> float:
        return self.n / self.n_requests if self.n_requests else 0.0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
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
        if self.label != "unsafe":  # the first label's files stay byte-identical
            out.update(label=self.label, c=self.c, unsafe_upper_bound=self.unsafe_upper_bound)
        if self.strata:
            out["strata"] = {name: cert.to_dict() for name, cert in sorted(self.strata.items())}
        if self.required_strata:
            out["required_strata"] = list(self.required_strata)
        return out

    @classmethod
    def from_dict(cls, c: Any, where: str = "certificate") -> "Certificate":
        """Validate a certificate document; the bounds are recomputed, not trusted (a hand-edited number must not
        pass as a certificate). Raises ValueError with a message naming the field."""
        if not isinstance(c, Mapping):
            raise ValueError(f"{where} must be an object")
        for key in ("n", "k", "n_requests") + (("c",) if "c" in c else ()):
            if not isinstance(c.get(key), int) or isinstance(c.get(key), bool) or c[key] < 0:
                raise ValueError(f"{where}.{key} must be an integer ≥ 0, got {c.get(key)!r}")
        for key in ("upper_bound", "alpha", "delta"):
            v = c.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{where}.{key} must be a number, got {v!r}")
        label = c.get("label", "unsafe")
        if label not in LABELS:
            raise ValueError(f"{where}.label must be one of {LABELS}, got {label!r}")
        k, n, nreq, cc = c["k"], c["n"], c["n_requests"], int(c.get("c", 0))
        if not (k + cc <= n <= nreq):
            raise ValueError(f"{where} needs k ≤ n ≤ n_requests and k + c ≤ n, got k={k}, c={cc}, n={n}, "
                             f"n_requests={nreq}")
        if not (0 < c["alpha"] < 1 and 0 < c["delta"] < 1):
            raise ValueError(f"{where} α and δ must be in (0, 1), got α={c['alpha']}, δ={c['delta']}")
        expect = certificate_bound(label, n, k, cc, c["delta"])
        if abs(float(c["upper_bound"]) - expect) > 1e-9:
            raise ValueError(
                f"{where}.upper_bound {c['upper_bound']} does not match {_METHODS[label]} = {expect:.6f} for "
                f"k={k}, c={cc}, n={n}, δ={c['delta']} (edited by hand or corrupted)"
            )
        strata_doc = c.get("strata", {})
        if not isinstance(strata_doc, Mapping):
            raise ValueError(f"{where}.strata must be an object")
        strata = {str(name): cls.from_dict(doc, f"{where}.strata[{name!r}]") for name, doc in strata_doc.items()}
        required = c.get("required_strata", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ValueError(f"{where}.required_strata must be a list of stratum names")
        cert = cls(
            n=n, k=k, upper_bound=expect, alpha=float(c["alpha"]), delta=float(c["delta"]), n_requests=nreq,
            method=_METHODS[label], c=cc, label=label,
            unsafe_upper_bound=clopper_pearson_upper(k, n, c["delta"]) if label != "unsafe" else None,
            strata=strata, required_strata=tuple(required),
        )
        if "passed" in c and bool(c["passed"]) != cert.passed:
            raise ValueError(f"{where}.passed is {c['passed']} but the recomputed certificate says {cert.passed}")
        return cert

    def line(self) -> str:
        """One human-readable line, e.g. for the README and node outputs."""
        verdict = "HOLDS" if self.passed else "FAILS"
        ok = self.upper_bound <= self.alpha
        if self.label == "excess":
            what = (f"excess failure (b − c)/n = ({self.k} − {self.c})/{self.n} accepted "
                    f"({self.n_requests} certification requests, coverage {self.coverage:.1%}); "
                    f"U = {self.upper_bound:.4f} {'≤' if ok else '>'} α = {self.alpha} at δ = {self.delta}; "
                    f"b/n alone: U = {self.unsafe_upper_bound:.4f}")
        else:
            what = (f"{self.k} unsafe of {self.n} accepted ({self.n_requests} certification requests, coverage "
                    f"{self.coverage:.1%}); U = {self.upper_bound:.4f} {'≤' if ok else '>'} α = {self.alpha} at "
                    f"δ = {self.delta}")
        failed = [r for r in self.required_strata if not (r in self.strata and self.strata[r].passed)]
        tail = f"; required strata failing: {', '.join(failed)}" if failed else ""
        return f"certificate {verdict}: {what}{tail}"


def _make_certificate(ev: Evaluation, alpha: float, delta: float, label: str) -> Certificate:
    k_better = ev.k_better if label == "excess" else 0
    return Certificate(
        n=ev.n_accepted,
        k=ev.k_unsafe,
        upper_bound=certificate_bound(label, ev.n_accepted, ev.k_unsafe, k_better, delta),
        alpha=float(alpha),
        delta=float(delta),
        n_requests=ev.n_requests,
        method=_METHODS[label],
        c=k_better,
        label=label,
        unsafe_upper_bound=clopper_pearson_upper(ev.k_unsafe, ev.n_accepted, delta) if label != "unsafe" else None,
    )


def certify(thresholds: Thresholds, pairs_cert: Sequence[LabelledPair], alpha: float = 0.05, delta: float = 0.1,
            label: str = "unsafe", required_strata: Sequence[str] = ()) -> Certificate:
    """Apply fixed thresholds to the certification split and bound the certified rate among accepted reuses.

    When the pairs carry a ``stratum``, a certificate per stratum is attached (each a valid bound for the traffic
    of that stratum alone; a name "a/b" also counts in stratum "a"); ``required_strata`` must each pass on their
    own for the certificate to pass.
    """
    _check_alpha_delta(alpha, delta)
    if label not in LABELS:
        raise CalibrationError(f"label must be one of {LABELS}, got {label!r}")
    cert = _make_certificate(evaluate(thresholds, pairs_cert), alpha, delta, label)
    by_stratum: dict[str, list[LabelledPair]] = {}
    for p in pairs_cert:
        if p.stratum is not None:
            # "1obj/paraphrase" is counted in "1obj" and in "1obj/paraphrase": a scene kind certifies as a whole
            # and per request kind
            parts = p.stratum.split("/")
            for i in range(1, len(parts) + 1):
                by_stratum.setdefault("/".join(parts[:i]), []).append(p)
    missing = [r for r in required_strata if r not in by_stratum]
    if missing:
        raise CalibrationError(f"required strata {missing} have no certification requests (strata present: "
                               f"{sorted(by_stratum)})")
    strata = {name: _make_certificate(evaluate(thresholds, ps), alpha, delta, label)
              for name, ps in sorted(by_stratum.items())}
    return replace(cert, strata=strata, required_strata=tuple(required_strata))


# --------------------------------------------------------------------------------------------- per-stratum

#: How the multiplicity over strata is handled (recorded in every strata certificate).
STRATA_METHOD = "fixed-sequence"
#: The unit of independence the strata certificates assume (recorded with them; docs/CALIBRATION.md).
STRATA_UNIT = ("the request, conditional on its run's cache: within a run the queries are drawn independently given "
               "the warm set; runs (caches) are pooled per stratum, and each run's own counts are listed")
#: The unit when the cached entry's clustering is accounted for as well (``certify_strata(entry_unit=True)``).
STRATA_UNIT_ENTRY = (STRATA_UNIT + "; and the cached entry: a stratum is claimed only when the Rao–Scott bound with "
                     "the requests of one cached entry as a cluster (design effect over entries) is ≤ α as well")


def design_effect(clusters: Sequence[tuple[int, int]]) -> float:
    """Rao–Scott design effect of a failure proportion over clustered requests, floored at 1.

    ``clusters``: one (n_j, b_j) per cluster (here a cached entry: the requests whose chosen candidate was that
    entry, and how many of them failed). deff = v_cluster / v_srs: the ratio estimator's between-cluster variance,
    m/(m−1) · Σ (b_j − p̂ n_j)² / N², over the binomial variance p̂(1 − p̂)/N the request-unit bound assumes. Failures
    spread one per entry give deff ≈ 1; failures that come in bursts on one entry give deff > 1 (the requests of that
    entry are not independent evidence). With fewer than two clusters or no failure, 1.
    """
    m = len(clusters)
    n = sum(int(c[0]) for c in clusters)
    b = sum(int(c[1]) for c in clusters)
    if m < 2 or n == 0 or b == 0 or b == n:
        return 1.0
    p = b / n
    v_clu = m / (m - 1) * sum((bj - p * nj) ** 2 for nj, bj in clusters) / n ** 2
    v_srs = p * (1 - p) / n
    return max(1.0, v_clu / v_srs)


def entry_unit_bound(clusters: Sequence[tuple[int, int]], delta: float) -> tuple[float, float]:
    """(deff, U): the upper (1 − δ) bound on the failure rate p_b with the cached entry as the unit of dependence.

    Rao–Scott: the counts are divided by the design effect (:func:`design_effect`), N' = N/deff, b' = b/deff, and the
    Clopper–Pearson upper bound is taken at those (continuous) effective counts, U = Beta⁻¹(1 − δ; b' + 1, N' − b').
    It bounds p_b, hence the excess p_b − p_c (c is ignored: conservative). This is the large-sample correction of
    survey statistics, not an exact bound: it is used only to *withdraw* strata whose request-unit certificate rests
    on failures that cluster on one cached entry (it can refuse a stratum, never admit one).
    """
    n = sum(int(c[0]) for c in clusters)
    b = sum(int(c[1]) for c in clusters)
    if n == 0:
        return 1.0, 1.0
    deff = design_effect(clusters)
    n_eff, b_eff = n / deff, b / deff
    if b_eff >= n_eff:
        return deff, 1.0
    return deff, float(_beta.ppf(1.0 - delta, b_eff + 1.0, n_eff - b_eff))


@dataclass(frozen=True)
class StratumCertificate:
    """One stratum's certificate under the rule's decisions: n accepted requests whose chosen candidate is in this
    stratum, k = b unsafe, c better, U the exact bound for the label at the full δ (fixed-sequence testing),
    ``tested`` False when an earlier stratum of the order failed (then never certified), ``passed`` ⇔ tested and
    U ≤ α — and, when ``clusters`` is recorded (per cached entry: requests, failures), also the entry-unit bound
    (:func:`entry_unit_bound`) ≤ α, so that a stratum whose failures cluster on one cached entry is not claimed."""

    name: str
    n: int
    k: int
    c: int
    upper_bound: float
    tested: bool
    passed: bool
    clusters: tuple[tuple[int, int], ...] | None = None
    deff: float = 1.0
    entry_upper_bound: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"n": self.n, "k": self.k, "c": self.c, "upper_bound": self.upper_bound,
                               "tested": self.tested, "passed": self.passed}
        if self.clusters is not None:
            out.update({"clusters": [list(c) for c in self.clusters], "deff": self.deff,
                        "entry_upper_bound": self.entry_upper_bound})
        return out


@dataclass(frozen=True)
class StrataCertificate:
    """Per-stratum certificates of fixed thresholds, with the multiplicity over strata handled by
    **fixed-sequence testing**: the strata are tested one at a time in ``order`` (fixed before the data), each at
    the full δ; the first that does not certify stops the sequence, and it and every later one are refused. The
    family-wise error over the certified strata is ≤ δ: a stratum is claimed only when every earlier hypothesis
    was rejected, so the first false claim is always the first error of the sequence.

    The filter's decision is the rule's (best passing candidate among the recalled ones); when the chosen
    candidate's stratum is not certified the request is served dense (no fall-through to another candidate), so
    the accepted pairs — and hence each stratum's counts — do not depend on which strata certify.

    n_requests: certification requests (exact repeats left out: they never reach the filter);
    accepted: requests accepted by the thresholds (any stratum); covered: accepted in a certified stratum.
    runs: per run (the request-id prefix before ":"), per stratum, [n, k, c] — the clusters, for the record.
    """

    order: tuple[str, ...]
    alpha: float
    delta: float
    label: str
    strata: Mapping[str, StratumCertificate]
    n_requests: int
    accepted: int
    runs: Mapping[str, Mapping[str, tuple[int, int, int]]] = field(default_factory=dict)
    method: str = STRATA_METHOD
    unit: str = STRATA_UNIT

    @property
    def certified(self) -> tuple[str, ...]:
        return tuple(s for s in self.order if s in self.strata and self.strata[s].passed)

    @property
    def covered(self) -> int:
        return sum(self.strata[s].n for s in self.certified)

    @property
    def coverage(self) -> float:
        return self.covered / self.n_requests if self.n_requests else 0.0

    def allows(self, stratum: str) -> bool:
        return stratum in self.certified

    def describe(self, stratum: str) -> str:
        """Why a stratum is refused or allowed, in one line (for the filter's verdicts)."""
        st = self.strata.get(stratum)
        if st is None:
            return (f"stratum {stratum!r} was never certified (no certification request of it; certified: "
                    f"{', '.join(self.certified) or 'none'})")
        if not st.tested:
            return (f"stratum {stratum!r} was not tested: an earlier stratum of the fixed sequence failed "
                    f"(certified: {', '.join(self.certified) or 'none'})")
        if st.upper_bound <= self.alpha and st.entry_upper_bound is not None \
                and st.entry_upper_bound > self.alpha:
            return (f"stratum {stratum!r}: (b − c)/n = ({st.k} − {st.c})/{st.n}, U = {st.upper_bound:.4f} ≤ "
                    f"α = {self.alpha}, but its failures cluster on cached entries (design effect {st.deff:.2f}): "
                    f"with the entry as the unit U = {st.entry_upper_bound:.4f} > α")
        rel = "≤" if st.passed else ">"
        return (f"stratum {stratum!r}: (b − c)/n = ({st.k} − {st.c})/{st.n}, U = {st.upper_bound:.4f} {rel} "
                f"α = {self.alpha}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method, "unit": self.unit, "order": list(self.order), "alpha": self.alpha,
            "delta": self.delta, "label": self.label, "n_requests": self.n_requests, "accepted": self.accepted,
            "covered": self.covered, "coverage": self.coverage, "certified": list(self.certified),
            "strata": {name: self.strata[name].to_dict() for name in sorted(self.strata)},
            "runs": {r: {s: list(v) for s, v in sorted(d.items())} for r, d in sorted(self.runs.items())},
        }

    @classmethod
    def from_dict(cls, d: Any, where: str = "strata") -> "StrataCertificate":
        """Validate a strata document: every bound is recomputed and the fixed sequence replayed (a hand-edited
        number or verdict does not pass). Raises ValueError naming the field."""
        if not isinstance(d, Mapping):
            raise ValueError(f"{where} must be an object")
        if d.get("method") != STRATA_METHOD:
            raise ValueError(f"{where}.method must be {STRATA_METHOD!r}, got {d.get('method')!r}")
        order = d.get("order")
        if not isinstance(order, list) or not order or any(s not in STRATA for s in order) \
                or len(set(order)) != len(order):
            raise ValueError(f"{where}.order must list distinct strata of {STRATA}, got {order!r}")
        alpha, delta, label = d.get("alpha"), d.get("delta"), d.get("label", "excess")
        for key, v in (("alpha", alpha), ("delta", delta)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1:
                raise ValueError(f"{where}.{key} must be a number in (0, 1), got {v!r}")
        if label not in LABELS:
            raise ValueError(f"{where}.label must be one of {LABELS}, got {label!r}")
        doc = d.get("strata")
        if not isinstance(doc, Mapping) or any(name not in STRATA for name in doc):
            raise ValueError(f"{where}.strata must be an object keyed by strata of {STRATA}")
        counts = {}
        clusters: dict[str, list[tuple[int, int]]] = {}
        for name, st in doc.items():
            if not isinstance(st, Mapping):
                raise ValueError(f"{where}.strata[{name!r}] must be an object")
            vals = [st.get(k) for k in ("n", "k", "c")]
            if any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in vals) or vals[1] + vals[2] > vals[0]:
                raise ValueError(f"{where}.strata[{name!r}] needs integers n, k, c ≥ 0 with k + c ≤ n, got {vals}")
            counts[name] = tuple(vals)
            if "clusters" in st:
                cl = st["clusters"]
                if not isinstance(cl, list) or any(
                        not isinstance(x, list) or len(x) != 2
                        or any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in x) or x[1] > x[0]
                        for x in cl) or sum(x[0] for x in cl) != vals[0] or sum(x[1] for x in cl) != vals[1]:
                    raise ValueError(f"{where}.strata[{name!r}].clusters must list [requests, failures] per cached "
                                     f"entry summing to n = {vals[0]} and k = {vals[1]}")
                clusters[name] = [tuple(x) for x in cl]
        nreq, acc = d.get("n_requests"), d.get("accepted")
        if any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in (nreq, acc)) \
                or not sum(c[0] for c in counts.values()) <= acc <= nreq:
            raise ValueError(f"{where}: n_requests and accepted must be integers with Σ n ≤ accepted ≤ n_requests, "
                             f"got {nreq!r}, {acc!r}")
        runs = d.get("runs", {})
        if not isinstance(runs, Mapping):
            raise ValueError(f"{where}.runs must be an object")
        cert = fixed_sequence(counts, tuple(order), float(alpha), float(delta), label, int(nreq), int(acc),
                              {str(r): {str(s): tuple(int(x) for x in v) for s, v in dict(rs).items()}
                               for r, rs in runs.items()}, clusters if clusters else None)
        for name, st in doc.items():
            got = cert.strata[name]
            if "upper_bound" in st and abs(float(st["upper_bound"]) - got.upper_bound) > 1e-9:
                raise ValueError(f"{where}.strata[{name!r}].upper_bound {st['upper_bound']} does not match the "
                                 f"recomputed {got.upper_bound:.6f} (edited by hand or corrupted)")
            if "passed" in st and bool(st["passed"]) != got.passed:
                raise ValueError(f"{where}.strata[{name!r}].passed is {st['passed']} but the fixed sequence gives "
                                 f"{got.passed}")
            if "entry_upper_bound" in st and got.entry_upper_bound is not None \
                    and abs(float(st["entry_upper_bound"]) - got.entry_upper_bound) > 1e-9:
                raise ValueError(f"{where}.strata[{name!r}].entry_upper_bound {st['entry_upper_bound']} does not "
                                 f"match the recomputed {got.entry_upper_bound:.6f} (edited by hand or corrupted)")
        if "certified" in d and list(d["certified"]) != list(cert.certified):
            raise ValueError(f"{where}.certified {d['certified']} does not match the fixed sequence's "
                             f"{list(cert.certified)}")
        return cert


def fixed_sequence(counts: Mapping[str, tuple[int, int, int]], order: Sequence[str], alpha: float, delta: float,
                   label: str, n_requests: int, accepted: int,
                   runs: Mapping[str, Mapping[str, tuple[int, int, int]]] | None = None,
                   clusters: Mapping[str, Sequence[tuple[int, int]]] | None = None) -> StrataCertificate:
    """The strata certificate of per-stratum counts ``{stratum: (n, b, c)}`` (see :class:`StrataCertificate`).
    A stratum of ``order`` without pairs has n = 0 and U = 1 (it fails, and stops the sequence there); strata in
    ``counts`` but not in ``order`` are never tested. With ``clusters`` (per stratum, per cached entry: requests,
    failures) a stratum passes only when the entry-unit bound is ≤ α as well (:data:`STRATA_UNIT_ENTRY`)."""
    _check_alpha_delta(alpha, delta)
    out: dict[str, StratumCertificate] = {}

    def one(name: str, n: int, k: int, c: int, going: bool) -> StratumCertificate:
        u = certificate_bound(label, n, k, c if label == "excess" else 0, delta) if n else 1.0
        if clusters is None:
            return StratumCertificate(name, n, k, c, u, going, going and u <= alpha)
        cl = tuple(sorted(tuple(int(v) for v in x) for x in clusters.get(name, ())))
        deff, ue = entry_unit_bound(cl, delta)
        return StratumCertificate(name, n, k, c, u, going, going and u <= alpha and ue <= alpha, cl, deff, ue)

    going = True
    for name in order:
        out[name] = one(name, *counts.get(name, (0, 0, 0)), going)
        going = out[name].passed
    for name, (n, k, c) in counts.items():
        if name not in out:
            out[name] = one(name, n, k, c, False)
    return StrataCertificate(tuple(order), float(alpha), float(delta), label, out, int(n_requests), int(accepted),
                             dict(runs or {}), unit=STRATA_UNIT if clusters is None else STRATA_UNIT_ENTRY)


def certify_strata(thresholds: Thresholds, pairs_cert: Sequence[LabelledPair], order: Sequence[str] = STRATA,
                   alpha: float = 0.05, delta: float = 0.1, label: str = "excess",
                   entry_unit: bool = False) -> StrataCertificate:
    """Certify fixed thresholds per stratum (each pair's ``change``) by fixed-sequence testing in ``order``.

    Requests are those of ``pairs_cert``; a request with an exact-repeat candidate ("exact": same prompt, same
    seed) is left out (in serving it is answered from that entry before the filter). Each accepted request (the rule's
    choice, :func:`accepted_pairs`) counts in its chosen pair's stratum. Raises CalibrationError when a pair has no
    ``change`` (write it with scripts/lab/relabel_pairs.py or risk.strata.stratum_of). ``entry_unit``: also
    require the entry-unit bound (failures clustered on one cached entry count as less evidence; each pair's
    ``entry_id`` is the cluster).
    """
    if label not in LABELS:
        raise CalibrationError(f"label must be one of {LABELS}, got {label!r}")
    bad = sorted({p.request_id for p in pairs_cert if p.change is None})
    if bad:
        raise CalibrationError(f"{len(bad)} request(s) have pairs without a 'change' (stratum), e.g. {bad[:3]}: "
                               "compute it with risk.strata.stratum_of (scripts/lab/relabel_pairs.py writes it)")
    groups = _by_request(pairs_cert)
    keep = [p for ps in groups.values() if not any(q.change == EXACT for q in ps) for p in ps]
    n_req, acc = accepted_pairs(thresholds, keep)
    counts: dict[str, list[int]] = {}
    runs: dict[str, dict[str, list[int]]] = {}
    per_entry: dict[str, dict[str, list[int]]] = {}
    accepted = 0
    for p in acc:
        accepted += 1
        e = per_entry.setdefault(p.change, {}).setdefault(p.entry_id, [0, 0])
        e[0] += 1
        e[1] += int(p.unsafe)
        for d in (counts.setdefault(p.change, [0, 0, 0]),
                  runs.setdefault(p.request_id.split(":", 1)[0] if ":" in p.request_id else "",
                                  {}).setdefault(p.change, [0, 0, 0])):
            d[0] += 1
            d[1] += int(p.unsafe)
            d[2] += int(p.better)
    return fixed_sequence({k: tuple(v) for k, v in counts.items()}, tuple(order), alpha, delta, label, n_req,
                          accepted, {r: {s: tuple(v) for s, v in d.items()} for r, d in runs.items()},
                          {s: [tuple(v) for v in d.values()] for s, d in per_entry.items()} if entry_unit else None)
