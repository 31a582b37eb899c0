"""Learning mode through a real ComfyUI server: the shipped Wan 2.1 workflow's graph, with no rule file, queues and
runs (no 400), serves dense bit-identical to a stock KSampler in the same prompt, writes the cache, reports a
``rule_state`` per namespace, and ``GET /carnator/rules`` lists the namespace's state.

The graph is ``workflows/api/wan21_t2v_1.3b.json`` with what a CPU test can run swapped in: a tiny random-weight Wan
2.1 (ComfyUI's own WanModel class, tests/tiny_models.py) under the workflow's own UNET file name, the embedded
text encoder (4096-wide tokens, as umT5's) instead of the umT5 CLIPLoader, a 32x32x9 latent, 10 steps with a
2-step probe, and SaveLatent instead of the VAE decode. Every Carnator node and link is the workflow's."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import pytest

pytestmark = pytest.mark.server

ROOT = Path(__file__).resolve().parents[1]
CACHE_DIR = "learn_tiny_wan_cache"


def tiny_wan_graph(text: str, prefix: str) -> dict[str, Any]:
    api = json.loads((ROOT / "workflows" / "api" / "wan21_t2v_1.3b.json").read_text(encoding="utf-8"))
    assert api["13"]["class_type"] == "CarnatorRiskFilter" and api["13"]["inputs"]["mode"] == "signature"
    g = {k: v for k, v in api.items() if k not in ("4", "16", "17")}  # no VAE: the latent is compared instead
    g["3"] = {"class_type": "CarnatorEmbeddedLoader", "inputs": {}}  # its text encoder stands in for umT5
    g["5"] = {"class_type": "PrimitiveStringMultiline", "inputs": {"value": text}}
    g["6"] = {"class_type": "CarnatorEmbeddedTextEncode", "inputs": {"text_encoder": ["3", 1], "text": ["5", 0]}}
    g["7"] = {"class_type": "CarnatorEmbeddedTextEncode", "inputs": {"text_encoder": ["3", 1], "text": ""}}
    g["8"] = {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 32, "height": 32, "length": 9,
                                                                  "batch_size": 1}}
    probe = dict(g["9"]["inputs"])
    probe.pop("clip")
    probe.update(steps=10, probe_steps=2, text_encoder=["3", 1])
    g["9"] = {**g["9"], "inputs": probe}
    g["11"] = {**g["11"], "inputs": {**g["11"]["inputs"], "directory": CACHE_DIR}}
    g["20"] = {"class_type": "SaveLatent", "inputs": {"samples": ["14", 0], "filename_prefix": f"{prefix}/carnator"}}
    g["21"] = {"class_type": "KSampler", "inputs": {
        "model": ["2", 0], "positive": ["6", 0], "negative": ["7", 0], "latent_image": ["8", 0],
        "seed": probe["seed"], "steps": 10, "cfg": probe["cfg"], "sampler_name": probe["sampler_name"],
        "scheduler": probe["scheduler"], "denoise": 1.0}}
    g["22"] = {"class_type": "SaveLatent", "inputs": {"samples": ["21", 0], "filename_prefix": f"{prefix}/stock"}}
    return g


@pytest.fixture(scope="module")
def server(comfy_server, comfy_env):
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    import tiny_models as tm

    # the workflow's own UNET file name, holding the tiny model (ComfyUI detects it as Wan 2.1 from its weights)
    target = comfy_server.base_dir / "models" / "diffusion_models" / "wan2.1_t2v_1.3B_fp16.safetensors"
    if not target.exists():
        tm.save_tiny_model("wan21", target.parent).rename(target)
    return comfy_server


def test_wan_workflow_without_a_rule_learns_and_serves_dense_bit_identical(server) -> None:
    import torch
    from safetensors.torch import load_file

    rules = server.base_dir / "user" / "carnator" / "rules"
    assert not (rules / "wan2.1_t2v_1.3B.json").exists()  # no rule for this model: learning mode
    outs = []
    # two prompts the embedded text encoder tells apart (words outside its vocabulary encode alike)
    for i, text in enumerate(["a big red ball moves to the right in the top left, on green grass",
                              "a big blue ball moves to the right in the top left, on green grass"]):
        history, _ = server.run_prompt_ws(tiny_wan_graph(text, f"learn{i}"), timeout=600)
        assert history["status"]["status_str"] == "success", server.log_tail()

        def saved(node: str) -> torch.Tensor:
            (f,) = history["outputs"][node]["latents"]
            return load_file(str(server.base_dir / "output" / f["subfolder"] / f["filename"]))["latent_tensor"]

        ours, stock = saved("20"), saved("22")
        assert torch.equal(ours, stock), f"max diff {(ours - stock).abs().max().item()}"
        report = history["outputs"]["14"]["carnator_report"][0]
        assert report["decision"] in ("dense", "miss")  # served dense (a decision that accepted nothing)
        state = report["rule_state"]
        assert state["state"] == "learning" and state["message"].startswith("learning")
        assert state["namespace"] and isinstance(state["labels"], int) and isinstance(state["needed"], int)
        outs.append((report, state))
    # the second request recalled the first (written by the Cache Writer) and recorded its covariates
    second = outs[1][0]
    assert second["verdicts"] and second["verdicts"][0]["reason"].startswith("learning")
    assert "reuse switches on when certified" in outs[1][1]["message"]
    answer = server.get(f"/carnator/rules?directory={CACHE_DIR}")
    assert answer["exists"] is True
    (ns,) = answer["namespaces"]
    assert ns["namespace"] == outs[1][1]["namespace"] and ns["state"] == "learning"
    assert server.get("/carnator/rules?directory=never_written")["namespaces"] == []


def learning_stream(servers: Sequence[Any], cache: str) -> list[dict[str, Any]]:
    """The embedded workflow with a rule file that does not exist (learning mode, label budget 0.5) on the cache
    ``cache`` (a folder, or ``redis://``), its 8-request stream queued round-robin over ``servers``; returns the
    ``rule_state`` of each request that was not an exact repeat (all served dense)."""
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    from api_client import set_request

    from carnator.carnator_core.lab.workload import WorkloadSpec, build_workload

    api = json.loads((ROOT / "workflows" / "api" / "embedded.json").read_text(encoding="utf-8"))
    for n in api.values():
        if n["class_type"] == "CarnatorRiskFilter":
            n["inputs"].update(rule_file="learned_embedded_test.json", learn_budget=0.5)
        if n["class_type"] == "CarnatorCacheLoader":
            n["inputs"]["directory"] = cache
        if n["class_type"] == "SaveAnimatedWEBP":
            n["inputs"]["filename_prefix"] = "learn_embedded/clip"
    sampler = next(k for k, n in api.items() if n["class_type"] == "CarnatorJointReuseSampler")
    wl = build_workload(WorkloadSpec(n_warm=0, n_stream=8, n_templates=2, seed=3))
    states = []
    last: dict[int, tuple[str, int]] = {}
    for i, req in enumerate(wl.stream):
        server = servers[i % len(servers)]
        history, _ = server.run_prompt_ws(set_request(api, req.prompt, req.seed), timeout=600)
        assert history["status"]["status_str"] == "success", server.log_tail()
        before, last[id(server)] = last.get(id(server)), (req.prompt, req.seed)
        if sampler not in history["outputs"]:  # ComfyUI's node cache answered the graph this server just ran
            assert before == (req.prompt, req.seed), history["outputs"]
            continue
        report = history["outputs"][sampler]["carnator_report"][0]
        if report["mode"] == "exact":  # an exact repeat, answered from the cache before any filter
            continue
        assert report["decision"] in ("dense", "miss") and report["rule_state"]["state"] == "learning"
        states.append(report["rule_state"])
    return states


def test_embedded_stream_without_a_rule_gets_shadow_labels_within_the_budget(server) -> None:
    """The embedded workflow with a rule file that does not exist: served dense, and once the budget has room a
    served request that recalled a candidate gets its counterfactual reuse labelled by the pixel checker; the
    labels land in the cache folder's learn.sqlite and the ledger keeps label compute within the budget."""
    from carnator.carnator_core.learn.labels import LabelStore

    cache = "learn_embedded_cache"
    states = learning_stream([server], cache)  # first: the record is opened only once the cache folder exists
    check_learning_record(LabelStore(server.base_dir / "output" / cache), states)


def check_learning_record(store: Any, states: Sequence[dict[str, Any]]) -> list[Any]:
    """The record after ``learning_stream``: shadow labels by the pixel checker, uncorrupted, every served request on
    the ledger, label compute within the budget, the last state counting every label. Returns the labels."""
    (ns,) = store.namespaces()
    labels = store.labels(ns)
    assert labels and all(lab.kind == "shadow" and lab.judge == "embedded-checker" for lab in labels)
    assert all(lab.cost_s > 0 and lab.x in (-1, 0, 1) for lab in labels) and store.corrupt == 0
    led = store.ledger(ns)
    # exact repeats are answered before the filter (no learning record): every other request is on the ledger
    assert led["requests"] == len(states) and led["label_s"] <= 0.5 * led["served_s"] + max(
        lab.cost_s for lab in labels)
    assert states[-1]["labels_total"] == sum(lab.kind == "shadow" for lab in labels)
    assert states[-1]["labels"] <= states[-1]["labels_total"]  # the closest kind's own, after the pilot
    assert states[-1]["message"].startswith("learning — ")
    return labels


def test_a_damaged_learning_record_never_costs_the_clip(server, tmp_path) -> None:
    """A cache folder whose learn.sqlite is garbage and whose -wal links out of it: every learning request is served
    (success, a clip), the badge says once what was wrong, the garbage and the link are set aside in quarantine/
    (the link's target untouched), and labelling goes on in a fresh record."""
    from carnator.carnator_core.cache.store import Store
    from carnator.carnator_core.learn.labels import FILENAME, LabelStore

    cache = "learn_damaged_cache"
    root = server.base_dir / "output" / cache
    Store.open(root).close()
    (root / FILENAME).write_bytes(b"not a database " * 500)
    outside = tmp_path / "precious.db"
    outside.write_bytes(b"someone else's file")
    (root / (FILENAME + "-wal")).symlink_to(outside)
    states = learning_stream([server], cache)
    said = [s["message"] for s in states if "was unusable" in s["message"]]
    assert len(said) == 1 and "set aside in quarantine/" in said[0], [s["message"] for s in states]
    assert outside.read_bytes() == b"someone else's file"
    aside = sorted(p.name for p in (root / "quarantine").iterdir() if p.name.startswith("learn-"))
    assert len(aside) == 2 and (root / "quarantine" / aside[1]).is_symlink(), aside
    assert not (root / (FILENAME + "-wal")).is_symlink()
    check_learning_record(LabelStore(root), states)
