"""Learning mode's record on a real ``redis-server`` (carnator_core/learn/redis_labels.py): a farm's workers share
one record, so two Learners on one Redis (two workers) derive the same state after interleaved labels — the state a
single worker's learn.sqlite gives for the same labels — and write each state transition once even when they
derive at the same moment; a writer SIGKILLed mid-write loses or corrupts nothing; a corrupted row is skipped and
counted, never deleted; the panel's ``GET /carnator/rules`` reads a Redis cache's record. Labels are injected (the
judge is the test), as in tests/test_learn_learner.py."""
from __future__ import annotations

import numpy as np
import pytest
import test_redis_store
from test_learn_learner import NS, ROOT, WRITER as SQLITE_WRITER, derive_at_once, feed, kill_writer_mid_write
from test_learn_rulefile import certified  # noqa: F401 — the fixture (a certified record and its learned rule)

from carnator.carnator_core.learn.labels import Covariate, Label, LabelStoreError
from carnator.carnator_core.learn.learner import Learner, LearnSettings, learner_for, rule_namespace
from carnator.carnator_core.learn.redis_labels import RedisLabelStore

server, redis_url = test_redis_store.server, test_redis_store.redis_url  # the real redis-server, flushed per test


def worker(url: str, settings: LearnSettings | None = None) -> Learner:
    """A worker's Learner on the Redis record (its own connection, as another process would have)."""
    return Learner(url, settings, store=RedisLabelStore.open(url, full_url=url))


def label(i: int, stratum: str = "reseed", x: int = 0, kind: str = "shadow") -> Label:
    return Label(f"k{i}", stratum, f"e{i}", 0.9, (0.1, 0.2, 0.3, 0.4), False, True, x, kind, "j", {"a": 1}, 0.5,
                 "p", "q", i)


def states(ln: Learner) -> dict:
    return {k: v.to_dict() for k, v in ln.state(NS).items()}


def test_two_workers_on_one_redis_record_agree_with_each_other_and_with_one_local_worker(redis_url, tmp_path):
    settings = LearnSettings(min_fit=20, level=1.0, pilot=30)
    a, b = worker(redis_url, settings), worker(redis_url, settings)
    local = Learner(tmp_path, settings)  # the same labels through one worker's learn.sqlite
    rng_a, rng_b = np.random.default_rng(7), np.random.default_rng(7)
    turns = ["a", "b", "b", "a", "b", "a", "a", "b"]
    for i in range(200):
        w = a if turns[i % len(turns)] == "a" else b  # interleaved: each worker labels some of the stream
        stratum = "reseed" if i % 3 else "colour"
        feed(w, 1, stratum, rng_a, start=i, check=False)
        feed(local, 1, stratum, rng_b, start=i, check=False)
        if i % 10 == 9:  # serving derives the state after each request; here every 10th, on the labelling worker
            w.state(NS)
            local.state(NS)
            assert states(a) == states(b) == states(local), i
    final = states(a)
    assert final["reseed"]["state"] in ("certified", "audited") and final == states(b) == states(local)
    assert a.rule_state(NS) == b.rule_state(NS)
    # one record: each worker reads the other's labels, covariates and ledger; ids increase across workers
    ids = [lab.id for lab in a.store.labels(NS)]
    assert len(ids) == 200 and ids == sorted(ids) and len(set(ids)) == 200
    assert [lab.request_key for lab in b.store.labels(NS)] == [lab.request_key for lab in local.store.labels(NS)]
    assert len(b.store.covariates(NS)) == 200 and a.store.namespaces() == [NS]
    a.store.charge(NS, served_s=1.5, requests=1)
    b.store.charge(NS, label_s=0.25, requests=1)
    assert a.store.ledger(NS) == {"served_s": 1.5, "label_s": 0.25, "audit_s": 0.0, "requests": 2}
    assert [e["kind"] for e in a.store.events(NS)] == [e["kind"] for e in local.store.events(NS)]
    assert a.store.corrupt == b.store.corrupt == 0


def test_workers_deriving_at_once_record_each_transition_once(redis_url):
    settings = LearnSettings(min_fit=20, level=1.0, pilot=30)
    seed_ln = worker(redis_url, settings)
    feed(seed_ln, 60, "reseed", np.random.default_rng(3), check=False)  # enough for fit 1 and the pilot's order
    out = derive_at_once([worker(redis_url, settings) for _ in range(4)])  # all find no fit and no order yet
    events = seed_ln.store.events(NS)
    kinds = [(e["kind"], e.get("fit", {}).get("index") if e["kind"] == "fit" else None) for e in events]
    assert kinds.count(("order", None)) == 1 and kinds.count(("fit", 1)) == 1, kinds
    assert all(o == out[0] for o in out) and out[0] == states(seed_ln)


# the learn.sqlite writer of tests/test_learn_learner.py, writing to the Redis record instead
_OPEN_SQLITE = "from carnator.carnator_core.learn.labels import Label, LabelStore\nst = LabelStore({d!r})\n"
assert _OPEN_SQLITE in SQLITE_WRITER
WRITER = SQLITE_WRITER.replace(_OPEN_SQLITE, "from carnator.carnator_core.learn.labels import Label\n"
                               "from carnator.carnator_core.learn.redis_labels import RedisLabelStore\n"
                               "st = RedisLabelStore.open({url!r}, full_url={url!r})\n")


def test_sigkill_mid_label_on_redis_loses_or_corrupts_nothing(redis_url, server):
    st = kill_writer_mid_write(WRITER.format(root=str(ROOT), url=redis_url),
                               lambda: RedisLabelStore.open(redis_url, full_url=redis_url))
    labels = st.labels("ns")
    assert st.corrupt == 0 and len(labels) >= 50
    assert [lab.seed for lab in labels] == list(range(len(labels)))  # no gap: each label whole or absent
    assert [lab.id for lab in labels] == list(range(1, len(labels) + 1))
    led = st.ledger("ns")
    assert st.corrupt == 0 and led["requests"] in (len(labels), len(labels) - 1)  # the ledger's own script
    assert led["served_s"] == float(led["requests"]) and led["label_s"] == 0.5 * led["requests"]
    # a row edited in Redis is skipped and counted, never deleted
    c = server.client()
    key = f"{st.prefix}:{{ns}}:lab"
    row = c.hget(key, "3")
    c.hset(key, "3", row.replace(b'"x":0', b'"x":1'))
    st2 = RedisLabelStore.open(redis_url, full_url=redis_url)
    assert len(st2.labels("ns")) == len(labels) - 1 and st2.corrupt == 1
    assert 3 not in [lab.id for lab in st2.labels("ns")] and c.hget(key, "3") is not None  # still there
    # a ledger edited in Redis is counted (its totals still answered, as from learn.sqlite)
    c.hset(f"{st.prefix}:{{ns}}:ledger", "served_s", "1e9")
    st3 = RedisLabelStore.open(redis_url, full_url=redis_url)
    assert st3.ledger("ns")["served_s"] == 1e9 and st3.corrupt == 1
    c.close()


def test_record_semantics_match_learn_sqlite(redis_url, server):
    st = RedisLabelStore.open(redis_url, full_url=redis_url)
    cov = Covariate("r1", "colour", "e1", 0.8, (0.1, 0.2, 0.3, 0.4), False, 1.0)
    assert st.add_covariate(NS, cov) and not st.add_covariate(NS, cov)  # once per request key
    assert st.covariates(NS) == [cov]
    assert st.add_label(NS, label(1)) and not st.add_label(NS, label(1))  # once per request key and kind
    assert st.add_label(NS, label(1, kind="audit"))  # the same request's audit is another label
    assert st.has_label(NS, "k1") and not st.has_label(NS, "k2") and not st.has_label("other", "k1")
    # a learned rule file's labels are replayed under their ids; later ids follow them
    assert st.add_label(NS, Label(**{**label(9).__dict__, "id": 40}), keep_id=True)
    assert not st.add_label(NS, Label(**{**label(10).__dict__, "id": 40}), keep_id=True)  # id taken
    st.add_label(NS, label(11))
    assert [(lab.request_key, lab.id) for lab in st.labels(NS)] == [("k1", 1), ("k1", 2), ("k9", 40), ("k11", 41)]
    assert [lab.kind for lab in st.labels(NS, "audit")] == ["audit"]
    # events: transitions once, other events every time
    assert st.add_event(NS, "fit", "m", fit={"stratum": "colour", "index": 1})
    assert not st.add_event(NS, "fit", "m again", fit={"stratum": "colour", "index": 1})
    assert st.add_event(NS, "fit", "m", fit={"stratum": "colour", "index": 2})
    assert st.add_event(NS, "note", "a") and st.add_event(NS, "note", "a")
    assert [e["kind"] for e in st.events(NS)] == ["fit", "fit", "note", "note"]
    assert st.namespaces() == [NS] and st.corrupt == 0
    # another schema is refused with what to do; a Redis that is not there says so
    c = server.client()
    c.set(f"{st.prefix}:schema", "99")
    c.close()
    with pytest.raises(LabelStoreError, match="schema 99"):
        RedisLabelStore.open(redis_url, full_url=redis_url)
    with pytest.raises(LabelStoreError, match="cannot be reached"):
        RedisLabelStore.open("redis://127.0.0.1:1/0", full_url="redis://127.0.0.1:1/0")


def test_learner_for_a_redis_cache_url_uses_the_shared_record(redis_url, monkeypatch):
    monkeypatch.setenv("CARNATOR_REDIS_URL", redis_url)
    settings = LearnSettings(min_fit=20, level=1.0, pilot=30)
    ln = learner_for(redis_url, settings)
    assert isinstance(ln.store, RedisLabelStore) and learner_for(redis_url, settings) is ln
    other = worker(redis_url, settings)
    feed(other, 5, "reseed", np.random.default_rng(1), check=False)
    assert len(ln.store.labels(NS)) == 5 and ln.rule_state(NS) == other.rule_state(NS)
    with pytest.raises(LabelStoreError, match="not configured|no longer configured"):
        learner_for("redis://10.9.9.9:6379/0", settings)  # a Redis the server owner did not configure


def test_panel_rules_route_reads_a_redis_caches_record(redis_url, server, monkeypatch, comfy_env):
    from carnator.nodes import routes

    monkeypatch.setenv("CARNATOR_REDIS_URL", redis_url)
    assert routes.rules_state("redis://") == {"directory": "redis://", "path": redis_url, "exists": False,
                                              "namespaces": []}
    c = server.client()
    assert c.keys("*") == []  # the panel reads only: an empty Redis is not claimed
    c.close()
    ln = worker(redis_url, LearnSettings(min_fit=20, level=1.0))  # the pilot the panel assumes (the default)
    feed(ln, 25, "reseed", np.random.default_rng(4), check=False)
    got = routes.rules_state("redis://")
    assert got["exists"] is True and [ns["namespace"] for ns in got["namespaces"]] == [NS]
    assert got["namespaces"][0] == ln.rule_state(NS, ln.state(NS, update=False))
    with pytest.raises(routes.RouteError, match="not a Redis this server may use"):
        routes.rules_state("redis://10.1.2.3:6379/0")



@pytest.mark.server
@pytest.mark.slow
def test_two_servers_on_one_redis_learn_one_rule(tmp_path):
    """Two real ComfyUI servers, one Redis cache: the embedded learning stream queued alternately to each lands in
    one record (one ledger, every label), both panels read the same state, and the last request's state (from
    whichever server served it) counts the labels both servers made."""
    from harness_redis import RedisServer
    from harness_server import ComfyServer, started_together
    from test_learn_server import check_learning_record, learning_stream

    with RedisServer(tmp_path / "redis") as rsrv:
        env = {"CARNATOR_REDIS_URL": rsrv.url}
        with started_together(ComfyServer(tmp_path / "a", env=env, startup_timeout=600),
                              ComfyServer(tmp_path / "b", env=env, startup_timeout=600)) as (a, b):
            states = learning_stream([a, b], "redis://")
            labels = check_learning_record(RedisLabelStore.open(rsrv.url, full_url=rsrv.url), states)
            made = [st["label"] for st in states if st["label"].startswith("shadow label")]
            assert len(made) == len(labels)  # each server's labels are in the one record
            seen = [srv.get("/carnator/rules?directory=redis://") for srv in (a, b)]
            assert seen[0] == seen[1] and seen[0]["exists"] and len(seen[0]["namespaces"]) == 1, seen
            assert seen[0]["namespaces"][0]["labels_total"] == len(labels) == states[-1]["labels_total"]


def test_a_worker_that_labelled_nothing_takes_up_the_farms_switch_on(redis_url, tmp_path):
    """A stratum certified on another worker's labels: this worker's learned rule file (what its Risk Filter reads)
    is written once the shared record says so, loads with the stratum on, and is not rewritten while nothing
    changes."""
    from types import SimpleNamespace

    from test_cache_store import CFG

    from carnator.carnator_core.learn import rulefile, runtime

    settings = LearnSettings(min_fit=20, level=1.0, pilot=30)
    labeller, idle = worker(redis_url, settings), worker(redis_url, settings)
    rng = np.random.default_rng(7)
    ns = rule_namespace("0123456789abcdef0000", CFG.rule_fingerprint())  # the probe's (a learned rule checks it)
    for i in range(200):
        vec = tuple(float(v) for v in rng.uniform(0.0, 1.0, 4))
        labeller.store.add_covariate(ns, Covariate(f"k{i}", "reseed", f"e{i}", 0.9, vec, False))
        labeller.store.add_label(ns, Label(f"k{i}", "reseed", f"e{i}", 0.9, vec, False, True, 0, "shadow", "j"))
        if i >= 30 and i % 10 == 9:
            labeller.state(ns)  # the state derived as serving does
    assert labeller.state(ns)["reseed"].on
    path = tmp_path / "rules" / "learned.json"
    probe = SimpleNamespace(model_fingerprint="0123456789abcdef0000", config=CFG)
    ctx = {"rule_path": str(path)}
    runtime._sync_rule(idle, ns, ctx, probe, None)
    learned = rulefile.load_learned(path)
    assert learned.on == ["reseed"] and learned.thresholds("reseed") is not None
    stamp = path.stat().st_mtime_ns
    runtime._sync_rule(idle, ns, ctx, probe, None)
    assert path.stat().st_mtime_ns == stamp  # nothing changed: not rewritten


def test_redis_gone_mid_run_is_a_label_store_error_saying_so(tmp_path):
    """Redis killed under an open record: every operation raises LabelStoreError naming the outage (the sampler
    turns it into the state's message and serves on), and the record works again once Redis is back."""
    from harness_redis import RedisServer

    srv = RedisServer(tmp_path / "redis", persist=True).start()
    try:
        st = RedisLabelStore.open(srv.url, full_url=srv.url)
        assert st.add_label(NS, label(1))
        srv.kill()
        for op in (lambda: st.charge(NS, served_s=1.0, requests=1), lambda: st.add_label(NS, label(2)),
                   lambda: st.labels(NS), lambda: st.has_label(NS, "k1")):
            with pytest.raises(LabelStoreError, match="cannot be reached"):
                op()
        srv.start()
        assert [lab.request_key for lab in st.labels(NS)] == ["k1"] and st.add_label(NS, label(2))
    finally:
        srv.stop()


def test_a_redis_that_may_evict_the_records_keys_is_refused_at_open_with_the_reason(redis_url, server):
    c = server.client()
    try:
        for policy in ("allkeys-lru", "allkeys-random"):
            c.config_set("maxmemory-policy", policy)
            with pytest.raises(LabelStoreError, match=f"maxmemory-policy {policy}: it may evict .* noeviction"):
                RedisLabelStore.open(redis_url, full_url=redis_url)
        c.config_set("maxmemory-policy", "volatile-lru")  # evicts only keys with an expiry: the record has none
        RedisLabelStore.open(redis_url, full_url=redis_url).close()
    finally:
        c.config_set("maxmemory-policy", "noeviction")
        c.close()


def test_a_lost_id_counter_never_makes_a_label_overwrite_another(redis_url, server):
    st = RedisLabelStore.open(redis_url, full_url=redis_url)
    for i in range(5):
        st.add_label(NS, label(i))
    c = server.client()
    c.delete(f"{st.prefix}:{{{NS}}}:seq")  # what an evicting Redis (or a hand) did to the counter
    c.close()
    assert st.add_label(NS, label(99))
    assert [(lab.request_key, lab.id) for lab in st.labels(NS)] == [(f"k{i}", i + 1) for i in range(5)] + [("k99", 6)]


def test_a_copied_rule_on_a_shared_record(redis_url, server, certified, tmp_path):  # noqa: F811
    """An empty farm record imports a copied learned rule; one with labels of its own keeps it as it is and never
    rewrites it (a shared record cannot be set aside by one worker)."""
    import json

    from test_learn_rulefile import JUDGE, NS as RNS, PROBE, SETTINGS, saved

    from carnator.carnator_core.learn import rulefile, runtime

    _, doc = certified
    path = saved(doc, tmp_path / "rules" / "mine.json")
    ln = Learner(redis_url, SETTINGS, store=RedisLabelStore.open(redis_url, full_url=redis_url))
    assert "imported into this cache's learning record" in runtime.adopt_rule_file(ln, RNS, path)
    assert len(ln.store.labels(RNS)) == len(doc["learning"]["labels"]) and ln.state(RNS)["reseed"].on
    c = server.client()
    c.flushall()
    c.close()
    ln = Learner(redis_url, SETTINGS, store=RedisLabelStore.open(redis_url, full_url=redis_url))
    ln.store.add_label(RNS, label(1, stratum="colour"))
    assert "never rewritten" in runtime.adopt_rule_file(ln, RNS, path)
    before = path.read_bytes()
    notes: list[str] = []
    runtime._LAST_ON.pop(str(path), None)
    runtime._write_rule(ln, RNS, {"rule_path": str(path), "k": 1}, PROBE, None, JUDGE, notes=notes)
    assert path.read_bytes() == before and "not rewritten" in notes[0]
    assert rulefile.from_doc(json.loads(before)).on == ["reseed"]
