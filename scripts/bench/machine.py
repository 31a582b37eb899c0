"""The CPU's model name, for the machine line benchmarks print beside their figures (offline tooling)."""
from __future__ import annotations

import platform
import subprocess


def cpu_model() -> str:
    """``lscpu``'s "Model name", else ``platform.processor()`` (which may be empty)."""
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip() or platform.processor()
    except OSError:
        pass
    return platform.processor()
