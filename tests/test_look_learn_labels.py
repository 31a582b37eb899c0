"""scripts/bench/look_learn_labels.py: re-creating learning mode's labels to look at them.

* The strip's rows are the candidate's cached clip, the dense clip, the reuse clip and |reuse - dense| x 2, frame by
  frame; the checks a label failed are read from the judge's real wording (clips rendered from the embedded world,
  where the verdicts are known in advance); the labels looked at are every b and c plus as many seeded 0 labels
  whose reuse ran; a request served again as an exact repeat after a resume still finds its served latent.
* One label end to end (embedded model, in process, a short schedule): a request served dense in learning mode and
  labelled by ``learn.runtime.observe`` — the runtime's own labelling — is re-created by the tool from the work
  folder alone: the same dense latent bit for bit, the same label, the same verdict on whether the reuse ran.
"""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from carnator.carnator_core.embedded import world
from carnator.carnator_core.judge import SECOND_LABEL, JudgeRequest, excess_label, judge_for
from carnator.carnator_core.learn.labels import Label

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

import look_learn_labels as look  # noqa: E402

SCENE = world.Scene((world.ObjectSpec("ball", "red", "big", "top left", "right"),), "grass")
CAPTION = "a big red ball moves to the right in the top left, on green grass"


def test_strip_rows_are_cache_dense_reuse_and_the_doubled_difference():
    t, h, w = 4, 2, 3
    cache = np.full((t, h, w, 3), 0.1)
    dense = np.full((t, h, w, 3), 0.5)
    reuse = dense.copy()
    reuse[2, 1, 0, 1] = 0.8  # one pixel of frame 2 differs by 0.3 in green
    img = look.strip(cache, dense, reuse, [0, 2], scale=2)
    assert img.shape == (4 * h * 2, 2 * w * 2, 3) and img.dtype == np.uint8
    rows = [img[i * h * 2:(i + 1) * h * 2] for i in range(4)]
    assert (rows[0] == 26).all() and (rows[1] == 128).all()  # 0.1 and 0.5 of 255
    assert rows[2][2:4, 6:8, 1].tolist() == [[204, 204], [204, 204]]  # frame 2 is the second column block
    assert (rows[2][:, :, [0, 2]] == 128).all()
    diff = rows[3]
    assert (diff[2:4, 6:8] == 153).all()  # |0.3| x 2 = 0.6, as grey
    diff[2:4, 6:8] = 0
    assert not diff.any()
    with pytest.raises(ValueError, match="reuse clip"):
        look.strip(cache, dense, reuse[:3], [0], scale=1)


def test_save_strip_keeps_the_strip_right_of_the_row_names(tmp_path: Path):
    from PIL import Image

    img = look.strip(np.zeros((2, 4, 4, 3)), np.ones((2, 4, 4, 3)), np.ones((2, 4, 4, 3)), [0, 1], scale=2)
    look.save_strip(tmp_path / "a" / "s.png", img, "title")
    back = np.asarray(Image.open(tmp_path / "a" / "s.png").convert("RGB"))
    assert back.shape == (img.shape[0] + 14, img.shape[1] + 44, 3)
    assert (back[14:, 44:] == img).all()


def test_failed_checks_are_read_from_the_judges_own_reasons():
    """The second label's judge on rendered clips: a wrong colour, a wrong motion, a ghost away from the object and
    background artifacts each come out as their check."""
    judge = judge_for(None, "embedded", SECOND_LABEL)
    req = JudgeRequest(prompt=CAPTION)
    dense = world.render(SCENE)[0]

    def failed(reuse: np.ndarray) -> set[str]:
        lab = excess_label(judge, reuse, dense, req)
        assert lab.b, lab.reuse.reasons
        return {look.check_of(r) for r in lab.reuse.reasons}

    obj = SCENE.objects[0]
    assert "colour" in failed(world.render(replace(SCENE, objects=(replace(obj, colour="yellow"),)))[0])
    assert "motion" in failed(world.render(replace(SCENE, objects=(replace(obj, motion="still"),)))[0])
    ghost = dense.copy()
    ghost[:, 40:45, 40:45] = 1.0  # a white patch far from the ball, in every frame
    assert "detail:ghost" in failed(ghost)
    rng = np.random.default_rng(0)
    noisy = np.clip(dense + rng.normal(0.0, 0.08, dense.shape), 0.0, 1.0).astype(np.float32)
    assert "artifact" in failed(noisy)
    assert look.check_of("cube: not found") == "not found"
    assert look.check_of("scene: background sand") == "scene:background"


def _label(i: int, x: int, reusable: bool = True) -> Label:
    return Label(f"k{i}", "colour", f"e{i}", 0.9, (0.0, 0.0, 0.0, 0.0), False, reusable, x, id=i)


def test_selection_is_every_b_and_c_plus_as_many_seeded_zeros_whose_reuse_ran():
    labels = [_label(i, x, r) for i, (x, r) in enumerate(
        [(0, True), (1, True), (0, False), (0, True), (-1, True), (0, True), (0, False), (0, True), (1, True)])]
    picked = look.select_labels(labels, None, seed=3)
    assert [lab.id for lab in picked] == sorted(lab.id for lab in picked)  # record order
    assert {lab.id for lab in picked if lab.x} == {1, 4, 8}
    zeros = [lab for lab in picked if lab.x == 0]
    assert len(zeros) == 3 and all(lab.reusable for lab in zeros)
    assert [lab.id for lab in look.select_labels(labels, None, seed=3)] == [lab.id for lab in picked]
    assert len(look.select_labels(labels, 10, seed=3)) == 3 + 4  # only four 0 labels ran their reuse
    assert {lab.id for lab in look.select_labels(labels, 0, seed=3)} == {1, 4, 8}


def test_served_latent_prefers_the_dense_run_and_falls_back_to_an_exact_repeat():
    rows = [{"prompt": "p", "seed": 1, "mode": "exact", "latent": "e2e/a_c_00002_.latent"},
            {"prompt": "p", "seed": 1, "mode": "dense", "latent": "e2e/a_c_00001_.latent"},
            {"prompt": "q", "seed": 2, "mode": "exact", "latent": "e2e/q.latent"},  # resumed: the only row
            {"prompt": "r", "seed": 3, "mode": "node_cache", "latent": "/"}]  # ComfyUI's node cache: no file
    got = look.served_latents(rows)
    assert got == {("p", 1): ("e2e/a_c_00001_.latent", "dense"), ("q", 2): ("e2e/q.latent", "exact")}


@pytest.mark.comfy
@pytest.mark.slow
def test_a_runtime_label_is_recreated_bit_for_bit(tmp_path: Path, comfy_env) -> None:
    """A bench_learn-shaped work folder made by the runtime itself (two requests of one scene, the second a colour
    change: served dense in learning mode, labelled by ``observe``); the tool re-creates that label."""
    from safetensors.torch import save_file

    from carnator.carnator_core.cache.store import Store
    from carnator.carnator_core.learn.labels import LabelStore
    from carnator.carnator_core.learn.learner import LearnSettings
    from carnator.carnator_core.learn.runtime import learning_decision, observe
    from carnator.carnator_core.request import (
        RequestSpec,
        probe_request,
        recall,
        reuse_stage,
        signature_stage,
        write_result,
    )

    gs = {**look.graph_settings(), "steps": 8}  # the shipped graph's settings on a shorter schedule (CPU test)
    m = look.Model.load(None)
    run = tmp_path / "run"
    cache = run / "comfy" / "output" / look.CACHE_DIR
    (run / "comfy" / "output" / "e2e").mkdir(parents=True)
    store = Store.open(cache, key_path=tmp_path / "index.key")
    settings = LearnSettings(budget=1.0)  # room for a label from the second request on
    rows = []
    prompts = [CAPTION, CAPTION.replace("red", "blue")]
    try:
        for i, prompt in enumerate(prompts):
            pos = m.encoder.encode(prompt)
            spec = RequestSpec(prompt=prompt, seed=7, steps=gs["steps"], cfg=gs["cfg"], sampler=gs["sampler"],
                               scheduler=gs["scheduler"], stage=gs["stage"])
            probe = probe_request(m.model, pos, m.negative, m.latent, spec, gs["probe"], m.encoder, store=store)
            sig, _ = signature_stage(probe, gs["signature"])
            decision = learning_decision(sig, recall(store, probe, 5, 0.0), probe, rule_file="learned.json",
                                         rule_path=tmp_path / "learned.json", settings=settings)
            samples, rep = reuse_stage(m.model, pos, m.negative, m.latent, probe, decision, store, gs["reuse"],
                                       signature=sig, record=True, stage=gs["sampler_stage"])
            state = observe(directory=cache, model=m.model, positive=pos, negative=m.negative, latent=m.latent,
                            probe=probe, signature=sig, decision=decision, samples=samples, report=rep, store=store,
                            reuse_config=gs["reuse"], served_s=5.0)
            write_result(store, probe, sig, samples, rep)
            name = f"e2e/s{i:04d}_c_00001_.latent"
            save_file({"latent_tensor": samples.contiguous()}, str(run / "comfy" / "output" / name))
            rows.append({"i": i, "prompt": prompt, "seed": 7, "mode": "dense", "decision": rep.decision,
                         "latent": name, "label": state.get("label", "")})
    finally:
        store.close()
    (run / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    record = LabelStore(cache)
    (ns,) = record.namespaces()
    (lab,) = record.labels(ns)
    record.close()
    assert lab.prompt == prompts[1] and lab.stratum == "colour" and lab.reusable, (lab, rows)

    out = look.look_run(run, tmp_path / "out", m, gs, zeros=1, seed=0, frames=4, scale=1, tmp=tmp_path / "t")
    (row,) = out
    assert row["dense_bit_identical"] and row["dense_max_abs_diff"] == 0.0, row
    assert row["x_recreated"] == lab.x and row["reusable_recreated"] is True and row["served_as"] == "dense"
    assert 0.0 < row["active_fraction"] <= gs["reuse"].max_active
    png = tmp_path / "out" / "run" / f"{lab.id:04d}_{look.LABEL_NAMES[lab.x]}_colour.png"
    assert png.is_file()
    summary, md = look.summarize(out, {"command": "test"})
    assert summary["runs"]["run"]["x_matches"] == 1 and "colour" in md
