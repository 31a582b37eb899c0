#!/usr/bin/env python
"""The floor of the excess label on the embedded model: a fresh dense sample at another seed, judged as a reuse.

    OMP_NUM_THREADS=1 .host/venv/bin/python scripts/lab/measure_label_floor.py --queries 300 --threads 1 \\
        --out artifacts/label_floor.jsonl --json artifacts/label_floor.json --png artifacts/label_floor_png

One process. Requests are drawn like the pairs workload (``lab.pairs.embedded_warm_set`` + ``embedded_queries``
with make_pairs' defaults: workload seed 0, 60 warm scenes, every query kind, one- and two-object scenes); for
each, the dense clip at its seed s and at another seed s' (``lab.floor.other_seed``) are generated with ComfyUI's
stock sampling path (``embedded.comfy_glue.generate``, what KSampler runs) and the s' clip is judged as if it were
the reuse output of the request, with the pairs labelling's own function (``lab.pairs.judge_against_dense``, the
request-level labeler with ``--artifact-ratio``) — and again with the artifact measure off. Summary per stratum
(all, 1obj, 2obj, and per request kind): n, b, c, b/n with its Clopper–Pearson upper bound, the exact excess upper
bound (``risk.bounds.excess_upper_bound``) at ``--delta``, for both labels (``lab.floor.summarize_floor``).

``--out`` grows one request at a time (a header line with the arguments, then one JSON row per request); re-run the
same command to resume, a different configuration with the same file is refused. ``--png DIR`` writes
dense | fresh | |diff| frame strips of every request where b or c is set (either label) to look at.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import conftest  # noqa: E402  (registers the `carnator` package; knows where the host's ComfyUI is)

RUN_KEYS = ("weights", "seed", "warm", "queries", "kinds", "p_same_seed", "artifact_ratio", "salt", "objects",
            "label_version")


def build_parser() -> argparse.ArgumentParser:
    from carnator.carnator_core.lab.pairs import QUERY_KINDS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", default="", help="embedded weights file (default: the shipped default version)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (warm set and queries; 0 as make_pairs)")
    p.add_argument("--warm", type=int, default=60, help="warm scenes the queries are derived from (60)")
    p.add_argument("--queries", type=int, default=300, help="requests (N; 2 dense clips each) (300)")
    p.add_argument("--kinds", default=",".join(QUERY_KINDS), help="query kinds, comma separated")
    p.add_argument("--p-same-seed", type=float, default=0.5, help="as make_pairs (0.5)")
    p.add_argument("--label-version", type=int, choices=(1, 2), default=1,
                   help="1 = the first excess label; 2 = the second (strict checker: shape and the motion track; the "
                   "detail check: blur, interiors, ghosts)")
    p.add_argument("--artifact-ratio", type=float, default=1.25,
                   help="a clip also fails when its background artifact score exceeds this multiple of the dense "
                   "clip's (1.25, the excess label's; 0 = checker only)")
    p.add_argument("--objects", type=int, choices=(0, 1, 2), default=0,
                   help="keep only the requests whose caption names this many objects (the first --queries of them "
                   "in the query stream; 0 = all). Two-object scenes are ~5 %% of the default workload: measure "
                   "that stratum at realistic n with --objects 2 and a larger --warm (more distinct sources)")
    p.add_argument("--salt", type=int, default=1, help="salt of the fresh seed s' = other_seed(s, salt) (1)")
    p.add_argument("--alpha", type=float, default=0.05)
    p.add_argument("--delta", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    p.add_argument("--out", type=Path, default=None, help="per-request rows (JSONL; resumable)")
    p.add_argument("--json", type=Path, default=None, help="write the summary here")
    p.add_argument("--png", type=Path, default=None, help="dense | fresh | |diff| strips where b or c is set")
    p.add_argument("--clips", type=Path, default=None,
                   help="also save every request's dense and fresh clips (uint8 .npz, one file per request) here, so "
                   "the floor can be judged again under another label without generating (--rejudge)")
    p.add_argument("--rejudge", action="store_true",
                   help="generate nothing: judge the clips saved in --clips again with the current label and write "
                   "--out / --json from them")
    return p


def requests(args: argparse.Namespace):
    from carnator.carnator_core.embedded import world
    from carnator.carnator_core.lab import pairs

    try:  # scenes in the clip geometry of the weights' version, as make_pairs.py draws them
        frame = pairs.embedded_frame(pairs.weights_version(args.weights or None))
    except ValueError as exc:
        raise SystemExit(f"--weights: {exc}") from None
    warm, scenes = pairs.embedded_warm_set(args.seed, args.warm, frame)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if not args.objects:
        return pairs.embedded_queries(args.seed, args.queries, warm, scenes, kinds=kinds,
                                      p_same_seed=args.p_same_seed, frame=frame)
    if not any(len(sc.objects) == args.objects for sc, _ in scenes.values()):
        raise SystemExit(f"no warm scene of --seed {args.seed} --warm {args.warm} has {args.objects} objects: "
                         "raise --warm")
    # The query stream is prefix-stable: a longer stream extends a shorter one, so the first --queries requests
    # with the wanted number of objects do not depend on how far the stream is drawn.
    m = args.queries
    while True:
        m *= 2
        qs = [q for q in pairs.embedded_queries(args.seed, m, warm, scenes, kinds=kinds, p_same_seed=args.p_same_seed,
                                                frame=frame)
              if len(world.parse_caption(q.prompt).objects) == args.objects]
        if len(qs) >= args.queries:
            return qs[:args.queries]


def open_rows(path: Path | None, run: dict) -> list[dict]:
    """Rows already measured under the same configuration; starts the file (header) when absent. A header without
    an option added since counts as written with that option's default."""
    if path is None:
        return []
    if path.exists() and path.stat().st_size:
        lines = path.read_text(encoding="utf-8").split("\n")
        head = json.loads(lines[0])
        defaults = {k: build_parser().get_default(k) for k in RUN_KEYS}
        if {**defaults, **head.get("run", {})} != run:
            raise SystemExit(f"{path} was written with {head.get('run')}, not {run}: use another --out")
        rows = []
        for line in filter(str.strip, lines[1:]):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # torn tail of an interrupted write: that request is redone
                break
        return rows
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"type": "header", "run": run}) + "\n", encoding="utf-8")
    return []


def write_png(path: Path, dense, fresh) -> None:
    import numpy as np
    from PIL import Image

    diff = np.repeat(np.abs(fresh - dense).max(-1, keepdims=True), 3, -1)
    img = np.concatenate([np.concatenate(list(x), 1) for x in (dense, fresh, np.clip(2 * diff, 0, 1))], 0)
    Image.fromarray((np.clip(img, 0, 1) * 255).astype(np.uint8)).save(path)


def save_clips(path: Path, dense, fresh, rec) -> None:
    """The request's two clips as uint8 (what a viewer sees; the label is re-judged on these)."""
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez_compressed(tmp, dense=(np.clip(dense, 0, 1) * 255 + 0.5).astype(np.uint8),
                        fresh=(np.clip(fresh, 0, 1) * 255 + 0.5).astype(np.uint8),
                        meta=np.asarray(json.dumps({"request_id": rec.request_id, "kind": rec.kind,
                                                    "prompt": rec.prompt, "seed": rec.seed,
                                                    "fresh_seed": rec.fresh_seed})))
    os.replace(tmp, path)


def rejudge(args: argparse.Namespace) -> list:
    """Floor records from the clips saved in ``args.clips`` under the current label (nothing is generated)."""
    import numpy as np

    from carnator.carnator_core.lab import floor, pairs
    from carnator.carnator_core.lab.metrics import background_mask

    labeler = pairs.embedded_checker_labeler("request", args.artifact_ratio or None,
                                             version=args.label_version)
    out = []
    for path in sorted(args.clips.glob("*.npz")):
        if path.name.endswith(".tmp.npz"):
            continue
        with np.load(path) as z:
            meta = json.loads(str(z["meta"]))
            dense, fresh = z["dense"].astype(np.float32) / 255.0, z["fresh"].astype(np.float32) / 255.0
        verdict = floor.judge_fresh(labeler, dense, fresh, meta["prompt"], _background(labeler, background_mask))
        out.append(floor.FloorRecord(meta["request_id"], meta["kind"], prompt=meta["prompt"], seed=meta["seed"],
                                     fresh_seed=meta["fresh_seed"], **verdict))
    return out


def _background(labeler: object, background_mask: Callable[..., object]) -> Callable[..., object]:
    """The artifact check's background as the labeler's checker reading segments it (``checker_version``)."""
    return functools.partial(background_mask, version=getattr(labeler, "checker_version", 1))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.rejudge:
        if args.clips is None or not args.clips.is_dir():
            raise SystemExit("--rejudge needs --clips DIR with the clips of an earlier run")
        from carnator.carnator_core.lab import floor

        records = rejudge(args)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text("".join(json.dumps(r.to_row()) + "\n" for r in records), encoding="utf-8")
        summary = floor.summarize_floor(records, args.alpha, args.delta, artifact_ratio=args.artifact_ratio or None)
        print_summary(summary)
        if args.json is not None:
            args.json.write_text(json.dumps({"rejudged": str(args.clips), "summary": summary}, indent=1))
        return 0
    conftest.ensure_comfy_importable()
    import torch

    torch.set_num_threads(max(1, args.threads))
    from carnator.carnator_core.embedded import comfy_glue
    from carnator.carnator_core.lab import floor, pairs
    from carnator.carnator_core.lab.metrics import background_mask

    run = {k: getattr(args, k) for k in RUN_KEYS}
    rows = open_rows(args.out, run)
    done = [floor.FloorRecord.from_row(r) for r in rows]
    model, _enc, _dec = comfy_glue.load_embedded(args.weights or None)
    labeler = pairs.embedded_checker_labeler("request", args.artifact_ratio or None,
                                             version=args.label_version)
    reqs = requests(args)
    if args.png is not None:
        args.png.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    count = {"n": len(done)}

    def gen(prompt: str, seed: int):
        return comfy_glue.generate([prompt], seed=seed, model=model).clips[0].numpy()

    def on_record(rec, dense, fresh) -> None:
        count["n"] += 1
        if args.clips is not None:
            save_clips(args.clips / f"{rec.request_id}.npz", dense, fresh, rec)
        if args.out is not None:
            with args.out.open("a", encoding="utf-8") as fh:
                fh.write(json.dumps(rec.to_row()) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
        flags = [n for n, v in (("b", rec.b), ("c", rec.c), ("b_chk", rec.b_checker), ("c_chk", rec.c_checker),
                                ("artifact", rec.artifact_failed)) if v]
        if args.png is not None and (rec.b or rec.c or rec.b_checker or rec.c_checker):
            write_png(args.png / f"{rec.request_id}_{rec.stratum.replace('/', '_')}.png", dense, fresh)
        el = time.perf_counter() - t0
        print(f"[{count['n']}/{len(reqs)} {el:.0f}s] {rec.request_id} {rec.stratum:18s} "
              f"dense_failed={list(rec.dense_failed)} fresh_failed={list(rec.fresh_failed)} "
              f"art={rec.artifact}/{rec.artifact_dense} {' '.join(flags)}", flush=True)

    new = floor.measure_floor(reqs, gen, labeler, _background(labeler, background_mask), salt=args.salt,
                              skip={r.request_id for r in done}, on_record=on_record)
    records = done + new
    summary = floor.summarize_floor(records, args.alpha, args.delta, artifact_ratio=args.artifact_ratio or None)
    print_summary(summary)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"run": run, "alpha": args.alpha, "delta": args.delta,
                                         "requests": len(records), "seconds_this_run": time.perf_counter() - t0,
                                         "summary": summary}, indent=1))
    return 0


def print_summary(summary: dict) -> None:
    for k, v in summary.items():
        f, ch = v["full"], v["checker"]
        print(f"{k:22s} n={v['n']:4d} | full b={f['b']:3d} c={f['c']:3d} b/n={f['b_rate']:.3f} "
              f"(U {f['b_upper']:.3f}) excess U={f['excess_upper']:.4f} {'OK' if f['certifies'] else 'FAILS'} "
              f"| checker b={ch['b']:3d} c={ch['c']:3d} b/n={ch['b_rate']:.3f} (U {ch['b_upper']:.3f}) "
              f"excess U={ch['excess_upper']:.4f} {'OK' if ch['certifies'] else 'FAILS'} "
              f"| art flagged {v['artifact_flagged']} (both-bg {v['artifact_flagged_both_bg']}), "
              f"b from art {v['b_from_artifact']}, "
              f"c lost {v['c_lost_to_artifact']}, ratio q50/90/99 {v['artifact_ratio_quantiles']} "
              f"(both-bg {v['artifact_ratio_both_quantiles']})")


if __name__ == "__main__":
    raise SystemExit(main())
