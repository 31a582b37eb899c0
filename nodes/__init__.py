"""Carnator's ComfyUI nodes (V3 schema).

Every module in this folder exports ``NODES``: a list of ``io.ComfyNode`` subclasses. They are discovered
here so that adding a node module needs no edit to a shared registry. A module that fails to import is logged
with its traceback and skipped, so one broken module does not take every other Carnator node down with it.
"""
from __future__ import annotations

import importlib
import logging
import pkgutil

from ._api import ComfyExtension, io


def all_nodes() -> list[type[io.ComfyNode]]:
    found: list[type[io.ComfyNode]] = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        try:
            module = importlib.import_module(f"{__name__}.{info.name}")
        except Exception:
            logging.getLogger("carnator").exception("carnator: node module %r failed to import; its nodes are "
                                                    "unavailable", info.name)
            continue
        found.extend(getattr(module, "NODES", []))
    return found


class CarnatorExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return all_nodes()
