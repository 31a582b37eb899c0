"""A real ComfyUI server with Carnator loaded: every Carnator node is registered, and a queued workflow using
the embedded model and the Carnator probe + sampler completes through POST /prompt and the websocket."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from harness_server import ComfyServer

pytestmark = [pytest.mark.server]
ROOT = Path(__file__).resolve().parents[1]


def declared_node_ids() -> set[str]:
    ids = set()
    for f in (ROOT / "nodes").glob("*.py"):
        ids |= set(re.findall(r'node_id="([A-Za-z0-9_]+)"', f.read_text()))
    return ids


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ComfyServer(tmp_path_factory.mktemp("comfy-base")) as s:
        yield s


def test_every_carnator_node_is_registered(server):
    info = server.get("/object_info")
    expected = declared_node_ids()
    assert len(expected) >= 8, expected
    missing = sorted(expected - set(info))
    assert not missing, f"not registered: {missing}; server log:\n{server.log_tail()}"
    for nid in expected:
        spec = info[nid]
        assert spec["category"].startswith("Carnator")
        for section in ("required", "optional"):
            for name, value in spec["input"].get(section, {}).items():
                opts = value[1] if len(value) > 1 and isinstance(value[1], dict) else {}
                assert opts.get("tooltip"), f"{nid}.{name} has no tooltip"


def test_queued_probe_and_sampler_workflow_completes(server):
    prompt_text = "a small red ball rolls to the right across green grass"
    graph = {
        "1": {"class_type": "CarnatorEmbeddedLoader", "inputs": {}},
        "2": {"class_type": "CarnatorEmbeddedTextEncode", "inputs": {"text_encoder": ["1", 1], "text": prompt_text}},
        "3": {"class_type": "CarnatorEmbeddedTextEncode", "inputs": {"text_encoder": ["1", 1], "text": ""}},
        "4": {"class_type": "CarnatorEmbeddedEmptyLatent", "inputs": {"batch_size": 1}},
        "5": {"class_type": "CarnatorEarlyProbe", "inputs": {
            "model": ["1", 0], "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "seed": 7,
            "steps": 8, "cfg": 5.0, "sampler_name": "euler", "scheduler": "simple", "probe_steps": 2,
            "prompt": prompt_text, "text_encoder": ["1", 1]}},
        "6": {"class_type": "CarnatorJointReuseSampler", "inputs": {
            "model": ["1", 0], "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0],
            "probe": ["5", 0], "mode": "dense"}},
        "7": {"class_type": "CarnatorEmbeddedDecode", "inputs": {"decoder": ["1", 2], "samples": ["6", 0]}},
        "8": {"class_type": "SaveImage", "inputs": {"images": ["7", 0], "filename_prefix": "carnator_test"}},
    }
    history, messages = server.run_prompt_ws(graph, timeout=600)
    assert history["status"]["status_str"] == "success"
    report = history["outputs"]["6"]["carnator_report"][0]
    assert report["decision"] == "dense" and report["replayed_calls"] == 2 and report["model_calls"] == 6
    assert history["outputs"]["8"]["images"], "no frames saved"
    assert any(m["type"] == "progress" for m in messages), "no progress events on the websocket"
