"""Which middle layers should the Early Probe read? The attention-peak rate per layer set, on selection captions.

A version's ``ModelVersion.probe_layers`` decide where the Signature Builder places each object (the peak of the
averaged cross-attention of the object's words at the probe step). The gate measures that peak on its 64 held-out
captions; choosing the layers on those same captions would fit the gate to its own test set, so this script
draws *other* captions (``--caption-seed``, default differs from ``config.GATE_CAPTION_SEED``), generates them
once on the stock sampling path and scores every contiguous window of 1..``--max-window`` layers with the gate's
own rule (``comfy_glue.attention_peak_rate``). Offline tooling: the runtime never imports it.

    python scripts/model/probe_layers.py --weights runs/v3.safetensors --threads 2
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
import conftest  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", type=Path, required=True)
    ap.add_argument("--captions", type=int, default=64, help="captions per scene kind (one and two objects)")
    ap.add_argument("--caption-seed", type=int, default=777)
    ap.add_argument("--max-window", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, help="also write the table here")
    args = ap.parse_args(argv)
    conftest.ensure_comfy_importable()
    import torch

    torch.set_num_threads(max(1, args.threads))
    from carnator.carnator_core.embedded import checker, comfy_glue, config

    if args.caption_seed == config.GATE_CAPTION_SEED:
        ap.error(f"--caption-seed {args.caption_seed} is the gate's own caption seed: choose the layers on other "
                 "captions")
    model, _, _ = comfy_glue.load_embedded(args.weights)
    ver = comfy_glue.model_version(model)
    windows = [tuple(range(a, a + w)) for w in range(1, args.max_window + 1)
               for a in range(0, ver.num_layers - w + 1)]
    table: dict[str, dict[str, float]] = {}
    for n_obj in (1, 2):
        caps = comfy_glue.gate_captions(args.captions, seed=args.caption_seed, n_objects=n_obj, version=ver.name)
        gen = comfy_glue.generate(caps, config.GATE_NOISE_SEED, model=model)
        results = [checker.check(gen.clips[i], c) for i, c in enumerate(caps)]
        table[f"{n_obj}obj"] = {",".join(map(str, w)): comfy_glue.attention_peak_rate(gen, caps, results, w, ver)
                                for w in windows}
    print(f"{ver.name} ({args.weights.name}), probe_layers now {ver.probe_layers}; "
          f"{args.captions} captions per kind, caption seed {args.caption_seed}")
    print(f"{'layers':>8s}  {'one obj':>7s}  {'two obj':>7s}")
    for w in windows:
        k = ",".join(map(str, w))
        print(f"{k:>8s}  {table['1obj'][k]:7.3f}  {table['2obj'][k]:7.3f}")
    if args.json:
        args.json.write_text(json.dumps({"weights": str(args.weights), "version": ver.name,
                                         "caption_seed": args.caption_seed, "captions": args.captions,
                                         "table": table}, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
