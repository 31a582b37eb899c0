"""Comfy Registry readiness: the real comfy-cli (scripts/setup/setup_registry_tools.sh) validates and packs a copy of
the repository's tracked files offline (scripts/setup/check_registry.py); the package holds what a user needs and
nothing else, within its size budget."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("check_registry", ROOT / "scripts" / "setup" / "check_registry.py")
check_registry = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_registry)

COMFY = check_registry.DEFAULT_COMFY
WEIGHTS = "carnator_core/embedded/weights/carnator_embedded_v3.safetensors"


@pytest.fixture(scope="module")
def comfy() -> Path:
    if not COMFY.exists():
        pytest.fail(f"comfy-cli missing at {COMFY}: run scripts/setup/setup_registry_tools.sh (make setup does)")
    return COMFY


def test_validate_and_pack_ready_for_registry(comfy: Path, tmp_path: Path) -> None:
    summary = check_registry.check(comfy, out=tmp_path)
    assert summary["problems"] == [], "\n".join(summary["problems"])
    files = set(summary["files"])
    # What a user needs, by name (the checker also compares against every tracked runtime file).
    for needed in ("__init__.py", "pyproject.toml", "web/carnator.js", "rules/embedded.json", WEIGHTS,
                   "workflows/embedded.json", "workflows/api/embedded.json", "README.md", "LICENSE"):
        assert needed in files, needed
    # What stays in the repository.
    assert "rules/embedded_pairs.jsonl" not in files
    assert not [f for f in files if f.endswith(("_v1.safetensors", "_v2.safetensors"))]  # one model: the default
    assert not [f for f in files if f.startswith(("tests/", ".ci/"))]
    assert summary["pack_bytes"] <= check_registry.PACK_BUDGET_BYTES
    assert (tmp_path / "node.zip").stat().st_size == summary["pack_bytes"]
    assert summary["requires_comfyui"] and summary["icon_px"] and summary["icon_px"][0] <= 800


def test_checker_catches_a_pack_with_calibration_data(comfy: Path) -> None:
    """Without the .comfyignore rules the labelled pairs and the dev scripts ship: the check must say so."""
    summary = check_registry.check(comfy, comfyignore="tests/\n")
    problems = "\n".join(summary["problems"])
    assert "not for users" in problems and "rules/embedded_pairs.jsonl" in problems, problems
    assert "scripts/bench/bench_reuse.py" in problems, problems
