"""Learning mode's two hooks in the request path: the Risk Filter's decision and the sampler's labelling.

* :func:`learning_decision` — what the Risk Filter decides when its rule file does not exist yet (learning: every
  request is served dense) or is a learned rule (``rulefile``): accept the chosen candidate (``choose``) only in a
  switched-on stratum within that stratum's thresholds; a share of those hits is drawn for audit (served dense,
  labelled; ``learner.audit_share_now``: raised while the stratum is young or a drift is suspected). The decision
  carries a ``learning`` record (rule file, namespace, the chosen candidate, its stratum and discrepancies) for the
  sampler.
* :func:`observe` — what the Joint Reuse Sampler does after finishing a request whose decision carries that record:
  charge the compute served, record the covariates, run a shadow label (or the audit's label) when the request's
  label coin is drawn and the ledger is within the budget,
  re-derive the state, rewrite the learned rule file when the state changed, and return the ``rule_state`` for
  the report and the badge.
* :func:`adopt_rule_file` — a learned rule file that holds labels this cache's record lacks (copied from another
  machine or cache folder, or the record was set aside after damage) is imported into the record before anything
  is written: the copy keeps what it certified, and it is never overwritten by a smaller record. A record it
  diverges from is set aside (renamed, kept) first; a record that cannot be set aside (Redis) leaves the file as
  it is, never rewritten. What happened is said on the badge and in the log.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Mapping, Sequence

from ..risk.discrepancy import discrepancies
from ..types import Candidates, CandidateVerdict, Decision, Signature
from . import warmup as _warmup
from .labels import Covariate, Label
from .learner import (
    STRATA,
    LearnSettings,
    accepts,
    audit_draw,
    audit_share_now,
    label_draw,
    learner_for,
    reading_in_force,
    rule_namespace,
    stratum_of,
)

log = logging.getLogger("carnator")

LEARNING_MODE = "learning"


def candidate_options(signature: Signature, candidates: Candidates, probe: Any) -> list[dict[str, Any]]:
    """Every recalled candidate with its kind of change (``stratum_of``) and its four discrepancies."""
    out = []
    for c in candidates.items:
        d = discrepancies(signature, c.signature)
        same_seed = c.seed is not None and int(c.seed) == int(probe.seed)
        st = stratum_of(str(probe.prompt), str(c.prompt), same_seed=same_seed)
        out.append({"candidate": c, "entry_id": c.entry_id, "stratum": st, "vector": [float(v) for v in d.vector()],
                    "missing": bool(d.missing), "similarity": float(c.similarity)})
    return out


def choose(options: Sequence[Mapping[str, Any]], order: Sequence[str] | None) -> Mapping[str, Any] | None:
    """The candidate the learned rule reuses (and labels): the one whose kind of change comes first in the order
    the strata are certified in (``STRATA``'s order while the pilot runs: single changes before "mixed"), the most
    similar among equals. It depends on the candidates and the order only — never on thresholds, switch-on or a
    label — so the requests a stratum is labelled on are exactly those it serves once switched on."""
    ranks = {st: i for i, st in enumerate(order or STRATA)}
    return min(options, key=lambda o: (ranks.get(o["stratum"], len(ranks)), -o["similarity"], o["entry_id"]),
               default=None)


def learning_decision(signature: Signature | None, candidates: Candidates, probe: Any, *, rule_file: str,
                      rule_path: str | Path, learned: Any = None,
                      settings: LearnSettings | None = None, note: str = "") -> Decision:
    """The Risk Filter's decision in learning mode (module docstring). ``learned``: a verified
    ``rulefile.LearnedRule`` for this model and config (its applicability already checked), or None.
    ``settings``: the node's; of a learned rule only its budget and audit share are taken (the rest is the file's).
    ``note``: said in the summary and on the badge (e.g. which name this model and config learn under)."""
    t0 = time.perf_counter()
    if learned is not None:  # the file's certified settings, with the node's operational ones (budget, audits)
        settings = learned.settings if settings is None else replace(
            learned.settings, budget=settings.budget, audit_share=settings.audit_share)
    settings = settings or LearnSettings()
    model_fp = str(getattr(probe, "model_fingerprint", ""))
    config = getattr(probe, "config", None)
    ns = rule_namespace(model_fp, config.rule_fingerprint()) if config is not None else candidates.namespace
    ctx: dict[str, Any] = {"rule_file": rule_file, "rule_path": str(rule_path), "namespace": ns,
                           "settings": settings.to_dict(), "audit": False,
                           "k": int(candidates.k or len(tuple(candidates.items)) or 1),
                           "origin": learned.origin if learned is not None else "", "note": note}
    top = None
    accept = False
    reason = ""
    if candidates.items and signature is not None and probe is not None and getattr(probe, "answered", None) is None:
        options = candidate_options(signature, candidates, probe)
        chosen = choose(options, learned.order if learned is not None else None)
        top, stratum = chosen["candidate"], chosen["stratum"]
        ctx.update({k: v for k, v in chosen.items()}, options=options)
        th = learned.thresholds(stratum) if learned is not None else None
        share, warm = settings.audit_share, None
        if th is None:  # a kind on by a warm-up certificate (``warmup``): its thresholds, its higher audit share
            warm = _warmup.provisional(ns, stratum)
            if warm is not None:
                th, share = warm
        if th is None:
            reason = (f"learning: stratum {stratum!r} is not switched on; served dense"
                      + (" (its reuse run may be labelled)" if stratum in STRATA else ""))
        elif not accepts(th, chosen["vector"], chosen["missing"]):
            reason = f"rejected: outside stratum {stratum!r}'s learned thresholds"
        elif audit_draw(share if warm is not None else audit_share_now(learned.states.get(stratum), settings),
                        str(getattr(probe, "request_key", "") or "")):
            ctx["audit"] = True
            reason = f"audit: stratum {stratum!r} would reuse this entry; served dense and labelled instead"
        else:
            accept = True
            reason = f"accepted: stratum {stratum!r} is certified on own labels and the candidate is within its " \
                     "thresholds" if warm is None else f"accepted: stratum {stratum!r} is on by its warm-up " \
                     "certificate (checking on your traffic) and the candidate is within its warm-up thresholds"
    verdicts = tuple(CandidateVerdict(c.entry_id, float(c.similarity), accept and c is top,
                                      reason if c is top else "not considered: the learned rule reuses the candidate "
                                      "whose kind of change comes first in its order") for c in candidates.items)
    ms = (time.perf_counter() - t0) * 1000.0
    if accept:
        summary = f"ACCEPT {top.entry_id!r} (learned rule, stratum {ctx['stratum']}); filter {ms:.2f} ms"
    elif top is None:
        summary = f"LEARNING → dense: no candidates recalled; filter {ms:.2f} ms"
    else:
        summary = f"LEARNING → dense: {reason}; filter {ms:.2f} ms"
    if note:
        summary += f" [{note}]"
    if learned is not None and learned.origin == "copied":
        summary += (f" [learned rule {Path(str(rule_path)).name} is a copy (not sealed by this installation): "
                    "it is used as it is, imported into this cache's learning record]")
    return Decision(accepted=accept, candidate=top if accept else None, verdicts=verdicts,
                    mode="signature" if accept else LEARNING_MODE,
                    rule_id=learned.rule.rule_id if learned is not None else "", filter_ms=ms, summary=summary,
                    reuse_config=learned.rule.reuse_config if (accept and learned is not None) else None,
                    learning=ctx)


# ---------------------------------------------------------------------------------------------- the judge
def text_encode_fn(text_encoder: Any) -> Callable[[str], Any] | None:
    """prompt -> CONDITIONING with the text encoder the request was tokenised with: a ComfyUI CLIP
    (``tokenize`` + ``encode_from_tokens_scheduled``, as CLIPTextEncode does) or an encoder with ``encode(text)``
    (the embedded model's); None when there is none."""
    if text_encoder is None:
        return None
    if hasattr(text_encoder, "tokenize") and hasattr(text_encoder, "encode_from_tokens_scheduled"):
        return lambda prompt: text_encoder.encode_from_tokens_scheduled(text_encoder.tokenize(prompt))
    encode = getattr(text_encoder, "encode", None)
    return encode if callable(encode) else None


def judge_and_decoder(model: Any, probe: Any = None) -> tuple[Any, Callable[[Any], Any] | None, str]:
    """(judge, samples -> what the judge is shown, why-not).

    The embedded model is judged by the pixel checker's second label (``judge.SECOND_LABEL``: shape, the motion
    track, blur, interiors, ghosts, background artifacts against the dense clip) on its own decoder's frames.
    Wan 2.1 / 2.2 / LTX-Video are judged by the generation-native judge (``judge.judge_for``) on the served
    latents themselves: it needs no VAE, only the text encoder the Early Probe was given (to encode the
    candidate's prompt); without one, or for a two-expert split stage, nothing is labelled and why-not says so."""
    from ..adapters import detect_arch

    try:
        arch = detect_arch(model)
    except ValueError as e:
        return None, None, str(e)
    if arch != "embedded":
        if probe is not None and probe.config.split:
            return None, None, ("no labels yet: a split (two-expert) stage is not labelled; requests are served "
                                "dense and cached, exact repeats answered")
        encode = text_encode_fn(getattr(probe, "text_encoder", None))
        if encode is None:
            return None, None, (f"no labels: a {arch} model is judged with its own text encoder; connect the CLIP to "
                                "the Early Probe's clip input (requests are served dense and cached meanwhile)")
        from ..judge import judge_for

        try:
            judge = judge_for(model, arch, encode=encode, text_encoder=probe.text_encoder)
        except (ImportError, ValueError) as e:
            return None, None, f"no labels: the native judge is unavailable ({e})"
        return judge, (lambda samples: None), ""
    from ..embedded import codec
    from ..judge import SECOND_LABEL, judge_for

    judge = judge_for(model, arch, SECOND_LABEL)  # the pixel checker's second label (shape, motion track, detail)

    return judge, (lambda samples: codec.latent_to_rgb(samples.float().cpu())[0].numpy()), ""


def label_counterfactual(judge: Any, decode: Callable[[Any], Any], probe: Any, source_prompt: str, dense: Any,
                         reuse: Any) -> Any:
    """The excess label (``judge.excess_label``) of the counterfactual reuse output ``reuse`` against ``dense``, the
    clip just served for the same request and seed (both latent samples). A pixel judge sees the decoded clips; the
    native judge reads the two latents from the request's ``extra`` ("latent": dense, "reuse_latent": reuse)."""
    from ..judge.base import JudgeRequest, excess_label

    jr = JudgeRequest(prompt=str(probe.prompt), seed=int(probe.seed), model=str(probe.model_fingerprint),
                      source_prompt=source_prompt, extra={"latent": dense, "reuse_latent": reuse})
    return excess_label(judge, decode(reuse), decode(dense), jr)


# ---------------------------------------------------------------------------------------------- the sampler's hook
def observe(*, directory: str | Path, model: Any, positive: Any, negative: Any, latent: dict, probe: Any,
            signature: Signature | None, decision: Decision, samples: Any, report: Any, store: Any,
            reuse_config: Any, served_s: float, pending: Callable[[], int] | None = None,
            judge: Any = None, decode: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """After the sampler finished a request under a learning decision (module docstring). Returns the
    ``rule_state`` (plus ``label``: what was labelled for this request, if anything). Never raises for a labelling
    problem: the request is already served; the problem is logged and said in the state's message.

    ``pending`` (prompts waiting in ComfyUI's queue) is accepted from the sampler but not consulted: which requests
    are labelled must not depend on the queue (``learner.label_draw``); a worker that runs drawn labels while the
    queue is idle would use it."""
    from ..cache.redis_url import is_redis_url
    from ..request import finish_stages
    from ..types import Decision as _Decision

    ctx = dict(decision.learning or {})
    settings = LearnSettings.from_dict(ctx.get("settings") or {})
    learner = learner_for(directory, settings)
    shared = is_redis_url(str(directory))  # a farm's Redis record: other workers label and switch on too
    wrote_rule = False
    ns = str(ctx.get("namespace", ""))
    answered = getattr(probe, "answered", None) is not None
    notes: list[str] = [learner.store.problem] if getattr(learner.store, "problem", "") else []
    if getattr(learner.store, "problem", ""):
        learner.store.problem = ""  # said once
    notes.append(str(ctx.get("note") or ""))
    if ctx.get("rule_path"):
        notes.append(adopt_rule_file(learner, ns, ctx["rule_path"]))
    learner.store.charge(ns, served_s=float(served_s), requests=1)
    done = ""
    key = str(getattr(probe, "request_key", "") or "")
    served_dense = getattr(report, "decision", "") in ("dense", "miss")
    if ctx.get("options") and not ctx.get("audit"):
        # the candidate by the record's own order (the filter saw only the rule file's, or none while learning)
        ctx.update(choose(ctx["options"], learner.order(ns)) or {})
    stratum = ctx.get("stratum")
    latest = None  # the states as of the record's last change, when derived here (rule_state then reuses them)
    if stratum is not None and not answered and served_dense and key:
        cov = Covariate(key, str(stratum), str(ctx["entry_id"]), float(ctx["similarity"]),
                        tuple(ctx["vector"]), bool(ctx["missing"]), time.time())
        learner.store.add_covariate(ns, cov)
        states = latest = learner.state(ns)
        st = states.get(str(stratum))
        audit = bool(ctx.get("audit"))
        want = audit or (st is not None and not st.on and stratum in STRATA and not cov.missing
                         and (st.fit is None or accepts(st.fit.thresholds, cov.vector, cov.missing))
                         # the cached entry is the unit: a second label of an entry its test has counted would
                         # count for nothing (``learner`` module docstring), so it is not made
                         and cov.entry_id not in st.entries)
        why_not = ""
        if want and not audit:
            # which requests are labelled: a coin at a share fixed by the settings, paused while the ledger is over
            # budget — never the queue, the request's risk or an outcome (``learner.label_draw``)
            if not label_draw(settings.label_share, key):
                want, why_not = False, "not drawn"
            elif learner.over_budget(ns):
                want, why_not = False, "budget"
        if want and reuse_config is not None and getattr(reuse_config, "mode", "joint") == "dense":
            want, why_not = False, "sampler mode dense"
        if want and learner.store.has_label(ns, key):
            want = False
        if want:
            if judge is None or decode is None:
                judge, decode, why_not = judge_and_decoder(model, probe)
            if judge is None:
                want = False
            elif learner.reading_superseded(ns, str(judge.name), dict(getattr(judge, "settings", {}) or {})):
                # the record has moved on to a newer judge reading: this worker's label would count for nothing
                want, why_not = False, (f"not labelled: this worker's judge reading ({judge.name} "
                                        f"{dict(getattr(judge, 'settings', {}) or {})}) is older than the record's; "
                                        "upgrade it")
        if want:
            try:
                cand = ctx["candidate"]
                cached = store.load(cand.entry_id, count_hit=False).cached_run()
                acc = _Decision(accepted=True, candidate=cand, verdicts=(), mode="signature",
                                summary="learning: the rule-to-be's reuse of its chosen candidate (counterfactual)")
                cfg = replace(reuse_config, mode="joint") if reuse_config is not None else None
                t0 = time.perf_counter()
                if _over_max_active(model, probe, signature, cached, cfg):
                    # the sampler would continue dense (changed region > max_active): a miss under any rule, and
                    # its output is the clip just served — nothing to run or judge
                    out, reusable = None, False
                else:
                    out, rep, _ = finish_stages(model, positive, negative, latent, probe, acc, store, cfg,
                                                signature=signature, record=False, cached=cached)
                    reusable = getattr(rep, "decision", "") == "hit"
                x = 0
                if reusable:
                    lab = label_counterfactual(judge, decode, probe, str(cand.prompt), samples, out)
                    x = 1 if lab.b else (-1 if lab.c else 0)
                cost = time.perf_counter() - t0  # the counterfactual run and its judging: both are labelling compute
                label = Label(key, str(stratum), str(cand.entry_id), float(ctx["similarity"]), cov.vector,
                              cov.missing, reusable, x, "audit" if audit else "shadow", str(judge.name),
                              dict(getattr(judge, "settings", {}) or {}), round(cost, 4), str(probe.prompt),
                              str(cand.prompt), int(probe.seed), time.time())
                if learner.store.add_label(ns, label):
                    learner.store.charge(ns, **({"audit_s": float(served_s)} if audit else {"label_s": cost}))
                done = f"{'audit' if audit else 'shadow'} label x={x:+d} ({stratum}, {cost:.2f} s)"
                latest = _write_rule(learner, ns, ctx, probe, reuse_config, judge, notes=notes)
                wrote_rule = True
            except Exception as e:  # noqa: BLE001 — the request is served; a failed label is only lost work
                log.warning("carnator learning: labelling request %s failed (%s: %s); it is not labelled",
                            key[:12], type(e).__name__, e)
                done = f"label failed: {e}"
                latest = None
        elif why_not and why_not not in ("budget", "not drawn"):
            done = why_not
    if shared and not wrote_rule:  # other workers may have labelled meanwhile
        latest = _sync_rule(learner, ns, ctx, probe, reuse_config, notes)
    state = learner.rule_state(ns, latest)
    state = _warmup.overlay_state(learner, ns, state, latest)
    state["label"] = done
    notes = [n for n in notes if n]
    if notes:
        state["notes"] = notes
        state["message"] += " — " + "; ".join(notes)
    return state


def _ident(lab: Label) -> tuple:
    """What makes a label the same label in two records (ids differ once imported)."""
    return (lab.request_key, lab.kind, lab.stratum, int(lab.x), bool(lab.reusable), bool(lab.missing),
            tuple(float(v) for v in lab.vector), lab.judge, json.dumps(dict(lab.judge_settings or {}),
                                                                       sort_keys=True))


def file_record(path: str | Path) -> Any:
    """The verified learned rule at ``path`` (``rulefile.LearnedRule``), or None when there is none or it is
    refused (the Risk Filter reports a refused file when the prompt is queued)."""
    from ..risk.rule import RuleFormatError
    from . import rulefile

    data = rulefile.read_if_learned(path)
    if data is None:
        return None
    try:
        return rulefile.from_doc(data, str(path))
    except RuleFormatError:
        return None


def missing_from(learner: Any, ns: str, learned: Any) -> list[Label]:
    """The labels of the learned rule ``learned`` that the record's namespace ``ns`` lacks."""
    have = {_ident(lab) for lab in learner.store.labels(ns)}
    return [lab for lab in learned.labels if _ident(lab) not in have]


_KEPT: set[tuple[str, str]] = set()


def adopt_rule_file(learner: Any, ns: str, path: str | Path) -> str:
    """Import the learned rule file at ``path`` into the record's namespace ``ns`` when it holds labels the
    record lacks (module docstring). Returns what happened, for the badge ("" when nothing did)."""
    learned = file_record(path)
    if learned is None or learned.namespace != ns:
        return ""
    missing = missing_from(learner, ns, learned)
    if not missing:
        return ""
    name = Path(str(path)).name
    origin = "a copy (not sealed by this installation)" if learned.origin == "copied" else "sealed here"
    aside = ""
    if learner.store.labels(ns) or learner.store.events(ns):
        set_aside = getattr(learner.store, "set_aside", None)
        if set_aside is None:
            msg = (f"learned rule {name} ({origin}) holds {len(missing)} labels this shared record lacks and the "
                   "record cannot take them: the file is used as it is and never rewritten; remove or rename it to "
                   "have the shared record's rule written instead")
            if (str(path), ns) not in _KEPT:  # the log once; the badge every time
                _KEPT.add((str(path), ns))
                log.warning("carnator learning: %s", msg)
            return msg
        aside = set_aside(ns)
    n = learner.store.import_record(ns, learned.labels, learned.events)
    msg = (f"learned rule {name} ({origin}, {len(learned.labels)} labels, reuse on for "
           f"{', '.join(learned.on) or 'nothing yet'}) imported into this cache's learning record ({n} labels)"
           + (f"; the record it replaced is kept as {aside}" if aside else ""))
    log.warning("carnator learning: %s", msg)
    return msg


def _over_max_active(model: Any, probe: Any, signature: Any, cached: Any, cfg: Any) -> bool:
    """Whether the reuse of ``cached`` would continue dense because its changed region covers more than
    ``cfg.max_active`` of the tokens (single-stage schedules in a mode with a region; others are run)."""
    from ..reuse import region_of

    if cfg is None or cfg.mode not in ("joint", "latent") or probe.config.leftover_noise or signature is None:
        return False
    return float(region_of(model, probe, signature, cached, cfg).mean()) > float(cfg.max_active)


_LAST_ON: dict[str, tuple[str, ...]] = {}


def _sync_rule(learner: Any, ns: str, ctx: Mapping[str, Any], probe: Any, reuse_config: Any,
               notes: list[str] | None = None) -> Any:
    """On a farm's shared record a stratum may switch on (or off after a drift) on another worker's label: this
    worker's learned rule file (what its Risk Filter reads) is rewritten when the record's switched-on strata differ
    from what it last wrote, naming the judge reading in force (``learner.reading_in_force``). Returns the states
    it derived, or None."""
    labels = learner.store.labels(ns)
    if labels and ctx.get("rule_path"):
        last = reading_in_force(labels)
        judge = SimpleNamespace(name=last.judge, settings=dict(last.judge_settings))
        return _write_rule(learner, ns, ctx, probe, reuse_config, judge, only_if_changed=True, notes=notes)
    return None


def _write_rule(learner: Any, ns: str, ctx: Mapping[str, Any], probe: Any, reuse_config: Any, judge: Any, *,
                only_if_changed: bool = False, notes: list[str] | None = None) -> Any:
    """Rewrite the learned rule file when a stratum switched on or off, and every 25 labels (sharing) unless
    ``only_if_changed``. Never over a file holding labels the record lacks (``adopt_rule_file`` imports those
    first), never past ``rulefile.MAX_LEARNED_BYTES`` (``rulefile.save``): each is said in ``notes``. Returns the
    states it derived from the record (None without a rule path)."""
    from . import rulefile

    path = ctx.get("rule_path")
    if not path:
        return None
    states = learner.state(ns)
    on = tuple(sorted(k for k, v in states.items() if v.on))
    n = len(learner.store.labels(ns))
    changed = _LAST_ON.get(str(path)) != on and (on or Path(path).exists())
    if not changed and (only_if_changed or n % 25 != 0):
        return states
    theirs = file_record(path) if Path(path).exists() else None
    if theirs is not None and theirs.namespace == ns and missing_from(learner, ns, theirs):
        if notes is not None:
            notes.append(f"learned rule {Path(path).name} holds labels this record lacks: not rewritten")
        return states
    cfg = probe.config
    reuse_meta = replace(reuse_config, mode="joint").to_meta() if reuse_config is not None else None

    def doc(keep_prompts: bool = True) -> dict[str, Any]:
        return rulefile.build(learner, ns, model_fingerprint=probe.model_fingerprint,
                              rule_fingerprint=cfg.rule_fingerprint(), arch=cfg.arch, config_meta=cfg.to_meta(),
                              reuse_meta=reuse_meta, judge={"name": judge.name,
                                                            "settings": dict(getattr(judge, "settings", {}) or {})},
                              states=states, recall_k=int(ctx.get("k") or 1), keep_prompts=keep_prompts)

    try:
        rulefile.save(doc(), path, rebuild=doc)
    except rulefile.LearnedFileFull as e:
        log.warning("carnator learning: %s", e)
        if notes is not None:
            notes.append(str(e))
        return states
    _LAST_ON[str(path)] = on
    log.info("carnator learning: wrote learned rule %s (reuse on for: %s)", Path(path).name, ", ".join(on) or "none")
    return states
