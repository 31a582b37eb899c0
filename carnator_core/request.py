"""Carnator's stage API: the request path as functions that the nodes and ``serve()`` both call.

Stages, in order (each node of the graph makes exactly one of these calls, and ``serve`` makes all of them, so
what calibration certifies through ``serve`` is what a queued workflow runs):

1. ``probe_request``  — exact lookup first: a request whose ``keys.request_key`` matches a cached dense result, or
   (``serve``) whose ``keys.answer_key`` matches an earlier hit's stored answer, is answered from the cache with
   no model call (the returned Probe is *answered*); otherwise the Early Probe.
2. ``signature_stage`` — the Early Signature (an answered probe passes the stored one through).
3. ``recall``         — top-K candidates of the same namespace above a minimum similarity (answered: none).
4. ``decide_stage``   — the Risk Filter (answered: an "exact" decision naming the entry).
5. ``reuse_stage``    — load the accepted entry and finish the request (reuse or dense); an accepted entry that
   vanished meanwhile (evicted, purged, quarantined) means a dense resume, logged once, never a failed request;
   an answered probe returns the stored latent.
6. ``write_result``   — persist a finished dense generation (with its exact-request key) for later requests; a
   hit's result only as an *answer-only* entry under its answer key (never recalled, never reused).

Every online cost is timed separately (ms): key, probe, signature, retrieval, filter, resume, write.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

from . import keys
from .probe import ProbeConfig, ProbeConfigError, objects_for, run_probe, stage_bounds
from .reuse import RULE_CONTEXT_KV_MB, CachedRun, ReuseConfig, RunReport, sample, stage_role
from .signature import SignatureConfig, build_signature_timed
from .types import (
    Candidate,
    Candidates,
    CandidateVerdict,
    Decision,
    ExactAnswer,
    Probe,
    Signature,
    Stage,
    namespace_key,
)

log = logging.getLogger("carnator")

# Recall defaults shared by the Retriever node and ``serve`` (a risk rule may record its own, see ``recall_limits``).
DEFAULT_TOP_K = 5
DEFAULT_MIN_SIMILARITY = 0.0


@dataclass(frozen=True)
class RequestSpec:
    """One generation request (what a workflow's widgets hold)."""

    prompt: str
    seed: int
    steps: int
    cfg: float
    sampler: str = "euler"
    scheduler: str = "simple"
    objects: str | None = None  # user override of the object list
    denoise: float = 1.0
    # The probe's stage of a split schedule (KSamplerAdvanced's start/end steps and switches); the default is the
    # whole schedule on one model.
    stage: Stage = Stage()


@dataclass(frozen=True)
class ServeOptions:
    """How the request is served.

    method:        "dense" (no cache), "carnator" (signature filter + reuse), "prompt_only" (NIRVANA-style
                   filter + the same reuse), "never" (probe + retrieval + filter run, always dense).
    reuse_mode:    sampler mode on a hit: "joint" | "latent" | "attention".
    rule:          RiskRule for "carnator".
    allow_uncertified: accept a rule whose certificate fails (experiments; decisions carry the UNCERTIFIED banner).
    prompt_threshold: similarity threshold of "prompt_only".
    top_k, min_similarity: recall limits; a rule that records its own (``recall_limits``) overrides them.
    exact:         answer exact repeats (same ``keys.request_key``) from the cache before the probe, with no model
                   call ("carnator" and "prompt_only" only: "never" and "dense" always compute). With ``write``,
                   a hit's result is kept as an answer-only entry under ``keys.answer_key`` (the request and
                   ``serving_settings``), so a repeat of the same request *served the same way* is answered too;
                   changing the rule or any setting that decided the hit runs the request again.
    write:         persist the finished generation as a cache entry (dense results; a hit's result only as such an
                   answer, never as an entry later requests reuse).
    """

    method: str = "carnator"
    reuse_mode: str = "joint"
    rule: Any = None
    allow_uncertified: bool = False
    prompt_threshold: float = 0.9
    top_k: int = DEFAULT_TOP_K
    min_similarity: float = DEFAULT_MIN_SIMILARITY
    exact: bool = True
    write: bool = True
    probe: ProbeConfig = ProbeConfig(probe_steps=4)
    signature: SignatureConfig = field(default_factory=SignatureConfig)
    reuse: ReuseConfig = ReuseConfig()

    @property
    def hit_reuse(self) -> ReuseConfig:
        """The reuse settings a hit runs with (``reuse`` in ``reuse_mode``): what pair labelling runs and records."""
        return replace(self.reuse, mode=self.reuse_mode)

    def following_rule(self) -> "ServeOptions":
        """These options with the reuse settings ``rule`` was certified with (its ``"reuse"`` record), for method
        "carnator": the hit then runs exactly the certified path, and when that path reads the probe's
        keys/values (``probe_context``) the probe keeps them (at least ``RULE_CONTEXT_KV_MB``; all or nothing, so
        a model too large for it refreshes densely, as certified runs on it would). Unchanged when there is no
        rule, it records no settings, or it records settings this version does not have (then the sampler
        continues dense and names them, as it must)."""
        meta = getattr(self.rule, "reuse_config", None) if self.method == "carnator" else None
        if not meta:
            return self
        reuse = ReuseConfig.from_meta(meta)
        if reuse is None:
            return self
        probe = self.probe
        if reuse.probe_context and reuse.kv_context and probe.context_kv_mb < RULE_CONTEXT_KV_MB:
            probe = replace(probe, context_kv_mb=RULE_CONTEXT_KV_MB)
        return replace(self, reuse=reuse, reuse_mode=reuse.mode, probe=probe)


@dataclass(frozen=True)
class RequestResult:
    latent: dict
    report: RunReport
    probe: Probe
    signature: Signature
    candidates: Candidates | None
    decision: Decision | None
    entry_id: str | None
    timings_ms: Mapping[str, float]

    @property
    def hit(self) -> bool:
        return self.report.decision == "hit"

    @property
    def exact(self) -> bool:
        return self.probe.answered is not None


def serving_settings(spec: RequestSpec, options: ServeOptions) -> dict[str, Any]:
    """Everything past ``keys.request_key`` that decides a hit's output under ``options`` (as ``serve`` runs them,
    i.e. after ``following_rule``): the filter and its rule (by content), recall limits, the prompt label and
    object override that recall and the signature read, the probe, signature and reuse settings. Two requests with
    the same request key and these settings get the same hit from the same cache entry; the answer of a hit is
    stored and found under ``keys.answer_key(request_key, serving_settings(...))``."""
    from dataclasses import asdict

    rule = options.rule if options.method == "carnator" else None
    k, min_sim = recall_limits(rule, options.top_k, options.min_similarity)
    return {"method": options.method, "prompt": spec.prompt, "objects": spec.objects,
            "rule": rule.rule_id if rule is not None else "", "allow_uncertified": bool(options.allow_uncertified),
            "prompt_threshold": float(options.prompt_threshold) if options.method == "prompt_only" else None,
            "recall": [int(k), float(min_sim)], "probe": asdict(options.probe),
            "signature": options.signature.to_meta(), "reuse": options.hit_reuse.to_meta()}


def answer_key_for(request_key: str, spec: RequestSpec, options: ServeOptions) -> str:
    """``keys.answer_key`` of a request served with ``options`` ("" when it has no request key or the settings
    cannot be digested: then its hits are neither stored nor answered as answers)."""
    if not request_key:
        return ""
    try:
        return keys.answer_key(request_key, serving_settings(spec, options))
    except keys.Opaque:
        return ""


@dataclass(frozen=True)
class WriteResult:
    """What ``write_result`` did: the entry id ("" when nothing was stored), whether a new file was written, and
    a one-line explanation for the node's preview. ``not_cached``: when the cache itself could not store the
    result (full disk, read-only, unreachable, over budget), a few words saying so for the badge ("" otherwise);
    the clip is fine, only its caching failed."""

    entry_id: str
    written: bool
    text: str
    not_cached: str = ""


def _not_cached_reason(e: Exception) -> str:
    """A few words for the badge on why a result could not be cached (the full message goes to the log)."""
    from .cache import errors as ce

    for kind, words in ((ce.CacheFullError, "the disk is full"), (ce.CacheReadOnlyError, "the cache is read-only"),
                        (ce.CacheUnavailableError, "the cache is unreachable"),
                        (ce.CacheBudgetError, "larger than the cache budget")):
        if isinstance(e, kind):
            return words
    return "a cache error (see the server log)"


_NOT_CACHED_SAID: set[str] = set()  # kinds of "not cached" already logged as a warning by this process


# ---------------------------------------------------------------------------------------------- 1. exact + probe
def request_key_for(model: Any, positive: Any, negative: Any, latent: dict, *, seed: int, steps: int, cfg: float,
                    sampler_name: str, scheduler: str, denoise: float = 1.0,
                    split: Mapping[str, Any] | None = None) -> str | None:
    """``keys.request_key`` of a request on a ComfyUI MODEL (None: it cannot be digested; never answered by key).
    ``split``: ``split_key_facts`` of a split schedule (None: the whole schedule on ``model``)."""
    from . import comfy_patch as cp  # ComfyUI-dependent: imported only when a model is actually served
    from .adapters import adapter_for

    adapter = adapter_for(model)
    if not isinstance(latent, dict) or "samples" not in latent:
        return None
    samples = cp.prepare_latent(model, latent)
    sigmas = cp.compute_sigmas(model, steps, sampler_name, scheduler, denoise)
    return keys.request_key(model_fingerprint=cp.model_fingerprint(model, adapter.arch),
                            model_options=getattr(model, "model_options", None), arch=adapter.arch,
                            latent_shape=tuple(int(x) for x in samples.shape), steps=int(steps), sampler=sampler_name,
                            scheduler=scheduler, cfg=float(cfg), sigmas_digest=cp.sigmas_digest(sigmas),
                            denoise=float(denoise), seed=int(seed), positive=positive, negative=negative,
                            latent=latent, split=split)


def split_key_facts(stage: Stage, steps: int, second_model: Any, second_fingerprint: str) -> dict[str, Any] | None:
    """What a split schedule adds to the exact-request key: the probe's stage and, when another model finishes it,
    that model's fingerprint and ``model_options`` (None for the whole schedule on one model)."""
    if stage.is_whole(steps):
        return None
    start, end = stage.bounds(steps)
    facts: dict[str, Any] = {"start": start, "end": end, "add_noise": bool(stage.add_noise),
                             "leftover": stage.leaves_noise(steps)}
    if second_model is not None:
        facts["second_model"] = second_fingerprint
        facts["second_options"] = dict(getattr(second_model, "model_options", None) or {})
    return facts


def lookup_exact(store: Any, request_key: str | None, model: Any, prompt: str, seed: int,
                 answer_key: str = "", dense: bool = True, count_lookup: bool = True) -> Probe | None:
    """The answered Probe of an exact repeat, or None: a cached dense result under ``request_key`` first (unless
    not ``dense``), then an earlier hit's answer-only entry under ``answer_key`` (``answer_key_for`` or
    ``hit_answer_key``; "" = none). Loads the entry
    (checksums verified), counts one hit in its namespace and, with ``count_lookup``, one lookup (off at the
    sampler: the request's recall already counted its lookup). An entry that vanishes or proves corrupt
    meanwhile is simply not an answer."""
    from .cache.store import CacheError

    find = getattr(store, "find_request", None)  # a store without an exact-request index answers nothing
    if find is None or not request_key:
        return None
    t0 = time.perf_counter()
    entry = None
    for key, answer in ((request_key if dense else "", False), (answer_key, True)):
        if not key:
            continue
        try:
            entry_id = find(key)
        except CacheError as e:  # e.g. a shared cache that is unreachable: the request simply runs
            log.info("carnator request: exact lookup unavailable (%s); running the request", e)
            return None
        if entry_id is None:
            continue
        try:
            entry = store.load(entry_id, count_hit=False)
        except CacheError as e:
            log.info("carnator request: exact repeat of entry %s not answered from the cache (%s); running it",
                     entry_id, e)
            return None
        if bool(getattr(entry, "answer_of", "")) != answer:  # the keys are domain-separated: never expected
            return None
        break
    if entry is None:
        return None
    final = entry.tensors.get("latent_final")
    if final is None or final.ndim not in (4, 5):
        return None
    latent = final if final.ndim == 5 else final.unsqueeze(0)
    stage_latent = None
    if entry.config.leftover_noise:  # a split schedule is answered only with its first stage's output too
        switch = entry.tensors.get("latent_switch")
        if switch is None or switch.ndim not in (4, 5):
            return None
        stage_latent = switch if switch.ndim == 5 else switch.unsqueeze(0)
    try:
        store.record_hit(entry_id)  # the data is loaded and verified: answer even if it is evicted this instant
    except CacheError:
        pass
    if count_lookup:
        store.record_lookup(entry.namespace)
    ms = (time.perf_counter() - t0) * 1000
    answer = ExactAnswer(entry_id=entry_id, request_key=request_key, namespace=entry.namespace, prompt=entry.prompt,
                         latent=latent, signature=entry.signature, lookup_ms=ms, stage_latent=stage_latent,
                         answer_of=entry.answer_of)
    what = (f"exact repeat of an earlier hit (answer entry {entry_id}, which reused entry {entry.answer_of})"
            if entry.answer_of else f"exact repeat of cache entry {entry_id}")
    from . import comfy_patch as cp
    from .adapters import adapter_for

    factors, bias = cp.latent_rgb(model)
    x0 = entry.tensors.get("x0_probe", latent[0])
    return Probe(arch=entry.config.arch, model_fingerprint=entry.model_fingerprint, config=entry.config,
                 prompt=prompt, seed=int(seed), objects=(), object_source="none", object_maps={},
                 grid=tuple(entry.signature.grid), patch=adapter_for(model).patch_of(model),  # type: ignore[arg-type]
                 x0_probe=x0, latent_probe=entry.tensors.get("latent_probe", x0), latent_rgb_factors=factors,
                 latent_rgb_bias=bias, embedding=entry.embedding, timings={"probe_ms": 0.0, "exact_ms": ms},
                 note=f"{what}: answered from the cache without running the model",
                 request_key=request_key, answered=answer)


def probe_request(model: Any, positive: Any, negative: Any, latent: dict, spec: RequestSpec, config: ProbeConfig,
                  text_encoder: Any = None, *, store: Any = None,
                  progress: Callable[[int], None] | None = None, second_model: Any = None,
                  serving: "ServeOptions | None" = None) -> Probe:
    """Stage 1. With a ``store``: an exact repeat is answered from it (answered Probe, no model call). Otherwise the
    Early Probe, stamped with the request key and the non-text conditioning digest (part of the namespace).

    A split schedule (``spec.stage``) is probed on its first model; ``second_model`` is the MODEL that continues a
    stage returning leftover noise (Wan 2.2 14B: the low-noise expert), fingerprinted into the namespace and the
    request key. An exact repeat of a split request is answered only from an entry that holds both stages'
    outputs (written from a dense second stage of Carnator's sampler, see ``write_result``). ``serving``: the
    options the request is served with (``serve``); an earlier hit of the same request served the same way is then
    answered too (``answer_key_for``). The graph's Early Probe cannot know the downstream rule and sampler settings
    and answers repeats of dense results only; a graph's repeated hit is answered at its sampler
    (``hit_answer_key`` in ``reuse_stage``)."""
    t0 = time.perf_counter()
    stage_bounds(spec.stage, spec.steps, second_connected=second_model is not None)
    second = ""
    if second_model is not None:
        from . import comfy_patch as cp
        from .adapters import adapter_for

        arch2 = adapter_for(second_model).arch
        if arch2 != adapter_for(model).arch:
            raise ProbeConfigError(f"second_model is a {arch2} model but the probe's model is "
                                   f"{adapter_for(model).arch}: both stages must run the same architecture")
        second = cp.model_fingerprint(second_model, arch2)
    key = request_key_for(model, positive, negative, latent, seed=spec.seed, steps=spec.steps, cfg=spec.cfg,
                          sampler_name=spec.sampler, scheduler=spec.scheduler, denoise=spec.denoise,
                          split=split_key_facts(spec.stage, spec.steps, second_model, second))
    answer_key = answer_key_for(key or "", spec, serving) if (serving is not None and store is not None) else ""
    key_ms = (time.perf_counter() - t0) * 1000
    answered = lookup_exact(store, key, model, spec.prompt, spec.seed, answer_key)
    if answered is not None:
        return replace(answered, timings={**answered.timings, "key_ms": key_ms})
    objs, source = objects_for(spec.prompt, text_encoder, spec.objects)
    probe = run_probe(model, positive, negative, latent, seed=spec.seed, steps=spec.steps, cfg=spec.cfg,
                      sampler_name=spec.sampler, scheduler=spec.scheduler, prompt=spec.prompt, objects=objs,
                      object_source=source, config=config, denoise=spec.denoise, progress=progress,
                      stage=spec.stage, second_model=second)
    cond = keys.conditioning_digest(positive, negative, latent)
    note = probe.note
    if cond.startswith(keys.OPAQUE_PREFIX):
        note = (note + "; " if note else "") + ("the conditioning holds values Carnator cannot identify: nothing is "
                                                "reused for this request and it is not cached")
    return replace(probe, config=replace(probe.config, conditioning=cond), request_key=key or "", note=note,
                   timings={**probe.timings, "key_ms": key_ms}, text_encoder=text_encoder)


# ---------------------------------------------------------------------------------------------- 2-4
def signature_stage(probe: Probe, config: SignatureConfig | None = None) -> tuple[Signature, float]:
    """Stage 2: (signature, build ms). An answered probe's stored signature is passed through (0 ms)."""
    if probe.answered is not None:
        return probe.answered.signature, 0.0
    return build_signature_timed(probe, config)


def recall_limits(rule: Any, top_k: int, min_similarity: float) -> tuple[int, float]:
    """The recall K and minimum similarity to use: a rule that records them (it was certified on that recall)
    wins over the caller's values."""
    k = getattr(rule, "recall_k", None)
    s = getattr(rule, "recall_min_similarity", None)
    return (int(k) if k else int(top_k)), (float(s) if s is not None else float(min_similarity))


def recall(store: Any, probe: Probe, top_k: int = DEFAULT_TOP_K,
           min_similarity: float = DEFAULT_MIN_SIMILARITY) -> Candidates:
    """Stage 3: the top-K entries of the request's namespace (model x config x non-text conditioning) by prompt
    similarity, at least ``min_similarity``. An answered probe is passed through without a lookup. The lookup is
    counted when the request is served (``reuse_stage``), not here: a request interrupted or killed in between
    counts nothing, so the counters equal the per-request reports."""
    if probe.answered is not None:
        a = probe.answered
        return Candidates(namespace=a.namespace, items=(), note=f"exact repeat of entry {a.entry_id}", answered=a)
    import inspect

    ns = namespace_key(probe.model_fingerprint, probe.config)
    kwargs: dict[str, Any] = {"min_similarity": float(min_similarity)}
    params = inspect.signature(store.candidates).parameters
    if "model_fingerprint" in params:  # the store compares it on read
        kwargs["model_fingerprint"] = probe.model_fingerprint
    if "count_lookup" in params:  # counted with the outcome, by reuse_stage
        kwargs["count_lookup"] = False
    found = store.candidates(ns, probe.embedding, int(top_k), **kwargs)
    # Record the recall the candidates came from: the filter checks it covers the rule's certified candidate set.
    return replace(found, k=int(top_k), min_similarity=float(min_similarity))


def exact_decision(candidates: Candidates | None) -> Decision | None:
    """Stage 4 for an exact repeat: the "exact" decision naming the stored entry (None if not an exact repeat)."""
    a = getattr(candidates, "answered", None)
    if a is None:
        return None
    cand = Candidate(entry_id=a.entry_id, similarity=1.0, prompt=a.prompt, signature=a.signature)
    summary = f"exact repeat of entry {a.entry_id}: the stored result is returned without running the model"
    return Decision(accepted=True, candidate=cand, mode="exact", summary=summary,
                    verdicts=(CandidateVerdict(entry_id=a.entry_id, similarity=1.0, accepted=True,
                                               reason="exact repeat (same request key)"),))


def decide_stage(signature: Signature, candidates: Candidates, probe: Probe, *, method: str = "carnator",
                 rule: Any = None, prompt_threshold: float = 0.9, allow_uncertified: bool = False) -> Decision:
    """Stage 4: the Risk Filter on the recalled candidates, checked against the probe's model and config (an
    exact repeat gets its "exact" decision)."""
    from .risk.filter import decide, request_of

    exact = exact_decision(candidates)
    if exact is not None:
        return exact
    mode = {"carnator": "signature", "prompt_only": "prompt_only", "never": "never"}[method]
    return decide(signature, candidates, rule if mode == "signature" else None, mode, prompt_threshold,
                  model_fingerprint=probe.model_fingerprint, config_fingerprint=probe.config.rule_fingerprint(),
                  allow_uncertified=allow_uncertified,
                  signature_settings=signature_settings(rule) if mode == "signature" and rule is not None else None,
                  request=request_of(probe))


def signature_settings(rule: Any) -> Any:
    """The filter's view of Signature Builder settings under ``rule``: the digest of the settings its signatures
    were built with (``RiskRule.signature_config``; a rule that records none was calibrated with the defaults),
    and how to read a signature's (``signature.settings_digest``). A rule whose recorded settings this version
    cannot build raises RuleFormatError."""
    from .risk.filter import SignatureSettings
    from .risk.rule import RuleFormatError
    from .signature import settings_digest

    meta = dict(getattr(rule, "signature_config", None) or {})  # SignatureConfig takes JSON's list for a tuple
    layers = meta.pop("capture_layers", ())
    try:
        digest = SignatureConfig(**meta).digest(tuple(int(i) for i in layers))
    except (TypeError, ValueError) as e:
        raise RuleFormatError(f"the rule's signature settings {meta} are not this version's Signature Builder "
                              f"settings: {e}") from None
    return SignatureSettings(of=settings_digest, rule=digest)


# ---------------------------------------------------------------------------------------------- 5. reuse
def load_accepted(store: Any, decision: Decision | None) -> tuple[CachedRun | None, str]:
    """The accepted entry as a CachedRun, or (None, reason) when it is gone or corrupt by now (evicted, purged or
    quarantined after the filter accepted it): the request then continues dense. Logged once. Counts no hit: the
    sampler may still continue dense (``reuse_stage`` counts the hit once a clip was served from reuse)."""
    from .cache.store import CacheError, CorruptEntryError, EntryNotFoundError

    if decision is None or not decision.accepted or decision.candidate is None or decision.mode == "exact":
        return None, ""
    if store is None:
        raise ValueError("the decision accepted a cache entry but no cache is connected to the sampler")
    entry_id = decision.candidate.entry_id
    try:
        return store.load(entry_id, count_hit=False).cached_run(), ""
    except EntryNotFoundError:
        why = "is no longer in the cache (evicted, purged or quarantined after the filter accepted it)"
    except CorruptEntryError:
        why = "turned out corrupt and was quarantined"
    except CacheError as e:
        why = f"could not be loaded ({e})"
    reason = f"accepted entry {entry_id} {why}: continuing dense"
    log.warning("carnator request: %s", reason)
    return None, reason


def exact_report(probe: Probe, upstream_ms: Mapping[str, float] | None = None, role: str = "") -> RunReport:
    """The report of an exact repeat: a hit with no model call (every step skipped); ``role``: the stage of a
    split schedule it answers (``reuse.stage_role``)."""
    a = probe.answered
    assert a is not None
    g = probe.config
    steps = {"": g.steps, "first": g.stage_end - g.start_step, "second": g.steps - g.stage_end}[role]
    timings = {**dict(upstream_ms or {}), "lookup": float(a.lookup_ms), "key": float(probe.timings.get("key_ms", 0))}
    timings["total"] = sum(v for k, v in timings.items() if k != "total")
    what = (f"exact repeat of an earlier hit: its stored result (answer entry {a.entry_id}, which reused entry "
            f"{a.answer_of}), no model call" if a.answer_of else
            f"exact repeat of entry {a.entry_id}: stored result, no model call")
    return RunReport(decision="hit", mode="exact", entry_id=a.entry_id, active_fraction=0.0, block_density=None,
                     steps_total=steps, steps_probe=0, model_calls=0, replayed_calls=0, skipped_calls=steps,
                     token_fraction=0.0, attention_fraction=0.0, timings_ms=timings, compute_fraction=0.0,
                     reason=what, stage=role,
                     final=not (role == "first" and g.leftover_noise))


def node_cache_report(probe: Probe, report: RunReport, entry_id: str) -> RunReport:
    """The report of a requeued identical graph that ComfyUI's node cache answered: no Carnator stage ran and no
    model was called; ``report`` is the run whose output was handed back (``entry_id``: where it is cached)."""
    steps = int(probe.config.steps)
    kept = report.entry_id or entry_id or None
    return RunReport(decision="hit", mode="node_cache", entry_id=kept, active_fraction=0.0, block_density=None,
                     steps_total=steps, steps_probe=0, model_calls=0, replayed_calls=0, skipped_calls=steps,
                     token_fraction=0.0, attention_fraction=0.0, timings_ms={"total": 0.0}, compute_fraction=0.0,
                     reason=f"identical graph requeued: ComfyUI's node cache returned the previous output "
                            f"({report.decision}{' of entry ' + kept if kept else ''})")


def _check_answered_inputs(model: Any, latent: dict, probe: Probe, role: str = "") -> None:
    """The sampler's MODEL and latent must be the probe's (as ``reuse.sample`` checks on the computing path)."""
    from . import comfy_patch as cp
    from .adapters import adapter_for

    fp = cp.model_fingerprint(model, adapter_for(model).arch)
    if role == "second":
        if fp != probe.config.second_model:
            raise ValueError("the MODEL differs from the probe's second_model (weights or patches changed): connect "
                             "the model that finishes the schedule to both the Early Probe's second_model and this "
                             "sampler")
    elif fp != probe.model_fingerprint:
        raise ValueError("the MODEL differs from the one the probe ran on (weights or patches changed): connect "
                         "the same MODEL to the Early Probe and the Joint Reuse Sampler")
    shape = tuple(cp.prepare_latent(model, latent).shape)
    if shape != tuple(probe.answered.latent.shape):
        raise ValueError(f"latent shape {shape} differs from the probed one {tuple(probe.answered.latent.shape)}: "
                         "connect the same latent to the probe and the sampler")


def hit_answer_key(probe: Probe, decision: Decision | None, config: ReuseConfig,
                   signature: Signature | None) -> str:
    """The key a reuse's result is kept and answered under *at the sampler*, after the probe and the filter: the
    request (``probe.request_key``: model and patches, conditioning, seed, latent, schedule), the probe's config
    (probe steps) and whether it kept its keys/values, the accepted entry, the reuse settings and the target
    signature by content. Given these, ``reuse.sample`` computes the same latent bit for bit, whatever filter,
    rule or recall accepted the entry — which is what a node graph can know at its sampler (the Early Probe cannot
    see the downstream settings that ``answer_key_for`` digests, so a graph answers a repeated hit here, after its
    probe, instead of before it). "" when there is nothing to key: no accepted entry, an exact answer, dense mode,
    a split schedule, no signature, settings other than those the decision's rule certified (``reuse.sample``
    then continues dense: an answer kept under another rule must not stand in for that), or inputs that cannot
    be digested."""
    if (not probe.request_key or decision is None or not decision.accepted or decision.candidate is None
            or decision.mode == "exact" or config.mode == "dense" or probe.config.leftover_noise
            or signature is None):
        return ""
    if decision.reuse_config is not None and config.differences(decision.reuse_config):
        return ""
    try:
        return keys.answer_key(probe.request_key, {
            "at": "sampler", "entry": decision.candidate.entry_id, "config": probe.config.to_meta(),
            "probe_context": bool(probe.context_kv), "reuse": config.to_meta(),
            "signature": [signature.to_meta(), signature.to_tensors()]})
    except keys.Opaque:
        return ""


def _answered_at_sampler(model: Any, latent: dict, probe: Probe, answered: Probe,
                         upstream_ms: Mapping[str, float] | None, key: str) -> tuple[Any, RunReport]:
    """The stored result of an earlier identical hit (``hit_answer_key``): no model call in the sampler; the probe
    ran, so the request's compute is the probe's share of the schedule."""
    _check_answered_inputs(model, latent, answered)
    g = probe.config
    n = g.stage_end - g.start_step
    k = min(int(g.probe_steps), n)
    report = replace(exact_report(answered, upstream_ms), steps_probe=k, skipped_calls=n - k,
                     compute_fraction=k / max(n, 1),
                     reason=f"a repeat of an earlier hit: its stored result (answer entry {answered.answered.entry_id},"
                            f" which reused entry {answered.answered.answer_of}), found after the probe; no model "
                            "call in the sampler", answer_key=key)
    return answered.answered.latent.clone(), report


def reuse_stage(model: Any, positive: Any, negative: Any, latent: dict, probe: Probe, decision: Decision | None,
                store: Any, config: ReuseConfig, *, signature: Signature | None = None, record: bool = True,
                progress: Callable[[int], None] | None = None,
                upstream_ms: Mapping[str, float] | None = None, stage: Stage | None = None,
                cached: CachedRun | None = None, answer_hits: bool = False) -> tuple[Any, RunReport]:
    """Stage 5: finish the request. Returns (final LATENT samples, RunReport).

    An answered probe returns the stored latent (bit-identical, no model call). Otherwise the accepted entry is
    loaded here (``load_accepted``; gone = dense resume with the reason in the report) and ``reuse.sample`` runs.
    ``stage``: the sampler's KSamplerAdvanced settings (None = the probe's stage); on a split schedule this stage
    runs once for the probe's stage and once, on the second model, for the rest (``reuse.stage_role``).
    ``cached``: the accepted entry already loaded by the caller (the pairs labelling loads it without counting a
    hit); it must be the decision's candidate (``reuse.sample`` checks). None = load it from ``store``.
    ``answer_hits``: look the reuse up under ``hit_answer_key`` first (the stored result of the same request
    reusing the same entry the same way: no model call here), and put that key on a hit's report for the Cache
    Writer. Off for the pairs labelling, which must compute every reuse it labels.
    """
    if probe.answered is not None:
        role = stage_role(probe.config, stage)  # the sampler's stage must fit the probe's, answered or not
        _check_answered_inputs(model, latent, probe, role)
        a = probe.answered
        out = a.stage_latent if role == "first" and probe.config.leftover_noise else a.latent
        return out.clone(), exact_report(probe, upstream_ms, role)
    hit_key = ""
    if answer_hits and store is not None and stage_role(probe.config, stage) == "":
        hit_key = hit_answer_key(probe, decision, config, signature)
        answered = lookup_exact(store, probe.request_key, model, probe.prompt, probe.seed, answer_key=hit_key,
                                dense=False, count_lookup=False) if hit_key else None
        if answered is not None:
            _count_lookup(store, probe)  # the recall's lookup; lookup_exact counted the hit
            return _answered_at_sampler(model, latent, probe, answered, upstream_ms, hit_key)
    fallback = ""
    loaded_here = False
    own_load = cached is None  # a caller with its own entry (the pairs labelling) serves nothing: counts nothing
    if config.mode == "dense":
        cached = None
    elif cached is None:
        cached, fallback = load_accepted(store, decision)
        loaded_here = cached is not None
    samples, report = sample(model, positive, negative, latent, probe, decision, cached, config,
                             target_signature=signature, record=record, progress=progress, upstream_ms=upstream_ms,
                             stage=stage)
    if fallback:
        report = replace(report, reason=fallback)
    if hit_key and report.decision == "hit":
        report = replace(report, answer_key=hit_key)
    if own_load and store is not None and decision is not None and report.final:
        _count_lookup(store, probe)  # this request's recall (stage 3), counted now that it was served
    if loaded_here and report.decision == "hit" and report.final:
        _count_hit(store, cached.entry_id)
    return samples, report


def _count_lookup(store: Any, probe: Probe) -> None:
    """One lookup for a served request that recalled candidates (best-effort, like every counter)."""
    from .cache.errors import CacheError

    try:
        store.record_lookup(namespace_key(probe.model_fingerprint, probe.config))
    except CacheError as e:
        log.info("carnator request: the lookup was not counted (%s)", e)


def _count_hit(store: Any, entry_id: str) -> None:
    """One hit for a clip served from reuse of ``entry_id`` (once per request: at the stage that finishes the
    schedule; a caller that passes its own ``cached`` entry, the pairs labelling, serves nothing and counts
    nothing). Best-effort: an entry evicted since it was loaded still served this clip."""
    from .cache.errors import CacheError

    try:
        store.record_hit(entry_id)
    except CacheError as e:
        log.info("carnator request: the hit on entry %s was not counted (%s)", entry_id, e)


def finish_stages(model: Any, positive: Any, negative: Any, latent: dict, probe: Probe, decision: Decision | None,
                  store: Any, config: ReuseConfig, *, second_model: Any = None, signature: Signature | None = None,
                  record: bool = True, progress: Callable[[int], None] | None = None,
                  upstream_ms: Mapping[str, float] | None = None,
                  cached: CachedRun | None = None, answer_hits: bool = False) -> tuple[Any, RunReport, float]:
    """Stage 5 over the whole schedule: what the Joint Reuse Sampler(s) of the graph do, in order. Returns (final
    LATENT samples, the last stage's RunReport, resume ms of all stages).

    The probe's stage runs on ``model`` (``reuse_stage`` with the probe's stage); when that stage returns leftover
    noise (a two-expert graph: Wan 2.2 14B), the rest of the schedule runs on ``second_model`` from its output,
    with the same decision, entry and signature — exactly the second Joint Reuse Sampler (``start_at_step`` = the
    switch step, ``add_noise`` off). ``serve`` and the pairs labelling both finish requests through this function,
    so a rule is calibrated on the reuse the two-sampler graph runs. ``cached``, ``answer_hits``: see
    ``reuse_stage`` (a split schedule's hits are not answered).
    """
    samples, report = reuse_stage(model, positive, negative, latent, probe, decision, store, config,
                                  signature=signature, record=record, progress=progress, upstream_ms=upstream_ms,
                                  cached=cached, answer_hits=answer_hits)
    resume_ms = float(report.timings_ms.get("resume", 0.0))
    g = probe.config
    if g.leftover_noise:  # the second stage, on the second model, from the first stage's output
        if second_model is None:
            raise ValueError("the probe's stage returns leftover noise but no second_model was given: pass the "
                             "model that finishes the schedule (Wan 2.2 14B: the low-noise expert)")
        samples, report = reuse_stage(second_model, positive, negative, {**latent, "samples": samples}, probe,
                                      decision, store, config, signature=signature, record=record,
                                      progress=progress, stage=Stage(g.stage_end, g.steps, False, False),
                                      cached=cached)
        resume_ms += float(report.timings_ms.get("resume", 0.0))
    return samples, report, resume_ms


# ---------------------------------------------------------------------------------------------- 6. write
def write_result(store: Any, probe: Probe, sig: Signature, samples: Any, report: RunReport | None, *,
                 store_reused: bool = False, meta: Mapping[str, Any] | None = None,
                 answer_key: str = "") -> WriteResult:
    """Stage 6: persist a finished generation. Exact repeats and requests with unidentifiable conditioning are
    never stored. The request key is recorded only for a dense result of one batch item (``report`` says
    dense/miss): only such a latent is what the request computes. A hit's result is stored as a reusable entry
    only with ``store_reused``; otherwise, given its ``answer_key`` (``answer_key_for``), as an answer-only entry
    that answers exact repeats of this request served the same way and is never recalled or reused (one batch
    item, a whole schedule)."""
    from .cache.errors import CacheError
    from .cache.store import EntryData

    if probe.answered is not None:
        return WriteResult(probe.answered.entry_id, False,
                           f"exact repeat of entry {probe.answered.entry_id}: already cached, nothing stored")
    if probe.config.conditioning.startswith(keys.OPAQUE_PREFIX):
        return WriteResult("", False, "not stored: the conditioning holds values Carnator cannot identify")
    if probe.embedding is None:
        return WriteResult("", False, "not stored: the prompt could not be embedded for retrieval (see the probe's "
                                      "summary)")
    if report is not None and not report.final:
        return WriteResult("", False, "not stored: this is the first stage's output of a split schedule (it still "
                                      "holds leftover noise); connect the latent and report of the Joint Reuse "
                                      "Sampler that finishes the schedule")
    if probe.config.leftover_noise and (report is None or report.stage != "second"):
        return WriteResult("", False, "not stored: a split schedule's result is stored only from the Joint Reuse "
                                      "Sampler that runs its second stage (it checks the second model); connect its "
                                      "latent and report")
    hit = report is not None and report.decision == "hit"
    answer_of = ""
    if hit and not store_reused:
        if not (answer_key and report.entry_id and int(getattr(samples, "shape", (0,))[0]) == 1
                and not probe.config.leftover_noise):
            return WriteResult("", False, f"not stored: this result reused cache entry {report.entry_id} (enable "
                                          "store_reused to keep reused results too)")
        answer_of = str(report.entry_id)
    if samples is None or getattr(samples, "ndim", 0) != 5:
        raise ValueError("latent must be a video LATENT with samples [B, C, T, H, W] (the sampler's output)")
    want = tuple(int(x) for x in probe.config.latent_shape)
    if tuple(samples.shape[1:]) != want:
        raise ValueError(f"the LATENT is {tuple(samples.shape[1:])} per item but the probe's config says {want}: "
                         "connect the sampler output that belongs to this probe")
    dense = report is not None and report.decision in ("dense", "miss")
    tensors = {"latent_final": samples[0].detach().cpu()}
    if not answer_of:  # an answer is never reused: it needs no probe tensors (nor a split's first stage)
        tensors["x0_probe"] = probe.x0_probe.float().cpu()
        tensors["latent_probe"] = probe.latent_probe.float().cpu()
    if probe.config.leftover_noise:
        # A split request is answered by key only with both stages' outputs: the second stage's report carries
        # the first stage's (when that stage certainly ran dense too, see reuse.sample).
        switch = getattr(report, "first_stage_latent", None)
        if switch is None or tuple(switch.shape) != tuple(samples.shape):
            dense = False
        else:
            tensors["latent_switch"] = switch[0].detach().cpu()
    key = probe.request_key if dense and int(samples.shape[0]) == 1 else ""
    if answer_of:
        key = answer_key
    m: dict[str, Any] = {"batch_size": int(samples.shape[0]), **dict(meta or {})}
    m["probe_timings_ms"] = {str(k): float(v) for k, v in dict(probe.timings).items()}
    if report is not None:
        m["report"] = report.to_meta()
    data = EntryData(
        model_fingerprint=probe.model_fingerprint, config=probe.config, prompt=probe.prompt, seed=probe.seed,
        embedding=probe.embedding, signature=sig, tensors=tensors,
        block_structure=report.block_structure if report is not None and not answer_of else None, meta=m,
        request_key=key, answer_of=answer_of,
    )
    try:
        entry_id, written = store.put_with_status(data)
    except CacheError as e:
        # The generation itself succeeded (full disk, read-only cache, Redis down, over budget): the clip is
        # returned and the prompt does not fail; the log and the badge say it was not cached.
        why = _not_cached_reason(e)
        first = why not in _NOT_CACHED_SAID
        _NOT_CACHED_SAID.add(why)
        (log.warning if first else log.info)("carnator cache: the result was not cached (%s); the generated clip "
                                             "is returned as usual. %s", why, e)
        return WriteResult("", False, f"not stored: {e}", not_cached=why)
    ns = namespace_key(probe.model_fingerprint, probe.config)
    if written and answer_of:
        text = (f"stored answer {entry_id} in namespace {ns}: a repeat of this request that reuses entry {answer_of} "
                f"the same way gets this result without recomputing it (never reused itself)")
    elif written:
        text = f"stored entry {entry_id} in namespace {ns}" + (
            " with attention block structure" if data.block_structure is not None else "")
    else:
        text = f"already cached as entry {entry_id} (same request, model and config)"
    return WriteResult(entry_id, written, text)


def write_entry(store: Any, probe: Probe, sig: Signature, samples: Any, report: RunReport | None) -> str:
    """Persist a finished generation; returns the entry id ("" if not stored). See ``write_result``."""
    return write_result(store, probe, sig, samples, report).entry_id


# ---------------------------------------------------------------------------------------------- all stages
def serve(model: Any, text_encoder: Any, positive, negative, latent: dict, spec: RequestSpec, store: Any,
          options: ServeOptions, progress: Callable[[int], None] | None = None,
          second_model: Any = None) -> RequestResult:
    """Serve one request end to end through the stages above. ``store`` is a ``cache.Store`` (or None for method
    "dense"). A split schedule (``spec.stage`` returning leftover noise) runs its second stage on
    ``second_model``, as the two-sampler graph does; the result's report is the second stage's."""
    options = options.following_rule()  # a hit runs the reuse path the rule certified, nothing else
    t: dict[str, float] = {}
    t0 = time.perf_counter()
    use_cache = options.method != "dense" and store is not None
    exact_store = store if use_cache and options.exact and options.method in ("carnator", "prompt_only") else None
    probe = probe_request(model, positive, negative, latent, spec, options.probe, text_encoder, store=exact_store,
                          progress=progress, second_model=second_model, serving=options)
    t["key"] = float(probe.timings.get("key_ms", 0.0))
    t["probe"] = float(probe.timings.get("probe_ms", 0.0))
    t1 = time.perf_counter()
    sig, _ = signature_stage(probe, options.signature)
    t["signature"] = (time.perf_counter() - t1) * 1000
    candidates = decision = None
    if use_cache:
        k, min_sim = recall_limits(options.rule if options.method == "carnator" else None, options.top_k,
                                   options.min_similarity)
        candidates = recall(store, probe, k, min_sim)
        t["retrieval"] = candidates.retrieval_ms
        decision = decide_stage(sig, candidates, probe, method=options.method, rule=options.rule,
                                prompt_threshold=options.prompt_threshold, allow_uncertified=options.allow_uncertified)
        t["filter"] = decision.filter_ms
    mode = options.reuse_mode if decision is not None else "dense"
    reuse_config = replace(options.reuse, mode=mode)
    samples, report, t["resume"] = finish_stages(model, positive, negative, latent, probe, decision, store,
                                                 reuse_config, second_model=second_model, signature=sig,
                                                 record=options.write, progress=progress,
                                                 upstream_ms={k: v for k, v in t.items() if k != "probe"},
                                                 answer_hits=exact_store is not None)
    entry_id = probe.answered.entry_id if probe.answered is not None else None
    if options.write and store is not None and probe.answered is None:
        # A hit is kept only as its answer (when exact repeats are answered at all): never reused itself.
        answer_key = answer_key_for(probe.request_key, spec, options) if exact_store is not None else ""
        if report.decision != "hit" or answer_key:
            t2 = time.perf_counter()
            written = write_result(store, probe, sig, samples, report, answer_key=answer_key).entry_id or None
            entry_id = written if report.decision != "hit" else entry_id
            t["write"] = (time.perf_counter() - t2) * 1000
    t["total"] = (time.perf_counter() - t0) * 1000
    out = dict(latent)
    out["samples"] = samples
    return RequestResult(latent=out, report=report, probe=probe, signature=sig, candidates=candidates,
                         decision=decision, entry_id=entry_id, timings_ms=t)
