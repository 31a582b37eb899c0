"""Cache store core: round trip, namespacing, dedupe, retrieval, hits, stats, purge, eviction, corruption,
index and catalogue rebuilds. Pure core (no ComfyUI). Helpers here are shared by the other test_cache_* files."""
from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import numpy as np
import pytest
import torch

from carnator.carnator_core.cache import (
    CacheBudgetError,
    CorruptEntryError,
    EntryData,
    EntryNotFoundError,
    IndexParams,
    NamespaceMismatchError,
    Store,
    embed_comfy_conditioning,
    embed_conditioning,
)
from carnator.carnator_core.types import BlockStructure, GenConfig, ObjectSignature, Signature, namespace_key

CFG = GenConfig(arch="wan21", latent_shape=(16, 2, 4, 4), steps=10, sampler="euler", scheduler="simple", cfg=5.0,
                sigmas_digest="s1", probe_steps=2)
GRID = (2, 2, 2)
DIM = 32
# min_explained=0: these tiny random embeddings are not low-rank; the tests exercise the IVF machinery itself
SMALL_IVF = IndexParams(flat_max=8, train_sample=64, reduced_dim=8, persist_every=4, min_explained=0.0)


def make_sig(names: tuple[str, ...] = ("cat",), seed: int = 0) -> Signature:
    rng = np.random.default_rng(seed)
    return Signature(
        objects=tuple(ObjectSignature(name=n, mask=rng.random(GRID, dtype=np.float32), size=0.3, lab=(50.0, 5.0, -3.0))
                      for n in names),
        context_lab=rng.random((4, 4, 3), dtype=np.float32), grid=GRID, note="test")


def make_entry(i: int, *, fp: str = "model-a", config: GenConfig = CFG, dim: int = DIM, emb: np.ndarray | None = None,
               prompt: str | None = None, seed: int | None = None, blocks: bool = True, meta: dict | None = None
               ) -> EntryData:
    g = torch.Generator().manual_seed(i)
    rng = np.random.default_rng(i)
    return EntryData(
        model_fingerprint=fp, config=config, prompt=prompt if prompt is not None else f"prompt {i}",
        seed=seed if seed is not None else i,
        embedding=emb if emb is not None else rng.standard_normal(dim).astype(np.float32),
        signature=make_sig(seed=i),
        tensors={"latent_final": torch.randn(config.latent_shape, generator=g),
                 "x0_probe": torch.randn(config.latent_shape, generator=g).to(torch.bfloat16),
                 "latent_probe": torch.randn(config.latent_shape, generator=g)},
        block_structure=BlockStructure(keep=rng.random((2, 3, 5, 5)) < 0.4, layers=(1, 2), block_size=64,
                                       n_tokens=300, steps=(3, 6)) if blocks else None,
        meta=meta if meta is not None else {"i": i, "report": {"decision": "miss", "x": np.float32(0.5)}})


def open_store(tmp_path: Path, **kw) -> Store:
    kw.setdefault("key_path", tmp_path / "index.key")
    return Store.open(tmp_path / "cache", **kw)


def carnator_warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "carnator" and r.levelno >= logging.WARNING]


# ------------------------------------------------------------------------------------------ round trip
def test_put_load_round_trip(tmp_path):
    st = open_store(tmp_path)
    data = make_entry(1)
    eid = st.put(data)
    e = st.load(eid)
    assert e.entry_id == eid and e.namespace == namespace_key("model-a", CFG) == data.namespace
    assert e.config == CFG and e.prompt == "prompt 1" and e.seed == 1 and e.hits == 1
    for name, t in data.tensors.items():
        assert e.tensors[name].dtype == t.dtype and torch.equal(e.tensors[name], t)
    assert set(e.tensors) == {"latent_final", "x0_probe", "latent_probe"}
    assert e.signature.object_names() == ("cat",) and e.signature.grid == GRID
    np.testing.assert_array_equal(e.signature.objects[0].mask, data.signature.objects[0].mask)
    np.testing.assert_array_equal(e.signature.context_lab, data.signature.context_lab)
    np.testing.assert_array_equal(e.block_structure.keep, data.block_structure.keep)
    assert e.block_structure.layers == (1, 2) and e.block_structure.steps == (3, 6)
    assert e.meta["report"]["x"] == 0.5
    np.testing.assert_allclose(np.linalg.norm(e.embedding), 1.0, rtol=1e-6)
    run = e.cached_run()
    assert run.entry_id == eid and torch.equal(run.final_latent, data.tensors["latent_final"])
    assert st.load(eid, count_hit=False).hits == 1
    assert st.load(eid).hits == 2
    # seeds beyond int64 (ComfyUI allows up to 2**64-1) survive
    big = st.put(make_entry(2, seed=2**64 - 1, blocks=False))
    assert st.load(big).seed == 2**64 - 1 and st.load(big).block_structure is None
    assert st.verify(deep=True).ok


def test_put_rejects_bad_inputs(tmp_path):
    st = open_store(tmp_path)
    base = make_entry(1)
    with pytest.raises(ValueError, match="not allowed"):
        st.put(EntryData(**{**base.__dict__, "namespace": "", "tensors": {"sig.mask.0": torch.zeros(2)}}))
    with pytest.raises(TypeError, match="dtype"):
        st.put(EntryData(**{**base.__dict__, "namespace": "", "tensors": {"z": torch.zeros(2, dtype=torch.complex64)}}))
    with pytest.raises(ValueError, match="NaN"):
        st.put(EntryData(**{**base.__dict__, "namespace": "", "embedding": np.full(DIM, np.nan, np.float32)}))
    with pytest.raises(ValueError, match="cannot be stored as JSON"):
        st.put(EntryData(**{**base.__dict__, "namespace": "", "meta": {"obj": object()}}))
    with pytest.raises(ValueError, match="does not match namespace_key"):
        EntryData(**{**base.__dict__, "namespace": "someone-elses"})
    assert st.stats().entries == 0 and not list((tmp_path / "cache" / "entries").rglob("*.safetensors"))


def test_dedupe_same_request(tmp_path):
    st = open_store(tmp_path)
    a, written = st.put_with_status(make_entry(1))
    b, written2 = st.put_with_status(make_entry(1))
    assert a == b and written and not written2
    c = st.put(make_entry(1, seed=99))
    assert c != a and st.stats().entries == 2


# ------------------------------------------------------------------------------------------ namespacing
def test_namespaces_never_mix(tmp_path):
    st = open_store(tmp_path)
    emb = np.ones(DIM, np.float32)
    cfg_b = GenConfig(**{**CFG.__dict__, "steps": 20})
    ids = {
        "a": st.put(make_entry(1, emb=emb)),
        "other_model": st.put(make_entry(2, fp="model-b", emb=emb)),
        "other_config": st.put(make_entry(3, config=cfg_b, emb=emb)),
    }
    assert len(set(ids.values())) == 3 and len(st.namespaces()) == 3
    for key, fp, cfg in (("a", "model-a", CFG), ("other_model", "model-b", CFG), ("other_config", "model-a", cfg_b)):
        ns = namespace_key(fp, cfg)
        hits = st.query(ns, emb, k=10)
        assert [h[0] for h in hits] == [ids[key]]  # the identical embeddings in other namespaces never show up
        assert hits[0][1] == pytest.approx(1.0, abs=1e-5)
        c = st.candidates(ns, emb, k=10)
        assert [x.entry_id for x in c.items] == [ids[key]] and c.namespace == ns
    unknown = namespace_key("model-c", CFG)
    assert st.query(unknown, emb) == []
    c = st.candidates(unknown, emb)
    assert c.items == () and "no cached entry" in c.note
    # a different embedding width in an existing namespace is refused (text encoder changed)
    with pytest.raises(NamespaceMismatchError, match="dimension"):
        st.put(make_entry(4, dim=DIM * 2))
    with pytest.raises(ValueError, match="dimension"):
        st.query(namespace_key("model-a", CFG), np.ones(DIM * 2))
    assert "no retrieval" in st.candidates(namespace_key("model-a", CFG), np.ones(DIM * 2)).note


def test_query_is_exact_and_ordered(tmp_path):
    st = open_store(tmp_path)
    rng = np.random.default_rng(5)
    embs = rng.standard_normal((6, DIM)).astype(np.float32)
    ids = [st.put(make_entry(i, emb=embs[i])) for i in range(6)]
    q = embs[3] + 0.1 * rng.standard_normal(DIM).astype(np.float32)
    got = st.query(namespace_key("model-a", CFG), q, k=6)
    unit = embs / np.linalg.norm(embs, axis=1, keepdims=True)
    sims = unit @ (q / np.linalg.norm(q))
    assert [g[0] for g in got] == [ids[i] for i in np.argsort(-sims)]
    np.testing.assert_allclose([g[1] for g in got], np.sort(sims)[::-1], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------ hits / stats / purge
def test_hits_lookups_stats_purge(tmp_path):
    st = open_store(tmp_path)
    ns_a, ns_b = namespace_key("model-a", CFG), namespace_key("model-b", CFG)
    a = [st.put(make_entry(i)) for i in range(3)]
    b = [st.put(make_entry(10 + i, fp="model-b")) for i in range(2)]
    for _ in range(4):
        st.candidates(ns_a, np.ones(DIM), k=2)
    st.candidates(ns_b, np.ones(DIM))
    st.load(a[0])
    st.record_hit(a[1])
    s = st.stats()
    assert (s.entries, s.lookups, s.hits) == (5, 5, 2) and s.hit_rate == pytest.approx(0.4)
    sa = st.stats(ns_a)
    assert (sa.entries, sa.lookups, sa.hits) == (3, 4, 2) and sa.hit_rate == pytest.approx(0.5)
    assert sa.bytes == sum((tmp_path / "cache" / "entries" / ns_a).joinpath(f"{i}.safetensors").stat().st_size
                           for i in a)
    assert "hit rate: 50.0%" in sa.to_text() and sa.to_meta()["namespaces"][0]["entries"] == 3
    assert st.purge(ns_b) == 2
    assert st.entry_ids() == a and st.query(ns_b, np.ones(DIM)) == []
    assert not list((tmp_path / "cache" / "entries" / ns_b).glob("*.safetensors"))
    with pytest.raises(EntryNotFoundError, match="no longer in the cache"):
        st.load(b[0])
    assert st.purge() == 3
    s = st.stats()
    assert (s.entries, s.bytes, s.lookups, s.hits) == (0, 0, 0, 0)
    assert st.verify().ok


# ------------------------------------------------------------------------------------------ eviction
def _entry_bytes(tmp_path) -> int:
    st = open_store(tmp_path / "probe-size")
    st.put(make_entry(0))
    n = st.stats().bytes
    st.close()
    return n


@pytest.mark.parametrize("policy,evicted", [("lru", 0), ("lcbfu", 1)])
def test_eviction_policies(tmp_path, policy, evicted):
    """Entry 0 is reused once early, then 1 and 2 are written; writing 3 must evict one entry. LRU evicts 0 (its
    use is the oldest); LCBFU keeps the reused 0 and evicts 1 (never reused, oldest of those)."""
    size = _entry_bytes(tmp_path)
    st = open_store(tmp_path, max_bytes=int(size * 3.5), policy=policy)
    ids = [st.put(make_entry(0))]
    st.load(ids[0])
    ids += [st.put(make_entry(i)) for i in (1, 2)]
    assert st.stats().entries == 3
    if policy == "lcbfu":  # 1 and 2 are both never reused: the one saving less work per byte goes (ties: older)
        with st._read() as c:
            nbytes = dict(c.execute("SELECT id, nbytes FROM entries").fetchall())
        evicted = 2 if nbytes[ids[2]] > nbytes[ids[1]] else 1  # sizes differ by the bytes of a timestamp
    ids.append(st.put(make_entry(3)))
    left = st.entry_ids()
    assert len(left) == 3 and ids[evicted] not in left and ids[3] in left
    assert st.stats().bytes <= int(size * 3.5)
    assert not (tmp_path / "cache" / "entries" / namespace_key("model-a", CFG) / f"{ids[evicted]}.safetensors").exists()
    with pytest.raises(EntryNotFoundError):
        st.load(ids[evicted])
    assert ids[evicted] not in [h[0] for h in st.query(namespace_key("model-a", CFG), np.ones(DIM), k=10)]
    assert st.verify().ok


def test_lcbfu_ages_and_budget_error(tmp_path):
    size = _entry_bytes(tmp_path)
    st = open_store(tmp_path, max_bytes=int(size * 2.5))
    first = st.put(make_entry(0))
    for _ in range(3):
        st.load(first)
    # a stream of one-off entries: the popular entry survives many evictions (LRU would drop it at once) ...
    for i in range(1, 6):
        st.put(make_entry(i))
        assert first in st.entry_ids()
    # ... but not forever: the inflation clock rises with every eviction, so an unused popular entry ages out
    for i in range(6, 30):
        st.put(make_entry(i))
    assert first not in st.entry_ids() and len(st.entry_ids()) == 2
    tiny = open_store(tmp_path / "tiny", max_bytes=size // 2)
    with pytest.raises(CacheBudgetError, match="max_gb"):
        tiny.put(make_entry(0))
    assert tiny.stats().entries == 0


# ------------------------------------------------------------------------------------------ corruption
def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "flip_tensor_byte":
        data[-3] ^= 0xFF  # inside the last tensor's data: only the checksum can notice
        path.write_bytes(bytes(data))
    elif how == "garbage_header":
        data[:64] = b"\xff" * 64
        path.write_bytes(bytes(data))
    elif how == "missing":
        path.unlink()
    elif how == "empty":
        path.write_bytes(b"")


def test_entry_whose_file_vanished_is_no_longer_cached(tmp_path, caplog):
    """A file removed under a row (another process evicting it right now: files go first) is "no longer cached",
    not corruption: EntryNotFoundError, the row dropped, no warning."""
    st = open_store(tmp_path)
    ids = [st.put(make_entry(i)) for i in range(2)]
    (tmp_path / "cache" / "entries" / namespace_key("model-a", CFG) / f"{ids[0]}.safetensors").unlink()
    with caplog.at_level(logging.WARNING, logger="carnator"):
        with pytest.raises(EntryNotFoundError, match="no longer in the cache"):
            st.load(ids[0])
    assert not carnator_warnings(caplog) and st.entry_ids() == [ids[1]] and st.verify(deep=True).ok


@pytest.mark.parametrize("how", ["truncate", "flip_tensor_byte", "garbage_header", "empty"])
def test_corrupt_entry_is_quarantined(tmp_path, caplog, how):
    st = open_store(tmp_path)
    ids = [st.put(make_entry(i)) for i in range(3)]
    ns = namespace_key("model-a", CFG)
    victim = tmp_path / "cache" / "entries" / ns / f"{ids[1]}.safetensors"
    _damage(victim, how)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="carnator"):
        with pytest.raises(CorruptEntryError, match="Other entries are unaffected"):
            st.load(ids[1])
    warnings = carnator_warnings(caplog)
    assert len(warnings) == 1 and ids[1] in warnings[0].getMessage()
    assert not victim.exists()
    assert (tmp_path / "cache" / "quarantine" / ns / victim.name).exists()
    assert (tmp_path / "cache" / "quarantine" / ns / f"{ids[1]}.reason.txt").exists()
    assert st.stats().quarantined == 1
    with pytest.raises(EntryNotFoundError):  # second attempt: a clean "not found", no second log line
        st.load(ids[1])
    assert len(carnator_warnings(caplog)) == 1
    for other in (ids[0], ids[2]):
        assert st.load(other).entry_id == other
    assert ids[1] not in [h[0] for h in st.query(ns, np.ones(DIM), k=10)]
    assert st.verify(deep=True).ok


def test_corrupt_signature_is_skipped_by_candidates(tmp_path, caplog):
    st = open_store(tmp_path)
    emb = np.ones(DIM, np.float32)
    good = st.put(make_entry(1, emb=emb))
    bad = st.put(make_entry(2, emb=emb * 2))  # same direction: both are candidates
    ns = namespace_key("model-a", CFG)
    path = tmp_path / "cache" / "entries" / ns / f"{bad}.safetensors"
    # flip one byte inside the sig.context_lab tensor's data
    import json
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    start, _ = json.loads(raw[8:8 + n])["sig.context_lab"]["data_offsets"]
    raw[8 + n + start] ^= 0x55
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="carnator"):
        c = st.candidates(ns, emb, k=5)
    assert [x.entry_id for x in c.items] == [good] and f"skipped corrupt entry {bad}" in c.note
    assert len(carnator_warnings(caplog)) == 1
    assert st.verify().ok


def test_missing_file_behind_the_stores_back_is_reported_and_repaired(tmp_path):
    st = open_store(tmp_path)
    ids = [st.put(make_entry(i)) for i in range(2)]
    (tmp_path / "cache" / "entries" / namespace_key("model-a", CFG) / f"{ids[0]}.safetensors").unlink()
    rep = st.verify()
    assert not rep.ok and any("file is missing" in p for p in rep.problems)
    assert st.scan()["missing_rows_removed"] == 1
    assert st.verify().ok and st.entry_ids() == [ids[1]]


# ------------------------------------------------------------------------------------------ index
def _ivf_store(tmp_path, n: int = 30, **kw) -> tuple[Store, list[str], np.ndarray]:
    st = open_store(tmp_path, index_params=SMALL_IVF, **kw)
    embs = np.random.default_rng(0).standard_normal((n, DIM)).astype(np.float32)
    ids = [st.put(make_entry(i, emb=embs[i])) for i in range(n)]
    return st, ids, embs


def test_ivf_index_persists_and_is_rebuilt_when_missing_or_corrupt(tmp_path, caplog):
    st, ids, embs = _ivf_store(tmp_path)
    ns = namespace_key("model-a", CFG)
    expected = st.query(ns, embs[7], k=5)
    assert expected[0][0] == ids[7] and st.index_kind(ns) == "pca-ivf"
    index_file = tmp_path / "cache" / "index" / f"{ns}.safetensors"
    assert index_file.exists()
    st.close()
    # reopen: loaded from the signed file, same answers
    st = open_store(tmp_path, index_params=SMALL_IVF)
    assert st.query(ns, embs[7], k=5) == expected
    st.close()
    for damage in ("delete", "garbage", "truncate"):
        if damage == "delete":
            index_file.unlink()
        elif damage == "garbage":
            index_file.write_bytes(b"not an index" * 100)
        else:
            index_file.write_bytes(index_file.read_bytes()[:200])
        caplog.clear()
        st = open_store(tmp_path, index_params=SMALL_IVF)
        with caplog.at_level(logging.WARNING, logger="carnator"):
            assert st.query(ns, embs[7], k=5) == expected
        if damage != "delete":
            assert any("rebuilt" in r.getMessage() for r in carnator_warnings(caplog))
        assert index_file.exists() and st.verify().ok
        st.close()


def test_index_file_from_another_machine_is_never_parsed(tmp_path, caplog):
    st, ids, embs = _ivf_store(tmp_path)
    ns = namespace_key("model-a", CFG)
    expected = st.query(ns, embs[3], k=4)
    st.close()
    other = open_store(tmp_path, index_params=SMALL_IVF, key_path=tmp_path / "other.key")
    with caplog.at_level(logging.WARNING, logger="carnator"):
        assert other.query(ns, embs[3], k=4) == expected
    assert any("not signed by this machine" in r.getMessage() for r in carnator_warnings(caplog))


def test_two_instances_stay_in_sync(tmp_path):
    """Writer and reader are separate Store objects (as in separate processes): the reader's index follows adds,
    deletes, evictions and purges through the change log, and through the index file once the log is pruned."""
    a, ids, embs = _ivf_store(tmp_path, n=12)
    b = open_store(tmp_path, index_params=SMALL_IVF)
    ns = namespace_key("model-a", CFG)
    assert b.query(ns, embs[5], k=1)[0][0] == ids[5]
    more = np.random.default_rng(1).standard_normal((40, DIM)).astype(np.float32)
    new_ids = [a.put(make_entry(100 + i, emb=more[i])) for i in range(40)]  # b falls far behind (log pruned)
    a.query(ns, more[0], k=1)  # a persists its index and prunes the change log
    assert b.query(ns, more[17], k=1)[0][0] == new_ids[17]
    a.delete(new_ids[17])
    assert new_ids[17] not in [h[0] for h in b.query(ns, more[17], k=3)]
    a.purge(ns)
    assert b.query(ns, more[3], k=3) == []
    c_id = a.put(make_entry(500, emb=more[3]))
    assert b.query(ns, more[3], k=3)[0][0] == c_id
    assert a.verify().ok and b.verify().ok


def test_unstructured_embeddings_fall_back_to_exact_search(tmp_path, caplog):
    """PCA-IVF on embeddings without low-rank structure would return near-random candidates: the index notices
    (variance explained by the PCA) and stays exact, with one warning, and persists that choice."""
    params = IndexParams(flat_max=8, train_sample=64, reduced_dim=4, persist_every=4)
    st = open_store(tmp_path, index_params=params)
    embs = np.random.default_rng(0).standard_normal((20, DIM)).astype(np.float32)
    ids = [st.put(make_entry(i, emb=embs[i])) for i in range(20)]
    ns = namespace_key("model-a", CFG)
    with caplog.at_level(logging.WARNING, logger="carnator"):
        got = st.query(ns, embs[11], k=20)
    assert st.index_kind(ns) == "flat" and [g[0] for g in got][0] == ids[11] and len(got) == 20
    assert any("exact flat search" in r.getMessage() for r in carnator_warnings(caplog))
    assert (tmp_path / "cache" / "index" / f"{ns}.safetensors").exists()
    st.close()
    again = open_store(tmp_path, index_params=params)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="carnator"):
        assert again.query(ns, embs[11], k=20) == got  # loaded from the file: no new PCA attempt, no warning
    assert not carnator_warnings(caplog) and again.verify().ok


# ------------------------------------------------------------------------------------------ catalogue
def test_corrupt_catalogue_is_rebuilt_from_entry_files(tmp_path, caplog):
    st = open_store(tmp_path)
    ids = [st.put(make_entry(i)) for i in range(4)]
    emb = st.load(ids[2], count_hit=False).embedding
    st.close()
    db = tmp_path / "cache" / "catalog.sqlite3"
    for suffix in ("-wal", "-shm"):
        Path(str(db) + suffix).unlink(missing_ok=True)
    db.write_bytes(b"this is not a database" * 500)
    with caplog.at_level(logging.WARNING, logger="carnator"):
        st = open_store(tmp_path)
    assert any("rebuilding from the entry files" in r.getMessage() for r in carnator_warnings(caplog))
    assert sorted(st.entry_ids()) == sorted(ids)
    assert st.query(namespace_key("model-a", CFG), emb, k=1)[0][0] == ids[2]
    assert st.load(ids[2]).prompt == "prompt 2"
    assert list((tmp_path / "cache" / "quarantine").glob("catalog-*.sqlite3"))
    assert st.verify(deep=True).ok


def test_catalogue_with_foreign_schema_objects_is_not_trusted(tmp_path, caplog):
    st = open_store(tmp_path)
    ids = [st.put(make_entry(i)) for i in range(2)]
    st.close()
    conn = sqlite3.connect(tmp_path / "cache" / "catalog.sqlite3")
    conn.execute("CREATE TRIGGER evil AFTER INSERT ON entries BEGIN DELETE FROM entries; END")
    conn.commit()
    conn.close()
    with caplog.at_level(logging.WARNING, logger="carnator"):
        st = open_store(tmp_path)
    assert any("unexpected" in r.getMessage() for r in carnator_warnings(caplog))
    names = [r[0] for r in st._conn.execute("SELECT name FROM sqlite_master WHERE type='trigger'")]
    assert names == [] and sorted(st.entry_ids()) == sorted(ids)
    st.put(make_entry(5))
    assert len(st.entry_ids()) == 3


def test_not_a_cache_directory(tmp_path):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "carnator-cache.json").write_text('{"format": "carnator-cache", "version": 99}')
    with pytest.raises(Exception, match="v99"):
        open_store(tmp_path)


# ------------------------------------------------------------------------------------------ embeddings
def test_embed_conditioning_ignores_padding():
    rng = np.random.default_rng(0)
    tokens = rng.standard_normal((5, 16)).astype(np.float32)
    padded = np.concatenate([tokens, np.zeros((507, 16), np.float32)])  # Wan/UMT5: zeroed padding to 512
    e = embed_conditioning(torch.from_numpy(padded)[None])
    want = tokens.mean(0) / np.linalg.norm(tokens.mean(0))
    np.testing.assert_allclose(e, want, rtol=1e-5, atol=1e-6)
    assert e.dtype == np.float32 and e.shape == (16,)
    junk = padded.copy()
    junk[5:] = 3.0  # non-zero padding: the attention mask decides
    mask = np.r_[np.ones(5), np.zeros(507)]
    np.testing.assert_allclose(embed_conditioning(junk, mask), want, rtol=1e-5, atol=1e-6)
    cond = [[torch.from_numpy(junk)[None], {"attention_mask": torch.tensor(mask)[None]}]]
    np.testing.assert_allclose(embed_comfy_conditioning(cond), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="no valid"):
        embed_conditioning(np.zeros((4, 16)))
    with pytest.raises(ValueError, match="shape"):
        embed_conditioning(np.zeros(16))


def test_a_second_handle_does_not_change_the_first_ones_settings(tmp_path):
    from carnator.carnator_core.cache import CacheHandle

    path = str((tmp_path / "cache").resolve())
    a = CacheHandle(path=path, max_bytes=10 << 20, policy="lcbfu", key_path=str(tmp_path / "k"))
    b = CacheHandle(path=path, max_bytes=1 << 20, policy="lru", key_path=str(tmp_path / "k"))
    sa = a.store()
    sb = b.store()
    assert (sa.max_bytes, sa.policy) == (10 << 20, "lcbfu") and (sb.max_bytes, sb.policy) == (1 << 20, "lru")
    assert a.store() is sa and CacheHandle(path=path, max_bytes=10 << 20, key_path=str(tmp_path / "k")).store() is sa
    eid = sb.put(make_entry(1))
    assert sa.load(eid, count_hit=False).entry_id == eid  # one directory: both see the same entries


def test_priority_is_policy_priority_everywhere(tmp_path):
    """The catalogue's eviction priority is ``policy.priority`` on insert and after hits (one definition)."""
    from carnator.carnator_core.cache.policy import priority

    st = open_store(tmp_path)
    eid = st.put(make_entry(1))
    for hits in (0, 1, 2):
        if hits:
            st.load(eid)
        with st._read() as c:
            prio, work, nbytes, h = c.execute("SELECT priority, work, nbytes, hits FROM entries WHERE id=?",
                                              (eid,)).fetchone()
            inflation = float(c.execute("SELECT value FROM info WHERE key='inflation'").fetchone()[0])
        assert h == hits and prio == pytest.approx(priority(inflation, hits, work, nbytes))


def test_entry_format_bytes_api_round_trip_and_tamper():
    """encode_entry / decode_entry work on bytes alone (what another store backend reuses)."""
    from safetensors.torch import save as st_save

    from carnator.carnator_core.cache import EntryFormatError, decode_entry, encode_entry

    data = make_entry(3)
    enc = encode_entry(data, entry_id="0123456789abcdef", created=1.0)
    dec = decode_entry(enc.blob, entry_id="0123456789abcdef", namespace=data.namespace, meta_digest=enc.meta_digest)
    assert dec.namespace == data.namespace and dec.prompt == "prompt 3" and dec.seed == 3
    assert torch.equal(dec.tensors["latent_final"], data.tensors["latent_final"])
    assert dec.block_structure.layers == (1, 2) and np.allclose(dec.embedding, enc.embedding)
    assert decode_entry(bytearray(enc.blob)).entry_id == "0123456789abcdef"
    n = int.from_bytes(enc.blob[:8], "little")
    for bad, match in [(enc.blob[:-5], None), (enc.blob[: 8 + n] + bytes([enc.blob[8 + n] ^ 1]) + enc.blob[9 + n :],
                                              "checksum"),
                       (st_save({"x": torch.zeros(2)}), "not a Carnator entry"), (b"", None)]:
        with pytest.raises(EntryFormatError, match=match):
            decode_entry(bad)
    with pytest.raises(EntryFormatError, match="metadata checksum"):
        decode_entry(enc.blob, meta_digest="0" * 64)
    with pytest.raises(EntryFormatError, match="claims id"):
        decode_entry(enc.blob, entry_id="fedcba9876543210")
