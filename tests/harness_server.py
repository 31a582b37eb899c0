"""A real ComfyUI server for tests and the demo.

``ComfyServer`` starts ``main.py --cpu`` from the local host on a free loopback port with its own
``--base-directory`` (Carnator linked into its custom_nodes), waits until ``/system_stats`` answers, and always
stops the process by PID (terminate, then kill) — also when the test fails. Helpers queue prompts
(``POST /prompt``), read ``/history/{id}`` and listen on the ``/ws`` websocket.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_python() -> str:
    venv = ROOT / ".host" / "venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def host_comfy_path() -> Path:
    marker = ROOT / ".host" / "comfy-path"
    if os.environ.get("CARNATOR_COMFY_PATH"):
        return Path(os.environ["CARNATOR_COMFY_PATH"])
    if not marker.exists():
        raise RuntimeError("ComfyUI host not set up: run `make setup` first")
    return Path(marker.read_text().strip())


@contextlib.contextmanager
def started_together(*servers: "ComfyServer") -> Iterator[tuple["ComfyServer", ...]]:
    """Start several independent servers at once (each start is mostly Python imports on one core, so on a 2-core
    machine two start in about the time of one); all are stopped at the end, and all if any fails to start."""
    try:
        with concurrent.futures.ThreadPoolExecutor(len(servers)) as pool:
            for future in [pool.submit(s.start) for s in servers]:
                future.result()
        yield servers
    finally:
        for s in servers:
            s.stop()


class ComfyServer:
    """Context manager around a ComfyUI server process on 127.0.0.1."""

    def __init__(self, base_dir: Path, port: int | None = None, extra_args: list[str] | None = None,
                 env: dict[str, str] | None = None, log_path: Path | None = None, startup_timeout: float = 120.0):
        self.base_dir = Path(base_dir)
        self.port = port or free_port()
        self.extra_args = extra_args or []
        self.env = env or {}
        self.log_path = log_path or (self.base_dir / "server.log")
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.client_id = uuid.uuid4().hex

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def prepare_base_dir(self) -> None:
        for sub in ("custom_nodes", "models/diffusion_models", "models/text_encoders", "models/vae", "input",
                    "output", "user"):
            (self.base_dir / sub).mkdir(parents=True, exist_ok=True)
        link = self.base_dir / "custom_nodes" / "carnator"
        if not link.exists():
            link.symlink_to(ROOT, target_is_directory=True)

    def start(self) -> "ComfyServer":
        self.prepare_base_dir()
        comfy = host_comfy_path()
        cmd = [host_python(), str(comfy / "main.py"), "--cpu", "--listen", "127.0.0.1", "--port", str(self.port),
               "--base-directory", str(self.base_dir), "--database-url",
               f"sqlite:///{self.base_dir / 'user' / 'comfyui.db'}", "--disable-auto-launch",
               "--use-pytorch-cross-attention", *self.extra_args]
        env = {**os.environ, **self.env}
        self._log = open(self.log_path, "ab")
        # New session so that stop() can signal the whole process group by PID.
        self.proc = subprocess.Popen(cmd, cwd=str(comfy), stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        deadline = time.time() + self.startup_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with code {self.proc.returncode} during start-up; log:\n"
                                   + self.log_tail())
            try:
                self.get("/system_stats", timeout=2)
                return self
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"ComfyUI did not answer on {self.url} within {self.startup_timeout}s; log:\n"
                           + self.log_tail())

    def stop(self) -> None:
        if self.proc is None:
            return
        pid = self.proc.pid
        try:
            if self.proc.poll() is None:
                os.killpg(pid, signal.SIGTERM)
                try:
                    self.proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(pid, signal.SIGKILL)
                    self.proc.wait(timeout=15)
        except ProcessLookupError:
            pass
        finally:
            self.proc = None
            try:
                self._log.close()
            except Exception:
                pass

    def __enter__(self) -> "ComfyServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "<no log>"

    # --- HTTP helpers -------------------------------------------------------------------------------------
    def get(self, path: str, timeout: float = 30) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            body = r.read()
        return json.loads(body) if body else None

    def post(self, path: str, payload: Any, timeout: float = 30) -> Any:
        req = urllib.request.Request(self.url + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                body = r.read()
        except urllib.error.HTTPError as e:  # ComfyUI answers validation errors with 400 + JSON
            raise RuntimeError(f"POST {path} -> {e.code}: {e.read().decode(errors='replace')}") from None
        return json.loads(body) if body else None

    def queue_prompt(self, prompt: dict) -> str:
        return self.post("/prompt", {"prompt": prompt, "client_id": self.client_id})["prompt_id"]

    def history(self, prompt_id: str) -> dict:
        return self.get(f"/history/{prompt_id}").get(prompt_id, {})

    def wait_history(self, prompt_id: str, timeout: float = 300) -> dict:
        """Poll /history until the prompt is done; raises with the server's error if it failed."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            h = self.history(prompt_id)
            status = h.get("status", {})
            if status.get("completed") or status.get("status_str") in ("success", "error"):
                if status.get("status_str") == "error":
                    raise RuntimeError(f"prompt {prompt_id} failed: {json.dumps(status.get('messages'))[:3000]}")
                return h
            time.sleep(0.25)
        raise TimeoutError(f"prompt {prompt_id} not finished within {timeout}s; log:\n{self.log_tail()}")

    def run_prompt_ws(self, prompt: dict, timeout: float = 300) -> tuple[dict, list[dict]]:
        """Queue a prompt and follow it on the websocket until it finishes; returns (history, ws messages)."""
        import websocket  # websocket-client

        ws = websocket.create_connection(f"ws://127.0.0.1:{self.port}/ws?clientId={self.client_id}", timeout=timeout)
        messages: list[dict] = []
        try:
            prompt_id = self.queue_prompt(prompt)
            deadline = time.time() + timeout
            while time.time() < deadline:
                raw = ws.recv()
                if isinstance(raw, bytes):
                    continue  # binary previews
                msg = json.loads(raw)
                messages.append(msg)
                data = msg.get("data", {})
                if data.get("prompt_id") not in (None, prompt_id):
                    continue
                if msg["type"] == "executing" and data.get("node") is None:
                    break
                if msg["type"] == "execution_error":
                    raise RuntimeError(f"prompt failed: {json.dumps(data)[:3000]}")
                if msg["type"] == "execution_success":
                    break
        finally:
            ws.close()
        return self.wait_history(prompt_id, timeout=30), messages
