"""The exact-request key and the conditioning digest (carnator_core/keys.py): every input that decides a dense
output changes the key; the prompt's own tensors stay out of the conditioning digest, everything else is in it;
what cannot be digested never yields a key that another request could share."""
from __future__ import annotations

import functools

import torch

from carnator.carnator_core import keys
from carnator.carnator_core.types import GenConfig


def _cond(seed: int = 0, **extra):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(1, 6, 8, generator=g), {"pooled_output": None, **extra}]]


def _key(**over):
    base = dict(model_fingerprint="fp", model_options={}, arch="wan21", latent_shape=(1, 16, 3, 8, 8), steps=8,
                sampler="euler", scheduler="simple", cfg=5.0, sigmas_digest="s", denoise=1.0, seed=1,
                positive=_cond(0), negative=_cond(1), latent={"samples": torch.zeros(1, 16, 3, 8, 8)})
    base.update(over)
    return keys.request_key(**base)


def _rescale(multiplier: float):
    def rescale_cfg(args):  # a closure, like ComfyUI's RescaleCFG
        return args["denoised"] * multiplier
    return rescale_cfg


def test_request_key_is_deterministic_and_covers_every_input():
    k = _key()
    assert k == _key() and len(k) == 32
    image = torch.ones(1, 16, 1, 8, 8)
    variants = {
        "model": _key(model_fingerprint="other"),
        "options": _key(model_options={"sampler_post_cfg_function": [_rescale(0.7)]}),
        "steps": _key(steps=9), "sampler": _key(sampler="dpmpp_2m"), "scheduler": _key(scheduler="karras"),
        "cfg": _key(cfg=5.5), "sigmas": _key(sigmas_digest="t"), "denoise": _key(denoise=0.9), "seed": _key(seed=2),
        "positive text": _key(positive=_cond(5)), "negative text": _key(negative=_cond(6)),
        "pooled": _key(positive=[[_cond(0)[0][0], {"pooled_output": torch.ones(1, 4)}]]),
        "concat": _key(positive=_cond(0, concat_latent_image=image)),
        "reference": _key(positive=_cond(0, reference_latents=[image])),
        "negative extra": _key(negative=_cond(1, concat_latent_image=image)),
        "latent": _key(latent={"samples": torch.zeros(1, 16, 3, 8, 8) + 0.5}),
        "noise mask": _key(latent={"samples": torch.zeros(1, 16, 3, 8, 8), "noise_mask": torch.ones(1, 1, 3, 8, 8)}),
        "batch index": _key(latent={"samples": torch.zeros(1, 16, 3, 8, 8), "batch_index": [3]}),
    }
    for what, other in variants.items():
        assert other is not None and other != k, what
    assert len(set(variants.values())) == len(variants)
    # A patch's parameters live in its closure: another multiplier is another request; the same one is the same.
    assert _key(model_options={"sampler_post_cfg_function": [_rescale(0.7)]}) == variants["options"]
    assert _key(model_options={"sampler_post_cfg_function": [_rescale(0.5)]}) != variants["options"]
    assert _key(model_options={"f": functools.partial(max, 1)}) != _key(model_options={"f": functools.partial(max, 2)})


class _Sealed:
    __slots__ = ()

    def __call__(self, x):
        return x


def test_undigestable_values_never_give_a_shared_key():
    assert _key(model_options={"wrapper": _Sealed()}) is None
    assert _key(positive=_cond(0, control=object())) is None
    a = keys.conditioning_digest(_cond(0, control=object()), _cond(1))
    b = keys.conditioning_digest(_cond(0, control=object()), _cond(1))
    assert a.startswith(keys.OPAQUE_PREFIX) and b.startswith(keys.OPAQUE_PREFIX) and a != b


def test_conditioning_digest_is_about_what_is_not_the_prompt():
    empty = {"samples": torch.zeros(1, 48, 3, 8, 8)}
    # Text-to-video: the prompt's tensors (embedding, pooled output, attention mask) do not count.
    assert keys.conditioning_digest(_cond(0), _cond(1), empty) == ""
    assert keys.conditioning_digest(_cond(3, attention_mask=torch.ones(1, 6)), _cond(4), empty) == ""
    # A start image in the latent (Wan 2.2 TI2V) or in the conditioning (I2V), reference latents: all count.
    mask = torch.ones(1, 1, 3, 8, 8)
    mask[:, :, :1] = 0

    def ti2v(v: float) -> dict:
        s = torch.zeros(1, 48, 3, 8, 8)
        s[:, :, :1] = v
        return {"samples": s, "noise_mask": mask}

    d1 = keys.conditioning_digest(_cond(0), _cond(1), ti2v(0.3))
    d2 = keys.conditioning_digest(_cond(0), _cond(1), ti2v(0.4))
    assert d1 and d2 and d1 != d2
    assert keys.conditioning_digest(_cond(7), _cond(8), ti2v(0.3)) == d1  # another prompt, same start image
    i2v = keys.conditioning_digest(_cond(0, concat_latent_image=torch.ones(1, 16, 3, 8, 8)), _cond(1), empty)
    ref = keys.conditioning_digest(_cond(0, reference_latents=[torch.ones(1, 16, 1, 8, 8)]), _cond(1), empty)
    assert i2v and ref and len({i2v, ref, d1}) == 3


def test_conditioning_is_in_the_namespace_but_not_in_the_rule_fingerprint():
    from carnator.carnator_core.types import namespace_key

    cfg = GenConfig(arch="wan22", latent_shape=(48, 3, 8, 8), steps=8, sampler="euler", scheduler="simple", cfg=5.0,
                    sigmas_digest="s", probe_steps=2)
    with_image = GenConfig(**{**cfg.__dict__, "conditioning": "abcd"})
    assert cfg.fingerprint() == cfg.rule_fingerprint()  # text-only configs fingerprint as before
    assert with_image.fingerprint() != cfg.fingerprint() and with_image.rule_fingerprint() == cfg.rule_fingerprint()
    assert namespace_key("fp", with_image) != namespace_key("fp", cfg)
    assert GenConfig.from_meta(with_image.to_meta()) == with_image and "conditioning" not in cfg.to_meta()


def test_module_names_from_comfyuis_path_loading_are_install_independent():
    """ComfyUI loads comfy_extras and custom-node packs by file path and names the module after the path ('.' as
    '_x_'); keys and fingerprints digest the name a plain import would give, so they do not depend on where ComfyUI
    is installed (farm workers, a rule certified in another process)."""
    from carnator.carnator_core.keys import stable_module_name

    assert stable_module_name("comfy_extras.nodes_easycache") == "comfy_extras.nodes_easycache"
    for root in ("/opt/ComfyUI", "/srv/u/_x_venv/lib/python3_x_11/site-packages/x/ComfyUI", "C:\\ComfyUI"):
        sep = "\\" if root.startswith("C:") else "/"
        assert stable_module_name(f"{root}{sep}comfy_extras{sep}nodes_easycache_x_py") == \
            "comfy_extras.nodes_easycache"
        assert stable_module_name(f"{root}{sep}custom_nodes{sep}ComfyUI-Pack.nodes.patch") == \
            "custom_nodes.ComfyUI-Pack.nodes.patch"
    assert stable_module_name("/a/custom_nodes/pack_one.nodes") != stable_module_name("/a/custom_nodes/pack_two.nodes")
    assert stable_module_name(None) == stable_module_name("") == ""


def test_a_patch_from_a_path_loaded_module_keys_the_same_at_any_install_path(tmp_path):
    """The same model options built by the same code, loaded from two install paths the way ComfyUI loads it, give
    one key; other code under the same name does not."""
    import importlib.util

    from carnator.carnator_core.keys import model_options_digest

    source = "def patch(args):\n    return args['denoised'] * 0.7\n"
    digests = []
    for root, text in (("one", source), ("two", source), ("three", source.replace("0.7", "0.3"))):
        path = tmp_path / root / "ComfyUI" / "comfy_extras" / "nodes_scale.py"
        path.parent.mkdir(parents=True)
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(str(path).replace(".", "_x_"), path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert "/" in module.patch.__module__  # named after its path, as ComfyUI names it
        digests.append(model_options_digest({"sampler_post_cfg_function": [module.patch]}))
    assert digests[0] == digests[1] != digests[2]
