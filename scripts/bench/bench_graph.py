#!/usr/bin/env python
"""Where a request's time goes in the node graph: per-node wall time of the demo's graphs on a real ComfyUI server.

    .host/venv/bin/python scripts/bench/bench_graph.py [--warm 8 --stream 16] [--json artifacts/bench_graph.json]

The demo's setting (``scripts/demo.py``: the workload, ``workflows/api/embedded_warm_cache.json`` for the warm set,
``workflows/api/embedded.json`` for the stream, the shipped rule, a dense twin — the same request through a plain
KSampler graph — queued right after each stream request), but every prompt is queued alone and followed on the
websocket: a node's time is from its ``executing`` message to the next one (the last node's to
``execution_success``), stamped on arrival on loopback. Per decision (hit, miss) and for the twins: the median per
node and of the whole prompt (``execution_start`` to ``execution_success``), and the Carnator nodes' own core
timings (``carnator_report.timings_ms``). What this separates: the probe and the sampler (the model calls) from
the Carnator nodes around them (signature, retrieval, filter, cache writer) and from what both graphs run
(decode, SaveAnimatedWEBP).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import demo as D  # noqa: E402  (registers the package; the demo's graphs and helpers)
from harness_server import ComfyServer  # noqa: E402


def run_timed(server: ComfyServer, graph: dict[str, Any], timeout: float = 600) -> tuple[dict, dict, float]:
    """Queue one prompt and follow it; returns (history entry, seconds per node id, seconds of the prompt)."""
    import websocket  # websocket-client

    ws = websocket.create_connection(f"ws://127.0.0.1:{server.port}/ws?clientId={server.client_id}", timeout=timeout)
    events: list[tuple[float, str, Any]] = []
    try:
        pid = server.queue_prompt(graph)
        while True:
            raw = ws.recv()
            t = time.perf_counter()
            if isinstance(raw, bytes):
                continue  # previews
            msg = json.loads(raw)
            data = msg.get("data", {})
            if data.get("prompt_id") not in (None, pid):
                continue
            events.append((t, msg["type"], data.get("node")))
            if msg["type"] == "execution_error":
                raise RuntimeError(f"prompt failed: {json.dumps(data)[:2000]}")
            if msg["type"] == "execution_success" or (msg["type"] == "executing" and data.get("node") is None):
                break
    finally:
        ws.close()
    starts = [(t, node) for t, kind, node in events if kind == "executing" and node is not None]
    end = events[-1][0]
    per: dict[str, float] = {}
    for i, (t, node) in enumerate(starts):
        per[node] = per.get(node, 0.0) + (starts[i + 1][0] if i + 1 < len(starts) else end) - t
    begin = next((t for t, kind, _ in events if kind == "execution_start"), starts[0][0] if starts else end)
    return server.wait_history(pid, timeout=60), per, end - begin


def by_class(graph: dict[str, Any], per: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for node, sec in per.items():
        name = graph.get(node, {}).get("class_type", node)
        out[name] = out.get(name, 0.0) + sec
    return out


def medians(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for r in rows for k in r})
    return {k: round(statistics.median([r.get(k, 0.0) for r in rows]) * 1000, 1) for k in keys}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    D.add_workload_args(ap, warm=8, stream=16)
    ap.set_defaults(mix="0,0.2,0.15,0.65")  # as the demo: no exact repeats (ComfyUI's output cache would answer)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    wl = D.build_workload(D.spec_from_args(args))
    warm_graph, _ = D.load_graph(D.WARM_WORKFLOW, stream=False)
    stream_graph, _ = D.load_graph(D.STREAM_WORKFLOW, stream=True)
    groups: dict[str, dict[str, list]] = {}
    with tempfile.TemporaryDirectory(prefix="carnator-bench-graph-") as tmp:
        base = Path(tmp)
        weights = base / "models" / "carnator_embedded_bench.safetensors"
        weights.parent.mkdir(parents=True)
        shutil.copyfile(D.DEFAULT_WEIGHTS, weights)
        with ComfyServer(base, log_path=base / "server.log", startup_timeout=600) as server:
            for r in wl.warm:
                run_timed(server, D.configure(warm_graph, r, str(weights), "embedded.json", False))
            rule_file, uncertified, rule_desc = D.choose_rule(server, base, "8,0.5,1.0,10")
            print(("!! " if uncertified else "") + f"risk rule: {rule_desc}", flush=True)
            for r in wl.stream:
                g = D.configure(stream_graph, r, str(weights), rule_file, uncertified)
                h, per, total = run_timed(server, g)
                report = next((o["carnator_report"][0] for o in h.get("outputs", {}).values()
                               if o.get("carnator_report")), {})
                twin = D.dense_twin(g, r.rid)
                _, tper, ttotal = run_timed(server, twin)
                decision = report.get("decision", "?")
                core = {f"core:{k}": v / 1000 for k, v in report.get("timings_ms", {}).items()}
                grp = groups.setdefault(decision, {"carnator": [], "twin": []})
                grp["carnator"].append({**by_class(g, per), **core, "prompt": total})
                grp["twin"].append({**by_class(twin, tper), "prompt": ttotal})
                print(f"{r.rid} {decision:5s} {total:.3f}s (twin {ttotal:.3f}s) "
                      + " ".join(f"{k}={v * 1000:.0f}" for k, v in by_class(g, per).items() if v >= 0.005),
                      flush=True)
    result = {"workload": D.describe(wl), "rule": rule_desc,
              "groups": {d: {"n": len(v["carnator"]), "carnator_ms": medians(v["carnator"]),
                             "twin_ms": medians(v["twin"]),
                             "prompt_ratio_median": round(statistics.median(
                                 c["prompt"] / t["prompt"] for c, t in zip(v["carnator"], v["twin"])), 3)}
                         for d, v in groups.items()}}
    for d, v in result["groups"].items():
        print(f"\n{d} (n={v['n']}): Carnator / twin per prompt, median {v['prompt_ratio_median']}")
        for k, ms in v["carnator_ms"].items():
            print(f"  carnator {k:34s} {ms:8.1f} ms")
        for k, ms in v["twin_ms"].items():
            print(f"  twin     {k:34s} {ms:8.1f} ms")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
