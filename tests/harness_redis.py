"""A real ``redis-server`` for tests: free loopback port, its own temp directory, stopped by PID even on failure.

``RedisServer(dir)`` starts ``redis-server`` (Debian's package, installed by scripts/setup/setup_host.sh) bound to
127.0.0.1 only, with no RDB snapshots, and with an fsync-always append-only file when ``persist`` is set (so a
restart keeps every acknowledged write). ``stop()`` signals the process by PID (SIGTERM, then SIGKILL);
``kill()`` is an abrupt SIGKILL; ``start()`` again reuses the same port and directory (a restart).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from harness_server import free_port


def redis_server_binary() -> str:
    path = shutil.which("redis-server")
    if path is None:
        raise RuntimeError("redis-server is not installed: run scripts/setup/setup_host.sh (installs Debian's "
                           "redis-server package)")
    return path


class RedisServer:
    def __init__(self, workdir: Path, *, persist: bool = False, port: int | None = None,
                 maxmemory: str | None = None):
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.persist = persist
        self.port = port or free_port()
        self.maxmemory = maxmemory
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 30.0) -> "RedisServer":
        import redis

        cmd = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--protected-mode", "yes",
               "--dir", str(self.dir), "--save", "", "--daemonize", "no", "--maxmemory-policy", "noeviction",
               "--logfile", str(self.dir / "redis.log"), "--io-threads", "1"]
        if self.persist:
            cmd += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            cmd += ["--appendonly", "no"]
        if self.maxmemory:
            cmd += ["--maxmemory", self.maxmemory]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.time() + timeout
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=1)
        try:
            while time.time() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}; log:\n{self.log_tail()}")
                try:
                    if client.ping():
                        return self
                except (redis.ConnectionError, redis.BusyLoadingError):
                    time.sleep(0.05)
        finally:
            client.close()
        self.stop()
        raise TimeoutError(f"redis-server did not answer on port {self.port}; log:\n{self.log_tail()}")

    def _signal(self, sig: int, wait: float) -> None:
        if self.proc is None:
            return
        try:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, sig)
                try:
                    self.proc.wait(timeout=wait)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(timeout=15)
        except ProcessLookupError:
            pass
        finally:
            self.proc = None

    def stop(self) -> None:
        self._signal(signal.SIGTERM, 15)

    def kill(self) -> None:
        self._signal(signal.SIGKILL, 15)

    def client(self) -> Any:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port)

    def log_tail(self, n: int = 3000) -> str:
        try:
            return (self.dir / "redis.log").read_text(errors="replace")[-n:]
        except OSError:
            return "<no log>"

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
