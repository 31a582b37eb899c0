"""Quality gate of the shipped embedded model: prompt following on held-out attribute
combinations, early-state probe quality, and generation speed. Fails (does not skip) without the weights.

Numbers and how they were measured: docs/MODEL_CARD.md.
"""
from __future__ import annotations

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.comfy]


@pytest.fixture(scope="module")
def gate(comfy_env):
    import torch

    from carnator.carnator_core.embedded import comfy_glue, config

    torch.set_num_threads(2)
    assert config.DEFAULT_WEIGHTS.exists(), f"shipped weights missing: {config.DEFAULT_WEIGHTS}"
    model, _, _ = comfy_glue.load_embedded()
    captions = comfy_glue.gate_captions()
    assert len(captions) >= 64
    return comfy_glue.evaluate(captions, model=model), comfy_glue


def test_held_out_colour_following(gate) -> None:
    rates, _ = gate
    print("gate rates:", rates)
    assert rates["colour"] >= 0.90, rates


def test_held_out_size_position_motion_following(gate) -> None:
    rates, _ = gate
    assert rates["size"] >= 0.80, rates
    assert rates["position"] >= 0.60, rates
    assert rates["motion"] >= 0.50, rates


def test_early_probe_quality(gate) -> None:
    rates, _ = gate
    assert rates["attn_peak_on_object"] >= 0.80, rates
    assert rates["x0_colour_match"] >= 0.90, rates


def test_one_clip_under_ten_seconds(gate) -> None:
    _, glue = gate
    seconds = glue.time_one_clip()
    assert seconds < 10.0, seconds


# --- v1 weights (the first default; ship beside v2 for comparison, docs/MODEL_CARD.md) -------------------------
@pytest.fixture(scope="module")
def gate_v1(comfy_env):
    import torch

    from carnator.carnator_core.embedded import comfy_glue, config

    torch.set_num_threads(2)
    path = config.WEIGHTS_DIR / "carnator_embedded_v1.safetensors"
    assert path.exists(), f"shipped v1 weights missing: {path}"
    model, _, _ = comfy_glue.load_embedded(path)
    return comfy_glue.evaluate(comfy_glue.gate_captions(), model=model)


def test_v1_held_out_colour_and_early_probe(gate_v1) -> None:
    rates = gate_v1
    print("v1 gate rates:", rates)
    assert rates["colour"] >= 0.90, rates
    assert rates["attn_peak_on_object"] >= 0.80, rates
    assert rates["x0_colour_match"] >= 0.90, rates


# strict=True: if v1 ever measured inside the gate, the XPASS fails the run and this marker must go.
@pytest.mark.xfail(strict=True, reason="v1 weights (90 min on a shared machine, trained text embedding) ignore "
                                       "size, position and motion words: 0.52 / 0.20 / 0.17; docs/MODEL_CARD.md")
def test_v1_size_position_motion(gate_v1) -> None:
    rates = gate_v1
    assert rates["size"] >= 0.80, rates
    assert rates["position"] >= 0.60, rates
    assert rates["motion"] >= 0.50, rates
