"""Which Redis a workflow may name, and where its credentials come from.

Contract: a workflow (and so a Carnator Cache node) names a Redis by a *credential-free* URL such as
``redis://cache-host:6379/0``, or by ``redis://`` alone for "the server's Redis". The server owner configures the
Redis servers Carnator may use in the environment variable ``CARNATOR_REDIS_URL`` (one or more full URLs,
whitespace-separated, passwords included, e.g. ``rediss://:s3cret@cache-host:6380/0``). So:

* a password never travels in workflow JSON: a URL with a user or password (or a ``password=`` query) in a
  node is refused with the reason;
* a workflow cannot point the server at an arbitrary host (the Redis counterpart of the cache-directory
  confinement): the scheme, host, port and database must match a configured URL;
* the credentials are looked up when the store connects (``connect_url``); the node's value, the handle and
  the statistics only ever hold the public form (``public_url``).
"""
from __future__ import annotations

import os
from urllib.parse import parse_qs, urlsplit

from .errors import CacheUnavailableError  # defined with the other cache errors; re-exported here

ENV_URL = "CARNATOR_REDIS_URL"
SCHEMES = ("redis", "rediss")


class RedisConfigError(ValueError):
    """A Redis cache URL that is malformed, carries credentials, or names a server the owner did not configure."""


def is_redis_url(text: object) -> bool:
    """True if ``text`` names a Redis store (``redis://`` or ``rediss://``) rather than a cache directory."""
    return isinstance(text, str) and text.strip().lower().startswith(tuple(f"{s}://" for s in SCHEMES))


def _parts(url: str) -> tuple[str, str, int, int]:
    """(scheme, host, port, db) of a Redis URL; raises RedisConfigError naming what is wrong."""
    try:
        u = urlsplit(url.strip())
        port = u.port or 6379
    except ValueError as e:
        raise RedisConfigError(f"{_redact(url)!r} is not a valid Redis URL ({e})") from None
    scheme = u.scheme.lower()
    if scheme not in SCHEMES:
        raise RedisConfigError(f"{_redact(url)!r} is not a Redis URL (use redis:// or rediss://)")
    path = u.path.strip("/")
    db = parse_qs(u.query).get("db", [path or "0"])[0]
    if not db.isdigit():
        raise RedisConfigError(f"the database of {_redact(url)!r} must be a number, e.g. redis://host:6379/0")
    return scheme, (u.hostname or "").lower(), port, int(db)


def _redact(url: str) -> str:
    """``url`` with any user/password replaced, for messages."""
    try:
        u = urlsplit(url.strip())
    except ValueError:
        return "<unparseable URL>"
    if u.username is None and u.password is None and "password" not in u.query:
        return url.strip()
    host = u.hostname or ""
    port = f":{u.port}" if u.port else ""
    return f"{u.scheme}://***@{host}{port}{u.path}"


def public_url(url: str) -> str:
    """The canonical, credential-free form ``scheme://host:port/db`` of a Redis URL."""
    scheme, host, port, db = _parts(url)
    return f"{scheme}://{host}:{port}/{db}"


def configured_urls(environ: dict[str, str] | None = None) -> list[str]:
    """The full URLs (credentials included) the server owner set in ``CARNATOR_REDIS_URL``."""
    raw = (environ if environ is not None else os.environ).get(ENV_URL, "")
    return [p for p in raw.split() if p]


def resolve_redis_url(user_url: str, environ: dict[str, str] | None = None) -> str:
    """The public URL of the configured Redis that ``user_url`` (a node's value) names.

    ``redis://`` (no host) names the first configured server. Raises RedisConfigError when ``user_url`` carries
    credentials, is malformed, or matches no configured server (the message lists what is configured).
    """
    text = (user_url or "").strip()
    u = urlsplit(text)
    if u.username is not None or u.password is not None or "password" in parse_qs(u.query):
        raise RedisConfigError(
            "the Redis URL in the workflow carries a user or password; credentials must never be saved in a "
            f"workflow. Put the full URL in the server's {ENV_URL} environment variable and give the node only "
            "redis://host:port/db (or redis:// for the server's Redis)")
    configured = configured_urls(environ)
    if not configured:
        raise RedisConfigError(
            f"no Redis is configured on this server: the server owner must set {ENV_URL} (e.g. "
            "redis://127.0.0.1:6379/0, with the password if Redis needs one) before a workflow can use a Redis "
            "cache. Or give the node a cache directory instead.")
    publics = [public_url(c) for c in configured]
    if not (u.hostname or ""):
        if u.scheme.lower() not in SCHEMES:
            raise RedisConfigError(f"{text!r} is not a Redis URL (use redis:// or rediss://)")
        return publics[0]
    want = public_url(text)
    if want in publics:
        return want
    raise RedisConfigError(
        f"{want} is not a Redis this server may use. Configured: {', '.join(publics)}. Use one of those (or "
        f"redis:// for the first), or ask the server owner to add it to {ENV_URL}.")


def connect_url(public: str, environ: dict[str, str] | None = None) -> str:
    """The configured full URL (with credentials) behind the public URL ``public``."""
    want = public_url(public)
    for full in configured_urls(environ):
        if public_url(full) == want:
            return full
    raise RedisConfigError(f"{want} is no longer configured in {ENV_URL} on this server")


__all__ = ["ENV_URL", "CacheUnavailableError", "RedisConfigError", "configured_urls", "connect_url", "is_redis_url",
           "public_url", "resolve_redis_url"]
