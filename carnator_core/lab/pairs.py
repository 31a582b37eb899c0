"""Labelled (request, candidate) pairs from a real model: the data a risk rule is calibrated and certified on.

What a labelled pair is and what the calibration does with it: docs/CALIBRATION.md. This module produces them
by running the request path exactly as serving does (:func:`..request.serve` for probe → signature → retrieval
→ dense resume; :func:`..request.finish_stages` for the joint-reuse output with a given candidate, through both
stages of a split schedule as the two Joint Reuse Samplers run them) — nothing of the pipeline is re-implemented
here.

Procedure (per test request; :func:`label_request`)
---------------------------------------------------
1. ``serve(method="never", write=False)``: the Early Probe, the Signature Builder, top-K recall from the cache
   (same namespace, as serving), and the dense resume of the request (the reference output).
2. For each recalled candidate: the four discrepancies (:func:`.discrepancy.discrepancies`) and the joint-reuse
   output with that candidate forced as accepted (``request.finish_stages`` with a ``Decision`` accepting it),
   and the label from a :class:`Labeler`:

   * :class:`CheckerLabeler` — ground truth exists (the embedded world): unsafe = the reuse output fails the
     checker on an attribute where the dense output passes (:func:`embedded_checker_labeler`).
   * :class:`ToleranceLabeler` — no checker (any model): unsafe = the decoded reuse output deviates from the
     decoded dense output beyond a stated tolerance (PSNR below a dB bound, or mean per-frame SSIM below a
     bound).

Every candidate is labelled, not only the one today's rule would pick, so calibration can evaluate any
threshold setting. The embedded world's request sampler (:func:`embedded_warm_set`, :func:`embedded_queries`)
draws a warm set of cache entries and query requests derived from them by one controlled edit each (exact
repeat, new seed, paraphrase, colour / size / position / motion / background change, different object), so
the recalled candidates are a mix of compatible and incompatible ones.

Contracts: deterministic given the seeds (generation is seeded; CPU float results may differ in the last bits
across thread counts); resumable (:func:`append_rows` appends one request's rows at a time and
:func:`done_requests` tells which requests are complete); the written file is the pairs JSONL format of
docs/CALIBRATION.md (:func:`.certify.read_pairs_jsonl` reads it; each row also carries a ``diag`` object with
diagnostics that the reader ignores).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

import numpy as np

from ..judge import pixels as _pixels, tolerance as _tolerance
from ..judge.base import Judge, JudgeRequest, excess_label
from ..judge.checker import detail_failures
from ..risk.certify import LabelledPair
from ..risk.discrepancy import discrepancies
from ..types import Decision

# --------------------------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class PairRequest:
    """One request of a pair-generation run.

    request_id: stable id ("w0007" warm entries, "q0042" queries); used as ``entry_id`` / ``request_id`` in
                the pairs file so the file does not depend on the cache's random entry ids.
    kind:       how a query was derived from its source ("warm" for cache entries).
    source:     the warm request it was derived from ("" for warm requests).
    """

    request_id: str
    prompt: str
    seed: int
    kind: str = "warm"
    source: str = ""

    def to_meta(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: Query kinds of the embedded-world sampler. "repeat": identical prompt and seed; "reseed": same prompt, new
#: seed; "paraphrase": same scene, freshly drawn caption wording; the edits change one attribute of the first
#: object (colour/size/position/motion/shape = "object") or the background, keeping the caption template.
QUERY_KINDS: tuple[str, ...] = (
    "repeat", "reseed", "paraphrase", "colour", "size", "position", "motion", "background", "object",
)


def _caption(scene: Any, caption_seed: int) -> str:
    from ..embedded import world

    return world.caption(scene, np.random.default_rng(caption_seed))


def embedded_frame(version: str | None = None) -> Any:
    """The clip geometry (``world.Frame``) of an embedded model version (default: the default version): scenes
    for that version's model are drawn in it, so two objects overlap (and are redrawn) as often as its own
    clips make them."""
    from ..embedded import config as ecfg, world

    v = ecfg.version(version)
    return world.Frame(v.frames, v.height, v.width)


def weights_version(weights: str | os.PathLike | None) -> str:
    """The embedded version a weights file was trained as, from its stored config (safetensors metadata; no
    ComfyUI import), or the default version's name for ``None`` (the shipped weights). ValueError for a file
    that is not embedded weights of a known version."""
    from ..embedded import config as ecfg

    if not weights:
        return ecfg.DEFAULT_VERSION
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as f:
        stored = json.loads((f.metadata() or {}).get("config", "null"))
    found = ecfg.version_of_config(stored) if isinstance(stored, dict) else None
    if found is None:
        raise ValueError(f"{weights} is not embedded weights of a known version (stored config {stored})")
    return found.name


def embedded_warm_set(seed: int, n: int, frame: Any = None) -> tuple[list[PairRequest], dict[str, tuple[Any, int]]]:
    """``n`` warm requests from the embedded world (held-in combinations only, 1–2 objects), drawn in ``frame``
    (default: the default version's; pass :func:`embedded_frame` of the weights' version — a 48-px v3 frame lets
    more two-object scenes through the no-overlap rule than v2's 32 px).

    Returns (requests, {request_id: (scene, caption_seed)}) — the scene and caption seed let queries be
    derived by a controlled edit with the same caption template.
    """
    from ..embedded import world

    frame = frame if frame is not None else world.DEFAULT_FRAME
    rng = np.random.default_rng([seed, 0])
    out: list[PairRequest] = []
    scenes: dict[str, tuple[Any, int]] = {}
    for i in range(n):
        scene = world.sample_scene(rng, held_out=False, frame=frame)
        cap_seed = int(rng.integers(2**31))
        rid = f"w{i:04d}"
        out.append(PairRequest(rid, _caption(scene, cap_seed), int(rng.integers(2**31)), "warm", ""))
        scenes[rid] = (scene, cap_seed)
    return out, scenes


def _edit(kind: str, scene: Any, rng: np.random.Generator, frame: Any = None) -> Any | None:
    """The scene with one attribute of its first object (or the background) changed; None if impossible (or if
    the edited objects would overlap in ``frame``, default: the default version's)."""
    from ..embedded import world

    frame = frame if frame is not None else world.DEFAULT_FRAME

    objs = list(scene.objects)
    first = objs[0]
    others = objs[1:]
    taken_colours = {o.colour for o in others}
    taken_positions = {o.position for o in others}

    def pick(options: Sequence[str]) -> str | None:
        options = list(options)
        return options[int(rng.integers(len(options)))] if options else None

    if kind == "background":
        bg = pick([b for b in world.BACKGROUNDS if b != scene.background
                   and all(world.compatible(o.colour, b) for o in objs)])
        return None if bg is None else replace(scene, background=bg)
    if kind == "colour":
        c = pick([c for c in world.COLOURS if c != first.colour and c not in taken_colours
                  and world.compatible(c, scene.background)])
        new = None if c is None else replace(first, colour=c)
    elif kind == "size":
        new = replace(first, size="big" if first.size == "small" else "small")
    elif kind == "position":
        p = pick([p for p in world.POSITIONS if p != first.position and p not in taken_positions])
        new = None if p is None else replace(first, position=p)
    elif kind == "motion":
        m = pick([m for m in world.MOTIONS if m != first.motion])
        new = None if m is None else replace(first, motion=m)
    elif kind == "object":
        s = pick([s for s in world.SHAPES if s != first.shape])
        new = None if s is None else replace(first, shape=s)
    else:
        raise ValueError(f"unknown edit kind {kind!r}; expected one of {QUERY_KINDS}")
    if new is None:
        return None
    edited = replace(scene, objects=(new, *others))
    # The world never shows held-out combinations or overlapping objects at calibration time.
    if world.is_held_out(new) or world._overlaps(edited, frame):
        return None
    return edited


def embedded_queries(seed: int, n: int, warm: Sequence[PairRequest], scenes: Mapping[str, tuple[Any, int]],
                     kinds: Sequence[str] = QUERY_KINDS, p_same_seed: float = 0.5,
                     frame: Any = None) -> list[PairRequest]:
    """``n`` query requests, each derived from a uniformly drawn warm request by one kind of change (edits are
    checked for overlapping objects in ``frame``, the warm set's).

    Kinds cycle through ``kinds`` in a seeded random order (each kind gets n / len(kinds) queries ± 1); the
    first m queries of a run of n > m are the queries of a run of m (prefix-stable). Edits
    (and paraphrases) keep the source's seed with probability ``p_same_seed``, else draw a new one; "repeat"
    always keeps it and "reseed" never does. An edit that is impossible for the drawn source (e.g. no other
    compatible colour) redraws the source.
    """
    from ..embedded import world

    for k in kinds:
        if k not in QUERY_KINDS:
            raise ValueError(f"unknown query kind {k!r}; expected some of {QUERY_KINDS}")
    rng = np.random.default_rng([seed, 1])
    out: list[PairRequest] = []
    perm: list[int] = []
    for j in range(n):
        # A fresh permutation of the kinds every len(kinds) queries, drawn from the same stream as the queries:
        # query j depends only on draws made for queries < j, so a longer run extends a shorter one.
        if j % len(kinds) == 0:
            perm = [int(i) for i in rng.permutation(len(kinds))]
        kind = str(kinds[perm[j % len(kinds)]])
        for _attempt in range(1000):
            src = warm[int(rng.integers(len(warm)))]
            scene, cap_seed = scenes[src.request_id]
            new_seed = int(rng.integers(2**31))
            keep_seed = bool(rng.random() < p_same_seed)
            if kind == "repeat":
                prompt, s = src.prompt, src.seed
            elif kind == "reseed":
                prompt, s = src.prompt, new_seed
            elif kind == "paraphrase":
                prompt = world.caption(scene, rng)
                s = src.seed if keep_seed else new_seed
            else:
                edited = _edit(kind, scene, rng, frame)
                if edited is None:
                    continue
                prompt = _caption(edited, cap_seed)
                s = src.seed if keep_seed else new_seed
            out.append(PairRequest(f"q{j:04d}", prompt, s, kind, src.request_id))
            break
        else:  # pragma: no cover - the world always admits every kind for some source
            raise RuntimeError(f"could not derive a {kind!r} query from the warm set")
    return out


# --------------------------------------------------------------------------------------------- labelers


class Labeler(Protocol):
    """Decides whether a reuse output is unsafe relative to the dense output of the same request.

    ``definition`` is the human-readable definition written into the pairs header (and from there into the
    rule's provenance). ``reference(dense_clip, prompt)`` is computed once per request; ``label(ref,
    reuse_clip, prompt)`` returns (unsafe, diagnostics) for one candidate's reuse output.
    """

    definition: str

    def reference(self, dense_clip: np.ndarray, prompt: str) -> Any: ...

    def label(self, ref: Any, reuse_clip: np.ndarray, prompt: str) -> tuple[bool, dict[str, Any]]: ...


def _verdicts(result: Any) -> dict[str, bool]:
    """Gated per-attribute verdicts of an embedded checker result: {"o0.colour": True, ..., "background": ...}.
    Attributes the caption does not name (None) are left out; shape only for a strict result (the second label)."""
    out: dict[str, bool] = {}
    for i, o in enumerate(result.objects):
        gated = ("colour", "size", "position", "motion") + (("shape",) if getattr(o, "strict", False) else ())
        for attr in gated:
            v = getattr(o, f"{attr}_ok")
            if v is not None:
                out[f"o{i}.{attr}"] = bool(v)
    if result.background_ok is not None:
        out["background"] = bool(result.background_ok)
    return out


@dataclass(frozen=True)
class CheckerLabeler:
    """Labels a reuse output against the dense output of the same request and seed with a checker.

    ``check(clip, prompt) -> {attribute: passed}`` must be deterministic.

    level "attribute" (the first label): unsafe = some checked attribute passes on the dense output and fails on
    the reuse output; attributes the dense output fails are the model's failures and never make a pair unsafe.
    level "request" (the excess label, docs/CALIBRATION.md): a clip *fails* when any checked attribute fails (or,
    with ``artifact_ratio``, when its background artifact score exceeds that multiple of the dense clip's);
    unsafe = b = the reuse output fails where the dense output passes, and ``diag["better"]`` = c = the reuse
    output passes where the dense output fails.
    """

    check: Callable[[np.ndarray, str], Mapping[str, bool]]
    definition: str
    level: str = "attribute"
    artifact_ratio: float | None = None
    judge: Judge | None = field(default=None, compare=False, repr=False)  # the same label as a judge, if known
    # The second label: at request level a clip also fails the detail check (lab.metrics.detail_verdict: blur,
    # object interiors, ghosts) against the dense clip.
    detail: bool = False
    # The checker's reading (embedded.checker.CHECKER_VERSIONS) of ``check``, the detail check and the judge; callers
    # computing the artifact check's background pass it to ``metrics.background_mask(..., version=)``.
    checker_version: int = 1

    def __post_init__(self) -> None:
        if self.level not in ("attribute", "request"):
            raise ValueError(f"level must be 'attribute' or 'request', got {self.level!r}")

    def as_judge(self) -> Judge:
        """This labeler's checker as a judge (``judge.excess_label`` gives the request-level label's b / c)."""
        if self.judge is None:
            raise ValueError("this CheckerLabeler was built without its judge; wrap its checker in a "
                             "carnator_core.judge Judge (the embedded one: embedded_checker_labeler(...).as_judge())")
        return self.judge

    def reference(self, dense_clip: np.ndarray, prompt: str) -> dict[str, bool]:
        return dict(self.check(dense_clip, prompt))

    def label(self, ref: Mapping[str, bool], reuse_clip: np.ndarray, prompt: str) -> tuple[bool, dict[str, Any]]:
        got = dict(self.check(reuse_clip, prompt))
        broken = sorted(a for a, ok in ref.items() if ok and not got.get(a, False))
        diag: dict[str, Any] = {"broken": broken, "dense_failed": sorted(a for a, ok in ref.items() if not ok),
                                "reuse_failed": sorted(a for a in ref if not got.get(a, False))}
        if self.level == "attribute":
            return bool(broken), diag
        return request_outcome(diag, artifact_failed=False)


def request_outcome(diag: Mapping[str, Any], artifact_failed: bool) -> tuple[bool, dict[str, Any]]:
    """(unsafe = b, diag with ``better`` = c) at request level from a checker diag's ``reuse_failed`` and
    ``dense_failed`` lists; ``artifact_failed`` makes the reuse output fail as well."""
    reuse_fail = bool(diag.get("reuse_failed")) or artifact_failed
    dense_fail = bool(diag.get("dense_failed"))
    out = {**diag, "artifact_failed": bool(artifact_failed), "better": dense_fail and not reuse_fail}
    return reuse_fail and not dense_fail, out



def judge_against_dense(labeler: Labeler, ref: Any, clip: np.ndarray, dense_clip: np.ndarray, prompt: str,
                        background: np.ndarray | None,
                        artifact_dense: float | None = None) -> tuple[bool, dict[str, Any], float | None]:
    """The labelling function: judge ``clip`` (a reuse output) against ``dense_clip``, the dense output of the
    same request and seed, whose ``labeler.reference`` is ``ref``.

    Returns (unsafe, diag, artifact_dense). ``diag`` is the labeler's diagnostics plus
    ``lab.metrics.clip_quality`` of ``clip`` against ``dense_clip`` over ``background`` (values rounded to 4
    decimals, None where not finite). With a request-level labeler that has an ``artifact_ratio``, the clip also
    *fails* when its (rounded) background artifact score exceeds ``artifact_ratio`` x the dense clip's, and
    unsafe / ``diag["better"]`` are the excess label's b / c (:func:`request_outcome`). ``artifact_dense`` (the
    dense clip's score over ``background``) may be passed in to be computed once per request; the value used is
    returned (None when the artifact measure was not needed). The pairs labelling and the floor measurement
    (``lab.floor``) both judge through this function, so they label alike.
    """
    from .metrics import artifact_score, clip_quality

    unsafe, diag = labeler.label(ref, clip, prompt)
    quality = {k: (None if not np.isfinite(v) else round(float(v), 4))
               for k, v in clip_quality(clip, dense_clip, background).items()}
    ratio = getattr(labeler, "artifact_ratio", None)
    request_level = getattr(labeler, "level", "attribute") == "request"
    detail_failed: list[str] = []
    if request_level and getattr(labeler, "detail", False):
        detail_failed = detail_failures(clip, dense_clip, prompt, version=getattr(labeler, "checker_version", 1))
        diag = {**diag, "detail_failed": detail_failed}
    if request_level and (ratio or detail_failed):
        art = quality.get("artifact")
        flagged = False
        if ratio:
            if artifact_dense is None:
                artifact_dense = artifact_score(dense_clip, background)
            flagged = art is not None and art > ratio * artifact_dense
        unsafe, diag = request_outcome(diag, flagged or bool(detail_failed))
    return bool(unsafe), {**diag, **quality}, artifact_dense


EMBEDDED_UNSAFE_DEFINITION = (
    "embedded pixel checker (carnator_core/embedded/checker.py): the joint-reuse output fails the checker on a "
    "named object's colour, size, position or motion, or on the background, where the dense output of the same "
    "request (same prompt, seed and settings) passes it"
)


EMBEDDED_EXCESS_DEFINITION = (
    "excess label, request level (docs/CALIBRATION.md): a clip fails when the embedded pixel checker "
    "(carnator_core/embedded/checker.py) fails it on any named object's colour, size, position or motion or on the "
    "background, or when its background artifact score (lab/metrics.py) exceeds {ratio} x the dense clip's; "
    "unsafe (b) = the joint-reuse output fails where the dense output of the same request and seed passes, better "
    "(c) = it passes where the dense output fails"
)


EMBEDDED_EXCESS_DEFINITION_V2 = (
    "second excess label, request level (docs/CALIBRATION.md): a clip fails when the embedded pixel checker "
    "(carnator_core/embedded/checker.py, strict, checker version {checker}) fails it "
    "on any named object's colour, size, position, shape or "
    "motion (read from the per-frame centroid track: direction, speed, still vs moving) or on the background, or when "
    "its background artifact score (lab/metrics.py) exceeds {ratio} x the dense clip's, or when it fails the detail "
    "check against the dense clip (lab/metrics.py detail_verdict: blurred object edges, object interiors, ghost "
    "objects); unsafe (b) = the joint-reuse output fails where the dense output of the same request and seed passes, "
    "better (c) = it passes where the dense output fails"
)
#: The label versions :func:`embedded_checker_labeler` makes (1 = the first excess label, 2 = the second).
LABEL_VERSIONS = (1, 2)


def embedded_checker_labeler(level: str = "attribute", artifact_ratio: float | None = None,
                             version: int = 1, *, checker_version: int | None = None) -> CheckerLabeler:
    """The embedded world's ground-truth labeler: level "attribute" (:data:`EMBEDDED_UNSAFE_DEFINITION`) or
    "request" (the excess label, :data:`EMBEDDED_EXCESS_DEFINITION`). ``version`` 2 (request level only) is the
    second label (:data:`EMBEDDED_EXCESS_DEFINITION_V2`): the strict checker (shape gated, motion from the
    per-frame track) plus the detail check (blur, object interiors, ghosts), read with the checker's reading
    ``checker_version`` (default: the latest, ``embedded.checker.CHECKER_VERSION``, as ``judge.SECOND_LABEL``; 1 =
    the reading the second label had before the small-object fix; the definition names it). The first label is
    always read with checker version 1."""
    from ..embedded import checker

    if version not in LABEL_VERSIONS:
        raise ValueError(f"label version must be one of {LABEL_VERSIONS}, got {version!r}")
    if version == 2:
        if level != "request":
            raise ValueError("the second label (version 2) is a request-level label: use level='request'")
        cv = checker.CHECKER_VERSION if checker_version is None else checker_version
        if cv not in checker.CHECKER_VERSIONS:
            raise ValueError(f"checker_version must be one of {checker.CHECKER_VERSIONS}, got {cv!r}")
        definition = EMBEDDED_EXCESS_DEFINITION_V2.format(ratio=artifact_ratio if artifact_ratio else "inf",
                                                          checker=cv)
        from ..judge.checker import CheckerJudge, detail_check

        return CheckerLabeler(lambda clip, prompt: _verdicts(checker.check(clip, prompt, strict=True, version=cv)),
                              definition, level, artifact_ratio, detail=True,
                              judge=CheckerJudge(artifact_ratio, strict=True, detail=detail_check(cv),
                                                 checker_version=cv),
                              checker_version=cv)
    if checker_version not in (None, 1):
        raise ValueError(f"the first label is read with checker version 1, not {checker_version!r}")
    if level == "request":
        definition = EMBEDDED_EXCESS_DEFINITION.format(ratio=artifact_ratio if artifact_ratio else "inf")
    else:
        definition = EMBEDDED_UNSAFE_DEFINITION
    from ..judge.checker import CheckerJudge

    return CheckerLabeler(lambda clip, prompt: _verdicts(checker.check(clip, prompt)), definition, level,
                          artifact_ratio, judge=CheckerJudge(artifact_ratio if level == "request" else None))


# Shared with the runtime judges (one definition: a label made here equals the judge's).
psnr_db = _pixels.psnr_db
mean_ssim = _tolerance.mean_ssim


@dataclass(frozen=True)
class ToleranceLabeler:
    """unsafe = the decoded reuse output deviates from the decoded dense output beyond a stated tolerance.

    metric "psnr": unsafe when PSNR(reuse, dense) < ``threshold`` dB (over all pixels of the clip);
    metric "ssim": unsafe when the mean per-frame SSIM < ``threshold``.
    State the tolerance before looking at results (docs/CALIBRATION.md §2).
    """

    metric: str = "psnr"
    threshold: float = 25.0

    def __post_init__(self) -> None:
        if self.metric not in ("psnr", "ssim"):
            raise ValueError(f"tolerance metric must be 'psnr' or 'ssim', got {self.metric!r}")

    @property
    def definition(self) -> str:
        if self.metric == "psnr":
            return (f"decoded joint-reuse output vs the dense output of the same request: PSNR over all pixels "
                    f"< {self.threshold:g} dB")
        return ("decoded joint-reuse output vs the dense output of the same request: mean per-frame SSIM < "
                f"{self.threshold:g}")

    def reference(self, dense_clip: np.ndarray, prompt: str) -> np.ndarray:
        return np.asarray(dense_clip)

    def label(self, ref: np.ndarray, reuse_clip: np.ndarray, prompt: str) -> tuple[bool, dict[str, Any]]:
        if self.metric == "psnr":
            v = psnr_db(reuse_clip, ref)
            return bool(v < self.threshold), {"psnr_db": None if not np.isfinite(v) else round(v, 3)}
        v = mean_ssim(reuse_clip, ref)
        return bool(v < self.threshold), {"ssim": round(v, 5)}

    def as_judge(self) -> Judge:
        """The same tolerance as a judge (``judge.tolerance.ToleranceJudge``: b = this labeler's unsafe)."""
        return _tolerance.ToleranceJudge(self.metric, self.threshold)


@dataclass(frozen=True)
class JudgeLabeler:
    """Any judge (``carnator_core.judge``) as a :class:`Labeler` of the pairs machinery: unsafe = the excess
    label's b, ``diag["better"]`` = c, plus the verdicts' reasons. ``request_for(prompt)`` builds the judge's request
    (default: the prompt alone; the candidate's source prompt is not known to a Labeler). The definition written
    into a pairs header names the judge and its settings, so pairs labelled by different judges never combine."""

    judge: Judge
    request_for: Callable[[str], JudgeRequest] = field(default=lambda prompt: JudgeRequest(prompt=prompt))
    level: str = "judge"

    @property
    def definition(self) -> str:
        settings = json.dumps(dict(self.judge.settings), sort_keys=True, default=str)
        return (f"excess label by the judge {self.judge.name!r} (settings {settings}): unsafe (b) = the joint-reuse "
                "output fails where the dense output of the same request and seed passes, better (c) = it passes "
                "where the dense output fails")

    def reference(self, dense_clip: np.ndarray, prompt: str) -> tuple[Any, np.ndarray]:
        return self.judge.reference(dense_clip, self.request_for(prompt)), dense_clip

    def label(self, ref: tuple[Any, np.ndarray], reuse_clip: np.ndarray, prompt: str) -> tuple[bool, dict[str, Any]]:
        judge_ref, dense_clip = ref
        lab = excess_label(self.judge, reuse_clip, dense_clip, self.request_for(prompt), ref=judge_ref)
        return lab.b, {"better": lab.c, "reuse_reasons": list(lab.reuse.reasons),
                       "dense_reasons": list(lab.dense.reasons), "judge": lab.judge}


# --------------------------------------------------------------------------------------------- the model side


@dataclass
class PairContext:
    """Everything needed to serve requests on one model (or one two-expert pair of models) and config.

    model:        ComfyUI MODEL (ModelPatcher); on a split schedule the model the probe's stage runs on.
    text_encoder: what ``serve`` uses to locate object words (the embedded encoder, or a ComfyUI CLIP).
    encode:       prompt -> CONDITIONING (the negative prompt is ``encode(negative_prompt)``).
    decode:       LATENT samples [1, C, T, H, W] -> clip [T, H, W, 3] in [0, 1] (for the labeler).
    latent:       the empty LATENT dict of the served resolution / length.
    steps, cfg, sampler, scheduler: the generation config (with ``options.probe`` it fixes the rule's config).
    store:        the cache (``cache.Store``) holding the warm entries.
    options:      ServeOptions (probe steps, reuse mode, signature config, top_k).
    background:   (dense clip, prompt) -> bool [T, H, W] of the pixels reuse should leave unchanged, for the
                  quality measures in each pair's ``diag`` (``lab.metrics.clip_quality``); None = whole clip.
    stage:        the probe's stage of a split schedule (``types.Stage``: KSamplerAdvanced's start/end steps and
                  switches); None = the whole schedule on ``model``.
    second_model: the MODEL that finishes a stage returning leftover noise (Wan 2.2 14B: the low-noise expert).
                  Requests are served and each candidate's reuse runs through both stages as the two Joint Reuse
                  Samplers of the graph do (``request.finish_stages``); the rule calibrated on the pairs is for
                  that two-expert config (both experts, the switch step), see docs/CALIBRATION.md.
    objects:      the object list override of every request (the probe's ``objects`` input); None = the words
                  the prompt names.
    """

    model: Any
    text_encoder: Any
    encode: Callable[[str], Any]
    decode: Callable[[Any], np.ndarray]
    latent: dict
    steps: int
    cfg: float
    sampler: str
    scheduler: str
    store: Any
    options: Any
    negative_prompt: str = ""
    background: Callable[[np.ndarray, str], np.ndarray] | None = None
    stage: Any = None
    second_model: Any = None
    objects: str | None = None
    _neg: Any = field(default=None, repr=False)

    def spec(self, req: PairRequest) -> Any:
        from ..request import RequestSpec
        from ..types import Stage

        return RequestSpec(prompt=req.prompt, seed=int(req.seed), steps=self.steps, cfg=self.cfg,
                           sampler=self.sampler, scheduler=self.scheduler, objects=self.objects,
                           stage=self.stage if self.stage is not None else Stage())

    def negative(self) -> Any:
        if self._neg is None:
            self._neg = self.encode(self.negative_prompt)
        return self._neg


def reuse_config_from(items: list[str]) -> Any:
    """``FIELD=VALUE`` strings -> a validated ``ReuseConfig`` of those fields over the defaults (booleans:
    1/true/yes). ``mode`` is not settable here (labelling and benches take it separately). Raises ValueError
    naming the bad item and the fields there are."""
    import dataclasses

    from ..reuse import ReuseConfig

    fields = {f.name for f in dataclasses.fields(ReuseConfig)} - {"mode"}
    kw: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if key == "mode":
            raise ValueError(f"{item!r}: the mode is set on its own (--reuse-mode), not as a field")
        if not sep or key not in fields:
            raise ValueError(f"{item!r}: expected FIELD=VALUE with a ReuseConfig field: {sorted(fields)}")
        cur = getattr(ReuseConfig(), key)
        try:
            kw[key] = (value.lower() in ("1", "true", "yes")) if isinstance(cur, bool) else type(cur)(value)
        except ValueError as exc:
            raise ValueError(f"{item!r}: {exc}") from None
    return dataclasses.replace(ReuseConfig(), **kw).validate()


def parse_easycache(text: str) -> tuple[float, float, float] | None:
    """``"THRESHOLD,START,END"`` (the settings of ComfyUI's EasyCache node: reuse threshold, start and end
    percent of the schedule) -> a checked tuple; ``""`` -> None (no EasyCache). Raises ValueError saying what is
    wrong."""
    if not text.strip():
        return None
    try:
        threshold, start, end = (float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"EasyCache settings are THRESHOLD,START,END numbers (e.g. 0.2,0.15,0.95, the node's "
                         f"defaults), got {text!r}") from None
    if not (math.isfinite(threshold) and threshold > 0):
        raise ValueError(f"the EasyCache reuse threshold must be a positive number, got {threshold}")
    if not (0.0 <= start < end <= 1.0):
        raise ValueError(f"EasyCache start and end percent need 0 <= start < end <= 1, got {start}, {end}")
    return threshold, start, end


def easycache_model(model: Any, settings: tuple[float, float, float]) -> Any:
    """``model`` patched by ComfyUI core's EasyCache node with ``settings`` (threshold, start, end; verbose off):
    the patched clone a user wires in front of Carnator. Its model fingerprint covers the patch and the settings,
    so pairs labelled on it make a rule that applies to exactly this composition."""
    from comfy_extras.nodes_easycache import EasyCacheNode

    threshold, start, end = settings
    return EasyCacheNode.execute(model, threshold, start, end, False).args[0]


def embedded_context(store: Any, weights: str | os.PathLike | None = None, *, top_k: int = 3,
                     reuse_mode: str = "joint", reuse: Any = None,
                     easycache: tuple[float, float, float] | None = None) -> PairContext:
    """A :class:`PairContext` for the embedded model with its default config (20 euler steps, simple, CFG 5,
    probe after 4 steps) and the latent geometry of the weights' version. ``reuse`` (a ``ReuseConfig``; default:
    the default settings) is what every labelled hit runs with; when it uses the probe's keys/values the probe
    keeps them. ``easycache`` (threshold, start, end): every generation — warm entries, probes, dense references
    and reuses — runs on the EasyCache-patched model (:func:`easycache_model`), so the labels compare Carnator +
    EasyCache with EasyCache alone. Imports ComfyUI (through the embedded glue)."""
    from ..embedded import codec, comfy_glue, config as ecfg
    from ..probe import ProbeConfig
    from ..request import ServeOptions
    from ..reuse import RULE_CONTEXT_KV_MB, ReuseConfig

    model, enc, _dec = comfy_glue.load_embedded(weights)
    ver = comfy_glue.model_version(model)
    version = ver.name
    if easycache is not None:
        model = easycache_model(model, easycache)
    reuse = reuse if reuse is not None else ReuseConfig()
    probe = ProbeConfig(probe_steps=ecfg.DEFAULT_PROBE_STEP,
                        context_kv_mb=RULE_CONTEXT_KV_MB if reuse.probe_context else 0.0)
    options = ServeOptions(method="never", reuse_mode=reuse_mode, top_k=int(top_k), write=False, probe=probe,
                           reuse=reuse)
    return PairContext(
        model=model, text_encoder=enc, encode=enc.encode,
        decode=lambda s: codec.latent_to_rgb(s[:1].float().cpu())[0].numpy(),
        latent=comfy_glue.empty_latent(1, version), steps=ecfg.DEFAULT_STEPS,
        cfg=ver.cfg, sampler=ecfg.DEFAULT_SAMPLER, scheduler=ecfg.DEFAULT_SCHEDULER, store=store,
        options=options, background=_embedded_background,
    )


def _embedded_background(dense_clip: np.ndarray, prompt: str) -> np.ndarray:
    from .metrics import background_mask

    return background_mask(dense_clip, prompt)


def warm_entry(ctx: PairContext, req: PairRequest) -> tuple[str, Any]:
    """Generate a warm request densely and write it to the cache (the Cache Writer path). Returns
    (store entry id, RequestResult)."""
    from ..request import serve

    opts = replace(ctx.options, method="dense", write=True)
    res = serve(ctx.model, ctx.text_encoder, ctx.encode(req.prompt), ctx.negative(), ctx.latent, ctx.spec(req),
                ctx.store, opts, second_model=ctx.second_model)
    if res.entry_id is None:  # pragma: no cover - serve always writes a dense result when write=True
        raise RuntimeError(f"warm request {req.request_id} was not written to the cache")
    return res.entry_id, res


@dataclass(frozen=True)
class CandidateOutcome:
    """One recalled candidate of a labelled request."""

    entry_id: str  # store entry id
    similarity: float
    discrepancies: Any  # risk.discrepancy.Discrepancies
    labelled: bool
    unsafe: bool | None
    diag: Mapping[str, Any]


@dataclass(frozen=True)
class RequestOutcome:
    """What :func:`label_request` measured for one request."""

    request: PairRequest
    result: Any  # request.RequestResult of the serve(method="never") call (probe, signature, candidates, dense)
    candidates: tuple[CandidateOutcome, ...]
    dense_diag: Mapping[str, Any]
    seconds: float


def _region_over_max_active(ctx: PairContext, res: Any, cached: Any, cfg: Any) -> float | None:
    """The active fraction when the sampler would not reuse ``cached`` because its region covers more than
    ``cfg.max_active`` of the tokens (it continues dense), else None. Only for a single-stage schedule in a mode
    with a region, where that dense continuation equals the request's dense result bit for bit."""
    from ..reuse import region_of

    if cfg.mode not in ("joint", "latent") or res.probe.config.leftover_noise or res.probe.answered is not None:
        return None
    fraction = float(region_of(ctx.model, res.probe, res.signature, cached, cfg).mean())
    return fraction if fraction > cfg.max_active else None


def label_request(ctx: PairContext, req: PairRequest, labeler: Labeler, *,
                  only: Iterable[str] | Callable[[Any], Iterable[str]] | None = None,
                  missing: str = "all", clips: dict[str, np.ndarray] | None = None) -> RequestOutcome:
    """Serve ``req`` as serving does (probe, signature, top-K recall, dense resume) and label its candidates.

    only: which store entry ids to label — None = every recalled candidate; an iterable of ids; or a callable
          given the ``serve`` result (``request.RequestResult``: probe, signature, candidates) that returns the
          ids (e.g. the candidates a filter accepts). The others get discrepancies but no reuse run
          (``labelled=False``). The store's hit counters are not touched.
    missing: "all" labels every selected candidate; "top" skips the reuse run of a candidate with a named object
          on one side only (``Discrepancies.missing``) unless it is the most similar candidate (ties included).
          A signature rule never accepts such a candidate (automatic reject) and the prompt-only baseline only
          ever considers the most similar one, so "top" loses nothing any evaluation uses and saves their
          reuse runs (often half of them).
    clips: when given, filled with the decoded clips: ``"dense"`` and each labelled candidate's reuse output under
          its store entry id (to judge them again later under another label without generating).
    """
    if missing not in ("all", "top"):
        raise ValueError(f"missing must be 'all' or 'top', got {missing!r}")
    from ..request import finish_stages, serve

    t0 = time.perf_counter()
    pos = ctx.encode(req.prompt)
    neg = ctx.negative()
    res = serve(ctx.model, ctx.text_encoder, pos, neg, ctx.latent, ctx.spec(req), ctx.store,
                replace(ctx.options, method="never", write=False), second_model=ctx.second_model)
    from .metrics import artifact_score

    dense_clip = ctx.decode(res.latent["samples"])
    if clips is not None:
        clips["dense"] = dense_clip
    ref = labeler.reference(dense_clip, req.prompt)
    background = ctx.background(dense_clip, req.prompt) if ctx.background is not None else None
    want = None if only is None else set(only(res) if callable(only) else only)
    cfg = ctx.options.hit_reuse
    outs = []
    artifact_dense: float | None = None
    items = res.candidates.items if res.candidates is not None else ()
    top_sim = max((float(c.similarity) for c in items), default=0.0)
    for cand in items:
        d = discrepancies(res.signature, cand.signature)
        skip_missing = missing == "top" and d.missing and float(cand.similarity) < top_sim
        if (want is not None and cand.entry_id not in want) or skip_missing:
            outs.append(CandidateOutcome(cand.entry_id, float(cand.similarity), d, False, None, {}))
            continue
        cached = ctx.store.load(cand.entry_id, count_hit=False).cached_run()
        decision = Decision(accepted=True, candidate=cand, verdicts=(), mode="signature",
                            summary="pair labelling: candidate forced as accepted")
        t1 = time.perf_counter()
        over = _region_over_max_active(ctx, res, cached, cfg)
        if over is not None:
            # The sampler would continue dense (region > max_active), bit-identical to the dense result this
            # request already has: label that instead of computing it again (serving counts it as a miss).
            reuse_clip, active, compute, skipped, reused = dense_clip, over, 1.0, 0, False
        else:
            # Both stages of a split schedule, as serving runs them; ``rep`` is the last stage's report.
            samples, rep, _ = finish_stages(ctx.model, pos, neg, ctx.latent, res.probe, decision, ctx.store, cfg,
                                            second_model=ctx.second_model, signature=res.signature, record=False,
                                            cached=cached)
            reuse_clip = ctx.decode(samples)
            active, compute, skipped = rep.active_fraction, rep.compute_fraction, rep.skipped_calls
            reused = rep.decision == "hit"
        reuse_s = time.perf_counter() - t1
        if clips is not None:
            clips[cand.entry_id] = reuse_clip
        unsafe, diag, artifact_dense = judge_against_dense(labeler, ref, reuse_clip, dense_clip, req.prompt,
                                                           background, artifact_dense)
        diag = {**diag, "candidate_prompt": cand.prompt, "candidate_seed": cand.seed,
                "active_fraction": round(active, 4), "compute_fraction": round(compute, 4),
                "skipped_calls": skipped, "reuse_s": round(reuse_s, 3),
                # the sampler continued dense (region > max_active): serving counts this candidate as a miss
                "reused": reused}
        outs.append(CandidateOutcome(cand.entry_id, float(cand.similarity), d, True, bool(unsafe), diag))
    if artifact_dense is None:
        artifact_dense = artifact_score(dense_clip, background)
    dense_diag = {"dense_s": round(res.timings_ms.get("total", 0.0) / 1000.0, 3),
                  "artifact_dense": round(artifact_dense, 4)}
    if isinstance(ref, Mapping):
        dense_diag["dense_failed"] = sorted(a for a, ok in ref.items() if not ok)
        # one-object / two-object scene: the stratum the certificate is also reported for
        dense_diag["objects"] = len({a.split(".", 1)[0] for a in ref if a.startswith("o")})
    return RequestOutcome(req, res, tuple(outs), dense_diag, time.perf_counter() - t0)


def outcome_rows(out: RequestOutcome, entry_names: Mapping[str, str]) -> list[dict[str, Any]]:
    """Pairs-file rows (docs/CALIBRATION.md format + a ``diag`` object) of a labelled request.

    entry_names: store entry id -> stable name (the warm request id) used as ``entry_id`` in the file.
    Unlabelled candidates are left out only if they are ``missing`` ones skipped under ``missing="top"`` (their
    names go into the first row's ``diag.skipped_missing``); any other unlabelled candidate is an error.
    """
    rows = []
    skipped = []
    for c in out.candidates:
        if not c.labelled and c.discrepancies.missing:
            skipped.append(entry_names.get(c.entry_id, c.entry_id))
            continue
        if not c.labelled:
            raise ValueError(f"request {out.request.request_id}: candidate {c.entry_id} was not labelled")
        p = LabelledPair.from_discrepancies(out.request.request_id, entry_names.get(c.entry_id, c.entry_id),
                                            c.similarity, c.discrepancies, bool(c.unsafe))
        n_obj = out.dense_diag.get("objects")
        p = replace(p, better=bool(c.diag.get("better", False)),
                    stratum=f"{n_obj}obj/{out.request.kind}" if n_obj else None,
                    reusable=bool(c.diag.get("reused", True)))
        row = p.to_row()
        row["diag"] = {"kind": out.request.kind, "source": out.request.source, "prompt": out.request.prompt,
                       "seed": out.request.seed, "store_entry": c.entry_id,
                       "missing_objects": list(c.discrepancies.missing_objects), **out.dense_diag, **c.diag}
        rows.append(row)
    if rows:
        rows[0]["diag"]["skipped_missing"] = skipped
    return rows


def summarize_by_kind(rows: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per query kind (``diag.kind``) of labelled pair rows: pairs, unsafe, and the medians of the reuse's
    counter-based compute, active fraction, PSNR over the background and artifact score (``diag``; pairs written
    before those fields existed are skipped in the medians), plus how many reuse outputs have an artifact score
    above their own dense clip's."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault(str((r.get("diag") or {}).get("kind", "?")), []).append(r)

    def med(xs: Iterable[Any]) -> float | None:
        v = [float(x) for x in xs if x is not None and np.isfinite(float(x))]
        return round(float(np.median(v)), 4) if v else None

    out = {}
    for kind, rs in sorted(groups.items()):
        d = [r.get("diag") or {} for r in rs]
        out[kind] = {
            "pairs": len(rs), "unsafe": sum(bool(r.get("unsafe")) for r in rs),
            "compute_median": med(x.get("compute_fraction") for x in d),
            "active_median": med(x.get("active_fraction") for x in d),
            "psnr_bg_median": med(x.get("psnr_bg") for x in d),
            "artifact_median": med(x.get("artifact") for x in d),
            "artifact_above_dense": sum(1 for x in d if x.get("artifact") is not None
                                        and x.get("artifact_dense") is not None
                                        and x["artifact"] > x["artifact_dense"]),
        }
    return out


# --------------------------------------------------------------------------------------------- fresh streams


@dataclass(frozen=True)
class StreamRecord:
    """One request of a measured stream: what each method accepted (store entry id or None) and whether that
    reuse was unsafe (None when nothing was accepted)."""

    request: PairRequest
    accepted: Mapping[str, str | None]
    unsafe: Mapping[str, bool | None]
    dense_s: float


@dataclass(frozen=True)
class StreamResult:
    """Outcome of :func:`measure_stream`; ``counts(method)`` = (requests, accepted, unsafe among accepted)."""

    records: tuple[StreamRecord, ...]
    methods: tuple[str, ...]

    def counts(self, method: str) -> tuple[int, int, int]:
        acc = [r for r in self.records if r.accepted.get(method) is not None]
        return len(self.records), len(acc), sum(bool(r.unsafe.get(method)) for r in acc)

    def summary(self) -> dict[str, dict[str, float | int]]:
        out = {}
        for m in self.methods:
            n_req, n, k = self.counts(m)
            out[m] = {"requests": n_req, "accepted": n, "unsafe": k, "coverage": n / n_req if n_req else 0.0,
                      "unsafe_rate": k / n if n else 0.0}
        return out


def measure_stream(ctx: PairContext, queries: Sequence[PairRequest], labeler: Labeler, rule: Any, *,
                   prompt_thresholds: Mapping[str, float] | None = None,
                   progress: Callable[[str], None] | None = None,
                   allow_uncertified: bool = False) -> StreamResult:
    """Serve a stream of requests and measure, per filter, the unsafe rate among the reuses it accepts.

    Methods: "rule" — the Risk Filter in signature mode with ``rule`` (a loaded :class:`.rule.RiskRule`; checked
    against the probe's model and config fingerprints, so a mismatched rule raises ``RuleMismatchError``);
    and one prompt-only filter per entry of ``prompt_thresholds`` (name -> similarity threshold). Each query is
    served once (probe, recall, dense); only the candidates some method accepts get a reuse run and a label.
    """
    from ..request import signature_settings
    from ..risk.filter import decide, probe_fingerprints

    methods = ("rule", *tuple(prompt_thresholds or {}))
    records = []
    for req in queries:
        chosen: dict[str, str | None] = {}

        def select(res: Any) -> list[str]:
            model_fp, config_fp = probe_fingerprints(res.probe)  # what serving's filter checks
            dec = decide(res.signature, res.candidates, rule, "signature", model_fingerprint=model_fp,
                         config_fingerprint=config_fp, allow_uncertified=allow_uncertified,
                         signature_settings=signature_settings(rule), request=(req.prompt, int(req.seed)))
            chosen["rule"] = dec.candidate.entry_id if dec.accepted else None
            for name, t in (prompt_thresholds or {}).items():
                d = decide(None, res.candidates, None, "prompt_only", float(t))
                chosen[name] = d.candidate.entry_id if d.accepted else None
            return [e for e in chosen.values() if e is not None]

        out = label_request(ctx, req, labeler, only=select)
        label = {c.entry_id: c.unsafe for c in out.candidates if c.labelled}
        # a chosen candidate the sampler did not reuse (region > max_active) is a miss, as in serving
        kept = {c.entry_id for c in out.candidates if c.labelled and c.diag.get("reused", True)}
        chosen = {m: (e if e in kept else None) for m, e in chosen.items()}
        rec = StreamRecord(req, dict(chosen), {m: (label[e] if e is not None else None) for m, e in chosen.items()},
                           float(out.dense_diag.get("dense_s", 0.0)))
        records.append(rec)
        if progress is not None:
            progress(f"{req.request_id} {req.kind}: " + ", ".join(
                f"{m}={'-' if rec.accepted[m] is None else ('UNSAFE' if rec.unsafe[m] else 'safe')}" for m in methods))
    return StreamResult(tuple(records), methods)


# --------------------------------------------------------------------------------------------- the file


def append_rows(path: str | os.PathLike, rows: Sequence[Mapping[str, Any]]) -> None:
    """Append rows (one request's, written together) and flush them to disk, so an interrupted run resumes
    after the last complete request."""
    with Path(path).open("a", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r, sort_keys=True) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def read_rows(path: str | os.PathLike) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """(header or None, pair rows) of a pairs file written by this module. A torn last line (a crash in the
    middle of a write) is dropped; its request is then redone by a resumed run."""
    path = Path(path)
    if not path.exists():
        return None, []
    header = None
    rows: list[dict[str, Any]] = []
    lines = path.read_text(encoding="utf-8").split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i >= len(lines) - 2:  # torn tail
                break
            raise ValueError(f"{path}:{i + 1}: not valid JSON; the pairs file is corrupt") from None
        if row.get("type") == "header":
            header = row
        else:
            rows.append(row)
    return header, rows


def done_requests(rows: Iterable[Mapping[str, Any]]) -> set[str]:
    """Request ids present in the file (a request's rows are always appended together)."""
    return {str(r["request_id"]) for r in rows}


def write_header(path: str | os.PathLike, header: Mapping[str, Any]) -> None:
    """Start a pairs file with its header row (atomically replaces an empty/absent file)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"type": "header", **header}, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)


def header_for(probe: Any, *, dataset: str, seeds: Sequence[int] | Mapping[str, Any], unsafe_definition: str,
               generator: str, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The pairs-file header for pairs generated with ``probe``'s model and config (docs/CALIBRATION.md §4).

    The fingerprints are the ones the Risk Filter checks at serving time (``risk.filter.probe_fingerprints``: the
    config's ``rule_fingerprint``, which covers a split schedule's stage and second expert and leaves out the
    request's own conditioning digest; for a text-only whole-schedule config it equals ``fingerprint()``)."""
    from ..risk.filter import probe_fingerprints

    model_fp, config_fp = probe_fingerprints(probe)
    return {
        "model_fingerprint": model_fp,
        "config_fingerprint": config_fp,
        "arch": probe.arch,
        "config": probe.config.to_meta(),
        "dataset": dataset,
        "seeds": seeds,
        "unsafe_definition": unsafe_definition,
        "generator": generator,
        **dict(extra or {}),
    }


def combine_pairs_files(sources: Sequence[tuple[Any, ...]], out: str | os.PathLike,
                        generator: str = "", calib_reuse_may_differ: bool = False,
                        calib_config_may_differ: bool = False) -> dict[str, Any]:
    """Concatenate pairs files made with the same model, config and definition of unsafe into one.

    sources: (path, prefix) or (path, prefix, split) per file; request and entry ids become ``"<prefix>:<id>"``
    so runs with their own warm sets and query ids never collide (pairs of one request stay together). ``split``
    ("calib" / "cert") fixes the calibration/certification split per file — e.g. certify on a run with its own
    warm set that calibration never saw; give it for every file or for none. The combined header keeps the
    common fingerprints, config and unsafe definition and lists every source (dataset, seeds, generator,
    sha256, requests). Raises ValueError when headers disagree. Returns the combined header.

    ``calib_reuse_may_differ`` (needs a split on every file): the calibration files' reuse settings
    (``reuse_config``) may differ from the certification files' — e.g. a rule whose thresholds were calibrated
    on an earlier hit path, certified on fresh runs of the new one. The certification files must agree; the header
    records *their* settings (what the rule will run, and what its certificate is about) and each calibration
    file's own under ``sources[i]["reuse_config"]``. Sound because the certificate needs only that the rule is fixed
    without the certification rows; the calibration rows then only decide how well the thresholds fit.

    ``calib_config_may_differ`` (needs a split on every file): likewise for the generation config
    (``config_fingerprint`` / ``config``, e.g. another probe length) of the same model and the same definition of
    unsafe. The header takes the certification files' config (they must agree): the rule applies to that config
    only, and each calibration file's own is listed under ``sources[i]["config"]``.
    """
    import hashlib

    if not sources:
        raise ValueError("no pairs files to combine")
    sources = [tuple(x) + (None,) * (3 - len(x)) for x in sources]
    prefixes = [x[1] for x in sources]
    splits = [x[2] for x in sources]
    if any(sp is not None for sp in splits) and (None in splits or not set(splits) <= {"calib", "cert"}):
        raise ValueError(f"split must be 'calib' or 'cert' for every file (or for none), got {splits}")
    if (calib_reuse_may_differ or calib_config_may_differ) and (None in splits or "cert" not in splits):
        what = "reuse settings" if calib_reuse_may_differ else "generation config"
        raise ValueError(f"calibration files with another {what} need the split on every file (:calib / :cert) "
                         "and at least one certification file, whose settings the rule then records")
    if len(set(prefixes)) != len(prefixes) or any(not p or ":" in p for p in prefixes):
        raise ValueError(f"prefixes must be distinct, non-empty and without ':', got {prefixes}")
    listed = []
    heads: list[dict[str, Any]] = []
    all_rows: list[dict[str, Any]] = []
    file_rows: list[list[dict[str, Any]]] = []
    config_keys = ("config_fingerprint", "config")
    # The header's model, config and definition of unsafe: the first file's, or with calibration files of another
    # config allowed, the first certification file's (the config the rule will apply to).
    first = next(i for i, sp in enumerate(splits) if sp == "cert") if calib_config_may_differ else 0
    for i, (path, prefix, split) in enumerate(sources):
        h, rows = read_rows(path)
        if h is None:
            raise ValueError(f"{path} has no header row: cannot check it was made with the same model and config")
        heads.append({k: v for k, v in h.items() if k != "type"})
        file_rows.append(rows)
    header = {k: heads[first][k] for k in ("model_fingerprint", "config_fingerprint", "arch", "config",
                                           "unsafe_definition") if k in heads[first]}
    for i, (path, prefix, split) in enumerate(sources):
        h, rows = heads[i], file_rows[i]
        keys = ("model_fingerprint", "unsafe_definition") + (
            () if calib_config_may_differ and split == "calib" else ("config_fingerprint",))
        bad = [k for k in keys if h.get(k) != header.get(k)]
        if bad:
            raise ValueError(f"{path} differs from {sources[first][0]} in {bad}: only pairs of one model, config "
                             "and definition of unsafe can be combined"
                             + (" (calibration files of another generation config: calib_config_may_differ / "
                                "--calib-config-may-differ)" if bad == ["config_fingerprint"] else ""))
        listed.append({"file": Path(path).name, "prefix": prefix, "dataset": h.get("dataset", ""),
                       "seeds": h.get("seeds", ""), "generator": h.get("generator", ""),
                       "requests": len({r["request_id"] for r in rows}), "pairs": len(rows), "split": split,
                       "sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]})
        if calib_config_may_differ and split == "calib":
            listed[-1]["config"] = {k: h.get(k) for k in config_keys}
        for r in rows:
            r = dict(r)
            r["request_id"] = f"{prefix}:{r['request_id']}"
            r["entry_id"] = f"{prefix}:{r['entry_id']}"
            if split is not None:
                r["split"] = split
            all_rows.append(r)
    # The recall (and reuse settings) the pairs were made with travel with them: the rule records the recall and
    # the filter considers only those candidates. Runs made with different ones are not one experiment.
    for key in ("top_k", "min_similarity", "reuse_mode", "reuse_config"):
        idx = range(len(heads))
        if key == "reuse_config" and calib_reuse_may_differ:
            idx = [i for i in idx if splits[i] == "cert"]
            for i in range(len(heads)):
                if splits[i] == "calib":
                    listed[i]["reuse_config"] = heads[i].get(key)
        values = [heads[i].get(key) for i in idx]
        if any(json.dumps(v, sort_keys=True) != json.dumps(values[0], sort_keys=True) for v in values):
            raise ValueError(f"the pairs files differ in {key!r} ({values}): combine only runs made with the same "
                             "recall and reuse settings"
                             + ("" if key != "reuse_config" or calib_reuse_may_differ else
                                " (calibration files made with other reuse settings than the certification files: "
                                "calib_reuse_may_differ / --calib-reuse-may-differ)"))
        if values[0] is not None:
            header[key] = values[0]
    header.update({
        "dataset": (f"{len(listed)} runs combined (request ids prefixed {[x['prefix'] for x in listed]}), each: "
                    + listed[0]["dataset"] if len({x["dataset"] for x in listed}) == 1 else
                    "combined: " + "; ".join(f"[{x['prefix']}] {x['dataset']}" for x in listed)),
        "seeds": {x["prefix"]: x["seeds"] for x in listed},
        "generator": generator or "lab.pairs.combine_pairs_files",
        "sources": listed,
    })
    path = Path(out)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        fh.write(json.dumps({"type": "header", **header}, sort_keys=True) + "\n")
        for r in all_rows:
            fh.write(json.dumps(r, sort_keys=True) + "\n")
    tmp.replace(path)
    return header


__all__ = [
    "CandidateOutcome", "CheckerLabeler", "combine_pairs_files", "EMBEDDED_UNSAFE_DEFINITION", "Labeler",
    "PairContext", "PairRequest", "QUERY_KINDS", "RequestOutcome", "StreamRecord", "StreamResult",
    "ToleranceLabeler", "append_rows", "done_requests", "easycache_model", "embedded_checker_labeler", "embedded_frame",
    "embedded_context", "embedded_queries", "embedded_warm_set", "header_for", "parse_easycache", "weights_version",
    "judge_against_dense", "label_request", "mean_ssim", "measure_stream", "outcome_rows", "psnr_db", "read_rows",
    "summarize_by_kind", "warm_entry", "write_header",
]
