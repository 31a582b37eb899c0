"""Confinement of cache directories: a workflow JSON must not read or write outside the roots a server owner allows.

Contract: ``resolve_cache_dir(user_path, allowed_roots)`` returns an absolute, symlink-resolved directory that is
*strictly inside* one of ``allowed_roots`` (after resolving the roots too), or raises ``CachePathError`` naming
the allowed roots and how to add one (``CARNATOR_CACHE_ROOTS``, set by the server owner, never by a workflow).
Relative paths are taken relative to the first root (ComfyUI's output directory in the nodes). ``..`` segments
and symlinks are resolved *before* the check, so neither can escape. The store re-checks every file path it
builds against its own root, which covers links planted inside the directory later.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterable

ENV_ROOTS = "CARNATOR_CACHE_ROOTS"
log = logging.getLogger("carnator")


class CachePathError(ValueError):
    """A cache directory outside the allowed roots (or otherwise unusable)."""


def roots_from_env(environ: dict[str, str] | None = None) -> list[Path]:
    """Extra allowed roots from ``CARNATOR_CACHE_ROOTS`` (``os.pathsep``-separated absolute paths).
    Relative entries are ignored with a warning: a root must not depend on the server's working directory."""
    raw = (environ if environ is not None else os.environ).get(ENV_ROOTS, "")
    out: list[Path] = []
    for part in raw.split(os.pathsep):
        part = part.strip()
        if not part:
            continue
        p = Path(part).expanduser()
        if not p.is_absolute():
            log.warning("carnator: ignoring relative entry %r in %s (roots must be absolute paths)", part, ENV_ROOTS)
            continue
        out.append(p)
    return out


def is_within(path: Path, root: Path) -> bool:
    """True if resolved ``path`` is ``root`` or below it (both resolved)."""
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


def resolve_cache_dir(user_path: str, allowed_roots: Iterable[Path | str]) -> Path:
    """Resolve a user-supplied cache directory under the allowed roots (see module docstring)."""
    roots = [Path(r).expanduser() for r in allowed_roots if str(r).strip()]
    if not roots:
        raise CachePathError(
            f"no cache root is configured: the server owner must set {ENV_ROOTS} (absolute paths separated by "
            f"{os.pathsep!r}) or run inside ComfyUI, whose output/user directories are allowed by default"
        )
    resolved_roots = [r.resolve() for r in roots]
    text = (user_path or "").strip()
    where = ", ".join(str(r) for r in resolved_roots)
    hint = (
        f"Allowed roots: {where}. Use a path relative to {resolved_roots[0]} (e.g. 'carnator_cache'), or ask the "
        f"server owner to add a root to the {ENV_ROOTS} environment variable (absolute paths separated by "
        f"{os.pathsep!r})."
    )
    if not text:
        raise CachePathError(f"the cache directory is empty. {hint}")
    if "\x00" in text:
        raise CachePathError(f"the cache directory contains a NUL character. {hint}")
    p = Path(text).expanduser()
    candidate = p if p.is_absolute() else resolved_roots[0] / p
    resolved = candidate.resolve()  # resolves '..' and every existing symlink on the way
    for root in resolved_roots:
        if resolved == root:
            raise CachePathError(
                f"cache directory {text!r} is the root {root} itself; use a subdirectory such as 'carnator_cache'. {hint}"
            )
        if resolved.is_relative_to(root):
            return resolved
    raise CachePathError(f"cache directory {text!r} resolves to {resolved}, which is outside the allowed roots. {hint}")
