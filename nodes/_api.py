"""ComfyUI's V3 node API, imported once for every Carnator node module, and Carnator's socket types.

The API comes from a pinned version where the host offers one: ``comfy_api.v0_0_2`` (ComfyUI 0.3.75 has it;
later releases keep it beside newer pins), so an upstream change to the unstable ``comfy_api.latest`` does not
silently change our nodes. A host that has no pinned module (only ``latest``) still works through the
fallback. Node modules import ``io``/``ui``/``ComfyExtension`` and the socket types from here, never from
``comfy_api`` directly.

The socket types are the values passed between Carnator's nodes (frozen dataclasses of ``carnator_core``), one
``io.Custom`` per type name, declared here only.
"""
from __future__ import annotations

try:
    from comfy_api.v0_0_2 import ComfyExtension, io, ui
    API_VERSION = "v0_0_2"
except ImportError:  # a host that offers only the unpinned API
    from comfy_api.latest import ComfyExtension, io, ui
    API_VERSION = "latest"

CACHE = io.Custom("CARNATOR_CACHE")  # cache.CacheHandle (Carnator Cache)
PROBE = io.Custom("CARNATOR_PROBE")  # types.Probe (Early Probe)
SIGNATURE = io.Custom("CARNATOR_SIGNATURE")  # types.Signature (Signature Builder)
CANDIDATES = io.Custom("CARNATOR_CANDIDATES")  # types.Candidates (Cache Retriever)
DECISION = io.Custom("CARNATOR_DECISION")  # types.Decision (Risk Filter)
REPORT = io.Custom("CARNATOR_REPORT")  # reuse.RunReport (Joint Reuse Sampler)
TEXT_ENCODER = io.Custom("CARNATOR_TEXT_ENCODER")  # embedded.comfy_glue.EmbeddedTextEncoder
EMBEDDED_DECODER = io.Custom("CARNATOR_EMBEDDED_DECODER")  # embedded.comfy_glue.EmbeddedDecoder

__all__ = ["API_VERSION", "CACHE", "CANDIDATES", "DECISION", "EMBEDDED_DECODER", "PROBE", "REPORT", "SIGNATURE",
           "TEXT_ENCODER", "ComfyExtension", "io", "ui"]
