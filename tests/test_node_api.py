"""The nodes' V3 API import and socket types: pinned where the host offers a pinned version, declared once."""
from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.comfy


def test_socket_types_and_api_import_live_in_one_module():
    declared, api_imports = {}, []
    for p in sorted((ROOT / "nodes").glob("*.py")):
        text = p.read_text()
        for name in re.findall(r'io\.Custom\("(CARNATOR_[A-Z_]+)"\)', text):
            declared.setdefault(name, []).append(p.name)
        if re.search(r"^\s*from comfy_api\b", text, re.M):
            api_imports.append(p.name)
    assert declared and all(files == ["_api.py"] for files in declared.values()), declared
    assert len(declared) == 8, sorted(declared)
    assert api_imports == ["_api.py"], api_imports


def test_api_is_pinned_on_this_host_and_falls_back_to_latest(comfy_env, monkeypatch):
    import comfy_api.latest

    import carnator.nodes._api as api

    # ComfyUI 0.3.75 offers comfy_api.v0_0_2: the nodes use it.
    assert api.API_VERSION == "v0_0_2"
    # A host with only `latest`: the same module imports and still gives a working io.
    monkeypatch.setitem(sys.modules, "comfy_api.v0_0_2", None)  # makes `import comfy_api.v0_0_2` fail
    fresh = importlib.reload(api)
    try:
        assert fresh.API_VERSION == "latest" and fresh.io is comfy_api.latest.io
        assert fresh.PROBE.io_type == "CARNATOR_PROBE"
    finally:
        monkeypatch.undo()
        importlib.reload(api)
    assert api.API_VERSION == "v0_0_2"


def test_advanced_flag_where_the_host_lacks_the_argument(comfy_env):
    from carnator.nodes._api import io
    from carnator.nodes._common import HOST_HAS_ADVANCED, advanced, mark_advanced

    assert HOST_HAS_ADVANCED is False  # ComfyUI 0.3.75: Input(...) has no `advanced` argument
    knob = advanced(io.Float.Input("x", default=1.0, tooltip="t"))
    assert knob.as_dict()["advanced"] is True and knob.optional is True
    required = mark_advanced(io.Float.Input("y", default=1.0, tooltip="t"))
    assert required.as_dict()["advanced"] is True and not required.optional
