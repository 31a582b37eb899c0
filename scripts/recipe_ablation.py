#!/usr/bin/env python
"""Short training runs of an embedded-model version with some of another recipe's knobs, to find what holds a
recipe back (a lab tool: nothing here is shipped or loaded by the runtime).

    # v2's geometry and depth (32 px, 4 blocks x 192) with v3's text context, two-object share and loss weighting:
    OMP_NUM_THREADS=1 .host/venv/bin/python scripts/recipe_ablation.py --base v2 --text-context 0.6 --p-two 0.6 \\
        --object-share 0.3 --state runs/abl --chunk-minutes 30
    # how much each kind of word moves that run's denoiser (same overrides: the text encoder depends on them):
    .host/venv/bin/python scripts/recipe_ablation.py --base v2 --text-context 0.6 --p-two 0.6 \\
        --measure runs/abl/latest.safetensors

Training is ``carnator_core.embedded.train`` unchanged (``--steps`` schedule, ``--state`` resumable, EMA snapshot
at every checkpoint to ``<state>/latest.safetensors``), with the base version's ``text_context``, ``p_two`` and
any ``--set`` field (frame, width, depth, heads) replaced in this process only (``config.VERSIONS``).
``--measure`` prints ``scripts/word_effects.py``'s numbers for a snapshot under the same overrides.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

import conftest  # noqa: E402  (registers the `carnator` package, puts ComfyUI on sys.path)

conftest.ensure_comfy_importable()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="v2")
    ap.add_argument("--text-context", type=float, default=None)
    ap.add_argument("--p-two", type=float, default=None)
    ap.add_argument("--object-share", type=float, default=None)
    ap.add_argument("--steps", type=int, default=15048)
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (train.py's default otherwise)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps (train.py's default otherwise)")
    ap.add_argument("--batch", type=int, default=None, help="clips per step (train.py's default otherwise)")
    ap.add_argument("--state", type=Path, default=None)
    ap.add_argument("--chunk-minutes", type=float, default=30.0)
    ap.add_argument("--ckpt-minutes", type=float, default=5.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="override any other field of the base version (config.ModelVersion), e.g. height=32, "
                         "dim=192, num_layers=4")
    ap.add_argument("--measure", default=None, help="a snapshot to measure instead of training")
    ns = ap.parse_args()
    from carnator.carnator_core.embedded import config, train

    over = {k: v for k, v in (("text_context", ns.text_context), ("p_two", ns.p_two)) if v is not None}
    base = config.VERSIONS[ns.base]
    for item in ns.set:
        key, _, value = item.partition("=")
        if not hasattr(base, key) or key == "name":
            raise SystemExit(f"--set {item!r}: ModelVersion has no field {key!r}")
        cur = getattr(base, key)
        over[key] = tuple(int(x) for x in value.split(",")) if isinstance(cur, tuple) else type(cur)(value)
    config.VERSIONS[ns.base] = dataclasses.replace(config.VERSIONS[ns.base], **over)
    if ns.measure:
        import torch
        from word_effects import word_effects

        torch.set_num_threads(ns.threads)
        print(json.dumps({"overrides": over, **word_effects(ns.measure)}), flush=True)
        return
    if ns.state is None:
        raise SystemExit("--state is required for training")
    argv = ["--version", ns.base, "--state", str(ns.state), "--steps", str(ns.steps), "--chunk-minutes",
            str(ns.chunk_minutes), "--ckpt-minutes", str(ns.ckpt_minutes), "--threads", str(ns.threads),
            "--freeze-text-embedding", "--snapshot", str(ns.state / "latest.safetensors"),
            "--log", str(ns.state / "log.jsonl"), "--out", str(ns.state / "final.safetensors")]
    if ns.object_share is not None:
        argv += ["--object-share", str(ns.object_share)]
    for flag, value in (("--lr", ns.lr), ("--warmup", ns.warmup), ("--batch", ns.batch)):
        if value is not None:
            argv += [flag, str(value)]
    print(f"overrides {over}; train {' '.join(argv)}", flush=True)
    train.main(argv)


if __name__ == "__main__":
    main()
