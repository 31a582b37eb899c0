"""Risk Filter and rule calibration nodes (thin: each execute is one call into carnator_core.risk).

File inputs are names, confined to known folders (a shared workflow must not be able to read or write
arbitrary paths):
* rule files: ``<ComfyUI user dir>/carnator/rules/`` (rules you calibrate; searched first), then the
  extension's shipped ``rules/`` folder;
* pairs files: ``<ComfyUI user dir>/carnator/pairs/``, the ComfyUI input folder, the ComfyUI output folder;
* calibrated rules are written to ``<ComfyUI user dir>/carnator/rules/``.
"""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import folder_paths

from ..carnator_core.learn.learner import LearnSettings, rule_namespace
from ..carnator_core.learn.rulefile import from_doc as learned_from_doc, read_if_learned
from ..carnator_core.learn.runtime import learning_decision
from ..carnator_core.paths import PathNotAllowedError, resolve_confined
from ..carnator_core.request import exact_decision, signature_settings
from ..carnator_core.risk.filter import MODES, decide_with_rule_file, probe_fingerprints, recall_problem
from ..carnator_core.risk.pipeline import CalibrationSettings, calibrate_rule_in_dirs
from ..carnator_core.risk.rule import CALIBRATE_HINT, RiskRule, RuleError, RuleMismatchError
from ._api import CANDIDATES, DECISION, PROBE, SIGNATURE, io
from ._common import mark_advanced as _advanced  # advanced but required: the node's execute has no defaults

SHIPPED_RULES = Path(__file__).resolve().parents[1] / "rules"



def user_rules_dir() -> Path:
    return Path(folder_paths.get_user_directory()) / "carnator" / "rules"


def rule_roots() -> list[Path]:
    return [user_rules_dir(), SHIPPED_RULES]


def rule_path(rule_file: str) -> Path | None:
    """The rule file a name resolves to, or None when no root holds it yet (learning mode: the learned rule is
    written to ``user_rules_dir()`` under that name). PathNotAllowedError for a name that is not allowed."""
    try:
        return resolve_confined(rule_file, rule_roots(), must_exist=True, what="risk rule file")
    except PathNotAllowedError:
        resolve_confined(rule_file, [user_rules_dir()], must_exist=False, what="risk rule file")  # allowed at all?
        return None


def learned_name(rule_file: str, namespace: str) -> str:
    """The name a model × config learns under when ``rule_file`` already holds the rule learned for another one:
    ``<stem>.<namespace><suffix>`` beside it (e.g. ``wan.json`` → ``wan.0123456789abcdef-9f2c….json``)."""
    p = Path(rule_file.strip())
    return str(p.with_name(f"{p.stem}.{namespace}{p.suffix or '.json'}"))


def learning_mode_decision(signature: Any, candidates: Any, probe: Any, rule_file: str,
                           settings: LearnSettings | None = None, seed_rule: str = "") -> Any:
    """Learning mode's decision (``carnator_core.learn.runtime``) when ``rule_file`` does not exist yet or is a
    learned rule; None for an ordinary rule file (the certified filter decides). ``seed_rule``: read only while no
    rule file exists yet (a learned rule's own settings, seed included, are recorded in it).

    One rule name, several models or configs: when ``rule_file`` is the rule learned for another model × config
    (another checkpoint, LoRA, steps or resolution), this one learns under ``learned_name(rule_file, namespace)``
    beside it — read from there once it exists — instead of being refused; the decision's summary says so."""
    path = rule_path(rule_file)
    data = read_if_learned(path) if path is not None else None
    if path is not None and data is None:
        return None
    if probe is None:
        raise ValueError(f"rule file {rule_file!r} does not exist yet (learning mode) or is learned: connect the Early "
                         "Probe's output to the Risk Filter's probe input so the request can be labelled")
    learned = None
    name, note = rule_file, ""
    if data is not None:
        learned = learned_from_doc(data, str(path))
        model_fp, config_fp = probe_fingerprints(probe)
        ns = rule_namespace(model_fp, config_fp)
        if learned.namespace != ns:  # learned for another model × config: this one learns beside it
            name = learned_name(rule_file, ns)
            note = (f"{rule_file} is the rule learned for another model or config ({learned.rule.describe_target()}); "
                    f"this model and config learn under {name}")
            other = rule_path(name)
            other_data = read_if_learned(other) if other is not None else None
            if other is not None and other_data is None:
                raise RuleError(f"{name} exists and is not a learned rule; this model and config learn under that "
                                "name when the Risk Filter's rule_file is learned for another one: rename or remove "
                                "it, or name another rule_file")
            learned = learned_from_doc(other_data, str(other)) if other_data is not None else None
        if learned is not None:
            learned.rule.check_applicable(model_fp, config_fp)
    elif seed_rule.strip():
        settings = replace(settings or LearnSettings(), seed_thresholds=seed_thresholds(seed_rule))
    target = resolve_confined(name, [user_rules_dir()], must_exist=False, what="risk rule file")
    return learning_decision(signature, candidates, probe, rule_file=name, rule_path=target, learned=learned,
                             settings=settings, note=note)


def seed_thresholds(seed_rule: str) -> tuple[float, float, float, float]:
    """The four axis thresholds of the rule file ``seed_rule`` (looked up like ``rule_file``), to start learning
    mode's first fit from. Any readable rule will do — another model's, an uncertified one: a seed only decides
    which requests the first fit accepts, never the certificate. Raises ValueError when no such file exists."""
    path = rule_path(seed_rule.strip())
    if path is None:
        raise ValueError(f"no rule file {seed_rule.strip()!r} in {user_rules_dir()} or the extension's rules/ "
                         "folder; name an existing rule file or leave seed_rule empty")
    data = read_if_learned(path)
    if data is not None:  # a learned rule: the thresholds of its loosest certified kind of change
        learned = learned_from_doc(data, str(path))
        if not learned.on:
            raise ValueError(f"the learned rule {seed_rule.strip()!r} has no certified kind of change yet: it has "
                             "no thresholds to seed from; leave seed_rule empty or name another rule")
        rule = learned.rule
    else:
        rule = RiskRule.load(path, allow_uncertified=True)
    t = rule.thresholds
    return (float(t.context), float(t.size), float(t.shape), float(t.appearance))


def pairs_roots() -> list[Path]:
    return [
        Path(folder_paths.get_user_directory()) / "carnator" / "pairs",
        Path(folder_paths.get_input_directory()),
        Path(folder_paths.get_output_directory()),
    ]


class CarnatorRiskFilter(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CarnatorRiskFilter",
            display_name="Carnator Risk Filter",
            category="Carnator",
            description=(
                "Compares the request's Early Signature with each recalled cache entry on four discrepancies "
                "(context appearance, object size, spatiotemporal shape, object appearance) and accepts the best "
                "entry that passes a calibrated, certified rule — or none, so the request runs dense. Every "
                "candidate gets a per-axis verdict."
            ),
            inputs=[
                SIGNATURE.Input(
                    "signature", optional=True,
                    tooltip="Early Signature of this request (Carnator Signature Builder). Needed in 'signature' mode.",
                ),
                CANDIDATES.Input("candidates", tooltip="Recalled cache entries (Carnator Cache Retriever)."),
                io.String.Input(
                    "rule_file", default="embedded.json",
                    tooltip="Risk rule file name, looked up in <ComfyUI user dir>/carnator/rules/ then in the "
                    "extension's rules/ folder. Must be calibrated for this model and generation config. A name "
                    "that does not exist yet starts learning mode: requests are served dense while Carnator labels "
                    "them and learns a rule, written under this name when it certifies.",
                ),
                io.Combo.Input(
                    "mode", options=list(MODES), default="signature",
                    tooltip="signature: certified four-axis rule. prompt_only: accept the most similar entry above "
                    "prompt_threshold (baseline, no certificate). never: always dense.",
                ),
                PROBE.Input(
                    "probe", optional=True,
                    tooltip="Early Probe of this request: lets the filter check the rule was calibrated for this "
                    "model and config (without it, the candidates' cache namespace is checked).",
                ),
                _advanced(io.Float.Input(
                    "prompt_threshold", default=0.9, min=-1.0, max=1.0, step=0.001,
                    tooltip="prompt_only mode: minimum prompt similarity for reuse.",
                )),
                _advanced(io.Boolean.Input(
                    "allow_uncertified", default=False,
                    tooltip="EXPERIMENTS ONLY: accept a rule whose certificate fails (U > α). Decisions are then "
                    "marked UNCERTIFIED; the risk is not bounded.",
                )),
                _advanced(io.Float.Input(
                    "learn_budget", default=0.2, min=0.0, max=2.0, step=0.01, optional=True,
                    tooltip="Learning mode (no rule file yet, or a learned one): extra compute for labelling served "
                    "requests, as a share of the compute served (0.2 = 20 %): that share ÷ 0.6 of the requests that "
                    "could be labelled are, drawn by a coin on the request (a third at 0.2). 0 = never label.",
                )),
                _advanced(io.Float.Input(
                    "audit_share", default=0.05, min=0.0, max=1.0, step=0.01, optional=True,
                    tooltip="Learning mode: share of a learned rule's hits served dense instead and labelled, to "
                    "catch a drift (0.05 = 5 %).",
                )),
                _advanced(io.String.Input(
                    "seed_rule", default="", optional=True,
                    tooltip="Learning mode: a rule file (shipped, calibrated or learned; any model or config) whose "
                    "thresholds start the first fit instead of this model's first requests. Only a starting point: "
                    "the certificate is still earned on this model's own labels. Empty = fit from own requests.",
                )),
            ],
            outputs=[
                DECISION.Output(display_name="decision",
                                tooltip="Accepted entry (or none) with per-candidate reasons."),
                io.String.Output(display_name="summary", tooltip="One-line human-readable verdict."),
            ],
        )

    @classmethod
    def validate_inputs(cls, rule_file: str | None = None, mode: str | None = None,
                        allow_uncertified: bool | None = None, seed_rule: str | None = None) -> bool | str:
        # At POST /prompt: a missing, unreadable or uncertified rule file is a 400 before anything runs. Naming
        # `mode` turns off ComfyUI's own combo check for it, so it is checked here.
        if isinstance(rule_file, str) and rule_file.startswith(RECALL_REFUSED):
            return rule_file[len(RECALL_REFUSED):]  # check_recall_at_queue found the Retriever too narrow
        if isinstance(seed_rule, str) and seed_rule.strip():
            try:
                seed_thresholds(seed_rule)
            except (PathNotAllowedError, RuleError, ValueError) as e:
                return f"seed_rule: {e}"
        if mode is None or rule_file is None:  # linked from another node: checked at execution
            return True
        if mode not in MODES:
            return f"mode must be one of {list(MODES)}, got {str(mode)[:50]!r}"
        if mode != "signature":
            return True
        try:
            path = rule_path(rule_file)
            if path is None:  # no rule yet: learning mode (served dense, labelled in the background)
                return True
            learned = read_if_learned(path)
            if learned is not None:
                learned_from_doc(learned, str(path))
            else:
                RiskRule.load(path, allow_uncertified=bool(allow_uncertified))
        except (PathNotAllowedError, RuleError) as e:
            return f"{e}" if isinstance(e, RuleError) else f"{e}. {CALIBRATE_HINT}"
        return True

    @classmethod
    def fingerprint_inputs(cls, rule_file: str = "", mode: str = "signature", **kwargs: Any) -> Any:
        # Re-run when the rule file changes on disk under the same name (e.g. after recalibration).
        if mode != "signature":
            return mode
        try:
            p = resolve_confined(rule_file, rule_roots(), must_exist=True, what="risk rule file")
            st = p.stat()
            # the rules other models or configs learn beside it under this name (``learned_name``)
            sib = [(q.name, q.stat().st_mtime_ns) for q in sorted(p.parent.glob(f"{p.stem}.*{p.suffix}"))]
            return f"{p}:{st.st_mtime_ns}:{st.st_size}:{sib}"
        except (PathNotAllowedError, OSError):
            return math.nan  # never equal: execute, and let execute report the problem

    @classmethod
    def execute(
        cls,
        candidates: Any,
        rule_file: str,
        mode: str,
        prompt_threshold: float,
        allow_uncertified: bool,
        signature: Any = None,
        probe: Any = None,
        learn_budget: float = 0.2,
        audit_share: float = 0.05,
        seed_rule: str = "",
    ) -> io.NodeOutput:
        exact = exact_decision(candidates)  # an exact repeat answered before the probe: nothing to filter
        if exact is not None:
            return io.NodeOutput(exact, exact.summary)
        if mode == "signature":
            settings = LearnSettings(budget=float(learn_budget), audit_share=float(audit_share))
            decision = learning_mode_decision(signature, candidates, probe, rule_file, settings,
                                              seed_rule if isinstance(seed_rule, str) else "")
            if decision is not None:
                return io.NodeOutput(decision, decision.summary, ui={"carnator_learning": [decision.summary]})
        try:
            decision = decide_with_rule_file(
                signature,
                candidates,
                rule_file=rule_file,
                rule_roots=rule_roots(),
                mode=mode,
                prompt_threshold=prompt_threshold,
                probe=probe,
                allow_uncertified=allow_uncertified,
                signature_settings=signature_settings,
            )
        except RuleMismatchError as e:
            raise RuleMismatchError(f"{e} To learn a rule for this model and config instead, name a rule_file that "
                                    f"does not exist yet (or rename or remove {rule_file!r}): learning mode starts "
                                    "on the next prompt.") from None
        return io.NodeOutput(decision, decision.summary)


class CarnatorCalibrateRule(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CarnatorCalibrateRule",
            display_name="Carnator Calibrate Rule",
            category="Carnator",
            description=(
                "Calibrates the Risk Filter's thresholds on labelled (request, cache entry) pairs and certifies them "
                "on a disjoint split with a one-sided Clopper–Pearson bound. Writes the rule to "
                "<ComfyUI user dir>/carnator/rules/ if the certificate holds. See docs/CALIBRATION.md."
            ),
            is_output_node=True,
            inputs=[
                io.String.Input(
                    "pairs_file", default="pairs.jsonl",
                    tooltip="Labelled pairs JSONL (format in docs/CALIBRATION.md), looked up in "
                    "<ComfyUI user dir>/carnator/pairs/, then the input and output folders.",
                ),
                io.String.Input(
                    "rule_name", default="my_model.json",
                    tooltip="File name of the rule to write into <ComfyUI user dir>/carnator/rules/.",
                ),
                io.Float.Input(
                    "alpha", default=0.05, min=0.001, max=0.5, step=0.001,
                    tooltip="Risk level α: the certified bound on the unsafe rate among accepted reuses.",
                ),
                io.Float.Input(
                    "delta", default=0.1, min=0.001, max=0.5, step=0.001,
                    tooltip="δ: the certificate holds with probability at least 1 − δ.",
                ),
                _advanced(io.Float.Input(
                    "calib_frac", default=0.5, min=0.05, max=0.95, step=0.05,
                    tooltip="Fraction of requests used to search thresholds; the rest certify them.",
                )),
                _advanced(io.Int.Input("seed", default=0, min=0, max=2**31 - 1, tooltip="Seed of the request split.")),
                _advanced(io.Combo.Input(
                    "constraint", options=["bound", "empirical"], default="bound",
                    tooltip="bound: calibration split's own Clopper–Pearson bound ≤ α (likely to certify). "
                    "empirical: unsafe rate ≤ α on the calibration split.",
                )),
                _advanced(io.Boolean.Input(
                    "search_similarity", default=False,
                    tooltip="Also search a minimum prompt similarity as a fifth threshold.",
                )),
                PROBE.Input(
                    "probe", optional=True,
                    tooltip="A probe of the model/config the pairs were made with; supplies the fingerprints if "
                    "the pairs file has no header row.",
                ),
            ],
            outputs=[io.String.Output(display_name="certificate", tooltip="Calibration and certification report.")],
        )

    @classmethod
    def fingerprint_inputs(cls, **kwargs: Any) -> Any:
        return math.nan  # writes a file from a file that may have changed: always run

    @classmethod
    def execute(
        cls,
        pairs_file: str,
        rule_name: str,
        alpha: float,
        delta: float,
        calib_frac: float,
        seed: int,
        constraint: str,
        search_similarity: bool,
        probe: Any = None,
    ) -> io.NodeOutput:
        settings = CalibrationSettings(alpha=alpha, delta=delta, calib_frac=calib_frac, seed=seed,
                                       constraint=constraint, search_similarity=search_similarity)
        report = calibrate_rule_in_dirs(pairs_file, pairs_roots(), rule_name, user_rules_dir(), settings, probe=probe,
                                        command=f"CarnatorCalibrateRule(pairs_file={pairs_file!r})")
        text = report.text()
        return io.NodeOutput(text, ui={"text": [text]})


#: Marks a Risk Filter whose Retriever recalls fewer candidates than its rule was certified on (set by
#: :func:`check_recall_at_queue`, read by ``validate_inputs``: the prompt is refused with the message that follows).
RECALL_REFUSED = "\x00carnator-recall-refused:"


def check_recall_at_queue(json_data: Any) -> Any:
    """ComfyUI on-prompt handler (runs on POST /prompt before validation): for every Risk Filter in signature mode
    fed directly by a Cache Retriever, both with literal settings, refuse the prompt when the Retriever's k is below
    the rule's certified recall K or its min_similarity above the rule's minimum. Node validation sees one node's
    inputs only, so the handler marks the filter's ``rule_file`` with :data:`RECALL_REFUSED` + the reason and the
    filter's ``validate_inputs`` turns that into a 400 naming the fix. Linked (computed) settings are checked at
    execution instead (``risk.filter.decide`` raises RecallNarrowedError). Never raises: a graph it cannot read is
    left to ComfyUI's own validation."""
    try:
        graph = json_data.get("prompt") if isinstance(json_data, dict) else None
        if not isinstance(graph, dict):
            return json_data
        for node in graph.values():
            if not isinstance(node, dict) or node.get("class_type") != "CarnatorRiskFilter":
                continue
            inputs = node.get("inputs") or {}
            rule_file, link = inputs.get("rule_file"), inputs.get("candidates")
            if inputs.get("mode", "signature") != "signature" or not isinstance(rule_file, str) \
                    or not isinstance(link, list) or not link:
                continue
            source = graph.get(str(link[0]))
            if not isinstance(source, dict) or source.get("class_type") != "CarnatorCacheRetriever":
                continue
            k, floor = (source.get("inputs") or {}).get("k"), (source.get("inputs") or {}).get("min_similarity")
            if isinstance(k, list) or isinstance(floor, list):
                continue  # linked: checked at execution
            try:
                path = rule_path(rule_file)
                if path is None or read_if_learned(path) is not None:
                    continue  # learning mode / learned rule: no certified recall to cover
                rule = RiskRule.load(path, allow_uncertified=bool(inputs.get("allow_uncertified", False)))
            except (PathNotAllowedError, RuleError, OSError, ValueError):
                continue  # validate_inputs reports those
            problem = recall_problem(rule, int(k) if isinstance(k, (int, float)) else None,
                                     float(floor) if isinstance(floor, (int, float)) else None)
            if problem is not None:
                inputs["rule_file"] = RECALL_REFUSED + f"Cache Retriever (node {link[0]}): {problem}"
    except Exception:  # noqa: BLE001 — a queue-time courtesy; execution enforces the same check
        return json_data
    return json_data


def _register_on_prompt() -> None:
    import sys

    server = sys.modules.get("server")
    instance = getattr(getattr(server, "PromptServer", None), "instance", None)
    if instance is None or getattr(instance, "_carnator_recall_check", False):
        return
    instance.add_on_prompt_handler(check_recall_at_queue)
    instance._carnator_recall_check = True


_register_on_prompt()

NODES = [CarnatorRiskFilter, CarnatorCalibrateRule]
