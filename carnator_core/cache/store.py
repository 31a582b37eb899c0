"""Carnator's on-disk cache store: one directory, shared safely by several ComfyUI processes on one machine.

``Store`` is the catalogue logic of ``orchestra.StoreOrchestra`` (recall, the put/publish protocol, eviction,
quarantine, answer-only entries, statistics: written once, shared with ``redis_store.RedisStore``) over the storage
of this module: entry files, a SQLite catalogue and per-process FAISS indexes.

Layout (everything below the store root)::

    carnator-cache.json                 format marker {"format": "carnator-cache", "version": 1}
    catalog.sqlite3 (+ -wal, -shm)      SQLite catalogue (WAL): an index over the entry files (``catalog.py``)
    entries/<namespace>/<id>.safetensors  one immutable, self-describing, checksummed file per entry (``entry.py``)
    index/<namespace>.safetensors       persisted FAISS index (large namespaces only), HMAC-signed
    quarantine/                         corrupt entries and unusable catalogues moved out of the way (never deleted)
    tmp/                                files being written: ``<stem>.<pid>.<8 hex>.tmp`` (same filesystem: atomic)
    locks/                              filelock files (catalogue repair, eviction, index persistence)

Contracts
---------
* **Whose directory.** ``Store.open`` adopts a directory only if it is empty (or new) or carries the marker
  file; anything else raises ``NotACacheDirectoryError`` and nothing in it is touched. Inside a cache, the only
  files ever removed automatically are the cache's own temp files (name pattern above, older than the grace
  period); entry files are only removed by ``delete`` / ``purge`` / eviction of catalogued entries, and
  corrupt ones are *moved* to ``quarantine/``. A cache folder deleted by hand while a store has it open is
  recreated as a fresh, empty cache at the next call (one warning); a folder that holds nothing but the
  cache's own empty lock files counts as empty.
* **The catalogue is an index.** Every entry file names its namespace, model, config, prompt and seed, so the
  catalogue can always be rebuilt from the files: it is, into a new file swapped in atomically, when it is
  missing, damaged (``PRAGMA quick_check``), not exactly our schema (e.g. has triggers), a symbolic link, or an
  interrupted rebuild (the old one is moved to ``quarantine/``). An entry file without a row is *adopted*
  (``scan``), never deleted. Files that appear while a rebuild runs (puts of other processes, committed to the
  old catalogue) are adopted right after its swap, so they are visible when it ends; a writer that waited for
  the write lock across a swap commits to the new catalogue.
* **Write-ahead log.** Checkpointed every ``catalog.WAL_CHECKPOINT_PAGES`` pages and truncated back to
  ``catalog.WAL_LIMIT_BYTES``: the folder stays within ``max_bytes`` + the catalogue file + ``WAL_MARGIN_BYTES``. Counters (lookups, hits, recency) are the only state a rebuild loses.
* **Never pickle.** Tensors are safetensors, metadata JSON; FAISS only parses index files whose HMAC verifies
  under a key kept outside the cache directory (``index.py``). SQLite runs with ``trusted_schema=OFF``.
* **Namespaces = model x generation config** (``types.namespace_key``); a namespace's first entry pins its full
  model fingerprint, config and embedding dimension, an entry that disagrees is refused, and readers that pass
  ``model_fingerprint`` get nothing from a namespace pinned to another model (a key-prefix collision).
* **Durability.** A write goes to ``tmp/``, is fsynced, renamed into ``entries/`` and then committed in one
  transaction (row + embedding + change-log record). A crash leaves nothing, one of our temp files, or a
  complete entry file without a row (adopted by ``scan``). A put whose file another process's scan adopted
  before the put committed (a forward clock jump, or a writer stalled past the grace period) keeps that file
  and returns its id: a put never deletes a file that a committed row points to. Deletes (eviction, purge) unlink the files first
  and commit afterwards: a crash leaves rows whose file is gone, which readers treat as "no longer cached" and
  ``scan`` drops; and on a full disk the unlinks free the space the commit needs.
* **Full disk.** Reads work (counter updates, index persistence and change-log trimming are best-effort);
  ``delete`` / ``purge`` work; a write fails with ``CacheFullError``.
* **Read-only cache** (a read-only mount or volume, no write permission): opened read-only with one warning;
  recalls, exact repeats and loads work, nothing is written (no lock files, no counters, no index files), and a
  write fails with ``CacheReadOnlyError`` before touching the disk. ``handle.open_store`` reopens it writable
  once it is (as it does for a full disk that has room again). The Cache Writer turns any ``CacheError`` of a
  write into "not cached" on its badge and in the log: the clip is returned and the prompt does not fail.
* **Errors.** Every failure is a ``CacheError`` (``errors.py``) saying what to do; raw ``sqlite3`` / ``OSError``
  never leave the public methods. A damaged catalogue found mid-operation is rebuilt at once and the call
  fails with ``CatalogError`` ("retry").
* **Corruption.** A file that fails to parse, is truncated, or does not match its checksums is moved to
  ``quarantine/`` with one warning, removed from the catalogue and reported as ``CorruptEntryError``. The file's
  own header and checksums decide: a row whose recorded size disagrees with a file that verifies is corrected
  (one warning), never a reason to quarantine an intact entry.
* **Concurrency.** SQLite WAL + ``BEGIN IMMEDIATE`` serialise writers across processes (``busy_timeout`` 60 s);
  readers see consistent snapshots. A process notices a catalogue swapped in by another (inode change) before
  its next transaction. Each process keeps its own in-memory FAISS index per namespace and brings it up to date
  from the change log (per-namespace generation counter + a token that changes on purge / rebuild).
* **Capacity.** ``max_bytes`` bounds the total size of entry files; after each write the lowest-value entries
  are evicted (``policy.py``: ``lcbfu`` by default, or ``lru``). An entry larger than the whole budget is refused.
* **Exact repeats.** An entry may carry the ``keys.request_key`` of the request whose dense output it holds
  (column ``entries.request_key``, indexed; ``""`` = none); ``find_request(key)`` finds it in one query.
  Duplicates are (namespace, prompt, seed, request key). An *answer-only* entry (``EntryData.answer_of``, column
  ``entries.answer``) holds a hit's result under its answer key: found by ``find_request``, never in a recall
  index (no embedding row, no change record), evicted, verified and adopted like any entry.
* **Hits.** ``candidates()`` counts a lookup (``count_lookup=False``: the caller counts it with
  ``record_lookup``); ``load(count_hit=True)`` or ``record_hit()`` counts a reuse (call exactly one of them per
  reuse). Hit rate = hits / lookups per namespace. The request path (``request.py``) counts a request's lookup and
  its hit once, when the request is served (an accepted entry the sampler did not reuse is no hit; an interrupted
  request counts nothing), so the counters equal the per-request reports.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import sqlite3
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from filelock import FileLock

from ..types import GenConfig, namespace_key
from . import catalog
from .catalog import CATALOG, SIDE_FILES, STORE_FORMAT, STORE_VERSION
from .common import format_bytes
from .entry import (
    EncodedEntry,
    Entry,
    EntryData,
    adopted_answer_of,
    adopted_request_key,
    check_meta,
    read_entry_parts,
    signature_from,
    valid_entry_id,
    valid_namespace,
)
from .errors import (
    CacheBudgetError,
    CacheError,
    CacheFullError,
    CacheReadOnlyError,
    CatalogError,
    CatalogRebuiltError,
    CorruptEntryError,
    EntryNotFoundError,
    NamespaceMismatchError,
    NotACacheDirectoryError,
)
from .index import IndexFileError, IndexParams, VectorIndex
from .orchestra import (
    CacheStats,
    NamespaceCounts,
    NamespaceStats,
    StoredEntry,
    StoredSignature,
    StoreOrchestra,
    VerifyReport,
    Victim,
    public,
)
from .policy import EVICTION_ORDER, check_policy, work_of
from .sigcache import SignatureLRU

log = logging.getLogger("carnator")

MARKER = "carnator-cache.json"
ENV_KEY_FILE = "CARNATOR_INDEX_KEY_FILE"
DEFAULT_GRACE_S = 600.0  # files younger than this may be another process's write in flight
CHANGE_LOG_KEEP = 20000  # change-log rows kept per namespace that has no persisted index
WAL_MARGIN_BYTES = 1 << 20  # what the folder may hold beyond max_bytes and the catalogue file (WAL, index, notes)
QUICK_CHECK_MAX_BYTES = 256 << 20  # catalogues up to this size get PRAGMA quick_check at open (~15k entries)
SUBDIRS = ("entries", "index", "quarantine", "tmp", "locks")
_TMP_RE = re.compile(r"^[A-Za-z0-9_.-]+\.\d+\.[0-9a-f]{8}\.tmp$")  # the temp files this cache creates
_MARKER_TMP_RE = re.compile(r"^\." + re.escape(MARKER) + r"\.\d+\.[0-9a-f]{8}\.tmp$")
_ENTRY_FILE_RE = re.compile(r"^[0-9a-f]{16}\.safetensors$")
_LOCK_FILE_RE = re.compile(r"^[A-Za-z0-9_.-]+\.lock$")  # filelock's files in locks/ (empty; never removed on Unix)


# ---------------------------------------------------------------------------------------------- values
@dataclass
class _NsIndex:
    token: str
    generation: int
    index: VectorIndex


def default_key_path() -> Path:
    """Where the index-signing key lives: ``$CARNATOR_INDEX_KEY_FILE`` or ``~/.config/carnator/index-hmac.key``."""
    env = os.environ.get(ENV_KEY_FILE)
    if env:
        return Path(env).expanduser()
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "carnator" / "index-hmac.key"


def _load_or_create_key(path: Path) -> bytes | None:
    try:
        return bytes.fromhex(path.read_text().strip())
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as e:
        log.warning("carnator cache: index key %s is unreadable (%s); index files will not be persisted", path, e)
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    except FileExistsError:
        pass  # another process created it meanwhile
    except OSError as e:
        log.warning("carnator cache: cannot create index key %s (%s); index files will not be persisted", path, e)
        return None
    try:
        return bytes.fromhex(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _claim_directory(root: Path) -> None:
    """Make sure ``root`` is ours: it carries the marker (checked), or it is empty / new (marked now).
    Raises NotACacheDirectoryError for anything else, so a cache never adopts (and later cleans) someone
    else's folder."""
    marker = root / MARKER
    if marker.is_symlink():
        raise CacheError(f"{marker} is a symbolic link; a cache directory must not link elsewhere. Remove it.")
    if not marker.exists():
        if root.exists() and not root.is_dir():
            raise NotACacheDirectoryError(f"{root} is a file, not a directory; choose a directory for the cache")
        root.mkdir(parents=True, exist_ok=True)
        why = adoption_problem(root)
        if why:
            raise NotACacheDirectoryError(why)
        if not marker.exists():
            tmp = root / f".{MARKER}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(json.dumps({"format": STORE_FORMAT, "version": STORE_VERSION}).encode())
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, marker)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            catalog.fsync_path(root)
    try:
        m = json.loads(marker.read_text())
    except (OSError, ValueError) as e:
        raise CacheError(f"{marker} is unreadable ({e}); is {root} a Carnator cache directory?") from None
    if not isinstance(m, dict) or m.get("format") != STORE_FORMAT or m.get("version") != STORE_VERSION:
        got = m if not isinstance(m, dict) else f"{m.get('format')!r} v{m.get('version')!r}"
        raise CacheError(f"{root} holds cache format {got}; this Carnator reads {STORE_FORMAT!r} v{STORE_VERSION}. "
                         "Use another directory or upgrade Carnator.")


def adoption_problem(root: Path) -> str | None:
    """Why ``root`` must not become (or be used as) a cache, or None: it is new, empty, or already a Carnator
    cache (marker present). For queue-time checks; ``Store.open`` enforces it."""
    try:
        if (root / MARKER).exists() or not root.exists():
            return None
        if not root.is_dir():
            return f"{root} is a file, not a directory; choose a directory for the cache"
        foreign = sorted(p.name for p in root.iterdir() if not _may_precede_marker(p))
    except OSError as e:
        return f"{root} cannot be used as a cache directory: {e.strerror or e}"
    if not foreign or (root / MARKER).exists():  # re-check: another process may have claimed it meanwhile
        return None
    shown = ", ".join(repr(n[:60]) for n in foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
    return (f"{root} is not empty ({shown}) and is not a Carnator cache (it has no {MARKER}). Carnator only uses an "
            "empty or new directory, or one it created, so it never touches files that are not its own: choose "
            "another directory name (e.g. a subdirectory such as 'carnator_cache').")


def _may_precede_marker(p: Path) -> bool:
    """What an unmarked directory may hold and still count as empty: our own marker temp files (a crash while
    claiming it) and empty subdirectories of our layout."""
    if p.is_symlink():
        return False
    if p.name == MARKER or (_MARKER_TMP_RE.match(p.name) and p.is_file()):
        return True
    if p.name == "locks" and p.is_dir():  # a folder deleted under a running store: only its empty lock files came back
        return all(_LOCK_FILE_RE.match(f.name) and f.is_file() and not f.is_symlink() and f.stat().st_size == 0
                   for f in p.iterdir())
    return p.name in SUBDIRS and p.is_dir() and not any(p.iterdir())


def _prepare_root(root: Path) -> None:
    """Claim ``root`` (``_claim_directory``) and create the layout's subdirectories (links refused)."""
    _claim_directory(root)
    for sub in SUBDIRS:
        d = root / sub
        if d.is_symlink():
            raise CacheError(f"{d} is a symbolic link; a cache directory must not link elsewhere. Remove it.")
        if not d.is_dir() and _writable(root):  # a read-only cache without it is served as it is
            d.mkdir(exist_ok=True)


# ---------------------------------------------------------------------------------------------- the store
class Store(StoreOrchestra):
    """The cache store on a local folder: the catalogue logic of ``StoreOrchestra`` over entry files, a SQLite
    catalogue and per-process FAISS indexes. Open with ``Store.open(path)``; one instance per process and directory
    is enough (it is thread-safe); several processes (or instances) may open the same directory."""

    _ELSEWHERE = "cache directory"
    _PUBLISHED_STAGE = "after_commit"

    def __init__(self, root: Path, *, max_bytes: int | None, policy: str, index_params: IndexParams,
                 key: bytes | None, grace_s: float, durable: bool,
                 clock: Callable[[], float] = time.time) -> None:
        self.root = root
        self._clock = clock  # wall clock that file ages are measured against (tests inject a jumped one)
        self.max_bytes = int(max_bytes) if max_bytes else None
        self.policy = check_policy(policy)
        self.index_params = index_params
        self.grace_s = float(grace_s)
        self.durable = bool(durable)
        self._key = key
        self._lock = threading.RLock()
        self._indexes: dict[str, _NsIndex] = {}
        self._sigs = SignatureLRU()
        self._warned: set[str] = set()
        # Fault injection for crash tests: called with a stage name ("after_tmp_write", "after_rename",
        # "after_commit" in put; "rebuild_entry", "rebuild_built", "rebuild_set_aside" in a catalogue rebuild;
        # "evict_picked", "evict_unlinked", "delete_unlinked", "purge_unlinked"); a test kills the process there.
        self._fault: Callable[[str], None] | None = None
        self._conn: sqlite3.Connection = None  # type: ignore[assignment]
        self._db_id: tuple[int, int] | None = None
        self.read_only = False  # opened on a full disk or a read-only mount: reads only (see _try_connect)
        self._read_only_why = ""  # "full" or "read-only" while read_only

    # ------------------------------------------------------------------ open / close
    @classmethod
    def open(cls, path: str | os.PathLike, *, max_bytes: int | None = None, policy: str = "lcbfu",
             index_params: IndexParams | None = None, key_path: str | os.PathLike | None = None,
             grace_s: float = DEFAULT_GRACE_S, durable: bool = True,
             clock: Callable[[], float] = time.time) -> "Store":
        """Open (creating if needed) the store at ``path``.

        max_bytes: byte budget of entry files for this instance's writes (None = unlimited).
        policy: "lcbfu" (default) or "lru". index_params: FAISS index choices. key_path: index-signing key
        (default ``default_key_path()``; must be outside the store). grace_s: age after which our stray temp files
        are removed and entry files without a catalogue row are adopted. durable: fsync entry files before they
        are committed. clock: the wall clock file ages are measured with (``time.time``; a test injects a jumped
        one). Raises NotACacheDirectoryError for a non-empty directory that is not a Carnator cache,
        CacheError for another format version or an unusable directory.
        """
        root = Path(path).expanduser()
        try:
            root = root.resolve()
            _prepare_root(root)
        except OSError as e:
            raise Store._translate_for(root, e, "open the cache directory") from e
        kp = Path(key_path).expanduser() if key_path else default_key_path()
        key = None
        if kp.resolve().is_relative_to(root):
            log.warning("carnator cache: the index key %s is inside the cache directory; index files will not be "
                        "persisted (a copied cache directory must not carry its own key)", kp)
        else:
            key = _load_or_create_key(kp)
        store = cls(root, max_bytes=max_bytes, policy=policy, index_params=index_params or IndexParams(), key=key,
                    grace_s=grace_s, durable=durable, clock=clock)
        try:
            store._open_catalog_checked()
        except CatalogRebuiltError:  # damage the open-time scan ran into: rebuilt; open the new catalogue
            store._open_catalog_checked()
        return store

    @public
    def _open_catalog_checked(self) -> None:
        self._open_catalog()
        if not self.read_only:
            self.scan()

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None  # type: ignore[assignment]
            self._indexes.clear()

    # ------------------------------------------------------------------ catalogue
    def _catalog_lock(self) -> FileLock:
        return FileLock(str(self.root / "locks" / "catalog.lock"), timeout=600)

    def _reclaim_if_deleted(self) -> None:
        """The cache folder (or its marker) was deleted while this store was open (by hand, to free space): make
        it a fresh, empty cache again, with one log line, instead of failing every later call. Taking the
        catalogue lock first would recreate ``locks/`` alone, which made the folder look foreign (not empty, no
        marker) to every later open. A folder that meanwhile holds someone else's files is still refused."""
        if (self.root / MARKER).exists():
            return
        log.warning("carnator cache: the cache folder %s was deleted while in use (its marker %s is gone); it is "
                    "recreated as a fresh, empty cache", self.root, MARKER)
        self._indexes.clear()
        self._sigs.clear()
        _prepare_root(self.root)

    def _open_catalog(self) -> None:
        """Connect to a healthy catalogue, rebuilding it from the entry files first if it is missing or unusable.
        A cache this process cannot write to (a read-only mount or volume, no write permission) is opened
        read-only: recalls, exact repeats and loads work, nothing is written (not even a lock file)."""
        self._reclaim_if_deleted()
        if not _writable(self.root):
            with self._lock:
                self._conn, self._db_id = self._connect_read_only(), None
                st = os.stat(self.root / CATALOG)
                self._db_id = (st.st_dev, st.st_ino)
            return
        with self._lock, self._catalog_lock():
            conn, reason = self._try_connect()
            if conn is None:
                if _disk_full(self.root):
                    raise sqlite3.OperationalError(f"database or disk is full (the catalogue needs a rebuild: "
                                                   f"{reason})")
                self._rebuild_locked(reason)
                conn, reason = self._try_connect()
                if conn is None:
                    raise CatalogError(f"the catalogue just rebuilt at {self.root / CATALOG} is unusable ({reason}); "
                                       "check the disk and file permissions of the cache directory")
            self._conn = conn
            st = os.stat(self.root / CATALOG)
            self._db_id = (st.st_dev, st.st_ino)

    def _connect_read_only(self) -> sqlite3.Connection:
        """The catalogue of a cache this process cannot write to, opened immutable (no WAL, no lock files). Said
        once in the log; a missing or unusable catalogue cannot be rebuilt here and raises CacheReadOnlyError."""
        db = self.root / CATALOG
        why = "missing" if not db.is_file() or db.is_symlink() else None
        conn = None
        if why is None:
            try:
                conn = catalog.connect(db, read_only=True)
                why = catalog.problem(conn, integrity=db.stat().st_size <= QUICK_CHECK_MAX_BYTES)
            except sqlite3.DatabaseError as e:
                why = f"{type(e).__name__}: {e}"
        if why:
            if conn is not None:
                conn.close()
            raise CacheReadOnlyError(
                f"the Carnator cache at {self.root} is read-only and its catalogue is unusable ({why}); it cannot be "
                "rebuilt without writing. Make the directory writable once (it is rebuilt from the entry files), or "
                "choose another cache directory.")
        if not (self.read_only and self._read_only_why == "read-only"):
            log.warning("carnator cache: %s is read-only (a read-only mount, volume or permissions); the cache serves "
                        "recalls and exact repeats from it and writes nothing (no new entries, no counters) until it "
                        "is writable and reopened", self.root)
        self.read_only, self._read_only_why = True, "read-only"
        return conn

    def _writable_again(self) -> bool:
        """For a store opened read-only: whether reopening it now would open it writable (space freed, remounted
        read-write)."""
        if not self.read_only:
            return False
        if self._read_only_why == "read-only":
            return _writable(self.root)
        return not _disk_full(self.root) and shutil.disk_usage(self.root).free >= (64 << 20)

    def _try_connect(self) -> tuple[sqlite3.Connection | None, str]:
        db = self.root / CATALOG
        links = [p.name for p in (db, *(Path(str(db) + s) for s in SIDE_FILES)) if p.is_symlink()]
        if links:
            return None, f"{links[0]} is a symbolic link (SQLite would write where it points)"
        if not db.exists():
            return None, "missing"
        conn = None
        # A full integrity check reads the whole file: affordable at open up to QUICK_CHECK_MAX_BYTES; damage in a
        # larger catalogue is found when a query reaches it (then it is rebuilt at once, see _boundary / _recover).
        integrity = db.stat().st_size <= QUICK_CHECK_MAX_BYTES
        try:
            conn = catalog.connect(db)
            why = catalog.problem(conn, integrity=integrity)
        except sqlite3.DatabaseError as e:
            if conn is not None:
                conn.close()
            if catalog.is_corruption(e):
                return None, f"{type(e).__name__}: {e}"
            if not _disk_full(self.root):
                raise
            # Too full for SQLite's WAL / shared-memory files: read the (checkpointed) catalogue as it is.
            conn = catalog.connect(db, read_only=True)
            why = catalog.problem(conn, integrity=integrity)
            if why:
                conn.close()
                raise
            self.read_only, self._read_only_why = True, "full"
            log.warning("carnator cache: the disk holding %s is full; the cache is open read-only (retrieval and "
                        "loading work, nothing is written) until space is freed and it is reopened", self.root)
            return conn, ""
        if why:
            conn.close()
            return None, why
        self.read_only, self._read_only_why = False, ""
        return conn, ""

    @public
    def rebuild_catalog(self, reason: str = "requested") -> None:
        """Rebuild the catalogue from the entry files now (the current one is moved to ``quarantine/``)."""
        with self._lock, self._catalog_lock():
            self._rebuild_locked(reason)
        self._open_catalog()

    def _rebuild_locked(self, reason: str) -> None:
        """Build a new catalogue from the entry files in ``tmp/`` and swap it in (caller holds the catalogue lock).
        The old catalogue (and any WAL / shared-memory file beside it) is moved to ``quarantine/`` just before
        the swap: a crash leaves the old catalogue, no catalogue (rebuilt again at the next open), or the new one."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None  # type: ignore[assignment]
        self._indexes.clear()
        self._sigs.clear()
        files = self._entry_files()
        if reason != "missing" or files:
            log.warning("carnator cache: catalogue %s is unusable (%s); setting it aside in quarantine/ and "
                        "rebuilding from the entry files (%d)", self.root / CATALOG, reason, len(files))
        build = self.root / "tmp" / f"catalog-rebuild.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        conn = catalog.connect(build, wal=False)
        try:
            conn.execute("PRAGMA journal_mode=MEMORY")
            conn.execute("PRAGMA synchronous=OFF")  # durability comes from the fsync before the swap
            conn.execute("BEGIN")
            catalog.create(conn)
            adopted = self._adopt_each(conn, files, fault="rebuild_entry")
            catalog.mark_complete(conn)
            conn.execute("COMMIT")
        except BaseException:
            conn.close()
            build.unlink(missing_ok=True)
            raise
        conn.close()
        catalog.fsync_path(build)
        if self._fault:
            self._fault("rebuild_built")
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{secrets.token_hex(2)}"
        db = self.root / CATALOG
        for suffix in ("", *SIDE_FILES):
            p = Path(str(db) + suffix)
            if p.exists() or p.is_symlink():
                os.replace(p, self.root / "quarantine" / f"catalog-{stamp}.sqlite3{suffix}")
        if self._fault:
            self._fault("rebuild_set_aside")
        os.replace(build, db)
        catalog.fsync_path(self.root)
        adopted += self._adopt_late(db, set(files))
        for p in (self.root / "index").glob("*.safetensors"):  # ours (signed); their seqs belonged to the old one
            p.unlink(missing_ok=True)
        if reason != "missing" or files:
            log.warning("carnator cache: catalogue rebuilt with %d entries", adopted)

    def _entry_files(self) -> list[Path]:
        return sorted(p for p in (self.root / "entries").glob("*/*.safetensors")
                      if valid_namespace(p.parent.name) and _ENTRY_FILE_RE.match(p.name))

    def _adopt_late(self, db: Path, listed: set[Path]) -> int:
        """After a rebuild's swap: adopt the entry files that appeared since the rebuild listed them. Puts of other
        processes committed to the old catalogue while the new one was built (their rows went aside with it) are
        then visible at once, not after the grace period. A file whose put has not committed yet is adopted too;
        that put then finds its own row and returns its id (``_discard_unless_catalogued``). Any later commit
        goes to the new catalogue (``_write`` re-checks which catalogue it locked)."""
        late = [p for p in self._entry_files() if p not in listed]
        if not late:
            return 0
        conn = catalog.connect(db)
        try:
            return self._adopt_each(conn, late, each_committed=True)
        finally:
            conn.close()

    def _adopt_each(self, conn: sqlite3.Connection, paths: list[Path], *, fault: str = "",
                    each_committed: bool = False) -> int:
        """Catalogue each entry file in ``conn`` (``_adopt_into``; bad ones are quarantined, vanished ones
        skipped), inside the caller's transaction or, with ``each_committed``, one transaction per file. Returns
        how many were adopted."""
        n = 0
        for path in paths:
            if self._fault and fault:
                self._fault(fault)
            if each_committed:
                conn.execute("BEGIN IMMEDIATE")
            try:
                self._adopt_into(conn, path)
                n += 1
            except (CorruptEntryError, FileNotFoundError):
                pass  # quarantined and logged / removed meanwhile
            finally:
                if each_committed:
                    conn.execute("COMMIT")
        return n

    def _recover(self, reason: str) -> None:
        """A corruption error mid-operation: rebuild the catalogue unless another process already swapped in a new
        one (its inode changed since this connection was opened)."""
        try:
            with self._lock:
                failed = self._db_id
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None  # type: ignore[assignment]
                self._indexes.clear()
                with self._catalog_lock():
                    try:
                        st = os.stat(self.root / CATALOG)
                        same = (st.st_dev, st.st_ino) == failed
                    except FileNotFoundError:
                        same = False
                    if same:
                        self._rebuild_locked(reason)
                self._open_catalog()
        except Exception as e:  # noqa: BLE001 - the caller raises the original problem
            log.warning("carnator cache: could not rebuild the catalogue after %s: %s", reason, e)

    def _inspect(self, path: Path, drop_row: bool) -> tuple[dict, str, np.ndarray, GenConfig, int]:
        """Validate an entry file enough to catalogue it; quarantines it (CorruptEntryError) if it is not valid."""
        ns, entry_id = path.parent.name, path.name.removesuffix(".safetensors")
        try:
            if not valid_namespace(ns) or not valid_entry_id(entry_id):
                raise ValueError("file name is not a Carnator entry name")
            meta, meta_json, parts = read_entry_parts(path, ("embedding",))
            check_meta(meta, entry_id, ns)
            emb = parts["embedding"]
            if emb.ndim != 1 or emb.shape[0] != int(meta["dim"]):
                raise ValueError(f"embedding has shape {emb.shape}, the metadata says [{meta['dim']}]")
            config = GenConfig.from_meta(meta["config"])
            adopted_answer_of(meta)  # a malformed answer-only record is refused, never adopted as a candidate
            if namespace_key(meta["model_fingerprint"], config) != ns:
                raise ValueError("metadata's model/config does not match the namespace directory")
            nbytes = path.stat().st_size
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise self._quarantine(entry_id, ns, f"cannot adopt file: {e}", path=path, drop_row=drop_row) from None
        return meta, meta_json, emb, config, nbytes

    def _adopt_into(self, c: sqlite3.Connection, path: Path) -> None:
        """Catalogue one entry file in ``c`` (inside the caller's transaction), or quarantine it."""
        meta, meta_json, emb, config, nbytes = self._inspect(path, drop_row=False)
        ns, entry_id = path.parent.name, meta["id"]
        c.execute("SAVEPOINT adopt")
        try:
            catalog.ensure_namespace(c, ns, meta["model_fingerprint"], config, int(emb.shape[0]))
            prompt = str(meta["prompt"])
            catalog.insert_row(c, entry_id, ns, prompt, _digest(prompt), int(meta["seed"]), nbytes,
                               _digest(meta_json),
                               work_of(config.steps, config.probe_steps, config.latent_shape), emb,
                               float(meta.get("created", time.time())), request_key=adopted_request_key(meta),
                               answer=bool(adopted_answer_of(meta)))
        except (NamespaceMismatchError, sqlite3.IntegrityError) as e:
            c.execute("ROLLBACK TO adopt")
            c.execute("RELEASE adopt")
            why = str(e) if isinstance(e, NamespaceMismatchError) else \
                "another entry already holds this id or this namespace, prompt and seed"
            raise self._quarantine(entry_id, ns, f"cannot adopt file: {why}", path=path, drop_row=False) from None
        c.execute("RELEASE adopt")

    # ------------------------------------------------------------------ transactions
    def _current(self) -> sqlite3.Connection:
        """The connection, reconnected first if another process swapped in a rebuilt catalogue."""
        if self._conn is None:
            raise CacheError(f"the cache store at {self.root} is closed")
        if self._conn.in_transaction:
            return self._conn  # never swap connections inside a transaction
        try:
            st = os.stat(self.root / CATALOG)
            same = (st.st_dev, st.st_ino) == self._db_id
        except FileNotFoundError:
            same = False
        if not same:
            self._conn.close()
            self._conn = None  # type: ignore[assignment]
            self._indexes.clear()
            self._open_catalog()
        return self._conn

    def _swapped(self) -> bool:
        """Whether the catalogue file at the path is no longer the one this connection has open (a rebuild by
        another process swapped a new one in)."""
        try:
            st = os.stat(self.root / CATALOG)
            return (st.st_dev, st.st_ino) != self._db_id
        except FileNotFoundError:
            return True

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            for _ in range(5):
                c = self._current()
                if self.read_only:  # best-effort callers skip, others translate (_translate_for)
                    if self._read_only_why == "read-only":
                        raise sqlite3.OperationalError("attempt to write a readonly database (the cache directory "
                                                       "is read-only)")
                    raise sqlite3.OperationalError("database or disk is full (the cache was opened read-only on a "
                                                   "full disk; free space and reopen it)")
                c.execute("BEGIN IMMEDIATE")
                # Waiting for the write lock, a rebuild may have swapped a new catalogue in: a commit to the old
                # one would be lost with it. Then write to the new one instead.
                if not self._swapped():
                    break
                c.execute("ROLLBACK")
            else:
                raise CatalogError(f"the catalogue at {self.root / CATALOG} kept being replaced while this process "
                                   "waited to write; retry")
            try:
                yield c
            except BaseException:
                if c.in_transaction:
                    c.execute("ROLLBACK")
                raise
            c.execute("COMMIT")

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            c = self._current()
            c.execute("BEGIN")
            try:
                yield c
            finally:
                if c.in_transaction:
                    c.execute("COMMIT")

    def _require_conn(self) -> sqlite3.Connection:
        return self._current()

    @contextmanager
    def _best_effort(self, what: str) -> Iterator[None]:
        """For bookkeeping a read must not fail on (counters, index files, log trimming): a full disk or a
        locked catalogue is logged once per kind and ignored. Corruption is not swallowed."""
        try:
            yield
        except (sqlite3.Error, OSError) as e:
            if isinstance(e, sqlite3.Error) and catalog.is_corruption(e):
                raise
            if self.read_only:
                return  # said once when it was opened read-only
            key = f"{what}:{type(e).__name__}"
            if key not in self._warned:
                self._warned.add(key)
                log.warning("carnator cache: could not %s (%s); continuing without it%s", what, e,
                            " (the disk is full: free space or purge entries)" if catalog.is_full(e) else "")

    @contextmanager
    def _boundary(self, what: str) -> Iterator[None]:
        """Raw sqlite3 / OS errors become CacheErrors that say what to do. A damaged catalogue found mid-operation
        is rebuilt from the entry files before the error (CatalogRebuiltError: retry) is raised."""
        try:
            yield
        except CacheError:
            raise
        except sqlite3.Error as e:
            if catalog.is_corruption(e):
                self._recover(f"{type(e).__name__}: {e}")
                raise CatalogRebuiltError(
                    f"the cache catalogue at {self.root / CATALOG} was damaged ({e}); it has been set aside in "
                    "quarantine/ and rebuilt from the entry files. Retry the operation.") from e
            raise self._translate(e, what) from e
        except OSError as e:
            raise self._translate(e, what) from e

    def _translate(self, e: BaseException, what: str) -> CacheError:
        return self._translate_for(self.root, e, what)

    @staticmethod
    def _translate_for(root: Path, e: BaseException, what: str) -> CacheError:
        what = what.strip("_").replace("_", " ")
        if catalog.is_full(e):
            return CacheFullError(
                f"the disk holding the Carnator cache {root} is full ({e}) during {what}: nothing was written. "
                "Free disk space, lower the cache's max_gb so it evicts older entries, or purge entries (Carnator "
                "Cache Stats node or the cache panel); reads, delete and purge keep working.")
        text = str(e).lower()
        if (isinstance(e, OSError) and e.errno == errno.EROFS) or "readonly" in text or "read-only" in text:
            return CacheReadOnlyError(
                f"the Carnator cache at {root} is read-only ({e}) during {what}: nothing was written; recalls, exact "
                "repeats and loads keep working. To cache new results, make it writable (remount read-write, fix "
                "permissions) or choose another cache directory.")
        if "locked" in text or "busy" in text:
            return CatalogError(f"the Carnator cache catalogue at {root} stayed locked by another process during "
                                f"{what} ({e}); retry when the other ComfyUI process is idle.")
        if isinstance(e, PermissionError):
            return CatalogError(f"the Carnator cache at {root} is not writable ({e}) during {what}: fix the "
                                "directory's permissions or choose another cache directory.")
        if isinstance(e, OSError) and e.errno == 36:  # ENAMETOOLONG
            return CacheError(f"a path of the Carnator cache at {str(root)[:200]} is too long ({e.strerror}); "
                              "choose a shorter cache directory.")
        return CatalogError(f"the Carnator cache at {root} failed during {what}: {type(e).__name__}: {e}. "
                            "Check the disk; if it persists, Store.verify() says what is inconsistent.")

    # ------------------------------------------------------------------ paths
    def _validate_namespace(self, namespace: str) -> None:
        self._ns_dir(namespace)

    def _ns_dir(self, ns: str, top: str = "entries") -> Path:
        if not valid_namespace(ns):
            raise ValueError(f"invalid namespace {str(ns)[:200]!r}")
        d = self.root / top / ns
        if (d.exists() or d.is_symlink()) and (d.is_symlink() or not d.resolve().is_relative_to(self.root)):
            raise CacheError(f"{d} resolves outside the cache directory (a symbolic link?); refusing to use it. "
                             "Remove the link.")
        return d

    def _entry_path(self, ns: str, entry_id: str) -> Path:
        if not valid_entry_id(entry_id):
            raise ValueError(f"invalid entry id {str(entry_id)[:200]!r}")
        return self._ns_dir(ns) / f"{entry_id}.safetensors"

    def _index_path(self, ns: str) -> Path:
        self._ns_dir(ns)  # validates the name
        return self.root / "index" / f"{ns}.safetensors"

    # ------------------------------------------------------------------ storage: put / publish
    def _check_writable(self) -> None:
        if self.read_only:  # nothing is attempted (a read-only mount, or opened read-only on a full disk)
            raise self._translate(sqlite3.OperationalError(
                "attempt to write a readonly database" if self._read_only_why == "read-only" else
                "database or disk is full"), "put")

    def _find_duplicate(self, data: EntryData) -> str | None:
        with self._read() as c:
            row = c.execute("SELECT id FROM entries WHERE namespace=? AND prompt_digest=? AND seed=? AND request_key=?",
                            (data.namespace, _digest(data.prompt), str(int(data.seed)), data.request_key)).fetchone()
        return row[0] if row else None

    def _new_entry_id(self, namespace: str) -> str:
        return secrets.token_hex(8)

    def _publish(self, data: EntryData, entry_id: str, enc: EncodedEntry, created: float) -> tuple[str, bool]:
        """The entry file is written to ``tmp/``, fsynced and renamed into ``entries/``, then the row, embedding
        and change record are committed in one transaction (see the module docstring: durability)."""
        ns = data.namespace
        final = self._entry_path(ns, entry_id)
        final.parent.mkdir(exist_ok=True)
        self._ns_dir(ns)  # re-check after mkdir: a link planted meanwhile is refused
        _atomic_write(self.root, final, enc.blob, self.durable, fault=self._fault)
        try:
            with self._write() as c:
                catalog.ensure_namespace(c, ns, data.model_fingerprint, data.config, int(enc.embedding.shape[0]))
                catalog.insert_row(c, entry_id, ns, data.prompt, _digest(data.prompt), int(data.seed),
                                   len(enc.blob), enc.meta_digest,
                                   work_of(data.config.steps, data.config.probe_steps, data.config.latent_shape),
                                   enc.embedding, created, request_key=data.request_key, answer=bool(data.answer_of))
        except sqlite3.IntegrityError:
            # Either another process stored the same request first, or its open-time scan adopted *this* file
            # (renamed, not yet committed: a forward clock jump, or this writer stalled past the grace period).
            if not self._discard_unless_catalogued(entry_id, final):
                dup = self._find_duplicate(data)
                if dup:
                    return dup, False
                raise
        except BaseException:
            self._discard_unless_catalogued(entry_id, final)
            raise
        return entry_id, True

    def _discard_unless_catalogued(self, entry_id: str, final: Path) -> bool:
        """After a put's commit failed: True if a committed row already names ``entry_id`` (another process's scan
        adopted this very file), and the file is kept; else the file is removed and False returned. Checked and
        removed under the catalogue's write lock, so no scan can adopt the file in between; when even that lock
        cannot be had (full disk), a plain read decides, and when nothing can be read the file is kept (``scan``
        adopts it later): a put never deletes a file that a committed row may point to."""
        try:
            try:
                with self._write() as c:
                    if c.execute("SELECT 1 FROM entries WHERE id=?", (entry_id,)).fetchone() is not None:
                        return True
                    final.unlink(missing_ok=True)
                    return False
            except sqlite3.OperationalError:
                with self._read() as c:
                    if c.execute("SELECT 1 FROM entries WHERE id=?", (entry_id,)).fetchone() is not None:
                        return True
                final.unlink(missing_ok=True)
                return False
        except (sqlite3.Error, OSError, CacheError) as e:
            log.warning("carnator cache: could not check whether entry file %s was catalogued (%s); it is kept and "
                        "adopted by a later scan", final.name, e)
            return False

    def _find_request(self, request_key: str) -> str | None:
        with self._read() as c:
            row = c.execute("SELECT id FROM entries WHERE request_key=? ORDER BY answer, seq DESC LIMIT 1",
                            (request_key,)).fetchone()
        return row[0] if row else None

    # ------------------------------------------------------------------ deletes / eviction / purge
    def _unlink_entries(self, rows: list[tuple[int, str, str]], stage: str) -> None:
        """Remove entry files first (see the module docstring: crash- and full-disk-safe order)."""
        for i, (_, entry_id, ns) in enumerate(rows):
            try:
                self._entry_path(ns, entry_id).unlink(missing_ok=True)
            except (ValueError, CacheError):
                pass  # an invalid name or a planted link: nothing of ours to remove there
            self._sigs.discard(entry_id)
            if self._fault and i == 0:
                self._fault(stage)

    def _commit_deletes(self, what: str, body: Callable[[sqlite3.Connection], None]) -> None:
        """Commit catalogue deletions after the files went; retried once on a full disk (the unlinks freed
        space); if it still fails the rows stay until a reader or ``scan`` drops them (their files are gone)."""
        for attempt in (0, 1):
            try:
                with self._write() as c:
                    body(c)
                return
            except sqlite3.Error as e:
                if not catalog.is_full(e) and not ("locked" in str(e).lower() and attempt == 0):
                    raise
                if attempt:
                    log.warning("carnator cache: %s removed the files but could not update the catalogue (%s); "
                                "the stale rows are dropped by the next open or read", what, e)

    def _stored_bytes(self) -> int:
        with self._read() as c:
            return int(c.execute("SELECT COALESCE(SUM(nbytes), 0) FROM entries").fetchone()[0])

    def _eviction_lock(self) -> FileLock:
        return FileLock(str(self.root / "locks" / "evict.lock"), timeout=600)

    def _eviction_plan(self) -> tuple[int, list[Victim]]:
        with self._read() as c:  # one snapshot: the total and the order agree
            total = int(c.execute("SELECT COALESCE(SUM(nbytes), 0) FROM entries").fetchone()[0])
            order = [Victim(entry_id=entry_id, namespace=ns, nbytes=int(nbytes), priority=float(prio), ref=seq)
                     for seq, entry_id, ns, nbytes, prio in c.execute(
                         "SELECT seq, id, namespace, nbytes, priority FROM entries"
                         f" ORDER BY {EVICTION_ORDER[self.policy]}").fetchall()]
        return total, order

    def _remove_victims(self, victims: list[Victim], inflation: float | None) -> int:
        rows = [(v.ref, v.entry_id, v.namespace) for v in victims]
        self._unlink_entries(rows, "evict_unlinked")

        def body(c: sqlite3.Connection) -> None:
            still = [r for r in rows if c.execute("SELECT 1 FROM entries WHERE seq=?", (r[0],)).fetchone()]
            catalog.delete_rows(c, still)
            if inflation is not None:  # GDSF clock: L rises to the priority of what was evicted
                c.execute("UPDATE info SET value=CAST(MAX(CAST(value AS REAL), ?) AS TEXT) WHERE key='inflation'",
                          (float(inflation),))

        self._commit_deletes("eviction", body)
        return len(rows)

    def _remove(self, namespace: str, entry_id: str) -> bool:
        """File first, then its row."""
        with self._read() as c:
            row = c.execute("SELECT seq, id, namespace FROM entries WHERE id=?", (entry_id,)).fetchone()
        if row is None:
            return False
        self._unlink_entries([row], "delete_unlinked")
        self._commit_deletes(f"deleting {entry_id}", lambda c: catalog.delete_rows(
            c, [r for r in [row] if c.execute("SELECT 1 FROM entries WHERE seq=?", (r[0],)).fetchone()]))
        return True

    def _purge_storage(self, namespace: str | None) -> tuple[int, list[str]]:
        """Files go first (freeing space on a full disk), then the rows; then the namespaces' index files."""
        where, args = ("WHERE namespace=?", (namespace,)) if namespace else ("", ())
        with self._read() as c:
            rows = c.execute(f"SELECT seq, id, namespace FROM entries {where}", args).fetchall()
            namespaces = [r[0] for r in c.execute(f"SELECT namespace FROM namespaces {where}", args).fetchall()]
        self._unlink_entries(rows, "purge_unlinked")
        seqs = [r[0] for r in rows]

        def body(c: sqlite3.Connection) -> None:
            for i in range(0, len(seqs), 900):  # exactly what was unlinked: a concurrent write stays
                chunk = seqs[i : i + 900]
                marks = ",".join("?" * len(chunk))
                c.execute(f"DELETE FROM embeddings WHERE seq IN ({marks})", chunk)
                c.execute(f"DELETE FROM entries WHERE seq IN ({marks})", chunk)
            for ns in namespaces:
                left = c.execute("SELECT COUNT(*) FROM entries WHERE namespace=?", (ns,)).fetchone()[0]
                if left:  # written meanwhile by another process: keep the namespace, log the deletions
                    catalog.log_changes(c, ns, [("del", s) for s, _, n in rows if n == ns])
                    continue
                for table in ("changes", "namespaces", "counters"):  # a recreated namespace gets a fresh token
                    c.execute(f"DELETE FROM {table} WHERE namespace=?", (ns,))
            if not namespace:
                c.execute("UPDATE info SET value='0' WHERE key='inflation'")
            c.execute("UPDATE info SET value=CAST(value AS INTEGER)+1 WHERE key='content_version'")
            # Counted apart from content_version (which every write moves): ComfyUI re-runs a graph after a purge.
            c.execute("INSERT INTO info(key, value) VALUES ('purges', '1')"
                      " ON CONFLICT(key) DO UPDATE SET value=CAST(value AS INTEGER)+1")

        self._commit_deletes("purge", body)
        for ns in namespaces:
            with FileLock(str(self.root / "locks" / f"index-{ns}.lock"), timeout=600):
                self._index_path(ns).unlink(missing_ok=True)
        return len(rows), namespaces

    # ------------------------------------------------------------------ quarantine
    def _set_aside(self, ns: str, entry_id: str, reason: str, path: Path | None = None,
                   drop_row: bool = True) -> tuple[str, str | None]:
        """Move a bad entry file (``path``: one not catalogued yet) to ``quarantine/<namespace>/`` with a note of
        the reason, and drop its row unless not ``drop_row``."""
        src = path or self._entry_path(ns, entry_id)
        try:
            qdir = self._ns_dir(ns, "quarantine")
        except (ValueError, CacheError):
            qdir = self.root / "quarantine" / "_invalid"
        moved, failed = False, ""
        dst = qdir / src.name
        try:
            qdir.mkdir(parents=True, exist_ok=True)
            if dst.exists() or dst.is_symlink():
                dst = qdir / f"{src.stem}.{secrets.token_hex(4)}{src.suffix}"
            os.replace(src, dst)
            moved = True
        except FileNotFoundError:
            pass  # another process moved it first (and logged it)
        except OSError as e:
            failed = f"nowhere (could not move it aside: {e})"
        if moved:
            with self._best_effort("write a quarantine note"):
                _atomic_write(self.root, qdir / f"{dst.stem}.reason.txt",
                              f"{time.strftime('%Y-%m-%d %H:%M:%S')} {reason}\n".encode(), durable=False)
        removed = False
        if drop_row and self._conn is not None:
            with self._best_effort("remove a quarantined entry from the catalogue"):
                with self._write() as c:
                    row = c.execute("SELECT seq, id, namespace FROM entries WHERE id=?", (entry_id,)).fetchone()
                    if row is not None:
                        catalog.delete_rows(c, [row])
                        removed = True
        where = failed or str(dst)
        return where, (where if moved else "file already gone, catalogue row removed" if removed else None)

    # ------------------------------------------------------------------ read path
    def _row(self, entry_id: str) -> tuple | None:
        if not valid_entry_id(entry_id):
            raise EntryNotFoundError(f"{str(entry_id)[:100]!r} is not a Carnator cache entry id")
        with self._read() as c:
            return c.execute(
                "SELECT seq, namespace, prompt, seed, nbytes, meta_digest, created, hits FROM entries WHERE id=?",
                (entry_id,)).fetchone()

    def _vanished(self, entry_id: str, seq: int) -> EntryNotFoundError:
        """A row whose file is gone (deleted by another process right now, or behind the store's back): drop
        the row (best-effort) and report the entry as no longer cached."""
        with self._best_effort("drop a catalogue row whose file is gone"):
            with self._write() as c:
                row = c.execute("SELECT seq, id, namespace FROM entries WHERE seq=?", (seq,)).fetchone()
                if row is not None:
                    catalog.delete_rows(c, [row])
        self._sigs.discard(entry_id)
        return self._gone(entry_id)

    # ------------------------------------------------------------------ storage: reads and counters
    def _namespace_of(self, entry_id: str) -> str | None:
        row = self._row(entry_id)
        return row[1] if row else None

    def _read_entry(self, entry_id: str) -> StoredEntry | None:
        row = self._row(entry_id)
        if row is None:
            return None
        seq, ns, prompt, seed, nbytes, meta_digest, created, hits = row
        try:
            data = self._entry_path(ns, entry_id).read_bytes()
        except FileNotFoundError:
            raise self._vanished(entry_id, seq) from None
        return StoredEntry(namespace=ns, prompt=prompt, seed=int(seed), created=float(created), hits=int(hits),
                           nbytes=int(nbytes), meta_digest=meta_digest, blob=data, ref=seq)

    def _read_signature(self, entry_id: str, hint: Any = None) -> StoredSignature | None:
        """Reads just the ``sig.*`` tensors of the entry file."""
        row = self._row(entry_id)
        if row is None:
            return None
        seq, ns, nbytes, meta_digest = row[0], row[1], int(row[4]), row[5]
        path = self._entry_path(ns, entry_id)
        try:
            # No expect_size: the header describes the file's size and every tensor read is checksummed, so a
            # truncated file fails here, and a row whose size disagrees with a whole file is corrected.
            meta, meta_json, parts = read_entry_parts(path, None, prefix="sig.")
        except FileNotFoundError:
            raise self._vanished(entry_id, seq) from None
        except Exception as e:  # noqa: BLE001 - any defect of a file from disk means "quarantine"
            return StoredSignature(namespace=ns, signature=None, defect=f"{type(e).__name__}: {e}")
        try:
            if _digest(meta_json) != meta_digest:
                raise ValueError("metadata checksum mismatch")
            check_meta(meta, entry_id, ns)
            sig = signature_from(meta, {k: torch.from_numpy(v) for k, v in parts.items()})
        except Exception as e:  # noqa: BLE001
            return StoredSignature(namespace=ns, signature=None, defect=f"{type(e).__name__}: {e}")
        return StoredSignature(namespace=ns, signature=sig, memo_bytes=sum(a.nbytes for a in parts.values()),
                               nbytes=nbytes, actual_size=path.stat().st_size, ref=seq)

    def _correct_size(self, stored: Any, namespace: str, entry_id: str, recorded: int, actual: int) -> None:
        with self._best_effort("correct an entry's recorded size"):
            with self._write() as c:  # the LCBFU value per byte changes with the size; its clock L stays
                c.execute("UPDATE entries SET priority=priority-carnator_priority(0, hits, work, nbytes)"
                          "+carnator_priority(0, hits, work, ?), nbytes=? WHERE seq=? AND nbytes=?",
                          (actual, actual, stored, recorded))

    def _count_hit(self, namespace: str, entry_id: str) -> int:
        with self._best_effort("count a cache hit"):
            with self._write() as c:
                inflation = float(c.execute("SELECT value FROM info WHERE key='inflation'").fetchone()[0])
                c.execute("UPDATE entries SET hits=hits+1, last_access=?,"
                          " priority=carnator_priority(?, hits+1, work, nbytes) WHERE id=?",
                          (time.time(), inflation, entry_id))
                c.execute("INSERT INTO counters(namespace, lookups, hits) VALUES (?, 0, 1) ON CONFLICT(namespace)"
                          " DO UPDATE SET hits=hits+1", (namespace,))
                row = c.execute("SELECT hits FROM entries WHERE id=?", (entry_id,)).fetchone()
            return int(row[0]) if row else -1
        row = self._row(entry_id)  # not counted: what is recorded
        return int(row[7]) if row else -1

    def _count_lookup(self, namespace: str) -> None:
        with self._best_effort("count a cache lookup"):
            with self._write() as c:
                c.execute("INSERT INTO counters(namespace, lookups, hits) VALUES (?, 1, 0) ON CONFLICT(namespace)"
                          " DO UPDATE SET lookups=lookups+1", (namespace,))

    # ------------------------------------------------------------------ storage: recall
    def _namespace_model(self, namespace: str) -> str | None:
        with self._read() as c:
            row = c.execute("SELECT model_fingerprint FROM namespaces WHERE namespace=?", (namespace,)).fetchone()
        return row[0] if row else None

    def _ids_of(self, namespace: str, seqs: list[int]) -> dict[int, str]:
        with self._lock:
            return dict(self._require_conn().execute(
                f"SELECT seq, id FROM entries WHERE namespace=? AND seq IN ({','.join('?' * len(seqs))})",
                (namespace, *seqs)).fetchall())

    def _recall_rows(self, namespace: str, ids: list[str]) -> dict[str, tuple[str, int, Any]]:
        with self._lock:
            return {r[0]: (r[1], int(r[2]), None) for r in self._require_conn().execute(
                f"SELECT id, prompt, seed FROM entries WHERE id IN ({','.join('?' * len(ids))})", ids).fetchall()}

    def _fetch_vectors(self, namespace: str, seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        out_ids, out_vecs = [], []
        with self._lock:
            for chunk in _chunks([int(s) for s in seqs]):
                for seq, blob in self._require_conn().execute(
                    f"SELECT seq, vec FROM embeddings WHERE seq IN ({','.join('?' * len(chunk))})", chunk
                ):
                    out_ids.append(seq)
                    out_vecs.append(np.frombuffer(blob, dtype=np.float32))
        if not out_ids:
            return np.zeros(0, np.int64), np.zeros((0, 0), np.float32)
        dims = {len(v) for v in out_vecs}
        if len(dims) != 1:
            raise CacheError("catalogue embeddings of one namespace have different sizes; run Store.verify()")
        return np.asarray(out_ids, np.int64), np.stack(out_vecs)

    # ------------------------------------------------------------------ index maintenance
    def _sync(self, ns: str) -> _NsIndex | None:
        """This process's index of ``ns``, brought up to the committed state (caller holds self._lock)."""
        rebuild_reason = None
        built = False
        with self._read() as c:
            row = c.execute("SELECT token, generation, index_generation, dim FROM namespaces WHERE namespace=?",
                            (ns,)).fetchone()
            if row is None:
                self._indexes.pop(ns, None)
                return None
            token, gen, index_gen = row[0], int(row[1]), int(row[2])
            st = self._indexes.get(ns)
            if st is not None and st.token == token and st.generation == gen:
                return st
            if st is not None and st.token == token and st.generation < gen:
                if self._apply_changes(c, ns, st, gen):
                    st.generation = gen
                else:
                    st = None
            else:
                st = None
            if st is None and index_gen >= 0:
                st, why = self._load_index_file(c, ns, token, gen, int(row[3]))
                if st is None:
                    rebuild_reason = why
            if st is None:
                st = self._build_from_catalog(c, ns)
                built = True
                if rebuild_reason:
                    log.warning("carnator cache: index file of namespace %s unusable (%s); rebuilt from %d entries",
                                ns, rebuild_reason, st.index.ntotal)
            self._indexes[ns] = st
        if st.index.needs_rebuild(self.index_params):
            with self._read() as c:
                st = self._build_from_catalog(c, ns)
            self._indexes[ns] = st
            built = True
        # A freshly built IVF index is written at once (rebuilding it costs seconds to minutes at scale).
        with self._best_effort("persist a retrieval index"):
            self._persist(ns, st, force=built, index_gen=index_gen)
        return st

    def _apply_changes(self, c: sqlite3.Connection, ns: str, st: _NsIndex, gen: int) -> bool:
        """Apply change-log rows (st.generation, gen] to st.index; False if the log has a gap (pruned) or the
        catalogue disagrees, in which case the caller reloads."""
        rows = c.execute("SELECT generation, op, seq FROM changes WHERE namespace=? AND generation>? AND generation<=?"
                         " ORDER BY generation", (ns, st.generation, gen)).fetchall()
        if len(rows) != gen - st.generation or (rows and int(rows[0][0]) != st.generation + 1):
            return False
        added: dict[int, None] = {}
        removed: set[int] = set()
        for _, op, seq in rows:
            if op == "add":
                added[int(seq)] = None
                removed.discard(int(seq))
            elif int(seq) in added:
                del added[int(seq)]
            else:
                removed.add(int(seq))
        if added:
            vecs = {}
            for chunk in _chunks(list(added)):
                for seq, blob in c.execute(
                    f"SELECT seq, vec FROM embeddings WHERE seq IN ({','.join('?' * len(chunk))})", chunk
                ):
                    vecs[int(seq)] = np.frombuffer(blob, dtype=np.float32)
            if len(vecs) != len(added) or any(v.shape[0] != st.index.dim for v in vecs.values()):
                return False
        if removed:
            st.index.remove(np.fromiter(removed, dtype=np.int64))
        if added:
            ids = np.fromiter(added, dtype=np.int64)
            st.index.add(ids, np.stack([vecs[int(i)] for i in ids]))
        return True

    def _build_from_catalog(self, c: sqlite3.Connection, ns: str) -> _NsIndex:
        """Index every entry of ``ns`` as of the read transaction ``c`` (token and generation read in it too)."""
        token, gen, dim = c.execute("SELECT token, generation, dim FROM namespaces WHERE namespace=?", (ns,)).fetchone()
        dim = int(dim)
        ids, vecs, bad = [], [], []
        for seq, entry_id, blob in c.execute(
            "SELECT e.seq, e.id, m.vec FROM entries e LEFT JOIN embeddings m ON m.seq=e.seq"
            " WHERE e.namespace=? AND e.answer=0", (ns,)
        ):
            if blob is None or len(blob) != dim * 4:
                bad.append(entry_id)
                continue
            ids.append(seq)
            vecs.append(np.frombuffer(blob, dtype=np.float32))
        if bad:
            # Cannot repair inside a read transaction; verify() reports these rows.
            log.warning("carnator cache: %d catalogue rows of namespace %s have no valid embedding and are not "
                        "searchable; run Store.verify()", len(bad), ns)
        arr = np.stack(vecs) if vecs else np.zeros((0, dim), np.float32)
        index = VectorIndex.build(np.asarray(ids, np.int64), arr, dim, self.index_params)
        return _NsIndex(token=token, generation=int(gen), index=index)

    def _load_index_file(self, c: sqlite3.Connection, ns: str, token: str, gen: int, dim: int
                         ) -> tuple[_NsIndex | None, str]:
        if self._key is None:
            return None, "no index key on this machine"
        path = self._index_path(ns)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None, "index file is missing"
        try:
            index, body = VectorIndex.from_bytes(data, self._key, self.index_params)
        except IndexFileError as e:
            return None, str(e)
        if body.get("namespace") != ns or body.get("token") != token or index.dim != dim:
            return None, "index file belongs to another namespace state (purged and recreated?)"
        fgen = int(body.get("generation", -1))
        if fgen > gen:
            return None, f"index file is ahead of the catalogue (generation {fgen} > {gen})"
        st = _NsIndex(token=token, generation=fgen, index=index)
        if fgen < gen and not self._apply_changes(c, ns, st, gen):
            return None, "index file is older than the change log"
        st.generation = gen
        return st, ""

    def _persist(self, ns: str, st: _NsIndex, *, force: bool, index_gen: int | None = None) -> None:
        """Write the namespace's index file when forced or enough changes accumulated, then prune the change log up
        to it. Small flat namespaces are not persisted (rebuilding is as cheap) and only get their log trimmed; a flat
        index chosen above flat_max (unstructured embeddings) is persisted like an IVF one."""
        if (st.index.kind == "flat" and not st.index.trained_n) or self._key is None:
            self._trim_log(ns, st.generation)
            return
        every = self.index_params.persist_every or max(64, st.index.ntotal // 16)
        if not force and index_gen is not None and st.generation - index_gen < every:
            return
        lock = FileLock(str(self.root / "locks" / f"index-{ns}.lock"), timeout=600)
        with lock:
            with self._read() as c:
                row = c.execute("SELECT token, index_generation FROM namespaces WHERE namespace=?", (ns,)).fetchone()
            if row is None or row[0] != st.token or int(row[1]) > st.generation:
                return  # purged meanwhile, or another process already wrote a newer state
            if int(row[1]) == st.generation and not force and self._index_path(ns).exists():
                return  # this state is already on disk (force: ours was rebuilt because the file was unusable)
            blob = st.index.to_bytes(self._key, {"namespace": ns, "token": st.token, "generation": st.generation})
            _atomic_write(self.root, self._index_path(ns), blob, durable=False)
            with self._write() as c:
                c.execute("UPDATE namespaces SET index_generation=? WHERE namespace=? AND token=? AND"
                          " index_generation<?", (st.generation, ns, st.token, st.generation))
                c.execute("DELETE FROM changes WHERE namespace=? AND generation<=?", (ns, st.generation))

    def _trim_log(self, ns: str, gen: int) -> None:
        """Bound the change log of namespaces without a persisted index: keep the last CHANGE_LOG_KEEP rows
        (a process further behind rebuilds from the catalogue, which is cheap at flat-index sizes)."""
        with self._read() as c:
            low = c.execute("SELECT MIN(generation) FROM changes WHERE namespace=?", (ns,)).fetchone()[0]
        if low is None or gen - int(low) < 2 * CHANGE_LOG_KEEP:
            return
        with self._best_effort("trim the change log"):
            with self._write() as c:
                c.execute("DELETE FROM changes WHERE namespace=? AND generation<=?", (ns, gen - CHANGE_LOG_KEEP))

    # ------------------------------------------------------------------ scan / verify / stats
    @public
    def scan(self, grace_s: float | None = None) -> dict[str, int]:
        """Recover after crashes (run at open). Older than ``grace_s`` (default: the store's grace period, so
        in-flight writes of other processes are never touched): our own temp files in ``tmp/`` are removed, and
        entry files without a catalogue row are adopted (valid) or quarantined (invalid) — never deleted. Rows
        whose file is missing are dropped. Files that are not ours by name are left alone. Returns counts."""
        grace = self.grace_s if grace_s is None else float(grace_s)
        now = self._clock()
        out = {"tmp_removed": 0, "orphans_adopted": 0, "orphans_quarantined": 0, "missing_rows_removed": 0,
               "foreign_files": 0}

        def old(p: Path) -> bool:
            try:
                return now - p.lstat().st_mtime >= grace
            except FileNotFoundError:
                return False

        for p in (self.root / "tmp").iterdir():
            if not _TMP_RE.match(p.name) or p.is_symlink() or not p.is_file():
                out["foreign_files"] += 1
                continue
            if old(p):
                p.unlink(missing_ok=True)
                out["tmp_removed"] += 1
        with self._read() as c:
            rows = c.execute("SELECT seq, id, namespace FROM entries").fetchall()
        known = {(ns, i) for _, i, ns in rows}
        for d in (self.root / "entries").iterdir():
            if not valid_namespace(d.name) or d.is_symlink() or not d.is_dir():
                out["foreign_files"] += 1
                continue
            for p in d.iterdir():
                if not _ENTRY_FILE_RE.match(p.name) or p.is_symlink():
                    out["foreign_files"] += 1
                    continue
                if (d.name, p.name[:16]) in known or not old(p):
                    continue
                try:
                    with self._write() as c:
                        self._adopt_into(c, p)
                    out["orphans_adopted"] += 1
                except CorruptEntryError:
                    out["orphans_quarantined"] += 1
                except FileNotFoundError:
                    pass  # removed meanwhile
        missing = []
        for seq, entry_id, ns in rows:
            try:
                if not self._entry_path(ns, entry_id).exists():
                    missing.append((seq, entry_id, ns))
            except (ValueError, CacheError):
                missing.append((seq, entry_id, ns))
        if missing:
            with self._best_effort("drop catalogue rows whose file is missing"):
                with self._write() as c:
                    still = [r for r in missing
                             if c.execute("SELECT 1 FROM entries WHERE seq=?", (r[0],)).fetchone() is not None]
                    catalog.delete_rows(c, still)
                for r in still:
                    self._sigs.discard(r[1])
                log.warning("carnator cache: removed %d catalogue rows whose entry file is missing", len(still))
                out["missing_rows_removed"] = len(still)
        if out["orphans_adopted"] or out["tmp_removed"]:
            log.info("carnator cache: removed %d stray temp files, adopted %d entry files written by interrupted "
                     "writes", out["tmp_removed"], out["orphans_adopted"])
        return out

    def _verify_storage(self) -> tuple[list[str], list[str], list[str], int]:
        """Catalogue rows against entry files, embeddings and indexes (persisted file + change log). Orphan files
        younger than the grace period are notes (they may be writes in flight)."""
        problems: list[str] = []
        notes: list[str] = []
        now = self._clock()
        with self._read() as c:
            rows = c.execute("SELECT seq, id, namespace, nbytes FROM entries").fetchall()
            answers = {r[0] for r in c.execute("SELECT seq FROM entries WHERE answer!=0").fetchall()}
            namespaces = [r[0] for r in c.execute("SELECT namespace FROM namespaces").fetchall()]
            emb_seqs = {r[0] for r in c.execute("SELECT seq FROM embeddings").fetchall()}
            ns_rows = {r[0]: r[1] for r in c.execute("SELECT namespace, dim FROM namespaces").fetchall()}
        seqs = {r[0] for r in rows} - answers  # answer-only entries are never searchable
        if seqs - emb_seqs:
            problems.append(f"{len(seqs - emb_seqs)} entries have no embedding row")
        if answers & emb_seqs:
            problems.append(f"{len(answers & emb_seqs)} answer-only entries have an embedding row (recallable)")
        if emb_seqs - seqs - answers:
            problems.append(f"{len(emb_seqs - seqs - answers)} embedding rows belong to no entry")
        if len({r[1] for r in rows}) != len(rows):
            problems.append("duplicate entry ids in the catalogue")
        for seq, entry_id, ns, nbytes in rows:
            if ns not in ns_rows:
                problems.append(f"entry {entry_id} is in unknown namespace {ns}")
            try:
                size = self._entry_path(ns, entry_id).stat().st_size
                if size != nbytes:
                    problems.append(f"entry {entry_id}: file is {size} bytes, catalogue says {nbytes}")
            except FileNotFoundError:
                problems.append(f"entry {entry_id}: file is missing")
            except (ValueError, CacheError) as e:
                problems.append(f"entry {entry_id}: {e}")
        known = {(r[2], r[1]) for r in rows}
        for p in (self.root / "entries").glob("*/*.safetensors"):
            if _ENTRY_FILE_RE.match(p.name) and (p.parent.name, p.stem) not in known:
                try:
                    young = now - p.stat().st_mtime < self.grace_s
                except FileNotFoundError:
                    continue
                (notes if young else problems).append(
                    f"uncommitted file {p.relative_to(self.root)}"
                    + (" (young: maybe a write in flight)" if young else " (scan() adopts it into the catalogue)"))
        with self._lock:
            for ns in namespaces:
                self._verify_index(ns, problems, notes)
        return problems, notes, [r[1] for r in rows], len(namespaces)

    def _verify_index(self, ns: str, problems: list[str], notes: list[str]) -> None:
        """Compare this process's index of ``ns`` (and the persisted file + change log) with the catalogue at the
        same generation; retried if other processes commit in between."""
        for _ in range(10):
            st = self._sync(ns)
            if st is None:
                return
            with self._read() as c:
                row = c.execute("SELECT token, generation, dim FROM namespaces WHERE namespace=?", (ns,)).fetchone()
                if row is None:
                    return
                if int(row[1]) != st.generation:
                    continue  # someone committed since the sync: try again
                want = {r[0] for r in c.execute("SELECT seq FROM entries WHERE namespace=? AND answer=0", (ns,))}
                fst, why = (None, "")
                if self._key is not None and self._index_path(ns).exists():
                    fst, why = self._load_index_file(c, ns, row[0], int(row[1]), int(row[2]))
                    if fst is None:
                        notes.append(f"namespace {ns}: index file not usable ({why}); it will be rebuilt")
            got = st.index.ids().tolist()
            if len(got) != len(set(got)):
                problems.append(f"namespace {ns}: index holds duplicate ids")
            if set(got) != want:
                problems.append(f"namespace {ns}: index has {len(got)} ids, catalogue {len(want)} entries "
                                f"({len(set(got) - want)} extra, {len(want - set(got))} missing)")
            if fst is not None and set(fst.index.ids().tolist()) != want:
                problems.append(f"namespace {ns}: persisted index + change log disagree with the entries")
            return
        notes.append(f"namespace {ns}: index not checked (the namespace kept changing)")

    def _stats_parts(self, namespace: str | None) -> tuple[list[NamespaceCounts], int, int, int, int, int]:
        where, args = ("WHERE n.namespace=?", (namespace,)) if namespace else ("", ())
        with self._read() as c:
            ns_rows = c.execute(
                "SELECT n.namespace, n.model_fingerprint, n.config_json, COUNT(e.seq), COALESCE(SUM(e.nbytes), 0),"
                " COALESCE(SUM(e.answer), 0) FROM namespaces n LEFT JOIN entries e ON e.namespace=n.namespace"
                f" {where} GROUP BY n.namespace"
                " ORDER BY n.namespace", args).fetchall()
            counters = {r[0]: (int(r[1]), int(r[2]))
                        for r in c.execute("SELECT namespace, lookups, hits FROM counters")}
        per: list[NamespaceCounts] = [(ns, fp, json.loads(cfg_json), int(n), int(b), int(a),
                                       *counters.get(ns, (0, 0))) for ns, fp, cfg_json, n, b, a in ns_rows]
        if namespace:
            lookups, hits = counters.get(namespace, (0, 0))
        else:
            lookups, hits = sum(v[0] for v in counters.values()), sum(v[1] for v in counters.values())
        return (per, lookups, hits, sum(1 for _ in (self.root / "quarantine").glob("*/*.safetensors")),
                sum(p.stat().st_size for p in self.root.glob(CATALOG + "*") if p.is_file()),
                sum(p.stat().st_size for p in (self.root / "index").glob("*.safetensors")))

    @property
    def _where(self) -> str:
        return str(self.root)

    @public
    def content_version(self) -> int:
        """A counter that changes whenever any entry is added or removed (any process)."""
        with self._read() as c:
            return int(c.execute("SELECT value FROM info WHERE key='content_version'").fetchone()[0])

    @public
    def purge_count(self) -> int:
        """How many purges this cache has seen (any process; 0 before the first)."""
        with self._read() as c:
            row = c.execute("SELECT value FROM info WHERE key='purges'").fetchone()
        return int(row[0]) if row else 0

    @public
    def namespaces(self) -> list[str]:
        with self._read() as c:
            return [r[0] for r in c.execute("SELECT namespace FROM namespaces ORDER BY namespace")]

    @public
    def entry_ids(self, namespace: str | None = None) -> list[str]:
        where, args = ("WHERE namespace=?", (namespace,)) if namespace else ("", ())
        with self._read() as c:
            return [r[0] for r in c.execute(f"SELECT id FROM entries {where} ORDER BY seq", args)]

# ---------------------------------------------------------------------------------------------- helpers
def _writable(root: Path) -> bool:
    """Whether this process may create files in ``root`` (False on a read-only mount or without permission)."""
    return os.access(root, os.W_OK | os.X_OK)


def _disk_full(root: Path) -> bool:
    """Less than 1 MiB free where the cache lives (SQLite's WAL and shared memory need more than that)."""
    try:
        return shutil.disk_usage(root).free < (1 << 20)
    except OSError:
        return False


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _chunks(seq: list[int], n: int = 900) -> Iterator[list[int]]:
    for i in range(0, len(seq), n):
        yield seq[i : i + n]


def _atomic_write(root: Path, final: Path, blob: bytes, durable: bool,
                  fault: Callable[[str], None] | None = None) -> None:
    """Write ``blob`` to ``final`` via a temp file in ``root/tmp`` and ``os.replace`` (atomic on POSIX). The temp
    name (``<stem>.<pid>.<8 hex>.tmp``) is what ``scan`` recognises as ours."""
    tmp_dir = root / "tmp"
    tmp_dir.mkdir(exist_ok=True)
    tmp = tmp_dir / f"{final.stem[:100]}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        if fault:
            fault("after_tmp_write")
        if final.is_symlink() or not final.parent.resolve().is_relative_to(root):
            raise CacheError(f"{final} resolves outside the cache directory; refusing to write there")
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fault:
        fault("after_rename")
    if durable:
        catalog.fsync_path(final.parent)


__all__ = [
    "CacheBudgetError", "CacheError", "CacheFullError", "CacheStats", "CatalogError", "CorruptEntryError", "Entry",
    "EntryData", "EntryNotFoundError", "NamespaceMismatchError", "NamespaceStats", "NotACacheDirectoryError", "Store",
    "VerifyReport", "adoption_problem", "default_key_path", "format_bytes",
]
