"""The idle-time warm-up worker inside ComfyUI (``carnator_core/learn/idle.py``): its ComfyUI side and its routes.
Not a node module: ``NODES`` is empty.

* The worker's ``busy()`` is ComfyUI's own queue: ``PromptServer.instance.prompt_queue.get_tasks_remaining()`` (the
  running prompt and those waiting) above zero.
* Before every model call of a warm-up run (Carnator's own PREDICT_NOISE wrapper calls the worker's step
  callback), the worker asks ``busy()`` and raises ``Preempted`` when the queue is not empty: a queued prompt stops
  the warm-up at the worker's next model call.
* ComfyUI's prompt worker, having taken a prompt from the queue, waits until the warm-up label in flight has
  unwound (``hold_prompts_for_worker``: the queue's ``get`` wrapped on this instance) — at most one model call.
* The Joint Reuse Sampler hands each served learning request to :func:`remember_request`: its model, text encoder,
  settings and cache are what the worker edits and labels with.

Routes (registered on ``PromptServer`` when node discovery imports this module, as ``routes.py``'s):

* ``GET  /carnator/warmup`` → the worker's status: the setting, what it is doing, warm-up labels made (in all and
  per kind), attempts without a label, pre-emptions, compute spent (``cost_s``; ``preempted_s`` of it discarded by
  pre-emptions; ``spent_last_hour_s``).
* ``POST /carnator/warmup`` with JSON ``{"mode": "off" | "idle" | "budget", "minutes_per_hour": 10, "max_labels":
  0, "provisional_audit_share": 0.25}`` (any of them) → sets them (400 with the reason for anything else) and
  answers the status. ``provisional_audit_share``: the share of a warm-up-certified kind's hits audited until its
  audits of your traffic confirm it (``learn.warmup``).

The setting starts from the environment variable ``CARNATOR_WARMUP`` ("off", the default; "idle"; "budget:10" for
10 minutes per hour) and lives in the process: a restart starts from that variable again.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import replace
from typing import Any

log = logging.getLogger("carnator")

NODES: list = []  # discovery imports every module in nodes/; this one contributes the worker and its routes

MAX_BODY = 4 << 10
_WORKER: Any = None


def _busy() -> bool:
    """Whether ComfyUI's queue holds a prompt (running or waiting); True when it cannot be asked (be polite)."""
    server = sys.modules.get("server")
    instance = getattr(getattr(server, "PromptServer", None), "instance", None)
    queue = getattr(instance, "prompt_queue", None)
    if queue is None:
        return True
    try:
        return int(queue.get_tasks_remaining()) > 0
    except Exception:  # noqa: BLE001 — an unknown queue: never warm up over it
        return True


def hold_prompts_for_worker(queue: Any) -> None:
    """Make ComfyUI's prompt worker wait, after it takes a prompt from ``queue`` and before it runs it, until no
    warm-up label is in flight (``IdleWorker.wait_unwound``: at most the worker's one model call in flight and its
    unwinding). The queue's ``get`` is wrapped on this instance only; everything else of it is ComfyUI's."""
    if getattr(queue, "_carnator_warmup_hold", False):
        return
    original = queue.get

    def get(*args: Any, **kwargs: Any) -> Any:
        item = original(*args, **kwargs)
        if item is not None and _WORKER is not None:
            _WORKER.wait_unwound()
        return item

    queue.get = get
    queue._carnator_warmup_hold = True


def settings_from_env(value: str | None) -> Any:
    """``CARNATOR_WARMUP`` -> ``IdleSettings`` ("off", "idle", "budget:MINUTES"); ValueError for anything else."""
    from ..carnator_core.learn.idle import IdleSettings

    v = (value or "off").strip().lower()
    if v.startswith("budget"):
        _, _, minutes = v.partition(":")
        return IdleSettings(mode="budget", minutes_per_hour=float(minutes or 10.0))
    return IdleSettings(mode=v)


def worker() -> Any:
    """The process's warm-up worker (created and started on first use)."""
    global _WORKER
    if _WORKER is None:
        from ..carnator_core.learn.idle import IdleSettings, IdleWorker

        w = IdleWorker(busy=_busy)
        try:
            w.configure(settings_from_env(os.environ.get("CARNATOR_WARMUP")))
        except ValueError as e:
            log.warning("carnator warm-up: CARNATOR_WARMUP is not understood (%s); warm-up is off", e)
            w.configure(IdleSettings())
        w.start()
        _WORKER = w
    return _WORKER


def remember_request(model: Any, negative: Any, latent: dict, probe: Any, signature: Any, decision: Any,
                     cache: Any, reuse_config: Any) -> str:
    """Hand a served learning request to the worker (what it edits and labels with). Returns "" or why it was not
    (a split schedule, non-default Signature Builder settings, no cache, an exact repeat): warm-up then skips
    that namespace. Never raises."""
    try:
        from ..carnator_core.learn.idle import WarmContext
        from ..carnator_core.learn.learner import LearnSettings
        from ..carnator_core.probe import ProbeConfig
        from ..carnator_core.request import RequestSpec
        from ..carnator_core.signature import SignatureConfig
        from ..carnator_core.types import namespace_key

        ctx = dict(getattr(decision, "learning", None) or {})
        if cache is None or not ctx.get("namespace") or probe is None or probe.answered is not None:
            return "no cache or an exact repeat"
        g = probe.config
        if g.split:
            return "a split schedule is not warmed up"
        if signature is None or signature.config not in ("", SignatureConfig().digest(probe.capture_layers)):
            return "warm-up builds signatures with the default Signature Builder settings only"
        spec = RequestSpec(prompt=str(probe.prompt), seed=int(probe.seed), steps=int(g.steps), cfg=float(g.cfg),
                           sampler=str(g.sampler), scheduler=str(g.scheduler), stage=g.probe_stage())
        pc = ProbeConfig(probe_steps=int(probe.probe_steps), layers=tuple(probe.capture_layers),
                         context_kv_mb=float(probe.context_kv_mb))
        worker().remember(WarmContext(
            directory=str(cache.path), handle=cache, namespace=str(ctx["namespace"]),
            store_namespace=namespace_key(probe.model_fingerprint, g), model=model,
            text_encoder=probe.text_encoder, negative=negative, latent=latent, spec=spec, probe_config=pc,
            reuse_config=reuse_config, settings=LearnSettings.from_dict(ctx.get("settings") or {}),
            top_k=int(ctx.get("k") or 1), vocabulary="embedded" if probe.arch == "embedded" else "english"))
        return ""
    except Exception as e:  # noqa: BLE001 — the request is served; warm-up is only extra
        log.warning("carnator warm-up: the request could not be handed to the worker (%s: %s)", type(e).__name__, e)
        return f"{type(e).__name__}: {e}"


def configure(body: Any) -> dict[str, Any]:
    """POST /carnator/warmup's body -> the new setting (ValueError saying what is wrong)."""
    from ..carnator_core.learn.idle import IdleSettings

    if not isinstance(body, dict):
        raise ValueError('send JSON like {"mode": "idle"} or {"mode": "budget", "minutes_per_hour": 10}')
    from ..carnator_core.learn import warmup

    known = ("mode", "minutes_per_hour", "max_labels", "provisional_audit_share")
    unknown = set(body) - set(known)
    if unknown:
        raise ValueError(f"unknown warm-up settings {sorted(unknown)}; known: {', '.join(known)}")
    cur = worker().settings
    try:
        new = IdleSettings(mode=str(body.get("mode", cur.mode)),
                           minutes_per_hour=float(body.get("minutes_per_hour", cur.minutes_per_hour)),
                           max_labels=int(body.get("max_labels", cur.max_labels)))
        ws = warmup.current_settings()
        ws = replace(ws, audit_share=float(body.get("provisional_audit_share", ws.audit_share)))
    except (TypeError, ValueError) as e:
        raise ValueError(str(e)) from None
    worker().configure(new)
    warmup.configure(ws)
    log.info("carnator warm-up: set to %s, provisional audit share %s", new.to_dict(), ws.audit_share)
    return status()


def status() -> dict[str, Any]:
    """The worker's status and the provisional kinds' audit share (GET /carnator/warmup)."""
    from ..carnator_core.learn import warmup

    return {**worker().status(), "provisional_audit_share": warmup.current_settings().audit_share}


def register(routes: Any) -> None:
    """Adds the warm-up routes to an aiohttp ``RouteTableDef``."""

    @routes.get("/carnator/warmup")
    async def carnator_warmup_status(request: Any) -> Any:
        from aiohttp import web

        return web.json_response(status())

    @routes.post("/carnator/warmup")
    async def carnator_warmup_set(request: Any) -> Any:
        from aiohttp import web

        raw = await request.content.read(MAX_BODY + 1)
        if len(raw) > MAX_BODY:
            return web.json_response({"error": f"the request body is larger than {MAX_BODY} bytes"}, status=413)
        try:
            return web.json_response(configure(json.loads(raw)))
        except (ValueError, RecursionError) as e:
            return web.json_response({"error": str(e)}, status=400)


def _register_with_running_server() -> None:
    server = sys.modules.get("server")
    instance = getattr(getattr(server, "PromptServer", None), "instance", None)
    if instance is None or getattr(instance, "_carnator_warmup_routes", False):
        return
    register(instance.routes)
    instance._carnator_warmup_routes = True
    queue = getattr(instance, "prompt_queue", None)
    if queue is None:
        log.warning("carnator warm-up: ComfyUI's prompt queue is not there; warm-up stays off")
        return
    # At start, not when warm-up is switched on: ComfyUI's prompt worker may then already be waiting inside the
    # queue's own ``get``, and the first prompt after would not wait for a label in flight. With warm-up off the
    # wrapper only checks that no label is in flight.
    hold_prompts_for_worker(queue)
    worker()


_register_with_running_server()
