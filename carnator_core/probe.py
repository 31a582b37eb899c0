"""Early Probe: the first k steps of a request's real schedule, captured so nothing is wasted.

``run_probe`` runs the first ``k`` model calls of exactly the schedule the request will use (any resumable stock
sampler/scheduler, see ``comfy_patch.RESUMABLE_SAMPLERS``), records what the Early Signature needs (object-token
cross-attention in middle layers, the x0 prediction at step k) and what generation needs to resume exactly
(the denoised outputs of those k calls). Contract (tested): probe + dense resume equals a plain KSampler run
with the same seed and settings, and the input MODEL is unchanged. On a split schedule (``types.Stage``: a
KSamplerAdvanced stage, e.g. Wan 2.2 14B's high-noise expert over [0, switch)) the probe is the first k steps of
that stage, and probe + dense resume equals that KSamplerAdvanced node (tests/test_two_expert.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .cache.embed import embed_comfy_conditioning
from .types import GenConfig, ObjectTokens, Probe, Stage


class ProbeConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ProbeConfig:
    """How long the probe runs and where it looks.

    probe_steps:    number of sampling steps to probe (k). 0 = use ``probe_sigma`` or ``probe_fraction``.
    probe_sigma:    when > 0 (and probe_steps is 0): probe until the schedule's sigma first drops to this value or
                    below (k = first step index with sigma <= probe_sigma), so k follows the noise level, not the
                    step count — the same denoising progress whatever the steps and shift.
    probe_fraction: fraction of the schedule to probe when probe_steps and probe_sigma are 0 (rounded, >= 1).
    layers:         transformer blocks whose cross-attention is captured; empty = the middle layers
                    (all but ``first_dense`` first and ``last_dense`` last blocks).
    first_dense, last_dense: how many first/last blocks count as "outer" (not middle).
    context_kv_mb:  at the probe's last model call, keep every token's self-attention keys/values of every block
                    (on the CPU) when they fit in this many MiB; 0 (the default, as ``ReuseConfig.probe_context``
                    is off) = never, so no request pays the copy for nothing. The Early Probe node defaults to
                    ``reuse.RULE_CONTEXT_KV_MB``, the budget rules with ``probe_context`` were labelled under (it
                    cannot see the rule downstream; ``request.ServeOptions.following_rule`` can). A cache hit with ``probe_context``
                    then attends to them as its first context record instead of paying a dense refresh call. The
                    embedded model needs 2-9 MiB; Wan 2.1-1.3B at 480p x 81 frames about 12 GiB (over any sensible
                    budget: its hits refresh densely, as without it).
    """

    probe_steps: int = 0
    probe_fraction: float = 0.2
    probe_sigma: float = 0.0
    layers: tuple[int, ...] = ()
    first_dense: int = 1
    last_dense: int = 1
    context_kv_mb: float = 0.0

    def resolve_steps(self, steps: int, sigmas: Sequence[float] | None = None, of: str = "the total steps") -> int:
        """The probe length k for a schedule (or a split schedule's stage: ``of`` names it in messages) of ``steps``
        steps (``sigmas``: its sigma schedule, needed for ``probe_sigma``). Raises ProbeConfigError naming the
        problem."""
        if steps < 2:
            raise ProbeConfigError(f"{of} = {steps}: a probed generation needs at least 2 steps")
        if self.probe_steps < 0:
            raise ProbeConfigError(f"probe_steps must be >= 0, got {self.probe_steps}")
        if not self.context_kv_mb >= 0:
            raise ProbeConfigError(f"context_kv_mb must be >= 0 (0 = keep no keys/values), got {self.context_kv_mb}")
        if self.probe_steps > 0:
            k = self.probe_steps
        elif self.probe_sigma > 0:
            if sigmas is None:
                raise ProbeConfigError("probe_sigma needs the sigma schedule")
            below = [i for i, s in enumerate(list(sigmas)[:steps]) if float(s) <= self.probe_sigma]
            if not below:
                raise ProbeConfigError(f"no step of this schedule reaches sigma <= {self.probe_sigma} before the end; "
                                       "raise probe_sigma")
            k = max(1, below[0])
        else:
            k = max(1, int(round(self.probe_fraction * steps)))
        if not 0.0 < self.probe_fraction < 1.0 and self.probe_steps == 0:
            raise ProbeConfigError(f"probe_fraction must be in (0, 1), got {self.probe_fraction}")
        if k >= steps:
            raise ProbeConfigError(
                f"probe steps ({k}) must be fewer than {of} ({steps}): the probe is the *start* of the "
                f"generation. Lower probe_steps (e.g. {max(1, steps // 5)}) or raise steps."
            )
        return k



def stage_bounds(stage: Stage, steps: int, second_model: str = "", second_connected: bool | None = None
                 ) -> tuple[int, int]:
    """(start, end) of the probe's stage in a schedule of ``steps`` steps, after checking that the stage and the
    second model fit together: a stage that returns leftover noise needs the model that continues it (its
    fingerprint is part of the namespace), and only such a stage has one. ``second_connected`` overrides
    "``second_model`` is set" (queue-time checks know only whether the input is linked). Raises
    ProbeConfigError naming the problem and its fix."""
    try:
        start, end = stage.bounds(steps)
    except ValueError as e:
        raise ProbeConfigError(str(e)) from None
    has_second = bool(second_model) if second_connected is None else second_connected
    if stage.leaves_noise(steps) and not has_second:
        raise ProbeConfigError(
            f"the probe's stage ends at step {end} of {steps} with leftover noise, so another model finishes the "
            "schedule: connect that model (Wan 2.2 14B: the low-noise expert; a single-model split: the same MODEL) "
            "to second_model, so the cache never mixes generations whose second stage differs")
    if has_second and not stage.leaves_noise(steps):
        raise ProbeConfigError(
            f"second_model is connected but the probe's stage [{start}, {end}) of {steps} steps does not return "
            "leftover noise for it: set end_at_step to the switch step and return_with_leftover_noise to enable, or "
            "disconnect second_model")
    return start, end


def run_probe(model: Any, positive, negative, latent: dict, *, seed: int, steps: int, cfg: float, sampler_name: str,
              scheduler: str, prompt: str, objects: tuple[ObjectTokens, ...], object_source: str,
              config: ProbeConfig = ProbeConfig(), denoise: float = 1.0,
              progress: Callable[[int], None] | None = None, stage: Stage = Stage(),
              second_model: str = "") -> Probe:
    """Probe one request. Raises ProbeConfigError / UnsupportedModelError / UnsupportedSamplerError with a message
    naming the problem. The input MODEL is only cloned, never modified.

    ``stage``: the steps of the schedule this model runs (a split schedule's stage, KSamplerAdvanced semantics); the
    probe is the first k of *its* steps. ``second_model``: the fingerprint of the model that continues a stage
    returning leftover noise (``comfy_patch.model_fingerprint``); both go into the config (the namespace)."""
    from . import comfy_patch as cp  # ComfyUI-dependent: imported only when a model is actually probed
    from .adapters import adapter_for

    t_all = time.perf_counter()
    adapter = adapter_for(model)
    cp.check_sampler(sampler_name)
    start, end = stage_bounds(stage, steps, second_model)
    sigmas = cp.compute_sigmas(model, steps, sampler_name, scheduler, denoise).tolist() \
        if config.probe_sigma > 0 else None
    k = config.resolve_steps(end - start, sigmas[start:end + 1] if sigmas is not None else None,
                             of="the total steps" if stage.is_whole(steps) else f"the steps of its stage [{start}, {end})")
    if not isinstance(latent, dict) or "samples" not in latent:
        raise ProbeConfigError("latent must be a ComfyUI LATENT (a dict with 'samples')")
    samples = latent["samples"]
    if samples.ndim != 5:
        raise ProbeConfigError(
            f"latent has shape {tuple(samples.shape)}; a video model needs [B, C, T, H, W]. Use an empty video "
            "latent node for this model (EmptyHunyuanLatentVideo / EmptyLTXVLatentVideo / Carnator Embedded Empty Latent)."
        )
    samples = cp.prepare_latent(model, latent)
    n_layers = adapter.num_layers(model)
    layers = config.layers or adapter.middle_layers(model, config.first_dense, config.last_dense) or tuple(range(n_layers))
    bad = [i for i in layers if not 0 <= i < n_layers]
    if bad:
        raise ProbeConfigError(f"capture layers {bad} do not exist: the model has {n_layers} blocks (0..{n_layers - 1})")
    raw = cp.probe_sample(model, positive, negative, latent, seed, steps, cfg, sampler_name, scheduler, k,
                          cp.CaptureConfig(objects=objects, layers=tuple(layers)), denoise=denoise, progress=progress,
                          stage=stage, kv_budget_bytes=int(config.context_kv_mb * 2 ** 20))
    t_fp = time.perf_counter()
    fingerprint = cp.model_fingerprint(model, adapter.arch)
    fp_ms = (time.perf_counter() - t_fp) * 1000
    gen = GenConfig(arch=adapter.arch, latent_shape=tuple(int(x) for x in samples.shape[1:]), steps=int(steps),
                    sampler=sampler_name, scheduler=scheduler, cfg=float(cfg),
                    sigmas_digest=cp.sigmas_digest(raw.sigmas), probe_steps=k, start_step=start,
                    end_step=0 if end == steps else end, add_noise=bool(stage.add_noise),
                    leftover_noise=stage.leaves_noise(steps), second_model=second_model)
    factors, bias = cp.latent_rgb(model)
    maps = dict(raw.object_maps)
    for o in objects:  # objects without tokens get an empty map (the signature says so)
        maps.setdefault(o.name, np.zeros(raw.grid, dtype=np.float32))
    x0 = raw.replay[-1]
    note = "" if objects else "no recognisable objects in the prompt: the signature will be context-only"
    if raw.fallbacks:
        note = (note + "; " if note else "") + "; ".join(raw.fallbacks)
    try:
        embedding = embed_comfy_conditioning(positive)
    except ValueError as e:
        # An empty, emoji-only or fully truncated prompt leaves no usable token: the request still runs (dense,
        # as a plain KSampler would); it is just neither retrieved against nor stored.
        embedding = None
        note = (note + "; " if note else "") + f"no cache retrieval for this prompt ({e}); it continues dense"
    return Probe(
        arch=adapter.arch, model_fingerprint=fingerprint, config=gen, prompt=prompt, seed=int(seed),
        objects=tuple(objects), object_source=object_source, object_maps=maps, grid=raw.grid, patch=adapter.patch_of(model),
        x0_probe=_first_cond_row(x0).detach().cpu(), latent_probe=raw.latent_at_k[0].detach().cpu(),
        latent_rgb_factors=factors, latent_rgb_bias=bias, embedding=embedding,
        replay=tuple(r.detach().cpu() for r in raw.replay), sigmas=tuple(float(s) for s in raw.sigmas),
        context_kv=raw.context_kv, context_kv_mb=float(config.context_kv_mb),
        capture_layers=tuple(int(i) for i in config.layers),
        timings={"probe_ms": raw.seconds * 1000, "fingerprint_ms": fp_ms,
                 "total_ms": (time.perf_counter() - t_all) * 1000},
        note=note,
    )


def _first_cond_row(x: torch.Tensor) -> torch.Tensor:
    """The sampler-level denoised output is per latent batch item (after CFG): take item 0."""
    return x[0]


def word_tokens_for(prompt: str, clip: Any | None) -> list[tuple[int, int]]:
    """(conditioning position, 1-based whitespace word id) pairs for ``prompt`` under ``clip``'s tokenizer.

    A text encoder may provide ``carnator_word_tokens(prompt)`` itself (the embedded model's does); a stock
    ComfyUI CLIP is tokenized with ``return_word_ids=True``. Without a tokenizer nothing can be located: [].
    """
    if clip is None:
        return []
    own = getattr(clip, "carnator_word_tokens", None)
    if callable(own):
        return list(own(prompt))
    from .comfy_tokens import comfy_word_tokens

    return list(comfy_word_tokens(clip, prompt))


def objects_for(prompt: str, clip: Any | None, override: str | None) -> tuple[tuple[ObjectTokens, ...], str]:
    """Objects named by the prompt (or the user's override) with their conditioning token positions."""
    from .objects import extract_objects, token_positions

    phrases, source = extract_objects(prompt, override)
    if not phrases:
        return (), "none"
    objects = token_positions(prompt, phrases, word_tokens_for(prompt, clip))
    return canonical_objects(objects, clip), source


def canonical_objects(objects: tuple[ObjectTokens, ...], clip: Any | None) -> tuple[ObjectTokens, ...]:
    """Rename objects by the text encoder's ``carnator_canonical_name(noun)`` hook when it has one.

    Objects are matched across requests by name, and "a named object on one side only" rejects reuse; a model
    whose text encoder maps synonyms to one concept (the embedded model does) says so through this hook, so a
    paraphrase ("wedge" for "triangle") still matches. Names stay unique ("ball", "ball#2"). Without the hook
    (stock CLIPs) names are the prompt's lemmas, unchanged."""
    canon = getattr(clip, "carnator_canonical_name", None)
    if not callable(canon) or not objects:
        return tuple(objects)
    import dataclasses

    from .objects import _unique_names

    heads = [str(canon(o.name.split("#", 1)[0])) or o.name for o in objects]
    return tuple(dataclasses.replace(o, name=n) for o, n in zip(objects, _unique_names(heads)))
