"""Kept for importers of ``risk.paths``: path confinement lives in ``carnator_core/paths.py`` (one module for
cache directories, rule and pairs files)."""
from ..paths import PathNotAllowedError, resolve_confined

__all__ = ["PathNotAllowedError", "resolve_confined"]
