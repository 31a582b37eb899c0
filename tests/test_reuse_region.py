"""The active region of a cache hit matches the change: attention jitter between two wordings is not evidence,
a moved or recoloured object is recomputed whole, a few disagreeing x0 tokens stay local (core, no ComfyUI)."""
from __future__ import annotations

import numpy as np
import pytest

from carnator.carnator_core import reuse
from carnator.carnator_core.types import ObjectSignature, Signature

GRID = (4, 8, 8)
PATCH = (2, 2, 2)


def _sig(mask: np.ndarray, lab=(50.0, 60.0, 40.0)) -> Signature:
    return Signature((ObjectSignature("ball", mask.astype(np.float32), float(mask.mean()), lab),),
                     np.zeros((4, 4, 3), np.float32), GRID)


def _box(y0: int, x0: int, h: int = 4, w: int = 4) -> np.ndarray:
    m = np.zeros(GRID, bool)
    m[:, y0:y0 + h, x0:x0 + w] = True
    return m


def _x0(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(16, 8, 16, 16)).astype(np.float32)


def _region(target: Signature, cached: Signature, xt: np.ndarray, xc: np.ndarray, **kw) -> np.ndarray:
    return reuse.active_region(target, cached, xt, xc, PATCH, reuse.ReuseConfig(**kw))


def test_mask_jitter_is_not_evidence() -> None:
    a = _box(2, 2)
    b = a.copy()
    b[0, 2, 6] = True  # two wordings: a few border tokens differ (IoU 64/67 = 0.96)
    b[1, 5, 1] = True
    b[3, 2, 2] = False
    assert reuse.mask_iou(a, b) >= 0.75
    x0 = _x0()
    assert not _region(_sig(b), _sig(a), x0, x0).any()
    # the rule before: any differing token recomputes the whole object, dilated
    old = _region(_sig(b), _sig(a), x0, x0, mask_iou_same=1.01)
    assert old.mean() > 0.3


def test_moved_object_is_recomputed_whole_in_both_places() -> None:
    a, b = _box(0, 0), _box(4, 4)
    x0 = _x0()
    A = _region(_sig(b), _sig(a), x0, x0, dilation=0)
    assert A[a].all() and A[b].all() and A.sum() == (a | b).sum()


def test_recoloured_object_is_recomputed_whole() -> None:
    a = _box(2, 2)
    x0 = _x0()
    A = _region(_sig(a, (50.0, -40.0, 30.0)), _sig(a), x0, x0, dilation=0)
    assert A.sum() == a.sum() and A[a].all()


def test_few_disagreeing_x0_tokens_stay_local() -> None:
    a = _box(2, 2)
    xc = _x0(1)
    xt = xc.copy()
    xt[:, 2:4, 4:6, 4:6] += 50.0  # one token (2x2x2 latent cells) inside the object disagrees
    A = _region(_sig(a), _sig(a), xt, xc, dilation=0)
    assert A.sum() == 1 and A[1, 2, 2]
    # disagreement over a real part of the object (>= 10 % of its support) recomputes it whole
    xt[:, 2:6, 4:8, 4:8] += 50.0  # 8 of 64 tokens
    A = _region(_sig(a), _sig(a), xt, xc, dilation=0)
    assert A[a].all()


def test_refresh_calls_spread_over_the_reuse_steps() -> None:
    assert reuse.refresh_plan_calls(20, 4, 1) == frozenset({4})
    assert reuse.refresh_plan_calls(20, 4, 3) == frozenset({4, 9, 14})
    assert reuse.refresh_plan_calls(6, 4, 5) == frozenset({4, 5})
    assert reuse.refresh_plan_calls(4, 4, 3) == frozenset()


def test_refresh_at_places_the_later_refreshes() -> None:
    """``refresh_at`` moves the records after the first to fractions of the calls after the probe; the first
    record stays on the first call (or is the probe's own); "" keeps the even spacing."""
    assert reuse.refresh_plan_calls(20, 2, 3, at="0.6,0.9") == frozenset({2, 13, 18})
    assert reuse.refresh_plan_calls(20, 2, 3, probe_record=True, at="0.6,0.9") == frozenset({13, 18})
    assert reuse.refresh_plan_calls(20, 2, 3, at="") == frozenset({2, 8, 14})
    # never past the last call, never on the first record's call
    assert reuse.refresh_plan_calls(6, 4, 3, at="0.01,0.99") == frozenset({4, 5})
    assert reuse.refresh_plan_calls(4, 4, 3, at="0.5") == frozenset()


def test_refresh_at_is_checked_and_spelt_one_way() -> None:
    cfg = reuse.ReuseConfig(refreshes=3, refresh_at=" 0.60, 0.9 ").validate()
    assert cfg.refresh_at == "0.6,0.9"
    assert reuse.ReuseConfig(refresh_at="  ").refresh_at == ""
    # the certified placement is compared as a placement, and a rule that records none certified the even one
    assert cfg.differences({**cfg.to_meta(), "refresh_at": "0.6,0.9"}) == []
    old = {k: v for k, v in cfg.to_meta().items() if k != "refresh_at"}
    assert cfg.differences(old) == ["refresh_at '0.6,0.9' (certified: '')"]
    assert reuse.ReuseConfig.from_meta(old).refresh_at == ""
    assert reuse.ReuseConfig.from_meta(cfg.to_meta()) == cfg
    with pytest.raises(ValueError, match="refreshes=3 asks for 2 after the first record"):
        reuse.ReuseConfig(refreshes=3, refresh_at="0.8").validate()
    with pytest.raises(ValueError, match="must lie in \\(0, 1\\) and increase"):
        reuse.ReuseConfig(refreshes=3, refresh_at="0.9,0.6").validate()
    with pytest.raises(ValueError, match="must lie in"):
        reuse.ReuseConfig(refreshes=2, refresh_at="1.0").validate()
    with pytest.raises(ValueError, match="comma-separated fractions"):
        reuse.ReuseConfig(refreshes=2, refresh_at="late").validate()
    assert reuse.ReuseConfig.from_meta({"refreshes": 2, "refresh_at": "late"}) is None


def test_changed_background_cells_are_recomputed() -> None:
    a = _box(2, 2)
    x0 = _x0()
    target, cached = _sig(a), _sig(a)
    ctx = np.zeros((4, 4, 3), np.float32)
    ctx[0, 3] = (60.0, 0.0, 0.0)  # one context cell changed colour (next to an object: its blur)
    assert _region(Signature(target.objects, ctx, GRID), cached, x0, x0, dilation=0).sum() == 0
    ctx[:, :2] = (60.0, 0.0, 0.0)  # the background changed: the cells that changed are recomputed
    A = _region(Signature(target.objects, ctx, GRID), cached, x0, x0, dilation=0)
    assert A[:, :, 0:4].all() and A[:, 0:2, 6:8].all() and A.sum() == 4 * (8 * 4 + 2 * 2)


def test_region_terms_name_the_evidence_the_region_is_made_of() -> None:
    """``region_terms`` separates the evidence (what diagnostics report) and composes to ``active_region``."""
    a, b = _box(0, 0), _box(4, 4)
    x0 = _x0()
    cfg = reuse.ReuseConfig(dilation=0)
    moved = reuse.region_terms(_sig(b), _sig(a), x0, x0, PATCH, cfg)
    assert np.array_equal(moved.moved, a ^ b) and np.array_equal(moved.moved_whole, a | b)
    assert not (moved.recoloured.any() or moved.x0.any() or moved.x0_objects.any() or moved.context.any())
    recol = reuse.region_terms(_sig(a, (50.0, -40.0, 30.0)), _sig(a), x0, x0, PATCH, cfg)
    assert np.array_equal(recol.recoloured, a) and not recol.moved.any()
    xt = x0.copy()
    xt[:, :2, :4, :4] += 5.0  # the first token-frame of the object's corner disagrees strongly
    local = reuse.region_terms(_sig(a), _sig(a), xt, x0, PATCH, cfg)
    assert local.x0.any() and float(local.x0_ratio[local.x0].min()) > cfg.x0_threshold
    for terms, (t, c, x) in ((moved, (b, a, x0)), (recol, (a, a, x0)), (local, (a, a, xt))):
        target = _sig(t, (50.0, -40.0, 30.0)) if terms is recol else _sig(t)
        for whole in (True, False):
            c2 = reuse.ReuseConfig(dilation=0, whole_objects=whole)
            assert np.array_equal(terms.compose(c2), reuse.active_region(target, _sig(c), x, x0, PATCH, c2))


def _drifting(y0: int, dy: int) -> np.ndarray:
    """A 4x4 object starting at row ``y0`` that moves ``dy`` rows per frame (GRID's 4 frames)."""
    m = np.zeros(GRID, bool)
    for t in range(GRID[0]):
        m[t, y0 + dy * t:y0 + dy * t + 4, 2:6] = True
    return m


def test_a_changed_motion_is_evidence_where_the_masks_still_overlap() -> None:
    """"Moves down" for "moves up" at the probe: the masks tilt opposite ways but overlap (IoU >= mask_iou_same) and
    the x0 predictions agree, so only the motion term sees the change; it recomputes the object whole. Off (0, the
    default: what rules certified without it ran) it is silent, and a reworded still object never triggers it."""
    down, up = np.zeros(GRID, bool), np.zeros(GRID, bool)
    for t in range(GRID[0]):  # one row over the clip: the early drift of an object that has barely started
        down[t, 2 + (t == 3):6 + (t == 3), 2:6] = True
        up[t, 3 - (t > 0):7 - (t > 0), 2:6] = True
    assert reuse.mask_iou(down, up) >= 0.75
    assert reuse.mask_displacement(down)[0] == 1.0 and reuse.mask_displacement(up)[0] == -1.0
    x0 = _x0()
    assert not _region(_sig(down), _sig(up), x0, x0).any()  # off: the cached motion would be kept
    A = _region(_sig(down), _sig(up), x0, x0, dilation=0, motion_shift=0.2)
    assert np.array_equal(A, down | up)
    terms = reuse.region_terms(_sig(down), _sig(up), x0, x0, PATCH, reuse.ReuseConfig(motion_shift=0.2))
    assert np.array_equal(terms.motion, down | up) and not terms.moved.any()
    # a shift below the threshold (0.25 of the 8-token side = 2 tokens > |1 - (-1)|) is no evidence
    assert not _region(_sig(down), _sig(up), x0, x0, motion_shift=0.25).any()
    still = _drifting(2, 0)
    jitter = still.copy()
    jitter[3, 6, 2] = True  # a border token of the last frame: the centroid moves 0.25 of a token
    assert not _region(_sig(jitter), _sig(still), x0, x0, motion_shift=0.05).any()


def test_mask_displacement_reads_the_drift_over_the_frames_that_hold_the_object() -> None:
    assert np.allclose(reuse.mask_displacement(_drifting(0, 1)), (3.0, 0.0))
    late = _drifting(0, 1)
    late[0] = False  # the first frame holds nothing: the drift of frames 1-3 scaled to the clip
    assert np.allclose(reuse.mask_displacement(late), (3.0, 0.0))
    one = np.zeros(GRID, bool)
    one[2, 1:3, 1:3] = True
    assert reuse.mask_displacement(one) is None
    for bad in (-0.1, 1.5):
        try:
            reuse.ReuseConfig(motion_shift=bad).validate()
        except ValueError as e:
            assert "motion_shift" in str(e)
        else:
            raise AssertionError("an out-of-range motion_shift was accepted")
