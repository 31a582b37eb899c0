"""Judges: per-clip verdicts "does this clip show what its prompt asks", and the excess label built on any judge.

A judge sees one decoded clip and its request; it never sees the other clip of a pair. The excess label
(:func:`excess_label`) holds a reuse clip and the dense clip of the same request and seed against one judge:
b = the reuse clip fails where the dense clip passes, c = it passes where the dense clip fails. This module is
part of the runtime (learning mode labels served traffic with it), so it imports neither ComfyUI nor the lab.

Judges here: :class:`~.checker.CheckerJudge` (the embedded world's pixel checker, ground truth),
:class:`~.native.NativeJudge` (the user's own video model, no extra weights), :class:`~.tolerance.ToleranceJudge`
(a pixel tolerance against the dense clip) and the optional weight-backed judges of :mod:`.optional`
(an open-vocabulary detector, SigLIP text-video alignment). :func:`judge_for` picks the default for a model.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from .base import ExcessLabel, Judge, JudgeBase, JudgeRequest, Verdict, excess_label
from .checker import CheckerJudge
from .tolerance import ToleranceJudge

__all__ = ["CheckerJudge", "ExcessLabel", "Judge", "JudgeBase", "JudgeRequest", "ToleranceJudge", "Verdict",
           "excess_label", "judge_for"]


#: The embedded world's second label as judge settings (the label the per-stratum certificates and learning use).
#: ``checker_version`` 2: the checker's reading that segments two-object scenes by the caption's colours first and
#: fails a shape only when another fits clearly better (``embedded.checker``: small white and dark objects were
#: misread). Labels recorded without the key were made by reading 1, a different label.
SECOND_LABEL: Mapping[str, Any] = {"judge": "checker", "artifact_ratio": 1.25, "strict": True, "detail": True,
                                   "checker_version": 2}


def judge_for(model: Any, arch: str | None = None, settings: Mapping[str, Any] | None = None, *,
              encode: Callable[[str], Any] | None = None, text_encoder: Any = None,
              vae_encode: Callable[[Any], Any] | None = None, second_model: Any = None,
              switch_sigma: float | None = None) -> Judge:
    """The default judge for ``model`` (a ComfyUI MODEL; ``arch`` = ``adapters.detect_arch(model)`` when None).

    - the embedded model ("embedded"): :class:`CheckerJudge` — the pixel checker knows the truth there.
      ``settings``: ``artifact_ratio`` (None = no artifact check), ``strict`` and ``detail`` (True for both plus
      ``artifact_ratio`` 1.25 is the second label, :data:`SECOND_LABEL`: shape, the motion track, blur, object
      interiors and ghosts), ``checker_version`` (the checker's reading, 1 when absent; the second label's is 2).
    - Wan 2.1 / Wan 2.2 / LTX-Video: :class:`~.native.NativeJudge` on the model itself; needs ``encode``
      (prompt -> CONDITIONING) and, to read objects, ``text_encoder`` (the CLIP); ``second_model`` +
      ``switch_sigma`` for a two-expert pair. ``settings``: ``sigmas``, ``layers``, ``support_mass``,
      ``thresholds`` (``native.NativeSettings``).
    - ``settings["judge"]`` forces one: "checker", "native", "tolerance" (``metric``, ``threshold``), or an optional
      weight-backed judge, "detector" (OWLv2) or "alignment" (SigLIP): ``weights`` (a folder, or a name under
      ``models_dir``/carnator_judges), ``models_dir`` (ComfyUI's models folder); never downloaded.
    Raises ValueError naming what is missing."""
    settings = dict(settings or {})
    kind = settings.pop("judge", None)
    if arch is None and kind in (None, "checker"):
        from ..adapters import detect_arch

        arch = detect_arch(model)
    if kind is None:
        kind = "checker" if arch == "embedded" else "native"
    if kind == "checker":
        if arch not in (None, "embedded"):
            raise ValueError(f"the pixel checker judges only the embedded model's world, not a {arch} model; use "
                             "judge='native' (or 'tolerance')")
        from .checker import detail_check

        version = settings.get("checker_version", 1)
        return CheckerJudge(settings.get("artifact_ratio"), strict=bool(settings.get("strict", False)),
                            detail=detail_check(version) if settings.get("detail") else None,
                            checker_version=version)
    if kind == "tolerance":
        return ToleranceJudge(settings.get("metric", "psnr"), float(settings.get("threshold", 25.0)))
    if kind == "native":
        from .native import NativeJudge, NativeSettings

        if encode is None:
            raise ValueError("the native judge needs encode (prompt -> CONDITIONING: the text encoder the requests "
                             "were generated with) to ask the model about a clip")
        known = {"sigmas", "layers", "support_mass", "thresholds"}
        unknown = set(settings) - known
        if unknown:
            raise ValueError(f"unknown native-judge settings {sorted(unknown)}; known: {sorted(known)}")
        cfg = NativeSettings(**{k: (tuple(v) if k in ("sigmas", "layers") else v) for k, v in settings.items()})
        return NativeJudge(model, encode, text_encoder, vae_encode=vae_encode, second_model=second_model,
                           switch_sigma=switch_sigma, settings=cfg)
    if kind in ("detector", "alignment"):
        from .optional import AlignmentJudge, DetectorJudge

        if "weights" not in settings:
            raise ValueError(f"the {kind} judge needs settings['weights']: a folder of transformers weights, or its "
                             "name under <ComfyUI models>/carnator_judges (pass models_dir)")
        cls = DetectorJudge if kind == "detector" else AlignmentJudge
        extra = {k: v for k, v in settings.items() if k not in ("weights", "models_dir")}
        return cls.load(settings["weights"], settings.get("models_dir"), **extra)
    raise ValueError(f"unknown judge {kind!r}; choose 'checker', 'native', 'tolerance', 'detector' or 'alignment'")
