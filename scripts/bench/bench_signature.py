"""Benchmark the Early Signature's online cost: object extraction + Signature Builder, against a dense generation.

Run from the repository root with the host python:

    .host/venv/bin/python scripts/bench/bench_signature.py [--dense auto|embedded|tiny-wan-480p|none] [--json out.json]

Measures (wall clock, this machine; medians over repeats):
* spaCy pipeline load (once per process) and object extraction per prompt (embedded-world captions and, when
  ../shared/data/vidprom_4k.jsonl exists, VidProM prompts);
* build_signature on probes of the embedded geometry (latent [16, 8, 16, 16], patch (2, 2, 2)) and of Wan 2.1
  480p / 81 frames (latent [16, 21, 60, 104], patch (1, 2, 2)), 2 objects each;
* the serialized signature size at Wan 2.1 480p / 81 frames;
* the dense-generation denominator: the embedded model's default generation (when its weights exist), else a
  tiny random-weight Wan 2.1 (tests/tiny_models.py: dim 256, 4 layers) sampling a 480p/81-frame latent for
  20 euler steps at cfg 5 — a model thousands of times cheaper than Wan 2.1 1.3B, so the percentage against it
  is a loose upper bound of the real overhead.
Prints a JSON object and the markdown lines for BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def _register() -> None:
    """Import the repo as the package ``carnator`` (as ComfyUI and the tests do), without ComfyUI."""
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))
    from repo_package import register_package

    register_package()


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times)


def bench_extraction(n: int) -> dict:
    from carnator.carnator_core.embedded import world
    from carnator.carnator_core.objects import extract_objects, load_spacy

    t0 = time.perf_counter()
    load_spacy()
    load_ms = (time.perf_counter() - t0) * 1000.0
    rng = np.random.default_rng(0)
    captions = [world.caption(world.sample_scene(rng, p_two=0.5), rng) for _ in range(n)]
    out = {"spacy_load_ms": load_ms}

    def per_prompt(prompts):
        times = []
        for p in prompts:
            t = time.perf_counter()
            extract_objects(p)
            times.append((time.perf_counter() - t) * 1000.0)
        return {"n": len(prompts), "median_ms": statistics.median(times), "mean_ms": statistics.fmean(times)}

    out["embedded_captions"] = per_prompt(captions)
    vidprom = ROOT / ".." / "shared" / "data" / "vidprom_4k.jsonl"
    if vidprom.exists():
        rows = [json.loads(line) for line in vidprom.read_text(encoding="utf-8").split("\n") if line.strip()]
        out["vidprom"] = per_prompt([r["text"] for r in rows[:n]])
    return out


def _synthetic_probe(latent, patch, n_objects=2):
    from carnator.carnator_core.types import GenConfig, ObjectTokens, Probe

    c, t, h, w = latent
    grid = (-(-t // patch[0]), -(-h // patch[1]), -(-w // patch[2]))
    rng = np.random.default_rng(0)
    maps = {}
    zz, yy, xx = np.meshgrid(*(np.arange(g, dtype=np.float32) for g in grid), indexing="ij")
    for i in range(n_objects):  # a Gaussian blob of attention per object, plus noise
        cy, cx = (0.3 + 0.4 * i) * grid[1], (0.3 + 0.4 * i) * grid[2]
        blob = np.exp(-(((yy - cy) / (0.1 * grid[1])) ** 2 + ((xx - cx) / (0.1 * grid[2])) ** 2))
        maps[f"object{i}"] = (blob + 0.05 * rng.random(grid)).astype(np.float32)
    return Probe(arch="wan21", model_fingerprint="bench", config=GenConfig("wan21", latent, 20, "euler", "simple",
                                                                             5.0, "bench", 4),
                 prompt="bench", seed=0, objects=tuple(ObjectTokens(k, (k,), (i,)) for i, k in enumerate(maps)),
                 object_source="user", object_maps=maps, grid=grid, patch=patch,
                 x0_probe=rng.standard_normal(latent).astype(np.float32), latent_probe=None,
                 latent_rgb_factors=(0.1 * rng.standard_normal((c, 3))).astype(np.float32),
                 latent_rgb_bias=np.zeros(3, np.float32), embedding=np.zeros(8, np.float32))


def bench_signature(repeats: int) -> dict:
    from carnator.carnator_core.signature import build_signature, signature_bytes_at

    out = {}
    for name, latent, patch in (("embedded", (16, 8, 16, 16), (2, 2, 2)),
                                ("wan21_480p_81f", (16, 21, 60, 104), (1, 2, 2))):
        probe = _synthetic_probe(latent, patch)
        build_signature(probe)  # warm-up (imports, caches)
        out[name] = {"grid": list(probe.grid), "median_ms": _median_ms(lambda: build_signature(probe), repeats)}
    out["bytes_wan21_480p_81f_2obj"] = signature_bytes_at()
    return out


def _ensure_comfy() -> None:
    import conftest  # tests/conftest.py: ComfyUI host path + CPU flags

    conftest.ensure_comfy_importable()


def dense_tiny_wan_480p(steps: int = 20) -> dict:
    """Wall time of a plain KSampler run of the tiny Wan 2.1 on a 480p / 81-frame latent."""
    import tempfile

    import torch

    _ensure_comfy()
    import tiny_models as tm

    import nodes as comfy_nodes

    with tempfile.TemporaryDirectory() as d:
        model = tm.load_tiny_model("wan21", Path(d))
        pos, neg = tm.conditioning("wan21")
        latent = {"samples": torch.zeros(1, 16, 21, 60, 104)}
        t0 = time.perf_counter()
        comfy_nodes.common_ksampler(model, 0, steps, 5.0, "euler", "simple", pos, neg, latent)
        ms = (time.perf_counter() - t0) * 1000.0
    return {"what": f"tiny random-weight Wan 2.1 (dim 256, 4 layers), latent [16,21,60,104], {steps} euler steps, "
                    "cfg 5", "ms": ms}


def dense_embedded(repeats: int = 3) -> dict | None:
    """The embedded model's default generation (best of ``repeats``, ``comfy_glue.time_one_clip``), when its
    weights exist (else None)."""
    from carnator.carnator_core.embedded import config as ecfg

    if not ecfg.DEFAULT_WEIGHTS.exists():
        return None
    import torch

    _ensure_comfy()
    from carnator.carnator_core.embedded import comfy_glue

    # On a shared machine 2 intra-op threads can be slower than 1: take the faster setting, i.e. the smaller
    # denominator, so the reported percentage is the conservative one.
    before = torch.get_num_threads()
    per_threads = {}
    try:
        for n in sorted({1, before}):
            torch.set_num_threads(n)
            per_threads[n] = float(comfy_glue.time_one_clip(repeats=repeats)) * 1000.0
    finally:
        torch.set_num_threads(before)
    best = min(per_threads, key=per_threads.get)
    return {"what": f"embedded model default generation of one clip ({ecfg.DEFAULT_STEPS} {ecfg.DEFAULT_SAMPLER} "
                    f"steps, cfg {ecfg.DEFAULT_CFG}, stock sampling path; best of {repeats}, {best} torch "
                    f"thread(s), the faster of {sorted(per_threads)})", "ms": per_threads[best],
            "ms_per_threads": per_threads}


def machine() -> dict:
    def sh(cmd):
        try:
            return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"nproc": sh("nproc"), "cpu": sh("lscpu | grep 'Model name' | sed 's/.*: *//'"),
            "python": platform.python_version()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dense", default="auto", choices=["auto", "embedded", "tiny-wan-480p", "none"])
    ap.add_argument("--prompts", type=int, default=200, help="prompts per extraction set")
    ap.add_argument("--repeats", type=int, default=9, help="repeats per signature timing")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    _register()

    res = {"machine": machine(), "extraction": bench_extraction(args.prompts),
           "signature": bench_signature(args.repeats)}
    dense = None
    if args.dense in ("auto", "embedded"):
        dense = dense_embedded()
        if dense is None and args.dense == "embedded":
            raise SystemExit("the embedded model's weights or ComfyUI glue are not available yet")
    if dense is None and args.dense in ("auto", "tiny-wan-480p"):
        dense = dense_tiny_wan_480p()
    res["dense"] = dense

    ex = res["extraction"]
    sig = res["signature"]
    lines = [f"- machine: {res['machine']['nproc']} CPU cores, {res['machine']['cpu']}, Python "
             f"{res['machine']['python']}; command: `.host/venv/bin/python scripts/bench/bench_signature.py "
             f"--dense {args.dense}`",
             f"- spaCy pipeline load (once per process): {ex['spacy_load_ms']:.0f} ms",
             f"- object extraction, median per prompt: {ex['embedded_captions']['median_ms']:.1f} ms "
             f"(embedded captions, n={ex['embedded_captions']['n']})"
             + (f", {ex['vidprom']['median_ms']:.1f} ms (VidProM, n={ex['vidprom']['n']})" if "vidprom" in ex else ""),
             f"- build_signature, 2 objects, median of {args.repeats}: {sig['embedded']['median_ms']:.2f} ms at the "
             f"embedded geometry (grid {tuple(sig['embedded']['grid'])}), {sig['wan21_480p_81f']['median_ms']:.1f} ms "
             f"at Wan 2.1 480p/81f (grid {tuple(sig['wan21_480p_81f']['grid'])})",
             f"- signature size at Wan 2.1 480p/81f, 2 objects: {sig['bytes_wan21_480p_81f_2obj']['nbytes']} bytes "
             f"(tensors + JSON), {sig['bytes_wan21_480p_81f_2obj']['file_bytes']} bytes as a safetensors file"]
    if dense is not None:
        # Same geometry only: the dense run is the embedded model (or the tiny Wan at 480p), so compare it with the
        # signature at that geometry plus extraction of that model's kind of prompt.
        if "embedded" in dense["what"]:
            key, ext = "embedded", ex["embedded_captions"]["median_ms"]
            label = "embedded-geometry signature + caption extraction"
        else:
            key = "wan21_480p_81f"
            ext = ex.get("vidprom", ex["embedded_captions"])["median_ms"]
            label = "480p signature + prompt extraction"
        total = ext + sig[key]["median_ms"]
        res["overhead"] = {"geometry": key, "extraction_plus_signature_ms": total, "dense_ms": dense["ms"],
                           "pct": 100.0 * total / dense["ms"]}
        lines.append(f"- dense generation: {dense['what']}: {dense['ms'] / 1000:.2f} s")
        lines.append(f"- extraction + signature as % of that dense generation: {res['overhead']['pct']:.3f}% "
                     f"({label}: {total:.1f} ms)")
    print(json.dumps(res, indent=2))
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
