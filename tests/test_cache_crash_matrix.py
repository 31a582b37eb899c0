"""Kill at every step: a child process dies (``os._exit`` at an injected fault point, which leaves the files
exactly as SIGKILL would, or a real SIGKILL at an arbitrary moment) during a catalogue rebuild, an eviction, a
delete and a purge. Afterwards, reopening with the default grace period (entry files are a day old, so the grace
period protects nothing): every acknowledged entry that was not being removed is there and verifies, nothing
torn is returned, and a scan leaves the store exactly consistent. The put stages are in test_cache_crash.py.
Later attacks, same check: a rebuild SIGKILLed while another process writes, a folder deleted under a writing
store, rows whose recorded sizes are wrong (the races of a put adopted under a jumped clock and of a put during a
completed rebuild, a read-only remount and a full disk at the write are in test_cache_hands.py).
Pure core (no ComfyUI); one child process imports once and forks a grandchild per case (bounded CPU on CI)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from test_cache_store import CFG, make_entry, open_store

from carnator.carnator_core.cache import EntryNotFoundError, Store
from carnator.carnator_core.types import namespace_key

ROOT = Path(__file__).resolve().parents[1]
N = 12

CHILD = textwrap.dedent("""
    import importlib.util, json, os, sys, time
    root, tests, key, cases = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    sys.path[:0] = [root, tests]
    spec = importlib.util.spec_from_file_location("carnator", os.path.join(root, "__init__.py"),
                                                  submodule_search_locations=[root])
    mod = importlib.util.module_from_spec(spec); sys.modules["carnator"] = mod; spec.loader.exec_module(mod)
    from carnator.carnator_core.cache import Store
    from test_cache_store import make_entry

    def run(cache, op, stage, nth, budget, arg):
        st = Store.open(cache, key_path=key, max_bytes=int(budget) or None)
        calls = [0]
        def fault(s):
            if s == stage:
                calls[0] += 1
                if calls[0] >= int(nth):
                    os._exit(77)  # no cleanup, no flush: the files are left as SIGKILL leaves them
        st._fault = fault
        if op == "rebuild":
            st.rebuild_catalog("crash test")
        elif op == "rebuild_loop":
            while True:
                st.rebuild_catalog("crash test")
                print("rebuilt", flush=True)
        elif op == "evict":
            st.put(make_entry(999))
        elif op == "delete":
            st.delete(arg)
        elif op == "purge":
            st.purge(arg or None)
        elif op == "rebuild_pause":  # at the stage: say so (a file), then wait to be SIGKILLed
            def pause(s):
                if s == stage:
                    open(arg, "w").close()
                    while True:
                        time.sleep(0.05)
            st._fault = pause
            st.rebuild_catalog("crash test")
        os._exit(0)

    if len(cases) == 1:
        run(*cases[0])
    # One import, one forked child per case (each opens its own store after the fork): bounded CPU on CI.
    for case in cases:
        pid = os.fork()
        if pid == 0:
            run(*case)
        _, status = os.waitpid(pid, 0)
        print("rc", os.waitstatus_to_exitcode(status), flush=True)
    os._exit(0)
""")

# (operation, fault stage, n-th time the stage is reached)
MATRIX = [
    ("rebuild", "rebuild_entry", N // 2), ("rebuild", "rebuild_built", 1), ("rebuild", "rebuild_set_aside", 1),
    ("evict", "evict_picked", 1), ("evict", "evict_unlinked", 1),
    ("delete", "delete_unlinked", 1), ("purge", "purge_unlinked", 1),
]


def _prepare(d: Path, key: Path) -> tuple[dict[str, str], int]:
    """N entries in two namespaces, files a day old; returns {id: namespace} and one entry's size."""
    st = open_store(d, key_path=key)
    ids = {}
    for i in range(N):
        e = make_entry(i, fp="model-a" if i % 2 else "model-b")
        ids[st.put(e)] = e.namespace
    size = st.stats().bytes // N
    st.close()
    old = time.time() - 86400
    for p in (d / "cache" / "entries").glob("*/*.safetensors"):
        os.utime(p, (old, old))
    return ids, size


def _spawn(key: Path, cases: list[tuple]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(ROOT), str(ROOT / "tests"), str(key), json.dumps(cases)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _check(d: Path, key: Path, must_keep: set[str], may_lose: set[str]) -> Store:
    """Reopen (default grace period) and check: every must-keep entry loads and verifies; a may-lose entry is
    either whole or cleanly gone; scans converge to a consistent store."""
    st = open_store(d, key_path=key)
    left = set(st.entry_ids())
    assert must_keep <= left, f"lost acknowledged entries: {sorted(must_keep - left)}"
    for eid in left:
        try:
            assert st.load(eid, count_hit=False).entry_id == eid  # checksummed: nothing torn
        except EntryNotFoundError:
            assert eid in may_lose, eid
    st.scan(grace_s=0)
    rep = st.verify(deep=True)
    assert rep.ok and not rep.notes, rep
    assert must_keep <= set(st.entry_ids())
    return st


def test_kill_at_every_step_of_rebuild_evict_delete_purge(tmp_path_factory):
    cases, runs = [], []
    key = tmp_path_factory.mktemp("key") / "index.key"
    for op, stage, nth in MATRIX:
        d = tmp_path_factory.mktemp(f"{op}-{stage}-{nth}")
        ids, size = _prepare(d, key)
        arg = ""
        if op == "delete":
            arg = next(iter(ids))
        elif op == "purge":
            arg = namespace_key("model-a", CFG)
        budget = int(size * (N - 1.5)) if op == "evict" else 0  # one more entry forces ~2 evictions
        cases.append((str(d / "cache"), op, stage, nth, budget, arg))
        runs.append((op, stage, d, ids, arg))
    p = _spawn(key, cases)
    out, err = p.communicate(timeout=900)  # generous: CI machines may be heavily shared
    codes = [int(line.split()[1]) for line in out.splitlines() if line.startswith("rc ")]
    assert codes == [77] * len(MATRIX), (out, err)
    for op, stage, d, ids, arg in runs:
        if op == "rebuild":
            must_keep, may_lose = set(ids), set()
        elif op == "delete":
            must_keep, may_lose = set(ids) - {arg}, {arg}
        elif op == "purge":
            must_keep = {e for e, ns in ids.items() if ns != arg}
            may_lose = set(ids) - must_keep
        else:  # evict: any old entry may be the victim; the new entry (committed first) may be chosen too
            must_keep, may_lose = set(), set(ids)
        st = _check(d, key, must_keep, may_lose)
        extra = set(st.entry_ids()) - set(ids)
        if op == "evict":  # the new entry was committed before eviction began (and is never its own victim)
            assert [st.load(e, count_hit=False).prompt for e in extra] == ["prompt 999"]
            assert len(st.entry_ids()) >= N - 2  # at most the victims went
        else:
            assert not extra
        if op == "rebuild":
            assert len(list((d / "cache" / "quarantine").glob("catalog-*.sqlite3"))) <= 1
        if op == "purge":  # an interrupted purge can be finished
            st.purge(arg)
            assert set(st.entry_ids()) == must_keep
        st.close()


def test_sigkill_at_an_arbitrary_moment_of_repeated_rebuilds(tmp_path):
    key = tmp_path / "index.key"
    ids, _ = _prepare(tmp_path, key)
    p = _spawn(key, [(str(tmp_path / "cache"), "rebuild_loop", "none", 1, 0, "")])
    line = p.stdout.readline()  # one full rebuild done: the next is in flight when the kill lands
    assert line.startswith("rebuilt"), p.stderr.read()
    time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=60)
    st = _check(tmp_path, key, set(ids), set())
    assert sorted(st.entry_ids()) == sorted(ids)


@pytest.mark.parametrize("nth", [1, 3])
def test_rebuild_interrupted_in_process_leaves_the_old_catalogue_usable(tmp_path, nth):
    """An exception (not a kill) mid-rebuild: the partial catalogue is discarded and the old one still serves."""
    ids, _ = _prepare(tmp_path, tmp_path / "index.key")
    st = open_store(tmp_path)
    calls = [0]

    def fault(stage: str) -> None:
        if stage == "rebuild_entry":
            calls[0] += 1
            if calls[0] >= nth:
                raise KeyboardInterrupt

    st._fault = fault
    with pytest.raises(KeyboardInterrupt):
        st.rebuild_catalog("test")
    st._fault = None
    assert not [p for p in (tmp_path / "cache" / "tmp").iterdir()]  # the partial build is gone
    st.close()
    assert sorted(open_store(tmp_path).entry_ids()) == sorted(ids)


# ------------------------------------------------------------------------------------------ later attacks
@pytest.mark.parametrize("stage", ["rebuild_built", "rebuild_set_aside"])
def test_sigkill_of_a_rebuild_while_another_process_puts(tmp_path, stage):
    """A rebuild is SIGKILLed after building (or after setting the old catalogue aside) while this process keeps
    writing: every put it acknowledged is there after the next open, with the files left by both."""
    key = tmp_path / "index.key"
    ids, _ = _prepare(tmp_path, key)
    writer = open_store(tmp_path, key_path=key)
    flag = tmp_path / "at-stage"
    p = _spawn(key, [(str(tmp_path / "cache"), "rebuild_pause", stage, 1, 0, str(flag))])
    for _ in range(6000):  # bounded: 60 s
        if flag.exists() or p.poll() is not None:
            break
        time.sleep(0.01)
    assert flag.exists(), p.communicate(timeout=60)
    acked = set()
    for i in range(3):  # before the kill: to the old catalogue, or (set aside) after a wait for the rebuild lock
        if stage == "rebuild_built":
            acked.add(writer.put(make_entry(500 + i)))
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=60)
    for i in range(3, 6):  # after the kill
        acked.add(writer.put(make_entry(500 + i)))
    writer.close()
    st = _check(tmp_path, key, set(ids) | acked, set())
    assert set(st.entry_ids()) == set(ids) | acked
    st.close()


def test_a_folder_deleted_under_a_writing_store_and_rows_with_wrong_sizes(tmp_path, caplog):
    """Two hands at once: the whole cache folder deleted while a store writes, then every row's recorded size
    made wrong. The store recreates a fresh cache; every entry acknowledged after that is kept, none is
    quarantined for its row's size, and a scan leaves the store consistent."""
    import shutil
    import sqlite3

    key = tmp_path / "index.key"
    st = open_store(tmp_path, key_path=key)
    st.put(make_entry(1))
    shutil.rmtree(tmp_path / "cache")
    acked = {st.put(make_entry(i)) for i in range(2, 8)}
    st.close()
    db = sqlite3.connect(tmp_path / "cache" / "catalog.sqlite3")
    db.execute("UPDATE entries SET nbytes=nbytes+seq*3")
    db.commit()
    db.close()
    st = _check(tmp_path, key, acked, set())
    assert set(st.entry_ids()) == acked
    assert not list((tmp_path / "cache" / "quarantine").rglob("*.safetensors"))
    st.close()
