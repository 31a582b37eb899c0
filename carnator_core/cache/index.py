"""Per-namespace vector index over retrieval embeddings (FAISS), and its safe on-disk form.

Contract
--------
* Vectors are L2-normalised float32 of one dimension per namespace; ids are the store's int64 ``seq`` numbers
  (never reused). ``search`` returns ``(id, cosine similarity)`` pairs, best first, and the similarities are
  always *exact* (inner products of the stored full-dimension vectors), whichever index kind produced the
  candidates.
* Two kinds, chosen by size (``IndexParams``):

  - ``flat``: ``IndexFlatIP`` on the full vectors: exact search. Its cost grows linearly with the entries
    (memory bound: every vector is read per query); ``flat_max`` = 4096 keeps it within the retrieval
    budget at dim 4096 (measured numbers: BENCHMARKS.md, "Cache store").
  - ``pca-ivf``: a PCA projection to ``reduced_dim`` dimensions (fitted on a sample of the entries, randomized
    SVD in numpy) followed by ``IndexIVFFlat`` (L2 in the reduced space: for unit vectors
    ``|x - q|^2 = 2 - 2 cos``, and PCA centring preserves L2 but not inner products). The IVF returns
    ``max(rerank_factor * k, rerank_min)`` candidates, which are re-ranked with their exact full vectors fetched
    through a callback (the store reads them from SQLite). IVF was chosen over HNSW because a cache evicts:
    IVF supports ``remove_ids``, HNSW does not, and IVF builds in seconds where HNSW needs minutes at 1M on
    two cores.
* Approximate search needs embeddings with low-rank structure (pooled text embeddings have it; i.i.d. random
  vectors do not). If the PCA explains less than ``min_explained`` of the variance, the index stays exact (flat)
  with a warning rather than return near-random candidates.
* ``needs_rebuild`` says when the kind no longer fits the size (flat grown past ``flat_max``; IVF grown past
  ``retrain_growth`` x the size it was trained at, or shrunk below ``flat_max // 2``).
* On disk an index is one safetensors file (the FAISS bytes as a uint8 tensor, PCA arrays, JSON metadata)
  whose metadata carries an HMAC-SHA256 under a key that lives *outside* the cache directory. FAISS's reader
  is a C++ parser that is not hardened against hostile input, and a cache directory may come from someone
  else: an index file whose HMAC does not verify under this machine's key is never handed to FAISS; the caller
  rebuilds it from the entries instead.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
from dataclasses import dataclass
from typing import Callable

import faiss
import numpy as np
import torch
from safetensors.torch import load as st_load, save as st_save

log = logging.getLogger("carnator")

INDEX_FORMAT = "carnator-index"
INDEX_VERSION = 1

# fetch(ids) -> (ids_found int64 [m], vectors float32 [m, d]); ids absent from the store are simply left out.
FetchFn = Callable[[np.ndarray], "tuple[np.ndarray, np.ndarray]"]


class IndexFileError(ValueError):
    """An index file is unreadable, corrupt, or not signed by this machine: rebuild it from the entries."""


@dataclass(frozen=True)
class IndexParams:
    """How the per-namespace index is built and searched.

    flat_max:        exact ``IndexFlatIP`` up to this many entries; PCA+IVF above.
    reduced_dim:     PCA dimensions of the approximate index (capped by the data's dimension and sample size).
    nprobe:          minimum IVF lists visited per query.
    scan:            reduced-space vectors to scan per query: nprobe is raised to ``ceil(scan / mean list size)``
                     so the approximate stage costs about the same at every size (small indexes, whose lists are
                     short and whose neighbours straddle lists, get a larger fraction scanned).
    rerank_factor, rerank_min: the IVF fetches ``max(rerank_factor * k, rerank_min)`` candidates for exact
                     re-ranking.
    train_sample:    at most this many vectors fit the PCA (randomized SVD); the IVF's k-means gets 50 per list.
    retrain_growth:  rebuild an IVF index once it holds this many times the entries it was trained on
                     (its list count was sized for the smaller set).
    persist_every:   the store re-writes an IVF index file after this many changes (0 = adaptive:
                     ``max(64, ntotal // 16)``); flat indexes are never persisted (rebuilding is as cheap).
    min_explained:   if the PCA keeps less than this fraction of the embeddings' variance, the approximate index
                     would return near-random candidates: exact flat search is used instead (with a warning).
    seed:            RNG seed of sampling / PCA, so a rebuild is reproducible.
    """

    flat_max: int = 4096
    reduced_dim: int = 256
    nprobe: int = 16
    scan: int = 8192
    rerank_factor: int = 4
    rerank_min: int = 32
    train_sample: int = 20000
    retrain_growth: float = 4.0
    persist_every: int = 0
    min_explained: float = 0.8
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.flat_max < 1 or self.reduced_dim < 1 or self.nprobe < 1 or self.rerank_factor < 1:
            raise ValueError("IndexParams: flat_max, reduced_dim, nprobe and rerank_factor must be >= 1")
        if self.train_sample < 16 or self.retrain_growth <= 1.0:
            raise ValueError("IndexParams: train_sample must be >= 16 and retrain_growth > 1")


def normalize_rows(x: np.ndarray) -> np.ndarray:
    """float32 copy of ``x`` ([n, d] or [d]) with unit rows; rejects non-finite or zero vectors."""
    a = np.array(x, dtype=np.float32, copy=True)
    two_d = a.ndim == 2
    a = a.reshape(1, -1) if not two_d else a
    if a.ndim != 2 or a.shape[1] == 0:
        raise ValueError(f"embedding must be a 1-D vector or an [n, d] matrix, got shape {np.shape(x)}")
    if not np.isfinite(a).all():
        raise ValueError("embedding contains NaN or inf: the conditioning it was pooled from is broken")
    n = np.linalg.norm(a, axis=1, keepdims=True)
    if (n <= 1e-12).any():
        raise ValueError("embedding is the zero vector: it cannot be compared by cosine similarity")
    a /= n
    return a if two_d else a[0]


def _pca(sample: np.ndarray, r: int, seed: int) -> tuple[np.ndarray, np.ndarray, float]:
    """Mean [d], top-r principal directions [r, d] of ``sample`` and the fraction of its variance they explain,
    by randomized SVD (Halko et al., two power iterations). A dense eigendecomposition of a 4096x4096 covariance
    takes ~1-2 min on two cores; this takes
    seconds and the trailing directions it may miss carry the least variance, which the exact re-rank fixes."""
    rng = np.random.default_rng(seed)
    mean = sample.mean(axis=0, dtype=np.float64).astype(np.float32)
    a = sample - mean
    p = min(r + 16, a.shape[0], a.shape[1])
    y = a @ rng.standard_normal((a.shape[1], p)).astype(np.float32)
    for _ in range(2):
        y, _ = np.linalg.qr(y)
        z, _ = np.linalg.qr(a.T @ y)
        y = a @ z
    q, _ = np.linalg.qr(y)
    _, sv, vt = np.linalg.svd(q.T @ a, full_matrices=False)
    total = float(np.einsum("ij,ij->", a, a, dtype=np.float64))
    explained = float((sv[:r].astype(np.float64) ** 2).sum() / total) if total > 0 else 1.0
    return mean, np.ascontiguousarray(vt[:r], dtype=np.float32), explained


def _ivf_ids(ivf: faiss.IndexIVF) -> np.ndarray:
    inv = ivf.invlists
    out = []
    for lst in range(ivf.nlist):
        n = inv.list_size(lst)
        if n:
            out.append(faiss.rev_swig_ptr(inv.get_ids(lst), n).copy())
    return np.concatenate(out).astype(np.int64) if out else np.zeros(0, dtype=np.int64)


def query_vector(embedding: np.ndarray) -> np.ndarray:
    """The unit query vector [D] of one embedding (both stores' ``query``); ValueError for anything else."""
    q = normalize_rows(embedding)
    if q.ndim != 1:
        raise ValueError(f"query embedding must be one vector [D], got shape {np.shape(embedding)}")
    return q


class VectorIndex:
    """One namespace's index. Not thread-safe: the store serialises access."""

    def __init__(self, kind: str, dim: int, index: faiss.Index, *, mean: np.ndarray | None = None,
                 components: np.ndarray | None = None, trained_n: int = 0, nprobe: int = 16) -> None:
        self.kind = kind
        self.dim = int(dim)
        self.index = index
        self.mean = mean
        self.components = components
        self.trained_n = int(trained_n)  # flat: > 0 when flat was chosen above flat_max (unstructured data)
        self.explained: float | None = None  # PCA variance explained (pca-ivf, or the check that chose flat)
        if kind == "pca-ivf":
            faiss.extract_index_ivf(index).nprobe = int(nprobe)

    # ------------------------------------------------------------------ build
    @classmethod
    def build(cls, ids: np.ndarray, vectors: np.ndarray, dim: int, params: IndexParams) -> "VectorIndex":
        """Index ``vectors`` (unit rows, [n, dim]; any array supporting slicing, e.g. a float16 memmap: it is
        converted to float32 chunk by chunk) under ``ids``; the kind follows ``params`` and n."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        n = len(ids)
        if n <= params.flat_max:
            idx = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
            if n:
                idx.add_with_ids(np.ascontiguousarray(vectors, dtype=np.float32).reshape(n, dim), ids)
            return cls("flat", dim, idx)
        rng = np.random.default_rng(params.seed)
        sample_ix = np.sort(rng.choice(n, size=min(n, params.train_sample), replace=False))
        sample = np.ascontiguousarray(vectors[sample_ix], dtype=np.float32)
        r = max(1, min(params.reduced_dim, dim, len(sample) - 1))
        mean, comps, explained = _pca(sample, r, params.seed)
        if explained < params.min_explained:
            # Unstructured embeddings: PCA candidates would be near-random (measured: recall@10 0.3% at 100k
            # isotropic vectors). Exact search is slow at this size but never wrong; retry once the set has grown.
            log.warning("carnator cache: %d PCA dimensions explain only %.0f%% of the embeddings' variance (< %.0f%%); "
                        "using exact flat search for %d entries (slower, but approximate search would miss neighbours)",
                        r, 100 * explained, 100 * params.min_explained, n)
            idx = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
            for s in range(0, n, 32768):
                idx.add_with_ids(np.ascontiguousarray(vectors[s : s + 32768], dtype=np.float32), ids[s : s + 32768])
            out = cls("flat", dim, idx, trained_n=n)
            out.explained = explained
            return out
        # about 2*sqrt(n) lists; k-means gets 50 points per list (FAISS warns below 39)
        nlist = int(max(1, min(round(2 * math.sqrt(n)), n // 39)))
        train_ix = np.sort(rng.choice(n, size=min(n, 50 * nlist), replace=False))
        train = np.concatenate([
            cls._project(np.ascontiguousarray(vectors[train_ix[s : s + 32768]], dtype=np.float32), mean, comps)
            for s in range(0, len(train_ix), 32768)
        ])
        ivf = faiss.IndexIVFFlat(faiss.IndexFlatL2(r), r, nlist, faiss.METRIC_L2)
        ivf.cp.seed = params.seed
        if nlist == 1:  # one list: its centroid is the mean (k-means would only warn about too few points)
            ivf.quantizer.add(train.mean(axis=0, keepdims=True))
            ivf.is_trained = True
        else:
            ivf.train(train)
        del train
        out = cls("pca-ivf", dim, ivf, mean=mean, components=comps, trained_n=n, nprobe=params.nprobe)
        out.explained = explained
        step = 32768  # chunked: projecting 1M x 4096 at once would need tens of GB
        for s in range(0, n, step):
            chunk = np.ascontiguousarray(vectors[s : s + step], dtype=np.float32)
            out.index.add_with_ids(cls._project(chunk, mean, comps), ids[s : s + step])
        return out

    @staticmethod
    def _project(x: np.ndarray, mean: np.ndarray, comps: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray((x - mean) @ comps.T, dtype=np.float32)

    def _prep(self, vectors: np.ndarray) -> np.ndarray:
        v = np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1, self.dim)
        if self.kind == "pca-ivf":
            return self._project(v, self.mean, self.components)  # type: ignore[arg-type]
        return v

    # ------------------------------------------------------------------ updates
    @property
    def ntotal(self) -> int:
        return int(self.index.ntotal)

    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        if len(ids):
            self.index.add_with_ids(self._prep(vectors), np.ascontiguousarray(ids, dtype=np.int64))

    def remove(self, ids: np.ndarray) -> int:
        if not len(ids):
            return 0
        return int(self.index.remove_ids(faiss.IDSelectorBatch(np.ascontiguousarray(ids, dtype=np.int64))))

    def ids(self) -> np.ndarray:
        """All ids in the index (unordered)."""
        if self.kind == "flat":
            return faiss.vector_to_array(self.index.id_map).astype(np.int64)
        return _ivf_ids(self.index)

    def needs_rebuild(self, params: IndexParams) -> bool:
        n = self.ntotal
        if self.kind == "flat":
            if self.trained_n:  # flat by choice (embeddings not low-rank): retry PCA after enough growth
                return n > params.retrain_growth * self.trained_n
            return n > params.flat_max
        return n > params.retrain_growth * max(self.trained_n, 1) or n <= params.flat_max // 2

    # ------------------------------------------------------------------ search
    def effective_nprobe(self, params: IndexParams) -> int:
        """IVF lists visited per query under ``params`` (see ``IndexParams.scan``)."""
        nlist = faiss.extract_index_ivf(self.index).nlist
        per_list = max(1.0, self.ntotal / max(nlist, 1))
        return int(min(nlist, max(params.nprobe, math.ceil(params.scan / per_list))))

    def search_query(self, query: np.ndarray, k: int, params: IndexParams, fetch: FetchFn | None,
                     namespace: str) -> list[tuple[int, float]]:
        """:meth:`search` for a :func:`query_vector` of ``namespace``'s index, after checking its dimension (a
        ValueError naming the namespace: another text encoder made the query)."""
        if query.shape[0] != self.dim:
            raise ValueError(f"query embedding has dimension {query.shape[0]} but namespace {namespace} holds "
                             f"dimension {self.dim}: a different text encoder produced it")
        return self.search(query, int(k), params, fetch=fetch)

    def search(self, query: np.ndarray, k: int, params: IndexParams, fetch: FetchFn | None = None
               ) -> list[tuple[int, float]]:
        """Top-k ``(id, exact cosine)`` for a unit ``query`` [dim]; ``fetch`` is required for ``pca-ivf``."""
        if k < 1 or self.ntotal == 0:
            return []
        q = np.ascontiguousarray(query, dtype=np.float32).reshape(1, self.dim)
        if self.kind == "flat":
            sims, ids = self.index.search(q, min(k, self.ntotal))
            return [(int(i), float(s)) for i, s in zip(ids[0], sims[0]) if i >= 0]
        if fetch is None:
            raise ValueError("a pca-ivf index needs a fetch callback to re-rank with the full vectors")
        kk = min(self.ntotal, max(params.rerank_factor * k, params.rerank_min))
        ivf = faiss.extract_index_ivf(self.index)
        ivf.nprobe = self.effective_nprobe(params)
        # One query: plain einsum loops, not BLAS. A multi-threaded BLAS call this small costs ~0.1 ms alone but
        # tens of ms when the cores are busy (measured on the loaded 2-core dev box: 44 ms vs 0.25 ms median).
        qr = np.einsum("d,rd->r", q[0] - self.mean, self.components).astype(np.float32)[None, :]
        _, cand = self.index.search(qr, kk)
        cand = cand[0][cand[0] >= 0]
        found, vecs = fetch(cand)
        if len(found) == 0:
            return []
        sims = np.einsum("nd,d->n", np.asarray(vecs, dtype=np.float32).reshape(len(found), self.dim), q[0])
        order = np.argsort(-sims, kind="stable")[:k]
        return [(int(found[i]), float(sims[i])) for i in order]

    # ------------------------------------------------------------------ persistence
    def to_bytes(self, key: bytes, meta: dict) -> bytes:
        """Serialise with ``meta`` (JSON-able: generation, token, namespace...) and an HMAC under ``key``."""
        tensors = {"faiss": torch.from_numpy(faiss.serialize_index(self.index).copy())}
        if self.kind == "pca-ivf":
            tensors["pca_mean"] = torch.from_numpy(np.ascontiguousarray(self.mean))
            tensors["pca_components"] = torch.from_numpy(np.ascontiguousarray(self.components))
        body = dict(meta, format=INDEX_FORMAT, version=INDEX_VERSION, kind=self.kind, dim=self.dim,
                    trained_n=self.trained_n, ntotal=self.ntotal, explained=self.explained)
        body_json = json.dumps(body, sort_keys=True)
        mac = _mac(key, body_json, tensors)
        return st_save(tensors, metadata={"carnator_index": body_json, "hmac": mac})

    @classmethod
    def from_bytes(cls, data: bytes, key: bytes, params: IndexParams) -> tuple["VectorIndex", dict]:
        """Inverse of ``to_bytes``. Raises IndexFileError if the file is corrupt or not signed under ``key``:
        FAISS only ever parses bytes this machine wrote."""
        try:
            tensors = st_load(data)
            header = _read_header(data)
            body_json = header["carnator_index"]
            mac = header["hmac"]
            body = json.loads(body_json)
        except Exception as e:  # noqa: BLE001 - any parse failure means "rebuild"
            raise IndexFileError(f"unreadable index file ({type(e).__name__}: {e})") from None
        if not hmac.compare_digest(mac, _mac(key, body_json, tensors)):
            raise IndexFileError("index file is not signed by this machine's key (copied from elsewhere, or corrupt)")
        if body.get("format") != INDEX_FORMAT or body.get("version") != INDEX_VERSION:
            raise IndexFileError(f"index file format {body.get('format')!r} v{body.get('version')!r} is not supported")
        try:
            index = faiss.deserialize_index(tensors["faiss"].numpy())
        except Exception as e:  # noqa: BLE001
            raise IndexFileError(f"FAISS could not read the index ({e})") from None
        kind = body["kind"]
        out = cls(kind, int(body["dim"]), index, trained_n=int(body.get("trained_n", 0)), nprobe=params.nprobe,
                  mean=tensors["pca_mean"].numpy() if kind == "pca-ivf" else None,
                  components=tensors["pca_components"].numpy() if kind == "pca-ivf" else None)
        out.explained = body.get("explained")
        if out.ntotal != int(body["ntotal"]):
            raise IndexFileError("index file holds a different number of vectors than its header says")
        return out, body


def _mac(key: bytes, body_json: str, tensors: dict[str, torch.Tensor]) -> str:
    h = hmac.new(key, digestmod=hashlib.sha256)
    h.update(body_json.encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"\0{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _read_header(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` dict of a safetensors buffer (safetensors' Python API only exposes it via safe_open)."""
    n = int.from_bytes(data[:8], "little")
    if n <= 0 or 8 + n > len(data):
        raise ValueError("safetensors header length is out of range")
    return dict(json.loads(data[8 : 8 + n]).get("__metadata__") or {})
