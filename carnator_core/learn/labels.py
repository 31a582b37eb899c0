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
"""
from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

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
    the counterfactual continued dense (its changed region exceeded ``max_active``): a miss, never accepted."""

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

    def to_row(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("id")
        d["vector"] = [float(v) for v in self.vector]
        d["judge_settings"] = dict(self.judge_settings)
        return d

    @classmethod
    def from_row(cls, d: Mapping[str, Any], row_id: int = 0) -> "Label":
        d = dict(d)
        d["vector"] = tuple(float(v) for v in d["vector"])
        x = int(d["x"])
        if x not in (-1, 0, 1) or d.get("kind") not in ("shadow", "audit") or len(d["vector"]) != 4:
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

    def __init__(self, directory: str | Path):
        """``directory``: the cache folder (``learn.sqlite`` is created in it), or ":memory:" for a record that
        lives only in this process (re-checking a learned rule file)."""
        memory = str(directory) == ":memory:"
        self.path = Path(FILENAME) if memory else Path(directory) / FILENAME
        self._lock = threading.Lock()
        self.corrupt = 0
        try:
            if memory:
                self._conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
            else:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._conn = sqlite3.connect(str(self.path), timeout=30.0, isolation_level=None,
                                             check_same_thread=False)
                self._conn.execute("PRAGMA journal_mode=WAL")
                self._conn.execute("PRAGMA synchronous=FULL")
            self._conn.executescript(_DDL)
            row = self._conn.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
            if row is None:
                self._conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (str(SCHEMA),))
            elif row[0] != str(SCHEMA):
                raise LabelStoreError(f"{self.path} has learning schema {row[0]}, this Carnator reads {SCHEMA}: "
                                      "update Carnator, or move the file away to start learning afresh")
        except sqlite3.Error as e:
            raise LabelStoreError(f"the learning record {self.path} cannot be opened ({e}); check the cache "
                                  "folder's permissions and free space") from None

    # ------------------------------------------------------------------ plumbing
    class _Tx:
        def __init__(self, conn: sqlite3.Connection, lock: threading.Lock):
            self.conn, self.lock = conn, lock

        def __enter__(self) -> sqlite3.Connection:
            self.lock.acquire()
            self.conn.execute("BEGIN IMMEDIATE")
            return self.conn

        def __exit__(self, exc_type: Any, *rest: Any) -> None:
            try:
                self.conn.execute("ROLLBACK" if exc_type else "COMMIT")
            finally:
                self.lock.release()

    def _tx(self) -> "LabelStore._Tx":
        return LabelStore._Tx(self._conn, self._lock)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def _rows(self, sql: str, args: tuple) -> Iterator[tuple[int, dict[str, Any]]]:
        with self._lock:
            rows = self._conn.execute(sql, args).fetchall()
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
        with self._tx() as c:
            cur = c.execute("INSERT OR IGNORE INTO covariates (namespace, request_key, body, checksum) "
                            "VALUES (?, ?, ?, ?)", (namespace, cov.request_key, body, checksum(body)))
            return cur.rowcount > 0


    # ------------------------------------------------------------------ labels
    def add_label(self, namespace: str, label: Label, *, keep_id: bool = False) -> bool:
        """Persist one label (one transaction; once per request key and kind; True if new). ``keep_id``: store it
        under ``label.id`` (replaying a learned rule file, whose fits and pilot refer to labels by id)."""
        body = _dump(label.to_row())
        with self._tx() as c:
            if keep_id and label.id > 0:
                cur = c.execute("INSERT OR IGNORE INTO labels (id, namespace, request_key, kind, body, checksum) "
                                "VALUES (?, ?, ?, ?, ?, ?)", (int(label.id), namespace, label.request_key,
                                                              label.kind, body, checksum(body)))
            else:
                cur = c.execute("INSERT OR IGNORE INTO labels (namespace, request_key, kind, body, checksum) "
                                "VALUES (?, ?, ?, ?, ?)", (namespace, label.request_key, label.kind, body,
                                                           checksum(body)))
            return cur.rowcount > 0

    def has_label(self, namespace: str, request_key: str) -> bool:
        with self._lock:
            return self._conn.execute("SELECT 1 FROM labels WHERE namespace=? AND request_key=?",
                                      (namespace, request_key)).fetchone() is not None


    # ------------------------------------------------------------------ ledger
    def ledger(self, namespace: str) -> dict[str, float]:
        with self._lock:
            row = self._conn.execute("SELECT served_s, label_s, audit_s, requests, checksum FROM ledger "
                                     "WHERE namespace=?", (namespace,)).fetchone()
        if row is None:
            return {"served_s": 0.0, "label_s": 0.0, "audit_s": 0.0, "requests": 0}
        d = {"served_s": float(row[0]), "label_s": float(row[1]), "audit_s": float(row[2]), "requests": int(row[3])}
        if checksum(_dump(d)) != row[4]:
            self.corrupt += 1
        return d

    def charge(self, namespace: str, *, served_s: float = 0.0, label_s: float = 0.0, audit_s: float = 0.0,
               requests: int = 0) -> dict[str, float]:
        """Add compute to the namespace's ledger (one transaction); returns the new totals."""
        with self._tx() as c:
            row = c.execute("SELECT served_s, label_s, audit_s, requests FROM ledger WHERE namespace=?",
                            (namespace,)).fetchone()
            cur = row or (0.0, 0.0, 0.0, 0)
            d = {"served_s": float(cur[0]) + served_s, "label_s": float(cur[1]) + label_s,
                 "audit_s": float(cur[2]) + audit_s, "requests": int(cur[3]) + requests}
            c.execute("INSERT OR REPLACE INTO ledger VALUES (?, ?, ?, ?, ?, ?)",
                      (namespace, d["served_s"], d["label_s"], d["audit_s"], d["requests"], checksum(_dump(d))))
        return d

    # ------------------------------------------------------------------ events
    def add_event(self, namespace: str, kind: str, message: str, **facts: Any) -> None:
        """Record a state transition once: a transition with a key (``event_key``) already recorded — by another
        process deriving the same state at the same moment — is dropped, inside the same write transaction."""
        body = _dump({"kind": kind, "message": message, "t": time.time(), **facts})
        key = event_key(kind, facts)
        with self._tx() as c:
            if key:
                for (old,) in c.execute("SELECT body FROM events WHERE namespace=?", (namespace,)):
                    try:
                        d = json.loads(old)
                    except ValueError:
                        continue
                    if event_key(str(d.get("kind", "")), d) == key:
                        return
            c.execute("INSERT INTO events (namespace, body, checksum) VALUES (?, ?, ?)",
                      (namespace, body, checksum(body)))


    def namespaces(self) -> list[str]:
        with self._lock:
            rows = self._conn.execute("SELECT namespace FROM covariates UNION SELECT namespace FROM labels "
                                      "UNION SELECT namespace FROM ledger").fetchall()
        return sorted(r[0] for r in rows)
