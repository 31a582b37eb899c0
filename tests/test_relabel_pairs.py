"""scripts/lab/relabel_pairs.py judges saved clips again under the second label (no generation): a pair the first
label passed (a diamond drawn for a ball) becomes b, the first label's verdict is kept, each row gets its stratum; and
scripts/lab/certify_strata.py writes a rule whose strata recompute from the combined pairs."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from carnator.carnator_core.embedded import checker, world

ROOT = Path(__file__).resolve().parents[1]
FRAME = world.Frame(frames=8, height=48, width=48)
PROMPT = "a big red ball moves to the right in the center, on green grass"
CAND = "a big red ball moves to the right in the center, on a grassy field"  # a rewording


def _clip(shape: str) -> np.ndarray:
    bg = world.background_image("grass", FRAME)
    out = np.broadcast_to(bg, (8, 48, 48, 3)).copy()
    tex = np.random.default_rng(0).normal(0.0, 0.03, out.shape)
    for t, x in enumerate(np.linspace(20.0, 28.0, 8)):
        out[t][checker.silhouette(shape, float(x), 24.0, 7.0, 48, 48)] = world.PALETTE["red"]
    return (np.clip(out + tex, 0, 1) * 255 + 0.5).astype(np.uint8)


def test_relabel_then_certify_strata(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts" / "lab"))
    import certify_strata
    import relabel_pairs

    from carnator.carnator_core.risk.rule import RiskRule

    rule = RiskRule.load(ROOT / "rules" / "embedded.json", allow_uncertified=True)
    head = {"type": "header", "model_fingerprint": rule.model_fingerprint,
            "config_fingerprint": rule.config_fingerprint, "unsafe_definition": "first label", "top_k": 3,
            "min_similarity": 0.0}
    clips = tmp_path / "clips"
    clips.mkdir()
    rows = []
    for i, shape in enumerate(("ball", "diamond")):  # q0: reuse = dense (safe); q1: a diamond for the ball
        rid = f"q{i}"
        np.savez_compressed(clips / f"{rid}.npz", dense=_clip("ball"), e1=_clip(shape), prompt=np.asarray(PROMPT))
        rows.append({"request_id": rid, "entry_id": "w1", "similarity": 0.95, "context": 1.0, "size": 0.1,
                     "shape": 0.1, "appearance": 1.0, "missing": False, "unsafe": False,
                     "diag": {"kind": "paraphrase", "prompt": PROMPT, "candidate_prompt": CAND, "seed": 5,
                              "candidate_seed": 5, "store_entry": "e1"}})
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("\n".join(json.dumps(r) for r in [head] + rows) + "\n")
    out = tmp_path / "relabelled.jsonl"
    assert relabel_pairs.main(["--pairs", str(pairs), "--clips", str(clips), "--out", str(out)]) == 0
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert "second excess label" in got[0]["unsafe_definition"] and got[0]["relabelled_from"]["pairs"] == 2
    q0, q1 = got[1], got[2]
    assert q0["unsafe"] is False and q1["unsafe"] is True  # the shape is now seen
    assert q1["diag"]["label_v1"] == {"unsafe": False, "better": False} and q1["diag"]["v2"]["reuse_failed"] == [
        "o0.shape"]
    assert q0["change"] == q1["change"] == "rewording"

    rule_out = tmp_path / "rule.json"
    assert certify_strata.main(["--rule", str(ROOT / "rules" / "embedded.json"), "--out", str(rule_out),
                                "--pairs", f"{out}=s1", "--combined", str(tmp_path / "combined.jsonl"),
                                "--order", "rewording,reseed"]) == 0
    written = RiskRule.load(rule_out)
    st = written.strata
    assert st.strata["rewording"].n == 2 and st.strata["rewording"].k == 1 and st.certified == ()
    assert written.provenance["strata_pairs"] == ["combined.jsonl"]
    assert written.thresholds == rule.thresholds and written.certificate == rule.certificate
