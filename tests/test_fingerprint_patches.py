"""The model fingerprint (and so the cache namespace) covers function patches, not only weights: a MODEL through
ComfyUI's RescaleCFG or CFGZeroStar (any model_options function / wrapper) must never share entries with the
plain model, while the same patch applied twice fingerprints the same (stable across clones)."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.comfy


@pytest.fixture(scope="module")
def tiny(comfy_env, tmp_path_factory):
    import tiny_models as tm

    return tm.load_tiny_model("wan21", tmp_path_factory.mktemp("tiny"))


def test_function_patches_change_the_fingerprint(tiny):
    from comfy_extras.nodes_cfg import CFGZeroStar
    from comfy_extras.nodes_model_advanced import RescaleCFG

    from carnator.carnator_core.comfy_patch import model_fingerprint

    def fp(m):
        return model_fingerprint(m, "wan21")

    plain = fp(tiny)
    rescaled = RescaleCFG().patch(tiny, 0.7)[0]
    rescaled_again = RescaleCFG().patch(tiny, 0.7)[0]
    rescaled_other = RescaleCFG().patch(tiny, 0.3)[0]
    zero_star = CFGZeroStar.execute(tiny)[0]
    wrapped = tiny.clone()
    wrapped.set_model_unet_function_wrapper(lambda apply_model, args: apply_model(args["input"], args["timestep"],
                                                                                  **args["c"]))
    from comfy_extras.nodes_easycache import EasyCacheNode

    easy = EasyCacheNode.execute(tiny, 0.2, 0.15, 0.95, False)[0]
    easy_other = EasyCacheNode.execute(tiny, 0.3, 0.15, 0.95, False)[0]
    got = {"plain": plain, "rescale 0.7": fp(rescaled), "rescale 0.3": fp(rescaled_other),
           "cfg zero star": fp(zero_star), "unet wrapper": fp(wrapped), "easycache 0.2": fp(easy),
           "easycache 0.3": fp(easy_other)}
    assert len(set(got.values())) == len(got), got  # every patch set is its own model
    assert fp(rescaled_again) == got["rescale 0.7"]  # stable: same patch, same value, new closure object
    assert fp(tiny.clone()) == plain and fp(tiny) == plain  # cloning and fingerprinting change nothing


def test_the_remembered_weight_digest_follows_every_weight_change(tiny):
    """The weights' digest is remembered per backbone module (a request fingerprints its model three times), but
    an in-place write, a replaced parameter or a retyped buffer is a new model, and undoing the change gives the
    old fingerprint back; the remembered value equals a fresh computation."""
    import torch

    from carnator.carnator_core import comfy_patch as cp

    m = tiny.clone()
    dm = m.model.diffusion_model
    first = cp.model_fingerprint(m, "wan21")
    assert dm in cp._WEIGHT_DIGESTS and cp.model_fingerprint(m, "wan21") == first
    cp._WEIGHT_DIGESTS.clear()
    assert cp.model_fingerprint(m, "wan21") == first  # remembered == recomputed
    name, p = next(iter(dm.named_parameters()))
    saved = p.detach().clone()
    with torch.no_grad():
        p.add_(1.0)  # in place: same storage, new version
        written = cp.model_fingerprint(m, "wan21")
        p.copy_(saved)
    assert written != first
    assert cp.model_fingerprint(m, "wan21") == first  # same bytes sampled again: the same model
    mod_name, _, attr = name.rpartition(".")
    owner = dm.get_submodule(mod_name) if mod_name else dm
    original = getattr(owner, attr)
    setattr(owner, attr, torch.nn.Parameter(original.detach() * 2))  # replaced
    try:
        assert cp.model_fingerprint(m, "wan21") not in (first, written)
    finally:
        setattr(owner, attr, original)
    assert cp.model_fingerprint(m, "wan21") == first
    assert cp.model_fingerprint(m, "ltxv") != first  # the arch is part of what is remembered


def test_a_patch_loaded_the_way_comfyui_loads_it_fingerprints_as_imported(tiny, tmp_path):
    """ComfyUI's server loads comfy_extras by file path and names the module after that path; the EasyCache patch
    from such a module — at any install path — must fingerprint exactly as the imported module's does, or a rule
    certified in-process (rules/embedded_easycache.json) never applies in a server and farm workers installed at
    different paths never share entries."""
    import importlib.util
    import shutil

    import comfy_extras.nodes_easycache as imported

    from carnator.carnator_core.comfy_patch import model_fingerprint

    want = model_fingerprint(imported.EasyCacheNode.execute(tiny, 0.2, 0.15, 0.95, False)[0], "wan21")
    for root in ("a", "b_x_c"):
        path = tmp_path / root / "ComfyUI" / "comfy_extras" / "nodes_easycache.py"
        path.parent.mkdir(parents=True)
        shutil.copy(imported.__file__, path)
        spec = importlib.util.spec_from_file_location(str(path).replace(".", "_x_"), path)  # as nodes.py names it
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert module.__name__ != imported.__name__
        easy = module.EasyCacheNode.execute(tiny, 0.2, 0.15, 0.95, False)[0]
        assert model_fingerprint(easy, "wan21") == want, root
        other = module.EasyCacheNode.execute(tiny, 0.3, 0.15, 0.95, False)[0]
        assert model_fingerprint(other, "wan21") != want
