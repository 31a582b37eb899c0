"""Import boundaries: the layers of docs/ARCHITECTURE.md hold in the code.

The graph is read from the source (every ``import``, also inside functions, since a function-level import is
still a dependency), so it covers modules that need ComfyUI too. Units are the top-level modules and
subpackages of ``carnator_core`` plus ``nodes``; ``__init__`` is the ``carnator_core`` package itself.

- The runtime never imports the offline lab (``carnator_core/lab``): only the lab itself, scripts, tests and
  docs use it. A ComfyUI user loads the runtime; the lab stays out of their process.
- The unit graph has no cycle (a cycle is how the lab once got braided into the runtime: ``risk`` and
  ``request`` imported each other).
- Every cross-unit import is one that docs/ARCHITECTURE.md's "what may import what" table allows, so the
  table a newcomer reads is the graph the code has.
- ComfyUI is imported only by the patching module, the per-architecture adapters, the embedded model's glue
  and the nodes; the rest of the core imports without it (checked for real in a subprocess below).
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "carnator_core"
COMFY_NAMES = {"comfy", "comfy_api", "comfy_extras", "folder_paths", "nodes", "server", "execution"}
# Modules allowed to import ComfyUI (see ARCHITECTURE.md): the patching module, the adapters, the embedded
# model's construction and glue; nodes/ is ComfyUI-facing by definition.
COMFY_ALLOWED = {"carnator.carnator_core." + m for m in ("comfy_patch", "adapters", "embedded.model",
                                                          "embedded.comfy_glue")}


def _modules() -> dict[str, Path]:
    """Dotted module name (the repository is package ``carnator``) -> file, for carnator_core/ and nodes/."""
    out = {}
    for top in ("carnator_core", "nodes"):
        for p in sorted((ROOT / top).rglob("*.py")):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(["carnator"] + parts)] = p
    return out


def _imports(name: str, path: Path, known: set[str]) -> tuple[set[str], set[str]]:
    """(internal modules ``name`` imports, top-level names of absolute imports) — at any depth of the file."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    internal, absolute = set(), set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            absolute.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            absolute.add(node.module.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[:len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
            assert base, f"{path}: relative import {node.module!r} leaves the repository package"
            for alias in node.names:  # `from . import reuse` imports a module; `from .. import x` a name
                sub = f"{target}.{alias.name}"
                internal.add(sub if sub in known else target)
    return internal, absolute


def _unit(module: str) -> str:
    parts = module.split(".")[1:]
    if parts[0] == "nodes":
        return "nodes"
    return parts[1] if len(parts) > 1 else "__init__"


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]], dict[str, set[str]]]:
    mods = _modules()
    known = set(mods)
    mod_edges, unit_edges, absolute = {}, defaultdict(set), {}
    for name, path in mods.items():
        internal, absolute[name] = _imports(name, path, known)
        mod_edges[name] = internal
        for target in internal:
            if not target.startswith(("carnator.carnator_core", "carnator.nodes")):
                continue
            if _unit(target) != _unit(name):
                unit_edges[_unit(name)].add(_unit(target))
    return mod_edges, unit_edges, absolute


def _documented() -> dict[str, set[str] | None]:
    """The "what may import what" table of docs/ARCHITECTURE.md: unit -> allowed units (None: any but nodes)."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    m = re.search(r"## [^\n]*what may import what.*?```text\n(.*?)```", text, re.S | re.I)
    assert m, "docs/ARCHITECTURE.md lost its 'what may import what' table (a ```text block after that heading)"
    table: dict[str, set[str] | None] = {}
    for line in m.group(1).splitlines():
        if "->" not in line:
            continue
        left, right = (s.strip() for s in line.split("->", 1))
        right = right.split("#", 1)[0].strip()
        table[left] = None if right == "*" else {u.strip() for u in right.split(",") if u.strip()}
    return table


def test_runtime_never_imports_the_lab():
    mod_edges, _, _ = _graph()
    bad = sorted(f"{m} -> {t}" for m, ts in mod_edges.items() if _unit(m) != "lab"
                 for t in ts if t.startswith("carnator.carnator_core.lab"))
    assert not bad, f"runtime modules import the offline lab (move the shared code out of lab/): {bad}"


def test_unit_graph_has_no_cycle():
    _, unit_edges, _ = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(u: str) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(unit_edges.get(u, ())):
            if state.get(v) == 1:
                cycle = stack[stack.index(v):] + [v]
                raise AssertionError(f"import cycle between units: {' -> '.join(cycle)}")
            if v not in state:
                visit(v)
        stack.pop()
        state[u] = 2

    for u in sorted(unit_edges):
        if u not in state:
            visit(u)


def test_imports_follow_the_documented_layers():
    _, unit_edges, _ = _graph()
    table = _documented()
    units = {_unit(m) for m in _modules()}
    missing = sorted(units - set(table))
    assert not missing, f"units not in docs/ARCHITECTURE.md's import table (add a row): {missing}"
    bad = []
    for u, targets in sorted(unit_edges.items()):
        allowed = table[u]
        for t in sorted(targets):
            if t == "lab" and u != "lab":
                bad.append(f"{u} -> lab")
            elif allowed is None:
                if t == "nodes":
                    bad.append(f"{u} -> nodes")
            elif t not in allowed:
                bad.append(f"{u} -> {t}")
    assert not bad, f"imports the layer table of docs/ARCHITECTURE.md does not allow: {bad}"


def test_the_documented_table_itself_is_layered():
    """The table (not only today's code) keeps the lab out of the runtime and has no cycle."""
    table = _documented()
    for u, allowed in table.items():
        if u not in ("lab", "nodes"):
            assert allowed is not None and "lab" not in allowed, f"the table lets {u} import the lab"
    state: dict[str, int] = {}

    def visit(u: str) -> None:
        state[u] = 1
        for v in sorted(table.get(u) or ()):
            assert state.get(v) != 1, f"the table allows a cycle through {u} -> {v}"
            if v not in state:
                visit(v)
        state[u] = 2

    for u in sorted(table):
        if u not in state and table[u] is not None:
            visit(u)


def test_comfyui_imported_only_where_allowed():
    _, _, absolute = _graph()
    bad = sorted(f"{m} imports {sorted(names & COMFY_NAMES)}" for m, names in absolute.items()
                 if m.startswith("carnator.carnator_core") and names & COMFY_NAMES
                 and not any(m == a or m.startswith(a + ".") for a in COMFY_ALLOWED)
                 and _unit(m) != "lab")
    assert not bad, bad


def test_runtime_modules_import_without_comfyui_or_lab():
    """Import every runtime module that needs no ComfyUI in a fresh interpreter; neither ComfyUI nor the lab
    may end up in sys.modules."""
    needs_comfy = COMFY_ALLOWED - {"carnator.carnator_core.adapters"}  # adapters import ComfyUI lazily
    names = sorted(m for m in _modules() if m.startswith("carnator.carnator_core") and _unit(m) != "lab"
                   and not any(m == a or m.startswith(a + ".") for a in needs_comfy))
    assert "carnator.carnator_core.request" in names and "carnator.carnator_core.risk.pipeline" in names
    code = (
        "import importlib, sys\n"
        f"sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "from repo_package import register_package\n"
        "register_package()\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "bad = sorted(k for k in sys.modules if k.split('.')[0] in ('comfy', 'comfy_api', 'nodes', 'folder_paths')\n"
        "             or k.startswith('carnator.carnator_core.lab'))\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT / "tests"))
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
