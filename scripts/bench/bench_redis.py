#!/usr/bin/env python
"""Shared cache store on Redis: entry publish/load against the local store, recall through the synced index at
scale, and the catch-up of a worker joining a large cache.

Run from the repository root with the host python (needs ``redis-server`` on PATH; the script starts its own on
a free loopback port, without persistence, and stops it by PID)::

    .host/venv/bin/python scripts/bench/bench_redis.py entry --writes 5
    .host/venv/bin/python scripts/bench/bench_redis.py recall --entries 100000 --queries 300
    .host/venv/bin/python scripts/bench/bench_redis.py farm --warm 24 --stream 24

Every command prints Markdown table rows and appends a JSON line per result to ``--out``
(default artifacts/bench_redis.jsonl).

What is measured
----------------
* ``entry``: ``put`` and ``load`` of a Wan 2.1 480p/81-frame entry (latent 16x21x60x104 in bfloat16: probe latent,
  probe x0, final latent; 3-object signature on the 21x30x52 token grid; the recorded per-head block structure of
  28 layers; 4096-d embedding: ~23 MiB) on the local directory store (durable: fsync, the default) and on the
  Redis store, interleaved in one process, medians over ``--writes``. Wall and CPU time of this process (Redis's
  own CPU is not in "CPU").
* ``recall``: ``--entries`` entries published through the real publish script (pipelined; their stored bytes
  are a few hundred bytes each: recall never reads them), with "structured" synthetic 4096-d embeddings
  (``scripts/bench/bench_cache.py``: anisotropic and low-rank-ish like pooled text embeddings). Then:
  - catch-up of a joining worker: ``warm()`` on a fresh handle (scan of the embeddings from Redis + index build),
    wall and CPU;
  - ``query`` and ``candidates`` latency (p50/p99 over ``--queries`` single queries) through the synced index,
    steady and with another worker publishing one entry every 10 queries (the stream catch-up path), beside the
    bare in-process ``VectorIndex.search`` over the same index (the floor: no Redis round trips);
  - catch-up of a running worker after 1,000 publishes by another one (stream replay).
* ``farm``: two real ComfyUI servers (``tests/harness_server.py``, ``--cache-none`` so every queued prompt really
  runs) on loopback, the Table-1 workload (``scripts/bench/workload.py`` flags) split round-robin between them in
  timeline order: warm requests through ``workflows/api/embedded_warm_cache.json``, stream requests through
  ``workflows/api/embedded.json`` (recall, certified filter, joint reuse, misses written), one at a time through
  ``POST /prompt``. Once with one shared Redis cache (database 0 for both), once with a private cache per server
  (databases 1 and 2 of the same Redis). Hit rate = stream requests whose sampler report says "hit".
  ``--assign random`` sends each request to a server drawn by a seeded coin instead of round-robin (round-robin
  puts requests an even distance apart on the same server, which decides where repeats land).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # harness_redis: the same redis-server start/stop discipline as the tests


from repo_package import register_package  # noqa: E402  (the one repo-as-package bootstrap)

register_package()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from harness_redis import RedisServer  # noqa: E402

from carnator.carnator_core.cache import redis_store as rs  # noqa: E402
from carnator.carnator_core.cache.index import IndexParams, normalize_rows  # noqa: E402
from carnator.carnator_core.cache.store import EntryData, Store  # noqa: E402
from carnator.carnator_core.types import BlockStructure, GenConfig, ObjectSignature, Signature  # noqa: E402


def _bench_cache():
    path = ROOT / "scripts" / "bench" / "bench_cache.py"
    spec = importlib.util.spec_from_file_location("carnator_bench_cache", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


BC = _bench_cache()
DIM = 4096


def pct(xs: list[float], p: float) -> float:
    return float(np.percentile(np.asarray(xs), p))


def wan_entry(i: int, rng: np.random.Generator) -> EntryData:
    """A Wan 2.1 480p/81f entry as the Cache Writer stores it (bfloat16 latents: ~23 MiB)."""
    latent, grid = (16, 21, 60, 104), (21, 30, 52)
    n_tok = grid[0] * grid[1] * grid[2]
    nb = (n_tok + 63) // 64
    cfg = GenConfig(arch="wan21", latent_shape=latent, steps=30, sampler="euler", scheduler="simple", cfg=5.0,
                    sigmas_digest="bench", probe_steps=6)
    sig = Signature(objects=tuple(ObjectSignature(name=f"obj{k}", mask=rng.random(grid, dtype=np.float32), size=0.2,
                                                  lab=(50.0, 1.0, 2.0)) for k in range(3)),
                    context_lab=rng.random((8, 8, 3), dtype=np.float32), grid=grid)
    bs = BlockStructure(keep=rng.random((28, 12, nb, nb)) < 0.25, layers=tuple(range(1, 29)), block_size=64,
                        n_tokens=n_tok, steps=(10, 18, 26))
    tensors = {n: torch.randn(latent).to(torch.bfloat16) for n in ("latent_probe", "latent_final", "x0_probe")}
    return EntryData(model_fingerprint="bench-model", config=cfg, prompt=f"prompt {i}", seed=i,
                     embedding=rng.standard_normal(DIM).astype(np.float32), signature=sig, tensors=tensors,
                     block_structure=bs, meta={"bench": True})


def _timed(fn):
    t, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, (time.perf_counter() - t) * 1000, (time.process_time() - c) * 1000


def bench_entry(args: argparse.Namespace, srv: RedisServer) -> list[dict]:
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    root = Path(tempfile.mkdtemp(prefix="bench_redis_local_", dir=args.workdir))
    local = Store.open(root / "cache", key_path=root / "index.key")
    shared = rs.RedisStore.open(srv.url, full_url=srv.url)
    res: dict[str, dict[str, list[float]]] = {k: {"put": [], "put_cpu": [], "load": [], "load_cpu": [],
                                                  "sig": []} for k in ("local", "redis")}
    size = 0
    for i in range(args.writes):
        data = wan_entry(i, rng)
        for name, st in (("local", local), ("redis", shared)) if i % 2 == 0 else (("redis", shared), ("local", local)):
            eid, ms, cpu = _timed(lambda st=st: st.put(data))
            res[name]["put"].append(ms)
            res[name]["put_cpu"].append(cpu)
            st._sigs.clear()  # noqa: SLF001 - measure the read, not the per-process memo
            _, ms, _ = _timed(lambda st=st, eid=eid: st.load_signature(eid))
            res[name]["sig"].append(ms)
            e, ms, cpu = _timed(lambda st=st, eid=eid: st.load(eid, count_hit=False))
            res[name]["load"].append(ms)
            res[name]["load_cpu"].append(cpu)
            size = e.nbytes
    info = shared._r.info("memory")
    rows = []
    for name in ("local", "redis"):
        r = res[name]
        rows.append({"bench": "entry", "store": name, "writes": args.writes, "bytes_per_entry": size,
                     "put_ms_p50": pct(r["put"], 50), "put_cpu_ms_p50": pct(r["put_cpu"], 50),
                     "load_ms_p50": pct(r["load"], 50), "load_cpu_ms_p50": pct(r["load_cpu"], 50),
                     "load_signature_ms_p50": pct(r["sig"], 50), "loadavg": os.getloadavg()[0],
                     **({"redis_used_memory_per_entry": (int(info["used_memory"]) / args.writes)}
                        if name == "redis" else {})})
    local.close()
    shared.close()
    return rows


def _populate(st: rs.RedisStore, synth, n: int, ns_data: EntryData, start: int = 0, batch: int = 1000) -> None:
    """Publish ``n`` small entries with synthetic embeddings through the real publish script (pipelined)."""
    import hashlib

    ns = ns_data.namespace
    p = st._p(ns)  # noqa: SLF001
    st._register_ns(ns)  # noqa: SLF001
    cfg_json = json.dumps(ns_data.config.to_meta(), sort_keys=True)
    script = st._scripts["publish"]  # noqa: SLF001
    for s in range(start, start + n, batch):
        m = min(batch, start + n - s)
        embs = synth.rows(m, seed=50_000 + s // batch)
        pipe = st._r.pipeline(transaction=False)  # noqa: SLF001
        for j in range(m):
            i = s + j
            eid = rs.ns_tag(ns) + secrets.token_hex(4)
            blob = f"bench entry {i}".encode()  # recall never reads the entry bytes
            sig_blob = rs._signature_blob(eid, ns_data.signature)  # noqa: SLF001 - the row's signature copy
            pipe.rpush(f"{p}stage:{eid}", blob)
            pipe.expire(f"{p}stage:{eid}", rs.STAGE_TTL_S)
            script(keys=[p], args=[eid, ns_data.model_fingerprint, cfg_json, DIM, "bench-token", repr(time.time()),
                                   f"prompt {i}", i, len(blob), "0" * 64, "1.0", 1, sig_blob, f"d{i}:{i}", "1.0",
                                   embs[j].astype(np.float32).tobytes(), hashlib.sha256(sig_blob).hexdigest(),
                                   rs.STREAM_KEEP], client=pipe)
        pipe.execute()
        if (s // batch) % 10 == 0:
            print(f"  published {s + m:,}", file=sys.stderr, flush=True)


def bench_recall(args: argparse.Namespace, srv: RedisServer) -> list[dict]:
    import faiss

    faiss.omp_set_num_threads(1)
    torch.set_num_threads(1)
    synth = BC.Synth("structured", DIM)
    rng = np.random.default_rng(1)
    small = EntryData(model_fingerprint="bench-model", config=GenConfig(
        arch="wan21", latent_shape=(16, 21, 60, 104), steps=30, sampler="euler", scheduler="simple", cfg=5.0,
        sigmas_digest="bench", probe_steps=6), prompt="x", seed=0, embedding=np.ones(DIM, np.float32),
        signature=Signature(objects=(ObjectSignature(name="obj", mask=rng.random((2, 3, 4), dtype=np.float32),
                                                     size=0.2, lab=(50.0, 1.0, 2.0)),),
                            context_lab=rng.random((4, 4, 3), dtype=np.float32), grid=(2, 3, 4)))
    ns = small.namespace
    writer = rs.RedisStore.open(srv.url, full_url=srv.url)
    t = time.perf_counter()
    _populate(writer, synth, args.entries, small)
    populate_s = time.perf_counter() - t
    used = int(writer._r.info("memory")["used_memory"])
    params = IndexParams()
    rows = []
    worker = rs.RedisStore.open(srv.url, full_url=srv.url, index_params=params)
    got, ms, cpu = _timed(worker.warm)
    kind = worker.index_kind(ns)
    rows.append({"bench": "catchup", "what": "joining worker: warm() (scan + build)", "entries": got[ns],
                 "index": kind, "wall_s": ms / 1000, "cpu_s": cpu / 1000, "populate_s": populate_s,
                 "redis_used_memory": used, "loadavg": os.getloadavg()[0]})
    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    queries = normalize_rows(synth.rows(args.queries, seed=7))
    st = worker._indexes[ns]  # noqa: SLF001
    for label, publish_every in (("steady", 0), ("1 publish / 10 queries", 10)):
        lat: dict[str, list[float]] = {"floor": [], "floor_cpu": [], "query": [], "query_cpu": [],
                                       "candidates": [], "candidates_cpu": []}
        added = 0
        for qi, q in enumerate(queries):
            if publish_every and qi % publish_every == 0:
                _populate(writer, synth, 1, small, start=args.entries + 10_000 + added)
                added += 1
            _, ms, cpu = _timed(lambda q=q: st.index.search(q, 5, params, fetch=lambda s: worker._fetch_vectors(ns, s)))
            lat["floor"].append(ms)
            lat["floor_cpu"].append(cpu)
            _, ms, cpu = _timed(lambda q=q: worker.query(ns, q, 5))
            lat["query"].append(ms)
            lat["query_cpu"].append(cpu)
            c, ms, cpu = _timed(lambda q=q: worker.candidates(ns, q, 5))
            assert len(c.items) == 5, c.note
            lat["candidates"].append(ms)
            lat["candidates_cpu"].append(cpu)
            st = worker._indexes[ns]  # noqa: SLF001
        row = {"bench": "recall", "load": label, "entries": st.index.ntotal, "index": st.index.kind,
               "queries": len(queries), "k": 5, "loadavg": os.getloadavg()[0]}
        for k, v in lat.items():
            row[f"{k}_ms_p50"], row[f"{k}_ms_p99"] = pct(v, 50), pct(v, 99)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    _populate(writer, synth, 1000, small, start=args.entries + 20_000)
    _, ms, cpu = _timed(lambda: worker.query(ns, queries[0], 5))
    rows.append({"bench": "catchup", "what": "running worker: 1,000 publishes replayed from the stream + 1 query",
                 "entries": worker._indexes[ns].index.ntotal, "index": worker.index_kind(ns),  # noqa: SLF001
                 "wall_s": ms / 1000, "cpu_s": cpu / 1000, "loadavg": os.getloadavg()[0]})
    writer.close()
    worker.close()
    return rows


def bench_farm(args: argparse.Namespace, srv: RedisServer) -> list[dict]:
    import copy

    from harness_server import ComfyServer

    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    from workload import spec_from_args

    from carnator.carnator_core.lab.workload import build_workload

    wl = build_workload(spec_from_args(args))
    urls = [f"redis://127.0.0.1:{srv.port}/{db}" for db in (0, 1, 2)]
    env = {"CARNATOR_REDIS_URL": " ".join(urls)}
    apis = {name: json.loads((ROOT / "workflows" / "api" / f"{name}.json").read_text())
            for name in ("embedded_warm_cache", "embedded")}

    def graph(name: str, prompt: str, seed: int, directory: str) -> dict:
        g = copy.deepcopy(apis[name])
        for node in g.values():
            if node["class_type"] == "PrimitiveStringMultiline":
                node["inputs"]["value"] = prompt
            elif node["class_type"] == "CarnatorEarlyProbe":
                node["inputs"]["seed"] = int(seed)
            elif node["class_type"] == "CarnatorCacheLoader":
                node["inputs"]["directory"] = directory
        return g

    def report(history: dict, g: dict) -> dict:
        sid = next(i for i, n in g.items() if n["class_type"] == "CarnatorJointReuseSampler")
        return history["outputs"][sid]["carnator_report"][0]

    rng = np.random.default_rng(args.assign_seed)
    n = len(wl.warm) + len(wl.stream)
    where = (rng.integers(0, 2, size=n) if args.assign == "random" else np.arange(n) % 2).tolist()
    base = Path(tempfile.mkdtemp(prefix="bench_farm_", dir=args.workdir))
    rows = []
    with ComfyServer(base / "a", env=env, extra_args=["--cache-none"], startup_timeout=900) as a, \
            ComfyServer(base / "b", env=env, extra_args=["--cache-none"], startup_timeout=900) as b:
        servers = (a, b)
        for config, dirs in (("shared", (urls[0], urls[0])), ("private", (urls[1], urls[2]))):
            t0 = time.perf_counter()
            for i, r in enumerate(wl.warm):
                w = where[i]
                g = graph("embedded_warm_cache", r.prompt, r.seed, dirs[w])
                servers[w].run_prompt_ws(g, timeout=1800)
            decisions, savings, per_server = [], [], [0, 0]
            for i, r in enumerate(wl.stream):
                w = where[len(wl.warm) + i]
                g = graph("embedded", r.prompt, r.seed, dirs[w])
                history, _ = servers[w].run_prompt_ws(g, timeout=1800)
                rep = report(history, g)
                decisions.append(rep["decision"])
                savings.append(float(rep.get("saving") or 0.0))
                per_server[w] += rep["decision"] == "hit"
                print(f"  {config} {r.rid} on {'AB'[w]}: {rep['decision']} {rep.get('entry_id') or ''}",
                      file=sys.stderr, flush=True)
            hits = sum(d == "hit" for d in decisions)
            rows.append({"bench": "farm", "cache": config, "assign": args.assign, "warm": len(wl.warm),
                         "stream": len(wl.stream),
                         "hits": hits, "hit_rate": hits / max(1, len(wl.stream)), "hits_a": per_server[0],
                         "hits_b": per_server[1], "mean_saving": float(np.mean(savings)) if savings else 0.0,
                         "wall_s": time.perf_counter() - t0, "loadavg": os.getloadavg()[0]})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    out = []
    for r in rows:
        if r["bench"] == "entry":
            extra = (f" | {r['redis_used_memory_per_entry'] / 2**20:.1f} MiB" if "redis_used_memory_per_entry" in r
                     else " | –")
            out.append(f"| {r['store']} | {r['bytes_per_entry'] / 2**20:.1f} MiB | {r['put_ms_p50']:.0f} | "
                       f"{r['put_cpu_ms_p50']:.0f} | {r['load_ms_p50']:.0f} | {r['load_cpu_ms_p50']:.0f} | "
                       f"{r['load_signature_ms_p50']:.1f}{extra} | {r['loadavg']:.1f} |")
        elif r["bench"] == "farm":
            out.append(f"| {r['cache']} | {r['assign']} | {r['warm']} + {r['stream']} | {r['hits']} / {r['stream']} "
                       f"({r['hit_rate']:.1%}) | {r['hits_a']} / {r['hits_b']} | {r['mean_saving']:.1%} | "
                       f"{r['wall_s']:.0f} | {r['loadavg']:.1f} |")
        elif r["bench"] == "recall":
            out.append(f"| {r['load']} | {r['entries']:,} | {r['index']} | {r['floor_ms_p50']:.2f} / "
                       f"{r['floor_ms_p99']:.2f} | {r['query_ms_p50']:.2f} / {r['query_ms_p99']:.2f} | "
                       f"{r['query_cpu_ms_p50']:.2f} / {r['query_cpu_ms_p99']:.2f} | {r['candidates_ms_p50']:.2f} / "
                       f"{r['candidates_ms_p99']:.2f} | {r['loadavg']:.1f} |")
        else:
            out.append(f"| {r['what']} | {r['entries']:,} | {r['index']} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} | "
                       f"{r['loadavg']:.1f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("entry", "recall", "farm"))
    ap.add_argument("--writes", type=int, default=5)
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument("--workdir", default=tempfile.gettempdir())
    ap.add_argument("--assign", choices=("round-robin", "random"), default="round-robin",
                    help="farm: how requests are split between the two servers")
    ap.add_argument("--assign-seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "artifacts" / "bench_redis.jsonl"))
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    from workload import add_workload_args

    add_workload_args(ap)
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench_redis_", dir=args.workdir))
    srv = RedisServer(workdir / "redis")
    srv.start()
    try:
        rows = {"entry": bench_entry, "recall": bench_recall, "farm": bench_farm}[args.what](args, srv)
    finally:
        srv.stop()
    print(f"machine: {BC.machine()}, redis-server {_redis_version()}")
    print(markdown(rows))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def _redis_version() -> str:
    import subprocess

    return subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.split()[2]


if __name__ == "__main__":
    main()
