"""Optional judges for users who have the weights: an open-vocabulary detector (OWLv2) and text-video alignment
(SigLIP, or any CLIP-style dual encoder), through ``transformers``.

Carnator never downloads anything for them: weights are loaded with ``local_files_only=True`` from a folder the user
gives, or from ``<ComfyUI models folder>/carnator_judges/<name>`` (the caller passes ComfyUI's models folder; this
module does not import ComfyUI). ``transformers`` is imported when a judge is built, so the runtime never needs it;
without it the judge raises :class:`OptionalJudgeUnavailable` saying what to install.

* :class:`DetectorJudge` — per sampled frame, each named object is looked up by its name as a text query; the best
  box per frame (score above ``score_min``) gives presence (found in at least half the sampled frames), the box
  centre track (where, and motion from the first to the last third of the sampled frames) and the CIELAB colour of
  the pixels in the box most distinct from the frame's median. Alone: fails an object that is not found. Against the
  dense clip (``judge_pair``): fails an object that moved (``d_where``, frame fractions), moves differently
  (``d_motion``) or changed colour (``d_colour``, ΔE2000) beyond its threshold.
* :class:`AlignmentJudge` — mean over sampled frames of the image-text similarity (the model's logit scale and bias)
  of the prompt. Alone: fails below ``score_min`` (default: never). Against the dense clip: fails when the reuse
  clip's score is more than ``d_score`` below the dense clip's, or, given the candidate's source prompt, when the
  reuse clip leans towards the source by more than ``d_source`` more than the dense clip does.

Their default thresholds were NOT fitted or validated on any model (docs/CALIBRATION.md says so); only the plumbing
is tested (tiny random configs). Grounding DINO is not supported.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from .base import JudgeBase, JudgeRequest, Verdict
from .pixels import as_clip

SUBFOLDER = "carnator_judges"


@dataclass(frozen=True)
class Reference:
    """The dense clip's measures and verdict (``excess_label`` reads ``verdict``)."""

    measures: Any
    verdict: Verdict


class OptionalJudgeUnavailable(RuntimeError):
    """An optional judge cannot be built here (missing package or weights); the message says how to fix it."""


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:  # the host venv has it; tests/test_judge_optional.py takes it away
        raise OptionalJudgeUnavailable(
            f"the optional judges need the 'transformers' package ({e}); install it into ComfyUI's Python "
            "(pip install transformers) or use the native judge, which needs no extra package") from None
    return transformers


def resolve_weights(name_or_path: str | os.PathLike, models_dir: str | os.PathLike | None = None) -> Path:
    """The folder holding a judge's weights (a ``transformers`` ``save_pretrained`` folder with ``config.json``):
    ``name_or_path`` itself when it is such a folder, else ``<models_dir>/carnator_judges/<name_or_path>``.
    Raises OptionalJudgeUnavailable naming every place looked at (nothing is downloaded)."""
    tried = [Path(name_or_path)]
    if models_dir is not None:
        tried.append(Path(models_dir) / SUBFOLDER / str(name_or_path))
    for p in tried:
        if (p / "config.json").is_file():
            return p
    raise OptionalJudgeUnavailable(
        f"no weights for the judge {str(name_or_path)!r}: looked for a config.json in {[str(p) for p in tried]}. "
        f"Carnator never downloads judge weights: save them there yourself (e.g. with transformers' "
        f"save_pretrained, or by copying a Hugging Face snapshot folder into models/{SUBFOLDER}/<name>)")


def _pretrained(name_or_path: str | os.PathLike, models_dir: str | os.PathLike | None, *classes: str
                ) -> tuple[Path, list[Any]]:
    """The weights folder and each named ``transformers`` class loaded from it, local files only."""
    tr = _transformers()
    path = resolve_weights(name_or_path, models_dir)
    return path, [getattr(tr, c).from_pretrained(str(path), local_files_only=True) for c in classes]


def _frames(clip: np.ndarray, n: int) -> list[int]:
    t = clip.shape[0]
    return sorted({int(round(i)) for i in np.linspace(0, t - 1, min(n, t))})


def _lab(rgb: np.ndarray) -> np.ndarray:
    from skimage.color import rgb2lab

    return rgb2lab(np.clip(np.asarray(rgb, np.float64), 0, 1).reshape(1, 1, 3)).reshape(3)


def _delta_e(a: Any, b: Any) -> float:
    from skimage.color import deltaE_ciede2000

    return float(deltaE_ciede2000(np.asarray(a, np.float64)[None], np.asarray(b, np.float64)[None])[0])


def _object_names(request: JudgeRequest) -> tuple[str, ...]:
    if request.objects:
        return tuple(o.split("#", 1)[0] for o in request.objects)
    from ..objects import extract_objects

    phrases, _ = extract_objects(request.prompt)
    return tuple(p.name.split("#", 1)[0] for p in phrases)


class DetectorJudge(JudgeBase):
    """Open-vocabulary detection (OWLv2) as a judge; see the module doc. Build with :meth:`load` (weights folder)
    or directly from a ``transformers`` model and processor."""

    name = "detector"

    def __init__(self, model: Any, processor: Any, *, frames: int = 4, score_min: float = 0.1,
                 thresholds: Mapping[str, float] | None = None, source: str = ""):
        self.model, self.processor = model.eval(), processor
        self.frames, self.score_min = int(frames), float(score_min)
        self.thresholds = {"d_where": 0.15, "d_motion": 0.15, "d_colour": 15.0, **(thresholds or {})}
        self.settings: Mapping[str, Any] = {"weights": source, "frames": self.frames, "score_min": self.score_min,
                                            "thresholds": dict(self.thresholds)}

    @classmethod
    def load(cls, name_or_path: str | os.PathLike, models_dir: str | os.PathLike | None = None,
             **kw: Any) -> "DetectorJudge":
        path, (model, processor) = _pretrained(name_or_path, models_dir, "Owlv2ForObjectDetection", "Owlv2Processor")
        return cls(model, processor, source=path.name, **kw)

    def detect(self, clip: Any, names: Sequence[str]) -> dict[str, list[tuple[float, float, float, np.ndarray]]]:
        """Per object name, per sampled frame: (score, cx, cy, CIELAB colour in the box) of its best box, centre in
        frame fractions; frames where the best score is below ``score_min`` are left out."""
        import torch

        x = as_clip(clip)
        idx = _frames(x, self.frames)
        images = [(x[i] * 255).astype(np.uint8) for i in idx]
        inputs = self.processor(text=[list(names)] * len(images), images=images, return_tensors="pt")
        with torch.no_grad():
            out = self.model(**inputs)
        scores = torch.sigmoid(out.logits).float()  # [F, patches, queries]
        boxes = out.pred_boxes.float()  # [F, patches, 4] (cx, cy, w, h) of the padded square input
        h, w = x.shape[1:3]
        side = max(h, w)  # OWLv2 pads to a square at the bottom / right
        res: dict[str, list] = {n: [] for n in names}
        for f, i in enumerate(idx):
            for q, n in enumerate(names):
                best = int(torch.argmax(scores[f, :, q]))
                s = float(scores[f, best, q])
                if s < self.score_min:
                    continue
                cx, cy, bw, bh = (float(v) * side for v in boxes[f, best])
                x0, x1 = int(max(0, cx - bw / 2)), int(min(w, math.ceil(cx + bw / 2)))
                y0, y1 = int(max(0, cy - bh / 2)), int(min(h, math.ceil(cy + bh / 2)))
                px = x[i, y0:max(y1, y0 + 1), x0:max(x1, x0 + 1)].reshape(-1, 3)
                bg = np.median(x[i].reshape(-1, 3), axis=0)
                dist = np.linalg.norm(px - bg, axis=-1)
                colour = _lab(np.median(px[dist >= np.median(dist)], axis=0)) if len(px) else np.zeros(3)
                res[n].append((s, cx / w, cy / h, colour))
        return res

    def _summary(self, det: Mapping[str, list], n_frames: int) -> dict[str, dict[str, Any]]:
        out = {}
        for n, hits in det.items():
            found = len(hits) >= max(1, (n_frames + 1) // 2)
            if not hits:
                out[n] = {"found": False}
                continue
            c = np.asarray([(h[1], h[2]) for h in hits])
            third = max(1, len(hits) // 3)
            out[n] = {"found": found, "where": c.mean(0), "motion": c[-third:].mean(0) - c[:third].mean(0),
                      "colour": np.median(np.asarray([h[3] for h in hits]), axis=0),
                      "score": float(np.mean([h[0] for h in hits]))}
        return out

    def _measure(self, clip: Any, request: JudgeRequest) -> dict[str, dict[str, Any]]:
        names = _object_names(request)
        x = as_clip(clip)
        return self._summary(self.detect(x, names), len(_frames(x, self.frames))) if names else {}

    def judge(self, clip: Any, request: JudgeRequest) -> Verdict:
        m = self._measure(clip, request)
        per = {n: bool(v["found"]) for n, v in m.items()}
        reasons = tuple(f"{n}: not detected in at least half of {self.frames} sampled frames"
                        for n, ok in per.items() if not ok)
        return Verdict(passed=all(per.values()), per_object=per, reasons=reasons,
                       scores={f"{n}.score": float(v.get("score", 0.0)) for n, v in m.items()})

    def reference(self, dense_clip: Any, request: JudgeRequest) -> Any:
        m = self._measure(dense_clip, request)
        return Reference(m, self._verdict_alone(m))

    def _verdict_alone(self, m: Mapping[str, Any]) -> Verdict:
        per = {n: bool(v["found"]) for n, v in m.items()}
        return Verdict(passed=all(per.values()), per_object=per,
                       reasons=tuple(f"{n}: not detected" for n, ok in per.items() if not ok))

    def judge_pair(self, ref: Any, reuse_clip: Any, dense_clip: Any, request: JudgeRequest) -> Verdict:
        dense = ref.measures if isinstance(ref, Reference) else self._measure(dense_clip, request)
        reuse = self._measure(reuse_clip, request)
        per, reasons, scores = {}, [], {}
        for n, r in reuse.items():
            d = dense.get(n, {"found": False})
            if not r["found"]:
                per[n] = False
                reasons.append(f"{n}: not detected")
                continue
            if not d["found"]:
                per[n] = True
                continue
            diffs = {"d_where": float(np.linalg.norm(r["where"] - d["where"])),
                     "d_motion": float(np.linalg.norm(r["motion"] - d["motion"])),
                     "d_colour": _delta_e(r["colour"], d["colour"])}
            scores.update({f"{n}.{k}": v for k, v in diffs.items()})
            bad = [k for k, v in diffs.items() if v > self.thresholds[k]]
            per[n] = not bad
            reasons += [f"{n}: {k[2:]} differs from the dense clip ({diffs[k]:.3f} > {self.thresholds[k]:g})"
                        for k in bad]
        return Verdict(passed=all(per.values()), per_object=per, reasons=tuple(reasons), scores=scores)


class AlignmentJudge(JudgeBase):
    """Text-video alignment (SigLIP, or a CLIP-style dual encoder) as a judge; see the module doc."""

    name = "alignment"

    def __init__(self, model: Any, tokenizer: Any, image_processor: Any, *, frames: int = 4,
                 score_min: float = -math.inf, d_score: float = 1.0, d_source: float = 0.5, source: str = ""):
        self.model, self.tokenizer, self.image_processor = model.eval(), tokenizer, image_processor
        self.frames, self.score_min, self.d_score, self.d_source = int(frames), score_min, d_score, d_source
        self.settings: Mapping[str, Any] = {"weights": source, "frames": self.frames, "score_min": score_min,
                                            "d_score": d_score, "d_source": d_source}

    @classmethod
    def load(cls, name_or_path: str | os.PathLike, models_dir: str | os.PathLike | None = None,
             **kw: Any) -> "AlignmentJudge":
        path, (model, tok, imp) = _pretrained(name_or_path, models_dir, "AutoModel", "AutoTokenizer",
                                              "AutoImageProcessor")
        return cls(model, tok, imp, source=path.name, **kw)

    def scores(self, clip: Any, prompts: Sequence[str]) -> np.ndarray:
        """[len(prompts)] mean over sampled frames of the image-text logit (scale x cosine + bias)."""
        import torch

        x = as_clip(clip)
        images = [(x[i] * 255).astype(np.uint8) for i in _frames(x, self.frames)]
        pix = self.image_processor(images=images, return_tensors="pt")
        txt = self.tokenizer(list(prompts), padding="max_length", truncation=True, return_tensors="pt",
                             max_length=getattr(self.model.config.text_config, "max_position_embeddings", 64))
        with torch.no_grad():
            img = self.model.get_image_features(**pix)
            tf = self.model.get_text_features(**txt)
            img = getattr(img, "pooler_output", img)
            tf = getattr(tf, "pooler_output", tf)
            img = img / img.norm(dim=-1, keepdim=True)
            tf = tf / tf.norm(dim=-1, keepdim=True)
            logits = img @ tf.T * self.model.logit_scale.exp()
            bias = getattr(self.model, "logit_bias", None)
            if bias is not None:
                logits = logits + bias
        return logits.float().mean(0).numpy()

    def _measure(self, clip: Any, request: JudgeRequest) -> dict[str, float]:
        prompts = [request.prompt] + ([request.source_prompt] if request.source_prompt else [])
        s = self.scores(clip, prompts)
        return {"score": float(s[0]), "lean_source": float(s[1] - s[0]) if len(s) > 1 else 0.0}

    def judge(self, clip: Any, request: JudgeRequest) -> Verdict:
        m = self._measure(clip, request)
        ok = m["score"] >= self.score_min
        return Verdict(passed=ok, scene=ok, scores=m,
                       reasons=() if ok else (f"scene: text-video score {m['score']:.3f} < {self.score_min}",))

    def reference(self, dense_clip: Any, request: JudgeRequest) -> Any:
        m = self._measure(dense_clip, request)
        ok = m["score"] >= self.score_min
        return Reference(m, Verdict(passed=ok, scene=ok, scores=m))

    def judge_pair(self, ref: Any, reuse_clip: Any, dense_clip: Any, request: JudgeRequest) -> Verdict:
        d = ref.measures if isinstance(ref, Reference) else self._measure(dense_clip, request)
        r = self._measure(reuse_clip, request)
        reasons = []
        if r["score"] < d["score"] - self.d_score:
            reasons.append(f"scene: text-video score {r['score']:.3f} is more than {self.d_score:g} below the dense "
                           f"clip's {d['score']:.3f}")
        if request.source_prompt and r["lean_source"] > d["lean_source"] + self.d_source:
            reasons.append(f"scene: leans towards the candidate's source prompt ({r['lean_source']:.3f} vs the dense "
                           f"clip's {d['lean_source']:.3f})")
        ok = not reasons
        return Verdict(passed=ok, scene=ok, reasons=tuple(reasons),
                       scores={"score": r["score"], "d_score": d["score"] - r["score"],
                               "d_lean_source": r["lean_source"] - d["lean_source"]})
