"""Every constant of the embedded toy model in one place: clip geometry, latent geometry, the denoiser's
config and the default sampling settings.

Contract: other modules (world, codec, text, train, comfy_glue, nodes, tests) read these names and never
re-derive them. Changing any value here invalidates the shipped weights (the trainer stores a copy of
``model_config()`` in the safetensors metadata and the loader refuses a mismatch).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

# --- pixels -------------------------------------------------------------------------------------------
FRAMES = 8  # frames per clip
HEIGHT = 32  # pixels
WIDTH = 32

# --- latent (codec.py): pixel-unshuffle x2 -> 12 channels, zero-padded to 16 -------------------------------
UNSHUFFLE = 2
LATENT_CHANNELS = 16
LATENT_SHAPE = (LATENT_CHANNELS, FRAMES, HEIGHT // UNSHUFFLE, WIDTH // UNSHUFFLE)  # (C, T, H, W)
# The denoiser also receives 3 fixed coordinate channels (x, y, t ramps in [-1, 1]) through ComfyUI's
# concat-conditioning path (like Wan i2v's extra input channels). Wan's RoPE is purely relative, so on a
# noise-only input a token cannot tell where in the frame it sits; without absolute coordinates
# "top left" and "moves right" are unlearnable from pure noise (a first run scored chance on both).
COORD_CHANNELS = 3

# --- denoiser: ComfyUI's WanModel --------------------------------------------------------------------------
# Temporal patch 2 halves the token count (4 x 8 x 8 = 256 tokens per clip), which doubles training
# throughput on CPU compared with patch (1, 2, 2) while keeping 8 frames and 4x4-pixel spatial tokens.
PATCH_SIZE = (2, 2, 2)
TOKEN_GRID = (
    FRAMES // PATCH_SIZE[0],
    LATENT_SHAPE[2] // PATCH_SIZE[1],
    LATENT_SHAPE[3] // PATCH_SIZE[2],
)  # (T', H', W') of the transformer's token grid
TEXT_LEN = 32  # conditioning tokens per prompt (zero-padded, like Wan pads umT5 output to 512)
TEXT_DIM = 4096  # width of one conditioning token (the same width as Wan's umT5 conditioning)
# Small on purpose: training gets ~1-2 contended CPU cores, and in a short budget a smaller model reaches a
# lower loss per wall-clock minute. 64-dim heads train faster here than 128-dim ones (see shared notes).
DIM = 192
FFN_DIM = 768
NUM_HEADS = 3
NUM_LAYERS = 4
FREQ_DIM = 256

# --- sampling defaults (stock KSampler settings for this model) ------------------------------------------
SHIFT = 3.0  # discrete-flow shift used at training time for timestep sampling and at inference
DEFAULT_STEPS = 20
DEFAULT_CFG = 5.0
DEFAULT_SAMPLER = "euler"
DEFAULT_SCHEDULER = "simple"
DEFAULT_PROBE_STEP = 4  # the step (0-based count of finished steps) at which the Early Signature probes

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
DEFAULT_WEIGHTS = WEIGHTS_DIR / "carnator_embedded_v2.safetensors"


def model_config() -> dict[str, Any]:
    """Keyword arguments for ``comfy.ldm.wan.model.WanModel`` (without device/dtype/operations)."""
    return {
        "model_type": "t2v",
        "patch_size": tuple(PATCH_SIZE),
        "text_len": TEXT_LEN,
        "in_dim": LATENT_CHANNELS + COORD_CHANNELS,
        "dim": DIM,
        "ffn_dim": FFN_DIM,
        "freq_dim": FREQ_DIM,
        "text_dim": TEXT_DIM,
        "out_dim": LATENT_CHANNELS,
        "num_heads": NUM_HEADS,
        "num_layers": NUM_LAYERS,
        "window_size": (-1, -1),
        "qk_norm": True,
        "cross_attn_norm": True,
        "eps": 1e-6,
    }

# The "middle layers" whose object-token cross-attention the probe averages (of NUM_LAYERS = 4).
PROBE_LAYERS = (1, 2)
# The quality gate (tests/test_embedded_gate.py, docs/MODEL_CARD.md): held-out captions and seeds.
GATE_CAPTIONS = 64
GATE_CAPTION_SEED = 12345
GATE_NOISE_SEED = 0
