"""The cache outlives hands, clocks and full disks: a folder deleted by hand while the store is open, a put whose
file another process adopts first (a forward clock jump), a wrong size in a catalogue row, a put during a
rebuild, the write-ahead log of a small cache, a read-only cache, a full disk at the write. Each case is a real
store on real files; the races run in real child processes. Pure core (no ComfyUI)."""
from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from test_cache_store import CFG, DIM, carnator_warnings, make_entry, open_store

from carnator.carnator_core.cache import Store, adoption_problem
from carnator.carnator_core.types import namespace_key

ROOT = Path(__file__).resolve().parents[1]
NS = namespace_key("model-a", CFG)

# A child process that imports the package once and runs one scripted operation on a store (see _child).
CHILD = textwrap.dedent("""
    import importlib.util, json, os, sys, time
    root, tests, cache, key, op, sync = sys.argv[1:7]
    sys.path[:0] = [root, tests]
    spec = importlib.util.spec_from_file_location("carnator", os.path.join(root, "__init__.py"),
                                                  submodule_search_locations=[root])
    mod = importlib.util.module_from_spec(spec); sys.modules["carnator"] = mod; spec.loader.exec_module(mod)
    from carnator.carnator_core.cache import Store, EntryNotFoundError
    from test_cache_store import make_entry

    def pause_at(stage):
        # At ``stage``: say so (a file), then wait until the test says go (another file).
        def fault(s):
            if s == stage:
                open(sync + ".at", "w").close()
                while not os.path.exists(sync + ".go"):
                    time.sleep(0.01)
        return fault

    st = Store.open(cache, key_path=key)
    if op == "put_paused_after_rename":
        st._fault = pause_at("after_rename")
        eid, written = st.put_with_status(make_entry(7))
        try:
            loaded = st.load(eid, count_hit=False).entry_id == eid
        except EntryNotFoundError:
            loaded = False
        print(json.dumps({"id": eid, "written": written, "loaded": loaded}), flush=True)
    elif op == "rebuild_paused_before_swap":
        st._fault = pause_at("rebuild_built")
        st.rebuild_catalog("test")
        print(json.dumps({"ids": st.entry_ids()}), flush=True)
    st.close()
""")


def _child(tmp_path: Path, op: str) -> tuple[subprocess.Popen, Path]:
    sync = tmp_path / f"sync-{op}"
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(ROOT), str(ROOT / "tests"), str(tmp_path / "cache"),
                          str(tmp_path / "index.key"), op, str(sync)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return p, sync


def _wait_for(p: subprocess.Popen, sync: Path) -> None:
    for _ in range(6000):  # bounded: 60 s of polling
        if Path(str(sync) + ".at").exists():
            return
        if p.poll() is not None:
            break
        time.sleep(0.01)
    out, err = p.communicate(timeout=60)
    raise AssertionError(f"the child never reached its pause point: {out} {err}")


def _finish(p: subprocess.Popen, sync: Path) -> dict:
    Path(str(sync) + ".go").touch()
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------ 1. deleted by hand
def test_a_cache_folder_deleted_by_hand_while_open_comes_back_fresh(tmp_path, caplog):
    st = open_store(tmp_path)
    first = st.put(make_entry(1))
    cache = tmp_path / "cache"
    shutil.rmtree(cache)  # a user cleaning up disk space while ComfyUI runs
    with caplog.at_level(logging.WARNING, logger="carnator"):
        assert st.candidates(NS, np.ones(DIM, np.float32), k=3).items == ()  # the next read: a fresh, empty cache
        second = st.put(make_entry(2))
        assert st.entry_ids() == [second] and st.load(second).prompt == "prompt 2"
    assert first != second and (cache / "carnator-cache.json").is_file()
    said = [r.getMessage() for r in carnator_warnings(caplog) if "deleted" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in carnator_warnings(caplog)]
    assert adoption_problem(cache) is None  # the loader's queue-time check accepts it
    st.close()
    assert open_store(tmp_path).entry_ids() == [second]  # and so does a restart


def test_a_folder_left_with_only_lock_files_is_adopted(tmp_path):
    """What an earlier version left after the folder was deleted under it: only ``locks/catalog.lock``. It holds
    nothing of anyone's, so it is taken as a fresh cache (it was a permanent 400 at every queue)."""
    d = tmp_path / "cache"
    (d / "locks").mkdir(parents=True)
    (d / "locks" / "catalog.lock").touch()
    assert adoption_problem(d) is None
    st = open_store(tmp_path)
    assert st.load(st.put(make_entry(1))).prompt == "prompt 1"
    st.close()
    (tmp_path / "other" / "locks").mkdir(parents=True)
    (tmp_path / "other" / "locks" / "catalog.lock").write_text("somebody's notes")  # not an empty lock file
    assert "not empty" in adoption_problem(tmp_path / "other")


# ------------------------------------------------------------------------------------------ 2. adopted under a put
def test_a_put_whose_file_another_process_adopts_first_returns_a_loadable_id(tmp_path):
    """Process A renamed its entry file into place and has not committed the row yet; process B opens the store
    with its clock jumped forward (or A stalled past the grace period) and its scan adopts A's file. A's commit
    then meets the row B wrote for the very same file: A must neither delete that file nor return an id that
    does not load."""
    open_store(tmp_path).close()
    p, sync = _child(tmp_path, "put_paused_after_rename")
    _wait_for(p, sync)
    b = Store.open(tmp_path / "cache", key_path=tmp_path / "index.key", clock=lambda: time.time() + 3600)
    adopted = b.entry_ids()
    assert len(adopted) == 1  # B adopted A's renamed, not yet committed file
    out = _finish(p, sync)
    assert out["id"] == adopted[0] and out["loaded"], out
    assert out["written"]  # A's put wrote it (B only catalogued it first)
    assert b.load(out["id"], count_hit=False).prompt == "prompt 7"
    b.close()
    st = open_store(tmp_path)
    assert st.entry_ids() == adopted and st.verify(deep=True).ok


# ------------------------------------------------------------------------------------------ 5. read-only cache
@pytest.fixture()
def mounted(tmp_path):
    """A 4 MiB tmpfs at ``tmp_path/mnt`` (real ENOSPC and real read-only remounts); unmounted afterwards."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()}); needs root in a container")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _remount(mnt: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(mnt)], check=True, capture_output=True)


def _tree(d: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(d.rglob("*"))
            if p.is_file()}


def test_a_read_only_cache_serves_recalls_and_repeats_and_writes_nothing(mounted, tmp_path, caplog):
    from carnator.carnator_core.cache import CacheReadOnlyError

    st = Store.open(mounted / "cache", key_path=tmp_path / "k")
    emb = np.ones(DIM, np.float32)
    key = "ab" * 16
    ids = [st.put(make_entry(i, emb=emb * (i + 1))) for i in range(3)]
    keyed = st.put(dataclasses.replace(make_entry(9), namespace="", request_key=key))
    st.close()
    _remount(mounted, "ro")  # e.g. a cache shipped on a read-only volume, or a mount gone read-only
    before = _tree(mounted)
    with caplog.at_level(logging.WARNING, logger="carnator"):
        ro = Store.open(mounted / "cache", key_path=tmp_path / "k")
        assert ro.read_only
        for _ in range(2):
            assert sorted(c.entry_id for c in ro.candidates(NS, emb, k=3).items) == sorted(ids)  # recalls
            assert ro.find_request(key) == keyed and ro.load(keyed).prompt == "prompt 9"  # exact repeats
            ro.record_hit(ids[0])
            with pytest.raises(CacheReadOnlyError, match="read-only"):
                ro.put(make_entry(20))
        assert ro.stats().entries == 4 and ro.verify().ok
    said = [r.getMessage() for r in carnator_warnings(caplog)]
    assert sum("read-only" in m for m in said) == 1, said  # said once, not per call
    assert _tree(mounted) == before  # nothing written
    ro.close()
    _remount(mounted, "rw")
    rw = Store.open(mounted / "cache", key_path=tmp_path / "k")
    assert not rw.read_only and rw.load(rw.put(make_entry(21))).prompt == "prompt 21"
    rw.close()


# ------------------------------------------------------------------------------------------ 3. a wrong row size
@pytest.mark.parametrize("delta", [+100, -7])
@pytest.mark.parametrize("first", ["load", "candidates"])
def test_a_wrong_size_in_a_catalogue_row_is_corrected_from_the_file(tmp_path, caplog, delta, first):
    """The row says the file has another size than it has; the file's own header and checksums say it is whole:
    the entry is served and the row corrected, nothing is quarantined. (A file that really is truncated is still
    quarantined: test_cache_store.test_corrupt_entry_is_quarantined.)"""
    st = open_store(tmp_path)
    emb = np.ones(DIM, np.float32)
    eid = st.put(make_entry(1, emb=emb))
    other = st.put(make_entry(2, emb=-emb))
    size = (tmp_path / "cache" / "entries" / NS / f"{eid}.safetensors").stat().st_size
    st.close()
    db = sqlite3.connect(tmp_path / "cache" / "catalog.sqlite3")
    db.execute("UPDATE entries SET nbytes=nbytes+? WHERE id=?", (delta, eid))
    db.commit()
    db.close()
    st = open_store(tmp_path)
    with caplog.at_level(logging.WARNING, logger="carnator"):
        if first == "candidates":
            assert eid in [c.entry_id for c in st.candidates(NS, emb, k=2).items]
        assert st.load(eid).prompt == "prompt 1"
        assert eid in [c.entry_id for c in st.candidates(NS, emb, k=2).items]
    assert sorted(st.entry_ids()) == sorted([eid, other])
    assert not list((tmp_path / "cache" / "quarantine").rglob("*.safetensors"))
    assert st.stats().bytes == size + (tmp_path / "cache" / "entries" / NS / f"{other}.safetensors").stat().st_size
    assert st.verify(deep=True).ok
    assert sum("size" in r.getMessage() for r in carnator_warnings(caplog)) == 1


# ------------------------------------------------------------------------------------------ 7. rebuild + WAL
def test_a_put_during_a_rebuild_is_visible_when_the_rebuild_ends(tmp_path):
    """Another process rebuilds the catalogue (its new file is built, not yet swapped in) while this one commits
    a put to the old catalogue: when the rebuild ends the entry is there at once, not after the grace period."""
    st = open_store(tmp_path)
    before = [st.put(make_entry(i)) for i in range(3)]
    p, sync = _child(tmp_path, "rebuild_paused_before_swap")
    _wait_for(p, sync)
    during = st.put(make_entry(50))  # committed to the catalogue that is about to be replaced
    out = _finish(p, sync)
    assert during in out["ids"], "the rebuild dropped a put committed while it ran"
    assert sorted(st.entry_ids()) == sorted(before + [during])
    assert st.load(during).prompt == "prompt 50"
    late = st.put(make_entry(51))  # and this process writes to the new catalogue
    st.close()
    again = open_store(tmp_path)
    assert sorted(again.entry_ids()) == sorted(before + [during, late]) and again.verify(deep=True).ok


def _folder_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def test_a_small_cache_stays_within_its_budget_plus_the_stated_margin(tmp_path):
    """A long-open store that writes and evicts all the time: entry files stay within max_bytes, and the whole
    folder within max_bytes + the catalogue's own file + store.WAL_MARGIN_BYTES (the write-ahead log is
    checkpointed and truncated instead of growing to many times the budget)."""
    from carnator.carnator_core.cache import store as store_mod

    one = Store.open(tmp_path / "one", key_path=tmp_path / "k")
    one.put(make_entry(0))
    entry = one.stats().bytes
    one.close()
    budget = 6 * entry
    st = Store.open(tmp_path / "cache", key_path=tmp_path / "k", max_bytes=budget)
    reader = Store.open(tmp_path / "cache", key_path=tmp_path / "k")  # a second process's view keeps reading
    worst = 0
    for i in range(300):  # bounded: 300 puts of ~8 KiB, each evicting the oldest
        st.put(make_entry(i, seed=i))
        reader.candidates(NS, np.ones(DIM, np.float32), k=2)
        cache = tmp_path / "cache"
        main = (cache / "catalog.sqlite3").stat().st_size
        worst = max(worst, _folder_bytes(cache) - main)
        assert st.stats().bytes <= budget
    assert worst <= budget + store_mod.WAL_MARGIN_BYTES, (worst, budget)
    st.close()
    reader.close()
