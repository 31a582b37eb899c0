#!/usr/bin/env python
"""An exact repeat answered from the cache vs dense generation, on the embedded model (default config).

    .host/venv/bin/python scripts/bench/bench_exact.py [--repeats 8] [--threads 2]

One process, side by side in rotating order, medians of ``--repeats`` runs of one request (default steps, cfg,
sampler), whose dense result was cached once beforehand:

* ``ksampler``  ``comfy.sample.sample`` as ComfyUI's KSampler calls it — the dense sampler, the bar.
* ``exact``     what the Early Probe + Joint Reuse Sampler nodes run on an exact repeat: the request key (model
                fingerprint, model options, sigma schedule, conditioning and latent digests), the indexed
                lookup, loading and verifying the entry (checksums), and returning the stored latent
                (``request.probe_request`` with the cache + ``request.reuse_stage``).
* ``serve``     ``request.serve(method="carnator")`` end to end on the same exact repeat (signature, recall and
                filter pass the answer through).
* ``hit_repeat``  ``request.serve`` on a repeat of a request that was itself a *hit* (the same prompt at another
                seed, prompt-only filter at 0.5, so it reused the cached entry once, beforehand): answered from the
                hit's answer-only entry (``keys.answer_key``). Checked bit-identical to that first hit, no model call.
* ``graph_hit_repeat``  the same repeat through the node graph's stages (Early Probe with the cache, Signature
                Builder, Retriever, Risk Filter, Joint Reuse Sampler with the cache), after the graph's first hit
                was kept by the Cache Writer under ``request.hit_answer_key``: the probe runs (its 4 model calls),
                the sampler answers from the stored hit. Checked bit-identical to the first hit, no sampler call.

Checks on every run that the exact answer is bit-identical to the KSampler latent and made no model call, and
prints medians and the speedup ratios.
"""
from __future__ import annotations

import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from side_by_side import setup  # noqa: E402  (registers the `carnator` package; knows where the host's ComfyUI is)


def main() -> int:
    args = setup(__doc__, repeats=8)
    import comfy.sample
    import torch

    from carnator.carnator_core.cache.store import Store
    from carnator.carnator_core.embedded import comfy_glue, config as ecfg
    from carnator.carnator_core.probe import ProbeConfig
    from carnator.carnator_core.request import (
        RequestSpec,
        ServeOptions,
        decide_stage,
        probe_request,
        recall,
        reuse_stage,
        serve,
        signature_stage,
        write_result,
    )
    from carnator.carnator_core.reuse import ReuseConfig

    model, te, _dec = comfy_glue.load_embedded()
    steps, cfg, seed = ecfg.DEFAULT_STEPS, float(ecfg.DEFAULT_CFG), 42
    prompt = "a big red ball moves to the right in the top left, on green grass"
    pos, neg = te.encode(prompt), te.encode("")
    latent = comfy_glue.empty_latent(1)
    tmp = Path(tempfile.mkdtemp(prefix="carnator-exact-"))
    store = Store.open(tmp / "store", key_path=tmp / "key")
    spec = RequestSpec(prompt, seed, steps, cfg, ecfg.DEFAULT_SAMPLER, ecfg.DEFAULT_SCHEDULER)
    options = ServeOptions(method="carnator", probe=ProbeConfig(probe_steps=ecfg.DEFAULT_PROBE_STEP))
    first = serve(model, te, pos, neg, latent, spec, store, ServeOptions(method="never", write=True,
                                                                         probe=options.probe))
    assert first.entry_id and not first.exact, "the first run must compute and store the dense result"
    hit_spec = RequestSpec(prompt, seed + 1, steps, cfg, ecfg.DEFAULT_SAMPLER, ecfg.DEFAULT_SCHEDULER)
    hit_options = ServeOptions(method="prompt_only", prompt_threshold=0.5, probe=options.probe)
    first_hit = serve(model, te, pos, neg, latent, hit_spec, store, hit_options)
    assert first_hit.hit and not first_hit.exact, f"the other seed must be a hit: {first_hit.report.reason}"
    hit_ms = first_hit.timings_ms["total"]

    def graph_stages():  # what the node graph runs on the hit's request (no serving options reach its probe)
        probe = probe_request(model, pos, neg, latent, hit_spec, options.probe, te, store=store)
        sig, _ = signature_stage(probe, options.signature)
        decision = decide_stage(sig, recall(store, probe, 5, 0.0), probe, method="prompt_only", prompt_threshold=0.5)
        samples, report = reuse_stage(model, pos, neg, latent, probe, decision, store, hit_options.hit_reuse,
                                      signature=sig, answer_hits=True)
        return probe, sig, samples, report

    probe_g, sig_g, samples_g, report_g = graph_stages()
    assert report_g.decision == "hit" and report_g.mode != "exact" and report_g.answer_key
    assert torch.equal(samples_g, first_hit.latent["samples"]), "the graph's hit differs from serve's"
    assert write_result(store, probe_g, sig_g, samples_g, report_g, answer_key=report_g.answer_key).entry_id

    calls = []
    dm = model.model.diffusion_model
    forward = dm.forward

    def counting(*a, **k):
        calls.append(1)
        return forward(*a, **k)

    dm.forward = counting
    ref = {}

    def ksampler() -> None:
        lat = latent["samples"]
        noise = comfy.sample.prepare_noise(lat, seed)
        ref["samples"] = comfy.sample.sample(model, noise, steps, cfg, ecfg.DEFAULT_SAMPLER, ecfg.DEFAULT_SCHEDULER,
                                             pos, neg, lat, disable_pbar=True, seed=seed)

    def exact() -> None:
        n = len(calls)
        probe = probe_request(model, pos, neg, latent, spec, options.probe, te, store=store)
        samples, report = reuse_stage(model, pos, neg, latent, probe, None, store, ReuseConfig(mode="joint"))
        assert probe.answered is not None and report.mode == "exact" and len(calls) == n
        ref["exact"] = samples

    def end_to_end() -> None:
        n = len(calls)
        res = serve(model, te, pos, neg, latent, spec, store, options)
        assert res.exact and len(calls) == n
        ref["serve"] = res.latent["samples"]

    def hit_repeat() -> None:
        n = len(calls)
        res = serve(model, te, pos, neg, latent, hit_spec, store, hit_options)
        assert res.exact and res.probe.answered.answer_of == first.entry_id and len(calls) == n
        ref["hit_repeat"] = res.latent["samples"]

    def graph_hit_repeat() -> None:
        n = len(calls)
        _, _, samples, report = graph_stages()
        assert report.mode == "exact" and len(calls) - n == options.probe.probe_steps
        ref["graph_hit_repeat"] = samples

    variants = {"ksampler": ksampler, "exact": exact, "serve": end_to_end, "hit_repeat": hit_repeat,
                "graph_hit_repeat": graph_hit_repeat}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():  # warm-up (imports, allocator)
        fn()
    for r in range(args.repeats):
        order = list(variants)[r % len(variants):] + list(variants)[: r % len(variants)]
        for name in order:
            t0 = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - t0)
        assert torch.equal(ref["exact"], ref["samples"]) and torch.equal(ref["serve"], ref["samples"])
        assert torch.equal(ref["hit_repeat"], first_hit.latent["samples"])
        assert torch.equal(ref["graph_hit_repeat"], first_hit.latent["samples"])
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    out = {
        "machine": f"{platform.machine()} {platform.processor() or ''} torch {torch.__version__}, "
                   f"{args.threads} threads",
        "steps": steps, "repeats": args.repeats, "median_ms": med,
        "speedup_exact_vs_ksampler": med["ksampler"] / med["exact"],
        "speedup_serve_vs_ksampler": med["ksampler"] / med["serve"],
        "speedup_hit_repeat_vs_ksampler": med["ksampler"] / med["hit_repeat"],
        "speedup_graph_hit_repeat_vs_ksampler": med["ksampler"] / med["graph_hit_repeat"],
        "first_hit_ms": hit_ms, "first_hit_compute_fraction": first_hit.report.compute_fraction,
        "bit_identical": True, "model_calls_on_exact": 0,
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
