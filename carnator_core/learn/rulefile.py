"""The learned rule as a rule file: a RiskRule JSON document plus a ``"learning"`` key with its whole history.

What the file holds (``"learning"``):
  format/version, the namespace, the learning settings (α, δ, budget, audit share, strata correction, fit levels),
  the judge's name and settings, every label (with its SHA-256 checksum), every fit and event (switch-on, drift),
  each stratum's state as recomputed, and the sequence's method.

The RiskRule part: the thresholds of the loosest switched-on stratum (informative; the filter reads each
stratum's own from ``"learning"``), recall K = the Retriever's k the labels were made with, the reuse settings
the labels ran with, and as ``certificate`` the fixed-n exact certificate of the pooled accepted labels (beside the
anytime-valid one; it usually fails at these n, so the file is loaded with :func:`load_learned`, never as a plain
shipped rule). Nothing in the file is trusted: :func:`load_learned` re-verifies every label's checksum and
recomputes every stratum's state from the labels and fits; a number edited by hand changes nothing, and an edited
label is refused.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ..risk.bounds import clopper_pearson_upper
from ..risk.certify import Certificate, certificate_bound
from ..risk.rule import MAX_RULE_BYTES, RiskRule, RuleFormatError
from ..risk.thresholds import Thresholds
from .labels import Label, _dump, checksum
from .learner import METHOD, Learner, LearnSettings, StratumState, accepts

FORMAT = "carnator-learned-rule"
VERSION = 1
KEY = "learning"
EXACT_METHOD = "exact unconditional paired bound on (b - c)/n (risk/bounds.py: excess_upper_bound)"


def is_learned(data: Any) -> bool:
    return isinstance(data, dict) and isinstance(data.get(KEY), dict)


def build(learner: Learner, namespace: str, *, model_fingerprint: str, rule_fingerprint: str, arch: str,
          config_meta: Mapping[str, Any], reuse_meta: Mapping[str, Any] | None, judge: Mapping[str, Any],
          states: Mapping[str, StratumState] | None = None, recall_k: int = 1) -> dict[str, Any]:
    """The rule document of ``namespace``'s learning record (see the module docstring). ``recall_k``: the
    Retriever's k the labels were made with (the learned rule chooses among that many candidates)."""
    s = learner.settings
    states = learner.state(namespace) if states is None else states
    labels = learner.store.labels(namespace)
    on = [st for st in states.values() if st.on and st.fit is not None]
    loosest = max(on, key=lambda st: sum(st.fit.thresholds.vector()), default=None)  # type: ignore[union-attr]
    th = loosest.fit.thresholds if loosest is not None else Thresholds(0.0, 0.0, 0.0, 0.0)  # type: ignore[union-attr]
    # fixed-n exact certificate of the pooled accepted shadow labels, reported beside the anytime-valid one
    acc = [lab for lab in labels if lab.kind == "shadow" and lab.reusable and lab.stratum in states
           and states[lab.stratum].fit is not None and accepts(states[lab.stratum].fit.thresholds, lab.vector,
                                                               lab.missing)]
    n, b, c = len(acc), sum(lab.x == 1 for lab in acc), sum(lab.x == -1 for lab in acc)
    n_req = max(n, sum(lab.kind == "shadow" for lab in labels))
    cert = Certificate(n=n, k=b, upper_bound=certificate_bound("excess", n, b, c, s.delta), alpha=s.alpha,
                       delta=s.delta, n_requests=n_req, method=EXACT_METHOD,
                       c=c, label="excess", unsafe_upper_bound=clopper_pearson_upper(b, n, s.delta))
    rule = RiskRule(thresholds=th, certificate=cert, model_fingerprint=model_fingerprint,
                    config_fingerprint=rule_fingerprint, arch=arch, config_meta=dict(config_meta),
                    provenance={"learned": True, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                "note": "learned on served traffic (learning mode); the anytime-valid per-stratum "
                                        "certificates are in 'learning'; 'certificate' is the fixed-n bound of "
                                        "the same labels, for comparison"},
                    recall_k=max(int(recall_k), 1), recall_min_similarity=0.0,
                    reuse_config=dict(reuse_meta) if reuse_meta else None)
    doc = rule.to_json()
    doc[KEY] = {
        "format": FORMAT, "version": VERSION, "namespace": namespace, "settings": s.to_dict(),
        "judge": dict(judge), "sequence": {"method": METHOD},
        "labels": [{**lab.to_row(), "checksum": checksum(_dump(lab.to_row())), "id": lab.id} for lab in labels],
        "events": learner.store.events(namespace),
        "strata": {k: v.to_dict() for k, v in sorted(states.items())},
        "on": sorted(st.stratum for st in on),
    }
    return doc


def save(doc: Mapping[str, Any], path: str | Path) -> Path:
    """Write atomically (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{time.time_ns()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


@dataclass(frozen=True)
class LearnedRule:
    """A learned rule file, verified: the RiskRule part, the settings, and each stratum's recomputed state."""

    rule: RiskRule
    settings: LearnSettings
    namespace: str
    states: Mapping[str, StratumState]
    judge: Mapping[str, Any]
    order: tuple[str, ...] = ()  # the order its strata are certified in (the candidate it reuses follows it)

    @property
    def on(self) -> list[str]:
        return sorted(k for k, v in self.states.items() if v.on)

    def thresholds(self, stratum: str) -> Thresholds | None:
        st = self.states.get(stratum)
        return st.fit.thresholds if st is not None and st.on and st.fit is not None else None


def from_doc(data: Mapping[str, Any], source: str = "") -> LearnedRule:
    """Verify a learned rule document (module docstring). Raises RuleFormatError saying what is wrong."""
    where = f"learned rule {source!r}" if source else "learned rule"
    rule = RiskRule.from_json(dict(data), source=source, allow_uncertified=True)
    rec = data.get(KEY)
    if not isinstance(rec, dict) or rec.get("format") != FORMAT or rec.get("version") != VERSION:
        raise RuleFormatError(f"{where}: its 'learning' record is not a {FORMAT} v{VERSION} record")
    try:
        settings = LearnSettings.from_dict(rec["settings"])
        labels = []
        for i, row in enumerate(rec["labels"]):
            row = dict(row)
            digest = row.pop("checksum", None)
            # the record's own ids: fits and the pilot's end refer to labels by id (outside the checksum; they
            # must increase, or the history's order is not the one recorded)
            row_id = int(row.pop("id", i + 1))
            if labels and row_id <= labels[-1].id:
                raise RuleFormatError(f"{where}: label {i} is out of order (ids must increase)")
            if digest != checksum(_dump(row)):
                raise RuleFormatError(f"{where}: label {i} fails its checksum (edited or corrupted); the file "
                                      "cannot be trusted — use the learning record in the cache folder, or delete "
                                      "this file to learn again")
            labels.append(Label.from_row(row, row_id))
        events = [dict(e) for e in rec.get("events", [])]
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, RuleFormatError):
            raise
        raise RuleFormatError(f"{where}: its 'learning' record is malformed ({e})") from None
    learner = Learner(":memory:", settings)
    ns = str(rec.get("namespace", rule.namespace))
    for lab in labels:
        learner.store.add_label(ns, lab, keep_id=True)
    for e in events:
        e = dict(e)
        learner.store.add_event(ns, str(e.pop("kind", "")), str(e.pop("message", "")), **e)
    states = learner.state(ns, update=False)
    return LearnedRule(rule, settings, ns, states, dict(rec.get("judge", {})), tuple(learner.order(ns) or ()))


def load_learned(path: str | Path) -> LearnedRule:
    path = Path(path)
    try:
        if path.stat().st_size > MAX_RULE_BYTES:
            raise RuleFormatError(f"learned rule {path.name!r} is larger than {MAX_RULE_BYTES} bytes")
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise RuleFormatError(f"learned rule {path.name!r} cannot be read ({e})") from None
    return from_doc(data, str(path))


def read_if_learned(path: str | Path) -> Any:
    """The parsed document when ``path`` is a learned rule file, else None (a plain rule, or unreadable: the
    ordinary loader reports those)."""
    try:
        p = Path(path)
        if not p.is_file() or p.stat().st_size > MAX_RULE_BYTES:
            return None
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return data if is_learned(data) else None
