"""scripts/lab/make_pairs.py's --merge-only: a run stopped early is written out as the prefix it labelled."""
from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.comfy, pytest.mark.slow]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "lab" / "make_pairs.py"), *args], capture_output=True,
                          text=True, timeout=600)


def _run_each(*argvs: list[str]) -> list[subprocess.CompletedProcess]:
    """Independent runs (each refused before any work) at once: what ``_run`` gives for each, in order."""
    with ThreadPoolExecutor(len(argvs)) as pool:
        return list(pool.map(lambda argv: _run(*argv), argvs))


def test_merge_only_writes_the_labelled_prefix_and_says_so(tmp_path):
    work, out = tmp_path / "w", tmp_path / "pairs.jsonl"
    common = ["--work", str(work), "--out", str(out), "--seed", "5", "--warm", "4", "--queries", "9"]
    r = _run(*common, "--merge-only")
    assert r.returncode != 0 and "no labelled requests yet" in r.stderr
    assert json.loads((work / "run.json").read_text())["queries"] == 9  # the run's settings are fixed as usual
    header = {"type": "header", "model_fingerprint": "m" * 24, "config_fingerprint": "c" * 16, "arch": "embedded",
              "config": {}, "dataset": "", "seeds": [], "unsafe_definition": "test", "generator": ""}
    rows = [{"request_id": f"q000{i}", "entry_id": "w0000", "similarity": 0.9, "context": 0, "size": 0, "shape": 0,
             "appearance": 0, "missing": False, "unsafe": i == 1} for i in (0, 1)]
    (work / "part-0.jsonl").write_text("\n".join(json.dumps(x) for x in [header, *rows]) + "\n")
    r = _run(*common, "--merge-only")
    assert r.returncode == 4, r.stderr  # fewer requests than planned: not a complete run
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0]["type"] == "header"
    assert (lines[0]["requests_labelled"], lines[0]["requests_planned"]) == (2, 9)
    assert [x["request_id"] for x in lines[1:]] == ["q0000", "q0001"]
    assert "wrote" in r.stdout and "2 requests, 2 pairs, 1 unsafe" in r.stdout
    assert "CFG 2," in lines[0]["dataset"]  # the default (v3) weights' stock scale
    r = _run(*[a if a != "9" else "10" for a in common], "--merge-only")  # other settings: refused, as before
    assert r.returncode != 0 and "other settings" in r.stderr
    # pairs of v2 weights say v2's own scale (what the labelled requests ran at)
    v2 = ROOT / "carnator_core" / "embedded" / "weights" / "carnator_embedded_v2.safetensors"
    work3, out3 = tmp_path / "w3", tmp_path / "pairs3.jsonl"
    common3 = ["--work", str(work3), "--out", str(out3), "--seed", "5", "--warm", "4", "--queries", "9",
               "--weights", str(v2)]
    assert _run(*common3, "--merge-only").returncode != 0  # fixes the run's settings
    (work3 / "part-0.jsonl").write_text("\n".join(json.dumps(x) for x in [header, *rows]) + "\n")
    assert _run(*common3, "--merge-only").returncode == 4
    assert "CFG 5," in json.loads(out3.read_text().splitlines()[0])["dataset"]


def test_reuse_set_is_checked_before_any_work(tmp_path):
    """``--reuse-set`` names a ReuseConfig field; a typo or a bad value fails at once, with the fields it could
    be, before a work directory is created."""
    work, out = tmp_path / "w", tmp_path / "pairs.jsonl"
    common = ["--work", str(work), "--out", str(out), "--seed", "5", "--warm", "4", "--queries", "9"]
    typo, bad, mode = _run_each([*common, "--reuse-set", "probe_contxt=1"], [*common, "--reuse-set", "refreshes=many"],
                                [*common, "--reuse-set", "mode=latent"])
    assert typo.returncode != 0 and "probe_contxt" in typo.stderr and "probe_context" in typo.stderr
    assert bad.returncode != 0 and "refreshes=many" in bad.stderr
    assert mode.returncode != 0 and "--reuse-mode" in mode.stderr
    assert not work.exists()


def test_easycache_settings_are_checked_before_any_work(tmp_path):
    """``--easycache THRESHOLD,START,END`` labels on the EasyCache-patched model; malformed or impossible settings
    fail at once with what is wrong, before a work directory is created."""
    work, out = tmp_path / "w", tmp_path / "pairs.jsonl"
    common = ["--work", str(work), "--out", str(out), "--seed", "5", "--warm", "4", "--queries", "9"]
    short, order, zero = _run_each([*common, "--easycache", "0.2,0.15"], [*common, "--easycache", "0.2,0.9,0.5"],
                                   [*common, "--easycache", "0,0.15,0.95"])
    assert short.returncode != 0 and "THRESHOLD,START,END" in short.stderr
    assert order.returncode != 0 and "start < end" in order.stderr
    assert zero.returncode != 0 and "positive" in zero.stderr
    assert not work.exists()
