"""Tiny random-weight Wan 2.1 / Wan 2.2 TI2V / LTX-Video models built from ComfyUI's own classes.

Each model is built in-process, its weights are filled from a seeded generator, saved with safetensors and
loaded back through ``comfy.sd.load_diffusion_model`` so ComfyUI's own model detection picks the model type
(Wan by ``head.modulation``, out_dim 48 -> WAN22; LTXV by ``adaln_single...`` + the safetensors config
metadata). Conditioning tensors match what the real text encoders produce (text_dim 4096).
Import only after ComfyUI is importable (the ``comfy_env`` fixture).
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

TEXT_DIM = 4096


@dataclass(frozen=True)
class TinySpec:
    name: str  # "wan21" | "wan22" | "ltxv"
    latent_shape: tuple[int, int, int, int]  # (C, T, H, W)
    text_len: int = 12


SPECS = {
    # 16-ch Wan 2.1 latent: 3 latent frames of 8x8 -> patch (1,2,2) -> 3*4*4 = 48 tokens
    "wan21": TinySpec("wan21", (16, 3, 8, 8)),
    # 48-ch Wan 2.2 TI2V latent
    "wan22": TinySpec("wan22", (48, 3, 8, 8)),
    # 128-ch LTXV latent, patch 1 -> 3*4*4 = 48 tokens
    "ltxv": TinySpec("ltxv", (128, 3, 4, 4)),
}


def _fill_(module: torch.nn.Module, seed: int) -> None:
    """ComfyUI's disable_weight_init leaves parameters uninitialised: fill them deterministically."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
            if p.ndim <= 1:
                if "norm" in name and name.endswith("weight"):
                    p.copy_(torch.ones_like(p))
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            else:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=gen) / fan_in**0.5)


def build_state_dict(name: str, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    import comfy.ops

    ops = comfy.ops.disable_weight_init
    metadata: dict[str, str] = {}
    if name in ("wan21", "wan22"):
        from comfy.ldm.wan.model import WanModel

        ch = 16 if name == "wan21" else 48
        # dim must be a multiple of 128: ComfyUI's detector hard-codes num_heads = dim // 128.
        model = WanModel(model_type="t2v", patch_size=(1, 2, 2), text_len=512, in_dim=ch, dim=256, ffn_dim=512,
                         freq_dim=256, text_dim=TEXT_DIM, out_dim=ch, num_heads=2, num_layers=4, operations=ops)
        if name == "wan22":
            # The in-tree WAN22 model wraps a TI2V model: image channels are concatenated only for i2v; the
            # detector routes out_dim 48 to WAN22_T2V.
            pass
    elif name == "ltxv":
        from comfy.ldm.lightricks.model import LTXVModel

        cfg = {"num_attention_heads": 2, "attention_head_dim": 64, "num_layers": 4, "in_channels": 128,
               "cross_attention_dim": 128, "caption_channels": TEXT_DIM}
        model = LTXVModel(**cfg, operations=ops)
        metadata = {"config": json.dumps({"transformer": cfg})}
    else:
        raise ValueError(f"unknown tiny model {name!r}; choose one of {sorted(SPECS)}")
    _fill_(model, seed)
    sd = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    return sd, metadata


def save_tiny_model(name: str, directory: Path, seed: int = 0) -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"carnator_tiny_{name}.safetensors"
    if not path.exists():
        sd, metadata = build_state_dict(name, seed)
        save_file(sd, str(path), metadata=metadata)
    return path


def load_tiny_model(name: str, directory: Path, seed: int = 0):
    """Save (once) and load a tiny model through ComfyUI's detection; returns a ModelPatcher."""
    import comfy.sd

    path = save_tiny_model(name, directory, seed)
    model = comfy.sd.load_diffusion_model(str(path))
    if model is None:
        raise RuntimeError(f"ComfyUI did not recognise {path}")
    return model


def conditioning(name: str, seed: int = 1, text_len: int | None = None):
    """(positive, negative) CONDITIONING lists as ComfyUI's text encoders would produce them."""
    spec = SPECS[name]
    n = text_len or spec.text_len
    gen = torch.Generator().manual_seed(seed)
    pos = torch.randn(1, n, TEXT_DIM, generator=gen)
    neg = torch.randn(1, n, TEXT_DIM, generator=gen) * 0.5
    extra = (lambda: {"attention_mask": torch.ones(1, n, dtype=torch.long)}) if name == "ltxv" else (lambda: {})
    return [[pos, extra()]], [[neg, extra()]]


def empty_latent(name: str, batch: int = 1) -> dict:
    return {"samples": torch.zeros((batch,) + SPECS[name].latent_shape)}


class WordTokens:
    """Text-encoder stand-in for the tiny models' conditioning: the probe's ``carnator_word_tokens`` hook, with
    whitespace word i of the prompt at conditioning position i (``conditioning`` has ``text_len`` positions), so
    the objects a test names have real token positions and the probe captures their cross-attention."""

    def __init__(self, text_len: int = 12):
        self.text_len = text_len

    def carnator_word_tokens(self, prompt: str) -> list[tuple[int, int]]:
        return [(i, i + 1) for i in range(min(len(prompt.split()), self.text_len))]


@contextmanager
def count_calls(model):
    """Counts forward calls of the model's diffusion backbone (the one place every model call goes through)."""
    dm = model.model.diffusion_model
    calls = []
    original = dm.forward

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    dm.forward = counting
    try:
        yield calls
    finally:
        del dm.forward


def prompt_only_options(**kw):
    """Serve options for prompt-only reuse at a threshold every same-prompt request passes, so a second seed is a
    hit on the first's entry. Random weights disagree everywhere across seeds: the region comes from the object's
    mask alone. ``kw`` overrides any ``ServeOptions`` field."""
    from carnator.carnator_core.probe import ProbeConfig
    from carnator.carnator_core.request import ServeOptions
    from carnator.carnator_core.reuse import ReuseConfig

    reuse = ReuseConfig(x0_threshold=50.0, dilation=0, whole_objects=False, context_delta=1e9, refreshes=1)
    return ServeOptions(**{"method": "prompt_only", "prompt_threshold": 0.5, "probe": ProbeConfig(probe_steps=2),
                           "reuse": reuse, **kw})


def serve_wan21(model, store, seed: int, options, prompt: str = "a red ball"):
    """One request ("ball", 8 steps, CFG 5) on the tiny Wan 2.1 through ``request.serve``: (result, model calls)."""
    from carnator.carnator_core.request import RequestSpec, serve

    pos, neg = conditioning("wan21")
    with count_calls(model) as calls:
        res = serve(model, WordTokens(), pos, neg, empty_latent("wan21"), RequestSpec(prompt, seed, 8, 5.0,
                                                                                      objects="ball"),
                    store, options)
    return res, len(calls)
