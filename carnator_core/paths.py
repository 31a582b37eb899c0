"""Path confinement: text from a workflow (a cache directory, a rule or pairs file name) must not reach the file
system outside the directories the server owner allows.

Contracts
---------
* ``resolve_cache_dir(user_path, allowed_roots)``: an absolute, symlink-resolved directory *strictly inside* one of
  ``allowed_roots`` (resolved too), or ``CachePathError`` naming the allowed roots and how to add one
  (``CARNATOR_CACHE_ROOTS``, set by the server owner, never by a workflow). Relative paths are taken relative to
  the first root (ComfyUI's output directory in the nodes).
* ``resolve_confined(name, roots, must_exist=...)``: a file inside one of ``roots`` — a relative name looked up
  under each root in order, or an absolute path already inside one — or ``PathNotAllowedError``.
* Both resolve ``..`` segments and symlinks *before* the check, so neither can escape, and both refuse empty
  names, NUL characters and over-long paths with a message (never a raw ``OSError`` such as ENAMETOOLONG).
  The cache store re-checks every file path it builds against its own root (links planted later).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterable, Sequence

ENV_ROOTS = "CARNATOR_CACHE_ROOTS"
NAME_MAX = 255  # bytes per path component (Linux, macOS)
PATH_MAX = 4000  # bytes in all (a little under PATH_MAX = 4096, leaving room for the files inside)
log = logging.getLogger("carnator")


class PathNotAllowedError(ValueError):
    """The requested path lies outside the allowed directories, is malformed, or does not exist where required."""


class CachePathError(PathNotAllowedError):
    """A cache directory outside the allowed roots (or otherwise unusable)."""


def _shown(text: str) -> str:
    """The user's text for a message: at most 80 characters (a 6,000-character name must not flood a reply)."""
    return repr(text if len(text) <= 80 else text[:60] + f"...({len(text)} characters)")


def _malformed(text: str, what: str) -> str | None:
    """Why ``text`` cannot be a path at all, or None."""
    if not text:
        return f"the {what} is empty"
    if "\x00" in text:
        return f"the {what} contains a NUL character"
    raw = text.encode("utf-8", "surrogateescape")
    if len(raw) > PATH_MAX or any(len(part.encode("utf-8", "surrogateescape")) > NAME_MAX
                                  for part in text.replace("\\", "/").split("/")):
        return (f"the {what} {_shown(text)} is too long: at most {NAME_MAX} bytes per folder or file name and "
                f"{PATH_MAX} in all")
    return None


def _resolve(p: Path, what: str, text: str, error: type[PathNotAllowedError]) -> Path:
    try:
        return p.resolve()
    except (OSError, RuntimeError) as e:  # ENAMETOOLONG, ELOOP (symlink loop), EACCES...
        raise error(f"the {what} {_shown(text)} cannot be resolved: {getattr(e, 'strerror', None) or e}") from None


def inside(path: Path, root: Path) -> bool:
    """``path`` is ``root`` or below it (both already resolved)."""
    return path == root or path.is_relative_to(root)


# ---------------------------------------------------------------------------------------------- cache dirs
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


def resolve_cache_dir(user_path: str, allowed_roots: Iterable[Path | str]) -> Path:
    """Resolve a user-supplied cache directory under the allowed roots (see the module docstring)."""
    roots = [Path(r).expanduser() for r in allowed_roots if str(r).strip()]
    if not roots:
        raise CachePathError(
            f"no cache root is configured: the server owner must set {ENV_ROOTS} (absolute paths separated by "
            f"{os.pathsep!r}) or run inside ComfyUI, whose output/user directories are allowed by default"
        )
    resolved_roots = [_resolve(r, "cache root", str(r), CachePathError) for r in roots]
    text = (user_path or "").strip() if isinstance(user_path, str) else ""
    where = ", ".join(str(r) for r in resolved_roots)
    hint = (
        f"Allowed roots: {where}. Use a path relative to {resolved_roots[0]} (e.g. 'carnator_cache'), or ask the "
        f"server owner to add a root to the {ENV_ROOTS} environment variable (absolute paths separated by "
        f"{os.pathsep!r})."
    )
    why = _malformed(text, "cache directory")
    if why:
        raise CachePathError(f"{why}. {hint}")
    p = Path(text).expanduser()
    candidate = p if p.is_absolute() else resolved_roots[0] / p
    resolved = _resolve(candidate, "cache directory", text, CachePathError)  # '..' and every existing symlink
    if len(str(resolved).encode()) > PATH_MAX:
        raise CachePathError(f"the cache directory {_shown(text)} resolves to a path that is too long. {hint}")
    for root in resolved_roots:
        if resolved == root:
            raise CachePathError(f"cache directory {_shown(text)} is the root {root} itself; use a subdirectory "
                                 f"such as 'carnator_cache'. {hint}")
        if resolved.is_relative_to(root):
            return resolved
    raise CachePathError(f"cache directory {_shown(text)} resolves to {resolved}, which is outside the allowed "
                         f"roots. {hint}")


# ---------------------------------------------------------------------------------------------- named files
def resolve_confined(name: str, roots: Sequence[str | Path], *, must_exist: bool, what: str = "file") -> Path:
    """Resolve ``name`` inside one of ``roots``.

    must_exist=True: return the first existing match, searching the roots in order.
    must_exist=False: return the location under the first root (parents are not created here).
    Raises :class:`PathNotAllowedError` naming the roots when the name escapes them, is malformed or not found.
    """
    name = (name or "").strip() if isinstance(name, str) else ""
    why = _malformed(name, f"{what} name")
    if why:
        raise PathNotAllowedError(why if name else f"no {what} name given")
    rroots = [_resolve(Path(r).expanduser(), "directory", str(r), PathNotAllowedError) for r in roots]
    if not rroots:
        raise PathNotAllowedError(f"no allowed directory configured for {what}s")
    shown = ", ".join(str(r) for r in rroots)
    raw = Path(name).expanduser()
    if raw.is_absolute():
        cand = _resolve(raw, what, name, PathNotAllowedError)
        if not any(inside(cand, r) for r in rroots):
            raise PathNotAllowedError(
                f"{what} {_shown(name)} is outside the allowed directories ({shown}); put the file there and give "
                "its name relative to one of them"
            )
        if must_exist and not cand.is_file():
            raise PathNotAllowedError(f"{what} {_shown(name)} not found")
        return cand
    tried = []
    for root in rroots:
        cand = _resolve(root / raw, what, name, PathNotAllowedError)
        if not inside(cand, root):
            raise PathNotAllowedError(
                f"{what} {_shown(name)} escapes its directory {root} ('..' or a symlink pointing outside); give a "
                "plain name inside one of the allowed directories"
            )
        if not must_exist:
            return cand
        if cand.is_file():
            return cand
        tried.append(str(cand))
    raise PathNotAllowedError(f"{what} {_shown(name)} not found; looked in: {', '.join(tried)}")


__all__ = ["CachePathError", "ENV_ROOTS", "PathNotAllowedError", "inside", "resolve_cache_dir", "resolve_confined",
           "roots_from_env"]
