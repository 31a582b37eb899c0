"""Example workflows, the cache routes and the API-queue client against one real ComfyUI server.

* Every workflow in ``workflows/`` (UI format) and ``workflows/api/`` (API format) is checked against the live
  server's ``/object_info``: node types exist, required inputs are present, widget values have the right type,
  range and combo option (loader file names excepted: the test server has no model files), links join
  compatible sockets; the UI format converts to exactly the API format (as the frontend's graphToPrompt does);
  and ``scripts/setup/make_workflows.py`` still renders exactly the committed files.
* The embedded-model workflows run through ``POST /prompt`` (warm the cache, then the same request again: a hit),
  with the per-run report in ``/history``, one log line per request and progress events on the websocket.
* ``/carnator/cache/stats`` and ``/purge`` answer, refuse paths outside the allowed roots, and purge.
* ``scripts/api_client.py`` and the README's client example drive a stream of prompts.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import urllib.error
from pathlib import Path
from typing import Any

import pytest
from harness_server import ComfyServer, host_python

pytestmark = pytest.mark.server

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / "workflows"
NAMES = sorted(p.stem for p in WORKFLOWS.glob("*.json"))
EMBEDDED_WEIGHTS = ROOT / "carnator_core" / "embedded" / "weights" / "carnator_embedded_v2.safetensors"
EMBEDDED_RULE = ROOT / "rules" / "embedded.json"
VIRTUAL = {"MarkdownNote", "Note"}
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
# Combos that list model files: the test server's models/ folders are empty, so only name and type are checked.
MODEL_FILE_INPUTS = {("UNETLoader", "unet_name"), ("CLIPLoader", "clip_name"), ("VAELoader", "vae_name"),
                     ("CheckpointLoaderSimple", "ckpt_name")}


def _load_script(relpath: str) -> Any:
    """Load ``scripts/<relpath>.py`` as a module (scripts are not a package)."""
    name = relpath.replace("/", "_")
    spec = importlib.util.spec_from_file_location(f"carnator_script_{name}", ROOT / "scripts" / f"{relpath}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class body runs
    spec.loader.exec_module(module)
    return module


make_workflows = _load_script("setup/make_workflows")


@pytest.fixture(scope="module")
def server(comfy_server: ComfyServer) -> ComfyServer:
    """The session's shared default server (tests/conftest.py). Only this module uses the workflows' cache
    directory (carnator_cache) and "never_written"; the log lines counted below are read from where this module's
    runs start."""
    return comfy_server


@pytest.fixture(scope="module")
def object_info(server: ComfyServer) -> dict[str, Any]:
    return server.get("/object_info", timeout=60)


def load(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    ui = json.loads((WORKFLOWS / f"{name}.json").read_text(encoding="utf-8"))
    api = json.loads((WORKFLOWS / "api" / f"{name}.json").read_text(encoding="utf-8"))
    return ui, api


# --- an independent reading of the node definitions (what the server validates, what the frontend lays out) ----
def inputs_of(node_def: dict[str, Any]) -> list[tuple[str, list[Any], bool]]:
    inputs, order = node_def["input"], node_def.get("input_order", {})
    out = []
    for section, optional in (("required", False), ("optional", True)):
        specs = inputs.get(section) or {}
        for name in order.get(section, list(specs)):
            out.append((name, list(specs[name]), optional))
    return out


def kind(spec: list[Any]) -> str:
    return "COMBO" if isinstance(spec[0], list) else spec[0]


def opts(spec: list[Any]) -> dict[str, Any]:
    return spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}


def widget(spec: list[Any]) -> bool:
    return kind(spec) in WIDGET_TYPES and not opts(spec).get("forceInput")


def compatible(out_type: str, in_type: str) -> bool:
    return "*" in (out_type, in_type) or bool(set(out_type.split(",")) & set(in_type.split(",")))


def value_problem(node_type: str, name: str, spec: list[Any], value: Any) -> str | None:
    """Why ``value`` is not acceptable for this widget input, or None."""
    k, o = kind(spec), opts(spec)
    where = f"{node_type}.{name}={value!r}"
    if k == "INT":
        if not isinstance(value, int) or isinstance(value, bool):
            return f"{where}: not an integer"
    elif k == "FLOAT":
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return f"{where}: not a number"
    elif k == "BOOLEAN":
        if not isinstance(value, bool):
            return f"{where}: not a boolean"
    elif k == "STRING":
        if not isinstance(value, str):
            return f"{where}: not a string"
    elif k == "COMBO":
        if (node_type, name) in MODEL_FILE_INPUTS:
            return None if isinstance(value, str) and value.endswith(".safetensors") else f"{where}: not a model file"
        options = spec[0] if isinstance(spec[0], list) else o.get("options", [])
        if value not in options:
            return f"{where}: not one of {options[:12]}"
    if k in ("INT", "FLOAT"):
        if "min" in o and value < o["min"] or "max" in o and value > o["max"]:
            return f"{where}: outside [{o.get('min')}, {o.get('max')}]"
    return None


def validate_api(prompt: dict[str, Any], info: dict[str, Any]) -> list[str]:
    problems = []
    for node_id, node in prompt.items():
        t = node.get("class_type")
        if t not in info:
            problems.append(f"node {node_id}: unknown node type {t!r}")
            continue
        known = {name: (spec, optional) for name, spec, optional in inputs_of(info[t])}
        for name in node["inputs"]:
            if name not in known:
                problems.append(f"node {node_id} {t}: unknown input {name!r}")
        for name, (spec, optional) in known.items():
            if name not in node["inputs"]:
                if not optional:
                    problems.append(f"node {node_id} {t}: required input {name!r} missing")
                continue
            value = node["inputs"][name]
            if isinstance(value, list):  # a link [source id, output index]
                src = prompt.get(str(value[0]))
                if src is None or src["class_type"] not in info:
                    problems.append(f"node {node_id} {t}.{name}: links to missing node {value[0]!r}")
                    continue
                outs = info[src["class_type"]]["output"]
                if not 0 <= value[1] < len(outs):
                    problems.append(f"node {node_id} {t}.{name}: {src['class_type']} has no output {value[1]}")
                elif not compatible(outs[value[1]], kind(spec)):
                    problems.append(f"node {node_id} {t}.{name}: gets {outs[value[1]]}, takes {kind(spec)}")
            elif not widget(spec):
                problems.append(f"node {node_id} {t}: socket input {name!r} has a value instead of a link")
            elif (p := value_problem(t, name, spec, value)) is not None:
                problems.append(f"node {node_id}: {p}")
    return problems


def validate_ui(wf: dict[str, Any], info: dict[str, Any]) -> list[str]:
    problems = []
    if wf.get("version") != 0.4:
        problems.append(f"version {wf.get('version')!r}, the frontend saves 0.4")
    nodes = {n["id"]: n for n in wf["nodes"]}
    if len(nodes) != len(wf["nodes"]):
        problems.append("duplicate node ids")
    if wf["last_node_id"] < max(nodes):
        problems.append("last_node_id below the largest node id")
    for n in wf["nodes"]:
        t = n["type"]
        for key in ("id", "type", "pos", "size", "inputs", "outputs", "widgets_values", "mode", "order", "flags"):
            if key not in n:
                problems.append(f"node {n.get('id')} {t}: no {key!r}")
        if t in VIRTUAL:
            continue
        if t not in info:
            problems.append(f"node {n['id']}: unknown node type {t!r}")
            continue
        specs = inputs_of(info[t])
        by_name = {name: (spec, optional) for name, spec, optional in specs}
        widgets = [(name, spec) for name, spec, _ in specs if widget(spec)]
        expected = len(widgets) + sum(1 for _, s in widgets if opts(s).get("control_after_generate"))
        values = list(n["widgets_values"])
        if len(values) != expected:
            problems.append(f"node {n['id']} {t}: {len(values)} widget values, the node has {expected} widgets")
        else:
            for name, spec in widgets:
                p = value_problem(t, name, spec, values.pop(0))
                if p:
                    problems.append(f"node {n['id']}: {p}")
                if opts(spec).get("control_after_generate"):
                    control = values.pop(0)
                    if control not in ("fixed", "increment", "decrement", "randomize"):
                        problems.append(f"node {n['id']} {t}.{name}: control_after_generate {control!r}")
        linked = set()
        for slot in n["inputs"]:
            if slot["name"] not in by_name:
                problems.append(f"node {n['id']} {t}: unknown input {slot['name']!r}")
                continue
            if slot["type"] != kind(by_name[slot["name"]][0]):
                problems.append(f"node {n['id']} {t}.{slot['name']}: type {slot['type']}, node says "
                                f"{kind(by_name[slot['name']][0])}")
            if slot.get("link") is not None:
                linked.add(slot["name"])
        for name, spec, optional in specs:
            if not optional and not widget(spec) and name not in linked:
                problems.append(f"node {n['id']} {t}: required input {name!r} not connected")
        if [o["type"] for o in n["outputs"]] != list(info[t]["output"]):
            problems.append(f"node {n['id']} {t}: outputs {[o['type'] for o in n['outputs']]} != {info[t]['output']}")
    for link in wf["links"]:
        lid, src, src_slot, dst, dst_slot, typ = link
        if src not in nodes or dst not in nodes:
            problems.append(f"link {lid}: missing end")
            continue
        out = nodes[src]["outputs"][src_slot]
        inp = nodes[dst]["inputs"][dst_slot]
        if lid not in (out.get("links") or []) or inp.get("link") != lid:
            problems.append(f"link {lid}: not recorded on both ends")
        if typ != out["type"] or not compatible(out["type"], inp["type"]):
            problems.append(f"link {lid}: {out['type']} -> {inp['type']} (link says {typ})")
    if wf["links"] and wf["last_link_id"] < max(link[0] for link in wf["links"]):
        problems.append("last_link_id below the largest link id")
    return problems


def ui_to_api(wf: dict[str, Any], info: dict[str, Any]) -> dict[str, Any]:
    """The frontend's graphToPrompt, for these workflows: widget values in layout order (control_after_generate
    values dropped), linked inputs as [source id, output index], frontend-only nodes left out."""
    links = {link[0]: link for link in wf["links"]}
    prompt = {}
    for n in wf["nodes"]:
        if n["type"] in VIRTUAL:
            continue
        node_def = info[n["type"]]
        slots = {s["name"]: s for s in n["inputs"]}
        values = list(n["widgets_values"])
        inputs: dict[str, Any] = {}
        for name, spec, _ in inputs_of(node_def):
            if widget(spec):
                value = values.pop(0)
                if opts(spec).get("control_after_generate"):
                    values.pop(0)
            link_id = slots.get(name, {}).get("link")
            if link_id is not None:
                link = links[link_id]
                inputs[name] = [str(link[1]), link[2]]
            elif widget(spec):
                inputs[name] = value
        prompt[str(n["id"])] = {"inputs": inputs, "class_type": n["type"],
                                "_meta": {"title": n.get("title") or node_def.get("display_name") or n["type"]}}
    return prompt


# --- tests ---------------------------------------------------------------------------------------------------
def test_every_workflow_is_there() -> None:
    expected = {"wan21_t2v_1.3b", "wan22_ti2v_5b", "wan22_t2v_14b", "ltxv", "embedded", "embedded_warm_cache",
                "embedded_easycache"}
    assert expected <= set(NAMES), f"missing UI workflows: {expected - set(NAMES)}"
    assert {p.stem for p in (WORKFLOWS / "api").glob("*.json")} == set(NAMES), "UI and API workflows differ"


def test_generator_renders_the_committed_files(object_info: dict[str, Any]) -> None:
    rendered = make_workflows.render_all(object_info)
    stale = [name for name, (ui, api) in rendered.items()
             if (ui, api) != load(name)]
    assert not stale, f"workflows {stale} are stale for these node definitions: run scripts/setup/make_workflows.py"


@pytest.mark.parametrize("name", NAMES)
def test_api_workflow_is_valid(name: str, object_info: dict[str, Any]) -> None:
    _, api = load(name)
    assert validate_api(api, object_info) == []


@pytest.mark.parametrize("name", NAMES)
def test_ui_workflow_is_valid_and_matches_api(name: str, object_info: dict[str, Any]) -> None:
    ui, api = load(name)
    assert validate_ui(ui, object_info) == []
    assert ui_to_api(ui, object_info) == api


@pytest.mark.parametrize("name", ["wan21_t2v_1.3b", "wan22_ti2v_5b", "wan22_t2v_14b", "ltxv", "embedded",
                                  "embedded_easycache"])
def test_full_reuse_path(name: str) -> None:
    _, api = load(name)
    types = {n["class_type"] for n in api.values()}
    path = {"CarnatorCacheLoader", "CarnatorEarlyProbe", "CarnatorSignatureBuilder", "CarnatorCacheRetriever",
            "CarnatorRiskFilter", "CarnatorJointReuseSampler", "CarnatorCacheWriter", "SaveAnimatedWEBP"}
    assert path <= types, f"{name}: missing {path - types}"
    sampler = next(n for n in api.values() if n["class_type"] == "CarnatorJointReuseSampler")
    assert sampler["inputs"]["mode"] == "joint" and isinstance(sampler["inputs"]["decision"], list)


@pytest.mark.parametrize("name", NAMES)
def test_note_says_what_the_named_rule_does(name: str) -> None:
    """Each workflow's note agrees with the rule its Risk Filter names, read from rules/ here: a rule that ships is
    said to ship, with the kinds of change it serves and the ones it refuses as its per-kind certificate has them;
    a rule that does not ship is never said to ship or to be certified, and the note says the graph learns one."""
    ui, api = load(name)
    notes = [n["widgets_values"][0] for n in ui["nodes"] if n["type"] in ("MarkdownNote", "Note")]
    assert len(notes) == 1, notes
    note = " ".join(notes[0].split())
    filters = [n["inputs"] for n in api.values() if n["class_type"] == "CarnatorRiskFilter"]
    if not filters:  # the warm-up graph decides nothing
        assert "rule" not in note.lower(), note
        return
    rule_file = filters[0]["rule_file"]
    path = ROOT / "rules" / rule_file
    assert "usually a HIT" not in note, note
    if not path.is_file():
        assert f"`{rule_file}`" in note and "learning mode" in note, note
        assert f"`{rule_file}` ships" not in note and "ships with Carnator, certified" not in note, note
        assert not re.search(r"certified (for|on)", note), note
        return
    rule = json.loads(path.read_text(encoding="utf-8"))
    assert f"risk rule `{rule_file}` ships with Carnator" in note, note
    assert f"U = {rule['certificate']['upper_bound']:.4f}" in note, note
    strata = rule.get("strata")
    if strata is None:
        return
    serves, _, refuses = note.partition(" by reuse, and refuses ")
    serves = serves.rpartition("it serves ")[2]
    refuses = refuses.partition(" (not certified")[0]
    for kind in strata["order"]:
        words = make_workflows.KIND_WORDS[kind]
        if kind in strata["certified"]:
            assert words in serves and words not in refuses, (kind, serves, refuses)
        else:
            assert words in refuses and words not in serves, (kind, serves, refuses)


def test_stock_loaders_and_file_names() -> None:
    def find(api: dict[str, Any], t: str) -> list[dict[str, Any]]:
        return [n["inputs"] for n in api.values() if n["class_type"] == t]

    _, wan21 = load("wan21_t2v_1.3b")
    assert find(wan21, "UNETLoader")[0]["unet_name"] == "wan2.1_t2v_1.3B_fp16.safetensors"
    umt5 = {"clip_name": "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "type": "wan"}
    assert find(wan21, "CLIPLoader")[0].items() >= umt5.items()
    assert find(load("wan22_ti2v_5b")[1], "CLIPLoader")[0].items() >= umt5.items()
    assert find(wan21, "VAELoader")[0]["vae_name"] == "wan_2.1_vae.safetensors"
    assert find(wan21, "ModelSamplingSD3")[0]["shift"] == 8.0
    assert find(wan21, "EmptyHunyuanLatentVideo")[0].items() >= {"width": 832, "height": 480, "length": 81}.items()
    _, wan22 = load("wan22_ti2v_5b")
    assert find(wan22, "UNETLoader")[0]["unet_name"] == "wan2.2_ti2v_5B_fp16.safetensors"
    assert find(wan22, "VAELoader")[0]["vae_name"] == "wan2.2_vae.safetensors"
    assert find(wan22, "Wan22ImageToVideoLatent")[0].items() >= {"width": 1280, "height": 704, "length": 121}.items()
    _, ltx = load("ltxv")
    assert find(ltx, "CheckpointLoaderSimple")[0]["ckpt_name"] == "ltx-video-2b-v0.9.5.safetensors"
    assert find(ltx, "CLIPLoader")[0].items() >= {"clip_name": "t5xxl_fp16.safetensors", "type": "ltxv"}.items()
    assert {"LTXVConditioning", "EmptyLTXVLatentVideo", "ModelSamplingLTXV"} <= {n["class_type"] for n in ltx.values()}


def test_embedded_easycache_workflow_runs_carnator_on_the_patched_model() -> None:
    """EasyCache (the node's defaults, the settings its rule was certified for) patches the loader's MODEL, and that
    patched MODEL is what both the Early Probe and the sampler run. The Risk Filter names the rule made for it, which
    was withdrawn (never re-tested on fresh data): no such file in rules/, so the workflow starts learning mode; the
    withdrawn record still says which settings it was made for, and the workflow keeps them."""
    _, api = load("embedded_easycache")
    (easy_id,) = [i for i, n in api.items() if n["class_type"] == "EasyCache"]
    (loader_id,) = [i for i, n in api.items() if n["class_type"] == "CarnatorEmbeddedLoader"]
    easy = api[easy_id]["inputs"]
    assert easy["model"] == [loader_id, 0]
    assert (easy["reuse_threshold"], easy["start_percent"], easy["end_percent"]) == (0.2, 0.15, 0.95)
    for t in ("CarnatorEarlyProbe", "CarnatorJointReuseSampler"):
        assert [n["inputs"]["model"] for n in api.values() if n["class_type"] == t] == [[easy_id, 0]], t
    (rule,) = [n["inputs"]["rule_file"] for n in api.values() if n["class_type"] == "CarnatorRiskFilter"]
    assert rule == "embedded_easycache.json"
    (probe,) = [n["inputs"] for n in api.values() if n["class_type"] == "CarnatorEarlyProbe"]
    assert not (ROOT / "rules" / rule).exists()
    certified = json.loads((ROOT / "rules" / "withdrawn" / rule).read_text(encoding="utf-8"))["config"]["meta"]
    assert probe["probe_steps"] == certified["probe_steps"] and probe["steps"] == certified["steps"]


def test_wan22_14b_two_experts_split_at_the_switch() -> None:
    """The high-noise expert probes and samples [0, 10) with leftover noise, the low-noise expert finishes
    [10, 20) from that latent without new noise (the stock two-KSamplerAdvanced split), and the probe knows the
    low-noise expert (namespace); the writer stores the finished latent with the second stage's report."""
    _, api = load("wan22_t2v_14b")

    def one(t: str) -> tuple[str, dict[str, Any]]:
        (found,) = [(i, n["inputs"]) for i, n in api.items() if n["class_type"] == t]
        return found

    def source(link: list[Any]) -> dict[str, Any]:
        return api[link[0]]

    loaders = {n["inputs"]["unet_name"]: i for i, n in api.items() if n["class_type"] == "UNETLoader"}
    assert set(loaders) == {"wan2.2_t2v_high_noise_14B_fp16.safetensors", "wan2.2_t2v_low_noise_14B_fp16.safetensors"}
    shifted = {n["inputs"]["model"][0]: i for i, n in api.items() if n["class_type"] == "ModelSamplingSD3"}
    assert all(api[i]["inputs"]["shift"] == 8.0 for i in shifted.values()) and set(shifted) == set(loaders.values())
    high = shifted[loaders["wan2.2_t2v_high_noise_14B_fp16.safetensors"]]
    low = shifted[loaders["wan2.2_t2v_low_noise_14B_fp16.safetensors"]]
    assert one("CLIPLoader")[1]["clip_name"] == "umt5_xxl_fp8_e4m3fn_scaled.safetensors"
    assert one("VAELoader")[1]["vae_name"] == "wan_2.1_vae.safetensors"
    _, probe = one("CarnatorEarlyProbe")
    assert probe["model"][0] == high and probe["second_model"][0] == low
    assert (probe["steps"], probe["cfg"], probe["sampler_name"], probe["scheduler"]) == (20, 3.5, "euler", "simple")
    assert (probe["add_noise"], probe["start_at_step"], probe["end_at_step"], probe["return_with_leftover_noise"],
            probe["probe_steps"]) == ("enable", 0, 10, "enable", 4)
    samplers = {n["inputs"]["model"][0]: (i, n["inputs"]) for i, n in api.items()
                if n["class_type"] == "CarnatorJointReuseSampler"}
    first_id, first = samplers[high]
    second_id, second = samplers[low]
    assert (first["add_noise"], first["start_at_step"], first["end_at_step"],
            first["return_with_leftover_noise"]) == ("enable", 0, 10, "enable")
    assert (second["add_noise"], second["start_at_step"], second["end_at_step"]) == ("disable", 10, 10000)
    assert second["latent_image"] == [first_id, 0] and source(first["latent_image"])["class_type"] == \
        "EmptyHunyuanLatentVideo"
    _, writer = one("CarnatorCacheWriter")
    assert writer["latent"] == [second_id, 0] and writer["report"] == [second_id, 1]
    assert one("VAEDecode")[1]["samples"] == [second_id, 0]


# --- the cache routes ------------------------------------------------------------------------------------------
def _get_error(server: ComfyServer, path: str) -> tuple[int, dict[str, Any]]:
    try:
        server.get(path)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    raise AssertionError(f"GET {path} succeeded")


def test_cache_routes_confine_paths(server: ComfyServer) -> None:
    empty = server.get("/api/carnator/cache/stats?directory=never_written")
    assert empty["exists"] is False and empty["entries"] == 0
    assert not (server.base_dir / "output" / "never_written").exists(), "stats must not create a cache"
    for bad in ("../../etc", "/etc", "", "."):
        code, body = _get_error(server, f"/carnator/cache/stats?directory={bad}")
        assert code == 400 and "allowed roots" in body["error"].lower(), (bad, body)
    with pytest.raises(RuntimeError, match="400"):
        server.post("/carnator/cache/purge", {"directory": "../outside"})


# --- running the embedded workflows ------------------------------------------------------------------------------
def _need_embedded() -> None:
    missing = [str(p.relative_to(ROOT)) for p in (EMBEDDED_WEIGHTS, EMBEDDED_RULE) if not p.exists()]
    if missing:
        pytest.skip(f"embedded model not shipped yet: {', '.join(missing)} missing")


def _outputs(history: dict[str, Any], class_type: str, api: dict[str, Any]) -> list[dict[str, Any]]:
    return [history["outputs"][i] for i, n in api.items() if n["class_type"] == class_type and i in history["outputs"]]


def _report(history: dict[str, Any], api: dict[str, Any]) -> dict[str, Any]:
    """The Joint Reuse Sampler's per-run report in a prompt's /history entry (exactly one sampler, one report)."""
    (sampler,) = _outputs(history, "CarnatorJointReuseSampler", api)
    (report,) = sampler["carnator_report"]
    return report


@pytest.fixture(scope="module")
def embedded_runs(server: ComfyServer) -> dict[str, Any]:
    """Warm the cache with the workflow's request (seed 42) and with seed 43, then run the seed-42 request through
    the full reuse path. (Seed 43 is for the API client: an identical prompt would be answered from ComfyUI's own
    execution cache without running anything.)"""
    _need_embedded()
    log_offset = server.log_path.stat().st_size if server.log_path.exists() else 0  # earlier modules' lines before
    _, warm = load("embedded_warm_cache")
    _, reuse = load("embedded")
    warm_history, warm_messages = server.run_prompt_ws(warm, timeout=600)
    warm_43 = json.loads(json.dumps(warm))
    for node in warm_43.values():
        if node["class_type"] == "CarnatorEarlyProbe":
            node["inputs"]["seed"] = 43
    server.run_prompt_ws(warm_43, timeout=600)
    reuse_history, reuse_messages = server.run_prompt_ws(reuse, timeout=600)
    return {"warm": (warm, warm_history, warm_messages), "reuse": (reuse, reuse_history, reuse_messages),
            "log_offset": log_offset}


@pytest.mark.slow
def test_embedded_warm_cache_runs_dense_and_saves(embedded_runs: dict[str, Any]) -> None:
    api, history, messages = embedded_runs["warm"]
    (saved,) = _outputs(history, "SaveAnimatedWEBP", api)
    assert saved["images"] and saved["images"][0]["filename"].endswith(".webp")
    report = _report(history, api)
    assert report["decision"] == "dense" and report["steps_total"] == 20
    progress_nodes = {m["data"]["node"] for m in messages if m["type"] == "progress"}
    probe_id = next(i for i, n in api.items() if n["class_type"] == "CarnatorEarlyProbe")
    sampler_id = next(i for i, n in api.items() if n["class_type"] == "CarnatorJointReuseSampler")
    assert {probe_id, sampler_id} <= progress_nodes, "probe and sampler must report progress"


@pytest.mark.slow
def test_embedded_identical_request_is_a_hit(embedded_runs: dict[str, Any], server: ComfyServer) -> None:
    api, history, _ = embedded_runs["reuse"]
    (saved,) = _outputs(history, "SaveAnimatedWEBP", api)
    assert saved["images"]
    report = _report(history, api)
    assert report["decision"] == "hit", f"identical request not reused: {json.dumps(report)[:2000]}"
    # The workflow connects the cache to the Early Probe: an identical request is answered before the probe,
    # from the stored dense result, with no model call (the filter passes the exact answer through).
    assert report["mode"] == "exact" and report["model_calls"] == 0 and report["saving"] == 1.0, report
    verdict = next(v for v in report["verdicts"] if v["entry_id"] == report["entry_id"])
    assert verdict["accepted"] and "exact repeat" in verdict["reason"]
    assert report["timings_ms"]["total"] > 0
    log = server.log_path.read_bytes()[embedded_runs["log_offset"]:].decode(errors="replace")  # these runs' lines
    assert len(re.findall(r"carnator request: ", log)) >= 2, "one log line per request expected"

    stats = server.get("/carnator/cache/stats?directory=carnator_cache")
    assert stats["exists"] and stats["entries"] >= 2 and stats["hits"] >= 1 and stats["bytes"] > 0


@pytest.mark.slow
def test_api_client_streams_prompts(embedded_runs: dict[str, Any], server: ComfyServer, tmp_path: Path) -> None:
    client = _load_script("api_client")
    out = tmp_path / "results.json"
    texts = ["a big red ball moves to the right in the top left, on green grass",  # the warmed request: a hit
             "a small blue cube moves down in the bottom right, on sand"]
    argv = ["--server", server.url, "--seeds", "43", "--json", str(out)]
    for text in texts:
        argv += ["--prompt", text]
    assert client.main(argv) == 0
    results = json.loads(out.read_text())
    assert [(r["text"], r["seed"]) for r in results] == [(t, 43) for t in texts]
    for r in results:
        assert r["files"] and r["reports"] and r["reports"][0]["decision"] in ("hit", "miss", "dense")
        assert r["files"][0].startswith(server.url + "/view?")
    assert results[0]["reports"][0]["decision"] == "hit", "the warmed request (seed 43) must be reused"


@pytest.mark.slow
def test_readme_client_example_runs(embedded_runs: dict[str, Any], server: ComfyServer, tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Driving Carnator through the ComfyUI API queue", 1)
    assert len(section) == 2, "README section missing"
    code = re.search(r"```python\n(.*?)```", section[1], re.S)
    assert code, "no python example in the README section"
    script = tmp_path / "readme_client.py"
    script.write_text(code.group(1))
    proc = subprocess.run([host_python(), str(script)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COMFYUI_URL": server.url})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "decision" in proc.stdout, proc.stdout


@pytest.mark.slow
def test_embedded_easycache_workflow_reuses_only_its_own_entries(embedded_runs: dict[str, Any], server: ComfyServer,
                                                                 object_info: dict[str, Any]) -> None:
    """The Carnator + EasyCache workflow through ``POST /prompt``: the plain workflow's seed-42 request is already
    cached (``embedded_runs``), yet the same request behind EasyCache is another model to Carnator — never answered
    from the plain entry. Warmed behind EasyCache (the same graph without reuse), the shipped workflow answers it
    exactly from that entry; a reworded request is decided under the EasyCache rule (a rule for another MODEL
    would fail the prompt)."""

    _, api = load("embedded_easycache")
    tokenizer = make_workflows.probe_input_for(object_info, "CARNATOR_TEXT_ENCODER")
    warm = make_workflows.render_api(make_workflows.embedded(False, tokenizer, easycache=True), object_info)
    plain_entries = server.get("/carnator/cache/stats?directory=carnator_cache")["entries"]

    warm_history, _ = server.run_prompt_ws(warm, timeout=600)
    assert _report(warm_history, warm)["decision"] == "dense"
    stats = server.get("/carnator/cache/stats?directory=carnator_cache")
    assert stats["entries"] == plain_entries + 1, "the EasyCache run must be stored as a new entry"

    history, _ = server.run_prompt_ws(api, timeout=600)
    report = _report(history, api)
    assert report["decision"] == "hit" and report["mode"] == "exact" and report["model_calls"] == 0, report
    plain_hit = _report(embedded_runs["reuse"][1], embedded_runs["reuse"][0])  # the plain model's same request
    assert plain_hit["mode"] == "exact" and report["entry_id"] != plain_hit["entry_id"]

    reworded = json.loads(json.dumps(api))
    for node in reworded.values():
        if node["class_type"] == "PrimitiveStringMultiline":
            node["inputs"]["value"] = "a big red ball moves right in the top left, on green grass"
    history, _ = server.run_prompt_ws(reworded, timeout=600)
    report = _report(history, reworded)
    # E5's EasyCache rule was withdrawn (rules/README.md, "Withdrawn rules"): the workflow's rule file name now starts
    # learning mode, which serves dense while it labels
    # (a miss: candidates were recalled and compared, none may be reused before a kind of change is certified)
    assert not (ROOT / "rules" / "embedded_easycache.json").exists()
    assert report["decision"] == "miss" and report["mode"] == "dense", report
    assert report["rule_state"]["state"] == "learning", report["rule_state"]


@pytest.mark.slow
def test_cache_purge_route(embedded_runs: dict[str, Any], server: ComfyServer) -> None:
    before = server.get("/carnator/cache/stats?directory=carnator_cache")
    assert before["entries"] >= 1
    answer = server.post("/carnator/cache/purge", {"directory": "carnator_cache"})
    assert answer["purged"] == before["entries"]
    after = server.get("/carnator/cache/stats?directory=carnator_cache")
    assert after["entries"] == 0 and after["bytes"] == 0
