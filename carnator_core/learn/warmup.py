"""Two populations: certify a kind of change on warm-up labels, switch it on provisionally, confirm it on traffic.

Warm-up labels (``edits`` made of the user's own cached scenes, labelled while the machine is idle: ``idle``) are a
population of their own. They live in the same record as the traffic's labels but under their own namespace,
``warmup_namespace(ns)`` = ``ns + "#warmup"``, and are tested there by a :class:`~.learner.Learner` of their own —
the same pilot-free graph of betting tests (``learner`` and ``sequence`` module docstrings), at the whole δ, in the
fixed order of ``STRATA`` (reseed first: it is exactly the traffic of its kind). No traffic label enters that test
and no warm-up label enters the traffic's.

A kind the warm-up test certifies (and the traffic's has not) is **provisional**: the Risk Filter reuses for it
within the warm-up fit's thresholds, and audits a share ``WarmupSettings.audit_share`` of those hits (higher than a
traffic-certified kind's), served dense and labelled like every audit. Its audits of real traffic feed the
**confirmation** (H0: excess ≥ α, an anytime-valid ``BettingSequence`` at ``confirm_share·δ``) and the **drift**
detector (a rise of the excess above α, the ``DriftDetector``, whose false alarms come on average no sooner than
``LearnSettings.drift_arl`` audits; ``sequence``). Whichever crosses first decides:
confirmed — the kind stays on, audited at the ordinary ``audit_share``; drift — the kind is **off** for that warm-up
fit, for good (its traffic learning goes on as before). Every state is recomputed from the record: deterministic.

The unit — the warm-up label, not the cached entry. The traffic's tests count each cached entry once (``learner``,
"The guarantee"): a user's requests cluster on the scenes they iterate on, and their labels are not independent.
Warm-up requests are not the user's: the worker draws them (``idle.draw_edit``) — for the kind it labels, a cached
entry uniformly at random *with replacement* among the namespace's entries that admit an edit of that kind
(rejection: another draw when the generator gives that entry none), then a random edit of that kind (a fresh random
seed for reseed; one of the entry's valid edits, each equally likely, for the others), from ``random.SystemRandom``,
which reads no label. Conditional on the cache's entries at each draw, the warm-up labels of a kind are then i.i.d.
draws from one population, "a random edit of kind k of a uniformly random cached scene", even when one scene is
drawn many times (sampling with replacement from a finite population is i.i.d.); a burst on one scene occurs only by
chance, which the i.i.d. model already contains. So the betting supermartingale Π(1 + λ_i(α − X_i)) (X = b − c,
λ_i predictable) is valid *at label level* for the null "that population's excess is ≥ α at every draw", and the
warm-up learner (``warm_learner``: ``Learner(unit="label")``) counts every such label: a cache of 24 scenes
certifies a safe kind on 86 labels, where counting each scene once it never could (a test needs 63–86 units).
What else selects a counted label looks at the draw and the clock, never at an outcome — the attempt gives no label
when the candidate recalled is of another kind or outside the current fit (so the population is that of the
accepted draws: an i.i.d. sequence thinned by a rule on the draw alone stays i.i.d.), the kind's turn comes when the
kinds before it are on or off, and a queued prompt abandons the label in flight — so each counted label's
conditional mean given the past is the population's. The randomness is the condition: labels that cluster on one
scene (a scene drawn once and labelled again and again) or a pick that avoids scenes once they failed switch a
kind on at an excess of α in most streams, where the draw holds the level (``tests/test_learn_warmup_iid.py``).
The row of a drawn label carries the draw (``Label.draw``: its marker, the entry and edit drawn); a warm-up label
without the marker (written by older code, which walked the entries round-robin) is counted once per entry, and
not at all once its entry is counted, as it was then — an old record never gets a weaker test.

What that certificate is about — precisely: **random edits of kind k of the scenes cached when warm-up ran, each
scene equally likely** — a scene uniform among the cached entries that admit an edit of kind k, then uniform among
its edits (``edits.make_edit``'s salts below ``idle.MAX_EDITS`` that give one; a fresh random seed for reseed),
restricted to the draws whose recalled candidate is of kind k inside the warm-up fit's thresholds. Where the cache
changed while warm-up ran, the null is about the population at each draw ("≥ α at every draw"). A certificate on
5 cached scenes is about those 5 scenes, however many labels it took; nothing in it speaks of the user's other or
future scenes, nor of how often the user's own requests recall each one. That is what the provisional state is
for: the traffic's confirmation test, its drift detector (below) and the traffic's own learning keep the **entry**
as their unit, unchanged.

What each state guarantees, plainly (``KindState.guarantee``):

* provisional — about the warm-up edits only: P(some kind switches on provisionally although reuse on random edits
  of its kind of the cached scenes, each scene equally likely, is worse than dense by α or more) ≤ δ. Nothing is
  certified about the user's own traffic yet; the audits watch it, and a kind that is bad on traffic is switched
  off by its drift test once its audits show it.
* confirmed — about the user's traffic: the audited hits (a draw independent of their outcome) certify excess < α
  within the warm-up thresholds; P(some kind is confirmed while its traffic excess is ≥ α) ≤ δ (``confirm_share``
  ≤ 1/10 of δ per kind, ten kinds at most).
* off — the audits showed an excess above α (the drift detector's false-alarm control is its average run length,
  ``LearnSettings.drift_arl`` audits: a switch-off is the safe side); reuse for the kind waits
  for its certificate on traffic labels.

The Risk Filter learns the provisional kinds of a namespace through :func:`provisional` (a per-process table that
:func:`overlay_state` refreshes whenever a request or the idle worker derives the state): after a restart a kind is
provisional again from the first request of its namespace on.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Any, Mapping

from ..risk.thresholds import Thresholds
from .learner import STRATA, Learner, LearnSettings, StratumState, accepts, same_label
from .sequence import BettingSequence, DriftDetector

WARMUP_SUFFIX = "#warmup"


def warmup_namespace(namespace: str) -> str:
    """The namespace the warm-up labels of ``namespace`` live under."""
    return namespace + WARMUP_SUFFIX


def is_warmup_namespace(namespace: str) -> bool:
    return namespace.endswith(WARMUP_SUFFIX)


@dataclass(frozen=True)
class WarmupSettings:
    """How warm-up certificates are used.

    audit_share:   share of a provisional kind's hits served dense and labelled (an audit of real traffic).
    confirm_share: the share of δ each kind's confirmation test on those audits gets (≤ 1/10: ten
                   kinds at most keep the confirmations' family-wise error ≤ δ).
    """

    audit_share: float = 0.25
    confirm_share: float = 0.1

    def __post_init__(self) -> None:
        if not (0.0 < self.audit_share <= 1.0 and 0.0 < self.confirm_share <= 1.0 / len(STRATA)):
            raise ValueError(f"warm-up settings need audit_share in (0, 1] and confirm_share in (0, "
                             f"{1.0 / len(STRATA):.2f}]; got {self}")


_SETTINGS = [WarmupSettings()]


def configure(settings: WarmupSettings) -> None:
    """Set this process's warm-up settings (the user's: ``POST /carnator/warmup`` with ``provisional_audit_share``)."""
    _SETTINGS[0] = settings


def current_settings() -> WarmupSettings:
    return _SETTINGS[0]


def warm_settings(settings: LearnSettings) -> LearnSettings:
    """The warm-up population's learning settings: the traffic's, with no pilot (the order is ``STRATA``'s, fixed
    before any warm-up label: reseed first) and no seed thresholds (warm-up fits come from warm-up covariates)."""
    return replace(settings, pilot=0, seed_thresholds=None)


def warm_learner(learner: Learner) -> Learner:
    """A Learner of the warm-up population on the same record as ``learner`` (its own namespace, its own tests),
    counting at label level the labels the worker drew i.i.d. (``unit="label"``; module docstring, "The unit"), each
    kind's fits taken from that kind's own warm-up covariates (``fit_from="stratum"``: the worker labels one kind at a
    time, reseed first, so the namespace's first covariates are all reseeds — fits taken from them shut every later
    kind out of its own thresholds)."""
    return Learner(learner.directory, warm_settings(learner.settings), store=learner.store, unit="label",
                   fit_from="stratum")


@dataclass
class KindState:
    """A kind certified on warm-up labels, as traffic sees it: "provisional", "confirmed" or "off"."""

    stratum: str
    state: str
    thresholds: Thresholds
    since: int              # the warm-up label id at which it certified; audits after it count
    confirm: BettingSequence
    drift: DriftDetector
    audit_share: float
    warm_labels: int
    message: str
    guarantee: str

    @property
    def on(self) -> bool:
        return self.state in ("provisional", "confirmed")

    def to_dict(self) -> dict[str, Any]:
        return {"stratum": self.stratum, "state": self.state, "thresholds": self.thresholds.to_dict(),
                "since": self.since, "audit_share": self.audit_share, "warm_labels": self.warm_labels,
                "audits": self.confirm.n, "confirm": self.confirm.to_dict(), "drift": self.drift.to_dict(),
                "message": self.message, "guarantee": self.guarantee, "population": (
                    "warm-up edits" if self.state == "provisional" else "your traffic (audited hits)")}


def kind_states(learner: Learner, namespace: str, traffic: Mapping[str, StratumState],
                warm: Mapping[str, StratumState], settings: WarmupSettings | None = None) -> dict[str, KindState]:
    """The kinds certified on warm-up labels and not (yet) on traffic labels, with their traffic audits' verdict
    (module docstring). ``traffic``/``warm``: the two populations' states (``Learner.state``); ``settings``: this
    process's (``configure``) when None."""
    settings = current_settings() if settings is None else settings
    s = learner.settings
    level = settings.confirm_share * s.delta
    labels = learner.store.labels(namespace, "audit")
    warm_all = learner.store.labels(warmup_namespace(namespace))
    latest_warm = max(warm_all, key=lambda x: x.id) if warm_all else None
    out: dict[str, KindState] = {}
    for st, w in warm.items():
        if not w.on or w.fit is None or (st in traffic and traffic[st].on):
            continue
        th = w.fit.thresholds
        confirm, drift = BettingSequence(s.alpha, level), DriftDetector(s.alpha, s.drift_arl)
        verdict = ""
        # The confirmation counts each cached entry once (the entry is the unit, as in the learner: a burst of audits
        # of one scene is one piece of evidence); the drift detector sees every audit (an alarm only switches off).
        audited: set[str] = set()
        for lab in sorted(labels, key=lambda x: x.id):
            if lab.stratum != st or lab.id <= w.switched_on_at or not lab.reusable or \
                    not accepts(th, lab.vector, lab.missing) or not same_label(lab, latest_warm):
                continue
            if lab.entry_id not in audited:
                audited.add(lab.entry_id)
                confirm.update(lab.x)
            drift.update(lab.x)
            if drift.drifted:
                verdict = "off"
                break
            if confirm.certified:
                verdict = "confirmed"
                break
        n_warm = w.sequence.n if w.sequence is not None else 0
        head = (f"warm-up certified on {n_warm} warm-up labels (b {w.sequence.b if w.sequence else 0}, "
                f"c {w.sequence.c if w.sequence else 0}; anytime-valid at δ = {w.level:.4g})")
        if verdict == "off":
            msg = (f"{st}: off — {head}, but its audits on your traffic showed an excess above α = {s.alpha} "
                   f"({drift.b} b, {drift.c} c of {drift.n} audits; the drift detector, false alarms on average "
                   f"no sooner than {s.drift_arl:g} audits); "
                   "reuse for it waits for a certificate on your own labels")
            guarantee = (f"none for reuse: switched off (on audits whose excess is ≤ α a false alarm comes on average "
                         f"no sooner than {s.drift_arl:g} audits)")
            share = 0.0
        elif verdict == "confirmed":
            msg = (f"{st}: on — warm-up certified, confirmed on your traffic ({confirm.n} audits, b {confirm.b}, "
                   f"c {confirm.c}; U = {confirm.upper:.4f} ≤ α = {s.alpha}, anytime-valid at δ = {level:.4g})")
            guarantee = (f"about your traffic: the audited hits certify excess < α = {s.alpha} within the warm-up "
                         f"thresholds; P(a kind is confirmed while its traffic excess is ≥ α) ≤ {level:.4g} per "
                         f"kind, ≤ {s.delta} over all kinds")
            share = s.audit_share
        else:
            msg = (f"{st}: on — warm-up certified, checking on your traffic ({head}; {confirm.n} audits of your "
                   f"traffic so far, b {confirm.b}, c {confirm.c}; {settings.audit_share:.0%} of its hits audited)")
            guarantee = (f"about warm-up edits of your cached scenes only (random edits of this kind of the scenes "
                         f"cached when warm-up ran, each scene equally likely): P(a kind switches on although its "
                         f"warm-up edits' excess is ≥ α = {s.alpha}) ≤ {s.delta}; nothing is certified about your "
                         f"own traffic yet — {settings.audit_share:.0%} of its hits are audited, and the audits' "
                         f"drift test switches it off when they show an excess above α")
            share = settings.audit_share
        out[st] = KindState(st, verdict or "provisional", th, w.switched_on_at, confirm, drift, share, n_warm, msg,
                            guarantee)
    return out


# ---------------------------------------------------------------------------------------------- the filter's table
_PROVISIONAL: dict[str, dict[str, tuple[Thresholds, float]]] = {}
_LOCK = threading.Lock()


def publish(namespace: str, kinds: Mapping[str, KindState]) -> None:
    """Make the kinds on by warm-up (provisional or confirmed) of ``namespace`` visible to the Risk Filter."""
    with _LOCK:
        _PROVISIONAL[namespace] = {k: (v.thresholds, v.audit_share) for k, v in kinds.items() if v.on}


def provisional(namespace: str, stratum: str) -> tuple[Thresholds, float] | None:
    """(thresholds, audit share) of ``stratum`` when it is on by a warm-up certificate in ``namespace``."""
    with _LOCK:
        return _PROVISIONAL.get(namespace, {}).get(stratum)


def overlay_state(learner: Learner, namespace: str, rule_state: dict[str, Any],
                  traffic: Mapping[str, StratumState] | None = None,
                  settings: WarmupSettings | None = None, *, update: bool = True) -> dict[str, Any]:
    """``rule_state`` (``Learner.rule_state``) with the warm-up population added: each kind on by warm-up gets its
    state ("provisional", "confirmed", "off"), message and guarantee; ``provisional``/``confirmed`` list them;
    the message begins with "on — warm-up certified, checking on your traffic: ..." while a kind is provisional;
    ``warmup`` holds the warm-up population's own rule_state. Publishes the kinds to the Risk Filter
    (:func:`publish`). Without warm-up labels the state is returned as it was. ``update``: record what the warm-up
    labels imply (``Learner.state``); a reader (the panel's route) passes False."""
    settings = current_settings() if settings is None else settings
    wns = warmup_namespace(namespace)
    if not learner.store.labels(wns):
        publish(namespace, {})
        return rule_state
    traffic = learner.state(namespace, update=update) if traffic is None else traffic
    wl = warm_learner(learner)
    warm = wl.state(wns, update=update)
    kinds = kind_states(learner, namespace, traffic, warm, settings)
    publish(namespace, kinds)
    out = dict(rule_state)
    strata = {k: dict(v) for k, v in (rule_state.get("strata") or {}).items()}
    for st, ks in kinds.items():
        strata[st] = {**strata.get(st, {"stratum": st}), "state": ks.state, "message": ks.message,
                      "guarantee": ks.guarantee, "warmup": ks.to_dict()}
    out["strata"] = strata
    prov = sorted(k for k, v in kinds.items() if v.state == "provisional")
    conf = sorted(k for k, v in kinds.items() if v.state == "confirmed")
    off = sorted(k for k, v in kinds.items() if v.state == "off")
    out["provisional"], out["confirmed"], out["warmup_off"] = prov, conf, off
    parts = []
    if prov:
        parts.append(f"on — warm-up certified, checking on your traffic: {', '.join(prov)}")
    if conf:
        parts.append(f"on — warm-up certified and confirmed on your traffic: {', '.join(conf)}")
    if off:
        parts.append(f"off — warm-up certified but not on your traffic: {', '.join(off)}")
    if parts:
        out["message"] = "; ".join(parts) + "; " + str(rule_state.get("message", ""))
        if rule_state.get("state") in ("learning", "off") and (prov or conf):
            out["state"] = "provisional" if prov else "certified"
    ws = wl.rule_state(wns, warm)
    out["warmup"] = {"namespace": wns, "state": ws["state"], "labels": ws["labels_total"],
                     "message": ws["message"], "strata": ws["strata"]}
    return out


__all__ = ["KindState", "WARMUP_SUFFIX", "WarmupSettings", "configure", "current_settings", "is_warmup_namespace",
           "kind_states", "overlay_state", "provisional", "publish", "warm_learner", "warm_settings",
           "warmup_namespace"]
