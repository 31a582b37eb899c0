"""What the side-by-side benchmarks on ComfyUI's sampling path share (bench_exact, bench_miss_overhead,
bench_two_expert): the repository registered as the ``carnator`` package, ComfyUI importable from the local host,
their ``--repeats`` / ``--threads`` flags and torch's thread count. Offline tooling: the runtime never imports it.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import conftest  # noqa: E402  (registers the `carnator` package; knows where the host's ComfyUI is)


def setup(doc: str, repeats: int, threads: int = 2) -> argparse.Namespace:
    """Parse ``--repeats`` (runs per variant; the benchmark reports medians) and ``--threads`` (torch threads),
    make ComfyUI importable and set torch's thread count. ``doc``: the script's docstring (its first line is the
    help text)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=repeats, help=f"runs per variant, medians ({repeats})")
    ap.add_argument("--threads", type=int, default=threads, help=f"torch threads ({threads})")
    args = ap.parse_args()
    conftest.ensure_comfy_importable()
    import torch

    torch.set_num_threads(args.threads)
    return args
