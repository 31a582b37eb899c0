"""Resumable training of the embedded model: a run resumed from its saved state continues bit for bit as the
run that wrote it; the state refuses a mismatched recipe; v3's full-size state fits the committed 20 MB bound.

Tiny model (2 blocks, dim 64) on v2's 32 x 32 world so each step costs a few milliseconds of CPU.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

pytestmark = pytest.mark.comfy

TINY = {"dim": 64, "ffn_dim": 128, "num_heads": 1, "num_layers": 2}


@pytest.fixture(scope="module")
def train_mod(comfy_env):
    from carnator.carnator_core.embedded import train

    return train


def _recipe(train, **kw):
    base = dict(version="v3", seed=3, steps=40, batch=2, warmup=2, object_share=0.3, p_two=0.5,
                freeze_text_embedding=True, model_overrides=TINY)
    base.update(kw)
    return train.Recipe(**base)


def _snapshot(t) -> dict[str, torch.Tensor]:
    out = {"w." + n: p.detach().clone() for n, p in zip(t.names, t.params)}
    out.update({"ema." + k: v.clone() for k, v in t.ema.items()})
    for n, p in zip(t.names, t.params):
        st = t.opt.state[p]
        out["m." + n], out["v." + n] = st["exp_avg"].clone(), st["exp_avg_sq"].clone()
    return out


def test_resume_continues_bit_for_bit(train_mod, tmp_path) -> None:
    torch.set_num_threads(1)
    recipe = _recipe(train_mod, version="v2")  # v2's 32 x 32 frame keeps the tiny run cheap
    # Uninterrupted: 6 steps, saving (and so rounding the live state) after step 3, as a chunked run does.
    whole = train_mod.Trainer(recipe, tmp_path / "whole")
    whole.run(chunk_minutes=None, ckpt_minutes=1e9, ckpt_steps=3, max_steps=6)
    # Chunked: 3 steps, stop; a fresh process-equivalent Trainer resumes from the state and runs 3 more.
    first = train_mod.Trainer(recipe, tmp_path / "chunked")
    first.run(chunk_minutes=None, ckpt_minutes=1e9, ckpt_steps=3, max_steps=3)
    assert (tmp_path / "chunked" / "state.json").exists()
    resumed = train_mod.Trainer(recipe, tmp_path / "chunked")
    resumed.load_state()
    assert resumed.step == 3
    resumed.run(chunk_minutes=None, ckpt_minutes=1e9, ckpt_steps=3, max_steps=3)
    assert whole.step == resumed.step == 6
    a, b = _snapshot(whole), _snapshot(resumed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # ... and the runs did train: the weights moved away from initialisation.
    fresh = train_mod.Trainer(recipe, None)
    assert any(not torch.equal(p, q) for p, q in zip(fresh.params, resumed.params))
    meta = json.loads((tmp_path / "chunked" / "state.json").read_text())
    assert meta["step"] == 6 and len(meta["chunks"]) == 2
    assert [c["start_step"] for c in meta["chunks"]] == [0, 3]


def test_resume_refuses_a_different_recipe(train_mod, tmp_path) -> None:
    torch.set_num_threads(1)
    recipe = _recipe(train_mod, version="v2")
    t = train_mod.Trainer(recipe, tmp_path / "s")
    t.run(chunk_minutes=None, ckpt_minutes=1e9, ckpt_steps=2, max_steps=2)
    other = train_mod.Trainer(dataclasses.replace(recipe, lr=5e-4), tmp_path / "s")
    with pytest.raises(ValueError, match="was started with"):
        other.load_state()


def test_v3_training_state_fits_the_commit_bound(train_mod, tmp_path) -> None:
    """v3's full-size state (one step so the AdamW moments exist) stays within the 20 MB committed bound."""
    torch.set_num_threads(1)
    t = train_mod.Trainer(train_mod.Recipe(version="v3", steps=10, batch=1, object_share=0.3,
                                           freeze_text_embedding=True), tmp_path / "v3")
    t.run(chunk_minutes=None, ckpt_minutes=1e9, ckpt_steps=1, max_steps=1)
    assert t.state_bytes() <= 20_000_000, t.state_bytes()
    from safetensors import safe_open

    with safe_open(str(tmp_path / "v3" / "state.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    assert any(k.startswith("m.") for k in keys) and any(k.startswith("ema.") for k in keys)
    assert not any(k.startswith("w.text_embedding") for k in keys)  # frozen: rebuilt from the seed
