"""The CARNATOR_CACHE value: a small frozen handle; the Store behind it is opened lazily, once per process.

Contract: a ``CacheHandle`` holds only the resolved directory and settings (cheap to copy, safe to cache in
ComfyUI's node outputs). ``handle.store()`` returns the process-wide ``Store`` for that directory, opening it on
first use; later handles for the same directory with other settings update the budget/policy of that Store.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from .policy import check_policy
from .store import Store

_STORES: dict[str, Store] = {}
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
        if not Path(self.path).is_absolute():
            raise ValueError(f"CacheHandle.path must be absolute (resolved by resolve_cache_dir), got {self.path!r}")

    def store(self) -> Store:
        return open_store(self)


def open_store(handle: CacheHandle) -> Store:
    """The process-wide Store of ``handle.path`` (opened on first use), with the handle's budget and policy."""
    with _LOCK:
        st = _STORES.get(handle.path)
        if st is None or st._conn is None:  # noqa: SLF001 - closed stores are reopened
            st = Store.open(handle.path, max_bytes=handle.max_bytes, policy=handle.policy, key_path=handle.key_path)
            _STORES[handle.path] = st
        else:
            st.max_bytes = int(handle.max_bytes) if handle.max_bytes else None
            st.policy = handle.policy
        return st
