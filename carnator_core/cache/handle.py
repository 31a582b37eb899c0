"""The CARNATOR_CACHE value: a small frozen handle; the Store behind it is opened lazily, once per process and
settings.

Contract: a ``CacheHandle`` holds only the resolved directory and settings (cheap to copy, safe to cache in
ComfyUI's node outputs). ``handle.store()`` returns the process-wide ``Store`` for exactly that directory *and*
settings (budget, policy, key), opening it on first use. Two handles on one directory with different settings get
two Store instances (the store's multi-process rules keep them in step, as for two processes), so a second
handle never changes the budget or policy the first one's users rely on. Instances kept per directory are bounded
(``MAX_PER_DIRECTORY``): the least recently opened one is closed when a new setting arrives.
A handle whose ``path`` is a public ``redis://`` / ``rediss://`` URL (``redis_url.resolve_redis_url``; never
credentials) opens the shared ``RedisStore`` instead, with the same surface and the same per-settings rule.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .policy import check_policy
from .redis_url import is_redis_url, public_url
from .store import Store

MAX_PER_DIRECTORY = 4  # a user trying budgets in the UI should not accumulate open catalogues and indexes
_STORES: OrderedDict[tuple, Store] = OrderedDict()
_REDIS: dict[tuple, Any] = {}
_LOCK = threading.Lock()


@dataclass(frozen=True)
class CacheHandle:
    """path: absolute, already confined directory. max_bytes: None = unlimited. key_path: index-signing key
    (None = the default outside the cache directory)."""

    path: str
    max_bytes: int | None = None
    policy: str = "lcbfu"
    key_path: str | None = None

    def __post_init__(self) -> None:
        check_policy(self.policy)
        if is_redis_url(self.path):
            if public_url(self.path) != self.path:
                raise ValueError(f"CacheHandle.path must be a public Redis URL (resolve_redis_url), got {self.path!r}")
            return
        if not Path(self.path).is_absolute():
            raise ValueError(f"CacheHandle.path must be absolute (resolved by resolve_cache_dir), got {self.path!r}")
        if self.max_bytes is not None and int(self.max_bytes) < 0:
            raise ValueError(f"CacheHandle.max_bytes must be >= 0 or None, got {self.max_bytes}")

    def store(self) -> Any:
        return open_store(self)


def open_store(handle: CacheHandle) -> Any:
    """The process-wide Store (or RedisStore) of ``handle``'s directory (or URL) and settings (opened on first
    use)."""
    key = (handle.path, int(handle.max_bytes) if handle.max_bytes else None, handle.policy, handle.key_path)
    if is_redis_url(handle.path):
        return _open_redis(handle, key)
    with _LOCK:
        st = _STORES.get(key)
        if st is not None and st._conn is not None and st._writable_again():  # noqa: SLF001
            st.close()  # opened read-only (full disk, read-only mount); writable again: reopen writable
        if st is not None and st._conn is not None:  # noqa: SLF001 - closed stores are reopened
            _STORES.move_to_end(key)
            return st
        st = Store.open(handle.path, max_bytes=key[1], policy=handle.policy, key_path=handle.key_path)
        _STORES[key] = st
        same_dir = [k for k in _STORES if k[0] == handle.path]
        for old in same_dir[: max(0, len(same_dir) - MAX_PER_DIRECTORY)]:
            _STORES.pop(old).close()
        return st


def _open_redis(handle: CacheHandle, key: tuple) -> Any:
    from .redis_store import RedisStore  # local: the redis client is only needed by servers that use it

    with _LOCK:
        st = _REDIS.get(key)
        if st is None or st._closed:  # noqa: SLF001 - closed stores are reopened
            st = RedisStore.open(handle.path, max_bytes=key[1], policy=handle.policy)
            _REDIS[key] = st
            # Build the recall indexes of a running farm's cache in the background: the first request finds them
            # ready (or waits for the same build it would have done itself).
            threading.Thread(target=st.warm, name="carnator-redis-warm", daemon=True).start()
        return st
