"""The Risk Filter: accept the best recalled candidate that passes the rule, or none — and always say why.

Modes
-----
* ``"signature"``   — the four discrepancies of each candidate against the target signature, each against the
                      certified rule's threshold (+ the rule's optional min prompt similarity); a named object on
                      only one side rejects. The best passing candidate is accepted (highest similarity; ties:
                      smallest normalised discrepancy, then entry id) — the same choice calibration evaluated.
* ``"prompt_only"`` — NIRVANA-style baseline for comparison: the most similar candidate is accepted if its
                      similarity ≥ ``prompt_threshold``. Signatures are not looked at; no certificate applies.
* ``"never"``       — always dense (every candidate rejected); a control for measurements.

Every decision carries one :class:`~carnator_core.types.CandidateVerdict` per candidate (per-axis value vs
threshold and a reason), a one-line summary, and the time the filter took (``filter_ms``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from ..paths import resolve_confined
from ..types import AxisCheck, Candidate, Candidates, CandidateVerdict, Decision, Signature
from .discrepancy import Discrepancies, discrepancies
from .rule import RiskRule, RuleError, RuleMismatchError
from .thresholds import Thresholds, prompt_check, select_best

MODES: tuple[str, ...] = ("signature", "prompt_only", "never")
UNCERTIFIED_BANNER = "!! UNCERTIFIED RULE (experiment only, risk NOT bounded) !! "


def _fmt_failed(checks: Sequence[AxisCheck]) -> str:
    return ", ".join(f"{c.axis} {c.value:.4g} > {c.threshold:.4g}" for c in checks if not c.passed)


def _signature_mode(
    target: Signature, items: Sequence[Candidate], rule: RiskRule
) -> tuple[int | None, list[CandidateVerdict]]:
    th: Thresholds = rule.thresholds
    discs: list[Discrepancies] = [discrepancies(target, c.signature) for c in items]
    checks = [th.checks(d.vector(), c.similarity) for d, c in zip(discs, items)]
    passing = [
        (i, c.similarity, th.normalised(d.vector()), c.entry_id)
        for i, (c, d, ch) in enumerate(zip(items, discs, checks))
        if not d.missing and all(x.passed for x in ch)
    ]
    best = select_best(passing)
    n_pass = len(passing)
    verdicts = []
    for i, (c, d, ch) in enumerate(zip(items, discs, checks)):
        if d.missing:
            reason = "rejected: named object on one side only: " + ", ".join(d.missing_objects)
        elif not all(x.passed for x in ch):
            worst = [f"{x.axis} (worst object {d.worst_object(x.axis)!r})" for x in ch
                     if not x.passed and d.worst_object(x.axis)]
            reason = "rejected: " + _fmt_failed(ch) + (f" — {'; '.join(worst)}" if worst else "")
        elif i == best:
            reason = f"accepted: passes all {len(ch)} checks; best of {n_pass} passing by similarity"
        else:
            reason = (f"passes the rule but not chosen: {items[best].entry_id!r} "  # type: ignore[index]
                      "ranks higher (similarity, then discrepancy)")
        verdicts.append(CandidateVerdict(c.entry_id, float(c.similarity), i == best, reason, ch))
    return best, verdicts


@dataclass(frozen=True)
class SignatureSettings:
    """How to tell which Signature Builder settings a signature was built with (``of``: signature -> digest) and
    the digest of the rule's (``request.signature_settings`` builds it; the risk layer does not import the
    signature layer)."""

    of: Callable[[Signature], str]
    rule: str


def _within_recall(
    target: Signature, items: Sequence[Candidate], rule: RiskRule, settings: SignatureSettings | None = None
) -> tuple[int | None, list[CandidateVerdict]]:
    """``_signature_mode`` over the candidates the rule was certified on: the top ``rule.recall_k`` by similarity
    that reach ``rule.recall_min_similarity`` (a rule that records no recall considers all), with ``settings``
    only when this request's signature was built with the rule's Signature Builder settings and only candidates
    built with the same. Others are rejected with the reason; verdicts stay in recall order."""
    k, floor = getattr(rule, "recall_k", None), getattr(rule, "recall_min_similarity", None)
    rejected: dict[int, str] = {}
    kept: list[int] = []
    # The thresholds bound discrepancies between signatures built with the rule's Signature Builder settings.
    mine = settings.of(target) if settings is not None else ""
    for i in sorted(range(len(items)), key=lambda j: -float(items[j].similarity)):
        sim = float(items[i].similarity)
        theirs = settings.of(items[i].signature) if settings is not None else ""
        if settings is not None and mine != settings.rule:
            rejected[i] = (f"rejected: this request's signature was built with Signature Builder settings "
                           f"({mine}) other than the rule's ({settings.rule}); the rule's thresholds do not apply "
                           "to it — use the settings the rule was calibrated with (the node defaults)")
        elif theirs != mine:
            rejected[i] = (f"rejected: the cached signature was built with other Signature Builder settings "
                           f"({theirs}, this request {mine}): not comparable")
        elif floor is not None and sim < floor:
            rejected[i] = (f"rejected: similarity {sim:.4f} is below the rule's recall minimum {floor:.4f} (the "
                           "rule was certified on that recall)")
        elif k is not None and len(kept) >= k:
            rejected[i] = f"rejected: outside the rule's recall top-{k} (the rule was certified on that recall)"
        else:
            kept.append(i)
    kept.sort()
    best_sub, sub = _signature_mode(target, [items[i] for i in kept], rule)
    by_index = dict(zip(kept, sub))
    verdicts = [by_index[i] if i in by_index else
                CandidateVerdict(c.entry_id, float(c.similarity), False, rejected[i]) for i, c in enumerate(items)]
    return (kept[best_sub] if best_sub is not None else None), verdicts


class RecallNarrowedError(RuleError):
    """The candidates were recalled with a smaller K or a higher minimum similarity than the rule's: the filter
    would decide among a candidate set the rule was never certified on."""


def recall_problem(rule: RiskRule, k: int | None, min_similarity: float | None) -> str | None:
    """Why a recall of top-``k`` at ``min_similarity`` does not cover the rule's certified candidate set (its
    ``recall_k`` / ``recall_min_similarity``), or None when it does (a larger K or a lower minimum is fine: the
    filter keeps only the rule's top-K above its minimum). Unrecorded values on either side are not compared."""
    rk, rmin = getattr(rule, "recall_k", None), getattr(rule, "recall_min_similarity", None)
    name = Path(rule.source).name if getattr(rule, "source", "") else rule.rule_id
    if rk is not None and k is not None and int(k) < int(rk):
        return (f"the Cache Retriever recalls the top-{int(k)} candidates, but risk rule {name!r} was certified on "
                f"the top-{int(rk)}: with fewer the filter would choose among a candidate set its certificate says "
                f"nothing about. Set the Retriever's k to {int(rk)} or more (the filter then considers the rule's "
                f"top-{int(rk)}).")
    if rmin is not None and min_similarity is not None and float(min_similarity) > float(rmin) + 1e-12:
        return (f"the Cache Retriever drops candidates below similarity {float(min_similarity):g}, but risk rule "
                f"{name!r} was certified on candidates down to {float(rmin):g}. Set the Retriever's min_similarity "
                f"to {float(rmin):g} or lower (the filter applies the rule's own minimum).")
    return None


def _stratum_gate(rule: RiskRule, items: Sequence[Candidate], best: int | None, verdicts: list[CandidateVerdict],
                  request: tuple[str, int | None] | None) -> tuple[int | None, list[CandidateVerdict]]:
    """A rule with per-stratum certificates serves its chosen candidate only when what changed against it (the
    stratum, :func:`.strata.stratum_of` of the request's and the candidate's prompts and seeds) certified on its
    own; otherwise the request is served dense (no fall-through to another candidate: the certificates were made
    on exactly this decision)."""
    strata = getattr(rule, "strata", None)
    if strata is None or best is None:
        return best, verdicts
    chosen = items[best]
    if request is None:
        why = ("rejected: the rule certifies per stratum (what changed against the candidate), which needs this "
               "request's prompt and seed; none were given to the filter (connect the Early Probe)")
    else:
        from .strata import stratum_of

        prompt, seed = request
        stratum = stratum_of(prompt, chosen.prompt, same_seed=seed is not None and chosen.seed == seed)
        if strata.allows(stratum):
            v = verdicts[best]
            verdicts = list(verdicts)
            verdicts[best] = replace(v, reason=v.reason + f"; {strata.describe(stratum)} (certified)")
            return best, verdicts
        why = f"rejected: passes the rule, but {strata.describe(stratum)} — refused, served dense"
    verdicts = list(verdicts)
    verdicts[best] = replace(verdicts[best], accepted=False, reason=why)
    return None, verdicts


def _prompt_mode(items: Sequence[Candidate], threshold: float) -> tuple[int | None, list[CandidateVerdict]]:
    top = select_best((i, c.similarity, 0.0, c.entry_id) for i, c in enumerate(items))
    verdicts = []
    best = None
    for i, c in enumerate(items):
        ch = prompt_check(c.similarity, threshold)
        if i != top:
            reason = f"rejected: prompt-only mode considers only the most similar candidate ({items[top].entry_id!r})"  # type: ignore[index]
            ok = False
        elif ch.passed:
            reason = (f"accepted: similarity {c.similarity:.4g} ≥ threshold {threshold:.4g} "
                      "(prompt only, no certificate)")
            ok, best = True, i
        else:
            reason, ok = f"rejected: similarity {c.similarity:.4g} < threshold {threshold:.4g}", False
        verdicts.append(CandidateVerdict(c.entry_id, float(c.similarity), ok, reason, (ch,)))
    return best, verdicts


def decide(
    target: Signature | None,
    candidates: Candidates,
    rule: RiskRule | None,
    mode: str = "signature",
    prompt_threshold: float = 0.9,
    *,
    model_fingerprint: str | None = None,
    config_fingerprint: str | None = None,
    allow_uncertified: bool = False,
    signature_settings: SignatureSettings | None = None,
    request: tuple[str, int | None] | None = None,
) -> Decision:
    """Decide whether (and which) recalled candidate the request reuses.

    Contract:
    * ``mode="signature"`` needs ``target`` and ``rule``. The rule must apply to this request: checked against
      ``model_fingerprint``/``config_fingerprint`` when given (the probe's), otherwise against
      ``candidates.namespace``; a mismatch raises :class:`~.rule.RuleMismatchError`. A rule whose certificate
      fails raises :class:`~.rule.UncertifiedRuleError` unless ``allow_uncertified`` (then the summary starts
      with a loud UNCERTIFIED banner).
    * ``mode="prompt_only"`` uses only similarities and ``prompt_threshold``; ``"never"`` rejects everything.
    * Signatures from different grids raise :class:`~.discrepancy.SignatureMismatchError` (never silently
      broadcast). With ``signature_settings`` (what the stage API passes), a request whose signature was built
      with other Signature Builder settings than the rule's is rejected, and so is a candidate built otherwise.
    Returns a :class:`~carnator_core.types.Decision` with one verdict per candidate, in recall order.
    """
    t0 = time.perf_counter()
    if mode not in MODES:
        raise ValueError(f"unknown Risk Filter mode {mode!r}; choose one of {list(MODES)}")
    items = tuple(candidates.items)
    rule_id = ""
    banner = ""
    best: int | None = None
    if mode == "signature":
        if rule is None:
            raise RuleError(
                "mode 'signature' needs a certified risk rule; load one (rules/README.md) or pick mode "
                "'prompt_only'/'never'"
            )
        if target is None:
            raise ValueError("mode 'signature' needs the target signature (connect the Signature Builder output)")
        if not rule.certificate.passed:
            if not allow_uncertified:
                rule.check_certified()  # raises with the full explanation
            banner = UNCERTIFIED_BANNER
        if model_fingerprint is not None or config_fingerprint is not None:
            if model_fingerprint is None or config_fingerprint is None:
                raise ValueError("give both model_fingerprint and config_fingerprint, or neither")
            rule.check_applicable(model_fingerprint, config_fingerprint)
        elif candidates.namespace:
            rule.check_namespace(candidates.namespace)
        else:
            raise RuleError(
                "cannot check that the risk rule applies to this request: no probe fingerprints were given and "
                "the candidates carry no cache namespace; connect the probe to the Risk Filter"
            )
        rule_id = rule.rule_id
        narrowed = recall_problem(rule, candidates.k, candidates.min_similarity)
        if narrowed is not None:
            raise RecallNarrowedError(narrowed)
        best, verdicts = _within_recall(target, items, rule, signature_settings)
        best, verdicts = _stratum_gate(rule, items, best, verdicts, request)
    elif mode == "prompt_only":
        best, verdicts = _prompt_mode(items, float(prompt_threshold))
    else:
        verdicts = [
            CandidateVerdict(c.entry_id, float(c.similarity), False, "rejected: mode 'never' (always dense)")
            for c in items
        ]
    chosen = items[best] if best is not None else None
    ms = (time.perf_counter() - t0) * 1000.0
    summary = banner + _summary(mode, chosen, verdicts, candidates, rule, prompt_threshold, ms)
    return Decision(
        accepted=chosen is not None,
        candidate=chosen,
        verdicts=tuple(verdicts),
        mode=mode,
        rule_id=rule_id,
        filter_ms=ms,
        summary=summary,
        reuse_config=rule.reuse_config if mode == "signature" and rule is not None else None,
        certified_strata=(tuple(rule.strata.certified) if mode == "signature" and rule is not None
                          and getattr(rule, "strata", None) is not None else None),
    )


def _summary(
    mode: str,
    chosen: Candidate | None,
    verdicts: Sequence[CandidateVerdict],
    candidates: Candidates,
    rule: RiskRule | None,
    prompt_threshold: float,
    ms: float,
) -> str:
    n = len(verdicts)
    if mode == "signature" and rule is not None:
        c = rule.certificate
        how = f"rule {rule.rule_id} (U={c.upper_bound:.4f}, α={c.alpha}, δ={c.delta})"
    elif mode == "prompt_only":
        how = f"prompt-only, similarity ≥ {prompt_threshold:.4g} (no certificate)"
    else:
        how = "mode never"
    if n == 0:
        extra = f" ({candidates.note})" if candidates.note else ""
        return f"REJECT → dense: no candidates recalled{extra}; {how}; filter {ms:.2f} ms"
    if chosen is not None:
        return (
            f"ACCEPT {chosen.entry_id!r} (similarity {chosen.similarity:.4g}) of {n} candidate(s); {how}; "
            f"filter {ms:.2f} ms"
        )
    reasons = "; ".join(f"{v.entry_id!r}: {v.reason.removeprefix('rejected: ')}" for v in verdicts[:3])
    more = f"; … {n - 3} more" if n > 3 else ""
    return f"REJECT → dense: none of {n} candidate(s) passes; {how}; {reasons}{more}; filter {ms:.2f} ms"


def request_of(probe: Any) -> tuple[str, int | None] | None:
    """(prompt, seed) of a probe for the stratum gate; None when the probe carries no prompt."""
    prompt = getattr(probe, "prompt", None)
    if not isinstance(prompt, str):
        return None
    seed = getattr(probe, "seed", None)
    return prompt, (int(seed) if isinstance(seed, int) and not isinstance(seed, bool) else None)


def probe_fingerprints(probe: Any) -> tuple[str, str]:
    """(model fingerprint, config fingerprint) of a probe (``types.Probe`` or anything with
    ``model_fingerprint: str`` and ``config.fingerprint()``)."""
    model_fp = getattr(probe, "model_fingerprint", None)
    config = getattr(probe, "config", None)
    if not isinstance(model_fp, str) or not model_fp or not callable(getattr(config, "fingerprint", None)):
        raise TypeError(
            f"the probe input ({type(probe).__name__}) lacks model_fingerprint/config.fingerprint(); connect the "
            "output of 'Carnator Early Probe' (CARNATOR_PROBE)"
        )
    # A rule is calibrated for a model and generation config, across prompts and start images: compare the config
    # without the request's own conditioning digest (GenConfig.rule_fingerprint) when the config has one.
    return model_fp, str(getattr(config, "rule_fingerprint", config.fingerprint)())


def decide_with_rule_file(
    target: Signature | None,
    candidates: Candidates,
    *,
    rule_file: str,
    rule_roots: Sequence[str | Path],
    mode: str = "signature",
    prompt_threshold: float = 0.9,
    probe: Any = None,
    allow_uncertified: bool = False,
    signature_settings: Callable[[RiskRule], SignatureSettings] | None = None,
) -> Decision:
    """What the Risk Filter node runs (the probe's prompt and seed are the request for per-stratum rules): resolve
    ``rule_file`` inside ``rule_roots`` (first match wins; absolute
    paths must lie inside a root), load and validate it (signature mode only), check it applies to the probe's
    model/config (or to the candidates' namespace without a probe), and :func:`decide` — with
    ``signature_settings(rule)`` (the node passes ``request.signature_settings``)."""
    rule = None
    path = None
    if mode == "signature":
        path = resolve_confined(rule_file, rule_roots, must_exist=True, what="risk rule file")
        rule = RiskRule.load(path, allow_uncertified=allow_uncertified)
    model_fp = config_fp = None
    if probe is not None and mode == "signature":
        model_fp, config_fp = probe_fingerprints(probe)
    try:
        return decide(
            target,
            candidates,
            rule,
            mode,
            prompt_threshold,
            model_fingerprint=model_fp,
            config_fingerprint=config_fp,
            allow_uncertified=allow_uncertified,
            signature_settings=signature_settings(rule) if signature_settings is not None and rule is not None
            else None,
            request=request_of(probe),
        )
    except RuleMismatchError as e:
        # The usual cause is a rule picked for another MODEL of the same family (e.g. the plain model's rule on
        # a MODEL patched by ComfyUI's EasyCache node): name the rule files in reach that do apply.
        others = [p for p in applicable_rule_files(rule_roots, model_fingerprint=model_fp, config_fingerprint=config_fp,
                                                   namespace=None if model_fp is not None else candidates.namespace)
                  if path is None or p.resolve() != path.resolve()]
        if not others:
            raise
        names = ", ".join(repr(p.name) for p in others)
        raise RuleMismatchError(f"{e} Certified rule file(s) in the rule folders that apply to this request: "
                                f"{names}; set rule_file to one of them.") from e


def applicable_rule_files(
    rule_roots: Sequence[str | Path],
    *,
    model_fingerprint: str | None = None,
    config_fingerprint: str | None = None,
    namespace: str | None = None,
) -> list[Path]:
    """Certified rule files (``*.json`` directly inside ``rule_roots``, first root first; a name only where the
    filter's lookup would find it) calibrated for this model and config — given as both fingerprints, or as a cache
    namespace. Files that are not valid rules, or whose certificate fails, are skipped: this only suggests what a
    mismatched request could use instead."""
    if model_fingerprint is None and namespace is None:
        return []
    found: list[Path] = []
    seen: set[str] = set()
    for root in rule_roots:
        root = Path(root)
        if not root.is_dir():
            continue
        for p in sorted(root.glob("*.json")):
            # The filter looks a name up root by root: a file shadowed by an earlier root's is never the one loaded.
            if p.name in seen:
                continue
            seen.add(p.name)
            try:
                rule = RiskRule.load(p)
                if model_fingerprint is not None:
                    rule.check_applicable(model_fingerprint, str(config_fingerprint))
                else:
                    rule.check_namespace(str(namespace))
            except (RuleError, OSError, ValueError):
                continue
            found.append(p)
    return found


__all__ = ["MODES", "RecallNarrowedError", "UNCERTIFIED_BANNER", "applicable_rule_files", "decide",
           "decide_with_rule_file", "probe_fingerprints", "recall_problem", "request_of"]
