"""The idle-time worker: warm-up labels made from the user's own cached scenes while ComfyUI's queue is empty.

What one warm-up label is (``IdleWorker.run_once``): a cached entry of a namespace that is learning (its prompt and
seed), an edit of it of one kind of change (``edits.make_edit``, the kind chosen below), served as a request the
way ComfyUI would serve it — the Early Probe, the recall from the user's cache, the dense generation (``request.
serve`` with method "never", nothing written) — then, if the candidate the rule-to-be would choose (``runtime.
choose``) is of a kind still learning and inside its warm-up fit, the reuse run of that candidate and the judge's
label (``runtime.label_counterfactual``), written with the request's covariates to the warm-up population's
namespace (``warmup.warmup_namespace``). It costs one dense run, one reuse run and a judgement: all three are its
cost (``cost_s``), charged to the warm-up namespace's ledger, none to the traffic's budget.

Which kind: the first kind of the warm-up order (``STRATA``'s, reseed first) that is neither on (by either
population) nor off, and for which the last ``MAX_MISSES`` attempts since any label did not all fail to give one
(a kind whose edits are never recalled as that kind — no cached scene offers it — yields to the next one; any label
gives the head of the order its turn back: ``count_attempt``).

When (``IdleSettings``): ``mode`` "off" (never), "idle" (whenever the queue is empty) or "budget" (while the queue
is empty, at most ``minutes_per_hour`` minutes of warm-up compute in any 60 minutes). The worker asks ``busy()``
(ComfyUI's queue holds a prompt, running or waiting) before each label and before each model call: every run of
a label goes through Carnator's own model-call wrapper (``comfy_patch``'s PREDICT_NOISE wrapper, installed on the
clone each Carnator run samples with), which calls the run's step callback before the model computes; the worker's
callback raises :class:`Preempted` when a prompt was queued. (A wrapper of the worker's own on the model would change
the model's fingerprint — ``comfy_patch.model_fingerprint`` digests wrappers — and with it the namespace: the
edits would recall nothing of the user's cache.) The user's prompt waits for at most that one model call in
flight (and the sampler's unwinding): ComfyUI's prompt worker asks ``wait_unwound`` before it runs a prompt it took
from the queue, since two samplings of one model at once break each other's state. The worker's partial label is
discarded, never written, and its compute counted as ``preempted_s``.

Which request (``draw_edit``): for the kind chosen, a cached entry of the namespace **uniformly at random, with
replacement**, among the entries that admit an edit of that kind (rejection: an entry the generator gives no valid
edit is drawn again, at most ``MAX_DRAWS`` times, after which the attempt gives no label and says why), then a
random edit of that kind — a fresh random seed for reseed, one of the scene's valid edits (``MAX_EDITS`` salts of
``edits.make_edit``), each equally likely, for the others. The generator is ``random.SystemRandom`` (the OS's
entropy): no draw depends on a label, on an outcome, on which entries the kind's test has counted or on what was
drawn before; an entry may be drawn again and again, and an edit may repeat (it is served and labelled again: a
with-replacement draw is not skipped). The label row records the draw (``Label.draw``: the marker ``IID_DRAW``,
the entry, the salt, how many edits the scene offers and how many entries were in the population). That is what
lets the warm-up learner count each label (``warmup`` module docstring, "The unit"): given the cache's entries at
each draw, a kind's warm-up labels are i.i.d. draws from "a random edit of kind k of a uniformly random cached
scene". (Before, the worker walked the entries round-robin and passed over those the kind's test had counted.)

What a label needs (``WarmContext``): the model, text encoder, negative conditioning, latent, probe and reuse
settings of a request of that namespace; the sampler hook (``remember``) keeps the last served one's. Nothing is
remembered across restarts: after one, warm-up starts with the first learning request served.

No ComfyUI import here: the glue (``nodes/warmup.py``) passes ``busy``.
"""
from __future__ import annotations

import hashlib
import logging
import random
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, MutableMapping, Sequence

from .edits import KINDS, Edit, make_edit
from .labels import IID_DRAW

log = logging.getLogger("carnator")

MODES = ("off", "idle", "budget")
#: Attempts of one kind without a label (since the last label of any kind) before the worker moves on to the next
#: kind; the next label gives it its turn back (``count_attempt``).
MAX_MISSES = 4
#: A scene's population of edits of a word kind: ``edits.make_edit``'s salts 0 .. MAX_EDITS − 1 that give an edit,
#: each equally likely (a reseed edit is a fresh random seed: its population has no bound).
MAX_EDITS = 8
#: Entries drawn (with replacement) for one label before the worker gives up on the kind for this attempt: an entry
#: that admits no edit of the kind is rejected and another drawn (``draw_edit``).
MAX_DRAWS = 256
#: Scenes (prompt, seed) and edit counts the worker remembers (entry ids do not change content; recomputed past it).
_MEMO_MAX = 20_000


def draw_edit(entries: Sequence[str], scene: Callable[[str], tuple[str, int]], kind: str, *, vocabulary: str,
              rng: random.Random, make: Callable[..., Edit | None] = make_edit, max_draws: int = MAX_DRAWS,
              memo: MutableMapping[Any, tuple[int, ...]] | None = None) -> tuple[Edit, dict[str, Any]] | str:
    """One warm-up request of kind ``kind``, drawn i.i.d. (module docstring, "Which request"): (the edit, the draw's
    record for ``Label.draw``), or why there is none.

    ``entries``: the namespace's cached entry ids now (the population); ``scene(entry_id)`` → (prompt, seed);
    ``rng``: the generator (``random.SystemRandom`` in the worker; a seeded one in tests) — the only source of
    randomness, and nothing here reads a label; ``make``: the edit generator (``edits.make_edit``); ``memo``: the
    valid salts of a (prompt, seed, kind, vocabulary), kept between calls (a deterministic function of the scene).

    An entry is drawn uniformly with replacement; it is rejected (another drawn) when it admits no edit of the kind
    — its valid salts (``make`` not None among 0 .. ``MAX_EDITS`` − 1; reseed: a non-empty prompt) are none — or
    cannot be read; otherwise a salt is drawn uniformly among its valid ones (reseed: 64 random bits, i.e. a fresh
    random seed). So the entry is uniform among the entries that admit the kind, and the edit uniform among that
    entry's edits, whatever was drawn or labelled before."""
    if not entries:
        return "the cache holds no entry of this namespace"
    memo = {} if memo is None else memo
    unreadable = 0
    for tries in range(1, int(max_draws) + 1):
        entry_id = entries[rng.randrange(len(entries))]
        try:
            prompt, seed = scene(entry_id)
        except Exception:  # noqa: BLE001 — an entry removed meanwhile (eviction): rejected like one with no edit
            unreadable += 1
            continue
        if kind == "reseed":
            salt = rng.getrandbits(64)
            edit = make(prompt, int(seed), kind, vocabulary=vocabulary, salt=salt)
            valid = None
        else:
            key = (prompt, int(seed), kind, vocabulary)
            valid = memo.get(key)
            if valid is None:
                valid = tuple(s for s in range(MAX_EDITS)
                              if make(prompt, int(seed), kind, vocabulary=vocabulary, salt=s) is not None)
                if len(memo) >= _MEMO_MAX:
                    memo.clear()
                memo[key] = valid
            if not valid:
                continue
            salt = valid[rng.randrange(len(valid))]
            edit = make(prompt, int(seed), kind, vocabulary=vocabulary, salt=salt)
        if edit is None:
            continue
        return edit, {"rule": IID_DRAW, "entry": str(entry_id), "salt": int(salt),
                      "edits": len(valid) if valid is not None else None, "population": len(entries),
                      "draws": tries}
    return (f"no {kind} edit drawn: {max_draws} draws among the {len(entries)} cached entries found none that admits "
            f"one" + (f" ({unreadable} could not be read)" if unreadable else "")
            + "; the worker moves on to the next kind after a few such attempts")


def next_kind(learning: Sequence[str], misses: Mapping[str, int]) -> str | None:
    """The kind the worker labels next: the first of ``learning`` (the warm-up order's kinds still learning) whose
    last ``MAX_MISSES`` attempts did not all give no label; None when every one has missed lately."""
    return next((k for k in learning if misses.get(k, 0) < MAX_MISSES), None)


def count_attempt(misses: dict[str, int], kind: str, labelled: bool) -> None:
    """Book one attempt of ``kind`` in ``misses`` (one namespace's). A label — of any kind — gives every kind a
    fresh start, so the next pick is the head of the order again: a head kind that missed a few times in a row (its
    candidates outside its fit by chance) yields for one label, not for good; before, it waited until every later
    kind had missed too, and the labels spread over the order instead of completing its head. An attempt without a
    label counts against its kind. Neither reads an outcome (a miss is a candidate outside the fit: covariates)."""
    if labelled:
        misses.clear()
    else:
        misses[kind] = misses.get(kind, 0) + 1


class Preempted(Exception):
    """A prompt was queued: the warm-up label in flight is abandoned at its next model call."""


@dataclass(frozen=True)
class IdleSettings:
    """The user's setting: ``mode`` "off" | "idle" | "budget"; ``minutes_per_hour`` (budget mode): warm-up compute
    allowed in any 60 minutes; ``max_labels`` (0 = no limit): stop after that many warm-up labels in all (a bounded
    warm-up, e.g. for a measurement)."""

    mode: str = "off"
    minutes_per_hour: float = 10.0
    max_labels: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"warm-up mode must be one of {MODES}, got {self.mode!r}")
        if not (0.0 <= float(self.minutes_per_hour) <= 60.0) or int(self.max_labels) < 0:
            raise ValueError(f"minutes_per_hour must be in [0, 60] and max_labels >= 0, got {self}")

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "minutes_per_hour": float(self.minutes_per_hour),
                "max_labels": int(self.max_labels)}


@dataclass
class WarmContext:
    """What a warm-up label of one namespace needs (module docstring), from a served learning request.

    directory: the cache's folder (or Redis URL) — the learning record's; handle: its ``CacheHandle``;
    namespace: the learning namespace (model × config); store_namespace: the cache's namespace of its entries;
    spec: a ``request.RequestSpec`` with the request's settings (its prompt and seed are replaced per edit)."""

    directory: str
    handle: Any
    namespace: str
    store_namespace: str
    model: Any
    text_encoder: Any
    negative: Any
    latent: dict
    spec: Any
    probe_config: Any
    reuse_config: Any
    settings: Any
    top_k: int
    vocabulary: str
    t: float = field(default_factory=time.time)


@dataclass
class _Stats:
    labels: int = 0
    attempts: int = 0
    no_label: int = 0
    preempted: int = 0
    errors: int = 0
    cost_s: float = 0.0
    preempted_s: float = 0.0
    model_calls: int = 0
    by_kind: dict = field(default_factory=dict)


class IdleWorker:
    """The worker (module docstring). ``busy()``: whether ComfyUI's queue holds a prompt (running or waiting)."""

    def __init__(self, *, busy: Callable[[], bool], poll_s: float = 1.0, rng: random.Random | None = None):
        """``rng``: the generator of the warm-up draws (``draw_edit``); the OS's entropy (``random.SystemRandom``)
        unless a test passes a seeded one."""
        self._busy = busy
        self._rng = random.SystemRandom() if rng is None else rng
        self._scenes: dict[tuple[str, str], tuple[str, int]] = {}
        self._edit_memo: dict[Any, tuple[int, ...]] = {}
        self.poll_s = float(poll_s)
        self.settings = IdleSettings()
        self._contexts: dict[str, WarmContext] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.stats = _Stats()
        self.doing = "off"
        self.last: dict[str, Any] = {}
        self.error = ""
        self._spent: deque = deque()  # (monotonic end, seconds) of the last hour's work
        self._misses: dict[str, dict[str, int]] = {}  # namespace → kind → attempts without a label since one
        self._in_flight = threading.Lock()  # held while a label runs (``wait_unwound``)

    # ------------------------------------------------------------------ settings and state
    def configure(self, settings: IdleSettings) -> None:
        with self._lock:
            self.settings = settings
        self._wake.set()

    def remember(self, ctx: WarmContext) -> None:
        """Keep ``ctx`` as its namespace's latest (the sampler hook, after a learning request was served)."""
        with self._lock:
            self._contexts[ctx.namespace] = ctx
        self._wake.set()

    def spent_last_hour(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._spent and self._spent[0][0] < now - 3600.0:
                self._spent.popleft()
            return float(sum(s for _, s in self._spent))

    def status(self) -> dict[str, Any]:
        """What the panel shows: the setting, what the worker is doing, labels made, what they cost."""
        s = self.stats
        with self._lock:
            namespaces = sorted(self._contexts)
        return {"settings": self.settings.to_dict(), "doing": self.doing, "labels": s.labels, "attempts": s.attempts,
                "no_label": s.no_label, "preempted": s.preempted, "errors": s.errors, "cost_s": round(s.cost_s, 3),
                "preempted_s": round(s.preempted_s, 3), "spent_last_hour_s": round(self.spent_last_hour(), 3),
                "model_calls": s.model_calls, "by_kind": dict(s.by_kind), "namespaces": namespaces,
                "last": dict(self.last), "error": self.error, "running": self.running}

    # ------------------------------------------------------------------ the thread
    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self.running:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="carnator-warmup", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._thread = None

    def wait_unwound(self) -> None:
        """Return once no warm-up label is in flight. ComfyUI's prompt worker calls this (``nodes/warmup.py``) before
        it runs a prompt it just took from the queue: a label in flight stops at its next model call (the queue is
        busy by then) and unwinds — the model's sampling state is ComfyUI's, shared by every clone of the model, and
        two samplings on it at once break each other — so the prompt waits at most one model call of the worker."""
        with self._in_flight:
            pass

    def should_stop(self) -> bool:
        """Stop the label in flight: the worker is stopping, switched off, or a prompt is queued."""
        return self._stop.is_set() or self.settings.mode == "off" or bool(self._busy())

    def why_waiting(self) -> str:
        """Why no label would start now ("" = one may)."""
        st = self.settings
        if st.mode == "off":
            return "off"
        if st.max_labels and self.stats.labels >= st.max_labels:
            return f"done — {self.stats.labels} warm-up labels (the limit set)"
        if self._busy():
            return "waiting — ComfyUI's queue holds a prompt"
        if st.mode == "budget" and self.spent_last_hour() >= 60.0 * float(st.minutes_per_hour):
            return f"waiting — this hour's budget of {st.minutes_per_hour:g} minutes is spent"
        with self._lock:
            if not self._contexts:
                return "waiting — no learning request served yet (warm-up edits the scenes it caches)"
        return ""

    def _loop(self) -> None:
        while not self._stop.is_set():
            why = self.why_waiting()
            if why:
                self.doing = why
                self._wake.wait(self.poll_s)
                self._wake.clear()
                continue
            try:
                self.run_once()
            except Exception as e:  # noqa: BLE001 — the worker never takes the server down; it says what failed
                self.stats.errors += 1
                self.error = f"{type(e).__name__}: {e}"
                log.warning("carnator warm-up: a label failed (%s); the worker goes on", self.error)
                self._wake.wait(self.poll_s)
                self._wake.clear()

    # ------------------------------------------------------------------ one label
    def _pick(self) -> tuple[WarmContext, str, list[str]] | None:
        """(context, kind, kinds still learning) of the next label, or None when every kind is on or off."""
        from .learner import learner_for
        from .warmup import kind_states, warm_learner, warmup_namespace

        with self._lock:
            contexts = sorted(self._contexts.values(), key=lambda c: -c.t)
        for ctx in contexts:
            learner = learner_for(ctx.directory, ctx.settings)
            traffic = learner.state(ctx.namespace)
            wl = warm_learner(learner)
            wns = warmup_namespace(ctx.namespace)
            warm = wl.state(wns)  # with no label yet this fixes the warm-up order (STRATA's) before its first
            ks = kind_states(learner, ctx.namespace, traffic, warm)
            order = wl.order(wns) or list(KINDS)
            learning = [k for k in order if k in KINDS and not (k in warm and warm[k].on)
                        and not (k in traffic and traffic[k].on) and k not in ks
                        and not (k in warm and warm[k].state == "off")]
            if not learning:
                continue
            misses = self._misses.setdefault(ctx.namespace, {})
            kind = next_kind(learning, misses)
            if kind is None:  # every kind missed lately: start over
                misses.clear()
                kind = learning[0]
            return ctx, kind, learning
        return None

    def run_once(self) -> dict[str, Any]:
        """Make (at most) one warm-up label now, whatever the queue (the loop asks first). Returns what it did:
        {"result": "label" | "no label" | "preempted" | "nothing to do", ...}."""
        picked = self._pick()
        if picked is None:
            self.doing = "nothing to warm up: every kind of change is on, off, or has no cached scene to edit"
            return {"result": "nothing to do"}
        ctx, kind, learning = picked
        self.stats.attempts += 1
        t0 = time.perf_counter()
        try:
            with self._in_flight:
                out = self._label(ctx, kind, learning)
        except Preempted as e:
            spent = time.perf_counter() - t0
            self.stats.preempted += 1
            self.stats.preempted_s += spent
            self.record_spent(spent)
            self.last = {"result": "preempted", "at": str(e) or "model call", "kind": kind,
                         "seconds": round(spent, 3)}
            self.doing = "preempted — a prompt was queued; the partial label was discarded"
            return dict(self.last)
        spent = time.perf_counter() - t0
        self.record_spent(spent)
        self.stats.cost_s += spent
        if out.get("result") == "label":
            self.stats.labels += 1
            k = out["stratum"]
            self.stats.by_kind[k] = self.stats.by_kind.get(k, 0) + 1
        else:
            self.stats.no_label += 1
        count_attempt(self._misses.setdefault(ctx.namespace, {}), kind, out.get("result") == "label")
        self.last = {**out, "seconds": round(spent, 3)}
        return dict(self.last)

    def record_spent(self, seconds: float) -> None:
        """Count ``seconds`` of warm-up compute ending now (the budget mode's hour window)."""
        with self._lock:
            self._spent.append((time.monotonic(), float(seconds)))

    def _entries(self, ctx: WarmContext, store: Any) -> list[str]:
        return [str(e) for e in store.entry_ids(ctx.store_namespace)]

    def _scene(self, ctx: WarmContext, store: Any, entry_id: str) -> tuple[str, int]:
        """(prompt, seed) of a cached entry (remembered: an entry id's content never changes)."""
        key = (ctx.store_namespace, entry_id)
        got = self._scenes.get(key)
        if got is None:
            entry = store.load(entry_id, count_hit=False)
            got = (str(entry.prompt), int(entry.seed))
            if len(self._scenes) >= _MEMO_MAX:
                self._scenes.clear()
            self._scenes[key] = got
        return got

    def draw(self, ctx: WarmContext, store: Any, kind: str) -> tuple[Edit, dict[str, Any]] | str:
        """The next warm-up request of ``kind`` (``draw_edit`` on the namespace's entries now, this worker's rng)."""
        return draw_edit(self._entries(ctx, store), lambda e: self._scene(ctx, store, e), kind,
                         vocabulary=ctx.vocabulary, rng=self._rng, memo=self._edit_memo)

    def _label(self, ctx: WarmContext, kind: str, learning: list[str]) -> dict[str, Any]:
        from ..request import ServeOptions, finish_stages, serve
        from ..types import Decision
        from .labels import Covariate, Label
        from .learner import accepts, learner_for
        from .runtime import (
            _over_max_active,
            candidate_options,
            choose,
            judge_and_decoder,
            label_counterfactual,
            text_encode_fn,
        )
        from .warmup import warm_learner, warmup_namespace

        store = _open_store(ctx.handle)
        learner = learner_for(ctx.directory, ctx.settings)
        wl = warm_learner(learner)
        wns = warmup_namespace(ctx.namespace)
        encode = text_encode_fn(ctx.text_encoder)
        if encode is None:
            return {"result": "no label", "why": "no text encoder to encode an edited prompt with", "kind": kind}
        # an i.i.d. draw (``draw_edit``): no entry is passed over for having been labelled or counted, no edit for
        # having been served before — the warm-up learner counts each label (``warmup``, "The unit")
        drawn = self.draw(ctx, store, kind)
        if isinstance(drawn, str):
            return {"result": "no label", "why": drawn, "kind": kind}
        edit, how_drawn = drawn
        key = _edit_key(wns, edit.prompt, edit.seed)
        self.doing = f"labelling {kind}: {edit.prompt[:120]!r} (from {edit.source[:80]!r})"
        calls = [0]

        def step(_: int) -> None:
            # Carnator's own model-call wrapper (comfy_patch, PREDICT_NOISE) calls this before every model call
            calls[0] += 1
            self.stats.model_calls += 1
            if self.should_stop():
                raise Preempted("model call")

        model = ctx.model
        if self.should_stop():
            raise Preempted("before the first model call")
        t0 = time.perf_counter()
        positive = encode(edit.prompt)
        spec = replace(ctx.spec, prompt=edit.prompt, seed=int(edit.seed))
        opts = ServeOptions(method="never", write=False, exact=False, top_k=int(ctx.top_k), probe=ctx.probe_config,
                            reuse=ctx.reuse_config)
        res = serve(model, ctx.text_encoder, positive, ctx.negative, ctx.latent, spec, store, opts, progress=step)
        options = candidate_options(res.signature, res.candidates, res.probe) if res.candidates is not None else []
        chosen = choose(options, wl.order(wns))
        base = {"kind": kind, "prompt": edit.prompt, "source": edit.source, "how": edit.how,
                "entry": how_drawn["entry"]}
        if chosen is None:
            return {**base, "result": "no label", "why": "no candidate recalled"}
        stratum = str(chosen["stratum"])
        cov = Covariate(key, stratum, str(chosen["entry_id"]),
                        float(chosen["similarity"]), tuple(chosen["vector"]), bool(chosen["missing"]), time.time())
        learner.store.add_covariate(wns, cov)
        warm = wl.state(wns)
        st = warm.get(stratum)
        if stratum not in learning or cov.missing or (st is not None and st.fit is not None
                                                      and not accepts(st.fit.thresholds, cov.vector, cov.missing)):
            learner.store.charge(wns, label_s=time.perf_counter() - t0)
            return {**base, "result": "no label", "stratum": stratum,
                    "why": f"the rule-to-be's candidate is a {stratum} change outside what is still learned"}
        cand = chosen["candidate"]
        cached = store.load(cand.entry_id, count_hit=False).cached_run()
        acc = Decision(accepted=True, candidate=cand, verdicts=(), mode="signature",
                       summary="warm-up: the rule-to-be's reuse of its chosen candidate")
        cfg = replace(ctx.reuse_config, mode="joint")
        if _over_max_active(model, res.probe, res.signature, cached, cfg):
            out, reusable = None, False
        else:
            out, rep, _ = finish_stages(model, positive, ctx.negative, ctx.latent, res.probe, acc, store, cfg,
                                        signature=res.signature, record=False, cached=cached, progress=step)
            reusable = getattr(rep, "decision", "") == "hit"
        judge, decode, why = judge_and_decoder(model, res.probe)
        if judge is None:
            return {**base, "result": "no label", "why": why}
        x = 0
        if reusable:
            lab = label_counterfactual(judge, decode, res.probe, str(cand.prompt), res.latent["samples"], out)
            x = 1 if lab.b else (-1 if lab.c else 0)
        if self.should_stop():  # a prompt came during the judging: nothing is written
            raise Preempted("before writing the label")
        cost = time.perf_counter() - t0
        label = Label(cov.request_key, stratum, str(cand.entry_id), cov.similarity, cov.vector, cov.missing,
                      reusable, x, "shadow", str(judge.name), dict(getattr(judge, "settings", {}) or {}),
                      round(cost, 4), edit.prompt, str(cand.prompt), int(edit.seed), time.time(),
                      draw={**how_drawn, "how": edit.how})
        if learner.store.add_label(wns, label):
            learner.store.charge(wns, label_s=cost, requests=1)
        wl.state(wns)  # record what the new label implies (a fit, a certificate)
        return {**base, "result": "label", "stratum": stratum, "x": x, "reusable": reusable,
                "model_calls": calls[0], "cost_s": round(cost, 3)}


def _edit_key(wns: str, prompt: str, seed: int) -> str:
    """A warm-up request's key: the edit and a nonce (a draw with replacement may repeat an edit; each draw is its
    own request, covariate and label)."""
    nonce = secrets.token_hex(8)
    return "warmup:" + hashlib.sha256(f"{wns}|{prompt}|{int(seed)}|{nonce}".encode("utf-8")).hexdigest()[:40]


def _open_store(handle: Any) -> Any:
    from ..cache.handle import open_store

    return open_store(handle)


__all__ = ["IdleSettings", "IdleWorker", "MAX_DRAWS", "MAX_EDITS", "MODES", "Preempted", "WarmContext", "draw_edit"]
