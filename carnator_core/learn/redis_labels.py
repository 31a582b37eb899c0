"""Learning mode's record on Redis: the farm counterpart of ``labels.LabelStore`` (``learn.sqlite``).

When the cache is a Redis cache (``redis://``), every worker on that Redis keeps its learning record there, under
the cache's key prefix, so N workers learn one rule together: their covariates, labels, ledger and state events
(fits, the pilot's order, switch-on, drift) are one record, and every worker recomputes the state from it
(``learner.Learner``), so two workers agree. The interface is ``LabelStore``'s: ``add_covariate`` /
``covariates``, ``add_label`` / ``labels`` / ``has_label``, ``charge`` / ``ledger``, ``add_event`` / ``events``,
``namespaces``, ``corrupt``, ``close``.

Key layout (``P`` = ``<cache prefix>:learn``; ``{ns}`` is a Redis Cluster hash tag, so each namespace's keys share
one slot and every write below is one Lua script in that slot)::

    P:schema                 the record's schema number (refused when another)
    P:namespaces             set of namespaces with covariates, labels or a ledger
    P:{ns}:cov  / :cov:key   hash row id -> row / hash request key -> row id (once per request)
    P:{ns}:lab  / :lab:key   hash row id -> row / hash "kind request key" -> row id (once per request and kind)
    P:{ns}:lab:req           set of labelled request keys (``has_label``)
    P:{ns}:ev   / :ev:key    hash row id -> row / hash transition key -> row id (see ``event_key``)
    P:{ns}:seq               hash: the id counters of cov, lab, ev (HINCRBY: ids increase across workers)
    P:{ns}:ledger            hash: served_s, label_s, audit_s, requests (HINCRBYFLOAT / HINCRBY) + sha1

Contracts
---------
* **Checksummed rows.** A row is ``<sha256 of its JSON body><JSON body>`` (the body is ``LabelStore``'s, so a row
  verifies the same way); every read verifies it. A row that fails (edited, truncated, not a label) is skipped and
  counted in ``corrupt``, never deleted (the cache never deletes what it did not write; a corrupt row is
  evidence). The ledger's fields are checked against a SHA-1 the same script writes (Lua offers no SHA-256);
  a mismatch is counted, the totals still returned (as ``LabelStore.ledger``).
* **Atomic writes.** Each write is one Lua script: the id is taken (HINCRBY) and the row, its uniqueness key and
  the counter are written together, so a worker killed mid-label (SIGKILL included) leaves the label whole or
  absent, and ids follow the order writes took effect in (a label's id orders it against the pilot's and the
  fits' ``since``, as SQLite's AUTOINCREMENT does). The ledger is added to with HINCRBYFLOAT in one script.
* **State transitions are written once.** Several workers deriving the state at the same moment would each
  record the same transition (fit k of a stratum, the pilot's order, a switch-on, a drift); ``add_event``
  writes the first and drops the others (``event_key``), so the record holds one fit k per stratum and one order,
  exactly as one worker writes them, and every worker derives from that one.
* **Faults.** A Redis that cannot be reached raises ``LabelStoreError`` saying so (the request is already served;
  the sampler reports the state as unavailable and serves on).
* **Eviction.** A Redis whose ``maxmemory-policy`` may evict keys without an expiry (``allkeys-*``) would drop
  labels silently; it is refused at open (``LabelStoreError`` naming the policy and the fix). ``volatile-*`` and
  ``noeviction`` never evict the record's keys (none has an expiry). A Redis that does not answer ``CONFIG GET``
  (managed services) is used with one warning that it could not be checked. Whatever the policy, a row is never
  overwritten: an id counter that went missing skips the ids in use.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, replace
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar

import redis

from ..cache.redis_store import PREFIX as CACHE_PREFIX
from .labels import (
    SCHEMA,
    Covariate,
    Label,
    LabelStoreError,
    RecordReads,
    _dump,
    checksum,
    event_key,
    shift_event,
)

T = TypeVar("T")
log = logging.getLogger("carnator")
DIGEST = 64  # hex characters of the SHA-256 that starts each row

# KEYS: rows hash, unique-key hash, seq hash[, request set]; ARGV: unique key, row (checksum + body), seq field,
# wanted id (0 = the next one)[, request key]. Returns the new row's id, or 0 when the unique key (or the wanted
# id) is already taken. One script: the row, its key and the counter are written together or not at all.
_ADD_ROW = """
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return 0 end
local id = tonumber(ARGV[4])
if id > 0 then
  if redis.call('HEXISTS', KEYS[1], ARGV[4]) == 1 then return 0 end
  local cur = tonumber(redis.call('HGET', KEYS[3], ARGV[3]) or '0')
  if cur < id then redis.call('HSET', KEYS[3], ARGV[3], id) end
else
  id = redis.call('HINCRBY', KEYS[3], ARGV[3], 1)
  -- a counter that went missing (evicted, deleted by hand) must never make a row overwrite another
  while redis.call('HEXISTS', KEYS[1], tostring(id)) == 1 do id = redis.call('HINCRBY', KEYS[3], ARGV[3], 1) end
end
redis.call('HSET', KEYS[1], tostring(id), ARGV[2])
if ARGV[1] ~= '' then redis.call('HSET', KEYS[2], ARGV[1], id) end
if KEYS[4] then redis.call('SADD', KEYS[4], ARGV[5]) end
return id
"""

# KEYS[1]: the ledger hash; ARGV: served_s, label_s, audit_s, requests. Adds and re-signs in one script; returns
# the new field strings (as stored) in LEDGER_FIELDS order.
_CHARGE = """
local f = {'served_s', 'label_s', 'audit_s'}
local out = {}
for i = 1, 3 do out[i] = redis.call('HINCRBYFLOAT', KEYS[1], f[i], ARGV[i]) end
out[4] = tostring(redis.call('HINCRBY', KEYS[1], 'requests', ARGV[4]))
redis.call('HSET', KEYS[1], 'sha1', redis.sha1hex(table.concat(out, '|')))
return out
"""

LEDGER_FIELDS = ("served_s", "label_s", "audit_s", "requests")


_TABLES = {"covariates": "cov", "labels": "lab", "events": "ev"}


class RedisLabelStore(RecordReads):
    """The learning record of one Redis cache (module docstring); ``LabelStore``'s interface. Thread-safe (redis-py's
    pooled client; the scripts make each write atomic)."""

    def __init__(self, client: redis.Redis, *, prefix: str = CACHE_PREFIX, url: str = "", claim: bool = True):
        """``client``: a connected ``redis.Redis``; ``prefix``: the cache's key prefix (the record lives under
        ``<prefix>:learn``); ``url``: the credential-free URL, for messages; ``claim``: write the schema number
        into a Redis without one (False: only check it, e.g. for the panel's read-only view)."""
        self._r = client
        self.prefix = f"{prefix}:learn"
        self.url = url or "Redis"
        self.path = f"{self.url} ({self.prefix})"  # what LabelStore calls its path: where the record is
        self.corrupt = 0
        self._add = client.register_script(_ADD_ROW)
        self._charge = client.register_script(_CHARGE)
        self._check_eviction_policy()
        got = self._call(lambda: (claim and client.set(f"{self.prefix}:schema", str(SCHEMA), nx=True),
                                  client.get(f"{self.prefix}:schema")))[1]
        if got is not None and _s(got) != str(SCHEMA):
            raise LabelStoreError(f"the learning record in {self.path} has schema {_s(got)}, this Carnator reads "
                                  f"{SCHEMA}: update Carnator, or use another Redis database to start learning afresh")

    @classmethod
    def open(cls, url: str, *, full_url: str | None = None, prefix: str = CACHE_PREFIX,
             socket_timeout: float = 10.0, claim: bool = True) -> "RedisLabelStore":
        """The record on the Redis cache named by ``url`` (its public form; the credentials come from
        ``CARNATOR_REDIS_URL`` via ``redis_url.connect_url`` unless ``full_url`` is given, e.g. by tests)."""
        from ..cache.redis_url import RedisConfigError, connect_url, public_url

        try:
            public = public_url(url)
            full = full_url or connect_url(public)
        except RedisConfigError as e:
            raise LabelStoreError(f"the learning record cannot be opened: {e}") from None
        client = redis.Redis.from_url(full, socket_timeout=socket_timeout, socket_connect_timeout=2.0,
                                      health_check_interval=30)
        return cls(client, prefix=prefix, url=public, claim=claim)

    def close(self) -> None:
        self._r.close()

    _UNCHECKED: set[str] = set()

    def _check_eviction_policy(self) -> None:
        """Refuse a Redis that may evict the record's keys (module docstring, "Eviction")."""
        try:
            policy = _s(self._r.config_get("maxmemory-policy").get("maxmemory-policy") or "")
        except redis.ResponseError as e:
            if self.url not in RedisLabelStore._UNCHECKED:
                RedisLabelStore._UNCHECKED.add(self.url)
                log.warning("carnator learning: Redis at %s does not say its maxmemory-policy (%s); make sure it is "
                            "noeviction or volatile-*: a policy that evicts keys would drop labels", self.url, e)
            return
        except (redis.ConnectionError, redis.TimeoutError):
            return  # unreachable: the next command says so
        if policy.startswith("allkeys-"):
            raise LabelStoreError(f"Redis at {self.url} runs with maxmemory-policy {policy}: it may evict the learning "
                                  "record's keys when memory is full, and labels would vanish silently. Set "
                                  "maxmemory-policy noeviction (CONFIG SET maxmemory-policy noeviction, or in "
                                  "redis.conf); requests are served and cached meanwhile, nothing is labelled")

    # ------------------------------------------------------------------ plumbing
    def _call(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except (redis.ConnectionError, redis.TimeoutError) as e:
            raise LabelStoreError(f"the learning record on {self.url} cannot be reached ({type(e).__name__}: {e}); "
                                  "requests are served and cached meanwhile, labelling resumes when Redis is "
                                  "back") from None
        except redis.ResponseError as e:
            raise LabelStoreError(f"Redis at {self.url} refused a learning-record command ({e}); check that it "
                                  "is writable and not out of memory (maxmemory-policy noeviction)") from None

    def _k(self, ns: str, name: str) -> str:
        return f"{self.prefix}:{{{ns}}}:{name}"

    def _register(self, ns: str) -> None:
        """List ``ns`` among the record's namespaces (after its row is written: a worker killed in between leaves
        a row the next write lists, never a listed namespace without rows; a separate command because the set is
        in another cluster slot than the namespace's keys)."""
        self._call(lambda: self._r.sadd(f"{self.prefix}:namespaces", ns))

    def _insert(self, ns: str, table: str, unique: str, body: str, *, want_id: int = 0,
                request_key: str | None = None) -> int:
        keys = [self._k(ns, table), self._k(ns, f"{table}:key"), self._k(ns, "seq")]
        args: list[Any] = [unique, checksum(body) + body, table, int(want_id)]
        if request_key is not None:
            keys.append(self._k(ns, f"{table}:req"))
            args.append(request_key)
        return int(self._call(lambda: self._add(keys=keys, args=args)))

    def _table_rows(self, ns: str, table: str) -> Iterator[tuple[int, dict[str, Any]]]:
        """The table's verified rows in id order (a row that fails its checksum or JSON is counted, skipped)."""
        raw = self._call(lambda: self._r.hgetall(self._k(ns, _TABLES[table])))
        rows: list[tuple[int, bytes]] = []
        for k, v in raw.items():
            try:
                rows.append((int(k), v))
            except ValueError:
                self.corrupt += 1
        for row_id, value in sorted(rows, key=lambda r: r[0]):
            text = _s(value)
            digest, body = text[:DIGEST], text[DIGEST:]
            if checksum(body) != digest:
                self.corrupt += 1
                continue
            try:
                yield row_id, json.loads(body)
            except ValueError:
                self.corrupt += 1

    # ------------------------------------------------------------------ covariates
    def add_covariate(self, namespace: str, cov: Covariate) -> bool:
        """Record a served request's covariates (once per request key, whichever worker is first; True if new)."""
        body = _dump({**asdict(cov), "vector": [float(v) for v in cov.vector]})
        new = self._insert(namespace, "cov", cov.request_key, body) > 0
        self._register(namespace)
        return new


    # ------------------------------------------------------------------ labels
    def add_label(self, namespace: str, label: Label, *, keep_id: bool = False) -> bool:
        """Persist one label (one script; once per request key and kind; True if new). ``keep_id``: store it
        under ``label.id`` (replaying a learned rule file)."""
        new = self._insert(namespace, "lab", f"{label.kind} {label.request_key}", _dump(label.to_row()),
                           want_id=int(label.id) if keep_id and label.id > 0 else 0,
                           request_key=label.request_key) > 0
        self._register(namespace)
        return new

    def has_label(self, namespace: str, request_key: str) -> bool:
        return bool(self._call(lambda: self._r.sismember(self._k(namespace, "lab:req"), request_key)))

    def label_id_floor(self, namespace: str) -> int:
        """The highest label id taken in ``namespace`` (ids are per namespace here)."""
        return int(self._call(lambda: self._r.hget(self._k(namespace, "seq"), "lab")) or 0)

    def import_record(self, namespace: str, labels: Sequence[Label], events: Sequence[Mapping[str, Any]]) -> int:
        """``LabelStore.import_record`` on Redis: labels shifted above the namespace's ids (order kept), events
        once each with their ``since`` shifted alike. Row by row (each one script): two workers importing at once
        write each label and transition once, the second's shifted copies being dropped as already there."""
        offset = self.label_id_floor(namespace)
        n = sum(self.add_label(namespace, replace(lab, id=lab.id + offset), keep_id=True) for lab in labels)
        for e in events:
            e = shift_event(e, offset)
            self._insert(namespace, "ev", event_key(str(e.get("kind", "")), e), _dump(e))
        return n


    # ------------------------------------------------------------------ ledger
    def ledger(self, namespace: str) -> dict[str, float]:
        raw = {_s(k): _s(v) for k, v in self._call(lambda: self._r.hgetall(self._k(namespace, "ledger"))).items()}
        if not raw:
            return {"served_s": 0.0, "label_s": 0.0, "audit_s": 0.0, "requests": 0}
        vals = [raw.get(f, "") for f in LEDGER_FIELDS]
        if hashlib.sha1("|".join(vals).encode()).hexdigest() != raw.get("sha1"):
            self.corrupt += 1
        try:
            return {"served_s": float(vals[0]), "label_s": float(vals[1]), "audit_s": float(vals[2]),
                    "requests": int(vals[3])}
        except ValueError:
            self.corrupt += 1
            return {"served_s": 0.0, "label_s": 0.0, "audit_s": 0.0, "requests": 0}

    def charge(self, namespace: str, *, served_s: float = 0.0, label_s: float = 0.0, audit_s: float = 0.0,
               requests: int = 0) -> dict[str, float]:
        """Add compute to the namespace's ledger (one script of HINCRBYFLOATs); returns the new totals."""
        out = self._call(lambda: self._charge(keys=[self._k(namespace, "ledger")],
                                              args=[repr(float(served_s)), repr(float(label_s)),
                                                    repr(float(audit_s)), int(requests)]))
        self._register(namespace)
        vals = [_s(v) for v in out]
        return {"served_s": float(vals[0]), "label_s": float(vals[1]), "audit_s": float(vals[2]),
                "requests": int(vals[3])}

    # ------------------------------------------------------------------ events
    def add_event(self, namespace: str, kind: str, message: str, **facts: Any) -> bool:
        """Record a state event; a transition another worker already recorded (``event_key``) is dropped (False)."""
        body = _dump({"kind": kind, "message": message, "t": time.time(), **facts})
        return self._insert(namespace, "ev", event_key(kind, facts), body) > 0


    def namespaces(self) -> list[str]:
        return sorted(_s(x) for x in self._call(lambda: self._r.smembers(f"{self.prefix}:namespaces")))


def _s(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


__all__ = ["RedisLabelStore", "event_key"]
