"""The certified candidate set is what runs: a Cache Retriever that recalls fewer candidates (k) or fewer similar ones
(min_similarity) than the shipped rule was certified on is refused — at POST /prompt when its settings are literal,
at execution when they are computed by another node — through the node graph on a real ComfyUI server."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from harness_server import ComfyServer

pytestmark = [pytest.mark.server]

PROMPT = "a small red ball rolls to the right across green grass"


@pytest.fixture(scope="module")
def server(comfy_server: ComfyServer) -> ComfyServer:
    return comfy_server


def _rule():
    from test_server import ROOT

    from carnator.carnator_core.risk.rule import RiskRule

    return RiskRule.load(ROOT / "rules" / "embedded.json")


def graph(k, min_similarity=0.0, prefix="recallk") -> dict:
    """The stock config of the shipped rule (20 steps, CFG 2, probe 2) with a Retriever of ``k`` candidates."""
    return {
        "1": {"class_type": "CarnatorEmbeddedLoader", "inputs": {}},
        "2": {"class_type": "CarnatorEmbeddedTextEncode", "inputs": {"text_encoder": ["1", 1], "text": PROMPT}},
        "3": {"class_type": "CarnatorEmbeddedTextEncode", "inputs": {"text_encoder": ["1", 1], "text": ""}},
        "4": {"class_type": "CarnatorEmbeddedEmptyLatent", "inputs": {"batch_size": 1}},
        "10": {"class_type": "CarnatorCacheLoader", "inputs": {"directory": f"{prefix}_cache"}},
        "5": {"class_type": "CarnatorEarlyProbe", "inputs": {
            "model": ["1", 0], "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "seed": 11,
            "steps": 20, "cfg": 2.0, "sampler_name": "euler", "scheduler": "simple", "probe_steps": 2,
            "prompt": PROMPT, "text_encoder": ["1", 1], "cache": ["10", 0]}},
        "11": {"class_type": "CarnatorSignatureBuilder", "inputs": {"probe": ["5", 0]}},
        "12": {"class_type": "CarnatorCacheRetriever", "inputs": {"cache": ["10", 0], "probe": ["5", 0], "k": k,
                                                                   "min_similarity": min_similarity}},
        "13": {"class_type": "CarnatorRiskFilter", "inputs": {
            "signature": ["11", 0], "candidates": ["12", 0], "rule_file": "embedded.json", "mode": "signature",
            "prompt_threshold": 0.9, "allow_uncertified": False, "probe": ["5", 0]}},
        "14": {"class_type": "PreviewAny", "inputs": {"source": ["13", 1]}},
    }


def post(server: ComfyServer, g: dict) -> tuple[int, dict]:
    req = urllib.request.Request(server.url + "/prompt", data=json.dumps({"prompt": g}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_smaller_k_is_refused_at_queue_time(server):
    rule = _rule()
    assert rule.recall_k == 3, "the shipped rule records top-3 recall"
    status, body = post(server, graph(rule.recall_k - 1))
    assert status == 400, body
    errors = json.dumps(body["node_errors"])
    assert "top-2" in errors and "top-3" in errors and "Set the Retriever's k to 3" in errors
    assert "13" in body["node_errors"]  # reported on the Risk Filter, naming the Retriever
    # a higher minimum similarity than the rule's narrows the candidates too
    status, body = post(server, graph(rule.recall_k, min_similarity=0.5))
    assert status == 400 and "min_similarity" in json.dumps(body["node_errors"]), body


def test_the_rules_k_or_more_runs(server):
    for k in (3, 5):
        status, body = post(server, graph(k, prefix=f"recallk{k}"))
        assert status == 200 and not body.get("node_errors"), body
        h = server.wait_history(body["prompt_id"], timeout=900)
        assert h["status"]["status_str"] == "success", h["status"]
        summary = h["outputs"]["14"]["text"][0]
        assert "REJECT → dense: no candidates recalled" in summary  # a fresh cache: the rule decided, dense


def test_a_computed_smaller_k_is_refused_at_execution(server):
    g = graph(["20", 0], prefix="recallk_linked")
    g["20"] = {"class_type": "PrimitiveInt", "inputs": {"value": 1}}
    status, body = post(server, g)
    assert status == 200, body  # a linked value is unknown at queue time
    with pytest.raises(RuntimeError, match=r"top-1 candidates, but risk rule 'embedded.json' was certified on the "
                                           r"top-3.*RecallNarrowedError") as err:
        server.wait_history(body["prompt_id"], timeout=900)
    assert '"node_id": "13"' in str(err.value)
