"""scripts/lab/validate_judge.py's offline half: the threshold fit and the report, on rows whose answer is known."""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "lab"))

import validate_judge as vj  # noqa: E402

ZERO = {f: 0.0 for f in vj.PAIR_FEATURES}


def test_fit_keeps_false_alarms_under_target_and_catches_what_it_can():
    neg = [{**ZERO, "d_margin": 0.01 * i} for i in range(100)]  # 0.00 .. 0.99
    pos = [{**ZERO, "d_margin": 0.5 + 0.01 * i} for i in range(50)] + [{**ZERO, "d_error": 5.0}]
    th = vj.fit_thresholds(pos, neg, vj.PAIR_FEATURES, 0.08)
    fa = sum(vj._fires(n, th) for n in neg) / len(neg)
    det = sum(vj._fires(p, th) for p in pos) / len(pos)
    assert fa <= 0.08 and th["d_margin"] >= 0.9
    assert vj._fires(pos[-1], th)  # the one positive only d_error shows is caught too (no negative has d_error > 0)
    assert det == (sum(p["d_margin"] > th["d_margin"] for p in pos[:-1]) + 1) / len(pos)


def _row(unit, dense_pass, items):
    alone = {"margin": -0.5, "error": 1.0, "neg_presence": -0.5}
    return {"unit": unit, "part": "scene", "target": "t", "seed": 1, "objects": 1,
            "dense_checker": {"pass": dense_pass, "reasons": []}, "dense_alone": alone,
            "alone": [{"caption": "t", "checker": {"pass": dense_pass, "reasons": []}, "scores": alone}],
            "items": [{"kind": k, "source": "s", "checker": {"pass": ok, "reasons": [] if ok else [f"ball: {a} x"]},
                       "pair": {**ZERO, "d_margin": dm}, "clip_alone": alone} for k, ok, a, dm in items]}


def test_report_on_known_rows(tmp_path, capsys):
    rows = []
    for i in range(20):
        rows.append(_row(f"s{i:04d}", True, [("colour_swap", False, "colour", 1.0 + 0.01 * i),
                                              ("fresh_seed", True, "", 0.0)]))
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert vj.main(["--out", str(tmp_path), "report", "--truth", "v1"]) == 0
    text = capsys.readouterr().out
    assert "| colour_swap | 10 | 10 | 100% (10/10) | – |" in text
    assert "| fresh_seed | 10 | 0 | – | 0% (0/10) |" in text
    assert "| colour | 10 | 100% (10/10) |" in text
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["disagreements"] == [] and 0.0 <= rep["thresholds"]["d_margin"] < 1.0
