"""Two populations (carnator_core/learn/warmup.py) on a real learn.sqlite: warm-up labels certify kinds in a test of
their own, a kind certified on them switches on provisionally (audited at the higher share), audits of real traffic
confirm it — or switch it off when reuse is safe on warm-up edits but not on the traffic. Labels are injected (the
judge is the test, as in tests/test_learn_learner.py); the warm-up labelling run itself is tests/test_learn_idle.py.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from carnator.carnator_core.learn.labels import Covariate, Label
from carnator.carnator_core.learn.learner import Learner, LearnSettings
from carnator.carnator_core.learn.sequence import labels_needed
from carnator.carnator_core.learn.warmup import (
    WarmupSettings,
    overlay_state,
    provisional,
    warm_learner,
    warmup_namespace,
)

NS = "fedcba9876543210-cfg"


def add(ln: Learner, ns: str, key: str, stratum: str, rng: np.random.Generator, p_b: float, kind: str) -> int:
    """One labelled request of ``stratum`` (discrepancies uniform in [0, 0.5]: inside every fit below), b with
    probability ``p_b``; returns x."""
    vec = tuple(float(v) for v in rng.uniform(0.0, 0.5, 4))
    ln.store.add_covariate(ns, Covariate(key, stratum, "e-" + key, 0.9, vec, False))
    x = int(rng.random() < p_b)
    ln.store.add_label(ns, Label(key, stratum, "e-" + key, 0.9, vec, False, True, x, kind, "test-judge"))
    return x


def test_warm_up_certifies_provisionally_and_traffic_audits_confirm_or_switch_off(tmp_path: Path) -> None:
    settings = LearnSettings(min_fit=20, level=1.0, pilot=30)
    ln = Learner(tmp_path, settings)
    wl = warm_learner(ln)
    wns = warmup_namespace(NS)
    rng = np.random.default_rng(64)
    ws = WarmupSettings(audit_share=0.3)
    # the traffic so far: 40 requests, a few labels, nothing certified (the pilot is still running)
    for i in range(40):
        add(ln, NS, f"t{i}", ("reseed", "colour", "size")[i % 3], rng, 0.0, "shadow")
    traffic = ln.state(NS)
    assert not any(st.on for st in traffic.values())
    # idle time: warm-up labels of three kinds. reseed and colour are safe on warm-up edits; size fails 25 %
    wl.state(wns)  # the warm-up order is fixed before its first label (no pilot)
    for i in range(600):
        kind = ("reseed", "colour", "size")[i % 3]
        add(wl, wns, f"w{i}", kind, rng, 0.25 if kind == "size" else 0.0, "shadow")
        if i % 6:
            continue
        warm = wl.state(wns)
        if warm.get("reseed") and warm["reseed"].on and warm.get("colour") and warm["colour"].on:
            break
    warm = wl.state(wns)
    assert warm["reseed"].on and warm["colour"].on and not warm["size"].on
    # the warm-up test is the warm-up population's own: the traffic's tests saw none of its labels
    after = ln.state(NS)
    assert all(after[k].labels == traffic[k].labels and not after[k].on for k in traffic)
    state = overlay_state(ln, NS, ln.rule_state(NS), settings=ws)
    assert state["provisional"] == ["colour", "reseed"] and state["state"] == "provisional"
    assert state["message"].startswith("on — warm-up certified, checking on your traffic: colour, reseed")
    assert "warm-up edits" in state["strata"]["colour"]["guarantee"]
    assert state["strata"]["size"]["state"] == "learning" and state["warmup"]["labels"] > 0
    th, share = provisional(NS, "colour")
    assert share == ws.audit_share and th == warm["colour"].fit.thresholds
    assert provisional(NS, "size") is None
    # real traffic, audited: reuse of reseed is as safe as on warm-up; colour is NOT (30 % of its audits fail)
    n = {"reseed": 0, "colour": 0}
    for i in range(1500):
        kind = ("reseed", "colour")[i % 2]
        add(ln, NS, f"a{i}", kind, rng, 0.3 if kind == "colour" else 0.0, "audit")
        n[kind] += 1
        if i % 4:
            continue
        state = overlay_state(ln, NS, ln.rule_state(NS), settings=ws)
        if state["strata"]["reseed"]["state"] == "confirmed" and state["strata"]["colour"]["state"] == "off":
            break
    colour, reseed = state["strata"]["colour"], state["strata"]["reseed"]
    assert colour["state"] == "off" and "showed an excess above" in colour["message"], colour
    assert provisional(NS, "colour") is None  # the filter no longer reuses for it
    assert colour["warmup"]["drift"]["drifted"] and colour["warmup"]["audits"] < 60
    assert reseed["state"] == "confirmed" and "your traffic" in reseed["guarantee"]
    # confirmed on audits alone, at confirm_share · δ, with no audit failing: the floor of that level
    assert reseed["warmup"]["audits"] == labels_needed(settings.alpha, ws.confirm_share * settings.delta)
    assert provisional(NS, "reseed") == (warm["reseed"].fit.thresholds, settings.audit_share)
    assert state["confirmed"] == ["reseed"] and state["warmup_off"] == ["colour"]
    # off is for good: more clean audits of colour do not switch it back on
    for i in range(200):
        add(ln, NS, f"b{i}", "colour", rng, 0.0, "audit")
    assert overlay_state(ln, NS, ln.rule_state(NS), settings=ws)["strata"]["colour"]["state"] == "off"


def test_without_warm_up_labels_the_state_is_the_traffic_s(tmp_path: Path) -> None:
    ln = Learner(tmp_path, LearnSettings(min_fit=20, level=1.0, pilot=30))
    rng = np.random.default_rng(1)
    for i in range(25):
        add(ln, NS, f"t{i}", "reseed", rng, 0.0, "shadow")
    before = ln.rule_state(NS)
    assert overlay_state(ln, NS, before) == before and provisional(NS, "reseed") is None


def test_a_burst_of_audits_of_one_scene_confirms_nothing(tmp_path: Path) -> None:
    """The confirmation on traffic audits counts each cached entry once (the entry is the unit, as in the learner):
    200 clean audits of one scene are one piece of evidence; audits of as many scenes as a test needs confirm."""
    settings = LearnSettings(min_fit=20, level=1.0, pilot=30)
    ln = Learner(tmp_path, settings)
    wl = warm_learner(ln)
    wns = warmup_namespace(NS)
    rng = np.random.default_rng(7)
    wl.state(wns)
    for i in range(400):
        add(wl, wns, f"w{i}", "reseed", rng, 0.0, "shadow")
        if wl.state(wns)["reseed"].on:
            break
    assert wl.state(wns)["reseed"].on
    for i in range(200):  # a user iterating on one scene: every audit recalls the same cached entry
        vec = tuple(float(v) for v in rng.uniform(0.0, 0.5, 4))
        ln.store.add_covariate(NS, Covariate(f"s{i}", "reseed", "e-same", 0.9, vec, False))
        ln.store.add_label(NS, Label(f"s{i}", "reseed", "e-same", 0.9, vec, False, True, 0, "audit", "test-judge"))
    reseed = overlay_state(ln, NS, ln.rule_state(NS))["strata"]["reseed"]
    assert reseed["state"] == "provisional" and reseed["warmup"]["audits"] == 1, reseed
    for i in range(300):
        add(ln, NS, f"a{i}", "reseed", rng, 0.0, "audit")  # each on its own scene
    reseed = overlay_state(ln, NS, ln.rule_state(NS))["strata"]["reseed"]
    assert reseed["state"] == "confirmed", reseed
    assert reseed["warmup"]["audits"] == labels_needed(settings.alpha, WarmupSettings().confirm_share * settings.delta)
