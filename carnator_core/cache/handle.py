"""The CARNATOR_CACHE value: a small frozen handle; the Store behind it is opened lazily, once per process.

Contract: a ``CacheHandle`` holds only the resolved directory and settings (cheap to copy, safe to cache in
ComfyUI's node outputs). ``handle.store()`` returns the process-wide ``Store`` for that directory, opening it on
first use; later handles for the same directory with other settings update the budget/policy of that Store.
A handle whose ``path`` is a public ``redis://`` / ``rediss://`` URL (``redis_url.resolve_redis_url``; never
credentials) opens the shared ``RedisStore`` instead, with the same surface.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .policy import check_policy
from .redis_url import is_redis_url, public_url
from .store import Store

_STORES: dict[str, Any] = {}
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

    def store(self) -> Any:
        return open_store(self)


def open_store(handle: CacheHandle) -> Any:
    """The process-wide Store (or RedisStore) of ``handle.path`` (opened on first use), with the handle's budget
    and policy."""
    if is_redis_url(handle.path):
        return _open_redis(handle)
    with _LOCK:
        st = _STORES.get(handle.path)
        if st is None or st._conn is None:  # noqa: SLF001 - closed stores are reopened
            st = Store.open(handle.path, max_bytes=handle.max_bytes, policy=handle.policy, key_path=handle.key_path)
            _STORES[handle.path] = st
        else:
            st.max_bytes = int(handle.max_bytes) if handle.max_bytes else None
            st.policy = handle.policy
        return st


def _open_redis(handle: CacheHandle) -> Any:
    from .redis_store import RedisStore  # local: the redis client is only needed by servers that use it

    with _LOCK:
        st = _STORES.get(handle.path)
        if st is None or st._closed:  # noqa: SLF001 - closed stores are reopened
            st = RedisStore.open(handle.path, max_bytes=handle.max_bytes, policy=handle.policy)
            _STORES[handle.path] = st
            # Build the recall indexes of a running farm's cache in the background: the first request finds them
            # ready (or waits for the same build it would have done itself).
            threading.Thread(target=st.warm, name="carnator-redis-warm", daemon=True).start()
        else:
            st.max_bytes = int(handle.max_bytes) if handle.max_bytes else None
            st.policy = handle.policy
        return st
