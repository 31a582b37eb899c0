"""Generate labelled (request, candidate) pairs on the embedded model, for calibrating and certifying a risk rule.

Usage (from the repository root, host python)::

    .host/venv/bin/python scripts/lab/make_pairs.py --out rules/embedded_pairs.jsonl --work /tmp/carnator-pairs \\
        [--weights PATH] [--seed 0] [--warm 60] [--queries 300] [--top-k 3] [--workers 4] [--threads 1] \\
        [--kinds repeat,reseed,...] [--labeler checker|psnr|ssim] [--tolerance 25]

then::

    .host/venv/bin/python -m carnator_core.lab.calibrate_cli --pairs rules/embedded_pairs.jsonl \\
        --out rules/embedded.json

What it does (core logic: carnator_core/lab/pairs.py; procedure: docs/CALIBRATION.md §3):

1. **Warm set.** ``--warm`` requests sampled from the embedded world (held-in combinations, 1–2 objects,
   seeded by ``--seed``) are generated densely and written to a fresh cache under ``--work/store`` (the
   Cache Writer path, ``request.serve(method="dense")``).
2. **Queries.** ``--queries`` requests, each derived from a random warm request by one kind of change (exact
   repeat, new seed, paraphrase, colour / size / position / motion / background change, different object;
   ``--kinds``). For each: probe + signature + top-K recall + dense resume (``serve(method="never")``), then
   for every recalled candidate the discrepancies and the joint-reuse output with that candidate forced as
   accepted (``reuse.sample``), labelled by ``--labeler``:
   ``checker`` (default) = unsafe when the reuse output fails the embedded pixel checker on an attribute where
   the dense output passes; ``psnr`` / ``ssim`` = unsafe when the decoded reuse output is below ``--tolerance``
   (dB / SSIM) against the dense output — the mode for models without a checker.
3. **Output.** The pairs JSONL (header with model/config fingerprints, config, dataset, seeds, unsafe
   definition, this command; one row per pair with a ``diag`` object of diagnostics).

Resumable: work happens in ``--work`` (cache, per-worker part files that grow one request at a time). Re-run
the same command after an interruption and it continues where it stopped; a different configuration in the
same work directory is refused. ``--workers N`` runs N processes (each with ``--threads`` torch threads) over
disjoint slices of the requests; the result does not depend on N except for last-bit float differences.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import conftest  # noqa: E402  (registers the `carnator` package; knows where the host's ComfyUI is)

RUN_KEYS = ("weights", "seed", "warm", "queries", "top_k", "kinds", "labeler", "tolerance", "reuse_mode",
            "p_same_seed", "label_missing", "label", "artifact_ratio", "easycache")


def build_parser() -> argparse.ArgumentParser:
    from carnator.carnator_core.lab.pairs import QUERY_KINDS

    p = argparse.ArgumentParser(description="Labelled pairs on the embedded model (docs/CALIBRATION.md).")
    p.add_argument("--out", required=True, help="pairs JSONL file to write")
    p.add_argument("--work", default="", help="work directory (cache + progress); reuse it to resume (required "
                   "unless --combine)")
    p.add_argument("--combine", nargs="+", default=None, metavar="FILE=PREFIX[:SPLIT]",
                   help="instead of generating: combine pairs files of the same model/config into --out, prefixing "
                   "their request/entry ids (e.g. a.jsonl=s0 b.jsonl=s11); with :calib / :cert on every item the "
                   "calibration/certification split is fixed per file (e.g. certify on a run with its own warm set)")
    p.add_argument("--calib-reuse-may-differ", action="store_true",
                   help="with --combine and a split on every file: the :calib files may have been labelled with "
                   "other reuse settings than the :cert files (the rule records the :cert files' settings; each "
                   "calibration file's own are listed in the header)")
    p.add_argument("--calib-config-may-differ", action="store_true",
                   help="with --combine and a split on every file: the :calib files may have been labelled with "
                   "another generation config of the same model (e.g. another probe length); the rule applies to "
                   "the :cert files' config, each calibration file's own is listed in the header")
    p.add_argument("--weights", default="", help="embedded weights file (default: the shipped one)")
    p.add_argument("--seed", type=int, default=0, help="seed of the warm set and the queries (0)")
    p.add_argument("--warm", type=int, default=60, help="warm (cached) requests (60)")
    p.add_argument("--queries", type=int, default=300, help="query requests (300)")
    p.add_argument("--top-k", type=int, default=3, help="candidates recalled and labelled per query (3)")
    p.add_argument("--kinds", default=",".join(QUERY_KINDS), help="query kinds, comma separated")
    p.add_argument("--p-same-seed", type=float, default=0.5,
                   help="probability that an edited query keeps its source's seed (0.5)")
    p.add_argument("--labeler", choices=("checker", "psnr", "ssim"), default="checker",
                   help="definition of unsafe: the embedded checker (default) or a tolerance vs dense")
    p.add_argument("--label", choices=("attribute", "request"), default="attribute",
                   help="with --labeler checker: 'attribute' = unsafe when an attribute dense passes fails on the "
                   "reuse (the first label); 'request' = the excess label: unsafe (b) = the reuse clip fails where "
                   "the dense clip passes, better (c) = the reverse (docs/CALIBRATION.md)")
    p.add_argument("--artifact-ratio", type=float, default=1.25,
                   help="with --label request: a reuse clip also fails when its background artifact score exceeds "
                   "this multiple of the dense clip's (1.25; 0 = checker only)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="tolerance of --labeler psnr (dB, default 25) or ssim (default 0.9)")
    p.add_argument("--reuse-mode", choices=("joint", "latent", "attention"), default="joint",
                   help="sampler mode the rule is for (joint)")
    p.add_argument("--reuse-set", action="append", default=[], metavar="FIELD=VALUE",
                   help="a ReuseConfig field every labelled hit runs with (repeatable), e.g. probe_context=1 (the "
                        "probe then keeps its keys/values); recorded in the part headers and the rule")
    p.add_argument("--easycache", default="", metavar="THRESHOLD,START,END",
                   help="label on the model patched by ComfyUI's EasyCache node with these settings (e.g. "
                        "0.2,0.15,0.95, its defaults): warm entries, dense references and reuses all run under "
                        "EasyCache, so the rule made from the pairs certifies Carnator + EasyCache against "
                        "EasyCache alone (its model fingerprint covers the patch); default: no EasyCache")
    p.add_argument("--label-missing", choices=("top", "all"), default="top",
                   help="reuse-label candidates with a named object on one side only: 'top' = only when most "
                   "similar (all that calibration and the prompt-only baseline use; default), 'all' = always")
    p.add_argument("--clips", action="store_true",
                   help="also save each labelled request's dense clip and every labelled candidate's reuse clip "
                   "(uint8, --work/clips/<request>.npz), so the pairs can be labelled again under another label "
                   "without generating (scripts/lab/relabel_pairs.py)")
    p.add_argument("--workers", type=int, default=1, help="worker processes (1)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per worker (1: on a shared machine more threads per process oversubscribe)")
    p.add_argument("--evaluate", default="",
                   help="a rule file: after writing the pairs, report its unsafe rate among accepted on them and "
                   "prompt-only's (a fresh-stream check of a shipped rule; use another --seed than its calibration)")
    p.add_argument("--limit-s", type=float, default=0.0,
                   help="stop starting new queries after this many seconds (0 = no limit); re-run to resume")
    p.add_argument("--merge-only", action="store_true",
                   help="label nothing: write --out from the requests this --work has labelled so far (a prefix "
                        "of the planned query stream for one worker; the header records labelled vs planned)")
    return p


def _labeler(args: dict):
    from carnator.carnator_core.lab import pairs

    if args["labeler"] == "checker":
        return pairs.embedded_checker_labeler(args.get("label", "attribute"), args.get("artifact_ratio") or None)
    tol = args["tolerance"]
    if tol is None:
        tol = 25.0 if args["labeler"] == "psnr" else 0.9
    return pairs.ToleranceLabeler(args["labeler"], float(tol))


def _requests(args: dict):
    """The warm set and queries of this run, drawn in the clip geometry of the weights' version."""
    from carnator.carnator_core.lab import pairs

    try:
        frame = pairs.embedded_frame(pairs.weights_version(args["weights"]))
    except ValueError as exc:
        raise SystemExit(f"--weights: {exc}") from None
    warm, scenes = pairs.embedded_warm_set(args["seed"], args["warm"], frame)
    queries = pairs.embedded_queries(args["seed"], args["queries"], warm, scenes,
                                     kinds=tuple(k for k in args["kinds"].split(",") if k),
                                     p_same_seed=args["p_same_seed"], frame=frame)
    return warm, queries


def reuse_config(items: list[str]):
    """``--reuse-set FIELD=VALUE`` items -> a validated ``ReuseConfig`` (exits with a clear error otherwise)."""
    from carnator.carnator_core.lab.pairs import reuse_config_from

    try:
        return reuse_config_from(items)
    except ValueError as exc:
        raise SystemExit(f"--reuse-set {exc}") from None


def easycache_settings(text: str):
    """``--easycache THRESHOLD,START,END`` -> checked settings or None (exits with a clear error otherwise)."""
    from carnator.carnator_core.lab.pairs import parse_easycache

    try:
        return parse_easycache(text)
    except ValueError as exc:
        raise SystemExit(f"--easycache: {exc}") from None


def _open(args: dict, threads: int):
    conftest.ensure_comfy_importable()
    import torch

    torch.set_num_threads(max(1, threads))
    from carnator.carnator_core.cache.store import Store
    from carnator.carnator_core.lab import pairs

    work = Path(args["work"])
    store = Store.open(work / "store", key_path=work / "index.key", durable=False)
    ctx = pairs.embedded_context(store, args["weights"] or None, top_k=args["top_k"], reuse_mode=args["reuse_mode"],
                                 reuse=reuse_config(args.get("reuse_set") or []),
                                 easycache=easycache_settings(args.get("easycache") or ""))
    return store, ctx


def _warm_manifest(work: Path) -> dict[str, str]:
    names: dict[str, str] = {}
    for f in sorted(work.glob("warm-*.jsonl")):
        for line in f.read_text(encoding="utf-8").split("\n"):
            if line.strip():
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue  # torn tail of an interrupted write: that request is redone
                names[r["request_id"]] = r["entry_id"]
    return names


def worker(args: dict, shard: int, n_shards: int, phase: str, threads: int) -> None:
    """One worker: its slice (index % n_shards == shard) of the warm set or of the queries."""
    from carnator.carnator_core.lab import pairs
    from carnator.carnator_core.risk.filter import probe_fingerprints  # what header_for writes and rules check

    work = Path(args["work"])
    warm, queries = _requests(args)
    store, ctx = _open(args, threads)
    t_start = time.time()
    try:
        if phase == "warm":
            done = _warm_manifest(work)
            path = work / f"warm-{shard}.jsonl"
            mine = [r for i, r in enumerate(warm) if i % n_shards == shard and r.request_id not in done]
            for req in mine:
                t0 = time.perf_counter()
                entry_id, _res = pairs.warm_entry(ctx, req)
                pairs.append_rows(path, [{"request_id": req.request_id, "entry_id": entry_id}])
                print(f"[w{shard}] warm {req.request_id} -> {entry_id} ({time.perf_counter() - t0:.1f} s)", flush=True)
            return
        names = {v: k for k, v in _warm_manifest(work).items()}  # store entry id -> warm request id
        if len(names) != len(warm):
            raise RuntimeError(f"the warm set is incomplete ({len(names)} of {len(warm)} entries); run the warm "
                               "phase first (re-run the command)")
        labeler = _labeler(args)
        reuse_meta = ctx.options.hit_reuse.to_meta()  # exactly what pairs.label_request runs
        path = work / f"part-{shard}.jsonl"
        header, _rows = pairs.read_rows(path)
        # Done = in any part file, so a resumed run may use another --workers than the interrupted one.
        done = set().union(*(pairs.done_requests(pairs.read_rows(f)[1]) for f in work.glob("part-*.jsonl")))
        mine = [r for i, r in enumerate(queries) if i % n_shards == shard and r.request_id not in done]
        for req in mine:
            if args["limit_s"] and time.time() - t_start > args["limit_s"]:
                print(f"[q{shard}] time limit reached; re-run to resume", flush=True)
                return
            clips: dict | None = {} if args.get("clips") else None
            out = pairs.label_request(ctx, req, labeler, missing=args["label_missing"], clips=clips)
            if clips:
                save_clips(work / "clips" / f"{req.request_id}.npz", clips, req.prompt)
            probe = out.result.probe
            if header is None:
                header = pairs.header_for(probe, dataset="", seeds=[], unsafe_definition=labeler.definition,
                                          generator="")
                header["reuse_config"] = reuse_meta  # the settings every hit of this file ran with
                pairs.write_header(path, header)
            elif (header["model_fingerprint"], header["config_fingerprint"]) != probe_fingerprints(probe):
                raise RuntimeError(f"{path} was started with another model or config (header "
                                   f"{header['model_fingerprint']}/{header['config_fingerprint']}); use a new --work")
            elif header.get("reuse_config") != reuse_meta:
                raise RuntimeError(f"{path} was started with other reuse settings ({header.get('reuse_config')}; "
                                   f"now {reuse_meta}): its pairs would mix two reuse paths; use a new --work")
            rows = pairs.outcome_rows(out, names)
            pairs.append_rows(path, rows)
            flags = "".join("U" if r["unsafe"] else ("m" if r["missing"] else ".") for r in rows)
            print(f"[q{shard}] {req.request_id} {req.kind:>10} {flags:<4} {out.seconds:5.1f} s", flush=True)
    finally:
        store.close()


def save_clips(path: Path, clips: dict, prompt: str) -> None:
    """A request's clips as uint8 arrays keyed "dense" and by store entry id (written atomically: a torn file
    never looks complete)."""
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {k: (np.clip(np.asarray(v, dtype=np.float32), 0, 1) * 255 + 0.5).astype(np.uint8)
              for k, v in clips.items()}
    tmp = path.with_name(path.stem + ".tmp.npz")
    np.savez_compressed(tmp, prompt=np.asarray(prompt), **arrays)
    tmp.replace(path)


def _run_phase(args: dict, phase: str, n: int, threads: int) -> None:
    if n == 1:
        worker(args, 0, 1, phase, threads)
        return
    ctxmp = mp.get_context("spawn")
    procs = [ctxmp.Process(target=worker, args=(args, i, n, phase, threads)) for i in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    bad = [i for i, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise SystemExit(f"worker(s) {bad} of the {phase} phase failed; see their output above. Re-run to resume.")


def merge(args: dict, command: str) -> tuple[int, int, int]:
    """Merge the part files into --out (queries in order). Returns (requests, pairs, unsafe pairs)."""
    from carnator.carnator_core.embedded import config as ecfg
    from carnator.carnator_core.lab import pairs
    from carnator.carnator_core.request import DEFAULT_MIN_SIMILARITY

    work = Path(args["work"])
    _warm, queries = _requests(args)
    header = None
    by_req: dict[str, list[dict]] = {}
    for f in sorted(work.glob("part-*.jsonl")):
        h, rows = pairs.read_rows(f)
        if h is None:
            continue
        h = {k: v for k, v in h.items() if k != "type"}
        key = (h["model_fingerprint"], h["config_fingerprint"])
        if header is not None and key != (header["model_fingerprint"], header["config_fingerprint"]):
            raise SystemExit(f"{f} was made with another model/config than the other part files")
        if header is not None and h.get("reuse_config") != header.get("reuse_config"):
            raise SystemExit(f"{f} was labelled with other reuse settings than the other part files")
        header = header or h
        seen_here: dict[str, list[dict]] = {}
        for r in rows:
            seen_here.setdefault(r["request_id"], []).append(r)
        for rid, rs in seen_here.items():
            by_req.setdefault(rid, rs)  # a request is taken from one part file only
    if header is None:
        raise SystemExit("no labelled requests yet")
    kinds = sorted({q.kind for q in queries})
    cfg = ecfg.version(pairs.weights_version(args["weights"] or None)).cfg
    gen = header.get("config") or {}  # what the part files were labelled with, probe included
    labelled = ("all labelled" if args["label_missing"] == "all" else
                "all labelled except those with a named object on one side only that are not the most similar "
                "(never accepted by a signature rule, never considered by prompt-only; left out)")
    header.update({
        "dataset": (f"embedded world (carnator_core/embedded/world.py), held-in combinations: {args['warm']} warm "
                    f"cache entries and {args['queries']} query requests, each derived from a random warm request "
                    f"by one change of kind {kinds} (edits keep the source seed with p={args['p_same_seed']}); "
                    f"top-{args['top_k']} recalled candidates per query, {labelled}; reuse mode "
                    f"{args['reuse_mode']}; the weights' stock config ({gen.get('steps')} {gen.get('sampler')} "
                    f"steps, {gen.get('scheduler')}, CFG {cfg:g}, probe {gen.get('probe_steps')} steps)"),
        "seeds": {"world": args["seed"], "warm_rng": [args["seed"], 0], "query_rng": [args["seed"], 1]},
        "generator": command,
        "top_k": args["top_k"],
        "min_similarity": DEFAULT_MIN_SIMILARITY,  # pairs.embedded_context recalls with ServeOptions' default
        "label_missing": args["label_missing"],
        "reuse_mode": args["reuse_mode"],
        # Descriptive only: the model fingerprint already covers the patch and its settings.
        "model_patch": (f"ComfyUI EasyCache (threshold, start, end) = ({args['easycache']})"
                        if args.get("easycache") else "none"),
        "requests_labelled": len(by_req),
        "requests_planned": len(queries),
    })
    out = Path(args["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    n_pairs = n_unsafe = 0
    with tmp.open("w", encoding="utf-8") as fh:
        fh.write(json.dumps({"type": "header", **header}, sort_keys=True) + "\n")
        for q in queries:
            for r in by_req.get(q.request_id, []):
                fh.write(json.dumps(r, sort_keys=True) + "\n")
                n_pairs += 1
                n_unsafe += bool(r["unsafe"])
    tmp.replace(out)
    return len(by_req), n_pairs, n_unsafe


def evaluate_rule(rule_path: str, pairs_path: str) -> dict:
    """The rule's and prompt-only's outcome on a pairs file (the filter's per-request decision, certify.evaluate)."""
    from carnator.carnator_core.risk.certify import (
        clopper_pearson_upper,
        evaluate,
        evaluate_prompt_only,
        read_pairs_jsonl,
    )
    from carnator.carnator_core.risk.rule import RiskRule

    rule = RiskRule.load(rule_path)
    header, ps = read_pairs_jsonl(pairs_path)
    rule.check_applicable(header.get("model_fingerprint", ""), header.get("config_fingerprint", ""))
    delta = rule.certificate.delta

    def row(ev) -> dict:
        return {"requests": ev.n_requests, "accepted": ev.n_accepted, "unsafe": ev.k_unsafe,
                "coverage": round(ev.coverage, 4), "unsafe_rate": round(ev.unsafe_rate, 4),
                "upper_bound": round(clopper_pearson_upper(ev.k_unsafe, ev.n_accepted, delta), 4)}

    out = {"rule": row(evaluate(rule.thresholds, ps))}
    po = rule.comparison.get("prompt_only", {})
    bars = {}
    if "threshold" in po:
        bars["calibrated"] = float(po["threshold"])
    if rule.thresholds.min_similarity is not None:
        bars["rule_min_similarity"] = float(rule.thresholds.min_similarity)
    bars["node_default"] = 0.9
    for name, t in bars.items():
        out[f"prompt_only@{name}={t:.4g}"] = row(evaluate_prompt_only(t, ps))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    args = {k: getattr(ns, k) for k in vars(ns)}
    command = "scripts/lab/make_pairs.py " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    if args["combine"]:
        from carnator.carnator_core.lab import pairs

        sources = []
        for item in args["combine"]:
            path, sep, prefix = item.rpartition("=")
            if not sep:
                parser.error(f"--combine takes FILE=PREFIX[:SPLIT] items, got {item!r}")
            prefix, _, split = prefix.partition(":")
            sources.append((path, prefix, split or None))
        try:
            header = pairs.combine_pairs_files(sources, args["out"], generator=command,
                                               calib_reuse_may_differ=args["calib_reuse_may_differ"],
                                               calib_config_may_differ=args["calib_config_may_differ"])
        except ValueError as e:
            parser.error(str(e))
        n = sum(x["requests"] for x in header["sources"])
        print(f"wrote {args['out']}: {n} requests from {len(sources)} files")
        if args["evaluate"]:
            print(json.dumps(evaluate_rule(args["evaluate"], args["out"]), indent=1))
        return 0
    if not args["work"]:
        parser.error("--work is required (unless --combine)")
    if args["weights"]:
        args["weights"] = str(Path(args["weights"]).resolve())
    reuse_config(args["reuse_set"])  # a bad --reuse-set fails here, before any work (the part headers record it)
    easycache_settings(args["easycache"])  # likewise a bad --easycache
    work = Path(args["work"])
    work.mkdir(parents=True, exist_ok=True)
    run_file = work / "run.json"
    run = {k: args[k] for k in RUN_KEYS}
    if run_file.exists():
        prev = json.loads(run_file.read_text(encoding="utf-8"))
        if prev != run:
            diff = {k: (prev.get(k), run[k]) for k in RUN_KEYS if prev.get(k) != run[k]}
            raise SystemExit(f"{work} holds a run with other settings {diff}; use another --work or the same settings")
    else:
        run_file.write_text(json.dumps(run, indent=1), encoding="utf-8")
    n = max(1, args["workers"])
    threads = max(1, args["threads"])
    t0 = t1 = time.time()
    if not args["merge_only"]:
        _run_phase(args, "warm", n, threads)
        t1 = time.time()
        print(f"warm set ready ({t1 - t0:.0f} s)", flush=True)
        _run_phase(args, "query", n, threads)
    t2 = time.time()
    n_req, n_pairs, n_unsafe = merge(args, command)
    print(f"queries {t2 - t1:.0f} s; wrote {args['out']}: {n_req} requests, {n_pairs} pairs, {n_unsafe} unsafe")
    from carnator.carnator_core.lab import pairs as _pairs

    print("per kind (compute, background PSNR, artifact score of the reuse outputs):")
    print(json.dumps(_pairs.summarize_by_kind(_pairs.read_rows(args["out"])[1]), indent=1))
    if args["evaluate"]:
        print(json.dumps(evaluate_rule(args["evaluate"], args["out"]), indent=1))
    return 0 if n_req == args["queries"] else 4


if __name__ == "__main__":
    sys.exit(main())
