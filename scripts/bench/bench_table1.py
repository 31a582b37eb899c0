#!/usr/bin/env python
"""Serving benchmark in the layout of the seed's Table 1, on the embedded model.

    .host/venv/bin/python scripts/bench/bench_table1.py --warm 24 --stream 24 --json artifacts/table1.json \
        --md artifacts/table1.md

One process, one workload (scripts/bench/workload.py flags), one generation config (the embedded model's defaults:
20 Euler steps, simple schedule, CFG 5, probe 4 steps). Methods (``--methods``):

* ``dense``            plain KSampler path (``comfy.sample.sample``, as ComfyUI's KSampler calls it); no cache.
* ``easycache``        the same KSampler path on a MODEL patched by ComfyUI core's EasyCache node alone (no
                       Carnator): the step-skipping baseline that ``carnator_easycache`` composes with.
* ``prompt_only``      NIRVANA-style: the most similar cached prompt is reused if similarity >= ``--prompt-threshold``
                       (default: the rule's calibrated prompt-only threshold, else the rule's min_similarity)
                       (same probe, retrieval and joint reuse as Carnator; no signature check, no certificate).
* ``carnator``         Early Signature + certified risk rule + joint reuse (region + historical sparse attention).
* ``latent_only``      Carnator's filter, region-guided latent reuse only.
* ``attention_only``   Carnator's filter, historical sparse-attention reuse only.
* ``carnator_easycache`` Carnator on a MODEL patched by ComfyUI core's EasyCache node
                       (``comfy_extras.nodes_easycache.EasyCacheNode``, default settings): misses and the probe
                       run under EasyCache too.

The warm set is generated once (dense, with block-structure recording, written through ``request.serve`` =
``request.write_entry``) into a store that is then copied per method, so every method starts from the same
cache. The stream is served request by request; for each request every method runs once, in an order rotated
per request (so slow drifts of a shared machine's load spread evenly over the methods). By default each
cross-request method writes its misses to its own store as the Cache Writer node does (``--frozen-cache``
disables that). Latency = wall time of text encoding + the whole request path (objects, probe, signature,
retrieval, filter, resume or dense fallback, block recording, cache write): every online cost is counted.
Decoding, the checker and PSNR/SSIM are evaluation only and not timed.

The rule: ``--rule`` (default rules/embedded.json, the shipped certified rule). Without a certified rule the
benchmark refuses to run Carnator rows unless ``--allow-uncertified`` is given, in which case
``--dev-thresholds`` build an UNCERTIFIED development rule and every Carnator row is labelled as such: such
numbers must never be published as "Carnator". A rule from rules/withdrawn/ is refused unless
``--allow-withdrawn`` (its rows are then labelled WITHDRAWN). The Carnator + EasyCache row (not run by default: no
rule certified for the EasyCache-patched model ships) runs on ``--easycache-rule`` (default: the shipped rule) where
that rule's fingerprint applies, else only with ``--easycache-uncertified``, and its label then says UNCERTIFIED.

Headline: the speedup **per request**, n / Σ (t / t_dense), each request's latency divided by that of its own dense
twin served in the same round, so the requests served while a shared machine was slow weigh no more than the others;
the sum ratio Σ t_dense / Σ t stands beside it. The machine's load (os.getloadavg at the start, at every stream
request and at the end), its cores and torch's thread count are recorded. Per hit the sampler's compute estimate
stands beside the measured t_hit / t_dense. A run that computed every token and attention pair is never a hit
(``counts_as_hit``).

Weights: ``--weights`` (default the shipped file) are copied to a temporary file first, so a checkpoint written
meanwhile cannot change the model in the middle of a run.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

from workload import add_workload_args, register_package, spec_from_args  # noqa: E402

register_package()

from carnator.carnator_core.lab import metrics as M  # noqa: E402
from carnator.carnator_core.lab.workload import Request, build_workload, describe  # noqa: E402

ALL_METHODS = ("dense", "easycache", "prompt_only", "carnator", "latent_only", "attention_only", "carnator_easycache")
# What runs without --methods: every row whose rule ships. Carnator + EasyCache needs a rule for the EasyCache-patched
# model, and none ships (rules/README.md): that row runs only when asked for, and says which rule it ran on.
DEFAULT_METHODS = ("dense", "easycache", "prompt_only", "carnator", "latent_only", "attention_only")
NO_CACHE = ("dense", "easycache")  # KSampler path, no cross-request cache
ON_EASYCACHE = ("easycache", "carnator_easycache")  # run on the EasyCache-patched MODEL
LABELS = {
    "dense": "Dense (KSampler)",
    "easycache": "EasyCache only (KSampler)",
    "prompt_only": "Prompt-similarity only",
    "carnator": "Carnator (joint)",
    "latent_only": "Carnator, latent reuse only",
    "attention_only": "Carnator, attention reuse only",
    "carnator_easycache": "Carnator + EasyCache",
}
DEFAULT_RULE = ROOT / "rules" / "embedded.json"
# The Carnator + EasyCache row needs a rule certified on the EasyCache-patched model (its fingerprint covers the
# patch): pairs labelled with `make_pairs.py --easycache ...`, calibrated as usual. None ships today (E5's was
# withdrawn), so its default is the shipped rule: used as it is where its fingerprint applies to the patched model,
# else only with --easycache-uncertified, its thresholds and strata then run UNCERTIFIED and the row says so.
DEFAULT_EASYCACHE_RULE = DEFAULT_RULE


# ----------------------------------------------------------------------------------------------------- setup
def machine() -> dict[str, Any]:
    from machine import cpu_model  # scripts/bench/machine.py (this folder is on sys.path)

    load = os.getloadavg() if hasattr(os, "getloadavg") else (math.nan,) * 3
    import torch

    return {"nproc": os.cpu_count(), "cpu": cpu_model(), "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "loadavg_start": [round(x, 2) for x in load]}


@dataclasses.dataclass
class Env:
    """Everything a method needs to serve a request."""

    model: Any
    easy_model: Any
    enc: Any
    dec: Any
    glue: Any
    steps: int
    cfg: float
    probe_steps: int  # the Carnator rows' probe length (their rule's)
    top_k: int
    version: str = ""  # the weights' embedded model version (its latent geometry); "" = the default
    easy_probe_steps: int = 0  # the Carnator + EasyCache row's (its rule's); 0 = probe_steps

    def latent(self) -> dict:
        """An empty latent of the weights' version (v2 and v3 differ in frame size)."""
        return self.glue.empty_latent(1, self.version or None)


def load_env(args: argparse.Namespace, tmp: Path) -> Env:
    from carnator.carnator_core.embedded import config as ecfg

    src = Path(args.weights) if args.weights else ecfg.DEFAULT_WEIGHTS
    if not src.exists():
        raise SystemExit(f"embedded weights not found at {src}: pass --weights or check out the repository's "
                         "carnator_core/embedded/weights/")
    frozen = tmp / "weights.safetensors"
    shutil.copyfile(src, frozen)  # a trainer checkpoint written meanwhile must not change the model mid-run
    from carnator.carnator_core.embedded import comfy_glue

    model, enc, dec = comfy_glue.load_embedded(frozen)
    easy = None
    if any(m in args.methods for m in ON_EASYCACHE):
        from comfy_extras.nodes_easycache import EasyCacheNode

        easy = EasyCacheNode.execute(model, args.easycache_threshold, args.easycache_start, args.easycache_end,
                                     False).args[0]
    version = comfy_glue.model_version(model)
    cfg = args.cfg if args.cfg is not None else version.cfg  # the CFG the weights were selected at and rules use
    # Each Carnator row probes as long as its rule was certified for (the probe length is part of the rule's
    # config); --probe-steps overrides both (a rule for another length then refuses to apply).
    probe = args.probe_steps if args.probe_steps is not None else rule_probe_steps(args.rule)
    easy_rule = getattr(args, "easycache_rule", None)
    easy_probe = args.probe_steps if args.probe_steps is not None else rule_probe_steps(easy_rule) if easy_rule \
        else probe
    return Env(model, easy, enc, dec, comfy_glue, args.steps, cfg, probe, args.top_k, version.name, easy_probe)


def rule_probe_steps(path: str | Path) -> int:
    """The probe length a rule file was certified for (its config's ``probe_steps``); the embedded model's stock
    probe when the file does not exist or does not say (development rules)."""
    from carnator.carnator_core.embedded import config as ecfg

    try:
        meta = json.loads(Path(path).read_text(encoding="utf-8")).get("config", {}).get("meta", {})
        return int(meta["probe_steps"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return ecfg.DEFAULT_PROBE_STEP


def dev_rule(thresholds: str, probe: Any) -> Any:
    """An UNCERTIFIED rule for development runs: hand-set thresholds, certificate n = 0 (U = 1 > α)."""
    from carnator.carnator_core.risk.certify import Certificate
    from carnator.carnator_core.risk.rule import RiskRule
    from carnator.carnator_core.risk.thresholds import Thresholds

    try:
        c, s, sh, a = (float(x) for x in thresholds.split(","))
    except ValueError:
        raise SystemExit(f"--dev-thresholds must be context,size,shape,appearance numbers; got {thresholds!r}")
    return RiskRule(thresholds=Thresholds(c, s, sh, a), certificate=Certificate(0, 0, 1.0, 0.05, 0.1, 0),
                    model_fingerprint=probe.model_fingerprint, config_fingerprint=probe.config.fingerprint(),
                    arch="embedded", config_meta=probe.config.to_meta(),
                    provenance={"note": "UNCERTIFIED development rule from --dev-thresholds (bench_table1.py)"})


# ----------------------------------------------------------------------------------------------------- serving
def dense_run(env: Env, model: Any, positive, negative, req: Request) -> Any:
    """What ComfyUI's KSampler does (nodes.common_ksampler), without the preview callback."""
    import comfy.sample

    latent = env.latent()["samples"]
    latent = comfy.sample.fix_empty_latent_channels(model, latent)
    noise = comfy.sample.prepare_noise(latent, req.seed)
    return comfy.sample.sample(model, noise, env.steps, env.cfg, "euler", "simple", positive, negative, latent,
                               disable_pbar=True, seed=req.seed)


def serve_options(method: str, rule: Any, prompt_threshold: float, env: Env, write: bool,
                  probe_steps: int | None = None) -> Any:
    """The ServeOptions of ``method``; the probe length is ``probe_steps``, else that of the method's rule
    (``env.easy_probe_steps`` for Carnator + EasyCache, else ``env.probe_steps``)."""
    from carnator.carnator_core.probe import ProbeConfig
    from carnator.carnator_core.request import ServeOptions

    if probe_steps is None:
        probe_steps = (env.easy_probe_steps or env.probe_steps) if method == "carnator_easycache" else env.probe_steps
    mode = {"latent_only": "latent", "attention_only": "attention"}.get(method, "joint")
    filt = "prompt_only" if method == "prompt_only" else ("dense" if method == "dense" else "carnator")
    if mode != "joint" and rule is not None and rule.reuse_config is not None:
        # The ablations reuse on the joint rule's decisions with another mode, which that rule does not certify
        # (the sampler would refuse it): their rows are measurements of the mode, not certified configurations.
        import dataclasses

        rule = dataclasses.replace(rule, reuse_config={**rule.reuse_config, "mode": mode})
    return ServeOptions(method=filt, reuse_mode=mode, rule=rule if filt == "carnator" else None,
                        allow_uncertified=bool(rule is not None and not rule.certificate.passed),
                        prompt_threshold=prompt_threshold, top_k=env.top_k, write=write,
                        probe=ProbeConfig(probe_steps=probe_steps))


def run_request(env: Env, method: str, req: Request, store: Any, options: Any) -> tuple[Any, float, Any]:
    """Serve one request with one method; returns (final latent samples, wall seconds, RequestResult | None)."""
    from carnator.carnator_core.request import RequestSpec, serve

    model = env.easy_model if method in ON_EASYCACHE else env.model
    t0 = time.perf_counter()
    positive = env.enc.encode(req.prompt)
    negative = env.enc.encode("")
    if method in NO_CACHE:
        samples = dense_run(env, model, positive, negative, req)
        return samples, time.perf_counter() - t0, None
    spec = RequestSpec(prompt=req.prompt, seed=req.seed, steps=env.steps, cfg=env.cfg)
    res = serve(model, env.enc, positive, negative, env.latent(), spec, store, options)
    return res.latent["samples"], time.perf_counter() - t0, res


def record_of(env: Env, method: str, req: Request, samples: Any, seconds: float,
              res: Any) -> tuple[M.RequestRecord, Any]:
    from carnator.carnator_core.embedded import checker

    clip = env.dec.decode_clips(samples)[0].numpy()
    chk = checker.check(clip, req.scene)
    decision = "dense" if res is None else res.report.decision
    if decision == "hit" and not counts_as_hit(res.report):
        decision = "miss"  # computed every token and pair: a dense run, never counted as a hit
    rec = M.RequestRecord(rid=req.rid, kind=req.kind, method=method, latency_s=seconds, decision=decision,
                          checker_pass=bool(chk.all_ok), attributes=M.attribute_verdicts(chk))
    if res is not None:
        rep = res.report
        rec.entry_id = rep.entry_id
        rec.active_fraction = rep.active_fraction
        rec.compute_fraction = rep.compute_fraction
        rec.timings_ms = {k: round(float(v), 2) for k, v in res.timings_ms.items()}
        rec.summary = rep.summary()
        dec = res.decision
        if dec is not None and dec.candidate is not None:
            rec.candidate_prompt = dec.candidate.prompt
            rec.similarity = float(dec.candidate.similarity)
        if dec is not None and res.candidates is not None and res.candidates.items:
            from carnator.carnator_core.risk.discrepancy import AXES, discrepancies

            top = dec.candidate or res.candidates.items[0]
            d = discrepancies(res.signature, top.signature)
            rec.discrepancies = {**{a: float(v) for a, v in zip(AXES, d.vector())}, "missing": bool(d.missing),
                                 "similarity": float(top.similarity)}
    return rec, clip


# ----------------------------------------------------------------------------------------------------- the run
def run(args: argparse.Namespace) -> dict[str, Any]:
    from carnator.carnator_core.cache import Store

    wl = build_workload(spec_from_args(args))
    info = {"workload": describe(wl), "machine": machine(), "args": vars(args).copy()}
    print(json.dumps(info["workload"]), flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="carnator-table1-"))
    try:
        env = load_env(args, tmp)
        info["probe_steps"] = {"carnator": env.probe_steps, "carnator_easycache": env.easy_probe_steps}
        print(f"probe steps (of {env.steps}): {info['probe_steps']}", flush=True)
        key = tmp / "index.key"
        warm_dir = tmp / "warm"
        warm = Store.open(warm_dir, key_path=key)
        from carnator.carnator_core.request import RequestSpec, serve

        # Not timed: loads spaCy and warms every lazy path once, on a prompt outside the workload.
        scratch = Store.open(tmp / "scratch", key_path=key)
        wprompt = "a big red ball moves to the right in the top left, on green grass"
        t0 = time.perf_counter()
        first = serve(env.model, env.enc, env.enc.encode(wprompt), env.enc.encode(""), env.latent(),
                      RequestSpec(wprompt, 123456789, env.steps, env.cfg), scratch,
                      serve_options("dense", None, 0.0, env, True))
        scratch.close()
        print(f"warm-up request (not counted): {time.perf_counter() - t0:.1f}s", flush=True)

        needs = [m for m in ("carnator", "latent_only", "attention_only") if m in args.methods]
        rule, rule_status = resolve_rule(args.rule, args, first.probe, bool(needs))
        info["rule"] = rule_status
        print(f"rule: {rule_status['summary']}", flush=True)
        easy_rule = None
        if "carnator_easycache" in args.methods:
            scratch = Store.open(tmp / "scratch-easy", key_path=key)
            easy_first = serve(env.easy_model, env.enc, env.enc.encode(wprompt), env.enc.encode(""), env.latent(),
                               RequestSpec(wprompt, 123456789, env.steps, env.cfg), scratch,
                               serve_options("dense", None, 0.0, env, True, env.easy_probe_steps))
            scratch.close()
            easy_rule, easy_status = resolve_rule(args.easycache_rule, args, easy_first.probe, True, transfer=True)
            info["easycache_rule"] = easy_status
            print(f"Carnator + EasyCache rule: {easy_status['summary']}", flush=True)
        prompt_threshold = args.prompt_threshold
        if prompt_threshold is None:
            # The rule's own prompt-only comparison threshold (calibrated under the same risk constraint) if it
            # has one; else the rule's minimum similarity (then prompt-only = Carnator's recall gate without the
            # signature check, the seed's "prompt similarity only" ablation); else 0.98.
            po = (rule.comparison or {}).get("prompt_only") if rule is not None else None
            min_sim = rule.thresholds.min_similarity if rule is not None else None
            if isinstance(po, dict) and "threshold" in po:
                prompt_threshold, src = float(po["threshold"]), "the rule's calibrated prompt-only comparison"
            elif min_sim is not None:
                prompt_threshold, src = float(min_sim), "the rule's min_similarity (same recall gate, no signature)"
            else:
                prompt_threshold, src = 0.98, "default 0.98 (see --help)"
            info["prompt_threshold_source"] = src
        else:
            info["prompt_threshold_source"] = "--prompt-threshold"
        info["prompt_threshold"] = prompt_threshold
        print(f"prompt-only threshold: {prompt_threshold:.4f} ({info['prompt_threshold_source']})", flush=True)

        t0 = time.perf_counter()
        # The EasyCache-patched model is another namespace (the fingerprint covers patches): its cache is warmed
        # by the same requests served on it, as a farm running Carnator + EasyCache would have filled it.
        # Each warm store is filled with its row's probe length: the cache namespace includes the config.
        warm_models = [("", env.model, warm, env.probe_steps)]
        if "carnator_easycache" in args.methods:
            warm_models.append(("easy ", env.easy_model, Store.open(tmp / "warm-easy", key_path=key),
                                env.easy_probe_steps))
        for tag, model, store, probe_steps in warm_models:
            for i, req in enumerate(wl.warm):
                res = serve(model, env.enc, env.enc.encode(req.prompt), env.enc.encode(""), env.latent(),
                            RequestSpec(req.prompt, req.seed, env.steps, env.cfg), store,
                            serve_options("dense", None, 0.0, env, True, probe_steps))
                print(f"{tag}warm {i + 1}/{len(wl.warm)} {req.rid} {res.timings_ms['total'] / 1000:.1f}s "
                      f"{req.prompt}", flush=True)
        info["warm_seconds"] = time.perf_counter() - t0
        info["warm_entries"] = warm.stats().entries
        for _tag, _model, store, _probe in warm_models:
            store.close()

        methods = [m for m in ALL_METHODS if m in args.methods]
        stores: dict[str, Any] = {}
        for m in methods:
            if m not in NO_CACHE:
                shutil.copytree(tmp / "warm-easy" if m == "carnator_easycache" else warm_dir, tmp / m)
                stores[m] = Store.open(tmp / m, key_path=key)
        records: dict[str, list[M.RequestRecord]] = {m: [] for m in methods}
        ref_cache: dict[tuple, list[float]] = {}
        t_stream = time.perf_counter()
        loads: list[list[float]] = []
        for i, req in enumerate(wl.stream):
            loads.append([round(x, 2) for x in os.getloadavg()])  # the 1/5/15-min load as this request starts
            order = methods[i % len(methods):] + methods[:i % len(methods)]
            outs: dict[str, tuple[M.RequestRecord, Any, Any]] = {}
            for m in order:
                opts = serve_options(m, easy_rule if m == "carnator_easycache" else rule, prompt_threshold, env,
                                     not args.frozen_cache)
                samples, sec, res = run_request(env, m, req, stores.get(m), opts)
                rec, clip = record_of(env, m, req, samples, sec, res)
                outs[m] = (rec, clip, samples)
            d_rec, d_clip, d_samples = outs["dense"]
            bg = M.background_mask(d_clip, req.scene)
            d_rec.artifact = d_rec.artifact_dense = M.artifact_score(d_clip, bg)
            for m in methods:
                rec, clip, samples = outs[m]
                if m != "dense":
                    q = M.clip_quality(clip, d_clip, bg)
                    rec.psnr, rec.ssim, rec.psnr_bg, rec.ssim_bg = q["psnr"], q["ssim"], q["psnr_bg"], q["ssim_bg"]
                    rec.off_frac, rec.artifact, rec.artifact_dense = q["off_frac"], q["artifact"], q["artifact_dense"]
                    rec.identical_to_dense = bool((samples.float() == d_samples.float()).all())
                    if rec.hit:
                        rec.regressions = M.regressions(rec.attributes, d_rec.attributes)
                        rec.unsafe = bool(rec.regressions)
                        # The model's own texture: dense clips of the same prompt with other seeds (not timed).
                        rec.artifact_ref = artifact_reference(env, req, bg, args.artifact_seeds, ref_cache)
                        split = M.artifact_split(clip, d_clip, source_clip(env, stores[m], rec.entry_id), bg)
                        rec.artifact_source, rec.kept_share = split["source"], split["kept_share"]
                        rec.excess_kept, rec.excess_recomputed = split["excess_kept"], split["excess_recomputed"]
                records[m].append(rec)
            line = " ".join(f"{m}={outs[m][0].decision[:4]}/{outs[m][0].latency_s:.1f}s" for m in methods)
            print(f"stream {i + 1}/{len(wl.stream)} {req.rid} {req.kind:16s} {line}", flush=True)
            if args.json:  # partial results after every request: a long run that is stopped still leaves data
                partial = {**info, "partial": f"{i + 1}/{len(wl.stream)} stream requests",
                           "records": {m: [r.to_json() for r in records[m]] for m in methods}}
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(partial, indent=1, default=str) + "\n", encoding="utf-8")
        info["stream_seconds"] = time.perf_counter() - t_stream
        for s in stores.values():
            s.close()
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"kept {tmp}")
    info["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    info["machine"]["loadavg_per_request"] = loads
    one = [x[0] for x in loads]
    info["machine"]["load1_stream"] = {"min": min(one), "median": M._median(one), "max": max(one)} if one else {}
    dense = records["dense"]
    info["summary"] = {m: {**M.summarize(records[m], dense), **per_request_ratios(records[m], dense)}
                       for m in methods}
    info["records"] = {m: [r.to_json() for r in records[m]] for m in methods}
    return info


def per_request_ratio(records: list[Any], dense: list[Any]) -> float:
    """n / Σ (t / t_dense): the speedup over the requests with each request's latency divided by its own dense
    twin's (served in the same round, under the same load), so a slow stretch of a shared machine weighs each of
    its requests as much as any other; NaN without requests."""
    by_rid = {r.rid: r for r in dense}
    ratios = [r.latency_s / by_rid[r.rid].latency_s for r in records]
    return len(ratios) / sum(ratios) if ratios and sum(ratios) > 0 else math.nan


def sum_ratio(records: list[Any], dense: list[Any]) -> float:
    """Σ t_dense / Σ t over the same requests: the stream's wall-time ratio (dominated by its slowest requests)."""
    by_rid = {r.rid: r for r in dense}
    total = sum(r.latency_s for r in records)
    return sum(by_rid[r.rid].latency_s for r in records) / total if records and total > 0 else math.nan


def counts_as_hit(report: Any) -> bool:
    """Whether a served request is reported as a hit: the sampler said so and the run did not compute every token
    and every attention pair on every call (such a run is a dense run whatever its mode; ``reuse.sample`` reports it
    as a miss, and this keeps any report that did not out of the hit counts). Answers from the cache (exact repeats,
    answer-only entries) compute nothing and are hits."""
    if report is None or report.decision != "hit":
        return False
    if report.mode in ("exact", "node_cache"):
        return True
    return not (report.token_fraction >= 1.0 and report.attention_fraction >= 1.0 and report.skipped_calls == 0
                and report.active_fraction >= 1.0)


def per_request_ratios(records: list[Any], dense: list[Any]) -> dict[str, Any]:
    """The headline speedups of one method against dense: per request (:func:`per_request_ratio`, over every request,
    its hits and its misses) and the sum ratio beside it; and per hit, the measured cost t_hit / t_dense against the
    sampler's compute estimate (``compute_fraction``)."""
    hits = [r for r in records if r.hit]
    misses = [r for r in records if not r.hit]
    by_rid = {r.rid: r for r in dense}
    over = [(r.latency_s / by_rid[r.rid].latency_s) / r.compute_fraction for r in hits
            if r.compute_fraction and r.compute_fraction > 0]
    return {"speedup_per_request": per_request_ratio(records, dense), "speedup_sum": sum_ratio(records, dense),
            "hit_speedup_per_request": per_request_ratio(hits, dense),
            "miss_speedup_per_request": per_request_ratio(misses, dense),
            "hit_cost_over_estimate_median": M._median(over), "hit_cost_over_estimate_max": max(over) if over else None}


def artifact_reference(env: Env, req: Request, background: Any, n_seeds: int, cache: dict) -> list[float]:
    """Artifact scores of dense clips of ``req``'s prompt with ``n_seeds`` other seeds, over the background of
    ``req``'s own dense clip (evaluation only: not timed). Cached per (prompt, background)."""
    key = (req.prompt, hash(background.tobytes()))
    if key not in cache:
        import dataclasses as dc

        pos, neg = env.enc.encode(req.prompt), env.enc.encode("")
        scores = []
        for j in range(n_seeds):
            other = dc.replace(req, seed=(req.seed + 7919 * (j + 1)) % (2 ** 31))
            clip = env.dec.decode_clips(dense_run(env, env.model, pos, neg, other))[0].numpy()
            scores.append(M.artifact_score(clip, background))
        cache[key] = scores
    return list(cache[key])


def source_clip(env: Env, store: Any, entry_id: str) -> Any:
    """The decoded final clip of the cache entry a hit reused (evaluation only: not timed, not counted as a hit)."""
    latent = store.load(entry_id, count_hit=False).tensors["latent_final"]
    return env.dec.decode_clips(latent.reshape(1, *latent.shape[-4:]))[0].numpy()


def hits_markdown(info: dict[str, Any]) -> str:
    """Per-hit quality: compute, PSNR/SSIM vs the dense clip of the same request and seed (whole clip and
    background), artifact score vs the dense clips of the same prompt across seeds, and its excess over the dense
    clip split into the background pixels kept from the reused clip and those the hit recomputed
    (``metrics.artifact_split``)."""
    lines = ["| Method | Request | Kind | Compute (of dense) | PSNR (dB) | PSNR bg (dB) | SSIM bg | Off > 0.25 "
             "| Artifact (hit) | Artifact (dense, seeds: min–max) | Inside spread | Artifact (reused clip) "
             "| Bg kept | Excess: kept / recomputed | Checker |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m, recs in info.get("records", {}).items():
        for r in recs:
            if r.get("decision") != "hit":
                continue
            ref = [x for x in (r.get("artifact_ref") or []) + [r.get("artifact_dense")] if x is not None]
            rec = M.RequestRecord(**{k: v for k, v in r.items() if k in M.RequestRecord.__dataclass_fields__})
            for k in ("psnr", "psnr_bg"):
                if getattr(rec, k) == "inf":
                    setattr(rec, k, math.inf)
            inside = M.artifact_inside_spread(rec)
            lines.append(
                f"| {LABELS[m]} | {r['rid']} | {r['kind']} | {_f(r.get('compute_fraction'), '.2f')} "
                f"| {_f(rec.psnr, '.1f')} | {_f(rec.psnr_bg, '.1f')} | {_f(r.get('ssim_bg'), '.3f')} "
                f"| {_f(r.get('off_frac'), '.2%')} | {_f(r.get('artifact'), '.2f')} "
                f"| {(f'{min(ref):.2f}–{max(ref):.2f}' if ref else '—')} "
                f"| {'—' if inside is None else ('yes' if inside else 'NO')} "
                f"| {_f(r.get('artifact_source'), '.2f')} | {_f(r.get('kept_share'), '.0%')} "
                f"| {_f(r.get('excess_kept'), '+.3f')} / {_f(r.get('excess_recomputed'), '+.3f')} "
                f"| {'pass' if r.get('checker_pass') else 'fail'}{' UNSAFE' if r.get('unsafe') else ''} |")
    return "\n".join(lines) + "\n"


def is_withdrawn(path: str | Path) -> bool:
    """Whether a rule file lies in a ``withdrawn`` folder (rules/withdrawn/: rules that shipped and were withdrawn;
    the files carry no mark of it themselves)."""
    return "withdrawn" in Path(path).resolve().parts


def resolve_rule(rule_path: str, args: argparse.Namespace, probe: Any, needed: bool, transfer: bool = False
                 ) -> tuple[Any, dict[str, Any]]:
    """The risk rule at ``rule_path`` for rows served on the model ``probe`` ran on (it must apply to that model
    and config), and a status dict saying exactly what it is.

    A withdrawn rule (:func:`is_withdrawn`) is refused unless ``args.allow_withdrawn``; then it is reported as
    WITHDRAWN and uncertified, never as certified. ``transfer`` (the Carnator + EasyCache row): a rule whose
    fingerprint does not apply to this model is refused unless ``args.easycache_uncertified``; then its thresholds,
    strata and reuse settings run on this model as an UNCERTIFIED rule (its certificate does not cover this model)."""
    import dataclasses as dc

    from carnator.carnator_core.risk.certify import Certificate
    from carnator.carnator_core.risk.rule import RiskRule, RuleError, RuleMismatchError

    if not needed:
        return None, {"summary": "no Carnator method selected", "certified": None}
    path = Path(rule_path)
    fp, cfp = probe.model_fingerprint, probe.config.fingerprint()
    withdrawn = is_withdrawn(path)
    if withdrawn and not getattr(args, "allow_withdrawn", False):
        raise SystemExit(f"risk rule {path} was withdrawn (rules/README.md): it is no rule that ships. Pass a "
                         "rule that ships, or --allow-withdrawn for a development run (every row on it is then "
                         "labelled "
                         "WITHDRAWN; such numbers must not be published as Carnator)")
    if path.exists():
        transferred = False
        try:
            rule = RiskRule.load(path, allow_uncertified=args.allow_uncertified or withdrawn or transfer)
            try:
                rule.check_applicable(fp, cfp)
            except RuleMismatchError:
                if not (transfer and getattr(args, "easycache_uncertified", False)):
                    raise
                c0 = rule.certificate
                rule = dc.replace(rule, model_fingerprint=fp, config_fingerprint=cfp,
                                  certificate=Certificate(0, 0, 1.0, c0.alpha, c0.delta, 0),
                                  provenance={**dict(rule.provenance),
                                              "note": f"UNCERTIFIED: {path}'s thresholds, strata and reuse settings "
                                                      "run on a model its certificate does not cover"})
                transferred = True
            if not rule.certificate.passed and not (args.allow_uncertified or withdrawn or transferred):
                rule.check_certified()
        except RuleError as e:
            hint = (" (the Carnator + EasyCache row: no rule certified for the EasyCache-patched model ships; pass "
                    "--easycache-uncertified to run the shipped rule's thresholds there UNCERTIFIED, labelled so)"
                    if transfer else "")
            raise SystemExit(f"cannot use risk rule {path}: {e}{hint}")
        c = rule.certificate
        certified = bool(c.passed and not withdrawn and not transferred)
        state = ("WITHDRAWN, UNCERTIFIED" if withdrawn else
                 "UNCERTIFIED on this model (its certificate is for another)" if transferred else
                 "CERTIFIED" if c.passed else "UNCERTIFIED")
        return rule, {"summary": f"{path} ({rule.rule_id}; {state}: {c.k} unsafe of {c.n}, U={c.upper_bound:.4f}, "
                                 f"α={c.alpha}, δ={c.delta})",
                      "path": str(path), "rule_id": rule.rule_id, "certified": certified, "withdrawn": withdrawn,
                      "transferred": transferred, "state": state,
                      "certificate": c.to_dict(), "thresholds": rule.thresholds.to_dict()}
    if not args.allow_uncertified:
        raise SystemExit(f"risk rule {path} not found. The Carnator rows need the certified rule for the embedded "
                         "model (rules/embedded.json; see rules/README.md). For a development run only, pass "
                         "--allow-uncertified (with --dev-thresholds) — such numbers must not be published.")
    rule = dev_rule(args.dev_thresholds, probe)
    return rule, {"summary": f"UNCERTIFIED development rule, thresholds {rule.thresholds.to_dict()} "
                             f"({path} not found)", "certified": False, "thresholds": rule.thresholds.to_dict(),
                  "path": None, "rule_id": rule.rule_id, "withdrawn": False, "transferred": False,
                  "state": "UNCERTIFIED development rule"}


def row_rule_label(status: dict[str, Any] | None) -> str:
    """What a Carnator row's label adds about its rule: nothing for a certified rule that ships, else its state and
    file (a row is never shown on a withdrawn or uncertified rule without naming it)."""
    if not status or status.get("certified") is not False:
        return ""
    where = f" {Path(status['path']).name}" if status.get("path") else ""
    if status.get("transferred"):
        return f" — UNCERTIFIED rule{where} (certified for another model)"
    state = status.get("state", "UNCERTIFIED")
    return f" — {state}{'' if state.endswith('rule') else ' rule'}{where}"


def frozen_stream_setup(args: argparse.Namespace, tmp: Path, wl: Any) -> tuple[Env, Any, dict[str, Any], Any]:
    """The set-up of the side-by-side stream benchmarks (``bench_reuse_settings.py``, ``profile_hit_calls.py``):
    Table 1's defaults for what they do not ask for (the shipped weights and their CFG, 20 steps, the rule's probe
    length, top-5 recall, a certified rule at ``args.rule``), the environment, one untimed dense request that warms
    every lazy path, the rule, and the warm set of ``wl`` served dense into one store under ``tmp``. Returns (env,
    rule, rule status, warm store); the caller keeps the store frozen (serves with ``write=False``) and closes it."""
    from carnator.carnator_core.cache import Store
    from carnator.carnator_core.request import RequestSpec, serve

    args.methods, args.weights, args.cfg, args.steps, args.probe_steps, args.top_k = "dense,carnator", None, None, \
        20, None, 5
    args.allow_uncertified, args.dev_thresholds = False, ""
    env = load_env(args, tmp)
    key = tmp / "index.key"

    def dense_into(store: Any, prompt: str, seed: int) -> Any:
        return serve(env.model, env.enc, env.enc.encode(prompt), env.enc.encode(""), env.latent(),
                     RequestSpec(prompt, seed, env.steps, env.cfg), store, serve_options("dense", None, 0.0, env, True))

    scratch = Store.open(tmp / "scratch", key_path=key)
    first = dense_into(scratch, "a big red ball moves to the right in the top left, on green grass", 123456789)
    scratch.close()
    rule, status = resolve_rule(args.rule, args, first.probe, True)
    warm = Store.open(tmp / "warm", key_path=key)
    t0 = time.perf_counter()
    for req in wl.warm:
        dense_into(warm, req.prompt, req.seed)
    print(f"warm set: {len(wl.warm)} requests, {time.perf_counter() - t0:.0f} s", flush=True)
    return env, rule, status, warm


# ----------------------------------------------------------------------------------------------------- output
def write_stream_report(path: Path, wl: Any, status: dict[str, Any], summary: dict[str, Any],
                        rows: list[dict[str, Any]], **extra: Any) -> None:
    """The JSON of a side-by-side stream benchmark: its own fields, the rule's status, machine, workload,
    summary and per-request rows."""
    out = {**extra, "rule": status, "machine": machine(), "workload": describe(wl), "summary": summary, "rows": rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=float) + "\n", encoding="utf-8")
    print(f"wrote {path}")


def _f(x: Any, fmt: str, suffix: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    if isinstance(x, float) and math.isinf(x):
        return "∞"
    return format(x, fmt) + suffix


def markdown(info: dict[str, Any]) -> str:
    s = info["summary"]
    mach = info.get("machine", {})
    lines = [f"Machine: {mach.get('nproc')} cores ({mach.get('cpu')}), torch threads {mach.get('torch_threads')}; "
             f"load average (1/5/15 min) {mach.get('loadavg_start')} at the start, {mach.get('loadavg_end')} at the "
             f"end; 1-min load as each stream request started: {mach.get('load1_stream')}.", "",
             "Speedup vs dense: **per request** = n / Σ (t / t_dense), each request against its own dense twin served "
             "in the same round (robust to load drifts); sum = Σ t_dense / Σ t (the stream's wall time).", "",
             "| Method | Hit rate | Speedup per request (all / hits / misses) | Speedup, sum | Mean latency (s) "
             "| Cache-hit latency (s) | Hit cost / compute estimate (median, max) "
             "| Checker pass | PSNR vs dense, hits (dB) | SSIM vs dense | Unsafe (of hits) "
             "| Compute of hits (median, non-repeat) | PSNR bg, hits (median) "
             "| Artifact, hits (median; inside spread) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m, r in s.items():
        label = LABELS[m]
        if m in ("carnator", "latent_only", "attention_only"):
            label += row_rule_label(info.get("rule"))
        elif m == "carnator_easycache":
            label += row_rule_label(info.get("easycache_rule"))
        if m == "dense":
            hit_lat = f"{_f(s.get('carnator', {}).get('dense_latency_on_hits_s'), '.2f')} (on Carnator's hits)" \
                if "carnator" in s else "—"
            lines.append(f"| {label} | — | 1.00× | 1.00× | {_f(r['mean_latency_s'], '.2f')} | {hit_lat} | — | "
                         f"{_f(r['checker_pass'], '.1%')} | — | — | — | 1.00 | — "
                         f"| {_f(M._median(x['artifact'] for x in info['records']['dense']), '.2f')} (all) |")
            continue
        if m in NO_CACHE:  # no cache: no hits; PSNR/SSIM over every request against dense
            lines.append(f"| {label} | — | {_f(r['speedup_per_request'], '.2f', '×')} "
                         f"| {_f(r['speedup_sum'], '.2f', '×')} "
                         f"| {_f(r['mean_latency_s'], '.2f')} | — | — "
                         f"| {_f(r['checker_pass'], '.1%')} | {_f(r['psnr_all'], '.1f')} (all requests) "
                         f"| {_f(r['ssim'], '.3f')} | — | — | — | — |")
            continue
        same = f" ({r['psnr_hits_identical']} identical)" if r["psnr_hits_identical"] else ""
        lines.append(
            f"| {label} | {_f(r['hit_rate'], '.1%')} ({r['hits']}/{r['requests']}) "
            f"| **{_f(r['speedup_per_request'], '.2f', '×')}** / {_f(r['hit_speedup_per_request'], '.2f', '×')} / "
            f"{_f(r['miss_speedup_per_request'], '.2f', '×')} | {_f(r['speedup_sum'], '.2f', '×')} "
            f"| {_f(r['mean_latency_s'], '.2f')} | {_f(r['hit_latency_s'], '.2f')} "
            f"| {_f(r['hit_cost_over_estimate_median'], '.2f')}, {_f(r['hit_cost_over_estimate_max'], '.2f')} "
            f"| {_f(r['checker_pass'], '.1%')} | {_f(r['psnr_hits'], '.1f')}{same} "
            f"| {_f(r['ssim'], '.3f')} | {_f(r['unsafe_rate'], '.1%')} ({r['unsafe']}/{r['hits']}) "
            f"| {_f(r['compute_hits_median'], '.2f')}, {_f(r['compute_nonrepeat_hits_median'], '.2f')} "
            f"| {_f(r['psnr_bg_hits'], '.1f')} "
            f"| {_f(r['artifact_hits'], '.2f')}; {r['artifact_inside_spread']}/{r['hits']} |")
    return "\n".join(lines) + "\n"


def cost_markdown(info: dict[str, Any]) -> str:
    """Per hit: the sampler's compute estimate (model compute of the hit / a dense run's, from its counters) beside
    the measured cost t_hit / t_dense (the request's own dense twin, same round), and their ratio."""
    dense = {r["rid"]: r for r in info.get("records", {}).get("dense", [])}
    lines = ["| Method | Request | Kind | Active tokens | Compute estimate | Measured t_hit / t_dense "
             "| Measured / estimate | t_hit (s) | t_dense (s) |", "|---|---|---|---|---|---|---|---|---|"]
    for m, recs in info.get("records", {}).items():
        for r in recs:
            if r.get("decision") != "hit" or r["rid"] not in dense:
                continue
            meas = r["latency_s"] / dense[r["rid"]]["latency_s"]
            est = r.get("compute_fraction")
            lines.append(f"| {LABELS[m]} | {r['rid']} | {r['kind']} | {_f(r.get('active_fraction'), '.0%')} "
                         f"| {_f(est, '.3f')} | {meas:.3f} | {_f(meas / est if est else None, '.2f')} "
                         f"| {r['latency_s']:.2f} | {dense[r['rid']]['latency_s']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                    help="comma-separated subset of " + ",".join(ALL_METHODS) + " (default: every row but "
                         "carnator_easycache, whose rule does not ship)")
    ap.add_argument("--weights", default=None, help="embedded weights file (default: the shipped one)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--cfg", type=float, default=None, help="CFG scale (default: the weights' version's stock CFG)")
    ap.add_argument("--probe-steps", type=int, default=None,
                    help="probe length of the Carnator rows (default: each row's rule's, the length it was certified "
                         "for; a rule made for another length refuses to apply)")
    ap.add_argument("--top-k", type=int, default=5, help="candidates recalled per request (the workflows use 5)")
    ap.add_argument("--rule", default=str(DEFAULT_RULE), help="risk rule file for the Carnator rows")
    ap.add_argument("--easycache-rule", default=str(DEFAULT_EASYCACHE_RULE),
                    help="risk rule for the Carnator + EasyCache row: one certified on the EasyCache-patched model "
                         "(make_pairs.py --easycache). Default: the shipped rule, which applies only where its "
                         "fingerprint covers the patched model (it does not: see --easycache-uncertified)")
    ap.add_argument("--easycache-uncertified", action="store_true",
                    help="run the Carnator + EasyCache row on --easycache-rule's thresholds, strata and reuse settings "
                         "although its certificate is for another model; the row is labelled UNCERTIFIED")
    ap.add_argument("--allow-withdrawn", action="store_true",
                    help="development only: accept a rule from rules/withdrawn/ (every row on it is labelled "
                         "WITHDRAWN)")
    ap.add_argument("--allow-uncertified", action="store_true",
                    help="development only: accept an uncertified rule / build one from --dev-thresholds")
    ap.add_argument("--dev-thresholds", default="8,0.5,1.0,10",
                    help="context,size,shape,appearance thresholds of the UNCERTIFIED development rule")
    ap.add_argument("--prompt-threshold", type=float, default=None,
                    help="similarity threshold of prompt_only (default: the rule's calibrated prompt-only "
                         "comparison threshold if it has one, else the rule's min_similarity, else 0.98: with the "
                         "embedded text encoder, one-word edits score about 0.98-1.0 and unrelated scenes of the "
                         "world 0.93-0.97)")
    ap.add_argument("--artifact-seeds", type=int, default=2,
                    help="dense clips of each hit's prompt with other seeds, for the artifact score's reference "
                         "spread (evaluation only, not timed)")
    ap.add_argument("--easycache-threshold", type=float, default=0.2)
    ap.add_argument("--easycache-start", type=float, default=0.15)
    ap.add_argument("--easycache-end", type=float, default=0.95)
    ap.add_argument("--frozen-cache", action="store_true", help="stream misses are not written to the cache")
    ap.add_argument("--json", type=Path, default=ROOT / "artifacts" / "table1.json")
    ap.add_argument("--md", type=Path, default=ROOT / "artifacts" / "table1.md")
    ap.add_argument("--keep", action="store_true", help="keep the temporary stores")
    args = ap.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in args.methods if m not in ALL_METHODS]
    if bad or "dense" not in args.methods:
        raise SystemExit(f"--methods: unknown {bad}; 'dense' is required (quality is measured against it)")
    from carnator.carnator_core.embedded.model import ensure_comfy_importable

    ensure_comfy_importable()
    t0 = time.perf_counter()
    info = run(args)
    info["total_seconds"] = time.perf_counter() - t0
    table = (markdown(info) + "\nPer hit, quality:\n\n" + hits_markdown(info)
             + "\nPer hit, cost against the compute estimate:\n\n" + cost_markdown(info))
    print(table)
    for k, v in info["summary"].items():
        print(k, json.dumps(v["by_kind"]))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    info["args"]["json"] = str(args.json)
    info["args"]["md"] = str(args.md)
    args.json.write_text(json.dumps(info, indent=1, default=str) + "\n", encoding="utf-8")
    args.md.parent.mkdir(parents=True, exist_ok=True)
    args.md.write_text(table, encoding="utf-8")
    print(f"wrote {args.json} and {args.md} ({info['total_seconds']:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
