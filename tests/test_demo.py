"""The demo (scripts/demo.py --quick) against a real ComfyUI server, and the workload it serves.

* Workload (pure core, fast): deterministic for a spec, stream disjoint from the warm set as requests, every
  request a valid scene whose caption the checker reads back, edits change exactly the attribute they name.
* Demo (server + slow): ``scripts/demo.py --quick`` runs end to end through ``POST /prompt`` and writes
  report.html with animated WebP clips and matplotlib plots.
"""
from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------ workload (core)
def test_workload_is_deterministic_and_disjoint():
    from carnator.carnator_core.lab.workload import WorkloadSpec, build_workload, describe

    spec = WorkloadSpec(n_warm=12, n_stream=20, seed=3)
    a, b = build_workload(spec), build_workload(spec)
    assert a == b and a.digest() == b.digest()
    assert build_workload(dataclasses.replace(spec, seed=4)).digest() != a.digest()
    assert len(a.warm) == 12 and len(a.stream) == 20
    assert {r.rid for r in a.warm}.isdisjoint({r.rid for r in a.stream})
    warm_keys = [(r.prompt, r.seed) for r in a.warm]
    assert len(set(warm_keys)) == len(warm_keys), "a cache holds one entry per (prompt, seed)"
    assert all(r.kind != "exact" for r in a.warm)
    d = describe(a)
    assert d["n_stream"] == 20 and sum(d["stream_kinds"].values()) == 20
    assert 0.0 <= d["stream_template_in_warm"] <= 1.0


def test_workload_requests_are_valid_and_edits_change_one_attribute():
    from carnator.carnator_core.embedded import world
    from carnator.carnator_core.lab.workload import Request, WorkloadSpec, build_workload, valid_scene

    wl = build_workload(WorkloadSpec(n_warm=16, n_stream=32, seed=1))
    by_rid = {r.rid: r for r in wl.requests}
    for r in wl.requests:
        assert valid_scene(r.scene), r
        parsed = world.parse_caption(r.prompt)
        assert parsed.background == r.scene.background, r.prompt
        assert [(o.shape, o.colour, o.size, o.position, o.motion) for o in parsed.objects] == \
            [(o.shape, o.colour, o.size, o.position, o.motion) for o in r.scene.objects], r.prompt
        assert Request.from_json(json.loads(json.dumps(r.to_json()))) == r
        if r.parent is None:
            assert r.kind == "base"
            continue
        p = by_rid[r.parent]
        if r.kind == "exact":
            assert (r.prompt, r.seed) == (p.prompt, p.seed)
        elif r.kind == "reroll":
            assert r.prompt == p.prompt and r.seed != p.seed
        elif r.kind == "paraphrase":
            assert r.scene == p.scene and r.seed == p.seed and r.prompt != p.prompt
        else:
            attr = r.kind.split(":", 1)[1]
            assert r.seed == p.seed
            if attr == "background":
                assert r.scene.background != p.scene.background and r.scene.objects == p.scene.objects
            else:
                changed = [(a, b) for a, b in zip(r.scene.objects, p.scene.objects) if a != b]
                assert len(changed) == 1
                a, b = changed[0]
                diff = [f.name for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)]
                assert diff == [attr]


def test_workload_popularity_is_heavy_tailed():
    from carnator.carnator_core.lab.workload import WorkloadSpec, build_workload, describe, zipf_probs

    p = zipf_probs(16, 1.1)
    assert abs(p.sum() - 1) < 1e-12 and p[0] > 5 * p[-1]
    d = describe(build_workload(WorkloadSpec(n_warm=40, n_stream=40, seed=0)))
    assert d["top_template_share"] > 1.5 / d["templates"]  # the most popular scene recurs well above uniform


# ------------------------------------------------------------------------------------------ the demo (server)
@pytest.mark.server
@pytest.mark.slow
def test_demo_quick_writes_report_with_clips_and_plots(tmp_path):
    from carnator.carnator_core.embedded import config as ecfg

    if not ecfg.DEFAULT_WEIGHTS.exists():
        pytest.skip(f"embedded model weights not found at {ecfg.DEFAULT_WEIGHTS}")
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py"), "--quick", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    # The node listing the demo always started with, one line per request, the summary.
    assert re.search(r"ComfyUI \S+ on http://127\.0\.0\.1:\d+: \d+ node types, \d+ from Carnator", proc.stdout)
    assert "CarnatorJointReuseSampler" in proc.stdout
    lines = [ln for ln in proc.stdout.splitlines() if re.match(r"^[ws]\d{4} ", ln)]
    assert len(lines) == 5, proc.stdout
    assert all(re.search(r"latency=\s*\d+\.\d+s", ln) for ln in lines), lines
    report = out / "report.html"
    assert report.exists()
    page = report.read_text(encoding="utf-8")
    clips = sorted((out / "clips").glob("*.webp"))
    assert len(clips) == 5 + 3  # every request's clip, and a dense twin's for each stream request
    for clip in clips:
        assert clip.read_bytes()[:4] == b"RIFF" and clip.read_bytes()[8:12] == b"WEBP"
        assert f'src="clips/{clip.name}"' in page
    for plot in ("latency.png", "hit_rate.png"):
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f'src="{plot}"' in page
    results = json.loads((out / "results.json").read_text())
    stream = [r for r in results["rows"] if r["phase"] == "stream"]
    assert len(stream) == 3 and all(r["decision"] in ("hit", "miss") for r in stream)
    # each stream request was measured beside its dense twin (the same request through a plain KSampler graph)
    assert all(r["dense_latency_s"] > 0 and r["dense_clip"] == f"clips/{r['rid']}_dense.webp" for r in stream)
    assert results["summary"]["stream"] == 3 and results["summary"]["stream_speedup_vs_dense"] > 0
