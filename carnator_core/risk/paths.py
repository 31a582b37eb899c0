"""Confine user-supplied file names (rule files, pairs files) to allowed directories.

A node input is text a shared workflow can set, so ``"../../etc/passwd"`` or an absolute path elsewhere must
not reach the file system. :func:`resolve_confined` accepts a relative name (looked up under each root in
order) or an absolute path that already lies inside one of the roots; symlinks are resolved before the check.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence


class PathNotAllowedError(ValueError):
    """The requested path lies outside the allowed directories (or does not exist where required)."""


def _inside(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
        return True
    except ValueError:
        return False


def resolve_confined(name: str, roots: Sequence[str | Path], *, must_exist: bool, what: str = "file") -> Path:
    """Resolve ``name`` inside one of ``roots``.

    must_exist=True: return the first existing match, searching the roots in order.
    must_exist=False: return the location under the first root (parents are not created here).
    Raises :class:`PathNotAllowedError` naming the roots when the name escapes them or is not found.
    """
    name = (name or "").strip()
    if not name:
        raise PathNotAllowedError(f"no {what} name given")
    if "\x00" in name:
        raise PathNotAllowedError(f"{what} name contains a NUL byte")
    rroots = [Path(r).expanduser().resolve() for r in roots]
    if not rroots:
        raise PathNotAllowedError(f"no allowed directory configured for {what}s")
    shown = ", ".join(str(r) for r in rroots)
    raw = Path(name).expanduser()
    if raw.is_absolute():
        cand = raw.resolve()
        if not any(_inside(cand, r) for r in rroots):
            raise PathNotAllowedError(
                f"{what} {name!r} is outside the allowed directories ({shown}); put the file there and give its "
                "name relative to one of them"
            )
        if must_exist and not cand.is_file():
            raise PathNotAllowedError(f"{what} {name!r} not found")
        return cand
    tried = []
    for root in rroots:
        cand = (root / raw).resolve()
        if not _inside(cand, root):
            raise PathNotAllowedError(
                f"{what} {name!r} escapes its directory {root} ('..' or a symlink pointing outside); give a plain "
                "name inside one of the allowed directories"
            )
        if not must_exist:
            return cand
        if cand.is_file():
            return cand
        tried.append(str(cand))
    raise PathNotAllowedError(f"{what} {name!r} not found; looked in: {', '.join(tried)}")
