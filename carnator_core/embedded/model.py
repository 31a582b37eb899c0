"""Build the embedded denoiser: ComfyUI's own ``comfy.ldm.wan.model.WanModel`` with ``config.model_config()``.

Only the trainer and the ComfyUI glue call this module (it imports ComfyUI lazily, from the host path in
``.host/comfy-path`` or ``$CARNATOR_COMFY_PATH`` when ComfyUI is not importable yet). The import rule that
core modules run without ComfyUI holds for everything else in this package.

Contract: ``build_wan(init=True)`` returns a float32 WanModel whose parameters are initialised the way
torch initialises its layers (ComfyUI's ``disable_weight_init`` ops skip initialisation, which is right for
loading but not for training); ``state_dict`` keys are exactly those of a stock WanModel, so a trained file
loads into ComfyUI's WanModel inside ``model_base.WAN21``.
"""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

import torch

from .config import model_config


def ensure_comfy_importable() -> None:
    """Put the host's ComfyUI tree on sys.path (if needed) and force CPU before comfy.model_management."""
    try:
        import comfy  # noqa: F401
        return
    except ImportError:
        pass
    path = os.environ.get("CARNATOR_COMFY_PATH")
    if not path:
        marker = Path(__file__).resolve().parents[2] / ".host" / "comfy-path"
        if not marker.exists():
            raise RuntimeError("ComfyUI is not importable and .host/comfy-path is missing: run "
                               "`make setup` (scripts/setup/setup_host.sh) or set CARNATOR_COMFY_PATH")
        path = marker.read_text().strip()
    sys.path.insert(0, path)
    from comfy.cli_args import args

    args.cpu = True
    args.use_pytorch_cross_attention = True
    import comfy.model_management  # noqa: F401


def build_wan(init: bool = True, dtype: torch.dtype = torch.float32, **overrides: Any) -> torch.nn.Module:
    """A ComfyUI WanModel with this package's config (``overrides`` replace config entries)."""
    ensure_comfy_importable()
    import comfy.ops
    from comfy.ldm.wan.model import WanModel

    cfg = {**model_config(), **overrides}
    model = WanModel(**cfg, device="cpu", dtype=dtype, operations=comfy.ops.disable_weight_init)
    if init:
        init_weights(model)
    return model


def init_weights(model: torch.nn.Module) -> None:
    """Initialise every parameter (ComfyUI's ops create them uninitialised).

    Layers get torch's own default init; AdaLN ``modulation`` tables get N(0, 1/dim) as in Wan's reference
    code; the output projection starts at zero so the untrained model predicts zero velocity.
    """
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
        for module in model.modules():
            for cls in type(module).__mro__:
                if cls.__module__.startswith("torch.nn") and "reset_parameters" in cls.__dict__:
                    cls.reset_parameters(module)
                    break
        for name, p in model.named_parameters():
            if name.endswith("modulation"):
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
            elif torch.isnan(p).any():
                if name.endswith("weight") and p.dim() == 1:  # norm scales
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
        model.head.head.weight.zero_()
        model.head.head.bias.zero_()
        bad = [n for n, p in model.named_parameters() if torch.isnan(p).any()]
        if bad:
            raise RuntimeError(f"uninitialised parameters left: {bad}")
