"""Per-architecture adapters: a small registry of what differs between Wan 2.1, Wan 2.2 TI2V, LTX-Video and the
embedded model, so that the patching code (``comfy_patch``) is written once.

What differs is only: how a model is recognised, how latent cells map to tokens (patch size), which block
arguments are indexed by video token (and along which dimension), and which layers are "middle" by default.
No forward function is copied: the patches always call ComfyUI's own blocks.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("carnator")


@dataclass(frozen=True)
class ArchAdapter:
    """What differs between the supported backbones.

    arch:        short name used in fingerprints and rules ("wan21", "wan22", "ltxv", "embedded").
    patch:       latent cells per token (t, h, w).
    token_dims:  block-replace argument -> the dimension indexed by video token. An argument is gathered for a
                 token subset only when its size along that dimension equals the token count (a per-batch
                 timestep embedding of size 1 is shared, a per-token one is gathered).
    blocks_attr: attribute of the diffusion model holding the transformer blocks.
    """

    arch: str
    patch: tuple[int, int, int]
    token_dims: dict[str, int] = field(default_factory=dict)
    blocks_attr: str = "blocks"

    def patch_of(self, model: Any) -> tuple[int, int, int]:
        """Latent cells per token for this model (Wan-family models carry their own patch size)."""
        p = getattr(model.model.diffusion_model, "patch_size", None)
        return tuple(int(x) for x in p) if p is not None and len(p) == 3 else self.patch

    def token_grid(self, latent_shape: tuple[int, ...], patch: tuple[int, int, int] | None = None
                   ) -> tuple[int, int, int]:
        """Token grid (T, H, W) for a latent of shape (C, T, H, W) (ceil division, as ComfyUI pads)."""
        _, t, h, w = latent_shape[-4:]
        pt, ph, pw = patch or self.patch
        return (-(-t // pt), -(-h // ph), -(-w // pw))

    def num_layers(self, model: Any) -> int:
        return len(getattr(model.model.diffusion_model, self.blocks_attr))

    def middle_layers(self, model: Any, first_dense: int = 1, last_dense: int = 1) -> tuple[int, ...]:
        """The blocks between the first ``first_dense`` and the last ``last_dense`` (the probe's capture layers
        and the layers the reuse sampler restricts; outer blocks always run dense)."""
        n = self.num_layers(model)
        return tuple(range(min(first_dense, n), max(n - last_dense, 0)))


WAN_DIMS = {"img": 1, "pe": 1, "vec": 1}
LTXV_DIMS = {"img": 1, "pe": 2, "vec": 1}

ADAPTERS = {
    "wan21": ArchAdapter("wan21", (1, 2, 2), WAN_DIMS),
    "wan22": ArchAdapter("wan22", (1, 2, 2), WAN_DIMS),
    "embedded": ArchAdapter("embedded", (1, 2, 2), WAN_DIMS),
    "ltxv": ArchAdapter("ltxv", (1, 1, 1), LTXV_DIMS, blocks_attr="transformer_blocks"),
}


class UnsupportedModelError(ValueError):
    pass


SUPPORTED = ("Wan 2.1 T2V (1.3B, 14B), Wan 2.2 TI2V 5B, LTX-Video 0.9.x (2B, 13B) and "
             "Carnator's embedded model")

# Model families that look like a supported one (a subclass of ComfyUI's WAN21 or LTXV, or the same backbone) but
# that Carnator cannot reuse across, recognised by class name so that ComfyUI releases newer than the host
# (which add e.g. WAN21_FlowRVS, WAN21_CausalAR, LTXAV) are refused with the right reason too.
# (pattern over the model's and its backbone's class and module names, what it is, why reuse does not apply)
_REFUSED_FAMILIES: tuple[tuple[re.Pattern[str], str, str], ...] = (
    (re.compile(r"FlowRVS|IMG_TO_IMG"), "an image-to-image flow Wan variant (e.g. WAN21_FlowRVS)",
     ("it transports an input image's latent instead of denoising noise, so the probe's noise schedule, the Early "
      "Signature and the cached text-to-video runs do not describe it")),
    (re.compile(r"Causal|Autoregressive|ar_model|(^|[._])AR($|[._])"),
     "a causal / autoregressive Wan (e.g. WAN21_CausalAR, frame-by-frame generation with a KV cache)",
     ("each frame block is generated from the previous ones, so there is no whole-clip probe to compare and no "
      "single attention structure to reuse")),
    (re.compile(r"LTXAV|av_model|LTX2|LTXV2"), "LTX-2 (the audio-video LTX model, LTXAV)",
     "its joint audio-video tokens and second (audio) stream are not covered by the signature or the reuse plan"),
)


def _names(obj: Any) -> list[str]:
    t = type(obj)
    return [t.__name__, t.__module__]


def _refuse(what: str, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"Carnator cannot reuse computation for {what}: {why}. Supported: {SUPPORTED}. Run this model with "
        f"ComfyUI's own samplers (KSampler / SamplerCustom), without the Carnator nodes."
    )


def detect_arch(model: Any) -> str:
    """Recognise a ComfyUI ModelPatcher's backbone: "wan21", "wan22", "ltxv" or "embedded".

    Only the exact model classes ComfyUI builds for the supported checkpoints are accepted (not subclasses:
    ComfyUI derives image-conditioned, audio, camera, causal and image-to-image variants from WAN21), with the
    plain backbone and prediction type those use. Anything else raises UnsupportedModelError naming what was
    found, why it cannot be reused across, and what is supported."""
    import comfy.model_base as mb

    base = getattr(model, "model", None)
    if hasattr(base, "carnator_embedded_meta"):  # set by carnator_core.embedded.comfy_glue.load_embedded
        return "embedded"
    dm = getattr(base, "diffusion_model", None)
    prediction = getattr(getattr(base, "model_type", None), "name", "?")
    names = _names(base) + _names(dm) + [prediction]
    for pattern, what, why in _REFUSED_FAMILIES:
        if any(pattern.search(n) for n in names):
            raise _refuse(f"{what}, found {type(base).__name__} / {type(dm).__name__}", why)
    if type(base) in (mb.WAN21, mb.WAN22):
        from comfy.ldm.wan.model import WanModel

        if type(dm) is not WanModel or getattr(dm, "model_type", "t2v") != "t2v":
            raise UnsupportedModelError(
                f"Carnator supports Wan text-to-video models; this Wan model is {type(dm).__name__} "
                f"(model_type={getattr(dm, 'model_type', '?')}). Load a Wan 2.1 T2V or Wan 2.2 TI2V "
                f"checkpoint. Supported: {SUPPORTED}."
            )
        if prediction != "FLOW":
            raise _refuse(f"a Wan model with prediction type {prediction}",
                          "the probe and the cache assume Wan's flow-matching (FLOW) denoising from noise")
        return "wan22" if type(base) is mb.WAN22 else "wan21"
    if type(base) is mb.LTXV:
        if prediction != "FLUX":
            raise _refuse(f"an LTX-Video model with prediction type {prediction}",
                          "the probe and the cache assume LTX-Video's flow (FLUX-type) denoising from noise")
        return "ltxv"
    if isinstance(base, mb.WAN21):
        raise _refuse(
            f"the Wan variant {type(base).__name__} (backbone {type(dm).__name__})",
            "its extra conditioning (reference video, image, audio, camera or pose inputs) is not part of the Early "
            "Signature or the cache namespace, so two runs that look alike may not be")
    if isinstance(base, mb.LTXV):
        raise _refuse(f"the LTX-Video variant {type(base).__name__}",
                      "only ComfyUI's plain LTXV text-to-video model is covered")
    raise UnsupportedModelError(
        f"Carnator works with {SUPPORTED}; got {type(base).__name__}. Load one of those with "
        f"UNETLoader/CheckpointLoader (or Carnator Embedded Loader)."
    )


def adapter_for(model: Any) -> ArchAdapter:
    return ADAPTERS[detect_arch(model)]
