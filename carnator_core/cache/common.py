"""What the on-disk ``Store`` and the shared ``RedisStore`` do alike, written once: the checks of a put before
anything is stored, the verification of an entry read back, and the assembly of recall candidates. Each store
supplies only its storage (rows, bytes, signatures, its index); this module never touches a file or Redis.

Contracts
---------
* ``encode_checked``: a put's ``EntryData`` encoded as entry ``entry_id``; ``CacheBudgetError`` for an entry larger
  than the whole budget (nothing is stored).
* ``verify_entry``: entry bytes decoded and checked against their own header and checksums and the recorded
  metadata digest; ``EntryFormatError`` (the caller quarantines) names a size disagreement only when the bytes do
  not verify, because a row whose recorded size disagrees with bytes that verify is the row's fault (the caller
  corrects it). ``NamespaceMismatchError`` when the entry was made by another model than ``model_fingerprint``.
* ``check_namespace_model``: NamespaceMismatchError when a namespace is pinned to another model (``query``).
* ``entry_of``: the public ``Entry`` of a verified entry.
* ``recall``: top-k ``Candidates`` from a store's ``query`` (model checked), its rows (prompt, seed) and its
  signatures, with the same notes on both stores (no embedding, another model, corrupt or vanished entries, nothing
  recalled, nothing above ``min_similarity``).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Mapping

import numpy as np

from ..types import Candidate, Candidates, Signature
from .entry import DecodedEntry, EncodedEntry, Entry, EntryData, decode_entry, encode_entry
from .errors import (
    CacheBudgetError,
    CacheError,
    CacheUnavailableError,
    CorruptEntryError,
    EntryFormatError,
    EntryNotFoundError,
    NamespaceMismatchError,
)


def format_bytes(n: float) -> str:
    """``n`` bytes for a message: "512 B", "1.50 MiB", "2.00 GiB" (binary units, GiB at most)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def encode_checked(data: EntryData, *, entry_id: str, created: float, max_bytes: int | None) -> EncodedEntry:
    """``entry.encode_entry`` of a put, refused (CacheBudgetError) when larger than the whole budget."""
    enc = encode_entry(data, entry_id=entry_id, created=created)
    if max_bytes and len(enc.blob) > max_bytes:
        raise CacheBudgetError(
            f"the entry is {format_bytes(len(enc.blob))} but the cache budget is {format_bytes(max_bytes)}: "
            "raise max_gb on the cache loader (or 0 for no limit)")
    return enc


def verify_entry(blob: bytes, *, entry_id: str, namespace: str, meta_digest: str, recorded_size: int,
                 what: str = "file") -> DecodedEntry:
    """Decode and verify entry bytes (see the module docstring); EntryFormatError for bytes that do not verify."""
    try:
        return decode_entry(blob, entry_id=entry_id, namespace=namespace, meta_digest=meta_digest)
    except EntryFormatError as e:
        if len(blob) != int(recorded_size):
            raise EntryFormatError(f"{what} is {len(blob)} bytes, the catalogue recorded {recorded_size}: {e}") \
                from None
        raise


def check_model(dec: DecodedEntry, entry_id: str, model_fingerprint: str | None, elsewhere: str) -> None:
    """NamespaceMismatchError when ``model_fingerprint`` is given and the entry was made by another model."""
    if model_fingerprint is not None and dec.model_fingerprint != str(model_fingerprint):
        raise NamespaceMismatchError(
            f"cache entry {entry_id} was made by model {dec.model_fingerprint}, not {model_fingerprint}: "
            "the two fingerprints share a namespace key prefix; it is never reused across models. Purge the "
            f"namespace or use another {elsewhere}.")


def check_namespace_model(namespace: str, pinned: str | None, model_fingerprint: str, elsewhere: str) -> None:
    """NamespaceMismatchError when ``namespace`` is pinned to another model than ``model_fingerprint``."""
    if pinned is not None and pinned != str(model_fingerprint):
        raise NamespaceMismatchError(
            f"namespace {namespace} holds entries of model {pinned}, not {model_fingerprint}: the fingerprints share "
            "the namespace key's prefix, and entries are never reused across models. Purge the namespace or use "
            f"another {elsewhere}.")


def entry_of(dec: DecodedEntry, *, entry_id: str, namespace: str, prompt: str, seed: Any, created: Any, hits: int,
             nbytes: int) -> Entry:
    """The public Entry of a verified entry and its catalogue row."""
    return Entry(entry_id=entry_id, namespace=namespace, model_fingerprint=dec.model_fingerprint, config=dec.config,
                 prompt=prompt, seed=int(seed), created=float(created), hits=int(hits), nbytes=int(nbytes),
                 embedding=dec.embedding, signature=dec.signature, tensors=dec.tensors,
                 block_structure=dec.block_structure, meta=dec.meta, answer_of=dec.answer_of)


def recall(namespace: str, embedding: np.ndarray | None, k: int, min_similarity: float,
           model_fingerprint: str | None, *, query: Callable[..., list[tuple[str, float]]],
           rows: Callable[[list[str]], Mapping[str, tuple[str, int]]], signature: Callable[[str], Signature],
           t0: float | None = None) -> Candidates:
    """Top-k candidates with their signatures (the ``candidates`` of both stores, counting aside). ``query`` is
    the store's ``query``; ``rows`` gives (prompt, seed) of the ids still cached; ``signature`` an entry's Early
    Signature (raising EntryNotFoundError / CorruptEntryError / CacheError). CacheUnavailableError propagates."""
    t0 = time.perf_counter() if t0 is None else t0
    notes: list[str] = []

    def done(items: tuple[Candidate, ...] = (), why: str = "") -> Candidates:
        return Candidates(namespace=namespace, items=items, retrieval_ms=(time.perf_counter() - t0) * 1000,
                          note=why or "; ".join(notes))

    if embedding is None:
        return done(why="no retrieval: the request has no retrieval embedding (its prompt could not be embedded)")
    try:
        found = query(namespace, embedding, k, model_fingerprint=model_fingerprint)
    except (NamespaceMismatchError, ValueError) as e:
        return done(why=f"no retrieval: {e}")
    recalled = bool(found)
    found = [(i, s) for i, s in found if s >= min_similarity]
    held = rows([i for i, _ in found]) if found else {}
    items = []
    for entry_id, sim in found:
        if entry_id not in held:
            continue  # evicted since the query
        try:
            sig = signature(entry_id)
        except EntryNotFoundError:
            continue
        except CorruptEntryError:
            notes.append(f"skipped corrupt entry {entry_id} (quarantined)")
            continue
        except CacheUnavailableError:
            raise
        except CacheError as e:  # e.g. a namespace directory that links out of the cache
            notes.append(f"skipped entry {entry_id}: {e}")
            continue
        prompt, seed = held[entry_id]
        items.append(Candidate(entry_id=entry_id, similarity=float(sim), prompt=prompt, signature=sig, seed=int(seed)))
    if not items and not notes:
        notes.append("no cached entry in this namespace (same model + config)" if not recalled
                     else f"no entry with similarity >= {min_similarity}")
    return done(tuple(items))


__all__ = ["check_model", "check_namespace_model", "encode_checked", "entry_of", "format_bytes", "recall",
           "verify_entry"]
