"""Learning mode: the life of a rule on a model that has none (serve dense → label → certify → reuse → audit).

Per rule namespace (model fingerprint × generation config, ``RiskRule.namespace``) and per stratum (what changed
against the candidate, ``risk.strata``):

1. **Learning.** Requests are served dense (bit-identical to KSampler); exact repeats are answered from the cache.
   Every served request that recalled a candidate records its *covariates* (stratum, the top candidate's four
   discrepancies; no outcome). Within the compute budget (``LearnSettings.budget`` of the compute served, default
   20 %) a request's *shadow label* is made: the reuse run the rule-to-be would make with its top candidate
   (recall K = 1, the learned rule's recall), judged b/c against the clip just served.
2. **Fit.** A stratum's thresholds are fitted from covariates alone: fit j takes per-axis quantiles at level
   ``level·tighten^(j−1)`` of the namespace's first ``min_fit·2^(j−1)`` covariates (or a seed rule's thresholds
   for fit 1). No label outcome enters a fit, so a fit's test may use every label (earlier ones too).
   A fit whose accepted labels show an excess ≥ α after ``fail_after`` labels is replaced by the next, stricter
   one; a drift (below) replaces it by the next one on labels after the drift only.
3. **Certify.** Fit j of stratum s is tested with ``sequence.BettingSequence`` at the δ share
   ``sequence.family_delta`` (Bonferroni over strata, alpha-spending 2^−j over fits): reuse switches on for the
   stratum by itself once that test certifies (anytime-valid: checked after every label).
4. **Audit.** A share of a switched-on stratum's hits (``audit_share``, default 5 %) is served dense instead and its
   reuse labelled against it; ``sequence.DriftTest`` (H0: excess ≤ α) watches these labels, and when it fires the
   stratum is switched off ("off", with the message) and learning resumes with the next fit.

Which requests get labelled (the policy): only requests whose top candidate the stratum's current fit would accept
(other labels cannot move its certificate), in strata not yet switched on, in arrival order, whenever the budget
has room for one more label; while ComfyUI's queue holds other prompts the budget must have room for three (so a
waiting user rarely waits for a label, and learning does not starve under constant load). The choice depends on
costs and covariates only, never on an outcome.

The guarantee: P(some stratum is ever switched on while its fitted rule's true excess (b − c)/n is ≥ α) ≤ δ, for
labels drawn from the traffic the rule would accept (budget-thinned). Requests sharing one cache are not
independent draws of anything but the stream itself: the guarantee is for the stream as it comes.
"""
from __future__ import annotations

import hashlib
import logging
import math
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ..risk.thresholds import Thresholds
from .labels import Covariate, Label, LabelStore
from .sequence import METHOD, BettingSequence, DriftTest, family_delta, labels_needed

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


@dataclass(frozen=True)
class LearnSettings:
    """How a rule is learned (recorded in the learned rule file).

    alpha, delta:  the certified level: excess (b − c)/n ≤ α with probability ≥ 1 − δ (family-wise).
    budget:        extra compute for shadow labels, as a share of the compute served (0.2 = 20 %).
    audit_share:   share of a switched-on stratum's hits that is run dense and labelled (0.05 = 5 %).
    strata:        "bonferroni" (δ split over the strata) or "none" (each stratum at its own δ, as the offline
                   per-stratum certificates; the family-wise guarantee then does not hold).
    level:         per-axis covariate quantile of the first fit; ``tighten`` multiplies it at each refit.
    min_fit:       covariates (served requests with a candidate) before the first fit.
    fail_after:    accepted labels after which a fit with an empirical excess ≥ α is replaced.
    max_fits:      fits per stratum (their δ shares 2^−j sum below 1).
    seed_thresholds: thresholds from another rule for fit 1 (the certificate is still earned on own labels).
    """

    alpha: float = 0.05
    delta: float = 0.1
    budget: float = 0.2
    audit_share: float = 0.05
    strata: str = "bonferroni"
    level: float = 0.8
    tighten: float = 0.7
    min_fit: int = 20
    fail_after: int = 40
    max_fits: int = 6
    seed_thresholds: tuple[float, float, float, float] | None = None

    def __post_init__(self) -> None:
        checks = [(0 < self.alpha < 1, "alpha in (0, 1)"), (0 < self.delta < 1, "delta in (0, 1)"),
                  (0 <= self.budget <= 10, "budget in [0, 10]"), (0 <= self.audit_share <= 1, "audit_share in [0, 1]"),
                  (self.strata in ("bonferroni", "none"), "strata 'bonferroni' or 'none'"),
                  (0 < self.level <= 1 and 0 < self.tighten <= 1, "level and tighten in (0, 1]"),
                  (self.min_fit >= 1 and self.fail_after >= 1 and 1 <= self.max_fits <= 30,
                   "min_fit, fail_after ≥ 1 and max_fits in [1, 30]")]
        bad = [what for ok, what in checks if not ok]
        if bad:
            raise ValueError(f"learning settings need {', '.join(bad)}; got {self}")

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
    """Fit ``index`` of a stratum: thresholds from covariates alone; its test uses labels with id > ``since``."""

    stratum: str
    index: int
    since: int
    level: float
    thresholds: Thresholds
    source: str  # "covariates" | "seed"

    def to_dict(self) -> dict[str, Any]:
        return {"stratum": self.stratum, "index": self.index, "since": self.since, "level": self.level,
                "thresholds": self.thresholds.to_dict(), "source": self.source}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Fit":
        return cls(str(d["stratum"]), int(d["index"]), int(d["since"]), float(d["level"]),
                   Thresholds.from_dict(d["thresholds"]), str(d.get("source", "covariates")))


@dataclass
class StratumState:
    """One stratum's state, recomputed from the record (labels, fits, events)."""

    stratum: str
    fit: Fit | None
    sequence: BettingSequence | None
    drift: DriftTest | None
    state: str  # "learning" | "certified" | "audited" | "off"
    labels: int
    needed: int
    message: str
    covariates: int = 0
    switched_on_at: int = 0  # label id at which it certified (0: not)

    @property
    def on(self) -> bool:
        return self.state in ("certified", "audited")

    def to_dict(self) -> dict[str, Any]:
        return {"stratum": self.stratum, "state": self.state, "labels": self.labels, "needed": self.needed,
                "covariates": self.covariates, "message": self.message,
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
    lam = min(0.95 / (1 - alpha), max(0.0, (alpha - (pb - pc)) / max(pb + pc, alpha * alpha)))
    growth = (pb * math.log1p(lam * (alpha - 1)) if pb else 0.0) + (pc * math.log1p(lam * (alpha + 1))) + \
        (1 - pb - pc) * math.log1p(lam * alpha)
    if growth <= 1e-6:
        return max(floor, 10 * seq.n)  # at this rate the stratum may never certify: say "many"
    left = (seq.threshold - seq.log_capital) / growth
    return int(max(floor, seq.n + math.ceil(max(left, 0.0))))


class Learner:
    """Learning state of one cache folder's ``learn.sqlite`` (every namespace in it). Stateless beyond the record:
    every question recomputes from the stored rows, so several processes on one folder agree."""

    def __init__(self, directory: str | Path, settings: LearnSettings | None = None):
        self.directory = Path(directory)
        self.store = LabelStore(self.directory)
        self.settings = settings or LearnSettings()
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
                 why: str) -> Fit | None:
        s = self.settings
        if index > s.max_fits:
            return None
        level = s.level * s.tighten ** (index - 1)
        if index == 1 and s.seed_thresholds is not None:
            th, source = Thresholds(*s.seed_thresholds), "seed"
        else:
            need = s.min_fit * 2 ** (index - 1)
            if len(covs) < need:
                return None
            th, source = _quantile_thresholds(covs[:need], level), "covariates"
            if th is None:
                return None
        fit = Fit(stratum, index, since, level, th, source)
        self.store.add_event(namespace, "fit", f"stratum {stratum}: fit {index} ({why})", fit=fit.to_dict())
        return fit

    def state(self, namespace: str, *, update: bool = True) -> dict[str, StratumState]:
        """Every stratum's state. With ``update``, also records what the labels now imply (new fits, switch-on,
        drift): the record stays the single source of truth."""
        covs = self.store.covariates(namespace)
        labels = self.store.labels(namespace)
        shadow = [lab for lab in labels if lab.kind == "shadow"]
        audits = [lab for lab in labels if lab.kind == "audit"]
        fits = self.fits(namespace)
        events = self.store.events(namespace)
        strata = sorted({c.stratum for c in covs if c.stratum in STRATA} | set(fits))
        out: dict[str, StratumState] = {}
        for st in strata:
            n_cov = sum(c.stratum == st for c in covs)
            mine = fits.get(st, [])
            fit = mine[-1] if mine else None
            if fit is None and update:
                fit = self._new_fit(namespace, st, 1, 0, covs, "first fit")
            state = self._stratum(namespace, st, fit, shadow, audits, events, covs, update)
            state.covariates = n_cov
            out[st] = state
        return out

    def _stratum(self, namespace: str, st: str, fit: Fit | None, shadow: Sequence[Label], audits: Sequence[Label],
                 events: Sequence[Mapping[str, Any]], covs: Sequence[Covariate], update: bool) -> StratumState:
        s = self.settings
        n_labels = sum(lab.stratum == st for lab in shadow)
        if fit is None:
            need = labels_needed(s.alpha, family_delta(s.delta, n_strata=len(STRATA), fit_index=1, n_levels=1,
                                                       strata=s.strata))
            return StratumState(st, None, None, None, "learning", n_labels, need,
                                f"learning ({st}) — {n_labels} labels; thresholds are fitted after "
                                f"{s.min_fit} served requests with a cached candidate")
        d = family_delta(s.delta, n_strata=len(STRATA), fit_index=fit.index, n_levels=1, strata=s.strata)
        seq = BettingSequence(s.alpha, d)
        switched_at = 0
        for lab in shadow:
            if lab.stratum != st or lab.id <= fit.since or not lab.reusable or not accepts(fit.thresholds,
                                                                                            lab.vector, lab.missing):
                continue
            seq.update(lab.x)
            if seq.certified and not switched_at:
                switched_at = lab.id
        drift = None
        drifted = any(e.get("kind") == "drift" and e.get("stratum") == st and e.get("fit") == fit.index
                      for e in events)
        if switched_at:
            drift = DriftTest(s.alpha, d)
            for lab in audits:
                if lab.stratum == st and lab.id > switched_at and lab.reusable and \
                        accepts(fit.thresholds, lab.vector, lab.missing):
                    drift.update(lab.x)
            if drift.drifted and not drifted and update:
                msg = (f"drift in stratum {st}: the audited hits' excess is above α = {s.alpha} "
                       f"({drift.b} b, {drift.c} c of {drift.n} audits; anytime-valid test at δ = {d:.4g}); reuse "
                       "is off for this stratum and learning resumes on new labels")
                log.warning("carnator learning: %s", msg)
                self.store.add_event(namespace, "drift", msg, stratum=st, fit=fit.index)
                last = max((lab.id for lab in list(shadow) + list(audits)), default=0)
                nxt = self._new_fit(namespace, st, fit.index + 1, last, covs, "after drift")
                return self._after_refit(namespace, st, nxt, msg, n_labels, fit)
        n_acc = seq.n
        if not switched_at and update and n_acc >= s.fail_after and (seq.b - seq.c) / n_acc >= s.alpha:
            nxt = self._new_fit(namespace, st, fit.index + 1, fit.since, covs,
                                f"fit {fit.index} showed excess {(seq.b - seq.c) / n_acc:.3f} ≥ α on {n_acc} labels")
            if nxt is not None:
                return self._stratum(namespace, st, nxt, shadow, audits, events, covs, update)
        needed = estimate_needed(seq, s.alpha, d)
        if switched_at:
            if update and not any(e.get("kind") == "on" and e.get("stratum") == st and e.get("fit") == fit.index
                                  for e in events):
                self.store.add_event(namespace, "on", f"stratum {st}: reuse switched on (fit {fit.index}, "
                                     f"{seq.n} labels, U = {seq.upper:.4f} ≤ α = {s.alpha})", stratum=st,
                                     fit=fit.index)
            state = "audited" if drift is not None and drift.n > 0 else "certified"
            msg = (f"{st}: reuse on — certified on {seq.n} labels (b {seq.b}, c {seq.c}; U = {seq.upper:.4f} ≤ "
                   f"α = {s.alpha}, anytime-valid at δ = {d:.4g})"
                   + (f"; {drift.n} audits, no drift" if drift is not None and drift.n else ""))
            return StratumState(st, fit, seq, drift, state, n_labels, seq.n, msg, switched_on_at=switched_at)
        off = drifted or any(e.get("kind") == "drift" and e.get("stratum") == st for e in events)
        what = "off after a drift, learning again" if off else "learning"
        msg = (f"{what} ({st}) — {seq.n} labels of about {needed} needed; reuse switches on when certified "
               f"(fit {fit.index}, U = {seq.upper:.4f}, α = {s.alpha})")
        return StratumState(st, fit, seq, drift, "off" if off else "learning", n_labels, needed, msg)

    def _after_refit(self, namespace: str, st: str, fit: Fit | None, msg: str, n_labels: int,
                     old: Fit) -> StratumState:
        s = self.settings
        d = family_delta(s.delta, n_strata=len(STRATA), fit_index=old.index + 1, n_levels=1, strata=s.strata)
        need = labels_needed(s.alpha, d)
        return StratumState(st, fit, None, None, "off", n_labels, need,
                            msg if fit is not None else msg + f"; no fit left (max_fits = {s.max_fits})")

    def rule_state(self, namespace: str, states: Mapping[str, StratumState] | None = None) -> dict[str, Any]:
        """The per-namespace ``rule_state`` the badge and the panel render (shared contract)."""
        states = self.state(namespace) if states is None else states
        labels = sum(x.labels for x in states.values())
        on = sorted(x.stratum for x in states.values() if x.on)
        off = sorted(x.stratum for x in states.values() if x.state == "off")
        learning = [x for x in states.values() if not x.on]
        closest = min(learning, key=lambda x: x.needed - (x.sequence.n if x.sequence else 0), default=None)
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
            needed = closest.needed if closest else labels_needed(self.settings.alpha, self.settings.delta)
            n_close = closest.sequence.n if closest is not None and closest.sequence is not None else 0
            msg = (f"learning — {labels} labels of about {needed} needed; reuse switches on when certified"
                   + (f" (closest: {closest.stratum}, {n_close} of about {closest.needed})" if closest else ""))
        return {"state": state, "labels": int(labels), "needed": int(needed), "message": msg,
                "namespace": namespace, "strata": {k: v.to_dict() for k, v in sorted(states.items())}}

    # ------------------------------------------------------------------ budget
    def budget_allows(self, namespace: str, busy: bool) -> bool:
        s = self.settings
        led = self.store.ledger(namespace)
        costs = [lab.cost_s for lab in self.store.labels(namespace, "shadow") if lab.cost_s > 0]
        per_request = led["served_s"] / max(led["requests"], 1)
        est = float(np.median(costs)) if costs else 0.6 * per_request
        room = s.budget * led["served_s"] - led["label_s"]
        return room >= est * (3.0 if busy else 1.0)


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
    """The process's Learner of a cache folder (one SQLite connection per folder and settings)."""
    key = f"{Path(directory).resolve()}|{settings.to_dict() if settings else ''}"
    with _LEARNERS_LOCK:
        ln = _LEARNERS.get(key)
        if ln is None:
            ln = _LEARNERS[key] = Learner(directory, settings)
        return ln


__all__ = ["Fit", "LearnSettings", "Learner", "METHOD", "STRATA", "StratumState", "accepts", "audit_draw",
           "learner_for", "rule_namespace", "stratum_of"]
