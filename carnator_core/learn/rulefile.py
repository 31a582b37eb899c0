"""The learned rule as a rule file: a RiskRule JSON document plus a ``"learning"`` key with its whole history.

What the file holds (``"learning"``, format v2):
  format/version, the namespace, the learning settings (α, δ, budget, audit share, strata correction, fit levels),
  the judge's name and settings, every label (compact rows, ``LABEL_FIELDS``; each distinct prompt once, in
  ``prompts``), every fit and event (switch-on, drift, the pilot's order), each stratum's state as recomputed, the
  sequence's method, and ``integrity``.

The RiskRule part: the thresholds of the loosest switched-on stratum (informative; the filter reads each
stratum's own from ``"learning"``), recall K = the Retriever's k the labels were made with, the reuse settings
the labels ran with, and as ``certificate`` the fixed-n exact certificate of the pooled accepted labels (beside the
anytime-valid one; it usually fails at these n, so the file is loaded with :func:`load_learned`, never as a plain
shipped rule).

Contracts
---------
* **Integrity.** ``integrity.sha256`` is the SHA-256 of the whole document but that field (canonical JSON): the
  thresholds, fingerprints, namespace, settings, judge, labels, fits and events — everything that decides what is
  served. A file whose digest does not match is refused, naming the file. The digest catches accidents and hand
  edits; it cannot stop a forger who recomputes it. ``integrity.hmac`` (HMAC-SHA256 under a key kept outside
  every cache and rules folder, ``key_path``) says whether *this installation* wrote the file: a file without a
  matching one is a copy (``LearnedRule.origin == "copied"``) — used, and said so, but only as trustworthy as where
  it came from. Whatever the seal, nothing in the file is taken on trust: the namespace must be the fingerprints'
  own, every event must be well-formed, and every stratum's state is recomputed from the labels and fits.
* **Bounded.** A saved file is at most ``MAX_LEARNED_BYTES`` (half the rule loader's limit, so a learned file is
  always loadable). Labels are compact rows and each prompt is stored once; a file that would exceed the cap is
  written without prompt texts (they are informative only; the cache's ``learn.sqlite`` keeps them), and one that
  still would is not written (``LearnedFileFull``): the previous file stays, learning continues in the cache's
  record, and the badge says so.
* **Versions.** A v1 file (no integrity seal) is refused with a message saying how to continue.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..risk.bounds import clopper_pearson_upper
from ..risk.certify import Certificate, certificate_bound
from ..risk.rule import MAX_RULE_BYTES, RiskRule, RuleFormatError
from ..risk.thresholds import Thresholds
from .labels import Label
from .learner import METHOD, Fit, Learner, LearnSettings, StratumState, accepts, rule_namespace

FORMAT = "carnator-learned-rule"
VERSION = 2
KEY = "learning"
EXACT_METHOD = "exact unconditional paired bound on (b - c)/n (risk/bounds.py: excess_upper_bound)"
MAX_LEARNED_BYTES = MAX_RULE_BYTES // 2  # 8 MiB: about 30,000 labels (~260 bytes each with their keys)
LABEL_FIELDS = ("id", "request_key", "stratum", "entry_id", "similarity", "vector", "missing", "reusable", "x",
                "kind", "judge", "cost_s", "prompt", "candidate_prompt", "seed", "t")
ENV_KEY_FILE = "CARNATOR_RULE_KEY_FILE"
INTEGRITY_COVERS = "the whole document except integrity itself (canonical JSON: sorted keys, no spaces)"


class LearnedFileFull(RuntimeError):
    """A learned rule document is larger than ``MAX_LEARNED_BYTES`` even without prompt texts (not written)."""


def is_learned(data: Any) -> bool:
    return isinstance(data, dict) and isinstance(data.get(KEY), dict)


# ---------------------------------------------------------------------------------------------- the seal
def key_path() -> Path:
    """Where the key that seals learned rules written here lives: ``$CARNATOR_RULE_KEY_FILE`` or
    ``~/.config/carnator/learned-rule-hmac.key`` — outside every cache and rules folder, so a copied rules folder
    does not carry it."""
    env = os.environ.get(ENV_KEY_FILE)
    if env:
        return Path(env).expanduser()
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "carnator" / "learned-rule-hmac.key"


_KEYS: dict[str, bytes | None] = {}
_KEYS_LOCK = threading.Lock()


def seal_key() -> bytes | None:
    """This installation's sealing key (created on first use; None when it cannot be read or created: files are
    then written with the digest alone and read back as copies)."""
    from ..cache.store import _load_or_create_key

    p = key_path()
    with _KEYS_LOCK:
        if str(p) not in _KEYS:
            _KEYS[str(p)] = _load_or_create_key(p)
        return _KEYS[str(p)]


def _canonical(doc: Mapping[str, Any]) -> bytes:
    """The bytes the seal covers: the document without ``learning.integrity``, as canonical JSON."""
    d = dict(doc)
    rec = dict(d.get(KEY) or {})
    rec.pop("integrity", None)
    d[KEY] = rec
    return json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def seal(doc: dict[str, Any], key: bytes | None = None) -> dict[str, Any]:
    """Set ``doc``'s integrity record (in place; returned): the digest, and the HMAC under ``key`` (default: this
    installation's ``seal_key``)."""
    key = seal_key() if key is None else key
    body = _canonical(json.loads(json.dumps(doc)))  # as it will read back (tuples become lists)
    doc[KEY]["integrity"] = {"sha256": hashlib.sha256(body).hexdigest(), "covers": INTEGRITY_COVERS,
                             "hmac": hmac.new(key, body, hashlib.sha256).hexdigest() if key else None}
    return doc


def _verify_seal(data: Mapping[str, Any], where: str, key: bytes | None) -> str:
    """"sealed here" or "copied"; raises RuleFormatError when the digest does not match."""
    integ = data[KEY].get("integrity")
    if not isinstance(integ, dict) or not isinstance(integ.get("sha256"), str):
        raise RuleFormatError(f"{where} has no integrity record; it was not written by Carnator as it is. Restore "
                              "the file Carnator wrote, or remove it to learn again")
    body = _canonical(data)
    if not hmac.compare_digest(hashlib.sha256(body).hexdigest(), integ["sha256"]):
        raise RuleFormatError(f"{where} fails its integrity check: it was edited or damaged after Carnator wrote it "
                              "(its thresholds, fingerprints, labels or events are not the ones certified). Carnator "
                              "does not use it: restore the file Carnator wrote, or remove it to learn again (the "
                              "cache folder's learning record is kept)")
    mac = integ.get("hmac")
    if key and isinstance(mac, str) and hmac.compare_digest(hmac.new(key, body, hashlib.sha256).hexdigest(), mac):
        return "sealed here"
    return "copied"


# ---------------------------------------------------------------------------------------------- compact labels
def _pack(labels: Sequence[Label], keep_prompts: bool) -> tuple[list[str], list[dict[str, Any]], list[list[Any]]]:
    """(prompts, judges, rows): each distinct prompt and judge once; a row per label in ``LABEL_FIELDS`` order
    with the prompts and the judge as indexes (−1: the prompt is not kept)."""
    prompts: dict[str, int] = {}
    judges: dict[str, int] = {}
    judge_list: list[dict[str, Any]] = []
    rows = []

    def pidx(text: str) -> int:
        if not keep_prompts or not text:
            return -1
        return prompts.setdefault(text, len(prompts))

    for lab in labels:
        jd = {"name": lab.judge, "settings": dict(lab.judge_settings or {})}
        jk = json.dumps(jd, sort_keys=True)
        if jk not in judges:
            judges[jk] = len(judge_list)
            judge_list.append(jd)
        rows.append([int(lab.id), lab.request_key, lab.stratum, lab.entry_id, float(lab.similarity),
                     [float(v) for v in lab.vector], int(lab.missing), int(lab.reusable), int(lab.x), lab.kind,
                     judges[jk], float(lab.cost_s), pidx(lab.prompt), pidx(lab.candidate_prompt), int(lab.seed),
                     round(float(lab.t), 3)])
    return list(prompts), judge_list, rows


def _unpack(rec: Mapping[str, Any], where: str) -> list[Label]:
    prompts = [str(p) for p in rec.get("prompts", [])]
    judges = list(rec.get("judges", []))
    if list(rec.get("label_fields", [])) != list(LABEL_FIELDS):
        raise RuleFormatError(f"{where}: its labels are not in the fields {list(LABEL_FIELDS)}")
    out: list[Label] = []
    for i, row in enumerate(rec["labels"]):
        try:
            (row_id, key, stratum, entry, sim, vec, missing, reusable, x, kind, j, cost, p, q, seed, t) = row
            judge = judges[int(j)]
            lab = Label.from_row({"request_key": str(key), "stratum": str(stratum), "entry_id": str(entry),
                                  "similarity": float(sim), "vector": vec, "missing": bool(missing),
                                  "reusable": bool(reusable), "x": x, "kind": kind, "judge": str(judge["name"]),
                                  "judge_settings": dict(judge["settings"]), "cost_s": float(cost),
                                  "prompt": prompts[p] if int(p) >= 0 else "",
                                  "candidate_prompt": prompts[q] if int(q) >= 0 else "", "seed": int(seed),
                                  "t": float(t)}, int(row_id))
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise RuleFormatError(f"{where}: label {i} is malformed ({type(e).__name__}: {e})") from None
        if out and lab.id <= out[-1].id:
            raise RuleFormatError(f"{where}: label {i} is out of order (ids must increase)")
        out.append(lab)
    return out


def _check_events(events: Any, where: str) -> list[dict[str, Any]]:
    """The events, each checked for the fields the state is derived from; RuleFormatError naming the first bad one."""
    if not isinstance(events, list):
        raise RuleFormatError(f"{where}: its events are not a list")
    out = []
    for i, e in enumerate(events):
        kind = e.get("kind") if isinstance(e, dict) else None
        try:
            if not isinstance(kind, str) or not isinstance(e.get("message", ""), str):
                raise ValueError("no kind or message")
            if kind == "fit":
                Fit.from_dict(e["fit"])
            elif kind == "order":
                if not isinstance(e["order"], list) or not all(isinstance(x, str) for x in e["order"]):
                    raise ValueError("order is not a list of kinds of change")
                int(e["since"])
            elif kind in ("on", "drift"):
                if not isinstance(e["stratum"], str):
                    raise ValueError("stratum is not a name")
                int(e["fit"])
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise RuleFormatError(f"{where}: event {i} ({str(kind)[:20]!r}) is malformed ({type(err).__name__}: "
                                  f"{err}); restore the file Carnator wrote, or remove it to learn again") from None
        out.append(dict(e))
    return out


def build(learner: Learner, namespace: str, *, model_fingerprint: str, rule_fingerprint: str, arch: str,
          config_meta: Mapping[str, Any], reuse_meta: Mapping[str, Any] | None, judge: Mapping[str, Any],
          states: Mapping[str, StratumState] | None = None, recall_k: int = 1, keep_prompts: bool = True,
          key: bytes | None = None) -> dict[str, Any]:
    """The sealed rule document of ``namespace``'s learning record (see the module docstring). ``recall_k``: the
    Retriever's k the labels were made with (the learned rule chooses among that many candidates);
    ``keep_prompts``: store the prompt texts; ``key``: the sealing key (default: this installation's)."""
    s = learner.settings
    states = learner.state(namespace) if states is None else states
    labels = learner.store.labels(namespace)
    on = [st for st in states.values() if st.on and st.fit is not None]
    loosest = max(on, key=lambda st: sum(st.fit.thresholds.vector()), default=None)  # type: ignore[union-attr]
    th = loosest.fit.thresholds if loosest is not None else Thresholds(0.0, 0.0, 0.0, 0.0)  # type: ignore[union-attr]
    # fixed-n exact certificate of the pooled accepted shadow labels, reported beside the anytime-valid one
    acc = [lab for lab in labels if lab.kind == "shadow" and lab.reusable and lab.stratum in states
           and states[lab.stratum].fit is not None and accepts(states[lab.stratum].fit.thresholds, lab.vector,
                                                               lab.missing)]
    n, b, c = len(acc), sum(lab.x == 1 for lab in acc), sum(lab.x == -1 for lab in acc)
    n_req = max(n, sum(lab.kind == "shadow" for lab in labels))
    cert = Certificate(n=n, k=b, upper_bound=certificate_bound("excess", n, b, c, s.delta), alpha=s.alpha,
                       delta=s.delta, n_requests=n_req, method=EXACT_METHOD,
                       c=c, label="excess", unsafe_upper_bound=clopper_pearson_upper(b, n, s.delta))
    rule = RiskRule(thresholds=th, certificate=cert, model_fingerprint=model_fingerprint,
                    config_fingerprint=rule_fingerprint, arch=arch, config_meta=dict(config_meta),
                    provenance={"learned": True, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                "note": "learned on served traffic (learning mode); the anytime-valid per-stratum "
                                        "certificates are in 'learning'; 'certificate' is the fixed-n bound of "
                                        "the same labels, for comparison"},
                    recall_k=max(int(recall_k), 1), recall_min_similarity=0.0,
                    reuse_config=dict(reuse_meta) if reuse_meta else None)
    doc = rule.to_json()
    prompts, judges, rows = _pack(labels, keep_prompts)
    doc[KEY] = {
        "format": FORMAT, "version": VERSION, "namespace": namespace, "settings": s.to_dict(),
        "judge": dict(judge), "sequence": {"method": METHOD},
        "label_fields": list(LABEL_FIELDS), "prompts": prompts, "judges": judges, "labels": rows,
        "events": learner.store.events(namespace),
        "strata": {k: v.to_dict() for k, v in sorted(states.items())},
        "on": sorted(st.stratum for st in on),
    }
    return seal(doc, key)


def save(doc: dict[str, Any], path: str | Path, *, cap: int | None = None, rebuild: Any = None) -> Path:
    """Write atomically (a reader never sees half a file), within ``cap`` bytes: a document over it is rebuilt
    without prompt texts by ``rebuild`` (a callable: keep_prompts -> document) when given, and raises
    LearnedFileFull when still over (the previous file is left as it was). ``cap``: default ``MAX_LEARNED_BYTES``."""
    path = Path(path)
    cap = MAX_LEARNED_BYTES if cap is None else int(cap)
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False) + "\n"
    if len(text.encode("utf-8")) > cap and rebuild is not None:
        doc = rebuild(False)
        text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False) + "\n"
    size = len(text.encode("utf-8"))
    if size > cap:
        raise LearnedFileFull(f"the learned rule {path.name!r} would be {size} bytes, over its cap of {cap} bytes "
                              f"even without prompt texts ({len(doc[KEY]['labels'])} labels); it is kept as last "
                              "written and learning continues in the cache folder's record")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{time.time_ns()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


@dataclass(frozen=True)
class LearnedRule:
    """A learned rule file, verified: the RiskRule part, the settings, each stratum's recomputed state, and the
    record it was recomputed from (``labels``, ``events``). ``origin``: "sealed here" (this installation wrote it)
    or "copied" (another installation did, or its seal was recomputed by hand)."""

    rule: RiskRule
    settings: LearnSettings
    namespace: str
    states: Mapping[str, StratumState]
    judge: Mapping[str, Any]
    order: tuple[str, ...] = ()  # the order its strata are certified in (the candidate it reuses follows it)
    labels: tuple[Label, ...] = ()
    events: tuple[Mapping[str, Any], ...] = field(default_factory=tuple)
    origin: str = "sealed here"
    source: str = ""

    @property
    def on(self) -> list[str]:
        return sorted(k for k, v in self.states.items() if v.on)

    def thresholds(self, stratum: str) -> Thresholds | None:
        st = self.states.get(stratum)
        return st.fit.thresholds if st is not None and st.on and st.fit is not None else None


def from_doc(data: Mapping[str, Any], source: str = "", *, key: bytes | None = None) -> LearnedRule:
    """Verify a learned rule document (module docstring): its seal, its namespace against its fingerprints, every
    label and event; the states are recomputed. Raises RuleFormatError naming ``source`` and saying what is wrong.
    ``key``: the sealing key to recognise this installation's files (default: ``seal_key``)."""
    where = f"learned rule {Path(source).name!r}" if source else "learned rule"
    rec = data.get(KEY) if isinstance(data, Mapping) else None
    if not isinstance(rec, dict) or rec.get("format") != FORMAT:
        raise RuleFormatError(f"{where}: its 'learning' record is not a {FORMAT} record")
    if rec.get("version") != VERSION:
        raise RuleFormatError(f"{where} is a {FORMAT} v{str(rec.get('version'))[:10]}; this Carnator reads v{VERSION} "
                              "(sealed) files only: remove or rename the file and learning continues from the cache "
                              "folder's record, which writes it again in this version")
    origin = _verify_seal(data, where, seal_key() if key is None else key)
    rule = RiskRule.from_json(dict(data), source=source, allow_uncertified=True)
    ns = rec.get("namespace")
    if ns != rule_namespace(rule.model_fingerprint, rule.config_fingerprint):
        raise RuleFormatError(f"{where}: its namespace {str(ns)[:80]!r} is not the one of its model and config "
                              f"fingerprints ({rule.namespace!r}); restore the file Carnator wrote, or remove it")
    try:
        settings = LearnSettings.from_dict(rec["settings"])
        labels = _unpack(rec, where)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        if isinstance(e, RuleFormatError):
            raise
        raise RuleFormatError(f"{where}: its 'learning' record is malformed ({type(e).__name__}: {e})") from None
    events = _check_events(rec.get("events", []), where)
    learner = Learner(":memory:", settings)
    try:
        for lab in labels:
            learner.store.add_label(ns, lab, keep_id=True)
        for e in events:
            e = dict(e)
            learner.store.add_event(ns, str(e.pop("kind", "")), str(e.pop("message", "")), **e)
        states = learner.state(ns, update=False)
        order = tuple(learner.order(ns) or ())
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise RuleFormatError(f"{where}: its record does not derive a state ({type(e).__name__}: {e}); restore the "
                              "file Carnator wrote, or remove it to learn again") from None
    finally:
        learner.store.close()
    return LearnedRule(rule, settings, ns, states, dict(rec.get("judge", {})), order, tuple(labels),
                       tuple(events), origin, str(source))


def load_learned(path: str | Path) -> LearnedRule:
    path = Path(path)
    try:
        if path.stat().st_size > MAX_RULE_BYTES:
            raise RuleFormatError(f"learned rule {path.name!r} is larger than {MAX_RULE_BYTES} bytes")
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise RuleFormatError(f"learned rule {path.name!r} cannot be read ({e})") from None
    return from_doc(data, str(path))


def read_if_learned(path: str | Path) -> Any:
    """The parsed document when ``path`` is a learned rule file, else None (a plain rule, or unreadable: the
    ordinary loader reports those)."""
    try:
        p = Path(path)
        if not p.is_file() or p.stat().st_size > MAX_RULE_BYTES:
            return None
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return data if is_learned(data) else None
