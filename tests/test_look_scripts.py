"""The looking tools of the certification write-ups, on hand-built clips: scripts/lab/look_label_disagreements.py
picks the pairs to draw (label disagreements, or every b of the pairs a rule accepts) and scripts/lab/track_speed.py
measures how far each moving object travels in the reuse clip against the dense clip."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from carnator.carnator_core.embedded import checker, world

ROOT = Path(__file__).resolve().parents[1]
FRAME = world.Frame(frames=8, height=48, width=48)
PROMPT = "a big red ball moves to the right in the center, on green grass"


def _clip(x0: float, x1: float) -> np.ndarray:
    """A red ball moving from x0 to x1 over the 8 frames, on grass."""
    bg = world.background_image("grass", FRAME)
    out = np.broadcast_to(bg, (8, 48, 48, 3)).copy()
    for t, x in enumerate(np.linspace(x0, x1, 8)):
        out[t][checker.silhouette("ball", float(x), 24.0, 7.0, 48, 48)] = world.PALETTE["red"]
    return (np.clip(out, 0, 1) * 255 + 0.5).astype(np.uint8)


@pytest.fixture()
def run(tmp_path):
    """Three requests, one accepted pair each: q0 reuse = dense; q1 the ball barely moves (a b under both labels);
    q2 the ball moves like the dense one but the second label calls it b and the first did not (a disagreement)."""
    clips = tmp_path / "clips"
    clips.mkdir()
    head = {"type": "header", "unsafe_definition": "second excess label", "top_k": 3, "min_similarity": 0.0}
    rows = []
    for i, (reuse, b, b_v1) in enumerate((((20.0, 30.0), False, False), ((20.0, 22.0), True, True),
                                          ((20.0, 30.0), True, False))):
        rid = f"q{i}"
        np.savez_compressed(clips / f"{rid}.npz", dense=_clip(20.0, 30.0), e1=_clip(*reuse))
        rows.append({"request_id": rid, "entry_id": "w1", "similarity": 0.95, "context": 1.0, "size": 0.1,
                     "shape": 0.1, "appearance": 1.0, "missing": False, "unsafe": b, "change": "rewording",
                     "diag": {"kind": "paraphrase", "prompt": PROMPT, "candidate_prompt": PROMPT + ".", "seed": 5,
                              "candidate_seed": 5, "store_entry": "e1", "label_v1": {"unsafe": b_v1, "better": False},
                              "v2": {"reuse_failed": [], "dense_failed": [], "detail_failed": []}}})
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("\n".join(json.dumps(r) for r in [head] + rows) + "\n")
    sys.path.insert(0, str(ROOT / "scripts" / "lab"))
    return pairs, clips


def test_look_label_disagreements_selects_disagreements_or_every_b(run, tmp_path, capsys):
    import look_label_disagreements as look

    pairs, clips = run
    assert look.main(["--pairs", str(pairs), "--clips", str(clips), "--png", str(tmp_path / "dis")]) == 0
    assert sorted(p.name for p in (tmp_path / "dis").iterdir()) == ["q2_w1_paraphrase.png"]
    rule = ROOT / "rules" / "embedded.json"  # its thresholds accept all three (context 1, size 0.1, similarity 0.95)
    assert look.main(["--pairs", str(pairs), "--clips", str(clips), "--png", str(tmp_path / "b"), "--select",
                      "unsafe", "--accepted-by", str(rule)]) == 0
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["q1_w1_paraphrase.png", "q2_w1_paraphrase.png"]
    out = capsys.readouterr().out
    assert "q1_w1_paraphrase.png: b (" in out and "q2_w1_paraphrase.png: new b" in out


def test_track_speed_measures_reuse_travel_against_the_dense_clip(run, tmp_path, capsys):
    import track_speed

    pairs, clips = run
    js = tmp_path / "speed.json"
    assert track_speed.main(["--rule", str(ROOT / "rules" / "embedded.json"), "--pairs", f"{pairs}={clips}",
                             "--json", str(js)]) == 0
    got = json.loads(js.read_text())["rewording"]
    assert got["pairs"] == 3 and got["moving"] == 3
    # q1's ball travels 2 px where the dense one travels 10: ratio ≈ 0.2, listed with its label
    assert [(x["pair"].split(":")[1], x["b"]) for x in got["slow"]] == [("q1", True)]
    assert got["slow"][0]["ratio"] == pytest.approx(0.2, abs=0.08)
    assert got["median"] == pytest.approx(1.0, abs=0.05)
    assert "| rewording | 3 | 3 |" in capsys.readouterr().out
