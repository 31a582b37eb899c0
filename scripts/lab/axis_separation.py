#!/usr/bin/env python
"""Do the signature's axes separate safe from unsafe reuses where the reuse region cannot repair a wrong candidate?

    nice -n 19 .host/venv/bin/python scripts/lab/axis_separation.py --out artifacts/axes/pairs.jsonl \\
        --work artifacts/axes/work [--seed 53] [--per-kind 10] [--rule rules/embedded.json] [--limit-s 2400]
    .host/venv/bin/python scripts/lab/axis_separation.py --out artifacts/axes/pairs.jsonl --report \\
        [--json artifacts/axes/summary.json]
    .host/venv/bin/python scripts/lab/axis_separation.py --out artifacts/axes/pairs.jsonl --png artifacts/axes/png \\
        PAIR_ID [PAIR_ID ...]      # rows: the candidate's cached clip, dense, reuse, |reuse - dense| x2

The pairs (``carnator_core/lab/hard_pairs.py``): hard kinds designed from how ``reuse.active_region`` is computed
(motion reversed or started in place, a big object moved onto its own old support, touching objects, big objects,
the nearest colour, the nearest background) and ordinary controls; each a candidate (cached) request and a target
request with the candidate's seed. Per pair, on the embedded model with the shipped rule's config and reuse
settings (``--rule``; its thresholds and strata are not used to decide anything): the candidate is generated
densely into a fresh cache of its own (``lab.pairs.warm_entry``), the target is served against it and its reuse
from the candidate forced (``lab.pairs.label_request``, as the calibration pairs are made: probe, signature, the
four discrepancies, dense clip of the same request, reuse clip), and both clips are labelled with the second
excess label (``lab.pairs.embedded_checker_labeler(version=2)``: b = the reuse fails where the dense clip passes,
c = the reverse). One JSONL row per pair (the pairs format of docs/CALIBRATION.md plus ``design``), appended as it
finishes: re-run the command to resume. The clips go to ``--work/clips/<pair>.npz`` (uint8) for ``--png``.

``--report`` prints per kind the pairs, how many the sampler reused (a region over ``max_active`` continues dense:
a miss, never unsafe), b and c, and per axis the AUC of its value for b against the other reused pairs, the
one-sided Mann-Whitney p, and what a threshold at the shipped rule's value rejects; pooled over the hard kinds and
over all kinds with the pre-registered criterion (``hard_pairs.separation``; protocol: rules/protocols/axes.md).
Offline tooling: imports ComfyUI.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import conftest  # noqa: E402  (registers the `carnator` package; knows where the host's ComfyUI is)

AXES = ("context", "size", "shape", "appearance")
AXES_AND_SIM = AXES + ("dissimilarity",)


def _rule(path: Path) -> tuple[dict, dict]:
    """(thresholds, reuse settings) recorded in a rule file (read as JSON: nothing here needs its certificate)."""
    rule = json.loads(path.read_text(encoding="utf-8"))
    return dict(rule["thresholds"]), dict(rule.get("reuse") or {})


def planned(seed: int, per_kind: int, kinds: list[str]):
    """The run's pairs, interleaved over the kinds (index 0 of every kind first), so a cut run stays balanced."""
    from carnator.carnator_core.lab import hard_pairs, pairs

    frame = pairs.embedded_frame()
    return [hard_pairs.design_pair(seed, k, i, frame) for i in range(per_kind) for k in kinds]


def run(args: argparse.Namespace) -> int:
    conftest.ensure_comfy_importable()
    import torch

    torch.set_num_threads(max(1, args.threads))
    from dataclasses import replace

    from make_pairs import save_clips

    from carnator.carnator_core.cache.store import Store
    from carnator.carnator_core.lab import pairs
    from carnator.carnator_core.reuse import ReuseConfig

    thresholds, reuse_meta = _rule(args.rule)
    reuse = ReuseConfig.from_meta(reuse_meta)
    if reuse is None:
        raise SystemExit(f"{args.rule}: its reuse settings {reuse_meta} cannot be built by this version")
    kinds = [k for k in args.kinds.split(",") if k]
    plan = planned(args.seed, args.per_kind, kinds)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    (work / "clips").mkdir(parents=True, exist_ok=True)
    header, rows = pairs.read_rows(out)
    done = {r["design"]["pair_id"] for r in rows}
    labeler = pairs.embedded_checker_labeler("request", 1.25, version=2)
    ctx = None
    t_start = time.time()
    for dp in plan:
        if dp.pair_id in done:
            continue
        if args.limit_s and time.time() - t_start > args.limit_s:
            print("time limit reached; re-run to resume", flush=True)
            return 3
        folder = work / "stores" / dp.pair_id.replace(":", "_")
        shutil.rmtree(folder, ignore_errors=True)  # a pair interrupted half-way: its own cache, started afresh
        store = Store.open(folder, key_path=work / "stores" / f"{folder.name}.key", durable=False)
        try:
            if ctx is None:
                ctx = pairs.embedded_context(store, None, top_k=1, reuse=reuse)
            ctx = replace(ctx, store=store)
            t0 = time.perf_counter()
            cand = pairs.PairRequest("c", dp.candidate_prompt, dp.seed, "warm", "")
            entry_id, _ = pairs.warm_entry(ctx, cand)
            target = pairs.PairRequest(dp.pair_id, dp.target_prompt, dp.seed, dp.kind, "c")
            clips: dict = {}
            res = pairs.label_request(ctx, target, labeler, clips=clips)
            if len(res.candidates) != 1 or res.candidates[0].entry_id != entry_id:
                raise RuntimeError(f"{dp.pair_id}: the candidate was not recalled ({res.candidates})")
            save_clips(work / "clips" / f"{dp.pair_id.replace(':', '_')}.npz",
                       {"dense": clips["dense"], "reuse": clips[entry_id]}, dp.target_prompt)
            if header is None:
                header = pairs.header_for(
                    res.result.probe, dataset="designed hard and control pairs (carnator_core/lab/hard_pairs.py)",
                    seeds={"design": args.seed}, unsafe_definition=labeler.definition,
                    generator="scripts/lab/axis_separation.py " + " ".join(sys.argv[1:]),
                    extra={"reuse_config": ctx.options.hit_reuse.to_meta(), "rule_thresholds": thresholds})
                pairs.write_header(out, header)
            row = pairs.outcome_rows(res, {entry_id: "c"})[0]
            row["design"] = {"pair_id": dp.pair_id, "kind": dp.kind, "hard": dp.hard,
                             "seconds": round(time.perf_counter() - t0, 2),
                             "rule_rejects": [a for a in AXES if float(row[a]) > float(thresholds[a])]}
            pairs.append_rows(out, [row])
            d = row["diag"]
            print(f"{dp.pair_id:<22} {'U' if row['unsafe'] else ('c' if row.get('better') else '.')} "
                  f"reused={d['reused']} active={d['active_fraction']:.2f} "
                  + " ".join(f"{a}={float(row[a]):.3f}" for a in AXES)
                  + f" {row['design']['seconds']:.1f} s", flush=True)
        finally:
            store.close()
            shutil.rmtree(folder, ignore_errors=True)  # the pair's own cache and key, written by this loop
            (work / "stores" / f"{folder.name}.key").unlink(missing_ok=True)
    return 0


def report(args: argparse.Namespace) -> int:
    from carnator.carnator_core.lab import hard_pairs, pairs

    header, rows = pairs.read_rows(args.out)
    if header is None:
        raise SystemExit(f"{args.out}: no pairs yet")
    thresholds = header["rule_thresholds"]
    # The rule's minimum prompt similarity as one more "axis": 1 - similarity above 1 - minimum is a reject.
    limits = {**{a: thresholds[a] for a in AXES}, "dissimilarity": 1.0 - float(thresholds["min_similarity"])}
    def flat(r: dict) -> dict:
        return {**{a: float(r[a]) for a in AXES}, "unsafe": bool(r["unsafe"]), "better": bool(r.get("better")),
                "reusable": bool(r.get("reusable", True)), "dissimilarity": 1.0 - float(r["similarity"])}

    groups = {k: [r for r in rows if r["design"]["kind"] == k] for k in hard_pairs.KINDS}
    groups = {k: v for k, v in groups.items() if v}
    groups["HARD (pooled)"] = [r for r in rows if r["design"]["hard"]]
    groups["CONTROLS (pooled)"] = [r for r in rows if not r["design"]["hard"]]
    groups["ALL"] = rows
    summary = {}
    for k, rs in groups.items():
        s = hard_pairs.separation([flat(r) for r in rs], limits, AXES_AND_SIM)
        s["dense_failed"] = sum(bool(r["diag"].get("dense_failed")) for r in rs)
        s["missing_object"] = sum(bool(r.get("missing")) for r in rs)
        act = sorted(float(r["diag"]["active_fraction"]) for r in rs)
        s["active_median"] = round(act[len(act) // 2], 3) if act else None
        summary[k] = s
    print(f"{'kind':<18} pairs reused  b  c dense_fail missing active | " + " | ".join(
        f"{a}: AUC p rej(b/safe)" for a in AXES_AND_SIM))
    for k, s in summary.items():
        cells = []
        for a in AXES_AND_SIM:
            x = s["axes"][a]
            cells.append(f"{a[:4]} {x['auc'] if x['auc'] is not None else '-'} {x['p'] if x['p'] is not None else '-'}"
                         f" {x['rejects_b']}/{x['rejects_safe']}{' *' if x['separates'] else ''}")
        print(f"{k:<18} {s['pairs']:>5} {s['reused']:>6} {s['b']:>2} {s['c']:>2} {s['dense_failed']:>10} "
              f"{s['missing_object']:>7} {s['active_median']} | " + " | ".join(cells))
    if args.json:
        Path(args.json).write_text(json.dumps({"thresholds": thresholds, "per_kind": summary}, indent=1) + "\n",
                                   encoding="utf-8")
    return 0


def _candidate_clip(ctx_holder: dict, prompt: str, seed: int, folder: Path):
    """The candidate's cached clip, generated again (dense generation is deterministic given prompt and seed): what
    the reuse started from. One throw-away cache under ``folder``."""
    from dataclasses import replace

    from carnator.carnator_core.cache.store import Store
    from carnator.carnator_core.lab import pairs

    shutil.rmtree(folder, ignore_errors=True)
    store = Store.open(folder / "store", key_path=folder / "index.key", durable=False)
    try:
        if "ctx" not in ctx_holder:
            from carnator.carnator_core.reuse import ReuseConfig

            ctx_holder["ctx"] = pairs.embedded_context(store, None, top_k=1,
                                                       reuse=ReuseConfig.from_meta(ctx_holder["reuse"]))
        ctx = replace(ctx_holder["ctx"], store=store)
        _entry, res = pairs.warm_entry(ctx, pairs.PairRequest("c", prompt, seed))
        return ctx.decode(res.latent["samples"])
    finally:
        store.close()
        shutil.rmtree(folder, ignore_errors=True)


def png(args: argparse.Namespace) -> int:
    """Frames of the named pairs: the candidate's cached clip (generated again) on top, then the dense clip of the
    request, the reuse clip, and |reuse - dense| x2 at the bottom."""
    conftest.ensure_comfy_importable()
    import numpy as np
    from look_label_disagreements import strip
    from PIL import Image

    from carnator.carnator_core.lab import pairs

    header, rows = pairs.read_rows(args.out)
    by_id = {r["design"]["pair_id"]: r for r in rows}
    Path(args.png).mkdir(parents=True, exist_ok=True)
    holder: dict = {"reuse": header["reuse_config"]}
    for pid in args.pair_ids:
        r = by_id[pid]
        name = pid.replace(":", "_")
        with np.load(Path(args.work) / "clips" / f"{name}.npz") as z:
            dense, reuse = (z[k].astype(np.float32) / 255.0 for k in ("dense", "reuse"))
        d = r["diag"]
        cached = np.clip(_candidate_clip(holder, d["candidate_prompt"], int(d["candidate_seed"]),
                                         Path(args.work) / "png_store"), 0, 1)
        label = "b" if r["unsafe"] else ("c" if r.get("better") else "ok")
        img = np.concatenate([np.kron(np.concatenate(list(cached), 1), np.ones((3, 3, 1))), strip(dense, reuse)], 0)
        Image.fromarray((img * 255 + 0.5).astype(np.uint8)).save(Path(args.png) / f"{name}_{label}.png")
        print(f"{pid} {label}: target {d['prompt']!r}; candidate {d['candidate_prompt']!r}; reuse_failed "
              f"{d.get('reuse_failed')} dense_failed {d.get('dense_failed')} detail {d.get('detail_failed')}; "
              f"active {d['active_fraction']}; " + " ".join(f"{a}={float(r[a]):.3f}" for a in AXES))
    return 0


def main(argv: list[str] | None = None) -> int:
    from carnator.carnator_core.lab.hard_pairs import KINDS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="pairs JSONL (appended one pair at a time)")
    ap.add_argument("--work", type=Path, default=Path("artifacts/axes/work"), help="per-pair caches and clips")
    ap.add_argument("--seed", type=int, default=53, help="design seed (53)")
    ap.add_argument("--per-kind", type=int, default=10, help="pairs per kind (10)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="kinds, comma separated (all)")
    ap.add_argument("--rule", type=Path, default=ROOT / "rules" / "embedded.json",
                    help="the rule whose reuse settings the reuses run with and whose thresholds are reported")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--limit-s", type=float, default=0.0, help="stop starting pairs after this many seconds")
    ap.add_argument("--report", action="store_true", help="report the pairs written so far (generates nothing)")
    ap.add_argument("--json", type=Path, default=None, help="with --report: write the summary here")
    ap.add_argument("--png", type=Path, default=None, help="write frames of the named pairs here")
    ap.add_argument("pair_ids", nargs="*", help="with --png: pair ids (e.g. motion_reverse:03)")
    args = ap.parse_args(argv)
    if args.report:
        return report(args)
    if args.png:
        return png(args)
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
