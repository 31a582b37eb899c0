"""The idle-time warm-up worker inside a real ComfyUI server (carnator_core/learn/idle.py, nodes/warmup.py).

The embedded workflow with no rule file (learning mode) serves a few requests into a cache; the worker, switched on
over HTTP (``POST /carnator/warmup``), edits those cached scenes and labels the edits while the queue is empty; the
labels land in the warm-up population's namespace and ``GET /carnator/rules`` shows them inside the traffic's
namespace. A prompt queued while the worker is in the middle of a label pre-empts it at its next model call: the
partial label is not written, the prompt runs, and the worker resumes once the queue is empty again. Work is
bounded by label counts (``max_labels``), never by wall time.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.server

ROOT = Path(__file__).resolve().parents[1]
CACHE = "idle_warmup_cache"


def embedded_graph() -> dict[str, Any]:
    api = json.loads((ROOT / "workflows" / "api" / "embedded.json").read_text(encoding="utf-8"))
    for n in api.values():
        if n["class_type"] == "CarnatorRiskFilter":
            n["inputs"].update(rule_file="learned_idle_test.json")
        if n["class_type"] == "CarnatorCacheLoader":
            n["inputs"]["directory"] = CACHE
        if n["class_type"] == "SaveAnimatedWEBP":
            n["inputs"]["filename_prefix"] = "idle_warmup/clip"
    return api


def wait_for(server: Any, what: Any, polls: int = 2400, every: float = 0.25) -> dict[str, Any]:
    """Poll GET /carnator/warmup until ``what(status)``; at most ``polls`` polls (a bound for a stuck worker)."""
    for _ in range(polls):
        st = server.get("/carnator/warmup")
        if what(st):
            return st
        time.sleep(every)
    raise AssertionError(f"the worker never got there; last status {st}; log:\n{server.log_tail()}")


@pytest.fixture(scope="module")
def server(comfy_env, tmp_path_factory):
    from harness_server import ComfyServer

    with ComfyServer(tmp_path_factory.mktemp("comfy-idle"), startup_timeout=600) as s:
        yield s


def test_the_worker_labels_cached_scenes_while_idle_and_a_queued_prompt_preempts_it(server) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    from api_client import set_request

    from carnator.carnator_core.embedded import world
    from carnator.carnator_core.learn.labels import LabelStore
    from carnator.carnator_core.learn.warmup import warmup_namespace

    api = embedded_graph()
    assert server.get("/carnator/warmup")["settings"]["mode"] == "off"
    rng = np.random.default_rng(7)
    prompts = [world.caption(world.sample_scene(rng, n_objects=1), rng) for _ in range(4)]
    for i, p in enumerate(prompts[:3]):
        history, _ = server.run_prompt_ws(set_request(api, p, 100 + i), timeout=600)
        assert history["status"]["status_str"] == "success", server.log_tail()
    st = server.get("/carnator/warmup")
    assert st["labels"] == 0 and len(st["namespaces"]) == 1 and st["doing"] == "off"  # off: nothing happens
    (ns,) = st["namespaces"]
    try:
        for bad in ({"mode": "sometimes"}, {"minutes_per_hour": 90}, {"colour": "red"}, [1],
                    {"provisional_audit_share": 1.5}):
            with pytest.raises(RuntimeError, match="400"):
                server.post("/carnator/warmup", bad)
        assert server.post("/carnator/warmup", {"provisional_audit_share": 0.3})["provisional_audit_share"] == 0.3
        server.post("/carnator/warmup", {"mode": "idle", "max_labels": 2})
        st = wait_for(server, lambda s: s["labels"] >= 2 and s["doing"].startswith("done"))
        assert st["labels"] == 2 and st["cost_s"] > 0 and sum(st["by_kind"].values()) == 2
        store = LabelStore(server.base_dir / "output" / CACHE)
        warm = store.labels(warmup_namespace(ns))
        assert len(warm) == 2 and all(lab.judge == "embedded-checker" and lab.kind == "shadow" for lab in warm)
        # each drawn i.i.d. (a uniformly random cached scene, then a random edit), the draw recorded in its row
        assert all(lab.iid and lab.draw["entry"] and lab.draw["population"] == 3 for lab in warm), \
            [lab.draw for lab in warm]
        assert all(lab.prompt not in prompts[:3] or lab.seed not in (100, 101, 102) for lab in warm)
        assert not any(lab.request_key.startswith("warmup:") for lab in store.labels(ns))  # populations apart
        rules = server.get(f"/carnator/rules?directory={CACHE}")
        (shown,) = rules["namespaces"]
        assert shown["namespace"] == ns and shown["warmup"]["labels"] == 2

        # pre-emption: queue a prompt while a label is in flight (several tries: a label may end just before)
        server.post("/carnator/warmup", {"max_labels": 40})
        seen = []
        for attempt in range(6):
            before = wait_for(server, lambda s: s["doing"].startswith("labelling") and s["model_calls"] > 0)
            pid = server.queue_prompt(set_request(api, prompts[3], 500 + attempt))
            h = server.wait_history(pid, timeout=600)
            assert h["status"]["status_str"] == "success"
            after = server.get("/carnator/warmup")
            # while the prompt ran the worker wrote no label, bar one that finished before the prompt was queued
            assert after["labels"] - before["labels"] <= 1, (before, after)
            if after["preempted"] > before["preempted"]:
                seen.append(after["last"])
                if after["last"].get("at") == "model call":
                    break
        assert seen and seen[-1]["result"] == "preempted" and seen[-1]["at"] == "model call", seen
        # the partial label was discarded, and the worker goes on once the queue is empty
        n = server.get("/carnator/warmup")["labels"]
        resumed = wait_for(server, lambda s: s["labels"] > n)
        assert resumed["preempted_s"] > 0 and resumed["errors"] == 0, resumed
    finally:
        server.post("/carnator/warmup", {"mode": "off"})
