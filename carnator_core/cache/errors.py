"""The cache's errors. Every failure the store reports is a ``CacheError`` whose message says what is wrong and
what to do; raw ``sqlite3`` / ``OSError`` exceptions are translated at the store's boundary (``store.py``)."""
from __future__ import annotations


class CacheError(RuntimeError):
    """Base class of cache errors (messages say what is wrong and what to do)."""


class EntryNotFoundError(CacheError, KeyError):
    """The entry is not in the catalogue (never written, evicted, purged or quarantined meanwhile)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class CorruptEntryError(CacheError):
    """The entry's file was corrupt or truncated; it has been quarantined. Other entries are unaffected."""


class EntryFormatError(CacheError, ValueError):
    """Bytes that are not a valid Carnator entry (``entry.decode_entry``): truncated, tampered or foreign."""


class CacheBudgetError(CacheError):
    """An entry larger than the whole byte budget."""


class NamespaceMismatchError(CacheError):
    """A namespace key collision: same key, different model fingerprint / config / embedding dimension."""


class NotACacheDirectoryError(CacheError):
    """A directory that is neither empty nor marked as a Carnator cache: the store never adopts it."""


class CacheFullError(CacheError):
    """The disk (or quota) holding the cache is full: nothing was written; reads keep working."""


class CacheReadOnlyError(CacheError):
    """The cache is read-only (a read-only mount or volume, a Redis replica): nothing was written; recalls, exact
    repeats and loads keep working."""


class CatalogError(CacheError):
    """The catalogue could not be read or written (locked past the timeout, permissions, damage)."""


class CatalogRebuiltError(CatalogError):
    """The catalogue turned out damaged during the call and has been rebuilt from the entry files: retry."""


class CacheUnavailableError(CacheError):
    """The shared cache (Redis) cannot be reached (down, restarting, network): the request continues without it.

    A ``CacheError`` like every other cache failure, so code that falls back when the cache cannot serve an entry
    (``except CacheError``) covers an unreachable Redis too."""


__all__ = [
    "CacheBudgetError", "CacheError", "CacheFullError", "CacheReadOnlyError", "CacheUnavailableError", "CatalogError",
    "CatalogRebuiltError",
    "CorruptEntryError",
    "EntryFormatError", "EntryNotFoundError", "NamespaceMismatchError", "NotACacheDirectoryError",
]
