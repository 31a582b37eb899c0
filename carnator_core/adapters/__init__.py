"""Per-architecture adapters: a small registry of what differs between Wan 2.1, Wan 2.2 TI2V, LTX-Video and the
embedded model, so that the patching code (``comfy_patch``) is written once.

What differs is only: how a model is recognised, how latent cells map to tokens (patch size), which block
arguments are indexed by video token (and along which dimension), and which layers are "middle" by default.
No forward function is copied: the patches always call ComfyUI's own blocks.
"""
from __future__ import annotations

import logging
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


def detect_arch(model: Any) -> str:
    """Recognise a ComfyUI ModelPatcher's backbone. Raises UnsupportedModelError naming what was found."""
    import comfy.model_base as mb

    base = getattr(model, "model", None)
    if hasattr(base, "carnator_embedded_meta"):  # set by carnator_core.embedded.comfy_glue.load_embedded
        return "embedded"
    if isinstance(base, mb.WAN22):
        return "wan22"
    if isinstance(base, mb.WAN21):
        dm = base.diffusion_model
        if getattr(dm, "model_type", "t2v") != "t2v" or type(dm).__name__ != "WanModel":
            raise UnsupportedModelError(
                f"Carnator supports Wan text-to-video models; this Wan model is {type(dm).__name__} "
                f"(model_type={getattr(dm, 'model_type', '?')}). Load a Wan 2.1 T2V or Wan 2.2 TI2V checkpoint."
            )
        return "wan21"
    if isinstance(base, mb.LTXV):
        return "ltxv"
    raise UnsupportedModelError(
        f"Carnator works with Wan 2.1 T2V, Wan 2.2 TI2V, LTX-Video and its embedded model; got "
        f"{type(base).__name__}. Load one of those with UNETLoader/CheckpointLoader (or Carnator Embedded Loader)."
    )


def adapter_for(model: Any) -> ArchAdapter:
    return ADAPTERS[detect_arch(model)]
