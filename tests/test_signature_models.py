"""Signature Builder mechanics on real probes of tiny random-weight Wan 2.1 / Wan 2.2 TI2V / LTX-Video models
(ComfyUI in-process), and the Signature Builder node."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.comfy


@pytest.fixture(scope="module")
def env(comfy_env, tmp_path_factory):
    import tiny_models as tm

    d = tmp_path_factory.mktemp("tiny_sig")
    return tm, {name: tm.load_tiny_model(name, d) for name in tm.SPECS}


def _probe(tm, model, name, seed, prompt="a red ball", objects=None):
    from carnator.carnator_core.probe import ProbeConfig, run_probe
    from carnator.carnator_core.types import ObjectTokens

    pos, neg = tm.conditioning(name)
    objs = objects if objects is not None else (ObjectTokens("ball", ("red", "ball"), (1, 2)),)
    return run_probe(model, pos, neg, tm.empty_latent(name), seed=seed, steps=6, cfg=5.0, sampler_name="euler",
                     scheduler="simple", prompt=prompt, objects=objs, object_source="user" if objs else "none",
                     config=ProbeConfig(probe_steps=2))


@pytest.mark.parametrize("name", ["wan21", "wan22", "ltxv"])
def test_identical_request_identical_signature(env, name):
    from carnator.carnator_core.signature import build_signature, signature_to_bytes

    tm, models = env
    a = build_signature(_probe(tm, models[name], name, seed=5))
    b = build_signature(_probe(tm, models[name], name, seed=5))
    assert signature_to_bytes(a) == signature_to_bytes(b)
    c = build_signature(_probe(tm, models[name], name, seed=6))
    assert c.grid == a.grid and c.object_names() == ("ball",)
    (obj,) = a.objects
    assert obj.mask.shape == a.grid and 0.0 <= obj.size <= 1.0
    assert np.all(np.isfinite(obj.lab)) and 0.0 <= obj.lab[0] <= 100.0
    assert np.all(np.isfinite(a.context_lab))


def test_context_only_from_a_probe_without_objects(env):
    from carnator.carnator_core.signature import CONTEXT_ONLY_NOTE, build_signature

    tm, models = env
    sig = build_signature(_probe(tm, models["wan21"], "wan21", seed=1, prompt="green grass", objects=()))
    assert sig.objects == () and CONTEXT_ONLY_NOTE in sig.note and "none" in sig.note


def test_signature_builder_node(env):
    import carnator.nodes.signature as node_mod
    from carnator.carnator_core.types import Signature

    (node,) = node_mod.NODES
    schema = node.define_schema()
    assert schema.node_id == "CarnatorSignatureBuilder" and schema.display_name == "Carnator Signature Builder"
    assert schema.category == "Carnator"
    inputs = {i.id: i for i in schema.inputs}
    assert all(i.tooltip for i in schema.inputs)
    assert all(inputs[k].as_dict().get("advanced") is True for k in inputs if k != "probe")
    info = node.GET_NODE_INFO_V1()
    assert info["output"] == ["CARNATOR_SIGNATURE", "STRING"]

    tm, models = env
    probe = _probe(tm, models["ltxv"], "ltxv", seed=3)
    out = node.execute(probe=probe)
    sig, summary = out.result
    assert isinstance(sig, Signature) and sig.object_names() == ("ball",)
    assert "ball: size" in summary and "bytes" in summary and "built in" in summary
    out2 = node.execute(probe=probe, context_rows=2, context_cols=3)
    assert out2.result[0].context_lab.shape == (2, 3, 3)
    with pytest.raises(ValueError, match="low <= high"):
        node.execute(probe=probe, mask_low=0.9, mask_high=0.1)
    with pytest.raises(TypeError, match="Carnator Early Probe"):
        node.execute(probe="not a probe")
