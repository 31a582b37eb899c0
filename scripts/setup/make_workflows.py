"""Generate Carnator's example workflows, in both formats, from one description each.

Output, for every workflow NAME (see ``WORKFLOWS``):

* ``workflows/NAME.json`` — the UI format the ComfyUI frontend saves (``version`` 0.4: ``nodes`` with
  ``id/type/pos/size/inputs/outputs/widgets_values``, a ``links`` array, ``groups``); drag-and-drop loadable.
* ``workflows/api/NAME.json`` — the API format ``POST /prompt`` takes (``{id: {class_type, inputs}}``).

Both are rendered from the same ``Graph`` description so they cannot drift. What the description does not say
comes from the node definitions a live server reports on ``/object_info``: widget order (``input_order``:
required, then optional — the order the frontend creates widgets in), defaults of widgets the description leaves
alone, socket types and output names. Hence the generator needs a server:

    .host/venv/bin/python scripts/setup/make_workflows.py             # starts a temporary ComfyUI server (≈10 s)
    .host/venv/bin/python scripts/setup/make_workflows.py --url http://127.0.0.1:8188
    .host/venv/bin/python scripts/setup/make_workflows.py --check     # exit 1 if the files on disk are stale

``tests/test_workflows.py`` re-renders every workflow against the live server's ``/object_info`` and fails when
the committed files differ, so a node whose inputs change forces a regeneration here.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

ROOT = Path(__file__).resolve().parents[2]
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
    "wan2.2_t2v_high_noise_14B_fp16.safetensors": (
        f"{_HF_WAN22}/diffusion_models/wan2.2_t2v_high_noise_14B_fp16.safetensors", "diffusion_models"),
    "wan2.2_t2v_low_noise_14B_fp16.safetensors": (
        f"{_HF_WAN22}/diffusion_models/wan2.2_t2v_low_noise_14B_fp16.safetensors", "diffusion_models"),
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

    def group(self, title: str, members: list[Ref], color: str = "#3f789e") -> None:
        """A titled frame around ``members`` (its bounds are computed from the laid-out nodes)."""
        self.groups.append({"title": title, "members": [m.node for m in members], "color": color})


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


#: Rows the Carnator web extension adds (web/carnator.js): the summary button of a node with advanced inputs, and
#: the reuse badge of the Joint Reuse Sampler (its fixed height, 3 rows of 17 px + padding, plus the widget margin).
TOGGLE_ROWS = 1
BADGE_PX = {"CarnatorJointReuseSampler": 80}


def _estimate_size(n_sockets: int, n_outputs: int, n_widgets: int, multiline: int, extra_px: int = 0) -> list[float]:
    # At least the frontend's own minimum for the node (it keeps a saved size that is not smaller). Widgets are the
    # ones the node shows by default: advanced ones are folded away (the summary button counts as one row).
    height = 30 + 22 * max(n_sockets, n_outputs) + 26 * n_widgets + 90 * multiline + extra_px
    return [340.0, float(max(height, 60))]


TITLE_H = 30  # LiteGraph title bar height: a node's pos is the top-left of its body, the title sits above it
GAP = 24


def _layout(graph: Graph, sizes: dict[int, list[float]]) -> dict[int, list[float]]:
    """Positions with no overlap: nodes sharing an x column keep their order by y but are pushed down until each
    clears the one above it (title bar included)."""
    pos = {n.id: [float(n.pos[0]), float(n.pos[1])] for n in graph.nodes}
    columns: dict[float, list[int]] = {}
    for n in graph.nodes:
        columns.setdefault(float(n.pos[0]), []).append(n.id)
    for ids in columns.values():
        ids.sort(key=lambda i: (pos[i][1], i))
        for above, below in zip(ids, ids[1:]):
            pos[below][1] = max(pos[below][1], pos[above][1] + sizes[above][1] + TITLE_H + GAP)
    return pos


def render_ui(graph: Graph, object_info: Mapping[str, Any]) -> dict[str, Any]:
    """The frontend's saved-workflow format (version 0.4), laid out as ComfyUI frontend 1.32 saves it: per node
    the socket inputs (required, then optional), then one input slot per widget (``widget: {name}``; linked when
    a link feeds the widget), ``widgets_values`` in widget order with the control_after_generate value after
    the widget it controls."""
    by_id = {n.id: n for n in graph.nodes}
    defs = {n.id: _node_def(object_info, n, graph) for n in graph.nodes if n.type not in VIRTUAL_NODES}
    ui_nodes: dict[int, dict[str, Any]] = {}
    sizes: dict[int, list[float]] = {}
    pending: list[tuple[Node, str, int, str]] = []  # (target node, input name, target slot, type)

    for order, node in enumerate(graph.nodes):
        if node.type in VIRTUAL_NODES:
            sizes[node.id] = list(node.size or (400, 200))
            ui_nodes[node.id] = {
                "id": node.id, "type": node.type, "pos": None, "size": sizes[node.id], "flags": {},
                "order": order, "mode": 0, "inputs": [], "outputs": [], "properties": {},
                "widgets_values": [node.values.get("text", "")], "color": "#432", "bgcolor": "#653",
            }
            continue
        node_def = defs[node.id]
        _check_description(graph, node, node_def)
        sockets: list[dict[str, Any]] = []
        widget_slots: list[dict[str, Any]] = []
        widgets_values: list[Any] = []
        n_widgets = multiline = n_advanced = 0
        for name, spec, optional in ordered_inputs(node_def):
            kind = input_type(spec)
            slot: dict[str, Any] = {"localized_name": name, "name": name, "type": kind}
            if is_widget(spec):
                opts = input_options(spec)
                shown = not opts.get("advanced") or name in node.links  # a linked widget is a socket row
                n_widgets += (1 + bool(opts.get("control_after_generate"))) if shown else 0
                n_advanced += not shown
                multiline += bool(opts.get("multiline")) and name not in node.links  # linked: a socket row
                widgets_values.append(node.values.get(name, widget_default(spec)))
                if opts.get("control_after_generate"):
                    widgets_values.append(node.control)
                widget_slots.append({**slot, "widget": {"name": name}, "link": None})
            else:
                if optional:
                    slot["shape"] = 7  # the frontend draws optional sockets hollow
                sockets.append({**slot, "link": None})
        ui_inputs = sockets + widget_slots
        for index, slot in enumerate(ui_inputs):
            if slot["name"] in node.links:
                pending.append((node, slot["name"], index, slot["type"]))
        out_types = list(node_def.get("output", []))
        out_names = list(node_def.get("output_name", out_types))
        properties: dict[str, Any] = {"Node name for S&R": node.type}
        models = [v for v in node.values.values() if isinstance(v, str) and v in MODEL_FILES]
        if models:  # lets the frontend offer the download of a missing model file
            properties["models"] = [{"name": m, "url": MODEL_FILES[m][0], "directory": MODEL_FILES[m][1]}
                                    for m in models]
        if n_advanced and node.type.startswith("Carnator"):
            n_widgets += TOGGLE_ROWS
        sizes[node.id] = list(node.size) if node.size else _estimate_size(len(sockets), len(out_types), n_widgets,
                                                                          multiline, BADGE_PX.get(node.type, 0))
        ui: dict[str, Any] = {
            "id": node.id, "type": node.type, "pos": None, "size": sizes[node.id], "flags": {}, "order": order,
            "mode": 0, "inputs": ui_inputs,
            "outputs": [{"localized_name": out_names[i] if i < len(out_names) else t,
                         "name": out_names[i] if i < len(out_names) else t, "type": t, "slot_index": i, "links": None}
                        for i, t in enumerate(out_types)],
            "properties": properties, "widgets_values": widgets_values,
        }
        if node.title:
            ui["title"] = node.title
        if node.color:
            ui["color"] = node.color
        if node.bgcolor:
            ui["bgcolor"] = node.bgcolor
        ui_nodes[node.id] = ui

    links: list[list[Any]] = []
    out_links: dict[tuple[int, int], list[int]] = {}
    for link_id, (node, name, target_slot, in_type) in enumerate(pending, start=1):
        ref = node.links[name]
        source = by_id.get(ref.node)
        if source is None or source.type in VIRTUAL_NODES:
            raise SchemaError(f"workflow {graph.name!r}: input {name!r} of node {node.id} links to a missing node")
        outputs = list(defs[source.id].get("output", []))
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

    positions = _layout(graph, sizes)
    for node_id, ui in ui_nodes.items():
        ui["pos"] = positions[node_id]
    groups = []
    for i, grp in enumerate(graph.groups, start=1):
        x0 = min(positions[m][0] for m in grp["members"]) - 20
        y0 = min(positions[m][1] for m in grp["members"]) - TITLE_H - 50
        x1 = max(positions[m][0] + sizes[m][0] for m in grp["members"]) + 20
        y1 = max(positions[m][1] + sizes[m][1] for m in grp["members"]) + 20
        groups.append({"id": i, "title": grp["title"], "bounding": [x0, y0, x1 - x0, y1 - y0], "color": grp["color"],
                       "font_size": 24, "flags": {}})
    return {
        "id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"carnator/workflows/{graph.name}")),  # the frontend wants a UUID
        "revision": 0, "last_node_id": max(n.id for n in graph.nodes), "last_link_id": len(links),
        "nodes": [ui_nodes[n.id] for n in graph.nodes], "links": links, "groups": groups, "config": {},
        "extra": {"ds": {"scale": 0.7, "offset": [80, 200]}}, "version": 0.4,
    }


def types_compatible(out_type: str, in_type: str) -> bool:
    """The frontend's rule for connecting sockets: equal types, a wildcard, or one of a comma-separated list."""
    if "*" in (out_type, in_type) or out_type == in_type:
        return True
    outs, ins = set(str(out_type).split(",")), set(str(in_type).split(","))
    return bool(outs & ins)


# --- the workflows ---------------------------------------------------------------------------------------------
# Column x positions of the left-to-right layout: models | prompt & size | probe & signature | retrieval & risk |
# sampler & writer | decode & save. Nodes in a column are stacked without overlap by ``_layout``.
X0, X1, X2, X3, X4, X5 = 0, 400, 800, 1200, 1600, 2000

CACHE_DIR = "carnator_cache"  # relative to ComfyUI's output directory (see the Cache loader's tooltip)


@dataclass(frozen=True)
class Sources:
    """The model-specific front half of a workflow, wired into the shared Carnator path."""

    model: Ref
    positive: Ref
    negative: Ref
    latent: Ref
    decode: Callable[[Graph, Ref], Ref]  # (graph, LATENT) -> IMAGE
    prompt: Ref  # STRING: the prompt text, fed to the text encoder and to the probe (one text box for both)
    tokenizer: tuple[str, Ref] | None  # (probe input, text encoder) that maps object words to token positions


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
    switch: int = 0  # split schedule: the step the second model takes over at (0: one model, one sampler)


def stock_decode(vae: Ref) -> Callable[[Graph, Ref], Ref]:
    def decode(g: Graph, latent: Ref) -> Ref:
        return g.add("VAEDecode", (X5, 0), links={"samples": latent, "vae": vae})
    return decode


def carnator_path(g: Graph, src: Sources, s: Settings, *, reuse: bool, prefix: str,
                  second_model: Ref | None = None) -> list[Ref]:
    """The shared Carnator request path; returns its nodes. ``reuse``: the full path (cache → probe → signature →
    retriever → risk filter → joint reuse sampler → writer); otherwise warm the cache (probe → dense → writer).
    ``second_model`` with ``s.switch``: a split schedule (Wan 2.2 14B's two experts): the probe and a first sampler
    run steps [0, switch) on ``src.model`` and return leftover noise, a second sampler finishes on
    ``second_model``, as two KSamplerAdvanced nodes would."""
    probe_links = {"model": src.model, "positive": src.positive, "negative": src.negative,
                   "latent_image": src.latent, "prompt": src.prompt}
    if src.tokenizer is not None:
        probe_links[src.tokenizer[0]] = src.tokenizer[1]
    first_stage = {"end_at_step": s.switch, "return_with_leftover_noise": "enable"} if second_model else {}
    if second_model is not None:
        probe_links["second_model"] = second_model
    probe = g.add("CarnatorEarlyProbe", (X2, 0),
                  {"seed": s.seed, "steps": s.steps, "cfg": s.cfg, "sampler_name": s.sampler,
                   "scheduler": s.scheduler, "probe_steps": s.probe_steps, **first_stage},
                  probe_links, control="fixed" if reuse else "increment")
    signature = g.add("CarnatorSignatureBuilder", (X2, 700), links={"probe": probe})
    cache = g.add("CarnatorCacheLoader", (X2, 900), {"directory": CACHE_DIR}, title="Carnator Cache")
    nodes = [probe, signature, cache]
    sampler_links = {"model": src.model, "positive": src.positive, "negative": src.negative,
                     "latent_image": src.latent, "probe": probe, "signature": signature}
    if reuse:
        candidates = g.add("CarnatorCacheRetriever", (X3, 0), links={"cache": cache, "probe": probe})
        decision = g.add("CarnatorRiskFilter", (X3, 200), {"rule_file": s.rule_file, "mode": "signature",
                                                            "allow_uncertified": False},
                         {"candidates": candidates, "signature": signature, "probe": probe})
        sampler_links.update(decision=decision, cache=cache)
        g.nodes[probe.node - 1].links["cache"] = cache  # exact repeats are answered before the probe
        nodes += [candidates, decision]
    mode = {"mode": "joint" if reuse else "dense"}
    sampler = g.add("CarnatorJointReuseSampler", (X4, 0), {**mode, **first_stage}, sampler_links,
                    color="#223", bgcolor="#335", title="Carnator Joint Reuse Sampler (high noise)" if first_stage
                    else None)
    nodes.append(sampler)
    if second_model is not None:
        sampler = g.add("CarnatorJointReuseSampler", (X4, 300),
                        {**mode, "add_noise": "disable", "start_at_step": s.switch},
                        {**sampler_links, "model": second_model, "latent_image": sampler},
                        color="#223", bgcolor="#335", title="Carnator Joint Reuse Sampler (low noise)")
        nodes.append(sampler)
    writer = g.add("CarnatorCacheWriter", (X4, 600), links={"cache": cache, "probe": probe, "signature": signature,
                                                            "latent": sampler, "report": Ref(sampler.node, 1)})
    nodes.append(writer)
    image = src.decode(g, sampler)
    save = g.add("SaveAnimatedWEBP", (X5, 150), {"filename_prefix": f"carnator/{prefix}", "fps": s.fps,
                                                "lossless": False, "quality": 90, "method": "default"},
                 {"images": image})
    g.group("Carnator: " + ("probe, recall, risk filter, joint reuse, cache" if reuse else "warm the cache"), nodes,
            color="#8a6d3b")
    g.group("Output", [image, save])
    return nodes


def prompt_node(g: Graph, text: str) -> Ref:
    return g.add("PrimitiveStringMultiline", (X1, 0), {"value": text}, title="Prompt", size=(340, 140),
                 color="#232", bgcolor="#353")


NOTE_REUSE = """## Carnator — {model}

**Full reuse path.** Carnator Cache → Early Probe (first {k} of {steps} steps) → Signature Builder → Cache Retriever
→ Risk Filter → Joint Reuse Sampler → Cache Writer; decode → Save.

**Dense fallback is built in.** When the Risk Filter accepts no cached generation, the Joint Reuse Sampler resumes
the probe densely (the same result as a plain KSampler with this seed and these settings) and the Cache Writer
stores the run for later requests. Set the sampler's `mode` to `dense` (or the filter's to `never`) to force it.

{setup}

After a run the sampler shows the decision badge; the **Carnator** sidebar tab shows the cache and can purge it.
"""

SETUP_STOCK = """**Before the first run:** put the model files into `ComfyUI/models/` (the loaders offer the downloads).
**No rule yet:** the Risk Filter's `{rule}` does not exist until a rule is learned or calibrated for this model
and config, and until then Carnator runs in learning mode: every request is served dense (as KSampler would) and
cached, exact repeats are answered from the cache, and the rule is learned where Carnator has a judge for this
model (README, "Your own model, day one"). A rule calibrated offline goes to `ComfyUI/user/default/carnator/rules/`
under that name (docs/CALIBRATION.md)."""

SETUP_EMBEDDED = """**No downloads:** the embedded model ({frames} frames of {height}×{width} px, a small Wan-architecture model trained on a
world of coloured shapes; vocabulary in docs/MODEL_CARD.md) ships with Carnator.
{rule_text}"""

#: The kinds of change (rule strata) as the notes name them; the order of a rule's certificate is kept.
KIND_WORDS = {"reseed": "re-rolls (a new seed)", "rewording": "rewordings", "colour": "colour edits",
              "size": "size edits", "position": "position edits", "motion": "motion edits",
              "background": "background edits", "object": "object swaps", "count": "changes in the number of objects",
              "mixed": "edits of several kinds at once"}


def _words(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def embedded_rule_summary(rule_file: str) -> str:
    """What the rule ``rule_file`` does, read from ``rules/<rule_file>`` (so the workflow note says what the file in
    the repository says; tests/test_workflows.py checks every note against the rule it names): which kinds of change
    it serves by reuse and which it refuses, with its certificate; or, when no such rule ships, learning mode."""
    path = ROOT / "rules" / rule_file
    if not path.is_file():  # withdrawn (rules/withdrawn/): the Risk Filter serves dense and learns one
        return (f"**No rule ships for this graph:** `{rule_file}` was withdrawn (rules/README.md), so the Risk Filter "
                "runs in learning mode (docs/LEARNING.md): every request is served dense and cached, an exact repeat "
                "is answered from the cache, and a rule is learned from labels of what was served; the badge and the "
                "Carnator panel show its progress. Reuse switches on by itself for each kind of change that "
                "certifies.")
    rule = json.loads(path.read_text(encoding="utf-8"))
    c = rule["certificate"]
    if not c.get("passed"):
        return (f"Its rule `{rule_file}` ships but is NOT certified (U = {c['upper_bound']:.4f} > α = {c['alpha']}); "
                "the filter refuses it unless allow_uncertified is on.")
    label = ("reuse failing where the dense run passes, net of the reverse: (b − c)/n = "
             f"({c['k']} − {c.get('c', 0)})/{c['n']}" if c.get("label") == "excess" else
             f"{c['k']} unsafe of {c['n']}")
    text = (f"Its risk rule `{rule_file}` ships with Carnator, certified on {label} accepted requests of its "
            f"certification split, U = {c['upper_bound']:.4f} ≤ α = {c['alpha']} at δ = {c['delta']} "
            "(rules/README.md).")
    strata = rule.get("strata")
    if strata is None:
        return text + (" Queue a request, then a reworded one, a re-roll or a one-attribute edit of it: the second "
                       "run reuses the first where the rule accepts it.")
    served = [k for k in strata["order"] if k in strata["certified"]]
    refused = [k for k in strata["order"] if k not in strata["certified"]]
    text += (f" Per kind of change: it serves {_words([KIND_WORDS.get(k, k) for k in served]) or 'none'} by reuse"
             + (f", and refuses {_words([KIND_WORDS.get(k, k) for k in refused])} (not certified: those run dense)."
                if refused else "."))
    if served:
        text += (f" Queue a request, then one of its {KIND_WORDS.get(served[0], served[0])}: the second run is a HIT "
                 "that recomputes only what changed, if the filter accepts the cached run.")
    return text


EASYCACHE_DEFAULTS = {"reuse_threshold": 0.2, "start_percent": 0.15, "end_percent": 0.95, "verbose": False}

SETUP_EASYCACHE = """**Behind EasyCache:** ComfyUI's EasyCache node (threshold 0.2, 15–95 %) patches the MODEL that both the Early
Probe and the Joint Reuse Sampler run, so within a request EasyCache skips steps and across requests Carnator
reuses. For Carnator the patched MODEL is another model: the cache keeps these entries apart from the plain
model's, and a rule for it (`{rule}`) holds for exactly these EasyCache settings and a {k}-step probe."""

NOTE_WARM = """## Carnator — warm the cache ({model})

Dense generations written to the cache so that later requests can reuse them. The probe's seed increments after
every queue: queue with a batch count, or change the prompt between runs, to fill the cache with varied entries.
"""


def wan_front(g: Graph, unet: str, vae_name: str, text: str) -> tuple[Ref, Ref, Ref, Ref, Ref, Ref]:
    """Stock Wan loading as in ComfyUI's Wan templates: (model, clip, vae, prompt, positive, negative)."""
    loader = g.add("UNETLoader", (X0, 0), {"unet_name": unet, "weight_dtype": "default"})
    model = g.add("ModelSamplingSD3", (X0, 150), {"shift": 8.0}, {"model": loader})
    clip = g.add("CLIPLoader", (X0, 300), {"clip_name": "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "type": "wan",
                                           "device": "default"})
    vae = g.add("VAELoader", (X0, 450), {"vae_name": vae_name})
    prompt = prompt_node(g, text)
    pos = g.add("CLIPTextEncode", (X1, 200), links={"clip": clip, "text": prompt}, title="CLIP Text Encode (Positive)",
                color="#232", bgcolor="#353")
    neg = g.add("CLIPTextEncode", (X1, 400), {"text": NEGATIVE_WAN}, {"clip": clip},
                title="CLIP Text Encode (Negative)", color="#322", bgcolor="#533")
    g.group("Models", [loader, model, clip, vae])
    return model, clip, vae, prompt, pos, neg


def wan21(reuse: bool = True) -> Graph:
    g = Graph("wan21_t2v_1.3b")
    model, clip, vae, prompt, pos, neg = wan_front(
        g, "wan2.1_t2v_1.3B_fp16.safetensors", "wan_2.1_vae.safetensors",
        "a red fox runs through a snowy pine forest, tracking camera, daytime")
    latent = g.add("EmptyHunyuanLatentVideo", (X1, 700), {"width": 832, "height": 480, "length": 81, "batch_size": 1})
    g.group("Prompt & video size", [prompt, pos, neg, latent], color="#3f7a4f")
    settings = Settings(steps=30, cfg=6.0, sampler="uni_pc", scheduler="simple", probe_steps=6, fps=16.0,
                        rule_file="wan2.1_t2v_1.3B.json")
    carnator_path(g, Sources(model, pos, neg, latent, stock_decode(vae), prompt, ("clip", clip)), settings,
                  reuse=reuse, prefix="wan21")
    g.note(NOTE_REUSE.format(model="Wan 2.1 T2V 1.3B", k=6, steps=30,
                             setup=SETUP_STOCK.format(rule=settings.rule_file)), (X5, 600), size=(440, 330))
    return g


def wan22_ti2v(reuse: bool = True) -> Graph:
    g = Graph("wan22_ti2v_5b")
    model, clip, vae, prompt, pos, neg = wan_front(
        g, "wan2.2_ti2v_5B_fp16.safetensors", "wan2.2_vae.safetensors",
        "a street musician plays guitar in a retro 1970s subway station, the camera slowly moves right")
    latent = g.add("Wan22ImageToVideoLatent", (X1, 700), {"width": 1280, "height": 704, "length": 121,
                                                          "batch_size": 1}, {"vae": vae})
    g.group("Prompt & video size", [prompt, pos, neg, latent], color="#3f7a4f")
    settings = Settings(steps=20, cfg=5.0, sampler="uni_pc", scheduler="simple", probe_steps=4, fps=24.0,
                        rule_file="wan2.2_ti2v_5B.json")
    carnator_path(g, Sources(model, pos, neg, latent, stock_decode(vae), prompt, ("clip", clip)), settings,
                  reuse=reuse, prefix="wan22")
    g.note(NOTE_REUSE.format(model="Wan 2.2 TI2V 5B (text to video; connect a start_image to the latent node for "
                                   "image to video)", k=4, steps=20,
                             setup=SETUP_STOCK.format(rule=settings.rule_file)), (X5, 600), size=(440, 350))
    return g


NOTE_TWO_EXPERTS = """**Two experts.** Wan 2.2 14B samples its first {switch} steps with the high-noise expert and the rest
with the low-noise expert. The Early Probe runs on the high-noise expert (its `end_at_step` = {switch}, leftover
noise on) and knows the low-noise expert through `second_model`: both experts and the switch step are part of the
cache namespace. The first Joint Reuse Sampler resumes the probe up to step {switch}; the second one finishes on
the low-noise expert (`start_at_step` = {switch}, `add_noise` off). Dense, the two equal the stock graph of two
KSamplerAdvanced nodes bit for bit; on a hit both reuse the cached run outside the changed region."""


def wan22_t2v_14b(reuse: bool = True) -> Graph:
    """Wan 2.2 T2V 14B, as ComfyUI's Wan 2.2 template loads it: two experts, each behind ModelSamplingSD3."""
    g = Graph("wan22_t2v_14b")
    high, clip, vae, prompt, pos, neg = wan_front(
        g, "wan2.2_t2v_high_noise_14B_fp16.safetensors", "wan_2.1_vae.safetensors",
        "a red fox runs through a snowy pine forest, tracking camera, daytime")
    high_loader = g.nodes[g.nodes[high.node - 1].links["model"].node - 1]
    high_loader.title = "Load Diffusion Model (high-noise expert)"
    low_loader = g.add("UNETLoader", (X0, 600), {"unet_name": "wan2.2_t2v_low_noise_14B_fp16.safetensors",
                                                 "weight_dtype": "default"},
                       title="Load Diffusion Model (low-noise expert)")
    low = g.add("ModelSamplingSD3", (X0, 750), {"shift": 8.0}, {"model": low_loader})
    g.groups[-1]["members"] += [low_loader.node, low.node]  # the "Models" group of wan_front
    latent = g.add("EmptyHunyuanLatentVideo", (X1, 700), {"width": 832, "height": 480, "length": 81, "batch_size": 1})
    g.group("Prompt & video size", [prompt, pos, neg, latent], color="#3f7a4f")
    settings = Settings(steps=20, cfg=3.5, sampler="euler", scheduler="simple", probe_steps=4, fps=16.0,
                        rule_file="wan2.2_t2v_14B.json", switch=10)
    carnator_path(g, Sources(high, pos, neg, latent, stock_decode(vae), prompt, ("clip", clip)), settings,
                  reuse=reuse, prefix="wan22_14b", second_model=low)
    g.note(NOTE_REUSE.format(model="Wan 2.2 T2V 14B (high- and low-noise experts)", k=4, steps=20,
                             setup=SETUP_STOCK.format(rule=settings.rule_file)) + "\n"
           + NOTE_TWO_EXPERTS.format(switch=settings.switch), (X5, 600), size=(440, 520))
    return g


def ltxv(reuse: bool = True) -> Graph:
    g = Graph("ltxv")
    ckpt = g.add("CheckpointLoaderSimple", (X0, 0), {"ckpt_name": "ltx-video-2b-v0.9.5.safetensors"})
    clip = g.add("CLIPLoader", (X0, 300), {"clip_name": "t5xxl_fp16.safetensors", "type": "ltxv", "device": "default"})
    prompt = prompt_node(g, "A red vintage car drives along a coastal road at sunset, the camera follows it from the "
                            "side; warm light, gentle waves, realistic footage.")
    pos = g.add("CLIPTextEncode", (X1, 200), links={"clip": clip, "text": prompt}, title="CLIP Text Encode (Positive)",
                color="#232", bgcolor="#353")
    neg = g.add("CLIPTextEncode", (X1, 400), {"text": NEGATIVE_LTXV}, {"clip": clip},
                title="CLIP Text Encode (Negative)", color="#322", bgcolor="#533")
    cond = g.add("LTXVConditioning", (X1, 600), {"frame_rate": 25.0}, {"positive": pos, "negative": neg})
    latent = g.add("EmptyLTXVLatentVideo", (X1, 750), {"width": 768, "height": 512, "length": 97, "batch_size": 1})
    model = g.add("ModelSamplingLTXV", (X0, 150), {"max_shift": 2.05, "base_shift": 0.95},
                  {"model": Ref(ckpt.node, 0), "latent": latent})
    g.group("Models", [ckpt, model, clip])
    g.group("Prompt & video size", [prompt, pos, neg, cond, latent], color="#3f7a4f")
    settings = Settings(steps=30, cfg=3.0, sampler="euler", scheduler="simple", probe_steps=6, fps=24.0,
                        rule_file="ltx-video-2b-v0.9.5.json")
    carnator_path(g, Sources(model, Ref(cond.node, 0), Ref(cond.node, 1), latent, stock_decode(Ref(ckpt.node, 2)),
                             prompt, ("clip", clip)), settings, reuse=reuse, prefix="ltxv")
    g.note(NOTE_REUSE.format(model="LTX-Video 2B v0.9.5", k=6, steps=30,
                             setup=SETUP_STOCK.format(rule=settings.rule_file)), (X5, 600), size=(440, 330))
    return g


def embedded(reuse: bool = True, tokenizer_input: str | None = "text_encoder", easycache: bool = False) -> Graph:
    """The embedded default model: ships with the extension, needs no download, runs in seconds on a CPU.
    ``tokenizer_input``: the Early Probe input that takes the embedded text encoder (it maps object words to
    token positions), None if the probe has none. ``easycache``: ComfyUI's EasyCache node (its defaults) patches the
    MODEL the probe and the sampler run, and the Risk Filter loads the rule certified for that patched MODEL."""
    name = "embedded" + ("_easycache" if easycache else "")
    g = Graph(name if reuse else name + "_warm_cache")
    loader = g.add("CarnatorEmbeddedLoader", (X0, 0))
    model = loader
    if easycache:
        model = g.add("EasyCache", (X0, 300), dict(EASYCACHE_DEFAULTS), {"model": loader},
                      title="EasyCache (ComfyUI core)")
    encoder, decoder = Ref(loader.node, 1), Ref(loader.node, 2)
    prompt = prompt_node(g, "a big red ball moves to the right in the top left, on green grass")
    pos = g.add("CarnatorEmbeddedTextEncode", (X1, 200), links={"text_encoder": encoder, "text": prompt},
                title="Embedded Text Encode (Positive)", color="#232", bgcolor="#353")
    neg = g.add("CarnatorEmbeddedTextEncode", (X1, 400), {"text": ""}, {"text_encoder": encoder},
                title="Embedded Text Encode (Negative)", color="#322", bgcolor="#533")
    latent = g.add("CarnatorEmbeddedEmptyLatent", (X1, 600), {"batch_size": 1})
    g.group("Model", [loader] + ([model] if easycache else []))
    g.group("Prompt & video size", [prompt, pos, neg, latent], color="#3f7a4f")

    def decode(graph: Graph, samples: Ref) -> Ref:
        return graph.add("CarnatorEmbeddedDecode", (X5, 0), {"upscale": 4}, {"decoder": decoder, "samples": samples})

    settings = Settings(steps=20, cfg=_embedded_config().DEFAULT_CFG, sampler="euler", scheduler="simple",
                        probe_steps=_embedded_config().DEFAULT_PROBE_STEP, fps=8.0, rule_file=f"{name}.json")
    carnator_path(g, Sources(model, pos, neg, latent, decode, prompt,
                             (tokenizer_input, encoder) if tokenizer_input else None),
                  settings, reuse=reuse, prefix=name if reuse else name + "_warm")
    if reuse:
        cfg = _embedded_config()
        setup = SETUP_EMBEDDED.format(frames=cfg.FRAMES, height=cfg.HEIGHT, width=cfg.WIDTH,
                                      rule_text=embedded_rule_summary(settings.rule_file))
        if easycache:
            setup += "\n\n" + SETUP_EASYCACHE.format(rule=settings.rule_file, k=settings.probe_steps)
        g.note(NOTE_REUSE.format(model="embedded default model", k=settings.probe_steps, steps=settings.steps,
                                 setup=setup), (X5, 600),
               size=(440, 440 if easycache else 400))
    else:
        g.note(NOTE_WARM.format(model="embedded default model"), (X5, 600), size=(440, 170))
    return g


def _embedded_config() -> Any:
    """carnator_core/embedded/config.py (stdlib only), loaded by path: this script runs without the package
    registered, and the embedded workflows use the default version's stock settings."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("carnator_embedded_config",
                                                  ROOT / "carnator_core" / "embedded" / "config.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve the module by name
    spec.loader.exec_module(mod)
    return mod


def probe_input_for(object_info: Mapping[str, Any], socket_type: str) -> str | None:
    """The Early Probe input that takes ``socket_type`` (e.g. the embedded text encoder), or None."""
    for name, spec, _ in ordered_inputs(object_info.get("CarnatorEarlyProbe", {})):
        if not is_widget(spec) and types_compatible(socket_type, input_type(spec)):
            return name
    return None


WORKFLOWS: dict[str, Callable[[Mapping[str, Any]], Graph]] = {
    "wan21_t2v_1.3b": lambda oi: wan21(),
    "wan22_ti2v_5b": lambda oi: wan22_ti2v(),
    "wan22_t2v_14b": lambda oi: wan22_t2v_14b(),
    "ltxv": lambda oi: ltxv(),
    "embedded": lambda oi: embedded(True, probe_input_for(oi, "CARNATOR_TEXT_ENCODER")),
    "embedded_warm_cache": lambda oi: embedded(False, probe_input_for(oi, "CARNATOR_TEXT_ENCODER")),
    "embedded_easycache": lambda oi: embedded(True, probe_input_for(oi, "CARNATOR_TEXT_ENCODER"), easycache=True),
}


def render_all(object_info: Mapping[str, Any]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """name -> (UI-format workflow, API-format prompt) for every workflow in ``WORKFLOWS``."""
    if probe_input_for(object_info, "CARNATOR_TEXT_ENCODER") is None:
        print("warning: no Early Probe input accepts the embedded text encoder; the embedded workflows leave it "
              "unconnected (objects cannot be located)", file=sys.stderr)
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
        with ComfyServer(Path(tmp), startup_timeout=600) as server:  # minutes on a busy machine
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
        print("stale (run scripts/setup/make_workflows.py):\n  " + "\n  ".join(str(p.relative_to(ROOT)) for p in stale))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
