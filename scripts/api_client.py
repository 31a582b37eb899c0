"""Drive Carnator through the ComfyUI API queue: submit a stream of prompts, follow them, read results and reports.

Standard library plus ``websocket-client`` (optional: without it the client polls ``/history``). It takes an
API-format workflow (``workflows/api/embedded.json`` by default), and for every request sets the prompt text
(the ``PrimitiveStringMultiline`` node titled "Prompt", else every text input of the positive encoder) and the
Early Probe's seed, queues all requests with ``POST /prompt`` (ComfyUI runs them one after another, so later
requests can reuse what earlier ones wrote to the cache), then reads each result from ``/history/{prompt_id}``:
the saved files and the Joint Reuse Sampler's per-run report (``outputs[node]["carnator_report"]``).

    python scripts/api_client.py --server http://127.0.0.1:8188 \
        --prompt "a big red ball moves to the right in the top left, on green grass" \
        --prompt "a big red ball moves to the right in the top left, on blue water" --seeds 0 1

Prints one line per request and, with ``--json FILE``, writes every report to FILE.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_WORKFLOW = ROOT / "workflows" / "api" / "embedded.json"


class ComfyError(RuntimeError):
    """The server refused a prompt or a prompt failed; the message carries the server's explanation."""


@dataclass
class Result:
    """One finished request: where its files are and what Carnator decided."""

    prompt_id: str
    text: str
    seed: int
    files: list[str] = field(default_factory=list)  # /view URLs of saved images/animations
    reports: list[dict[str, Any]] = field(default_factory=list)  # carnator_report of every sampler node
    seconds: float = 0.0  # queue-to-history wall time seen by this client
    # ComfyUI answered from its own execution cache (an identical prompt ran just before): nothing was
    # recomputed, so the sampler sent no new report.
    cached: bool = False

    def line(self) -> str:
        r = self.reports[0] if self.reports else ({"decision": "cached"} if self.cached else {})
        total = (r.get("timings_ms") or {}).get("total")
        saving = r.get("saving")
        return (f"{self.prompt_id[:8]} seed={self.seed:<4d} {str(r.get('decision', '?')).upper():5s} "
                f"entry={str(r.get('entry_id') or '-')[:12]:12s} "
                f"saving={'-' if saving is None else f'{saving:.0%}':>4s} "
                f"sampler={'-' if total is None else f'{total / 1000:.2f}s'} wall={self.seconds:.2f}s  {self.text!r}")


class ComfyClient:
    """A minimal client for one ComfyUI server (HTTP + the /ws websocket)."""

    def __init__(self, server: str, timeout: float = 600.0):
        self.server = server.rstrip("/")
        self.client_id = uuid.uuid4().hex  # the websocket only carries this client's execution events
        self.timeout = timeout

    def _request(self, path: str, payload: Any | None = None) -> Any:
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(self.server + path, data=data, headers={"Content-Type": "application/json"},
                                     method="GET" if payload is None else "POST")
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:  # /prompt answers validation errors with 400 and a JSON explanation
            raise ComfyError(f"{path}: HTTP {e.code}: {e.read().decode(errors='replace')[:4000]}") from None

    def queue(self, prompt: dict[str, Any]) -> str:
        """POST /prompt; returns the prompt id."""
        answer = self._request("/prompt", {"prompt": prompt, "client_id": self.client_id})
        if answer.get("node_errors"):
            raise ComfyError(f"prompt refused: {json.dumps(answer['node_errors'])[:4000]}")
        return answer["prompt_id"]

    def history(self, prompt_id: str) -> dict[str, Any]:
        return (self._request(f"/history/{prompt_id}") or {}).get(prompt_id, {})

    def view_url(self, item: dict[str, Any]) -> str:
        query = urllib.parse.urlencode({k: item.get(k, "") for k in ("filename", "subfolder", "type")})
        return f"{self.server}/view?{query}"

    def wait_all(self, prompt_ids: Iterable[str], on_event: Any = None) -> dict[str, dict[str, Any]]:
        """Wait until every prompt is in /history (following the websocket when websocket-client is installed);
        returns prompt_id -> history entry. Raises ComfyError for a prompt that failed."""
        pending, done = set(prompt_ids), {}
        deadline = time.time() + self.timeout
        ws = self._connect_ws()
        try:
            while pending:
                if time.time() > deadline:
                    raise ComfyError(f"{len(pending)} prompt(s) not finished within {self.timeout:.0f}s")
                if ws is not None:
                    try:
                        raw = ws.recv()
                    except Exception:  # noqa: BLE001 — a timeout or closed socket: fall back to polling
                        raw = None
                    if isinstance(raw, str):
                        msg = json.loads(raw)
                        if on_event:
                            on_event(msg)
                        if msg.get("type") not in ("executing", "execution_success", "execution_error"):
                            continue
                else:
                    time.sleep(0.25)
                for pid in list(pending):
                    entry = self.history(pid)
                    status = entry.get("status", {})
                    if status.get("completed") or status.get("status_str") in ("success", "error"):
                        if status.get("status_str") == "error":
                            raise ComfyError(f"prompt {pid} failed: {json.dumps(status.get('messages'))[:4000]}")
                        done[pid] = entry
                        pending.discard(pid)
        finally:
            if ws is not None:
                ws.close()
        return done

    def _connect_ws(self) -> Any:
        try:
            import websocket  # websocket-client
        except ImportError:
            return None
        url = self.server.replace("http://", "ws://").replace("https://", "wss://") + f"/ws?clientId={self.client_id}"
        ws = websocket.create_connection(url, timeout=5)
        return ws


def set_request(workflow: dict[str, Any], text: str, seed: int) -> dict[str, Any]:
    """A copy of an API-format workflow with the prompt text and the probe's seed set. Raises ValueError if the
    workflow has no place for either (so a wrong workflow fails loudly instead of repeating one request)."""
    prompt = copy.deepcopy(workflow)
    text_nodes = [n for n in prompt.values() if n.get("class_type") == "PrimitiveStringMultiline"
                  and n.get("_meta", {}).get("title") == "Prompt"]
    if text_nodes:
        for node in text_nodes:
            node["inputs"]["value"] = text
    else:
        probes = [n for n in prompt.values() if n.get("class_type") == "CarnatorEarlyProbe"]
        if not probes or not isinstance(probes[0]["inputs"].get("prompt"), str):
            raise ValueError("the workflow has no 'Prompt' text node and no Early Probe prompt text to set")
        for node in probes:
            node["inputs"]["prompt"] = text
        positive = probes[0]["inputs"]["positive"][0]
        if isinstance(prompt[positive]["inputs"].get("text"), str):
            prompt[positive]["inputs"]["text"] = text
    seeded = 0
    for node in prompt.values():
        if node.get("class_type") in ("CarnatorEarlyProbe", "KSampler") and isinstance(node["inputs"].get("seed"), int):
            node["inputs"]["seed"] = seed
            seeded += 1
    if not seeded:
        raise ValueError("the workflow has no Carnator Early Probe (or KSampler) whose seed could be set")
    return prompt


def run_stream(client: ComfyClient, workflow: dict[str, Any], requests: list[tuple[str, int]],
               verbose: bool = False) -> list[Result]:
    """Queue every (text, seed) request at once, wait for all, and return their results in order."""
    started = time.time()
    queued = [(client.queue(set_request(workflow, text, seed)), text, seed) for text, seed in requests]

    def show(msg: dict[str, Any]) -> None:
        if verbose and msg.get("type") == "progress":
            d = msg["data"]
            print(f"  node {d.get('node')}: {d.get('value')}/{d.get('max')}", file=sys.stderr)

    finished_at: dict[str, float] = {}

    def track(msg: dict[str, Any]) -> None:
        show(msg)
        d = msg.get("data") or {}
        if msg.get("type") in ("execution_success", "execution_error") and d.get("prompt_id"):
            finished_at.setdefault(d["prompt_id"], time.time())

    history = client.wait_all([pid for pid, _, _ in queued], on_event=track)
    results = []
    for pid, text, seed in queued:
        outputs = history[pid].get("outputs", {})
        res = Result(pid, text, seed, seconds=finished_at.get(pid, time.time()) - started)
        cached_nodes = {str(n) for event, data in history[pid].get("status", {}).get("messages", [])
                        if event == "execution_cached" for n in data.get("nodes", [])}
        samplers = {k for k, n in workflow.items() if n.get("class_type") == "CarnatorJointReuseSampler"}
        res.cached = bool(samplers) and samplers <= cached_nodes
        for node_id in sorted(outputs, key=lambda k: (len(k), k)):
            out = outputs[node_id]
            res.reports.extend(out.get("carnator_report", []))
            res.files.extend(client.view_url(i) for i in out.get("images", []) + out.get("gifs", []))
        results.append(res)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Submit a stream of prompts to ComfyUI and print Carnator's reports.")
    ap.add_argument("--server", default="http://127.0.0.1:8188")
    ap.add_argument("--workflow", type=Path, default=DEFAULT_WORKFLOW, help="API-format workflow JSON")
    ap.add_argument("--prompt", action="append", dest="prompts",
                    help="prompt text (repeatable; default: the workflow's own prompt)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds; every prompt runs with every seed")
    ap.add_argument("--json", type=Path, help="write all results (files and reports) to this JSON file")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("-v", "--verbose", action="store_true", help="show progress events")
    args = ap.parse_args(argv)

    workflow = json.loads(args.workflow.read_text(encoding="utf-8"))
    prompts = args.prompts or [next((n["inputs"]["value"] for n in workflow.values()
                                     if n.get("_meta", {}).get("title") == "Prompt"), "")]
    requests = [(text, seed) for text in prompts for seed in args.seeds]
    client = ComfyClient(args.server, timeout=args.timeout)
    try:
        results = run_stream(client, workflow, requests, verbose=args.verbose)
    except (ComfyError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for res in results:
        print(res.line())
    hits = sum(1 for r in results if r.reports and r.reports[0].get("decision") == "hit")
    print(f"{len(results)} requests, {hits} cache hits")
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in results], indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
