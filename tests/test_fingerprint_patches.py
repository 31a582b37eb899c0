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
