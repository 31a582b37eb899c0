"""The benchmark's artifact split: a hit's excess background texture over its dense clip, divided into what it
kept from the reused clip and what it recomputed (lab/metrics.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from carnator.carnator_core.lab import metrics as M


def _clip(seed: int, amp: float = 0.02) -> np.ndarray:
    """A grey clip with a little texture, [T, H, W, 3] in [0, 1]."""
    rng = np.random.default_rng(seed)
    return np.clip(0.5 + amp * rng.standard_normal((3, 24, 24, 3)), 0, 1).astype(np.float32)


def _dashes(clip: np.ndarray, rows: slice, cols: slice) -> np.ndarray:
    """Rows of short bright dashes (the reuse artifact the score was made for) inside a window."""
    out = clip.copy()
    win = out[:, rows, cols]
    win[:, ::3, ::4] = 1.0
    return out


def test_a_hit_that_hands_back_the_reused_clip_inherits_all_its_excess() -> None:
    dense, source = _clip(0), _clip(1, amp=0.04)
    bg = np.ones(dense.shape[:3], bool)
    split = M.artifact_split(source, dense, source, bg)
    assert split["kept_share"] == 1.0
    assert split["excess_recomputed"] == 0.0
    assert split["excess_kept"] == pytest.approx(M.artifact_score(source, bg) - M.artifact_score(dense, bg))
    assert split["source"] == pytest.approx(M.artifact_score(source, bg))
    assert split["excess_kept"] > 0  # the reused clip is rougher than this request's dense clip


def test_dashes_drawn_in_the_recomputed_region_are_charged_to_the_reuse() -> None:
    dense = _clip(0)
    source = dense.copy()  # same texture as dense: nothing to inherit
    hit = _dashes(source, slice(4, 16), slice(4, 16))
    bg = np.ones(dense.shape[:3], bool)
    bg[:, 18:, 18:] = False  # an object's pixels are not background
    split = M.artifact_split(hit, dense, source, bg)
    total = M.artifact_score(hit, bg) - M.artifact_score(dense, bg)
    assert split["excess_kept"] + split["excess_recomputed"] == pytest.approx(total)
    assert split["excess_recomputed"] == pytest.approx(total) and total > 0  # the dashes' neighbours included
    assert 0.5 < split["kept_share"] < 1.0


def test_the_tolerance_decides_what_counts_as_kept() -> None:
    dense = _clip(0)
    source = dense.copy()
    hit = source + 0.01  # every pixel moved by less than the default tolerance
    bg = np.ones(dense.shape[:3], bool)
    assert M.artifact_split(hit, dense, source, bg)["kept_share"] == 1.0
    assert M.artifact_split(hit, dense, source, bg, tol=0.005)["kept_share"] == 0.0


def test_bad_shapes_and_empty_masks() -> None:
    a, b = _clip(0), _clip(1)
    with pytest.raises(ValueError, match="clips differ in shape"):
        M.artifact_split(a, b, a[:, :12], np.ones(a.shape[:3], bool))
    with pytest.raises(ValueError, match="mask shape"):
        M.artifact_split(a, b, a, np.ones((3, 12, 12), bool))
    empty = M.artifact_split(a, b, a, np.zeros(a.shape[:3], bool))
    assert all(math.isnan(v) for v in empty.values())


def test_summaries_report_the_split_medians_over_hits() -> None:
    dense = [M.RequestRecord(rid=f"r{i}", kind="edit:colour", method="dense", latency_s=1.0, decision="dense")
             for i in range(3)]
    recs = [M.RequestRecord(rid=f"r{i}", kind="edit:colour", method="carnator", latency_s=0.5,
                            decision="hit" if i < 2 else "miss", excess_kept=0.01 * (i + 1),
                            excess_recomputed=0.1 * (i + 1)) for i in range(3)]
    s = M.summarize(recs, dense)
    assert s["excess_kept_hits"] == pytest.approx(0.015)
    assert s["excess_recomputed_hits"] == pytest.approx(0.15)  # the miss's figures are not a hit's
