"""Every constant of the embedded toy model in one place: clip geometry, latent geometry, the denoiser's
config and the default sampling settings.

Contract: other modules (world, codec, text, train, comfy_glue, nodes, tests) read these names and never
re-derive them. Changing any value here invalidates the shipped weights (the trainer stores a copy of
``model_config()`` in the safetensors metadata and the loader refuses a mismatch).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

# --- shared by every version -------------------------------------------------------------------------
# Latent (codec.py): pixel-unshuffle x2 -> 12 channels, zero-padded to 16.
UNSHUFFLE = 2
LATENT_CHANNELS = 16
# The denoiser also receives 3 fixed coordinate channels (x, y, t ramps in [-1, 1]) through ComfyUI's
# concat-conditioning path (like Wan i2v's extra input channels). Wan's RoPE is purely relative, so on a
# noise-only input a token cannot tell where in the frame it sits; without absolute coordinates
# "top left" and "moves right" are unlearnable from pure noise (a first run scored chance on both).
COORD_CHANNELS = 3
TEXT_LEN = 32  # conditioning tokens per prompt (zero-padded, like Wan pads umT5 output to 512)
TEXT_DIM = 4096  # width of one conditioning token (the same width as Wan's umT5 conditioning)
FREQ_DIM = 256

# --- sampling defaults (stock KSampler settings for this model) ------------------------------------------
SHIFT = 3.0  # discrete-flow shift used at training time for timestep sampling and at inference
DEFAULT_STEPS = 20
# DEFAULT_CFG (below, after the versions): the default version's ``ModelVersion.cfg``.
DEFAULT_SAMPLER = "euler"
DEFAULT_SCHEDULER = "simple"
DEFAULT_PROBE_STEP = 2  # the step (0-based count of finished steps) at which the Early Signature probes
# What a denoiser may be trained to output (train.Recipe.prediction; a weights file's "prediction" metadata, absent
# = "v"): the flow velocity eps - x0 (ComfyUI's FLOW) or the clean latent (comfy_glue.ModelSamplingFlowX0).
PREDICTIONS = ("v", "x0")
# Bounds of the per-weights-file input options (train.Recipe.coord_time_scale / motion_axes), checked by the
# trainer and by the loader alike.
MAX_COORD_TIME_SCALE = 64.0
MAX_MOTION_AXES = 16.0

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"


# The quality gate (tests/test_embedded_gate.py, docs/MODEL_CARD.md): held-out captions and seeds.
GATE_CAPTIONS = 64
GATE_CAPTION_SEED = 12345
GATE_NOISE_SEED = 0
# Minimum rates on the one-object held-out captions (every version); two-object: ModelVersion.two_object_all_ok_gate.
GATE_THRESHOLDS = {"colour": 0.90, "size": 0.80, "position": 0.60, "motion": 0.50, "attn_peak_on_object": 0.80,
                   "x0_colour_match": 0.90}
# Work bound of one clip (tests/test_embedded_gate.py; the wall time is a benchmark, scripts/
# bench_embedded_clip.py): analytic FLOPs of DEFAULT_STEPS denoiser calls on cond + uncond
# (comfy_glue.clip_flops). v2 = 53 GFLOP ran in 0.71 s on 2 idle cores (~75 GFLOP/s), so 250 GFLOP keeps one
# clip under the 10 s target with a 3x margin for a slower or shared machine. v3 = 144 GFLOP.
CLIP_FLOP_BUDGET = 250e9


# --- model versions -----------------------------------------------------------------------------------------
# ``DEFAULT_VERSION`` names the shipped weights; the constants after ``VERSIONS`` are derived from it, and code
# that must also handle another version reads its ``ModelVersion`` (``version(name)``, or ``version_of_config``
# for a weights file's stored config). A version becomes the default only when its weights pass its quality gate
# (tests/test_embedded_gate.py) and the shipped rule is certified on it (rules/README.md).
@dataclass(frozen=True)
class ModelVersion:
    """One embedded-model version: clip geometry, denoiser shape, text-encoder variant, training recipe knobs
    that define the model, and its quality gate. Frozen: a version never changes once weights exist."""

    name: str
    frames: int
    height: int
    width: int
    patch_size: tuple[int, int, int]
    dim: int
    ffn_dim: int
    num_heads: int
    num_layers: int
    probe_layers: tuple[int, ...]  # the middle layers whose object-token cross-attention the probe averages
    # Text encoder: weight of the object's phrase context added to each of its word tokens (0 = v2's
    # bag-of-words encoder; see text.py).
    text_context: float
    p_two: float  # fraction of two-object training clips
    weights_file: str
    # Two-object gate: fraction of two-object held-out captions with every attribute right (None = not gated).
    two_object_all_ok_gate: Optional[float]
    # Coordinate channels (``codec.coord_channels``): the x, y, t ramps are multiplied by ``coord_scale``, and
    # ``coord_octaves`` > 0 adds sin/cos(pi 2^k x) and sin/cos(pi 2^k y) for k < coord_octaves, so a token can
    # respond to a bounded region of the frame with one linear read instead of a learned bump. v2: 1.0 and 0.
    coord_scale: float = 1.0
    coord_octaves: int = 0
    # The stock KSampler CFG scale of this version's weights: what the gate, the workflows, the pairs labelling
    # and the rules use. Chosen on selection captions, never the gate's (docs/MODEL_CARD.md): a scale above the
    # one the weights were trained to follow overshoots into halos the checker reads as wrong colours.
    cfg: float = 5.0

    @property
    def coord_channels(self) -> int:
        """How many fixed coordinate channels the denoiser receives besides the latent."""
        return COORD_CHANNELS + 4 * self.coord_octaves

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        return (LATENT_CHANNELS, self.frames, self.height // UNSHUFFLE, self.width // UNSHUFFLE)

    @property
    def token_grid(self) -> tuple[int, int, int]:
        _, t, h, w = self.latent_shape
        return (t // self.patch_size[0], h // self.patch_size[1], w // self.patch_size[2])

    @property
    def tokens(self) -> int:
        t, h, w = self.token_grid
        return t * h * w

    @property
    def weights_path(self) -> Path:
        return WEIGHTS_DIR / self.weights_file

    def model_config(self) -> dict[str, Any]:
        """Keyword arguments for ``comfy.ldm.wan.model.WanModel`` (without device/dtype/operations)."""
        return {
            "model_type": "t2v",
            "patch_size": tuple(self.patch_size),
            "text_len": TEXT_LEN,
            "in_dim": LATENT_CHANNELS + self.coord_channels,
            "dim": self.dim,
            "ffn_dim": self.ffn_dim,
            "freq_dim": FREQ_DIM,
            "text_dim": TEXT_DIM,
            "out_dim": LATENT_CHANNELS,
            "num_heads": self.num_heads,
            "num_layers": self.num_layers,
            "window_size": (-1, -1),
            "qk_norm": True,
            "cross_attn_norm": True,
            "eps": 1e-6,
        }


VERSIONS: dict[str, ModelVersion] = {
    # v2 (docs/MODEL_CARD.md): 32x32 frames, 256 tokens (4 x 8 x 8: temporal patch 2 halves the token count,
    # which doubled training throughput on CPU against patch (1, 2, 2) while keeping 4x4-pixel spatial tokens),
    # 4 blocks of dim 192 (3 heads x 64: in a short CPU budget a smaller model reaches a lower loss per
    # wall-clock minute, and 64-dim heads train faster here than 128-dim ones), probe layers (1, 2), CFG 5.
    "v2": ModelVersion(
        name="v2", frames=8, height=32, width=32, patch_size=(2, 2, 2), dim=192, ffn_dim=768, num_heads=3,
        num_layers=4, probe_layers=(1, 2), text_context=0.0, p_two=0.3,
        weights_file="carnator_embedded_v2.safetensors", two_object_all_ok_gate=None),
    # v3 (docs/MODEL_CARD.md, "v3 design"): a 48x48 frame with the same object sizes, so an object covers
    # 3-9 % of the pixels (v2: 6-19 %) and 576 tokens (4 x 12 x 12) of 2 frames x 4x4 px each; 8 blocks, so
    # the always-dense first and last block are 25 % of a step; dim 128 (2 heads x 64) keeps the resumable
    # training state (weights + EMA + AdamW moments, 16-bit) under 20 MB and a training step at ~1.5 s on
    # one core; the contextual text encoder and 60 % two-object clips target two-object binding. Two octaves of
    # sin/cos coordinate channels (in_dim 27) since the restart of 2026-12-02
    # (docs/history/MODEL_CARD_HISTORY.md, "v3's recipe fix"): the first run (3 ramps, object share 0.3) never
    # read position words. Probe layers (5, 6) and CFG 2
    # chosen on the final weights (stage 4) with selection captions (docs/MODEL_CARD.md, "Stage 4").
    "v3": ModelVersion(
        name="v3", frames=8, height=48, width=48, patch_size=(2, 2, 2), dim=128, ffn_dim=512, num_heads=2,
        num_layers=8, probe_layers=(5, 6), text_context=0.6, p_two=0.6,
        weights_file="carnator_embedded_v3.safetensors", two_object_all_ok_gate=0.5, coord_octaves=2, cfg=2.0),
}
DEFAULT_VERSION = "v3"

# --- the default version's constants --------------------------------------------------------------------
# Derived, never set: code that handles only the default model reads these; code that must also handle another
# version reads its ``ModelVersion``.
_D = VERSIONS[DEFAULT_VERSION]
FRAMES = _D.frames  # frames per clip
HEIGHT = _D.height  # pixels
WIDTH = _D.width
LATENT_SHAPE = _D.latent_shape  # (C, T, H, W)
PATCH_SIZE = _D.patch_size
TOKEN_GRID = _D.token_grid  # (T', H', W') of the transformer's token grid
DIM = _D.dim
FFN_DIM = _D.ffn_dim
NUM_HEADS = _D.num_heads
NUM_LAYERS = _D.num_layers
PROBE_LAYERS = _D.probe_layers  # the middle layers whose object-token cross-attention the probe averages
DEFAULT_WEIGHTS = _D.weights_path
DEFAULT_CFG = _D.cfg


def version(name: Optional[str] = None) -> ModelVersion:
    """The named version (default: ``DEFAULT_VERSION``); a clear error for an unknown name."""
    key = DEFAULT_VERSION if name is None else name
    if key not in VERSIONS:
        raise ValueError(f"unknown embedded model version {key!r}; known: {sorted(VERSIONS)}")
    return VERSIONS[key]


def model_config(name: Optional[str] = None) -> dict[str, Any]:
    """Keyword arguments for ``comfy.ldm.wan.model.WanModel`` of a version (default: the default version)."""
    return version(name).model_config()


def version_of_config(stored: dict[str, Any]) -> Optional[ModelVersion]:
    """The version whose WanModel config equals ``stored`` (a weights file's JSON metadata), or None."""
    import json

    for v in VERSIONS.values():
        if json.loads(json.dumps(v.model_config())) == stored:
            return v
    return None
