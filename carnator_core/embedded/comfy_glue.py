"""ComfyUI glue for the embedded model (the only module of this package that imports ComfyUI at load time).

``load_embedded(weights_path=None) -> (MODEL, EmbeddedTextEncoder, EmbeddedDecoder)``:

* MODEL is a real ``comfy.model_patcher.ModelPatcher`` around ``EmbeddedWan``, a subclass of ComfyUI's
  ``comfy.model_base.WAN21`` whose ``diffusion_model`` is ComfyUI's own ``WanModel`` with
  ``config.model_config()``. Model sampling is ComfyUI's discrete flow (``ModelType.FLOW``,
  ``shift = config.SHIFT``) for a velocity-predicting file, and the same flow with denoised = the model's output
  (``ModelSamplingFlowX0``) for a file whose metadata says ``"prediction": "x0"`` (v3's x0 run); the latent
  format is the identity (``EmbeddedLatent``: 16 channels, 3-D).
  The only override is ``concat_cond``: it supplies the 3 fixed coordinate channels (see
  ``config.COORD_CHANNELS``) through the same path Wan i2v uses for its extra input channels, so the stock
  ``KSampler`` and every ModelPatcher wrapper / attention override apply unchanged.
* ``EmbeddedTextEncoder.encode(prompt)`` -> ComfyUI CONDITIONING ``[[cond [1, TEXT_LEN, TEXT_DIM], {}]]``;
  ``encode_with_words`` also returns the word -> token positions (``text.Encoded``).
* ``EmbeddedDecoder.decode(samples [B, 16, T, h, w])`` -> IMAGE ``[B*T, H, W, 3]`` in [0, 1].

Importing this module requires ComfyUI importable (nodes import it; tests use the ``comfy_env`` fixture).
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch

from . import codec, config, text
from .model import ensure_comfy_importable

ensure_comfy_importable()

import comfy.latent_formats  # noqa: E402
import comfy.model_base  # noqa: E402
import comfy.model_management  # noqa: E402
import comfy.model_patcher  # noqa: E402
import comfy.model_sampling  # noqa: E402
import comfy.supported_models  # noqa: E402


class EmbeddedLatent(comfy.latent_formats.LatentFormat):
    """Identity latent format: the codec already maps pixels to roughly unit-scale values."""

    latent_channels = config.LATENT_CHANNELS
    latent_dimensions = 3
    scale_factor = 1.0

    def __init__(self) -> None:
        # Preview (latent -> RGB) factors in ComfyUI's convention: the previewer computes
        # rgb = ((latent @ factors + bias) + 1) / 2. Channel c of the first 12 carries colour c // 4 at one of the
        # four sub-pixels of a latent cell, each holding 2*value-1, so 0.25 per channel averages the four back
        # into [-1, 1] and the bias is zero (tests/test_embedded_comfy.py pins the round trip against the codec).
        factors = [[0.0, 0.0, 0.0] for _ in range(config.LATENT_CHANNELS)]
        for c in range(12):
            factors[c][c // 4] = 0.25
        self.latent_rgb_factors = factors
        self.latent_rgb_factors_bias = [0.0, 0.0, 0.0]


class FlowX0(comfy.model_sampling.CONST):
    """Model-sampling mixin for a denoiser that outputs the clean latent: flow-matching noise and inputs (ComfyUI's
    ``CONST``, so flow-aware samplers still see a flow model), denoised = the model's output (``X0``'s rule).
    Samplers, CFG and every ModelPatcher wrapper work on the denoised value, so they apply unchanged."""

    def calculate_denoised(self, sigma: torch.Tensor, model_output: torch.Tensor,
                           model_input: torch.Tensor) -> torch.Tensor:
        return model_output


class ModelSamplingFlowX0(comfy.model_sampling.ModelSamplingDiscreteFlow, FlowX0):
    """Discrete flow (shift, multiplier from the model config) with an x0 output."""


class EmbeddedModelConfig(comfy.supported_models.WAN21_T2V):
    """A WAN21_T2V model config with the embedded WanModel's shape, identity latent and shift."""

    sampling_settings = {"shift": config.SHIFT, "multiplier": 1000}
    latent_format = EmbeddedLatent
    memory_usage_factor = 0.05

    def __init__(self, version: str = config.DEFAULT_VERSION, prediction: str = "v", time_scale: float = 1.0) -> None:
        unet = {"image_model": "wan2.1", **config.model_config(version), "dtype": torch.float32}
        super().__init__(unet)
        self.memory_usage_factor = 0.05
        self.carnator_version = version  # which coordinate channels EmbeddedWan.concat_cond supplies
        if prediction not in config.PREDICTIONS:
            raise ValueError(f"unknown embedded-model prediction {prediction!r} (expected "
                             f"{' or '.join(repr(p) for p in config.PREDICTIONS)})")
        self.carnator_prediction = prediction  # what the denoiser outputs (train.Recipe.prediction)
        if not (isinstance(time_scale, (int, float)) and 0.0 < float(time_scale) <= config.MAX_COORD_TIME_SCALE):
            raise ValueError(f"embedded-model coord_time_scale must be a number in (0, "
                             f"{config.MAX_COORD_TIME_SCALE:g}], not {time_scale!r}")
        self.carnator_time_scale = float(time_scale)  # the t coordinate ramp's scale (train.Recipe)

    def get_model(self, state_dict: dict, prefix: str = "", device: Any = None) -> "EmbeddedWan":
        return EmbeddedWan(self, device=device)


class EmbeddedWan(comfy.model_base.WAN21):
    """ComfyUI's WAN21 BaseModel; ``concat_cond`` feeds the fixed coordinate channels; a model trained to output
    x0 gets ``ModelSamplingFlowX0`` instead of the FLOW sampling."""

    def __init__(self, model_config: EmbeddedModelConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(model_config, *args, **kwargs)
        if getattr(model_config, "carnator_prediction", "v") == "x0":
            self.model_sampling = ModelSamplingFlowX0(model_config)

    def concat_cond(self, **kwargs: Any) -> Optional[torch.Tensor]:
        noise = kwargs.get("noise", None)
        if noise is None:
            return None
        b, _, t, h, w = noise.shape
        v = config.version(getattr(self.model_config, "carnator_version", config.DEFAULT_VERSION))
        coords = codec.coord_channels(t, h, w, scale=v.coord_scale, octaves=v.coord_octaves,
                                      time_scale=getattr(self.model_config, "carnator_time_scale", 1.0)).to(
            device=noise.device, dtype=noise.dtype)
        return coords[None].expand(b, -1, -1, -1, -1).contiguous()


def read_metadata(weights_path: Union[str, Path]) -> dict[str, Any]:
    """The JSON metadata the trainer stored in a weights file (config, seed, steps, minutes, ...)."""
    from safetensors import safe_open

    with safe_open(str(weights_path), framework="pt") as f:
        meta = f.metadata() or {}
    return {k: json.loads(v) for k, v in meta.items()}


def version_of(meta: dict[str, Any], path: Path) -> config.ModelVersion:
    """The model version whose config a weights file was trained with (a clear error for any other file)."""
    stored = meta.get("config")
    if stored is None:
        raise ValueError(f"{path} has no 'config' metadata: not a Carnator embedded weights file "
                         "(train one with `python -m carnator_core.embedded.train`)")
    found = config.version_of_config(stored)
    if found is None:
        known = {v.name: v.model_config() for v in config.VERSIONS.values()}
        raise ValueError(f"{path} was trained with config {stored}, which is none of this code's versions "
                         f"{known}: use weights shipped with this code or retrain (see docs/MODEL_CARD.md)")
    return found


@dataclass(frozen=True)
class EmbeddedTextEncoder:
    """Text -> CONDITIONING for the embedded model (socket type CARNATOR_TEXT_ENCODER) of one model version
    (``load_embedded`` returns the one its weights need; the versions' encoders differ, see text.py)."""

    version: str = config.DEFAULT_VERSION
    motion_axes: float = 0.0  # direction words as axis + signed direction (text.encode; the weights' metadata)

    @property
    def name(self) -> str:
        """Identifies the conditioning (caches never reuse across different names); v2's is its historic name."""
        base = "carnator-embedded-text-v1" if self.version == "v2" else f"carnator-embedded-text-{self.version}"
        return base if not self.motion_axes else f"{base}-axes{self.motion_axes:g}"

    def encode_with_words(self, prompt: str) -> tuple[list, text.Encoded]:
        enc = text.encode(prompt, version=self.version, motion_axes=self.motion_axes)
        cond = torch.from_numpy(enc.cond.copy())[None]
        return [[cond, {}]], enc

    def encode(self, prompt: str) -> list:
        """ComfyUI CONDITIONING for ``prompt`` (unknown words are ignored with a warning)."""
        return self.encode_with_words(prompt)[0]

    def carnator_word_tokens(self, prompt: str) -> list[tuple[int, int]]:
        """``(conditioning position, 1-based whitespace word id)`` per token: the probe's contract
        (see docs/ARCHITECTURE.md)."""
        return text.word_tokens(prompt)

    def carnator_canonical_name(self, noun: str) -> str:
        """The probe's optional hook: the object name used to match objects across requests (synonyms of one
        concept share it; see ``world.canonical_noun``)."""
        from .world import canonical_noun

        return canonical_noun(noun)


@dataclass(frozen=True)
class EmbeddedDecoder:
    """Latent -> IMAGE frames for the embedded model (socket type CARNATOR_EMBEDDED_DECODER)."""

    name: str = "carnator-embedded-codec-v1"

    def decode(self, samples: torch.Tensor) -> torch.Tensor:
        """[B, 16, T, h, w] -> [B*T, 2h, 2w, 3] float32 in [0, 1] (ComfyUI IMAGE)."""
        if samples.dim() != 5:
            raise ValueError(f"expected a video latent [B, C, T, H, W]; got {tuple(samples.shape)}")
        rgb = codec.latent_to_rgb(samples.float().cpu())
        return rgb.reshape(-1, *rgb.shape[2:])

    def decode_clips(self, samples: torch.Tensor) -> torch.Tensor:
        """[B, 16, T, h, w] -> [B, T, 2h, 2w, 3] in [0, 1] (one clip per batch item; for the checker)."""
        return codec.latent_to_rgb(samples.float().cpu())


_CACHE: dict[str, Any] = {}
_LOCK = threading.Lock()


def load_embedded(weights_path: Union[str, Path, None] = None) -> tuple[comfy.model_patcher.ModelPatcher,
                                                                         EmbeddedTextEncoder, EmbeddedDecoder]:
    """Load the embedded model as (MODEL, text encoder, decoder). The built BaseModel is cached per file
    (path + mtime); each call returns a fresh ``ModelPatcher`` clone so callers may patch it freely."""
    from safetensors.torch import load_file

    path = Path(weights_path) if weights_path is not None else config.DEFAULT_WEIGHTS
    if not path.exists():
        raise FileNotFoundError(f"embedded model weights not found at {path}; they ship with the repository "
                                "(git checkout) or can be retrained with `python -m carnator_core.embedded.train`")
    key = f"{path.resolve()}:{path.stat().st_mtime_ns}"
    with _LOCK:
        patcher = _CACHE.get(key)
        if patcher is None:
            meta = read_metadata(path)
            version = version_of(meta, path)
            model_config = EmbeddedModelConfig(version.name, prediction=meta.get("prediction", "v"),
                                               time_scale=meta.get("coord_time_scale", 1.0))
            base = model_config.get_model({}, device=torch.device("cpu"))
            sd = {k: v.to(torch.float32) for k, v in load_file(str(path)).items()}
            missing, unexpected = base.diffusion_model.load_state_dict(sd, strict=False)
            if missing or unexpected:
                raise ValueError(f"{path}: weights do not fit the embedded WanModel (missing {missing[:5]}, "
                                 f"unexpected {unexpected[:5]})")
            base.carnator_embedded_meta = meta
            base.carnator_embedded_version = version.name
            cpu = torch.device("cpu")
            patcher = comfy.model_patcher.ModelPatcher(base, load_device=cpu, offload_device=cpu)
            _CACHE.clear()
            _CACHE[key] = patcher
    return patcher.clone(), text_encoder_for(patcher), EmbeddedDecoder()


def text_encoder_for(model: comfy.model_patcher.ModelPatcher) -> EmbeddedTextEncoder:
    """The text encoder a MODEL from ``load_embedded`` was trained with (its version and its weights' metadata)."""
    meta = getattr(model.model, "carnator_embedded_meta", {}) or {}
    axes = meta.get("motion_axes", 0.0)
    if not (isinstance(axes, (int, float)) and 0.0 <= float(axes) <= config.MAX_MOTION_AXES):
        raise ValueError(f"embedded-model motion_axes must be a number in [0, {config.MAX_MOTION_AXES:g}], "
                         f"not {axes!r}")
    return EmbeddedTextEncoder(model_version(model).name, motion_axes=float(axes))


def model_version(model: comfy.model_patcher.ModelPatcher) -> config.ModelVersion:
    """The version of a MODEL from ``load_embedded`` (the default version for anything else)."""
    return config.version(getattr(model.model, "carnator_embedded_version", None))


def empty_latent(batch_size: int = 1, version: Optional[str] = None) -> dict[str, torch.Tensor]:
    """ComfyUI LATENT of a version's geometry (default: the default version): zeros [B, 16, T, h, w]."""
    return {"samples": torch.zeros((batch_size,) + tuple(config.version(version).latent_shape))}


# --- generation with an optional early-state probe (used by the gate test and the model card numbers) -----
@dataclass
class Generation:
    """Result of ``generate``: final clips [B, T, H, W, 3] in [0, 1], final latents [B, 16, T, h, w];
    when probing: ``x0_probe`` (the x0 prediction at the probe step, latent [B, 16, T, h, w]) and
    ``cross_attn`` [B, num_layers, TEXT_LEN, T', H', W'] (conditional branch, mean over heads) at that step."""

    clips: torch.Tensor
    latents: torch.Tensor
    x0_probe: Optional[torch.Tensor] = None
    cross_attn: Optional[torch.Tensor] = None
    x0_steps: Optional[list[torch.Tensor]] = None  # keep_x0: the x0 prediction (latent) of every step


def generate(prompts: list[str], seed: int = 0, *, model: Optional[comfy.model_patcher.ModelPatcher] = None,
             steps: int = config.DEFAULT_STEPS, cfg: Optional[float] = None,
             sampler_name: str = config.DEFAULT_SAMPLER, scheduler: str = config.DEFAULT_SCHEDULER,
             probe_step: Optional[int] = None, keep_x0: bool = False) -> Generation:
    """Generate one clip per prompt in one batch with ComfyUI's stock sampling path (``comfy.sample.sample``,
    what KSampler calls). Noise comes from ``comfy.sample.prepare_noise(latent, seed)`` exactly as in
    KSampler, so clip i equals KSampler's batch item i for the same seed. With ``probe_step`` set, the
    x0 prediction and the cross-attention maps of the model call at ``sample_sigmas[probe_step]`` are kept; with
    ``keep_x0`` the x0 prediction of every step (``Generation.x0_steps``). ``cfg`` None = the weights' version's
    stock scale (``ModelVersion.cfg``).
    """
    import comfy.sample

    if model is None:
        model, _, _ = load_embedded()
    else:
        model = model.clone()
    ver = model_version(model)
    if cfg is None:
        cfg = ver.cfg
    enc = text_encoder_for(model)
    cond = torch.cat([enc.encode(p)[0][0] for p in prompts])
    positive = [[cond, {}]]
    negative = enc.encode("")
    latent = empty_latent(len(prompts), ver.name)["samples"]
    noise = comfy.sample.prepare_noise(latent, seed)
    store: dict[str, Any] = {}
    x0_steps: list[torch.Tensor] = []
    callback = None
    if probe_step is not None or keep_x0:

        def callback(step: int, x0: torch.Tensor, x: torch.Tensor, total: int) -> None:
            if step == probe_step:
                store["x0"] = x0.detach().cpu().clone()
            if keep_x0:
                x0_steps.append(x0.detach().cpu().float().clone())

    if probe_step is not None:
        maps: list[torch.Tensor] = []
        state = {"layer": 0}

        def attn_override(func, *args, **kwargs):  # noqa: ANN001 (ComfyUI's override signature)
            q, k = args[0], args[1]
            topts = kwargs.get("transformer_options") or {}
            if k.shape[1] == config.TEXT_LEN and q.shape[1] != k.shape[1]:
                layer = state["layer"] % ver.num_layers
                state["layer"] += 1
                sig, all_sig = topts.get("sigmas"), topts.get("sample_sigmas")
                if sig is not None and all_sig is not None and torch.isclose(
                        sig.flatten()[0].float(), all_sig[probe_step].float()):
                    heads = kwargs.get("heads", ver.num_heads)
                    b = q.shape[0]
                    qh = q.reshape(b, q.shape[1], heads, -1).transpose(1, 2).float()
                    kh = k.reshape(b, k.shape[1], heads, -1).transpose(1, 2).float()
                    a = torch.softmax(qh @ kh.transpose(-1, -2) / qh.shape[-1] ** 0.5, dim=-1).mean(1)  # [b, Lq, Lk]
                    chunks = topts.get("cond_or_uncond", [0])
                    per = b // len(chunks)
                    for ci, kind in enumerate(chunks):
                        if kind == 0:
                            maps.append((layer, a[ci * per:(ci + 1) * per].detach().cpu()))
            return func(*args, **kwargs)

        model.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = attn_override
        store["maps"] = maps
    samples = comfy.sample.sample(model, noise, steps, cfg, sampler_name, scheduler, positive, negative, latent,
                                  callback=callback, disable_pbar=True, seed=seed)
    out = Generation(clips=codec.latent_to_rgb(samples.float()), latents=samples.float(),
                     x0_steps=x0_steps if keep_x0 else None)
    if probe_step is not None:
        out.x0_probe = store.get("x0")
        b = len(prompts)
        t2, h2, w2 = ver.token_grid
        per_layer = [None] * ver.num_layers
        for layer, a in store["maps"]:
            per_layer[layer] = a if per_layer[layer] is None else torch.cat([per_layer[layer], a])
        if all(p is not None and p.shape[0] == b for p in per_layer):
            stacked = torch.stack(per_layer, 1)  # [b, layers, Lq, Lk]
            out.cross_attn = stacked.transpose(2, 3).reshape(b, ver.num_layers, config.TEXT_LEN, t2, h2, w2)
    return out


def gate_captions(n: int = config.GATE_CAPTIONS, seed: int = config.GATE_CAPTION_SEED,
                  n_objects: int = 1, version: Optional[str] = None) -> list[str]:
    """``n`` captions whose first object is a held-out (shape, colour, position) combination, drawn in the
    version's frame (two-object scenes must not overlap there; default: the default version)."""
    import numpy as np

    from . import world

    v = config.version(version)
    frame = world.Frame(v.frames, v.height, v.width)
    rng = np.random.default_rng(seed + 1000 * (n_objects - 1))
    return [world.caption(world.sample_scene(rng, held_out=True, n_objects=n_objects, frame=frame), rng)
            for _ in range(n)]


def evaluate(captions: list[str], seed: int = config.GATE_NOISE_SEED, *,
             model: Optional[comfy.model_patcher.ModelPatcher] = None, steps: int = config.DEFAULT_STEPS,
             cfg: Optional[float] = None, probe_step: int = config.DEFAULT_PROBE_STEP) -> dict[str, Any]:
    """Generate one clip per caption (one batch, stock sampling path; ``cfg`` None = the version's stock scale)
    and score it with the checker.

    Returns pass rates ``colour``/``size``/``position``/``motion``/``shape`` over named objects (plus the
    diagnostic ``motion_axis``/``motion_sign`` of ``checker.motion_axis_and_sign``), and the
    early-state metrics over clips whose first object the checker found in the final clip:
    ``attn_peak_on_object`` (the peak of the mean cross-attention of object 0's colour+shape tokens over
    the version's ``probe_layers`` at ``probe_step`` lands on a token whose 2-frame x 4x4-pixel region is at least
    25% covered by the final object's mask) and ``x0_colour_match`` (the nearest palette colour of the
    probe-step x0 prediction under the final object's mask, read from the half of those pixels most distinct from
    the x0's background, equals the final clip's object colour). ``attn_peak_by_layer`` is the same peak rule
    for each single layer (to choose a version's ``probe_layers`` on captions other than the gate's).
    """
    import numpy as np

    from . import checker, world

    if model is None:
        model, _, _ = load_embedded()
    ver = model_version(model)
    gen = generate(captions, seed, model=model, steps=steps, cfg=cfg, probe_step=probe_step)
    results = [checker.check(gen.clips[i], c) for i, c in enumerate(captions)]
    rates = checker.pass_rates(results)
    rates.update(checker.motion_axis_and_sign(results))
    x0_rgb = codec.latent_to_rgb(gen.x0_probe).numpy() if gen.x0_probe is not None else None
    palette_names = list(world.PALETTE)
    palette = np.asarray([world.PALETTE[c] for c in palette_names])
    colour_hits, found = 0, 0
    for i, (cap, r) in enumerate(zip(captions, results)):
        obj = r.objects[0]
        if not obj.found:
            continue
        found += 1
        mask = r.masks[0]
        if x0_rgb is not None:
            # The early x0 is blurred: under the final mask it blends object and background. Read the object's
            # colour from the half of those pixels most distinct from the x0's background (the same rule as the
            # checker's half-contrast size and the Signature Builder's object colour).
            bg = np.median(x0_rgb[i].reshape(-1, 3), axis=0)
            colour = checker.distinct_colour(x0_rgb[i], mask, bg)
            name = palette_names[int(np.argmin(np.linalg.norm(palette - colour, axis=1)))]
            colour_hits += int(name == obj.measured.get("colour"))
    rates.update({
        "n_captions": len(captions),
        "n_found": found,
        "attn_peak_on_object": attention_peak_rate(gen, captions, results, ver.probe_layers, ver),
        "attn_peak_by_layer": [attention_peak_rate(gen, captions, results, (k,), ver) for k in range(ver.num_layers)],
        "x0_colour_match": colour_hits / found if found else float("nan"),
        "all_ok": float(np.mean([r.all_ok for r in results])),
    })
    return rates


def attention_peak_rate(gen: Generation, captions: list[str], results: list[Any], layers: tuple[int, ...],
                        ver: config.ModelVersion) -> float:
    """Share of clips (among those whose first object the checker found in the final clip) where the peak of the
    probe-step cross-attention of object 0's colour+shape tokens, averaged over ``layers``, lands on a token whose
    2-frame x 4x4-pixel region is at least 25 % covered by the final object's mask; NaN when none was found or
    the generation kept no cross-attention."""
    import numpy as np

    if gen.cross_attn is None:
        return float("nan")
    pt, ph, pw = ver.patch_size[0], ver.patch_size[1] * config.UNSHUFFLE, ver.patch_size[2] * config.UNSHUFFLE
    hits, found = 0, 0
    for i, (cap, r) in enumerate(zip(captions, results)):
        if not r.objects[0].found:
            continue
        found += 1
        toks = text.encode(cap, warn=False, version=ver.name).object_tokens(0)
        amap = gen.cross_attn[i, list(layers)][:, toks].mean(dim=(0, 1))  # [T', H', W']
        t, y, x = np.unravel_index(int(torch.argmax(amap)), tuple(amap.shape))
        region = r.masks[0][t * pt:(t + 1) * pt, y * ph:(y + 1) * ph, x * pw:(x + 1) * pw]
        hits += int(region.mean() >= 0.25)
    return hits / found if found else float("nan")


def gate_verdict(report: dict[str, Any], version: config.ModelVersion) -> dict[str, Any]:
    """Pass/fail of a version's quality gate for a report of ``evaluate`` results (``one_object`` and, where the
    version gates two-object scenes, ``two_objects``); the same thresholds as tests/test_embedded_gate.py."""
    checks = {k: report["one_object"][k] >= v for k, v in config.GATE_THRESHOLDS.items()}
    if version.two_object_all_ok_gate is not None:
        two = report.get("two_objects")
        checks["two_objects_all_ok"] = bool(two is not None and two["all_ok"] >= version.two_object_all_ok_gate)
    return {"passes": all(checks.values()), "checks": checks}


def clip_flops(version: config.ModelVersion, steps: int = config.DEFAULT_STEPS) -> float:
    """Analytic FLOPs (2 per multiply-add) of one clip: ``steps`` denoiser calls on cond + uncond.

    Counts the WanModel's matrix work per sample: patch embedding, per block the self-attention projections
    and scores, the cross-attention projections (keys/values over the ``TEXT_LEN`` text tokens) and scores,
    the FFN, and the head. Norms, modulation and RoPE are left out (well under 1 %)."""
    n, d, f, l_txt = version.tokens, version.dim, version.ffn_dim, config.TEXT_LEN
    patch = version.patch_size[0] * version.patch_size[1] * version.patch_size[2]
    block = (4 * d * d * n  # self-attention q, k, v, o
             + 2 * n * n * d  # self-attention scores and weighted sum
             + 2 * d * d * n + 2 * d * d * l_txt  # cross-attention q, o (frame tokens) and k, v (text tokens)
             + 2 * n * l_txt * d  # cross-attention scores and weighted sum
             + 2 * d * f * n)  # FFN
    macs = version.num_layers * block + n * (config.LATENT_CHANNELS + version.coord_channels) * patch * d \
        + n * d * config.LATENT_CHANNELS * patch
    return float(2 * macs * 2 * steps)


def count_denoiser_work(model: comfy.model_patcher.ModelPatcher,
                        prompt: str = "a big red ball moves to the right in the top left, on green grass",
                        steps: int = config.DEFAULT_STEPS) -> dict[str, int]:
    """Generate one clip with the default settings and count the denoiser calls and the batch items they
    processed (ComfyUI batches cond and uncond into one call when memory allows, as it does on the CPU)."""
    counts = {"calls": 0, "batch_items": 0}

    def wrapper(apply_model, args):  # noqa: ANN001 (ComfyUI's unet wrapper signature)
        counts["calls"] += 1
        counts["batch_items"] += int(args["input"].shape[0])
        return apply_model(args["input"], args["timestep"], **args["c"])

    m = model.clone()
    m.set_model_unet_function_wrapper(wrapper)
    generate([prompt], seed=0, model=m, steps=steps)
    return counts


def time_one_clip(prompt: str = "a big red ball moves to the right in the top left, on green grass",
                  repeats: int = 2, model: Optional[comfy.model_patcher.ModelPatcher] = None) -> float:
    """Best-of-``repeats`` seconds to generate one clip with the default settings (stock sampling path);
    a benchmark figure (scripts/model/bench_embedded_clip.py), never a test assertion."""
    import time

    if model is None:
        model, _, _ = load_embedded()
    best = float("inf")
    for k in range(repeats):
        t0 = time.perf_counter()
        generate([prompt], seed=k, model=model)
        best = min(best, time.perf_counter() - t0)
    return best


if __name__ == "__main__":  # python -m carnator_core.embedded.comfy_glue [--two]: print the gate numbers
    import argparse

    ap = argparse.ArgumentParser(description="Measure the embedded model's quality gate numbers.")
    ap.add_argument("--weights", default=None)
    ap.add_argument("--two", action="store_true", help="also score 64 two-object held-out captions")
    ap.add_argument("--threads", type=int, default=2)
    ns = ap.parse_args()
    torch.set_num_threads(ns.threads)
    m, _, _ = load_embedded(ns.weights)
    ver = model_version(m).name
    report = {"meta": {k: v for k, v in m.model.carnator_embedded_meta.items() if k != "config"},
              "version": ver, "one_object": evaluate(gate_captions(version=ver), model=m)}
    if ns.two:
        report["two_objects"] = evaluate(gate_captions(n_objects=2, version=ver), model=m)
    report["seconds_per_clip"] = time_one_clip(model=m)
    report["gate"] = gate_verdict(report, model_version(m))
    print(json.dumps(report, indent=1))
