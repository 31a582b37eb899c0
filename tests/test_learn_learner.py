"""Learning mode's state machine on a real learn.sqlite (carnator_core/learn): fits from covariates, switch-on per
stratum by the anytime-valid sequence, the audit's drift test turning a stratum off (injected drift) and learning
resuming, the learned rule file (verified on load, refused when edited or for another model), and a process killed
with SIGKILL in the middle of writing labels losing or corrupting nothing. Labels here are injected (the judge is
the test); the labelling run itself is covered through a real server in tests/test_learn_server.py."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from carnator.carnator_core.learn import rulefile
from carnator.carnator_core.learn.labels import Covariate, Label, LabelStore
from carnator.carnator_core.learn.learner import STRATA, Learner, LearnSettings
from carnator.carnator_core.learn.sequence import fit_share, labels_needed
from carnator.carnator_core.risk.rule import RuleFormatError, RuleMismatchError

NS = "0123456789abcdef-cfg"
ROOT = Path(__file__).resolve().parents[1]


def feed(ln: Learner, n: int, stratum: str, rng: np.random.Generator, *, p_b: float = 0.0, kind: str = "shadow",
         start: int = 0, check: bool = True, every: int = 1) -> list[str]:
    """n served requests of ``stratum`` with discrepancies uniform in [0, 1], each labelled (b with probability
    p_b); returns the state of the stratum after every ``every``-th label (re-derived from the record, as serving
    does after each request)."""
    states = []
    for i in range(start, start + n):
        key = f"{kind}-{stratum}-{i}"
        vec = tuple(float(v) for v in rng.uniform(0.0, 1.0, 4))
        ln.store.add_covariate(NS, Covariate(key, stratum, f"e{i}", 0.9, vec, False))
        x = int(rng.random() < p_b)
        ln.store.add_label(NS, Label(key, stratum, f"e{i}", 0.9, vec, False, True, x, kind, "test-judge"))
        if check and (i - start) % every == every - 1:
            states.append(ln.state(NS)[stratum].state)
    return states


def head_needed(settings: LearnSettings) -> int:
    """Accepted labels without a failure the first stratum of the order needs (its level: δ · head_weight · 3/4)."""
    return labels_needed(settings.alpha, settings.delta * settings.head_weight * fit_share(1))


def test_a_stratum_switches_on_by_itself_and_drift_turns_it_off(tmp_path: Path) -> None:
    settings = LearnSettings(min_fit=20, level=1.0, pilot=30)  # fit 1 accepts every discrepancy of the first 20
    ln = Learner(tmp_path, settings)
    rng = np.random.default_rng(0)
    feed(ln, 20, "reseed", rng, check=False)
    st = ln.state(NS)["reseed"]
    assert st.fit is not None and st.fit.index == 1 and st.state == "learning" and "pilot" in st.message
    states = feed(ln, 200, "reseed", rng, start=20)
    order = [e for e in ln.store.events(NS) if e["kind"] == "order"]
    assert len(order) == 1 and order[0]["order"][0] == "reseed" and order[0]["since"] == 30
    first_on = states.index("certified") + 1
    seq = ln.state(NS)["reseed"].sequence
    # the pilot's 30 labels count for no test; after it, the head of the order certifies at its own level exactly
    # when the sequence at δ · ½ · 3/4 does (the accepted labels are those inside the first 20's maxima)
    accepted = [lab for lab in ln.store.labels(NS) if lab.id > 30 and lab.id <= 20 + first_on
                and all(v <= t for v, t in zip(lab.vector, ln.state(NS)["reseed"].fit.thresholds.vector()))]
    assert len(accepted) == head_needed(settings) == seq.n or seq.n >= head_needed(settings)
    assert len(accepted) == head_needed(settings)
    rs = ln.rule_state(NS)
    assert rs["state"] == "certified" and "reuse on for reseed" in rs["message"]
    assert any(e["kind"] == "on" for e in ln.store.events(NS))
    # another stratum with no labels is still learning, with its own count
    feed(ln, 3, "colour", rng)
    assert ln.state(NS)["colour"].state == "learning"
    # audits of the switched-on stratum: fine at first, then an injected drift (every audited hit now fails)
    feed(ln, 30, "reseed", rng, p_b=0.0, kind="audit", start=1000)
    assert ln.state(NS)["reseed"].state == "audited"
    drifted = feed(ln, 60, "reseed", rng, p_b=1.0, kind="audit", start=2000)
    assert "off" in drifted, drifted
    after = ln.state(NS)["reseed"]
    assert after.state == "off" and after.fit.index == 2 and "drift" in after.message
    assert any(e["kind"] == "drift" for e in ln.store.events(NS))
    assert ln.rule_state(NS)["state"] == "off"
    # learning resumes: fit 2 counts only labels after the drift, at its own (smaller) level
    again = feed(ln, 900, "reseed", rng, start=5000, every=25)
    assert again[0] == "off" and again[-1] == "certified", again
    st = ln.state(NS)["reseed"]
    assert st.fit.index == 2 and st.sequence.n >= labels_needed(0.05, settings.delta * settings.head_weight *
                                                                 fit_share(2))


def test_the_pilot_orders_the_strata_and_a_certified_stratum_passes_its_level_on(tmp_path: Path) -> None:
    """The frequent kind leads the order; once it certifies, the next kind is tested at (nearly) the head's
    level instead of its own small share — it certifies with as few labels as the head did."""
    settings = LearnSettings(min_fit=10, level=1.0, pilot=40)
    ln = Learner(tmp_path, settings)
    rng = np.random.default_rng(5)
    # the pilot: 30 colour requests and 10 size requests (one in four), all labelled, no failure
    for i in range(40):
        feed(ln, 1, "colour" if i % 4 else "size", rng, start=i, check=False)
    ln.state(NS)
    order = next(e for e in ln.store.events(NS) if e["kind"] == "order")
    assert order["order"][:2] == ["colour", "size"] and order["since"] == 40
    assert order["order"][2:] == [s for s in STRATA if s not in ("colour", "size")]
    # size alone, before colour certifies: its own share is ¼ · 3/4 of δ
    size_alone = labels_needed(0.05, 0.1 * 0.25 * 0.75)
    assert size_alone >= head_needed(settings) + 10
    # colour certifies (about two in three labels fall inside fit 1's maxima); size, fed after it, then needs no
    # more accepted labels than the head did
    feed(ln, 2 * head_needed(settings), "colour", rng, start=100, check=False)
    assert ln.state(NS)["colour"].state == "certified"
    feed(ln, 2 * size_alone, "size", rng, start=1000, check=False)
    st = ln.state(NS)["size"]
    assert st.state == "certified"
    acc = [lab for lab in ln.store.labels(NS) if lab.stratum == "size" and 40 < lab.id <= st.switched_on_at
           and all(v <= t for v, t in zip(lab.vector, st.fit.thresholds.vector()))]
    # its level: its own share plus colour's, passed on over size's fits (3/4 of it to fit 1)
    assert st.level == pytest.approx(0.1 * 0.75 * (0.25 + 0.5 * 0.75 / sum(fit_share(j) for j in range(1, 7))))
    assert len(acc) == labels_needed(0.05, st.level) < head_needed(settings) < size_alone


def test_the_pilot_puts_a_kind_that_fails_last(tmp_path: Path) -> None:
    settings = LearnSettings(min_fit=10, level=1.0, pilot=40)
    ln = Learner(tmp_path, settings)
    rng = np.random.default_rng(6)
    for i in range(40):  # motion is the most frequent kind but fails half its labels in the pilot
        feed(ln, 1, "motion" if i % 2 else "colour", rng, start=i, check=False, p_b=0.5 if i % 2 else 0.0)
    ln.state(NS)
    order = next(e for e in ln.store.events(NS) if e["kind"] == "order")["order"]
    assert order[0] == "colour" and order.index("motion") == len(order) - 1 - (len(STRATA) - 2)


def test_a_risky_stratum_never_switches_on_and_is_refitted_stricter(tmp_path: Path) -> None:
    ln = Learner(tmp_path, LearnSettings(min_fit=20, fail_after=40))
    rng = np.random.default_rng(1)
    states = feed(ln, 300, "colour", rng, p_b=0.3)
    assert "certified" not in states
    fits = ln.fits(NS)["colour"]
    assert len(fits) >= 2 and fits[1].level < fits[0].level  # refitted stricter after fit 1 failed
    assert ln.rule_state(NS)["state"] == "learning"


def test_learned_rule_file_round_trip_verification_and_refusal(tmp_path: Path) -> None:
    ln = Learner(tmp_path / "cache", LearnSettings(min_fit=20, level=1.0))
    rng = np.random.default_rng(2)
    feed(ln, 20, "reseed", rng, check=False)
    feed(ln, 200, "reseed", rng, start=20)
    doc = rulefile.build(ln, NS, model_fingerprint="0123456789abcdef0000", rule_fingerprint="cfg", arch="embedded",
                         config_meta={"steps": 20}, reuse_meta={"mode": "joint"},
                         judge={"name": "test-judge", "settings": {}})
    path = rulefile.save(doc, tmp_path / "rules" / "learned.json")
    learned = rulefile.load_learned(path)
    assert learned.on == ["reseed"] and learned.thresholds("reseed") is not None
    assert learned.rule.recall_k == 1 and learned.settings == ln.settings
    assert learned.states["reseed"].sequence.to_dict() == ln.state(NS)["reseed"].sequence.to_dict()
    # sealed: any edit (here the informative state) is refused, naming the file (tests/test_learn_rulefile.py)
    data = json.loads(path.read_text())
    data["learning"]["strata"]["reseed"]["state"] = "learning"
    with pytest.raises(RuleFormatError, match="'learned.json' fails its integrity check"):
        rulefile.from_doc(data, str(path))
    # refused for another model or config, as every rule
    with pytest.raises(RuleMismatchError):
        learned.rule.check_applicable("another-model", "cfg")
    learned.rule.check_applicable("0123456789abcdef0000", "cfg")


WRITER = r"""
import sys, time
sys.path.insert(0, {root!r})
from tests.repo_package import register_package
register_package()
from carnator.carnator_core.learn.labels import Label, LabelStore
st = LabelStore({d!r})
print("ready", flush=True)
i = 0
while True:
    st.add_label("ns", Label(f"k{{i}}", "reseed", "e", 0.9, (0.1, 0.2, 0.3, 0.4), False, True, 0, "shadow",
                             "j", {{}}, 0.5, "p" * 2000, "q" * 2000, i))
    st.charge("ns", served_s=1.0, label_s=0.5, requests=1)
    i += 1
"""


def kill_writer_mid_write(script: str, open_store: Callable[[], Any], n: int = 50) -> Any:
    """Run the writer ``script`` in its own process, let it write ``n`` labels of "ns", SIGKILL it mid-write;
    returns the record freshly opened (``open_store``) after the kill."""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == b"ready"
        deadline = time.time() + 60
        st = open_store()
        while len(st.labels("ns")) < n and time.time() < deadline:  # let it write a while, then kill it mid-write
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return open_store()


def test_sigkill_mid_label_loses_or_corrupts_nothing(tmp_path: Path) -> None:
    st = kill_writer_mid_write(WRITER.format(root=str(ROOT), d=str(tmp_path)), lambda: LabelStore(tmp_path))
    labels = st.labels("ns")
    assert st.corrupt == 0 and len(labels) >= 50
    assert [lab.seed for lab in labels] == list(range(len(labels)))  # no gap: each label whole or absent
    led = st.ledger("ns")
    assert st.corrupt == 0 and led["requests"] in (len(labels), len(labels) - 1)  # the ledger's own transaction
    # a row edited on disk is skipped and counted, never deleted
    import sqlite3

    c = sqlite3.connect(str(tmp_path / "learn.sqlite"))
    c.execute("UPDATE labels SET body = replace(body, '\"x\":0', '\"x\":1') WHERE id = 3")
    c.commit()
    c.close()
    st2 = LabelStore(tmp_path)
    assert len(st2.labels("ns")) == len(labels) - 1 and st2.corrupt == 1


def test_the_candidate_reused_and_labelled_follows_the_order_not_similarity_alone() -> None:
    """Among the recalled candidates the learned rule takes the one whose kind of change comes first in the order
    (single changes before "mixed" while the pilot runs), the most similar among equals — so a request whose most
    similar candidate differs in two ways is still labelled (and served) through the candidate that differs in one."""
    from carnator.carnator_core.learn.runtime import choose

    opts = [{"entry_id": "a", "stratum": "mixed", "similarity": 0.97}, {"entry_id": "b", "stratum": "colour",
            "similarity": 0.91}, {"entry_id": "c", "stratum": "colour", "similarity": 0.93},
            {"entry_id": "d", "stratum": "exact", "similarity": 0.99}]
    assert choose(opts, None)["entry_id"] == "c"  # the pilot: STRATA's order, mixed last, "exact" never first
    assert choose(opts, ["mixed", "colour"])["entry_id"] == "a"
    assert choose(opts[3:], None)["entry_id"] == "d" and choose([], None) is None


def test_a_learned_rule_file_keeps_its_order_and_recall(tmp_path: Path) -> None:
    ln = Learner(tmp_path / "cache", LearnSettings(min_fit=20, level=1.0, pilot=30))
    rng = np.random.default_rng(3)
    feed(ln, 20, "colour", rng, check=False)
    feed(ln, 130, "colour", rng, start=20)
    doc = rulefile.build(ln, NS, model_fingerprint="0123456789abcdef0000", rule_fingerprint="cfg", arch="embedded",
                         config_meta={"steps": 20}, reuse_meta={"mode": "joint"},
                         judge={"name": "test-judge", "settings": {}}, recall_k=5)
    learned = rulefile.from_doc(json.loads(json.dumps(doc)))
    assert learned.order[0] == "colour" and learned.order == tuple(ln.order(NS)) and learned.rule.recall_k == 5


def derive_at_once(workers: list[Learner]) -> list[dict]:
    """Every worker derives the state at the same moment (a barrier), each in its own thread; their states."""
    import threading

    go = threading.Barrier(len(workers))
    out: list[dict] = [{} for _ in workers]
    errors: list[BaseException] = []

    def derive(i: int) -> None:
        try:
            go.wait(timeout=30)
            out[i] = {k: v.to_dict() for k, v in workers[i].state(NS).items()}
        except BaseException as e:  # noqa: BLE001 — reported below
            errors.append(e)

    threads = [threading.Thread(target=derive, args=(i,)) for i in range(len(workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return out


def test_processes_deriving_at_once_on_one_folder_record_each_transition_once(tmp_path: Path) -> None:
    """Several ComfyUI processes on one cache folder (here: four connections to one learn.sqlite, deriving at the
    same moment) record one pilot order and one fit 1 — a second copy would feed a label twice into one test."""
    settings = LearnSettings(min_fit=20, level=1.0, pilot=30)
    seed_ln = Learner(tmp_path, settings)
    feed(seed_ln, 60, "reseed", np.random.default_rng(3), check=False)  # enough for fit 1 and the pilot's order
    out = derive_at_once([Learner(tmp_path, settings) for _ in range(4)])
    kinds = [(e["kind"], e.get("fit", {}).get("index") if e["kind"] == "fit" else None)
             for e in seed_ln.store.events(NS)]
    assert kinds.count(("order", None)) == 1 and kinds.count(("fit", 1)) == 1, kinds
    assert all(o == out[0] for o in out) and out[0] == {k: v.to_dict() for k, v in seed_ln.state(NS).items()}


def test_one_early_failure_does_not_send_the_most_frequent_kind_to_the_back(tmp_path: Path) -> None:
    """A pilot is small: the kind that makes half the traffic leads the order though one of its few pilot labels
    failed; only PILOT_DEMOTE more failures than successes send a kind behind the others."""
    from carnator.carnator_core.learn.learner import PILOT_DEMOTE, pilot_order

    rng = np.random.default_rng(8)
    covs, labs = [], []
    for i in range(60):
        st = "rewording" if i % 2 else ("colour" if i % 4 else "size")
        vec = tuple(float(v) for v in rng.uniform(0.0, 1.0, 4))
        covs.append(Covariate(f"k{i}", st, f"e{i}", 0.9, vec, False))
        if i % 3 == 0:
            labs.append(Label(f"k{i}", st, f"e{i}", 0.9, vec, False, True, int(st == "rewording" and i == 3),
                              "shadow", "j", id=len(labs) + 1))
    order, _ = pilot_order(covs, labs, {}, LearnSettings())
    assert order[0] == "rewording" and sum(lab.x for lab in labs if lab.stratum == "rewording") == 1 < PILOT_DEMOTE
    worse = [dataclasses.replace(lab, x=1) if lab.stratum == "rewording" else lab for lab in labs]
    assert pilot_order(covs, worse, {}, LearnSettings())[0][:2] == ["colour", "size"]


def test_the_learning_count_is_the_closest_kinds_own_labels_against_its_own_need(tmp_path: Path) -> None:
    """The badge reads "n of N labels": n and N must be one kind's (a total over all kinds against one kind's
    need read "221 of about 87" on the rewording-heavy stream while no kind was near its certificate)."""
    ln = Learner(tmp_path, LearnSettings(min_fit=10, level=1.0, pilot=20))
    rng = np.random.default_rng(9)
    feed(ln, 20, "colour", rng, check=False)  # the pilot
    ln.state(NS)  # (serving derives the state after every request: the pilot ends here)
    feed(ln, 30, "colour", rng, start=20, check=False)
    feed(ln, 25, "motion", rng, start=50, check=False, p_b=0.3)
    feed(ln, 1, "colour", rng, start=75, check=False, p_b=1.0)  # the head fails once: its estimate grows ...
    rs, states = ln.rule_state(NS), ln.state(NS)
    assert states["colour"].rank == 0 and states["colour"].sequence.b >= 1
    # ... and it is still the kind shown: the label budget goes to it first
    assert rs["state"] == "learning" and rs["labels_total"] == 76
    assert 0 < rs["labels"] == states["colour"].sequence.n < rs["needed"] == states["colour"].needed
    assert f"{rs['labels']} labels of about {rs['needed']} needed for the closest kind of change (colour)" \
        in rs["message"] and "76 labels in all" in rs["message"]


def test_a_new_judge_reading_starts_the_tests_afresh_and_its_labels_are_never_pooled(tmp_path: Path) -> None:
    """A record continued under another judge reading (e.g. a new checker version after an upgrade): the
    certificate earned on the old label does not carry over, and the new labels certify on their own."""
    settings = LearnSettings(min_fit=20, level=1.0, pilot=20)
    ln = Learner(tmp_path, settings)
    rng = np.random.default_rng(4)
    feed(ln, 20, "reseed", rng, check=False)
    ln.state(NS)
    assert "certified" in feed(ln, 200, "reseed", rng, start=20)
    vec = (0.1, 0.1, 0.1, 0.1)
    new = dict(judge="test-judge", judge_settings={"checker_version": 2})
    for i in range(5):  # five labels of the new reading: far too few for a certificate of their own
        key = f"v2-{i}"
        ln.store.add_covariate(NS, Covariate(key, "reseed", f"n{i}", 0.9, vec, False))
        ln.store.add_label(NS, Label(key, "reseed", f"n{i}", 0.9, vec, False, True, 0, "shadow", **new))
    st = ln.state(NS)["reseed"]
    assert st.state == "learning" and st.sequence.n == 5
    for i in range(5, 5 + 2 * head_needed(settings)):
        key = f"v2-{i}"
        ln.store.add_covariate(NS, Covariate(key, "reseed", f"n{i}", 0.9, vec, False))
        ln.store.add_label(NS, Label(key, "reseed", f"n{i}", 0.9, vec, False, True, 0, "shadow", **new))
        if ln.state(NS)["reseed"].on:
            break
    st = ln.state(NS)["reseed"]
    assert st.on and st.sequence.n == head_needed(settings)  # on the new labels alone
