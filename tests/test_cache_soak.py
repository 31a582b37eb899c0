"""A short soak through a real ComfyUI server: several API clients at once, an interrupt and a SIGKILL while a
sampler runs, restarts. Afterwards the stats route's lookups and hits equal what the per-request reports say
(one lookup per served request that used the cache, one hit per report whose decision is "hit"), and every
cached entry loads. ComfyUI's node cache is off (``--cache-none``) so every prompt runs Carnator's stages."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
from harness_server import ComfyServer
from test_server_exact import graph

pytestmark = [pytest.mark.server, pytest.mark.slow]

PROMPTS = ("a small red ball rolls to the right across green grass",
           "a small blue ball rolls to the right across green grass")
DIRECTORY = "soak"
SAMPLER = "6"


def request(prompt: str, seed: int) -> dict:
    """The exact-repeat graph of test_server_exact, with a prompt-only filter that accepts the pool's prompts."""
    g = graph(DIRECTORY, seed)
    g["2"]["inputs"]["text"] = prompt
    g["5"]["inputs"]["prompt"] = prompt
    g["13"]["inputs"]["prompt_threshold"] = 0.5
    return g


def reports_of(history: dict) -> list[dict]:
    return [r for out in history.get("outputs", {}).values() for r in out.get("carnator_report", [])]


def finished(server: ComfyServer, prompt_id: str, timeout: float = 900) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        h = server.history(prompt_id)
        if h.get("status", {}).get("status_str") in ("success", "error"):
            return h
        time.sleep(0.25)
    raise TimeoutError(f"prompt {prompt_id} not finished; log:\n{server.log_tail()}")


def clients(server: ComfyServer, jobs: list[list[tuple[str, int]]], reports: list[dict]) -> None:
    """One thread per job list, each queueing its requests one after another (the queue interleaves them)."""
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run(job: list[tuple[str, int]]) -> None:
        try:
            for prompt, seed in job:
                h = finished(server, server.post("/prompt", {"prompt": request(prompt, seed)})["prompt_id"])
                assert h["status"]["status_str"] == "success", json.dumps(h["status"])[:2000]
                got = reports_of(h)
                assert len(got) == 1, got
                with lock:
                    reports.extend(got)
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=3600)
    if errors:
        raise errors[0]


def while_sampling(server: ComfyServer, prompt: dict, act) -> str:
    """Queue ``prompt``, wait (websocket) until its Joint Reuse Sampler runs, then ``act()``; returns its id."""
    import websocket

    ws = websocket.create_connection(f"ws://127.0.0.1:{server.port}/ws?clientId={server.client_id}", timeout=600)
    try:
        prompt_id = server.queue_prompt(prompt)
        for _ in range(100000):  # bounded by the socket timeout per message
            raw = ws.recv()
            if isinstance(raw, bytes):
                continue
            msg = json.loads(raw)
            data = msg.get("data", {})
            if msg["type"] == "executing" and data.get("prompt_id") == prompt_id and data.get("node") == SAMPLER:
                break
        time.sleep(0.3)  # inside the sampler's steps
        act()
    finally:
        ws.close()
    return prompt_id


def test_counters_equal_the_reports_after_a_soak_with_an_interrupt_a_kill_and_restarts(tmp_path):
    base = tmp_path / "base"
    reports: list[dict] = []
    pool = [(p, s) for p in PROMPTS for s in (7, 8)]
    with ComfyServer(base, extra_args=["--cache-none"]) as server:
        clients(server, [pool[0:3], pool[1:4], [pool[3], pool[0]]], reports)
        # An interrupt while a sampler runs (a new seed: a dense run): no report, nothing counted.
        pid = while_sampling(server, request(PROMPTS[0], 100), lambda: server.post("/interrupt", {}))
        h = finished(server, pid)
        assert h["status"]["status_str"] == "error" and not reports_of(h), h["status"]
        # A SIGKILL of the server while a sampler runs, then a restart on the same folders.
        while_sampling(server, request(PROMPTS[1], 101), lambda: os.killpg(server.proc.pid, signal.SIGKILL))
        server.proc.wait(timeout=60)
        server.proc = None
    with ComfyServer(base, extra_args=["--cache-none"]) as server:
        clients(server, [[pool[2], (PROMPTS[0], 9)], [pool[0], pool[3]]], reports)
        stats = server.get(f"/carnator/cache/stats?directory={DIRECTORY}")
    hits = sum(r["decision"] == "hit" for r in reports)
    kinds = sorted({(r["decision"], r.get("mode")) for r in reports})
    assert (stats["lookups"], stats["hits"]) == (len(reports), hits), (stats, kinds)
    assert hits and hits < len(reports) and ("hit", "exact") in kinds, kinds  # the soak saw each kind
    from carnator.carnator_core.cache import Store

    st = Store.open(base / "output" / DIRECTORY, key_path=base / "user" / "carnator" / "index-hmac.key")
    rep = st.verify(deep=True)  # every entry loads and checksums
    assert rep.ok and rep.entries == stats["entries"] >= 3, rep
    st.close()
