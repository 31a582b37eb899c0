"""The designed pairs of carnator_core/lab/hard_pairs.py are what their kind says (the world's own geometry and
caption parser decide), a run is a prefix of a longer one, and the separation measures are the textbook ones."""
from __future__ import annotations

import numpy as np
import pytest

from carnator.carnator_core.embedded import world
from carnator.carnator_core.lab import hard_pairs as H
from carnator.carnator_core.lab.pairs import embedded_frame

FRAME = embedded_frame()


def _pairs(kind: str, n: int = 6) -> list[H.DesignedPair]:
    return [H.design_pair(53, kind, i, FRAME) for i in range(n)]


def test_each_kind_changes_what_it_says_and_captions_parse_back() -> None:
    for kind in H.KINDS:
        for p in _pairs(kind):
            c, t = p.candidate_scene, p.target_scene
            # the captions name exactly the scenes (the checker reads them the same way)
            assert world.parse_caption(p.candidate_prompt) == c
            assert world.parse_caption(p.target_prompt) == t
            assert not any(world.is_held_out(o) for o in c.objects + t.objects)
            c0, t0 = c.objects[0], t.objects[0]
            if kind == "motion_reverse":
                assert (c0.position, t0.position) == (c0.position, c0.position)
                assert np.dot(world.MOTION_DIR[c0.motion], world.MOTION_DIR[t0.motion]) == -1.0
            elif kind == "motion_start":
                assert t0.position == c0.position and "still" in (c0.motion, t0.motion) and c0.motion != t0.motion
            elif kind == "position_overlap":
                assert c0.size == t0.size == "big" and "center" in (c0.position, t0.position)
                assert c0.position != t0.position
                # the two footprints over the clip overlap: the object moves onto its own old place
                assert (world.object_alpha(c0, FRAME).max(0) * world.object_alpha(t0, FRAME).max(0)).any()
            elif kind in ("touch_colour", "touch_motion"):
                assert world._overlaps(c, FRAME) and world._overlaps(t, FRAME)
                assert all(o.size == "big" for o in c.objects)
            elif kind == "big_colour":
                assert not world._overlaps(c, FRAME) and all(o.size == "big" for o in c.objects)
                assert c0.colour != t0.colour
            elif kind == "colour_near":
                allowed = [x for x in world.COLOURS if x not in {o.colour for o in c.objects}
                           and world.compatible(x, c.background)]
                assert t0.colour == H.nearest(c0.colour, world.PALETTE, allowed)
            elif kind == "background_near":
                assert t.background != c.background and t.objects == c.objects
            elif kind == "control_rewording":
                assert c == t and p.candidate_prompt != p.target_prompt
            else:
                assert c != t
            assert c.background == t.background or kind == "background_near"


def test_design_is_seeded_and_prefix_stable() -> None:
    a = [H.design_pair(53, k, i, FRAME) for i in range(3) for k in H.KINDS]
    b = [H.design_pair(53, k, i, FRAME) for i in range(4) for k in H.KINDS]
    assert a == b[: len(a)]
    assert H.design_pair(54, "motion_reverse", 0, FRAME) != H.design_pair(53, "motion_reverse", 0, FRAME)
    with pytest.raises(ValueError, match="unknown pair kind"):
        H.design_pair(53, "lighting", 0, FRAME)


def test_auc_and_separation_against_brute_force() -> None:
    rng = np.random.default_rng(0)
    u, s = rng.normal(1.0, 1.0, 9), rng.normal(0.0, 1.0, 30)
    s[:3] = u[:3]  # ties count one half
    brute = np.mean([1.0 if x > y else (0.5 if x == y else 0.0) for x in u for y in s])
    assert H.auc(u, s) == pytest.approx(brute)
    assert H.auc([], s) is None
    rows = ([{"shape": float(x), "unsafe": True, "reusable": True} for x in u]
            + [{"shape": float(x), "unsafe": False, "reusable": True} for x in s]
            + [{"shape": 99.0, "unsafe": False, "reusable": False}])  # not reused: out of the comparison
    out = H.separation(rows, {"shape": 1.0}, axes=("shape",))
    assert (out["pairs"], out["reused"], out["b"]) == (40, 39, 9)
    ax = out["axes"]["shape"]
    assert ax["rejects_b"] == int((u > 1.0).sum()) and ax["rejects_safe"] == int((s > 1.0).sum())
    assert ax["separates"] == (ax["auc"] >= H.MIN_AUC and ax["p"] <= H.ALPHA)
    # an axis on which unsafe and safe take the same values never separates
    same = [{"shape": 0.5, "unsafe": i < 6, "reusable": True} for i in range(20)]
    got = H.separation(same, {"shape": 1.0}, axes=("shape",))["axes"]["shape"]
    assert got["auc"] == 0.5 and not got["separates"]


def test_the_committed_axes_result_recomputes_from_its_pairs(tmp_path) -> None:
    """rules/protocols/axes_s53_summary.json is what the report makes of rules/axes_s53_pairs.jsonl (the docs quote it:
    6 unsafe of 171 reused hard pairs, no axis separating them)."""
    import json
    import sys

    from repo_package import ROOT

    sys.path.insert(0, str(ROOT / "scripts" / "lab"))
    import axis_separation

    out = tmp_path / "summary.json"
    assert axis_separation.main(["--out", str(ROOT / "rules" / "axes_s53_pairs.jsonl"), "--report",
                                 "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got == json.loads((ROOT / "rules" / "protocols" / "axes_s53_summary.json").read_text())
    hard = got["per_kind"]["HARD (pooled)"]
    assert (hard["pairs"], hard["reused"], hard["b"]) == (200, 171, 6)
    assert not any(a["separates"] for a in hard["axes"].values())
    assert got["per_kind"]["background_near"]["reused"] == 0
