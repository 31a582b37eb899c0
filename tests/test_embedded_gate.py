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


def test_held_out_colour_position_motion_following(gate) -> None:
    rates, _ = gate
    print("gate rates:", rates)
    assert rates["colour"] >= 0.90, rates
    assert rates["position"] >= 0.60, rates
    assert rates["motion"] >= 0.50, rates


# Known gaps (issue 9 stays open): the shipped v2 weights measured size 0.53 (chance for 2 classes) and an x0
# colour match of 0.70 at the probe step on the 64 held-out captions (docs/MODEL_CARD.md). strict=True: the day
# a retrained model meets these, the test reports XPASS as a failure so the marker gets removed.
@pytest.mark.xfail(strict=True, reason="v2 weights miss the size gate (0.53 < 0.80; docs/MODEL_CARD.md)")
def test_held_out_size_following(gate) -> None:
    rates, _ = gate
    assert rates["size"] >= 0.80, rates


def test_early_probe_attention_peaks_on_the_object(gate) -> None:
    rates, _ = gate
    assert rates["attn_peak_on_object"] >= 0.80, rates


@pytest.mark.xfail(strict=True, reason="v2 weights: x0 colour at the probe step matches the final clip 0.70 < 0.90 "
                                       "(docs/MODEL_CARD.md)")
def test_early_probe_x0_colour(gate) -> None:
    rates, _ = gate
    assert rates["x0_colour_match"] >= 0.90, rates


def test_one_clip_under_ten_seconds(gate) -> None:
    _, glue = gate
    seconds = glue.time_one_clip()
    assert seconds < 10.0, seconds
