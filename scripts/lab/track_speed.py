#!/usr/bin/env python
"""How far each moving object travels in the reuse clip against the dense clip, per stratum — a check of what the
second label does not judge (it reads each clip's track against the prompt: direction and still vs moving, not speed
against the dense clip).

    .host/venv/bin/python scripts/lab/track_speed.py --rule rules/embedded.json \\
        --pairs rules/attempt20_s87.jsonl=artifacts/a20/w87/clips … [--json artifacts/a20/track_speed.json]

For every pair the rule's thresholds accept (its chosen candidate per request, as certification counts them) the
strict checker reads both saved clips; for each named object that travels at least ``--moving`` pixels (net, first
to last frame) in the dense clip, the ratio reuse travel / dense travel; the pair's ratio is its slowest object's.
Printed per stratum: pairs, pairs with a moving object, the median ratio, and every pair below ``--slow`` with its
label. Nothing is generated; nothing here enters a label or a certificate.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

sys.path.insert(0, str(ROOT / "scripts" / "lab"))

import conftest  # noqa: E402,F401  (registers the `carnator` package)
from relabel_pairs import accepted_keys, pair_clips  # noqa: E402


def travel_ratio(dense: np.ndarray, reuse: np.ndarray, prompt: str, moving: float) -> float | None:
    """The slowest named object's reuse / dense net travel, over the objects moving ≥ ``moving`` px in the dense
    clip (None when none does)."""
    from carnator.carnator_core.embedded import checker

    a, b = checker.check(dense, prompt, strict=True), checker.check(reuse, prompt, strict=True)
    worst = None
    for oa, ob in zip(a.objects, b.objects):
        ta = float(np.hypot(*(oa.measured.get("track_travel_xy") or (0.0, 0.0))))
        tb = float(np.hypot(*(ob.measured.get("track_travel_xy") or (0.0, 0.0))))
        if ta >= moving:
            worst = tb / ta if worst is None else min(worst, tb / ta)
    return worst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rule", type=Path, required=True, help="its thresholds choose the pairs")
    ap.add_argument("--pairs", nargs="+", required=True, metavar="PAIRS=CLIPS",
                    help="a relabelled pairs file and its run's clips folder")
    ap.add_argument("--moving", type=float, default=5.0, help="px of net travel for 'moving' in the dense clip")
    ap.add_argument("--slow", type=float, default=0.6, help="list the pairs whose ratio is below this")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    per: dict = defaultdict(list)
    for spec in args.pairs:
        pairs_path, clips = (Path(x) for x in spec.split("=", 1))
        keep = accepted_keys(args.rule, pairs_path)
        for line in pairs_path.read_text(encoding="utf-8").splitlines():
            r = json.loads(line)
            if r.get("type") == "header" or (r["request_id"], r["entry_id"]) not in keep:
                continue
            d = r["diag"]
            rid = r["request_id"].split(":")[-1]
            dense, reuse = pair_clips(clips, r)
            ratio = travel_ratio(dense, reuse, d["prompt"], args.moving)
            per[r["change"]].append({"pair": f"{pairs_path.stem}:{rid}:{r['entry_id']}", "kind": d["kind"],
                                  "ratio": None if ratio is None else round(ratio, 3), "b": bool(r["unsafe"]),
                                  "c": bool(r.get("better", False))})
    out = {}
    print(f"| stratum | pairs | with a moving object | median reuse/dense travel | below {args.slow} (b?) |")
    print("|---|---|---|---|---|")
    for name in sorted(per):
        rs = [x["ratio"] for x in per[name] if x["ratio"] is not None]
        slow = [x for x in per[name] if x["ratio"] is not None and x["ratio"] < args.slow]
        out[name] = {"pairs": len(per[name]), "moving": len(rs), "median": float(np.median(rs)) if rs else None,
                     "slow": slow}
        med = f"{np.median(rs):.3f}" if rs else "—"
        listed = ", ".join(f"{x['pair']} {x['ratio']} ({'b' if x['b'] else 'c' if x['c'] else '0'})" for x in slow)
        print(f"| {name} | {len(per[name])} | {len(rs)} | {med} | {len(slow)}: {listed or '—'} |")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
