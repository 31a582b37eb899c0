"""Comfy Registry readiness: run `comfy node validate` and `comfy node pack` and check what they produce.

    python scripts/setup/check_registry.py [--comfy .host/registry-tools/bin/comfy] [--out artifacts/registry]

comfy-cli (scripts/setup/setup_registry_tools.sh) packs the *git-tracked* files minus the patterns in `.comfyignore`.
So that the repository is never touched, this copies the tracked files of the working tree (and `.comfyignore`)
into a temporary git repository and runs the tools there, offline: telemetry and remote refreshes off
(`DO_NOT_TRACK`, `COMFY_NO_TELEMETRY`, `COMFY_CLI_NO_REMOTE_REFRESH`), its config in the temporary folder, and
each call bounded by a timeout. Then it checks:

- validate exits 0 and prints no warning (comfy-cli only warns about bad classifiers, versions or licences);
- pyproject's Registry fields: `Repository`, `requires-comfyui`, an OS classifier, and an `Icon` that is the raw
  URL of an image tracked in this repository (PNG/SVG/JPG/GIF, at most 800x400 px) under `Repository`;
- the package: every tracked file a user needs is in it (nodes, runtime core, the current embedded weights, web
  extension, shipped rules, example workflows, the API client, README, LICENSE), nothing that is not (tests,
  benchmarks and setup scripts, CI, labelled calibration pairs, superseded weights), and its size is within
  PACK_BUDGET_BYTES.

Prints a JSON summary (size, file count, bytes per top-level folder, the largest files) and writes it with the
package to --out. Exit status 1 with the list of problems when a check fails.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import tomllib

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_COMFY = ROOT / ".host" / "registry-tools" / "bin" / "comfy"
PACK_BUDGET_BYTES = 8 * 1024 * 1024  # the default embedded weights (v3) are ~5.7 MB of it
TOOL_TIMEOUT_S = 180

# Tracked files a user needs (fnmatch patterns; `*` crosses folders): each must be in the package.
NEEDED = ["__init__.py", "pyproject.toml", "requirements.txt", "README.md", "LICENSE", "nodes/*", "carnator_core/*",
          "web/*", "rules/*.json", "rules/README.md", "workflows/*", "scripts/api_client.py", "docs/*"]
# Tracked, but kept in the repository only: superseded weights, training state, v2 (the side-by-side reference),
# the withdrawn rules (records only; v2's among them), and the docs' history (superseded measurements and their
# pictures). The package carries one model, the default (v3), and the current docs.
REPO_ONLY = ["*_v1.safetensors", "carnator_core/embedded/weights/train_state_*",
             "carnator_core/embedded/weights/carnator_embedded_v2.safetensors", "docs/history/*", "rules/withdrawn/*"]
# Never in the package, even when tracked (development, calibration data, REPO_ONLY).
NOT_SHIPPED = ["tests/*", "scripts/*", ".ci/*", "Makefile", "pytest.ini", "requirements-dev.txt", "BENCHMARKS.md",
               ".gitignore", ".comfyignore", "rules/*.jsonl", ".host/*", "artifacts/*", "runs/*", "*.pyc",
               *REPO_ONLY]
SHIPPED_EXCEPTIONS = ["scripts/api_client.py"]  # the documented API client is for users
# A tracked file matching NEEDED is still left out when it also matches one of these.
NEEDED_EXCEPTIONS = REPO_ONLY

def matches(path: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(path, p) for p in patterns)


def tracked_files(root: Path) -> list[str]:
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], check=True, capture_output=True).stdout
    return [p for p in out.decode().split("\0") if p and (root / p).is_file()]


def image_size(path: Path) -> tuple[int, int] | None:
    """(width, height) of a PNG, GIF or JPEG file; None if it is none of those (SVG has no fixed size)."""
    data = path.read_bytes()
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return struct.unpack(">II", data[16:24])
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return struct.unpack("<HH", data[6:10])
    if data[:2] == b"\xff\xd8":
        i = 2
        while i + 9 < len(data):
            marker, length = data[i + 1], struct.unpack(">H", data[i + 2:i + 4])[0]
            if 0xC0 <= marker <= 0xC3:
                h, w = struct.unpack(">HH", data[i + 5:i + 9])
                return w, h
            i += 2 + length
    return None


def check_pyproject(root: Path, tracked: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The Registry fields of pyproject.toml; returns (fields, problems)."""
    data = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    project, comfy = data.get("project", {}), data.get("tool", {}).get("comfy", {})
    repo = project.get("urls", {}).get("Repository", "")
    icon = comfy.get("Icon", "")
    fields = {"name": project.get("name"), "version": project.get("version"), "repository": repo, "icon": icon,
              "requires_comfyui": comfy.get("requires-comfyui", ""), "classifiers": project.get("classifiers", [])}
    problems = []
    prefix = "https://github.com/"
    if not repo.startswith(prefix) or len(repo[len(prefix):].strip("/").split("/")) != 2:
        problems.append(f"[project.urls] Repository must be https://github.com/<owner>/<repo>, got {repo!r}")
    if not fields["requires_comfyui"]:
        problems.append("[tool.comfy] requires-comfyui is missing (e.g. \">=0.3.75\")")
    if not any(c.startswith("Operating System :: ") for c in fields["classifiers"]):
        problems.append("[project] classifiers name no operating system (e.g. \"Operating System :: OS Independent\")")
    owner_repo = repo[len(prefix):].strip("/")
    raw = f"https://raw.githubusercontent.com/{owner_repo}/"
    if not icon.startswith(raw):
        problems.append(f"[tool.comfy] Icon must be a raw URL under {raw}<branch>/<path>, got {icon!r}")
    else:
        rel = icon[len(raw):].split("/", 1)[1] if "/" in icon[len(raw):] else ""
        if rel not in tracked:
            problems.append(f"Icon {icon!r}: {rel!r} is not a tracked file of this repository")
        elif not rel.lower().endswith((".png", ".svg", ".jpg", ".jpeg", ".gif")):
            problems.append(f"Icon {rel!r} must be PNG, SVG, JPG or GIF")
        else:
            size = image_size(root / rel)
            fields["icon_px"] = size
            if not rel.lower().endswith(".svg") and (size is None or size[0] > 800 or size[1] > 400):
                problems.append(f"Icon {rel!r}: {size} px, the Registry takes at most 800x400")
    return fields, problems


def run_tool(comfy: Path, args: list[str], cwd: Path, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "DO_NOT_TRACK": "1", "COMFY_NO_TELEMETRY": "1", "COMFY_CLI_NO_REMOTE_REFRESH": "1",
           "XDG_CONFIG_HOME": str(home / "config"), "HOME": str(home), "NO_COLOR": "1", "COLUMNS": "200"}
    try:
        return subprocess.run([str(comfy), *args], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=TOOL_TIMEOUT_S, stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"`comfy {' '.join(args)}` did not finish within {TOOL_TIMEOUT_S} s (waiting on the "
                           f"network?); output so far: {e.stdout!r} {e.stderr!r}") from None


def check(comfy: Path = DEFAULT_COMFY, root: Path = ROOT, out: Path | None = None,
          comfyignore: str | None = None) -> dict[str, Any]:
    """Validate and pack a copy of ``root``'s tracked files; returns the summary with ``problems`` (empty = ready).

    ``comfyignore`` replaces the repository's .comfyignore in the copy (tests use it to see a bad one caught)."""
    if not comfy.exists():
        raise FileNotFoundError(f"{comfy} not found: run scripts/setup/setup_registry_tools.sh (make setup does)")
    tracked = tracked_files(root)
    fields, problems = check_pyproject(root, tracked)
    with tempfile.TemporaryDirectory(prefix="carnator-registry-") as tmp:
        work, home = Path(tmp) / "carnator", Path(tmp) / "home"
        home.mkdir()
        for rel in tracked:
            (work / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / rel, work / rel)
        ignore = comfyignore if comfyignore is not None else (
            (root / ".comfyignore").read_text(encoding="utf-8") if (root / ".comfyignore").exists() else "")
        (work / ".comfyignore").write_text(ignore, encoding="utf-8")
        git = ["git", "-C", str(work), "-c", "user.name=carnator", "-c", "user.email=carnator@localhost"]
        subprocess.run([*git, "init", "-q"], check=True)
        subprocess.run([*git, "add", "-A"], check=True)
        validate = run_tool(comfy, ["node", "validate"], work, home)
        text = validate.stdout + validate.stderr
        if validate.returncode != 0 or "warning" in text.lower() or "error" in text.lower():
            problems.append(f"`comfy node validate` (exit {validate.returncode}) says:\n{text.strip()}")
        pack = run_tool(comfy, ["node", "pack"], work, home)
        zip_path = work / "node.zip"
        if pack.returncode != 0 or not zip_path.exists():
            problems.append(f"`comfy node pack` failed (exit {pack.returncode}):\n{pack.stdout}{pack.stderr}")
            return {**fields, "problems": problems}
        with zipfile.ZipFile(zip_path) as z:
            infos = [i for i in z.infolist() if not i.is_dir()]
        names = {i.filename for i in infos}
        missing = [p for p in tracked if matches(p, NEEDED) and not matches(p, NEEDED_EXCEPTIONS) and p not in names]
        extra = sorted(n for n in names if matches(n, NOT_SHIPPED) and not matches(n, SHIPPED_EXCEPTIONS))
        if missing:
            problems.append(f"left out of the package, but users need them: {missing}")
        if extra:
            problems.append(f"in the package, but not for users (add them to .comfyignore): {extra}")
        size = zip_path.stat().st_size
        if size > PACK_BUDGET_BYTES:
            problems.append(f"package is {size / 2**20:.1f} MiB > budget {PACK_BUDGET_BYTES / 2**20:.0f} MiB")
        by_top: dict[str, int] = {}
        for i in infos:
            top = i.filename.split("/", 1)[0] if "/" in i.filename else "(root files)"
            by_top[top] = by_top.get(top, 0) + i.compress_size
        summary = {
            **fields, "pack_bytes": size, "pack_files": len(infos),
            "compressed_bytes_by_folder": dict(sorted(by_top.items(), key=lambda kv: -kv[1])),
            "largest_files": [(i.filename, i.file_size) for i in sorted(infos, key=lambda i: -i.file_size)[:5]],
            "files": sorted(names), "validate_output": text.strip(), "problems": problems,
        }
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            shutil.copy2(zip_path, out / "node.zip")
            (out / "pack.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
        return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--comfy", type=Path, default=DEFAULT_COMFY, help="comfy-cli executable")
    ap.add_argument("--out", type=Path, default=ROOT / "artifacts" / "registry", help="where node.zip goes")
    args = ap.parse_args()
    summary = check(args.comfy, out=args.out)
    shown = {k: v for k, v in summary.items() if k not in ("files", "validate_output")}
    print(json.dumps(shown, indent=1))
    if summary["problems"]:
        print("\nNOT READY for the Registry:\n- " + "\n- ".join(summary["problems"]), file=sys.stderr)
        return 1
    print(f"\nready: {summary['pack_files']} files, {summary['pack_bytes'] / 2**20:.2f} MiB -> "
          f"{args.out / 'node.zip'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
