"""Carnator's on-disk cache: store (SQLite + safetensors), FAISS retrieval, eviction, path confinement.

Public API (see each module's docstring for contracts)::

    Store.open(path, *, max_bytes=None, policy="lcbfu", index_params=None) -> Store
    store.put(EntryData) -> entry_id            store.load(entry_id, count_hit=True) -> Entry
    store.query(ns, embedding, k) -> [(id, sim)] store.candidates(ns, embedding, k) -> types.Candidates
    store.record_hit(id) / record_lookup(ns)    store.stats(ns=None) / purge(ns=None) / verify() / scan()
    embed_conditioning(cond_tensor, attention_mask=None) -> np.ndarray
    resolve_cache_dir(user_path, allowed_roots) -> Path
    CacheHandle(path, max_bytes, policy).store() -> Store (one per process and directory)
    CacheHandle("redis://host:port/db", ...).store() -> RedisStore (shared by many workers; redis_store.py)
"""
from .embed import embed_comfy_conditioning, embed_conditioning
from .handle import CacheHandle, open_store
from .index import IndexParams, VectorIndex
from .paths import ENV_ROOTS, CachePathError, resolve_cache_dir, roots_from_env
from .policy import POLICIES
from .redis_url import ENV_URL as ENV_REDIS_URL
from .redis_url import CacheUnavailableError, RedisConfigError, is_redis_url, resolve_redis_url
from .store import (
    CacheBudgetError,
    CacheError,
    CacheStats,
    CorruptEntryError,
    Entry,
    EntryData,
    EntryNotFoundError,
    NamespaceMismatchError,
    NamespaceStats,
    Store,
    VerifyReport,
)

__all__ = [
    "CacheUnavailableError", "ENV_REDIS_URL", "RedisConfigError", "is_redis_url", "resolve_redis_url",
    "CacheBudgetError", "CacheError", "CacheHandle", "CachePathError", "CacheStats", "CorruptEntryError", "ENV_ROOTS",
    "Entry", "EntryData", "EntryNotFoundError", "IndexParams", "NamespaceMismatchError", "NamespaceStats", "POLICIES",
    "Store", "VectorIndex", "VerifyReport", "embed_comfy_conditioning", "embed_conditioning", "open_store",
    "resolve_cache_dir", "roots_from_env",
]
