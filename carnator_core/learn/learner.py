"""Learning mode: the life of a rule on a model that has none (serve dense → label → certify → reuse → audit).

Per rule namespace (model fingerprint × generation config, ``RiskRule.namespace``) and per stratum (what changed
against the candidate, ``risk.strata``):

1. **Learning.** Requests are served dense (bit-identical to KSampler); exact repeats are answered from the cache.
   Every served request that recalled a candidate records its *covariates* (stratum, the chosen candidate's four
   discrepancies; no outcome). A share of them (``LearnSettings.label_share``, from the compute budget
   ``budget``, default 20 % of the compute served; "Which requests get labelled" below) get a *shadow label*: the
   reuse run the rule-to-be would make with its chosen candidate (``runtime.choose``: among the recalled
   candidates, the one whose kind of change comes first in the order), judged b/c against the clip just served.
2. **Fit.** A stratum's thresholds are fitted from covariates alone: fit j takes per-axis quantiles at level
   ``level·tighten^(j−1)`` of the namespace's first ``min_fit·2^(j−1)`` covariates (the warm-up learner: of the
   stratum's own first that many, ``fit_from``) (or a seed rule's thresholds
   for fit 1). No label outcome enters a fit. A fit whose accepted labels show an excess ≥ α after
   ``fail_after`` labels is replaced by the next, stricter one; a drift (below) replaces it by the next one on
   labels after the drift only.
3. **Pilot, then certify.** The first ``pilot`` served requests with a candidate are a pilot: their labels fix the
   order in which the strata are certified (``pilot_order``: the most frequent stratum first; one whose pilot labels
   already show two more failures than successes last) and are counted by no test. After it, fit j of stratum s is
   tested with ``sequence.BettingSequence`` inside the graph of tests (``build_graph``; ``sequence`` module
   docstring, "Multiplicity"): reuse switches on for the stratum by itself once its test certifies at the level the
   graph gives it now (anytime-valid: checked after every label); a certified stratum passes its level on to the
   next.
4. **Audit.** A share of a switched-on stratum's hits (``audit_share``, default 5 %; ``audit_share_now``: four times
   that while the stratum is young or a drift is suspected) is served dense instead and its reuse labelled against
   it; ``sequence.DriftDetector`` (a restarting e-detector of excess > α) watches these labels, and when it fires
   the stratum is switched off ("off", with the message) and learning resumes with the next fit.

Which requests get labelled (the policy): a served request can be labelled when its chosen candidate the
stratum's current fit would accept (other labels cannot move its certificate), in a stratum not yet switched on,
with a cached entry its test has not counted yet, by a worker whose judge reading is in force. Of those, a coin
decides: ``label_draw`` at ``LearnSettings.label_share`` = budget / ``LABEL_COST`` (1/3 at the default 20 %
budget), drawn from the request key's hash, and skipped while the ledger shows labelling over ``budget`` of the
compute served (``over_budget``; it reads only the past). Neither the coin nor the pause looks at the queue, the
request's risk or any outcome, so the labelled requests are a fair sample of the requests that could be labelled
— a script's queued batch is labelled as often as single requests (``tests/test_learn_validity.py``). The label
runs in the sampler right after the request it labels.

How soon: a stratum needs 86 accepted labels without a failure at the head of the order (α = 0.05, δ = 0.1; the
next one then 81; about 212 when 2 % of its labels fail), and no valid test can do with fewer than 45
(``sequence``). On a stream that spreads over many kinds of change the first switch-on therefore comes after
roughly pilot + 86 / (the head kind's share of requests that give an accepted, reusable label) requests.

The guarantee: P(some (stratum, fit) is ever switched on — or rejected in the graph, passing its level on — while
its population's excess is ≥ α or its b-rate is ≥ ``b_ceiling``) ≤ δ. Each (stratum, fit) is a hypothesis about
one population, and its test counts exactly a fair sample of it:

* **whose requests**: served requests of the stratum whose chosen candidate the fit accepts, made *while the fit
  is the stratum's current one* (labels are made only inside the current fit's thresholds, so a replaced fit's
  test is frozen at the refit, ``fit_window``; a refit counts only labels made after it is recorded);
* **the unit is the cached entry**: a test counts at most one label per cached entry (the first of its labels in
  the fit's window), so a burst of requests recalling one entry (a user iterating on one scene) weighs as one
  draw. The excess certified is the excess over the cached entries the kind's requests recall — each entry once —
  not over requests: a workload whose risky entries are recalled more often than its safe ones is served with a
  request-weighted excess the test does not see (the entries' risks, not their popularity, are certified);
  (The warm-up population's learner is the one exception, "The unit" below.)
* **which of them**: a coin at a share fixed by the settings (``label_draw``, paused only while the ledger is over
  budget), never the queue, the request's risk or an outcome — so a queued batch is labelled as often as a single
  request;
* **the judge reading in force** (below).

The null of (stratum, fit) is that each request of its population — each cached entry's first labelled recall —
has an excess ≥ α (or a b-rate ≥ β) given everything before it; for a stream of independent entries, that the
population's excess over entries is ≥ α. Under it each counted label's conditional mean is ≥ α, because what
selects it (the current fit, the entries already counted, the order, the coin) is fixed before its outcome and
says nothing about it, and the capital is a supermartingale (``sequence``). Drift after a switch-on is watched
separately (``sequence.DriftDetector``): a switch-off, never a switch-on, so it spends none of δ; its false
alarms are bounded by an average run length (``drift_arl`` audits at excess α).
The unit (``Learner(unit=...)``): "entry" — the above — for every traffic namespace, where the requests come as the
user sends them and cluster on cached entries. "label" only for the warm-up population (``warmup.warm_learner``),
whose requests are not the user's but drawn by the idle worker (``idle.draw_edit``): each warm-up label's cached
entry uniformly at random *with replacement* among the namespace's entries that admit an edit of its kind, then a
random edit of that kind, by a generator that reads no label. Given the cache's entries at each draw, the draws
are then i.i.d. from one population — "a random edit of kind k of a uniformly random cached scene" — and so are
the labels (the outcome is a function of the draw and the cache), however often one entry is drawn: sampling with
replacement from a finite population is i.i.d. sampling, and a run of one scene happens only as often as chance
makes it, which the i.i.d. model contains. Under the null "that population's excess is ≥ α at every draw" each
counted label's conditional mean given the past is ≥ α, and the capital is a supermartingale at label level (the
fit's acceptance, the kind's turn and a pre-emption by the queue select draws on the draw and the time, never on
an outcome). A label counts at label level only when its row carries the draw's marker (``Label.iid``): a warm-up
label written before the draw existed (round-robin over entries not yet counted) is counted once per entry, as it
was — and not at all when its entry is already counted — so an old record never gets a weaker test.

One label at a time: the tests count only labels of the judge reading in force (``reading_in_force``: judge +
settings, e.g. the pixel checker's ``checker_version``) — the newest reading the record has ever seen. A reading
seen for the first time takes over, unless the judge's own version numbers say it is older; a reading once
superseded never takes over again. So a record continued under a new judge (an upgrade) starts every test afresh
on the new labels (the old certificates are closed, not carried over: the two labels measure different things),
and a label of an older reading after that — a farm worker not yet upgraded, a rollback — counts for nothing and
revives nothing (tests/test_learn_validity.py). A farm with mixed versions therefore behaves predictably: the
newest reading's labels are the only ones counted, older workers stop labelling (their labels would count for
nothing) and the badge says how many labels of an older reading were not counted. The guarantee holds for each
reading's tests in turn.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ..risk.thresholds import Thresholds
from .labels import Covariate, Label, LabelStore
from .sequence import (
    METHOD,
    BettingSequence,
    DriftDetector,
    GraphProcedure,
    family_delta,
    fit_share,
    labels_needed,
)

log = logging.getLogger("carnator")

try:  # the strata contract (what changed against the candidate); a minimal reading until it is installed
    from ..risk.strata import STRATA, stratum_of
except ImportError:  # pragma: no cover - exercised only on a tree without risk/strata.py
    STRATA = ("reseed", "rewording", "colour", "size", "position", "motion", "background", "object", "count",
              "mixed")

    def stratum_of(target_prompt: str, candidate_prompt: str, *, same_seed: bool) -> str:
        same = " ".join(target_prompt.lower().split()) == " ".join(candidate_prompt.lower().split())
        if same:
            return "exact" if same_seed else "reseed"
        return "mixed"


#: What a test counts as one draw (``Learner``'s ``unit``; module docstring, "The unit").
UNITS = ("entry", "label")

#: A label's compute as a share of the dense request it labels: the counterfactual reuse run (about half a dense
#: run) and the judge — the estimate the budget used before a label's cost was measured (``label_share``).
LABEL_COST = 0.6


@dataclass(frozen=True)
class LearnSettings:
    """How a rule is learned (recorded in the learned rule file).

    alpha, delta:  the certified level: excess (b − c)/n ≤ α with probability ≥ 1 − δ (family-wise).
    budget:        extra compute for shadow labels, as a share of the compute served (0.2 = 20 %).
    audit_share:   share of a switched-on stratum's hits that is run dense and labelled (0.05 = 5 %).
    strata:        how δ is shared by the (stratum, fit) tests (``sequence`` module docstring): "graph" (the
                   default: a graphical procedure over the strata in the pilot's order), "bonferroni" (δ split
                   evenly, fits halving) or "none" (each stratum at the whole δ, as the offline per-stratum
                   certificates; the family-wise guarantee then does not hold).
    pilot:         served requests with a candidate before the order of the strata is fixed ("graph" only); the
                   labels made until then order the strata and are not counted by any test.
    head_weight:   h, the share of δ the first stratum of the order starts with ("graph" only); stratum k starts
                   with h(1 − h)^k (the last with the rest), so an order whose first kind never certifies still
                   leaves the second a quarter of δ; a stratum that certifies passes its share on to the next.
    level:         per-axis covariate quantile of the first fit; ``tighten`` multiplies it at each refit.
    min_fit:       covariates (served requests with a candidate) before the first fit.
    fail_after:    accepted labels after which a fit with an empirical excess ≥ α is replaced.
    max_fits:      fits per stratum (their δ shares 2^−j sum below 1).
    b_ceiling:     β, the b-rate a kind must also be shown below (``sequence``: "The b-rate alone"): a kind switches
                   on only when its excess is certified ≤ α *and* its failure rate p_b ≤ β, both at the same level,
                   so a judge that over-calls dense failures (c) cannot certify a kind whose reuse fails often.
    drift_arl:     the audits' drift detector's threshold (``sequence.DriftDetector``): while a switched-on kind's
                   audited excess is ≤ α a false switch-off comes after at least this many audits on average.
    audit_boost:   the audit share is multiplied by this (at most 1) while a switched-on kind is young (fewer than
                   ``young_audits`` audits of its fit) or a drift is suspected (the detector's statistic at a quarter
                   of ``drift_arl`` or more): fewer hits are served between two audits when a drift is likeliest
                   (``audit_share_now``). 1 = a constant share.
    young_audits:  audits after a switch-on during which the boosted share applies.
    seed_thresholds: thresholds from another rule for fit 1 (the certificate is still earned on own labels).
    """

    alpha: float = 0.05
    delta: float = 0.1
    budget: float = 0.2
    audit_share: float = 0.05
    strata: str = "graph"
    pilot: int = 60
    head_weight: float = 0.5
    level: float = 0.9
    tighten: float = 0.7
    min_fit: int = 20
    fail_after: int = 40
    max_fits: int = 6
    b_ceiling: float = 0.1
    drift_arl: float = 1000.0
    audit_boost: float = 4.0
    young_audits: int = 100
    seed_thresholds: tuple[float, float, float, float] | None = None

    def __post_init__(self) -> None:
        checks = [(0 < self.alpha < 1, "alpha in (0, 1)"), (0 < self.delta < 1, "delta in (0, 1)"),
                  (0 <= self.budget <= 10, "budget in [0, 10]"), (0 <= self.audit_share <= 1, "audit_share in [0, 1]"),
                  (self.strata in ("graph", "bonferroni", "none"), "strata 'graph', 'bonferroni' or 'none'"),
                  (self.pilot >= 0 and 0 < self.head_weight <= 1, "pilot ≥ 0 and head_weight in (0, 1]"),
                  (0 < self.level <= 1 and 0 < self.tighten <= 1, "level and tighten in (0, 1]"),
                  (self.min_fit >= 1 and self.fail_after >= 1 and 1 <= self.max_fits <= 30,
                   "min_fit, fail_after ≥ 1 and max_fits in [1, 30]"),
                  (self.alpha <= self.b_ceiling < 1, "b_ceiling in [alpha, 1)"),
                  (self.drift_arl >= 1, "drift_arl ≥ 1"),
                  (self.audit_boost >= 1 and self.young_audits >= 0, "audit_boost ≥ 1 and young_audits ≥ 0")]
        bad = [what for ok, what in checks if not ok]
        if bad:
            raise ValueError(f"learning settings need {', '.join(bad)}; got {self}")

    @property
    def label_share(self) -> float:
        """The share of the requests that could be labelled that are (``label_draw``): ``budget`` over a label's
        cost as a share of a dense run (``LABEL_COST``), at most 1 — so labelling spends about ``budget`` of the
        compute served when every request could be labelled, and less otherwise."""
        return min(1.0, self.budget / LABEL_COST)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["seed_thresholds"] = list(self.seed_thresholds) if self.seed_thresholds is not None else None
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LearnSettings":
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown learning settings {sorted(unknown)}; known: {sorted(known)}")
        d = dict(d)
        if d.get("seed_thresholds") is not None:
            d["seed_thresholds"] = tuple(float(v) for v in d["seed_thresholds"])
        return cls(**d)


def rule_namespace(model_fingerprint: str, rule_fingerprint: str) -> str:
    """The namespace a rule is learned for (the same formula as ``RiskRule.namespace``)."""
    return f"{model_fingerprint[:16]}-{rule_fingerprint}"


def accepts(th: Thresholds, vector: Sequence[float], missing: bool) -> bool:
    return (not missing) and all(float(v) <= t for v, t in zip(vector, th.vector()))


@dataclass(frozen=True)
class Fit:
    """Fit ``index`` of a stratum: thresholds from covariates alone. Its test uses the labels with id > ``since``
    made while it was the stratum's current fit: those with id ≤ the next fit's ``created`` (``fit_window``).
    ``created``: the record's last label id when the fit was recorded (a record written before this field existed
    reads ``since``)."""

    stratum: str
    index: int
    since: int
    level: float
    thresholds: Thresholds
    source: str  # "covariates" | "seed"
    created: int = -1

    def __post_init__(self) -> None:
        if self.created < 0:
            object.__setattr__(self, "created", self.since)

    def to_dict(self) -> dict[str, Any]:
        return {"stratum": self.stratum, "index": self.index, "since": self.since, "level": self.level,
                "thresholds": self.thresholds.to_dict(), "source": self.source, "created": self.created}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Fit":
        return cls(str(d["stratum"]), int(d["index"]), int(d["since"]), float(d["level"]),
                   Thresholds.from_dict(d["thresholds"]), str(d.get("source", "covariates")),
                   int(d.get("created", d["since"])))


def fit_window(fits: Sequence[Fit]) -> dict[int, tuple[int, float]]:
    """fit index → (since, until): the label ids whose labels its test may count (since < id ≤ until).

    A fit's test counts only labels made while it was its stratum's current fit. Labels are made only for
    requests the *current* fit accepts (``runtime.observe``), so after a refit the older fit's population would
    be sampled only inside the newer (stricter) thresholds — a safer sub-region than the one it is a hypothesis
    about. Its test is therefore frozen at the refit: a replaced fit counts no label after its successor was
    recorded. (Measured before this rule, ``tests/test_learn_validity.py``: a replaced fit 1 whose true excess
    was ≥ α was rejected in 6 of 20 simulated streams, against its level 0.0375.)"""
    ordered = sorted(fits, key=lambda f: f.index)
    out: dict[int, tuple[int, float]] = {}
    for k, fit in enumerate(ordered):
        until = float(ordered[k + 1].created) if k + 1 < len(ordered) else math.inf
        out[fit.index] = (fit.since, until)
    return out


@dataclass
class StratumState:
    """One stratum's state, recomputed from the record (labels, fits, events)."""

    stratum: str
    fit: Fit | None
    sequence: BettingSequence | None
    drift: DriftDetector | None
    state: str  # "learning" | "certified" | "audited" | "off"
    labels: int
    needed: int
    message: str
    covariates: int = 0
    switched_on_at: int = 0  # label id at which it certified (0: not)
    rank: int = -1           # its place in the order the strata are certified in (−1: the pilot runs)
    level: float = 0.0       # the δ its current fit is tested at now (the graph's level; 0 once passed on)
    superseded: int = 0      # its labels of a judge reading other than the one in force (counted by no test)
    entries: frozenset = frozenset()  # the cached entries its current fit's test has counted a label of

    @property
    def on(self) -> bool:
        return self.state in ("certified", "audited")

    def to_dict(self) -> dict[str, Any]:
        return {"stratum": self.stratum, "state": self.state, "labels": self.labels, "needed": self.needed,
                "covariates": self.covariates, "message": self.message, "rank": self.rank,
                "level": round(self.level, 8),
                "fit": self.fit.to_dict() if self.fit is not None else None,
                "sequence": self.sequence.to_dict() if self.sequence is not None else None,
                "drift": self.drift.to_dict() if self.drift is not None else None}


def _quantile_thresholds(covs: Sequence[Covariate], level: float) -> Thresholds | None:
    vecs = np.array([c.vector for c in covs if not c.missing], dtype=np.float64)
    if len(vecs) == 0:
        return None
    q = np.quantile(vecs, level, axis=0, method="higher")
    return Thresholds(*(float(max(v, 0.0)) for v in q))


def estimate_needed(seq: BettingSequence | None, alpha: float, delta: float) -> int:
    """About how many accepted labels the test needs in all: the labels so far plus what the growth rate at the
    observed b/c rates (Kelly's, with the test's cap) needs to reach 1/δ from the capital reached."""
    floor = labels_needed(alpha, delta)
    if seq is None or seq.n == 0:
        return floor
    if seq.certified:
        return seq.n
    pb, pc = seq.b / seq.n, seq.c / seq.n
    # each gambler's growth at the observed rates; the mixture crosses 1/δ once one gambler alone holds
    # (number of gamblers)/δ, so the soonest such gambler bounds the labels still needed
    kelly = min(0.95 / (1 - alpha), max(0.0, (alpha - (pb - pc)) / max(pb + pc, alpha * alpha)))
    lefts = []
    for lam, log_part in zip(seq.gambler_bets(kelly, alpha), seq.log_parts):
        growth = (pb * math.log1p(lam * (alpha - 1)) if pb else 0.0) + (pc * math.log1p(lam * (alpha + 1))) + \
            (1 - pb - pc) * math.log1p(lam * alpha)
        if growth > 1e-6:
            lefts.append((seq.threshold + math.log(len(seq.log_parts)) - log_part) / growth)
    if not lefts:
        return max(floor, 10 * seq.n)  # at this rate the stratum may never certify: say "many"
    left = min(lefts)
    return int(max(floor, seq.n + math.ceil(max(left, 0.0))))


def same_label(a: Label, b: Label | None) -> bool:
    """Whether two labels are the same label: the same judge with the same settings (e.g. the pixel checker's
    ``checker_version``). Labels of different judges or settings measure different things and are never pooled."""
    return b is not None and a.judge == b.judge and dict(a.judge_settings or {}) == dict(b.judge_settings or {})


def _versions(settings: Mapping[str, Any] | None) -> dict[str, float]:
    """The judge's own version numbers among its settings (numeric values of keys that name a version)."""
    return {k: float(v) for k, v in dict(settings or {}).items()
            if "version" in str(k).lower() and isinstance(v, (int, float)) and not isinstance(v, bool)}


def older_reading(judge: str, settings: Mapping[str, Any] | None, than: Label) -> bool:
    """Whether the reading (``judge``, ``settings``) is older than ``than``'s by the judge's own version numbers:
    the same judge, and of the version keys both carry none higher and one lower."""
    if judge != than.judge:
        return False
    mine, theirs = _versions(settings), _versions(than.judge_settings)
    shared = sorted(set(mine) & set(theirs))
    return bool(shared) and all(mine[k] <= theirs[k] for k in shared) and any(mine[k] < theirs[k] for k in shared)


def reading_in_force(labels: Sequence[Label]) -> Label | None:
    """The label whose judge reading (judge + settings) the tests count, from the record alone: the newest
    reading ever seen. Walking the labels in id order, a reading seen for the first time takes over unless it is
    older than the one in force by the judge's own version numbers (``older_reading``); a reading seen before
    never takes over again. Labels are never deleted and ids only grow, so once a newer reading has been seen, no
    later label of an older one — a farm worker not yet upgraded, a rollback — can bring its certificates back,
    and every process derives the same reading."""
    current: Label | None = None
    seen: set[str] = set()
    for lab in sorted(labels, key=lambda x: x.id):
        key = _dump_reading(lab.judge, lab.judge_settings)
        if key in seen:
            continue
        seen.add(key)
        if current is None or not older_reading(lab.judge, lab.judge_settings, current):
            current = lab
    return current


def _dump_reading(judge: str, settings: Mapping[str, Any] | None) -> str:
    return json.dumps([judge, dict(settings or {})], sort_keys=True, default=str)


def first_level(settings: LearnSettings) -> float:
    """The level the first stratum's first fit starts at: δ·h·3/4 under "graph", the stratum's Bonferroni share
    (δ/|STRATA|, halved for fit 1) under "bonferroni", δ/2 under "none"."""
    s = settings
    if s.strata == "graph":
        return s.delta * s.head_weight * fit_share(1, s.strata)
    return family_delta(s.delta, n_strata=len(STRATA), fit_index=1, n_levels=1, strata=s.strata)


def build_graph(order: Sequence[str], settings: LearnSettings) -> GraphProcedure:
    """The family of (stratum, fit) tests as a graph (``sequence`` module docstring, "Multiplicity"): under "graph"
    stratum k (0, 1, ...) of ``order`` weighs h(1 − h)^k (h = ``head_weight``; the last the rest), fit j takes
    ``fit_share(j)`` of its stratum, and a rejected node passes its level to the next stratum's fits (cyclic).
    Under "bonferroni"/"none" each node has its fixed ``family_delta`` share and nothing is passed on."""
    s = settings
    m = max(len(order), 1)
    fits = range(1, s.max_fits + 1)
    g = GraphProcedure(s.delta)
    if s.strata != "graph":
        for st in order:
            for j in fits:
                g.add((st, j), family_delta(1.0, n_strata=m, fit_index=j, n_levels=1, strata=s.strata))
        return g
    shares = {j: fit_share(j, s.strata) for j in fits}
    total = sum(shares.values())
    for k, st in enumerate(order):
        # each stratum takes head_weight of what the earlier ones left; the last takes the rest
        w = s.head_weight * (1.0 - s.head_weight) ** k if k < m - 1 else (1.0 - s.head_weight) ** k
        out = {(order[(k + 1) % m], j): shares[j] / total for j in fits} if m > 1 else {}
        for j in fits:
            g.add((st, j), w * shares[j], out)
    return g


#: A kind whose pilot labels show at least this many more failures (b) than successes (c) is certified last.
PILOT_DEMOTE = 2


def pilot_order(covs: Sequence[Covariate], shadow: Sequence[Label], first_fits: Mapping[str, Fit],
                settings: LearnSettings) -> tuple[list[str], dict[str, float]]:
    """The order the strata are certified in, from the pilot: by how many served requests it takes, at the pilot's
    rates, to give the stratum one accepted, reusable label (its share of the requests with a candidate, accepted by
    its first fit, times its labels' reusable share with one pseudo-label) — the most frequent first, since every
    stratum needs about as many labels. A stratum whose pilot labels show ``PILOT_DEMOTE`` or more failures than
    successes goes after the others (a pilot is small: a single failure says little, a frequent kind matters much).
    Strata the pilot never saw follow in :data:`STRATA` order. Returns (order, requests per accepted label)."""
    total = max(len(covs), 1)
    score: dict[str, float] = {}
    demoted: set[str] = set()
    for st in STRATA:
        fit = first_fits.get(st)
        mine = [c for c in covs if c.stratum == st and (fit is None or accepts(fit.thresholds, c.vector, c.missing))]
        labs = [lab for lab in shadow if lab.stratum == st and (fit is None or accepts(fit.thresholds, lab.vector,
                                                                                           lab.missing))]
        if not mine:
            continue
        reusable = (sum(lab.reusable for lab in labs) + 1.0) / (len(labs) + 1.0)
        score[st] = 1.0 / (len(mine) / total * reusable)
        xs = [lab.x for lab in labs if lab.reusable]
        if sum(x == 1 for x in xs) - sum(x == -1 for x in xs) >= PILOT_DEMOTE:
            demoted.add(st)
    seen = sorted(score, key=lambda st: (st in demoted, score[st], STRATA.index(st)))
    return seen + [st for st in STRATA if st not in score], {k: round(v, 2) for k, v in score.items()}


class Learner:
    """Learning state of one cache's record (every namespace in it): a cache folder's ``learn.sqlite``, or, given
    as ``store``, any record with ``LabelStore``'s interface (``redis_labels.RedisLabelStore``: a farm's Redis
    cache). Stateless beyond the record: every question recomputes from the stored rows, so several processes on
    one folder (or one Redis) agree."""

    def __init__(self, directory: str | Path, settings: LearnSettings | None = None, *, store: Any = None,
                 unit: str = "entry", fit_from: str = "namespace"):
        """``directory``: the cache folder (``LabelStore``), or, with ``store``, only a name for the record.
        ``unit``: what a test counts as one draw (module docstring, "The unit"): "entry" (the default, every
        traffic namespace: one label per cached entry and test) or "label" (the warm-up population's learner only,
        ``warmup.warm_learner``: each label the worker drew i.i.d. — ``Label.iid`` — counts; a label without the
        marker is still counted once per entry).
        ``fit_from``: which covariates a stratum's fit j is taken from (module docstring, "Fit"): "namespace" (the
        default: the namespace's first ``min_fit·2^(j−1)``, whatever their stratum) or "stratum" (the first that many
        of that stratum — the warm-up learner's: warm-up draws one kind at a time, so the namespace's first
        covariates are all of the first kind, and fits taken from them would leave every later kind's candidates
        outside its thresholds). Either way a fit reads covariates only, never an outcome."""
        if unit not in UNITS:
            raise ValueError(f"a learner's unit is one of {UNITS}, got {unit!r}")
        if fit_from not in ("namespace", "stratum"):
            raise ValueError(f"a learner's fit_from is 'namespace' or 'stratum', got {fit_from!r}")
        self.fit_from = fit_from
        self.directory = Path(directory) if store is None else directory
        self.store = LabelStore(self.directory) if store is None else store
        self.settings = settings or LearnSettings()
        self.unit = unit
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ the record → state
    def fits(self, namespace: str) -> dict[str, list[Fit]]:
        out: dict[str, list[Fit]] = {}
        for ev in self.store.events(namespace):
            if ev.get("kind") == "fit":
                f = Fit.from_dict(ev["fit"])
                out.setdefault(f.stratum, []).append(f)
        return out

    def _new_fit(self, namespace: str, stratum: str, index: int, since: int, covs: Sequence[Covariate],
                 why: str, created: int = 0) -> Fit | None:
        """Record fit ``index`` of ``stratum`` (None when there is no fit left or too few covariates).
        ``created``: the record's last label id now (the older fit's test is frozen there, ``fit_window``)."""
        s = self.settings
        if index > s.max_fits:
            return None
        level = s.level * s.tighten ** (index - 1)
        if index == 1 and s.seed_thresholds is not None:
            th, source = Thresholds(*s.seed_thresholds), "seed"
        else:
            need = s.min_fit * 2 ** (index - 1)
            if self.fit_from == "stratum":
                covs = [c for c in covs if c.stratum == stratum]
            if len(covs) < need:
                return None
            th, source = _quantile_thresholds(covs[:need], level), "covariates"
            if th is None:
                return None
        fit = Fit(stratum, index, since, level, th, source, max(int(created), int(since)))
        self.store.add_event(namespace, "fit", f"stratum {stratum}: fit {index} ({why})", fit=fit.to_dict())
        return fit

    def state(self, namespace: str, *, update: bool = True) -> dict[str, StratumState]:
        """Every stratum's state. With ``update``, also records what the labels now imply (the pilot's order, new
        fits, switch-on, drift): the record stays the single source of truth. Deterministic given the record."""
        for _ in range(4 * len(STRATA) * self.settings.max_fits + 4):
            changed, out = self._derive(namespace, update)
            if not changed:
                return out
        return out  # pragma: no cover - every pass that changes something adds a fit or an event, which are bounded

    # The record → (graph, sequences) → states. Returns (whether it recorded something new, states); the caller
    # derives again after a change, so every decision is made on the record as it now stands.
    def _derive(self, namespace: str, update: bool) -> tuple[bool, dict[str, StratumState]]:
        s = self.settings
        covs = self.store.covariates(namespace)
        labels = self.store.labels(namespace)
        shadow = [lab for lab in labels if lab.kind == "shadow"]
        audits = [lab for lab in labels if lab.kind == "audit"]
        fits = self.fits(namespace)
        events = self.store.events(namespace)
        strata = sorted({c.stratum for c in covs if c.stratum in STRATA} | set(fits))
        last_id = max((lab.id for lab in labels), default=0)
        if update:
            for st in strata:
                if st not in fits and self._new_fit(namespace, st, 1, 0, covs, "first fit", last_id) is not None:
                    return True, {}
        order = self._order(namespace, covs, labels, fits, events, update)
        if order is None:
            return False, {st: self._pilot_state(st, fits.get(st, []), shadow, covs) for st in strata}
        ranking, since = order
        if since < 0:
            return True, {}
        graph = build_graph(ranking, s)
        seqs: dict[tuple[str, int], BettingSequence] = {}
        switched: dict[tuple[str, int], int] = {}
        counted: dict[tuple[str, int], set[str]] = {}  # the cached entries each test has counted a label of
        by_stratum = {st: fits.get(st, []) for st in ranking}
        windows = {st: fit_window(fs) for st, fs in by_stratum.items()}
        latest = reading_in_force(labels)
        superseded = Counter(lab.stratum for lab in labels if not same_label(lab, latest))
        for lab in sorted(shadow, key=lambda x: x.id):
            if lab.id <= since or not lab.reusable or lab.stratum not in by_stratum:
                continue
            if not same_label(lab, latest):  # another judge or reading: another label (module docstring)
                continue
            for fit in by_stratum[lab.stratum]:
                lo, hi = windows[lab.stratum][fit.index]
                if not lo < lab.id <= hi or not accepts(fit.thresholds, lab.vector, lab.missing):
                    continue
                node = (lab.stratum, fit.index)
                entries = counted.setdefault(node, set())
                # the cached entry is the unit: one label per entry and test — unless the label was drawn i.i.d.
                # (a warm-up label of a label-unit learner), which counts whatever entry it drew (module docstring)
                if lab.entry_id in entries and not (self.unit == "label" and lab.iid):
                    continue
                entries.add(lab.entry_id)
                seq = seqs.get(node)
                if seq is None:
                    seq = seqs[node] = BettingSequence(s.alpha, s.delta, b_ceiling=s.b_ceiling)
                seq.update(lab.x)
                for j in graph.offer(node, seq.p_value):
                    switched[j] = lab.id
        out: dict[str, StratumState] = {}
        for st in strata:
            n_cov = sum(c.stratum == st for c in covs)
            mine = fits.get(st, [])
            fit = mine[-1] if mine else None
            rank = ranking.index(st) if st in ranking else len(ranking)
            n_labels = sum(lab.stratum == st for lab in shadow)
            if fit is None:
                need = labels_needed(s.alpha, graph.level((st, 1)) or s.delta)
                out[st] = StratumState(st, None, None, None, "learning", n_labels, need,
                                       f"learning ({st}) — {n_labels} labels; thresholds are fitted after "
                                       f"{s.min_fit} served requests with a cached candidate", n_cov, rank=rank,
                                       superseded=superseded.get(st, 0))
                continue
            node = (st, fit.index)
            level = graph.rejected_level.get(node, graph.level(node))
            seq = seqs.get(node) or BettingSequence(s.alpha, s.delta, b_ceiling=s.b_ceiling)
            if level > 0:
                seq.delta = level  # what its U_t and "certified" are read at (the graph's level for this node)
                if seq.b_test is not None:
                    seq.b_test.delta = level
            switched_at = switched.get(node, 0)
            drifted = any(e.get("kind") == "drift" and e.get("stratum") == st and e.get("fit") == fit.index
                          for e in events)
            drift = None
            if switched_at:
                drift = DriftDetector(s.alpha, s.drift_arl)
                for lab in audits:
                    if lab.stratum == st and lab.id > switched_at and lab.reusable and \
                            same_label(lab, latest) and accepts(fit.thresholds, lab.vector, lab.missing):
                        drift.update(lab.x)
                if drift.drifted and not drifted and update:
                    msg = (f"drift in stratum {st}: the audited hits' excess is above α = {s.alpha} "
                           f"({drift.b} b, {drift.c} c of {drift.n} audits; e-detector alarm at audit "
                           f"{drift.alarm_at}, "
                           f"false alarms on average no sooner than {s.drift_arl:g} audits); "
                           "reuse is off for this stratum and learning resumes on new labels")
                    log.warning("carnator learning: %s", msg)
                    self.store.add_event(namespace, "drift", msg, stratum=st, fit=fit.index)
                    self._new_fit(namespace, st, fit.index + 1, last_id, covs, "after drift", last_id)
                    return True, {}
            if not switched_at and not drifted and update and seq.n >= s.fail_after and \
                    (seq.b - seq.c) / seq.n >= s.alpha and \
                    self._new_fit(namespace, st, fit.index + 1, max(last_id, since), covs,
                                  f"fit {fit.index} showed excess {(seq.b - seq.c) / seq.n:.3f} ≥ α on "
                                  f"{seq.n} labels", last_id) is not None:
                return True, {}
            if switched_at and not drifted:
                if update and not any(e.get("kind") == "on" and e.get("stratum") == st and e.get("fit") == fit.index
                                      for e in events):
                    self.store.add_event(namespace, "on", f"stratum {st}: reuse switched on (fit {fit.index}, "
                                         f"{seq.n} labels, U = {seq.upper:.4f} ≤ α = {s.alpha})", stratum=st,
                                         fit=fit.index)
                    return True, {}
                state = "audited" if drift is not None and drift.n > 0 else "certified"
                msg = (f"{st}: reuse on — certified on {seq.n} labels (b {seq.b}, c {seq.c}; U = {seq.upper:.4f} ≤ "
                       f"α = {s.alpha}, anytime-valid at δ = {level:.4g})"
                       + (f"; {drift.n} audits, no drift" if drift is not None and drift.n else ""))
                out[st] = StratumState(st, fit, seq, drift, state, n_labels, seq.n, msg, n_cov, switched_at,
                                       rank=rank, level=level, superseded=superseded.get(st, 0),
                                       entries=frozenset(counted.get(node, ())))
                continue
            off = drifted or any(e.get("kind") == "drift" and e.get("stratum") == st for e in events)
            if drifted:  # the drifted fit has no successor left (max_fits): off for good
                needed, what = 0, f"off after a drift; no fit left (max_fits = {s.max_fits})"
            else:
                needed = estimate_needed(seq, s.alpha, level) if level > 0 else 10 * max(seq.n, 1)
                if level > 0 and seq.b_test is not None:  # both tests must certify: the slower one decides
                    needed = max(needed, estimate_needed(seq.b_test, seq.b_test.alpha, level))
                what = "off after a drift, learning again" if off else "learning"
            msg = (f"{what} ({st}) — {seq.n} labels of about {needed} needed; reuse switches on when certified "
                   f"(fit {fit.index}, U = {seq.upper:.4f}, α = {s.alpha}, kind {rank + 1} of the order"
                   + (f"; its failure rate {seq.b}/{seq.n} is not yet shown ≤ {s.b_ceiling}"
                      if seq.n and seq.excess_certified and not seq.b_certified else "") + ")")
            out[st] = StratumState(st, fit, seq, drift, "off" if off else "learning", n_labels, needed, msg, n_cov,
                                   rank=rank, level=level, superseded=superseded.get(st, 0),
                                   entries=frozenset(counted.get(node, ())))
        return False, out

    def _order(self, namespace: str, covs: Sequence[Covariate], labels: Sequence[Label],
               fits: Mapping[str, Sequence[Fit]], events: Sequence[Mapping[str, Any]],
               update: bool) -> tuple[list[str], int] | None:
        """(the order of the strata, the last label id of the pilot); None while the pilot runs. Under
        "bonferroni"/"none" there is no pilot (STRATA's order, every label counts). A since of −1 means the order
        was just recorded (derive again)."""
        s = self.settings
        recorded = self._recorded_order(events)
        if recorded is not None or not update or len(covs) < s.pilot:
            return recorded
        shadow = [lab for lab in labels if lab.kind == "shadow"]
        ranking, why = pilot_order(covs, shadow, {k: v[0] for k, v in fits.items() if v}, s)
        since = max((lab.id for lab in labels), default=0)
        self.store.add_event(namespace, "order", f"pilot over ({len(covs)} served requests with a candidate): kinds "
                             f"are certified in the order {', '.join(ranking)}; tests count labels after label "
                             f"{since}", order=ranking, since=since, why=why)
        return ranking, -1

    def _recorded_order(self, events: Sequence[Mapping[str, Any]]) -> tuple[list[str], int] | None:
        """(order, the pilot's last label id) as recorded; STRATA's and 0 without a pilot; None while it runs."""
        if self.settings.strata != "graph":
            return list(STRATA), 0
        for e in events:
            if e.get("kind") == "order":
                return [str(x) for x in e["order"]], int(e["since"])
        return None

    def order(self, namespace: str) -> list[str] | None:
        """The order the strata are certified in (None while the pilot runs; STRATA's without a pilot)."""
        recorded = self._recorded_order(self.store.events(namespace))
        return recorded[0] if recorded is not None else None

    def _pilot_state(self, st: str, fits: Sequence[Fit], shadow: Sequence[Label],
                     covs: Sequence[Covariate]) -> StratumState:
        s = self.settings
        n_labels = sum(lab.stratum == st for lab in shadow)
        need = labels_needed(s.alpha, first_level(s))
        msg = (f"learning ({st}) — pilot: {len(covs)} of {s.pilot} served requests with a candidate; the order in "
               f"which kinds are certified is fixed after it ({n_labels} pilot labels of this kind)")
        return StratumState(st, fits[-1] if fits else None, None, None, "learning", n_labels, need, msg,
                            sum(c.stratum == st for c in covs))

    def rule_state(self, namespace: str, states: Mapping[str, StratumState] | None = None) -> dict[str, Any]:
        """The per-namespace ``rule_state`` the badge and the panel render (shared contract)."""
        states = self.state(namespace) if states is None else states
        labels = sum(x.labels for x in states.values())
        superseded = sum(x.superseded for x in states.values())
        on = sorted(x.stratum for x in states.values() if x.on)
        off = sorted(x.stratum for x in states.values() if x.state == "off")
        learning = [x for x in states.values() if not x.on]
        # the kind shown: the first of the order still learning (where the label budget goes; a later kind with a
        # smaller estimate gets labels last), during the pilot the one with the fewest labels left
        closest = min(learning, key=lambda x: (x.rank if x.rank >= 0 else 0,
                                               x.needed - (x.sequence.n if x.sequence else 0)), default=None)
        n_close = closest.sequence.n if closest is not None and closest.sequence is not None else 0
        if on:
            state = "audited" if any(states[x].state == "audited" for x in on) else "certified"
            needed = sum(states[x].needed for x in on)
            msg = (f"reuse on for {', '.join(on)} (certified on own labels, anytime-valid)"
                   + (f"; learning {len(learning)} other kind(s) of change" if learning else "")
                   + (f"; off after drift: {', '.join(off)}" if off else ""))
        elif off:
            state, needed = "off", closest.needed if closest else 0
            msg = f"reuse off after a drift ({', '.join(off)}); learning again — {labels} labels so far"
        else:
            state = "learning"
            needed = closest.needed if closest else labels_needed(self.settings.alpha, first_level(self.settings))
            # n of N for the kind closest to its certificate (a total over kinds against one kind's N would read
            # as "done" while no kind is near); the total is said separately
            msg = (f"learning — {n_close} labels of about {needed} needed"
                   + (f" for the closest kind of change ({closest.stratum}); {labels} labels in all" if closest
                      else "") + "; reuse switches on when certified")
        # "labels" of "needed": while learning, the closest kind's own labels against its own need (the badge's
        # "n of N"); "labels_total" counts every kind's
        if superseded:
            msg += (f"; {superseded} labels of an older judge reading are not counted (the newest reading seen "
                    "is in force: upgrade every worker's judge)")
        shown = n_close if state == "learning" else labels
        # the pilot's progress (served requests with a candidate of its size; "done" once the order is fixed) and,
        # after it, the served requests per accepted label of each kind it measured (the order event's "why")
        order = next((e for e in self.store.events(namespace) if e.get("kind") == "order"), None)
        pilot = {"requests": min(len(self.store.covariates(namespace)), self.settings.pilot),
                 "size": self.settings.pilot, "done": self.settings.strata != "graph" or order is not None}
        return {"state": state, "labels": int(shown), "needed": int(needed), "labels_total": int(labels),
                "message": msg, "namespace": namespace, "strata": {k: v.to_dict() for k, v in sorted(states.items())},
                "pilot": pilot, "requests_per_label": dict((order or {}).get("why") or {})}

    def reading_superseded(self, namespace: str, judge: str, settings: Mapping[str, Any] | None) -> bool:
        """Whether a label of this judge reading would count for nothing: the record has seen it and another
        reading is now in force, or it is older than the one in force by version (``reading_in_force``)."""
        labels = self.store.labels(namespace)
        current = reading_in_force(labels)
        if current is None or _dump_reading(judge, settings) == _dump_reading(current.judge, current.judge_settings):
            return False
        key = _dump_reading(judge, settings)
        seen = any(_dump_reading(lab.judge, lab.judge_settings) == key for lab in labels)
        return seen or older_reading(judge, settings, current)

    # ------------------------------------------------------------------ budget
    def over_budget(self, namespace: str) -> bool:
        """Whether labelling has spent more than ``budget`` of the compute served so far (the ledger): drawn
        labels are skipped until the served compute catches up. It reads only the past, never the request at
        hand, so it cannot select which kind of request is labelled."""
        led = self.store.ledger(namespace)
        return led["label_s"] > self.settings.budget * led["served_s"]


def label_draw(share: float, request_key: str) -> bool:
    """Whether a served request that could be labelled is: a coin at ``share`` (``LearnSettings.label_share``),
    drawn from the request key's hash (the same request gets the same draw in every process, and a replay of the
    record is deterministic). The draw does not depend on the queue, on the request's risk or on any outcome, so
    the labelled requests are a fair sample of the requests served (module docstring)."""
    if share <= 0 or not request_key:
        return False
    h = int(hashlib.sha256(("label:" + request_key).encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return h < share


def audit_share_now(state: StratumState | None, settings: LearnSettings) -> float:
    """The share of a switched-on kind's hits audited now: ``audit_share``, times ``audit_boost`` (at most 1) while
    the kind is young (fewer than ``young_audits`` audits of its fit) or a drift is suspected (its detector's
    statistic ≥ ``drift_arl``/4; a clean history keeps it near 66, 2 % of b near 100). The share depends only on
    past audits, never on the hit at hand, so each audit stays a fair draw of the kind's hits and the detector's
    false-alarm control (counted in audits) is unchanged; it only changes how many hits pass between audits."""
    base = settings.audit_share
    drift = state.drift if state is not None else None
    if drift is None:
        return base
    young = drift.n < settings.young_audits
    suspected = drift.statistic >= settings.drift_arl / 4.0
    return min(1.0, base * settings.audit_boost) if (young or suspected) else base


def audit_draw(share: float, request_key: str) -> bool:
    """Whether a switched-on hit is audited: a deterministic draw from the request key (the same request is
    audited or not in every process), at rate ``share``."""
    if share <= 0 or not request_key:
        return False
    h = int(hashlib.sha256(("audit:" + request_key).encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return h < share


_LEARNERS: dict[str, Learner] = {}
_LEARNERS_LOCK = threading.Lock()


def learner_for(directory: str | Path, settings: LearnSettings | None = None) -> Learner:
    """The process's Learner of a cache (one SQLite connection per folder and settings). ``directory``: a cache
    folder, or a Redis cache's URL (``redis://``, public form): then the record is the Redis one
    (``redis_labels``), shared by every worker on that Redis."""
    from ..cache.redis_url import is_redis_url

    shared = is_redis_url(directory)
    key = f"{directory if shared else Path(directory).resolve()}|{settings.to_dict() if settings else ''}"
    with _LEARNERS_LOCK:
        ln = _LEARNERS.get(key)
        if ln is None:
            if shared:
                from .redis_labels import RedisLabelStore  # local: only servers with a Redis cache need redis

                ln = Learner(str(directory), settings, store=RedisLabelStore.open(str(directory)))
            else:
                ln = Learner(directory, settings)
            _LEARNERS[key] = ln
        return ln


__all__ = ["Fit", "LearnSettings", "Learner", "METHOD", "STRATA", "StratumState", "UNITS", "accepts", "audit_draw",
           "audit_share_now", "label_draw", "learner_for", "rule_namespace", "stratum_of"]
