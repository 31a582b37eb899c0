"""Plumbing of the optional weight-backed judges (OWLv2 detector, SigLIP alignment) on tiny random-weight models
built from ``transformers`` configs in the test, saved with ``save_pretrained`` and loaded back through the judges'
own loaders (local files only, as a user's weights would be). Random weights see nothing: these tests pin the
plumbing (shapes, frames, verdict structure, the excess label, the errors), not what the judges are worth."""
from __future__ import annotations

import json

import numpy as np
import pytest

from carnator.carnator_core.embedded import world
from carnator.carnator_core.judge import JudgeRequest, excess_label, optional as opt

# transformers is in the host venv (ComfyUI itself needs it), so these tests never skip; the judges import it lazily

PROMPT = "a big red ball moves to the right in the top left, on green grass"
SOURCE = "a big blue ball moves to the right in the top left, on green grass"


def _tokenizer(d):
    """A tiny CLIP BPE tokenizer: single letters as tokens (enough to tokenise any prompt)."""
    from transformers import CLIPTokenizer

    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = {t: i for i, t in enumerate(["<|startoftext|>", "<|endoftext|>"] + letters + [c + "</w>" for c in letters])}
    (d / "vocab.json").write_text(json.dumps(vocab))
    (d / "merges.txt").write_text("#version: 0.2\n")
    return CLIPTokenizer(str(d / "vocab.json"), str(d / "merges.txt")), len(vocab)


def _towers(n_vocab: int, max_positions: int) -> dict:
    """Tiny text and vision tower configs (one layer, width 32, 32 x 32 images in 8 x 8 patches)."""
    layer = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    return {"text_config": {**layer, "vocab_size": n_vocab, "max_position_embeddings": max_positions,
                            "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1},
            "vision_config": {**layer, "image_size": 32, "patch_size": 8}}


def _clip(scene_colour="red"):
    scene = world.parse_caption(PROMPT.replace("red", scene_colour))
    return world.render(scene)[0]


@pytest.fixture(scope="module")
def owl_dir(tmp_path_factory):
    import torch
    from transformers import Owlv2Config, Owlv2ForObjectDetection, Owlv2ImageProcessor, Owlv2Processor

    d = tmp_path_factory.mktemp("owl")
    tok, n_vocab = _tokenizer(d)
    torch.manual_seed(0)
    cfg = Owlv2Config(**_towers(n_vocab, 16), projection_dim=32)
    Owlv2ForObjectDetection(cfg).save_pretrained(d)
    proc = Owlv2Processor(image_processor=Owlv2ImageProcessor(size={"height": 32, "width": 32}), tokenizer=tok)
    proc.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def siglip_dir(tmp_path_factory):
    import torch
    from transformers import SiglipConfig, SiglipImageProcessor, SiglipModel

    d = tmp_path_factory.mktemp("siglip")
    tok, n_vocab = _tokenizer(d)
    torch.manual_seed(0)
    cfg = SiglipConfig(**_towers(n_vocab, 64))
    SiglipModel(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    SiglipImageProcessor(size={"height": 32, "width": 32}).save_pretrained(d)
    return d


def test_detector_judge_plumbing(owl_dir, tmp_path):
    # found through the models folder by name, as a user's ComfyUI/models/carnator_judges/<name> would be
    models = tmp_path / "models"
    (models / opt.SUBFOLDER).mkdir(parents=True)
    (models / opt.SUBFOLDER / "owl-tiny").symlink_to(owl_dir, target_is_directory=True)
    j = opt.DetectorJudge.load("owl-tiny", models_dir=models, frames=3, score_min=0.0)
    clip = _clip()
    det = j.detect(clip, ["ball"])
    assert len(det["ball"]) == 3  # score_min 0: the best box of each sampled frame
    for score, cx, cy, lab in det["ball"]:
        assert 0.0 <= score <= 1.0 and np.isfinite([cx, cy]).all() and lab.shape == (3,)
    req = JudgeRequest(PROMPT, objects=("ball",), source_prompt=SOURCE)
    v = j.judge(clip, req)
    assert v.passed and v.per_object == {"ball": True}
    same = excess_label(j, clip, clip, req)
    assert not same.b and not same.c and same.reuse.scores["ball.d_where"] == 0.0
    other = excess_label(j, (1.0 - clip).astype(np.float32), clip, req)  # every pixel's colour changed
    assert other.reuse.scores["ball.d_colour"] > 0  # the colour under the box is read
    strict = opt.DetectorJudge.load(owl_dir, score_min=1.01)  # nothing scores above 1: nothing is found
    lab = excess_label(strict, clip, clip, req)
    assert not lab.dense.passed and lab.reuse.reasons == ("ball: not detected",)


def test_alignment_judge_plumbing(siglip_dir):
    j = opt.AlignmentJudge.load(siglip_dir, frames=2)
    clip = _clip()
    s = j.scores(clip, [PROMPT, SOURCE])
    assert s.shape == (2,) and np.isfinite(s).all() and s[0] != s[1]
    req = JudgeRequest(PROMPT, source_prompt=SOURCE)
    same = excess_label(j, clip, clip, req)
    assert same.reuse.passed and same.reuse.scores["d_score"] == 0.0
    picky = opt.AlignmentJudge.load(siglip_dir, frames=2, d_score=-1.0)  # any clip "worse" than dense by -1 fails
    assert not excess_label(picky, clip, clip, req).reuse.passed
    assert not opt.AlignmentJudge.load(siglip_dir, score_min=float(s[0]) + 1).judge(clip, req).passed


def test_missing_weights_and_missing_package_say_how_to_fix(tmp_path, monkeypatch):
    with pytest.raises(opt.OptionalJudgeUnavailable, match="never downloads"):
        opt.DetectorJudge.load("owlv2-base", models_dir=tmp_path)
    import builtins

    real_import = builtins.__import__

    def no_transformers(name, *a, **kw):
        if name == "transformers" or name.startswith("transformers."):
            raise ImportError("No module named 'transformers'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_transformers)
    with pytest.raises(opt.OptionalJudgeUnavailable, match="pip install transformers"):
        opt.AlignmentJudge.load(tmp_path)
