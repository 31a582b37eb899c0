#!/usr/bin/env python
"""Frames of every pair where the first and the second label disagree (or every b pair), to look at.

    .host/venv/bin/python scripts/lab/look_label_disagreements.py --pairs rules/attempt19_s84.jsonl \\
        --clips artifacts/a19/w84/clips --png artifacts/a19/disagree_s84
    # every b of the pairs the shipped rule's thresholds accept (its chosen candidate per request)
    .host/venv/bin/python scripts/lab/look_label_disagreements.py --pairs rules/attempt20_s90.jsonl \\
        --clips artifacts/a20/w90/clips --png artifacts/a20/b_s90 --select unsafe --accepted-by rules/embedded.json

Reads a pairs file written by scripts/lab/relabel_pairs.py (``diag.label_v1`` = the first label's verdict, the row's
own ``unsafe``/``better`` = the second's) and the run's saved clips; for each pair whose (b, c) differ between the
two labels writes ``<request>_<entry>_<kind>.png``: the dense clip's frames on the top row, the reuse clip's below,
|difference| x2 at the bottom, and prints one line per pair with what the second label failed (checker attributes,
detail checks) and the measured track / shape. Nothing is generated.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

sys.path.insert(0, str(ROOT / "scripts" / "lab"))

import conftest  # noqa: E402,F401  (registers the `carnator` package)
from relabel_pairs import accepted_keys, pair_clips  # noqa: E402


def strip(dense: np.ndarray, reuse: np.ndarray, scale: int = 3) -> np.ndarray:
    diff = np.repeat(np.abs(reuse - dense).max(-1, keepdims=True), 3, -1)
    img = np.concatenate([np.concatenate(list(x), 1) for x in (dense, reuse, np.clip(2 * diff, 0, 1))], 0)
    return np.kron(img, np.ones((scale, scale, 1)))


def main(argv: list[str] | None = None) -> int:
    from PIL import Image

    from carnator.carnator_core.embedded import checker

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=Path, required=True)
    ap.add_argument("--clips", type=Path, required=True)
    ap.add_argument("--png", type=Path, required=True)
    ap.add_argument("--select", choices=("disagreements", "unsafe"), default="disagreements",
                    help="disagreements: pairs whose (b, c) differ between the labels; unsafe: pairs the second "
                         "label calls b")
    ap.add_argument("--accepted-by", type=Path, default=None,
                    help="a rule file: keep only the pairs its thresholds accept (the chosen candidate per request)")
    args = ap.parse_args(argv)
    keep = None if args.accepted_by is None else accepted_keys(args.accepted_by, args.pairs)
    args.png.mkdir(parents=True, exist_ok=True)
    tally: Counter = Counter()
    for line in args.pairs.read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        if r.get("type") == "header":
            continue
        d = r["diag"]
        old = (d["label_v1"]["unsafe"], d["label_v1"]["better"])
        new = (bool(r["unsafe"]), bool(r.get("better", False)))
        if (old == new) if args.select == "disagreements" else not new[0]:
            continue
        if keep is not None and (r["request_id"], r["entry_id"]) not in keep:
            continue
        rid = r["request_id"].split(":")[-1]
        dense, reuse = pair_clips(args.clips, r)
        name = f"{rid}_{r['entry_id'].split(':')[-1]}_{d['kind']}.png"
        Image.fromarray((strip(dense, reuse) * 255 + 0.5).astype(np.uint8)).save(args.png / name)
        seen = checker.check(reuse, d["prompt"], strict=True)
        meas = [{k: o.measured.get(k) for k in ("shape", "track_motion", "motion", "track_travel_xy",
                                                  "track_monotone", "track_jump")} for o in seen.objects]
        v2 = d.get("v2", {})
        what = "b" if old == new else "new b" if new[0] else ("new c" if new[1] else ("lost b" if old[0] else "lost c"))
        tally[(what, d["kind"], r.get("change"))] += 1
        print(f"{name}: {what} (v1 b,c={old} -> v2 {new}); change {r.get('change')}; v2 reuse_failed "
              f"{v2.get('reuse_failed')} dense_failed {v2.get('dense_failed')} detail {v2.get('detail_failed')}; "
              f"prompt {d['prompt']!r}; candidate {d['candidate_prompt']!r}; measured {meas}")
    for k, v in sorted(tally.items()):
        print(k, v)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
