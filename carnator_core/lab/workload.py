"""The embedded-world serving workload: a warm set and a disjoint request stream with realistic repetition.

How it is built (deterministic given ``WorkloadSpec.seed``)
-----------------------------------------------------------
1. **Scene templates.** ``n_templates`` scenes are drawn from the embedded world (``world.sample_scene``; never a
   held-out attribute combination, 1-2 objects). A template stands for one thing some user wants to see.
2. **Popularity.** Every request picks its template from a Zipf law, P(template i) ∝ (i + 1)^-s: a few scenes
   are asked for again and again, most only once or twice (a heavy tail, as in prompt logs).
3. **One timeline.** The warm set is the first ``n_warm`` requests of one timeline and the stream the next
   ``n_stream``; the stream is *disjoint* from the warm set as requests (no stream request is a warm record),
   while its content may repeat warm content exactly the way later traffic repeats earlier traffic.
4. **Iteration.** The first request of a template is its ``base`` (template caption, template seed). A later
   request of the same template iterates on that template's *latest* request (users refine their last try):

   * ``exact``       — the same prompt and seed again (re-submitted job, shared link, fixed-seed API client);
   * ``reroll``      — the same prompt with a new seed ("randomize" seed control);
   * ``paraphrase``  — the same scene described in other words, same seed;
   * ``edit:<attr>`` — one attribute of one object (colour, size, position, motion) or the background changed,
     same seed and the same wording apart from the changed words (ComfyUI's "fixed" seed while editing the
     prompt).

   The kind is drawn from ``Mix``. The warm set never contains exact repeats (a cache holds one entry per
   (prompt, seed)): there an ``exact`` draw becomes a ``reroll``.
5. **Validity.** Edits keep every object visible on its background (``world.compatible``), two objects apart
   (distinct colours/positions, no overlap in any frame) and outside the held-out split, so the checker's
   verdicts measure reuse, not the model's generalisation.

Why this is realistic: see BENCHMARKS.md, "Serving benchmark: Table 1 on the embedded model" (workload
section), which also measures how much near-duplication a real prompt log (VidProM) shows.

Contract: pure numpy + ``embedded.world``; no torch, no ComfyUI. ``build_workload(spec)`` returns the same
``Workload`` for the same spec on every machine; ``Request.to_json()`` round-trips through ``Request.from_json``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from ..embedded import world
from ..embedded.world import ObjectSpec, Scene

EDIT_ATTRIBUTES: tuple[str, ...] = ("colour", "size", "position", "motion", "background")
KINDS: tuple[str, ...] = ("base", "exact", "reroll", "paraphrase") + tuple(f"edit:{a}" for a in EDIT_ATTRIBUTES)
SEED_RANGE = 2**31 - 1


@dataclass(frozen=True)
class Mix:
    """Probabilities of the kinds of a repeat request (a request whose template was asked for before).
    ``edit`` is split evenly over ``EDIT_ATTRIBUTES``. They need not sum to 1 (they are normalised)."""

    exact: float = 0.05
    reroll: float = 0.15
    paraphrase: float = 0.15
    edit: float = 0.65

    def probabilities(self, allow_exact: bool = True) -> dict[str, float]:
        raw = {"exact": self.exact if allow_exact else 0.0,
               "reroll": self.reroll + (0.0 if allow_exact else self.exact), "paraphrase": self.paraphrase}
        for a in EDIT_ATTRIBUTES:
            raw[f"edit:{a}"] = self.edit / len(EDIT_ATTRIBUTES)
        if any(v < 0 for v in raw.values()):
            raise ValueError(f"Mix probabilities must be >= 0, got {self}")
        total = sum(raw.values())
        if total <= 0:
            raise ValueError(f"Mix probabilities sum to 0: {self}")
        return {k: v / total for k, v in raw.items()}


@dataclass(frozen=True)
class WorkloadSpec:
    """Sizes and knobs of a workload. ``n_templates`` 0 = automatic: max(4, (n_warm + n_stream) // 3)."""

    n_warm: int = 24
    n_stream: int = 24
    n_templates: int = 0
    zipf_s: float = 1.1
    p_two: float = 0.3
    mix: Mix = Mix()
    seed: int = 0

    def templates(self) -> int:
        return self.n_templates if self.n_templates > 0 else max(4, (self.n_warm + self.n_stream) // 3)

    def validate(self) -> "WorkloadSpec":
        if self.n_warm < 0 or self.n_stream < 0:
            raise ValueError(f"n_warm and n_stream must be >= 0, got {self.n_warm}, {self.n_stream}")
        if self.zipf_s < 0:
            raise ValueError(f"zipf_s must be >= 0 (0 = uniform popularity), got {self.zipf_s}")
        if not 0.0 <= self.p_two <= 1.0:
            raise ValueError(f"p_two must be in [0, 1], got {self.p_two}")
        self.mix.probabilities()
        return self

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["n_templates_effective"] = self.templates()
        return d


@dataclass(frozen=True)
class Request:
    """One request of the workload.

    rid:          "w0007" (warm) or "s0012" (stream); position in the timeline = order of service.
    prompt, seed: what the user submits (seed = the Early Probe's / KSampler's noise seed).
    template:     scene template index; kind: one of ``KINDS``; parent: rid this request iterates on (None
                  for a base); caption_seed: the wording seed (edits keep it, so only changed words differ).
    scene:        the structured scene the prompt describes (ground truth for the checker).
    repeat_of:    rid of an earlier request with the same (prompt, seed), if any (an exact repeat in content).
    """

    rid: str
    prompt: str
    seed: int
    template: int
    kind: str
    parent: Optional[str]
    caption_seed: int
    scene: Scene
    repeat_of: Optional[str] = None

    @property
    def phase(self) -> str:
        return "warm" if self.rid.startswith("w") else "stream"

    def to_json(self) -> dict[str, Any]:
        return {"rid": self.rid, "prompt": self.prompt, "seed": self.seed, "template": self.template,
                "kind": self.kind, "parent": self.parent, "caption_seed": self.caption_seed,
                "repeat_of": self.repeat_of, "scene": scene_to_json(self.scene)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Request":
        return cls(rid=d["rid"], prompt=d["prompt"], seed=int(d["seed"]), template=int(d["template"]),
                   kind=d["kind"], parent=d.get("parent"), caption_seed=int(d["caption_seed"]),
                   scene=scene_from_json(d["scene"]), repeat_of=d.get("repeat_of"))


@dataclass(frozen=True)
class Workload:
    spec: WorkloadSpec
    warm: tuple[Request, ...]
    stream: tuple[Request, ...]
    template_probs: tuple[float, ...] = field(default=(), repr=False)

    @property
    def requests(self) -> tuple[Request, ...]:
        return self.warm + self.stream

    def digest(self) -> str:
        """Content digest of the requests (to state in results which workload was served)."""
        body = json.dumps([r.to_json() for r in self.requests], sort_keys=True).encode()
        return hashlib.sha256(body).hexdigest()[:16]

    def to_jsonl(self) -> str:
        head = {"workload": self.spec.to_json(), "digest": self.digest()}
        return "\n".join([json.dumps(head)] + [json.dumps(r.to_json()) for r in self.requests]) + "\n"


def scene_to_json(scene: Scene) -> dict[str, Any]:
    return {"background": scene.background, "objects": [dataclasses.asdict(o) for o in scene.objects]}


def scene_from_json(d: dict[str, Any]) -> Scene:
    return Scene(tuple(ObjectSpec(**o) for o in d["objects"]), d["background"])


# ----------------------------------------------------------------------------------------------- scene edits
def _overlap(a: ObjectSpec, b: ObjectSpec) -> bool:
    """Whether two objects touch in any frame (with a one-pixel margin, as ``world.sample_scene`` demands)."""
    from scipy.ndimage import binary_dilation

    ma = world.object_alpha(a) > 0
    mb = world.object_alpha(b) > 0
    grown = np.stack([binary_dilation(f) for f in mb])
    return bool((ma & grown).any())


def valid_scene(scene: Scene) -> bool:
    """Every object visible on the background, outside the held-out split; two objects apart and distinct."""
    if scene.background not in world.BACKGROUNDS:
        return False
    for o in scene.objects:
        if not world.compatible(o.colour, scene.background) or world.is_held_out(o):
            return False
    if len(scene.objects) == 2:
        a, b = scene.objects
        if a.colour == b.colour or a.position == b.position or _overlap(a, b):
            return False
    return True


def edit_scene(scene: Scene, attribute: str, rng: np.random.Generator) -> Optional[Scene]:
    """``scene`` with exactly one attribute changed (of a random object, or the background), or None when no
    valid change exists. Raises ValueError for an unknown attribute."""
    if attribute not in EDIT_ATTRIBUTES:
        raise ValueError(f"unknown edit attribute {attribute!r}; expected one of {EDIT_ATTRIBUTES}")
    options: list[Scene] = []
    if attribute == "background":
        options = [dataclasses.replace(scene, background=b) for b in world.BACKGROUNDS if b != scene.background]
    else:
        k = int(rng.integers(len(scene.objects)))
        obj = scene.objects[k]
        values = {"colour": world.COLOURS, "size": world.SIZES, "position": world.POSITIONS,
                  "motion": world.MOTIONS}[attribute]
        for v in values:
            if v == getattr(obj, attribute):
                continue
            objs = list(scene.objects)
            objs[k] = dataclasses.replace(obj, **{attribute: v})
            options.append(dataclasses.replace(scene, objects=tuple(objs)))
    options = [s for s in options if valid_scene(s)]
    if not options:
        return None
    return options[int(rng.integers(len(options)))]


# ----------------------------------------------------------------------------------------------- the builder
def zipf_probs(n: int, s: float) -> np.ndarray:
    p = (np.arange(1, n + 1, dtype=np.float64)) ** (-float(s))
    return p / p.sum()


def build_workload(spec: WorkloadSpec = WorkloadSpec()) -> Workload:
    """Build the warm set and the stream (see the module docstring). Deterministic for a given spec."""
    spec.validate()
    rng = np.random.default_rng(spec.seed)
    n_t = spec.templates()
    templates: list[Scene] = []
    while len(templates) < n_t:
        s = world.sample_scene(rng, p_two=spec.p_two)
        if valid_scene(s):
            templates.append(s)
    t_seeds = [int(x) for x in rng.integers(SEED_RANGE, size=n_t)]
    t_caps = [int(x) for x in rng.integers(SEED_RANGE, size=n_t)]
    probs = zipf_probs(n_t, spec.zipf_s)
    latest: dict[int, Request] = {}
    seen: dict[tuple[str, int], str] = {}
    out: list[Request] = []
    for i in range(spec.n_warm + spec.n_stream):
        warm = i < spec.n_warm
        rid = f"w{i:04d}" if warm else f"s{i - spec.n_warm:04d}"
        t = int(rng.choice(n_t, p=probs))
        parent = latest.get(t)
        if parent is None:
            req = Request(rid, world.caption(templates[t], np.random.default_rng(t_caps[t])), t_seeds[t], t, "base",
                          None, t_caps[t], templates[t])
        else:
            req = _iterate(rid, parent, rng, spec.mix.probabilities(allow_exact=not warm))
        key = (req.prompt, req.seed)
        if warm and key in seen:
            # A cache holds one entry per (prompt, seed): re-roll the seed of an accidental duplicate.
            while key in seen:
                key = (req.prompt, int(rng.integers(SEED_RANGE)))
            req = dataclasses.replace(req, seed=key[1], kind="reroll" if req.kind == "exact" else req.kind)
        if key in seen:
            req = dataclasses.replace(req, repeat_of=seen[key])
        seen.setdefault(key, rid)
        latest[t] = req
        out.append(req)
    return Workload(spec, tuple(out[:spec.n_warm]), tuple(out[spec.n_warm:]), tuple(float(p) for p in probs))


def _iterate(rid: str, parent: Request, rng: np.random.Generator, probs: dict[str, float]) -> Request:
    kinds = list(probs)
    for _ in range(100):
        kind = kinds[int(rng.choice(len(kinds), p=[probs[k] for k in kinds]))]
        if kind == "exact":
            return dataclasses.replace(parent, rid=rid, kind=kind, parent=parent.rid, repeat_of=None)
        if kind == "reroll":
            return dataclasses.replace(parent, rid=rid, kind=kind, parent=parent.rid,
                                       seed=int(rng.integers(SEED_RANGE)), repeat_of=None)
        if kind == "paraphrase":
            for _ in range(20):
                cs = int(rng.integers(SEED_RANGE))
                text = world.caption(parent.scene, np.random.default_rng(cs))
                if text != parent.prompt:
                    return dataclasses.replace(parent, rid=rid, kind=kind, parent=parent.rid, prompt=text,
                                               caption_seed=cs, repeat_of=None)
            continue
        scene = edit_scene(parent.scene, kind.split(":", 1)[1], rng)
        if scene is None:
            continue
        text = world.caption(scene, np.random.default_rng(parent.caption_seed))
        return Request(rid, text, parent.seed, parent.template, kind, parent.rid, parent.caption_seed, scene)
    raise RuntimeError(f"could not derive a request from {parent.rid} ({parent.prompt!r})")


# ----------------------------------------------------------------------------------------------- statistics
_TOKEN_RE = re.compile(r"[a-z0-9]+")


def tokens(text: str) -> frozenset[str]:
    """Lower-case alphanumeric word set of a prompt (for token-Jaccard near-duplicate statistics)."""
    return frozenset(_TOKEN_RE.findall(text.lower()))


def jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    u = len(a | b)
    return len(a & b) / u if u else 0.0


def max_jaccard(queries: Sequence[str], corpus: Sequence[str]) -> np.ndarray:
    """For every query, the highest token-Jaccard similarity to any corpus text (0 for an empty corpus)."""
    ct = [tokens(c) for c in corpus]
    out = np.zeros(len(queries))
    for i, q in enumerate(queries):
        qt = tokens(q)
        out[i] = max((jaccard(qt, c) for c in ct), default=0.0)
    return out


def describe(wl: Workload, thresholds: Iterable[float] = (0.5, 0.7, 0.9, 1.0)) -> dict[str, Any]:
    """Repetition statistics of a workload: kinds in the stream, how many stream requests come from a template
    that is in the warm set, exact (prompt, seed) repeats of warm requests, and the fraction of stream prompts
    whose nearest warm prompt has token-Jaccard >= each threshold."""
    warm_t = {r.template for r in wl.warm}
    warm_keys = {(r.prompt, r.seed) for r in wl.warm}
    kinds: dict[str, int] = {}
    for r in wl.stream:
        kinds[r.kind] = kinds.get(r.kind, 0) + 1
    n = max(len(wl.stream), 1)
    mj = max_jaccard([r.prompt for r in wl.stream], [r.prompt for r in wl.warm])
    tmpl_counts = np.bincount([r.template for r in wl.requests], minlength=wl.spec.templates())
    return {
        "n_warm": len(wl.warm), "n_stream": len(wl.stream), "templates": wl.spec.templates(),
        "templates_used": int((tmpl_counts > 0).sum()),
        "top_template_share": float(tmpl_counts.max() / max(tmpl_counts.sum(), 1)),
        "stream_kinds": dict(sorted(kinds.items())),
        "stream_template_in_warm": sum(r.template in warm_t for r in wl.stream) / n,
        "stream_exact_repeat_of_warm": sum((r.prompt, r.seed) in warm_keys for r in wl.stream) / n,
        "stream_two_objects": sum(len(r.scene.objects) == 2 for r in wl.stream) / n,
        "near_duplicate_jaccard": {f"{t:g}": float((mj >= t).mean()) if len(mj) else 0.0 for t in thresholds},
        "digest": wl.digest(),
    }


__all__ = ["EDIT_ATTRIBUTES", "KINDS", "Mix", "Request", "Workload", "WorkloadSpec", "build_workload", "describe",
           "edit_scene", "jaccard", "max_jaccard", "scene_from_json", "scene_to_json", "tokens", "valid_scene",
           "zipf_probs"]
