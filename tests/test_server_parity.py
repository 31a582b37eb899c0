"""What is certified is what runs: the node graph queued through POST /prompt on a real ComfyUI server and
``request.serve`` (what calibration drives) reach the same decisions and outputs on the same request stream.

Stream (embedded model, 8 steps, probe 2, prompt-only filter at 0.95 so that decisions do not depend on a rule
calibrated for another config): a first request (miss, dense, written), a rewording of it at the same seed
(recalled and reused; on the default v3 model a new seed redraws more than the region gate allows), another scene
(miss or hit — whatever the stage functions decide, both sides must agree), and the first request again (an exact
repeat). The server runs with ``--cache-none`` so every request executes.
The final latents come back through ComfyUI's SaveLatent node.

Then, on the same server and caches, one request under a risk rule that records reuse settings (an uncertified
test rule for this config, permissive thresholds, ``probe_context`` on, as the shipped rule): a colour edit of the
first request at its seed, whose hit computes a region. The Sampler node follows the rule's settings
(``settings = certified``) and ``serve`` follows them (``ServeOptions.following_rule``); the hit reads the Early
Probe's keys/values on both sides only if the node's defaults keep them, so the outputs agree only if the graph
runs what the labelling ran.

Last, the same two requests behind ComfyUI's EasyCache node (its defaults): in the server the node's module is
loaded by file path, in this process by import, yet the patched MODEL must fingerprint the same on both sides — a
rule made here for it (as the certified EasyCache rule was) must apply there, with the same decision and output.
"""
from __future__ import annotations

import re

import pytest
import torch
from harness_server import ComfyServer

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.comfy]

P1 = "a small red ball rolls to the right across green grass"
P2 = "a big blue cube sits still in the center on a sandy beach"
P1B = "a small red ball rolls to the right across the green grass"  # a rewording of P1
STREAM = [(P1, 7), (P1B, 7), (P2, 7), (P1, 7)]
P1C = "a small blue ball rolls to the right across green grass"  # a colour edit of P1
STEPS, PROBE, THRESHOLD = 8, 2, 0.95
CFG = 2.0  # the default (v3) weights' stock scale


def graph(prompt: str, seed: int, prefix: str, rule_file: str = "embedded.json", mode: str = "prompt_only",
          allow_uncertified: bool = False, easycache: bool = False) -> dict:
    g = _graph(prompt, seed, prefix, rule_file, mode, allow_uncertified)
    if easycache:  # ComfyUI's EasyCache node (its defaults) patches the MODEL both the probe and the sampler run
        g["20"] = {"class_type": "EasyCache", "inputs": {"model": ["1", 0], "reuse_threshold": 0.2,
                                                         "start_percent": 0.15, "end_percent": 0.95, "verbose": False}}
        g["5"]["inputs"]["model"] = g["6"]["inputs"]["model"] = ["20", 0]
    return g


def _graph(prompt: str, seed: int, prefix: str, rule_file: str, mode: str, allow_uncertified: bool) -> dict:
    return {
        "1": {"class_type": "CarnatorEmbeddedLoader", "inputs": {}},
        "2": {"class_type": "CarnatorEmbeddedTextEncode", "inputs": {"text_encoder": ["1", 1], "text": prompt}},
        "3": {"class_type": "CarnatorEmbeddedTextEncode", "inputs": {"text_encoder": ["1", 1], "text": ""}},
        "4": {"class_type": "CarnatorEmbeddedEmptyLatent", "inputs": {"batch_size": 1}},
        "10": {"class_type": "CarnatorCacheLoader", "inputs": {"directory": "parity"}},
        "5": {"class_type": "CarnatorEarlyProbe", "inputs": {
            "model": ["1", 0], "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "seed": seed,
            "steps": STEPS, "cfg": CFG, "sampler_name": "euler", "scheduler": "simple", "probe_steps": PROBE,
            "prompt": prompt, "text_encoder": ["1", 1], "cache": ["10", 0]}},
        "11": {"class_type": "CarnatorSignatureBuilder", "inputs": {"probe": ["5", 0]}},
        "12": {"class_type": "CarnatorCacheRetriever", "inputs": {"cache": ["10", 0], "probe": ["5", 0]}},
        "13": {"class_type": "CarnatorRiskFilter", "inputs": {
            "signature": ["11", 0], "candidates": ["12", 0], "rule_file": rule_file, "mode": mode,
            "prompt_threshold": THRESHOLD, "allow_uncertified": allow_uncertified, "probe": ["5", 0]}},
        "6": {"class_type": "CarnatorJointReuseSampler", "inputs": {
            "model": ["1", 0], "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0],
            "probe": ["5", 0], "decision": ["13", 0], "signature": ["11", 0], "cache": ["10", 0], "mode": "joint"}},
        "14": {"class_type": "CarnatorCacheWriter", "inputs": {
            "cache": ["10", 0], "probe": ["5", 0], "signature": ["11", 0], "latent": ["6", 0], "report": ["6", 1]}},
        "15": {"class_type": "SaveLatent", "inputs": {"samples": ["6", 0], "filename_prefix": f"latents/{prefix}"}},
    }


def _outcome(report: dict, written: str | None, own_ids: dict[str, int]) -> tuple:
    """What must agree: decision, mode, which request's entry was used (by stream position), compute."""
    used = own_ids.get(report.get("entry_id") or "", None)
    return (report["decision"], report["mode"], used, report["model_calls"], round(report["active_fraction"], 6))


def _test_rule(probe):
    """An UNCERTIFIED rule for the test's config that accepts the colour edit and records reuse settings with
    ``probe_context`` (what the shipped rule records)."""
    from carnator.carnator_core.reuse import ReuseConfig
    from carnator.carnator_core.risk.certify import Certificate
    from carnator.carnator_core.risk.rule import RiskRule
    from carnator.carnator_core.risk.thresholds import Thresholds

    return RiskRule(thresholds=Thresholds(1000.0, 10.0, 10.0, 1000.0), certificate=Certificate(0, 0, 1.0, 0.05, 0.1, 0),
                    model_fingerprint=probe.model_fingerprint, config_fingerprint=probe.config.fingerprint(),
                    arch="embedded", config_meta=probe.config.to_meta(),
                    reuse_config=ReuseConfig(probe_context=True, context_margin_blocks=0).to_meta(),
                    provenance={"note": "UNCERTIFIED test rule (tests/test_server_parity.py)"})


def test_node_graph_and_serve_reach_the_same_decisions_and_outputs(tmp_path, comfy_env):
    from comfy_extras.nodes_easycache import EasyCacheNode
    from safetensors.torch import load_file

    from carnator.carnator_core.cache.store import Store
    from carnator.carnator_core.embedded import comfy_glue
    from carnator.carnator_core.probe import ProbeConfig
    from carnator.carnator_core.request import RequestSpec, ServeOptions, serve

    base = tmp_path / "base"
    server_out, server_ids = [], {}
    serve_out, serve_ids = [], {}
    model, te, _ = comfy_glue.load_embedded()
    store = Store.open(tmp_path / "serve-cache", key_path=tmp_path / "key")

    def via_server(server, i, g):
        h, _ = server.run_prompt_ws(g, timeout=900)
        report = h["outputs"]["6"]["carnator_report"][0]
        m = re.search(r"stored entry ([0-9a-f]{16})", h["outputs"]["14"]["text"][0])
        if m:
            server_ids[m.group(1)] = i
        latent = load_file(next((base / "output" / "latents").glob(f"parity{i}_*.latent")))["latent_tensor"]
        server_out.append((report, latent))

    def via_serve(i, prompt, seed, options, m=model):
        res = serve(m, te, te.encode(prompt), te.encode(""), comfy_glue.empty_latent(1),
                    RequestSpec(prompt, seed, STEPS, CFG), store, options)
        if res.entry_id and not res.exact and res.report.decision != "hit":
            serve_ids[res.entry_id] = i
        serve_out.append((res.report.to_meta(), res.latent["samples"]))
        return res

    with ComfyServer(base, extra_args=["--cache-none"]) as server:
        for i, (prompt, seed) in enumerate(STREAM):
            via_server(server, i, graph(prompt, seed, f"parity{i}"))
        options = ServeOptions(method="prompt_only", prompt_threshold=THRESHOLD, probe=ProbeConfig(probe_steps=PROBE))
        first = [via_serve(i, prompt, seed, options) for i, (prompt, seed) in enumerate(STREAM)][0]
        # Under a rule that records reuse settings: the colour edit, through both paths.
        rule = _test_rule(first.probe)
        rule.save(base / "user" / "carnator" / "rules" / "parity.json")
        i = len(STREAM)
        via_server(server, i, graph(P1C, 7, f"parity{i}", "parity.json", "signature", allow_uncertified=True))
        via_serve(i, P1C, 7, ServeOptions(method="carnator", rule=rule, allow_uncertified=True,
                                          probe=ProbeConfig(probe_steps=PROBE)))
        # Behind ComfyUI's EasyCache (the server loads the node by file path, the test imports it): another MODEL
        # to Carnator, so P1 is a miss in its own namespace; then the colour edit under a rule made in this process
        # for the patched MODEL — the server must find the same fingerprint, decision and output.
        easy = EasyCacheNode.execute(model, 0.2, 0.15, 0.95, False).args[0]
        i += 1
        ec_first = via_serve(i, P1, 7, options, m=easy)
        via_server(server, i, graph(P1, 7, f"parity{i}", easycache=True))
        ec_rule = _test_rule(ec_first.probe)
        assert ec_rule.model_fingerprint != rule.model_fingerprint
        ec_rule.save(base / "user" / "carnator" / "rules" / "parity_easycache.json")
        i += 1
        via_serve(i, P1C, 7, ServeOptions(method="carnator", rule=ec_rule, allow_uncertified=True,
                                          probe=ProbeConfig(probe_steps=PROBE)), m=easy)
        via_server(server, i, graph(P1C, 7, f"parity{i}", "parity_easycache.json", "signature",
                                    allow_uncertified=True, easycache=True))

    decisions = []
    for i, ((srep, slat), (rrep, rlat)) in enumerate(zip(server_out, serve_out)):
        a, b = _outcome(srep, None, server_ids), _outcome(rrep, None, serve_ids)
        request = STREAM[i] if i < len(STREAM) else [(P1C, 7), (P1, 7), (P1C, 7)][i - len(STREAM)]
        assert a == b, f"request {i} {request}: node graph {a} vs serve {b}"
        assert torch.allclose(slat, rlat, atol=1e-4, rtol=1e-4), (i, float((slat - rlat).abs().max()))
        decisions.append(a)
    # The stream exercised every path: a dense miss, a reuse of request 0, an exact repeat of request 0, and a
    # hit under the rule's settings that computes a region over the probe's keys/values.
    assert len(decisions) == len(STREAM) + 3
    assert decisions[0][0] == "miss" and decisions[1][:3] == ("hit", "joint", 0)
    assert decisions[3][:4] == ("hit", "exact", 0, 0)
    assert decisions[4][:3] == ("hit", "joint", 0) and decisions[4][3] > 0 and 0 < decisions[4][4] < 1, decisions[4]
    # Behind EasyCache: a miss (the plain model's entries are another namespace), then a hit on that miss's entry.
    assert decisions[5][0] == "miss", decisions[5]
    assert decisions[6][:3] == ("hit", "joint", 5) and decisions[6][3] > 0 and 0 < decisions[6][4] < 1, decisions[6]
