"""Risk Filter: discrepancies, calibrated thresholds, Clopper–Pearson certificate.

Public API (import from the submodules; re-exported here for convenience):
  discrepancy.discrepancies(target, cand) -> Discrepancies
  certify.clopper_pearson_upper(k, n, delta), calibrate(...), certify(...), LabelledPair, read_pairs_jsonl
  rule.RiskRule (load/save/check_applicable), RuleMismatchError, UncertifiedRuleError, RuleFormatError
  filter.decide(target, candidates, rule, mode, prompt_threshold, ...) -> types.Decision
  pipeline.calibrate_rule_file(pairs_path, out_path, CalibrationSettings(...)) -> CalibrationReport
"""
# The function certify.certify is deliberately not re-exported: it would shadow the submodule attribute
# `risk.certify` (and `import ...risk.certify as m` would then yield the function).
from ..paths import PathNotAllowedError, resolve_confined
from .certify import (
    CalibrationError,
    Certificate,
    Evaluation,
    LabelledPair,
    calibrate,
    calibrate_prompt_only,
    clopper_pearson_upper,
    evaluate,
    evaluate_prompt_only,
    min_accepted_for_certificate,
    read_pairs_jsonl,
    split_pairs,
    write_pairs_jsonl,
)
from .discrepancy import AXES, Discrepancies, ObjectDiscrepancy, SignatureMismatchError, discrepancies
from .filter import MODES, decide
from .pipeline import CalibrationReport, CalibrationSettings, calibrate_rule, calibrate_rule_file
from .rule import RiskRule, RuleError, RuleFormatError, RuleMismatchError, UncertifiedRuleError
from .thresholds import Thresholds

__all__ = [
    "AXES", "MODES", "CalibrationError", "CalibrationReport", "CalibrationSettings", "Certificate", "Discrepancies",
    "Evaluation",
    "LabelledPair", "ObjectDiscrepancy", "PathNotAllowedError", "RiskRule", "RuleError", "RuleFormatError",
    "RuleMismatchError", "SignatureMismatchError", "Thresholds", "UncertifiedRuleError", "calibrate",
    "calibrate_prompt_only", "calibrate_rule", "calibrate_rule_file", "clopper_pearson_upper", "decide",
    "discrepancies", "evaluate", "evaluate_prompt_only", "min_accepted_for_certificate", "read_pairs_jsonl",
    "resolve_confined", "split_pairs", "write_pairs_jsonl",
]
