"""Carnator's on-disk cache store: one directory, shared safely by several ComfyUI processes on one machine.

Layout (everything below the store root)::

    carnator-cache.json                 format marker {"format": "carnator-cache", "version": 1}
    catalog.sqlite3 (+ -wal, -shm)      SQLite catalogue (WAL): entries, embeddings, namespaces, change log, counters
    entries/<namespace>/<id>.safetensors  one immutable file per entry: tensors + JSON metadata
    index/<namespace>.safetensors       persisted FAISS index (large namespaces only), HMAC-signed
    quarantine/<namespace>/<id>.*       corrupt entries moved out of the way, with a .reason.txt
    tmp/                                files being written (same filesystem, so os.replace is atomic)
    locks/                              filelock files (catalogue repair, index persistence)

Contracts
---------
* **Never pickle.** Tensors are safetensors, metadata JSON inside the safetensors header and SQLite rows. Entry
  files are parsed with safetensors / our own bounds-checked header reader; FAISS only ever parses index files
  whose HMAC verifies under a key kept outside the cache directory (see ``index.py``). SQLite runs with
  ``trusted_schema=OFF`` and a catalogue whose schema is not exactly ours (e.g. has triggers) is set aside and
  rebuilt from the entry files.
* **Namespaces = model x generation config** (``types.namespace_key``). ``EntryData`` derives its namespace
  from its own model fingerprint and config, and a namespace's first entry pins its fingerprint, config and
  embedding dimension: an entry that disagrees is refused. Retrieval only searches one namespace, so a
  mismatched entry is never returned.
* **Durability.** A write goes to ``tmp/``, is fsynced, renamed into ``entries/`` and only then committed to the
  catalogue in one transaction (row + embedding + change-log record). A crash leaves nothing, a stray temp
  file, or an uncommitted orphan file; ``scan()`` (run at open) removes those once older than a grace period
  (so in-flight writes of other processes are never touched). Deletes (eviction, purge) commit first and
  unlink afterwards, so a committed row never points at a missing file.
* **Corruption.** Every tensor's sha256 is in the entry's metadata, and the metadata's sha256 in the catalogue.
  A file that fails to parse, is truncated, or does not match is moved to ``quarantine/`` with one warning on
  the ``carnator`` logger, removed from the catalogue and reported to the caller as ``CorruptEntryError``;
  nothing else is touched. A corrupt catalogue is quarantined and rebuilt from the entry files.
* **Concurrency.** SQLite WAL + ``BEGIN IMMEDIATE`` serialise writers across processes (``busy_timeout`` 60 s);
  readers see consistent snapshots. Each process keeps its own in-memory FAISS index per namespace and
  brings it up to date from the change log (keyed by a per-namespace generation counter and a random token
  that changes on purge), so an index always agrees with the committed entries when a query runs.
* **Capacity.** ``max_bytes`` bounds the total size of entry files; after each write the lowest-value entries
  are evicted (``policy.py``: ``lcbfu`` by default, or ``lru``). An entry larger than the whole budget is refused.
* **Exact repeats.** An entry may carry the ``keys.request_key`` of the request whose dense output it holds
  (column ``entries.request_key``, indexed; ``""`` = none); ``find_request(key)`` finds it in one query.
  Duplicates are (namespace, prompt, seed, request key).
* **Hits.** ``candidates()`` counts a lookup per request; ``load(count_hit=True)`` or ``record_hit()`` counts a
  reuse (call exactly one of them per reuse). Hit rate = hits / lookups per namespace.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import secrets
import sqlite3
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import torch
from filelock import FileLock
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..types import BlockStructure, Candidate, Candidates, GenConfig, Signature, namespace_key
from .index import IndexFileError, IndexParams, VectorIndex, normalize_rows
from .policy import check_policy, priority, work_of

log = logging.getLogger("carnator")

STORE_FORMAT = "carnator-cache"
STORE_VERSION = 1
ENTRY_FORMAT = "carnator-entry"
ENTRY_VERSION = 1
CATALOG = "catalog.sqlite3"
MARKER = "carnator-cache.json"
ENV_KEY_FILE = "CARNATOR_INDEX_KEY_FILE"
DEFAULT_GRACE_S = 600.0  # files younger than this may be another process's write in flight
CHANGE_LOG_KEEP = 20000  # change-log rows kept per namespace that has no persisted index
_MAX_HEADER = 64 << 20

_NS_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_ID_RE = re.compile(r"^[0-9a-f]{16}$")
_KEY_RE = re.compile(r"^(|[0-9a-f]{16,64})$")
_TENSOR_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
_RESERVED = ("sig.", "blocks.")
_ALLOWED_DTYPES = {
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool,
}

_SCHEMA = [
    "CREATE TABLE info(key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE namespaces(namespace TEXT PRIMARY KEY, model_fingerprint TEXT NOT NULL, config_json TEXT NOT NULL,"
    " dim INTEGER NOT NULL, token TEXT NOT NULL, generation INTEGER NOT NULL, index_generation INTEGER NOT NULL,"
    " created REAL NOT NULL)",
    "CREATE TABLE entries(seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, namespace TEXT NOT NULL,"
    " prompt TEXT NOT NULL, prompt_digest TEXT NOT NULL, seed TEXT NOT NULL, nbytes INTEGER NOT NULL,"
    " meta_digest TEXT NOT NULL, work REAL NOT NULL, priority REAL NOT NULL, created REAL NOT NULL,"
    " last_access REAL NOT NULL, hits INTEGER NOT NULL, request_key TEXT NOT NULL DEFAULT '',"
    " UNIQUE(namespace, prompt_digest, seed, request_key))",
    "CREATE INDEX entries_namespace ON entries(namespace)",
    "CREATE INDEX entries_request_key ON entries(request_key)",
    "CREATE INDEX entries_priority ON entries(priority)",
    "CREATE INDEX entries_last_access ON entries(last_access)",
    "CREATE TABLE embeddings(seq INTEGER PRIMARY KEY, vec BLOB NOT NULL)",
    "CREATE TABLE changes(namespace TEXT NOT NULL, generation INTEGER NOT NULL, op TEXT NOT NULL,"
    " seq INTEGER NOT NULL, PRIMARY KEY(namespace, generation)) WITHOUT ROWID",
    "CREATE TABLE counters(namespace TEXT PRIMARY KEY, lookups INTEGER NOT NULL, hits INTEGER NOT NULL)",
]


# ---------------------------------------------------------------------------------------------- errors
class CacheError(RuntimeError):
    """Base class of cache errors (messages say what is wrong and what to do)."""


class EntryNotFoundError(CacheError, KeyError):
    """The entry is not in the catalogue (never written, evicted, purged or quarantined meanwhile)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class CorruptEntryError(CacheError):
    """The entry's file was corrupt or truncated; it has been quarantined. Other entries are unaffected."""


class CacheBudgetError(CacheError):
    """An entry larger than the whole byte budget."""


class NamespaceMismatchError(CacheError):
    """A namespace key collision: same key, different model fingerprint / config / embedding dimension."""


# ---------------------------------------------------------------------------------------------- values
@dataclass(frozen=True, kw_only=True)
class EntryData:
    """What a finished generation contributes to the cache (input of ``Store.put``).

    namespace: derived from ``model_fingerprint`` x ``config`` (``types.namespace_key``); passing a different
               one is an error. model_fingerprint: includes LoRA/patches (the probe computes it).
    embedding: retrieval embedding [D] (normalised on write). signature: the request's Early Signature.
    tensors:   name -> torch.Tensor | np.ndarray, e.g. "latent_probe", "latent_final", "x0_probe", "noise"
               (names: letters, digits, ``_ . -``; not starting with "sig." / "blocks.", not "embedding").
    block_structure: recorded attention block structure of the dense run, if any.
    meta:      JSON-able extra metadata (e.g. the run report).
    request_key: ``keys.request_key`` of the request whose *dense* output ``tensors["latent_final"]`` is ("" when
               unknown or when the result came from reuse): ``Store.find_request`` answers exact repeats by it.
    """

    model_fingerprint: str
    config: GenConfig
    prompt: str
    seed: int
    embedding: np.ndarray
    signature: Signature
    tensors: Mapping[str, Any] = field(default_factory=dict)
    block_structure: BlockStructure | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)
    namespace: str = ""
    request_key: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.request_key, str) or not _KEY_RE.match(self.request_key):
            raise ValueError("EntryData.request_key must be '' or 16-64 lowercase hex digits (keys.request_key)")
        if not isinstance(self.model_fingerprint, str) or not self.model_fingerprint:
            raise ValueError("EntryData.model_fingerprint must be a non-empty string")
        if not isinstance(self.config, GenConfig):
            raise TypeError(f"EntryData.config must be a GenConfig, got {type(self.config).__name__}")
        if not isinstance(self.signature, Signature):
            raise TypeError(f"EntryData.signature must be a types.Signature, got {type(self.signature).__name__}")
        if self.block_structure is not None and not isinstance(self.block_structure, BlockStructure):
            raise TypeError("EntryData.block_structure must be a types.BlockStructure or None")
        if not isinstance(self.prompt, str):
            raise TypeError("EntryData.prompt must be a string")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)):
            raise TypeError(f"EntryData.seed must be an int, got {type(self.seed).__name__}")
        expected = namespace_key(self.model_fingerprint, self.config)
        if self.namespace and self.namespace != expected:
            raise ValueError(
                f"EntryData.namespace {self.namespace!r} does not match namespace_key(model_fingerprint, config) = "
                f"{expected!r}; leave it empty to derive it"
            )
        object.__setattr__(self, "namespace", expected)


@dataclass(frozen=True)
class Entry:
    """A loaded cache entry (immutable; tensors are fresh CPU tensors owned by the caller)."""

    entry_id: str
    namespace: str
    model_fingerprint: str
    config: GenConfig
    prompt: str
    seed: int
    created: float
    hits: int
    nbytes: int
    embedding: np.ndarray
    signature: Signature
    tensors: Mapping[str, torch.Tensor]
    block_structure: BlockStructure | None
    meta: Mapping[str, Any]

    def cached_run(self) -> Any:
        """This entry as ``reuse.CachedRun`` (needs tensors "latent_final" and "x0_probe")."""
        from ..reuse import CachedRun  # local: reuse is a sibling core module, keep import graph acyclic

        missing = [k for k in ("latent_final", "x0_probe") if k not in self.tensors]
        if missing:
            raise CacheError(f"cache entry {self.entry_id} has no {missing}: it was written without them and "
                             "cannot be reused for joint reuse")
        return CachedRun(entry_id=self.entry_id, final_latent=self.tensors["latent_final"],
                         x0_probe=self.tensors["x0_probe"], signature=self.signature, structure=self.block_structure)


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

    def to_meta(self) -> dict[str, Any]:
        return {
            "path": self.path, "entries": self.entries, "bytes": self.bytes, "max_bytes": self.max_bytes,
            "policy": self.policy, "lookups": self.lookups, "hits": self.hits, "hit_rate": self.hit_rate,
            "quarantined": self.quarantined, "catalog_bytes": self.catalog_bytes, "index_bytes": self.index_bytes,
            "namespaces": [dict(n.__dict__, config=dict(n.config)) for n in self.namespaces],
        }

    def to_text(self) -> str:
        budget = "unlimited" if not self.max_bytes else _fmt_bytes(self.max_bytes)
        lines = [
            f"Carnator cache at {self.path}",
            f"entries: {self.entries}  size: {_fmt_bytes(self.bytes)} (budget {budget}, policy {self.policy})",
            f"lookups: {self.lookups}  hits: {self.hits}  hit rate: {self.hit_rate:.1%}",
            f"catalogue: {_fmt_bytes(self.catalog_bytes)}  index files: {_fmt_bytes(self.index_bytes)}  "
            f"quarantined: {self.quarantined}",
        ]
        for n in self.namespaces:
            c = n.config
            lines.append(
                f"- {n.namespace}: {n.entries} entries, {_fmt_bytes(n.bytes)}, hits {n.hits}/{n.lookups} "
                f"({n.hit_rate:.1%}) [{c.get('arch')} {tuple(c.get('latent_shape', ()))} {c.get('steps')} steps "
                f"{c.get('sampler')}/{c.get('scheduler')} cfg {c.get('cfg')}]"
            )
        return "\n".join(lines)


@dataclass(frozen=True)
class VerifyReport:
    """Result of ``Store.verify``: ``ok`` iff ``problems`` is empty; ``notes`` are harmless observations."""

    ok: bool
    entries: int
    namespaces: int
    problems: tuple[str, ...]
    notes: tuple[str, ...] = ()


@dataclass
class _NsIndex:
    token: str
    generation: int
    index: VectorIndex


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def _sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _jsonable(obj: Any, where: str = "meta") -> Any:
    """A JSON-able copy of ``obj`` (numpy/torch scalars unwrapped); raises ValueError naming the bad key."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return obj.item()
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v, f"{where}.{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    raise ValueError(f"{where} is a {type(obj).__name__}, which cannot be stored as JSON metadata; "
                     "put tensors in EntryData.tensors and plain values in meta")


def _to_tensor(name: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu")
    elif isinstance(value, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(value))
    else:
        raise TypeError(f"tensor {name!r} is a {type(value).__name__}; give a torch.Tensor or numpy array")
    if t.dtype not in _ALLOWED_DTYPES:
        raise TypeError(f"tensor {name!r} has dtype {t.dtype}, which the cache does not store "
                        f"(use one of {sorted(_dtype_name(torch.empty(0, dtype=d)) for d in _ALLOWED_DTYPES)})")
    return t.contiguous()


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


# ---------------------------------------------------------------------------------------------- the store
class Store:
    """The cache store. Open with ``Store.open(path)``; one instance per process and directory is enough
    (it is thread-safe); several processes may open the same directory."""

    def __init__(self, root: Path, *, max_bytes: int | None, policy: str, index_params: IndexParams,
                 key: bytes | None, grace_s: float, durable: bool) -> None:
        self.root = root
        self.max_bytes = int(max_bytes) if max_bytes else None
        self.policy = check_policy(policy)
        self.index_params = index_params
        self.grace_s = float(grace_s)
        self.durable = bool(durable)
        self._key = key
        self._lock = threading.RLock()
        self._indexes: dict[str, _NsIndex] = {}
        self._sigs: OrderedDict[str, tuple[Signature, int]] = OrderedDict()
        self._sig_bytes = 0
        self._sig_budget = 256 << 20
        # Fault injection for crash tests: called with a stage name ("after_tmp_write", "after_rename",
        # "after_commit") during put(); a test sets it to kill the process at that point.
        self._fault: Callable[[str], None] | None = None
        self._conn: sqlite3.Connection = None  # type: ignore[assignment]

    # ------------------------------------------------------------------ open / close
    @classmethod
    def open(cls, path: str | os.PathLike, *, max_bytes: int | None = None, policy: str = "lcbfu",
             index_params: IndexParams | None = None, key_path: str | os.PathLike | None = None,
             grace_s: float = DEFAULT_GRACE_S, durable: bool = True) -> "Store":
        """Open (creating if needed) the store at ``path``.

        max_bytes: byte budget of entry files for this process's writes (None = unlimited).
        policy: "lcbfu" (default) or "lru". index_params: FAISS index choices. key_path: index-signing key
        (default ``default_key_path()``; must be outside the store). grace_s: age after which stray temp/orphan
        files are cleaned. durable: fsync entry files before they are committed.
        Raises CacheError if ``path`` is not a Carnator cache directory of a supported version.
        """
        root = Path(path).expanduser().resolve()
        root.mkdir(parents=True, exist_ok=True)
        for sub in ("entries", "index", "quarantine", "tmp", "locks"):
            d = root / sub
            if d.is_symlink():
                raise CacheError(f"{d} is a symbolic link; a cache directory must not link elsewhere. Remove it.")
            d.mkdir(exist_ok=True)
        marker = root / MARKER
        if marker.exists():
            try:
                m = json.loads(marker.read_text())
            except (OSError, ValueError) as e:
                raise CacheError(f"{marker} is unreadable ({e}); is {root} a Carnator cache directory?") from None
            if m.get("format") != STORE_FORMAT or m.get("version") != STORE_VERSION:
                raise CacheError(f"{root} holds cache format {m.get('format')!r} v{m.get('version')!r}; this Carnator "
                                 f"reads {STORE_FORMAT!r} v{STORE_VERSION}. Use another directory or upgrade Carnator.")
        else:
            _atomic_write(root, marker, json.dumps({"format": STORE_FORMAT, "version": STORE_VERSION}).encode(), False)
        kp = Path(key_path).expanduser() if key_path else default_key_path()
        key = None
        if kp.resolve().is_relative_to(root):
            log.warning("carnator cache: the index key %s is inside the cache directory; index files will not be "
                        "persisted (a copied cache directory must not carry its own key)", kp)
        else:
            key = _load_or_create_key(kp)
        store = cls(root, max_bytes=max_bytes, policy=policy, index_params=index_params or IndexParams(), key=key,
                    grace_s=grace_s, durable=durable)
        store._open_catalog()
        store.scan()
        return store

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None  # type: ignore[assignment]
            self._indexes.clear()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.root / CATALOG, timeout=60.0, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA busy_timeout=60000")
        conn.execute("PRAGMA trusted_schema=OFF")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    def _open_catalog(self) -> None:
        with FileLock(str(self.root / "locks" / "catalog.lock"), timeout=600):
            existed = (self.root / CATALOG).exists()
            problem = None
            try:
                conn = self._connect()
                rows = conn.execute("SELECT type, name, sql FROM sqlite_master").fetchall()
                if not rows:
                    conn.execute("BEGIN IMMEDIATE")
                    for ddl in _SCHEMA:
                        conn.execute(ddl)
                    conn.executemany("INSERT INTO info(key, value) VALUES (?, ?)",
                                     [("format", STORE_FORMAT), ("version", str(STORE_VERSION)), ("inflation", "0"),
                                      ("content_version", "0")])
                    conn.execute("COMMIT")
                    rows = conn.execute("SELECT type, name, sql FROM sqlite_master").fetchall()
                problem = _schema_problem(rows)
                if problem is None:
                    info = dict(conn.execute("SELECT key, value FROM info").fetchall())
                    if info.get("format") != STORE_FORMAT or info.get("version") != str(STORE_VERSION):
                        problem = f"catalogue is format {info.get('format')!r} v{info.get('version')!r}"
            except sqlite3.DatabaseError as e:
                if not _is_corruption(e):
                    # e.g. "database is locked" past the busy timeout: a healthy catalogue in use, never rebuild it
                    raise CacheError(f"cannot open the cache catalogue {self.root / CATALOG}: {e}. If another process "
                                     "holds a long transaction, retry; otherwise check file permissions.") from e
                problem = f"{type(e).__name__}: {e}"
                conn = None  # type: ignore[assignment]
            if problem is None:
                self._conn = conn
                return
            if conn is not None:
                conn.close()
            self._rebuild_catalog(problem if existed else "new catalogue")

    def _rebuild_catalog(self, reason: str) -> None:
        """Set the catalogue aside and rebuild it from the entry files (caller holds the catalogue lock)."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        qdir = self.root / "quarantine"
        for suffix in ("", "-wal", "-shm"):
            p = self.root / (CATALOG + suffix)
            if p.exists():
                os.replace(p, qdir / f"catalog-{stamp}-{os.getpid()}.sqlite3{suffix}")
        log.warning("carnator cache: catalogue %s was unusable (%s); moved to %s and rebuilding from the entry files",
                    self.root / CATALOG, reason, qdir)
        conn = self._connect()
        conn.execute("BEGIN IMMEDIATE")
        for ddl in _SCHEMA:
            conn.execute(ddl)
        conn.executemany("INSERT INTO info(key, value) VALUES (?, ?)",
                         [("format", STORE_FORMAT), ("version", str(STORE_VERSION)), ("inflation", "0"),
                          ("content_version", "0")])
        conn.execute("COMMIT")
        self._conn = conn
        adopted = 0
        for path in sorted((self.root / "entries").glob("*/*.safetensors")):
            ns, entry_id = path.parent.name, path.stem
            try:
                self._adopt(path, ns, entry_id)
                adopted += 1
            except CorruptEntryError:
                pass  # already quarantined and logged
        for p in (self.root / "index").glob("*.safetensors"):
            p.unlink(missing_ok=True)
        log.warning("carnator cache: catalogue rebuilt with %d entries", adopted)

    def _adopt(self, path: Path, ns: str, entry_id: str) -> None:
        """Insert a (valid) entry file into the catalogue; quarantine it if it is not valid."""
        try:
            if not _NS_RE.match(ns) or ".." in ns or not _ID_RE.match(entry_id):
                raise ValueError("file name is not a Carnator entry name")
            meta, meta_json, parts = _read_partial(path, ("embedding",))
            _check_meta(meta, entry_id, ns)
            emb = parts["embedding"]
            config = GenConfig.from_meta(meta["config"])
            if namespace_key(meta["model_fingerprint"], config) != ns:
                raise ValueError("metadata's model/config does not match the namespace directory")
            nbytes = path.stat().st_size
        except (ValueError, KeyError, TypeError, OSError) as e:
            raise self._quarantine(entry_id, ns, f"cannot adopt file: {e}", path=path) from None
        with self._write() as c:
            self._ensure_namespace(c, ns, meta["model_fingerprint"], config, int(emb.shape[0]))
            self._insert_row(c, entry_id, ns, str(meta["prompt"]), int(meta["seed"]), nbytes,
                             hashlib.sha256(meta_json.encode()).hexdigest(),
                             work_of(config.steps, config.probe_steps, config.latent_shape), emb,
                             float(meta.get("created", time.time())), request_key=_adopted_key(meta))

    # ------------------------------------------------------------------ transactions
    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            c = self._require_conn()
            c.execute("BEGIN IMMEDIATE")
            try:
                yield c
            except BaseException:
                c.execute("ROLLBACK")
                raise
            c.execute("COMMIT")

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            c = self._require_conn()
            c.execute("BEGIN")
            try:
                yield c
            finally:
                c.execute("COMMIT")

    def _require_conn(self) -> sqlite3.Connection:
        if self._conn is None:
            raise CacheError(f"the cache store at {self.root} is closed")
        return self._conn

    # ------------------------------------------------------------------ paths
    def _ns_dir(self, ns: str, top: str = "entries") -> Path:
        if not _NS_RE.match(ns) or ".." in ns:
            raise ValueError(f"invalid namespace {ns!r}")
        d = self.root / top / ns
        if d.exists() and not d.resolve().is_relative_to(self.root):
            raise CacheError(f"{d} resolves outside the cache directory (a symbolic link?); refusing to use it")
        return d

    def _entry_path(self, ns: str, entry_id: str) -> Path:
        if not _ID_RE.match(entry_id):
            raise ValueError(f"invalid entry id {entry_id!r}")
        return self._ns_dir(ns) / f"{entry_id}.safetensors"

    def _index_path(self, ns: str) -> Path:
        self._ns_dir(ns)  # validates the name
        return self.root / "index" / f"{ns}.safetensors"

    # ------------------------------------------------------------------ write path
    def put(self, data: EntryData) -> str:
        """Store one entry; returns its id. If an entry with the same namespace, prompt and seed exists, returns
        its id and writes nothing (a deterministic request is cached once). May evict other entries."""
        return self.put_with_status(data)[0]

    def put_with_status(self, data: EntryData) -> tuple[str, bool]:
        """Like ``put``; also says whether a new entry was written (False: an identical request was cached)."""
        if not isinstance(data, EntryData):
            raise TypeError(f"Store.put takes an EntryData, got {type(data).__name__}")
        ns = data.namespace
        self._ns_dir(ns)
        emb = normalize_rows(data.embedding)
        if emb.ndim != 1:
            raise ValueError(f"EntryData.embedding must be one vector [D], got shape {np.shape(data.embedding)}")
        prompt_digest = hashlib.sha256(data.prompt.encode()).hexdigest()
        seed = int(data.seed)
        existing = self._find_duplicate(ns, prompt_digest, seed, data.request_key)
        if existing:
            return existing, False
        entry_id = secrets.token_hex(8)
        now = time.time()
        tensors: dict[str, torch.Tensor] = {"embedding": torch.from_numpy(emb)}
        seen_storage: set[int] = set()
        for name, value in data.tensors.items():
            if not isinstance(name, str) or not _TENSOR_RE.match(name) or name == "embedding" or name.startswith(_RESERVED):
                raise ValueError(f"tensor name {name!r} is not allowed (letters, digits, '_.-'; not 'embedding', "
                                 "not starting with 'sig.' or 'blocks.')")
            t = _to_tensor(name, value)
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen_storage and t.numel():
                t = t.clone()  # safetensors refuses tensors sharing memory
            seen_storage.add(ptr)
            tensors[name] = t
        for name, arr in data.signature.to_tensors("sig.").items():
            tensors[name] = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
        block_meta = None
        if data.block_structure is not None:
            bs = data.block_structure
            keep = np.asarray(bs.keep, dtype=bool)
            if keep.ndim != 4 or keep.shape[0] != len(bs.layers):
                raise ValueError(f"block_structure.keep must be bool [L, H, Qb, Kb] with L = len(layers) = "
                                 f"{len(bs.layers)}, got shape {keep.shape}")
            # Bit-packed along the key-block axis: 8x smaller (a per-head Wan 480p/81f structure is ~88 MB as
            # bool, ~11 MB packed).
            tensors["blocks.keep"] = torch.from_numpy(np.ascontiguousarray(np.packbits(keep, axis=-1)))
            block_meta = {"layers": [int(x) for x in bs.layers], "block_size": int(bs.block_size),
                          "n_tokens": int(bs.n_tokens), "steps": [int(x) for x in bs.steps],
                          "shape": list(keep.shape), "packing": "packbits-last-axis"}
        meta = {
            "format": ENTRY_FORMAT, "version": ENTRY_VERSION, "id": entry_id, "namespace": ns,
            "model_fingerprint": data.model_fingerprint, "config": data.config.to_meta(), "prompt": data.prompt,
            "seed": seed, "created": now, "dim": int(emb.shape[0]), "signature": data.signature.to_meta(),
            "block_structure": block_meta, "meta": _jsonable(dict(data.meta)), "request_key": data.request_key,
            "tensors": {k: {"dtype": _dtype_name(t), "shape": list(t.shape), "sha256": _sha256(t)}
                        for k, t in tensors.items()},
        }
        meta_json = json.dumps(meta, sort_keys=True)
        blob = st_save(tensors, metadata={"carnator": meta_json})
        if self.max_bytes and len(blob) > self.max_bytes:
            raise CacheBudgetError(
                f"the entry is {_fmt_bytes(len(blob))} but the cache budget is {_fmt_bytes(self.max_bytes)}: "
                "raise max_gb on the cache loader (or 0 for no limit)")
        final = self._entry_path(ns, entry_id)
        final.parent.mkdir(exist_ok=True)
        _atomic_write(self.root, final, blob, self.durable, fault=self._fault)
        try:
            with self._write() as c:
                self._ensure_namespace(c, ns, data.model_fingerprint, data.config, int(emb.shape[0]))
                self._insert_row(c, entry_id, ns, data.prompt, seed, len(blob),
                                 hashlib.sha256(meta_json.encode()).hexdigest(),
                                 work_of(data.config.steps, data.config.probe_steps, data.config.latent_shape), emb, now,
                                 request_key=data.request_key)
        except sqlite3.IntegrityError:
            final.unlink(missing_ok=True)  # another process stored the same request first
            dup = self._find_duplicate(ns, prompt_digest, seed, data.request_key)
            if dup:
                return dup, False
            raise
        except BaseException:
            final.unlink(missing_ok=True)
            raise
        if self._fault:
            self._fault("after_commit")
        self._evict_if_needed(protect={entry_id})
        return entry_id, True

    def _find_duplicate(self, ns: str, prompt_digest: str, seed: int, request_key: str = "") -> str | None:
        with self._lock:
            row = self._require_conn().execute(
                "SELECT id FROM entries WHERE namespace=? AND prompt_digest=? AND seed=? AND request_key=?",
                (ns, prompt_digest, str(seed), request_key)).fetchone()
        return row[0] if row else None

    def find_request(self, request_key: str) -> str | None:
        """The id of the entry holding the dense output of exactly this request (``EntryData.request_key``), or
        None. One indexed query; counts nothing (the caller loads the entry with ``count_hit``)."""
        if not request_key or not isinstance(request_key, str) or not _KEY_RE.match(request_key):
            return None
        with self._lock:
            row = self._require_conn().execute(
                "SELECT id FROM entries WHERE request_key=? ORDER BY seq DESC LIMIT 1", (request_key,)).fetchone()
        return row[0] if row else None

    def _ensure_namespace(self, c: sqlite3.Connection, ns: str, model_fp: str, config: GenConfig, dim: int) -> None:
        row = c.execute("SELECT model_fingerprint, config_json, dim FROM namespaces WHERE namespace=?", (ns,)).fetchone()
        cfg_json = json.dumps(config.to_meta(), sort_keys=True)
        if row is None:
            c.execute("INSERT INTO namespaces(namespace, model_fingerprint, config_json, dim, token, generation,"
                      " index_generation, created) VALUES (?, ?, ?, ?, ?, 0, -1, ?)",
                      (ns, model_fp, cfg_json, dim, secrets.token_hex(8), time.time()))
            return
        if row[0] != model_fp or GenConfig.from_meta(json.loads(row[1])) != config:
            raise NamespaceMismatchError(
                f"namespace {ns} already holds entries of another model/config (fingerprint {row[0][:24]}...); "
                "this is a fingerprint collision: purge the namespace or use another cache directory")
        if int(row[2]) != dim:
            raise NamespaceMismatchError(
                f"namespace {ns} holds embeddings of dimension {row[2]}, this entry has {dim}: the text encoder "
                "changed for the same model/config; purge the namespace or use another cache directory")

    def _insert_row(self, c: sqlite3.Connection, entry_id: str, ns: str, prompt: str, seed: int, nbytes: int,
                    meta_digest: str, work: float, emb: np.ndarray, created: float, request_key: str = "") -> None:
        inflation = float(c.execute("SELECT value FROM info WHERE key='inflation'").fetchone()[0])
        cur = c.execute(
            "INSERT INTO entries(id, namespace, prompt, prompt_digest, seed, nbytes, meta_digest, work, priority,"
            " created, last_access, hits, request_key) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0, ?)",
            (entry_id, ns, prompt, hashlib.sha256(prompt.encode()).hexdigest(), str(seed), nbytes, meta_digest, work,
             priority(inflation, 0, work, nbytes), created, created, request_key))
        seq = cur.lastrowid
        c.execute("INSERT INTO embeddings(seq, vec) VALUES (?, ?)", (seq, np.ascontiguousarray(emb, np.float32).tobytes()))
        self._log_changes(c, ns, [("add", seq)])

    def _log_changes(self, c: sqlite3.Connection, ns: str, ops: list[tuple[str, int]]) -> None:
        gen = int(c.execute("SELECT generation FROM namespaces WHERE namespace=?", (ns,)).fetchone()[0])
        c.executemany("INSERT INTO changes(namespace, generation, op, seq) VALUES (?, ?, ?, ?)",
                      [(ns, gen + i + 1, op, seq) for i, (op, seq) in enumerate(ops)])
        c.execute("UPDATE namespaces SET generation=? WHERE namespace=?", (gen + len(ops), ns))
        c.execute("UPDATE info SET value=CAST(value AS INTEGER)+1 WHERE key='content_version'")

    # ------------------------------------------------------------------ deletes / eviction / purge
    def _delete_rows(self, c: sqlite3.Connection, rows: list[tuple[int, str, str]]) -> None:
        """Delete catalogue rows (seq, id, namespace) and log the deletions (caller holds a write transaction)."""
        by_ns: dict[str, list[int]] = {}
        for seq, _, ns in rows:
            by_ns.setdefault(ns, []).append(int(seq))
        for ns, seqs in by_ns.items():
            for chunk in _chunks(seqs):
                marks = ",".join("?" * len(chunk))
                c.execute(f"DELETE FROM entries WHERE seq IN ({marks})", chunk)
                c.execute(f"DELETE FROM embeddings WHERE seq IN ({marks})", chunk)
            self._log_changes(c, ns, [("del", s) for s in seqs])
        for _, entry_id, _ in rows:
            self._forget_sig(entry_id)

    def _evict_if_needed(self, protect: set[str]) -> int:
        if not self.max_bytes:
            return 0
        victims: list[tuple[int, str, str]] = []
        with self._write() as c:
            total = int(c.execute("SELECT COALESCE(SUM(nbytes), 0) FROM entries").fetchone()[0])
            if total <= self.max_bytes:
                return 0
            order = "priority ASC, seq ASC" if self.policy == "lcbfu" else "last_access ASC, seq ASC"
            top_priority = None
            for seq, entry_id, ns, nbytes, prio in c.execute(
                f"SELECT seq, id, namespace, nbytes, priority FROM entries ORDER BY {order}"
            ).fetchall():
                if total <= self.max_bytes:
                    break
                if entry_id in protect:
                    continue
                victims.append((seq, entry_id, ns))
                total -= int(nbytes)
                top_priority = prio if top_priority is None else max(top_priority, prio)
            if not victims:
                return 0
            self._delete_rows(c, victims)
            if top_priority is not None:  # GDSF clock: L rises to the priority of what was evicted
                c.execute("UPDATE info SET value=CAST(MAX(CAST(value AS REAL), ?) AS TEXT) WHERE key='inflation'",
                          (float(top_priority),))
        for _, entry_id, ns in victims:
            self._entry_path(ns, entry_id).unlink(missing_ok=True)
        log.info("carnator cache: evicted %d entr%s (%s policy) to stay within %s", len(victims),
                 "y" if len(victims) == 1 else "ies", self.policy, _fmt_bytes(self.max_bytes))
        return len(victims)

    def delete(self, entry_id: str) -> bool:
        """Remove one entry (row first, then file). Returns False if it was not there."""
        with self._write() as c:
            row = c.execute("SELECT seq, id, namespace FROM entries WHERE id=?", (entry_id,)).fetchone()
            if row is None:
                return False
            self._delete_rows(c, [row])
        self._entry_path(row[2], row[1]).unlink(missing_ok=True)
        return True

    def purge(self, namespace: str | None = None) -> int:
        """Delete every entry (``namespace=None``) or those of one namespace, their index files and counters.
        Returns how many entries were removed."""
        where, args = ("WHERE namespace=?", (namespace,)) if namespace else ("", ())
        if namespace:
            self._ns_dir(namespace)
        with self._write() as c:
            rows = c.execute(f"SELECT seq, id, namespace FROM entries {where}", args).fetchall()
            namespaces = [r[0] for r in c.execute(f"SELECT namespace FROM namespaces {where}", args).fetchall()]
            c.execute(f"DELETE FROM embeddings WHERE seq IN (SELECT seq FROM entries {where})", args)
            c.execute(f"DELETE FROM entries {where}", args)
            c.execute(f"DELETE FROM changes {where}", args)
            c.execute(f"DELETE FROM namespaces {where}", args)  # a recreated namespace gets a fresh token
            c.execute(f"DELETE FROM counters {where}", args)
            if not namespace:
                c.execute("UPDATE info SET value='0' WHERE key='inflation'")
            c.execute("UPDATE info SET value=CAST(value AS INTEGER)+1 WHERE key='content_version'")
        for _, entry_id, ns in rows:
            self._entry_path(ns, entry_id).unlink(missing_ok=True)
            self._forget_sig(entry_id)
        for ns in namespaces:
            self._indexes.pop(ns, None)
            with FileLock(str(self.root / "locks" / f"index-{ns}.lock"), timeout=600):
                self._index_path(ns).unlink(missing_ok=True)
        log.info("carnator cache: purged %d entries (%s)", len(rows), f"namespace {namespace}" if namespace else "all")
        return len(rows)

    # ------------------------------------------------------------------ quarantine
    def _quarantine(self, entry_id: str, ns: str, reason: str, path: Path | None = None) -> CorruptEntryError:
        """Move a bad entry file aside, drop its row, log one line; returns the error to raise."""
        src = path or self._entry_path(ns, entry_id)
        qdir = self.root / "quarantine" / (ns if _NS_RE.match(ns) and ".." not in ns else "_invalid")
        qdir.mkdir(parents=True, exist_ok=True)
        dst = qdir / src.name
        moved = False
        try:
            os.replace(src, dst)
            moved = True
            (qdir / f"{src.stem}.reason.txt").write_text(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {reason}\n")
        except FileNotFoundError:
            pass  # another process moved it first (and logged it)
        except OSError as e:
            reason += f" (could not move it aside: {e})"
        removed = False
        if self._conn is not None:
            with self._write() as c:
                row = c.execute("SELECT seq, id, namespace FROM entries WHERE id=?", (entry_id,)).fetchone()
                if row is not None:
                    self._delete_rows(c, [row])
                    removed = True
        self._forget_sig(entry_id)
        if moved or removed:
            log.warning("carnator cache: quarantined entry %s (namespace %s): %s -> %s; other entries are unaffected",
                        entry_id, ns, reason, dst if moved else "file already gone, catalogue row removed")
        return CorruptEntryError(
            f"cache entry {entry_id} is corrupt ({reason}); it was moved to {dst} and removed from the catalogue. "
            "Other entries are unaffected; the request continues without it.")

    # ------------------------------------------------------------------ read path
    def _row(self, entry_id: str) -> tuple | None:
        if not isinstance(entry_id, str) or not _ID_RE.match(entry_id):
            raise EntryNotFoundError(f"{entry_id!r} is not a Carnator cache entry id")
        with self._lock:
            return self._require_conn().execute(
                "SELECT seq, namespace, prompt, seed, nbytes, meta_digest, created, hits FROM entries WHERE id=?",
                (entry_id,)).fetchone()

    def _gone(self, entry_id: str) -> EntryNotFoundError:
        return EntryNotFoundError(f"cache entry {entry_id} is no longer in the cache (evicted, purged or "
                                  "quarantined meanwhile); retrieve candidates again")

    def load(self, entry_id: str, *, count_hit: bool = True) -> Entry:
        """Load and fully validate one entry. ``count_hit``: count this as a reuse (hits, recency, LCBFU value).
        Raises EntryNotFoundError (not in the catalogue) or CorruptEntryError (quarantined; others unaffected)."""
        row = self._row(entry_id)
        if row is None:
            raise self._gone(entry_id)
        seq, ns, prompt, seed, nbytes, meta_digest, created, hits = row
        path = self._entry_path(ns, entry_id)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            if self._row(entry_id) is None:
                raise self._gone(entry_id) from None
            raise self._quarantine(entry_id, ns, "its file is missing") from None
        try:
            if len(data) != nbytes:
                raise ValueError(f"file is {len(data)} bytes, the catalogue recorded {nbytes} (truncated?)")
            tensors = st_load(data)
            meta_json = _header_meta(data)
            if hashlib.sha256(meta_json.encode()).hexdigest() != meta_digest:
                raise ValueError("metadata checksum mismatch")
            meta = json.loads(meta_json)
            _check_meta(meta, entry_id, ns)
            manifest = meta["tensors"]
            if set(manifest) != set(tensors):
                raise ValueError(f"tensor set {sorted(tensors)} differs from the manifest {sorted(manifest)}")
            for name, t in tensors.items():
                m = manifest[name]
                if _dtype_name(t) != m["dtype"] or list(t.shape) != list(m["shape"]):
                    raise ValueError(f"tensor {name} is {_dtype_name(t)}{list(t.shape)}, manifest says "
                                     f"{m['dtype']}{m['shape']}")
                if _sha256(t) != m["sha256"]:
                    raise ValueError(f"tensor {name} checksum mismatch")
            config = GenConfig.from_meta(meta["config"])
            if namespace_key(meta["model_fingerprint"], config) != ns:
                raise ValueError("metadata's model/config does not match the entry's namespace")
            signature = _signature_from(meta, {k: v for k, v in tensors.items() if k.startswith("sig.")})
            block = _block_from(meta, tensors)
            embedding = tensors["embedding"].numpy()
            if embedding.ndim != 1 or embedding.shape[0] != int(meta["dim"]):
                raise ValueError(f"embedding has shape {tuple(embedding.shape)}, expected [{meta['dim']}]")
        except Exception as e:  # noqa: BLE001 - any defect of a file from disk means "quarantine"
            raise self._quarantine(entry_id, ns, f"{type(e).__name__}: {e}") from None
        if count_hit:
            hits = self._bump(entry_id, ns)
        user = {k: v for k, v in tensors.items() if k != "embedding" and not k.startswith(_RESERVED)}
        return Entry(entry_id=entry_id, namespace=ns, model_fingerprint=meta["model_fingerprint"], config=config,
                     prompt=prompt, seed=int(seed), created=float(created), hits=int(hits), nbytes=int(nbytes),
                     embedding=embedding, signature=signature, tensors=user, block_structure=block,
                     meta=meta.get("meta") or {})

    def load_signature(self, entry_id: str) -> Signature:
        """The entry's Early Signature only (reads just those tensors; cached per process)."""
        with self._lock:
            hit = self._sigs.get(entry_id)
            if hit is not None:
                self._sigs.move_to_end(entry_id)
                return hit[0]
        row = self._row(entry_id)
        if row is None:
            raise self._gone(entry_id)
        ns, nbytes, meta_digest = row[1], row[4], row[5]
        path = self._entry_path(ns, entry_id)
        try:
            meta, meta_json, parts = _read_partial(path, None, prefix="sig.", expect_size=nbytes)
        except FileNotFoundError:
            if self._row(entry_id) is None:
                raise self._gone(entry_id) from None
            raise self._quarantine(entry_id, ns, "its file is missing") from None
        except Exception as e:  # noqa: BLE001
            raise self._quarantine(entry_id, ns, f"{type(e).__name__}: {e}") from None
        try:
            if hashlib.sha256(meta_json.encode()).hexdigest() != meta_digest:
                raise ValueError("metadata checksum mismatch")
            _check_meta(meta, entry_id, ns)
            sig = _signature_from(meta, {k: torch.from_numpy(v) for k, v in parts.items()})
        except Exception as e:  # noqa: BLE001
            raise self._quarantine(entry_id, ns, f"{type(e).__name__}: {e}") from None
        size = sum(a.nbytes for a in parts.values())
        with self._lock:
            self._sigs[entry_id] = (sig, size)
            self._sig_bytes += size
            while self._sig_bytes > self._sig_budget and self._sigs:
                _, (_, s) = self._sigs.popitem(last=False)
                self._sig_bytes -= s
        return sig

    def _forget_sig(self, entry_id: str) -> None:
        with self._lock:
            hit = self._sigs.pop(entry_id, None)
            if hit is not None:
                self._sig_bytes -= hit[1]

    def _bump(self, entry_id: str, ns: str) -> int:
        with self._write() as c:
            inflation = float(c.execute("SELECT value FROM info WHERE key='inflation'").fetchone()[0])
            c.execute("UPDATE entries SET hits=hits+1, last_access=?, priority=?+(2.0+hits)*work/MAX(nbytes,1)"
                      " WHERE id=?", (time.time(), inflation, entry_id))
            c.execute("INSERT INTO counters(namespace, lookups, hits) VALUES (?, 0, 1) ON CONFLICT(namespace)"
                      " DO UPDATE SET hits=hits+1", (ns,))
            row = c.execute("SELECT hits FROM entries WHERE id=?", (entry_id,)).fetchone()
        return int(row[0]) if row else 0

    def record_hit(self, entry_id: str) -> int:
        """Count one reuse of ``entry_id`` (when it was not loaded with ``count_hit=True``). Returns its hits."""
        row = self._row(entry_id)
        if row is None:
            raise self._gone(entry_id)
        return self._bump(entry_id, row[1])

    def record_lookup(self, namespace: str) -> None:
        """Count one retrieval request in ``namespace`` (the hit-rate denominator)."""
        with self._write() as c:
            c.execute("INSERT INTO counters(namespace, lookups, hits) VALUES (?, 1, 0) ON CONFLICT(namespace)"
                      " DO UPDATE SET lookups=lookups+1", (namespace,))

    # ------------------------------------------------------------------ retrieval
    def query(self, namespace: str, embedding: np.ndarray, k: int = 5) -> list[tuple[str, float]]:
        """Top-k entries of ``namespace`` by cosine similarity to ``embedding``: ``[(entry_id, similarity)]``, best
        first. Only that namespace is searched. Raises ValueError if the embedding's dimension differs from the
        namespace's."""
        self._ns_dir(namespace)  # validates the name
        q = normalize_rows(embedding)
        if q.ndim != 1:
            raise ValueError(f"query embedding must be one vector [D], got shape {np.shape(embedding)}")
        with self._lock:
            st = self._sync(namespace)
            if st is None:
                return []
            if q.shape[0] != st.index.dim:
                raise ValueError(f"query embedding has dimension {q.shape[0]} but namespace {namespace} holds "
                                 f"dimension {st.index.dim}: a different text encoder produced it")
            found = st.index.search(q, int(k), self.index_params, fetch=self._fetch_vectors)
            if not found:
                return []
            seqs = [s for s, _ in found]
            ids = dict(self._require_conn().execute(
                f"SELECT seq, id FROM entries WHERE namespace=? AND seq IN ({','.join('?' * len(seqs))})",
                (namespace, *seqs)).fetchall())
        return [(ids[s], sim) for s, sim in found if s in ids]

    def candidates(self, namespace: str, embedding: np.ndarray, k: int = 5, *, min_similarity: float = -1.0
                   ) -> Candidates:
        """Top-k candidates with their signatures (``types.Candidates``); counts one lookup. Entries that turn out
        corrupt are quarantined and skipped (said in ``note``); entries evicted meanwhile are skipped."""
        t0 = time.perf_counter()
        self._ns_dir(namespace)  # validates the name
        self.record_lookup(namespace)
        notes: list[str] = []
        try:
            found = self.query(namespace, embedding, k)
        except ValueError as e:
            return Candidates(namespace=namespace, items=(), retrieval_ms=(time.perf_counter() - t0) * 1000,
                              note=f"no retrieval: {e}")
        items = []
        if found:
            with self._lock:
                rows = {r[0]: r for r in self._require_conn().execute(
                    f"SELECT id, prompt, seed FROM entries WHERE id IN ({','.join('?' * len(found))})",
                    [i for i, _ in found]).fetchall()}
            for entry_id, sim in found:
                if sim < min_similarity or entry_id not in rows:
                    continue
                try:
                    sig = self.load_signature(entry_id)
                except EntryNotFoundError:
                    continue
                except CorruptEntryError:
                    notes.append(f"skipped corrupt entry {entry_id} (quarantined)")
                    continue
                except CacheError as e:  # e.g. a namespace directory that links out of the cache
                    notes.append(f"skipped entry {entry_id}: {e}")
                    continue
                items.append(Candidate(entry_id=entry_id, similarity=float(sim), prompt=rows[entry_id][1],
                                       signature=sig, seed=int(rows[entry_id][2])))
        if not items and not notes:
            notes.append("no cached entry in this namespace (same model + config)" if not found
                         else f"no entry with similarity >= {min_similarity}")
        return Candidates(namespace=namespace, items=tuple(items), retrieval_ms=(time.perf_counter() - t0) * 1000,
                          note="; ".join(notes))

    def _fetch_vectors(self, seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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
            "SELECT e.seq, e.id, m.vec FROM entries e LEFT JOIN embeddings m ON m.seq=e.seq WHERE e.namespace=?", (ns,)
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
        with self._lock:
            low = self._require_conn().execute("SELECT MIN(generation) FROM changes WHERE namespace=?", (ns,)).fetchone()[0]
        if low is None or gen - int(low) < 2 * CHANGE_LOG_KEEP:
            return
        with self._write() as c:
            c.execute("DELETE FROM changes WHERE namespace=? AND generation<=?", (ns, gen - CHANGE_LOG_KEEP))

    # ------------------------------------------------------------------ scan / verify / stats
    def scan(self, grace_s: float | None = None) -> dict[str, int]:
        """Clean up after crashes: remove temp files and uncommitted orphan entry files older than ``grace_s``
        (default: the store's grace period, so in-flight writes of other processes are never touched), and
        catalogue rows whose file vanished. Returns counts."""
        grace = self.grace_s if grace_s is None else float(grace_s)
        now = time.time()
        out = {"tmp_removed": 0, "orphans_removed": 0, "missing_rows_removed": 0}
        for p in (self.root / "tmp").iterdir():
            try:
                if now - p.stat().st_mtime >= grace:
                    p.unlink()
                    out["tmp_removed"] += 1
            except FileNotFoundError:
                pass
        with self._lock:
            rows = self._require_conn().execute("SELECT seq, id, namespace FROM entries").fetchall()
        known = {(ns, i) for _, i, ns in rows}
        for p in (self.root / "entries").glob("*/*.safetensors"):
            if (p.parent.name, p.stem) in known:
                continue
            try:
                if now - p.stat().st_mtime >= grace:
                    p.unlink()
                    out["orphans_removed"] += 1
            except FileNotFoundError:
                pass
        missing = []
        for seq, entry_id, ns in rows:
            try:
                if not self._entry_path(ns, entry_id).exists():
                    missing.append((seq, entry_id, ns))
            except (ValueError, CacheError):
                missing.append((seq, entry_id, ns))
        if missing:
            with self._write() as c:
                still = [r for r in missing
                         if c.execute("SELECT 1 FROM entries WHERE seq=?", (r[0],)).fetchone() is not None]
                self._delete_rows(c, still)
            log.warning("carnator cache: removed %d catalogue rows whose entry file is missing", len(still))
            out["missing_rows_removed"] = len(still)
        if out["orphans_removed"] or out["tmp_removed"]:
            log.info("carnator cache: cleaned %d stray temp files and %d uncommitted entry files",
                     out["tmp_removed"], out["orphans_removed"])
        return out

    def verify(self, *, deep: bool = False) -> VerifyReport:
        """Check that catalogue, files and indexes agree. ``deep``: also load and checksum every entry (corrupt
        ones get quarantined as a side effect and reported). Orphan files younger than the grace period are
        reported as notes (they may be writes in flight)."""
        problems: list[str] = []
        notes: list[str] = []
        now = time.time()
        with self._read() as c:
            rows = c.execute("SELECT seq, id, namespace, nbytes FROM entries").fetchall()
            namespaces = [r[0] for r in c.execute("SELECT namespace FROM namespaces").fetchall()]
            emb_seqs = {r[0] for r in c.execute("SELECT seq FROM embeddings").fetchall()}
            ns_rows = {r[0]: r[1] for r in c.execute("SELECT namespace, dim FROM namespaces").fetchall()}
        seqs = {r[0] for r in rows}
        if seqs - emb_seqs:
            problems.append(f"{len(seqs - emb_seqs)} entries have no embedding row")
        if emb_seqs - seqs:
            problems.append(f"{len(emb_seqs - seqs)} embedding rows belong to no entry")
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
            if (p.parent.name, p.stem) not in known:
                try:
                    young = now - p.stat().st_mtime < self.grace_s
                except FileNotFoundError:
                    continue
                (notes if young else problems).append(f"uncommitted file {p.relative_to(self.root)}"
                                                      + (" (young: maybe a write in flight)" if young else ""))
        with self._lock:
            for ns in namespaces:
                self._verify_index(ns, problems, notes)
        if deep:
            for _, entry_id, _, _ in rows:
                try:
                    self.load(entry_id, count_hit=False)
                except EntryNotFoundError:
                    pass
                except CorruptEntryError as e:
                    problems.append(str(e))
        return VerifyReport(ok=not problems, entries=len(rows), namespaces=len(namespaces), problems=tuple(problems),
                            notes=tuple(notes))

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
                want = {r[0] for r in c.execute("SELECT seq FROM entries WHERE namespace=?", (ns,))}
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

    def stats(self, namespace: str | None = None) -> CacheStats:
        """Entries, bytes, lookups, hits and hit rate, overall and per namespace (or for one namespace)."""
        where, args = ("WHERE n.namespace=?", (namespace,)) if namespace else ("", ())
        with self._read() as c:
            ns_rows = c.execute(
                "SELECT n.namespace, n.model_fingerprint, n.config_json, COUNT(e.seq), COALESCE(SUM(e.nbytes), 0)"
                f" FROM namespaces n LEFT JOIN entries e ON e.namespace=n.namespace {where} GROUP BY n.namespace"
                " ORDER BY n.namespace", args).fetchall()
            counters = {r[0]: (int(r[1]), int(r[2])) for r in c.execute("SELECT namespace, lookups, hits FROM counters")}
        per = []
        for ns, fp, cfg_json, n, b in ns_rows:
            lookups, hits = counters.get(ns, (0, 0))
            per.append(NamespaceStats(namespace=ns, model_fingerprint=fp, config=json.loads(cfg_json), entries=int(n),
                                      bytes=int(b), lookups=lookups, hits=hits,
                                      hit_rate=hits / lookups if lookups else 0.0))
        if namespace:
            lookups, hits = counters.get(namespace, (0, 0))
        else:
            lookups = sum(v[0] for v in counters.values())
            hits = sum(v[1] for v in counters.values())
        qdir = self.root / "quarantine"
        return CacheStats(
            path=str(self.root), entries=sum(p.entries for p in per), bytes=sum(p.bytes for p in per),
            max_bytes=self.max_bytes, policy=self.policy, lookups=lookups, hits=hits,
            hit_rate=hits / lookups if lookups else 0.0,
            quarantined=sum(1 for _ in qdir.glob("*/*.safetensors")),
            catalog_bytes=sum(p.stat().st_size for p in self.root.glob(CATALOG + "*") if p.is_file()),
            index_bytes=sum(p.stat().st_size for p in (self.root / "index").glob("*.safetensors")),
            namespaces=tuple(per))

    def content_version(self) -> int:
        """A counter that changes whenever any entry is added or removed (any process)."""
        with self._lock:
            return int(self._require_conn().execute("SELECT value FROM info WHERE key='content_version'").fetchone()[0])

    def namespaces(self) -> list[str]:
        with self._lock:
            return [r[0] for r in self._require_conn().execute("SELECT namespace FROM namespaces ORDER BY namespace")]

    def entry_ids(self, namespace: str | None = None) -> list[str]:
        where, args = ("WHERE namespace=?", (namespace,)) if namespace else ("", ())
        with self._lock:
            return [r[0] for r in self._require_conn().execute(f"SELECT id FROM entries {where} ORDER BY seq", args)]

    def index_kind(self, namespace: str) -> str | None:
        """The kind of this process's index for ``namespace`` ("flat" / "pca-ivf"), after syncing; None if empty."""
        with self._lock:
            st = self._sync(namespace)
            return st.index.kind if st else None


# ---------------------------------------------------------------------------------------------- helpers
def _chunks(seq: list[int], n: int = 900) -> Iterator[list[int]]:
    for i in range(0, len(seq), n):
        yield seq[i : i + n]


def _atomic_write(root: Path, final: Path, blob: bytes, durable: bool,
                  fault: Callable[[str], None] | None = None) -> None:
    """Write ``blob`` to ``final`` via a temp file in ``root/tmp`` and ``os.replace`` (atomic on POSIX)."""
    tmp_dir = root / "tmp"
    tmp_dir.mkdir(exist_ok=True)
    tmp = tmp_dir / f"{final.stem}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        if fault:
            fault("after_tmp_write")
        if not final.parent.resolve().is_relative_to(root):
            raise CacheError(f"{final.parent} resolves outside the cache directory; refusing to write there")
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fault:
        fault("after_rename")
    if durable:
        try:
            dfd = os.open(final.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError:
            pass  # some filesystems do not support directory fsync; the rename is still atomic


def _is_corruption(e: sqlite3.DatabaseError) -> bool:
    """True for "this is not a (valid) database" errors, False for busy/locked/permission errors."""
    name = getattr(e, "sqlite_errorname", "") or ""
    if name in ("SQLITE_CORRUPT", "SQLITE_NOTADB") or name.startswith(("SQLITE_CORRUPT_", "SQLITE_NOTADB_")):
        return True
    if name:
        return False
    msg = str(e).lower()
    return "not a database" in msg or "malformed" in msg


def _schema_problem(rows: list[tuple]) -> str | None:
    """None if ``sqlite_master`` holds exactly our schema (no triggers, views or altered tables)."""
    ref = sqlite3.connect(":memory:")
    for ddl in _SCHEMA:
        ref.execute(ddl)
    want = {(t, n, s) for t, n, s in ref.execute("SELECT type, name, sql FROM sqlite_master")}
    ref.close()
    got = {(t, n, s) for t, n, s in rows}
    got.discard(("table", "sqlite_sequence", "CREATE TABLE sqlite_sequence(name,seq)"))
    want.discard(("table", "sqlite_sequence", "CREATE TABLE sqlite_sequence(name,seq)"))
    if got != want:
        extra = sorted(n for _, n, _ in got - want)
        missing = sorted(n for _, n, _ in want - got)
        return f"catalogue schema differs from Carnator's (unexpected: {extra}, missing: {missing})"
    return None


def _header_meta(data: bytes) -> str:
    n = int.from_bytes(data[:8], "little")
    if n <= 1 or n > _MAX_HEADER or 8 + n > len(data):
        raise ValueError("safetensors header length is out of range (truncated file?)")
    header = json.loads(data[8 : 8 + n])
    meta = (header.get("__metadata__") or {}).get("carnator")
    if not isinstance(meta, str):
        raise ValueError("not a Carnator entry (no 'carnator' metadata)")
    return meta


def _read_partial(path: Path, names: tuple[str, ...] | None, prefix: str = "", expect_size: int | None = None
                  ) -> tuple[dict, str, dict[str, np.ndarray]]:
    """Read the header and a few float32 tensors of an entry file without mmap (a file truncated under an mmap
    would SIGBUS the process): ``names`` and/or all tensors starting with ``prefix``. Checks the file size against
    the header (truncation) and every tensor read against its sha256 in the metadata."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if expect_size is not None and size != expect_size:
            raise ValueError(f"file is {size} bytes, the catalogue recorded {expect_size} (truncated?)")
        head = f.read(8)
        if len(head) != 8:
            raise ValueError("file is shorter than a safetensors header")
        n = int.from_bytes(head, "little")
        if n <= 1 or n > _MAX_HEADER or 8 + n > size:
            raise ValueError("safetensors header length is out of range (truncated file?)")
        header = json.loads(f.read(n))
        meta_json = (header.get("__metadata__") or {}).get("carnator")
        if not isinstance(meta_json, str):
            raise ValueError("not a Carnator entry (no 'carnator' metadata)")
        meta = json.loads(meta_json)
        infos = {k: v for k, v in header.items() if k != "__metadata__"}
        end = max((int(v["data_offsets"][1]) for v in infos.values()), default=0)
        if 8 + n + end != size:
            raise ValueError(f"file is {size} bytes but its header describes {8 + n + end} (truncated?)")
        wanted = [k for k in infos if (names and k in names) or (prefix and k.startswith(prefix))]
        for k in names or ():
            if k not in infos:
                raise ValueError(f"tensor {k!r} is missing")
        manifest = meta.get("tensors") or {}
        out = {}
        for k in wanted:
            info = infos[k]
            if info.get("dtype") != "F32":
                raise ValueError(f"tensor {k} has dtype {info.get('dtype')}, expected F32")
            shape = [int(x) for x in info["shape"]]
            s, e = int(info["data_offsets"][0]), int(info["data_offsets"][1])
            if e - s != 4 * math.prod(shape) or s < 0:
                raise ValueError(f"tensor {k} has inconsistent offsets")
            f.seek(8 + n + s)
            buf = f.read(e - s)
            if len(buf) != e - s:
                raise ValueError(f"tensor {k} is truncated")
            m = manifest.get(k)
            if m is None or list(m.get("shape", [])) != shape or hashlib.sha256(buf).hexdigest() != m.get("sha256"):
                raise ValueError(f"tensor {k} does not match its manifest (checksum/shape)")
            out[k] = np.frombuffer(buf, dtype="<f4").reshape(shape).copy()
    return meta, meta_json, out


def _adopted_key(meta: Mapping[str, Any]) -> str:
    """The request key an entry file carries ("" for files written before keys existed, or a malformed one)."""
    key = meta.get("request_key", "")
    return key if isinstance(key, str) and _KEY_RE.match(key) else ""


def _check_meta(meta: Any, entry_id: str, ns: str) -> None:
    if not isinstance(meta, dict) or meta.get("format") != ENTRY_FORMAT:
        raise ValueError("not a Carnator entry")
    if meta.get("version") != ENTRY_VERSION:
        raise ValueError(f"entry format version {meta.get('version')!r} is not supported")
    if meta.get("id") != entry_id or meta.get("namespace") != ns:
        raise ValueError(f"file claims id {meta.get('id')!r} in namespace {meta.get('namespace')!r}")


def _signature_from(meta: dict, tensors: Mapping[str, torch.Tensor]) -> Signature:
    arrays = {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in tensors.items()}
    sig = Signature.from_parts(meta["signature"], arrays, prefix="sig.")
    grid = tuple(sig.grid)
    for o in sig.objects:
        if o.mask.ndim != 3 or (len(grid) == 3 and tuple(o.mask.shape) != grid):
            raise ValueError(f"signature mask of {o.name!r} has shape {o.mask.shape}, grid is {grid}")
    return sig


def _block_from(meta: dict, tensors: Mapping[str, torch.Tensor]) -> BlockStructure | None:
    bm = meta.get("block_structure")
    if bm is None:
        if "blocks.keep" in tensors:
            raise ValueError("block structure tensor without its metadata")
        return None
    if bm.get("packing") != "packbits-last-axis":
        raise ValueError(f"unknown block structure packing {bm.get('packing')!r}")
    shape = [int(x) for x in bm["shape"]]
    packed = tensors["blocks.keep"]
    if (packed.dtype != torch.uint8 or len(shape) != 4
            or list(packed.shape) != shape[:3] + [(shape[3] + 7) // 8]):
        raise ValueError(f"blocks.keep is {packed.dtype}{list(packed.shape)}, inconsistent with shape {shape}")
    keep = np.unpackbits(packed.numpy(), axis=-1, count=shape[3]).astype(bool)
    layers = tuple(int(x) for x in bm["layers"])
    if len(layers) != shape[0]:
        raise ValueError(f"block structure lists {len(layers)} layers for {shape[0]} rows")
    return BlockStructure(keep=keep, layers=layers, block_size=int(bm["block_size"]),
                          n_tokens=int(bm["n_tokens"]), steps=tuple(int(x) for x in bm.get("steps", ())))


__all__ = [
    "CacheBudgetError", "CacheError", "CacheStats", "CorruptEntryError", "Entry", "EntryData", "EntryNotFoundError",
    "NamespaceMismatchError", "NamespaceStats", "Store", "VerifyReport", "default_key_path",
]
