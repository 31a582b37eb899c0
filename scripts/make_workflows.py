"""Generate Carnator's example workflows, in both formats, from one description each.

Output, for every workflow NAME (see ``WORKFLOWS``):

* ``workflows/NAME.json`` — the UI format the ComfyUI frontend saves (``version`` 0.4: ``nodes`` with
  ``id/type/pos/size/inputs/outputs/widgets_values``, a ``links`` array, ``groups``); drag-and-drop loadable.
* ``workflows/api/NAME.json`` — the API format ``POST /prompt`` takes (``{id: {class_type, inputs}}``).

Both are rendered from the same ``Graph`` description so they cannot drift. What the description does not say
comes from the node definitions a live server reports on ``/object_info``: widget order (``input_order``:
required, then optional — the order the frontend creates widgets in), defaults of widgets the description leaves
alone, socket types and output names. Hence the generator needs a server:

    .host/venv/bin/python scripts/make_workflows.py             # starts a temporary ComfyUI server (≈10 s)
    .host/venv/bin/python scripts/make_workflows.py --url http://127.0.0.1:8188
    .host/venv/bin/python scripts/make_workflows.py --check     # exit 1 if the files on disk are stale

``tests/test_workflows.py`` re-renders every workflow against the live server's ``/object_info`` and fails when
the committed files differ, so a node whose inputs change forces a regeneration here.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS_DIR = ROOT / "workflows"
API_DIR = WORKFLOWS_DIR / "api"

# Input types the frontend renders as widgets (everything else is a socket). A list as the first element of an
# input spec is the legacy COMBO form.
WIDGET_TYPES = frozenset({"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"})
# Frontend-only nodes: saved in the UI format, never sent to the server (the frontend drops them from prompts).
VIRTUAL_NODES = frozenset({"MarkdownNote", "Note"})

NEGATIVE_WAN = ("色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，最差质量，低质量，JPEG压缩残留，"
                "丑陋的，残缺的，多余的手指，画得不好的手部，画得不好的脸部，畸形的，毁容的，形态畸形的肢体，手指融合，静止不动的画面，"
                "杂乱的背景，三条腿，背景人很多，倒着走")  # the stock Wan negative prompt (ComfyUI's Wan templates)
NEGATIVE_LTXV = ("low quality, worst quality, deformed, distorted, disfigured, motion smear, motion artifacts, fused "
                 "fingers, bad anatomy, weird hand, ugly")  # the stock LTX-Video negative prompt

# Download locations the frontend offers for missing model files (``properties.models`` on loader nodes),
# the same ones ComfyUI's own workflow templates use.
_HF_WAN21 = "https://huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged/resolve/main/split_files"
_HF_WAN22 = "https://huggingface.co/Comfy-Org/Wan_2.2_ComfyUI_Repackaged/resolve/main/split_files"
MODEL_FILES: dict[str, tuple[str, str]] = {  # file name -> (url, models sub-folder)
    "wan2.1_t2v_1.3B_fp16.safetensors": (f"{_HF_WAN21}/diffusion_models/wan2.1_t2v_1.3B_fp16.safetensors",
                                         "diffusion_models"),
    "umt5_xxl_fp8_e4m3fn_scaled.safetensors": (f"{_HF_WAN21}/text_encoders/umt5_xxl_fp8_e4m3fn_scaled.safetensors",
                                               "text_encoders"),
    "wan_2.1_vae.safetensors": (f"{_HF_WAN21}/vae/wan_2.1_vae.safetensors", "vae"),
    "wan2.2_ti2v_5B_fp16.safetensors": (f"{_HF_WAN22}/diffusion_models/wan2.2_ti2v_5B_fp16.safetensors",
                                        "diffusion_models"),
    "wan2.2_vae.safetensors": (f"{_HF_WAN22}/vae/wan2.2_vae.safetensors", "vae"),
    "ltx-video-2b-v0.9.5.safetensors": ("https://huggingface.co/Lightricks/LTX-Video/resolve/main/"
                                        "ltx-video-2b-v0.9.5.safetensors", "checkpoints"),
    "t5xxl_fp16.safetensors": ("https://huggingface.co/comfyanonymous/flux_text_encoders/resolve/main/"
                               "t5xxl_fp16.safetensors", "text_encoders"),
}


class SchemaError(RuntimeError):
    """The description does not fit the node definitions the server reports."""


@dataclass(frozen=True)
class Ref:
    """An output socket: node ``node`` (its id in the description), output index ``slot``."""

    node: int
    slot: int = 0


@dataclass
class Node:
    id: int
    type: str
    pos: tuple[float, float]
    values: dict[str, Any] = field(default_factory=dict)  # widget values by input name (others: defaults)
    links: dict[str, Ref] = field(default_factory=dict)  # input name -> source output
    title: str | None = None
    color: str | None = None
    bgcolor: str | None = None
    control: str = "fixed"  # value of the frontend's control_after_generate widget, where the node has one
    size: tuple[float, float] | None = None


@dataclass
class Graph:
    """One workflow description; ``render_ui``/``render_api`` turn it into the two formats."""

    name: str
    nodes: list[Node] = field(default_factory=list)
    groups: list[dict[str, Any]] = field(default_factory=list)

    def add(self, type_: str, pos: tuple[float, float], values: Mapping[str, Any] | None = None,
            links: Mapping[str, Ref] | None = None, **kw: Any) -> Ref:
        node = Node(id=len(self.nodes) + 1, type=type_, pos=pos, values=dict(values or {}),
                    links=dict(links or {}), **kw)
        self.nodes.append(node)
        return Ref(node.id, 0)

    def note(self, text: str, pos: tuple[float, float], size: tuple[float, float] = (420, 260)) -> None:
        self.nodes.append(Node(id=len(self.nodes) + 1, type="MarkdownNote", pos=pos, values={"text": text},
                               size=size))

    def group(self, title: str, bounding: tuple[float, float, float, float], color: str = "#3f789e") -> None:
        self.groups.append({"id": len(self.groups) + 1, "title": title, "bounding": list(bounding), "color": color,
                            "font_size": 24, "flags": {}})


# --- node definitions (from /object_info) ----------------------------------------------------------------------
def ordered_inputs(node_def: Mapping[str, Any]) -> list[tuple[str, list[Any], bool]]:
    """(name, spec, optional) in the order the frontend lays inputs out: ``input_order`` required, then optional."""
    inputs = node_def.get("input", {})
    order = node_def.get("input_order") or {k: list(inputs.get(k, {})) for k in ("required", "optional")}
    out = []
    for section, optional in (("required", False), ("optional", True)):
        specs = inputs.get(section, {}) or {}
        for name in order.get(section, list(specs)):
            if name in specs:
                out.append((name, list(specs[name]) if isinstance(specs[name], (list, tuple)) else [specs[name]],
                            optional))
    return out


def input_type(spec: list[Any]) -> str:
    """Socket/widget type name of an input spec (legacy combos, given as an options list, are COMBO)."""
    return "COMBO" if isinstance(spec[0], list) else str(spec[0])


def input_options(spec: list[Any]) -> dict[str, Any]:
    return spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}


def combo_options(spec: list[Any]) -> list[Any]:
    return list(spec[0]) if isinstance(spec[0], list) else list(input_options(spec).get("options", []))


def is_widget(spec: list[Any]) -> bool:
    return input_type(spec) in WIDGET_TYPES and not input_options(spec).get("forceInput", False)


def widget_default(spec: list[Any]) -> Any:
    opts = input_options(spec)
    if "default" in opts:
        return opts["default"]
    kind = input_type(spec)
    if kind == "COMBO":
        options = combo_options(spec)
        return options[0] if options else ""
    return {"INT": 0, "FLOAT": 0.0, "STRING": "", "BOOLEAN": False}[kind]


def _node_def(object_info: Mapping[str, Any], node: Node, graph: Graph) -> Mapping[str, Any]:
    try:
        return object_info[node.type]
    except KeyError:
        raise SchemaError(
            f"workflow {graph.name!r}: node type {node.type!r} (node {node.id}) is not on the server. Is the "
            f"extension providing it loaded, and is the name right? (the server knows {len(object_info)} types)"
        ) from None


def _check_description(graph: Graph, node: Node, node_def: Mapping[str, Any]) -> None:
    names = {name for name, _, _ in ordered_inputs(node_def)}
    for name in list(node.values) + list(node.links):
        if name not in names:
            raise SchemaError(f"workflow {graph.name!r}: {node.type} (node {node.id}) has no input {name!r}; "
                              f"its inputs are {sorted(names)}")
    for name, spec, optional in ordered_inputs(node_def):
        if not optional and not is_widget(spec) and name not in node.links:
            raise SchemaError(f"workflow {graph.name!r}: required input {name!r} of {node.type} (node {node.id}) "
                              "is not connected")


# --- rendering -------------------------------------------------------------------------------------------------
def render_api(graph: Graph, object_info: Mapping[str, Any]) -> dict[str, Any]:
    """The API format: every non-virtual node with all its widget values and its links, as the frontend's
    ``graphToPrompt`` produces it (control_after_generate widgets are frontend-only and not sent)."""
    prompt: dict[str, Any] = {}
    for node in graph.nodes:
        if node.type in VIRTUAL_NODES:
            continue
        node_def = _node_def(object_info, node, graph)
        _check_description(graph, node, node_def)
        inputs: dict[str, Any] = {}
        for name, spec, _ in ordered_inputs(node_def):
            if name in node.links:
                ref = node.links[name]
                inputs[name] = [str(ref.node), ref.slot]
            elif is_widget(spec):
                inputs[name] = node.values.get(name, widget_default(spec))
        prompt[str(node.id)] = {"inputs": inputs, "class_type": node.type,
                                "_meta": {"title": node.title or node_def.get("display_name") or node.type}}
    return prompt


def _estimate_size(n_sockets: int, n_outputs: int, n_widgets: int, multiline: int) -> list[float]:
    # The frontend keeps a saved size if it is at least the node's minimum; these estimates are generous.
    height = 30 + 22 * max(n_sockets, n_outputs) + 26 * n_widgets + 90 * multiline
    return [340.0, float(max(height, 60))]


def render_ui(graph: Graph, object_info: Mapping[str, Any]) -> dict[str, Any]:
    """The frontend's saved-workflow format (version 0.4)."""
    by_id = {n.id: n for n in graph.nodes}
    defs = {n.id: _node_def(object_info, n, graph) for n in graph.nodes if n.type not in VIRTUAL_NODES}
    ui_nodes: dict[int, dict[str, Any]] = {}
    links: list[list[Any]] = []
    out_links: dict[tuple[int, int], list[int]] = {}

    # Inputs first (they give the target slot indices of the links).
    pending: list[tuple[Node, str, int, str]] = []  # (target node, input name, target slot, type)
    for order, node in enumerate(graph.nodes):
        if node.type in VIRTUAL_NODES:
            ui_nodes[node.id] = {
                "id": node.id, "type": node.type, "pos": list(node.pos), "size": list(node.size or (400, 200)),
                "flags": {}, "order": order, "mode": 0, "inputs": [], "outputs": [], "properties": {},
                "widgets_values": [node.values.get("text", "")], "color": "#432", "bgcolor": "#653",
            }
            continue
        node_def = defs[node.id]
        _check_description(graph, node, node_def)
        ui_inputs: list[dict[str, Any]] = []
        linked_widgets: list[dict[str, Any]] = []
        widgets_values: list[Any] = []
        n_widgets = multiline = 0
        for name, spec, optional in ordered_inputs(node_def):
            kind = input_type(spec)
            if is_widget(spec):
                n_widgets += 1
                opts = input_options(spec)
                multiline += bool(opts.get("multiline"))
                widgets_values.append(node.values.get(name, widget_default(spec)))
                if opts.get("control_after_generate"):
                    widgets_values.append(node.control)
                    n_widgets += 1
                if name in node.links:  # a widget fed by a link (e.g. one prompt text for several nodes)
                    linked_widgets.append({"name": name, "type": kind, "widget": {"name": name}, "link": None})
                continue
            slot: dict[str, Any] = {"name": name, "type": kind, "link": None}
            if optional:
                slot["shape"] = 7  # the frontend draws optional sockets hollow
            ui_inputs.append(slot)
        ui_inputs.extend(linked_widgets)
        for index, slot in enumerate(ui_inputs):
            if slot["name"] in node.links:
                pending.append((node, slot["name"], index, slot["type"]))
        out_types = list(node_def.get("output", []))
        out_names = list(node_def.get("output_name", out_types))
        properties: dict[str, Any] = {"Node name for S&R": node.type}
        models = [node.values[k] for k in node.values if isinstance(node.values[k], str) and node.values[k] in MODEL_FILES]
        if models:
            properties["models"] = [{"name": m, "url": MODEL_FILES[m][0], "directory": MODEL_FILES[m][1]} for m in models]
        ui = {
            "id": node.id, "type": node.type, "pos": list(node.pos),
            "size": list(node.size) if node.size else _estimate_size(len(ui_inputs), len(out_types), n_widgets,
                                                                    multiline),
            "flags": {}, "order": order, "mode": 0, "inputs": ui_inputs,
            "outputs": [{"name": out_names[i] if i < len(out_names) else t, "type": t, "links": None,
                         "slot_index": i} for i, t in enumerate(out_types)],
            "properties": properties, "widgets_values": widgets_values,
        }
        if node.title:
            ui["title"] = node.title
        if node.color:
            ui["color"] = node.color
        if node.bgcolor:
            ui["bgcolor"] = node.bgcolor
        ui_nodes[node.id] = ui

    for link_id, (node, name, target_slot, in_type) in enumerate(pending, start=1):
        ref = node.links[name]
        source = by_id.get(ref.node)
        if source is None or source.type in VIRTUAL_NODES:
            raise SchemaError(f"workflow {graph.name!r}: input {name!r} of node {node.id} links to a missing node")
        src_def = defs[source.id]
        outputs = list(src_def.get("output", []))
        if ref.slot >= len(outputs):
            raise SchemaError(f"workflow {graph.name!r}: {source.type} (node {source.id}) has no output {ref.slot}")
        out_type = outputs[ref.slot]
        if not types_compatible(out_type, in_type):
            raise SchemaError(f"workflow {graph.name!r}: {source.type}.{ref.slot} gives {out_type} but "
                              f"{node.type}.{name} takes {in_type}")
        ui_nodes[node.id]["inputs"][target_slot]["link"] = link_id
        out_links.setdefault((source.id, ref.slot), []).append(link_id)
        links.append([link_id, source.id, ref.slot, node.id, target_slot, out_type])
    for (node_id, slot), ids in out_links.items():
        ui_nodes[node_id]["outputs"][slot]["links"] = ids

    return {
        "id": f"carnator-{graph.name}", "revision": 0,
        "last_node_id": max(n.id for n in graph.nodes), "last_link_id": len(links),
        "nodes": [ui_nodes[n.id] for n in graph.nodes], "links": links, "groups": copy.deepcopy(graph.groups),
        "config": {}, "extra": {"ds": {"scale": 0.6, "offset": [60, 80]}}, "version": 0.4,
    }


def types_compatible(out_type: str, in_type: str) -> bool:
    """The frontend's rule for connecting sockets: equal types, a wildcard, or one of a comma-separated list."""
    if "*" in (out_type, in_type) or out_type == in_type:
        return True
    outs, ins = set(str(out_type).split(",")), set(str(in_type).split(","))
    return bool(outs & ins)


# --- the workflows ---------------------------------------------------------------------------------------------
# Column x positions of the left-to-right layout.
X0, X1, X2, X3, X4, X5 = 0, 400, 800, 1200, 1600, 2000

CACHE_DIR = "carnator_cache"  # relative to ComfyUI's output directory (see the Cache loader's tooltip)


@dataclass(frozen=True)
class Sources:
    """The model-specific front half of a workflow, wired into the shared Carnator path."""

    model: Ref
    positive: Ref
    negative: Ref
    latent: Ref
    vae_decode: Callable[[Graph, Ref, tuple[float, float]], Ref]  # (graph, latent, pos) -> IMAGE
    prompt: Ref  # STRING: the prompt text (fed to the text encoder and the probe)
    clip: Ref | None  # CLIP for the probe's word -> token mapping


@dataclass(frozen=True)
class Settings:
    steps: int
    cfg: float
    sampler: str
    scheduler: str
    probe_steps: int
    fps: float
    rule_file: str
    seed: int = 42


def stock_decode(vae: Ref) -> Callable[[Graph, Ref, tuple[float, float]], Ref]:
    def decode(g: Graph, latent: Ref, pos: tuple[float, float]) -> Ref:
        return g.add("VAEDecode", pos, links={"samples": latent, "vae": vae})
    return decode


def carnator_path(g: Graph, src: Sources, s: Settings, *, reuse: bool, prefix: str) -> None:
    """The shared Carnator request path. ``reuse``: the full path (cache → probe → signature → retriever → risk
    filter → joint reuse sampler → writer); otherwise the warm-the-cache path (probe → dense sampler → writer)."""
    cache = g.add("CarnatorCacheLoader", (X0, 900), {"directory": CACHE_DIR}, title="Carnator Cache")
    probe_links = {"model": src.model, "positive": src.positive, "negative": src.negative,
                   "latent_image": src.latent, "prompt": src.prompt}
    if src.clip is not None:
        probe_links["clip"] = src.clip
    probe = g.add("CarnatorEarlyProbe", (X2, 0),
                  {"seed": s.seed, "steps": s.steps, "cfg": s.cfg, "sampler_name": s.sampler,
                   "scheduler": s.scheduler, "probe_steps": s.probe_steps},
                  probe_links, control="fixed" if reuse else "increment")
    signature = g.add("CarnatorSignatureBuilder", (X2, 560), links={"probe": probe})
    sampler_links = {"model": src.model, "positive": src.positive, "negative": src.negative,
                     "latent_image": src.latent, "probe": probe, "signature": signature, "cache": cache}
    if reuse:
        candidates = g.add("CarnatorCacheRetriever", (X3, 0), links={"cache": cache, "probe": probe})
        decision = g.add("CarnatorRiskFilter", (X3, 300), {"rule_file": s.rule_file, "mode": "signature"},
                         {"candidates": candidates, "signature": signature, "probe": probe})
        sampler_links["decision"] = decision
    sampler = g.add("CarnatorJointReuseSampler", (X4, 0), {"mode": "joint" if reuse else "dense"}, sampler_links,
                    color="#223", bgcolor="#335")
    g.add("CarnatorCacheWriter", (X5, 420), links={"cache": cache, "probe": probe, "signature": signature,
                                                   "latent": sampler, "report": Ref(sampler.node, 1)})
    image = src.vae_decode(g, sampler, (X5, 0))
    g.add("SaveAnimatedWEBP", (X5, 120), {"filename_prefix": f"carnator/{prefix}", "fps": s.fps, "lossless": False,
                                         "quality": 90, "method": "default"}, {"images": image})


def prompt_node(g: Graph, text: str, pos: tuple[float, float]) -> Ref:
    return g.add("PrimitiveStringMultiline", pos, {"value": text}, title="Prompt", size=(380, 160),
                 color="#232", bgcolor="#353")


NOTE_REUSE = """## Carnator — {model}

**Full reuse path.** Carnator Cache → Early Probe (first {k} of {steps} steps) → Signature Builder → Cache Retriever
→ Risk Filter → Joint Reuse Sampler → Cache Writer; VAE Decode → Save.

**Dense fallback is built in.** When the Risk Filter accepts no cached generation, the Joint Reuse Sampler resumes
the probe densely: the result equals a plain KSampler with the same seed and settings, and the run is written to
the cache for later requests. Set the sampler's `mode` to `dense` (or the filter's to `never`) to force it.

**Before the first run:** the model files below go into `ComfyUI/models/`; the Risk Filter needs a rule calibrated
for this model and config, `{rule}` in `ComfyUI/user/default/carnator/rules/` (see docs/CALIBRATION.md).
After a run the sampler shows the decision badge; the Carnator sidebar tab shows the cache.
"""

NOTE_EMBEDDED = """## Carnator — embedded default model

Ships with Carnator (no downloads) and runs in seconds on a CPU: 8 frames of 32×32 px from a small Wan-architecture
model trained on a world of coloured shapes (vocabulary: docs/MODEL_CARD.md). Its risk rule, `embedded.json`,
ships in Carnator's `rules/` folder.

**Full reuse path** with the **dense fallback** built in: when the Risk Filter accepts no cached generation, the
Joint Reuse Sampler resumes the probe densely (= a plain KSampler) and the Cache Writer stores the run. Queue the
same prompt twice (or use "warm the cache" first): the second run shows a HIT badge on the sampler.
"""

NOTE_WARM = """## Carnator — warm the cache ({model})

Dense generations written to the cache so that later requests can reuse them. The probe's seed increments after
every queue; queue with a batch count (or change the prompt between runs) to fill the cache with varied entries.
"""


def wan21(reuse: bool = True) -> Graph:
    g = Graph("wan21_t2v_1.3b")
    unet = g.add("UNETLoader", (X0, 0), {"unet_name": "wan2.1_t2v_1.3B_fp16.safetensors", "weight_dtype": "default"})
    clip = g.add("CLIPLoader", (X0, 150), {"clip_name": "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "type": "wan"})
    vae = g.add("VAELoader", (X0, 320), {"vae_name": "wan_2.1_vae.safetensors"})
    model = g.add("ModelSamplingSD3", (X1, 0), {"shift": 8.0}, {"model": unet})
    text = prompt_node(g, "a red fox runs through a snowy pine forest, tracking camera, daytime", (X0, 440))
    pos = g.add("CLIPTextEncode", (X1, 140), links={"clip": clip, "text": text}, title="CLIP Text Encode (Positive)",
                color="#232", bgcolor="#353")
    neg = g.add("CLIPTextEncode", (X1, 320), {"text": NEGATIVE_WAN}, {"clip": clip},
                title="CLIP Text Encode (Negative)", color="#322", bgcolor="#533")
    latent = g.add("EmptyHunyuanLatentVideo", (X1, 560), {"width": 832, "height": 480, "length": 81, "batch_size": 1})
    settings = Settings(steps=30, cfg=6.0, sampler="uni_pc", scheduler="simple", probe_steps=6, fps=16.0,
                        rule_file="wan2.1_t2v_1.3B.json")
    carnator_path(g, Sources(model, pos, neg, latent, stock_decode(vae), text, clip), settings, reuse=reuse,
                  prefix="wan21")
    g.note(NOTE_REUSE.format(model="Wan 2.1 T2V 1.3B", k=6, steps=30, rule=settings.rule_file), (X3, 700))
    return g


def wan22_ti2v(reuse: bool = True) -> Graph:
    g = Graph("wan22_ti2v_5b")
    unet = g.add("UNETLoader", (X0, 0), {"unet_name": "wan2.2_ti2v_5B_fp16.safetensors", "weight_dtype": "default"})
    clip = g.add("CLIPLoader", (X0, 150), {"clip_name": "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "type": "wan"})
    vae = g.add("VAELoader", (X0, 320), {"vae_name": "wan2.2_vae.safetensors"})
    model = g.add("ModelSamplingSD3", (X1, 0), {"shift": 8.0}, {"model": unet})
    text = prompt_node(g, "a street musician plays guitar in a retro 1970s subway station, the camera slowly "
                          "moves right", (X0, 440))
    pos = g.add("CLIPTextEncode", (X1, 140), links={"clip": clip, "text": text}, title="CLIP Text Encode (Positive)",
                color="#232", bgcolor="#353")
    neg = g.add("CLIPTextEncode", (X1, 320), {"text": NEGATIVE_WAN}, {"clip": clip},
                title="CLIP Text Encode (Negative)", color="#322", bgcolor="#533")
    latent = g.add("Wan22ImageToVideoLatent", (X1, 560),
                   {"width": 1280, "height": 704, "length": 121, "batch_size": 1}, {"vae": vae})
    settings = Settings(steps=20, cfg=5.0, sampler="uni_pc", scheduler="simple", probe_steps=4, fps=24.0,
                        rule_file="wan2.2_ti2v_5B.json")
    carnator_path(g, Sources(model, pos, neg, latent, stock_decode(vae), text, clip), settings, reuse=reuse,
                  prefix="wan22")
    g.note(NOTE_REUSE.format(model="Wan 2.2 TI2V 5B (text to video; connect a start_image for image to video)",
                             k=4, steps=20, rule=settings.rule_file), (X3, 700))
    return g


def ltxv(reuse: bool = True) -> Graph:
    g = Graph("ltxv")
    ckpt = g.add("CheckpointLoaderSimple", (X0, 0), {"ckpt_name": "ltx-video-2b-v0.9.5.safetensors"})
    clip = g.add("CLIPLoader", (X0, 150), {"clip_name": "t5xxl_fp16.safetensors", "type": "ltxv"})
    text = prompt_node(g, "A red vintage car drives along a coastal road at sunset, the camera follows it from the "
                          "side; warm light, gentle waves, realistic footage.", (X0, 440))
    pos = g.add("CLIPTextEncode", (X1, 140), links={"clip": clip, "text": text}, title="CLIP Text Encode (Positive)",
                color="#232", bgcolor="#353")
    neg = g.add("CLIPTextEncode", (X1, 320), {"text": NEGATIVE_LTXV}, {"clip": clip},
                title="CLIP Text Encode (Negative)", color="#322", bgcolor="#533")
    cond = g.add("LTXVConditioning", (X1, 520), {"frame_rate": 25.0}, {"positive": pos, "negative": neg})
    latent = g.add("EmptyLTXVLatentVideo", (X0, 700), {"width": 768, "height": 512, "length": 97, "batch_size": 1})
    model = g.add("ModelSamplingLTXV", (X1, 0), {"max_shift": 2.05, "base_shift": 0.95},
                  {"model": Ref(ckpt.node, 0), "latent": latent})
    settings = Settings(steps=30, cfg=3.0, sampler="euler", scheduler="simple", probe_steps=6, fps=24.0,
                        rule_file="ltx-video-2b-v0.9.5.json")
    carnator_path(g, Sources(model, Ref(cond.node, 0), Ref(cond.node, 1), latent, stock_decode(Ref(ckpt.node, 2)),
                             text, clip), settings, reuse=reuse, prefix="ltxv")
    g.note(NOTE_REUSE.format(model="LTX-Video 2B v0.9.5", k=6, steps=30, rule=settings.rule_file), (X3, 700))
    return g


def embedded(reuse: bool = True, probe_takes_text_encoder: bool = True) -> Graph:
    """The embedded default model: ships with the extension, needs no download, runs in seconds on a CPU.
    ``probe_takes_text_encoder``: connect the loader's text encoder to the probe's ``clip`` input (it maps object
    words to token positions); ``render_all`` turns it off when the probe's socket does not accept that type."""
    g = Graph("embedded" if reuse else "embedded_warm_cache")
    loader = g.add("CarnatorEmbeddedLoader", (X0, 0))
    encoder, decoder = Ref(loader.node, 1), Ref(loader.node, 2)
    text = prompt_node(g, "a big red ball moves to the right in the top left, on green grass", (X0, 440))
    pos = g.add("CarnatorEmbeddedTextEncode", (X1, 140), links={"text_encoder": encoder, "text": text},
                title="Embedded Text Encode (Positive)", color="#232", bgcolor="#353")
    neg = g.add("CarnatorEmbeddedTextEncode", (X1, 320), {"text": ""}, {"text_encoder": encoder},
                title="Embedded Text Encode (Negative)", color="#322", bgcolor="#533")
    latent = g.add("CarnatorEmbeddedEmptyLatent", (X1, 560), {"batch_size": 1})

    def decode(graph: Graph, samples: Ref, pos_: tuple[float, float]) -> Ref:
        return graph.add("CarnatorEmbeddedDecode", pos_, {"upscale": 4}, {"decoder": decoder, "samples": samples})

    settings = Settings(steps=20, cfg=5.0, sampler="euler", scheduler="simple", probe_steps=4, fps=8.0,
                        rule_file="embedded.json")
    carnator_path(g, Sources(loader, pos, neg, latent, decode, text, encoder if probe_takes_text_encoder else None),
                  settings, reuse=reuse, prefix="embedded" if reuse else "embedded_warm")
    if reuse:
        g.note(NOTE_EMBEDDED, (X3, 700), size=(420, 230))
    else:
        g.note(NOTE_WARM.format(model="embedded default model"), (X3, 700), size=(420, 160))
    return g


def probe_accepts(object_info: Mapping[str, Any], socket_type: str) -> bool:
    """Whether the Early Probe's ``clip`` input takes ``socket_type`` (e.g. the embedded text encoder)."""
    for name, spec, _ in ordered_inputs(object_info.get("CarnatorEarlyProbe", {})):
        if name == "clip":
            return types_compatible(socket_type, input_type(spec))
    return False


WORKFLOWS: dict[str, Callable[[Mapping[str, Any]], Graph]] = {
    "wan21_t2v_1.3b": lambda oi: wan21(),
    "wan22_ti2v_5b": lambda oi: wan22_ti2v(),
    "ltxv": lambda oi: ltxv(),
    "embedded": lambda oi: embedded(True, probe_accepts(oi, "CARNATOR_TEXT_ENCODER")),
    "embedded_warm_cache": lambda oi: embedded(False, probe_accepts(oi, "CARNATOR_TEXT_ENCODER")),
}


def render_all(object_info: Mapping[str, Any]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """name -> (UI-format workflow, API-format prompt) for every workflow in ``WORKFLOWS``."""
    if not probe_accepts(object_info, "CARNATOR_TEXT_ENCODER"):
        print("warning: the Early Probe's 'clip' input does not accept the embedded text encoder; the embedded "
              "workflows leave it unconnected (objects cannot be located)", file=sys.stderr)
    out = {}
    for name, build in WORKFLOWS.items():
        graph = build(object_info)
        assert graph.name == name, (graph.name, name)
        out[name] = (render_ui(graph, object_info), render_api(graph, object_info))
    return out


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


def paths_for(name: str) -> tuple[Path, Path]:
    return WORKFLOWS_DIR / f"{name}.json", API_DIR / f"{name}.json"


def fetch_object_info(url: str) -> dict[str, Any]:
    import urllib.request

    with urllib.request.urlopen(url.rstrip("/") + "/object_info", timeout=60) as r:
        return json.loads(r.read())


def object_info_from_temp_server() -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "tests"))
    from harness_server import ComfyServer  # the project's real-server harness (start/stop by PID)

    with tempfile.TemporaryDirectory(prefix="carnator-workflows-") as tmp:
        with ComfyServer(Path(tmp)) as server:
            return server.get("/object_info", timeout=60)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running ComfyUI server with Carnator loaded (default: start a temporary one)")
    ap.add_argument("--object-info", type=Path, help="read node definitions from this saved /object_info JSON")
    ap.add_argument("--check", action="store_true", help="do not write; exit 1 if a file on disk differs")
    ap.add_argument("--only", nargs="*", help="workflow names (default: all)")
    args = ap.parse_args(argv)
    if args.object_info:
        object_info = json.loads(args.object_info.read_text(encoding="utf-8"))
    else:
        object_info = fetch_object_info(args.url) if args.url else object_info_from_temp_server()
    stale = []
    for name, (ui, api) in render_all(object_info).items():
        if args.only and name not in args.only:
            continue
        for path, obj in zip(paths_for(name), (ui, api)):
            text = dumps(obj)
            if args.check:
                if not path.exists() or path.read_text(encoding="utf-8") != text:
                    stale.append(path)
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text, encoding="utf-8")
                print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print("stale (run scripts/make_workflows.py):\n  " + "\n  ".join(str(p.relative_to(ROOT)) for p in stale))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
