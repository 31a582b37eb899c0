"""HTTP routes behind the frontend's Carnator cache panel (web/carnator.js). Not a node module: ``NODES`` is empty.

Registered on ComfyUI's ``PromptServer`` when node discovery imports this module (the server exists by then;
ComfyUI adds ``PromptServer.instance.routes`` to its web app after loading custom nodes, under both ``/`` and
``/api``). Imported in-process without a server (tests that build the node list), it registers nothing.

* ``GET  /carnator/cache/stats?directory=carnator_cache`` → the store's statistics as JSON (``Store.stats()``:
  entries, bytes, lookups, hits, hit_rate, namespaces, ...), or ``exists: false`` and zeros for a directory that
  is not a Carnator cache (yet): reading stats never creates a cache. Its lookups and hits count since the last
  purge (``counted_since``), by the one definition of both (``definitions``, ``nodes/_history.py``).
* ``POST /carnator/cache/purge`` with JSON ``{"directory": "carnator_cache"}`` → what the purge removed. The
  cache's purge count moves, and with it the Cache loader node's change fingerprint: ComfyUI runs the same graph
  again next time instead of answering it from its own node cache.
* ``GET  /carnator/rules?directory=carnator_cache`` → learning mode's state per namespace (model × config) of that
  cache folder: each namespace's ``rule_state`` ("learning — n labels of about N needed; ...", per stratum), or
  ``namespaces: []`` when nothing was learned there yet (reading never creates the learning record).
* ``GET  /carnator/requests?namespace=&limit=50`` → the last requests this server process served, per namespace
  (``nodes/_history.py``: time, decision, what it counts as, share of compute saved, rule and rule state, a
  thumbnail), newest last; ``counts`` per namespace over every event held (requests, hits, lookups, not run),
  ``since`` (when the history started), ``titles`` (each namespace in words: the MODEL's loader and its patches,
  the probe's schedule, from the graph that served it) and ``purges``: when this process purged a cache. Lives in
  memory: empty after a restart; a purge keeps it.

``directory`` is the same string a Carnator Cache loader node takes and is confined by the same rule: it must
resolve (symlinks and ``..`` resolved) strictly inside ComfyUI's output directory, its user directory, or a root
the server owner lists in ``CARNATOR_CACHE_ROOTS``; relative paths are relative to the output directory. Anything
else is answered with 400 and the reason, so a browser cannot read or delete arbitrary folders. A credential-free
``redis://host:port/db`` (or ``redis://``) names the shared Redis cache instead; it must match a Redis the server
owner configured in ``CARNATOR_REDIS_URL`` (400 otherwise), and an unreachable Redis answers 503.
"""
from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import Any, Callable

from . import _history

log = logging.getLogger("carnator")

NODES: list = []  # discovery imports every module in nodes/; this one contributes routes, not nodes

DEFAULT_DIRECTORY = "carnator_cache"
MAX_BODY = 64 << 10  # a purge request is a few bytes of JSON; refuse to buffer anything large


class RouteError(Exception):
    """A request the route refuses; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def allowed_roots() -> list[Path]:
    """Where cache directories may live — exactly the Cache loader node's rule (nodes/cache.py): ComfyUI's output
    dir (first: relative paths resolve there), its user dir, then ``CARNATOR_CACHE_ROOTS``."""
    from .cache import allowed_roots as node_roots

    return node_roots()


def resolve_directory(directory: str | None) -> Path:
    from ..carnator_core.paths import CachePathError, resolve_cache_dir

    try:
        return resolve_cache_dir(directory if directory is not None else DEFAULT_DIRECTORY, allowed_roots())
    except CachePathError as e:
        raise RouteError(400, str(e)) from None


def _is_redis(directory: str | None) -> bool:
    from ..carnator_core.cache.redis_url import is_redis_url

    return is_redis_url(directory)


def _is_cache_dir(path: Path) -> bool:
    """A directory a Carnator store has initialised (its marker file). The panel never turns another folder into a
    cache: ``Store.open`` would create one, so stats and purge only open directories that already are caches."""
    from ..carnator_core.cache.store import MARKER

    try:
        return path.is_dir() and (path / MARKER).is_file()
    except OSError as e:
        raise RouteError(400, f"the cache directory cannot be used: {e.strerror or e}") from None


def _store_class() -> Any:
    try:
        from ..carnator_core.cache import Store
    except ImportError as e:  # the cache core is missing or broken: say so instead of a bare 500
        raise RouteError(500, f"Carnator's cache core could not be imported ({e}); reinstall the extension") from None
    return Store


def _open(path: Path) -> Any:
    """A Store of its own for this request (closed by the caller), with the index key the cache nodes use: the
    nodes' process-wide Store keeps its budget and policy, and the store's multi-process rules keep both in step."""
    from .cache import key_path

    return _store_class().open(path, key_path=key_path())


def _jsonable(value: Any) -> Any:
    """Stats as plain JSON: dataclasses and objects with ``to_dict``/``to_meta`` become dicts, paths strings."""
    import dataclasses

    for attr in ("to_meta", "to_dict"):
        if callable(getattr(value, attr, None)):
            return _jsonable(getattr(value, attr)())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: _jsonable(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return value.item()
    return value


_PANEL_STORES: dict[str, Any] = {}


def _redis_store(url: str) -> Any:
    """The panel's RedisStore for ``url`` (one per URL and process, kept open: an outage is then logged once, not
    on every poll; it has no byte budget of its own and never claims an empty Redis). RouteError for a URL the
    server owner did not configure."""
    from ..carnator_core.cache.redis_store import RedisStore
    from ..carnator_core.cache.redis_url import RedisConfigError, resolve_redis_url

    try:
        public = resolve_redis_url(url)
        st = _PANEL_STORES.get(public)
        if st is None:
            st = _PANEL_STORES[public] = RedisStore.open(public, claim=False)
        return st
    except RedisConfigError as e:
        raise RouteError(400, str(e)) from None


def _redis_answer(directory: str, purge: bool) -> dict[str, Any]:
    from ..carnator_core.cache.errors import CacheUnavailableError

    store = _redis_store(directory)
    base = {"directory": directory, "path": store.url}
    try:
        if not store.exists():
            empty = {"purged": 0} if purge else {"entries": 0, "bytes": 0, "lookups": 0, "hits": 0, "hit_rate": None,
                                                 "counted_since": "purge", "definitions": _history.DEFINITIONS}
            return {**base, "exists": False, **empty}
        if purge:
            result = store.purge()
            log.info("carnator: cache %s purged from the web panel: %s", store.url, result)
            _history.mark_purge()
            return {**base, "exists": True, "purged": result}
        return {**base, "exists": True, **_jsonable(store.stats()), "counted_since": "purge",
                "definitions": _history.DEFINITIONS}
    except CacheUnavailableError as e:
        raise RouteError(503, str(e)) from None


def cache_stats(directory: str | None) -> dict[str, Any]:
    """Statistics of the cache in ``directory`` (confined); zeros if it does not exist yet."""
    if _is_redis(directory):
        return _redis_answer(str(directory).strip(), purge=False)
    path = resolve_directory(directory)
    base = {"directory": directory or DEFAULT_DIRECTORY, "path": str(path)}
    if not _is_cache_dir(path):
        return {**base, "exists": False, "entries": 0, "bytes": 0, "lookups": 0, "hits": 0, "hit_rate": None,
                "counted_since": "purge", "definitions": _history.DEFINITIONS}
    store = _open(path)
    try:
        stats = _jsonable(store.stats())
    finally:
        close = getattr(store, "close", None)
        if callable(close):
            close()
    if not isinstance(stats, dict):
        stats = {"stats": stats}
    return {**base, "exists": True, **stats, "counted_since": "purge", "definitions": _history.DEFINITIONS}


def cache_purge(directory: str | None) -> dict[str, Any]:
    """Removes every entry of the cache in ``directory`` (confined); the directory itself stays."""
    if _is_redis(directory):
        return _redis_answer(str(directory).strip(), purge=True)
    path = resolve_directory(directory)
    base = {"directory": directory or DEFAULT_DIRECTORY, "path": str(path)}
    if not _is_cache_dir(path):
        return {**base, "exists": False, "purged": 0}
    store = _open(path)
    try:
        result = _jsonable(store.purge())
    finally:
        close = getattr(store, "close", None)
        if callable(close):
            close()
    log.info("carnator: cache %s purged from the web panel: %s", path, result)
    _history.mark_purge()
    return {**base, "exists": True, "purged": result}


def rules_state(directory: str | None) -> dict[str, Any]:
    """Learning mode's ``rule_state`` of every namespace in the cache folder ``directory`` (confined), or in the
    Redis cache ``directory`` names (the farm's shared record)."""
    from ..carnator_core.learn.labels import FILENAME

    if _is_redis(directory):
        return _redis_rules_state(str(directory).strip())
    path = resolve_directory(directory)
    base = {"directory": directory or DEFAULT_DIRECTORY, "path": str(path)}
    if not _is_cache_dir(path) or not ((path / FILENAME).is_file() or (path / FILENAME).is_symlink()):
        return {**base, "exists": False, "namespaces": []}
    from ..carnator_core.learn.labels import LabelStore, LabelStoreError
    from ..carnator_core.learn.learner import Learner

    try:  # read only: the panel creates and writes nothing, and a record that is a link is refused
        learner = Learner(path, store=LabelStore(path, read_only=True))
    except LabelStoreError as e:
        raise RouteError(503, str(e)) from None
    try:
        return {**base, "exists": True, "namespaces": _namespace_states(learner, learner.store.namespaces())}
    except LabelStoreError as e:
        raise RouteError(503, str(e)) from None
    finally:
        learner.store.close()


def _namespace_states(learner: Any, namespaces: list[str]) -> list[dict[str, Any]]:
    """Each traffic namespace's ``rule_state``, with its warm-up population (``learn.warmup``) folded in: a
    namespace of warm-up labels is shown inside its traffic namespace, never as one of its own."""
    from ..carnator_core.learn.warmup import is_warmup_namespace, overlay_state, warmup_namespace

    out = []
    for ns in namespaces:
        if is_warmup_namespace(ns):
            if ns[:-len(warmup_namespace(""))] in namespaces:
                continue
            ns = ns[:-len(warmup_namespace(""))]  # warm-up labels before any traffic label of the namespace
        states = learner.state(ns, update=False)
        out.append(overlay_state(learner, ns, learner.rule_state(ns, states), states, update=False))
    return out


def _redis_rules_state(url: str) -> dict[str, Any]:
    """``rules_state`` of a Redis cache's learning record (read only: an empty Redis is not claimed)."""
    from ..carnator_core.cache.redis_url import RedisConfigError, resolve_redis_url
    from ..carnator_core.learn.labels import LabelStoreError
    from ..carnator_core.learn.learner import Learner
    from ..carnator_core.learn.redis_labels import RedisLabelStore

    try:
        public = resolve_redis_url(url)
    except RedisConfigError as e:
        raise RouteError(400, str(e)) from None
    try:
        store = RedisLabelStore.open(public, claim=False)
    except LabelStoreError as e:
        raise RouteError(503, str(e)) from None
    try:
        learner = Learner(public, store=store)
        nss = store.namespaces()
        return {"directory": url, "path": public, "exists": bool(nss), "namespaces": _namespace_states(learner, nss)}
    except LabelStoreError as e:
        raise RouteError(503, str(e)) from None
    finally:
        store.close()


MAX_LIMIT = 200


def recent_requests(namespace: str | None, limit: str | None) -> dict[str, Any]:
    """The last ``limit`` requests per namespace (all namespaces unless one is named), oldest first."""
    try:
        n = int(limit) if limit not in (None, "") else 50
    except ValueError:
        raise RouteError(400, f"limit must be an integer between 1 and {MAX_LIMIT}, got {str(limit)[:20]!r}") from None
    if not 1 <= n <= MAX_LIMIT:
        raise RouteError(400, f"limit must be an integer between 1 and {MAX_LIMIT}, got {n}")
    events = _history.recent((namespace or "").strip() or None)
    # ``counts``: every event the server still holds, counted by the one definition (``definitions``), beside the
    # last ``limit`` events listed; the history survives a purge and starts with the server (``since``).
    counts = {ns: {"requests": len(ev), "hits": sum(e.get("outcome") == "hit" for e in ev),
                   "lookups": sum(bool(e.get("lookup")) for e in ev),
                   "not_run": sum(e.get("outcome") == "not_run" for e in ev)} for ns, ev in events.items()}
    return {"namespaces": {ns: ev[-n:] for ns, ev in events.items()}, "counts": counts, "purges": _history.purges(),
            "since": _history.STARTED, "definitions": _history.DEFINITIONS, "titles": _history.titles()}


async def _answer(fn: Callable[[str | None], dict[str, Any]], directory: str | None) -> Any:
    from aiohttp import web

    from ..carnator_core.cache.errors import CacheError

    try:
        # SQLite and file work off the event loop: the server keeps serving websockets meanwhile.
        return web.json_response(await asyncio.to_thread(fn, directory))
    except RouteError as e:
        return web.json_response({"error": str(e)}, status=e.status)
    except CacheError as e:  # the store's errors say what to do
        log.warning("carnator: cache route failed: %s", e)
        return web.json_response({"error": str(e)}, status=500)
    except Exception as e:  # noqa: BLE001 — a panel request must answer with the reason, not hang the UI
        log.exception("carnator: cache route failed")
        return web.json_response({"error": f"{type(e).__name__}: {e}"}, status=500)


def register(routes: Any) -> None:
    """Adds the cache routes to an aiohttp ``RouteTableDef``."""

    @routes.get("/carnator/cache/stats")
    async def carnator_cache_stats(request: Any) -> Any:
        return await _answer(cache_stats, request.rel_url.query.get("directory"))

    @routes.get("/carnator/rules")
    async def carnator_rules(request: Any) -> Any:
        return await _answer(rules_state, request.rel_url.query.get("directory"))

    @routes.get("/carnator/requests")
    async def carnator_requests(request: Any) -> Any:
        q = request.rel_url.query
        return await _answer(lambda _: recent_requests(q.get("namespace"), q.get("limit")), None)

    @routes.post("/carnator/cache/purge")
    async def carnator_cache_purge(request: Any) -> Any:
        from aiohttp import web

        too_big = web.json_response({"error": f"the request body is larger than {MAX_BODY} bytes; send JSON like "
                                              '{"directory": "carnator_cache"}'}, status=413)
        if request.content_length is not None and request.content_length > MAX_BODY:
            return too_big
        raw = await request.content.read(MAX_BODY + 1)  # bounded even without a Content-Length
        if len(raw) > MAX_BODY:
            return too_big
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            return web.json_response({"error": 'send JSON like {"directory": "carnator_cache"}'}, status=400)
        if not isinstance(body, dict) or not isinstance(body.get("directory", DEFAULT_DIRECTORY), str):
            return web.json_response({"error": '"directory" must be a string'}, status=400)
        return await _answer(cache_purge, body.get("directory"))


def _register_with_running_server() -> None:
    # Only when ComfyUI's server module is already loaded and has an instance: importing `server` ourselves
    # in a test process would drag in the whole web stack and there would be no app to serve the routes anyway.
    server = sys.modules.get("server")
    instance = getattr(getattr(server, "PromptServer", None), "instance", None)
    if instance is None or getattr(instance, "_carnator_routes", False):
        return
    register(instance.routes)
    instance._carnator_routes = True


_register_with_running_server()
