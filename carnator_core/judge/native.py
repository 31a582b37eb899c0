"""The generation-native judge: the user's own video model asked what a finished clip shows.

No extra weights: the judge re-noises the clip's latent to a few low noise levels with the seed's own noise (the
noise KSampler draws for that seed) and asks the model for one x0 prediction per level, in one CFG batch of two
conditionings (``comfy_patch.denoise_levels``; the ComfyUI-specific part lives there and in the adapters). From
those calls it reads:

(a) **explanation** — the denoising error of the clip under the target prompt and under an alternative: the
    candidate's source prompt when the clip is a reuse output (a clip that carries the source's scene is explained
    better by the source), else the empty prompt (how much the prompt explains at all). ``margin`` = mean over
    levels of (e_target - e_alt) / (e_target + e_alt): negative when the target explains the clip better.
(b) **objects** — each named object's cross-attention support at low noise (the target prompt's object tokens over
    the video tokens, captured in the middle layers as the Early Probe captures them): ``presence`` (share of a
    frame's attention mass on its top tenth of cells; 0.1 = spread evenly), where (the support's centroid, frame
    fractions), motion (centroid of the last third of frames minus the first third), size (support share of the
    frame) and colour (CIELAB of the clip's pixels under the support, the half most distinct from the clip's
    background) and ``local`` — (a) localised: the target's denoising error minus the alternative's over the
    object's support (a share of both errors over the clip; > 0 where the target explains that region worse);
    **scene**: CIELAB means of the clip outside every support on a 2 x 2 grid.

A clip alone (:meth:`NativeJudge.judge`) fails when a named object's presence is below ``presence_min`` or the
margin is above ``margin_max_empty`` / ``margin_max_source``. A reuse clip in the excess label
(:meth:`NativeJudge.judge_pair`) is held against the same quantities of the same-seed dense clip (same noise, same
alternative): it fails when the margin rose by more than ``d_margin``, the target error rose by more than
``d_error`` (relative), or an object moved (``d_where``), moves differently (``d_motion``), changed colour
(``d_colour``, ΔE2000), size (``d_size``, |log ratio|) or presence (``d_presence``), its region is explained worse
(``d_local``), or the scene's colours changed
(``d_scene``, ΔE2000, worst cell). Default thresholds were fitted on the embedded model (docs/CALIBRATION.md, "Real
models: which judge, what it sees, what it misses"); they are in the judge's settings, so labels made under other
thresholds never mix.

Cost per clip: one model call (batch 2) per noise level, i.e. ``len(sigmas)`` / (steps x 1) of a dense CFG run.
The clip's latent comes from ``request.extra["latent"]`` (the LATENT samples the request produced; what serving
has) or from ``vae_encode(clip)``. Runtime-safe: ComfyUI is touched only through ``comfy_patch`` (imported when a
clip is judged) and the adapters.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from .base import JudgeBase, JudgeRequest, Verdict

#: Thresholds (see the module doc); ``NativeSettings.thresholds`` overrides any. Fitted on the embedded model by
#: scripts/lab/validate_judge.py on its calibration half (the fewest false alarms catching >= 90 % of the second
#: label's failures, then the middle of the interval of thresholds giving that: 0.538). There the margin's rise alone
#: separates failures from passes; the other quantities are reported (scores) but off (inf) by default, since on the
#: embedded model they added false alarms and no detection, and the judge alone (a clip without its dense clip) is
#: off too (it told too few failing dense clips), so the native judge's excess label has no c.
DEFAULT_THRESHOLDS: Mapping[str, float] = {
    "presence_min": 0.0,
    "margin_max_empty": math.inf,
    "margin_max_source": math.inf,
    "d_margin": 0.54,
    "d_error": math.inf,
    "d_where": math.inf,
    "d_motion": math.inf,
    "d_colour": math.inf,
    "d_size": math.inf,
    "d_presence": math.inf,
    "d_scene": math.inf,
    "d_local": math.inf,
}


@dataclass(frozen=True)
class NativeSettings:
    """How the native judge looks.

    sigmas:       the noise levels (flow sigma, 0 = clean, 1 = pure noise) the clip is re-noised to; one model
                  call each.
    layers:       transformer blocks whose cross-attention is read; empty = the adapter's middle layers.
    support_mass: an object's support in a frame = the fewest cells holding this share of its attention mass.
    thresholds:   overrides of :data:`DEFAULT_THRESHOLDS`.
    """

    sigmas: tuple[float, ...] = (0.3, 0.5)
    layers: tuple[int, ...] = ()
    support_mass: float = 0.5
    thresholds: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.sigmas or not all(0.0 < float(s) < 1.0 for s in self.sigmas):
            raise ValueError(f"sigmas must be noise levels in (0, 1), got {self.sigmas!r}")
        if not 0.0 < self.support_mass < 1.0:
            raise ValueError(f"support_mass must be in (0, 1), got {self.support_mass!r}")
        unknown = set(self.thresholds) - set(DEFAULT_THRESHOLDS)
        if unknown:
            raise ValueError(f"unknown native-judge thresholds {sorted(unknown)}; known: {sorted(DEFAULT_THRESHOLDS)}")

    def threshold(self, key: str) -> float:
        return float(self.thresholds.get(key, DEFAULT_THRESHOLDS[key]))

    def as_dict(self) -> dict[str, Any]:
        return {"sigmas": [float(s) for s in self.sigmas], "layers": [int(i) for i in self.layers],
                "support_mass": self.support_mass,
                # inf (a check that is off) as None, so the settings stay plain JSON in a rule's provenance
                "thresholds": {k: (None if math.isinf(self.threshold(k)) else self.threshold(k))
                               for k in sorted(DEFAULT_THRESHOLDS)}}


@dataclass(frozen=True)
class ObjectMeasure:
    """One named object's attention support, read at low noise (see the module doc)."""

    presence: float
    where: tuple[float, float]
    motion: tuple[float, float]
    size: float
    lab: tuple[float, float, float] | None  # None: no pixel under the support
    # (a) localised: the target's denoising error minus the alternative's, summed over the object's support, over
    # both errors summed over the whole clip (> 0: the target explains the object's region worse than the
    # alternative does)
    local: float = 0.0


@dataclass(frozen=True)
class NativeMeasures:
    """Everything the native judge read from one clip."""

    alt: str  # "source" or "empty"
    err_target: tuple[float, ...]
    err_alt: tuple[float, ...]
    objects: Mapping[str, ObjectMeasure]
    context_lab: np.ndarray  # [cells, 3]
    model_calls: int
    seconds: float

    @property
    def margin(self) -> float:
        return float(np.mean([(t - a) / max(t + a, 1e-12) for t, a in zip(self.err_target, self.err_alt)]))

    @property
    def error(self) -> float:
        return float(np.mean(self.err_target))


@dataclass(frozen=True)
class NativeReference:
    """The dense clip's measures and verdict (``verdict`` is what ``excess_label`` reads)."""

    measures: NativeMeasures
    verdict: Verdict


def _rgb2lab(rgb: np.ndarray) -> np.ndarray:
    from skimage.color import rgb2lab

    return rgb2lab(np.clip(np.asarray(rgb, np.float64), 0, 1).reshape(-1, 1, 3)).reshape(-1, 3)


def delta_e(a: Any, b: Any) -> float:
    """CIEDE2000 distance of two CIELAB colours."""
    from skimage.color import deltaE_ciede2000

    return float(deltaE_ciede2000(np.asarray(a, np.float64)[None], np.asarray(b, np.float64)[None])[0])


def _support(m: np.ndarray, mass: float) -> np.ndarray:
    """bool [T, H, W]: per frame the fewest cells holding ``mass`` of that frame's (non-negative) attention."""
    t = m.shape[0]
    flat = m.reshape(t, -1)
    order = np.argsort(-flat, axis=1, kind="stable")
    sorted_ = np.take_along_axis(flat, order, axis=1)
    cum = np.cumsum(sorted_, axis=1) / np.maximum(sorted_.sum(1, keepdims=True), 1e-12)
    keep_n = (cum < mass).sum(1) + 1
    out = np.zeros_like(flat, dtype=bool)
    for i in range(t):
        out[i, order[i, :keep_n[i]]] = True
    return out.reshape(m.shape)


def _to_pixels(mask: np.ndarray, shape: tuple[int, int, int]) -> np.ndarray:
    """Nearest-neighbour resample of a token-grid mask [T', H', W'] to the clip's [T, H, W]."""
    t, h, w = shape
    tt, hh, ww = mask.shape
    it = np.minimum(np.arange(t) * tt // t, tt - 1)
    ih = np.minimum(np.arange(h) * hh // h, hh - 1)
    iw = np.minimum(np.arange(w) * ww // w, ww - 1)
    return mask[it][:, ih][:, :, iw]


def object_measure(amap: np.ndarray, clip: np.ndarray | None, bg_rgb: np.ndarray | None, support_mass: float
                   ) -> tuple[ObjectMeasure, np.ndarray | None]:
    """An object's :class:`ObjectMeasure` from its attention map [T', H', W'] and the clip [T, H, W, 3]; also its
    support resampled to the clip's pixels. Without a clip (None) there is no colour and no pixel support."""
    m = np.clip(np.asarray(amap, np.float64), 0, None)
    t, h, w = m.shape
    flat = m.reshape(t, -1)
    frame_mass = np.maximum(flat.sum(1), 1e-12)
    top = max(1, int(round(0.1 * flat.shape[1])))
    presence = float(np.mean(np.sort(flat, axis=1)[:, -top:].sum(1) / frame_mass))
    sup = _support(m, support_mass)
    ys = (np.arange(h) + 0.5) / h
    xs = (np.arange(w) + 0.5) / w
    cents = []
    for i in range(t):
        wgt = m[i] * sup[i]
        s = max(wgt.sum(), 1e-12)
        cents.append((float((wgt.sum(0) * xs).sum() / s), float((wgt.sum(1) * ys).sum() / s)))
    cents_a = np.asarray(cents)
    third = max(1, t // 3)
    motion = cents_a[-third:].mean(0) - cents_a[:third].mean(0) if t > 1 else np.zeros(2)
    size = float(sup.reshape(t, -1).mean())
    pix = _to_pixels(sup, clip.shape[:3]) if clip is not None else None
    lab = None
    if pix is not None and pix.any():
        px = clip[pix]
        dist = np.linalg.norm(px - bg_rgb, axis=-1)
        lab = tuple(float(v) for v in _rgb2lab(np.median(px[dist >= np.median(dist)], axis=0))[0])
    return ObjectMeasure(presence, (float(cents_a[:, 0].mean()), float(cents_a[:, 1].mean())),
                         (float(motion[0]), float(motion[1])), size, lab), pix


def context_lab(clip: np.ndarray, objects_px: np.ndarray) -> np.ndarray:
    """[4, 3] mean CIELAB of the clip's pixels outside every object support, per quadrant (whole clip's mean for a
    quadrant the objects cover entirely)."""
    _, h, w, _ = clip.shape
    free = ~objects_px
    fallback = clip[free].mean(0) if free.any() else clip.reshape(-1, 3).mean(0)
    cells = []
    for ys in (slice(0, h // 2), slice(h // 2, h)):
        for xs in (slice(0, w // 2), slice(w // 2, w)):
            sel = free[:, ys, xs]
            px = clip[:, ys, xs][sel]
            cells.append(px.mean(0) if len(px) else fallback)
    return _rgb2lab(np.asarray(cells))


def _token_excess(raw: Any, patch: tuple[int, int, int]) -> np.ndarray | None:
    """[T', H', W'] on the token grid: per token, the target's squared x0 error minus the alternative's (summed over
    its latent cells and channels, mean over levels), over the sum of both errors over the whole latent. None when
    the latent does not tile into the token grid."""
    import torch

    maps = []
    for lv in raw.levels:
        et = ((lv.cond_x0 - lv.x0) ** 2).sum(1)[0]  # [T, H, W]
        ea = ((lv.alt_x0 - lv.x0) ** 2).sum(1)[0]
        total = float((et + ea).sum()) or 1.0
        d = (et - ea)[None, None].float()
        pooled = torch.nn.functional.avg_pool3d(d, kernel_size=patch, stride=patch, ceil_mode=True)[0, 0]
        maps.append(pooled.numpy() * float(np.prod(patch)) / total)
    out = np.mean(maps, axis=0)
    return out if tuple(out.shape) == tuple(raw.grid) else None


class NativeJudge(JudgeBase):
    """The generation-native judge (see the module doc).

    model:        the user's ComfyUI MODEL (a ModelPatcher); never modified (the calls run on clones).
    encode:       prompt -> CONDITIONING, the text encoder the request was generated with.
    text_encoder: the CLIP (or the embedded encoder) used to locate the object words' tokens; None = objects are
                  not read (explanation only).
    vae_encode:   clip [T, H, W, 3] -> LATENT samples [1, C, T', H', W'], used when the request carries no latent.
    second_model, switch_sigma: a two-expert pair (Wan 2.2 14B): levels below ``switch_sigma`` run on
                  ``second_model`` (the low-noise expert), the others on ``model``.
    negative:     the CONDITIONING of the empty alternative (default: ``encode("")``).
    """

    name = "native"

    def __init__(self, model: Any, encode: Callable[[str], Any], text_encoder: Any = None, *,
                 vae_encode: Callable[[Any], Any] | None = None, second_model: Any = None,
                 switch_sigma: float | None = None, settings: NativeSettings | None = None,
                 negative: Any = None, model_name: str = ""):
        if (second_model is None) != (switch_sigma is None):
            raise ValueError("a two-expert judge needs both second_model and switch_sigma (the sigma below which "
                             "the second, low-noise expert runs)")
        self.model, self.encode, self.text_encoder = model, encode, text_encoder
        self.vae_encode, self.second_model, self.switch_sigma = vae_encode, second_model, switch_sigma
        self.config = settings or NativeSettings()
        self._negative = negative
        self.model_name = model_name
        self.settings: Mapping[str, Any] = {**self.config.as_dict(), "two_expert": second_model is not None,
                                            "switch_sigma": switch_sigma}
        self.last_calls = 0  # model calls of the last measurement (for the cost measurement)

    # -- measuring ----------------------------------------------------------------------------------------------
    def _latent(self, clip: Any, request: JudgeRequest) -> dict:
        import torch

        lat = request.extra.get("latent")
        if lat is None:
            if self.vae_encode is None:
                raise ValueError("the native judge needs the clip's latent: pass it as JudgeRequest.extra['latent'] "
                                 "(the LATENT samples the request produced) or give the judge a vae_encode")
            lat = self.vae_encode(clip)
        lat = lat["samples"] if isinstance(lat, Mapping) else lat
        lat = torch.as_tensor(lat).float()
        if lat.dim() == 4:
            lat = lat[None]
        return {"samples": lat[:1]}

    def _model_for(self, sigma: float) -> Any:
        if self.second_model is not None and sigma < float(self.switch_sigma):
            return self.second_model
        return self.model

    def _objects(self, request: JudgeRequest) -> tuple[Any, ...]:
        if self.text_encoder is None:
            return ()
        from ..probe import objects_for

        override = ", ".join(request.objects) if request.objects else None
        objects, _ = objects_for(request.prompt, self.text_encoder, override)
        return tuple(o for o in objects if o.positions)

    def _patch(self) -> tuple[int, int, int]:
        from ..adapters import adapter_for

        return adapter_for(self.model).patch_of(self.model)

    def _layers(self) -> tuple[int, ...]:
        if self.config.layers:
            return tuple(self.config.layers)
        from ..adapters import adapter_for

        return adapter_for(self.model).middle_layers(self.model)

    def measure(self, clip: Any, request: JudgeRequest) -> NativeMeasures:
        """Run the model on ``clip`` (``len(sigmas)`` calls) and read :class:`NativeMeasures`. ``clip`` may be None
        when the request carries the latent (``extra["latent"]``): everything but the colours is read from the model
        (the default verdict uses none of the colours), so a model whose VAE the caller does not have can be judged."""
        from .. import comfy_patch as cp
        from .pixels import as_clip

        t0 = time.perf_counter()
        x = as_clip(clip) if clip is not None else None
        objects = self._objects(request)
        alt_prompt = request.source_prompt
        if self._negative is None:
            self._negative = self.encode("")
        alternative = self.encode(alt_prompt) if alt_prompt is not None else self._negative
        capture = cp.CaptureConfig(objects=objects, layers=self._layers()) if objects else None
        raw = cp.denoise_levels(self.model, self.encode(request.prompt), alternative, self._latent(x, request),
                                int(request.seed), tuple(float(s) for s in self.config.sigmas), capture,
                                models_by_sigma=self._model_for if self.second_model is not None else None)
        self.last_calls = raw.model_calls
        err_t = tuple(float(((lv.cond_x0 - lv.x0) ** 2).mean()) for lv in raw.levels)
        err_a = tuple(float(((lv.alt_x0 - lv.x0) ** 2).mean()) for lv in raw.levels)
        excess = _token_excess(raw, self._patch())
        bg = np.median(x.reshape(-1, 3), axis=0) if x is not None else None
        measures: dict[str, ObjectMeasure] = {}
        covered = np.zeros(x.shape[:3], bool) if x is not None else None
        for o in objects:
            amap = raw.object_maps.get(o.name)
            if amap is None:
                continue
            om, pix = object_measure(amap, x, bg, self.config.support_mass)
            if excess is not None and excess.shape == amap.shape:
                om = dataclasses.replace(om, local=float((excess * _support(amap, self.config.support_mass)).sum()))
            measures[o.name] = om
            if covered is not None:
                covered |= pix
        # without a decoded clip (the latent alone) no colour is read: the scene's colours are a constant
        ctx = context_lab(x, covered) if x is not None else np.zeros((4, 3))
        return NativeMeasures("source" if alt_prompt is not None else "empty", err_t, err_a, measures, ctx,
                              raw.model_calls, time.perf_counter() - t0)

    # -- verdicts -----------------------------------------------------------------------------------------------
    def verdict_alone(self, m: NativeMeasures) -> Verdict:
        """A clip's verdict from its own measures (no reference)."""
        th = self.config.threshold
        reasons: list[str] = []
        per_object: dict[str, bool] = {}
        scores: dict[str, float] = {"margin": m.margin, "error": m.error}
        for name, om in m.objects.items():
            ok = om.presence >= th("presence_min")
            per_object[name] = ok
            scores[f"{name}.presence"] = om.presence
            if not ok:
                reasons.append(f"{name}: attention support too diffuse (presence {om.presence:.3f} < "
                               f"{th('presence_min'):.3f})")
        limit = th("margin_max_source") if m.alt == "source" else th("margin_max_empty")
        scene = m.margin <= limit
        if not scene:
            other = "the candidate's source prompt" if m.alt == "source" else "the empty prompt"
            reasons.append(f"scene: explained too well by {other} (margin {m.margin:.4f} > {limit:.4f})")
        return Verdict(passed=scene and all(per_object.values()), per_object=per_object, scene=scene,
                       reasons=tuple(reasons), scores=scores)

    def verdict_pair(self, reuse: NativeMeasures, dense: NativeMeasures) -> Verdict:
        """A reuse clip's verdict against the same-seed dense clip's measures (same alternative, same noise)."""
        th = self.config.threshold
        reasons: list[str] = []
        per_object: dict[str, bool] = {}
        d_margin = reuse.margin - dense.margin
        d_error = (reuse.error - dense.error) / max(dense.error, 1e-12)
        scores: dict[str, float] = {"d_margin": d_margin, "d_error": d_error, "margin": reuse.margin}
        scene = True
        margin_fired = d_margin > th("d_margin")
        if d_error > th("d_error"):
            scene = False
            reasons.append(f"scene: the target prompt's denoising error is {100 * d_error:.0f}% above the dense "
                           f"clip's (> {100 * th('d_error'):.0f}%)")
        d_scene = max(delta_e(a, b) for a, b in zip(reuse.context_lab, dense.context_lab))
        scores["d_scene"] = d_scene
        if d_scene > th("d_scene"):
            scene = False
            reasons.append(f"scene: background colours changed (ΔE {d_scene:.1f} > {th('d_scene'):.1f})")
        for name, dm in dense.objects.items():
            rm = reuse.objects.get(name)
            if rm is None:
                per_object[name] = False
                reasons.append(f"{name}: not read in the reuse clip")
                continue
            d = {
                "d_where": float(math.dist(rm.where, dm.where)),
                "d_motion": float(math.dist(rm.motion, dm.motion)),
                "d_size": abs(math.log(max(rm.size, 1e-6) / max(dm.size, 1e-6))),
                "d_presence": dm.presence - rm.presence,
                "d_colour": delta_e(rm.lab, dm.lab) if rm.lab is not None and dm.lab is not None else 0.0,
                "d_local": rm.local - dm.local,
            }
            bad = [k for k, v in d.items() if v > th(k)]
            per_object[name] = not bad
            scores.update({f"{name}.{k}": v for k, v in d.items()})
            for k in bad:
                if k == "d_local":
                    reasons.append(f"{name}: its region is explained worse by the target prompt than in the dense "
                                   f"clip ({d[k]:.3f} > {th(k):.3f})")
                else:
                    reasons.append(f"{name}: {k[2:]} differs from the dense clip ({d[k]:.3f} > {th(k):.3f})")
        if margin_fired:
            # Where the rise of the margin lies: the same error difference over each object's support (``d_local``,
            # in the margin's units). Objects carrying at least half of it take the blame, each one that carries a
            # quarter; otherwise it is the scene's (background, lighting, everywhere).
            other = "the candidate's source prompt" if reuse.alt == "source" else "the empty prompt"
            local = {n: scores.get(f"{n}.d_local", 0.0) for n in per_object}
            blamed = [n for n, v in local.items() if v >= 0.25 * d_margin]
            if blamed and sum(max(v, 0.0) for v in local.values()) >= 0.5 * d_margin:
                for n in blamed:
                    if per_object[n]:
                        per_object[n] = False
                        reasons.append(f"{n}: explained relatively better by {other} than in the dense clip (its "
                                       f"region carries {local[n]:.3f} of the margin's rise {d_margin:.3f})")
            else:
                scene = False
                reasons.append(f"scene: explained relatively better by {other} than the dense clip is "
                               f"(margin +{d_margin:.4f} > {th('d_margin'):.4f})")
        return Verdict(passed=scene and all(per_object.values()), per_object=per_object, scene=scene,
                       reasons=tuple(reasons), scores=scores)

    def judge(self, clip: Any, request: JudgeRequest) -> Verdict:
        return self.verdict_alone(self.measure(clip, request))

    def reference(self, dense_clip: Any, request: JudgeRequest) -> NativeReference:
        m = self.measure(dense_clip, request)
        return NativeReference(m, self.verdict_alone(m))

    def judge_pair(self, ref: Any, reuse_clip: Any, dense_clip: Any, request: JudgeRequest) -> Verdict:
        if not isinstance(ref, NativeReference):
            ref = self.reference(dense_clip, request)
        reuse_req = request
        if "reuse_latent" in request.extra:  # the reuse clip's own latent (``latent`` is the dense clip's)
            reuse_req = dataclasses.replace(request, extra={**request.extra, "latent": request.extra["reuse_latent"]})
        elif "latent" in request.extra:
            reuse_req = dataclasses.replace(request, extra={k: v for k, v in request.extra.items() if k != "latent"})
        return self.verdict_pair(self.measure(reuse_clip, reuse_req), ref.measures)
