"""Signature Builder mechanics on constructed probes (pure core: no ComfyUI, no model).

The probes here are real ``types.Probe`` values whose attention maps and x0 latents are built by hand, so the
expected masks, sizes and colours are known exactly.
"""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
from skimage.color import rgb2lab

from carnator.carnator_core.signature import (
    CONTEXT_ONLY_NOTE,
    MissingLatentRGBFactorsError,
    SignatureConfig,
    build_signature,
    build_signature_timed,
    load_signature,
    object_mask,
    save_signature,
    signature_bytes_at,
    signature_from_bytes,
    signature_to_bytes,
    summarize,
)
from carnator.carnator_core.types import GenConfig, ObjectTokens, Probe, Signature

GRID = (2, 8, 8)
PATCH = (1, 2, 2)
C = 4
# Channels 0-2 carry RGB in [-1, 1] (ComfyUI preview convention), channel 3 is ignored.
FACTORS = np.array([[1, 0, 0], [0, 1, 0], [0, 0, 1], [0, 0, 0]], dtype=np.float32)
BIAS = np.zeros(3, dtype=np.float32)
RED, GREEN, BLUE = (0.9, 0.1, 0.1), (0.1, 0.7, 0.2), (0.15, 0.3, 0.95)
# No smoothing, no context dilation: masks and context are exactly the constructed boxes.
EXACT = SignatureConfig(smooth_sigma_t=0.0, smooth_sigma_hw=0.0, context_dilation=0)


def _config() -> GenConfig:
    return GenConfig("embedded", (C, GRID[0], GRID[1] * 2, GRID[2] * 2), 20, "euler", "simple", 5.0, "x", 4)


def _latent(rgb_grid: np.ndarray) -> np.ndarray:
    """[T, H, W, 3] RGB per token in [0, 1] -> latent [C, T, 2H, 2W] whose token means decode to it."""
    x = np.zeros((C,) + tuple(GRID), dtype=np.float32)
    x[:3] = np.moveaxis(rgb_grid * 2.0 - 1.0, -1, 0)
    return np.repeat(np.repeat(x, 2, axis=2), 2, axis=3)


def make_probe(boxes: dict[str, tuple[slice, slice, tuple[float, float, float]]], background=GREEN, *,
               factors=FACTORS, bias=BIAS, x0=None, maps=None, source="spacy") -> Probe:
    """Objects as (rows, cols, colour) boxes in every frame over a flat background; attention 1 on the box,
    0.05 elsewhere."""
    rgb = np.broadcast_to(np.asarray(background, np.float32), GRID + (3,)).copy()
    object_maps = {}
    for name, (rows, cols, colour) in boxes.items():
        rgb[:, rows, cols] = colour
        m = np.full(GRID, 0.05, np.float32)
        m[:, rows, cols] = 1.0
        object_maps[name] = m
    if maps is not None:
        object_maps = maps
    objects = tuple(ObjectTokens(n, (n,), (i,)) for i, n in enumerate(boxes))
    return Probe(arch="embedded", model_fingerprint="f" * 16, config=_config(), prompt="p", seed=1,
                 objects=objects, object_source=source, object_maps=object_maps, grid=GRID, patch=PATCH,
                 x0_probe=_latent(rgb) if x0 is None else x0, latent_probe=None, latent_rgb_factors=factors,
                 latent_rgb_bias=bias, embedding=np.zeros(4, np.float32))


def lab_of(rgb) -> np.ndarray:
    return rgb2lab(np.asarray(rgb, np.float64)[None, None, :])[0, 0]


def test_mask_size_colour_on_constructed_maps():
    probe = make_probe({"ball": (slice(1, 4), slice(2, 5), RED)})
    sig = build_signature(probe, EXACT)
    (ball,) = sig.objects
    expected = np.zeros(GRID, np.float32)
    expected[:, 1:4, 2:5] = 1.0
    np.testing.assert_array_equal(ball.mask, expected)
    assert ball.mask.dtype == np.float32 and ball.mask.shape == GRID
    assert ball.size == pytest.approx(9 / 64)
    np.testing.assert_allclose(ball.lab, lab_of(RED), atol=1e-4)
    # Context excludes the object: every cell is the background colour.
    assert sig.context_lab.shape == (4, 4, 3) and sig.context_lab.dtype == np.float32
    np.testing.assert_allclose(sig.context_lab, np.broadcast_to(lab_of(GREEN), (4, 4, 3)), atol=1e-3)
    assert sig.grid == GRID and sig.note == ""


def test_two_objects_and_context_cells():
    probe = make_probe({"ball": (slice(0, 2), slice(0, 2), RED), "cube": (slice(5, 8), slice(5, 8), BLUE)},
                       background=GREEN)
    sig = build_signature(probe, EXACT)
    assert sig.object_names() == ("ball", "cube")
    assert sig.get("cube").size == pytest.approx(9 / 64)
    np.testing.assert_allclose(sig.get("cube").lab, lab_of(BLUE), atol=1e-4)
    # The top-left context cell is covered by the ball entirely -> global context mean (= green here).
    np.testing.assert_allclose(sig.context_lab[0, 0], lab_of(GREEN), atol=1e-3)


def test_context_reflects_background_per_cell():
    # Left half blue, right half green background, no objects.
    rgb = np.empty(GRID + (3,), np.float32)
    rgb[:, :, :4] = BLUE
    rgb[:, :, 4:] = GREEN
    probe = make_probe({}, x0=_latent(rgb))
    sig = build_signature(probe)
    np.testing.assert_allclose(sig.context_lab[:, :2], np.broadcast_to(lab_of(BLUE), (4, 2, 3)), atol=1e-3)
    np.testing.assert_allclose(sig.context_lab[:, 2:], np.broadcast_to(lab_of(GREEN), (4, 2, 3)), atol=1e-3)


def test_latent_cells_are_averaged_per_token():
    # Within each 2x2 latent cell one value is +1 and three are -1/3: the token mean is 0 -> RGB 0.5 grey.
    x0 = np.full((C, GRID[0], 16, 16), -1.0 / 3.0, np.float32)
    x0[:, :, ::2, ::2] = 1.0
    probe = make_probe({"ball": (slice(0, 4), slice(0, 4), RED)}, x0=x0)
    sig = build_signature(probe)
    np.testing.assert_allclose(sig.objects[0].lab, lab_of((0.5, 0.5, 0.5)), atol=1e-3)


def test_torch_x0_gives_same_signature():
    torch = pytest.importorskip("torch")
    probe = make_probe({"ball": (slice(1, 4), slice(2, 5), RED)})
    tprobe = make_probe({"ball": (slice(1, 4), slice(2, 5), RED)}, x0=torch.from_numpy(probe.x0_probe.copy()))
    a, b = build_signature(probe), build_signature(tprobe)
    np.testing.assert_array_equal(a.objects[0].mask, b.objects[0].mask)
    assert a.objects[0].lab == b.objects[0].lab


def test_default_smoothing_and_context_dilation():
    probe = make_probe({"ball": (slice(2, 5), slice(2, 5), RED)})
    sig = build_signature(probe)
    mask = sig.objects[0].mask
    # Smoothing keeps the support where the attention is, softly: inside ~1, far away 0.
    assert mask[:, 3, 3].min() > 0.99 and mask[:, 0, 7].max() == 0.0
    assert sig.objects[0].size == pytest.approx(9 / 64, abs=0.03)
    np.testing.assert_allclose(sig.objects[0].lab, lab_of(RED), atol=1.0)
    # A single-token attention spike is smoothed away relative to a 3x3 object of the same peak.
    spiky = np.full(GRID, 0.05, np.float32)
    spiky[:, 2:5, 2:5] = 1.0
    spiky[:, 6, 6] = 1.0
    plain = build_signature(make_probe({"ball": (slice(2, 5), slice(2, 5), RED)}, maps={"ball": spiky}))
    assert plain.objects[0].mask[:, 6, 6].max() < 0.5 and plain.objects[0].mask[:, 3, 3].min() > 0.99
    # Context dilation: red pixels right next to the mask (which attention missed) stay out of the context.
    rgb = np.broadcast_to(np.asarray(GREEN, np.float32), GRID + (3,)).copy()
    rgb[:, 1:6, 1:6] = RED  # the object is larger than where attention points (2:5)
    leaky = make_probe({"ball": (slice(2, 5), slice(2, 5), RED)}, x0=_latent(rgb))
    tight = build_signature(leaky, EXACT)
    grown = build_signature(leaky, SignatureConfig(smooth_sigma_t=0.0, smooth_sigma_hw=0.0, context_dilation=1))
    green = lab_of(GREEN)
    err = lambda s: float(np.abs(s.context_lab - green).max())  # noqa: E731
    assert err(grown) < 1e-3 < err(tight)


def test_soft_ramp():
    cfg = SignatureConfig(baseline_quantile=0.0, low=0.25, high=0.75, smooth_sigma_t=0.0, smooth_sigma_hw=0.0)
    attn = np.linspace(0.0, 1.0, 5, dtype=np.float32).reshape(1, 1, 5)  # r = 0, .25, .5, .75, 1
    mask, localised = object_mask(attn, cfg)
    assert localised
    np.testing.assert_allclose(mask.ravel(), [0.0, 0.0, 0.5, 1.0, 1.0], atol=1e-6)
    hard, _ = object_mask(attn, SignatureConfig(baseline_quantile=0.0, low=0.5, high=0.5, smooth_sigma_hw=0.0,
                                                smooth_sigma_t=0.0))
    np.testing.assert_array_equal(hard.ravel(), [0, 0, 1, 1, 1])


def test_deterministic_and_input_untouched():
    probe = make_probe({"ball": (slice(1, 4), slice(2, 5), RED), "cube": (slice(5, 7), slice(0, 3), BLUE)})
    before = copy.deepcopy(probe)
    a, b = build_signature(probe), build_signature(copy.deepcopy(probe))
    assert signature_to_bytes(a) == signature_to_bytes(b)
    np.testing.assert_array_equal(probe.x0_probe, before.x0_probe)
    for k in probe.object_maps:
        np.testing.assert_array_equal(probe.object_maps[k], before.object_maps[k])


def test_round_trip_safetensors_file_and_json(tmp_path):
    probe = make_probe({"ball": (slice(1, 4), slice(2, 5), RED), "ball#2": (slice(5, 7), slice(0, 3), BLUE)})
    sig = build_signature(probe)
    path = tmp_path / "sig.safetensors"
    size = save_signature(sig, path)
    assert size == path.stat().st_size
    back = load_signature(path)
    _assert_same(sig, back)
    # JSON metadata + tensors (the cache's route): JSON text round-trip.
    meta = json.loads(json.dumps(sig.to_meta()))
    _assert_same(sig, Signature.from_parts(meta, sig.to_tensors()))
    with pytest.raises(ValueError, match="not a Carnator signature"):
        from safetensors.numpy import save

        signature_from_bytes(save({"x": np.zeros(2, np.float32)}))


def _assert_same(a: Signature, b: Signature) -> None:
    assert a.object_names() == b.object_names() and a.grid == b.grid and a.note == b.note
    np.testing.assert_array_equal(a.context_lab, b.context_lab)
    for oa, ob in zip(a.objects, b.objects):
        np.testing.assert_array_equal(oa.mask, ob.mask)
        assert oa.size == ob.size and oa.lab == ob.lab


def test_context_only_signature_says_so():
    sig = build_signature(make_probe({}, source="spacy"))
    assert sig.objects == ()
    assert CONTEXT_ONLY_NOTE in sig.note
    assert sig.context_lab.shape == (4, 4, 3)
    assert "0 object(s)" in summarize(sig)


def test_flat_map_gives_empty_mask_and_note():
    flat = {"ball": np.full(GRID, 0.2, np.float32)}
    probe = make_probe({"ball": (slice(1, 4), slice(2, 5), RED)}, maps=flat)
    sig = build_signature(probe)
    assert sig.objects[0].size == 0.0 and not sig.objects[0].mask.any()
    assert "no localised attention" in sig.note
    assert all(np.isfinite(sig.objects[0].lab))


def test_missing_factors_error_names_the_model():
    probe = make_probe({"ball": (slice(1, 4), slice(2, 5), RED)}, factors=None)
    with pytest.raises(MissingLatentRGBFactorsError, match="'embedded' model's latent format has no latent_rgb"):
        build_signature(probe)
    with pytest.raises(ValueError, match=r"expected \(4, 3\)"):
        build_signature(make_probe({}, factors=np.zeros((16, 3), np.float32)))


def test_inconsistent_probe_errors():
    probe = make_probe({"ball": (slice(1, 4), slice(2, 5), RED)}, maps={})
    with pytest.raises(ValueError, match="no attention map"):
        build_signature(probe)
    bad = make_probe({"ball": (slice(1, 4), slice(2, 5), RED)}, maps={"ball": np.zeros((2, 4, 4), np.float32)})
    with pytest.raises(ValueError, match="expected the token grid"):
        build_signature(bad)
    # A patch that does not tile the latent onto the grid (e.g. (1, 2, 2) recorded for a (2, 2, 2) model).
    wrong_patch = make_probe({})
    object.__setattr__(wrong_patch, "patch", (2, 2, 2))
    with pytest.raises(ValueError, match="wrong patch size"):
        build_signature(wrong_patch)


@pytest.mark.parametrize("kwargs", [dict(low=0.7, high=0.2), dict(baseline_quantile=1.0), dict(context_grid=(0, 4)),
                                    dict(low=float("nan")), dict(context_grid=(4,)), dict(smooth_sigma_hw=-1.0),
                                    dict(context_dilation=-1), dict(context_dilation=1.5)])
def test_config_validation(kwargs):
    with pytest.raises(ValueError):
        SignatureConfig(**kwargs)


def test_bytes_at_wan21_480p_81_frames():
    info = signature_bytes_at()
    assert info["grid"] == (21, 30, 52)
    tensors = 2 * 21 * 30 * 52 * 4 + 4 * 4 * 3 * 4
    assert tensors < info["nbytes"] < tensors + 1024
    assert info["nbytes"] < info["file_bytes"] < info["nbytes"] + 1024


def test_timed_build_reports_ms():
    sig, ms = build_signature_timed(make_probe({"ball": (slice(1, 4), slice(2, 5), RED)}))
    assert sig.objects and ms >= 0.0
