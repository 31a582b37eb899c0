"""A per-process, byte-bounded LRU of decoded Early Signatures (both stores' ``load_signature`` and recall).

Signatures are small and read on every recall, so each store keeps the decoded ones; the bound keeps a long-running
server's memory flat. Thread-safe: ComfyUI's routes and the prompt worker share a store.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

from ..types import Signature


class SignatureLRU:
    """``get`` / ``put`` / ``discard`` / ``clear`` of entry id -> Signature, at most ``budget_bytes`` in all."""

    def __init__(self, budget_bytes: int = 256 << 20) -> None:
        self.budget_bytes = int(budget_bytes)
        self._items: OrderedDict[str, tuple[Signature, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, entry_id: str) -> Signature | None:
        """The cached signature (now most recently used), or None."""
        with self._lock:
            hit = self._items.get(entry_id)
            if hit is None:
                return None
            self._items.move_to_end(entry_id)
            return hit[0]

    def put(self, entry_id: str, sig: Signature, nbytes: int) -> None:
        """Remember ``sig`` (``nbytes`` of arrays); the least recently used ones go when over the budget."""
        with self._lock:
            old = self._items.pop(entry_id, None)
            if old is not None:
                self._bytes -= old[1]
            self._items[entry_id] = (sig, int(nbytes))
            self._bytes += int(nbytes)
            while self._bytes > self.budget_bytes and self._items:
                _, (_, s) = self._items.popitem(last=False)
                self._bytes -= s

    def discard(self, entry_id: str) -> None:
        with self._lock:
            hit = self._items.pop(entry_id, None)
            if hit is not None:
                self._bytes -= hit[1]

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0
