#!/usr/bin/env python
"""Build the embedded-world serving workload (warm set + disjoint stream) and print its repetition statistics.

    .host/venv/bin/python scripts/bench/workload.py --warm 24 --stream 24 --seed 0            # statistics + requests
    .host/venv/bin/python scripts/bench/workload.py --warm 24 --stream 24 --out artifacts/workload.jsonl

The workload is deterministic for a given set of flags (its digest is printed); how it is built and why it is
realistic: ``carnator_core/lab/workload.py`` and BENCHMARKS.md. The benchmark (scripts/bench/bench_table1.py) and the
demo (scripts/demo.py) build it with the same code and flags.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


sys.path.insert(0, str(ROOT / "tests"))
from repo_package import register_package  # noqa: E402  (re-exported for demo.py and the benchmarks)

register_package()

from carnator.carnator_core.lab.workload import Mix, WorkloadSpec, build_workload, describe  # noqa: E402


def add_workload_args(ap: argparse.ArgumentParser, warm: int = 24, stream: int = 24) -> None:
    """The workload flags shared by this script, bench_table1.py and demo.py."""
    g = ap.add_argument_group("workload")
    g.add_argument("--warm", type=int, default=warm, help="warm-set size (requests written to the cache first)")
    g.add_argument("--stream", type=int, default=stream, help="stream size (requests served and measured)")
    g.add_argument("--templates", type=int, default=0, help="scene templates (0 = max(4, (warm+stream)//3))")
    g.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of template popularity")
    g.add_argument("--p-two", type=float, default=0.3, help="probability that a template has two objects")
    g.add_argument("--mix", default="0.05,0.15,0.15,0.65",
                   help="kinds of repeat requests: exact,reroll,paraphrase,edit probabilities")
    g.add_argument("--workload-seed", type=int, default=0, help="seed of the workload generator")


def add_learning_run_args(ap: argparse.ArgumentParser, *, out: str, dense_every: int, dense_help: str) -> None:
    """The flags of an end-to-end learning-mode run over HTTP shared by bench_learn.py and bench_warmup.py: its
    resumable work folder, the embedded weights, the learning budget and audit share, and the dense twins."""
    weights = Path(__file__).resolve().parents[2] / "carnator_core" / "embedded" / "weights"
    ap.add_argument("--out", default=out, help="work folder (kept; the run resumes from it)")
    ap.add_argument("--weights", default=str(weights / "carnator_embedded_v3.safetensors"))
    ap.add_argument("--budget", type=float, default=0.2, help="learning budget (share of the compute served)")
    ap.add_argument("--audit", type=float, default=0.05, help="audit share of a learned rule's hits")
    ap.add_argument("--dense-every", type=int, default=dense_every, help=dense_help)


def spec_from_args(args: argparse.Namespace) -> WorkloadSpec:
    try:
        exact, reroll, para, edit = (float(x) for x in args.mix.split(","))
    except ValueError:
        raise SystemExit(f"--mix must be four comma-separated numbers exact,reroll,paraphrase,edit; got {args.mix!r}")
    return WorkloadSpec(n_warm=args.warm, n_stream=args.stream, n_templates=args.templates, zipf_s=args.zipf,
                        p_two=args.p_two, mix=Mix(exact, reroll, para, edit), seed=args.workload_seed).validate()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(ap)
    ap.add_argument("--out", type=Path, help="write the workload as JSONL (header line + one request per line)")
    ap.add_argument("--quiet", action="store_true", help="statistics only, no request list")
    args = ap.parse_args(argv)
    wl = build_workload(spec_from_args(args))
    print(json.dumps(describe(wl), indent=2))
    if not args.quiet:
        for r in wl.requests:
            src = f"<- {r.parent}" if r.parent else ""
            rep = f" (= {r.repeat_of})" if r.repeat_of else ""
            print(f"{r.rid} t{r.template:<3d} {r.kind:16s} {src:8s} seed={r.seed:<10d} {r.prompt}{rep}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(wl.to_jsonl(), encoding="utf-8")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
