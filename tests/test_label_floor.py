"""The label's floor measurement (lab/floor.py, scripts/lab/measure_label_floor.py): a fresh dense sample at another
seed judged as a reuse with the pairs labelling's own function.

Fast: the per-stratum summary on hand-made records (counts and bounds as risk.bounds computes them). With the
embedded model (a handful of requests): the records' structure, that a clip judged against itself gives b = c = 0,
that a fresh clip which lost every object is charged (b wherever dense passes) and that one with high-frequency
noise on its background is flagged by the artifact measure; the script end to end, resumed.
"""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest

from carnator.carnator_core.lab import floor, pairs
from carnator.carnator_core.risk.bounds import clopper_pearson_upper, excess_upper_bound

ROOT = Path(__file__).resolve().parents[1]


def _rec(i: int, objects: int, kind: str, b: bool, c: bool, b_chk: bool, c_chk: bool,
         art: bool = False) -> floor.FloorRecord:
    return floor.FloorRecord(f"q{i:04d}", kind, objects, "p", i, i + 1, b, c, b_chk, c_chk, art,
                             ("o0.size",) if c or c_chk else (), ("o0.size",) if b or b_chk else (), 4.0, 3.0)


def test_summary_counts_and_bounds_per_stratum():
    recs = ([_rec(i, 1, "paraphrase", True, False, True, False) for i in range(3)]
            + [_rec(3, 1, "paraphrase", True, False, False, False, art=True)]  # b only through the artifact
            + [_rec(4, 1, "colour", False, False, False, True, art=True)]  # a c the artifact measure removed
            + [_rec(5 + i, 1, "colour", False, True, False, True) for i in range(2)]
            + [_rec(10 + i, 2, "colour", False, False, False, False) for i in range(5)])
    s = floor.summarize_floor(recs, alpha=0.05, delta=0.1)
    assert list(s)[:3] == ["all", "1obj", "2obj"]
    assert {"1obj/paraphrase", "1obj/colour", "2obj/colour"} <= set(s)
    one = s["1obj"]
    assert one["n"] == 7
    assert (one["full"]["b"], one["full"]["c"]) == (4, 2)
    assert (one["checker"]["b"], one["checker"]["c"]) == (3, 3)
    assert one["b_from_artifact"] == 1 and one["c_lost_to_artifact"] == 1 and one["artifact_flagged"] == 2
    # the hand-made records score 4.0 vs 3.0 (ratio 1.33) over the shared background: flagged at 1.25, not at 1.5
    both = [floor.FloorRecord(**{**r.to_row(), "artifact_both": 4.0, "artifact_dense_both": 3.0}) for r in recs]
    assert floor.summarize_floor(both)["1obj"]["artifact_flagged_both_bg"] == 7
    assert floor.summarize_floor(both, artifact_ratio=1.5)["1obj"]["artifact_flagged_both_bg"] == 0
    assert one["artifact_flagged_both_bg"] == 0  # no shared-background scores recorded
    assert one["full"]["b_upper"] == pytest.approx(clopper_pearson_upper(4, 7, 0.1), abs=1e-4)
    assert one["full"]["excess_upper"] == pytest.approx(excess_upper_bound(7, 4, 2, 0.1), abs=1e-4)
    assert one["full"]["certifies"] is False
    assert s["2obj"]["full"]["b"] == 0 and s["all"]["n"] == 12
    assert sum(v["n"] for k, v in s.items() if k.count("/") == 1) == 12


def test_other_seed_differs_and_is_deterministic():
    seeds = [0, 1, 7, 2**31 - 1]
    assert all(floor.other_seed(s) != s for s in seeds)
    assert [floor.other_seed(s) for s in seeds] == [floor.other_seed(s) for s in seeds]
    assert floor.other_seed(5, salt=1) != floor.other_seed(5, salt=2)


def test_the_floor_is_a_property_of_the_request_label():
    with pytest.raises(ValueError, match="request-level"):
        floor.judge_fresh(pairs.embedded_checker_labeler("attribute"), np.zeros((8, 32, 32, 3)),
                          np.zeros((8, 32, 32, 3)), "a red ball on green grass")


@pytest.fixture(scope="module")
def embedded(comfy_env):
    import torch

    from carnator.carnator_core.embedded import comfy_glue

    # Two threads, as the quality gate (tests/test_embedded_gate.py): about half the time of one on an idle 2-core
    # machine, with the same bits (tests/conftest.py restores the count for later modules).
    torch.set_num_threads(2)
    model, _enc, _dec = comfy_glue.load_embedded()
    cache: dict[tuple[str, int], np.ndarray] = {}

    def gen(prompt: str, seed: int) -> np.ndarray:
        if (prompt, seed) not in cache:
            cache[(prompt, seed)] = comfy_glue.generate([prompt], seed=seed, model=model).clips[0].numpy()
        return cache[(prompt, seed)]

    warm, scenes = pairs.embedded_warm_set(0, 60)
    reqs = pairs.embedded_queries(0, 4, warm, scenes)
    return gen, reqs


@pytest.mark.comfy
def test_fresh_dense_samples_on_the_embedded_model(embedded):
    from carnator.carnator_core.embedded import world
    from carnator.carnator_core.lab.metrics import background_mask

    gen, reqs = embedded
    lab = pairs.embedded_checker_labeler("request", 1.25)
    seen = []
    recs = floor.measure_floor(reqs, gen, lab, background_mask, on_record=lambda r, d, f: seen.append(r.request_id))
    assert [r.request_id for r in recs] == [q.request_id for q in reqs] == seen
    for r, q in zip(recs, reqs):
        assert (r.prompt, r.seed, r.kind) == (q.prompt, q.seed, q.kind)
        assert r.fresh_seed == floor.other_seed(q.seed) != q.seed
        assert r.objects == len(world.parse_caption(q.prompt).objects) in (1, 2)
        assert r.stratum == f"{r.objects}obj/{q.kind}"
        assert not (r.b and r.c) and not (r.b_checker and r.c_checker)
        assert r.b_checker == (bool(r.fresh_failed) and not r.dense_failed)
        assert r.c_checker == (bool(r.dense_failed) and not r.fresh_failed)
        if not r.artifact_failed:
            assert (r.b, r.c) == (r.b_checker, r.c_checker)
        assert r.artifact_failed == (r.artifact > 1.25 * r.artifact_dense)
        assert r.artifact is not None and r.artifact_dense is not None and r.artifact_both is not None
    assert floor.summarize_floor(recs)["all"]["n"] == len(reqs)

    # the same clip judged against itself: nothing to charge, nothing to credit, no artifact flag
    same = floor.measure_floor(reqs, lambda p, s: gen(p, next(q.seed for q in reqs if q.prompt == p)), lab,
                               background_mask)
    assert all(not (r.b or r.c or r.b_checker or r.c_checker or r.artifact_failed) for r in same)
    assert all(r.dense_failed == r.fresh_failed for r in same)

    # a fresh clip that lost its objects (the background only) fails wherever dense passes: b, never c
    def blank(p: str, s: int) -> np.ndarray:
        d = gen(p, next(q.seed for q in reqs if q.prompt == p))
        return d if s != floor.other_seed(next(q.seed for q in reqs if q.prompt == p)) else \
            np.broadcast_to(np.median(d.reshape(-1, 3), 0), d.shape).copy()

    lost = floor.measure_floor(reqs, blank, lab, background_mask)
    assert all(r.fresh_failed and r.b_checker == (not r.dense_failed) and not r.c for r in lost)
    assert any(r.b for r in lost)  # at least one of the dense clips passes (else the check above is vacuous)

    # a fresh clip with a checkerboard on it: the artifact measure flags it, whatever the checker says
    def noisy(p: str, s: int) -> np.ndarray:
        s0 = next(q.seed for q in reqs if q.prompt == p)
        d = gen(p, s0)
        if s == s0:
            return d
        board = (np.indices(d.shape[1:3]).sum(0) % 2)[None, :, :, None] * 0.1 - 0.05
        return np.clip(d + board, 0.0, 1.0)

    flagged = floor.measure_floor(reqs, noisy, lab, background_mask)
    assert all(r.artifact_failed and not r.c for r in flagged)
    assert all(r.b for r in flagged if not r.dense_failed)
    # with the artifact measure off the same pairs are judged by the checker alone
    off = floor.measure_floor(reqs, noisy, pairs.embedded_checker_labeler("request", None), background_mask)
    assert all(not r.artifact_failed and (r.b, r.c) == (r.b_checker, r.c_checker) for r in off)


def _script():
    path = ROOT / "scripts" / "lab" / "measure_label_floor.py"
    spec = importlib.util.spec_from_file_location("measure_label_floor", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.comfy
@pytest.mark.slow
def test_script_writes_rows_and_summary_and_resumes(comfy_env, tmp_path, capsys):
    mod = _script()
    out, js = tmp_path / "rows.jsonl", tmp_path / "floor.json"
    # --threads 2: not part of the run's configuration (RUN_KEYS), only faster than the default 1 on 2 idle cores
    argv = ["--queries", "2", "--warm", "10", "--threads", "2", "--out", str(out), "--json", str(js)]
    assert mod.main(argv) == 0
    lines = out.read_text().splitlines()
    assert json.loads(lines[0])["type"] == "header" and len(lines) == 3
    summary = json.loads(js.read_text())
    assert summary["requests"] == 2 and summary["summary"]["all"]["n"] == 2
    assert set(summary["summary"]["all"]) >= {"full", "checker", "artifact_flagged", "b_from_artifact"}
    # resumed: nothing is generated again, the summary is the same
    capsys.readouterr()
    assert mod.main(argv) == 0
    assert not re.search(r"^\[\d+/", capsys.readouterr().out, re.M)  # no per-request progress line
    assert out.read_text().splitlines() == lines
    assert json.loads(js.read_text())["summary"] == summary["summary"]
    # another configuration with the same file is refused
    with pytest.raises(SystemExit, match="written with"):
        mod.main(["--queries", "3", "--warm", "10", "--out", str(out)])


def test_script_objects_filter_keeps_the_stream_order():
    from carnator.carnator_core.embedded import world

    mod = _script()
    args = mod.build_parser().parse_args(["--objects", "2", "--warm", "200", "--queries", "6"])
    got = mod.requests(args)
    warm, scenes = pairs.embedded_warm_set(0, 200)
    stream = [q for q in pairs.embedded_queries(0, 400, warm, scenes)
              if len(world.parse_caption(q.prompt).objects) == 2]
    assert len(got) == 6 and got == stream[:6]
    one = mod.requests(mod.build_parser().parse_args(["--objects", "1", "--warm", "200", "--queries", "6"]))
    assert all(len(world.parse_caption(q.prompt).objects) == 1 for q in one)
    with pytest.raises(SystemExit, match="raise --warm"):  # a warm set of one two-object scene
        mod.requests(mod.build_parser().parse_args(["--objects", "1", "--warm", "1", "--queries", "2"]))
