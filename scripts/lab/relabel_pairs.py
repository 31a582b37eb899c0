#!/usr/bin/env python
"""Label a pairs file again under the second label, from the clips its run saved (nothing is generated).

    .host/venv/bin/python scripts/lab/relabel_pairs.py --pairs artifacts/a19/pairs_s84.jsonl \\
        --clips artifacts/a19/w84/clips --out rules/attempt19_s84.jsonl [--cutoff-requests N]

``make_pairs.py --clips`` saves, per labelled request, the dense clip and every labelled candidate's reuse clip
(uint8). Here each pair is judged again with ``lab.pairs.judge_against_dense`` and the second label
(``embedded_checker_labeler("request", ratio, version=2)``, with the latest checker version), the dense clip and
the reuse clip both read from the saved uint8 arrays, so both sides are judged from the same quantisation. Per row:

* ``unsafe`` / ``better``: the second label's b / c; the first label's (as the run recorded it) is kept in
  ``diag.label_v1`` = {"unsafe", "better"} for the old-vs-new comparison;
* ``change``: the row's stratum, ``risk.strata.stratum_of(request prompt, candidate prompt, same_seed)``;
* ``diag``: the second label's ``reuse_failed`` / ``dense_failed`` / ``detail_failed`` / ``artifact_failed``.

Requests without a saved clips file (a run cut off, or one made without ``--clips``) are left out and counted. The
header's ``unsafe_definition`` becomes the second label's and ``relabelled_from`` names the source file (sha256).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import conftest  # noqa: E402,F401  (registers the `carnator` package)


def load_clips(path: Path) -> dict:
    import numpy as np

    with np.load(path) as z:
        return {k: (z[k].astype(np.float32) / 255.0) for k in z.files if k != "prompt"}


def pair_clips(clips_dir: Path, row: dict) -> tuple:
    """(dense clip, reuse clip) of one pairs row, float in [0, 1]: the request's saved ``<request>.npz`` (the run's
    own request id, without a combined file's run prefix) holds the dense clip and one clip per labelled entry."""
    import numpy as np

    with np.load(clips_dir / f"{row['request_id'].split(':')[-1]}.npz") as z:
        return (z["dense"].astype(np.float32) / 255.0, z[row["diag"]["store_entry"]].astype(np.float32) / 255.0)


def accepted_keys(rule_path: Path, pairs_path: Path) -> set:
    """(request id, entry id) of the pairs a rule's thresholds accept — its chosen candidate per request, as
    certification counts them (``risk.certify.accepted_pairs``)."""
    from carnator.carnator_core.risk.certify import accepted_pairs, read_pairs_jsonl
    from carnator.carnator_core.risk.rule import RiskRule

    rule = RiskRule.load(rule_path, allow_uncertified=True)
    return {(p.request_id, p.entry_id) for p in accepted_pairs(rule.thresholds, read_pairs_jsonl(pairs_path)[1])[1]}


def relabel(pairs_path: Path, clips_dir: Path, artifact_ratio: float = 1.25, cutoff: int = 0) -> tuple[dict, list,
                                                                                                        dict]:
    """(header, relabelled rows, counts) — see the module docstring. ``cutoff`` > 0 keeps the first ``cutoff``
    requests of the file (its query order)."""
    from carnator.carnator_core.lab import pairs
    from carnator.carnator_core.lab.metrics import background_mask
    from carnator.carnator_core.risk.strata import stratum_of

    header, rows = pairs.read_rows(pairs_path)
    if header is None:
        raise SystemExit(f"{pairs_path} has no header row")
    lab = pairs.embedded_checker_labeler("request", artifact_ratio or None, version=2)
    order: list[str] = []
    by_req: dict[str, list[dict]] = {}
    for r in rows:
        if r["request_id"] not in by_req:
            order.append(r["request_id"])
        by_req.setdefault(r["request_id"], []).append(r)
    if cutoff > 0:
        order = order[:cutoff]
    out, counts = [], {"requests": 0, "requests_without_clips": 0, "pairs": 0, "changed": 0}
    for rid in order:
        f = clips_dir / f"{rid}.npz"
        if not f.exists():
            counts["requests_without_clips"] += 1
            continue
        clips = load_clips(f)
        dense = clips["dense"]
        counts["requests"] += 1
        for r in by_req[rid]:
            d = r["diag"]
            prompt = d["prompt"]
            ref = lab.reference(dense, prompt)
            bg = background_mask(dense, prompt, version=lab.checker_version)
            unsafe, diag, _ = pairs.judge_against_dense(lab, ref, clips[d["store_entry"]], dense, prompt, bg)
            new = dict(r)
            new["diag"] = {**d, "label_v1": {"unsafe": bool(r["unsafe"]), "better": bool(r.get("better", False))},
                           "v2": {k: diag.get(k) for k in ("reuse_failed", "dense_failed", "detail_failed",
                                                           "artifact_failed", "artifact", "broken")}}
            new["unsafe"] = bool(unsafe)
            new["better"] = bool(diag.get("better", False))
            if not new["better"]:
                new.pop("better")
            new["change"] = stratum_of(prompt, d["candidate_prompt"], same_seed=d["seed"] == d["candidate_seed"])
            counts["pairs"] += 1
            counts["changed"] += (new["unsafe"], new.get("better", False)) != (bool(r["unsafe"]),
                                                                              bool(r.get("better", False)))
            out.append(new)
    head = {k: v for k, v in header.items() if k != "type"}
    head["unsafe_definition"] = lab.definition
    head["relabelled_from"] = {"file": pairs_path.name, "sha256": hashlib.sha256(pairs_path.read_bytes()).hexdigest(),
                               "unsafe_definition": header.get("unsafe_definition"), **counts}
    return head, out, counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=Path, required=True, help="pairs JSONL written by make_pairs.py --clips")
    p.add_argument("--clips", type=Path, required=True, help="the run's clips folder (<work>/clips)")
    p.add_argument("--out", type=Path, required=True, help="relabelled pairs JSONL")
    p.add_argument("--artifact-ratio", type=float, default=1.25, help="background artifact ratio (1.25)")
    p.add_argument("--cutoff-requests", type=int, default=0, help="keep the first N requests (0 = all)")
    args = p.parse_args(argv)
    head, rows, counts = relabel(args.pairs, args.clips, args.artifact_ratio, args.cutoff_requests)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        fh.write(json.dumps({"type": "header", **head}, sort_keys=True) + "\n")
        for r in rows:
            fh.write(json.dumps(r, sort_keys=True) + "\n")
    tmp.replace(args.out)
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
