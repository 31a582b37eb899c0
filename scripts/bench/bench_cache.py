#!/usr/bin/env python
"""Cache store benchmarks: retrieval latency/recall at scale and write-path cost per entry.

Run from the repository root with the host python, e.g.::

    .host/venv/bin/python scripts/bench/bench_cache.py retrieval --sizes 10000,100000 --data structured
    .host/venv/bin/python scripts/bench/bench_cache.py retrieval --sizes 1000000 --data structured
    .host/venv/bin/python scripts/bench/bench_cache.py store --sizes 10000,100000
    .host/venv/bin/python scripts/bench/bench_cache.py write

Every command prints Markdown table rows and appends a JSON line per result to ``--out``
(default artifacts/bench_cache.jsonl).

What is measured
----------------
* ``retrieval``: ``VectorIndex`` (the store's index code) built over N synthetic unit vectors of dimension 4096
  (Wan's UMT5 text width, which the pooled retrieval embedding has), held as a float16 memmap on disk (the
  dataset *is* those float16 values; float32 copies of 1M x 4096 would need 16 GB). Exact top-K is computed
  by brute force over the same values in the generation pass. Latency = one query at a time, FAISS on one
  thread (a ComfyUI process serves one request at a time), including the exact re-rank whose full
  vectors come from the memmap. recall@K = |approx top-K ∩ exact top-K| / K averaged over the queries.
* ``store``: the real ``Store.query`` path (SQLite catalogue, re-rank vectors read from SQLite, id mapping) on a
  store whose catalogue rows are inserted directly (no entry files: the query path never reads them): time of
  the first query (index built from the catalogue, IVF file written), latency of later queries, and the first
  query of a *new* process-level Store (index loaded from its signed file).
* ``write``: ``Store.put`` / ``load`` / ``load_signature`` at Wan 2.1 480p/81-frame geometry.

Synthetic data (an assumption, stated in BENCHMARKS.md): real pooled text embeddings are anisotropic and
low-rank-ish; "structured" models that as a common direction + one of 2000 topic centres in a 128-d subspace +
prompt-specific variation in a 64-d subspace + isotropic noise (norms 1 : 1 : 0.5 : 0.3), normalised. "isotropic"
(i.i.d. Gaussian directions) is the worst case for any approximate index and is reported too.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
from machine import cpu_model  # noqa: E402
from repo_package import register_package  # noqa: E402

register_package()

import faiss  # noqa: E402
import numpy as np  # noqa: E402

from carnator.carnator_core.cache.index import IndexParams, VectorIndex  # noqa: E402

DIM = 4096


def machine() -> str:
    return f"{os.cpu_count()} CPUs ({cpu_model()}), python {platform.python_version()}, " \
           f"faiss {faiss.__version__} ({faiss.get_compile_options().strip()}), numpy {np.__version__}"


class Synth:
    """Deterministic synthetic embeddings (see module docstring)."""

    def __init__(self, kind: str, dim: int = DIM, seed: int = 0, topics: int = 2000, rt: int = 128, rv: int = 64):
        self.kind, self.dim = kind, dim
        rng = np.random.default_rng(seed)
        q, _ = np.linalg.qr(rng.standard_normal((dim, 1 + rt + rv)).astype(np.float32))
        basis = q.T.astype(np.float32)
        self.mu, self.vt, self.u = basis[0], basis[1 : 1 + rt], basis[1 + rt :]
        w = rng.standard_normal((topics, rt)).astype(np.float32)
        self.w = w / np.linalg.norm(w, axis=1, keepdims=True)
        self.rv = rv

    def rows(self, n: int, seed: int) -> np.ndarray:
        r = np.random.default_rng(seed)
        if self.kind == "isotropic":
            x = r.standard_normal((n, self.dim), dtype=np.float32)
        else:
            j = r.integers(len(self.w), size=n)
            x = self.mu[None, :] + self.w[j] @ self.vt
            x += (r.standard_normal((n, self.rv), dtype=np.float32) * (0.5 / np.sqrt(self.rv))) @ self.u
            x += r.standard_normal((n, self.dim), dtype=np.float32) * (0.3 / np.sqrt(self.dim))
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        return x


def make_dataset(synth: Synth, n: int, queries: np.ndarray, k: int, workdir: Path, chunk: int = 10000
                 ) -> tuple[np.memmap, np.ndarray, float]:
    """float16 memmap [n, d] + exact top-k ids per query (computed on the float16 values), and CPU seconds taken."""
    t0 = time.perf_counter()
    c0 = time.process_time()
    path = workdir / f"{synth.kind}-{n}.f16"
    gt_path = workdir / f"{synth.kind}-{n}-q{len(queries)}-k{k}.gt.npy"
    if path.exists() and gt_path.exists() and path.stat().st_size == n * synth.dim * 2:  # --keep-data reuse
        return np.memmap(path, dtype=np.float16, mode="r", shape=(n, synth.dim)), np.load(gt_path), 0.0
    mm = np.memmap(path, dtype=np.float16, mode="w+", shape=(n, synth.dim))
    best_s = np.full((len(queries), k), -np.inf, np.float32)
    best_i = np.zeros((len(queries), k), np.int64)
    for s in range(0, n, chunk):
        rows = synth.rows(min(chunk, n - s), seed=10_000 + s // chunk)
        mm[s : s + len(rows)] = rows.astype(np.float16)
        vals = np.asarray(mm[s : s + len(rows)], dtype=np.float32)
        sims = queries @ vals.T
        cs = np.concatenate([best_s, sims], axis=1)
        ci = np.concatenate([best_i, np.arange(s, s + len(rows))[None, :].repeat(len(queries), 0)], axis=1)
        top = np.argpartition(-cs, k - 1, axis=1)[:, :k]
        best_s = np.take_along_axis(cs, top, 1)
        best_i = np.take_along_axis(ci, top, 1)
        if (s // chunk) % 20 == 0:
            print(f"  generated {s + len(rows):,}/{n:,} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr,
                  flush=True)
    mm.flush()
    np.save(gt_path, best_i)
    return mm, best_i, time.process_time() - c0


def pct(xs: list[float], p: float) -> float:
    return float(np.percentile(np.asarray(xs), p))


def bench_retrieval(args: argparse.Namespace) -> list[dict]:
    out = []
    synth = Synth(args.data)
    queries = Synth(args.data).rows(args.queries, seed=7)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_cache_"))
    workdir.mkdir(parents=True, exist_ok=True)
    for n in [int(x) for x in args.sizes.split(",")]:
        print(f"[retrieval] N={n:,} data={args.data}", file=sys.stderr, flush=True)
        mm, gt, gen_s = make_dataset(synth, n, queries, args.k, workdir)

        def fetch(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            order = np.sort(ids)
            return order, np.asarray(mm[order], dtype=np.float32)  # noqa: F821 (`del mm` ends the loop)

        params = IndexParams(flat_max=args.flat_max, nprobe=args.nprobe, scan=args.scan)
        faiss.omp_set_num_threads(os.cpu_count() or 1)  # building may use every core ...
        t0, c0 = time.perf_counter(), time.process_time()
        index = VectorIndex.build(np.arange(n, dtype=np.int64), mm, DIM, params)
        build_s, build_cpu_s = time.perf_counter() - t0, time.process_time() - c0
        faiss.omp_set_num_threads(1)  # ... a query is served on one (one request at a time per process)
        scans = sorted({args.scan, *(int(x) for x in args.scan_sweep.split(",") if x)}) \
            if index.kind == "pca-ivf" else [args.scan]
        for scan in scans:
            p = IndexParams(flat_max=args.flat_max, nprobe=args.nprobe, scan=scan)
            for q in queries:  # warm-up pass: steady state (page cache holds what these queries touch)
                index.search(q, args.k, p, fetch=fetch)
            lat, cpu, rec = [], [], []
            load0 = os.getloadavg()[0]
            for qi, q in enumerate(queries):
                c = time.thread_time()
                t = time.perf_counter()
                res = index.search(q, args.k, p, fetch=fetch)
                lat.append((time.perf_counter() - t) * 1000)
                cpu.append((time.thread_time() - c) * 1000)
                rec.append(len({i for i, _ in res} & set(gt[qi].tolist())) / args.k)
            ivf = index.kind == "pca-ivf"
            stage = {}
            if ivf:  # the FAISS stage alone (projection + IVF search), and its recall without the exact re-rank
                kk = max(p.rerank_factor * args.k, p.rerank_min)
                faiss.extract_index_ivf(index.index).nprobe = index.effective_nprobe(p)
                slat, srec = [], []
                for qi, q in enumerate(queries):
                    t = time.perf_counter()
                    qr = np.einsum("d,rd->r", q - index.mean, index.components).astype(np.float32)[None, :]
                    _, cand = index.index.search(qr, kk)
                    slat.append((time.perf_counter() - t) * 1000)
                    srec.append(len(set(cand[0][: args.k].tolist()) & set(gt[qi].tolist())) / args.k)
                stage = {"faiss_p50_ms": pct(slat, 50), "faiss_p99_ms": pct(slat, 99),
                         "recall_without_rerank": float(np.mean(srec))}
            row = {"bench": "retrieval", "data": args.data, "n": n, "dim": DIM, "kind": index.kind,
                   "nlist": int(faiss.extract_index_ivf(index.index).nlist) if ivf else None,
                   "scan": scan if ivf else None, "nprobe": index.effective_nprobe(p) if ivf else None,
                   "reduced_dim": params.reduced_dim if ivf else None,
                   "rerank": max(params.rerank_factor * args.k, params.rerank_min) if ivf else None,
                   "k": args.k, "queries": len(queries), "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99),
                   "max_ms": max(lat), "cpu_p50_ms": pct(cpu, 50), "cpu_p99_ms": pct(cpu, 99),
                   "recall": float(np.mean(rec)), "build_s": build_s, "build_cpu_s": build_cpu_s,
                   "generate_cpu_s": gen_s, **stage,
                   "loadavg": [load0, os.getloadavg()[0]]}
            out.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        if args.flat_compare and n <= args.flat_compare:
            faiss.omp_set_num_threads(1)
            flat = faiss.IndexFlatIP(DIM)
            for s in range(0, n, 32768):
                flat.add(np.asarray(mm[s : s + 32768], dtype=np.float32))
            lat, cpu, rec = [], [], []
            for qi, q in enumerate(queries):
                c = time.thread_time()
                t = time.perf_counter()
                _, ids = flat.search(q[None, :], args.k)
                lat.append((time.perf_counter() - t) * 1000)
                cpu.append((time.thread_time() - c) * 1000)
                rec.append(len(set(ids[0].tolist()) & set(gt[qi].tolist())) / args.k)
            row = {"bench": "retrieval", "data": args.data, "n": n, "dim": DIM, "kind": "flat (exact, reference)",
                   "k": args.k, "queries": len(queries), "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99),
                   "max_ms": max(lat), "cpu_p50_ms": pct(cpu, 50), "cpu_p99_ms": pct(cpu, 99),
                   "recall": float(np.mean(rec)), "build_s": None, "generate_cpu_s": gen_s,
                   "loadavg": [os.getloadavg()[0]]}
            out.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            del flat
        del index, mm
        if not args.keep_data:
            (workdir / f"{args.data}-{n}.f16").unlink(missing_ok=True)
    return out


def bench_store(args: argparse.Namespace) -> list[dict]:
    """The real Store.query path over a catalogue filled by SQL (no entry files needed for queries)."""
    import hashlib
    import secrets
    import sqlite3

    from carnator.carnator_core.cache.store import Store
    from carnator.carnator_core.types import GenConfig, namespace_key

    faiss.omp_set_num_threads(1)
    out = []
    synth = Synth(args.data)
    queries = Synth(args.data).rows(args.queries, seed=7)
    cfg = GenConfig(arch="wan21", latent_shape=(16, 21, 60, 104), steps=30, sampler="euler", scheduler="simple",
                    cfg=5.0, sigmas_digest="bench", probe_steps=6)
    ns = namespace_key("bench-model-fingerprint", cfg)
    for n in [int(x) for x in args.sizes.split(",")]:
        root = Path(tempfile.mkdtemp(prefix=f"bench_store_{n}_", dir=args.workdir))
        key = root.parent / f"{root.name}.key"
        st = Store.open(root, key_path=key)
        t0 = time.perf_counter()
        conn = sqlite3.connect(root / "catalog.sqlite3", timeout=60, isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO namespaces VALUES (?, ?, ?, ?, ?, ?, -1, ?)",
                     (ns, "bench-model-fingerprint", json.dumps(cfg.to_meta(), sort_keys=True), DIM,
                      secrets.token_hex(8), n, time.time()))
        now = time.time()
        for s in range(0, n, 10000):
            rows = synth.rows(min(10000, n - s), seed=10_000 + s // 10000)
            conn.executemany(
                "INSERT INTO entries(seq, id, namespace, prompt, prompt_digest, seed, nbytes, meta_digest, work,"
                " priority, created, last_access, hits) VALUES (?, ?, ?, ?, ?, ?, 1, 'x', 1, 1, ?, ?, 0)",
                [(s + i + 1, f"{s + i + 1:016x}", ns, f"p{s + i}", hashlib.sha256(str(s + i).encode()).hexdigest(),
                  str(s + i), now, now) for i in range(len(rows))])
            conn.executemany("INSERT INTO embeddings(seq, vec) VALUES (?, ?)",
                             [(s + i + 1, rows[i].tobytes()) for i in range(len(rows))])
        conn.execute("COMMIT")
        conn.close()
        fill_s = time.perf_counter() - t0
        t0, c0 = time.perf_counter(), time.process_time()
        st.query(ns, queries[0], args.k)
        first_s, first_cpu_s = time.perf_counter() - t0, time.process_time() - c0
        lat, cpu = [], []
        load0 = os.getloadavg()[0]
        for q in queries:
            c = time.thread_time()
            t = time.perf_counter()
            st.query(ns, q, args.k)
            lat.append((time.perf_counter() - t) * 1000)
            cpu.append((time.thread_time() - c) * 1000)
        kind = st.index_kind(ns)
        st.close()
        st2 = Store.open(root, key_path=key)
        t0, c0 = time.perf_counter(), time.process_time()
        st2.query(ns, queries[0], args.k)
        reopen_s, reopen_cpu_s = time.perf_counter() - t0, time.process_time() - c0
        st2.close()
        row = {"bench": "store.query", "data": args.data, "n": n, "kind": kind, "k": args.k, "queries": len(queries),
               "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99), "max_ms": max(lat), "cpu_p50_ms": pct(cpu, 50),
               "cpu_p99_ms": pct(cpu, 99), "loadavg": load0, "first_query_s": first_s, "first_query_cpu_s": first_cpu_s,
               "reopen_first_query_cpu_s": reopen_cpu_s,
               "reopen_first_query_s": reopen_s, "fill_s": fill_s,
               "catalog_mb": sum(p.stat().st_size for p in root.glob("catalog.sqlite3*")) / 2**20,
               "index_file_mb": sum(p.stat().st_size for p in (root / "index").glob("*")) / 2**20}
        out.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        for p in sorted(root.rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
        root.rmdir()
        key.unlink(missing_ok=True)
    return out


def bench_write(args: argparse.Namespace) -> list[dict]:
    """put/load cost at Wan 2.1 480p/81f: latent [16, 21, 60, 104]; token grid 21 x 30 x 52 = 32,760 tokens."""
    import torch

    from carnator.carnator_core.cache.store import EntryData, Store
    from carnator.carnator_core.types import BlockStructure, GenConfig, ObjectSignature, Signature

    torch.set_num_threads(1)
    latent = (16, 21, 60, 104)
    grid = (21, 30, 52)
    n_tok = grid[0] * grid[1] * grid[2]
    nb = (n_tok + 63) // 64
    cfg = GenConfig(arch="wan21", latent_shape=latent, steps=30, sampler="euler", scheduler="simple", cfg=5.0,
                    sigmas_digest="bench", probe_steps=6)
    rng = np.random.default_rng(0)
    sig = Signature(objects=tuple(ObjectSignature(name=f"obj{i}", mask=rng.random(grid, dtype=np.float32), size=0.2,
                                                  lab=(50.0, 1.0, 2.0)) for i in range(3)),
                    context_lab=rng.random((8, 8, 3), dtype=np.float32), grid=grid)
    # per-head structure of the 28 middle layers of Wan2.1-1.3B (30 blocks, 12 heads), 64-token blocks
    keep = rng.random((28, 12, nb, nb)) < 0.25
    bs = BlockStructure(keep=keep, layers=tuple(range(1, 29)), block_size=64, n_tokens=n_tok, steps=(10, 18, 26))
    out = []
    for dtype, durable, with_blocks in ((torch.float32, True, True), (torch.bfloat16, True, True),
                                        (torch.float32, False, True), (torch.float32, True, False)):
        root = Path(tempfile.mkdtemp(prefix="bench_write_", dir=args.workdir))
        st = Store.open(root, key_path=root.parent / f"{root.name}.key", durable=durable)
        put_ms, put_cpu, load_ms, sig_ms, sizes = [], [], [], [], []
        for i in range(args.writes):
            tensors = {name: torch.randn(latent).to(dtype) for name in ("latent_probe", "latent_final", "x0_probe")}
            data = EntryData(model_fingerprint="bench-model", config=cfg, prompt=f"prompt {i}", seed=i,
                             embedding=rng.standard_normal(DIM).astype(np.float32), signature=sig, tensors=tensors,
                             block_structure=bs if with_blocks else None, meta={"bench": True})
            t, c = time.perf_counter(), time.process_time()
            eid = st.put(data)
            put_ms.append((time.perf_counter() - t) * 1000)
            put_cpu.append((time.process_time() - c) * 1000)
            sizes.append(st.stats().bytes / (i + 1))
            st._sigs.clear()  # noqa: SLF001 - measure the disk read, not the per-process memo
            t = time.process_time()
            st.load_signature(eid)
            sig_ms.append((time.process_time() - t) * 1000)
            t = time.process_time()
            st.load(eid, count_hit=False)
            load_ms.append((time.process_time() - t) * 1000)
        row = {"bench": "write", "dtype": str(dtype).removeprefix("torch."), "durable": durable,
               "block_structure": with_blocks, "writes": args.writes, "bytes_per_entry": int(sizes[-1]),
               "put_ms_p50": pct(put_ms, 50), "put_ms_max": max(put_ms), "put_cpu_ms_p50": pct(put_cpu, 50),
               "load_cpu_ms_p50": pct(load_ms, 50), "load_signature_cpu_ms_p50": pct(sig_ms, 50),
               "loadavg": os.getloadavg()[0]}
        out.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        st.close()
        for p in sorted(root.rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
        root.rmdir()
        (root.parent / f"{root.name}.key").unlink(missing_ok=True)
    return out


def markdown(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        if r["bench"] == "retrieval":
            desc = r["kind"]
            if r.get("nlist"):
                desc += (f" (r={r['reduced_dim']}, nlist={r['nlist']}, scan={r['scan']} → nprobe={r['nprobe']}, "
                         f"rerank {r['rerank']})")
            build = (f"{r['build_cpu_s']:.0f} CPU-s ({r['build_s']:.0f} s wall)" if r.get("build_s") is not None
                     else "–")
            load = f"{r['loadavg'][0]:.1f}" if r.get("loadavg") else ""
            stage = (f"{r['faiss_p50_ms']:.2f} / {r['faiss_p99_ms']:.2f} | {r['recall_without_rerank']:.3f}"
                     if "faiss_p50_ms" in r else "– | –")
            lines.append(f"| {r['data']} | {r['n']:,} | {desc} | {r['p50_ms']:.2f} / {r['p99_ms']:.2f} | "
                         f"{r['cpu_p50_ms']:.2f} / {r['cpu_p99_ms']:.2f} | {r['recall']:.3f} | {stage} | {build} | "
                         f"{load} |")
        elif r["bench"] == "store.query":
            lines.append(f"| {r['data']} | {r['n']:,} | {r['kind']} | {r['p50_ms']:.2f} / {r['p99_ms']:.2f} | "
                         f"{r['cpu_p50_ms']:.2f} / {r['cpu_p99_ms']:.2f} | {r['first_query_cpu_s']:.1f} CPU-s | "
                         f"{r['reopen_first_query_cpu_s']:.2f} CPU-s | {r['catalog_mb']:.0f} | "
                         f"{r['index_file_mb']:.0f} | "
                         f"{r['loadavg']:.1f} |")
        elif r["bench"] == "write":
            lines.append(f"| {r['dtype']} | {'yes' if r['durable'] else 'no'} | "
                         f"{'yes' if r['block_structure'] else 'no'} | {r['bytes_per_entry'] / 2**20:.1f} MiB | "
                         f"{r['put_ms_p50']:.0f} | {r['put_cpu_ms_p50']:.0f} | {r['load_cpu_ms_p50']:.0f} | "
                         f"{r['load_signature_cpu_ms_p50']:.1f} | {r['loadavg']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("retrieval", "store", "write"))
    ap.add_argument("--sizes", default="10000,100000")
    ap.add_argument("--data", choices=("structured", "isotropic"), default="structured")
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--nprobe", type=int, default=IndexParams().nprobe)
    ap.add_argument("--scan", type=int, default=IndexParams().scan)
    ap.add_argument("--scan-sweep", default="4096,16384")
    ap.add_argument("--flat-max", type=int, default=IndexParams().flat_max)
    ap.add_argument("--flat-compare", type=int, default=100000, help="also time exact flat search up to this N")
    ap.add_argument("--writes", type=int, default=5)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--keep-data", action="store_true", help="keep (and reuse) the generated dataset in --workdir")
    ap.add_argument("--out", default=str(ROOT / "artifacts" / "bench_cache.jsonl"))
    args = ap.parse_args()
    print(f"machine: {machine()}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    rows = {"retrieval": bench_retrieval, "store": bench_store, "write": bench_write}[args.what](args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        for r in rows:
            f.write(json.dumps(dict(r, machine=machine(), argv=sys.argv[1:])) + "\n")
    print(markdown(rows))
    print(f"total {time.perf_counter() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
