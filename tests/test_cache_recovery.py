"""The catalogue is an index that can always be rebuilt from the entry files, and the store never touches what
is not its own: damaged / deleted / symlinked catalogues, foreign directories, a full disk, and a fingerprint
prefix collision on read. Pure core (no ComfyUI), in-process; the kill-at-every-step matrix is in
test_cache_crash_matrix.py."""
from __future__ import annotations

import errno
import logging
import os
import sqlite3
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from test_cache_store import CFG, DIM, carnator_warnings, make_entry, open_store

from carnator.carnator_core.cache import (
    CacheError,
    CacheFullError,
    EntryNotFoundError,
    NamespaceMismatchError,
    NotACacheDirectoryError,
    Store,
    catalog,
    store as store_mod,
)
from carnator.carnator_core.types import namespace_key

NS = namespace_key("model-a", CFG)


def _filled(tmp_path: Path, n: int = 20, age_s: float = 86400.0) -> tuple[list[str], Path]:
    """A closed store with ``n`` entries whose files are ``age_s`` old (far past the grace period)."""
    st = open_store(tmp_path)
    ids = [st.put(make_entry(i)) for i in range(n)]
    st.close()
    cache = tmp_path / "cache"
    old = time.time() - age_s
    for p in (cache / "entries").glob("*/*.safetensors"):
        os.utime(p, (old, old))
    return ids, cache


def _assert_all_there(st: Store, ids: list[str]) -> None:
    assert sorted(st.entry_ids()) == sorted(ids)
    for eid in ids:
        assert st.load(eid, count_hit=False).entry_id == eid
    rep = st.verify(deep=True)
    assert rep.ok, rep.problems


def _snapshot(d: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(d)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(d.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------ catalogue
def test_corrupt_catalogue_page_is_quarantined_and_rebuilt(tmp_path, caplog):
    ids, cache = _filled(tmp_path)
    db = cache / "catalog.sqlite3"
    assert not Path(str(db) + "-wal").exists()  # closed cleanly: everything is in the main file
    raw = bytearray(db.read_bytes())
    page = 4096
    assert len(raw) >= 4 * page
    mid = (len(raw) // page // 2) * page  # a b-tree page in the middle; page 1 (the header) stays intact
    raw[mid : mid + 16] = b"\xff" * 16
    db.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="carnator"):
        st = open_store(tmp_path)
    assert any("damaged pages" in r.getMessage() or "malformed" in r.getMessage() for r in carnator_warnings(caplog))
    _assert_all_there(st, ids)
    assert list((cache / "quarantine").glob("catalog-*.sqlite3"))  # moved aside, not deleted
    st.close()
    again = open_store(tmp_path)  # the rebuilt catalogue is healthy: no second rebuild
    assert len(list((cache / "quarantine").glob("catalog-*.sqlite3"))) == 1
    _assert_all_there(again, ids)


def test_deleted_catalogue_is_rebuilt_and_no_entry_is_deleted(tmp_path, caplog):
    ids, cache = _filled(tmp_path)
    for suffix in ("", "-wal", "-shm"):
        Path(str(cache / "catalog.sqlite3") + suffix).unlink(missing_ok=True)
    with caplog.at_level(logging.WARNING, logger="carnator"):
        st = open_store(tmp_path)  # default grace period; the files are a day old
    _assert_all_there(st, ids)
    assert st.scan(grace_s=0)["orphans_adopted"] == 0  # nothing left over
    st.close()
    _assert_all_there(open_store(tmp_path), ids)


def test_entry_files_without_rows_are_adopted_never_deleted(tmp_path):
    """An emptied catalogue (the obvious manual 'repair') followed by scans: every file comes back."""
    ids, cache = _filled(tmp_path)
    conn = sqlite3.connect(cache / "catalog.sqlite3")
    conn.execute("DELETE FROM embeddings")
    conn.execute("DELETE FROM entries")
    conn.commit()
    conn.close()
    st = open_store(tmp_path)
    _assert_all_there(st, ids)


def test_symlinked_catalogue_is_never_written_through(tmp_path, caplog):
    ids, cache = _filled(tmp_path, n=4)
    outside = tmp_path / "outside"
    outside.mkdir()
    db = cache / "catalog.sqlite3"
    os.replace(db, outside / "victim.sqlite3")  # somebody else's database, linked into the cache
    db.symlink_to(outside / "victim.sqlite3")
    (outside / "victim.sqlite3-wal").write_bytes(b"")
    Path(str(db) + "-wal").unlink(missing_ok=True)
    Path(str(db) + "-wal").symlink_to(outside / "victim.sqlite3-wal")
    before = _snapshot(outside)
    with caplog.at_level(logging.WARNING, logger="carnator"):
        st = open_store(tmp_path)
        st.put(make_entry(50))
        st.purge()
    assert _snapshot(outside) == before  # nothing written where the links pointed
    assert not db.is_symlink() and any("symbolic link" in r.getMessage() for r in carnator_warnings(caplog))
    assert [p for p in (cache / "quarantine").iterdir() if p.is_symlink()]  # the links were moved aside


# ------------------------------------------------------------------------------------------ whose directory
def test_a_foreign_directory_is_never_adopted_or_cleaned(tmp_path):
    d = tmp_path / "outputs"
    (d / "tmp").mkdir(parents=True)
    (d / "entries" / "renders").mkdir(parents=True)
    (d / "tmp" / "draft.png").write_bytes(b"png")
    (d / "entries" / "renders" / "shot.safetensors").write_bytes(b"user data")
    (d / "notes.txt").write_text("mine")
    old = time.time() - 86400
    for p in d.rglob("*"):
        os.utime(p, (old, old))
    before = _snapshot(d)
    with pytest.raises(NotACacheDirectoryError, match="not empty .* not a Carnator cache"):
        Store.open(d, key_path=tmp_path / "k")
    assert _snapshot(d) == before and not (d / "carnator-cache.json").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    Store.open(empty, key_path=tmp_path / "k").close()  # an empty directory is fine, and is marked
    assert (empty / "carnator-cache.json").is_file()


def test_scan_only_removes_its_own_temp_files(tmp_path):
    st = open_store(tmp_path)
    keep = st.put(make_entry(1))
    cache = tmp_path / "cache"
    foreign = [cache / "tmp" / "user-notes.txt", cache / "entries" / NS / "readme.txt", cache / "entries" / "x y"]
    for p in foreign:
        p.write_text("not the cache's")
    ours = cache / "tmp" / f"{'a' * 16}.{os.getpid()}.0123abcd.tmp"
    ours.write_bytes(b"half an entry")
    garbage = cache / "entries" / NS / f"{'b' * 16}.safetensors"  # our name, not our content
    garbage.write_bytes(b"\x00" * 64)
    out = st.scan(grace_s=0)
    assert out["tmp_removed"] == 1 and not ours.exists()
    assert all(p.read_text() == "not the cache's" for p in foreign) and out["foreign_files"] == 3
    assert out["orphans_quarantined"] == 1 and not garbage.exists()
    assert (cache / "quarantine" / NS / garbage.name).read_bytes() == b"\x00" * 64  # moved, not deleted
    assert st.entry_ids() == [keep]


# ------------------------------------------------------------------------------------------ full disk
class _FullConnection(sqlite3.Connection):
    """SQLite that answers every write like a full disk does."""

    full = False

    def execute(self, sql, *args):  # noqa: ANN001
        self._check(sql)
        return super().execute(sql, *args)

    def executemany(self, sql, *args):  # noqa: ANN001
        self._check(sql)
        return super().executemany(sql, *args)

    def _check(self, sql: str) -> None:
        if _FullConnection.full and sql.lstrip().split()[0].upper() in ("INSERT", "UPDATE", "DELETE", "REPLACE"):
            raise sqlite3.OperationalError("database or disk is full")


@pytest.fixture
def full_disk(monkeypatch):
    real_connect = sqlite3.connect
    monkeypatch.setattr(catalog.sqlite3, "connect", lambda *a, **k: real_connect(*a, factory=_FullConnection, **k))

    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    def set_full(on: bool) -> None:
        _FullConnection.full = on
        if on:
            monkeypatch.setattr(store_mod, "_atomic_write", no_space)
        else:
            monkeypatch.undo()
            monkeypatch.setattr(catalog.sqlite3, "connect",
                                lambda *a, **k: real_connect(*a, factory=_FullConnection, **k))

    yield set_full
    _FullConnection.full = False


def test_reads_delete_and_purge_work_on_a_full_disk(tmp_path, full_disk, caplog):
    st = open_store(tmp_path)
    emb = np.ones(DIM, np.float32)
    ids = [st.put(make_entry(i, emb=emb * (i + 1))) for i in range(4)]
    full_disk(True)
    with caplog.at_level(logging.WARNING, logger="carnator"):
        for _ in range(3):
            c = st.candidates(NS, emb, k=4)
            assert sorted(x.entry_id for x in c.items) == sorted(ids)
            assert st.load(ids[0]).entry_id == ids[0]  # count_hit=True: the counter is skipped, the read works
            st.record_hit(ids[1])
        assert st.stats().entries == 4 and st.query(NS, emb, k=1)
        assert len({r.getMessage() for r in carnator_warnings(caplog)}) <= 2  # one line per kind, not per call
        with pytest.raises(CacheFullError, match="is full .* purge"):
            st.put(make_entry(10))
        assert not list((tmp_path / "cache" / "tmp").iterdir())
        assert st.delete(ids[0]) is True
        with pytest.raises(EntryNotFoundError):
            st.load(ids[0])
        assert st.purge() >= 3
    assert not list((tmp_path / "cache" / "entries").glob("*/*.safetensors"))  # the space is free
    full_disk(False)
    st.close()
    st = open_store(tmp_path)  # the rows left behind while the disk was full are dropped
    assert st.stats().entries == 0 and st.verify().ok
    assert st.load(st.put(make_entry(11))).prompt == "prompt 11"


def _fill(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        for size in (65536, 4096, 512):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError as e:
                assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)


def test_a_really_full_disk(tmp_path):
    """The same on a real filesystem that runs out of space (a 3 MiB tmpfs)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()}); the injected variant above runs")
    st = None
    try:
        st = Store.open(mnt / "cache", key_path=tmp_path / "k")
        emb = np.ones(DIM, np.float32)
        ids = [st.put(make_entry(i, emb=emb * (i + 1))) for i in range(6)]
        _fill(mnt / "filler")
        c = st.candidates(NS, emb, k=6)
        assert sorted(x.entry_id for x in c.items) == sorted(ids)
        assert st.load(ids[2]).entry_id == ids[2]
        _fill(mnt / "filler2")  # the reads' counter commits let SQLite truncate its log: fill what that freed
        with pytest.raises(CacheFullError):
            st.put(make_entry(20))
        assert st.delete(ids[0]) is True  # the file goes even if the disk is too full to commit the row's removal
        with pytest.raises(EntryNotFoundError):
            st.load(ids[0])
        assert st.purge() in (5, 6)  # (6: the row of the entry deleted above was still there)
        assert st.stats().entries == 0 and not list((mnt / "cache" / "entries").glob("*/*.safetensors"))
        (mnt / "filler").unlink()
        (mnt / "filler2").unlink()
        ids = [st.put(make_entry(i, emb=emb * (i + 1))) for i in range(30, 33)]
        st.close()
        _fill(mnt / "filler")
        # A restart on a full disk: SQLite cannot create its WAL / shared-memory files; the store opens read-only.
        st = Store.open(mnt / "cache", key_path=tmp_path / "k")
        assert st.read_only
        assert sorted(x.entry_id for x in st.candidates(NS, emb, k=6).items) == sorted(ids)
        assert st.load(ids[1]).entry_id == ids[1]
        with pytest.raises(CacheFullError, match="full"):
            st.put(make_entry(22))
        st.close()
        (mnt / "filler").unlink()
        st = Store.open(mnt / "cache", key_path=tmp_path / "k")
        assert not st.read_only and st.load(st.put(make_entry(21))).prompt == "prompt 21"
    finally:
        if st is not None:
            st.close()
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_errors_are_cache_errors_that_say_what_to_do(tmp_path):
    st = open_store(tmp_path)
    st.put(make_entry(1))
    st.close()
    with pytest.raises(CacheError, match="closed"):
        st.entry_ids()
    os.chmod(tmp_path / "cache" / "entries", 0o500)
    try:
        if os.geteuid() == 0:
            return  # root ignores permissions: nothing to provoke here
        st = open_store(tmp_path)
        with pytest.raises(CacheError, match="not writable|permission"):
            st.put(make_entry(2, fp="model-z"))
    finally:
        os.chmod(tmp_path / "cache" / "entries", 0o700)


# ------------------------------------------------------------------------------------------ fingerprints
def test_reads_compare_the_full_model_fingerprint(tmp_path):
    """Two models whose fingerprints share the namespace key's 64-bit prefix: the second model's request gets
    nothing from the first model's entries."""
    a, b = "0123456789abcdef" + "aaaaaaaa", "0123456789abcdef" + "bbbbbbbb"
    assert namespace_key(a, CFG) == namespace_key(b, CFG)
    st = open_store(tmp_path)
    emb = np.ones(DIM, np.float32)
    eid = st.put(make_entry(1, fp=a, emb=emb))
    ns = namespace_key(a, CFG)
    assert [x.entry_id for x in st.candidates(ns, emb, k=3, model_fingerprint=a).items] == [eid]
    other = st.candidates(ns, emb, k=3, model_fingerprint=b)
    assert other.items == () and "holds entries of model" in other.note
    with pytest.raises(NamespaceMismatchError, match="never reused across models"):
        st.load(eid, model_fingerprint=b)
    assert st.load(eid, model_fingerprint=a).entry_id == eid
    assert st.candidates(ns, None, k=3).items == ()  # no embedding (unembeddable prompt): no retrieval


def test_a_catalogue_from_before_the_completion_flag_is_kept_and_completed_by_scan(tmp_path, caplog):
    """Caches written by earlier versions (no 'complete' row) open without a rebuild; entry files their catalogue
    lacks (e.g. an old interrupted rebuild) are adopted."""
    ids, cache = _filled(tmp_path, n=6)
    conn = sqlite3.connect(cache / "catalog.sqlite3")
    conn.execute("DELETE FROM info WHERE key='complete'")
    conn.execute("DELETE FROM embeddings WHERE seq IN (SELECT seq FROM entries ORDER BY seq LIMIT 3)")
    conn.execute("DELETE FROM entries WHERE seq IN (SELECT seq FROM entries ORDER BY seq LIMIT 3)")
    conn.commit()
    conn.close()
    with caplog.at_level(logging.WARNING, logger="carnator"):
        st = open_store(tmp_path)
    assert not any("rebuild" in r.getMessage() for r in carnator_warnings(caplog))
    _assert_all_there(st, ids)


def test_a_catalogue_from_before_answer_entries_is_rebuilt_from_the_files(tmp_path, caplog):
    """Caches written before answer-only entries existed (no ``entries.answer`` column) are not our schema: the
    catalogue is rebuilt from the entry files on open, every entry and request key is still there, and an answer
    entry written afterwards is found by key and never recalled."""
    import dataclasses

    ids, cache = _filled(tmp_path, n=4)
    st = open_store(tmp_path)
    keyed = st.put(dataclasses.replace(make_entry(50), request_key="ab" * 16))
    st.close()
    conn = sqlite3.connect(cache / "catalog.sqlite3")
    conn.execute("ALTER TABLE entries DROP COLUMN answer")
    conn.commit()
    conn.close()
    with caplog.at_level(logging.WARNING, logger="carnator"):
        st = open_store(tmp_path)
    assert any("schema" in r.getMessage() or "rebuil" in r.getMessage() for r in carnator_warnings(caplog))
    _assert_all_there(st, ids + [keyed])
    assert st.find_request("ab" * 16) == keyed
    emb = make_entry(50).embedding
    answer = st.put(dataclasses.replace(make_entry(51, emb=emb), request_key="cd" * 16, answer_of=keyed))
    assert st.find_request("cd" * 16) == answer and st.load(answer, count_hit=False).answer_of == keyed
    assert answer not in {i for i, _ in st.query(NS, emb, 50)}
    assert keyed in {i for i, _ in st.query(NS, emb, 50)}
    rep = st.verify(deep=True)
    assert rep.ok, rep.problems


def test_damage_found_mid_operation_is_rebuilt_at_once(tmp_path, monkeypatch):
    """Catalogues too big for an integrity check at open: the first query that reaches a damaged page fails with
    a CatalogError that says the catalogue was rebuilt; the retry works and nothing is lost."""
    from carnator.carnator_core.cache import CatalogError

    ids, cache = _filled(tmp_path)
    monkeypatch.setattr(store_mod, "QUICK_CHECK_MAX_BYTES", 0)
    db = cache / "catalog.sqlite3"
    conn = sqlite3.connect(db)
    root_page = conn.execute("SELECT rootpage FROM sqlite_master WHERE name='embeddings'").fetchone()[0]
    conn.close()
    raw = bytearray(db.read_bytes())
    raw[(root_page - 1) * 4096 : (root_page - 1) * 4096 + 16] = b"\xff" * 16  # the embeddings table's root page
    db.write_bytes(bytes(raw))
    st = open_store(tmp_path)  # no integrity check at open: the damage is not noticed yet
    emb = st.load(ids[3], count_hit=False).embedding
    with pytest.raises(CatalogError, match="rebuilt from the entry files. Retry"):
        st.query(NS, emb, k=1)
    assert st.query(NS, emb, k=1)[0][0] == ids[3]
    assert list((cache / "quarantine").glob("catalog-*.sqlite3"))
    _assert_all_there(st, ids)


def test_open_recovers_from_damage_its_scan_runs_into(tmp_path, monkeypatch):
    """A big catalogue (no integrity check at open) whose entries table is damaged: open itself rebuilds and
    succeeds, instead of asking the caller to retry."""
    ids, cache = _filled(tmp_path)
    monkeypatch.setattr(store_mod, "QUICK_CHECK_MAX_BYTES", 0)
    db = cache / "catalog.sqlite3"
    conn = sqlite3.connect(db)
    root_page = conn.execute("SELECT rootpage FROM sqlite_master WHERE name='entries'").fetchone()[0]
    conn.close()
    raw = bytearray(db.read_bytes())
    raw[(root_page - 1) * 4096 : (root_page - 1) * 4096 + 16] = b"\xff" * 16
    db.write_bytes(bytes(raw))
    _assert_all_there(open_store(tmp_path), ids)
