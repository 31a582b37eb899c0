"""The Redis-backed store against a real ``redis-server``: the local store's semantics (round trip, dedupe,
namespaces, exact retrieval, hits/stats/purge, eviction policies and budget, quarantine), chunked Wan-size
entries, atomic publish, the synced per-worker index, Redis outages and restarts, and the URL rules that keep
passwords out of workflows. Pure core (no ComfyUI)."""
from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import pytest
import torch
from harness_redis import RedisServer
from test_cache_store import CFG, DIM, SMALL_IVF, carnator_warnings, make_entry

from carnator.carnator_core.cache import (
    CacheBudgetError,
    CacheError,
    CacheHandle,
    CacheUnavailableError,
    CorruptEntryError,
    EntryData,
    EntryNotFoundError,
    NamespaceMismatchError,
    RedisConfigError,
    open_store,
    orchestra,
    redis_store as rs,
    resolve_redis_url,
)
from carnator.carnator_core.cache.redis_store import RedisStore
from carnator.carnator_core.types import GenConfig, namespace_key

NS_A = namespace_key("model-a", CFG)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = RedisServer(tmp_path_factory.mktemp("redis"))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture()
def redis_url(server):
    c = server.client()
    c.flushall()
    c.close()
    return server.url


def store(url: str, **kw) -> RedisStore:
    return RedisStore.open(url, full_url=url, **kw)


def _entry_bytes(url: str) -> int:
    st = store(url)
    st.put(make_entry(0))
    n = st.stats().bytes
    st.purge()
    st.close()
    return n


# ------------------------------------------------------------------------------------------ round trip
def test_put_load_round_trip(redis_url):
    st = store(redis_url)
    data = make_entry(1)
    eid = st.put(data)
    assert len(eid) == 16 and eid.startswith(rs.ns_tag(NS_A))
    e = st.load(eid)
    assert e.entry_id == eid and e.namespace == NS_A and e.config == CFG and e.prompt == "prompt 1" and e.seed == 1
    assert e.hits == 1
    for name, t in data.tensors.items():
        assert e.tensors[name].dtype == t.dtype and torch.equal(e.tensors[name], t)
    assert e.signature.object_names() == ("cat",)
    np.testing.assert_array_equal(e.signature.objects[0].mask, data.signature.objects[0].mask)
    np.testing.assert_array_equal(e.block_structure.keep, data.block_structure.keep)
    assert e.meta["report"]["x"] == 0.5
    assert torch.equal(e.cached_run().final_latent, data.tensors["latent_final"])
    assert st.load(eid, count_hit=False).hits == 1 and st.load(eid).hits == 2
    sig = st.load_signature(eid)
    np.testing.assert_array_equal(sig.context_lab, data.signature.context_lab)
    big = st.put(make_entry(2, seed=2**64 - 1, blocks=False))
    assert st.load(big).seed == 2**64 - 1 and st.load(big).block_structure is None
    rep = st.verify(deep=True)
    assert rep.ok, rep


def test_entry_bytes_are_the_local_store_format(redis_url, tmp_path):
    """One entry format: the bytes in Redis are ``encode_entry``'s, byte for byte, and the on-disk store adopts
    them as an entry file and serves the same tensors."""
    from carnator.carnator_core.cache import Store, decode_entry, encode_entry

    st = store(redis_url)
    data = make_entry(3)
    eid = st.put(data)
    blob = b"".join(st._r.lrange(f"carnator:{{{NS_A}}}:b:{eid}", 0, -1))
    created = float(st._r.hget(f"carnator:{{{NS_A}}}:e:{eid}", "created"))
    assert blob == encode_entry(data, entry_id=eid, created=created).blob
    dec = decode_entry(blob, entry_id=eid, namespace=NS_A)
    assert dec.model_fingerprint == "model-a" and set(dec.tensors) == set(data.tensors)
    local = Store.open(tmp_path / "cache", key_path=tmp_path / "index.key")
    (local.root / "entries" / NS_A).mkdir(parents=True, exist_ok=True)
    (local.root / "entries" / NS_A / f"{eid}.safetensors").write_bytes(blob)
    assert local.scan(grace_s=0)["orphans_adopted"] == 1
    e = local.load(eid)
    assert e.prompt == data.prompt and all(torch.equal(e.tensors[k], data.tensors[k]) for k in data.tensors)
    local.close()


def test_wan_size_entry_is_chunked(redis_url):
    """A ~23 MiB entry (Wan 2.1 480p latents + attention structure) is stored as several bounded values."""
    cfg = GenConfig(**{**CFG.__dict__, "latent_shape": (16, 21, 60, 104)})
    g = torch.Generator().manual_seed(0)
    lat = [torch.randn(cfg.latent_shape, generator=g) for _ in range(3)]
    base = make_entry(1, config=cfg)
    data = EntryData(**{**base.__dict__, "namespace": "",
                        "tensors": {"latent_final": lat[0], "x0_probe": lat[1], "latent_probe": lat[2]}})
    st = store(redis_url)
    eid = st.put(data)
    ns = namespace_key("model-a", cfg)
    chunks = st._r.lrange(f"carnator:{{{ns}}}:b:{eid}", 0, -1)
    total = sum(len(c) for c in chunks)
    assert total > 23 * 2**20 and len(chunks) == -(-total // rs.CHUNK_BYTES)
    assert max(len(c) for c in chunks) <= rs.CHUNK_BYTES
    e = st.load(eid)
    assert all(torch.equal(e.tensors[k], data.tensors[k]) for k in data.tensors)


def test_put_rejects_bad_inputs(redis_url):
    st = store(redis_url)
    base = make_entry(1)
    with pytest.raises(ValueError, match="not allowed"):
        st.put(EntryData(**{**base.__dict__, "namespace": "", "tensors": {"sig.mask.0": torch.zeros(2)}}))
    with pytest.raises(TypeError, match="dtype"):
        st.put(EntryData(**{**base.__dict__, "namespace": "", "tensors": {"z": torch.zeros(2, dtype=torch.complex64)}}))
    with pytest.raises(ValueError, match="NaN"):
        st.put(EntryData(**{**base.__dict__, "namespace": "", "embedding": np.full(DIM, np.nan, np.float32)}))
    assert st.stats().entries == 0 and not list(st._r.scan_iter(match="carnator:{*}:stage:*"))


def test_dedupe_same_request(redis_url):
    st, other = store(redis_url), store(redis_url)
    a, written = st.put_with_status(make_entry(1))
    b, written2 = other.put_with_status(make_entry(1))  # another worker, same request
    assert a == b and written and not written2
    c = st.put(make_entry(1, seed=99))
    assert c != a and st.stats().entries == 2


def test_racing_publishers_leave_one_entry(redis_url):
    """Both writers passed the dedupe pre-check (a race): the publish script itself lets exactly one entry through."""
    st = store(redis_url)
    first = st.put(make_entry(1))
    racer = store(redis_url)
    real_hget = racer._r.hget
    racer._r.hget = lambda key, field: None if key.endswith(":dedup") else real_hget(key, field)  # missed it
    again, written = racer.put_with_status(make_entry(1))
    assert again == first and not written and st.stats().entries == 1
    assert not list(st._r.scan_iter(match="carnator:{*}:stage:*"))  # the loser's staging is gone


# ------------------------------------------------------------------------------------------ exact repeats
KEY_A, KEY_B = "a" * 32, "b" * 32


def keyed(i: int, key: str, **kw) -> EntryData:
    return dataclasses.replace(make_entry(i, **kw), request_key=key)


def test_find_request_across_workers_and_dedupe(redis_url):
    """As on disk: one lookup by key from any worker, one entry per (namespace, prompt, seed, key), the newest
    entry holding a key is named, malformed keys find nothing, and nothing is counted."""
    st, other = store(redis_url), store(redis_url)
    plain = st.put(make_entry(1, prompt="p", seed=1))
    assert st.find_request(KEY_A) is None and st.find_request("") is None
    a = st.put(keyed(2, KEY_A, prompt="p", seed=1))
    b = st.put(keyed(3, KEY_B, prompt="p", seed=1))
    assert len({plain, a, b}) == 3  # same prompt and seed, another request (e.g. another negative prompt)
    for s in (st, other):
        assert s.find_request(KEY_A) == a and s.find_request(KEY_B) == b
    again, written = other.put_with_status(keyed(4, KEY_A, prompt="p", seed=1))  # another worker, same request
    assert again == a and not written and st.stats().entries == 3
    for bad in ("not hex", "A" * 32, "a" * 8, "a" * 65, None, 7, KEY_A + "\n"):
        assert st.find_request(bad) is None, bad
    s0 = st.stats()
    assert (s0.lookups, s0.hits) == (0, 0)  # find_request counts nothing
    newer = other.put(keyed(5, KEY_A, prompt="another label", seed=1))  # the same request under another label
    assert newer != a and st.find_request(KEY_A) == newer and st.load(newer, count_hit=False).entry_id == newer
    assert st.verify().ok


def test_racing_publishers_of_one_request_leave_one_entry_and_its_hint(redis_url):
    st = store(redis_url)
    first = st.put(keyed(1, KEY_A))
    racer = store(redis_url)
    real_hget = racer._r.hget
    racer._r.hget = lambda key, field: None if key.endswith(":dedup") else real_hget(key, field)  # missed it
    again, written = racer.put_with_status(keyed(1, KEY_A))
    assert again == first and not written and st.stats().entries == 1
    assert store(redis_url).find_request(KEY_A) == first


def test_a_hint_lost_with_its_writer_is_written_again(redis_url):
    """A writer killed between the publish and the hint: the entry is stored but not found by key (a miss, never a
    wrong answer); the next put of the same request dedupes to it and writes the hint."""
    st = store(redis_url)

    def die(stage: str) -> None:
        if stage == "after_publish":
            raise KeyboardInterrupt

    st._fault = die
    with pytest.raises(KeyboardInterrupt):
        st.put(keyed(1, KEY_A))
    st._fault = None
    other = store(redis_url)
    assert other.stats().entries == 1 and other.find_request(KEY_A) is None
    eid, written = other.put_with_status(keyed(1, KEY_A))
    assert not written and st.find_request(KEY_A) == eid == other.entry_ids()[0]


@pytest.mark.parametrize("how", ["deleted", "evicted", "purged", "purged_all", "quarantined", "stale_hint"])
def test_find_request_never_names_a_vanished_entry(redis_url, how):
    """Every way an entry leaves the cache clears its hint; a hint left stale (a worker died between the delete
    and clearing it) answers None and is removed by the next lookup, and by ``scan``."""
    size = _entry_bytes(redis_url)
    # LRU: the least recently used entry (eid, written first and never loaded) is the one evicted
    st = store(redis_url, max_bytes=int(size * 2.5) if how == "evicted" else None, policy="lru")
    reader = store(redis_url)
    eid = st.put(keyed(1, KEY_A))
    keep = st.put(keyed(2, KEY_B))
    assert reader.find_request(KEY_A) == eid
    hints = "carnator:requests"
    if how == "deleted":
        assert st.delete(eid)
    elif how == "evicted":
        st.put(make_entry(3))  # over the budget: the oldest entry (eid) goes
        assert eid not in st.entry_ids() and keep in st.entry_ids()
    elif how == "purged":
        st.purge(NS_A)
    elif how == "purged_all":
        st.purge()
    elif how == "quarantined":
        _damage(st._r, f"carnator:{{{NS_A}}}:b:{eid}", "flip_tensor_byte")
        with pytest.raises(CorruptEntryError):
            reader.load(eid)
    else:
        real = st._scripts["forget"]
        st._scripts["forget"] = lambda **kw: 0  # the worker dies before clearing the hint
        assert st.delete(eid)
        st._scripts["forget"] = real
        assert st._r.hget(hints, KEY_A) is not None
    if how != "stale_hint":
        assert st._r.hget(hints, KEY_A) is None  # cleared with the entry, not left for a reader to find
    for s in (reader, st):
        assert s.find_request(KEY_A) is None
        with pytest.raises(EntryNotFoundError):
            s.load(eid)
    assert st._r.hget(hints, KEY_A) is None
    survivor = None if how.startswith("purged") else keep
    assert reader.find_request(KEY_B) == survivor  # another entry's hint is untouched
    if how.startswith("purged"):
        assert not st._r.exists(hints)
    st._r.hset(hints, KEY_A, eid)  # stale again: scan drops it (and only it)
    assert st.scan()["missing_rows_removed"] == 1 and st._r.hget(hints, KEY_A) is None
    assert reader.find_request(KEY_B) == survivor


def test_find_request_after_its_entry_was_evicted_meanwhile_fails_the_load_only(redis_url):
    """Found, then evicted by another worker before the load: the load raises EntryNotFoundError (the request
    treats it as "not an answer"); a hint naming another namespace's id or a foreign value finds nothing."""
    st, other = store(redis_url), store(redis_url)
    eid = st.put(keyed(1, KEY_A))
    assert st.find_request(KEY_A) == eid
    other.delete(eid)
    with pytest.raises(EntryNotFoundError):
        st.load(eid)
    b = st.put(keyed(2, KEY_B, fp="model-b"))
    st._r.hset("carnator:requests", KEY_A, b)  # names an entry that holds another key
    assert st.find_request(KEY_A) is None and st.find_request(KEY_B) == b
    st._r.hset("carnator:requests", KEY_A, "not an id")
    assert st.find_request(KEY_A) is None and st._r.hget("carnator:requests", KEY_A) is None


# ------------------------------------------------------------------------------------------ namespacing
def test_namespaces_never_mix(redis_url):
    st = store(redis_url)
    emb = np.ones(DIM, np.float32)
    cfg_b = GenConfig(**{**CFG.__dict__, "steps": 20})
    ids = {"a": st.put(make_entry(1, emb=emb)), "other_model": st.put(make_entry(2, fp="model-b", emb=emb)),
           "other_config": st.put(make_entry(3, config=cfg_b, emb=emb))}
    assert len(set(ids.values())) == 3 and len(st.namespaces()) == 3
    reader = store(redis_url)  # another worker's index
    for key, fp, cfg in (("a", "model-a", CFG), ("other_model", "model-b", CFG), ("other_config", "model-a", cfg_b)):
        ns = namespace_key(fp, cfg)
        for s in (st, reader):
            hits = s.query(ns, emb, k=10)
            assert [h[0] for h in hits] == [ids[key]] and hits[0][1] == pytest.approx(1.0, abs=1e-5)
            c = s.candidates(ns, emb, k=10)
            assert [x.entry_id for x in c.items] == [ids[key]] and c.namespace == ns
    assert st.candidates(namespace_key("model-c", CFG), emb).items == ()
    with pytest.raises(NamespaceMismatchError, match="dimension"):
        st.put(make_entry(4, dim=DIM * 2))
    with pytest.raises(ValueError, match="dimension"):
        st.query(NS_A, np.ones(DIM * 2))
    # an id is bound to its namespace: the id of an entry of another namespace with this namespace's tag is
    # simply not found, never loaded from the other namespace
    forged = rs.ns_tag(NS_A) + ids["other_model"][8:]
    with pytest.raises(EntryNotFoundError):
        st.load(forged)
    assert st.verify().ok


def test_reads_compare_the_full_model_fingerprint(redis_url):
    """As on disk: two models whose fingerprints share the namespace key's prefix never get each other's entries
    (query, candidates and load take ``model_fingerprint``); no embedding gives no retrieval."""
    a, b = "0123456789abcdef" + "aaaaaaaa", "0123456789abcdef" + "bbbbbbbb"
    ns = namespace_key(a, CFG)
    assert namespace_key(b, CFG) == ns
    st = store(redis_url)
    emb = np.ones(DIM, np.float32)
    eid = st.put(make_entry(1, fp=a, emb=emb))
    reader = store(redis_url)  # another worker
    for s in (st, reader):
        assert [x.entry_id for x in s.candidates(ns, emb, k=3, model_fingerprint=a).items] == [eid]
        assert [i for i, _ in s.query(ns, emb, k=3, model_fingerprint=a)] == [eid]
        other = s.candidates(ns, emb, k=3, model_fingerprint=b)
        assert other.items == () and "holds entries of model" in other.note
        with pytest.raises(NamespaceMismatchError, match="never reused across models"):
            s.query(ns, emb, k=3, model_fingerprint=b)
        with pytest.raises(NamespaceMismatchError, match="never reused across models"):
            s.load(eid, model_fingerprint=b)
        assert s.load(eid, model_fingerprint=a, count_hit=False).entry_id == eid
        none = s.candidates(ns, None, k=3)  # no embedding (unembeddable prompt): no retrieval, with the reason
        assert none.items == () and "no retrieval embedding" in none.note
    assert [i for i, _ in st.query(ns, emb, k=3)] == [eid]  # without a fingerprint: the namespace alone
    assert st.load(eid).hits == 1  # refused loads counted no hit


def test_surface_matches_the_local_store(redis_url, tmp_path):
    """Callers hold either store: every public method of ``Store`` but the disk-only catalogue rebuild exists on
    ``RedisStore`` with the same parameters (names, kinds, defaults), and ``scan`` reports the same keys."""
    import inspect

    from carnator.carnator_core.cache import Store

    disk_only = {"open", "rebuild_catalog"}  # open: a directory vs a URL; the catalogue is the disk store's
    checked = []
    for name, fn in inspect.getmembers(Store, callable):
        if (name.startswith("_") and name not in ("__enter__", "__exit__")) or name in disk_only:
            continue
        other = getattr(RedisStore, name, None)
        assert other is not None, f"RedisStore lacks Store.{name}"
        want, got = inspect.signature(fn).parameters, inspect.signature(other).parameters
        assert [(p.name, p.kind, p.default) for p in want.values()] == \
            [(p.name, p.kind, p.default) for p in got.values()], f"{name}: Store{inspect.signature(fn)} vs " \
            f"RedisStore{inspect.signature(other)}"
        checked.append(name)
    assert {"candidates", "query", "load", "scan", "put_with_status", "verify"} <= set(checked)
    local = Store.open(tmp_path / "cache", key_path=tmp_path / "index.key")
    st = store(redis_url)
    st.put(make_entry(1))
    st._r.rpush(f"carnator:{{{NS_A}}}:stage:feedfeedfeedfeed", b"x")  # a staging key without TTL (cannot happen)
    out = st.scan()
    assert set(out) == set(local.scan(grace_s=0)) and out["tmp_removed"] == 1
    assert not list(st._r.scan_iter(match="carnator:{*}:stage:*")) and st.stats().entries == 1
    local.close()


def test_the_catalogue_logic_is_written_once():
    """Both stores are the one orchestration over their own storage: no public method of ``StoreOrchestra`` (nor
    its eviction or quarantine) is redefined by a backend, and each backend implements the whole ``Storage``
    interface (nothing abstract left)."""
    from carnator.carnator_core.cache import Store

    shared = {n for n, v in vars(orchestra.StoreOrchestra).items() if callable(v) and not n.startswith("_")}
    assert {"put_with_status", "load", "load_signature", "candidates", "query", "find_request", "record_hit",
            "record_lookup", "delete", "purge", "stats", "verify"} <= shared
    for cls in (Store, RedisStore):
        assert issubclass(cls, orchestra.StoreOrchestra) and not cls.__abstractmethods__
        assert not (shared | {"_evict_if_needed", "_quarantine"}) & set(vars(cls)), cls.__name__


def test_query_is_exact_and_ordered(redis_url):
    st = store(redis_url)
    rng = np.random.default_rng(5)
    embs = rng.standard_normal((6, DIM)).astype(np.float32)
    ids = [st.put(make_entry(i, emb=embs[i])) for i in range(6)]
    q = embs[3] + 0.1 * rng.standard_normal(DIM).astype(np.float32)
    got = store(redis_url).query(NS_A, q, k=6)
    unit = embs / np.linalg.norm(embs, axis=1, keepdims=True)
    sims = unit @ (q / np.linalg.norm(q))
    assert [g[0] for g in got] == [ids[i] for i in np.argsort(-sims)]
    np.testing.assert_allclose([g[1] for g in got], np.sort(sims)[::-1], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------ hits / stats / purge
def test_hits_lookups_stats_purge(redis_url):
    st, other = store(redis_url), store(redis_url)
    ns_b = namespace_key("model-b", CFG)
    purges = st.purge_count()
    a = [st.put(make_entry(i)) for i in range(3)]
    b = [st.put(make_entry(10 + i, fp="model-b")) for i in range(2)]
    for _ in range(4):
        other.candidates(NS_A, np.ones(DIM), k=2)
    st.candidates(ns_b, np.ones(DIM))
    other.load(a[0])
    st.record_hit(a[1])
    s = st.stats()
    assert (s.entries, s.lookups, s.hits) == (5, 5, 2) and s.hit_rate == pytest.approx(0.4)
    sa = other.stats(NS_A)
    assert (sa.entries, sa.lookups, sa.hits) == (3, 4, 2) and sa.hit_rate == pytest.approx(0.5)
    assert sa.bytes == sum(sum(len(c) for c in st._r.lrange(f"carnator:{{{NS_A}}}:b:{i}", 0, -1)) for i in a)
    assert "hit rate: 50.0%" in sa.to_text() and sa.to_meta()["namespaces"][0]["entries"] == 3
    assert sa.path == redis_url
    assert st.purge(ns_b) == 2
    assert st.entry_ids() == a and other.query(ns_b, np.ones(DIM)) == []
    with pytest.raises(EntryNotFoundError, match="no longer in the cache"):
        other.load(b[0])
    assert other.purge() == 3
    s = st.stats()
    assert (s.entries, s.bytes, s.lookups, s.hits) == (0, 0, 0, 0)
    # every purge, by any worker, moves the count the Cache node's change fingerprint follows (puts do not)
    assert st.purge_count() == other.purge_count() == purges + 2
    assert st.query(NS_A, np.ones(DIM)) == [] and st.verify().ok
    # nothing of the purged namespaces is left in Redis but the bookkeeping of which namespaces exist
    left = {k.decode() for k in st._r.scan_iter(match="carnator:{*")}
    assert left == set(), left


# ------------------------------------------------------------------------------------------ eviction
class _Clock:
    """``time`` for the store with a clock whose timestamps all print with the same number of digits: entry sizes
    (the metadata holds the creation time) are then equal, so LCBFU's work-per-byte ties exactly."""

    def __init__(self) -> None:
        self.t = 1_700_000_000.25

    def time(self) -> float:
        self.t += 1.0
        return self.t

    def __getattr__(self, name: str):
        import time

        return getattr(time, name)


def _use_clock(monkeypatch) -> None:
    """One ``_Clock`` for the Redis storage (recency, hits) and the orchestration (an entry's creation time)."""
    clock = _Clock()
    monkeypatch.setattr(rs, "time", clock)
    monkeypatch.setattr(orchestra, "time", clock)


@pytest.mark.parametrize("policy,evicted", [("lru", 0), ("lcbfu", 1)])
def test_eviction_policies(redis_url, policy, evicted, monkeypatch):
    """As on disk: entry 0 reused once, 1 and 2 written; writing 3 evicts LRU's 0 or LCBFU's 1."""
    _use_clock(monkeypatch)
    size = _entry_bytes(redis_url)
    st = store(redis_url, max_bytes=int(size * 3.5), policy=policy)
    reader = store(redis_url)
    ids = [st.put(make_entry(0))]
    reader.candidates(NS_A, np.ones(DIM))  # builds the reader's index now; it must follow the eviction later
    reader.load(ids[0])  # a hit by another worker counts for the shared policy
    ids += [st.put(make_entry(i)) for i in (1, 2)]
    ids.append(st.put(make_entry(3)))
    left = st.entry_ids()
    assert len(left) == 3 and ids[evicted] not in left and ids[3] in left
    assert st.stats().bytes <= int(size * 3.5)
    with pytest.raises(EntryNotFoundError):
        reader.load(ids[evicted])
    assert ids[evicted] not in [h[0] for h in reader.query(NS_A, np.ones(DIM), k=10)]
    assert sorted(h[0] for h in reader.query(NS_A, np.ones(DIM), k=10)) == sorted(left)
    assert not st._r.exists(f"carnator:{{{NS_A}}}:b:{ids[evicted]}")
    assert st.verify().ok and reader.verify().ok


def test_lcbfu_ages_and_budget_error(redis_url, monkeypatch):
    _use_clock(monkeypatch)
    size = _entry_bytes(redis_url)
    st = store(redis_url, max_bytes=int(size * 2.5))
    first = st.put(make_entry(0))
    for _ in range(3):
        st.load(first)
    for i in range(1, 6):
        st.put(make_entry(i))
        assert first in st.entry_ids()
    for i in range(6, 30):
        st.put(make_entry(i))
    assert first not in st.entry_ids() and len(st.entry_ids()) == 2
    assert float(st._r.get("carnator:inflation")) > 0
    tiny = store(redis_url, max_bytes=size // 2)
    with pytest.raises(CacheBudgetError, match="max_gb"):
        tiny.put(make_entry(100))


def test_budget_spans_namespaces(redis_url):
    size = _entry_bytes(redis_url)
    st = store(redis_url, max_bytes=int(size * 3.5))
    for i in range(4):
        st.put(make_entry(i, fp="model-a" if i % 2 else "model-b"))
    assert st.stats().entries == 3 and st.stats().bytes <= int(size * 3.5)


@pytest.mark.parametrize("policy", ["lru", "lcbfu"])
def test_eviction_order_merges_namespaces_page_by_page(redis_url, policy):
    """The eviction walk reads each namespace's sorted set a page at a time and merges them: it yields every entry
    once, in the order of all the sets together (ties: the older entry), with its recorded size."""
    st = store(redis_url, policy=policy)
    for i in range(7):
        st.put(make_entry(i, fp="model-a" if i % 3 else "model-b"))
    st.load(st.entry_ids()[4])  # a hit moves one entry in both orders
    nss = st.namespaces()
    zset = "prio" if policy == "lcbfu" else "lru"
    want = sorted((score, m.decode()) for ns in nss
                  for m, score in st._r.zrange(f"carnator:{{{ns}}}:{zset}", 0, -1, withscores=True))
    for page in (1, 2, 32):
        got = list(st._eviction_order(nss, page=page))
        assert [v.entry_id for v in got] == [m[13:] for _, m in want]
        assert sum(v.nbytes for v in got) == st.stats().bytes
        assert all((v.priority is not None) == (policy == "lcbfu") for v in got)


# ------------------------------------------------------------------------------------------ corruption
def _damage(client, key: str, how: str) -> None:
    chunks = client.lrange(key, 0, -1)
    if how == "flip_tensor_byte":
        last = bytearray(chunks[-1])
        last[-3] ^= 0xFF
        client.lset(key, len(chunks) - 1, bytes(last))
    elif how == "truncate":
        client.lset(key, len(chunks) - 1, chunks[-1][: len(chunks[-1]) // 2])
    elif how == "garbage_header":
        client.lset(key, 0, b"\xff" * 64 + chunks[0][64:])
    elif how == "missing":
        client.delete(key)
    elif how == "bad_row":  # the row's chunk count is not a number (a tampered Redis): quarantined, not a crash
        client.hset(key.replace(":b:", ":e:"), "nchunks", "x")


@pytest.mark.parametrize("how", ["flip_tensor_byte", "truncate", "garbage_header", "missing", "bad_row"])
def test_corrupt_entry_is_quarantined(redis_url, caplog, how):
    st = store(redis_url)
    ids = [st.put(make_entry(i)) for i in range(3)]
    key = f"carnator:{{{NS_A}}}:b:{ids[1]}"
    _damage(st._r, key, how)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="carnator"):
        with pytest.raises(CorruptEntryError, match="Other entries are unaffected"):
            store(redis_url).load(ids[1])
    warnings = carnator_warnings(caplog)
    assert len(warnings) == 1 and ids[1] in warnings[0].getMessage()
    qkey = f"carnator:{{{NS_A}}}:q:{ids[1]}"
    assert not st._r.exists(key) and st.stats().quarantined == 1
    if how != "missing":
        assert st._r.exists(qkey) and 0 < st._r.ttl(qkey) <= rs.QUARANTINE_TTL_S
    assert dict(st.iter_quarantine(NS_A))[ids[1]]
    with pytest.raises(EntryNotFoundError):
        st.load(ids[1])
    assert len(carnator_warnings(caplog)) == 1
    for other in (ids[0], ids[2]):
        assert st.load(other).entry_id == other
    assert ids[1] not in [h[0] for h in st.query(NS_A, np.ones(DIM), k=10)]
    assert st.verify(deep=True).ok


def test_corrupt_signature_is_skipped_by_candidates(redis_url, caplog):
    st = store(redis_url)
    emb = np.ones(DIM, np.float32)
    good = st.put(make_entry(1, emb=emb))
    bad = st.put(make_entry(2, emb=emb * 2))
    row = f"carnator:{{{NS_A}}}:e:{bad}"
    sig = bytearray(st._r.hget(row, "sig"))
    sig[-2] ^= 0x55
    st._r.hset(row, "sig", bytes(sig))
    with caplog.at_level(logging.WARNING, logger="carnator"):
        c = store(redis_url).candidates(NS_A, emb, k=5)
    assert [x.entry_id for x in c.items] == [good] and f"skipped corrupt entry {bad}" in c.note
    assert len(carnator_warnings(caplog)) == 1 and st.verify().ok


# ------------------------------------------------------------------------------------------ atomic publish
def test_writer_dying_before_publish_leaves_nothing_visible(redis_url):
    st = store(redis_url)
    keep = st.put(make_entry(0))

    def die(stage: str) -> None:
        if stage == "after_stage":
            raise KeyboardInterrupt  # stands in for a SIGKILL (tests/test_redis_farm.py kills real processes)

    st._fault = die
    with pytest.raises(KeyboardInterrupt):
        st.put(make_entry(1))
    st._fault = None
    other = store(redis_url)
    assert other.entry_ids() == [keep] and other.stats().entries == 1
    assert [h[0] for h in other.query(NS_A, np.ones(DIM), k=10)] == [keep]
    staged = list(st._r.scan_iter(match="carnator:{*}:stage:*"))
    assert len(staged) == 1 and 0 < st._r.ttl(staged[0]) <= rs.STAGE_TTL_S  # expires by itself
    assert other.put(make_entry(1)) != keep and other.stats().entries == 2


# ------------------------------------------------------------------------------------------ synced index
def test_index_follows_the_stream_and_rebuilds_after_a_gap(redis_url):
    writer, reader = store(redis_url, index_params=SMALL_IVF), store(redis_url, index_params=SMALL_IVF)
    embs = np.random.default_rng(0).standard_normal((30, DIM)).astype(np.float32)
    ids = [writer.put(make_entry(i, emb=embs[i])) for i in range(4)]
    assert reader.query(NS_A, embs[2], k=1)[0][0] == ids[2] and reader.index_kind(NS_A) == "flat"
    ids += [writer.put(make_entry(i, emb=embs[i])) for i in range(4, 30)]
    writer.delete(ids[5])
    # the reader caught up from the stream: the IVF index holds exactly the live entries
    assert reader.query(NS_A, embs[7], k=1)[0][0] == ids[7] and reader.index_kind(NS_A) == "pca-ivf"
    st = reader._indexes[NS_A]
    assert st.ids == {int(s) for s in writer._r.hkeys(f"carnator:{{{NS_A}}}:sid")}
    # a gap in the stream (trimmed past this reader) makes it rebuild from the embeddings
    writer.delete(ids[6])
    writer._r.xtrim(f"carnator:{{{NS_A}}}:log", maxlen=0)
    got = [h[0] for h in reader.query(NS_A, embs[6], k=30)]
    assert ids[6] not in got and ids[5] not in got and len(got) == 28
    assert reader.verify().ok
    joining = store(redis_url, index_params=SMALL_IVF)  # a worker joining the farm builds its indexes up front
    assert joining.warm() == {NS_A: 28} and joining._indexes[NS_A].ids == reader._indexes[NS_A].ids


# ------------------------------------------------------------------------------------------ faults
def test_redis_outage_degrades_then_resumes(tmp_path, caplog):
    srv = RedisServer(tmp_path / "redis", persist=True)
    srv.start()
    try:
        st = store(srv.url, retry_s=0.2)
        kept = st.put(make_entry(1))
        assert st.candidates(NS_A, np.ones(DIM)).items
        srv.stop()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="carnator"):
            c = st.candidates(NS_A, np.ones(DIM))
            assert c.items == () and "cache unavailable" in c.note
            with pytest.raises(CacheUnavailableError, match="unreachable"):
                st.put(make_entry(2))
            with pytest.raises(CacheUnavailableError):
                st.load(kept)
            with pytest.raises(CacheUnavailableError):  # request.lookup_exact catches it and runs the request
                st.find_request(KEY_A)
            assert not st.available
            warnings = carnator_warnings(caplog)
            assert len(warnings) == 1 and "requests continue without the shared cache" in warnings[0].getMessage()
            srv.start()  # same port, same append-only file: every acknowledged write is back
            deadline = 50
            while deadline and not st.candidates(NS_A, np.ones(DIM)).items:
                import time

                time.sleep(0.1)
                deadline -= 1
        assert st.available and any("reachable again" in r.getMessage() for r in caplog.records)
        assert st.load(kept).entry_id == kept and st.put(make_entry(2))
        assert st.verify(deep=True).ok
        # a restart that lost everything (no persistence): indexes are dropped, not served stale
        srv.kill()
        srv.persist = False
        for p in srv.dir.glob("appendonly*"):
            import shutil

            shutil.rmtree(p) if p.is_dir() else p.unlink()
        srv.start()
        import time

        time.sleep(0.3)
        assert st.query(NS_A, np.ones(DIM)) == [] and st.candidates(NS_A, np.ones(DIM)).items == ()
        with pytest.raises(EntryNotFoundError):
            st.load(kept)
        new = st.put(make_entry(3))
        assert len(st.query(NS_A, np.ones(DIM))) == 1
        assert store(srv.url).load(new).entry_id == new  # the lost namespace registry was written again
    finally:
        srv.stop()


def test_open_never_fails_because_redis_is_down(caplog):
    from harness_server import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"
    with caplog.at_level(logging.WARNING, logger="carnator"):
        st = store(url, connect_timeout=0.5)
    assert not st.available and len(carnator_warnings(caplog)) == 1
    assert "cache unavailable" in st.candidates(NS_A, np.ones(DIM)).note
    with pytest.raises(CacheUnavailableError):
        st.stats()
    # code that falls back when the cache cannot serve an entry catches CacheError: that covers a Redis outage
    with pytest.raises(CacheError) as caught:
        st.load(rs.ns_tag(NS_A) + "00000000")
    assert caught.type is CacheUnavailableError


# ------------------------------------------------------------------------------------------ URLs / handle
def test_redis_urls_never_carry_passwords_and_must_be_configured(redis_url, monkeypatch):
    env = {"CARNATOR_REDIS_URL": "redis://:s3cret@cache.internal:6380/2"}
    assert resolve_redis_url("redis://", env) == "redis://cache.internal:6380/2"
    assert resolve_redis_url("redis://cache.internal:6380/2", env) == "redis://cache.internal:6380/2"
    for bad, why in (("redis://:s3cret@cache.internal:6380/2", "never be saved in a workflow"),
                     ("redis://user:pw@cache.internal:6380/2", "never be saved in a workflow"),
                     ("redis://cache.internal:6380/2?password=x", "never be saved in a workflow"),
                     ("redis://elsewhere:6379/0", "not a Redis this server may use"),
                     ("redis://cache.internal:6380/x", "must be a number")):
        with pytest.raises(RedisConfigError, match=why) as e:
            resolve_redis_url(bad, env)
        assert "s3cret" not in str(e.value)
    with pytest.raises(RedisConfigError, match="CARNATOR_REDIS_URL"):
        resolve_redis_url("redis://", {})
    # the node's handle holds the public URL only; the store finds the credentials in the environment
    monkeypatch.setenv("CARNATOR_REDIS_URL", redis_url)
    h = CacheHandle(path=resolve_redis_url("redis://"), max_bytes=None)
    st = open_store(h)
    assert isinstance(st, RedisStore) and open_store(h) is st and st.url == redis_url
    eid = st.put(make_entry(1))
    assert h.store().load(eid).entry_id == eid
    with pytest.raises(ValueError, match="public Redis URL"):
        CacheHandle(path="redis://:pw@127.0.0.1:1/0")


def test_foreign_data_in_redis_is_refused(redis_url):
    st = store(redis_url)
    st._r.set("carnator:format", '{"format": "something-else", "version": 9}')
    with pytest.raises(Exception, match="something-else"):
        store(redis_url)


def test_a_read_only_replica_serves_recalls_and_repeats_and_writes_nothing(redis_url, server, tmp_path, caplog):
    """A worker pointed at a read-only Redis replica: recalls, exact repeats and loads work, nothing is written
    (counters are skipped, a put raises CacheReadOnlyError), said once in the log."""
    from harness_redis import RedisServer

    from carnator.carnator_core.cache import CacheReadOnlyError

    key = "cd" * 16
    master = store(redis_url)
    emb = np.ones(DIM, np.float32)
    ids = [master.put(make_entry(i, emb=emb * (i + 1))) for i in range(3)]
    keyed = master.put(dataclasses.replace(make_entry(9), namespace="", request_key=key))
    replica = RedisServer(tmp_path / "replica")
    replica.start()
    try:
        c = replica.client()
        c.replicaof("127.0.0.1", server.port)
        for _ in range(600):  # bounded: 30 s for the initial sync
            if c.info("replication").get("master_link_status") == "up" and c.exists(f"{rs.PREFIX}:requests"):
                break
            time.sleep(0.05)
        with caplog.at_level(logging.WARNING, logger="carnator"):
            ro = store(replica.url)
            for _ in range(2):
                assert sorted(x.entry_id for x in ro.candidates(NS_A, emb, k=3).items) == sorted(ids)
                assert ro.find_request(key) == keyed and ro.load(keyed).prompt == "prompt 9"
                ro.record_hit(ids[0])
                with pytest.raises(CacheReadOnlyError, match="read-only"):
                    ro.put(make_entry(20))
        said = [r.getMessage() for r in carnator_warnings(caplog)]
        assert sum("read-only" in m for m in said) == 1, said
        assert ro.stats().entries == 4 and (ro.stats().lookups, ro.stats().hits) == (0, 0)  # nothing counted
        ro.close()
        c.close()
    finally:
        replica.stop()


def test_a_full_redis_refuses_writes_as_full_and_keeps_serving(tmp_path):
    """Redis at its maxmemory (noeviction): a put raises CacheFullError (what the Cache Writer turns into "not
    cached"), recalls and loads keep working, counters are skipped."""
    from carnator.carnator_core.cache import CacheFullError

    srv = RedisServer(tmp_path / "full", maxmemory="3mb")
    srv.start()
    try:
        st = store(srv.url)
        emb = np.ones(DIM, np.float32)
        ids = []
        with pytest.raises(CacheFullError, match="full"):
            for i in range(400):  # bounded: a ~6 KiB entry each, far past 3 MiB
                ids.append(st.put(make_entry(i, emb=emb * (i + 1))))
        assert ids
        for _ in range(2):
            assert {x.entry_id for x in st.candidates(NS_A, emb, k=3).items} <= set(ids)
            assert st.load(ids[0]).entry_id == ids[0]
        st.close()
    finally:
        srv.stop()


@pytest.mark.parametrize("delta", [+100, -7])
def test_a_wrong_size_in_a_row_is_corrected_from_the_entry(redis_url, caplog, delta):
    """The row (and the byte total with it) records another size than the entry's bytes have; the bytes verify
    against their own header and checksums: served, the row corrected, nothing quarantined."""
    st = store(redis_url)
    eid = st.put(make_entry(1))
    size = st.stats().bytes
    c = rs.redis.Redis.from_url(redis_url)
    p = f"{rs.PREFIX}:{{{NS_A}}}:"
    c.hincrby(p + f"e:{eid}", "nbytes", delta)
    c.incrby(p + "bytes", delta)
    assert st.verify().ok and st.stats().bytes == size + delta
    with caplog.at_level(logging.WARNING, logger="carnator"):
        assert st.load(eid).prompt == "prompt 1"
        assert st.load(eid, count_hit=False).nbytes == size
    assert st.entry_ids() == [eid] and st.stats().quarantined == 0
    assert st.stats().bytes == size and st.verify(deep=True).ok
    assert sum("size" in r.getMessage() for r in carnator_warnings(caplog)) == 1
    c.close()


def test_a_redis_flushed_by_hand_while_workers_run_comes_back_fresh(redis_url):
    """The shared store's counterpart of a cache folder deleted by hand: FLUSHALL while a worker holds the store
    and its index. The next calls see an empty cache, the next put writes a fresh one (format marker, namespace,
    tag), and a worker opened afterwards uses it; nothing is refused."""
    st = store(redis_url)
    emb = np.ones(DIM, np.float32)
    st.put(make_entry(1, emb=emb))
    assert st.candidates(NS_A, emb, k=2).items
    c = rs.redis.Redis.from_url(redis_url)
    c.flushall()
    assert st.candidates(NS_A, emb, k=2).items == () and st.stats().entries == 0
    eid = st.put(make_entry(2, emb=emb))
    assert [x.entry_id for x in st.candidates(NS_A, emb, k=2).items] == [eid]
    other = store(redis_url)  # a worker started after the flush
    assert other.load(eid).prompt == "prompt 2" and other.exists() and other.verify().ok
    c.close()
