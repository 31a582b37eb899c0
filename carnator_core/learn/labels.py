"""Learning mode's persistent record: labels, covariates, the compute ledger and state events, in ``learn.sqlite``.

The file lives in the cache folder next to the cache's own catalog (a separate file: the cache's schema is not
touched). One row per fact; every row carries a SHA-256 checksum of its content, verified on every read (a row that
fails is skipped and counted in ``corrupt``, never deleted: the cache never deletes what it did not write, and a
corrupt row is evidence). Writes are single transactions under SQLite's WAL journal with ``synchronous=FULL``: a
process killed mid-label (SIGKILL included) leaves either the whole label or none of it, and the labels already
written intact. Several ComfyUI processes on one cache folder share the file (SQLite's locking; a busy timeout).

Tables (all keyed by the cache namespace, i.e. model × generation config):

* ``covariates`` — every served request that recalled a candidate: its stratum and the chosen candidate's
  discrepancies (no outcome: the threshold fits are made from these alone, see ``sequence``);
* ``labels``     — one excess label (x = +1 b, −1 c, 0 agree) of a request's counterfactual reuse against the clip
  served densely, with the discrepancies, the judge and its settings, the kind ("shadow" or "audit") and the
  compute it cost;
* ``ledger``     — compute served and compute spent labelling/auditing, the budget's accounting;
* ``events``     — state changes (switch-on per stratum, drift, refits) with their messages.

Faults (as the cache's catalogue, ``cache/catalog.py``, ``cache/store.py``):

* **Confined.** ``learn.sqlite`` and its ``-wal`` / ``-shm`` / ``-journal`` files must be plain files in the cache
  folder: a symbolic link among them (SQLite would write where it points) makes the record unusable; the links
  are moved to the cache's ``quarantine/`` (never their targets, never deleted) and a fresh record is started.
* **Damaged.** A file that is not SQLite, fails ``PRAGMA quick_check`` or has a schema that is not ours is moved
  to ``quarantine/`` (with its side files) and a fresh record started, with one warning; damage found later by a
  query is handled the same way and that call raises ``LabelStoreError`` saying so. The learned rule file's record
  is imported into the fresh one at the next learning request (``runtime.adopt_rule_file``).
* **Unwritable** (read-only folder, full disk, permissions): ``LabelStoreError`` saying which. No raw
  ``sqlite3`` error leaves a public method. The sampler turns it into a message on the badge: the clip is served.
* **Read-only opening** (``read_only=True``, the panel's route): nothing is created or written, links are refused.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
import sqlite3
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar
from urllib.parse import quote

from filelock import FileLock

from ..cache.catalog import SIDE_FILES, is_corruption, is_full

log = logging.getLogger("carnator")
T = TypeVar("T")
QUICK_CHECK_MAX_BYTES = 64 << 20  # the whole-file check at open, up to this size (larger: damage found by queries)
_TABLES = ("meta", "covariates", "labels", "ledger", "events")

FILENAME = "learn.sqlite"
SCHEMA = 1
AXES = ("context", "size", "shape", "appearance")

_DDL = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS covariates (
    id INTEGER PRIMARY KEY AUTOINCREMENT, namespace TEXT NOT NULL, request_key TEXT NOT NULL, body TEXT NOT NULL,
    checksum TEXT NOT NULL, UNIQUE(namespace, request_key));
CREATE TABLE IF NOT EXISTS labels (
    id INTEGER PRIMARY KEY AUTOINCREMENT, namespace TEXT NOT NULL, request_key TEXT NOT NULL, kind TEXT NOT NULL,
    body TEXT NOT NULL, checksum TEXT NOT NULL, UNIQUE(namespace, request_key, kind));
CREATE TABLE IF NOT EXISTS ledger (
    namespace TEXT PRIMARY KEY, served_s REAL NOT NULL, label_s REAL NOT NULL, audit_s REAL NOT NULL,
    requests INTEGER NOT NULL, checksum TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, namespace TEXT NOT NULL, body TEXT NOT NULL, checksum TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS labels_ns ON labels(namespace, id);
CREATE INDEX IF NOT EXISTS cov_ns ON covariates(namespace, id);
"""


def event_key(kind: str, facts: Mapping[str, Any]) -> str:
    """The uniqueness key of a state transition ("" for an event that may repeat): one pilot order per namespace,
    one fit k per stratum, one switch-on and one drift per fit of a stratum."""
    if kind == "order":
        return "order"
    if kind == "fit" and isinstance(facts.get("fit"), Mapping):
        return f"fit:{facts['fit'].get('stratum')}:{facts['fit'].get('index')}"
    if kind in ("on", "drift") and "stratum" in facts:
        return f"{kind}:{facts['stratum']}:{facts.get('fit')}"
    return ""


class LabelStoreError(RuntimeError):
    """The learning record cannot be opened or written (the message says why and what to do)."""


def checksum(body: str) -> str:
    return hashlib.sha256(body.encode("utf-8")).hexdigest()


def _dump(obj: Mapping[str, Any]) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


#: The marker of a warm-up label drawn i.i.d. (``Label.draw["rule"]``): its cached entry uniformly at random, with
#: replacement, among the namespace's entries that admit an edit of its kind, then a random edit of that kind, by a
#: generator independent of every label (``idle.draw_edit``).
IID_DRAW = "uniform-entry-with-replacement"


@dataclass(frozen=True)
class Covariate:
    """A served request with a recalled candidate: the chosen one's stratum and discrepancies (no outcome)."""

    request_key: str
    stratum: str
    entry_id: str
    similarity: float
    vector: tuple[float, float, float, float]
    missing: bool
    t: float = 0.0


@dataclass(frozen=True)
class Label:
    """One excess label. ``x``: +1 = b (reuse fails where dense passes), −1 = c, 0 = agree. ``reusable`` False:
    the counterfactual continued dense (its changed region exceeded ``max_active``): a miss, never accepted.

    ``draw``: how the request was drawn, for a warm-up label made by an i.i.d. draw (``idle``: {"rule":
    :data:`IID_DRAW`, the drawn entry, the edit, the population's size}); empty for every other label (traffic,
    audits, and warm-up labels written before the draw existed). A warm-up learner counts a label at label level
    only when it carries ``rule`` = ``IID_DRAW`` (``learner`` module docstring, "The unit"); the row stores it only
    when set, so every other row is as before."""

    request_key: str
    stratum: str
    entry_id: str
    similarity: float
    vector: tuple[float, float, float, float]
    missing: bool
    reusable: bool
    x: int
    kind: str = "shadow"          # "shadow" (learning) | "audit" (a switched-on rule's hit run dense)
    judge: str = ""
    judge_settings: Mapping[str, Any] = field(default_factory=dict)
    cost_s: float = 0.0
    prompt: str = ""
    candidate_prompt: str = ""
    seed: int = 0
    t: float = 0.0
    id: int = 0
    draw: Mapping[str, Any] = field(default_factory=dict)

    @property
    def iid(self) -> bool:
        """Whether the label was made by the warm-up worker's i.i.d. draw (``draw``'s marker)."""
        return isinstance(self.draw, Mapping) and self.draw.get("rule") == IID_DRAW

    def to_row(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("id")
        d["vector"] = [float(v) for v in self.vector]
        d["judge_settings"] = dict(self.judge_settings)
        if self.draw:
            d["draw"] = dict(self.draw)
        else:
            d.pop("draw")  # a row without a draw is byte for byte a row of before
        return d

    @classmethod
    def from_row(cls, d: Mapping[str, Any], row_id: int = 0) -> "Label":
        d = dict(d)
        d["vector"] = tuple(float(v) for v in d["vector"])
        x = int(d["x"])
        if x not in (-1, 0, 1) or d.get("kind") not in ("shadow", "audit") or len(d["vector"]) != 4 or \
                not isinstance(d.get("draw", {}), Mapping):
            raise ValueError(f"not a label row: x={x!r}, kind={d.get('kind')!r}")
        return cls(**{**d, "x": x, "id": row_id})


class RecordReads:
    """What every learning record reads the same way (``LabelStore`` here, ``redis_labels.RedisLabelStore`` on a
    farm's Redis): its verified rows (``_table_rows``: checksum checked, JSON parsed, in id order) become covariates,
    labels and events; a row that is not one is counted in ``corrupt`` and skipped."""

    corrupt: int

    def _table_rows(self, namespace: str, table: str) -> Iterator[tuple[int, dict[str, Any]]]:
        """(id, body) of ``table`` ("covariates", "labels" or "events") of ``namespace`` that pass their checksum."""
        raise NotImplementedError

    def covariates(self, namespace: str) -> list[Covariate]:
        out = []
        for _, d in self._table_rows(namespace, "covariates"):
            try:
                out.append(Covariate(**{**d, "vector": tuple(float(v) for v in d["vector"])}))
            except (TypeError, KeyError, ValueError):
                self.corrupt += 1
        return out

    def labels(self, namespace: str, kind: str | None = None) -> list[Label]:
        out = []
        for row_id, d in self._table_rows(namespace, "labels"):
            try:
                lab = Label.from_row(d, row_id)
            except (TypeError, KeyError, ValueError):
                self.corrupt += 1
                continue
            if kind is None or lab.kind == kind:
                out.append(lab)
        return out

    def events(self, namespace: str) -> list[dict[str, Any]]:
        return [d for _, d in self._table_rows(namespace, "events")]


class LabelStore(RecordReads):
    """``learn.sqlite`` of one cache folder (module docstring). Thread-safe; one connection per instance."""

    def __init__(self, directory: str | Path, *, read_only: bool = False):
        """``directory``: the cache folder (``learn.sqlite`` is created in it), or ":memory:" for a record that
        lives only in this process (re-checking a learned rule file). ``read_only``: open an existing record
        without creating or writing anything (LabelStoreError when there is none or it is unusable)."""
        self.memory = str(directory) == ":memory:"
        self.path = Path(FILENAME) if self.memory else Path(directory) / FILENAME
        self.read_only = read_only
        self._lock = threading.Lock()
        self.corrupt = 0
        self.problem = ""  # what was wrong with the record this instance found (and set aside), said once
        self._conn: sqlite3.Connection | None = None
        self._ino: tuple[int, int] | None = None  # the file the connection was checked on
        with self._lock:
            self._open()

    # ------------------------------------------------------------------ opening, faults
    def _links(self) -> list[str]:
        return [p.name for p in (self.path, *(Path(str(self.path) + s) for s in SIDE_FILES)) if p.is_symlink()]

    def _open(self) -> None:
        """Connect (caller holds the lock): a record that is a link, damaged or not ours is set aside and a fresh
        one started (read-only: refused); an unwritable one raises LabelStoreError saying why."""
        if self.memory:
            self._conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
            self._conn.executescript(_DDL)
            self._conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (str(SCHEMA),))
            return
        for attempt in (1, 2, 3):
            ino = self._ino_now()
            why = self._try()
            if why is None:
                self._ino = ino
                return
            if self.read_only:
                raise LabelStoreError(f"the learning record {self.path} is unusable ({why}); it is set aside and "
                                      "started afresh at the next learning request")
            if attempt == 3:
                raise LabelStoreError(f"the learning record {self.path} just started afresh is unusable ({why}); "
                                      "check the disk and the cache folder's permissions")
            with self._aside_lock():
                if self._ino_now() == ino:  # not replaced meanwhile (another process setting it aside first)
                    self._set_aside_file(why)

    def _try(self) -> str | None:
        """Connect and check (``self._conn`` set on success): None, or why the record is unusable (a link, damage,
        not ours). Raises LabelStoreError for a record that cannot be opened at all (not damage: permissions...)."""
        links = self._links()
        if links:
            return f"{links[0]} is a symbolic link (SQLite would write where it points)"
        try:
            self._conn = self._connect()
            why = self._check()
            if why is None:
                return None
        except sqlite3.Error as e:
            if not is_corruption(e):
                self._close_conn()
                raise self._error(e, "opening") from None
            why = f"{type(e).__name__}: {e}"
        self._close_conn()
        return why

    def _ino_now(self) -> tuple[int, int] | None:
        try:
            st = os.lstat(self.path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino)

    def _aside_lock(self) -> Any:
        """The cache's lock for setting the record aside (several processes on one folder set aside one file once)."""
        locks = self.path.parent / "locks"
        if locks.is_dir() and not locks.is_symlink():
            return FileLock(str(locks / "learn.lock"), timeout=120)
        return contextlib.nullcontext()

    def _connect(self) -> sqlite3.Connection:
        if self.read_only:
            if not self.path.is_file():
                raise LabelStoreError(f"there is no learning record at {self.path}")
            conn = sqlite3.connect(f"file:{quote(str(self.path))}?mode=ro", uri=True, isolation_level=None,
                                   check_same_thread=False)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(str(self.path), timeout=30.0, isolation_level=None, check_same_thread=False)
        try:
            conn.execute("PRAGMA busy_timeout=30000")
            conn.execute("PRAGMA trusted_schema=OFF")
            if not self.read_only:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=FULL")
        except BaseException:
            conn.close()
            raise
        return conn

    def _check(self) -> str | None:
        """Why the open record cannot be used (None: it can): damaged pages, a schema that is not ours, another
        schema version (LabelStoreError: never set aside, a newer Carnator's record is not damaged)."""
        c = self._conn
        assert c is not None
        names = {n for (n,) in c.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'trigger', "
                                         "'view')")} - {"sqlite_sequence"}
        if not names and not self.read_only:
            c.executescript(_DDL)
            c.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (str(SCHEMA),))
            return None
        if names != set(_TABLES):
            return f"its tables are not a learning record's ({sorted(names)[:8]})"
        if self.path.stat().st_size <= QUICK_CHECK_MAX_BYTES:
            check = [r[0] for r in c.execute("PRAGMA quick_check(5)").fetchall()]
            if check != ["ok"]:
                return "damaged pages: " + "; ".join(str(x) for x in check)
        row = c.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
        if row is None and not self.read_only:
            c.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (str(SCHEMA),))
        elif row is not None and row[0] != str(SCHEMA):
            raise LabelStoreError(f"{self.path} has learning schema {row[0]}, this Carnator reads {SCHEMA}: "
                                  "update Carnator, or move the file away to start learning afresh")
        return None

    def _close_conn(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except sqlite3.Error:
                pass
            self._conn = None

    def _set_aside_file(self, why: str) -> None:
        """Move ``learn.sqlite`` and its side files (links as links) to the cache's ``quarantine/``, say so once."""
        qdir = self.path.parent / "quarantine"
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{secrets.token_hex(2)}"
        moved = []
        try:
            qdir.mkdir(exist_ok=True)
            if qdir.is_symlink():
                raise LabelStoreError(f"{qdir} is a symbolic link; a cache folder must not link elsewhere. Remove it.")
            for suffix in ("", *SIDE_FILES):
                p = Path(str(self.path) + suffix)
                if p.exists() or p.is_symlink():
                    os.replace(p, qdir / f"learn-{stamp}.sqlite{suffix}")
                    moved.append(p.name)
        except OSError as e:
            raise LabelStoreError(f"the learning record {self.path} is unusable ({why}) and cannot be set aside "
                                  f"({e.strerror or e}); check the cache folder's permissions and free space") from None
        self.problem = (f"the learning record {self.path.name} was unusable ({why}); it is set aside in "
                        f"quarantine/ as learn-{stamp}.sqlite and learning starts afresh (the learned rule file's "
                        "labels are imported back)")
        log.warning("carnator learning: %s", self.problem)

    def _error(self, e: BaseException, what: str) -> LabelStoreError:
        if is_full(e):
            why = "the disk is full: free space"
        elif isinstance(e, sqlite3.OperationalError) and "readonly" in str(e).lower().replace("-", "").replace(
                " ", ""):
            why = "the cache folder is read-only: make it writable"
        elif isinstance(e, (PermissionError, sqlite3.OperationalError)) and "unable to open" in str(e).lower():
            why = "it cannot be opened: check the cache folder's permissions"
        else:
            why = "check the disk and the cache folder's permissions"
        return LabelStoreError(f"the learning record {self.path} failed while {what} ({type(e).__name__}: {e}); "
                               f"{why}. Requests are served and cached meanwhile; nothing is labelled")

    def _guard(self, fn: Callable[[sqlite3.Connection], T], what: str) -> T:
        """Run ``fn`` on the connection (caller holds the lock): sqlite3 errors become LabelStoreError; damage is
        set aside and the record started afresh before raising."""
        try:
            if self._conn is not None and not self.memory and self._ino_now() != self._ino:
                self._close_conn()  # set aside (or replaced) by another process: follow the file, not the old inode
            if self._conn is None:
                self._open()
            assert self._conn is not None
            return fn(self._conn)
        except sqlite3.Error as e:
            if not is_corruption(e) or self.memory or self.read_only:
                raise self._error(e, what) from None
            self._close_conn()
            with self._aside_lock():
                if self._ino_now() == self._ino:  # still the file this query found damaged
                    self._set_aside_file(f"{type(e).__name__}: {e}")
            self._open()
            said, self.problem = self.problem, ""  # said by this error (once)
            raise LabelStoreError(said or f"the learning record {self.path} was damaged and has been replaced by "
                                  "another process; retry") from None
        except OSError as e:
            raise self._error(e, what) from None

    # ------------------------------------------------------------------ plumbing
    def _write(self, fn: Callable[[sqlite3.Connection], T], what: str) -> T:
        """One write transaction (BEGIN IMMEDIATE … COMMIT) under ``_guard``."""
        if self.read_only:
            raise LabelStoreError(f"the learning record {self.path} is open read-only")

        def tx(c: sqlite3.Connection) -> T:
            c.execute("BEGIN IMMEDIATE")
            try:
                out = fn(c)
            except BaseException:
                try:
                    c.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
                raise
            c.execute("COMMIT")
            return out

        with self._lock:
            return self._guard(tx, what)

    def _read(self, sql: str, args: tuple, what: str = "reading") -> list[tuple]:
        with self._lock:
            return self._guard(lambda c: c.execute(sql, args).fetchall(), what)

    def close(self) -> None:
        with self._lock:
            self._close_conn()

    def _rows(self, sql: str, args: tuple) -> Iterator[tuple[int, dict[str, Any]]]:
        rows = self._read(sql, args)
        for row_id, body, digest in rows:
            if checksum(body) != digest:
                self.corrupt += 1
                continue
            try:
                yield int(row_id), json.loads(body)
            except ValueError:
                self.corrupt += 1

    def _table_rows(self, namespace: str, table: str) -> Iterator[tuple[int, dict[str, Any]]]:
        assert table in ("covariates", "labels", "events")  # a fixed table name, never user input
        return self._rows(f"SELECT id, body, checksum FROM {table} WHERE namespace=? ORDER BY id", (namespace,))

    # ------------------------------------------------------------------ covariates
    def add_covariate(self, namespace: str, cov: Covariate) -> bool:
        """Record a served request's covariates (once per request key; True if new)."""
        body = _dump({**asdict(cov), "vector": [float(v) for v in cov.vector]})
        return self._write(lambda c: c.execute("INSERT OR IGNORE INTO covariates (namespace, request_key, body, "
                                               "checksum) VALUES (?, ?, ?, ?)",
                                               (namespace, cov.request_key, body, checksum(body))).rowcount > 0,
                           "recording a request")

    # ------------------------------------------------------------------ labels
    def add_label(self, namespace: str, label: Label, *, keep_id: bool = False) -> bool:
        """Persist one label (one transaction; once per request key and kind; True if new). ``keep_id``: store it
        under ``label.id`` (replaying a learned rule file, whose fits and pilot refer to labels by id)."""
        return self._write(lambda c: _insert_label(c, namespace, label, keep_id), "writing a label")

    def has_label(self, namespace: str, request_key: str) -> bool:
        return bool(self._read("SELECT 1 FROM labels WHERE namespace=? AND request_key=? LIMIT 1",
                               (namespace, request_key)))

    def label_id_floor(self, namespace: str) -> int:
        """The highest label id in use (any namespace: ids are one sequence in this file); a label imported into
        ``namespace`` is shifted above it."""
        rows = self._read("SELECT max(id) FROM labels", ())
        seq = self._read("SELECT seq FROM sqlite_sequence WHERE name='labels'", ())
        return max(int(rows[0][0] or 0) if rows else 0, int(seq[0][0] or 0) if seq else 0)

    def import_record(self, namespace: str, labels: Sequence[Label], events: Sequence[Mapping[str, Any]]) -> int:
        """Import a learned rule file's record into ``namespace`` in one transaction: its labels shifted above every
        id in use (their order kept; the events' ``since`` shifted alike, so each fit and the pilot count the same
        labels), its events once each (``event_key``). A label already there (request key and kind) is skipped.
        Returns the labels imported."""
        def tx(c: sqlite3.Connection) -> int:
            top = c.execute("SELECT max(id) FROM labels").fetchone()[0] or 0
            seq = c.execute("SELECT seq FROM sqlite_sequence WHERE name='labels'").fetchone()
            offset = max(int(top), int(seq[0]) if seq else 0)
            n = sum(_insert_label(c, namespace, replace(lab, id=lab.id + offset), True) for lab in labels)
            for e in events:
                _insert_event(c, namespace, shift_event(e, offset))
            return n

        return self._write(tx, "importing a learned rule's record")

    def set_aside(self, namespace: str) -> str:
        """Rename ``namespace``'s record (covariates, labels, ledger, events) to a new namespace
        ``<namespace>~set-aside-<stamp>`` (kept, never deleted; listed by ``namespaces``); returns that name."""
        aside = f"{namespace}~set-aside-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"

        def tx(c: sqlite3.Connection) -> str:
            for table in ("covariates", "labels", "ledger", "events"):
                c.execute(f"UPDATE {table} SET namespace=? WHERE namespace=?", (aside, namespace))
            return aside

        return self._write(tx, "setting a record aside")

    # ------------------------------------------------------------------ ledger
    def ledger(self, namespace: str) -> dict[str, float]:
        rows = self._read("SELECT served_s, label_s, audit_s, requests, checksum FROM ledger WHERE namespace=?",
                          (namespace,))
        if not rows:
            return {"served_s": 0.0, "label_s": 0.0, "audit_s": 0.0, "requests": 0}
        row = rows[0]
        d = {"served_s": float(row[0]), "label_s": float(row[1]), "audit_s": float(row[2]), "requests": int(row[3])}
        if checksum(_dump(d)) != row[4]:
            self.corrupt += 1
        return d

    def charge(self, namespace: str, *, served_s: float = 0.0, label_s: float = 0.0, audit_s: float = 0.0,
               requests: int = 0) -> dict[str, float]:
        """Add compute to the namespace's ledger (one transaction); returns the new totals."""
        def tx(c: sqlite3.Connection) -> dict[str, float]:
            row = c.execute("SELECT served_s, label_s, audit_s, requests FROM ledger WHERE namespace=?",
                            (namespace,)).fetchone()
            cur = row or (0.0, 0.0, 0.0, 0)
            d = {"served_s": float(cur[0]) + served_s, "label_s": float(cur[1]) + label_s,
                 "audit_s": float(cur[2]) + audit_s, "requests": int(cur[3]) + requests}
            c.execute("INSERT OR REPLACE INTO ledger VALUES (?, ?, ?, ?, ?, ?)",
                      (namespace, d["served_s"], d["label_s"], d["audit_s"], d["requests"], checksum(_dump(d))))
            return d

        return self._write(tx, "charging compute")

    # ------------------------------------------------------------------ events
    def add_event(self, namespace: str, kind: str, message: str, **facts: Any) -> None:
        """Record a state transition once: a transition with a key (``event_key``) already recorded — by another
        process deriving the same state at the same moment — is dropped, inside the same write transaction."""
        body = {"kind": kind, "message": message, "t": time.time(), **facts}
        self._write(lambda c: _insert_event(c, namespace, body), "recording a state change")

    def namespaces(self) -> list[str]:
        rows = self._read("SELECT namespace FROM covariates UNION SELECT namespace FROM labels "
                          "UNION SELECT namespace FROM ledger", ())
        return sorted(r[0] for r in rows)


def _insert_label(c: sqlite3.Connection, namespace: str, label: Label, keep_id: bool) -> bool:
    body = _dump(label.to_row())
    if keep_id and label.id > 0:
        cur = c.execute("INSERT OR IGNORE INTO labels (id, namespace, request_key, kind, body, checksum) "
                        "VALUES (?, ?, ?, ?, ?, ?)", (int(label.id), namespace, label.request_key, label.kind, body,
                                                      checksum(body)))
    else:
        cur = c.execute("INSERT OR IGNORE INTO labels (namespace, request_key, kind, body, checksum) "
                        "VALUES (?, ?, ?, ?, ?)", (namespace, label.request_key, label.kind, body, checksum(body)))
    return cur.rowcount > 0


def _insert_event(c: sqlite3.Connection, namespace: str, event: Mapping[str, Any]) -> bool:
    key = event_key(str(event.get("kind", "")), event)
    if key:
        for (old,) in c.execute("SELECT body FROM events WHERE namespace=?", (namespace,)):
            try:
                d = json.loads(old)
            except ValueError:
                continue
            if event_key(str(d.get("kind", "")), d) == key:
                return False
    body = _dump(dict(event))
    c.execute("INSERT INTO events (namespace, body, checksum) VALUES (?, ?, ?)", (namespace, body, checksum(body)))
    return True


def shift_event(event: Mapping[str, Any], offset: int) -> dict[str, Any]:
    """``event`` with the label ids it refers to (a fit's and the pilot order's ``since``) shifted by ``offset``."""
    e = json.loads(json.dumps(event))
    if not offset:
        return e
    if e.get("kind") == "fit" and isinstance(e.get("fit"), dict) and "since" in e["fit"]:
        e["fit"]["since"] = int(e["fit"]["since"]) + offset
    if e.get("kind") == "order" and "since" in e:
        e["since"] = int(e["since"]) + offset
    return e
