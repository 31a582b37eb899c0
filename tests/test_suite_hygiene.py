"""The suite passes whatever the clone's folder is called (custom-node folders usually have dashes) and whatever
order its tests run in. Each test runs a small part of the suite in a subprocess, in a copy of the tracked files
placed where the bug showed (see tests/pytest_carnator.py)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The reproduction: test_resume_samplers.py collects ComfyUI; test_nodes_chain then needs ComfyUI's own top-level
# ``nodes`` module (common_ksampler), which the extension's ``nodes/`` package shadowed when the root was on sys.path.
REPRO = ["tests/test_resume_samplers.py", "tests/test_embedded_comfy.py", "-k", "nodes_chain"]


def _tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True)
    return [p for p in out.stdout.decode().split("\0") if p]


def _copy_clone(dest: Path) -> Path:
    """The files a fresh clone has (tracked, plus this checkout's edits and new unignored files) under ``dest``, with
    the local host linked in (it is what `make setup` would build there)."""
    for rel in _tracked_files():
        src = ROOT / rel
        if not src.is_file():  # deleted in the working tree, not yet committed
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)
    (dest / ".host").symlink_to((ROOT / ".host").resolve(), target_is_directory=True)
    return dest


def _pytest(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
@pytest.mark.comfy
@pytest.mark.parametrize("folder", ["ComfyUI-Carnator", "carnator.v2 (copy)"])
def test_suite_in_folder_whose_name_is_not_an_identifier(tmp_path, folder):
    clone = _copy_clone(tmp_path / folder)
    res = _pytest(clone, *REPRO)
    assert res.returncode == 0, f"in a clone named {folder!r}:\n{res.stdout[-3000:]}\n{res.stderr[-2000:]}"
    assert "1 passed" in res.stdout, res.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.comfy
def test_order_option_reverses_and_shuffles(tmp_path):
    """``--order`` changes the order the tests run in (what `make test-reversed` relies on), and a bad value is a
    usage error that says what is accepted."""
    def order(*args: str) -> list[str]:
        res = _pytest(ROOT, "tests/test_keys.py", "--collect-only", *args)
        assert res.returncode == 0, res.stdout + res.stderr
        return [ln for ln in res.stdout.splitlines() if "::" in ln]

    given = order()
    assert len(given) >= 3
    assert order("--order", "reverse") == given[::-1]
    shuffled = order("--order", "shuffle:3")
    assert sorted(shuffled) == sorted(given) and shuffled == order("--order", "shuffle:3")
    bad = _pytest(ROOT, "tests/test_keys.py", "--order", "sideways")
    assert bad.returncode != 0 and "shuffle:SEED" in bad.stderr
