"""Import the repository as the package ``carnator`` — the name ComfyUI gives it under custom_nodes/ — without
importing ComfyUI. The one copy of this bootstrap: tests (via conftest), spawned test children, and the scripts
(``sys.path.insert(0, str(ROOT / "tests"))`` then ``from repo_package import register_package``) all use it.

The package code uses relative imports only, so it must be imported under a package name; registering the
repository root by file location gives it one without putting the root itself on ``sys.path`` (which would
shadow ComfyUI's top-level ``nodes`` module with ours).
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def register_package(name: str = "carnator") -> ModuleType:
    """Register (once) and return the repository root as package ``name``; idempotent."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "__init__.py", submodule_search_locations=[str(ROOT)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
