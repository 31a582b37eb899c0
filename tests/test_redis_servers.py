"""Two real ComfyUI servers share one real Redis: a request served (dense) by server A is a hit on server B through
``POST /prompt`` with the embedded workflow, and both servers' cache panel routes read the shared statistics
(and refuse a Redis URL that carries a password or names an unconfigured server); with Redis gone, a prompt
still succeeds dense and the panel answers 503."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from harness_redis import RedisServer
from harness_server import ComfyServer, started_together

pytestmark = [pytest.mark.server, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]
EMBEDDED_WEIGHTS = ROOT / "carnator_core" / "embedded" / "weights" / "carnator_embedded_v2.safetensors"
EMBEDDED_RULE = ROOT / "rules" / "embedded.json"


def _with_redis(name: str) -> dict[str, Any]:
    api = json.loads((ROOT / "workflows" / "api" / f"{name}.json").read_text())
    loaders = [n for n in api.values() if n["class_type"] == "CarnatorCacheLoader"]
    assert len(loaders) == 1
    loaders[0]["inputs"]["directory"] = "redis://"  # the server's configured Redis; no credentials in the JSON
    return api


def _report(history: dict[str, Any], api: dict[str, Any]) -> dict[str, Any]:
    sid = next(i for i, n in api.items() if n["class_type"] == "CarnatorJointReuseSampler")
    (report,) = history["outputs"][sid]["carnator_report"]
    return report


def _get_error(server: ComfyServer, path: str) -> tuple[int, dict[str, Any]]:
    try:
        urllib.request.urlopen(server.url + path, timeout=30)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    raise AssertionError(f"{path} did not fail")


def test_request_served_by_a_is_a_hit_on_b(tmp_path):
    missing = [str(p.relative_to(ROOT)) for p in (EMBEDDED_WEIGHTS, EMBEDDED_RULE) if not p.exists()]
    assert not missing, f"embedded model files missing: {missing}"
    with RedisServer(tmp_path / "redis") as redis_srv:
        env = {"CARNATOR_REDIS_URL": redis_srv.url}
        with started_together(ComfyServer(tmp_path / "a", env=env, startup_timeout=600),
                              ComfyServer(tmp_path / "b", env=env, startup_timeout=600)) as (a, b):
            warm = _with_redis("embedded_warm_cache")
            history_a, _ = a.run_prompt_ws(warm, timeout=900)
            report_a = _report(history_a, warm)
            assert report_a["decision"] == "dense"
            stats = b.get("/carnator/cache/stats?directory=redis://")
            assert stats["exists"] and stats["entries"] == 1 and stats["path"] == redis_srv.url, stats
            entry_id = next(iter(redis_srv.client().zrange(f"carnator:{{{stats['namespaces'][0]['namespace']}}}:lru",
                                                           0, -1))).decode()[13:]

            reuse = _with_redis("embedded")
            history_b, _ = b.run_prompt_ws(reuse, timeout=900)
            report_b = _report(history_b, reuse)
            assert report_b["decision"] == "hit", f"not reused across servers: {json.dumps(report_b)[:2000]}"
            assert report_b["entry_id"] == entry_id
            # the same request as A's: B answers it from the shared cache before the probe (no model call)
            assert report_b["mode"] == "exact" and report_b["model_calls"] == 0, report_b
            writer = next(i for i, n in reuse.items() if n["class_type"] == "CarnatorCacheWriter")
            text = json.dumps(history_b["outputs"].get(writer, {}))
            assert "nothing stored" in text  # B reused A's entry and stored nothing of its own

            for server in (a, b):
                s = server.get("/carnator/cache/stats?directory=redis://")
                assert s["entries"] == 1 and s["hits"] == 1 and s["lookups"] == 1 and s["bytes"] > 0
            code, body = _get_error(a, "/carnator/cache/stats?directory=redis://:pw@127.0.0.1:1/0")
            assert code == 400 and "never be saved in a workflow" in body["error"] and "pw" not in body["error"]
            code, body = _get_error(a, "/carnator/cache/stats?directory=redis://10.9.8.7:6379/0")
            assert code == 400 and "CARNATOR_REDIS_URL" in body["error"]
            purged = b.post("/carnator/cache/purge", {"directory": "redis://"})
            assert purged["purged"] == 1 and a.get("/carnator/cache/stats?directory=redis://")["entries"] == 0

            # Redis goes away mid-run: the prompt still succeeds (dense, not stored), the panel answers 503
            redis_srv.stop()
            history_a2, _ = a.run_prompt_ws(reuse, timeout=900)
            assert history_a2["status"]["status_str"] == "success"
            assert _report(history_a2, reuse)["decision"] != "hit"
            assert "not stored" in json.dumps(history_a2["outputs"].get(writer, {}))
            code, body = _get_error(a, "/carnator/cache/stats?directory=redis://")
            assert code == 503 and "unreachable" in body["error"]
            assert a.log_tail(200_000).count("requests continue without the shared cache") == 1
