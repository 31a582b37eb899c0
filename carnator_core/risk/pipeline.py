"""Labelled pairs → calibrated, certified :class:`~.rule.RiskRule` (shared by the CLI and the node).

One call, :func:`calibrate_rule_file`, does it all: read pairs, split by request, calibrate on one split,
certify on the other, measure the prompt-only baseline on the same splits, and (if certified, or if asked)
write the rule. The model/config fingerprints come from the pairs file's header row or from the caller; when
both are present they must agree.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from .. import __version__
from ..types import GenConfig
from .certify import (
    Calibration,
    CalibrationError,
    Certificate,
    Constraint,
    LabelledPair,
    calibrate,
    calibrate_prompt_only,
    certificate_bound,
    certify,
    clopper_pearson_upper,
    evaluate_prompt_only,
    read_pairs_jsonl,
    split_pairs,
)
from .rule import RiskRule


@dataclass(frozen=True)
class CalibrationSettings:
    """How a rule is calibrated and certified (what the CLI's flags and the Calibrate node's widgets set).

    alpha, delta:     the certificate: the unsafe-rate bound α, holding with probability ≥ 1 − δ.
    calib_alpha:      the level the threshold search targets on the calibration split (None: ``alpha``; a
                      smaller one leaves room for certification traffic riskier than calibration traffic).
    calib_frac, seed: the seeded split of requests into calibration and certification (unless the pairs carry
                      their own split field).
    constraint:       "bound" (calibration split's own Clopper–Pearson bound ≤ α) or "empirical" (rate ≤ α).
    levels:           candidate values per threshold axis in the search.
    search_similarity: also search a minimum prompt similarity as a fifth threshold.
    model_fingerprint, config_fingerprint: what the rule certifies; None: from the pairs file's header (when
                      both are given they must agree).
    label:            what is certified (certify.LABELS): "unsafe" = b/n, "excess" = (b − c)/n
                      (docs/CALIBRATION.md, "The excess label").
    required_strata:  strata (the pairs' ``stratum`` field) that must each certify on their own.
    """

    alpha: float = 0.05
    delta: float = 0.1
    calib_alpha: float | None = None
    calib_frac: float = 0.5
    seed: int = 0
    constraint: Constraint = "bound"
    levels: int = 12
    search_similarity: bool = False
    model_fingerprint: str | None = None
    config_fingerprint: str | None = None
    label: str = "unsafe"
    required_strata: tuple[str, ...] = ()


@dataclass(frozen=True)
class CalibrationReport:
    """What a calibration run produced. ``written`` is the rule path, or None if it was not written."""

    rule: RiskRule
    calibration: Calibration
    written: Path | None

    @property
    def certificate(self) -> Certificate:
        return self.rule.certificate

    def text(self) -> str:
        """Multi-line human-readable report (what the CLI prints and the node returns)."""
        r, cal, c = self.rule, self.calibration, self.rule.certificate
        th = r.thresholds
        lines = [
            ("CERTIFIED" if c.passed else "NOT CERTIFIED") + f" — rule {r.rule_id} for {r.describe_target()}",
            "thresholds: "
            + ", ".join(f"{k}={v:.4g}" for k, v in th.to_dict().items() if v is not None)
            + ("" if th.min_similarity is not None else " (no min similarity)"),
            f"calibration ({cal.constraint} constraint, label {cal.label}): {cal.evaluation.k_unsafe} unsafe"
            + (f", {cal.evaluation.k_better} better" if cal.label == "excess" else "")
            + f" of {cal.evaluation.n_accepted} accepted / {cal.evaluation.n_requests} requests "
            f"(coverage {cal.evaluation.coverage:.1%}), {cal.combinations} threshold settings searched",
            c.line(),
        ]
        po = r.comparison.get("prompt_only")
        if isinstance(po, dict) and "cert" in po:
            pc = po["cert"]
            lines.append(
                f"prompt-only baseline (threshold {po['threshold']:.4g}, calibrated the same way): "
                f"{pc['k']} unsafe" + (f", {pc['c']} better" if "c" in pc else "")
                + f" of {pc['n']} accepted (coverage {pc['coverage']:.1%}), U = {pc['upper_bound']:.4f}"
            )
        elif isinstance(po, dict) and "error" in po:
            lines.append(f"prompt-only baseline: {po['error']}")
        lines.append(f"written to {self.written}" if self.written else "rule NOT written (certificate fails)")
        return "\n".join(lines)


def _resolve_fingerprints(
    header: Mapping[str, Any], model_fingerprint: str | None, config_fingerprint: str | None
) -> tuple[str, str, str, dict[str, Any]]:
    meta = header.get("config") or {}
    if meta and not isinstance(meta, dict):
        raise CalibrationError("pairs header 'config' must be an object (GenConfig.to_meta())")
    cfg_from_meta = None
    if meta:
        try:
            cfg_from_meta = GenConfig.from_meta(meta).fingerprint()
        except (KeyError, TypeError, ValueError) as e:
            raise CalibrationError(f"pairs header 'config' is not a valid GenConfig description: {e!r}") from None
    out = {}
    for key, given in (("model_fingerprint", model_fingerprint), ("config_fingerprint", config_fingerprint)):
        in_header = header.get(key)
        if key == "config_fingerprint" and in_header is None:
            in_header = cfg_from_meta
        if given and in_header and str(given) != str(in_header):
            raise CalibrationError(
                f"{key} given as {given!r} but the pairs file header says {in_header!r}: the pairs were made with "
                "another model/config; calibrate with the fingerprints of the run that produced them"
            )
        value = given or in_header
        if not value:
            raise CalibrationError(
                f"no {key}: put it in the pairs file header row ({{\"type\": \"header\", \"{key}\": ...}}) or pass "
                f"--{key.replace('_', '-')}; a rule must name the model and config it certifies"
            )
        out[key] = str(value)
    if cfg_from_meta and cfg_from_meta != out["config_fingerprint"]:
        raise CalibrationError(
            f"pairs header 'config' describes config {cfg_from_meta!r} but config_fingerprint is "
            f"{out['config_fingerprint']!r}: inconsistent header"
        )
    arch = str(header.get("arch") or meta.get("arch") or "")
    return out["model_fingerprint"], out["config_fingerprint"], arch, dict(meta)


def calibrate_rule(
    pairs: Sequence[LabelledPair],
    header: Mapping[str, Any] | None = None,
    settings: CalibrationSettings = CalibrationSettings(),
    *,
    provenance: Mapping[str, Any] | None = None,
) -> tuple[RiskRule, Calibration]:
    """Split, calibrate, certify; return the rule (certified or not — check ``rule.certificate.passed``).

    ``settings.calib_alpha`` (default: ``alpha``) is the risk level the threshold search targets on the
    calibration split; the certificate is always computed at ``alpha``. A smaller ``calib_alpha`` leaves room for
    the certification traffic to be riskier than the calibration traffic (requests served from different caches
    differ: docs/CALIBRATION.md).
    """
    s = settings
    alpha, delta, calib_alpha, calib_frac, seed = s.alpha, s.delta, s.calib_alpha, s.calib_frac, s.seed
    constraint, levels, search_similarity = s.constraint, s.levels, s.search_similarity
    header = dict(header or {})
    model_fp, config_fp, arch, meta = _resolve_fingerprints(header, s.model_fingerprint, s.config_fingerprint)
    if calib_alpha is None:
        calib_alpha = alpha
    if not 0.0 < calib_alpha <= alpha:
        raise CalibrationError(f"calib_alpha must be in (0, alpha={alpha}], got {calib_alpha}")
    calib, cert = split_pairs(pairs, calib_frac, seed)
    cal = calibrate(calib, calib_alpha, delta, constraint=constraint, levels=levels,
                    search_similarity=search_similarity, label=s.label)
    certificate = certify(cal.thresholds, cert, alpha, delta, label=s.label, required_strata=s.required_strata)

    comparison: dict[str, Any] = {}
    try:
        pt, pcal = calibrate_prompt_only(calib, calib_alpha, delta, constraint=constraint, label=s.label)
        pev = evaluate_prompt_only(pt, cert)
        pcert = {
            "n": pev.n_accepted,
            "k": pev.k_unsafe,
            "coverage": pev.coverage,
            "unsafe_rate": pev.unsafe_rate,
            "upper_bound": certificate_bound(s.label, pev.n_accepted, pev.k_unsafe, pev.k_better, delta),
        }
        if s.label == "excess":
            pcert.update(c=pev.k_better, excess_rate=pev.excess_rate,
                         unsafe_upper_bound=clopper_pearson_upper(pev.k_unsafe, pev.n_accepted, delta))
        comparison["prompt_only"] = {"threshold": pt, "calib": pcal.to_dict(), "cert": pcert}
    except CalibrationError as e:
        comparison["prompt_only"] = {"error": f"no prompt-only threshold qualifies: {e}"}

    prov: dict[str, Any] = {
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "carnator_version": __version__,
        "dataset": header.get("dataset", ""),
        "seeds": header.get("seeds", ""),
        "unsafe_definition": header.get("unsafe_definition", ""),
        "generator": header.get("generator", ""),
        "calib_alpha": calib_alpha,
        "split": {
            "method": "rows' split field" if pairs and pairs[0].split is not None else "seeded shuffle of request ids",
            "calib_frac": calib_frac,
            "seed": seed,
            "calib_requests": len({p.request_id for p in calib}),
            "cert_requests": len({p.request_id for p in cert}),
            "calib_pairs": len(calib),
            "cert_pairs": len(cert),
        },
    }
    prov.update(dict(provenance or {}))
    rule = RiskRule(
        thresholds=cal.thresholds,
        certificate=certificate,
        model_fingerprint=model_fp,
        config_fingerprint=config_fp,
        arch=arch,
        config_meta=meta,
        calibration=cal.to_dict(),
        provenance=prov,
        comparison=comparison,
        **_recall_from(header),
    )
    return rule, cal


def _recall_from(header: Mapping[str, Any]) -> dict[str, Any]:
    """The recall the pairs were made with, from the header (``top_k``; ``min_similarity``, which files written
    before it was recorded did not carry: their recall had no floor, -1; no recall when ``top_k`` is absent), and
    the reuse settings the labelled hits ran with (``reuse_config``, when recorded)."""
    out: dict[str, Any] = {}
    if isinstance(header.get("reuse_config"), dict):  # the reuse settings the labelled hits ran with
        out["reuse_config"] = dict(header["reuse_config"])
    k = header.get("top_k")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        return out
    floor = header.get("min_similarity", -1.0)
    out.update(recall_k=k, recall_min_similarity=None if floor is None else float(floor))
    return out


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def calibrate_rule_file(
    pairs_path: str | Path,
    out_path: str | Path,
    settings: CalibrationSettings = CalibrationSettings(),
    *,
    write_uncertified: bool = False,
    command: str = "",
) -> CalibrationReport:
    """Read a pairs JSONL file, calibrate + certify, write the rule to ``out_path`` if it is certified (or if
    ``write_uncertified``), and return the report. Raises CalibrationError on unusable data."""
    pairs_path = Path(pairs_path)
    header, pairs = read_pairs_jsonl(pairs_path)
    rule, cal = calibrate_rule(
        pairs, header, settings,
        provenance={"pairs_file": pairs_path.name, "pairs_sha256": _file_digest(pairs_path), "command": command},
    )
    written = None
    if rule.certificate.passed or write_uncertified:
        written = rule.save(out_path)
    return CalibrationReport(rule=rule, calibration=cal, written=written)


def calibrate_rule_in_dirs(
    pairs_file: str,
    pairs_roots: Sequence[str | Path],
    rule_name: str,
    rules_dir: str | Path,
    settings: CalibrationSettings = CalibrationSettings(),
    *,
    probe: Any = None,
    command: str = "",
) -> CalibrationReport:
    """What the Calibrate Rule node runs: resolve the pairs file inside ``pairs_roots`` and the output name
    inside ``rules_dir`` (no escaping either), take fingerprints from ``probe`` if given, then
    :func:`calibrate_rule_file`."""
    from ..paths import resolve_confined
    from .filter import probe_fingerprints

    pairs = resolve_confined(pairs_file, pairs_roots, must_exist=True, what="pairs file")
    name = rule_name.strip()
    name = name if name.endswith(".json") else name + ".json"
    out = resolve_confined(name, [rules_dir], must_exist=False, what="rule file")
    if probe is not None:
        model_fp, config_fp = probe_fingerprints(probe)
        settings = replace(settings, model_fingerprint=model_fp, config_fingerprint=config_fp)
    return calibrate_rule_file(pairs, out, settings, command=command)
