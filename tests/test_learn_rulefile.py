"""A learned rule a user can keep, move and trust (carnator_core/learn/rulefile.py, runtime.adopt_rule_file) on real
files and a real learn.sqlite:

* integrity — every part that decides what is served (thresholds, fits, switch-on events, labels, settings,
  fingerprints, namespace) is under the file's seal: an edit is refused naming the file; a file resealed by someone
  else (a forger, another installation) is recognised as a copy, and a forged namespace or a malformed event is
  still refused by name;
* a copy keeps what it certified — copied to another cache folder, its record is imported into the local one
  (ids, fits and the pilot's order kept), the first label there rewrites it with every label, a diverging local
  record is set aside (kept), and on a shared record that cannot take it the file is never rewritten;
* bounded — labels compact, each prompt once, a stated cap; over it the prompts go, past it the file is kept as
  last written while the record goes on learning;
* the node's learn_budget and audit_share are honoured when a learned file exists.
Labels are injected (the judge is the test), as in tests/test_learn_learner.py."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from carnator.carnator_core.learn import rulefile, runtime
from carnator.carnator_core.learn.labels import Covariate, Label, LabelStore
from carnator.carnator_core.learn.learner import Learner, LearnSettings, label_draw, rule_namespace
from carnator.carnator_core.risk.rule import RuleFormatError
from carnator.carnator_core.types import Candidates, GenConfig

MODEL = "0123456789abcdef" + "77" * 8
CONFIG = GenConfig(arch="embedded", latent_shape=(4, 3, 8, 8), steps=20, sampler="euler", scheduler="normal", cfg=5.0,
                   sigmas_digest="sigmas", probe_steps=2)
NS = rule_namespace(MODEL, CONFIG.rule_fingerprint())
SETTINGS = LearnSettings(min_fit=20, level=1.0, pilot=30)
PROBE = SimpleNamespace(model_fingerprint=MODEL, config=CONFIG)  # what _write_rule reads of the Early Probe
JUDGE = SimpleNamespace(name="test-judge", settings={})


def feed(ln: Learner, n: int, stratum: str, rng: np.random.Generator, *, start: int = 0, p_b: float = 0.0,
         prompt: Any = "a red ball", every: int = 10) -> None:
    """n served requests of ``stratum``, each labelled (b with probability p_b); the state is derived every
    ``every`` labels (serving derives it after each request). ``prompt``: the text, or i -> text."""
    for i in range(start, start + n):
        key = f"{stratum}-{i}"
        vec = tuple(float(v) for v in rng.uniform(0.0, 1.0, 4))
        text = prompt(i) if callable(prompt) else prompt
        ln.store.add_covariate(NS, Covariate(key, stratum, f"e{i}", 0.9, vec, False))
        ln.store.add_label(NS, Label(key, stratum, f"e{i}", 0.9, vec, False, True, int(rng.random() < p_b), "shadow",
                                     "test-judge", {}, 0.5, text, text + " again", i, 1.0e9 + i))
        if (i - start) % every == every - 1:
            ln.state(NS)


def build(ln: Learner, **kw: Any) -> dict[str, Any]:
    return rulefile.build(ln, NS, model_fingerprint=MODEL, rule_fingerprint=CONFIG.rule_fingerprint(),
                          arch="embedded", config_meta=CONFIG.to_meta(), reuse_meta={"mode": "joint"},
                          judge={"name": "test-judge", "settings": {}}, **kw)


@pytest.fixture(scope="module")
def certified(tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    """A cache folder whose record certified "reseed" (about 220 labels), and its learned rule document."""
    root = tmp_path_factory.mktemp("machine_a")
    ln = Learner(root / "cache", SETTINGS)
    feed(ln, 220, "reseed", np.random.default_rng(2))
    assert ln.state(NS)["reseed"].on
    doc = build(ln)
    ln.store.close()
    return root / "cache", doc


def saved(doc: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc), encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------- 2: integrity
EDITS = {
    "a fit's threshold": lambda r: next(e for e in r["events"] if e["kind"] == "fit")["fit"]["thresholds"].update(
        context=9.0),
    "a fit's since": lambda r: next(e for e in r["events"] if e["kind"] == "fit")["fit"].update(since=5),
    "the pilot's order": lambda r: next(e for e in r["events"] if e["kind"] == "order").update(
        order=["colour", "reseed"]),
    "a switch-on event removed": lambda r: r["events"].remove(next(e for e in r["events"] if e["kind"] == "on")),
    "a label's outcome": lambda r: r["labels"][40].__setitem__(8, 1),
    "a label's discrepancies": lambda r: r["labels"][40].__setitem__(5, [0.0, 0.0, 0.0, 0.0]),
    "an invented label": lambda r: r["labels"].append([10_000, *r["labels"][-1][1:]]),
    "the settings' alpha": lambda r: r["settings"].update(alpha=0.5),
    "the namespace": lambda r: r.update(namespace="ffffffffffffffff-" + CONFIG.rule_fingerprint()),
}


@pytest.mark.parametrize("what", sorted(EDITS))
def test_an_edit_to_any_part_that_decides_is_refused_naming_the_file(certified, tmp_path, what) -> None:
    _, doc = certified
    edited = json.loads(json.dumps(doc))
    EDITS[what](edited["learning"])
    path = saved(edited, tmp_path / "rules" / "mine.json")
    with pytest.raises(RuleFormatError, match="learned rule 'mine.json' fails its integrity check") as e:
        rulefile.load_learned(path)
    assert "remove it to learn again" in str(e.value)


def test_the_rule_part_fingerprints_and_thresholds_are_sealed_too(certified, tmp_path) -> None:
    _, doc = certified
    for edit in (lambda d: d["thresholds"].update(context=9.0),
                 lambda d: d["model"].update(fingerprint="ffffffffffffffff" + MODEL[16:]),
                 lambda d: d["config"].update(fingerprint="another")):
        edited = json.loads(json.dumps(doc))
        edit(edited)
        with pytest.raises(RuleFormatError, match="integrity"):
            rulefile.from_doc(edited, str(saved(edited, tmp_path / "mine.json")))
    assert rulefile.from_doc(json.loads(json.dumps(doc))).on == ["reseed"]  # the untouched file loads


def test_a_resealed_file_is_a_copy_and_a_forged_namespace_or_event_is_still_refused(certified, tmp_path) -> None:
    """A digest can be recomputed by anyone: what a forger's file cannot have is this installation's seal (it
    loads as a copy), nor a namespace that is not its fingerprints', nor a malformed event."""
    _, doc = certified
    assert rulefile.from_doc(json.loads(json.dumps(doc))).origin == "sealed here"
    other = json.loads(json.dumps(doc))
    rulefile.seal(other, key=b"another installation's key")
    assert rulefile.from_doc(other).origin == "copied"
    forged = json.loads(json.dumps(doc))
    forged["model"]["fingerprint"] = "ffffffffffffffff" + MODEL[16:]  # "another model's learned rule applies"
    rulefile.seal(forged, key=b"forger")
    with pytest.raises(RuleFormatError, match="'forged.json': its namespace .* is not the one of its model"):
        rulefile.from_doc(forged, "rules/forged.json")
    bad = json.loads(json.dumps(doc))
    fit = next(i for i, e in enumerate(bad["learning"]["events"]) if e["kind"] == "fit")
    del bad["learning"]["events"][fit]["fit"]["thresholds"]
    rulefile.seal(bad, key=b"forger")
    with pytest.raises(RuleFormatError, match=rf"'bad.json': event {fit} \('fit'\) is malformed \(KeyError"):
        rulefile.from_doc(bad, "rules/bad.json")
    old = json.loads(json.dumps(doc))
    old["learning"]["version"] = 1
    with pytest.raises(RuleFormatError, match="v1; this Carnator reads v2 .*remove or rename the file"):
        rulefile.from_doc(old, "old.json")


# ---------------------------------------------------------------------------------------------- 1: a copy
def test_a_copied_rule_is_imported_and_the_first_label_there_keeps_every_label_and_switch_on(certified,
                                                                                         tmp_path) -> None:
    _, doc = certified
    n = len(doc["learning"]["labels"])
    copy = rulefile.seal(json.loads(json.dumps(doc)), key=b"machine A")  # written on another machine
    path = saved(copy, tmp_path / "rules" / "mine.json")
    ln = Learner(tmp_path / "cache_b", SETTINGS)
    feed(ln, 0, "reseed", np.random.default_rng(1))
    note = runtime.adopt_rule_file(ln, NS, path)
    assert f"mine.json (a copy (not sealed by this installation), {n} labels, reuse on for reseed) imported" in note
    assert len(ln.store.labels(NS)) == n and ln.state(NS)["reseed"].on
    assert runtime.adopt_rule_file(ln, NS, path) == ""  # once
    # the first label on machine B rewrites the file from B's record: every label, reseed still on, sealed here
    feed(ln, 1, "reseed", np.random.default_rng(9), start=5000, every=1)
    notes: list[str] = []
    runtime._LAST_ON.pop(str(path), None)
    runtime._write_rule(ln, NS, {"rule_path": str(path), "k": 1}, PROBE, None, JUDGE, notes=notes)
    back = rulefile.load_learned(path)
    assert notes == [] and back.origin == "sealed here" and len(back.labels) == n + 1 and back.on == ["reseed"]
    assert [e["kind"] for e in back.events] == [e["kind"] for e in doc["learning"]["events"]]


def test_a_local_record_that_diverges_is_set_aside_not_lost(certified, tmp_path) -> None:
    _, doc = certified
    path = saved(doc, tmp_path / "rules" / "mine.json")
    ln = Learner(tmp_path / "cache_b", SETTINGS)
    feed(ln, 30, "colour", np.random.default_rng(4))  # B's own learning, before the copy arrived
    mine = len(ln.store.labels(NS))
    note = runtime.adopt_rule_file(ln, NS, path)
    (aside,) = [ns for ns in ln.store.namespaces() if ns != NS]
    assert aside.startswith(NS + "~set-aside-") and f"kept as {aside}" in note
    assert len(ln.store.labels(aside)) == mine and len(ln.store.labels(NS)) == len(doc["learning"]["labels"])
    assert ln.state(NS)["reseed"].on


def test_a_damaged_local_record_is_rebuilt_from_the_rule_file(certified, tmp_path) -> None:
    """The rule file is the record's copy: a learn.sqlite that was set aside (damage) comes back from it."""
    src, doc = certified
    path = saved(doc, tmp_path / "rules" / "mine.json")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "learn.sqlite").write_bytes(b"not a database at all" * 200)
    ln = Learner(tmp_path / "cache", SETTINGS)
    assert "set aside in quarantine/" in ln.store.problem
    runtime.adopt_rule_file(ln, NS, path)
    assert [runtime._ident(x) for x in ln.store.labels(NS)] == \
        [runtime._ident(x) for x in LabelStore(src, read_only=True).labels(NS)]
    assert ln.state(NS)["reseed"].on


# ---------------------------------------------------------------------------------------------- 3: bounded
def test_the_learned_file_is_compact_with_each_prompt_once_and_bounded(tmp_path) -> None:
    ln = Learner(tmp_path / "cache", SETTINGS)
    long = ["a " + "very " * 400 + f"long prompt {k}" for k in range(5)]  # ~2 KB each, as real prompts can be
    feed(ln, 2000, "reseed", np.random.default_rng(3), prompt=lambda i: long[i % 5], every=50)
    doc = build(ln)
    path = rulefile.save(doc, tmp_path / "rules" / "big.json", rebuild=lambda keep: build(ln, keep_prompts=keep))
    size = path.stat().st_size
    assert len(doc["learning"]["prompts"]) == 10 and size < 2000 * 300  # v1 kept ~4 KB a label
    loaded = rulefile.load_learned(path)
    assert len(loaded.labels) == 2000 and loaded.labels[7].prompt == long[2]
    # distinct prompts past a (here small) cap: written without them, same states
    distinct = Learner(tmp_path / "cache2", SETTINGS)
    feed(distinct, 300, "reseed", np.random.default_rng(3), prompt=lambda i: f"{i} " + "word " * 300)
    cap = 300 * 400
    full = build(distinct)
    assert len(json.dumps(full)) > cap
    p2 = rulefile.save(full, tmp_path / "rules" / "capped.json", cap=cap,
                       rebuild=lambda keep: build(distinct, keep_prompts=keep))
    small = rulefile.load_learned(p2)
    assert p2.stat().st_size <= cap and small.labels[0].prompt == ""
    decides = ("state", "fit", "sequence", "drift", "level")  # (the file holds no covariates: their count differs)
    assert {k: {f: v.to_dict()[f] for f in decides} for k, v in small.states.items()} == \
        {k: {f: v.to_dict()[f] for f in decides} for k, v in distinct.state(NS, update=False).items()}
    # past the cap even without prompts: the file stays as last written, learning goes on in the record
    before = p2.read_bytes()
    cap = len(before) + 2000  # room for a few more labels, not for 200
    feed(distinct, 200, "reseed", np.random.default_rng(5), start=300)
    with pytest.raises(rulefile.LearnedFileFull, match=f"over its cap of {cap} bytes .*learning continues"):
        rulefile.save(build(distinct), p2, cap=cap, rebuild=lambda keep: build(distinct, keep_prompts=keep))
    assert p2.read_bytes() == before and len(distinct.store.labels(NS)) == 500
    notes: list[str] = []
    runtime._LAST_ON.pop(str(p2), None)
    old_cap = rulefile.MAX_LEARNED_BYTES
    try:
        rulefile.MAX_LEARNED_BYTES = cap
        runtime._write_rule(distinct, NS, {"rule_path": str(p2), "k": 1}, PROBE, None, JUDGE, notes=notes)
    finally:
        rulefile.MAX_LEARNED_BYTES = old_cap
    assert p2.read_bytes() == before and notes and "over its cap" in notes[0]


# ---------------------------------------------------------------------------------------------- 6: settings
def test_the_nodes_budget_and_audit_share_are_honoured_with_a_learned_file(certified, tmp_path) -> None:
    _, doc = certified
    learned = rulefile.from_doc(json.loads(json.dumps(doc)))
    assert learned.settings.budget == 0.2
    node = LearnSettings(budget=0.0, audit_share=0.5)
    d = runtime.learning_decision(None, Candidates(NS, ()), None, rule_file="mine.json",
                                  rule_path=tmp_path / "mine.json", learned=learned, settings=node)
    got = LearnSettings.from_dict(d.learning["settings"])
    assert got.budget == 0.0 and got.audit_share == 0.5 and got.alpha == learned.settings.alpha
    ln = Learner(tmp_path / "cache", got)
    ln.store.charge(NS, served_s=100.0, requests=10)
    # learn_budget = 0: the label coin never comes up and the ledger is over budget as soon as anything was served
    assert got.label_share == 0.0 and not any(label_draw(got.label_share, f"r{i}") for i in range(200))
    assert ln.over_budget(NS) is False and LearnSettings(budget=0.2).label_share > 0
    ln.store.charge(NS, label_s=0.5)
    assert ln.over_budget(NS)


def test_the_badge_says_a_copy_was_imported_once(certified, tmp_path) -> None:
    """Through the Risk Filter's decision and the sampler's hook (``observe``) on a request that recalled nothing:
    the summary says the rule is a copy; the first request's rule_state says it was imported, the next does not."""
    _, doc = certified
    copy = rulefile.seal(json.loads(json.dumps(doc)), key=b"machine A")
    path = saved(copy, tmp_path / "rules" / "mine.json")
    probe = SimpleNamespace(model_fingerprint=MODEL, config=CONFIG, answered=None, request_key="r1")
    report = SimpleNamespace(decision="dense")
    states = []
    for key in ("r1", "r2"):
        probe.request_key = key
        d = runtime.learning_decision(None, Candidates(NS, ()), probe, rule_file="mine.json", rule_path=path,
                                      learned=rulefile.load_learned(path), settings=LearnSettings())
        assert "mine.json is a copy (not sealed by this installation)" in d.summary
        states.append(runtime.observe(directory=tmp_path / "cache_b", model=None, positive=None, negative=None,
                                      latent={}, probe=probe, signature=None, decision=d, samples=None,
                                      report=report, store=None, reuse_config=None, served_s=1.0))
    assert states[0]["state"] == "certified" and "reuse on for reseed" in states[0]["message"]
    assert f"{len(doc['learning']['labels'])} labels, reuse on for reseed) imported into this cache's learning " \
        "record" in states[0]["message"]
    assert "imported" not in states[1]["message"] and states[1]["state"] == "certified"
