"""Kill at every step: a child process dies (``os._exit`` at an injected fault point, which leaves the files
exactly as SIGKILL would, or a real SIGKILL at an arbitrary moment) during a catalogue rebuild, an eviction, a
delete and a purge. Afterwards, reopening with the default grace period (entry files are a day old, so the grace
period protects nothing): every acknowledged entry that was not being removed is there and verifies, nothing
torn is returned, and a scan leaves the store exactly consistent. The put stages are in test_cache_crash.py.
Pure core (no ComfyUI); the children run in parallel to keep the wall time bounded."""
from __future__ import annotations

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
    import importlib.util, os, sys
    root, tests, cache, key, op, stage, nth, budget, arg = sys.argv[1:10]
    sys.path[:0] = [root, tests]
    spec = importlib.util.spec_from_file_location("carnator", os.path.join(root, "__init__.py"),
                                                  submodule_search_locations=[root])
    mod = importlib.util.module_from_spec(spec); sys.modules["carnator"] = mod; spec.loader.exec_module(mod)
    from carnator.carnator_core.cache import Store
    from test_cache_store import make_entry
    st = Store.open(cache, key_path=key, max_bytes=int(budget) or None)
    calls = [0]
    def fault(s):
        if s == stage:
            calls[0] += 1
            if calls[0] >= int(nth):
                os._exit(77)
    st._fault = fault
    if op == "rebuild":
        st.rebuild_catalog("crash test")
    elif op == "rebuild_loop":
        while True:
            st.rebuild_catalog("crash test")
            print("rebuilt", flush=True)
    elif op == "evict":
        print("committed", st.put(make_entry(999)), flush=True)
    elif op == "delete":
        st.delete(arg)
    elif op == "purge":
        st.purge(arg or None)
    os._exit(0)
""")

# (operation, fault stage, n-th time the stage is reached)
MATRIX = [
    ("rebuild", "rebuild_entry", N // 2), ("rebuild", "rebuild_built", 1), ("rebuild", "rebuild_set_aside", 1),
    ("evict", "evict_picked", 1), ("evict", "evict_unlinked", 1),
    ("delete", "delete_unlinked", 1), ("purge", "purge_unlinked", 1),
]


def _prepare(d: Path) -> tuple[dict[str, str], int]:
    """N entries in two namespaces, files a day old; returns {id: namespace} and one entry's size."""
    st = open_store(d)
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


def _spawn(d: Path, op: str, stage: str, nth: int, budget: int = 0, arg: str = "") -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(ROOT), str(ROOT / "tests"), str(d / "cache"), str(d / "index.key"), op,
         stage, str(nth), str(budget), arg],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _check(d: Path, must_keep: set[str], may_lose: set[str]) -> Store:
    """Reopen (default grace period) and check: every must-keep entry loads and verifies; a may-lose entry is
    either whole or cleanly gone; nothing else appears; scans converge to a consistent store."""
    st = open_store(d)
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
    cases = []
    for op, stage, nth in MATRIX:
        d = tmp_path_factory.mktemp(f"{op}-{stage}-{nth}")
        ids, size = _prepare(d)
        arg = ""
        if op == "delete":
            arg = next(iter(ids))
        elif op == "purge":
            arg = namespace_key("model-a", CFG)
        budget = int(size * (N - 1.5)) if op == "evict" else 0  # one more entry forces ~2 evictions
        cases.append((op, stage, nth, d, ids, arg, _spawn(d, op, stage, nth, budget, arg)))
    for op, stage, nth, d, ids, arg, p in cases:
        out, err = p.communicate(timeout=900)  # generous: CI machines may be heavily shared
        assert p.returncode == 77, (op, stage, out, err)
        if op == "rebuild":
            must_keep, may_lose = set(ids), set()
        elif op == "delete":
            must_keep, may_lose = set(ids) - {arg}, {arg}
        elif op == "purge":
            must_keep = {e for e, ns in ids.items() if ns != arg}
            may_lose = set(ids) - must_keep
        else:  # evict: any old entry may be the victim; the new entry (committed first) may be chosen too
            must_keep, may_lose = set(), set(ids)
        st = _check(d, must_keep, may_lose)
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
    ids, _ = _prepare(tmp_path)
    p = _spawn(tmp_path, "rebuild_loop", "none", 1)
    line = p.stdout.readline()  # one full rebuild done: the next is in flight when the kill lands
    assert line.startswith("rebuilt"), p.stderr.read()
    time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=60)
    st = _check(tmp_path, set(ids), set())
    assert sorted(st.entry_ids()) == sorted(ids)


@pytest.mark.parametrize("nth", [1, 3])
def test_rebuild_interrupted_in_process_leaves_the_old_catalogue_usable(tmp_path, nth):
    """An exception (not a kill) mid-rebuild: the partial catalogue is discarded and the old one still serves."""
    ids, _ = _prepare(tmp_path)
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
