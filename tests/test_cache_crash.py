"""Crash mid-write: a real child process dies (os._exit / SIGKILL) at each stage of ``Store.put``; the store stays
readable, nothing committed is lost, and ``scan`` cleans up what the crash left. Pure core (no ComfyUI)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from test_cache_store import CFG, DIM, make_entry, open_store

from carnator.carnator_core.types import namespace_key

ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import os, sys
    root, tests, cache, key, stage, count = sys.argv[1:7]
    sys.path[:0] = [root, tests]
    from repo_package import register_package
    register_package()
    from carnator.carnator_core.cache import Store
    from test_cache_store import make_entry
    st = Store.open(cache, key_path=key)
    if stage != "none":
        st._fault = lambda s: os._exit(77) if s == stage else None
    for i in range(int(count)):
        st.put(make_entry(1000 + i))
        print("committed", i, flush=True)
    os._exit(0)
""")


def _child(tmp_path: Path, stage: str, count: int = 1) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(ROOT), str(ROOT / "tests"), str(tmp_path / "cache"),
         str(tmp_path / "index.key"), stage, str(count)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_crash_at_each_stage_of_put(tmp_path_factory):
    stages = ("after_tmp_write", "after_rename", "after_commit")
    dirs = {s: tmp_path_factory.mktemp(s) for s in stages}
    before = {}
    for s, d in dirs.items():
        st = open_store(d)
        before[s] = [st.put(make_entry(i)) for i in range(3)]
        st.close()
    procs = {s: _child(d, s) for s, d in dirs.items()}  # run the three crashes in parallel
    for s, p in procs.items():
        out, err = p.communicate(timeout=900)  # generous: CI machines may be heavily shared
        assert p.returncode == 77, (s, out, err)
    for s, d in dirs.items():
        st = open_store(d)  # default grace period: the open-time scan leaves the young debris alone
        for eid in before[s]:
            assert st.load(eid).entry_id == eid  # committed entries are intact and readable
        tmp_files = list((d / "cache" / "tmp").iterdir())
        ns_dir = d / "cache" / "entries" / namespace_key("model-a", CFG)
        files = {p.stem for p in ns_dir.glob("*.safetensors")}
        rep = st.verify(deep=True)
        assert rep.ok, (s, rep.problems)
        if s == "after_tmp_write":
            assert len(tmp_files) == 1 and files == set(before[s]) and len(st.entry_ids()) == 3
        elif s == "after_rename":
            # renamed but never committed: an orphan file, reported as a (young) note, not an entry
            assert not tmp_files and len(files) == 4 and len(st.entry_ids()) == 3
            assert any("uncommitted file" in n for n in rep.notes)
        else:
            assert len(st.entry_ids()) == 4 and files == set(st.entry_ids())
        cleaned = st.scan(grace_s=0)
        assert cleaned["tmp_removed"] == (1 if s == "after_tmp_write" else 0)
        # a complete entry file without its row (crash between rename and commit) is adopted, never deleted
        assert cleaned["orphans_adopted"] == (1 if s == "after_rename" else 0)
        assert len(st.entry_ids()) == (3 if s == "after_tmp_write" else 4)
        rep = st.verify()
        assert rep.ok and not rep.notes and not list((d / "cache" / "tmp").iterdir())
        # and the store keeps working
        new = st.put(make_entry(50))
        assert st.query(namespace_key("model-a", CFG), st.load(new).embedding, k=1)[0][0] == new


def test_sigkill_during_a_burst_of_writes(tmp_path):
    """SIGKILL at an arbitrary moment of a write loop: everything the child reported committed is there and valid,
    and after a scan the store is exactly consistent."""
    p = _child(tmp_path, "none", count=400)
    committed = -1
    deadline = time.time() + 900
    while time.time() < deadline:  # let it commit a few entries, then kill it mid-stream
        line = p.stdout.readline()
        if not line:  # the child ended on its own (an error): fail below with its stderr
            break
        if line.startswith("committed"):
            committed = int(line.split()[1])
            if committed >= 4:
                break
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    assert committed >= 4, p.stderr.read()
    st = open_store(tmp_path)
    ids = st.entry_ids()
    assert len(ids) >= committed + 1
    for eid in ids:
        st.load(eid, count_hit=False)
    st.scan(grace_s=0)
    rep = st.verify(deep=True)
    assert rep.ok and not rep.notes, rep
    emb = np.random.default_rng(1000).standard_normal(DIM).astype(np.float32)  # entry 1000's embedding
    assert st.query(namespace_key("model-a", CFG), emb, k=1)[0][1] == pytest.approx(1.0, abs=1e-5)
