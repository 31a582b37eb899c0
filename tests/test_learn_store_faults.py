"""learn.sqlite under faults and hands (carnator_core/learn/labels.py), on real files and a real SQLite: a file that
is not SQLite, a damaged page (found at open or by a later query), a schema that is not ours, a record that is a
directory, and symbolic links (learn.sqlite or its -wal) pointing out of the cache folder. Each is set aside in the
cache's quarantine/ (links as links, never their targets) and a fresh record started, or refused with a
LabelStoreError saying why — never a raw sqlite3 error, never a write outside the cache folder. The panel's
``GET /carnator/rules`` opens the record read-only and writes nothing."""
from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from carnator.carnator_core.learn.labels import FILENAME, Label, LabelStore, LabelStoreError


def label(i: int, x: int = 0) -> Label:
    return Label(f"k{i}", "reseed", f"e{i}", 0.9, (0.1, 0.2, 0.3, 0.4), False, True, x, "shadow", "j", {}, 0.5,
                 "p" * 500, "q" * 500, i)


def filled(cache: Path, n: int = 200) -> Path:
    st = LabelStore(cache)
    for i in range(n):
        st.add_label("ns", label(i))
    st.close()
    return cache / FILENAME


def quarantined(cache: Path) -> list[str]:
    q = cache / "quarantine"
    return sorted(p.name for p in q.iterdir()) if q.is_dir() else []


def test_a_file_that_is_not_sqlite_is_set_aside_and_learning_starts_afresh(tmp_path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    garbage = b"this is not a database " * 300
    (cache / FILENAME).write_bytes(garbage)
    st = LabelStore(cache)
    assert "was unusable" in st.problem and "set aside in quarantine/" in st.problem
    (aside,) = quarantined(cache)
    assert (cache / "quarantine" / aside).read_bytes() == garbage  # kept as it was: evidence, never deleted
    assert st.add_label("ns", label(1)) and [lab.seed for lab in st.labels("ns")] == [1]


def test_a_damaged_page_is_found_at_open_and_set_aside(tmp_path) -> None:
    cache = tmp_path / "cache"
    db = filled(cache)
    raw = bytearray(db.read_bytes())
    assert len(raw) > 20 * 4096
    raw[10 * 4096: 10 * 4096 + 4096] = b"\xff" * 4096  # one page in the middle: a b-tree page of the labels
    db.write_bytes(bytes(raw))
    st = LabelStore(cache)
    assert "damaged pages" in st.problem or "malformed" in st.problem, st.problem
    assert quarantined(cache) and st.labels("ns") == []


def test_damage_found_by_a_later_query_is_a_label_store_error_and_the_record_starts_afresh(tmp_path) -> None:
    cache = tmp_path / "cache"
    filled(cache, 400)
    st = LabelStore(cache)  # open and checked: the damage comes after
    other = LabelStore(cache)  # another process writes: st's page cache is stale at its next read
    other.add_label("ns", label(1000))
    db = cache / FILENAME
    raw = bytearray(db.read_bytes())
    raw[8 * 4096: 60 * 4096] = b"\xff" * (52 * 4096)  # pages the labels query reads
    db.write_bytes(bytes(raw))
    with pytest.raises(LabelStoreError, match="set aside in quarantine/"):
        st.labels("ns")
    assert quarantined(cache) and st.labels("ns") == [] and st.add_label("ns", label(5))
    # idle damage (the store closed, the file replaced by garbage): found when it reopens, said once
    st.close()
    db.write_bytes(b"garbage" * 1000)
    assert st.labels("ns") == [] and "was unusable" in st.problem


def test_a_schema_that_is_not_a_learning_records_is_set_aside(tmp_path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    c = sqlite3.connect(str(cache / FILENAME))
    c.execute("CREATE TABLE photos (id INTEGER PRIMARY KEY, data BLOB)")  # someone else's database
    c.execute("INSERT INTO photos VALUES (1, x'00')")
    c.commit()
    c.close()
    st = LabelStore(cache)
    assert "not a learning record's" in st.problem
    (aside,) = quarantined(cache)
    back = sqlite3.connect(str(cache / "quarantine" / aside))
    assert back.execute("SELECT count(*) FROM photos").fetchone() == (1,)  # untouched
    back.close()


def test_a_record_that_cannot_be_opened_is_a_label_store_error_saying_why(tmp_path) -> None:
    cache = tmp_path / "cache"
    (cache / FILENAME).mkdir(parents=True)  # a directory where the file should be: cannot be opened at all
    with pytest.raises(LabelStoreError, match="learn.sqlite failed while opening .*OperationalError.*permissions"):
        LabelStore(cache)
    assert (cache / FILENAME).is_dir() and not quarantined(cache)


@pytest.mark.parametrize("which", [FILENAME, FILENAME + "-wal"])
def test_a_symbolic_link_out_of_the_cache_folder_is_never_written_through(tmp_path, which) -> None:
    cache, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    cache.mkdir()
    elsewhere.mkdir()
    target = elsewhere / "precious.sqlite"
    c = sqlite3.connect(str(target))
    c.execute("CREATE TABLE mine (v TEXT)")
    c.commit()
    c.close()
    before = target.read_bytes()
    if which != FILENAME:
        filled(cache, 3)
    (cache / which).symlink_to(target)
    with pytest.raises(LabelStoreError, match="symbolic link"):
        LabelStore(cache, read_only=True)  # the panel's reading: refused
    st = LabelStore(cache)
    assert f"{which} is a symbolic link" in st.problem
    st.add_label("ns", label(1))
    st.close()
    assert target.read_bytes() == before and sorted(p.name for p in elsewhere.iterdir()) == ["precious.sqlite"]
    assert any(n.endswith(which[len(FILENAME):] or ".sqlite") for n in quarantined(cache))
    assert all((cache / "quarantine" / n).is_symlink() or not n.endswith(which[len(FILENAME):] or ".sqlite")
               for n in quarantined(cache))
    assert not (cache / FILENAME).is_symlink() and LabelStore(cache).labels("ns")[0].seed == 1


def test_the_panel_route_reads_without_writing_and_refuses_a_link(comfy_dirs, tmp_path) -> None:
    import carnator.nodes.routes as routes
    from carnator.carnator_core.cache.store import Store

    cache = tmp_path / "output" / "learn_cache"
    Store.open(cache).close()
    filled(cache, 5)
    files = sorted(p.name for p in cache.iterdir())
    got = routes.rules_state("learn_cache")
    assert got["exists"] and [n["namespace"] for n in got["namespaces"]] == ["ns"]
    # no table created, nothing written; only SQLite's own side files of the record may appear beside it
    assert set(p.name for p in cache.iterdir()) - set(files) <= {FILENAME + "-wal", FILENAME + "-shm"}
    (cache / FILENAME).rename(tmp_path / "moved.sqlite")
    (cache / FILENAME).symlink_to(tmp_path / "moved.sqlite")
    before = (tmp_path / "moved.sqlite").read_bytes()
    with pytest.raises(routes.RouteError, match="symbolic link") as e:
        routes.rules_state("learn_cache")
    assert e.value.status == 503 and (tmp_path / "moved.sqlite").read_bytes() == before
    assert not Path(str(tmp_path / "moved.sqlite") + "-wal").exists()


def test_two_processes_on_one_damaged_record_set_it_aside_once_and_share_the_fresh_one(tmp_path) -> None:
    """A store opened before the damage and another that finds it: the second sets the file aside; the first then
    follows the fresh file (never writes into the set-aside one, never sets the fresh one aside)."""
    cache = tmp_path / "cache"
    filled(cache, 50)
    (cache / "locks").mkdir()
    a = LabelStore(cache)
    assert len(a.labels("ns")) == 50
    db = cache / FILENAME
    raw = bytearray(db.read_bytes())
    raw[0:16] = b"garbage garbage!"
    db.write_bytes(bytes(raw))
    b = LabelStore(cache)
    assert "was unusable" in b.problem and b.add_label("ns", label(7))
    assert [lab.seed for lab in a.labels("ns")] == [7]  # a follows the fresh record
    assert a.add_label("ns", label(8)) and [lab.seed for lab in b.labels("ns")] == [7, 8]
    assert sum(n.endswith(".sqlite") for n in quarantined(cache)) == 1  # set aside once
