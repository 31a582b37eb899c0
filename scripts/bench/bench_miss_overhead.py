#!/usr/bin/env python
"""What a cache miss costs on top of plain KSampler, on the embedded model (the dense-fallback overhead).

    .host/venv/bin/python scripts/bench/bench_miss_overhead.py [--repeats 8] [--threads 2]

One process, side by side in rotating order, medians of ``--repeats`` runs (each a new seed):

* ``ksampler``     ``comfy.sample.sample`` as ComfyUI's KSampler calls it (text encoding included).
* ``miss``         ``request.serve(method="never")``: object extraction, Early Probe, signature, retrieval from
                   an empty cache, dense resume with block recording — what a rejected request runs.
* ``miss+write``   the same and the Cache Writer (the entry is stored).
* ``miss+kv``      ``miss`` with the probe keeping every token's keys/values of its last call
                   (``context_kv_mb = RULE_CONTEXT_KV_MB``), as it does under a rule certified with ``probe_context``.

Prints per-variant medians, the ratio to KSampler, and the median per-stage timings of the miss path, so the
overhead can be split into per-step cost (probe + resume per model call vs KSampler per call) and fixed
per-request cost (everything else).
"""
from __future__ import annotations

import json
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

    from carnator.carnator_core.cache.store import Store
    from carnator.carnator_core.embedded import comfy_glue, config as ecfg
    from carnator.carnator_core.probe import ProbeConfig
    from carnator.carnator_core.request import RULE_CONTEXT_KV_MB, RequestSpec, ServeOptions, serve

    model, te, _dec = comfy_glue.load_embedded()
    steps, cfg = ecfg.DEFAULT_STEPS, float(ecfg.DEFAULT_CFG)
    prompt = "a big red ball moves to the right in the top left, on green grass"
    tmp = Path(tempfile.mkdtemp(prefix="carnator-miss-"))
    store = Store.open(tmp / "store", key_path=tmp / "key")

    def ksampler(seed: int) -> None:
        pos, neg = te.encode(prompt), te.encode("")
        lat = comfy_glue.empty_latent(1)["samples"]
        noise = comfy.sample.prepare_noise(lat, seed)
        comfy.sample.sample(model, noise, steps, cfg, ecfg.DEFAULT_SAMPLER, ecfg.DEFAULT_SCHEDULER, pos, neg, lat,
                            disable_pbar=True, seed=seed)

    def miss(seed: int, write: bool, kv_mb: float = 0.0) -> dict:
        probe = ProbeConfig(probe_steps=ecfg.DEFAULT_PROBE_STEP, context_kv_mb=kv_mb)
        opts = ServeOptions(method="never", write=write, probe=probe)
        spec = RequestSpec(prompt, seed, steps, cfg, ecfg.DEFAULT_SAMPLER, ecfg.DEFAULT_SCHEDULER)
        res = serve(model, te, te.encode(prompt), te.encode(""), comfy_glue.empty_latent(1), spec, store, opts)
        return dict(res.timings_ms)

    ksampler(1)
    miss(1, False)  # warm every lazy path once (spaCy, patches), not timed
    # miss+kv: the probe also keeps every token's keys/values of its last call, as it does under a rule certified
    # with probe_context (request.ServeOptions.following_rule), so a miss pays what serving with that rule pays.
    variants = ("ksampler", "miss", "miss+write", "miss+kv")
    wall: dict[str, list[float]] = {v: [] for v in variants}
    stages: list[dict] = []
    for r in range(args.repeats):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for v in order:
            seed = 1000 * (variants.index(v) + 1) + r  # every run a new seed: nothing is ever a cache hit
            t0 = time.perf_counter()
            if v == "ksampler":
                ksampler(seed)
            else:
                st = miss(seed, v == "miss+write", RULE_CONTEXT_KV_MB if v == "miss+kv" else 0.0)
                if v == "miss":
                    stages.append(st)
            wall[v].append(time.perf_counter() - t0)
    store.close()
    med = {v: statistics.median(x) for v, x in wall.items()}
    stage_med = {k: round(statistics.median(s.get(k, 0.0) for s in stages), 2) for k in stages[0]}
    out = {
        "repeats": args.repeats, "threads": args.threads, "steps": steps,
        "probe_steps": ecfg.DEFAULT_PROBE_STEP,
        "median_s": {v: round(m, 4) for v, m in med.items()},
        "ratio_to_ksampler": {v: round(m / med["ksampler"], 3) for v, m in med.items()},
        "ksampler_ms_per_step": round(1000 * med["ksampler"] / steps, 2),
        "miss_stage_ms_median": stage_med,
        "miss_ms_per_step_probe_resume": round((stage_med.get("probe", 0) + stage_med.get("resume", 0)) / steps, 2),
        "miss_untimed_ms": round(1000 * med["miss"] - stage_med.get("total", 0.0), 1),
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
