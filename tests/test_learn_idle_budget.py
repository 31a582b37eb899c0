"""The idle-time worker's setting (carnator_core/learn/idle.py) without a server: when it may start a label — off,
idle only, a budget of minutes per hour, a bounded number of labels — and that a busy queue stops it. The labelling
itself and the pre-emption by a real queued prompt are tests/test_learn_idle.py."""
from __future__ import annotations

import pytest

from carnator.carnator_core.learn.idle import IdleSettings, IdleWorker


def test_when_the_worker_may_start_a_label() -> None:
    queue = {"n": 0}
    w = IdleWorker(busy=lambda: queue["n"] > 0)
    assert w.why_waiting() == "off" and w.should_stop()
    w.configure(IdleSettings(mode="idle"))
    assert w.why_waiting().startswith("waiting — no learning request") and not w.should_stop()
    queue["n"] = 1
    assert w.why_waiting() == "waiting — ComfyUI's queue holds a prompt" and w.should_stop()
    queue["n"] = 0
    w.configure(IdleSettings(mode="budget", minutes_per_hour=1.0))
    w.record_spent(30.0)
    assert "budget" not in w.why_waiting() and w.spent_last_hour() == 30.0
    w.record_spent(30.0)
    assert w.why_waiting() == "waiting — this hour's budget of 1 minutes is spent"
    w.configure(IdleSettings(mode="idle"))  # idle only: no budget
    assert "budget" not in w.why_waiting()
    w.stats.labels = 3
    w.configure(IdleSettings(mode="idle", max_labels=3))
    assert w.why_waiting().startswith("done — 3 warm-up labels")
    st = w.status()
    assert st["settings"] == {"mode": "idle", "minutes_per_hour": 10.0, "max_labels": 3} and st["labels"] == 3


def test_settings_are_checked() -> None:
    for bad in ({"mode": "sometimes"}, {"minutes_per_hour": -1.0}, {"minutes_per_hour": 61.0}, {"max_labels": -1}):
        with pytest.raises(ValueError):
            IdleSettings(**bad)
