"""Train the embedded model (ComfyUI WanModel) on the procedural world with rectified-flow matching.

Run from the repository root with the host python. v3 trains in resumable chunks (docs/MODEL_CARD.md has the
chunk log); every chunk is the same command, which starts the run when ``--state`` holds no state yet and
otherwise continues it:

    # stage 1 (velocity prediction; its committed state at step 7 359 is the warm start's source):
    OMP_NUM_THREADS=1 .host/venv/bin/python -m carnator_core.embedded.train --version v3 \\
        --state carnator_core/embedded/weights/train_state_v3 --steps 20000 --chunk-minutes 150 --threads 1
    # stage 2 (x0 prediction), after exporting stage 1's EMA with ``... --export runs/v3r_s7359.safetensors``:
    OMP_NUM_THREADS=1 .host/venv/bin/python -m carnator_core.embedded.train --version v3 --prediction x0 \\
        --init runs/v3r_s7359.safetensors --state carnator_core/embedded/weights/train_state_v3x0 --steps 12000 \\
        --chunk-minutes 140 --threads 1
    # stage 4 (the motion sign: --motion-axes, --coord-time-scale, --high-sigma-share):
    # docs/history/MODEL_CARD_HISTORY.md, "Stage 4"

v2 (the shipped default weights; one uninterrupted run whose schedule ended with its time budget):

    .host/venv/bin/python -m carnator_core.embedded.train --freeze-text-embedding \\
        --out carnator_core/embedded/weights/carnator_embedded_v2.safetensors --minutes 125 --steps 20000 --seed 0

Recipe (why each choice, see docs/MODEL_CARD.md): scenes rendered on the fly from a seeded generator
(held-out attribute combinations never drawn); x_t = (1 - s) x0 + s eps, the model predicts the velocity
eps - x0 at timestep 1000 s (ComfyUI's discrete-flow convention, so stock samplers apply it unchanged);
(with ``--prediction x0`` the model outputs x0 and the loss is that of the velocity it implies; see ``Recipe``);
s from a logit-normal distribution pushed towards high noise with the inference shift (layout is decided
at high noise); the loss is up-weighted on object pixels (v2: x(1 + object_weight) on the union of the
objects; v3: each object gets ``object_share`` of the clip's loss weight whatever its size, so a small object
of a two-object clip counts as much as a big one); AdamW with linear warm-up and cosine decay driven by
progress = max(step / steps, elapsed / budget) (v3 sets no time budget, so its schedule, and with it the
weights, depend only on the seed and the step count, not on how fast the machine was or how the run was
chunked); an EMA copy of the weights is what gets exported (fp16 safetensors with the config, seed and
progress in the metadata).

Resumable state (``--state DIR``): ``state.safetensors`` (trainable weights and EMA in fp16, AdamW moments in
bf16, the torch generator state; its metadata holds step, elapsed time, chunk log, recipe, the numpy
generator state and a checksum of the frozen text projection, which is rebuilt from the seed) and
``state.json`` (a readable copy of that metadata), written every ``--ckpt-minutes`` and at the end of a chunk;
no pickle. The live run is rounded to exactly what it stores at every save, so a run resumed
from a state continues bit for bit as the run that wrote it (tests/test_embedded_train.py), at the same
thread count. v3's state is 18.6 MB.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from . import codec, config, text, world
from .model import build_wan

STATE_FORMAT = "carnator-embedded-train-state-1"
# v3's per-object loss share. 1.0 (each object weighs as much as the rest of the clip): at 0.3 a v3-sized model
# routed its cross-attention to the padding slots and never read position words
# (docs/history/MODEL_CARD_HISTORY.md, "v3's recipe fix"); at 1.0 the same model reads them within ~700 steps.
V3_OBJECT_SHARE = 1.0
_W_DTYPE = torch.float16  # stored weights and EMA
_M_DTYPE = torch.bfloat16  # stored AdamW moments (bf16: squared gradients underflow in fp16)


@dataclass(frozen=True)
class Recipe:
    """Everything that defines a training run's result besides the code: fixed when a run starts, stored in
    its state, and enforced when it resumes."""

    version: str = "v2"
    seed: int = 0
    steps: int = 100000
    minutes: Optional[float] = None  # total wall-clock budget over all chunks (None: the step budget alone)
    batch: int = 8
    lr: float = 1e-3
    warmup: int = 100
    ema: float = 0.998
    object_weight: float = 4.0  # v2's loss weighting (used when object_share is None)
    object_share: Optional[float] = None  # v3's per-object loss weighting
    p_drop: float = 0.1
    p_two: Optional[float] = None  # None: the version's fraction of two-object clips
    freeze_text_embedding: bool = False
    model_overrides: dict[str, Any] = field(default_factory=dict)  # tiny configs for tests only
    # What the denoiser outputs: "v" (the flow velocity eps - x0, ComfyUI's FLOW convention) or "x0" (the clean
    # latent; ComfyUI samples it through ``comfy_glue.ModelSamplingFlowX0``). The loss is the same velocity loss
    # either way (for "x0" computed from the implied velocity), so only the parameterisation differs: a "v"
    # model must carry every noise value of a token through its residual stream to predict it, which v3's width
    # of 128 (= the 128 latent values of a token) cannot do cleanly
    # (docs/history/MODEL_CARD_HISTORY.md, "v3's background noise").
    prediction: str = "v"
    # Warm start: an exported weights file whose tensors initialise the model (its final projection is zeroed
    # when the file was trained with another prediction), identified by its SHA-256 so a resume cannot
    # silently mix files. None: a fresh initialisation from the seed.
    init: Optional[str] = None
    init_sha256: Optional[str] = None
    # High-noise share: this fraction of every batch (rounded to whole clips) takes its sigma uniformly from
    # [high_sigma_min, 1] instead of the shifted logit-normal. Why: near sigma = 1 the noisy input carries no
    # trace of the clip, so only the caption can say where an object is in each frame; below ~0.9 the object is
    # already visible in the noise and a model can follow it instead. v3 learned that route and never read the
    # motion direction (docs/history/MODEL_CARD_HISTORY.md, "Stage 4"); the sampler's first steps run at sigma
    # 1.0-0.95, where a direction-blind model picks the direction by chance. The logit-normal puts ~3 % of its draws
    # there.
    high_sigma_share: float = 0.0
    high_sigma_min: float = 0.95
    # The t coordinate ramp's scale (``codec.coord_channels(time_scale=...)``), stored in the exported file's
    # metadata so inference feeds the same channels. > 1 makes "which frame am I" a louder input; with it (and a
    # stronger rate) a warm-started v3 starts to read the motion direction
    # (docs/history/MODEL_CARD_HISTORY.md, "Stage 4").
    coord_time_scale: float = 1.0
    # Direction words as axis + signed direction in the text encoder (``text.encode(motion_axes=...)``; 0: each
    # direction its own random concept, as v2 and v3's first stages), stored in the exported metadata.
    motion_axes: float = 0.0


def make_batch(rng: np.random.Generator, batch: int, p_drop: float, *, frame: world.Frame = world.DEFAULT_FRAME,
               p_two: float = 0.3, text_version: Optional[str] = None, motion_axes: float = 0.0,
               scene_filter: Optional[Callable[[world.Scene], bool]] = None) -> dict[str, Any]:
    """Render ``batch`` fresh training clips: latents [B,16,T,h,w], contexts [B,L,D], the union object mask
    [B,T,h,w] and the per-object masks (a list of [n_objects,T,h,w] per clip). ``scene_filter`` (diagnostics
    only, e.g. the motion-sign probe of docs/MODEL_CARD.md: never part of a recipe) redraws scenes it rejects."""
    rgbs, masks, per_object, conds = [], [], [], []
    for _ in range(batch):
        scene = world.sample_scene(rng, p_two=p_two, frame=frame)
        while scene_filter is not None and not scene_filter(scene):
            scene = world.sample_scene(rng, p_two=p_two, frame=frame)
        rgb, alpha = world.render(scene, frame)
        prompt = "" if rng.random() < p_drop else world.caption(scene, rng)
        rgbs.append(rgb)
        masks.append(alpha.max(axis=0))
        per_object.append(codec.mask_to_latent(alpha))
        conds.append(text.encode(prompt, warn=False, version=text_version, motion_axes=motion_axes).cond)
    x0 = codec.rgb_to_latent(np.stack(rgbs))
    mask = codec.mask_to_latent(np.stack(masks))
    return {"x0": x0, "mask": mask, "objects": per_object, "context": torch.from_numpy(np.stack(conds))}


def loss_weights(b: dict[str, Any], recipe: Recipe) -> torch.Tensor:
    """[B, 1, T, h, w] per-cell loss weights (see the module docstring)."""
    if recipe.object_share is None:
        return 1.0 + recipe.object_weight * b["mask"][:, None]
    out = []
    for masks in b["objects"]:
        w = torch.ones(masks.shape[1:])
        for m in masks:
            w = w + recipe.object_share * m.numel() / max(float(m.sum()), 1.0) * m
        out.append(w)
    return torch.stack(out)[:, None]


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load_init(model: torch.nn.Module, path: Path, recipe: "Recipe", model_cfg: dict[str, Any]) -> None:
    """Initialise ``model``'s trainable tensors from an exported weights file (warm start; see ``Recipe.init``).
    The frozen text projection must be the one the run's seed builds (checked), so a resumed run, which rebuilds
    it from the seed, has the same. When the file was trained with another prediction the final projection is
    zeroed, so the new output starts at 0 instead of at the old parameterisation's values."""
    from safetensors import safe_open

    if not path.exists():
        raise FileNotFoundError(f"--init {path}: no such weights file (export one with --state ... --export)")
    sha = file_sha256(path)
    if recipe.init_sha256 is not None and sha != recipe.init_sha256:
        raise ValueError(f"--init {path} has SHA-256 {sha[:12]}..., but the run was started from "
                         f"{recipe.init_sha256[:12]}...: resume with the same file")
    with safe_open(str(path), framework="pt") as f:
        meta = {k: json.loads(v) for k, v in (f.metadata() or {}).items()}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if meta.get("config") != json.loads(json.dumps(model_cfg)):
        raise ValueError(f"--init {path}: its model config differs from the run's ({meta.get('config')})")
    state = model.state_dict()
    missing = sorted(set(state) - set(tensors))
    if missing:
        raise ValueError(f"--init {path}: missing tensors {missing[:5]}")
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    # The file holds fp16 copies; the seeded fp32 tensors stay (a resumed run rebuilds them from the seed).
    changed = [n for n in frozen if not torch.equal(tensors[n].float(), state[n].to(tensors[n].dtype).float())]
    if changed:
        raise ValueError(f"--init {path}: its frozen tensors ({changed[:3]}) are not the ones seed {recipe.seed} "
                         "builds; warm-start with the seed the file was trained with")
    with torch.no_grad():
        for k, v in state.items():
            if k not in frozen:
                v.copy_(tensors[k].to(v.dtype))
        if meta.get("prediction", "v") != recipe.prediction:
            model.head.head.weight.zero_()
            model.head.head.bias.zero_()


def sample_sigmas(gen: torch.Generator, n: int, shift: float, *, high_share: float = 0.0,
                  high_min: float = 0.95) -> torch.Tensor:
    """Logit-normal(0, 1) times, then the discrete-flow shift (more mass at high noise); the first
    ``round(high_share * n)`` of them instead uniform in [high_min, 1] (``Recipe.high_sigma_share``). With
    ``high_share`` 0 the generator is drawn exactly as before the option existed (older runs resume bit for bit)."""
    u = torch.sigmoid(torch.randn(n, generator=gen))
    sigma = shift * u / (1.0 + (shift - 1.0) * u)
    k = int(round(high_share * n))
    if k > 0:
        sigma[:k] = high_min + (1.0 - high_min) * torch.rand(k, generator=gen)
    return sigma


def save_weights(ema: dict[str, torch.Tensor], path: Path, meta: dict) -> None:
    """fp16 safetensors of ``ema`` with JSON-encoded ``meta`` (what comfy_glue.load_embedded reads)."""
    from safetensors.torch import save

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in ema.items()}
    # safetensors writes the metadata in hash-map order, which changes from process to process; the header is
    # rewritten with sorted keys so an export from a committed state reproduces a warm start's file (and its
    # SHA-256, part of the recipe) byte for byte.
    blob = save(tensors, metadata={k: json.dumps(v) for k, v in meta.items()})
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
    with tmp.open("wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + blob[8 + n:])
    os.replace(tmp, path)


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(tensors):
        h.update(k.encode())
        h.update(tensors[k].detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:24]


class Trainer:
    """One training run: build (or resume) the model, optimizer, EMA and generators; ``run`` trains."""

    def __init__(self, recipe: Recipe, state_dir: Optional[Path] = None, threads: int = 1,
                 scene_filter: Optional[Callable[[world.Scene], bool]] = None) -> None:
        self.recipe = recipe
        self.scene_filter = scene_filter  # diagnostics only (make_batch); a saved state never uses one
        self.state_dir = state_dir
        self.version = config.version(recipe.version)
        self.frame = world.Frame(self.version.frames, self.version.height, self.version.width)
        self.p_two = self.version.p_two if recipe.p_two is None else recipe.p_two
        self.threads = threads
        torch.set_num_threads(threads)
        torch.manual_seed(recipe.seed)
        self.rng = np.random.default_rng(recipe.seed)
        self.gen = torch.Generator().manual_seed(recipe.seed + 1)
        self.model_cfg = {**self.version.model_config(), **recipe.model_overrides}
        self.model = build_wan(init=True, **self.model_cfg)
        if recipe.prediction not in config.PREDICTIONS:
            raise ValueError(f"prediction must be one of {config.PREDICTIONS}, not {recipe.prediction!r}")
        if not 0.0 <= recipe.motion_axes <= config.MAX_MOTION_AXES:
            raise ValueError(f"--motion-axes must be in [0, {config.MAX_MOTION_AXES:g}], not {recipe.motion_axes}")
        if not 0.0 < recipe.coord_time_scale <= config.MAX_COORD_TIME_SCALE:
            raise ValueError(f"--coord-time-scale must be in (0, {config.MAX_COORD_TIME_SCALE:g}], not "
                             f"{recipe.coord_time_scale}")
        if not (0.0 <= recipe.high_sigma_share <= 1.0 and 0.0 <= recipe.high_sigma_min < 1.0):
            raise ValueError(f"--high-sigma-share must be in [0, 1] (got {recipe.high_sigma_share}) and "
                             f"--high-sigma-min in [0, 1) (got {recipe.high_sigma_min})")
        if recipe.freeze_text_embedding:
            for p in self.model.text_embedding.parameters():
                p.requires_grad_(False)
        # A warm start reads its file only when the run starts: a resumed state holds every trained tensor, and
        # the frozen ones are rebuilt from the seed (load_init checks the file agrees with them).
        if recipe.init is not None and not (state_dir is not None and (state_dir / "state.safetensors").exists()):
            load_init(self.model, Path(recipe.init), recipe, self.model_cfg)
        self.model.train()
        self.names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        named = dict(self.model.named_parameters())
        self.params = [named[n] for n in self.names]
        decay = [p for p in self.params if p.dim() >= 2]
        no_decay = [p for p in self.params if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                                      {"params": no_decay, "weight_decay": 0.0}],
                                     lr=recipe.lr, betas=(0.9, 0.98), eps=1e-8)
        self.ema = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.frozen = {n: p.detach().clone() for n, p in self.model.named_parameters() if not p.requires_grad}
        self.frozen_digest = _digest(self.frozen)
        self.coords = codec.coord_channels(*self.version.latent_shape[1:], scale=self.version.coord_scale,
                                           octaves=self.version.coord_octaves,
                                           time_scale=recipe.coord_time_scale)[None]
        self.step = 0
        self.elapsed_s = 0.0  # training time over all chunks
        self.chunks: list[dict[str, Any]] = []

    # --- state ------------------------------------------------------------------------------------------
    def _round_live_state(self) -> None:
        """Round the live state to the stored precision (so resuming from the file is bit-exact)."""
        with torch.no_grad():
            for p in self.params:
                p.copy_(p.to(_W_DTYPE).float())
                st = self.opt.state.get(p)
                if st:
                    st["exp_avg"].copy_(st["exp_avg"].to(_M_DTYPE).float())
                    st["exp_avg_sq"].copy_(st["exp_avg_sq"].to(_M_DTYPE).float())
            for k in self.ema:
                self.ema[k].copy_(self.ema[k].to(_W_DTYPE).float())

    def save_state(self) -> None:
        """Write ``state.safetensors`` + ``state.json`` atomically into ``state_dir``."""
        from safetensors.torch import save_file

        assert self.state_dir is not None
        if self.scene_filter is not None:
            raise ValueError("a run with a scene_filter is a diagnostic, not a recipe: it keeps no resumable state")
        self._round_live_state()
        tensors: dict[str, torch.Tensor] = {"rng.torch": self.gen.get_state().clone()}
        adam_steps = []
        for n, p in zip(self.names, self.params):
            tensors["w." + n] = p.detach().to(_W_DTYPE).contiguous()
            st = self.opt.state.get(p)
            if st:
                tensors["m." + n] = st["exp_avg"].to(_M_DTYPE).contiguous()
                tensors["v." + n] = st["exp_avg_sq"].to(_M_DTYPE).contiguous()
                adam_steps.append(float(st["step"]))
        for k, v in self.ema.items():
            if k not in self.frozen:
                tensors["ema." + k] = v.to(_W_DTYPE).contiguous()
        meta = {"format": STATE_FORMAT, "recipe": asdict(self.recipe), "model_config": self.model_cfg,
                "step": self.step, "elapsed_s": round(self.elapsed_s, 3), "chunks": self.chunks,
                "adam_step": adam_steps[0] if adam_steps else 0.0, "numpy_rng": self.rng.bit_generator.state,
                "frozen_digest": self.frozen_digest, "threads": self.threads}
        self.state_dir.mkdir(parents=True, exist_ok=True)
        tmp_t, tmp_j = self.state_dir / "state.safetensors.tmp", self.state_dir / "state.json.tmp"
        # The tensors file carries the metadata too, so it alone is the state (one atomic rename); state.json
        # is a readable copy.
        save_file(tensors, str(tmp_t), metadata={"state": json.dumps(meta)})
        tmp_j.write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(tmp_t, self.state_dir / "state.safetensors")
        os.replace(tmp_j, self.state_dir / "state.json")

    def load_state(self) -> None:
        """Continue from ``state_dir`` (errors say what does not match and how to fix it)."""
        from safetensors import safe_open
        from safetensors.torch import load_file

        assert self.state_dir is not None
        path = self.state_dir / "state.safetensors"
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("state", "{}"))
        if meta.get("format") != STATE_FORMAT:
            raise ValueError(f"{self.state_dir}: not a training state of this trainer (format "
                             f"{meta.get('format')!r}, expected {STATE_FORMAT!r})")
        stored = Recipe(**meta["recipe"])
        if stored != self.recipe:
            raise ValueError(f"{self.state_dir} was started with {stored}, not {self.recipe}: resume with the "
                             "run's own settings (drop the flags that differ) or start a new --state directory")
        if meta["frozen_digest"] != self.frozen_digest:
            raise ValueError(f"{self.state_dir}: the frozen text projection rebuilt from seed {stored.seed} "
                             "differs from the one the run started with (changed initialisation code?)")
        tensors = load_file(str(path))
        with torch.no_grad():
            for n, p in zip(self.names, self.params):
                p.copy_(tensors["w." + n].float())
                if "m." + n in tensors:
                    self.opt.state[p] = {"step": torch.tensor(float(meta["adam_step"])),
                                         "exp_avg": tensors["m." + n].float(),
                                         "exp_avg_sq": tensors["v." + n].float()}
            for k in self.ema:
                self.ema[k] = tensors["ema." + k].float() if k not in self.frozen else self.frozen[k].clone()
        self.gen.set_state(tensors["rng.torch"])
        self.rng.bit_generator.state = meta["numpy_rng"]
        self.step = int(meta["step"])
        self.elapsed_s = float(meta["elapsed_s"])
        self.chunks = list(meta["chunks"])

    def state_bytes(self) -> int:
        assert self.state_dir is not None
        return sum((self.state_dir / f).stat().st_size for f in ("state.safetensors", "state.json"))

    # --- training ---------------------------------------------------------------------------------------
    def progress(self) -> float:
        r = self.recipe
        p = self.step / r.steps
        if r.minutes is not None:
            p = max(p, self.elapsed_s / (r.minutes * 60.0))
        return p

    def train_step(self) -> float:
        """One optimizer step; returns the loss."""
        r = self.recipe
        lr = r.lr * min(1.0, (self.step + 1) / r.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * self.progress())))
        for g in self.opt.param_groups:
            g["lr"] = lr
        b = make_batch(self.rng, r.batch, r.p_drop, frame=self.frame, p_two=self.p_two,
                       text_version=self.version.name, motion_axes=r.motion_axes, scene_filter=self.scene_filter)
        x0 = b["x0"]
        sigma = sample_sigmas(self.gen, r.batch, config.SHIFT, high_share=r.high_sigma_share,
                              high_min=r.high_sigma_min)
        eps = torch.randn(x0.shape, generator=self.gen)
        s = sigma.view(-1, 1, 1, 1, 1)
        xt = (1.0 - s) * x0 + s * eps
        inp = torch.cat([xt, self.coords.expand(r.batch, -1, -1, -1, -1)], dim=1)
        out = self.model(inp, sigma * 1000.0, b["context"])
        w = loss_weights(b, r)
        if r.prediction == "x0":
            # The velocity loss through the x0 output: v_hat - v = (x0 - x0_hat) / s (s floored: below 0.02 the
            # logit-normal draws almost never land, and 1/s^2 would only amplify float noise there).
            err = (x0 - out) / s.clamp(min=0.02)
        else:
            err = out - (eps - x0)
        loss = (w * err ** 2).mean() / w.mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.step += 1
        d = min(r.ema, (1.0 + self.step) / (10.0 + self.step))
        with torch.no_grad():
            for k, v in self.model.state_dict().items():
                if k not in self.frozen:
                    self.ema[k].mul_(d).add_(v.detach(), alpha=1.0 - d)
        self.last_lr = lr
        return float(loss.detach())

    def export_meta(self, final: bool) -> dict[str, Any]:
        r = self.recipe
        return {"config": self.model_cfg, "version": r.version, "seed": r.seed, "init": r.init,
                "init_sha256": r.init_sha256, "prediction": r.prediction,
                "freeze_text_embedding": r.freeze_text_embedding, "batch": r.batch, "lr": r.lr,
                "shift": config.SHIFT, "object_weight": r.object_weight, "object_share": r.object_share,
                "p_drop": r.p_drop, "p_two": self.p_two, "high_sigma_share": r.high_sigma_share,
                "high_sigma_min": r.high_sigma_min, "coord_time_scale": r.coord_time_scale,
                "motion_axes": r.motion_axes, "steps": self.step,
                "minutes": round(self.elapsed_s / 60.0, 2), "final": final, "format": "carnator-embedded-v1"}

    def run(self, *, chunk_minutes: Optional[float], ckpt_minutes: float, ckpt_steps: Optional[int] = None,
            max_steps: Optional[int] = None, log: Optional[Path] = None, out: Optional[Path] = None,
            snapshot: Optional[Path] = None) -> None:
        """Train until the schedule ends, this chunk's time is up or ``max_steps`` steps of this call ran.

        Saves the state (when ``state_dir``) every ``ckpt_minutes`` / ``ckpt_steps`` and at the end; exports
        the EMA weights to ``snapshot`` at every save and to ``out`` when the schedule ends.
        """
        start = time.time()
        chunk = {"start_step": self.step, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "threads": self.threads}
        self.chunks.append(chunk)
        last_ckpt = time.time()
        losses: list[float] = []
        logf = None
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            logf = log.open("a")
        ran = 0

        def save() -> None:
            chunk.update({"end_step": self.step, "minutes": round((time.time() - start) / 60.0, 2)})
            if self.state_dir is not None:
                self.save_state()
            if snapshot is not None:
                save_weights(self.ema, snapshot, self.export_meta(final=False))

        while self.progress() < 1.0:
            if chunk_minutes is not None and time.time() - start >= chunk_minutes * 60.0:
                break
            if max_steps is not None and ran >= max_steps:
                break
            t0 = time.time()
            losses.append(self.train_step())
            dt = time.time() - t0
            self.elapsed_s += dt
            ran += 1
            if self.step % 25 == 0:
                rec = {"step": self.step, "min": round(self.elapsed_s / 60.0, 2),
                       "loss": round(float(np.mean(losses)), 5), "lr": round(self.last_lr, 7),
                       "s_per_step": round(dt, 3), "threads": self.threads}
                losses.clear()
                if logf is not None:
                    logf.write(json.dumps(rec) + "\n")
                    logf.flush()
                print(rec, flush=True)
            if (ckpt_steps is not None and self.step % ckpt_steps == 0) or \
                    (ckpt_steps is None and time.time() - last_ckpt >= ckpt_minutes * 60.0):
                save()
                last_ckpt = time.time()
        save()
        if self.progress() >= 1.0 and out is not None:
            save_weights(self.ema, out, self.export_meta(final=True))
            print(f"schedule finished: {self.step} steps, {self.elapsed_s / 60.0:.1f} min -> {out}", flush=True)
        if logf is not None:
            logf.close()


def _init_sha(init: Path, state: Optional[Path]) -> Optional[str]:
    """The --init file's SHA-256; when resuming a state without the file at hand (a fresh clone), the state's."""
    if init.exists():
        return file_sha256(init)
    if state is not None and (state / "state.json").exists():
        return json.loads((state / "state.json").read_text())["recipe"].get("init_sha256")
    raise SystemExit(f"--init {init}: no such weights file (export one with --state ... --export)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", default="v2", choices=sorted(config.VERSIONS))
    p.add_argument("--state", type=Path, default=None,
                   help="resumable training state directory: continued when it holds a state.safetensors, else "
                        "created")
    p.add_argument("--chunk-minutes", type=float, default=None, help="stop this chunk after this many minutes "
                   "(the state is saved; rerun the same command to continue)")
    p.add_argument("--out", type=Path, default=None,
                   help="final EMA weights (default: the version's file in carnator_core/embedded/weights)")
    p.add_argument("--snapshot", type=Path, default=None,
                   help="EMA weights written at every checkpoint (default with --state: runs/<version>_latest"
                        ".safetensors); comfy_glue.load_embedded and the gate script read it")
    p.add_argument("--minutes", type=float, default=None, help="total wall-clock budget (the schedule ends with "
                   "it; v2 used 125); default none: the step budget alone")
    p.add_argument("--steps", type=int, default=100000, help="step budget (the schedule ends with it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--ema", type=float, default=0.998)
    p.add_argument("--object-weight", type=float, default=4.0, help="v2: extra loss weight on object pixels")
    p.add_argument("--object-share", type=float, default=None,
                   help="per-object loss share (default: V3_OBJECT_SHARE = 1.0 for v3, v2's --object-weight "
                        "otherwise; <= 0: v2's "
                        "--object-weight on the union of the objects, for ablations)")
    p.add_argument("--prediction", choices=config.PREDICTIONS, default="v",
                   help="what the denoiser outputs: the flow velocity (v, ComfyUI's FLOW) or the clean latent (x0); "
                        "the loss is the velocity loss either way")
    p.add_argument("--init", type=Path, default=None,
                   help="warm start: an exported weights file (--export) whose trainable tensors initialise a new "
                        "run (read only when the run starts; its SHA-256 is part of the recipe)")
    p.add_argument("--p-drop", type=float, default=0.1, help="caption dropout (for classifier-free guidance)")
    p.add_argument("--high-sigma-share", type=float, default=0.0,
                   help="fraction of each batch trained at sigma uniform in [--high-sigma-min, 1] (where only the "
                        "caption can place an object; see Recipe.high_sigma_share)")
    p.add_argument("--high-sigma-min", type=float, default=0.95)
    p.add_argument("--motion-axes", type=float, default=0.0,
                   help="encode direction words as axis + this x signed direction (stored in the weights' metadata; "
                        "see Recipe)")
    p.add_argument("--coord-time-scale", type=float, default=1.0,
                   help="scale of the t coordinate ramp (stored in the weights' metadata; see Recipe)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (keep it fixed across chunks: "
                   "a different count changes float summation order, so resumption is then only approximate)")
    p.add_argument("--ckpt-minutes", type=float, default=10.0)
    p.add_argument("--export", type=Path, default=None,
                   help="only write the EMA weights of the --state run to this file (loadable by comfy_glue) and "
                        "exit; for measuring the gate between chunks")
    p.add_argument("--log", type=Path, default=None, help="JSON lines log (default runs/embedded_train_<version>"
                   ".jsonl)")
    p.add_argument("--freeze-text-embedding", action="store_true",
                   help="keep WanModel.text_embedding at its random init (always on for v3): trained, its GELU "
                        "dies for every token that is not useful early (size/position/motion words)")
    args = p.parse_args(argv)

    v3_like = args.version != "v2"
    recipe = Recipe(version=args.version, seed=args.seed, steps=args.steps, minutes=args.minutes,
                    batch=args.batch, lr=args.lr, warmup=args.warmup, ema=args.ema,
                    object_weight=args.object_weight,
                    object_share=(None if args.object_share is not None and args.object_share <= 0 else
                                  args.object_share if args.object_share is not None else
                                  (V3_OBJECT_SHARE if v3_like else None)),
                    p_drop=args.p_drop, freeze_text_embedding=args.freeze_text_embedding or v3_like,
                    prediction=args.prediction, high_sigma_share=args.high_sigma_share,
                    high_sigma_min=args.high_sigma_min, coord_time_scale=args.coord_time_scale,
                    motion_axes=args.motion_axes,
                    init=None if args.init is None else args.init.as_posix(),
                    init_sha256=None if args.init is None else _init_sha(args.init, args.state))
    out = args.out or config.version(args.version).weights_path
    snapshot = args.snapshot or (Path(f"runs/{args.version}_latest.safetensors") if args.state else None)
    log = args.log or Path(f"runs/embedded_train_{args.version}.jsonl")
    trainer = Trainer(recipe, args.state, threads=args.threads)
    if args.state is not None and (args.state / "state.safetensors").exists():
        trainer.load_state()
        print(f"resuming {args.state} at step {trainer.step} ({trainer.elapsed_s / 60.0:.1f} min so far)", flush=True)
    if args.export is not None:
        if args.state is None or trainer.step == 0:
            raise SystemExit("--export needs --state with a saved training state")
        save_weights(trainer.ema, args.export, trainer.export_meta(final=trainer.progress() >= 1.0))
        print(f"exported the EMA weights at step {trainer.step} -> {args.export}", flush=True)
        return
    n_train = sum(p_.numel() for p_ in trainer.params)
    print(f"training {args.version}: {n_train / 1e6:.2f} M trainable params, {config.version(args.version).tokens} "
          f"tokens, schedule {recipe.steps} steps" + (f" / {recipe.minutes} min" if recipe.minutes else ""),
          flush=True)
    trainer.run(chunk_minutes=args.chunk_minutes, ckpt_minutes=args.ckpt_minutes, log=log, out=out,
                snapshot=snapshot)
    if args.state is not None:
        print(f"state: {args.state} ({trainer.state_bytes() / 1e6:.1f} MB), step {trainer.step} of "
              f"{recipe.steps}, {trainer.elapsed_s / 60.0:.1f} min in {len(trainer.chunks)} chunk(s)", flush=True)


if __name__ == "__main__":
    if __package__ in (None, ""):
        raise SystemExit("run as a module from the repository root: python -m carnator_core.embedded.train ...")
    main()
