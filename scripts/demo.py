"""`make demo`: start a real ComfyUI server with Carnator loaded on loopback, show what it offers, stop it.

Later stages of the demo (warm cache, request stream, HTML report) build on this skeleton.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from harness_server import ComfyServer  # noqa: E402


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="carnator-demo-") as tmp:
        with ComfyServer(Path(tmp)) as server:
            info = server.get("/object_info")
            ours = sorted((name, spec.get("display_name", name)) for name, spec in info.items()
                          if spec.get("python_module", "").endswith("carnator") or name.startswith("Carnator"))
            print(f"ComfyUI {server.get('/system_stats')['system']['comfyui_version']} on {server.url}: "
                  f"{len(info)} node types, {len(ours)} from Carnator")
            for name, display in ours:
                print(f"  {name:32s} {display}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
