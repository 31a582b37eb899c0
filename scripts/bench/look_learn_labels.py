#!/usr/bin/env python
"""Look at learning mode's labels: re-create the served dense clip and the counterfactual reuse clip of recorded
labels, and write frames of both to look at.

    OMP_NUM_THREADS=1 nice -n 19 .host/venv/bin/python scripts/bench/look_learn_labels.py \\
        artifacts/learn_e2e artifacts/learn_e2e_rewording --out artifacts/look_learn_labels

Each argument is a work folder of ``scripts/bench/bench_learn.py`` (read only): its learning record is
``comfy/output/learn_e2e_cache/learn.sqlite`` (table ``labels``), the cache entries are in that cache folder, the
served latents in ``comfy/output/e2e/`` and ``requests.jsonl`` maps the requests to them. Learning mode keeps no
clip, so the clips are made again, in this process, on the embedded model (CPU):

1. The cache folder is copied to a temporary folder first (opening a cache scans and may write; the run's folder is
   never opened), and the labels are read from the copy (checksums verified).
2. Selected labels (default: every b and c label plus as many random 0 labels whose reuse ran, ``--seed``) are
   re-created with the settings of the graph the run queued (``workflows/api/embedded.json``'s Early Probe,
   Signature Builder and Joint Reuse Sampler inputs, as ``bench_learn.py`` queues it) through the same stage calls
   the nodes make: ``request.probe_request``, ``signature_stage``, ``reuse_stage`` under a not-accepted learning
   decision (the dense clip served), then what ``learn.runtime.observe`` runs for the label: the recorded candidate
   entry loaded from the cache, ``runtime._over_max_active``, ``request.finish_stages`` with the candidate forced
   as accepted (``record=False``, joint mode), and ``runtime.label_counterfactual`` with the judge
   ``runtime.judge_and_decoder`` picks (the pixel checker's second label), with the settings the label records
   (its checker reading; ``--judge current``: today's), against the **served** latent.
3. Checked, per label: the re-created dense latent against the served one (bit for bit, else the max |difference|)
   and the re-created label (x, whether the reuse ran) against the recorded one.
4. Written to ``--out``: ``<run>/<label id>_<b|c|0>_<stratum>.png`` (rows: the candidate's cached clip, the dense
   clip, the reuse clip, |reuse - dense| x ``--gain`` as grey; ``--frames`` frames, x ``--scale``
   nearest-neighbour), with ``--clips`` the three clips as uint8 ``.npz`` next to it, and ``summary.json`` /
   ``summary.md``: per label the judge's failures by check (shape, motion track, detail: blur / interior / ghost,
   background artifact, ...), the checker's readings of the failing objects, the detail and
   artifact numbers, PSNR of the reuse clip against the dense clip, and the reproduction checks.

Offline tooling: the runtime never imports this file.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from repo_package import register_package  # noqa: E402

register_package()

WORKFLOW = ROOT / "workflows" / "api" / "embedded.json"
CACHE_DIR = "learn_e2e_cache"  # bench_learn.py's cache folder name under comfy/output
LABEL_NAMES = {1: "b", -1: "c", 0: "0"}
ROWS = ("cache", "dense", "reuse", "|d|")


# ---------------------------------------------------------------------------------------------- pure helpers
def check_of(reason: str) -> str:
    """Which check a judge reason names (``judge.checker.verdict_of`` / ``CheckerJudge.judge_pair`` wording):
    "detail:blur" / "detail:interior" / "detail:ghost", "artifact" (background artifacts against the dense clip),
    "not found", "scene:<field>", else the object attribute ("shape", "motion", "colour", "size", "position")."""
    if reason.startswith("detail: "):
        return "detail:" + reason.split()[1]
    if "background artifacts" in reason:
        return "artifact"
    if reason.endswith(": not found"):
        return "not found"
    if reason.startswith("scene: "):
        return "scene:" + reason.split()[1]
    _, _, rest = reason.partition(": ")
    return rest.split()[0] if rest else reason


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR (dB) of two clips in [0, 1]; inf when equal."""
    mse = float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
    return math.inf if mse == 0.0 else 10.0 * math.log10(1.0 / mse)


def frame_indices(t: int, n: int) -> list[int]:
    """``n`` frame indices spread evenly over ``t`` frames (all of them when n >= t), first and last included."""
    if n >= t:
        return list(range(t))
    return sorted({int(round(i * (t - 1) / (n - 1))) for i in range(n)}) if n > 1 else [0]


def strip(cache: np.ndarray, dense: np.ndarray, reuse: np.ndarray, frames: Sequence[int], scale: int,
          gain: float = 2.0) -> np.ndarray:
    """uint8 image [4*H*scale, len(frames)*W*scale, 3]: rows = the candidate's cached clip, the dense clip, the reuse
    clip, |reuse - dense| (largest over RGB) x ``gain`` as grey; clips [T, H, W, 3] in [0, 1]."""
    for name, c in (("cache", cache), ("dense", dense), ("reuse", reuse)):
        if c.ndim != 4 or c.shape[-1] != 3 or c.shape != dense.shape:
            raise ValueError(f"the {name} clip is {c.shape}; every clip must be [T, H, W, 3] like the dense clip "
                             f"{dense.shape}")
    diff = np.repeat(np.abs(reuse - dense).max(-1, keepdims=True), 3, -1)
    rows = [np.concatenate([np.clip(x[t], 0.0, 1.0) for t in frames], 1) for x in (cache, dense, reuse, gain * diff)]
    img = np.concatenate(rows, 0)
    img = np.kron(img, np.ones((scale, scale, 1)))
    return (np.clip(img, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)


def save_strip(path: Path, img: np.ndarray, title: str = "", gain: float = 2.0,
               rows: Sequence[str] = ROWS) -> None:
    """The strip as a PNG with the row names (``rows``) in a left margin and ``title`` above (PIL's built-in
    font)."""
    from PIL import Image, ImageDraw

    margin, top = 44, (14 if title else 0)
    h = img.shape[0] // len(rows)
    canvas = Image.new("RGB", (img.shape[1] + margin, img.shape[0] + top), (255, 255, 255))
    canvas.paste(Image.fromarray(img), (margin, top))
    draw = ImageDraw.Draw(canvas)
    for i, name in enumerate(tuple(rows[:-1]) + (f"|d|x{gain:g}",)):
        draw.text((2, top + i * h + h // 2 - 5), name, fill=(0, 0, 0))
    if title:
        draw.text((2, 1), title[:200], fill=(0, 0, 0))
    path.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(path, optimize=True)


def select_labels(labels: Sequence[Any], zeros: int | None, seed: int) -> list[Any]:
    """Every b and c label (x != 0) plus ``zeros`` random 0 labels whose counterfactual reuse actually ran
    (``reusable``; a 0 label whose reuse continued dense has no reuse clip to look at), drawn with ``seed``;
    ``zeros`` None = as many as there are b and c labels. Returned in record order."""
    flagged = [lab for lab in labels if lab.x != 0]
    pool = [lab for lab in labels if lab.x == 0 and lab.reusable]
    n = len(flagged) if zeros is None else int(zeros)
    picked = random.Random(seed).sample(pool, min(n, len(pool)))
    keep = {id(lab) for lab in flagged + picked}
    return [lab for lab in labels if id(lab) in keep]


def served_latents(rows: Iterable[Mapping[str, Any]]) -> dict[tuple[str, int], tuple[str, str]]:
    """(prompt, seed) -> (the served latent's path under comfy/output, how it was served) from ``bench_learn.py``'s
    ``requests.jsonl`` rows: "dense" for a request the model ran, else "exact" for an exact repeat answered from the
    cache ("exact" / "node_cache"), whose latent is the stored dense result of an earlier run of the same request.
    A run that resumed after a kill re-queues the request it was serving: that request was served dense and
    labelled, but its row was not written, and the re-queued one was answered as an exact repeat."""
    out: dict[tuple[str, int], tuple[str, str]] = {}
    for r in rows:
        if not r.get("latent") or not str(r["latent"]).strip("/"):
            continue
        how = "exact" if r.get("mode") in ("exact", "node_cache") else "dense"
        key = (str(r["prompt"]), int(r["seed"]))
        if key not in out or (out[key][1] == "exact" and how == "dense"):
            out[key] = (str(r["latent"]), how)
    return out


def graph_settings(path: Path = WORKFLOW) -> dict[str, Any]:
    """The request, probe, signature and reuse settings of the graph ``bench_learn.py`` queues (the shipped
    embedded workflow), built from its node inputs exactly as the nodes' ``execute`` builds them."""
    from carnator.carnator_core.probe import ProbeConfig
    from carnator.carnator_core.reuse import ReuseConfig
    from carnator.carnator_core.signature import SignatureConfig
    from carnator.carnator_core.types import Stage

    g = json.loads(path.read_text(encoding="utf-8"))

    def inputs(cls: str) -> dict[str, Any]:
        (node,) = [n for n in g.values() if n["class_type"] == cls]
        return node["inputs"]

    p, s, r = inputs("CarnatorEarlyProbe"), inputs("CarnatorSignatureBuilder"), inputs("CarnatorJointReuseSampler")
    if str(p.get("capture_layers") or "").strip():
        raise ValueError("the workflow's Early Probe names capture_layers; this tool re-creates only the default")
    if not (isinstance(p["steps"], int) and isinstance(p["cfg"], (int, float))):
        raise ValueError("the workflow's Early Probe steps/cfg are links; this tool needs literal values")
    stage = Stage(int(p["start_at_step"]), int(p["end_at_step"]), p["add_noise"] != "disable",
                  p["return_with_leftover_noise"] == "enable")
    sampler_stage = Stage(int(r["start_at_step"]), int(r["end_at_step"]), r["add_noise"] != "disable",
                          r["return_with_leftover_noise"] == "enable")
    probe = ProbeConfig(probe_steps=p["probe_steps"], probe_fraction=p["probe_fraction"],
                        probe_sigma=p["probe_sigma"], layers=(), context_kv_mb=float(p["context_kv_mb"]))
    sig = SignatureConfig(baseline_quantile=float(s["baseline_quantile"]), low=float(s["mask_low"]),
                          high=float(s["mask_high"]), min_contrast=float(s["min_contrast"]),
                          smooth_sigma_t=float(s["smooth_sigma_t"]), smooth_sigma_hw=float(s["smooth_sigma_hw"]),
                          context_dilation=int(s["context_dilation"]),
                          context_grid=(int(s["context_rows"]), int(s["context_cols"])))
    reuse = ReuseConfig(mode=r["mode"], first_dense=r["dense_first_layers"], last_dense=r["dense_last_layers"],
                        refreshes=r["refreshes"], refresh_at=str(r.get("refresh_at") or ""),
                        x0_threshold=r["x0_threshold"], dilation=r["dilation"], max_active=r["max_active"],
                        block_size=r["block_size"], record_mass=r["record_mass"],
                        probe_context=bool(r["probe_context"]), motion_shift=float(r["motion_shift"]),
                        sparse_kernel=r["sparse_kernel"]).validate()
    return {"steps": int(p["steps"]), "cfg": float(p["cfg"]), "sampler": p["sampler_name"],
            "scheduler": p["scheduler"], "denoise": float(p["denoise"]), "objects": p.get("objects") or None,
            "stage": stage, "sampler_stage": sampler_stage, "probe": probe, "signature": sig, "reuse": reuse}


# ---------------------------------------------------------------------------------------------- re-creation
@dataclass
class Model:
    """The embedded model as the run's graph loads it (Embedded Model Loader, Text Encode, Empty Latent)."""

    model: Any
    encoder: Any
    latent: dict
    negative: Any

    @classmethod
    def load(cls, weights: str | None) -> "Model":
        from conftest import ensure_comfy_importable

        ensure_comfy_importable()
        from carnator.carnator_core.embedded import comfy_glue

        model, enc, _dec = comfy_glue.load_embedded(weights)
        return cls(model, enc, comfy_glue.empty_latent(1), enc.encode(""))


def _readings(clip: np.ndarray, prompt: str) -> list[dict[str, Any]]:
    """The strict checker's readings of each named object (what it saw), for the report."""
    from carnator.carnator_core.embedded import checker

    res = checker.check(clip, prompt, strict=True)
    keep = ("colour", "size", "position", "motion", "track_motion", "shape", "shape_guess", "shape_iou",
            "track_travel_xy", "track_monotone", "track_jump", "frames_found")
    out = []
    for o in res.objects:
        m = {k: o.measured[k] for k in keep if k in o.measured}
        out.append({"expected": str(getattr(o.expected, "shape", "")), "found": bool(o.found),
                    "ok": {k: getattr(o, f"{k}_ok") for k in ("colour", "size", "position", "motion", "shape")},
                    "measured": json.loads(json.dumps(m, default=lambda v: np.asarray(v).round(3).tolist()))})
    return out


def recreate(m: Model, gs: Mapping[str, Any], store: Any, lab: Any, served: Any,
             judge_from: str = "recorded") -> dict[str, Any]:
    """Re-create one label (module docstring, step 2). ``served``: the served dense samples [1, C, T, H, W].
    Returns the clips (decoded, [T, H, W, 3] in [0, 1]) and the measured facts."""
    import torch

    from carnator.carnator_core.judge.checker import object_detail
    from carnator.carnator_core.learn import runtime
    from carnator.carnator_core.request import (
        RequestSpec,
        finish_stages,
        probe_request,
        reuse_stage,
        signature_stage,
    )
    from carnator.carnator_core.types import Candidate, Decision

    t0 = time.perf_counter()
    pos = m.encoder.encode(lab.prompt)
    spec = RequestSpec(prompt=lab.prompt, seed=int(lab.seed), steps=gs["steps"], cfg=gs["cfg"], sampler=gs["sampler"],
                       scheduler=gs["scheduler"], objects=gs["objects"], denoise=gs["denoise"], stage=gs["stage"])
    # The Early Probe without the cache: the labelled request was not an exact repeat (it was labelled), and an
    # exact lookup here could only answer it from an entry written after it.
    probe = probe_request(m.model, pos, m.negative, m.latent, spec, gs["probe"], m.encoder)
    sig, _ = signature_stage(probe, gs["signature"])
    learning = Decision(accepted=False, candidate=None, verdicts=(), mode=runtime.LEARNING_MODE,
                        summary="learning: served dense (re-created)")
    dense, dense_rep = reuse_stage(m.model, pos, m.negative, m.latent, probe, learning, store, gs["reuse"],
                                   signature=sig, record=True, stage=gs["sampler_stage"])
    entry = store.load(lab.entry_id, count_hit=False)
    cached = entry.cached_run()
    cand = Candidate(entry_id=lab.entry_id, similarity=float(lab.similarity), prompt=entry.prompt,
                     signature=entry.signature, seed=entry.seed)
    acc = Decision(accepted=True, candidate=cand, verdicts=(), mode="signature",
                   summary="learning: the rule-to-be's reuse of its chosen candidate (counterfactual)")
    cfg = replace(gs["reuse"], mode="joint")
    judge, decode, why = runtime.judge_and_decoder(m.model, probe)
    if judge is None:
        raise RuntimeError(f"no judge for this model: {why}")
    if judge_from == "recorded" and str(lab.judge) == judge.name:
        # the label as it was made: the judge's settings the record names (an earlier checker reading included)
        from carnator.carnator_core.judge import judge_for

        judge = judge_for(m.model, "embedded", dict(lab.judge_settings))
    t1 = time.perf_counter()
    over = runtime._over_max_active(m.model, probe, sig, cached, cfg)  # noqa: SLF001 — the runtime's own test
    active = compute = None
    if over:
        out, reusable = served, False
    else:
        out, rep, _ = finish_stages(m.model, pos, m.negative, m.latent, probe, acc, store, cfg, signature=sig,
                                    record=False, cached=cached)
        reusable = rep.decision == "hit"
        active, compute = float(rep.active_fraction), float(rep.compute_fraction)
    x, lbl = 0, None
    if reusable:
        lbl = runtime.label_counterfactual(judge, decode, probe, str(cand.prompt), served, out)
        x = 1 if lbl.b else (-1 if lbl.c else 0)
    reuse_s = time.perf_counter() - t1
    dense_clip, reuse_clip = decode(served), decode(out)
    cache_clip = decode(entry.tensors["latent_final"].unsqueeze(0))
    if lbl is None:  # no reuse ran (or it continued dense): the judge's verdicts on the clips still say what it sees
        from carnator.carnator_core.judge.base import JudgeRequest, excess_label

        lbl = excess_label(judge, reuse_clip, dense_clip,
                           JudgeRequest(prompt=lab.prompt, seed=int(lab.seed), source_prompt=str(cand.prompt)))
    diff = (dense.float() - served.float()).abs()
    facts = {
        "x_recreated": x, "reusable_recreated": bool(reusable),
        "dense_bit_identical": bool(torch.equal(dense, served)), "dense_max_abs_diff": float(diff.max()),
        "dense_report": dense_rep.decision, "over_max_active": bool(over),
        "active_fraction": active, "compute_fraction": compute,
        "psnr_reuse_vs_dense_db": psnr(reuse_clip, dense_clip),
        "psnr_cache_vs_dense_db": psnr(cache_clip, dense_clip),
        "reuse_failed": sorted({check_of(r) for r in lbl.reuse.reasons}),
        "dense_failed": sorted({check_of(r) for r in lbl.dense.reasons}),
        "reuse_reasons": list(lbl.reuse.reasons), "dense_reasons": list(lbl.dense.reasons),
        "artifact": lbl.reuse.scores.get("artifact"), "artifact_dense": lbl.reuse.scores.get("artifact_dense"),
        "detail_reuse": object_detail(reuse_clip, lab.prompt), "detail_dense": object_detail(dense_clip, lab.prompt),
        "readings_reuse": _readings(reuse_clip, lab.prompt), "readings_dense": _readings(dense_clip, lab.prompt),
        "candidate_seed": entry.seed, "judge": judge.name, "judge_settings": dict(judge.settings),
        "reuse_s": round(reuse_s, 3), "total_s": round(time.perf_counter() - t0, 3),
    }
    return {"clips": (cache_clip, dense_clip, reuse_clip), "facts": facts}


# ---------------------------------------------------------------------------------------------- one run
def copy_cache(run: Path, tmp: Path) -> Path:
    """The run's cache folder copied under ``tmp`` (the run's own folder is only read)."""
    src = run / "comfy" / "output" / CACHE_DIR
    if not (src / "learn.sqlite").is_file():
        raise FileNotFoundError(f"{src / 'learn.sqlite'} not found: pass a work folder of scripts/bench/"
                                "bench_learn.py (it holds comfy/output/learn_e2e_cache/learn.sqlite)")
    dst = tmp / run.name / CACHE_DIR
    shutil.copytree(src, dst)
    return dst


def look_run(run: Path, out: Path, m: Model | None, gs: Mapping[str, Any], *, zeros: int | None, seed: int,
             frames: int, scale: int, tmp: Path, only: set[int] | None = None, gain: float = 2.0,
             clips: bool = False, judge_from: str = "recorded") -> list[dict[str, Any]]:
    """Re-create and write the selected labels of one bench_learn work folder; returns one row per label.
    ``clips``: also save the three clips (uint8, ``<label>.npz``: cache, dense, reuse) to look at again without
    generating."""
    from safetensors.torch import load_file

    from carnator.carnator_core.cache.store import Store
    from carnator.carnator_core.learn.labels import LabelStore

    cache = copy_cache(run, tmp)
    record = LabelStore(cache)
    try:
        (ns,) = record.namespaces()
        labels = record.labels(ns)
    finally:
        record.close()
    chosen = [lab for lab in labels if lab.id in only] if only else select_labels(labels, zeros, seed)
    rows = [json.loads(line) for line in (run / "requests.jsonl").read_text(encoding="utf-8").splitlines() if line]
    latents = served_latents(rows)
    counts = {LABEL_NAMES[x]: sum(lab.x == x for lab in labels) for x in (1, -1, 0)}
    print(f"{run.name}: {len(labels)} labels {counts}, {sum(not lab.reusable for lab in labels)} not reusable; "
          f"re-creating {len(chosen)}", flush=True)
    store = Store.open(cache, key_path=tmp / "index-hmac.key")  # a key outside the copy: never the user's
    if m is None:
        m = Model.load(None)
    result = []
    try:
        for lab in chosen:
            path, how = latents.get((lab.prompt, int(lab.seed)), ("", ""))
            if not path:
                print(f"  label {lab.id}: no served request with prompt {lab.prompt!r} and seed {lab.seed} in "
                      f"{run / 'requests.jsonl'}; skipped", flush=True)
                result.append({"run": run.name, "label_id": lab.id, "x": lab.x, "label": LABEL_NAMES[lab.x],
                               "error": "no served latent"})
                continue
            served = load_file(str(run / "comfy" / "output" / path))["latent_tensor"]
            r = recreate(m, gs, store, lab, served, judge_from)
            f = r["facts"]
            name = f"{lab.id:04d}_{LABEL_NAMES[lab.x]}_{lab.stratum}.png"
            cache_clip, dense_clip, reuse_clip = r["clips"]
            img = strip(cache_clip, dense_clip, reuse_clip, frame_indices(dense_clip.shape[0], frames), scale, gain)
            save_strip(out / run.name / name, img,
                       f"{run.name} label {lab.id} x={LABEL_NAMES[lab.x]} {lab.stratum}: {lab.prompt}", gain)
            if clips:
                np.savez_compressed(out / run.name / name.replace(".png", ".npz"),
                                    **{k: (np.clip(c, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)
                                       for k, c in zip(("cache", "dense", "reuse"), r["clips"])})
            row = {"run": run.name, "label_id": lab.id, "request_key": lab.request_key, "x": lab.x,
                   "label": LABEL_NAMES[lab.x], "reusable": lab.reusable, "stratum": lab.stratum,
                   "prompt": lab.prompt, "candidate_prompt": lab.candidate_prompt, "entry_id": lab.entry_id,
                   "seed": lab.seed, "similarity": lab.similarity, "served_latent": path, "served_as": how,
                   "recorded_judge": lab.judge, "recorded_judge_settings": dict(lab.judge_settings),
                   "png": f"{run.name}/{name}", "x_matches": f["x_recreated"] == lab.x,
                   "reusable_matches": f["reusable_recreated"] == lab.reusable, **f}
            result.append(row)
            print(f"  {name}: x {lab.x:+d} -> {f['x_recreated']:+d}; dense bit-identical {f['dense_bit_identical']} "
                  f"(max |d| {f['dense_max_abs_diff']:.3g}); reuse failed {f['reuse_failed']}, dense failed "
                  f"{f['dense_failed']}; PSNR {f['psnr_reuse_vs_dense_db']:.1f} dB; {f['total_s']:.1f} s", flush=True)
    finally:
        store.close()
    return result


# ---------------------------------------------------------------------------------------------- summary
def summarize(rows: Sequence[Mapping[str, Any]], meta: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """(summary JSON, markdown) of the re-created labels."""
    by: dict[str, dict[str, Any]] = {}
    for r in rows:
        s = by.setdefault(r["run"], {"labels": 0, "b": 0, "c": 0, "0": 0, "x_matches": 0, "reusable_matches": 0,
                                     "dense_bit_identical": 0, "dense_max_abs_diff": 0.0, "failed_checks_b": {},
                                     "not_recreated": 0})
        if "error" in r:
            s["not_recreated"] += 1
            continue
        s["labels"] += 1
        s[r["label"]] += 1
        s["x_matches"] += bool(r["x_matches"])
        s["reusable_matches"] += bool(r["reusable_matches"])
        s["dense_bit_identical"] += bool(r["dense_bit_identical"])
        s["dense_max_abs_diff"] = max(s["dense_max_abs_diff"], float(r["dense_max_abs_diff"]))
        if r["label"] == "b":
            for c in r["reuse_failed"]:
                s["failed_checks_b"][c] = s["failed_checks_b"].get(c, 0) + 1
    summary = {**meta, "runs": by, "labels": list(rows)}
    lines = ["# Learning labels looked at", "", f"Command: `{meta.get('command', '')}`", "",
             "| run | labels (b / c / 0) | x reproduced | dense bit-identical (max abs diff) | b: failed checks |",
             "|---|---|---|---|---|"]
    for run, s in by.items():
        lines.append(f"| {run} | {s['labels']} ({s['b']} / {s['c']} / {s['0']}) | {s['x_matches']} of {s['labels']} "
                     f"| {s['dense_bit_identical']} of {s['labels']} ({s['dense_max_abs_diff']:.3g}) | "
                     f"{', '.join(f'{k} {v}' for k, v in sorted(s['failed_checks_b'].items())) or '-'} |")
    lines += ["", "| png | x (re-created) | stratum | reuse failed | dense failed | PSNR reuse/dense dB | active | "
              "prompt ← candidate |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['run']} label {r['label_id']} | {r['label']} | not re-created: {r['error']} |")
            continue
        act = "-" if r["active_fraction"] is None else f"{r['active_fraction']:.2f}"
        lines.append(f"| {r['png']} | {r['label']} ({LABEL_NAMES[r['x_recreated']]}) | {r['stratum']} | "
                     f"{'; '.join(r['reuse_reasons']) or '-'} | {'; '.join(r['dense_reasons']) or '-'} | "
                     f"{r['psnr_reuse_vs_dense_db']:.1f} | {act} | {r['prompt']} ← {r['candidate_prompt']} |")
    return summary, "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="bench_learn.py work folders (read only)")
    ap.add_argument("--out", type=Path, default=ROOT / "artifacts" / "look_learn_labels", help="output folder")
    ap.add_argument("--zeros", type=int, default=None,
                    help="random 0 labels per run (default: as many as its b and c labels)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the 0 labels drawn (0)")
    ap.add_argument("--only", default="", help="comma-separated label ids (the record's row ids) instead")
    ap.add_argument("--frames", type=int, default=8, help="frames per row (8: all of the embedded model's)")
    ap.add_argument("--scale", type=int, default=3, help="nearest-neighbour enlargement (3)")
    ap.add_argument("--gain", type=float, default=2.0, help="gain of the |reuse - dense| row (2)")
    ap.add_argument("--clips", action="store_true", help="also save each label's clips (uint8 .npz)")
    ap.add_argument("--judge", choices=("recorded", "current"), default="recorded",
                    help="recorded: judge with the settings each label records (reproduces the record); current: "
                    "with today's second label (what a label made now would say)")
    ap.add_argument("--weights", default="", help="embedded weights (default: the shipped ones the run used)")
    ap.add_argument("--workflow", type=Path, default=WORKFLOW, help="the graph the run queued")
    args = ap.parse_args(argv)
    only = {int(t) for t in args.only.split(",") if t.strip()} or None
    gs = graph_settings(args.workflow)
    m = Model.load(args.weights or None)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="look_learn_labels_") as tmp:
        for run in args.runs:
            rows += look_run(run.resolve(), args.out, m, gs, zeros=args.zeros, seed=args.seed, frames=args.frames,
                             scale=args.scale, tmp=Path(tmp), only=only, gain=args.gain, clips=args.clips,
                             judge_from=args.judge)
    meta = {"command": " ".join(["scripts/bench/look_learn_labels.py", *(argv if argv is not None else sys.argv[1:])]),
            "runs_read": [str(r) for r in args.runs], "seed": args.seed, "zeros": args.zeros}
    summary, md = summarize(rows, meta)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=float), encoding="utf-8")
    (args.out / "summary.md").write_text(md, encoding="utf-8")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
