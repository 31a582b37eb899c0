"""Several processes share one store: 4 spawned processes write, query, retrieve and load at once (with the
index switching to IVF, being persisted and log-pruned meanwhile). Afterwards: no lost, duplicated or torn
entries, and every index agrees with the catalogue. Pure core (no ComfyUI)."""
from __future__ import annotations

import multiprocessing as mp
import traceback
from pathlib import Path

import pytest
from repo_package import register_package

ROOT = Path(__file__).resolve().parents[1]


# Spawned children do not run conftest: they register the repo as package ``carnator`` here, the same way.
register_package()

WORKERS = 4
PER_WORKER = 10


def _worker(wid: int, cache: str, key: str, start, results, max_bytes: int | None) -> None:
    try:
        import numpy as np
        from test_cache_store import CFG, make_entry

        from carnator.carnator_core.cache import (
            CorruptEntryError,
            EntryNotFoundError,
            IndexParams,
            Store,
        )
        from carnator.carnator_core.types import namespace_key

        st = Store.open(cache, key_path=key, max_bytes=max_bytes,
                        index_params=IndexParams(flat_max=12, train_sample=64, reduced_dim=8, persist_every=3,
                                                 min_explained=0.0))
        rng = np.random.default_rng(wid)
        start.wait(timeout=900)
        mine, seen, errors = [], set(), []
        for i in range(PER_WORKER):
            n = wid * 1000 + i
            fp = "model-a" if i % 2 == 0 else "model-b"
            mine.append(st.put(make_entry(n, fp=fp)))
            for f in ("model-a", "model-b"):
                ns = namespace_key(f, CFG)
                for eid, _ in st.query(ns, rng.standard_normal(32), k=4):
                    seen.add(eid)
                c = st.candidates(ns, rng.standard_normal(32), k=3)
                for item in c.items:
                    try:
                        e = st.load(item.entry_id)
                        assert e.namespace == ns and e.signature.grid == item.signature.grid
                    except EntryNotFoundError:
                        if not max_bytes:
                            errors.append(f"entry {item.entry_id} vanished without eviction")
                    except CorruptEntryError as e:  # a torn entry would show up here
                        errors.append(str(e))
        results.put({"wid": wid, "ids": mine, "seen": sorted(seen), "errors": errors})
    except Exception:  # noqa: BLE001 - report to the parent instead of dying silently
        results.put({"wid": wid, "ids": [], "seen": [], "errors": [traceback.format_exc()]})


def _run(tmp_path: Path, max_bytes: int | None) -> list[dict]:
    ctx = mp.get_context("spawn")
    start, results = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(w, str(tmp_path / "cache"), str(tmp_path / "index.key"), start,
                                               results, max_bytes)) for w in range(WORKERS)]
    for p in procs:
        p.start()
    start.set()
    out = [results.get(timeout=1200) for _ in procs]  # generous: shared CI machines
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    return out


def test_four_processes_write_and_read_at_once(tmp_path):
    from test_cache_store import CFG

    from carnator.carnator_core.cache import IndexParams, Store
    from carnator.carnator_core.types import namespace_key

    out = _run(tmp_path, max_bytes=None)
    assert all(not r["errors"] for r in out), [r["errors"] for r in out]
    written = [eid for r in out for eid in r["ids"]]
    assert len(written) == WORKERS * PER_WORKER and len(set(written)) == len(written)  # nothing duplicated
    st = Store.open(tmp_path / "cache", key_path=tmp_path / "index.key",
                    index_params=IndexParams(flat_max=12, train_sample=64, reduced_dim=8, persist_every=3,
                                                 min_explained=0.0))
    assert sorted(st.entry_ids()) == sorted(written)  # nothing lost, nothing extra
    seen = {eid for r in out for eid in r["seen"]}
    assert seen <= set(written)
    rep = st.verify(deep=True)  # deep: every entry re-read and checksummed (no torn entries)
    assert rep.ok and not rep.notes, rep
    for fp in ("model-a", "model-b"):
        ns = namespace_key(fp, CFG)
        assert len(st.entry_ids(ns)) == WORKERS * PER_WORKER // 2
        for eid in st.entry_ids(ns):
            e = st.load(eid, count_hit=False)
            assert st.query(ns, e.embedding, k=1)[0][0] == eid
    assert st.stats().lookups == WORKERS * PER_WORKER * 2


@pytest.mark.slow
def test_four_processes_with_concurrent_eviction(tmp_path):
    from test_cache_store import make_entry

    from carnator.carnator_core.cache import Store

    probe = Store.open(tmp_path / "probe", key_path=tmp_path / "index.key")
    probe.put(make_entry(0))
    size = probe.stats().bytes
    budget = int(size * 12.5)
    out = _run(tmp_path, max_bytes=budget)
    assert all(not r["errors"] for r in out), [r["errors"] for r in out]
    written = {eid for r in out for eid in r["ids"]}
    st = Store.open(tmp_path / "cache", key_path=tmp_path / "index.key")
    left = set(st.entry_ids())
    assert left <= written and 0 < len(left) <= 12
    assert st.stats().bytes <= budget
    st.scan(grace_s=0)
    rep = st.verify(deep=True)
    assert rep.ok and not rep.notes, rep
