"""The last requests this ComfyUI process served, per cache namespace, for the web panel (nodes/routes.py).

Not a node module (discovery skips '_' names). The Joint Reuse Sampler records one event per finished request (and
the Cache Writer one when ComfyUI's node cache answered a requeued graph): the time, the decision, the share of
dense compute saved, the rule that decided (and its ``rule_state`` when the report carries one) and a small
thumbnail of the result. The thumbnail is the middle frame of the final latent mapped to RGB with the model's own
latent preview factors (what ComfyUI's latent previews use), so it costs no VAE decode.

Bounded by design: at most ``MAX_EVENTS`` events per namespace and ``MAX_NAMESPACES`` namespaces (the oldest go
first); thumbnails are at most ``THUMB_PX`` pixels on their long side. The history lives in this process only: it
starts empty when the server starts (the cache's own counters, in ``/carnator/cache/stats``, persist).
"""
from __future__ import annotations

import base64
import io
import sys
import threading
import time
from collections import OrderedDict, deque
from typing import Any, Mapping

#: The one definition of a hit and of a lookup: the badge (web/carnator.js ``isHit`` / ``isLookup``), the panel, its
#: help, these events and the cache's own counters (``/carnator/cache/stats``; carnator_core/request.py counts a
#: request's lookup and hit when it is served) all count this way.
DEFINITIONS = {
    "lookup": "a request Carnator served that searched its cache: the Risk Filter ran, or an exact repeat was found",
    "hit": "a lookup answered from the cache: an exact repeat (no model call) or a reuse of a cached clip",
    "not_run": "ComfyUI's own node cache handed back the output of an unchanged graph: no Carnator stage ran, so it "
               "is neither a lookup nor a hit",
}

MAX_EVENTS = 200
MAX_NAMESPACES = 32
THUMB_PX = 96

_LOCK = threading.Lock()
_EVENTS: "OrderedDict[str, deque[dict[str, Any]]]" = OrderedDict()
_PURGES: "deque[float]" = deque(maxlen=MAX_EVENTS)
_TITLES: "OrderedDict[str, dict[str, str]]" = OrderedDict()  # namespace -> its words (``describe``)
STARTED = time.time()  # the history covers the requests since then (this process)

#: Report fields an event keeps (the rest of a report is per-axis detail the badge already shows).
_KEEP = ("decision", "mode", "entry_id", "saving", "model_calls", "steps_total", "active_fraction", "reason",
         "requested_mode", "filter_mode", "rule_id", "certified_strata", "rule_state", "decision_summary")


def outcome(meta: Mapping[str, Any]) -> str:
    """What a served request counts as: "hit", "miss", "dense" (forced, or nothing connected to decide) or
    "not_run" (ComfyUI's node cache answered: no Carnator stage ran)."""
    if meta.get("mode") == "node_cache":
        return "not_run"
    if meta.get("decision") == "hit":
        return "hit"
    if meta.get("decision") == "miss" and meta.get("requested_mode") != "dense" and meta.get("filter_mode") != "never":
        return "miss"
    return "dense"


def is_lookup(meta: Mapping[str, Any]) -> bool:
    """Whether a served request searched the cache (``DEFINITIONS["lookup"]``): a hit, or a request the Risk Filter
    decided (its report names the filter's mode)."""
    kind = outcome(meta)
    return kind == "hit" or (kind != "not_run" and meta.get("filter_mode") is not None)


def thumbnail(samples: Any, model: Any = None) -> str | None:
    """A PNG data URL of the middle frame of ``samples`` ([B, C, (T,) H, W]), or None when it cannot be made.

    RGB comes from the model's ``latent_format.latent_rgb_factors`` when it has them (a linear map per latent
    channel, as ComfyUI's previews use); otherwise from the first three channels. Each thumbnail is stretched to its
    own value range: it shows what is where, not exact colours."""
    try:
        import numpy as np
        from PIL import Image

        x = samples.detach().float().cpu()
        if x.ndim == 5:
            x = x[0, :, x.shape[2] // 2]
        elif x.ndim == 4:
            x = x[0]
        else:
            return None
        lf = getattr(getattr(getattr(model, "model", None), "latent_format", None), "latent_rgb_factors", None)
        arr = x.numpy()  # [C, H, W]
        if lf is not None and len(lf) == arr.shape[0]:
            rgb = np.einsum("chw,cr->hwr", arr, np.asarray(lf, dtype=np.float32))
        else:
            rgb = np.stack([arr[min(i, arr.shape[0] - 1)] for i in range(3)], axis=-1)
        lo, hi = np.percentile(rgb, 1), np.percentile(rgb, 99)
        img = np.clip((rgb - lo) / max(hi - lo, 1e-6), 0, 1)
        pil = Image.fromarray((img * 255).astype(np.uint8), "RGB")
        scale = THUMB_PX / max(pil.size)
        pil = pil.resize((max(1, round(pil.size[0] * scale)), max(1, round(pil.size[1] * scale))), Image.NEAREST)
        buf = io.BytesIO()
        pil.save(buf, format="PNG", optimize=True)
        return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
    except Exception:  # noqa: BLE001 — a thumbnail is a nicety: never fail a request for it
        return None


def _running_prompt() -> tuple[dict[str, Any], str] | None:
    """(the API prompt ComfyUI is executing, the id of the node executing now), or None outside a server run."""
    try:
        from comfy_execution.utils import get_executing_context

        ctx = get_executing_context()
        instance = getattr(getattr(sys.modules.get("server"), "PromptServer", None), "instance", None)
        if ctx is None or instance is None:
            return None
        for item in list(instance.prompt_queue.currently_running.values()):
            if item[1] == ctx.prompt_id and isinstance(item[2], dict):
                return item[2], str(ctx.node_id)
    except Exception:  # noqa: BLE001 — another ComfyUI: the panel then names the namespace by its config alone
        return None
    return None


def _title(node: Mapping[str, Any]) -> str:
    return str((node.get("_meta") or {}).get("title") or node.get("class_type") or "?")


def describe(graph: Mapping[str, Any], node_id: str) -> dict[str, str] | None:
    """A namespace in words from the graph that served it: ``model``, the MODEL's loader (and its file) and every
    patch on the way to the node (EasyCache, a LoRA, ... with their settings), and ``config``, the Early Probe's
    schedule. None when the graph has no MODEL upstream of ``node_id``."""
    def linked(value: Any) -> bool:
        return isinstance(value, list) and len(value) == 2 and str(value[0]) in graph

    seen: set[str] = set()
    frontier, start, probe = [str(node_id)], None, None
    while frontier and start is None:  # the nearest node upstream that takes a MODEL
        nid = frontier.pop(0)
        if nid in seen or nid not in graph:
            continue
        seen.add(nid)
        inputs = graph[nid].get("inputs") or {}
        if graph[nid].get("class_type") == "CarnatorEarlyProbe":
            probe = inputs
        if linked(inputs.get("model")):
            start = str(inputs["model"][0])
            probe = probe or next((graph[str(v[0])].get("inputs") for v in inputs.values() if linked(v)
                                   and graph[str(v[0])].get("class_type") == "CarnatorEarlyProbe"), None)
        frontier += [str(v[0]) for v in inputs.values() if linked(v)]
    chain: list[Mapping[str, Any]] = []
    while start is not None and len(chain) < 16:  # along MODEL to its loader
        node = graph[start]
        chain.append(node)
        start = str(node["inputs"]["model"][0]) if linked((node.get("inputs") or {}).get("model")) else None
    if not chain:
        return None
    loader, patches = chain[-1], chain[-2::-1]
    files = [str(v) for k, v in (loader.get("inputs") or {}).items() if isinstance(v, str) and v and "name" in k]
    words = [_title(loader) + (f" ({', '.join(files)})" if files else "")]
    for node in patches:
        values = [f"{k} {v:g}" for k, v in (node.get("inputs") or {}).items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool)][:3]
        names = [str(v) for k, v in (node.get("inputs") or {}).items() if isinstance(v, str) and v and "name" in k]
        words.append(_title(node) + (f" ({', '.join(names + values)})" if names or values else ""))
    config = ""
    if probe:
        bits = [f"probe {probe.get('probe_steps')} of {probe.get('steps')} steps" if "probe_steps" in probe else "",
                f"{probe.get('sampler_name')}/{probe.get('scheduler')}" if "sampler_name" in probe else "",
                f"cfg {probe.get('cfg'):g}" if isinstance(probe.get("cfg"), (int, float)) else ""]
        config = " · ".join(b for b in bits if b)
    return {"model": " + ".join(words), "config": config}


def record(namespace: str, meta: Mapping[str, Any], *, prompt: str = "", seed: int | None = None,
           thumb: str | None = None) -> None:
    """Remember one served request of ``namespace`` (its report ``meta``, as the badge gets it), and the namespace
    in words from the graph that served it (``titles``)."""
    running = _running_prompt()
    words = describe(*running) if running else None
    if words:
        with _LOCK:
            _TITLES[namespace] = words
            while len(_TITLES) > MAX_NAMESPACES * 4:
                _TITLES.popitem(last=False)
    event = {k: meta.get(k) for k in _KEEP if k in meta}
    event.update(time=time.time(), prompt=str(prompt)[:200], seed=seed, thumbnail=thumb, outcome=outcome(meta),
                 lookup=is_lookup(meta))
    with _LOCK:
        q = _EVENTS.get(namespace)
        if q is None:
            q = _EVENTS[namespace] = deque(maxlen=MAX_EVENTS)
            while len(_EVENTS) > MAX_NAMESPACES:
                _EVENTS.popitem(last=False)
        q.append(event)
        _EVENTS.move_to_end(namespace)


def recent(namespace: str | None = None) -> dict[str, list[dict[str, Any]]]:
    """Events per namespace, oldest first (one namespace, or all)."""
    with _LOCK:
        items = [(namespace, _EVENTS.get(namespace, ()))] if namespace else list(_EVENTS.items())
        return {ns: [dict(e) for e in q] for ns, q in items}


def mark_purge() -> None:
    """Note that the cache was purged now (the panel marks it on the plots; the events before it stay)."""
    with _LOCK:
        _PURGES.append(time.time())


def purges() -> list[float]:
    """When this process purged a cache (seconds since the epoch, the last ``MAX_EVENTS``)."""
    with _LOCK:
        return list(_PURGES)


def titles() -> dict[str, dict[str, str]]:
    """Each namespace this process served, in words (``describe``): kept through a purge."""
    with _LOCK:
        return {k: dict(v) for k, v in _TITLES.items()}
