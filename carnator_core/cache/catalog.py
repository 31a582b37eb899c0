"""The catalogue: an SQLite index over the entry files, which can always be rebuilt from them.

Contract
--------
* The catalogue holds nothing the entry files cannot restore except counters (lookups, hits, recency), which
  are statistics. It is created in exactly one place, ``build``: a new catalogue file is written next to the
  cache (``tmp/``), filled from the entry files, made durable and only then swapped in with ``os.replace``. A
  crash at any point leaves either the old catalogue or the new complete one, never a partial one that could
  be taken for the truth.
* ``problem(conn)`` says why an open catalogue must not be trusted: not SQLite, damaged pages
  (``PRAGMA quick_check``), a schema that is not exactly ours (triggers, views: ``trusted_schema=OFF`` alone does
  not stop a trigger), or another format version.
* ``connect`` registers ``carnator_priority`` (``policy.priority``) so SQL updates the eviction priority with the
  same Python definition the write path uses.
"""
from __future__ import annotations

import errno
import json
import os
import secrets
import sqlite3
import time
from pathlib import Path
from urllib.parse import quote

import numpy as np

from ..types import GenConfig
from .errors import NamespaceMismatchError
from .policy import priority

CATALOG = "catalog.sqlite3"
SIDE_FILES = ("-wal", "-shm", "-journal")
STORE_FORMAT = "carnator-cache"
STORE_VERSION = 1
WAL_CHECKPOINT_PAGES = 64  # ~256 KiB of 4 KiB pages between automatic checkpoints
WAL_LIMIT_BYTES = 256 << 10  # the log is truncated back to this after a checkpoint

SCHEMA = (
    "CREATE TABLE info(key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE namespaces(namespace TEXT PRIMARY KEY, model_fingerprint TEXT NOT NULL, config_json TEXT NOT NULL,"
    " dim INTEGER NOT NULL, token TEXT NOT NULL, generation INTEGER NOT NULL, index_generation INTEGER NOT NULL,"
    " created REAL NOT NULL)",
    "CREATE TABLE entries(seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, namespace TEXT NOT NULL,"
    " prompt TEXT NOT NULL, prompt_digest TEXT NOT NULL, seed TEXT NOT NULL, nbytes INTEGER NOT NULL,"
    " meta_digest TEXT NOT NULL, work REAL NOT NULL, priority REAL NOT NULL, created REAL NOT NULL,"
    " last_access REAL NOT NULL, hits INTEGER NOT NULL, request_key TEXT NOT NULL DEFAULT '',"
    " answer INTEGER NOT NULL DEFAULT 0, UNIQUE(namespace, prompt_digest, seed, request_key))",
    "CREATE INDEX entries_namespace ON entries(namespace)",
    "CREATE INDEX entries_request_key ON entries(request_key)",
    "CREATE INDEX entries_priority ON entries(priority)",
    "CREATE INDEX entries_last_access ON entries(last_access)",
    "CREATE TABLE embeddings(seq INTEGER PRIMARY KEY, vec BLOB NOT NULL)",
    "CREATE TABLE changes(namespace TEXT NOT NULL, generation INTEGER NOT NULL, op TEXT NOT NULL,"
    " seq INTEGER NOT NULL, PRIMARY KEY(namespace, generation)) WITHOUT ROWID",
    "CREATE TABLE counters(namespace TEXT PRIMARY KEY, lookups INTEGER NOT NULL, hits INTEGER NOT NULL)",
)


def connect(path: Path, *, wal: bool = True, read_only: bool = False) -> sqlite3.Connection:
    """A connection with Carnator's settings (autocommit mode: callers use explicit transactions).

    read_only: open the file as immutable (no WAL, no locks, no writes at all) — the fallback that keeps reads
    working when the disk is too full for SQLite to create its WAL / shared-memory files."""
    if read_only:
        conn = sqlite3.connect(f"file:{quote(str(path))}?immutable=1", uri=True, isolation_level=None,
                               check_same_thread=False)
    else:
        conn = sqlite3.connect(path, timeout=60.0, isolation_level=None, check_same_thread=False)
    try:
        conn.execute("PRAGMA busy_timeout=60000")
        conn.execute("PRAGMA trusted_schema=OFF")
        if wal and not read_only:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            # Keep the write-ahead log small: checkpoint every WAL_CHECKPOINT_PAGES pages (SQLite's default, 1000
            # pages = 4 MiB, is many times a small cache's whole budget) and truncate the log back to
            # WAL_LIMIT_BYTES after each checkpoint (by default it never shrinks while the catalogue is open).
            conn.execute(f"PRAGMA wal_autocheckpoint={WAL_CHECKPOINT_PAGES}")
            conn.execute(f"PRAGMA journal_size_limit={WAL_LIMIT_BYTES}")
        conn.create_function("carnator_priority", 4, priority, deterministic=True)
    except BaseException:
        conn.close()
        raise
    return conn


def is_corruption(e: sqlite3.Error) -> bool:
    """True for "this is not a (valid) database" errors, False for busy/locked/permission/full errors."""
    name = getattr(e, "sqlite_errorname", "") or ""
    if name in ("SQLITE_CORRUPT", "SQLITE_NOTADB") or name.startswith(("SQLITE_CORRUPT_", "SQLITE_NOTADB_")):
        return True
    if name:
        return False
    msg = str(e).lower()
    return "not a database" in msg or "malformed" in msg


def is_full(e: BaseException) -> bool:
    """True for "no space left" from SQLite (SQLITE_FULL) or the OS (ENOSPC / EDQUOT)."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return True
    if isinstance(e, sqlite3.Error):
        name = getattr(e, "sqlite_errorname", "") or ""
        return name == "SQLITE_FULL" or "disk is full" in str(e).lower()
    return False


def _reference_schema() -> set[tuple[str, str, str]]:
    ref = sqlite3.connect(":memory:")
    try:
        for ddl in SCHEMA:
            ref.execute(ddl)
        return {(t, n, s) for t, n, s in ref.execute("SELECT type, name, sql FROM sqlite_master")}
    finally:
        ref.close()


def problem(conn: sqlite3.Connection, *, integrity: bool = True) -> str | None:
    """None if ``conn`` is a healthy catalogue of our schema and version, else why it is not (may raise
    sqlite3.DatabaseError for a file that is not a database at all). ``integrity``: also run
    ``PRAGMA quick_check`` (reads every page: O(size))."""
    rows = conn.execute("SELECT type, name, sql FROM sqlite_master").fetchall()
    got = {(t, n, s) for t, n, s in rows}
    want = _reference_schema()
    seq = ("table", "sqlite_sequence", "CREATE TABLE sqlite_sequence(name,seq)")
    got.discard(seq)
    want.discard(seq)
    if got != want:
        extra = sorted(n for _, n, _ in got - want)
        missing = sorted(n for _, n, _ in want - got)
        return f"catalogue schema differs from Carnator's (unexpected: {extra}, missing: {missing})"
    info = dict(conn.execute("SELECT key, value FROM info").fetchall())
    if info.get("format") != STORE_FORMAT or info.get("version") != str(STORE_VERSION):
        return f"catalogue is format {info.get('format')!r} v{info.get('version')!r}"
    # Catalogues written before this flag existed have no "complete" row; they are accepted, and any entry file
    # they lack is adopted by the store's scan (entry files without rows are never deleted).
    if info.get("complete", "1") != "1":
        return "catalogue was never completed (a rebuild was interrupted)"
    check = [r[0] for r in conn.execute("PRAGMA quick_check(5)").fetchall()] if integrity else ["ok"]
    if check != ["ok"]:
        return "damaged pages: " + "; ".join(str(c) for c in check)
    return None


def create(conn: sqlite3.Connection) -> None:
    """Create the schema in an empty database (inside the caller's transaction); ``complete`` is set by
    ``mark_complete`` once the catalogue holds every entry."""
    for ddl in SCHEMA:
        conn.execute(ddl)
    # content_version starts at a time stamp so that it differs from the catalogue this one replaces.
    conn.executemany("INSERT INTO info(key, value) VALUES (?, ?)",
                     [("format", STORE_FORMAT), ("version", str(STORE_VERSION)), ("inflation", "0"),
                      ("content_version", str(time.time_ns() // 1000)), ("complete", "0")])


def mark_complete(conn: sqlite3.Connection) -> None:
    conn.execute("UPDATE info SET value='1' WHERE key='complete'")


def ensure_namespace(c: sqlite3.Connection, ns: str, model_fp: str, config: GenConfig, dim: int) -> None:
    """Create ``ns`` pinned to this model / config / dimension, or check that it already is."""
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


def insert_row(c: sqlite3.Connection, entry_id: str, ns: str, prompt: str, prompt_digest: str, seed: int,
               nbytes: int, meta_digest: str, work: float, emb: np.ndarray, created: float,
               request_key: str = "", answer: bool = False) -> int:
    """Insert one entry (row, embedding, change-log record); returns its seq. Raises sqlite3.IntegrityError for
    an id or (namespace, prompt, seed, request key) that is already there. An answer-only entry (``answer``,
    ``EntryData.answer_of``) gets no embedding row and no "add" record: it is never in a recall index (its
    deletion is logged like any other; removing an absent id from an index is a no-op)."""
    inflation = float(c.execute("SELECT value FROM info WHERE key='inflation'").fetchone()[0])
    cur = c.execute(
        "INSERT INTO entries(id, namespace, prompt, prompt_digest, seed, nbytes, meta_digest, work, priority,"
        " created, last_access, hits, request_key, answer)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, carnator_priority(?, 0, ?, ?), ?, ?, 0, ?, ?)",
        (entry_id, ns, prompt, prompt_digest, str(seed), nbytes, meta_digest, work, inflation, work, nbytes, created,
         created, request_key, int(bool(answer))))
    seq = int(cur.lastrowid)
    if answer:
        c.execute("UPDATE info SET value=CAST(value AS INTEGER)+1 WHERE key='content_version'")
        return seq
    c.execute("INSERT INTO embeddings(seq, vec) VALUES (?, ?)", (seq, np.ascontiguousarray(emb, np.float32).tobytes()))
    log_changes(c, ns, [("add", seq)])
    return seq


def log_changes(c: sqlite3.Connection, ns: str, ops: list[tuple[str, int]]) -> None:
    gen = int(c.execute("SELECT generation FROM namespaces WHERE namespace=?", (ns,)).fetchone()[0])
    c.executemany("INSERT INTO changes(namespace, generation, op, seq) VALUES (?, ?, ?, ?)",
                  [(ns, gen + i + 1, op, seq) for i, (op, seq) in enumerate(ops)])
    c.execute("UPDATE namespaces SET generation=? WHERE namespace=?", (gen + len(ops), ns))
    c.execute("UPDATE info SET value=CAST(value AS INTEGER)+1 WHERE key='content_version'")


def delete_rows(c: sqlite3.Connection, rows: list[tuple[int, str, str]]) -> None:
    """Delete entries (seq, id, namespace) and log the deletions (caller holds a write transaction)."""
    by_ns: dict[str, list[int]] = {}
    for seq, _, ns in rows:
        by_ns.setdefault(ns, []).append(int(seq))
    for ns, seqs in by_ns.items():
        for i in range(0, len(seqs), 900):
            chunk = seqs[i : i + 900]
            marks = ",".join("?" * len(chunk))
            c.execute(f"DELETE FROM entries WHERE seq IN ({marks})", chunk)
            c.execute(f"DELETE FROM embeddings WHERE seq IN ({marks})", chunk)
        log_changes(c, ns, [("del", s) for s in seqs])


def fsync_path(path: Path) -> None:
    """fsync a file or directory; filesystems without directory fsync are tolerated (renames stay atomic)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
