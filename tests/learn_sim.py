"""Helpers for the learning-mode validity simulations (tests/test_learn_validity.py): an in-memory learning record
with the interface ``Learner`` reads and writes (the SQLite record's checksums and transactions are covered by
tests/test_learn_learner.py; here only what the record says matters, and thousands of labels must stay fast)."""
from __future__ import annotations

import json
from typing import Any, Mapping

from carnator_core.learn.labels import Covariate, Label, event_key


class MemoryRecord:
    """A learning record held in lists: covariates, labels (ids from 1, in insertion order), events (a transition
    with a key is recorded once, as ``LabelStore.add_event`` does) and a ledger."""

    def __init__(self) -> None:
        self._covs: dict[str, list[Covariate]] = {}
        self._cov_keys: dict[str, set[str]] = {}
        self._labels: dict[str, list[Label]] = {}
        self._events: dict[str, list[dict[str, Any]]] = {}
        self._ledger: dict[str, dict[str, float]] = {}
        self._next_id = 1
        self.corrupt = 0

    def covariates(self, namespace: str) -> list[Covariate]:
        return list(self._covs.get(namespace, []))

    def labels(self, namespace: str, kind: str | None = None) -> list[Label]:
        return [lab for lab in self._labels.get(namespace, []) if kind is None or lab.kind == kind]

    def events(self, namespace: str) -> list[dict[str, Any]]:
        return [json.loads(json.dumps(e)) for e in self._events.get(namespace, [])]

    def add_covariate(self, namespace: str, cov: Covariate) -> bool:
        keys = self._cov_keys.setdefault(namespace, set())
        if cov.request_key in keys:
            return False
        keys.add(cov.request_key)
        self._covs.setdefault(namespace, []).append(cov)
        return True

    def add_label(self, namespace: str, label: Label, *, keep_id: bool = False) -> bool:
        import dataclasses

        lab = dataclasses.replace(label, id=self._next_id)
        self._next_id += 1
        self._labels.setdefault(namespace, []).append(lab)
        return True

    def has_label(self, namespace: str, request_key: str) -> bool:
        return any(lab.request_key == request_key for lab in self._labels.get(namespace, []))

    def add_event(self, namespace: str, kind: str, message: str, **facts: Any) -> None:
        key = event_key(kind, facts)
        mine = self._events.setdefault(namespace, [])
        if key and any(event_key(str(e.get("kind", "")), e) == key for e in mine):
            return
        mine.append({"kind": kind, "message": message, **json.loads(json.dumps(facts))})

    def ledger(self, namespace: str) -> dict[str, float]:
        return dict(self._ledger.get(namespace, {"served_s": 0.0, "label_s": 0.0, "audit_s": 0.0, "requests": 0}))

    def charge(self, namespace: str, **amounts: float) -> Mapping[str, float]:
        led = self.ledger(namespace)
        for k, v in amounts.items():
            led[k] = led.get(k, 0.0) + v
        self._ledger[namespace] = led
        return led
