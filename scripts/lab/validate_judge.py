"""Validate the generation-native judge against the embedded pixel checker, where the truth is known.

    nice -n 10 .host/venv/bin/python scripts/lab/validate_judge.py --out artifacts/judge_val scenes --scenes 120
    nice -n 10 .host/venv/bin/python scripts/lab/validate_judge.py --out artifacts/judge_val pairs \\
        --pairs-work artifacts/judge_val/pairs_work --pairs-seed 52 --warm 24 --queries 48
    .host/venv/bin/python scripts/lab/validate_judge.py --out artifacts/judge_val report

Clips (all on the embedded model, default weights, 20 euler steps, its stock CFG):

* ``scenes``: per unit a held-out scene (its first object is a held-out shape/colour/position combination, 1-2
  objects), generated densely for its caption (seed s) together with two *wrong-scene* variants sharing the same
  noise (the same seed): an attribute-binding swap (two objects: colours / shapes / positions swapped; one object:
  that attribute changed), a size or background change, or a motion edit reused from a still scene (the caption
  moves, the clip is the still scene's). Plus a fresh dense sample of the same caption (another seed), judged as if
  it were a reuse (a legitimate difference: the label's floor). The checker judges every clip against the *target*
  caption; the native judge holds each variant against the same-seed dense clip (``judge_pair``, the variant's
  caption as the candidate's source prompt) and the dense clip alone (``judge``).
* ``pairs``: reuse clips of labelled pairs (``scripts/make_pairs.py --clips`` run in ``--pairs-work``: joint-reuse
  outputs of recalled candidates, and their requests' dense clips), judged the same way.
* ``report``: fits the native judge's thresholds on the calibration half (even units) and reports, on the
  validation half (odd units), detection of the checker's failures and false alarms on clips the checker passes,
  per attribute and for the excess label's b / c.

Resumable (rows are appended per unit; a rerun skips done units). Writes ``rows.jsonl``, ``clips/<unit>.npz``
(uint8) and ``report.json`` under ``--out``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import conftest  # noqa: E402  (registers the `carnator` package; knows where the host's ComfyUI is)
import numpy as np  # noqa: E402

PAIR_FEATURES = ("d_margin", "d_error", "d_scene", "d_where", "d_motion", "d_colour", "d_size", "d_presence",
                 "d_local")
ALONE_FEATURES = ("margin", "neg_presence")


# ------------------------------------------------------------------------------------------------ generation
def generate_same_noise(model, enc, prompts: list[str], seed: int):
    """Clips of ``prompts`` in one batch, every item with the noise KSampler draws for ``seed`` at batch 1 (so each
    equals that prompt's own same-seed run up to batching's float rounding). Returns (clips [B, T, H, W, 3],
    latents [B, C, T, h, w])."""
    import comfy.sample
    import torch

    from carnator.carnator_core.embedded import codec, comfy_glue, config as ecfg

    ver = comfy_glue.model_version(model)
    latent = comfy_glue.empty_latent(1, ver.name)["samples"]
    noise = comfy.sample.prepare_noise(latent, seed)
    b = len(prompts)
    positive = [[torch.cat([enc.encode(p)[0][0] for p in prompts]), {}]]
    samples = comfy.sample.sample(model, noise.repeat(b, 1, 1, 1, 1), ecfg.DEFAULT_STEPS, ver.cfg,
                                  ecfg.DEFAULT_SAMPLER, ecfg.DEFAULT_SCHEDULER, positive, enc.encode(""),
                                  latent.repeat(b, 1, 1, 1, 1), disable_pbar=True, seed=seed)
    return codec.latent_to_rgb(samples.float()).numpy(), samples.float()


def variants(scene, rng, frame):
    """(kind, edited scene) candidates of the wrong-scene kinds applicable to ``scene``."""
    from carnator.carnator_core.embedded import world

    objs = list(scene.objects)
    first = objs[0]
    out = []
    if len(objs) == 2:
        a, b = objs
        for attr in ("colour", "shape", "position"):
            if getattr(a, attr) != getattr(b, attr):
                out.append((f"{attr}_swap", replace(scene, objects=(replace(a, **{attr: getattr(b, attr)}),
                                                                   replace(b, **{attr: getattr(a, attr)})))))
    else:
        cs = [c for c in world.COLOURS if c != first.colour and world.compatible(c, scene.background)]
        out.append(("colour", replace(scene, objects=(replace(first, colour=cs[int(rng.integers(len(cs)))]),))))
        ss = [s for s in world.SHAPES if s != first.shape]
        out.append(("shape", replace(scene, objects=(replace(first, shape=ss[int(rng.integers(len(ss)))]),))))
        ps = [p for p in world.POSITIONS if p != first.position]
        out.append(("position", replace(scene, objects=(replace(first, position=ps[int(rng.integers(len(ps)))]),))))
    if first.motion != "still":
        out.append(("motion_from_still", replace(scene, objects=(replace(first, motion="still"), *objs[1:]))))
    out.append(("size", replace(scene, objects=(replace(first, size="big" if first.size == "small" else "small"),
                                                *objs[1:]))))
    bgs = [g for g in world.BACKGROUNDS if g != scene.background and all(world.compatible(o.colour, g) for o in objs)]
    if bgs:
        out.append(("background", replace(scene, background=bgs[int(rng.integers(len(bgs)))])))
    return [(k, s) for k, s in out if not world._overlaps(s, frame)]


# ------------------------------------------------------------------------------------------------ judging
def checker_row(cj, clip, caption):
    from carnator.carnator_core.judge import JudgeRequest

    v = cj.judge(clip, JudgeRequest(caption))
    return {"pass": v.passed, "reasons": list(v.reasons)}


def pair_scores(nj, reuse_m, dense_m) -> dict:
    v = nj.verdict_pair(reuse_m, dense_m)
    s = {k: float(v.scores[k]) for k in ("d_margin", "d_error", "d_scene")}
    for f in ("d_where", "d_motion", "d_colour", "d_size", "d_presence", "d_local"):
        vals = [float(x) for k, x in v.scores.items() if k.endswith("." + f)]
        s[f] = max(vals) if vals else 0.0
    s["margin_reuse"], s["margin_dense"] = reuse_m.margin, dense_m.margin
    return s


def alone_scores(m) -> dict:
    pres = [o.presence for o in m.objects.values()]
    return {"margin": m.margin, "error": m.error, "neg_presence": -min(pres) if pres else 0.0}


def _append(path: Path, row: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def _done(path: Path) -> set[str]:
    if not path.exists():
        return set()
    out = set()
    for line in path.read_text().splitlines():
        try:
            out.add(json.loads(line)["unit"])
        except (json.JSONDecodeError, KeyError):
            continue
    return out


def _setup(threads: int):
    conftest.ensure_comfy_importable()
    import torch

    torch.set_num_threads(threads)
    from carnator.carnator_core.embedded import codec, comfy_glue
    from carnator.carnator_core.judge import CheckerJudge
    from carnator.carnator_core.judge.native import NativeJudge

    model, enc, _ = comfy_glue.load_embedded()
    nj = NativeJudge(model, enc.encode, enc, vae_encode=lambda c: codec.rgb_to_latent(np.asarray(c))[None])
    return model, enc, nj, CheckerJudge(artifact_ratio=1.25)


def _u8(x: np.ndarray) -> np.ndarray:
    return (np.clip(np.asarray(x, np.float32), 0, 1) * 255 + 0.5).astype(np.uint8)


def run_scenes(args) -> None:
    from carnator.carnator_core.embedded import world
    from carnator.carnator_core.judge import JudgeRequest
    from carnator.carnator_core.lab.pairs import embedded_frame

    out = Path(args.out)
    clips_dir = out / "clips"
    clips_dir.mkdir(parents=True, exist_ok=True)
    if args.rejudge:  # judge saved clips again with today's judge (no generation); the report prefers these rows
        rows = out / "rows_rejudged.jsonl"
        done = _done(rows) | {f"s{i:04d}" for i in range(args.scenes) if not (clips_dir / f"s{i:04d}.npz").exists()}
    else:
        rows = out / f"rows{args.start or ''}.jsonl"
        done = set().union(*(_done(f) for f in out.glob("rows*.jsonl")))
    model, enc, nj, cj = _setup(args.threads)
    frame = embedded_frame()
    t_start = time.time()
    for i in range(args.start, args.scenes):
        unit = f"s{i:04d}"
        if unit in done:
            continue
        if args.limit_s and time.time() - t_start > args.limit_s:
            print("time limit reached; re-run to resume", flush=True)
            return
        t0 = time.perf_counter()
        rng = np.random.default_rng([args.seed, i])
        scene = world.sample_scene(rng, held_out=True, p_two=0.5, frame=frame)
        cap_seed, seed, seed2 = (int(x) for x in rng.integers(2**31, size=3))
        target = world.caption(scene, np.random.default_rng(cap_seed))
        cands = variants(scene, rng, frame)
        pick = [cands[int(j)] for j in rng.permutation(len(cands))[:args.variants]]
        vcaps = [world.caption(s, np.random.default_rng(cap_seed)) for _, s in pick]
        if args.rejudge:
            with np.load(clips_dir / f"{unit}.npz") as z:
                saved = [z[k] for k in ["dense"] + [f"v{k}" for k in range(len(vcaps) + 1)]]
            clips, fresh = np.stack(saved[:-1]), saved[-1][None]
        else:
            clips, _ = generate_same_noise(model, enc, [target] + vcaps, seed)
            fresh, _ = generate_same_noise(model, enc, [target], seed2)
            clips, fresh = _u8(clips), _u8(fresh)
        # judged as saved (uint8), so a rejudged unit sees exactly the clips its first judgement saw
        clips, fresh = clips.astype(np.float32) / 255.0, fresh.astype(np.float32) / 255.0
        dense = clips[0]
        caps = [target] + vcaps
        # every generated clip is a dense clip of its own caption (judged alone); each (target, variant) pair is a
        # wrong-scene case both ways round (the variant's clip under the target's caption and vice versa)
        alone_m = [nj.measure(c, JudgeRequest(cap, seed=seed)) for c, cap in zip(clips, caps)]
        alone = [{"caption": cap, "checker": checker_row(cj, c, cap), "scores": alone_scores(m)}
                 for c, cap, m in zip(clips, caps, alone_m)]
        base = {"part": "scene", "target": target, "seed": seed, "objects": len(scene.objects),
                "dense_checker": alone[0]["checker"], "dense_alone": alone[0]["scores"], "alone": alone}
        items = []
        for k, ((kind, _), vcap) in enumerate(zip(pick, vcaps), start=1):
            for t_idx, c_idx, name in ((0, k, kind), (k, 0, kind + "_rev")):
                tcap, ccap = caps[t_idx], caps[c_idx]
                req = JudgeRequest(tcap, seed=seed, source_prompt=ccap)
                ref = nj.measure(clips[t_idx], req)
                m = nj.measure(clips[c_idx], req)
                items.append({"kind": name, "target": tcap, "source": ccap,
                              "dense_checker": alone[t_idx]["checker"], "dense_alone": alone[t_idx]["scores"],
                              "checker": checker_row(cj, clips[c_idx], tcap),
                              "pair": pair_scores(nj, m, ref), "clip_alone": alone_scores(m)})
        m_fresh = nj.measure(fresh[0], JudgeRequest(target, seed=seed))
        alone.append({"caption": target, "checker": checker_row(cj, fresh[0], target),
                      "scores": alone_scores(nj.measure(fresh[0], JudgeRequest(target, seed=seed2)))})
        items.append({"kind": "fresh_seed", "source": None, "checker": checker_row(cj, fresh[0], target),
                      "pair": pair_scores(nj, m_fresh, alone_m[0]), "clip_alone": alone_scores(m_fresh)})
        if not args.rejudge:
            np.savez_compressed(clips_dir / f"{unit}.npz", dense=_u8(dense),
                                **{f"v{k}": _u8(c) for k, c in enumerate(list(clips[1:]) + [fresh[0]])})
        _append(rows, {"unit": unit, **base, "items": items, "seconds": round(time.perf_counter() - t0, 2)})
        print(f"{unit} {time.perf_counter() - t0:.1f} s dense_pass={alone[0]['checker']['pass']} "
              f"{[(it['kind'], it['checker']['pass']) for it in items]}", flush=True)


def run_pairs(args) -> None:
    from carnator.carnator_core.judge import JudgeRequest
    from carnator.carnator_core.lab import pairs

    out = Path(args.out)
    rows = out / "rows_pairs.jsonl"
    done = _done(rows)
    work = Path(args.pairs_work)
    frame = pairs.embedded_frame()
    warm, scenes = pairs.embedded_warm_set(args.pairs_seed, args.warm, frame)
    kinds = [k for k in pairs.QUERY_KINDS if k != "repeat"]
    queries = {q.request_id: q for q in pairs.embedded_queries(args.pairs_seed, args.queries, warm, scenes, kinds,
                                                               frame=frame)}
    prompts = {w.request_id: w.prompt for w in warm}
    store_to_warm: dict[str, str] = {}
    for f in sorted(work.glob("warm-*.jsonl")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            store_to_warm[r["entry_id"]] = r["request_id"]
    model, enc, nj, cj = _setup(args.threads)
    for f in sorted((work / "clips").glob("q*.npz")):
        rid = f.stem
        unit = f"p{rid}"
        if unit in done or rid not in queries:
            continue
        t0 = time.perf_counter()
        q = queries[rid]
        z = np.load(f)
        dense = z["dense"].astype(np.float32) / 255.0
        d_check = checker_row(cj, dense, q.prompt)
        alone = nj.measure(dense, JudgeRequest(q.prompt, seed=q.seed))
        items = []
        for key in z.files:
            if key in ("dense", "prompt") or key not in store_to_warm:
                continue
            src = prompts[store_to_warm[key]]
            clip = z[key].astype(np.float32) / 255.0
            req = JudgeRequest(q.prompt, seed=q.seed, source_prompt=None if src == q.prompt else src)
            ref = nj.measure(dense, req) if req.source_prompt is not None else alone
            m = nj.measure(clip, req)
            from carnator.carnator_core.judge import excess_label

            art = excess_label(cj, clip, dense, JudgeRequest(q.prompt))
            items.append({"kind": f"reuse_{q.kind}", "source": src, "entry": store_to_warm[key],
                          "checker": {"pass": art.reuse.passed, "reasons": list(art.reuse.reasons)},
                          "pair": pair_scores(nj, m, ref), "clip_alone": alone_scores(m)})
        _append(rows, {"unit": unit, "part": "pair", "target": q.prompt, "seed": q.seed, "objects": None,
                       "dense_checker": d_check, "dense_alone": alone_scores(alone), "items": items,
                       "seconds": round(time.perf_counter() - t0, 2)})
        print(f"{unit} {time.perf_counter() - t0:.1f} s {len(items)} reuse clips", flush=True)


# ------------------------------------------------------------------------------------------------ report
def _attr_of(reasons: list[str]) -> set[str]:
    out = set()
    for r in reasons:
        head = r.split(":", 1)[1].strip() if ":" in r else r
        word = head.split(" ", 1)[0]
        out.add("artifact" if "artifact" in r else ("not found" if "not found" in r else word))
    return out


def retruth(rows: list[dict], out: Path, pairs_work: Path | None, judge) -> None:
    """Replace every checker verdict in ``rows`` (in place) by ``judge``'s on the saved clips: a clip judged alone by
    ``judge.judge``, a clip held against its dense clip by ``excess_label`` (so the artifact and detail checks of the
    second label apply)."""
    from carnator.carnator_core.judge import JudgeRequest, excess_label

    def alone(clip, cap):
        v = judge.judge(clip, JudgeRequest(cap))
        return {"pass": v.passed, "reasons": list(v.reasons)}

    def against(clip, dense, cap):
        v = excess_label(judge, clip, dense, JudgeRequest(cap)).reuse
        return {"pass": v.passed, "reasons": list(v.reasons)}

    store_to_warm: dict[str, str] = {}
    if pairs_work is not None:
        for f in sorted(pairs_work.glob("warm-*.jsonl")):
            for line in f.read_text().splitlines():
                rec = json.loads(line)
                store_to_warm[rec["entry_id"]] = rec["request_id"]
    for r in rows:
        if r["part"] == "scene":
            with np.load(out / "clips" / f"{r['unit']}.npz") as z:
                c = {k: z[k].astype(np.float32) / 255.0 for k in z.files}
            n_var = len(c) - 2
            gen = [c["dense"]] + [c[f"v{k}"] for k in range(n_var)]
            caps = [a["caption"] for a in r["alone"][:n_var + 1]]
            for a, clip in zip(r["alone"], gen + [c[f"v{n_var}"]]):
                a["checker"] = alone(clip, a["caption"])
            r["dense_checker"] = r["alone"][0]["checker"]
            for k in range(n_var):
                fwd, rev = r["items"][2 * k], r["items"][2 * k + 1]
                fwd["checker"] = against(gen[k + 1], gen[0], caps[0])
                fwd["dense_checker"] = r["alone"][0]["checker"]
                rev["checker"] = against(gen[0], gen[k + 1], caps[k + 1])
                rev["dense_checker"] = r["alone"][k + 1]["checker"]
            r["items"][-1]["checker"] = against(c[f"v{n_var}"], gen[0], caps[0])
        elif pairs_work is not None:
            with np.load(pairs_work / "clips" / f"{r['unit'][1:]}.npz") as z:
                c = {k: z[k].astype(np.float32) / 255.0 for k in z.files if k != "prompt"}
            r["dense_checker"] = alone(c["dense"], r["target"])
            warm_to_store = {w: s_ for s_, w in store_to_warm.items() if s_ in c}
            for it in r["items"]:
                it["checker"] = against(c[warm_to_store[it["entry"]]], c["dense"], r["target"])


def _records(rows: list[dict]):
    """Pair records: dense passes the checker (where b is defined); label = the clip fails the checker."""
    recs = []
    for r in rows:
        split = "calib" if int(r["unit"][-1]) % 2 == 0 else "valid"
        for it in r["items"]:
            recs.append({"unit": r["unit"], "split": split, "kind": it["kind"], "part": r["part"],
                         "dense_pass": it.get("dense_checker", r["dense_checker"])["pass"],
                         "clip_pass": it["checker"]["pass"],
                         "attrs": sorted(_attr_of(it["checker"]["reasons"])), "x": it["pair"],
                         "dense_alone": it.get("dense_alone", r["dense_alone"]), "clip_alone": it["clip_alone"],
                         "source": it.get("source")})
    return recs


def _fires(x: dict, th: dict) -> bool:
    return any(x.get(f, 0.0) > th[f] for f in th)


def fit_thresholds(pos: list[dict], neg: list[dict], features, fa_target: float, det_target: float | None = None
                   ) -> dict:
    """Greedy coordinate search over per-feature quantiles of the negatives (any feature over its threshold flags):
    without ``det_target``, the most positives caught with at most ``fa_target`` of the negatives flagged; with it,
    the fewest negatives flagged while catching at least ``det_target`` of the positives (a label for certification
    pays for every false alarm on a legitimate reuse). Each threshold used then moves to the middle of the interval of
    values (over every observed value) that give the same calibration result, so it sits between the classes rather
    than on the last negative."""
    qs = (0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.98, 0.99, 1.0)
    grid = {f: sorted({float(np.quantile([n.get(f, 0.0) for n in neg], q)) for q in qs} | {float("inf")})
            for f in features}
    th = {f: float("inf") for f in features}

    def score(t):
        fa = np.mean([_fires(n, t) for n in neg]) if neg else 0.0
        det = np.mean([_fires(p, t) for p in pos]) if pos else 0.0
        if det_target is not None:  # fewest false alarms, then the most detections
            return (float(-fa) if det >= det_target - 1e-12 else -2.0), float(det)
        return (float(det) if fa <= fa_target else -1.0), float(-fa)  # most detections, then fewest false alarms

    best = score(th)
    for _ in range(4):
        improved = False
        for f in features:
            for v in grid[f]:
                t = {**th, f: v}
                s = score(t)
                if s > best:
                    th, best, improved = t, s, True
        if not improved:
            break
    for f in features:
        if not np.isfinite(th[f]):
            continue
        values = sorted({float(x.get(f, 0.0)) for x in pos + neg})
        same = [v for v in values if score({**th, f: v}) == best]
        above = [v for v in values if v > max(same)] if same else []
        if same:  # [lowest value giving the result, next observed value that changes it): its middle
            th[f] = (min(same) + (above[0] if above else max(same))) / 2.0
    return th


def _rate(xs) -> str:
    xs = list(xs)
    return f"{np.mean(xs) * 100:.0f}% ({sum(xs)}/{len(xs)})" if xs else "–"


def report(args) -> None:
    out = Path(args.out)
    by_unit: dict[str, dict] = {}
    for f in sorted(out.glob("rows*.jsonl"), key=lambda f: f.name == "rows_rejudged.jsonl"):  # rejudged rows last
        for x in f.read_text().splitlines():
            if x.strip():
                r = json.loads(x)
                by_unit[r["unit"]] = r
    rows = [by_unit[u] for u in sorted(by_unit)]
    if args.truth == "v2":
        from carnator.carnator_core.lab.pairs import embedded_checker_labeler

        retruth(rows, out, Path(args.pairs_work) if args.pairs_work else None,
                embedded_checker_labeler("request", 1.25, version=2).as_judge())
    recs = _records(rows)
    calib = [r for r in recs if r["split"] == "calib" and r["dense_pass"]]
    pos = [r["x"] for r in calib if not r["clip_pass"]]
    neg = [r["x"] for r in calib if r["clip_pass"]]
    th = fit_thresholds(pos, neg, PAIR_FEATURES, args.fa_target, args.det_target or None)
    # the judge alone (dense clips): thresholds on margin (vs the empty prompt) and presence
    def alone_recs(parity):
        out = []
        for r in rows:
            if int(r["unit"][-1]) % 2 != parity:
                continue
            out += r.get("alone") or [{"checker": r["dense_checker"], "scores": r["dense_alone"]}]
        return out

    dense_c = alone_recs(0)
    th_alone = fit_thresholds([a["scores"] for a in dense_c if not a["checker"]["pass"]],
                              [a["scores"] for a in dense_c if a["checker"]["pass"]], ALONE_FEATURES,
                              args.fa_target)
    valid = [r for r in recs if r["split"] == "valid" and r["dense_pass"]]
    lines = [f"thresholds (fitted on {len(calib)} calibration pairs, {len(pos)} checker failures): "
             + json.dumps({k: round(v, 4) for k, v in th.items()}),
             "", "| clips (validation half, dense passes the checker) | n | checker fails | native detects "
             "(of checker failures) | native false alarms (of checker passes) |", "|---|---|---|---|---|"]
    groups: dict[str, list] = {}
    for r in valid:
        groups.setdefault(r["kind"], []).append(r)
    for name, rs in sorted(groups.items()) + [("all", valid)]:
        f = [r for r in rs if not r["clip_pass"]]
        p = [r for r in rs if r["clip_pass"]]
        lines.append(f"| {name} | {len(rs)} | {len(f)} | {_rate(_fires(r['x'], th) for r in f)} | "
                     f"{_rate(_fires(r['x'], th) for r in p)} |")
    lines += ["", "| checker's failed attribute (validation) | n | native detects |", "|---|---|---|"]
    attrs = sorted({a for r in valid for a in r["attrs"]})
    for a in attrs:
        rs = [r for r in valid if a in r["attrs"] and not r["clip_pass"]]
        lines.append(f"| {a} | {len(rs)} | {_rate(_fires(r['x'], th) for r in rs)} |")
    # b / c on every validation record (dense may fail): checker's b/c vs the native judge's
    allv = [r for r in recs if r["split"] == "valid"]
    b_chk = [r["dense_pass"] and not r["clip_pass"] for r in allv]
    c_chk = [(not r["dense_pass"]) and r["clip_pass"] for r in allv]
    # the judge alone is off in the shipped defaults (it tells too few failing dense clips, see the line below), so
    # every dense clip passes it: native c is never produced
    d_nat = [True for r in allv]
    r_nat = [not _fires(r["x"], th) for r in allv]
    b_nat = [d and not c for d, c in zip(d_nat, r_nat)]
    c_nat = [(not d) and c for d, c in zip(d_nat, r_nat)]
    lines += ["", f"excess label on {len(allv)} validation pairs: checker b = {sum(b_chk)}, native b = {sum(b_nat)}, "
              f"both = {sum(x and y for x, y in zip(b_chk, b_nat))}; native b among checker b: "
              f"{_rate(y for x, y in zip(b_chk, b_nat) if x)}; native b among checker not-b: "
              f"{_rate(y for x, y in zip(b_chk, b_nat) if not x)}",
              f"c: checker c = {sum(c_chk)}, native c = {sum(c_nat)}, both = "
              f"{sum(x and y for x, y in zip(c_chk, c_nat))}"]
    dv = alone_recs(1)
    lines += ["", f"judge alone on the {len(dv)} validation dense clips (thresholds {json.dumps(th_alone)}): "
              f"detects {_rate(_fires(a['scores'], th_alone) for a in dv if not a['checker']['pass'])} "
              f"of the checker's failures, false alarms "
              f"{_rate(_fires(a['scores'], th_alone) for a in dv if a['checker']['pass'])}"]
    n_alone = sum(len(r.get("alone") or [1]) for r in rows)
    n_pairs = sum(len(r["items"]) for r in rows)
    n_clips = n_alone + n_pairs
    lines.insert(0, f"{len(rows)} units, {n_clips} clip judgements ({n_alone} alone, {n_pairs} against a dense "
                    f"clip; {sum(r['part'] == 'scene' for r in rows)} scene "
                    f"units, {sum(r['part'] == 'pair' for r in rows)} pair requests)")
    dis = [{"unit": r["unit"], "kind": r["kind"], "checker_pass": r["clip_pass"], "attrs": r["attrs"],
            "native_fires": [f for f in th if r["x"][f] > th[f]]}
           for r in valid if _fires(r["x"], th) == r["clip_pass"]]
    if args.pairs_file and Path(args.pairs_file).exists():
        lines += ["", *compare_certificates(Path(args.pairs_file), rows, th, th_alone, args.rule)]
    text = "\n".join(lines)
    print(text)
    (out / "report.json").write_text(json.dumps({"thresholds": th, "thresholds_alone": th_alone, "text": text,
                                                 "disagreements": dis}, indent=1))


def compare_certificates(pairs_file: Path, rows: list[dict], th: dict, th_alone: dict, rule_file: str) -> list[str]:
    """The pairs run's certificate under the shipped rule's thresholds, labelled by the checker (as the run labelled
    it) and by the native judge (b / c from the validation rows of the same clips)."""
    from dataclasses import replace as dc_replace

    from carnator.carnator_core.risk.certify import certify, read_pairs_jsonl
    from carnator.carnator_core.risk.rule import RiskRule

    _, labelled = read_pairs_jsonl(pairs_file)
    native: dict[tuple[str, str], tuple[bool, bool]] = {}
    second: dict[tuple[str, str], tuple[bool, bool]] = {}  # the checker verdicts of ``rows`` (--truth)
    for r in rows:
        if r["part"] != "pair":
            continue
        d_pass = r["dense_checker"]["pass"]
        for it in r["items"]:  # the judge alone is off (as shipped): the dense clip passes, so b = the pair verdict
            native[(r["unit"][1:], it["entry"])] = (_fires(it["pair"], th), False)
            second[(r["unit"][1:], it["entry"])] = (d_pass and not it["checker"]["pass"],
                                                    (not d_pass) and it["checker"]["pass"])
    both = [p for p in labelled if (p.request_id, p.entry_id) in native]
    relabelled = [dc_replace(p, unsafe=native[(p.request_id, p.entry_id)][0],
                             better=native[(p.request_id, p.entry_id)][1]) for p in both]
    truth = [dc_replace(p, unsafe=second[(p.request_id, p.entry_id)][0],
                        better=second[(p.request_id, p.entry_id)][1]) for p in both]
    rule = RiskRule.from_json(json.loads(Path(rule_file).read_text()), source=rule_file, allow_uncertified=True)
    out = [f"certificate of {rule_file}'s thresholds on the {len(both)} pairs of {pairs_file.name} judged both ways "
           "(excess label, alpha 0.05, delta 0.1):", "", "| label | accepted n | b | c | excess bound | b/n bound |",
           "|---|---|---|---|---|---|"]
    for name, ps in (("checker, first label (as the run labelled it)", both),
                     ("checker, the report's truth (--truth)", truth), ("native judge", relabelled)):
        c = certify(rule.thresholds, ps, 0.05, 0.1, label="excess")
        out.append(f"| {name} | {c.n} | {c.k} | {c.c} | {c.upper_bound:.3f} | "
                   f"{(c.unsafe_upper_bound if c.unsafe_upper_bound is not None else float('nan')):.3f} |")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=7301, help="seed of the held-out scenes (7301)")
    p.add_argument("--limit-s", type=float, default=0.0)
    sub = p.add_subparsers(dest="phase", required=True)
    s = sub.add_parser("scenes")
    s.add_argument("--scenes", type=int, default=120)
    s.add_argument("--start", type=int, default=0, help="first unit (a second worker takes a later range; its rows go "
                   "to rows<start>.jsonl)")
    s.add_argument("--variants", type=int, default=2, help="wrong-scene variants per scene (2)")
    s.add_argument("--rejudge", action="store_true", help="judge the saved clips of done units again (no generation)")
    q = sub.add_parser("pairs")
    q.add_argument("--pairs-work", required=True)
    q.add_argument("--pairs-seed", type=int, default=52)
    q.add_argument("--warm", type=int, default=24)
    q.add_argument("--queries", type=int, default=48)
    r = sub.add_parser("report")
    r.add_argument("--fa-target", type=float, default=0.08,
                   help="most false alarms (of the calibration half's checker passes) the fit may spend (0.08)")
    r.add_argument("--det-target", type=float, default=0.9,
                   help="instead: the fewest false alarms catching at least this share of the checker's failures "
                   "(0.9; 0 = use --fa-target)")
    r.add_argument("--truth", choices=("v1", "v2"), default="v2",
                   help="the checker verdicts to hold the judge against: v2 = the second label (strict checker: shape "
                   "gated, motion track; detail check and artifact ratio 1.25 against the dense clip), recomputed "
                   "from the saved clips; v1 = the verdicts recorded when the clips were judged (first checker)")
    r.add_argument("--pairs-work", default="", help="make_pairs --work folder of the pairs phase (its clips)")
    r.add_argument("--pairs-file", default="", help="the pairs run's JSONL (make_pairs --out) to certify both ways")
    r.add_argument("--rule", default=str(ROOT / "rules" / "embedded.json"), help="rule whose thresholds to apply")
    args = p.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    {"scenes": run_scenes, "pairs": run_pairs, "report": report}[args.phase](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
