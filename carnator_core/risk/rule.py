"""Risk rule files: thresholds + certificate + what they were calibrated for, as validated JSON.

A rule certifies the unsafe-reuse rate only for the model and generation config it was calibrated on, so it
records both fingerprints and :meth:`RiskRule.check_applicable` refuses any other. Loading a rule whose
certificate does not hold (U > α) raises :class:`UncertifiedRuleError` unless the caller explicitly allows it
for an experiment. The file format is documented in rules/README.md and docs/CALIBRATION.md.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..types import stable_digest
from .bounds import EXACT_MAX_N
from .certify import Certificate, StrataCertificate
from .thresholds import Thresholds

RULE_FORMAT = "carnator-risk-rule"
SCHEMA_VERSION = 1
MAX_RULE_BYTES = 16 << 20  # a rule is a few KB; refuse to parse anything absurd
# Plausible sizes of a certificate, checked before any bound is computed (a bound is recomputed at every load, not
# trusted): counts of labelled requests far beyond any calibration run, more strata than the runtime can observe,
# or more exact-bound work than four times the largest exact bound are refused (a rule with
# nested strata and per-stratum certificates at n = EXACT_MAX_N needs about three). The exact excess bound costs
# ~n² (``bounds.EXACT_MAX_N``), so a rule's total exact work Σ n² over its certificate and strata is capped.
MAX_CERTIFIED_N = 1_000_000
MAX_STRATA = 64
MAX_EXACT_WORK = 4 * EXACT_MAX_N**2

#: How to make a rule, quoted in every refusal so the user knows the way out.
CALIBRATE_HINT = (
    "Calibrate a rule for this model and config: write labelled pairs (docs/CALIBRATION.md), then run "
    "`python -m carnator_core.lab.calibrate_cli --pairs pairs.jsonl --out rules/<name>.json` from the extension "
    "folder (or use the 'Carnator Calibrate Rule' node)."
)


class RuleError(ValueError):
    """Base class of risk-rule problems."""


class RuleFormatError(RuleError):
    """The rule file is unreadable, corrupt, or of an unknown schema."""


class RuleMismatchError(RuleError):
    """The rule was calibrated for another model or generation config."""


class UncertifiedRuleError(RuleError):
    """The rule's certificate does not hold (U > α)."""


@dataclass(frozen=True)
class RiskRule:
    """A calibrated, certified risk rule.

    thresholds:         per-axis maxima (+ optional min prompt similarity).
    certificate:        the disjoint-split Clopper–Pearson certificate; ``certificate.passed`` ⇔ U ≤ α.
    model_fingerprint:  fingerprint of the model the pairs were generated with (as the probe reports it).
    config_fingerprint: :meth:`types.GenConfig.fingerprint` of the generation config.
    arch / config_meta: human-readable description of the above (GenConfig.to_meta()), for messages.
    calibration:        calibration-split outcome and search settings (certify.Calibration.to_dict()).
    provenance:         dataset, seeds, split sizes, date, command, definition of "unsafe".
    comparison:         optional extra measurements (e.g. the prompt-only baseline on the same splits).
    recall_k / recall_min_similarity: the recall the pairs were made with (top-K candidates of at least that
                        prompt similarity). The certificate holds for decisions among those candidates, so the
                        filter only considers them and ``request.serve`` recalls exactly them; None = not recorded
                        (rules made before recall was recorded).
    reuse_config:       the ``ReuseConfig`` fields the labelled hits ran with; the Joint Reuse Sampler reuses under
                        this rule only with exactly those settings (else it continues dense and says why). None =
                        not recorded (rules made before it was).
    signature_config:   the Signature Builder settings (``SignatureConfig.to_meta``, plus ``capture_layers`` when the
                        probe was given some) the labelled signatures were built with; the thresholds bound
                        discrepancies of signatures built so, and the filter rejects signatures built otherwise.
                        None = the defaults (every rule so far: the labelling builds signatures with
                        ``SignatureConfig()`` from probes of the default capture layers).
    """

    thresholds: Thresholds
    certificate: Certificate
    model_fingerprint: str
    config_fingerprint: str
    arch: str = ""
    config_meta: Mapping[str, Any] = field(default_factory=dict)
    calibration: Mapping[str, Any] = field(default_factory=dict)
    provenance: Mapping[str, Any] = field(default_factory=dict)
    comparison: Mapping[str, Any] = field(default_factory=dict)
    recall_k: int | None = None
    recall_min_similarity: float | None = None
    reuse_config: Mapping[str, Any] | None = None
    signature_config: Mapping[str, Any] | None = None
    # Per-stratum certificates (certify.StrataCertificate): when present the filter serves a request from its chosen
    # candidate only if what changed against it (risk.strata.stratum_of) is a certified stratum. None = not recorded
    # (the rule is certified on average only, as every rule before per-stratum certificates).
    strata: StrataCertificate | None = None
    source: str = field(default="", compare=False)  # the file it was loaded from (not serialised)

    # ------------------------------------------------------------------ identity and applicability

    @property
    def rule_id(self) -> str:
        """Content digest: two files with the same rule content have the same id."""
        return "rule-" + stable_digest(self.to_json(), 12)

    @property
    def namespace(self) -> str:
        """The cache namespace this rule applies to (same formula as types.namespace_key)."""
        return f"{self.model_fingerprint[:16]}-{self.config_fingerprint}"

    def describe_target(self) -> str:
        cfg = dict(self.config_meta)
        bits = [f"model {self.model_fingerprint}"]
        if self.arch:
            bits.append(f"arch {self.arch}")
        bits.append(f"config {self.config_fingerprint}")
        if cfg:
            keys = ("latent_shape", "steps", "sampler", "scheduler", "cfg", "probe_steps")
            shown = {k: cfg[k] for k in keys if k in cfg}
            bits.append(str(shown))
        return ", ".join(bits)

    def _name(self) -> str:
        return f"risk rule {Path(self.source).name!r}" if self.source else f"risk rule {self.rule_id}"

    def check_applicable(self, model_fingerprint: str, config_fingerprint: str) -> None:
        """Raise :class:`RuleMismatchError` unless the rule was calibrated for this model and config."""
        problems = []
        if str(model_fingerprint) != self.model_fingerprint:
            problems.append(f"model {model_fingerprint!r} (rule: {self.model_fingerprint!r})")
        if str(config_fingerprint) != self.config_fingerprint:
            problems.append(f"generation config {config_fingerprint!r} (rule: {self.config_fingerprint!r})")
        if problems:
            raise RuleMismatchError(
                f"{self._name()} does not apply to this request: it differs in {' and '.join(problems)}. "
                f"It was calibrated for {self.describe_target()}. Its certificate bounds the risk only for that "
                f"model and config (discrepancy scales change with model, resolution, steps and sampler). "
                + CALIBRATE_HINT
            )

    def check_namespace(self, namespace: str) -> None:
        """Like :meth:`check_applicable`, from a cache namespace string (model_fp[:16]-config_fp)."""
        if str(namespace) != self.namespace:
            raise RuleMismatchError(
                f"{self._name()} does not apply to cache namespace {namespace!r}: it was calibrated for namespace "
                f"{self.namespace!r} ({self.describe_target()}). Its certificate bounds the risk only for that "
                "model and config. " + CALIBRATE_HINT
            )

    def check_certified(self) -> None:
        """Raise :class:`UncertifiedRuleError` unless U ≤ α."""
        c = self.certificate
        if not c.passed:
            raise UncertifiedRuleError(
                f"{self._name()} is not certified: {c.line()}. "
                "The filter refuses it because its risk is not bounded. Recalibrate with more labelled requests "
                "or stricter thresholds (docs/CALIBRATION.md); for experiments only, allow_uncertified=True "
                "accepts it and marks every decision as UNCERTIFIED."
            )

    # ------------------------------------------------------------------ JSON

    def to_json(self) -> dict[str, Any]:
        out = {
            "format": RULE_FORMAT,
            "schema_version": SCHEMA_VERSION,
            "thresholds": self.thresholds.to_dict(),
            "certificate": self.certificate.to_dict(),
            "model": {"fingerprint": self.model_fingerprint, "arch": self.arch},
            "config": {"fingerprint": self.config_fingerprint, "meta": dict(self.config_meta)},
            "calibration": dict(self.calibration),
            "provenance": dict(self.provenance),
            "comparison": dict(self.comparison),
        }
        if self.recall_k is not None:  # absent in older rules: their content (and rule_id) stays the same
            out["recall"] = {"k": int(self.recall_k), "min_similarity": self.recall_min_similarity}
        if self.reuse_config is not None:  # absent in older rules, as recall
            out["reuse"] = dict(self.reuse_config)
        if self.signature_config is not None:  # absent = the defaults (every rule made before it was recorded)
            out["signature"] = dict(self.signature_config)
        if self.strata is not None:  # absent in rules certified on average only
            out["strata"] = self.strata.to_dict()
        return out

    def save(self, path: str | Path) -> Path:
        """Write the rule as JSON (atomically: a reader never sees half a file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        text = json.dumps(self.to_json(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
        return path

    @classmethod
    def from_json(cls, data: Any, source: str = "", allow_uncertified: bool = False) -> "RiskRule":
        """Validate a parsed rule document. Raises RuleFormatError / UncertifiedRuleError with clear messages."""
        where = f"risk rule {source!r}" if source else "risk rule"

        def bad(msg: str) -> RuleFormatError:
            return RuleFormatError(f"{where} is invalid: {msg}. Re-create it with the calibration CLI or node.")

        if not isinstance(data, dict):
            raise bad(f"expected a JSON object, got {type(data).__name__}")
        if data.get("format") != RULE_FORMAT:
            raise bad(f"'format' must be {RULE_FORMAT!r}, got {data.get('format')!r} (is this a Carnator rule file?)")
        ver = data.get("schema_version")
        if ver != SCHEMA_VERSION:
            raise bad(f"schema_version {ver!r} is not supported by this Carnator (expects {SCHEMA_VERSION})")
        for key in ("thresholds", "certificate", "model", "config"):
            if not isinstance(data.get(key), dict):
                raise bad(f"missing or non-object section {key!r}")
        try:
            thresholds = Thresholds.from_dict(data["thresholds"])
        except (ValueError, TypeError) as e:
            raise bad(str(e)) from None

        problem = rule_size_problem(data)
        if problem:
            raise bad(problem)
        try:
            cert = Certificate.from_dict(data["certificate"])
        except ValueError as e:
            raise bad(str(e)) from None

        model, config = data["model"], data["config"]
        for sec, name in ((model, "model"), (config, "config")):
            if not isinstance(sec.get("fingerprint"), str) or not sec["fingerprint"]:
                raise bad(f"{name}.fingerprint must be a non-empty string")
        for key in ("calibration", "provenance", "comparison"):
            if key in data and not isinstance(data[key], dict):
                raise bad(f"{key!r} must be an object")
        meta = config.get("meta", {})
        if not isinstance(meta, dict):
            raise bad("config.meta must be an object")
        recall = data.get("recall")
        recall_k = recall_min = None
        if recall is not None:
            k, m = (recall.get("k"), recall.get("min_similarity")) if isinstance(recall, dict) else (None, None)
            if not isinstance(k, int) or isinstance(k, bool) or k < 1:
                raise bad(f"recall.k must be an integer ≥ 1, got {k!r}")
            if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m)):
                raise bad(f"recall.min_similarity must be a number or null, got {m!r}")
            recall_k, recall_min = k, (None if m is None else float(m))
        sig_meta = data.get("signature")
        # Shape only, as reuse: the request layer builds a SignatureConfig from it (and refuses a rule it cannot).
        if sig_meta is not None and (not isinstance(sig_meta, dict) or not sig_meta):
            raise bad("signature must be a non-empty object of SignatureConfig fields")
        reuse = data.get("reuse")
        if reuse is not None:
            # Shape only: the sampler compares it field by field with its ReuseConfig (reuse.ReuseConfig.differences;
            # the risk layer does not import the reuse layer) and refuses reuse on any difference or unknown field.
            if not isinstance(reuse, dict) or not reuse:
                raise bad("reuse must be a non-empty object of ReuseConfig fields")
            odd = sorted(k for k, v in reuse.items()
                         if not isinstance(k, str) or not (v is None or isinstance(v, (bool, int, float, str))))
            if odd:
                raise bad(f"reuse fields must have scalar values; not so: {odd}")
        strata = None
        if data.get("strata") is not None:
            try:
                strata = StrataCertificate.from_dict(data["strata"])
            except ValueError as e:
                raise bad(str(e)) from None
        rule = cls(
            thresholds=thresholds,
            certificate=cert,
            model_fingerprint=model["fingerprint"],
            config_fingerprint=config["fingerprint"],
            arch=str(model.get("arch", "")),
            config_meta=meta,
            calibration=data.get("calibration", {}),
            provenance=data.get("provenance", {}),
            comparison=data.get("comparison", {}),
            recall_k=recall_k,
            recall_min_similarity=recall_min,
            reuse_config=dict(reuse) if reuse is not None else None,
            signature_config=dict(sig_meta) if sig_meta is not None else None,
            strata=strata,
            source=source,
        )
        if not allow_uncertified:
            rule.check_certified()
        return rule

    @classmethod
    def load(cls, path: str | Path, allow_uncertified: bool = False) -> "RiskRule":
        """Read and validate a rule file (see :meth:`from_json`)."""
        path = Path(path)
        shown = str(path) if len(str(path)) <= 200 else str(path)[:150] + f"...({len(str(path))} characters)"
        try:
            if not path.is_file():
                raise RuleFormatError(f"risk rule file not found: {shown}. " + CALIBRATE_HINT)
            if path.stat().st_size > MAX_RULE_BYTES:
                raise RuleFormatError(f"risk rule {shown!r} is {path.stat().st_size} bytes; a rule file is a few KB "
                                      f"(at most {MAX_RULE_BYTES}). Is it the right file? " + CALIBRATE_HINT)
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            why = "it nests too deeply" if isinstance(e, RecursionError) else str(e)
            raise RuleFormatError(
                f"risk rule {shown!r} is not valid JSON ({why}); the file is corrupt. Re-create it with the "
                "calibration CLI or node."
            ) from None
        except OSError as e:
            raise RuleFormatError(f"risk rule {shown!r} cannot be read ({e.strerror or e}). "
                                  + CALIBRATE_HINT) from None
        return cls.from_json(data, source=str(path), allow_uncertified=allow_uncertified)


def rule_size_problem(data: Mapping[str, Any]) -> str | None:
    """Why a rule document's sizes are implausible, or None. Checked before any bound is computed (every load
    recomputes them: ``Certificate.from_dict``, ``StrataCertificate.from_dict``): counts are integers in
    [0, ``MAX_CERTIFIED_N``] with k + c ≤ n ≤ n_requests, at most ``MAX_STRATA`` strata in all (each no larger
    than the certificate it restricts), and the exact bounds the file implies cost at most ``MAX_EXACT_WORK``
    (Σ n² over the excess bounds with n ≤ ``EXACT_MAX_N``; larger ones get the constant-time union bound).
    Malformed fields are left to the ``from_dict`` messages."""
    work = 0
    count = 0

    def sizes(doc: Mapping[str, Any], name: str, keys: tuple[str, ...]) -> dict[str, int] | str | None:
        out = {}
        for key in keys:
            v = doc.get(key, 0)
            if not isinstance(v, int) or isinstance(v, bool):
                return None
            if not 0 <= v <= MAX_CERTIFIED_N:
                return (f"{name}.{key} = {v} is implausible (a certificate counts at most {MAX_CERTIFIED_N:,} "
                        "labelled requests); the file is corrupt or was not made by Carnator's calibration")
            out[key] = v
        return out

    def exact(label: Any, n: int) -> int:
        return n * n if label == "excess" and n <= EXACT_MAX_N else 0

    stack: list[tuple[Any, str, int | None]] = [(data.get("certificate"), "certificate", None)]
    while stack:
        cert, name, parent_n = stack.pop()
        if not isinstance(cert, Mapping):
            continue  # from_dict says what is wrong
        got = sizes(cert, name, ("n", "k", "c", "n_requests"))
        if not isinstance(got, dict):
            return got
        n = got["n"]
        if got["k"] + got["c"] > n or n > got["n_requests"]:
            continue  # from_dict names the inconsistency
        if parent_n is not None and n > parent_n:
            return f"{name} (a stratum) has n = {n}, more than the {parent_n} requests of the certificate it restricts"
        work += exact(cert.get("label", "unsafe"), n)
        strata = cert.get("strata") or {}
        if isinstance(strata, Mapping):
            count += len(strata)
            if count > MAX_STRATA:
                return f"the rule has more than {MAX_STRATA} strata; the runtime observes far fewer kinds of request"
            stack.extend((sub, f"{name}.strata[{str(key)[:40]!r}]", n) for key, sub in strata.items())
    doc = data.get("strata")
    if isinstance(doc, Mapping):
        top = sizes(doc, "strata", ("n_requests", "accepted"))
        if not isinstance(top, dict):
            return top
        per = doc.get("strata")
        if isinstance(per, Mapping):
            count += len(per)
            if count > MAX_STRATA:
                return f"the rule has more than {MAX_STRATA} strata; the runtime observes far fewer kinds of request"
            for key, st in per.items():
                if not isinstance(st, Mapping):
                    continue
                got = sizes(st, f"strata.strata[{str(key)[:40]!r}]", ("n", "k", "c"))
                if not isinstance(got, dict):
                    return got
                work += exact(doc.get("label", "excess"), got["n"])
    if work > MAX_EXACT_WORK:
        return (f"the rule's exact bounds would cost Σ n² = {work:,} (at most {MAX_EXACT_WORK:,}: four exact bounds "
                f"at n = {EXACT_MAX_N}); the file claims more labelled requests than a calibration run produces")
    return None
