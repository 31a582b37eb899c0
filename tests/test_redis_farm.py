"""A farm of worker processes on one real ``redis-server``: writers SIGKILLed at random moments (and at chosen
points: after staging, after publishing), Redis itself killed and restarted mid-stream, and a byte budget shared
by several workers. Afterwards: every acknowledged entry is there and bit-exact, nothing is torn, partial writes
left nothing visible and nothing without a TTL, and every worker's synced index agrees with Redis.
Pure core (no ComfyUI). Entries are small (≤ 3 MiB) and workers few, to keep CPU bounded."""
from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import random
import signal
import sys
import time
import traceback
from pathlib import Path

import pytest
from harness_redis import RedisServer

ROOT = Path(__file__).resolve().parents[1]


def _ensure_package() -> None:
    """Spawned children do not run conftest: register the repo as package ``carnator`` the same way."""
    if "carnator" not in sys.modules:
        spec = importlib.util.spec_from_file_location("carnator", ROOT / "__init__.py",
                                                      submodule_search_locations=[str(ROOT)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["carnator"] = mod
        spec.loader.exec_module(mod)


_ensure_package()

PER_WORKER = 8


def _config(big: bool):
    from test_cache_store import CFG

    from carnator.carnator_core.types import GenConfig

    # big: 3 latents of 16x4x32x64 float32 (~0.5 MiB each) -> entries of many 256 KiB chunks, so a kill often
    # lands in the middle of staging
    return GenConfig(**{**CFG.__dict__, "latent_shape": (16, 4, 32, 64)}) if big else CFG


def _data(n: int):
    from test_cache_store import make_entry

    return make_entry(n, fp="model-a" if n % 2 == 0 else "model-b", config=_config(n % 3 == 0))


def _same(entry, n: int) -> bool:
    import torch

    want = _data(n)
    return entry.prompt == want.prompt and all(torch.equal(entry.tensors[k], t) for k, t in want.tensors.items())


def _worker(url: str, wid: int, incarnation: int, outdir: str, fault: str, count: int, max_bytes: int | None
            ) -> None:
    """Writes ``count`` entries through one handle and reads through a second one; appends "<id> <n>" to its ack
    file only after ``put`` returned. ``fault`` = "after_stage:K" / "after_publish:K": SIGKILL itself there on
    the K-th put. Errors (wrong or torn data) go to its error file."""
    import numpy as np

    from carnator.carnator_core.cache import (
        CacheUnavailableError,
        CorruptEntryError,
        EntryNotFoundError,
        redis_store as rs,
    )
    from carnator.carnator_core.types import namespace_key

    rs.CHUNK_BYTES = 256 << 10
    writer = rs.RedisStore.open(url, full_url=url, max_bytes=max_bytes, retry_s=0.2)
    reader = rs.RedisStore.open(url, full_url=url, retry_s=0.2)
    ack = open(Path(outdir) / f"ack-{wid}-{incarnation}.txt", "a")
    err = open(Path(outdir) / f"err-{wid}-{incarnation}.txt", "a")
    rng = np.random.default_rng(wid * 100 + incarnation)
    where, _, at = fault.partition(":")
    done = 0
    try:
        while done < count:
            n = wid * 100_000 + incarnation * 1000 + done
            if where and done == int(at):
                writer._fault = lambda stage: os.kill(os.getpid(), signal.SIGKILL) if stage == where else None
            try:
                eid = writer.put(_data(n))
            except CacheUnavailableError:
                time.sleep(0.05)  # Redis down: this write is not acknowledged; try the next one later
                continue
            ack.write(f"{eid} {n}\n")
            ack.flush()
            done += 1
            for fp in ("model-a", "model-b"):
                for big in (False, True):
                    ns = namespace_key(fp, _config(big))
                    c = reader.candidates(ns, rng.standard_normal(32), k=2)
                    for item in c.items:
                        try:
                            e = reader.load(item.entry_id)
                        except (EntryNotFoundError, CacheUnavailableError):
                            continue  # evicted meanwhile / Redis restarting: the request would run dense
                        except CorruptEntryError as ex:
                            err.write(f"torn or corrupt: {ex}\n")
                            continue
                        if not _same(e, int(e.prompt.split()[-1])):
                            err.write(f"entry {item.entry_id} does not hold what was written\n")
                        if e.namespace != ns or item.signature.grid != e.signature.grid:
                            err.write(f"entry {item.entry_id} crossed namespaces\n")
    except Exception:  # noqa: BLE001 - report to the parent instead of dying silently
        err.write(traceback.format_exc())
    finally:
        ack.close()
        err.close()


def _spawn(ctx, url: str, wid: int, inc: int, out: Path, fault: str = "", count: int = PER_WORKER,
           max_bytes: int | None = None):
    p = ctx.Process(target=_worker, args=(url, wid, inc, str(out), fault, count, max_bytes))
    p.start()
    return p


def _acks(out: Path) -> dict[str, int]:
    acked = {}
    for f in out.glob("ack-*.txt"):
        for line in f.read_text().splitlines():
            eid, n = line.split()
            acked[eid] = int(n)
    return acked


def _errors(out: Path) -> list[str]:
    return [f"{f.name}: {f.read_text()}" for f in out.glob("err-*.txt") if f.read_text().strip()]


def _reap(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=60)


def _check_store(url: str, acked: dict[str, int], *, all_present: bool) -> None:
    from carnator.carnator_core.cache.redis_store import RedisStore

    st = RedisStore.open(url, full_url=url)
    ids = set(st.entry_ids())
    if all_present:
        assert set(acked) <= ids, f"acknowledged entries lost: {sorted(set(acked) - ids)}"
    for eid in ids & set(acked):
        assert _same(st.load(eid, count_hit=False), acked[eid])
    rep = st.verify(deep=True)  # every entry re-read and checksummed; sets, totals and index agree
    assert rep.ok, rep.problems
    staged = list(st._r.scan_iter(match="carnator:{*}:stage:*"))
    assert all(st._r.ttl(k) > 0 for k in staged), "a staging key without a TTL would leak forever"
    st.close()


@pytest.fixture()
def redis_server(tmp_path):
    srv = RedisServer(tmp_path / "redis", persist=True)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.mark.slow
def test_four_workers_with_sigkills_lose_nothing_acknowledged(redis_server, tmp_path):
    ctx = mp.get_context("spawn")
    out = tmp_path / "out"
    out.mkdir()
    url = redis_server.url
    faults = {0: "after_stage:2", 1: "after_publish:1"}  # chosen kill points, besides the random ones below
    procs = {w: _spawn(ctx, url, w, 0, out, faults.get(w, "")) for w in range(4)}
    incarnation = {w: 0 for w in range(4)}
    rnd = random.Random(7)
    all_procs = list(procs.values())
    try:
        kills = 0
        deadline = time.time() + 600
        while time.time() < deadline:
            for w, p in list(procs.items()):
                if not p.is_alive():
                    p.join()
                    if p.exitcode != 0 and incarnation[w] < 3:  # died (chosen kill): a new incarnation
                        incarnation[w] += 1
                        procs[w] = _spawn(ctx, url, w, incarnation[w], out)
                        all_procs.append(procs[w])
            if kills < 4:
                time.sleep(rnd.uniform(0.3, 1.5))
                # only workers that are writing (past start-up), and not the ones heading for a chosen kill point
                alive = [w for w, p in procs.items() if p.is_alive() and (w not in faults or incarnation[w])
                         and (out / f"ack-{w}-{incarnation[w]}.txt").exists()]
                if alive:
                    w = rnd.choice(alive)
                    procs[w].kill()  # SIGKILL at a random moment
                    kills += 1
                continue
            if all(not p.is_alive() for p in procs.values()) and all(p.exitcode == 0 for p in procs.values()):
                break
            time.sleep(0.2)
    finally:
        _reap(all_procs)
    assert not _errors(out), _errors(out)
    acked = _acks(out)
    assert len(acked) >= 4 * PER_WORKER  # every worker's last incarnation finished its writes
    assert (out / "ack-0-0.txt").read_text().count("\n") == 2  # killed itself after staging its 3rd write
    _check_store(url, acked, all_present=True)


@pytest.mark.slow
def test_redis_restart_mid_stream(redis_server, tmp_path):
    """Redis is SIGKILLed while two workers write and read, and restarted from its append-only file: workers see
    "unavailable" meanwhile, resume by themselves, and every acknowledged write survives."""
    ctx = mp.get_context("spawn")
    out = tmp_path / "out"
    out.mkdir()
    url = redis_server.url
    procs = [_spawn(ctx, url, w, 0, out, count=12) for w in range(2)]
    try:
        deadline = time.time() + 300
        while len(_acks(out)) < 6 and time.time() < deadline:
            time.sleep(0.1)
        assert len(_acks(out)) >= 6, _errors(out)
        redis_server.kill()
        time.sleep(1.0)
        redis_server.start()
        for p in procs:
            p.join(timeout=600)
            assert p.exitcode == 0
    finally:
        _reap(procs)
    assert not _errors(out), _errors(out)
    acked = _acks(out)
    assert len(acked) == 24
    _check_store(url, acked, all_present=True)


@pytest.mark.slow
def test_byte_budget_held_across_workers(redis_server, tmp_path):
    from carnator.carnator_core.cache.redis_store import RedisStore

    url = redis_server.url
    probe = RedisStore.open(url, full_url=url)
    sizes = []
    for n in (1, 3):  # a small and a big entry
        eid = probe.put(_data(n))
        sizes.append(probe.load(eid, count_hit=False).nbytes)
    probe.purge()
    budget = int(sizes[1] * 4 + sizes[0] * 2)
    ctx = mp.get_context("spawn")
    out = tmp_path / "out"
    out.mkdir()
    procs = [_spawn(ctx, url, w, 0, out, count=PER_WORKER, max_bytes=budget) for w in range(3)]
    peak = 0
    try:
        while any(p.is_alive() for p in procs):
            peak = max(peak, probe.stats().bytes)
            time.sleep(0.05)
        assert all(p.exitcode == 0 for p in procs)
    finally:
        _reap(procs)
    assert not _errors(out), _errors(out)
    acked = _acks(out)
    assert len(acked) == 3 * PER_WORKER
    s = probe.stats()
    assert 0 < s.bytes <= budget and s.entries < len(acked)
    # between a publish and its eviction a worker may be over by at most the entries being published
    assert peak <= budget + 3 * sizes[1]
    _check_store(url, acked, all_present=False)
