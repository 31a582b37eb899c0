"""Carnator's on-disk cache: store (SQLite + safetensors), FAISS retrieval, eviction, path confinement.

Public API (see each module's docstring for contracts)::

    Store.open(path, *, max_bytes=None, policy="lcbfu", index_params=None) -> Store
    store.put(EntryData) -> entry_id            store.load(entry_id, count_hit=True) -> Entry
    store.query(ns, embedding, k) -> [(id, sim)] store.candidates(ns, embedding, k) -> types.Candidates
    store.record_hit(id) / record_lookup(ns)    store.stats(ns=None) / purge(ns=None) / verify() / scan()
    encode_entry(EntryData, entry_id=, created=) -> EncodedEntry (bytes)   decode_entry(bytes) -> DecodedEntry
    embed_conditioning(cond_tensor, attention_mask=None) -> np.ndarray
    resolve_cache_dir(user_path, allowed_roots) -> Path
    CacheHandle(path, max_bytes, policy).store() -> Store (one per process and directory)
    CacheHandle("redis://host:port/db", ...).store() -> RedisStore (shared by many workers; redis_store.py)

Both stores are ``orchestra.StoreOrchestra`` (the catalogue logic, written once) over a storage backend
(``orchestra.Storage``: the local folder + SQLite in ``store.py``, Redis in ``redis_store.py``).
"""
from ..paths import ENV_ROOTS, CachePathError, resolve_cache_dir, roots_from_env
from .embed import embed_comfy_conditioning, embed_conditioning
from .entry import DecodedEntry, EncodedEntry, Entry, EntryData, decode_entry, encode_entry
from .errors import (
    CacheBudgetError,
    CacheError,
    CacheFullError,
    CacheReadOnlyError,
    CacheUnavailableError,
    CatalogError,
    CatalogRebuiltError,
    CorruptEntryError,
    EntryFormatError,
    EntryNotFoundError,
    NamespaceMismatchError,
    NotACacheDirectoryError,
)
from .handle import CacheHandle, open_store
from .index import IndexParams, VectorIndex
from .policy import POLICIES
from .redis_url import (
    ENV_URL as ENV_REDIS_URL,
    RedisConfigError,
    is_redis_url,
    resolve_redis_url,
)
from .store import (
    CacheStats,
    NamespaceStats,
    Store,
    VerifyReport,
    adoption_problem,
)

__all__ = [
    "CacheBudgetError", "CacheError", "CacheFullError", "CacheHandle", "CachePathError",
    "CacheStats", "CatalogError", "CatalogRebuiltError", "CorruptEntryError", "DecodedEntry", "ENV_ROOTS",
    "EncodedEntry", "Entry", "EntryData", "EntryFormatError", "EntryNotFoundError", "IndexParams",
    "NamespaceMismatchError", "NamespaceStats", "NotACacheDirectoryError", "POLICIES", "Store", "VectorIndex",
    "VerifyReport", "adoption_problem", "decode_entry", "embed_comfy_conditioning", "embed_conditioning",
    "encode_entry", "open_store", "resolve_cache_dir", "roots_from_env",
    "CacheReadOnlyError", "CacheUnavailableError", "ENV_REDIS_URL", "RedisConfigError", "is_redis_url",
    "resolve_redis_url",
]
