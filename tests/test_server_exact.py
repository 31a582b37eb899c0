"""Exact repeats on a real ComfyUI server (POST /prompt, /history, the stats route, the server log):

* with ComfyUI's node cache off (``--cache-none``) the second identical request is answered from Carnator's cache
  with no model call (report: HIT, mode exact, 0 model calls; stats: one more hit; log: ``carnator request: HIT``),
  and so is a third one after a server restart;
* with the node cache on, a requeued identical graph is short-circuited by ComfyUI, and Carnator's report still
  reaches /history — also for an API client that sends no client_id.
"""
from __future__ import annotations

import json

import pytest
from harness_server import ComfyServer

pytestmark = [pytest.mark.server, pytest.mark.slow]

PROMPT = "a small red ball rolls to the right across green grass"


def graph(directory: str, seed: int = 7) -> dict:
    return {
        "1": {"class_type": "CarnatorEmbeddedLoader", "inputs": {}},
        "2": {"class_type": "CarnatorEmbeddedTextEncode", "inputs": {"text_encoder": ["1", 1], "text": PROMPT}},
        "3": {"class_type": "CarnatorEmbeddedTextEncode", "inputs": {"text_encoder": ["1", 1], "text": ""}},
        "4": {"class_type": "CarnatorEmbeddedEmptyLatent", "inputs": {"batch_size": 1}},
        "10": {"class_type": "CarnatorCacheLoader", "inputs": {"directory": directory}},
        "5": {"class_type": "CarnatorEarlyProbe", "inputs": {
            "model": ["1", 0], "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "seed": seed,
            "steps": 8, "cfg": 5.0, "sampler_name": "euler", "scheduler": "simple", "probe_steps": 2,
            "prompt": PROMPT, "text_encoder": ["1", 1], "cache": ["10", 0]}},
        "11": {"class_type": "CarnatorSignatureBuilder", "inputs": {"probe": ["5", 0]}},
        "12": {"class_type": "CarnatorCacheRetriever", "inputs": {"cache": ["10", 0], "probe": ["5", 0]}},
        "13": {"class_type": "CarnatorRiskFilter", "inputs": {
            "signature": ["11", 0], "candidates": ["12", 0], "rule_file": "embedded.json", "mode": "prompt_only",
            "prompt_threshold": 0.999, "allow_uncertified": False, "probe": ["5", 0]}},
        "6": {"class_type": "CarnatorJointReuseSampler", "inputs": {
            "model": ["1", 0], "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0],
            "probe": ["5", 0], "decision": ["13", 0], "signature": ["11", 0], "cache": ["10", 0], "mode": "joint"}},
        "14": {"class_type": "CarnatorCacheWriter", "inputs": {
            "cache": ["10", 0], "probe": ["5", 0], "signature": ["11", 0], "latent": ["6", 0], "report": ["6", 1]}},
        "7": {"class_type": "CarnatorEmbeddedDecode", "inputs": {"decoder": ["1", 2], "samples": ["6", 0]}},
        "8": {"class_type": "SaveImage", "inputs": {"images": ["7", 0], "filename_prefix": "carnator_exact"}},
    }


def reports(history: dict) -> list[dict]:
    return [r for out in history["outputs"].values() for r in out.get("carnator_report", [])]


def stats(server: ComfyServer, directory: str) -> dict:
    return server.get(f"/carnator/cache/stats?directory={directory}")


def queue_without_client(server: ComfyServer, prompt: dict) -> dict:
    """An API client that sends no client_id (ComfyUI then reports no cached node UI to anyone)."""
    pid = server.post("/prompt", {"prompt": prompt})["prompt_id"]
    return server.wait_history(pid, timeout=600)


def test_exact_repeat_with_node_cache_off_and_after_restart(tmp_path):
    base = tmp_path / "base"
    with ComfyServer(base, extra_args=["--cache-none"]) as server:
        first, _ = server.run_prompt_ws(graph("exact"), timeout=600)
        r1 = reports(first)[0]
        assert r1["decision"] in ("miss", "dense") and r1["model_calls"] == 6, r1
        s1 = stats(server, "exact")
        second, _ = server.run_prompt_ws(graph("exact"), timeout=600)
        r2 = reports(second)[0]
        assert (r2["decision"], r2["mode"], r2["model_calls"], r2["replayed_calls"]) == ("hit", "exact", 0, 0), r2
        s2 = stats(server, "exact")
        assert (s2["hits"] - s1["hits"], s2["lookups"] - s1["lookups"], s2["entries"]) == (1, 1, s1["entries"])
        assert "carnator request: HIT" in server.log_tail(200000)
        entry = r2["entry_id"]
    with ComfyServer(base, extra_args=["--cache-none"]) as server:  # a restart: only the disk is left
        third = queue_without_client(server, graph("exact"))
        r3 = reports(third)[0]
        assert (r3["decision"], r3["mode"], r3["entry_id"], r3["model_calls"]) == ("hit", "exact", entry, 0), r3
        other = queue_without_client(server, graph("exact", seed=8))  # another seed is another request
        assert reports(other)[0]["model_calls"] == 6


def test_report_reaches_history_when_comfyui_short_circuits_a_requeued_graph(comfy_server):
    # The session's shared default server (node cache on, tests/conftest.py): the cache directory "requeue" is this
    # test's alone, and the two identical graphs are queued back to back.
    server = comfy_server
    first = queue_without_client(server, graph("requeue"))
    assert reports(first) and reports(first)[0]["decision"] in ("miss", "dense")
    again = queue_without_client(server, graph("requeue"))
    found = reports(again)
    assert found, f"no carnator_report in /history of a requeued graph: {json.dumps(again['outputs'])[:800]}"
    assert (found[0]["decision"], found[0]["mode"], found[0]["model_calls"]) == ("hit", "node_cache", 0), found[0]
