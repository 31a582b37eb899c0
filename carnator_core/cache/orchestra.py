"""The cache's catalogue logic, written once over two storages: ``StoreOrchestra`` holds recall, the put / publish
protocol, loads, hit and lookup counting, eviction, quarantine, answer-only entries and statistics; a storage
backend supplies only how rows, bytes and change logs are kept, through the small ``Storage`` interface below.
``store.Store`` (a local folder: entry files + SQLite catalogue) and ``redis_store.RedisStore`` (one Redis shared by
a farm) are the two backends, and the public cache classes.

The orchestration never touches a file, a database or Redis. What both backends guarantee, and what the
orchestration relies on, is stated on each ``Storage`` method. In short:

* **Errors.** A backend method raises ``CacheError`` subclasses, or raw errors of its storage that its
  ``_boundary`` context translates (the local store turns ``sqlite3`` / ``OSError`` into ``CacheError``\\ s and
  rebuilds a damaged catalogue; Redis translates every call itself, its boundary passes through). Every public
  method runs inside the boundary, so callers only ever see ``CacheError`` (and ``TypeError`` / ``ValueError``
  for arguments that are not what the method takes).
* **Atomicity.** A publish is all or nothing for other readers (a committed transaction, one Lua script); a
  removal unpublishes an entry at once (its bytes may go first, a reader then finds "no longer cached").
* **Best effort.** Counters, size corrections and hint bookkeeping never fail a read: the backend skips them on a
  full or read-only storage (said once in the log).

Semantics shared by both stores (the module docstrings of ``store.py`` and ``redis_store.py`` add each storage's
own guarantees: durability, concurrency, faults):

* **Dedup.** One entry per (namespace, prompt, seed, request key): a put of a cached request returns the cached
  id and writes nothing (``put_with_status`` says which); the check is repeated atomically at publish, so two
  concurrent writers of one request store it once.
* **Budget.** An entry larger than the whole ``max_bytes`` is refused (``CacheBudgetError``); after each publish
  the lowest-value entries of all namespaces are evicted (``policy.py``: ``lcbfu`` by priority, ``lru`` by last
  use), one process at a time, and the shared clock L rises to the highest LCBFU priority evicted. A failed
  eviction never fails the put that triggered it.
* **Corruption.** Bytes that do not verify against their own header and checksums are quarantined (moved aside,
  never deleted; unpublished; one warning) and reported as ``CorruptEntryError``; a recorded size that disagrees
  with bytes that verify is corrected (one warning), never a reason to quarantine.
* **Hits.** ``candidates`` counts a lookup (unless ``count_lookup=False``), ``load(count_hit=True)`` or
  ``record_hit`` a reuse: hit rate = hits / lookups per namespace.
* **Answer-only entries** (``EntryData.answer_of``) are stored, found by ``find_request``, evicted, verified and
  counted like any entry, and never recalled (no embedding in the recall index).
"""
from __future__ import annotations

import functools
import logging
import time
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Protocol

import numpy as np

from ..types import Candidates, Signature
from . import common
from .entry import REQUEST_KEY_RE, EncodedEntry, Entry, EntryData, valid_entry_id
from .errors import CacheError, CacheUnavailableError, CorruptEntryError, EntryFormatError, EntryNotFoundError
from .index import IndexParams, VectorIndex, query_vector
from .sigcache import SignatureLRU

log = logging.getLogger("carnator")


# ---------------------------------------------------------------------------------------------- values
@dataclass(frozen=True)
class NamespaceStats:
    namespace: str
    model_fingerprint: str
    config: Mapping[str, Any]
    entries: int
    bytes: int
    lookups: int
    hits: int
    hit_rate: float
    answers: int = 0  # of ``entries``: answer-only entries (a hit's result, answers exact repeats only)


@dataclass(frozen=True)
class CacheStats:
    path: str
    entries: int
    bytes: int
    max_bytes: int | None
    policy: str
    lookups: int
    hits: int
    hit_rate: float
    quarantined: int
    catalog_bytes: int
    index_bytes: int
    namespaces: tuple[NamespaceStats, ...]
    answers: int = 0  # of ``entries``: answer-only entries (never recalled or reused)

    def to_meta(self) -> dict[str, Any]:
        return {
            "path": self.path, "entries": self.entries, "bytes": self.bytes, "max_bytes": self.max_bytes,
            "policy": self.policy, "lookups": self.lookups, "hits": self.hits, "hit_rate": self.hit_rate,
            "answers": self.answers,
            "quarantined": self.quarantined, "catalog_bytes": self.catalog_bytes, "index_bytes": self.index_bytes,
            "namespaces": [dict(n.__dict__, config=dict(n.config)) for n in self.namespaces],
        }

    def to_text(self) -> str:
        fb = common.format_bytes
        budget = "unlimited" if not self.max_bytes else fb(self.max_bytes)
        lines = [
            f"Carnator cache at {self.path}",
            f"entries: {self.entries}" + (f" ({self.answers} answers of hits)" if self.answers else "")
            + f"  size: {fb(self.bytes)} (budget {budget}, policy {self.policy})",
            f"lookups: {self.lookups}  hits: {self.hits}  hit rate: {self.hit_rate:.1%}",
            f"catalogue: {fb(self.catalog_bytes)}  index files: {fb(self.index_bytes)}  "
            f"quarantined: {self.quarantined}",
        ]
        for n in self.namespaces:
            c = n.config
            lines.append(
                f"- {n.namespace}: {n.entries} entries, {fb(n.bytes)}, hits {n.hits}/{n.lookups} "
                f"({n.hit_rate:.1%}) [{c.get('arch')} {tuple(c.get('latent_shape', ()))} {c.get('steps')} steps "
                f"{c.get('sampler')}/{c.get('scheduler')} cfg {c.get('cfg')}]"
            )
        return "\n".join(lines)


@dataclass(frozen=True)
class VerifyReport:
    """Result of ``verify``: ``ok`` iff ``problems`` is empty; ``notes`` are harmless observations."""

    ok: bool
    entries: int
    namespaces: int
    problems: tuple[str, ...]
    notes: tuple[str, ...] = ()


# ---------------------------------------------------------------------------------------------- backend records
@dataclass(frozen=True)
class StoredEntry:
    """One entry as a backend read it: its catalogue row and its bytes, from one instant (``Storage._read_entry``).
    ``defect``: what the storage itself found wrong (e.g. chunks missing); the entry is then quarantined.
    ``ref``: the backend's own handle of the row (e.g. its sequence number), passed back to ``_correct_size``."""

    namespace: str
    prompt: str
    seed: int
    created: float
    hits: int
    nbytes: int
    meta_digest: str
    blob: bytes
    ref: Any = None
    defect: str = ""


@dataclass(frozen=True)
class StoredSignature:
    """An entry's Early Signature as a backend read it (``Storage._read_signature``): ``signature`` or, when it
    did not parse or verify, ``defect`` (the entry is then quarantined). ``memo_bytes``: its size in the
    per-process memo. ``actual_size``: the entry's byte size when the read saw it (None: not seen), compared with
    the recorded ``nbytes``."""

    namespace: str
    signature: Signature | None
    defect: str = ""
    memo_bytes: int = 0
    nbytes: int = 0
    actual_size: int | None = None
    ref: Any = None


@dataclass(frozen=True)
class Victim:
    """An eviction candidate (``Storage._eviction_plan``): ``priority`` is its LCBFU priority where the backend
    knows it (None: not known, e.g. when ordered by recency); the clock L rises to the highest known one."""

    entry_id: str
    namespace: str
    nbytes: int
    priority: float | None = None
    ref: Any = None


#: What ``Storage._stats_parts`` reports per non-empty namespace: (namespace, model fingerprint, config, entries,
#: bytes, answer-only entries, lookups, hits); the orchestration derives the rates and totals.
NamespaceCounts = tuple[str, str, Mapping[str, Any], int, int, int, int, int]


class SyncedIndex(Protocol):
    """What ``Storage._sync`` returns: this process's recall index of one namespace, up to date."""

    index: VectorIndex


# ---------------------------------------------------------------------------------------------- the interface
class Storage(ABC):
    """The storage a ``StoreOrchestra`` runs on: the small set of primitives each backend implements. Unless
    stated otherwise a method may raise ``CacheError`` (``CacheUnavailableError`` for an unreachable shared
    storage) or a raw error of its storage that ``_boundary`` translates; entry ids and namespaces passed in are
    valid (``_validate_namespace`` / ``valid_entry_id`` were checked)."""

    #: How the storage is named where a message tells the user to use another one ("cache directory").
    _ELSEWHERE = "cache"
    #: Fault-injection stage right after a publish is visible to others (crash tests kill the process there).
    _PUBLISHED_STAGE = "after_publish"

    # ------------------------------------------------------------------ errors
    @abstractmethod
    def _boundary(self, what: str) -> AbstractContextManager[None]:
        """A context in which raw errors of the storage become ``CacheError``\\ s saying what to do (``what``: the
        public method's name). A damaged storage found meanwhile may be repaired here before the error is raised."""

    @abstractmethod
    def _validate_namespace(self, namespace: str) -> None:
        """ValueError for a namespace that is not one (``entry.valid_namespace``); CacheError for one the storage
        refuses to use (e.g. a directory that links out of the cache)."""

    # ------------------------------------------------------------------ put / publish
    @abstractmethod
    def _check_writable(self) -> None:
        """Raise ``CacheReadOnlyError`` / ``CacheFullError`` when the storage is known to refuse writes (checked
        before a put reads anything); a storage that only learns it when writing does nothing here."""

    @abstractmethod
    def _find_duplicate(self, data: EntryData) -> str | None:
        """The id of the entry already holding ``data``'s namespace, prompt, seed and request key, or None."""

    @abstractmethod
    def _new_entry_id(self, namespace: str) -> str:
        """A fresh 16-hex entry id for ``namespace`` (may register the namespace with the storage)."""

    @abstractmethod
    def _publish(self, data: EntryData, entry_id: str, enc: EncodedEntry, created: float) -> tuple[str, bool]:
        """Store ``enc`` (``entry.EncodedEntry`` of ``data`` as ``entry_id``) and make it visible atomically: the
        row, its bytes, its embedding (none for an answer-only entry) and a change record, all or nothing. The
        duplicate check is repeated inside that step: returns ``(id, True)`` for the entry published (a backend may
        re-encode it under another id on an id collision) or ``(existing id, False)`` when another writer stored the
        same request first (nothing of this put stays). Raises ``NamespaceMismatchError`` when the namespace is
        pinned to another model / config / embedding dimension; on any failure nothing is published (a crash may
        leave staged bytes that the storage cleans up or adopts, never a half-visible entry)."""

    def _note_request(self, request_key: str, entry_id: str) -> None:
        """After a put found or published ``entry_id``: keep any separate exact-repeat index in step (best
        effort). A storage whose row index answers ``_find_request`` directly does nothing."""

    @abstractmethod
    def _find_request(self, request_key: str) -> str | None:
        """The entry stored under exactly this (well-formed) request key, answer-only entries included; None."""

    # ------------------------------------------------------------------ reads and counters
    @abstractmethod
    def _namespace_of(self, entry_id: str) -> str | None:
        """The namespace of a cached entry, or None when it is not cached. EntryNotFoundError for an id that is
        not an entry id at all."""

    @abstractmethod
    def _read_entry(self, entry_id: str) -> StoredEntry | None:
        """The entry's row and bytes from one instant, or None when it is not cached (a row whose bytes vanished
        is dropped and reported as None or ``EntryNotFoundError``; so is a read torn by a concurrent removal). A
        defect the storage sees itself (e.g. chunks missing) is the record's ``defect``. EntryNotFoundError for a
        malformed id."""

    @abstractmethod
    def _read_signature(self, entry_id: str, hint: Any = None) -> StoredSignature | None:
        """The entry's Early Signature alone (without its latents), or None when it is not cached. ``hint``: what
        ``_recall_rows`` returned for the entry, when it was read there already."""

    @abstractmethod
    def _correct_size(self, stored: Any, namespace: str, entry_id: str, recorded: int, actual: int) -> None:
        """Record ``actual`` as the entry's size (and the totals and values derived from it), only if the row
        still records ``recorded``; ``stored`` is the read's ``ref``. Best effort: never raises for a full or
        read-only storage."""

    @abstractmethod
    def _count_hit(self, namespace: str, entry_id: str) -> int:
        """Count one reuse: the entry's hits, recency and LCBFU priority (at the current clock L) and the
        namespace's hit counter, in one atomic step. Returns the entry's hits after it (best effort: on a full or
        read-only storage nothing is counted and its recorded hits are returned), -1 when the entry is gone."""

    @abstractmethod
    def _count_lookup(self, namespace: str) -> None:
        """Add one lookup to the namespace's counter. Best effort: never raises for a full or read-only storage."""

    # ------------------------------------------------------------------ recall
    @abstractmethod
    def _namespace_model(self, namespace: str) -> str | None:
        """The model fingerprint the namespace is pinned to, or None when it holds nothing."""

    @abstractmethod
    def _sync(self, namespace: str) -> SyncedIndex | None:
        """This process's recall index of ``namespace``, brought up to the published state first (caller holds
        ``self._lock``); None when the namespace does not exist. Answer-only entries are never in it."""

    @abstractmethod
    def _fetch_vectors(self, namespace: str, seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(seqs found, their float32 embeddings) for re-ranking; rows removed meanwhile are left out."""

    @abstractmethod
    def _ids_of(self, namespace: str, seqs: list[int]) -> dict[int, str]:
        """Entry ids of index sequence numbers still cached in ``namespace``."""

    @abstractmethod
    def _recall_rows(self, namespace: str, ids: list[str]) -> dict[str, tuple[str, int, Any]]:
        """(prompt, seed, hint for ``_read_signature``) of the ids still cached, in one read where possible."""

    # ------------------------------------------------------------------ removal
    @abstractmethod
    def _set_aside(self, namespace: str, entry_id: str, reason: str, **how: Any) -> tuple[str, str | None]:
        """Quarantine: move the entry's bytes aside (never delete them) with ``reason``, and unpublish the entry.
        Returns (where the bytes went, what to log: None when nothing was moved or unpublished, e.g. another
        process did it first). Never raises for an unreachable, full or read-only storage (then less is done)."""

    @abstractmethod
    def _remove(self, namespace: str, entry_id: str) -> bool:
        """Unpublish and delete one entry; False when it was not cached. Works on a full storage."""

    @abstractmethod
    def _stored_bytes(self) -> int:
        """Total bytes of all entries (what ``max_bytes`` bounds)."""

    @abstractmethod
    def _eviction_lock(self) -> AbstractContextManager[None]:
        """Held while one process evicts (across processes / machines)."""

    @abstractmethod
    def _eviction_plan(self) -> tuple[int, Iterable[Victim]]:
        """(total bytes, every entry in eviction order of ``self.policy``: first = evicted first), under the
        eviction lock; the iterable may be lazy."""

    @abstractmethod
    def _remove_victims(self, victims: list[Victim], inflation: float | None) -> int:
        """Remove the victims (bytes first where that frees space for the bookkeeping) and raise the clock L to
        ``inflation`` (never lower it; None: leave it). Returns how many were removed (others went meanwhile)."""

    @abstractmethod
    def _purge_storage(self, namespace: str | None) -> tuple[int, list[str]]:
        """Delete every entry of ``namespace`` (None: all, and reset the clock L), with its counters, change log
        and exact-repeat keys, and count one purge. Returns (entries removed, namespaces touched)."""

    # ------------------------------------------------------------------ inspection
    @abstractmethod
    def _stats_parts(self, namespace: str | None) -> tuple[list[NamespaceCounts], int, int, int, int, int]:
        """(per-namespace counts of the non-empty namespaces, lookups, hits, quarantined, catalogue bytes, index
        bytes) of ``namespace`` (None: all)."""

    @abstractmethod
    def _verify_storage(self) -> tuple[list[str], list[str], list[str], int]:
        """Check that the storage's rows, bytes, sets and this process's indexes agree: (problems, notes, ids of
        the entries to load for a deep check, namespaces)."""

    @property
    @abstractmethod
    def _where(self) -> str:
        """The storage as the user named it (directory or public URL), for stats and log lines."""


def public(fn: Callable) -> Callable:
    """Run a public method inside the backend's ``_boundary`` (raw storage errors become CacheErrors)."""

    @functools.wraps(fn)
    def wrapper(self: "StoreOrchestra", *args: Any, **kwargs: Any) -> Any:
        with self._boundary(fn.__name__):
            return fn(self, *args, **kwargs)

    return wrapper


# ---------------------------------------------------------------------------------------------- the orchestra
class StoreOrchestra(Storage):
    """The public cache surface, written once over ``Storage``. A backend's ``__init__`` sets the attributes
    below and implements the ``Storage`` methods; its own public methods (``open``, ``close``, ``scan``,
    ``namespaces``, ``entry_ids``, ``content_version``, ``purge_count``) complete the surface. Thread-safe:
    ``_lock`` serialises index maintenance."""

    max_bytes: int | None
    policy: str
    index_params: IndexParams
    _lock: Any
    _indexes: dict[str, Any]
    _sigs: SignatureLRU
    _fault: Callable[[str], None] | None

    def __enter__(self) -> "StoreOrchestra":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ put / publish
    def put(self, data: EntryData) -> str:
        """Store one entry; returns its id. If an entry with the same namespace, prompt, seed and request key
        exists, returns its id and writes nothing (a deterministic request is cached once). May evict others."""
        return self.put_with_status(data)[0]

    @public
    def put_with_status(self, data: EntryData) -> tuple[str, bool]:
        """Like ``put``; also says whether a new entry was written (False: an identical request was cached)."""
        if not isinstance(data, EntryData):
            raise TypeError(f"Store.put takes an EntryData, got {type(data).__name__}")
        ns, rk = data.namespace, data.request_key
        self._validate_namespace(ns)
        self._check_writable()
        existing = self._find_duplicate(data)
        if existing:
            self._note_request(rk, existing)
            return existing, False
        created = time.time()
        entry_id = self._new_entry_id(ns)
        enc = common.encode_checked(data, entry_id=entry_id, created=created, max_bytes=self.max_bytes)
        entry_id, new = self._publish(data, entry_id, enc, created)
        if new and self._fault:
            self._fault(self._PUBLISHED_STAGE)
        self._note_request(rk, entry_id)  # after the publish: a writer dying in between loses only the hint
        if not new:
            return entry_id, False
        try:
            self._evict_if_needed(protect={entry_id})
        except CacheUnavailableError:
            pass  # published; the next write enforces the budget (the outage is logged once)
        except CacheError as e:  # the entry is published: report, do not fail the put
            log.warning("carnator cache: eviction after writing %s failed (%s); it is retried after the next write",
                        entry_id, e)
        return entry_id, True

    @public
    def find_request(self, request_key: str) -> str | None:
        """The id of the entry stored under exactly this request key (``EntryData.request_key``: a dense output,
        or an answer-only entry's answer key), or None (a malformed key, or none cached). Counts nothing (the
        caller loads the entry and counts the hit)."""
        if not isinstance(request_key, str) or not request_key or not REQUEST_KEY_RE.match(request_key):
            return None
        return self._find_request(request_key)

    # ------------------------------------------------------------------ reads
    def _gone(self, entry_id: str) -> EntryNotFoundError:
        return EntryNotFoundError(f"cache entry {entry_id} is no longer in the cache (evicted, purged or "
                                  "quarantined meanwhile); retrieve candidates again")

    @public
    def load(self, entry_id: str, *, count_hit: bool = True, model_fingerprint: str | None = None) -> Entry:
        """Load and fully validate one entry. ``count_hit``: count this as a reuse (hits, recency, LCBFU value;
        best effort). ``model_fingerprint``: refuse (NamespaceMismatchError) an entry made by another model.
        Raises EntryNotFoundError (not cached any more) or CorruptEntryError (quarantined; others unaffected)."""
        rec = self._read_entry(entry_id)
        if rec is None:
            raise self._gone(entry_id)
        ns = rec.namespace
        try:
            if rec.defect:
                raise EntryFormatError(rec.defect)
            # The bytes' own header and checksums decide whether the entry is whole (truncated bytes fail them); a
            # row whose size disagrees with bytes that verify is what is wrong, and is corrected below.
            dec = common.verify_entry(rec.blob, entry_id=entry_id, namespace=ns, meta_digest=rec.meta_digest,
                                      recorded_size=rec.nbytes)
        except EntryFormatError as e:
            raise self._quarantine(entry_id, ns, str(e)) from None
        nbytes = self._fix_size(rec.ref, ns, entry_id, rec.nbytes, len(rec.blob))
        common.check_model(dec, entry_id, model_fingerprint, self._ELSEWHERE)
        hits = rec.hits
        if count_hit:
            counted = self._count_hit(ns, entry_id)
            hits = counted if counted >= 0 else hits  # removed since the read: the bytes are still valid
        return common.entry_of(dec, entry_id=entry_id, namespace=ns, prompt=rec.prompt, seed=rec.seed,
                               created=rec.created, hits=hits, nbytes=nbytes)

    @public
    def load_signature(self, entry_id: str) -> Signature:
        """The entry's Early Signature only (reads just those tensors; cached per process)."""
        return self._signature(entry_id)

    def _signature(self, entry_id: str, hint: Any = None) -> Signature:
        hit = self._sigs.get(entry_id)
        if hit is not None:
            return hit
        got = self._read_signature(entry_id, hint)
        if got is None:
            raise self._gone(entry_id)
        if got.signature is None:
            raise self._quarantine(entry_id, got.namespace, got.defect)
        if got.actual_size is not None:
            self._fix_size(got.ref, got.namespace, entry_id, got.nbytes, got.actual_size)
        self._sigs.put(entry_id, got.signature, got.memo_bytes)
        return got.signature

    def _fix_size(self, ref: Any, ns: str, entry_id: str, recorded: int, actual: int) -> int:
        """A row recorded another size than its bytes have, and the bytes verified against their own header and
        checksums: correct the row (best effort; it is what budgets and eviction add up). Returns ``actual``."""
        if int(recorded) != int(actual):
            log.warning("carnator cache: the catalogue recorded %d bytes for entry %s but its bytes (which verify) "
                        "have %d; the recorded size was corrected", int(recorded), entry_id, int(actual))
            self._correct_size(ref, ns, entry_id, int(recorded), int(actual))
        return int(actual)

    @public
    def record_hit(self, entry_id: str) -> int:
        """Count one reuse of ``entry_id`` (when it was not loaded with ``count_hit=True``). Returns its hits."""
        ns = self._namespace_of(entry_id)
        if ns is None:
            raise self._gone(entry_id)
        hits = self._count_hit(ns, entry_id)
        if hits < 0:
            raise self._gone(entry_id)
        return hits

    @public
    def record_lookup(self, namespace: str) -> None:
        """Count one retrieval request in ``namespace`` (the hit-rate denominator; best effort)."""
        self._validate_namespace(namespace)
        self._count_lookup(namespace)

    # ------------------------------------------------------------------ recall
    @public
    def query(self, namespace: str, embedding: np.ndarray, k: int = 5, *, model_fingerprint: str | None = None
              ) -> list[tuple[str, float]]:
        """Top-k entries of ``namespace`` by cosine similarity to ``embedding``: ``[(entry_id, similarity)]``, best
        first, searched in this process's index after bringing it up to date. Only that namespace is searched.
        Raises ValueError if the embedding's dimension differs from the namespace's. ``model_fingerprint``: raise
        NamespaceMismatchError if the namespace holds another model's entries (its key is a fingerprint prefix: a
        collision must not mix models)."""
        self._validate_namespace(namespace)
        if model_fingerprint is not None:
            common.check_namespace_model(namespace, self._namespace_model(namespace), model_fingerprint,
                                         self._ELSEWHERE)
        q = query_vector(embedding)
        with self._lock:
            st = self._sync(namespace)
            if st is None:
                return []
            found = st.index.search_query(q, k, self.index_params,
                                          lambda seqs: self._fetch_vectors(namespace, seqs), namespace)
        if not found:
            return []
        ids = self._ids_of(namespace, [int(s) for s, _ in found])
        return [(ids[s], float(sim)) for s, sim in found if s in ids]

    @public
    def candidates(self, namespace: str, embedding: np.ndarray | None, k: int = 5, *, min_similarity: float = -1.0,
                   model_fingerprint: str | None = None, count_lookup: bool = True) -> Candidates:
        """Top-k candidates with their signatures (``types.Candidates``); counts one lookup unless not
        ``count_lookup`` (the request path counts it when the request is served: ``request.reuse_stage``). Entries
        that turn out corrupt are quarantined and skipped (said in ``note``); entries evicted meanwhile are
        skipped. No embedding (a prompt that could not be embedded), a namespace pinned to another
        ``model_fingerprint`` or an unreachable shared cache gives no candidates, with the reason in ``note``."""
        t0 = time.perf_counter()
        self._validate_namespace(namespace)
        held: dict[str, tuple[str, int, Any]] = {}

        def rows(ids: list[str]) -> dict[str, tuple[str, int]]:
            held.update(self._recall_rows(namespace, ids))
            return {i: (r[0], r[1]) for i, r in held.items()}

        try:
            if count_lookup:
                self.record_lookup(namespace)
            return common.recall(namespace, embedding, k, min_similarity, model_fingerprint, query=self.query,
                                 rows=rows, signature=self._recall_signature(held), t0=t0)
        except CacheUnavailableError as e:
            return Candidates(namespace=namespace, items=(), retrieval_ms=(time.perf_counter() - t0) * 1000,
                              note=f"cache unavailable: {e}")

    def _recall_signature(self, held: dict[str, tuple[str, int, Any]]) -> Callable[[str], Signature]:
        """``load_signature`` for recall: from what ``_recall_rows`` read already, inside the boundary (a raw
        storage error of one candidate becomes a CacheError, and recall skips that candidate with a note)."""

        def signature(entry_id: str) -> Signature:
            with self._boundary("load_signature"):
                return self._signature(entry_id, held[entry_id][2] if entry_id in held else None)

        return signature

    @public
    def index_kind(self, namespace: str) -> str | None:
        """The kind of this process's index for ``namespace`` ("flat" / "pca-ivf"), after syncing; None if empty."""
        with self._lock:
            st = self._sync(namespace)
            return st.index.kind if st else None

    # ------------------------------------------------------------------ quarantine / removal / eviction
    def _quarantine(self, entry_id: str, ns: str, reason: str, **how: Any) -> CorruptEntryError:
        """Set a bad entry aside (never delete it), unpublish it, log one line; returns the error to raise."""
        where, said = self._set_aside(ns, entry_id, reason, **how)
        self._sigs.discard(entry_id)
        if said is not None:
            log.warning("carnator cache: quarantined entry %s (namespace %s): %s -> %s; other entries are unaffected",
                        entry_id, ns, reason, said)
        return CorruptEntryError(
            f"cache entry {entry_id} is corrupt ({reason}); it was moved to {where} and removed from the catalogue. "
            "Other entries are unaffected; the request continues without it.")

    @public
    def delete(self, entry_id: str) -> bool:
        """Remove one entry. Returns False if it was not there. Works on a full storage."""
        if not valid_entry_id(entry_id):
            return False
        ns = self._namespace_of(entry_id)
        removed = ns is not None and self._remove(ns, entry_id)
        self._sigs.discard(entry_id)
        return removed

    @public
    def _evict_if_needed(self, protect: set[str]) -> int:
        """Evict the lowest-value entries (``self.policy``, all namespaces) until the total is within
        ``max_bytes``; ``protect``: ids never evicted (the entry just written). One process evicts at a time."""
        if not self.max_bytes or self._stored_bytes() <= self.max_bytes:
            return 0
        with self._eviction_lock():
            total, order = self._eviction_plan()
            victims: list[Victim] = []
            for v in order:
                if total <= self.max_bytes:
                    break
                if v.entry_id in protect:
                    continue
                victims.append(v)
                total -= v.nbytes
            if not victims:
                return 0
            if self._fault:
                self._fault("evict_picked")
            known = [v.priority for v in victims if v.priority is not None]
            evicted = self._remove_victims(victims, max(known) if known else None)
            for v in victims:
                self._sigs.discard(v.entry_id)
        if evicted:
            log.info("carnator cache: evicted %d entr%s (%s policy) to stay within %s", evicted,
                     "y" if evicted == 1 else "ies", self.policy, common.format_bytes(self.max_bytes))
        return evicted

    @public
    def purge(self, namespace: str | None = None) -> int:
        """Delete every entry (``namespace=None``) or those of one namespace, with their counters and recall
        indexes. Returns how many entries were removed. Works on a full storage."""
        if namespace:
            self._validate_namespace(namespace)
        n, touched = self._purge_storage(namespace)
        with self._lock:
            for ns in touched:
                self._indexes.pop(ns, None)
        log.info("carnator cache: purged %d entries (%s) in %s", n, f"namespace {namespace}" if namespace else "all",
                 self._where)
        return n

    # ------------------------------------------------------------------ inspection
    @public
    def stats(self, namespace: str | None = None) -> CacheStats:
        """Entries, bytes, lookups, hits and hit rate, overall and per namespace (or for one namespace)."""
        counts, lookups, hits, quarantined, catalog_bytes, index_bytes = self._stats_parts(namespace)
        per = tuple(NamespaceStats(namespace=ns, model_fingerprint=fp, config=config, entries=int(n), bytes=int(b),
                                   lookups=int(lk), hits=int(ht), hit_rate=ht / lk if lk else 0.0, answers=int(a))
                    for ns, fp, config, n, b, a, lk, ht in counts)
        return CacheStats(path=self._where, entries=sum(p.entries for p in per), bytes=sum(p.bytes for p in per),
                          max_bytes=self.max_bytes, policy=self.policy, lookups=lookups, hits=hits,
                          hit_rate=hits / lookups if lookups else 0.0, quarantined=quarantined,
                          catalog_bytes=catalog_bytes, index_bytes=index_bytes, namespaces=per,
                          answers=sum(p.answers for p in per))

    @public
    def verify(self, *, deep: bool = False) -> VerifyReport:
        """Check that catalogue, stored bytes and this process's indexes agree. ``deep``: also load and checksum
        every entry (corrupt ones are quarantined as a side effect and reported)."""
        problems, notes, ids, namespaces = self._verify_storage()
        if deep:
            for entry_id in ids:
                try:
                    self.load(entry_id, count_hit=False)
                except EntryNotFoundError:
                    pass
                except CorruptEntryError as e:
                    problems.append(str(e))
        return VerifyReport(ok=not problems, entries=len(ids), namespaces=namespaces, problems=tuple(problems),
                            notes=tuple(notes))


__all__ = ["CacheStats", "NamespaceCounts", "NamespaceStats", "Storage", "StoreOrchestra", "StoredEntry",
           "StoredSignature", "VerifyReport", "Victim"]
