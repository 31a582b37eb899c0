#!/usr/bin/env python
"""Variants of one reuse setting on the Table-1 stream, side by side: what a hit costs and how close it stays to
the dense clip of the same request and seed.

    .host/venv/bin/python scripts/bench/bench_reuse_settings.py --setting refreshes --values 3,2,1 \
        --json artifacts/reuse_settings.json [--warm 24 --stream 24]

One process, one workload (scripts/bench/workload.py flags, as bench_table1.py), the shipped rule (``--rule``): the warm
set is served dense into one store, which then stays **frozen** (no variant writes to it), so every variant of a
request sees the same cache and — since the filter and the region do not depend on the reuse settings varied here —
the same decision and region. Per stream request (exact repeats left out: they never compute): the dense KSampler
run (timed, decoded), then each variant of the rule's reuse config with ``--setting`` replaced by one of
``--values`` (the order rotates per request), timed the way Table 1 times a request (text encoding + the whole
request path). Per hit: wall time / the dense run's, compute (counter-based), PSNR of the clip and of its
background against the dense clip, and the no-reference background artifact score beside the dense clip's
(``carnator_core.lab.metrics.clip_quality``).

The variants other than the rule's own setting are **not certified** (the rule's certificate covers its own reuse
settings only); this benchmark is how a candidate setting is measured before a certification attempt is
written (rules/README.md). Prints one line per request and a summary over the hits that compute something
(compute > the probe's share), writes ``--json``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

import bench_table1 as T  # noqa: E402  (registers the `carnator` package; the Table-1 environment and helpers)
from workload import add_workload_args, spec_from_args  # noqa: E402


def parse_values(setting: str, raw: str, current: Any) -> list[Any]:
    """``--values`` as the type of the rule's current value (bool, int, float or str)."""
    out: list[Any] = []
    for item in raw.split(","):
        item = item.strip()
        try:
            if isinstance(current, bool):
                out.append(item.lower() in ("1", "true", "yes", "on"))
            elif isinstance(current, int):
                out.append(int(item))
            elif isinstance(current, float):
                out.append(float(item))
            else:
                out.append(item)
        except ValueError:
            raise SystemExit(f"--values: {item!r} is not a {type(current).__name__} like {setting}'s current value "
                             f"{current!r}") from None
    if not out or len(set(map(repr, out))) != len(out):
        raise SystemExit(f"--values for {setting} must be distinct comma-separated values, got {raw!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(ap)
    ap.add_argument("--setting", default="refreshes", help="a field of the rule's reuse config (reuse.ReuseConfig)")
    ap.add_argument("--values", default="3,2,1", help="comma-separated values of --setting to compare")
    ap.add_argument("--rule", default=str(T.DEFAULT_RULE))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=ROOT / "artifacts" / "reuse_settings.json")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from carnator.carnator_core.lab import metrics as M
    from carnator.carnator_core.reuse import ReuseConfig

    if args.setting not in {f.name for f in dataclasses.fields(ReuseConfig)}:
        raise SystemExit(f"--setting {args.setting!r} is not a reuse setting (reuse.ReuseConfig fields)")
    wl = T.build_workload(spec_from_args(args))
    tmp = Path(tempfile.mkdtemp(prefix="carnator-reuse-settings-"))
    rows: list[dict[str, Any]] = []
    try:
        env, rule, status, warm = T.frozen_stream_setup(args, tmp, wl)
        base = dict(rule.reuse_config or {})
        current = base.get(args.setting, getattr(ReuseConfig(), args.setting))
        values = parse_values(args.setting, args.values, current)
        rules = {}
        for v in values:
            cfg = {**base, args.setting: v}
            if ReuseConfig.from_meta(cfg) is None:
                raise SystemExit(f"{args.setting}={v!r} is not a valid reuse setting (reuse.ReuseConfig.validate)")
            rules[repr(v)] = dataclasses.replace(rule, reuse_config=cfg)
        print(f"rule {status['summary']}; {args.setting}: rule {current!r}, variants {values}", flush=True)
        names = list(rules)
        for i, req in enumerate(wl.stream):
            if req.kind == "exact":
                continue
            samples, dense_s, _ = T.run_request(env, "dense", req, None, None)
            d_clip = env.dec.decode_clips(samples)[0].numpy()
            bg = M.background_mask(d_clip, req.scene)
            row: dict[str, Any] = {"rid": req.rid, "kind": req.kind, "dense_s": dense_s, "variants": {}}
            for name in names[i % len(names):] + names[:i % len(names)]:
                # Not the rule's certified settings (except the rule's own value): measured, never served.
                opts = dataclasses.replace(T.serve_options("carnator", rules[name], 0.0, env, False),
                                           allow_uncertified=True)
                s, sec, res = T.run_request(env, "carnator", req, warm, opts)
                clip = env.dec.decode_clips(s)[0].numpy()
                q = M.clip_quality(clip, d_clip, bg)
                row["variants"][name] = {"decision": res.report.decision, "seconds": sec,
                                         "vs_dense": sec / dense_s, "compute": res.report.compute_fraction,
                                         **{k: q[k] for k in ("psnr", "psnr_bg", "artifact", "artifact_dense")}}
            rows.append(row)
            print(json.dumps({"rid": row["rid"], "kind": row["kind"], **{
                n: (f"{v['decision']} {v['vs_dense']:.3f}x c={v['compute']:.2f} {v['psnr']:.1f}dB "
                    f"art={v['artifact']:.3f}/{v['artifact_dense']:.3f}") for n, v in row["variants"].items()}}),
                flush=True)
        warm.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    hits = [r for r in rows if all(v["decision"] == "hit" and v["compute"] > 0.2 + 1e-6
                                   for v in r["variants"].values())]
    summary = {}
    for n in names:
        vs = [r["variants"][n] for r in hits]
        if not vs:
            continue
        summary[n] = {"hits": len(vs),
                      "vs_dense_median": statistics.median(v["vs_dense"] for v in vs),
                      "compute_median": statistics.median(v["compute"] for v in vs),
                      "psnr_median": statistics.median(v["psnr"] for v in vs),
                      "psnr_min": min(v["psnr"] for v in vs),
                      "psnr_bg_median": statistics.median(v["psnr_bg"] for v in vs),
                      "artifact_median": statistics.median(v["artifact"] for v in vs),
                      "artifact_dense_median": statistics.median(v["artifact_dense"] for v in vs)}
        s = summary[n]
        print(f"{args.setting}={n}: {s['hits']} computing hits, wall {s['vs_dense_median']:.3f} of dense (median), "
              f"compute {s['compute_median']:.3f}, PSNR {s['psnr_median']:.1f} dB (min {s['psnr_min']:.1f}; "
              f"background {s['psnr_bg_median']:.1f}), artifact {s['artifact_median']:.3f} "
              f"(dense {s['artifact_dense_median']:.3f})")
    T.write_stream_report(args.json, wl, status, summary, rows, setting=args.setting,
                          values=[repr(v) for v in values])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
