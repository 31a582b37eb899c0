"""The judge interface and the excess label on top of it.

Contract of a judge (:class:`Judge`):
- ``judge(clip, request)`` returns a :class:`Verdict` for one decoded clip ``[T, H, W, 3]`` in [0, 1] (numpy or a
  CPU tensor). It must be deterministic for the same clip and request, and must not mutate the clip.
- ``name`` and ``settings`` identify the judge in a rule's provenance: two labels are comparable only when both
  were made by the same name and settings.
- ``reference(dense_clip, request)`` may precompute what every reuse clip of the same request is held against
  (e.g. the dense clip's own verdict); the default judges the dense clip. A reference that is not itself a
  :class:`Verdict` may carry the dense clip's verdict as its ``verdict`` attribute (the native judge's does), so
  ``excess_label`` need not judge the dense clip twice.
- A judge that holds a reuse clip against the dense clip (a pixel artifact ratio, the generation-native judge's
  comparison with the dense clip's quantities) does that in ``judge_pair``; the default judges the reuse clip
  alone. ``excess_label`` always goes through ``judge_pair``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, runtime_checkable


@dataclass(frozen=True)
class JudgeRequest:
    """What a judge may know of the request a clip was made for.

    prompt:        the request's prompt.
    objects:       the named objects (``objects.extract_objects`` names, prompt order); empty = parse the prompt.
    seed:          the request's seed.
    model:         the model's fingerprint or a readable name (a judge may refuse a model it was not set up for).
    source_prompt: the cached candidate's prompt, when the clip is a reuse output (a judge may test whether the
                   clip is better explained by the source than by the target).
    extra:         judge-specific facts (e.g. the embedded world's scene), never required by the interface.
    """

    prompt: str
    objects: tuple[str, ...] = ()
    seed: int = 0
    model: str = ""
    source_prompt: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Verdict:
    """One clip's verdict. ``passed`` is the request-level verdict; ``per_object`` maps each named object to its
    pass/fail; ``scene`` is the verdict on what is not an object (background, lighting, artifacts; None when not
    judged); ``reasons`` are short human-readable strings for every failure ("ball: colour red, expected blue");
    ``scores`` the numbers behind the verdict (for reports and validation tables)."""

    passed: bool
    per_object: Mapping[str, bool] = field(default_factory=dict)
    scene: bool | None = None
    reasons: tuple[str, ...] = ()
    scores: Mapping[str, float] = field(default_factory=dict)


@runtime_checkable
class Judge(Protocol):
    name: str
    settings: Mapping[str, Any]

    def judge(self, clip: Any, request: JudgeRequest) -> Verdict: ...

    def reference(self, dense_clip: Any, request: JudgeRequest) -> Any: ...

    def judge_pair(self, ref: Any, reuse_clip: Any, dense_clip: Any, request: JudgeRequest) -> Verdict: ...


class JudgeBase:
    """Defaults for ``reference`` (the dense clip's verdict) and ``judge_pair`` (the reuse clip alone)."""

    name: str = "judge"
    settings: Mapping[str, Any] = {}

    def judge(self, clip: Any, request: JudgeRequest) -> Verdict:  # pragma: no cover - abstract
        raise NotImplementedError

    def reference(self, dense_clip: Any, request: JudgeRequest) -> Any:
        return self.judge(dense_clip, request)

    def judge_pair(self, ref: Any, reuse_clip: Any, dense_clip: Any, request: JudgeRequest) -> Verdict:
        return self.judge(reuse_clip, request)


@dataclass(frozen=True)
class ExcessLabel:
    """The excess label of one reuse clip: ``b`` (unsafe: reuse fails where dense passes) and ``c`` (better:
    reuse passes where dense fails); both False when the two agree. The verdicts are kept for reports."""

    b: bool
    c: bool
    reuse: Verdict
    dense: Verdict
    judge: str

    @property
    def unsafe(self) -> bool:
        return self.b


def excess_label(judge: Judge, reuse_clip: Any, dense_clip: Any, request: JudgeRequest,
                 ref: Any = None) -> ExcessLabel:
    """b/c of ``reuse_clip`` against ``dense_clip`` (the dense output of the same request and seed) under
    ``judge``. ``ref`` is ``judge.reference(dense_clip, request)`` when already computed (once per request)."""
    if ref is None:
        ref = judge.reference(dense_clip, request)
    dense_v = ref if isinstance(ref, Verdict) else getattr(ref, "verdict", None)
    if not isinstance(dense_v, Verdict):
        dense_v = judge.judge(dense_clip, request)
    reuse_v = judge.judge_pair(ref, reuse_clip, dense_clip, request)
    return ExcessLabel(b=(not reuse_v.passed) and dense_v.passed, c=reuse_v.passed and not dense_v.passed,
                       reuse=reuse_v, dense=dense_v, judge=judge.name)
