"""The suite's pytest plugin (pytest.ini: ``-p pytest_carnator``): a suite that does not care what its folder is
called or in which order its tests run.

1. The repository root is collected as a plain directory, never as a Python package. The root holds
   ``__init__.py`` because ComfyUI imports a custom-node folder as a package. pytest would collect such a root as a
   Package and import that ``__init__.py``; when the folder's name is not a Python identifier (custom-node folders
   usually have dashes, e.g. ``ComfyUI-Carnator``), it imports it as a top-level module and puts the root itself
   on ``sys.path`` — where our ``nodes/`` package then shadows ComfyUI's top-level ``nodes`` module for every test
   that runs later. The tests import the repository through ``tests/repo_package.py`` instead (as ``carnator``, the
   name ComfyUI gives it). A plugin rather than a conftest: a ``conftest.py`` at the root would itself be imported
   the same way, and the hooks of ``tests/conftest.py`` do not apply to the root's own collection.
2. ``--order reverse`` / ``--order shuffle:SEED`` run the collected tests in reverse or in a seeded random order
   (``make test-reversed``), to show that no test depends on another having run first.
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[1]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--order", default="given",
                     help="test order: 'given' (default), 'reverse', or 'shuffle:SEED' (a seeded random order)")


def pytest_collect_directory(path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if path.resolve() == _ROOT:
        return pytest.Dir.from_parent(parent, path=path)
    return None


def _parse_order(value: str) -> tuple[str, int]:
    kind, _, seed = value.partition(":")
    if kind == "shuffle":
        try:
            return kind, int(seed)
        except ValueError:
            raise pytest.UsageError(f"--order shuffle needs an integer seed, e.g. shuffle:7; got {value!r}") from None
    if kind in ("given", "reverse") and not seed:
        return kind, 0
    raise pytest.UsageError(f"--order must be 'given', 'reverse' or 'shuffle:SEED'; got {value!r}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    kind, seed = _parse_order(config.getoption("--order"))
    if kind == "reverse":
        items.reverse()
    elif kind == "shuffle":
        random.Random(seed).shuffle(items)


def pytest_report_header(config: pytest.Config) -> str | None:
    order = config.getoption("--order")
    return None if order == "given" else f"carnator: test order {order}"
