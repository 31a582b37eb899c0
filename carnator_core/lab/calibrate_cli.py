"""Calibrate and certify a Carnator risk rule from labelled (request, candidate) pairs.

Usage (from the extension folder, with the Python that runs ComfyUI)::

    python -m carnator_core.lab.calibrate_cli --pairs pairs.jsonl --out rules/my_model.json \\
        [--alpha 0.05] [--delta 0.1] [--calib-frac 0.5] [--seed 0] \\
        [--model-fingerprint FP] [--config-fingerprint FP] \\
        [--constraint bound|empirical] [--levels 12] [--search-similarity] [--write-uncertified]

    # choose --calib-alpha first, by cross-validation on the calibration split only (nothing is written):
    python -m carnator_core.lab.calibrate_cli --pairs pairs.jsonl --plan 0.05,0.03,0.02 \\
        [--cert-requests N] [--folds 5] [--search-similarity]

Pairs file (JSON Lines, UTF-8; one JSON object per line; blank lines ignored)
------------------------------------------------------------------------------
Optional first row, the header (recommended: it makes the rule self-describing)::

    {"type": "header", "model_fingerprint": "…", "config_fingerprint": "…",
     "arch": "embedded", "config": {…GenConfig.to_meta()…},
     "dataset": "what requests / cache entries", "seeds": [..],
     "unsafe_definition": "checker fails where dense passes", "generator": "script + args"}

Then one row per (request, recalled cache entry)::

    {"request_id": "r17", "entry_id": "e3", "similarity": 0.93,
     "context": 4.1, "size": 0.12, "shape": 0.31, "appearance": 6.5,
     "missing": false, "unsafe": false, "split": "calib"}

* ``similarity``: the retriever's prompt similarity; ``context``/``size``/``shape``/``appearance``: the four
  discrepancies (carnator_core.risk.discrepancy); ``missing``: a named object present on one side only (such a
  pair is never accepted); ``unsafe``: reusing this entry for this request failed the quality check.
* ``split`` is optional ("calib" or "cert"); if given it must be on every row; otherwise requests are split at
  random with ``--seed`` (a request's rows always stay together).
* ``--model-fingerprint``/``--config-fingerprint`` are needed only if the header lacks them; when both are
  given they must agree.

``--plan`` (carnator_core/lab/plan.py) calibrates each listed level on all folds of the calibration split
but one and evaluates it on the held-out fold (folds = runs when request ids look like ``run:request``), then
prints the out-of-sample unsafe rate, coverage and the estimated probability that a certificate on
``--cert-requests`` requests (default: the certification split's size) passes, and the level to use.

Output: the rule JSON (written only if its certificate holds, unless ``--write-uncertified``) and the report on
stdout. Exit status: 0 certified and written, 3 certificate fails, 2 unusable input.
See docs/CALIBRATION.md for the procedure.
"""
from __future__ import annotations

import argparse
import shlex
import sys

from ..risk.certify import CalibrationError, read_pairs_jsonl, split_pairs
from ..risk.pipeline import CalibrationSettings, calibrate_rule_file
from .plan import plan_calib_alpha


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m carnator_core.lab.calibrate_cli",
        description="Calibrate and certify a Carnator risk rule from labelled pairs (docs/CALIBRATION.md).",
    )
    p.add_argument("--pairs", required=True, help="labelled pairs JSONL file")
    p.add_argument("--out", default=None, help="where to write the rule JSON (required unless --plan)")
    p.add_argument("--alpha", type=float, default=0.05, help="risk level α: max unsafe rate among accepted (0.05)")
    p.add_argument("--calib-alpha", type=float, default=None,
                   help="risk level the threshold search targets on the calibration split (default: --alpha); "
                        "smaller leaves room for riskier certification traffic. The certificate uses --alpha")
    p.add_argument("--delta", type=float, default=0.1, help="δ: the certificate holds with probability ≥ 1−δ (0.1)")
    p.add_argument("--calib-frac", type=float, default=0.5, help="fraction of requests used for calibration (0.5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the request split (0)")
    p.add_argument("--model-fingerprint", default=None, help="model fingerprint (if the header lacks it)")
    p.add_argument("--config-fingerprint", default=None, help="generation config fingerprint (if the header lacks it)")
    p.add_argument(
        "--constraint",
        choices=("bound", "empirical"),
        default="bound",
        help="calibration constraint: 'bound' = the calibration split's own Clopper-Pearson bound ≤ α (default), "
        "'empirical' = unsafe rate ≤ α with enough accepted pairs for a certificate to be possible",
    )
    p.add_argument("--levels", type=int, default=12, help="threshold levels searched per axis (12)")
    p.add_argument("--label", choices=("unsafe", "excess"), default="unsafe",
                   help="what is certified: 'unsafe' = b/n, reuse fails where dense passes (default, the first "
                        "label); 'excess' = (b - c)/n, reuse charged only for failures it adds over the dense output "
                        "of the same request (rows' 'better' field = c; docs/CALIBRATION.md)")
    p.add_argument("--require-stratum", action="append", default=[], metavar="NAME",
                   help="a stratum (rows' 'stratum' field) that must certify on its own; repeatable")
    p.add_argument("--search-similarity", action="store_true", help="also search a minimum prompt similarity")
    p.add_argument("--plan", default=None, metavar="A1,A2,...",
                   help="cross-validate these calibration levels on the calibration split, print which to use as "
                        "--calib-alpha, write nothing")
    p.add_argument("--cert-requests", type=int, default=None,
                   help="with --plan: size of the planned certification split (default: this file's)")
    p.add_argument("--folds", type=int, default=5,
                   help="with --plan: random folds when request ids carry no 'run:' prefix (5)")
    p.add_argument("--write-uncertified", action="store_true", help="write the rule even if its certificate fails")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = "python -m carnator_core.lab.calibrate_cli " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)
    )
    if args.plan is not None:
        return _plan(args)
    if not args.out:
        print("calibration failed: --out is required (where to write the rule JSON)", file=sys.stderr)
        return 2
    try:
        settings = CalibrationSettings(
            alpha=args.alpha,
            calib_alpha=args.calib_alpha,
            delta=args.delta,
            calib_frac=args.calib_frac,
            seed=args.seed,
            model_fingerprint=args.model_fingerprint,
            config_fingerprint=args.config_fingerprint,
            constraint=args.constraint,
            levels=args.levels,
            search_similarity=args.search_similarity,
            label=args.label,
            required_strata=tuple(args.require_stratum),
        )
        report = calibrate_rule_file(args.pairs, args.out, settings, write_uncertified=args.write_uncertified,
                                     command=command)
    except CalibrationError as e:
        print(f"calibration failed: {e}", file=sys.stderr)
        return 2
    print(report.text())
    return 0 if report.certificate.passed else 3


def _plan(args: argparse.Namespace) -> int:
    try:
        try:
            levels = [float(a) for a in args.plan.split(",") if a.strip()]
        except ValueError:
            raise CalibrationError(
                f"--plan takes comma-separated levels like 0.05,0.03,0.02, got {args.plan!r}") from None
        _, pairs = read_pairs_jsonl(args.pairs)
        if pairs and all(p.split == "calib" for p in pairs):  # planning before certification data exist
            calib, cert = list(pairs), []
        else:
            calib, cert = split_pairs(pairs, args.calib_frac, args.seed)
        cert_requests = args.cert_requests or len({p.request_id for p in cert})
        if not cert_requests:
            raise CalibrationError("the file has no certification split: give --cert-requests (planned size)")
        plan = plan_calib_alpha(calib, levels, cert_requests=cert_requests, alpha=args.alpha, delta=args.delta,
                                levels=args.levels, search_similarity=args.search_similarity,
                                n_folds=args.folds, seed=args.seed, label=args.label)
    except CalibrationError as e:
        print(f"planning failed: {e}", file=sys.stderr)
        return 2
    print(plan.text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
