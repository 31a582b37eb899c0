"""The whole request path in one call, in-process: probe -> signature -> retrieve -> filter -> sample -> write.

This is exactly what the node graph does (each step is the same core call the corresponding node makes), for
benchmarks, calibration-pair generation and serving code that drives Carnator without a workflow. Every online
cost is timed separately (ms): probe, signature, retrieval, filter, resume (the rest of sampling, including a
dense fallback), write.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

from .probe import ProbeConfig, objects_for, run_probe
from .reuse import ReuseConfig, RunReport, sample
from .signature import SignatureConfig, build_signature
from .types import Candidates, Decision, Probe, Signature, namespace_key


@dataclass(frozen=True)
class RequestSpec:
    """One generation request (what a workflow's widgets hold)."""

    prompt: str
    seed: int
    steps: int
    cfg: float
    sampler: str = "euler"
    scheduler: str = "simple"
    objects: str | None = None  # user override of the object list


@dataclass(frozen=True)
class ServeOptions:
    """How the request is served.

    method:        "dense" (no cache), "carnator" (signature filter + reuse), "prompt_only" (NIRVANA-style
                   filter + the same reuse), "never" (probe + retrieval + filter run, always dense).
    reuse_mode:    sampler mode on a hit: "joint" | "latent" | "attention".
    rule:          RiskRule for "carnator".
    allow_uncertified: accept a rule whose certificate fails (experiments; decisions carry the UNCERTIFIED banner).
    prompt_threshold: similarity threshold of "prompt_only".
    top_k:         candidates recalled.
    write:         persist the finished generation as a cache entry (misses only; hits reuse an entry).
    """

    method: str = "carnator"
    reuse_mode: str = "joint"
    rule: Any = None
    allow_uncertified: bool = False
    prompt_threshold: float = 0.9
    top_k: int = 4
    write: bool = True
    probe: ProbeConfig = ProbeConfig(probe_steps=4)
    signature: SignatureConfig = field(default_factory=SignatureConfig)
    reuse: ReuseConfig = ReuseConfig()


@dataclass(frozen=True)
class RequestResult:
    latent: dict
    report: RunReport
    probe: Probe
    signature: Signature
    candidates: Candidates | None
    decision: Decision | None
    entry_id: str | None
    timings_ms: Mapping[str, float]

    @property
    def hit(self) -> bool:
        return self.report.decision == "hit"


def serve(model: Any, text_encoder: Any, positive, negative, latent: dict, spec: RequestSpec, store: Any,
          options: ServeOptions, progress: Callable[[int], None] | None = None) -> RequestResult:
    """Serve one request end to end. ``store`` is a ``cache.Store`` (or None for method "dense")."""
    from .risk.filter import decide

    t = {}
    t0 = time.perf_counter()
    objs, source = objects_for(spec.prompt, text_encoder, spec.objects)
    t["objects"] = (time.perf_counter() - t0) * 1000
    probe = run_probe(model, positive, negative, latent, seed=spec.seed, steps=spec.steps, cfg=spec.cfg,
                      sampler_name=spec.sampler, scheduler=spec.scheduler, prompt=spec.prompt, objects=objs,
                      object_source=source, config=options.probe, progress=progress)
    t["probe"] = probe.timings["probe_ms"]
    t1 = time.perf_counter()
    sig = build_signature(probe, options.signature)
    t["signature"] = (time.perf_counter() - t1) * 1000
    candidates = decision = None
    cached = None
    if options.method != "dense" and store is not None:
        ns = namespace_key(probe.model_fingerprint, probe.config)
        candidates = store.candidates(ns, probe.embedding, options.top_k)
        t["retrieval"] = candidates.retrieval_ms
        mode = {"carnator": "signature", "prompt_only": "prompt_only", "never": "never"}[options.method]
        decision = decide(sig, candidates, options.rule if mode == "signature" else None, mode,
                          options.prompt_threshold, model_fingerprint=probe.model_fingerprint,
                          config_fingerprint=probe.config.fingerprint(),
                          allow_uncertified=options.allow_uncertified)
        t["filter"] = decision.filter_ms
        if decision.accepted:
            cached = store.load(decision.candidate.entry_id).cached_run()
    samples, report = sample(model, positive, negative, latent, probe, decision, cached,
                             replace(options.reuse, mode=options.reuse_mode if decision is not None else "dense"),
                             target_signature=sig, record=options.write, progress=progress,
                             upstream_ms={k: v for k, v in t.items() if k != "probe"})
    t["resume"] = report.timings_ms["resume"]
    entry_id = None
    if options.write and store is not None and report.decision != "hit":
        t2 = time.perf_counter()
        entry_id = write_entry(store, probe, sig, samples, report)
        t["write"] = (time.perf_counter() - t2) * 1000
    t["total"] = (time.perf_counter() - t0) * 1000
    out = dict(latent)
    out["samples"] = samples
    return RequestResult(latent=out, report=report, probe=probe, signature=sig, candidates=candidates,
                         decision=decision, entry_id=entry_id, timings_ms=t)


def write_entry(store: Any, probe: Probe, sig: Signature, samples: Any, report: RunReport | None) -> str:
    """Persist a finished generation (what the Cache Writer node does)."""
    from .cache.store import EntryData

    data = EntryData(
        model_fingerprint=probe.model_fingerprint, config=probe.config, prompt=probe.prompt, seed=probe.seed,
        embedding=probe.embedding, signature=sig,
        tensors={"latent_final": samples[:1].float().cpu(), "x0_probe": probe.x0_probe.float().cpu(),
                 "latent_probe": probe.latent_probe.float().cpu()},
        block_structure=report.block_structure if report is not None else None,
        meta={"report": report.to_meta()} if report is not None else {},
    )
    return store.put(data)
