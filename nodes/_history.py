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


def record(namespace: str, meta: Mapping[str, Any], *, prompt: str = "", seed: int | None = None,
           thumb: str | None = None) -> None:
    """Remember one served request of ``namespace`` (its report ``meta``, as the badge gets it)."""
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
