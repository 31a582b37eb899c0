"""Immutable values passed between Carnator nodes (CARNATOR_* socket types) and stored in the cache.

Contract: every value here is a frozen dataclass. Arrays inside are never modified after construction
(producers pass fresh arrays; consumers copy before changing). Everything serialises to
safetensors-compatible tensors + JSON-able metadata (``to_tensors``/``to_meta`` and ``from_parts``):
cache files may come from someone else, so no pickle anywhere.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np


def stable_digest(obj: Any, n: int = 16) -> str:
    """Short sha256 hex digest of a JSON-able object (sorted keys), used for fingerprints."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:n]


# Version of what an Early Signature, its discrepancies and a reuse's active region mean (signature.py,
# risk/discrepancy.py, reuse.active_region: a rule's labels depend on all three). It is part
# of every config fingerprint, so a risk rule (whose thresholds are in these units) and cached signatures are
# never compared across versions. Bump it whenever either file changes what a value measures.
# 2: object colour from the distinct half of the support, size from the colour extent (was: attention mass);
#    a changed object is recomputed whole (ReuseConfig.whole_objects).
SIGNATURE_VERSION = 2


# KSamplerAdvanced's "to the end of the schedule" (its end_at_step default and maximum).
STAGE_END_MAX = 10000


@dataclass(frozen=True)
class Stage:
    """Which steps of the schedule one sampler runs, with ComfyUI's ``KSamplerAdvanced`` semantics.

    start_at_step, end_at_step: the sampler runs steps [start, min(end, steps)) of the schedule of ``steps``
                     steps (the end's default, 10000, is "to the end").
    add_noise:       add the seed's noise to the input latent (off: the latent already carries the noise the
                     previous stage left in it).
    return_with_leftover_noise: a stage that ends before the schedule does returns its latent at that sigma
                     (for a next stage to continue) instead of denoising it fully at its last step.
    """

    start_at_step: int = 0
    end_at_step: int = STAGE_END_MAX
    add_noise: bool = True
    return_with_leftover_noise: bool = False

    def bounds(self, steps: int) -> tuple[int, int]:
        """(start, end) clipped to a schedule of ``steps`` steps. Raises ValueError naming what is wrong."""
        if not 0 <= self.start_at_step <= STAGE_END_MAX or not 0 <= self.end_at_step <= STAGE_END_MAX:
            raise ValueError(f"start_at_step and end_at_step must be in [0, {STAGE_END_MAX}], got "
                             f"{self.start_at_step} and {self.end_at_step}")
        end = min(int(self.end_at_step), int(steps))
        if not int(self.start_at_step) < end:
            clipped = f", clipped to steps={steps}" if end < self.end_at_step else ""
            raise ValueError(f"start_at_step ({self.start_at_step}) must be below end_at_step "
                             f"({self.end_at_step}{clipped}): the stage would run no step")
        return int(self.start_at_step), end

    def is_whole(self, steps: int) -> bool:
        """The stage is the whole schedule with fresh noise: a plain KSampler run."""
        start, end = self.bounds(steps)
        return start == 0 and end == steps and self.add_noise

    def leaves_noise(self, steps: int) -> bool:
        """The stage stops before the end of the schedule and returns its latent with leftover noise."""
        return self.bounds(steps)[1] < steps and self.return_with_leftover_noise


@dataclass(frozen=True)
class GenConfig:
    """The generation configuration that must match for a cache entry to be reusable.

    Two requests may share cached computation only if every field here is equal (the seed is *not* part
    of the namespace: different seeds of the same config are exactly what cross-request reuse serves).
    """

    arch: str  # "wan21" | "wan22" | "ltxv" | "embedded"
    latent_shape: tuple[int, ...]  # (C, T, H, W) without batch
    steps: int
    sampler: str
    scheduler: str
    cfg: float
    sigmas_digest: str  # digest of the full sigma schedule (captures shift / model sampling / denoise)
    probe_steps: int

    # Digest of the conditioning beyond the prompt text (start image, concat latent, reference latents, a non-empty
    # input latent; ``keys.conditioning_digest``); "" for plain text-to-video. Part of the namespace, so a
    # generation is only ever reused for requests with the same start image; not part of ``rule_fingerprint``
    # (a risk rule is calibrated across start images as it is across prompts).
    conditioning: str = ""

    # The probe's stage of a split schedule (KSamplerAdvanced's start/end steps and switches; see ``Stage``), and
    # for a stage that returns leftover noise the fingerprint of the model that runs the rest of the schedule
    # (Wan 2.2 14B: the low-noise expert). Defaults: the whole schedule on one model, which fingerprints as a
    # config did before these fields existed. ``end_step`` 0 = the end of the schedule. A two-expert entry is
    # hence never reused for a single-model request, another switch step or another second expert.
    start_step: int = 0
    end_step: int = 0
    add_noise: bool = True
    leftover_noise: bool = False
    second_model: str = ""

    @property
    def split(self) -> bool:
        """The probe's stage is not the whole schedule with fresh noise (a split schedule)."""
        return self.start_step != 0 or self.end_step != 0 or not self.add_noise

    @property
    def stage_end(self) -> int:
        """The step the probe's stage ends at (``steps`` for a stage that runs to the end)."""
        return self.end_step or self.steps

    def probe_stage(self) -> Stage:
        """The probe's stage as a ``Stage``."""
        return Stage(self.start_step, self.stage_end, self.add_noise, self.leftover_noise)

    def _stage_meta(self) -> dict[str, Any]:
        if not self.split and not self.second_model:
            return {}
        return {"start_step": self.start_step, "end_step": self.end_step, "add_noise": self.add_noise,
                "leftover_noise": self.leftover_noise, "second_model": self.second_model}

    def fingerprint(self) -> str:
        """The namespace part of the config: every field, the conditioning digest included when set (a text-only
        config fingerprints as it did before the field existed)."""
        fp = self.rule_fingerprint()
        return fp if not self.conditioning else stable_digest({"config": fp, "conditioning": self.conditioning})

    def rule_fingerprint(self) -> str:
        """What a risk rule is calibrated for: the generation config without the request's conditioning."""
        parts: dict[str, Any] = {
            "arch": self.arch,
            "latent_shape": list(self.latent_shape),
            "steps": self.steps,
            "sampler": self.sampler,
            "scheduler": self.scheduler,
            "cfg": round(float(self.cfg), 6),
            "sigmas": self.sigmas_digest,
            "probe_steps": self.probe_steps,
            "signature_version": SIGNATURE_VERSION,
        }
        stage = self._stage_meta()
        if stage:  # a split schedule; a whole-schedule config keeps the fingerprint it always had
            parts["stage"] = stage
        return stable_digest(parts)

    def to_meta(self) -> dict[str, Any]:
        meta = {
            "arch": self.arch,
            "latent_shape": list(self.latent_shape),
            "steps": self.steps,
            "sampler": self.sampler,
            "scheduler": self.scheduler,
            "cfg": float(self.cfg),
            "sigmas_digest": self.sigmas_digest,
            "probe_steps": self.probe_steps,
        }
        if self.conditioning:
            meta["conditioning"] = self.conditioning
        meta.update(self._stage_meta())
        return meta

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "GenConfig":
        return cls(
            arch=str(meta["arch"]),
            latent_shape=tuple(int(x) for x in meta["latent_shape"]),
            steps=int(meta["steps"]),
            sampler=str(meta["sampler"]),
            scheduler=str(meta["scheduler"]),
            cfg=float(meta["cfg"]),
            sigmas_digest=str(meta["sigmas_digest"]),
            probe_steps=int(meta["probe_steps"]),
            conditioning=str(meta.get("conditioning", "")),
            start_step=int(meta.get("start_step", 0)),
            end_step=int(meta.get("end_step", 0)),
            add_noise=bool(meta.get("add_noise", True)),
            leftover_noise=bool(meta.get("leftover_noise", False)),
            second_model=str(meta.get("second_model", "")),
        )


def namespace_key(model_fingerprint: str, config: GenConfig) -> str:
    """The cache namespace: model x generation config. Entries are only ever reused within one namespace."""
    return f"{model_fingerprint[:16]}-{config.fingerprint()}"


@dataclass(frozen=True)
class ObjectSignature:
    """Early-signature facts about one named object.

    mask: float32 [T, H, W] in [0, 1] over the latent *token* grid (after patchify), the object's soft
          spatiotemporal support from cross-attention.
    size: relative size = mask mass / number of grid cells, in [0, 1].
    lab:  mean CIELAB colour (L, a, b) of the x0 prediction under the mask.
    """

    name: str
    mask: np.ndarray
    size: float
    lab: tuple[float, float, float]


@dataclass(frozen=True)
class Signature:
    """The Early Signature of one request.

    objects:     one entry per named object (may be empty: a context-only signature).
    context_lab: float32 [gh, gw, 3] CIELAB means of the non-object region on a coarse grid (cells with no
                 context pixels hold the global context mean).
    grid:        (T, H, W) of the token grid the masks live on.
    note:        human-readable remark (e.g. "no recognisable objects: context-only signature").
    """

    objects: tuple[ObjectSignature, ...]
    context_lab: np.ndarray
    grid: tuple[int, int, int]
    note: str = ""
    # Digest of the Signature Builder settings it was built with (``signature.SignatureConfig.digest``); "" = built
    # before signatures recorded them, i.e. with the defaults (``signature.settings_digest`` reads it so).
    config: str = ""

    def object_names(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.objects)

    def get(self, name: str) -> ObjectSignature | None:
        for o in self.objects:
            if o.name == name:
                return o
        return None

    def to_tensors(self, prefix: str = "sig.") -> dict[str, np.ndarray]:
        out = {f"{prefix}context_lab": np.ascontiguousarray(self.context_lab, dtype=np.float32)}
        for i, o in enumerate(self.objects):
            out[f"{prefix}mask.{i}"] = np.ascontiguousarray(o.mask, dtype=np.float32)
        return out

    def to_meta(self) -> dict[str, Any]:
        out = {
            "grid": list(self.grid),
            "note": self.note,
            "objects": [{"name": o.name, "size": float(o.size), "lab": [float(v) for v in o.lab]}
                        for o in self.objects],
        }
        if self.config:  # absent in signatures stored before it was recorded (their entries read the same)
            out["config"] = self.config
        return out

    @classmethod
    def from_parts(cls, meta: Mapping[str, Any], tensors: Mapping[str, np.ndarray],
                   prefix: str = "sig.") -> "Signature":
        objs = []
        for i, om in enumerate(meta["objects"]):
            key = f"{prefix}mask.{i}"
            if key not in tensors:
                raise ValueError(f"signature is missing tensor {key!r}: the cache entry is incomplete or corrupt")
            objs.append(
                ObjectSignature(
                    name=str(om["name"]),
                    mask=np.asarray(tensors[key], dtype=np.float32),
                    size=float(om["size"]),
                    lab=tuple(float(v) for v in om["lab"]),  # type: ignore[arg-type]
                )
            )
        return cls(
            objects=tuple(objs),
            context_lab=np.asarray(tensors[f"{prefix}context_lab"], dtype=np.float32),
            grid=tuple(int(x) for x in meta["grid"]),  # type: ignore[arg-type]
            note=str(meta.get("note", "")),
            config=str(meta.get("config", "")),
        )

    def nbytes(self) -> int:
        """Serialized size in bytes (tensors + JSON metadata)."""
        return sum(a.nbytes for a in self.to_tensors().values()) + len(json.dumps(self.to_meta()).encode())


@dataclass(frozen=True)
class Candidate:
    """One recalled cache entry, as the Risk Filter and the sampler see it."""

    entry_id: str
    similarity: float
    prompt: str
    signature: Signature
    seed: int | None = None


@dataclass(frozen=True)
class Candidates:
    """Top-K recall result for one request (same namespace only; may be empty)."""

    namespace: str
    items: tuple[Candidate, ...]
    retrieval_ms: float = 0.0
    note: str = ""
    answered: "ExactAnswer | None" = None  # an exact repeat answered before the probe: passed through, no recall
    # The recall that produced these candidates (request.recall sets them): top-``k`` of at least ``min_similarity``.
    # The Risk Filter refuses a recall narrower than the rule's (its certificate is about the rule's candidate set).
    # None = not recorded (candidates built elsewhere, e.g. in tests or by older code).
    k: int | None = None
    min_similarity: float | None = None


@dataclass(frozen=True)
class AxisCheck:
    axis: str  # "context" | "size" | "shape" | "appearance"
    value: float
    threshold: float

    @property
    def passed(self) -> bool:
        return self.value <= self.threshold


@dataclass(frozen=True)
class CandidateVerdict:
    entry_id: str
    similarity: float
    accepted: bool
    reason: str
    checks: tuple[AxisCheck, ...] = ()


@dataclass(frozen=True)
class Decision:
    """The Risk Filter's verdict for one request: the accepted candidate (or None) and why, per candidate."""

    accepted: bool
    candidate: Candidate | None
    verdicts: tuple[CandidateVerdict, ...]
    mode: str  # "signature" | "prompt_only" | "never"
    rule_id: str = ""
    filter_ms: float = 0.0
    summary: str = ""
    # The reuse settings (``ReuseConfig`` fields) the rule was certified with; the sampler reuses only with
    # exactly those. None: not recorded (rules made before they were; prompt-only and forced decisions).
    reuse_config: Mapping[str, Any] | None = None
    # Learning mode (carnator_core.learn): the rule file being learned, the namespace, the top candidate's stratum
    # and discrepancies, and whether this request is an audit; the sampler labels from it. None: no learning.
    learning: Mapping[str, Any] | None = None
    # The strata (what changed against the candidate) the deciding rule certified on their own, in its order; only a
    # candidate of one of them is ever served. None: the rule certifies on average only (no per-stratum section), or
    # no rule decided. An empty tuple: no stratum certified, so only exact repeats (answered before the filter) reuse.
    certified_strata: tuple[str, ...] | None = None

    def to_meta(self) -> dict[str, Any]:
        return {
            "accepted": self.accepted,
            "entry_id": self.candidate.entry_id if self.candidate else None,
            "mode": self.mode,
            "rule_id": self.rule_id,
            "certified_strata": list(self.certified_strata) if self.certified_strata is not None else None,
            "reuse_config": dict(self.reuse_config) if self.reuse_config is not None else None,
            "filter_ms": self.filter_ms,
            "summary": self.summary,
            "verdicts": [
                {
                    "entry_id": v.entry_id,
                    "similarity": v.similarity,
                    "accepted": v.accepted,
                    "reason": v.reason,
                    "checks": [{"axis": c.axis, "value": c.value, "threshold": c.threshold, "passed": c.passed}
                               for c in v.checks],
                }
                for v in self.verdicts
            ],
        }


@dataclass(frozen=True)
class BlockStructure:
    """Recorded attention block structure of a dense run (structure, not values).

    keep: bool [L, Hh, Qb, Kb] — for each recorded middle layer (L), head (Hh, or 1 if head-averaged),
          query block, which key blocks carry the attention mass.
    layers: the transformer block indices the rows refer to.
    block_size: tokens per block; n_tokens: sequence length the blocks tile.
    """

    keep: np.ndarray
    layers: tuple[int, ...]
    block_size: int
    n_tokens: int
    steps: tuple[int, ...] = ()

    @property
    def density(self) -> float:
        return float(self.keep.mean()) if self.keep.size else 1.0


@dataclass(frozen=True)
class ObjectTokens:
    """A named object and the positions of its word tokens (noun + its modifiers) in the conditioning."""

    name: str
    words: tuple[str, ...]
    positions: tuple[int, ...]


@dataclass(frozen=True)
class Probe:
    """Result of the Early Probe: the first k steps of the real schedule of one request.

    Tensors are batch item 0 unless stated. ``replay`` holds the sampler-level denoised outputs of the first
    k model calls (full batch), so generation resumes *exactly* (any deterministic one-call-per-step sampler):
    the resumed sampler re-runs the schedule from step 0 and gets these outputs back instead of model calls.
    """

    arch: str
    model_fingerprint: str
    config: GenConfig
    prompt: str
    seed: int
    objects: tuple[ObjectTokens, ...]
    object_source: str  # "user" | "spacy" | "vocabulary" | "none"
    object_maps: Mapping[str, np.ndarray]  # name -> float32 [T, H, W] cross-attention mass on the token grid
    grid: tuple[int, int, int]  # token grid (T, H, W) after patchify
    patch: tuple[int, int, int]  # latent cells per token (t, h, w)
    x0_probe: Any  # torch.Tensor [C, T, H, W] model-space x0 prediction at the last probe call
    latent_probe: Any  # torch.Tensor [C, T, H, W] sampler state entering step k
    latent_rgb_factors: np.ndarray | None  # [C, 3] latent -> RGB (ComfyUI latent format), or None
    latent_rgb_bias: np.ndarray | None  # [3]
    embedding: np.ndarray | None  # float32 [D] L2-normalised retrieval embedding; None: prompt not embeddable
    replay: tuple[Any, ...] = ()  # torch.Tensor per probe call: denoised (after CFG), full batch
    sigmas: tuple[float, ...] = ()  # the full schedule
    # Self-attention keys/values of every token at the last probe call, per (block, batch composition), on the CPU
    # (``ProbeConfig.context_kv_mb``); empty when over that budget. Read only: a hit's context, never mutated.
    context_kv: Mapping[tuple, tuple[Any, Any]] = field(default_factory=dict)
    # The budget (MiB) the probe was allowed to keep them under: empty ``context_kv`` under a budget of at least
    # ``reuse.RULE_CONTEXT_KV_MB`` means "they do not fit" (a certified hit then refreshes densely, as the
    # labelling did), under a smaller one "not asked for" (``reuse.sample``).
    context_kv_mb: float = 0.0
    # The blocks whose cross-attention it was asked to capture (``ProbeConfig.layers``; () = the model's default
    # middle layers): the object maps, and so the signature, depend on them.
    capture_layers: tuple[int, ...] = ()
    timings: Mapping[str, float] = field(default_factory=dict)  # ms per stage
    note: str = ""
    request_key: str = ""  # keys.request_key of the request ("" when it could not be digested)
    answered: "ExactAnswer | None" = None  # set: an exact repeat, answered from the cache without running the model
    # The text encoder (ComfyUI CLIP) the prompt was tokenised with, when one was connected: learning mode's native
    # judge encodes a candidate's prompt with it. A live object of this process: never serialised, never compared.
    text_encoder: Any = field(default=None, repr=False, compare=False)

    @property
    def probe_steps(self) -> int:
        return self.config.probe_steps


@dataclass(frozen=True)
class ExactAnswer:
    """An exact repeat of a cached generation, found before the probe: of a dense one (same ``keys.request_key``),
    or of a hit (same ``keys.answer_key``: the request and the serving settings that decided the hit).

    latent: the stored final LATENT samples [B, C, T, H, W], bit-identical to what the request computed
            (a split schedule: what its second stage computes, ``stage_latent`` what its first stage computes).
    signature: the stored Early Signature (the Signature Builder passes it on instead of recomputing it).
    answer_of: "" for a dense result; for a hit's answer, the entry that hit reused (``entry_id`` is the
            answer-only entry holding its result).
    """

    entry_id: str
    request_key: str
    namespace: str
    prompt: str
    latent: Any
    signature: Signature
    lookup_ms: float
    # A split schedule's first-stage output [B, C, T, H, W] (the latent with leftover noise at the switch step),
    # what the probe's stage returns; None for a whole-schedule request.
    stage_latent: Any = None
    answer_of: str = ""
