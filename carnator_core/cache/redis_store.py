"""Carnator's shared cache store on Redis: one cache for a farm of ComfyUI workers (processes and machines).

The same public surface and semantics as the on-disk ``Store`` (``store.py``), because both are one
orchestration (``orchestra.StoreOrchestra``: recall, the put/publish protocol, eviction, quarantine, answer-only
entries, statistics) over their own storage; this module is the Redis storage. ``put`` / ``put_with_status``,
``load``, ``load_signature``, ``record_hit``, ``record_lookup``, ``query``, ``candidates``, ``find_request``,
``stats``, ``purge``, ``delete``, ``verify``, ``scan``, ``namespaces``, ``entry_ids``, ``index_kind``,
``content_version``, ``close`` (``query`` / ``candidates`` / ``load`` take ``model_fingerprint=`` and refuse
another model's namespace or entry, as on disk); the same errors (``errors.py``: ``EntryNotFoundError``,
``CorruptEntryError``, ``CacheBudgetError``, ``NamespaceMismatchError``) plus ``CacheUnavailableError`` (also a
``CacheError``) when Redis cannot be reached.

Key layout (prefix ``carnator``; ``{ns}`` is a Redis Cluster hash tag, so every key of a namespace lives in one
hash slot and each multi-key step below is one atomic Lua script in that slot)::

    carnator:format                       {"format": "carnator-cache", "version": 1, "backend": "redis"}
    carnator:namespaces                   set of namespaces ever written (empty ones are skipped by stats)
    carnator:tags                         hash: 8-hex namespace tag -> namespace (entry ids start with the tag)
    carnator:inflation                    the LCBFU/GDSF clock L (policy.py), shared by all workers
    carnator:evict-lock                   short-lived lock: one worker evicts at a time
    carnator:requests                     hash: request key -> entry id (exact repeats; a hint, see below)
    carnator:{ns}:meta                    hash: model fingerprint, config JSON, embedding dim, token, created
    carnator:{ns}:gen / :seq              change counter (one per publish/eviction) / entry sequence numbers
    carnator:{ns}:e:<id>                  hash: catalogue row (prompt, seed, nbytes, digest, work, hits, ...,
                                          signature copy + checksum)
    carnator:{ns}:b:<id>                  list: the entry's bytes in chunks (``entry.py``'s format, as on disk)
    carnator:{ns}:stage:<id>              list: chunks being written (TTL; renamed to :b:<id> on publish)
    carnator:{ns}:emb / :sid              hash: seq -> embedding float32 bytes / seq -> entry id
    carnator:{ns}:ans                     set: seqs of answer-only entries (``EntryData.answer_of``; no :emb)
    carnator:{ns}:prio / :lru             sorted sets "<seq:012d>:<id>" by LCBFU priority / last access
    carnator:{ns}:dedup                   hash: sha256(prompt):seed[:request key] -> entry id (cached once)
    carnator:{ns}:bytes                   total entry bytes of the namespace
    carnator:{ns}:counters                hash: lookups, hits
    carnator:{ns}:log                     stream of changes: op (add/del), gen, seq, id (trimmed ~STREAM_KEEP)
    carnator:{ns}:q:<id> / :qreason       quarantined bytes (TTL QUARANTINE_TTL_S) / id -> reason

Contracts
---------
* **One entry format.** An entry's bytes are ``entry.encode_entry``'s, byte for byte what the on-disk store
  writes to a file, and every load checks them with ``entry.decode_entry`` (tensors + JSON metadata with a sha256
  per tensor; never pickle). The row's signature copy (for recall without the latents) holds the entry's ``sig.*``
  tensors (``entry.signature_tensors``); everything else is plain strings/numbers. A value that fails to parse
  or verify is quarantined: its bytes are moved to ``:q:<id>`` with a reason, the entry is unpublished, one
  warning is logged and ``CorruptEntryError`` raised; nothing else is touched.
* **Atomic publish.** A writer first stages the chunks under ``:stage:<id>`` (created with a TTL in one
  MULTI/EXEC, extended only with RPUSHX, so it can never lose its TTL), then one Lua script checks the staging
  is complete, refuses a namespace/model/config/dimension mismatch, dedupes (same namespace + prompt + seed +
  request key = one entry, whoever publishes first wins), renames the staging to ``:b:<id>`` and writes the row,
  embedding, sorted sets, byte total and a stream record. Other workers see all of it or nothing; a writer killed before
  the script leaves only a staging key that expires.
* **Exact repeats.** ``find_request(key)`` answers a request whose ``EntryData.request_key`` is cached. A key
  does not name its namespace, so the key -> id map cannot live in a namespace's slot: it is the one global hash
  ``carnator:requests``, written right after the atomic publish (and again whenever a put finds the request
  already cached, which heals a hint lost to a writer that died between the two steps) and cleared, only if it
  still names that entry, when the entry is deleted, evicted, quarantined or purged. The hint is never trusted:
  the entry's row (in its namespace's slot, written by the same publish script) records its request key, and
  ``find_request`` returns the id only if that row exists and holds exactly this key; a stale hint (the entry
  went between two steps of other workers) answers None and is removed there and then (and by ``scan``). A
  reader that loses the race with an eviction after the check gets ``EntryNotFoundError`` from ``load``, which
  the request treats as "not an answer". Two round trips (hint, then the row), no counting. Several entries may
  hold one key (another prompt label or probe setting: the same dense output); the last published is named, and
  when it goes the others are not found by key until that request is put again (a miss, never a wrong answer;
  the on-disk store would name the newest remaining one). An *answer-only* entry (``EntryData.answer_of``: a hit's
  result stored under its answer key) is published like any entry but without an embedding: it is in ``:ans``,
  never in a recall index (its "add" record finds no vector and is skipped), and only ``find_request`` finds it.
* **Recall stays local.** Each process keeps a FAISS index per namespace (``index.py``), built from ``:emb`` on
  first use and brought up to date from the ``:log`` stream before every query (one round trip). A stream gap
  (trimmed, or Redis restarted from an older snapshot), a new namespace token (purge) or a generation that went
  backwards rebuilds the index from ``:emb``. An entry evicted between recall and load raises
  ``EntryNotFoundError``: the request continues dense.
* **Capacity.** ``max_bytes`` bounds the bytes of all namespaces together (this handle's writes enforce it, as on
  disk); after a publish the worker takes the eviction lock and evicts the lowest-priority entries across
  namespaces (``policy.py``: ``lcbfu`` by default, or ``lru``), raising the shared clock L to the evicted
  priority. Ties go to the oldest entry of a namespace. Redis itself must not evict (``maxmemory-policy
  noeviction``): Carnator's budget decides what goes.
* **Faults.** When Redis cannot be reached, every operation raises ``CacheUnavailableError`` quickly (after a
  failure Redis is not retried for ``retry_s``), except ``candidates``, which answers "no candidates" with the
  reason so the request runs dense. One warning per process is logged when Redis goes away and one info line
  when it is back; reuse resumes by itself. A read-only Redis (a replica) serves recalls, exact repeats and
  loads; counters are skipped, a write raises ``CacheReadOnlyError`` (a ``CacheError``), said once in the log.
"""
from __future__ import annotations

import hashlib
import heapq
import json
import logging
import secrets
import threading
import time
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, TypeVar

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from safetensors.torch import load as st_load, save as st_save

from ..types import Signature
from .catalog import STORE_FORMAT, STORE_VERSION
from .common import format_bytes
from .entry import (
    EncodedEntry,
    EntryData,
    encode_entry,
    signature_from,
    signature_tensors,
    valid_entry_id,
    valid_namespace,
)
from .errors import (
    CacheError,
    CacheFullError,
    CacheReadOnlyError,
    CacheUnavailableError,
    EntryNotFoundError,
    NamespaceMismatchError,
)
from .index import IndexParams, VectorIndex
from .orchestra import NamespaceCounts, StoredEntry, StoredSignature, StoreOrchestra, Victim
from .policy import check_policy, priority, work_of
from .redis_url import connect_url, public_url
from .sigcache import SignatureLRU

log = logging.getLogger("carnator")

PREFIX = "carnator"
# Entry bytes are stored in values just under 4 MiB (a Wan entry of ~23 MiB is 6 of them): no single huge value,
# and a value plus Redis's header stays inside jemalloc's 4 MiB size class (exactly 4 MiB would be rounded up to
# the 5 MiB class: +25% memory, measured in BENCHMARKS.md).
CHUNK_BYTES = (4 << 20) - 4096
STAGE_TTL_S = 600  # a staging key outlives any healthy write, and vanishes after a writer died
QUARANTINE_TTL_S = 7 * 86400  # quarantined bytes are kept a week for inspection (memory is precious in Redis)
STREAM_KEEP = 50_000  # change records kept per namespace; a worker further behind rebuilds its index
LOCK_TTL_MS = 30_000
_EVICT_LOCK = f"{PREFIX}:evict-lock"

T = TypeVar("T")


# ---------------------------------------------------------------------------------------------- signature copy
# Recall needs each candidate's Early Signature without the entry's latents, so the row keeps a copy: the entry's
# ``sig.*`` tensors (``entry.signature_tensors``) in a small safetensors value whose metadata names the entry and
# holds the signature's JSON part. It is checksummed in the row; the entry bytes themselves stay the one format.
def _signature_blob(entry_id: str, signature: Signature) -> bytes:
    meta = json.dumps({"id": entry_id, "signature": signature.to_meta()}, sort_keys=True)
    return st_save(signature_tensors(signature), metadata={"carnator-signature": meta})


# ---------------------------------------------------------------------------------------------- Lua scripts
# Every script touches keys of one namespace only (one hash slot). Per-entry keys are built inside the scripts
# from the namespace's key prefix (KEYS[1]), which shares the hash tag.
_PUBLISH = """
local p = KEYS[1]
local id = ARGV[1]
local stage = p .. 'stage:' .. id
local nchunks = tonumber(ARGV[12])
local dup = redis.call('HGET', p .. 'dedup', ARGV[14])
if dup then
  redis.call('DEL', stage)
  return {'dup', dup}
end
if redis.call('EXISTS', stage) == 0 or redis.call('LLEN', stage) ~= nchunks then
  return {'incomplete'}
end
local meta = p .. 'meta'
if redis.call('EXISTS', meta) == 1 then
  local m = redis.call('HMGET', meta, 'fp', 'config', 'dim')
  if m[1] ~= ARGV[2] or m[2] ~= ARGV[3] then
    redis.call('DEL', stage)
    return {'mismatch', 'model', m[1]}
  end
  if m[3] ~= ARGV[4] then
    redis.call('DEL', stage)
    return {'mismatch', 'dim', m[3]}
  end
else
  redis.call('HSET', meta, 'fp', ARGV[2], 'config', ARGV[3], 'dim', ARGV[4], 'token', ARGV[5], 'created', ARGV[6])
end
local e = p .. 'e:' .. id
if redis.call('EXISTS', e) == 1 then
  return {'collision'}
end
local seq = redis.call('INCR', p .. 'seq')
local member = string.format('%012d:%s', seq, id)
redis.call('RENAME', stage, p .. 'b:' .. id)
redis.call('PERSIST', p .. 'b:' .. id)
redis.call('HSET', e, 'seq', seq, 'prompt', ARGV[7], 'seed', ARGV[8], 'nbytes', ARGV[9], 'digest', ARGV[10],
  'work', ARGV[11], 'nchunks', ARGV[12], 'sig', ARGV[13], 'sigsum', ARGV[17], 'dedup', ARGV[14], 'created', ARGV[6],
  'last_access', ARGV[6], 'hits', 0, 'rk', ARGV[19], 'answer', ARGV[20])
redis.call('ZADD', p .. 'prio', ARGV[15], member)
redis.call('ZADD', p .. 'lru', ARGV[6], member)
if ARGV[20] == '1' then
  redis.call('SADD', p .. 'ans', seq)
else
  redis.call('HSET', p .. 'emb', seq, ARGV[16])
end
redis.call('HSET', p .. 'sid', seq, id)
redis.call('HSET', p .. 'dedup', ARGV[14], id)
redis.call('INCRBY', p .. 'bytes', ARGV[9])
local g = redis.call('INCR', p .. 'gen')
redis.call('XADD', p .. 'log', 'MAXLEN', '~', ARGV[18], '*', 'op', 'add', 'gen', g, 'seq', seq, 'id', id)
return {'ok', seq}
"""

# ARGV: id, stream keep, quarantine reason ('' = plain delete), quarantine ttl. Returns {bytes freed (-1: gone),
# the entry's request key ('' = none)}.
_DELETE = """
local p = KEYS[1]
local id = ARGV[1]
local e = p .. 'e:' .. id
local r = redis.call('HMGET', e, 'seq', 'nbytes', 'dedup', 'rk')
if not r[1] then return {-1, ''} end
local seq = tonumber(r[1])
local member = string.format('%012d:%s', seq, id)
redis.call('ZREM', p .. 'prio', member)
redis.call('ZREM', p .. 'lru', member)
redis.call('HDEL', p .. 'emb', seq)
redis.call('SREM', p .. 'ans', seq)
redis.call('HDEL', p .. 'sid', seq)
if r[3] and redis.call('HGET', p .. 'dedup', r[3]) == id then redis.call('HDEL', p .. 'dedup', r[3]) end
redis.call('DECRBY', p .. 'bytes', r[2])
redis.call('DEL', e)
local b = p .. 'b:' .. id
if ARGV[3] ~= '' then
  if redis.call('EXISTS', b) == 1 then
    redis.call('RENAME', b, p .. 'q:' .. id)
    redis.call('EXPIRE', p .. 'q:' .. id, ARGV[4])
  end
  redis.call('HSET', p .. 'qreason', id, ARGV[3])
else
  redis.call('UNLINK', b)
end
local g = redis.call('INCR', p .. 'gen')
redis.call('XADD', p .. 'log', 'MAXLEN', '~', ARGV[2], '*', 'op', 'del', 'gen', g, 'seq', seq, 'id', id)
return {tonumber(r[2]), r[4] or ''}
"""

# ARGV: id, inflation, now. Returns the entry's hits after this one (-1: gone).
_HIT = """
local p = KEYS[1]
local id = ARGV[1]
local e = p .. 'e:' .. id
local r = redis.call('HMGET', e, 'seq', 'work', 'nbytes')
if not r[1] then return -1 end
local hits = redis.call('HINCRBY', e, 'hits', 1)
redis.call('HSET', e, 'last_access', ARGV[3])
local member = string.format('%012d:%s', tonumber(r[1]), id)
local nb = math.max(1, tonumber(r[3]))
local prio = tonumber(ARGV[2]) + (1 + hits) * tonumber(r[2]) / nb
redis.call('ZADD', p .. 'prio', 'XX', string.format('%.17g', prio), member)
redis.call('ZADD', p .. 'lru', 'XX', ARGV[3], member)
redis.call('HINCRBY', p .. 'counters', 'hits', 1)
return hits
"""

# Removes every entry and the namespace's state (a recreated namespace gets a new token). Returns the count and
# the (request key, id) pairs of the removed entries that had a key (their hints are cleared by the caller).
_PURGE = """
local p = KEYS[1]
local members = redis.call('ZRANGE', p .. 'lru', 0, -1)
local keyed = {}
for _, m in ipairs(members) do
  local id = string.sub(m, 14)
  local rk = redis.call('HGET', p .. 'e:' .. id, 'rk')
  if rk and rk ~= '' then
    keyed[#keyed + 1] = rk
    keyed[#keyed + 1] = id
  end
  redis.call('UNLINK', p .. 'e:' .. id, p .. 'b:' .. id)
end
for _, k in ipairs({'meta', 'gen', 'seq', 'emb', 'ans', 'sid', 'prio', 'lru', 'dedup', 'bytes', 'counters', 'log'}) do
  redis.call('UNLINK', p .. k)
end
return {#members, keyed}
"""

# The exact-repeat hints (KEYS[1] = carnator:requests, one key): ARGV is (request key, entry id) pairs; each hint
# is removed only if it still names that entry (a newer entry's hint stays). Returns how many were removed.
_FORGET_REQUESTS = """
local n = 0
for i = 1, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then
    n = n + redis.call('HDEL', KEYS[1], ARGV[i])
  end
end
return n
"""

# ARGV: id, recorded size, actual size. Corrects a row whose size disagrees with its (verified) bytes, and the
# namespace's byte total with it; only if the row still records that size. Returns 1 if corrected.
_FIX_SIZE = """
local p = KEYS[1]
local e = p .. 'e:' .. ARGV[1]
if redis.call('HGET', e, 'nbytes') ~= ARGV[2] then return 0 end
redis.call('HSET', e, 'nbytes', ARGV[3])
redis.call('INCRBY', p .. 'bytes', tonumber(ARGV[3]) - tonumber(ARGV[2]))
return 1
"""

_MAX_UPDATE = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) > cur then redis.call('SET', KEYS[1], ARGV[1]) end
return 1
"""

_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

_CONN_ERRORS = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)
# URLs whose outage has been logged in this process (by any store instance: the nodes' and the panel's), so an
# outage is one warning and its end one info line, however many handles notice it.
_OUTAGES: set[str] = set()
_OUTAGES_LOCK = threading.Lock()


@dataclass
class _NsIndex:
    token: str
    generation: int
    last_xid: str
    index: VectorIndex
    ids: set[int] = field(default_factory=set)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def ns_tag(ns: str) -> str:
    """The 8-hex tag of a namespace that starts each of its entry ids (ids alone locate their namespace)."""
    return hashlib.sha256(ns.encode()).hexdigest()[:8]


# ---------------------------------------------------------------------------------------------- the store
class RedisStore(StoreOrchestra):
    """The shared cache store on one Redis: the catalogue logic of ``StoreOrchestra`` over the key layout of the
    module docstring. Thread-safe; one per process and URL is enough (``handle.open_store`` keeps it), and any
    number of processes on any machines may share the Redis."""

    _ELSEWHERE = "Redis database"
    _PUBLISHED_STAGE = "after_publish"

    def __init__(self, url: str, client: redis.Redis, *, max_bytes: int | None, policy: str,
                 index_params: IndexParams, retry_s: float) -> None:
        self.url = url  # public (credential-free) form only
        self.max_bytes = int(max_bytes) if max_bytes else None
        self.policy = check_policy(policy)
        self.index_params = index_params
        self.retry_s = float(retry_s)
        self._r = client
        self._lock = threading.RLock()
        self._indexes: dict[str, _NsIndex] = {}
        self._tags: dict[str, str] = {}
        self._sigs = SignatureLRU()
        self._down_until = 0.0
        self._down_reason = ""
        self._read_only = False  # a write was refused by a read-only replica (logged once)
        self._full = False  # a command was refused for maxmemory: read without transactions (_read_pipeline)
        self._closed = False
        self._scripts = {name: client.register_script(src) for name, src in
                         (("publish", _PUBLISH), ("delete", _DELETE), ("hit", _HIT), ("purge", _PURGE),
                          ("max", _MAX_UPDATE), ("unlock", _UNLOCK), ("forget", _FORGET_REQUESTS),
                          ("fix_size", _FIX_SIZE))}
        # Fault injection for crash tests: called with a stage name ("after_stage", "after_publish") in put().
        self._fault: Callable[[str], None] | None = None

    # ------------------------------------------------------------------ open / close
    @classmethod
    def open(cls, url: str, *, max_bytes: int | None = None, policy: str = "lcbfu",
             index_params: IndexParams | None = None, retry_s: float = 2.0, socket_timeout: float = 30.0,
             connect_timeout: float = 2.0, full_url: str | None = None, claim: bool = True) -> "RedisStore":
        """Open the store on the Redis named by ``url`` (public form; the credentials come from
        ``CARNATOR_REDIS_URL`` via ``redis_url.connect_url`` unless ``full_url`` is given, e.g. by tests).

        Never fails because Redis is down (the store starts "unavailable", logs once and retries later); raises
        CacheError if the Redis holds another cache format, RedisConfigError for an unconfigured URL. ``claim``:
        write the format marker into an empty Redis (False: only check it, e.g. for read-only statistics).
        """
        public = public_url(url)
        full = full_url or connect_url(public)
        # One immediate retry: a pooled connection broken by a Redis restart is replaced at once instead of
        # costing a "down" period. Scripts stay safe when re-run (publish dedupes, delete/hit check existence).
        client = redis.Redis.from_url(full, socket_timeout=socket_timeout, socket_connect_timeout=connect_timeout,
                                      health_check_interval=30, retry=Retry(NoBackoff(), 1))
        st = cls(public, client, max_bytes=max_bytes, policy=policy, index_params=index_params or IndexParams(),
                 retry_s=retry_s)
        try:
            st._check_format(claim)
            st._check_eviction_policy()
        except CacheUnavailableError:
            pass  # already logged; operations retry after retry_s
        return st

    def _check_eviction_policy(self) -> None:
        """Warn once if Redis may evict keys by itself (it would drop parts of entries; Carnator's budget must
        decide). Managed Redis services often forbid CONFIG: then nothing is said."""
        try:
            policy = self._r.config_get("maxmemory-policy").get("maxmemory-policy")
        except (redis.ResponseError, *_CONN_ERRORS):
            return
        if policy and policy != "noeviction":
            log.warning("carnator cache: Redis at %s runs with maxmemory-policy %s; set it to noeviction (Redis "
                        "would otherwise drop parts of entries, which are then quarantined). Carnator's own byte "
                        "budget (max_gb on the Cache node) decides what is evicted.", self.url, policy)

    def _check_format(self, claim: bool = True) -> bool:
        """True if the Redis holds a Carnator cache (after claiming an empty one when ``claim``)."""
        marker = json.dumps({"format": STORE_FORMAT, "version": STORE_VERSION, "backend": "redis"})
        try:
            got = self._call(lambda: (claim and self._r.set(f"{PREFIX}:format", marker, nx=True),
                                      self._r.get(f"{PREFIX}:format")))
        except CacheReadOnlyError:  # a read-only replica: check the marker its primary wrote
            got = (None, self._call(lambda: self._r.get(f"{PREFIX}:format")))
        if got[1] is None and not claim:
            return False
        try:
            m = json.loads(got[1])
        except (TypeError, ValueError):
            m = {}
        if m.get("format") != STORE_FORMAT or m.get("version") != STORE_VERSION:
            raise CacheError(f"the Redis at {self.url} holds cache format {m.get('format')!r} v{m.get('version')!r}; "
                             f"this Carnator uses {STORE_FORMAT!r} v{STORE_VERSION}. Use another Redis database "
                             "(redis://host:port/N) or upgrade Carnator.")
        return True

    def exists(self) -> bool:
        """True if this Redis holds a Carnator cache (its format marker); raises CacheUnavailableError if down."""
        return self._check_format(claim=False)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._indexes.clear()
            self._r.close()

    # ------------------------------------------------------------------ connection faults
    def _call(self, fn: Callable[[], T]) -> T:
        """Run one Redis interaction; connection failures become CacheUnavailableError (logged once per outage)."""
        if self._closed:
            raise CacheError(f"the cache store at {self.url} is closed")
        if time.monotonic() < self._down_until:
            raise CacheUnavailableError(f"the shared cache at {self.url} is unreachable ({self._down_reason}); "
                                        "continuing without it")
        try:
            out = fn()
        except redis.ReadOnlyError as e:  # a read-only replica: reads work, writes are refused (said once)
            self._read_only = self._say_once(self._read_only, "is read-only (a replica); the cache serves "
                                             "recalls and exact repeats from it and writes nothing (no new entries, "
                                             "no counters)")
            raise CacheReadOnlyError(
                f"the shared cache at {self.url} is read-only ({e}): nothing was written; recalls, exact repeats "
                "and loads keep working. Point the cache at the primary Redis to cache new results.") from None
        except redis.OutOfMemoryError as e:  # maxmemory reached (noeviction): like a full disk
            self._full = self._say_once(self._full, "is full (maxmemory); nothing more is cached until entries are "
                                        "evicted or purged, reads keep working")
            raise CacheFullError(
                f"the shared cache at {self.url} is full (Redis refused a write: {e}): nothing was written; reads "
                "keep working. Lower max_gb on the Cache node so Carnator evicts older entries first, raise Redis's "
                "maxmemory, or purge entries.") from None
        except _CONN_ERRORS as e:
            self._down_reason = f"{type(e).__name__}: {e}"
            self._down_until = time.monotonic() + self.retry_s
            with _OUTAGES_LOCK:
                first = self.url not in _OUTAGES
                _OUTAGES.add(self.url)
            if first:
                log.warning("carnator cache: Redis at %s is unreachable (%s); requests continue without the shared "
                            "cache (dense) and reuse resumes when it is back", self.url, self._down_reason)
            raise CacheUnavailableError(f"the shared cache at {self.url} is unreachable ({self._down_reason}); "
                                        "continuing without it") from None
        if self._down_reason or self.url in _OUTAGES:
            self._down_reason = ""
            with _OUTAGES_LOCK:
                was_down = self.url in _OUTAGES
                _OUTAGES.discard(self.url)
            if was_down:
                log.info("carnator cache: Redis at %s is reachable again; reuse resumes", self.url)
        return out

    def _say_once(self, said: bool, what: str) -> bool:
        """Log "Redis at <url> <what>" unless ``said`` already (the state flag it sets); returns True."""
        if not said:
            log.warning("carnator cache: Redis at %s %s", self.url, what)
        return True

    def _read_pipeline(self) -> Any:
        """A pipeline for reads that must see one instant (MULTI/EXEC). Redis refuses every command queued in a
        transaction while it is over its maxmemory, so a full Redis gets a plain pipeline instead (reads keep
        working; ``load`` re-checks a read torn by a concurrent delete)."""
        return self._r.pipeline(transaction=not self._full)

    @property
    def available(self) -> bool:
        """False while the last Redis call failed (within ``retry_s``)."""
        return not self._down_reason

    # ------------------------------------------------------------------ keys
    @staticmethod
    def _p(ns: str) -> str:
        if not valid_namespace(ns):
            raise ValueError(f"invalid namespace {str(ns)[:200]!r}")
        return f"{PREFIX}:{{{ns}}}:"

    def _ns_of(self, entry_id: str) -> str | None:
        # Ids have the local store's shape (16 hex): 8 hex of the namespace tag + 8 random hex.
        if not valid_entry_id(entry_id):
            raise EntryNotFoundError(f"{str(entry_id)[:100]!r} is not a Carnator cache entry id")
        tag = entry_id[:8]
        ns = self._tags.get(tag)
        if ns is None:
            raw = self._call(lambda: self._r.hget(f"{PREFIX}:tags", tag))
            if raw is None:
                return None
            ns = self._tags[tag] = _s(raw)
        return ns

    def _register_ns(self, ns: str) -> None:
        """Record the namespace and its id tag (on every write: a Redis that lost its data must learn them again,
        or other workers could not resolve the new ids)."""
        tag = ns_tag(ns)
        pipe = self._r.pipeline(transaction=False)
        pipe.sadd(f"{PREFIX}:namespaces", ns)
        pipe.hsetnx(f"{PREFIX}:tags", tag, ns)
        pipe.hget(f"{PREFIX}:tags", tag)
        got = _s(self._call(pipe.execute)[2])
        if got != ns:
            raise NamespaceMismatchError(f"namespace {ns} and {got} share the id tag {tag} in {self.url} (a 32-bit "
                                         "hash collision): purge one of them or use another Redis database")
        self._tags[tag] = ns

    def _inflation(self) -> float:
        return float(self._call(lambda: self._r.get(f"{PREFIX}:inflation")) or 0.0)

    # ------------------------------------------------------------------ write path
    # ------------------------------------------------------------------ storage: put / publish
    def _boundary(self, what: str) -> AbstractContextManager[None]:
        return nullcontext()  # every Redis interaction is translated where it is made (_call)

    def _validate_namespace(self, namespace: str) -> None:
        self._p(namespace)

    def _check_writable(self) -> None:
        pass  # a read-only replica or a full Redis refuses the first write (_call says which)

    @property
    def _where(self) -> str:
        return self.url

    @staticmethod
    def _dedup_key(data: EntryData) -> str:
        """As on disk, one entry per (namespace, prompt, seed, request key); "" keeps the key of keyless entries."""
        rk = data.request_key
        return f"{hashlib.sha256(data.prompt.encode()).hexdigest()}:{int(data.seed)}" + (f":{rk}" if rk else "")

    def _find_duplicate(self, data: EntryData) -> str | None:
        existing = self._call(lambda: self._r.hget(self._p(data.namespace) + "dedup", self._dedup_key(data)))
        return None if existing is None else _s(existing)

    def _new_entry_id(self, namespace: str) -> str:
        self._register_ns(namespace)
        return ns_tag(namespace) + secrets.token_hex(4)

    def _publish(self, data: EntryData, entry_id: str, enc: EncodedEntry, created: float) -> tuple[str, bool]:
        """Stage the chunks under a TTL, then one Lua script publishes everything (see the module docstring)."""
        ns = data.namespace
        p = self._p(ns)
        dedup_key = self._dedup_key(data)
        cfg_json = json.dumps(data.config.to_meta(), sort_keys=True)
        work = work_of(data.config.steps, data.config.probe_steps, data.config.latent_shape)
        for _ in range(8):  # a random-id collision within the namespace: retry with a fresh id
            blob, emb, sig_blob = enc.blob, enc.embedding, _signature_blob(entry_id, data.signature)
            stage = f"{p}stage:{entry_id}"
            chunks = [blob[i : i + CHUNK_BYTES] for i in range(0, len(blob), CHUNK_BYTES)] or [b""]

            def stage_chunks() -> None:
                first = self._r.pipeline(transaction=True)  # the key exists only with its TTL
                first.rpush(stage, chunks[0])
                first.expire(stage, STAGE_TTL_S)
                first.execute()
                for c in chunks[1:]:
                    if not self._r.rpushx(stage, c):
                        raise CacheError(f"staging of entry {entry_id} expired while it was written (over "
                                         f"{STAGE_TTL_S} s); nothing was published")
                    self._r.expire(stage, STAGE_TTL_S)

            self._call(stage_chunks)
            if self._fault:
                self._fault("after_stage")
            prio = priority(self._inflation(), 0, work, len(blob))
            args = [entry_id, data.model_fingerprint, cfg_json, int(emb.shape[0]), secrets.token_hex(8),
                    repr(created), data.prompt, int(data.seed), len(blob), enc.meta_digest, repr(work), len(chunks),
                    sig_blob, dedup_key, repr(prio), np.ascontiguousarray(emb, np.float32).tobytes(),
                    hashlib.sha256(sig_blob).hexdigest(), STREAM_KEEP, data.request_key,
                    "1" if data.answer_of else "0"]
            res = self._call(lambda: self._scripts["publish"](keys=[p], args=args))
            status = _s(res[0])
            if status == "ok":
                break
            if status == "dup":
                return _s(res[1]), False
            if status == "mismatch":
                what = _s(res[1])
                if what == "dim":
                    raise NamespaceMismatchError(
                        f"namespace {ns} holds embeddings of dimension {_s(res[2])}, this entry has {emb.shape[0]}: "
                        "the text encoder changed for the same model/config; purge the namespace")
                raise NamespaceMismatchError(
                    f"namespace {ns} already holds entries of another model/config (fingerprint "
                    f"{_s(res[2])[:24]}...); this is a fingerprint collision: purge the namespace or use another "
                    "Redis database")
            if status == "incomplete":
                raise CacheError(f"staging of entry {entry_id} was incomplete at publish (expired or evicted by "
                                 "Redis? Redis must run with maxmemory-policy noeviction); nothing was published")
            self._call(lambda: self._r.delete(stage))  # collision: drop this staging, retry with a new id
            entry_id = ns_tag(ns) + secrets.token_hex(4)
            enc = encode_entry(data, entry_id=entry_id, created=created)  # the id is part of the entry's metadata
        else:
            raise CacheError(f"could not find a free entry id in namespace {ns} after 8 tries")
        self._full = False  # a write went through: transactions are accepted again
        return entry_id, True

    # ------------------------------------------------------------------ exact repeats
    def _note_request(self, request_key: str, entry_id: str) -> None:
        """Point the global hint of ``request_key`` at ``entry_id`` (after the entry is published; see the module
        docstring). A failure here loses only the hint: the entry is stored, and the next put of the same request
        writes the hint again."""
        if not request_key:
            return
        try:
            self._call(lambda: self._r.hset(f"{PREFIX}:requests", request_key, entry_id))
        except CacheUnavailableError:
            pass  # logged once by _call

    def _forget_requests(self, pairs: list[tuple[str, str]]) -> int:
        """Remove the hints of these (request key, entry id) pairs that still name that entry."""
        args = [x for pair in pairs if pair[0] for x in pair]
        if not args:
            return 0
        return int(self._call(lambda: self._scripts["forget"](keys=[f"{PREFIX}:requests"], args=args)))

    def _find_request(self, request_key: str) -> str | None:
        """The hint, trusted only when the entry's row holds exactly this key; a stale hint (the entry went between
        two steps of other workers) answers None and is removed."""
        raw = self._call(lambda: self._r.hget(f"{PREFIX}:requests", request_key))
        if raw is None:
            return None
        entry_id = _s(raw)
        ns = self._ns_of(entry_id) if valid_entry_id(entry_id) else None
        if ns is not None:
            held = self._call(lambda: self._r.hget(self._p(ns) + f"e:{entry_id}", "rk"))
            if held is not None and _s(held) == request_key:
                return entry_id
        try:
            self._forget_requests([(request_key, entry_id)])  # stale: the entry went between two steps of others
        except CacheReadOnlyError:
            pass  # a read-only replica: its primary clears the hint
        return None

    # ------------------------------------------------------------------ deletes / eviction / purge
    def _delete(self, ns: str, entry_id: str, reason: str = "") -> int:
        """Unpublish one entry (quarantine its bytes if ``reason``) and clear its exact-repeat hint. Returns its
        bytes, -1 if it was gone."""
        n, rk = self._call(lambda: self._scripts["delete"](keys=[self._p(ns)],
                                                           args=[entry_id, STREAM_KEEP, reason, QUARANTINE_TTL_S]))
        self._sigs.discard(entry_id)
        if rk:
            try:
                self._forget_requests([(_s(rk), entry_id)])
            except CacheUnavailableError:
                pass  # the hint is stale now; find_request and scan drop it
        return int(n)

    def _known_namespaces(self) -> list[str]:
        return sorted(_s(x) for x in self._call(lambda: self._r.smembers(f"{PREFIX}:namespaces")))

    def _total_bytes(self, nss: list[str]) -> int:
        pipe = self._r.pipeline(transaction=False)
        for ns in nss:
            pipe.get(self._p(ns) + "bytes")
        return sum(int(v or 0) for v in self._call(pipe.execute))

    def _remove(self, namespace: str, entry_id: str) -> bool:
        return self._delete(namespace, entry_id) >= 0

    def _stored_bytes(self) -> int:
        return self._total_bytes(self._known_namespaces())

    @contextmanager
    def _eviction_lock(self) -> Iterator[None]:
        """A Redis lock with a TTL (renewed after each removal), so a worker that dies holding it blocks nobody for
        long."""
        token = secrets.token_hex(8)
        deadline = time.monotonic() + 120
        while not self._call(lambda: self._r.set(_EVICT_LOCK, token, nx=True, px=LOCK_TTL_MS)):
            if time.monotonic() > deadline:
                raise CacheError(f"could not take the eviction lock of {self.url} within 120 s")
            time.sleep(0.02)
        try:
            yield
        finally:
            try:
                self._call(lambda: self._scripts["unlock"](keys=[_EVICT_LOCK], args=[token]))
            except CacheUnavailableError:
                pass  # the lock expires by itself

    def _eviction_plan(self) -> tuple[int, Iterator[Victim]]:
        nss = self._known_namespaces()
        return self._total_bytes(nss), self._eviction_order(nss)

    def _eviction_order(self, nss: list[str], page: int = 32) -> Iterator[Victim]:
        """Every entry of ``nss`` in eviction order: a merge of the namespaces' sorted sets (priority or recency;
        ties go to the oldest entry of a namespace), read ``page`` members at a time per namespace."""
        zset = "prio" if self.policy == "lcbfu" else "lru"
        heap: list[tuple[float, str, str, int]] = []
        offset = {ns: 0 for ns in nss}
        left: dict[str, int] = {}

        def fetch(batch: list[str]) -> None:
            pipe = self._r.pipeline(transaction=False)
            for ns in batch:
                pipe.zrange(self._p(ns) + zset, offset[ns], offset[ns] + page - 1, withscores=True)
            heads = self._call(pipe.execute)
            pipe = self._r.pipeline(transaction=False)
            for ns, head in zip(batch, heads):
                for m, _ in head:
                    pipe.hget(self._p(ns) + f"e:{_s(m)[13:]}", "nbytes")
            sizes = iter(self._call(pipe.execute))
            for ns, head in zip(batch, heads):
                offset[ns] += len(head)
                left[ns] = len(head) if len(head) == page else -1  # -1: nothing after this page
                for m, score in head:
                    nb = next(sizes)
                    heapq.heappush(heap, (float(score), _s(m), ns, -1 if nb is None else int(_s(nb))))

        fetch(list(nss))
        seen: set[str] = set()  # a member whose score changed between two pages (a hit meanwhile) comes once
        while heap:
            score, member, ns, nbytes = heapq.heappop(heap)
            if left[ns] > 0:
                left[ns] -= 1
                if left[ns] == 0:
                    fetch([ns])  # the namespace's next page, before its next member is compared
            if nbytes >= 0 and member not in seen:  # nbytes < 0: removed since the page was read
                seen.add(member)
                yield Victim(entry_id=member[13:], namespace=ns, nbytes=nbytes,
                             priority=score if zset == "prio" else None)

    def _remove_victims(self, victims: list[Victim], inflation: float | None) -> int:
        n = 0
        for v in victims:
            n += self._delete(v.namespace, v.entry_id) >= 0
            self._call(lambda: self._r.pexpire(_EVICT_LOCK, LOCK_TTL_MS))
        if inflation is not None:
            self._call(lambda: self._scripts["max"](keys=[f"{PREFIX}:inflation"], args=[repr(inflation)]))
        return n

    def _purge_storage(self, namespace: str | None) -> tuple[int, list[str]]:
        nss = [namespace] if namespace else self._known_namespaces()
        n = 0
        for ns in nss:
            count, keyed = self._call(lambda ns=ns: self._scripts["purge"](keys=[self._p(ns)]))
            n += int(count)
            keyed = [_s(x) for x in keyed]
            self._forget_requests(list(zip(keyed[0::2], keyed[1::2])))
        if not namespace:
            self._call(lambda: self._r.set(f"{PREFIX}:inflation", "0"))
        # Counted after the entries are gone: the Cache node's change fingerprint follows it, so ComfyUI runs a graph
        # again after a purge instead of answering it from its own node cache (as the disk store's info row does).
        self._call(lambda: self._r.incr(f"{PREFIX}:purges"))
        self._sigs.clear()
        self._full = False
        return n, nss

    def purge_count(self) -> int:
        """How many purges this cache has seen (any worker; 0 before the first)."""
        return int(self._call(lambda: self._r.get(f"{PREFIX}:purges")) or 0)

    # ------------------------------------------------------------------ quarantine
    def _set_aside(self, ns: str, entry_id: str, reason: str, **how: Any) -> tuple[str, str | None]:
        """The bytes go to ``:q:<id>`` (kept QUARANTINE_TTL_S) with the reason in ``:qreason``; unpublished."""
        stamped = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {reason}"
        where = f"{self._p(ns)}q:{entry_id}"
        try:
            removed = self._delete(ns, entry_id, reason=stamped) >= 0
        except (CacheUnavailableError, CacheReadOnlyError):
            removed = False
        return where, (where if removed else None)

    # ------------------------------------------------------------------ read path
    # ------------------------------------------------------------------ storage: reads and counters
    def _namespace_of(self, entry_id: str) -> str | None:
        return self._ns_of(entry_id)

    def _read_entry(self, entry_id: str) -> StoredEntry | None:
        ns = self._ns_of(entry_id)
        if ns is None:
            return None
        p = self._p(ns)

        def read() -> list:
            pipe = self._read_pipeline()  # row and bytes from one instant: never torn by a delete
            pipe.hmget(p + f"e:{entry_id}", "prompt", "seed", "nbytes", "digest", "created", "hits", "nchunks")
            pipe.lrange(p + f"b:{entry_id}", 0, -1)
            return pipe.execute()

        row, chunks = self._call(read)
        if row[0] is None:
            return None
        prompt, seed, nbytes, digest, created, hits, nchunks = (_s(x) for x in row)
        blob = b"".join(chunks)
        try:
            defect = "" if len(chunks) == int(nchunks) else \
                f"{len(chunks)} chunks stored, {nchunks} expected (evicted by Redis itself?)"
            if defect and self._full and not self._call(lambda: self._r.exists(p + f"e:{entry_id}")):
                return None  # a plain (non-transaction) read of a full Redis, torn by a concurrent delete
            return StoredEntry(namespace=ns, prompt=prompt, seed=int(seed), created=float(created), hits=int(hits),
                               nbytes=int(nbytes), meta_digest=digest, blob=blob, defect=defect)
        except ValueError as e:  # a row field that is not a number: "quarantine"
            return StoredEntry(namespace=ns, prompt=prompt, seed=0, created=0.0, hits=0, nbytes=len(blob),
                               meta_digest=digest, blob=blob, defect=f"{type(e).__name__}: {e}")

    def _correct_size(self, stored: Any, namespace: str, entry_id: str, recorded: int, actual: int) -> None:
        try:
            self._call(lambda: self._scripts["fix_size"](keys=[self._p(namespace)], args=[entry_id, recorded, actual]))
        except (CacheReadOnlyError, CacheFullError):
            pass  # best-effort: served all the same

    def _read_signature(self, entry_id: str, hint: Any = None) -> StoredSignature | None:
        """The row's signature copy (``hint``: (namespace, copy, checksum) read by ``_recall_rows``)."""
        if hint is None:
            ns = self._ns_of(entry_id)
            if ns is None:
                return None
            blob, sigsum = self._call(lambda: self._r.hmget(self._p(ns) + f"e:{entry_id}", "sig", "sigsum"))
            if blob is None and sigsum is None:
                return None
        else:
            ns, blob, sigsum = hint
        try:
            if blob is None or sigsum is None:
                raise ValueError("signature is missing")
            if hashlib.sha256(blob).hexdigest() != _s(sigsum):
                raise ValueError("signature checksum mismatch")
            n = int.from_bytes(blob[:8], "little")
            header = json.loads(blob[8 : 8 + n])
            sm = json.loads((header.get("__metadata__") or {})["carnator-signature"])
            if sm.get("id") != entry_id:
                raise ValueError(f"signature belongs to entry {sm.get('id')!r}")
            sig = signature_from({"signature": sm["signature"]}, st_load(blob))
        except Exception as e:  # noqa: BLE001
            return StoredSignature(namespace=ns, signature=None, defect=f"{type(e).__name__}: {e}")
        size = int(sig.nbytes()) if callable(getattr(sig, "nbytes", None)) else 0
        return StoredSignature(namespace=ns, signature=sig, memo_bytes=size)

    def _count_hit(self, namespace: str, entry_id: str) -> int:
        inflation = self._inflation()
        try:
            return int(self._call(lambda: self._scripts["hit"](keys=[self._p(namespace)],
                                                               args=[entry_id, repr(inflation), repr(time.time())])))
        except (CacheReadOnlyError, CacheFullError):  # counters are best-effort: a read must not fail on them
            held = self._call(lambda: self._r.hget(self._p(namespace) + f"e:{entry_id}", "hits"))
            return -1 if held is None else int(held)

    def _count_lookup(self, namespace: str) -> None:
        """Skipped on a read-only replica or a full Redis."""
        p = self._p(namespace)
        try:
            self._call(lambda: self._r.hincrby(p + "counters", "lookups", 1))
        except (CacheReadOnlyError, CacheFullError):
            pass

    # ------------------------------------------------------------------ retrieval
    # ------------------------------------------------------------------ storage: recall
    def _namespace_model(self, namespace: str) -> str | None:
        pinned = self._call(lambda: self._r.hget(self._p(namespace) + "meta", "fp"))
        return None if pinned is None else _s(pinned)

    def _ids_of(self, namespace: str, seqs: list[int]) -> dict[int, str]:
        ids = self._call(lambda: self._r.hmget(self._p(namespace) + "sid", seqs))
        return {s: _s(i) for s, i in zip(seqs, ids) if i is not None}

    def _recall_rows(self, namespace: str, ids: list[str]) -> dict[str, tuple[str, int, Any]]:
        """Prompt, seed and the signature copy of each id in one round trip."""
        p = self._p(namespace)
        pipe = self._r.pipeline(transaction=False)
        for entry_id in ids:
            pipe.hmget(p + f"e:{entry_id}", "prompt", "seed", "sig", "sigsum")
        return {i: (_s(r[0]), int(_s(r[1])), (namespace, r[2], r[3]))
                for i, r in zip(ids, self._call(pipe.execute)) if r[0] is not None}

    def _fetch_vectors(self, ns: str, seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        want = [int(s) for s in seqs]
        vals = self._call(lambda: self._r.hmget(self._p(ns) + "emb", want)) if want else []
        pairs = [(s, np.frombuffer(v, dtype=np.float32)) for s, v in zip(want, vals) if v is not None]
        if not pairs:
            return np.zeros(0, np.int64), np.zeros((0, 0), np.float32)
        return np.asarray([s for s, _ in pairs], np.int64), np.stack([v for _, v in pairs])

    # ------------------------------------------------------------------ index maintenance
    def _head(self, ns: str) -> tuple[str | None, int, int, str]:
        """(token, generation, dim, last stream id) of ``ns`` in one round trip (token None: no such namespace)."""
        p = self._p(ns)

        def read() -> list:
            pipe = self._read_pipeline()
            pipe.hmget(p + "meta", "token", "dim")
            pipe.get(p + "gen")
            pipe.xrevrange(p + "log", count=1)
            return pipe.execute()

        (token, dim), gen, last = self._call(read)
        xid = _s(last[0][0]) if last else "0-0"
        return (_s(token) if token is not None else None), int(gen or 0), int(dim or 0), xid

    def _sync(self, ns: str) -> _NsIndex | None:
        """This process's index of ``ns``, brought up to the published state (caller holds self._lock)."""
        token, gen, dim, xid = self._head(ns)
        if token is None:
            self._indexes.pop(ns, None)
            return None
        st = self._indexes.get(ns)
        if st is not None and (st.token != token or gen < st.generation or dim != st.index.dim):
            st = None  # purged and recreated, or Redis came back from an older snapshot
        if st is not None and (st.generation != gen or st.last_xid != xid):
            if not self._catch_up(ns, st):
                st = None
        if st is None:
            st = self._build(ns, token, dim)
        elif st.index.needs_rebuild(self.index_params):
            st = self._build(ns, token, dim)
        self._indexes[ns] = st
        return st

    def _read_log(self, ns: str, after: str) -> list[tuple[str, dict[str, str]]]:
        p = self._p(ns)
        out: list[tuple[str, dict[str, str]]] = []
        start = f"({after}" if after != "0-0" else "-"
        while True:
            batch = self._call(lambda: self._r.xrange(p + "log", min=start, count=10_000))
            out.extend((_s(i), {_s(k): _s(v) for k, v in f.items()}) for i, f in batch)
            if len(batch) < 10_000:
                return out
            start = f"({_s(batch[-1][0])}"

    def _apply(self, ns: str, st: _NsIndex, records: list[tuple[str, dict[str, str]]]) -> None:
        """Apply change records to ``st`` idempotently (adds of present ids and removes of absent ids are no-ops)."""
        net: dict[int, bool] = {}
        for _, f in records:
            net[int(f["seq"])] = f["op"] == "add"
        adds = [s for s, on in net.items() if on and s not in st.ids]
        drops = [s for s, on in net.items() if not on and s in st.ids]
        if drops:
            st.index.remove(np.asarray(drops, np.int64))
            st.ids.difference_update(drops)
        if adds:
            ids, vecs = self._fetch_vectors(ns, np.asarray(adds, np.int64))  # deleted meanwhile: absent, skipped
            if len(ids):
                st.index.add(ids, vecs)
                st.ids.update(int(i) for i in ids)
        if records:
            st.last_xid = records[-1][0]
            st.generation = int(records[-1][1]["gen"])

    def _catch_up(self, ns: str, st: _NsIndex) -> bool:
        """Bring ``st`` forward from the stream; False if the stream has a gap (trimmed past us) or disagrees."""
        records = self._read_log(ns, st.last_xid)
        if records and int(records[0][1]["gen"]) != st.generation + 1:
            return False
        if not records and st.last_xid != "0-0":
            return False
        self._apply(ns, st, records)
        return True

    def _build(self, ns: str, token: str, dim: int) -> _NsIndex:
        """Index every entry of ``ns``: a scan of its embeddings, then the change records written during the scan
        (idempotent), so the result is exact as of the last record applied."""
        p = self._p(ns)
        _, gen0, _, xid0 = self._head(ns)
        vecs: dict[int, np.ndarray] = {}
        cursor = 0
        while True:
            cursor, part = self._call(lambda c=cursor: self._r.hscan(p + "emb", c, count=2000))
            for s, v in part.items():
                a = np.frombuffer(v, dtype=np.float32)
                if a.shape[0] == dim:
                    vecs[int(s)] = a
            if int(cursor) == 0:
                break
        ids = np.fromiter(vecs, dtype=np.int64, count=len(vecs))
        arr = np.stack([vecs[int(i)] for i in ids]) if len(vecs) else np.zeros((0, dim), np.float32)
        index = VectorIndex.build(ids, arr, dim, self.index_params)
        st = _NsIndex(token=token, generation=gen0, last_xid=xid0, index=index, ids=set(int(i) for i in ids))
        self._apply(ns, st, self._read_log(ns, xid0))
        return st

    def warm(self) -> dict[str, int]:
        """Build (or catch up) this process's index of every namespace now, instead of at its first recall.
        Returns entries indexed per namespace; an unreachable Redis is logged (once) and gives ``{}``."""
        out: dict[str, int] = {}
        try:
            for ns in self.namespaces():
                with self._lock:
                    st = self._sync(ns)
                out[ns] = st.index.ntotal if st else 0
        except CacheUnavailableError:
            return {}
        return out

    # ------------------------------------------------------------------ scan / verify / stats
    def namespaces(self) -> list[str]:
        nss = self._known_namespaces()
        pipe = self._r.pipeline(transaction=False)
        for ns in nss:
            pipe.exists(self._p(ns) + "meta")
        return [ns for ns, ok in zip(nss, self._call(pipe.execute)) if ok]

    def entry_ids(self, namespace: str | None = None) -> list[str]:
        """Entry ids, oldest first within each namespace."""
        out: list[str] = []
        for ns in ([namespace] if namespace else self._known_namespaces()):
            members = sorted(_s(m) for m in self._call(lambda ns=ns: self._r.zrange(self._p(ns) + "lru", 0, -1)))
            out.extend(m[13:] for m in members)  # "<seq:012d>:<id>" sorts by sequence number
        return out

    def content_version(self) -> int:
        """A number that changes whenever any entry is added or removed (any process): the sum of the namespaces'
        change counters (a purge resets a namespace, so compare for equality only)."""
        nss = self._known_namespaces()
        pipe = self._r.pipeline(transaction=False)
        for ns in nss:
            pipe.get(self._p(ns) + "gen")
            pipe.hget(self._p(ns) + "meta", "token")
        vals = self._call(pipe.execute)
        h = hashlib.sha256(json.dumps([_s(v) if v is not None else None for v in vals]).encode()).digest()
        return int.from_bytes(h[:6], "little")

    def scan(self, grace_s: float | None = None) -> dict[str, int]:
        """Defensive clean-up: staging keys without a TTL (cannot happen through this class) are removed, and
        exact-repeat hints whose entry is gone (a worker died between a delete and clearing its hint). Returns the
        counts ``Store.scan`` returns (the same keys); Redis has no temp files, orphan entry files or foreign
        files, so only ``tmp_removed`` (staging keys) and ``missing_rows_removed`` (stale hints) can be non-zero.
        ``grace_s`` is accepted for the common surface: a staging key always carries its own TTL."""
        removed = 0
        for key in self._call(lambda: list(self._r.scan_iter(match=f"{PREFIX}:{{*}}:stage:*", count=1000))):
            if self._call(lambda key=key: self._r.ttl(key)) == -1:
                self._call(lambda key=key: self._r.delete(key))
                removed += 1
        hints = [(_s(k), _s(v)) for k, v in
                 self._call(lambda: list(self._r.hscan_iter(f"{PREFIX}:requests", count=1000)))]
        stale = [h for h in hints if self.find_request(h[0]) is None]  # find_request drops what it finds stale
        return {"tmp_removed": removed, "orphans_adopted": 0, "orphans_quarantined": 0,
                "missing_rows_removed": len(stale), "foreign_files": 0}

    def _verify_storage(self) -> tuple[list[str], list[str], list[str], int]:
        """Rows, bytes, embeddings, sorted sets, byte totals and this process's indexes."""
        problems: list[str] = []
        notes: list[str] = []
        nss = self.namespaces()
        total = 0
        ids: list[str] = []
        for ns in nss:
            p = self._p(ns)

            def snapshot(p: str = p) -> list:
                pipe = self._read_pipeline()
                pipe.zrange(p + "lru", 0, -1)
                pipe.zrange(p + "prio", 0, -1)
                pipe.hgetall(p + "sid")
                pipe.hkeys(p + "emb")
                pipe.get(p + "bytes")
                pipe.get(p + "gen")
                pipe.smembers(p + "ans")
                return pipe.execute()

            lru, prio, sid, emb_keys, nbytes, gen, ans = self._call(snapshot)
            answers = {int(_s(a)) for a in ans}
            members = {_s(m) for m in lru}
            if members != {_s(m) for m in prio}:
                problems.append(f"namespace {ns}: the priority and recency sets differ")
            by_seq = {int(_s(k)): _s(v) for k, v in sid.items()}
            want = {f"{s:012d}:{i}" for s, i in by_seq.items()}
            if want != members:
                problems.append(f"namespace {ns}: {len(members ^ want)} entries differ between ids and sets")
            if {int(_s(k)) for k in emb_keys} != set(by_seq) - answers or not answers <= set(by_seq):
                problems.append(f"namespace {ns}: embeddings and ids differ")
            pipe = self._r.pipeline(transaction=False)
            for i in by_seq.values():
                pipe.hmget(p + f"e:{i}", "nbytes", "nchunks")
                pipe.llen(p + f"b:{i}")
            vals = self._call(pipe.execute)
            ns_bytes = 0
            for n, i in enumerate(by_seq.values()):
                (nb, nc), ln = vals[2 * n], vals[2 * n + 1]
                if nb is None:
                    problems.append(f"entry {i}: row is missing")
                    continue
                ns_bytes += int(nb)
                if int(ln) != int(nc):
                    problems.append(f"entry {i}: {ln} chunks stored, {_s(nc)} expected")
            if ns_bytes != int(nbytes or 0):
                problems.append(f"namespace {ns}: byte total {int(nbytes or 0)}, entries add up to {ns_bytes}")
            total += ns_bytes
            with self._lock:
                st = self._sync(ns)
                got = set(st.ids) if st else set()
                idx_ids = st.index.ids().tolist() if st else []
                at_snapshot = st is not None and st.generation == int(gen or 0)
            if len(idx_ids) != len(set(idx_ids)) or set(idx_ids) != got:
                problems.append(f"namespace {ns}: index holds duplicate or untracked ids")
            if at_snapshot and got != set(by_seq) - answers:
                problems.append(f"namespace {ns}: index has {len(got)} ids, the cache "
                                f"{len(set(by_seq) - answers)} recallable entries")
            elif not at_snapshot:
                notes.append(f"namespace {ns}: index not compared (the namespace changed meanwhile)")
            ids.extend(by_seq.values())
        if self.max_bytes and total > self.max_bytes:
            notes.append(f"{format_bytes(total)} stored, over this handle's budget {format_bytes(self.max_bytes)}")
        return problems, notes, ids, len(nss)

    def _stats_parts(self, namespace: str | None) -> tuple[list[NamespaceCounts], int, int, int, int, int]:
        nss = [namespace] if namespace else self._known_namespaces()
        pipe = self._r.pipeline(transaction=False)
        for ns in nss:
            p = self._p(ns)
            pipe.hmget(p + "meta", "fp", "config")
            pipe.zcard(p + "lru")
            pipe.get(p + "bytes")
            pipe.hmget(p + "counters", "lookups", "hits")
            pipe.hlen(p + "qreason")
            pipe.scard(p + "ans")
        vals = self._call(pipe.execute)
        per: list[NamespaceCounts] = []
        lookups = hits = quarantined = 0
        for n, ns in enumerate(nss):
            (fp, cfg), count, nb, (lk, ht), q, ans = vals[6 * n : 6 * n + 6]
            lk, ht = int(lk or 0), int(ht or 0)
            lookups, hits, quarantined = lookups + lk, hits + ht, quarantined + int(q)
            if fp is not None:  # else purged (or never completed)
                per.append((ns, _s(fp), json.loads(_s(cfg)), int(count), int(nb or 0), int(ans), lk, ht))
        return per, lookups, hits, quarantined, 0, 0

    def iter_quarantine(self, namespace: str) -> Iterator[tuple[str, str]]:
        """(entry id, reason) of the quarantined entries of ``namespace``."""
        for k, v in self._call(lambda: self._r.hgetall(self._p(namespace) + "qreason")).items():
            yield _s(k), _s(v)


__all__ = ["CHUNK_BYTES", "CacheUnavailableError", "RedisStore", "ns_tag"]
