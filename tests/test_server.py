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
def server(comfy_server: ComfyServer) -> ComfyServer:
    """The session's shared default server (tests/conftest.py): these tests use no cache directory, and their
    saved files have their own prefixes (carnator_test, split/...)."""
    return comfy_server


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


def test_queued_split_schedule_equals_two_ksampler_advanced_and_checks_stages(server):
    """A split schedule through POST /prompt (a single-model split on the embedded model: the same MODEL is both
    stages' model and the probe's second_model): the two Joint Reuse Sampler stages save the same latent as two
    stock KSamplerAdvanced nodes in the same prompt, bit for bit; a stage that runs no step is refused at queue
    time with the reason."""
    import torch
    from safetensors.torch import load_file

    text = "a small red ball rolls to the right across green grass"
    base = {
        "1": {"class_type": "CarnatorEmbeddedLoader", "inputs": {}},
        "2": {"class_type": "CarnatorEmbeddedTextEncode", "inputs": {"text_encoder": ["1", 1], "text": text}},
        "3": {"class_type": "CarnatorEmbeddedTextEncode", "inputs": {"text_encoder": ["1", 1], "text": ""}},
        "4": {"class_type": "CarnatorEmbeddedEmptyLatent", "inputs": {"batch_size": 1}},
    }
    cond = {"positive": ["2", 0], "negative": ["3", 0]}
    common = {"seed": 11, "steps": 8, "cfg": 5.0, "sampler_name": "euler", "scheduler": "simple"}
    first = {"add_noise": "enable", "start_at_step": 0, "end_at_step": 4, "return_with_leftover_noise": "enable"}
    second = {"add_noise": "disable", "start_at_step": 4, "end_at_step": 10000, "return_with_leftover_noise": "disable"}
    graph = {
        **base,
        "5": {"class_type": "CarnatorEarlyProbe", "inputs": {
            "model": ["1", 0], "second_model": ["1", 0], **cond, "latent_image": ["4", 0], **common,
            "probe_steps": 2, "prompt": text, "text_encoder": ["1", 1], **first}},
        "6": {"class_type": "CarnatorJointReuseSampler", "inputs": {
            "model": ["1", 0], **cond, "latent_image": ["4", 0], "probe": ["5", 0], "mode": "dense", **first}},
        "7": {"class_type": "CarnatorJointReuseSampler", "inputs": {
            "model": ["1", 0], **cond, "latent_image": ["6", 0], "probe": ["5", 0], "mode": "dense", **second}},
        "8": {"class_type": "SaveLatent", "inputs": {"samples": ["7", 0], "filename_prefix": "split/carnator"}},
        "9": {"class_type": "KSamplerAdvanced", "inputs": {
            "model": ["1", 0], **cond, "latent_image": ["4", 0], "noise_seed": 11,
            **{k: v for k, v in common.items() if k != "seed"}, **first}},
        "10": {"class_type": "KSamplerAdvanced", "inputs": {
            "model": ["1", 0], **cond, "latent_image": ["9", 0], "noise_seed": 11,
            **{k: v for k, v in common.items() if k != "seed"}, **second}},
        "11": {"class_type": "SaveLatent", "inputs": {"samples": ["10", 0], "filename_prefix": "split/stock"}},
    }
    history, _ = server.run_prompt_ws(graph, timeout=600)
    assert history["status"]["status_str"] == "success", server.log_tail()
    r1, r2 = history["outputs"]["6"]["carnator_report"][0], history["outputs"]["7"]["carnator_report"][0]
    assert (r1["stage"], r1["final"], r1["replayed_calls"], r1["model_calls"]) == ("first", False, 2, 2)
    assert (r2["stage"], r2["final"], r2["replayed_calls"], r2["model_calls"]) == ("second", True, 0, 4)

    def saved(node: str) -> torch.Tensor:
        (f,) = history["outputs"][node]["latents"]
        return load_file(str(server.base_dir / "output" / f["subfolder"] / f["filename"]))["latent_tensor"]

    ours, stock = saved("8"), saved("11")
    assert torch.equal(ours, stock), f"max diff {(ours - stock).abs().max().item()}"

    # only the Carnator path: with another valid output ComfyUI would queue the rest and list this in node_errors
    bad = {k: v for k, v in graph.items() if int(k) <= 8}
    bad["5"] = {**graph["5"], "inputs": {**graph["5"]["inputs"], "start_at_step": 6, "end_at_step": 4}}
    with pytest.raises(RuntimeError, match=r"400.*start_at_step \(6\) must be below end_at_step \(4\)"):
        server.queue_prompt(bad)
