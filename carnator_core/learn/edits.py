"""Warm-up edits: a cached prompt changed in one kind of change at a time, for labelling while the machine is idle.

A warm-up label is the label a served request would get (dense clip vs the rule-to-be's reuse of a cached entry),
made for a request nobody asked for: an *edit* of a prompt the cache already holds, in one kind of change
(``risk.strata``'s strata). A new seed of a cached prompt is exactly the traffic of the ``reseed`` kind; the other
kinds are near that traffic, not equal to it (which is why warm-up labels are a population of their own:
``warmup``).

Contract
--------
``make_edit(prompt, seed, kind, vocabulary=..., salt=0) -> Edit | None`` — an edit of ``prompt`` of kind ``kind``
(one of :data:`KINDS`), or None when this prompt offers none. Every returned edit is *classified*: ``stratum_of(
edit.prompt, prompt, same_seed=edit.seed == seed) == kind`` holds (checked here, on every edit, before it is
returned). Deterministic given (prompt, seed, kind, vocabulary, salt); another ``salt`` gives another edit where the
prompt offers several. ``make_edits`` returns one edit per kind that has one.

How an edit is made (word-level, the prompt's template kept; whitespace between words is folded to one space):

* ``reseed``    — the same prompt, another seed (always exists);
* ``rewording`` — the same words in another order or with another article: the clauses (split at ", ") rotated,
                  or "a"/"an" <-> "the"; every content word is kept (English). In the embedded world also a
                  synonym of the world's lexicon ("ball" -> "sphere");
* ``colour`` / ``size`` — a colour (size) word replaced by one of another value; where the prompt has none, one
                  inserted in front of an object's head noun;
* ``position``  — a position word flipped (left <-> right, top <-> bottom, centre -> a side); where there is none,
                  a position phrase inserted after an object's head noun;
* ``motion``    — a motion word replaced by one of another value of the same form (-s verb, -ing, adverb);
* ``background``— a scene noun replaced by another scene noun;
* ``object``    — an object's head noun replaced by another noun of its group (people, animals, vehicles, ...).

Vocabularies: ``"english"`` (real prompts; the word lists of ``risk.strata``) and ``"embedded"`` (the embedded
world: only words of its lexicon, and an edit must also change the scene ``world.parse_caption`` reads in exactly
the claimed attribute — or not at all for reseed and rewording — and stay a scene the world can render: colours
visible on the background, two objects that do not overlap). spaCy is needed only through ``risk.strata`` (the
objects of a prompt), loaded lazily on the first edit.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

#: The kinds of change an edit can be made of (``risk.strata.STRATA`` less "count" and "mixed").
KINDS: tuple[str, ...] = ("reseed", "rewording", "colour", "size", "position", "motion", "background", "object")
VOCABULARIES: tuple[str, ...] = ("english", "embedded")
#: Edits tried per kind before giving up (each is classified; the first that classifies as its kind is kept).
MAX_TRIES = 24


@dataclass(frozen=True)
class Edit:
    """One warm-up edit: the request ``(prompt, seed)`` made from the cached ``(source, source_seed)``.

    kind: the stratum it is of (``stratum_of(prompt, source, same_seed=seed == source_seed)``).
    how:  what was changed, for people ("replace 'red' -> 'blue'", "insert 'big'", "rotate clauses", "new seed").
    """

    kind: str
    source: str
    source_seed: int
    prompt: str
    seed: int
    how: str

    def to_dict(self) -> dict:
        return {"kind": self.kind, "source": self.source, "source_seed": self.source_seed, "prompt": self.prompt,
                "seed": self.seed, "how": self.how}


# ----------------------------------------------------------------------------------------------- word tables
# Replacement words per kind of change. English: values of risk.strata's lists; embedded: the world's lexicon.
_EN_COLOURS = ("red", "blue", "green", "yellow", "purple", "white", "black", "orange", "pink", "brown")
_EN_SIZES = {"small": ("big", "huge", "large"), "big": ("small", "tiny", "little")}
_EN_POSITION_PHRASES = ("on the left", "on the right", "in the top left corner", "in the bottom right corner",
                        "at the top", "at the bottom")
_EN_BACKGROUNDS = ("forest", "beach", "city", "desert", "ocean", "garden", "park", "room", "field", "street")
_EN_NOUN_GROUPS: tuple[tuple[str, ...], ...] = (
    ("man", "woman", "boy", "girl", "child", "person", "soldier", "astronaut", "robot"),
    ("dog", "cat", "horse", "bird", "fox", "bear", "rabbit", "lion", "tiger", "wolf", "elephant", "owl"),
    ("car", "truck", "bus", "bicycle", "boat", "train", "motorcycle", "airplane", "ship"),
    ("ball", "cube", "box", "bottle", "cup", "book", "chair", "lamp", "clock", "vase"),
    ("tree", "flower", "rose", "mushroom", "cactus"),
    ("house", "castle", "tower", "bridge", "church", "building"),
)
_EN_OTHER_NOUNS = ("cat", "dog", "robot", "car", "ball")
# Motion words by form, from risk.strata's lists (a replacement keeps the form: "rises" -> "falls").
_EN_MOTION_FORMS: dict[str, tuple[str, ...]] = {
    "s": ("rises", "falls", "spins", "bounces", "jumps", "walks", "runs", "flies", "sinks", "climbs", "rests"),
    "ing": ("rising", "falling", "spinning", "bouncing", "jumping", "walking", "running", "flying", "sinking",
            "climbing", "resting"),
    "ly": ("quickly", "slowly", "rapidly", "gently"),
    "dir": ("up", "down", "upward", "downward", "leftward", "rightward"),
}


def _rng(*parts: object) -> np.random.Generator:
    h = hashlib.sha256("|".join(str(p) for p in parts).encode("utf-8")).digest()
    return np.random.default_rng(int.from_bytes(h[:8], "little"))


def _order(items: Sequence, rng: np.random.Generator) -> list:
    return [items[int(i)] for i in rng.permutation(len(items))]


def _match_case(new: str, old: str) -> str:
    if old.isupper() and len(old) > 1:
        return new.upper()
    if old[:1].isupper():
        return new[:1].upper() + new[1:]
    return new


_ALPHA = re.compile(r"[A-Za-z]+")


@dataclass(frozen=True)
class _Word:
    """The k-th alphabetic run of the prompt: whitespace word ``wid`` (0-based), its span inside that word."""

    text: str
    wid: int
    start: int
    end: int

    @property
    def lower(self) -> str:
        return self.text.lower()


def _tokens(prompt: str) -> list[str]:
    return prompt.split()


def _alpha_words(tokens: Sequence[str]) -> list[_Word]:
    return [_Word(m.group(0), wid, m.start(), m.end()) for wid, tok in enumerate(tokens)
            for m in _ALPHA.finditer(tok)]


def _replace(tokens: Sequence[str], w: _Word, new: str) -> str:
    out = list(tokens)
    tok = out[w.wid]
    out[w.wid] = tok[:w.start] + _match_case(new, w.text) + tok[w.end:]
    return " ".join(out)


def _fix_article(tokens: list[str], wid: int) -> None:
    """"a"/"an" before whitespace word ``wid`` made to agree with it."""
    if wid <= 0 or tokens[wid - 1].lower() not in ("a", "an"):
        return
    vowel = tokens[wid][:1].lower() in "aeiou"
    art = "an" if vowel else "a"
    tokens[wid - 1] = _match_case(art, tokens[wid - 1])


def _insert_before(tokens: Sequence[str], wid: int, word: str) -> str:
    out = list(tokens)
    lead = re.match(r"^[^A-Za-z0-9]*", out[wid]).group(0)  # "(red" -> "(" stays in front
    out[wid] = out[wid][len(lead):]
    out.insert(wid, lead + word)
    _fix_article(out, wid)
    return " ".join(out)


def _insert_after(tokens: Sequence[str], wid: int, phrase: str) -> str:
    out = list(tokens)
    tok = out[wid]
    trail = re.search(r"[^A-Za-z0-9]*$", tok).group(0)  # "dog," -> "dog in the top left corner,"
    out[wid] = tok[:len(tok) - len(trail)] + " " + phrase + trail
    return " ".join(out)


def _new_seed(seed: int, salt: int) -> int:
    h = hashlib.sha256(f"reseed|{int(seed)}|{int(salt)}".encode()).digest()
    new = int.from_bytes(h[:4], "little")
    return new if new != int(seed) else (new + 1) % (1 << 32)


# ----------------------------------------------------------------------------------------------- candidates
def _objects(prompt: str) -> list:
    from ..objects import extract_objects

    return extract_objects(prompt)[0]


def _head_wid(tokens: Sequence[str], phrase) -> int:
    return int(phrase.word_ids[-1]) - 1


def _colour_candidates(prompt: str, vocab: str, rng: np.random.Generator) -> Iterator[tuple[str, str]]:
    from ..risk.strata import COLOUR_OF

    tokens = _tokens(prompt)
    palette = _world_words("colour") if vocab == "embedded" else _EN_COLOURS
    for w in _order([w for w in _alpha_words(tokens) if w.lower in COLOUR_OF], rng):
        for new in _order([c for c in palette if COLOUR_OF.get(c) != COLOUR_OF[w.lower]], rng):
            yield _replace(tokens, w, new), f"replace {w.lower!r} -> {new!r}"
    if vocab == "embedded":
        return
    for ph in _order(_objects(prompt), rng):
        first = int(ph.word_ids[0]) - 1
        for new in _order(list(_EN_COLOURS), rng)[:3]:
            yield _insert_before(tokens, first, new), f"insert {new!r} before {ph.head!r}"


def _size_candidates(prompt: str, vocab: str, rng: np.random.Generator) -> Iterator[tuple[str, str]]:
    from ..risk.strata import SIZE_OF

    tokens = _tokens(prompt)
    for w in _order([w for w in _alpha_words(tokens) if w.lower in SIZE_OF], rng):
        other = "big" if SIZE_OF[w.lower] == "small" else "small"
        options = _world_words("size", other) if vocab == "embedded" else _EN_SIZES[SIZE_OF[w.lower]]
        for new in _order(list(options), rng):
            yield _replace(tokens, w, new), f"replace {w.lower!r} -> {new!r}"
    if vocab == "embedded":
        return
    for ph in _order(_objects(prompt), rng):
        first = int(ph.word_ids[0]) - 1
        for new in _order(["small", "big", "tiny", "huge"], rng)[:2]:
            yield _insert_before(tokens, first, new), f"insert {new!r} before {ph.head!r}"


_FLIP = {"left": "right", "right": "left", "top": "bottom", "bottom": "top", "upper": "lower", "lower": "upper"}


def _position_candidates(prompt: str, vocab: str, rng: np.random.Generator) -> Iterator[tuple[str, str]]:
    tokens = _tokens(prompt)
    words = _alpha_words(tokens)
    for w in _order([w for w in words if w.lower in _FLIP or w.lower in ("center", "centre", "middle")], rng):
        if w.lower in _FLIP:
            yield _replace(tokens, w, _FLIP[w.lower]), f"replace {w.lower!r} -> {_FLIP[w.lower]!r}"
        else:
            for new in _order(["top left", "bottom right", "top right", "bottom left"] if vocab == "embedded"
                              else ["left", "right", "top"], rng):
                yield _replace(tokens, w, new), f"replace {w.lower!r} -> {new!r}"
    if vocab == "embedded":
        return
    for ph in _order(_objects(prompt), rng):
        if "'" in tokens[_head_wid(tokens, ph)]:  # "Amelia's actions": not after a possessive
            continue
        for phrase in _order(list(_EN_POSITION_PHRASES), rng)[:2]:
            yield _insert_after(tokens, _head_wid(tokens, ph), phrase), f"insert {phrase!r} after {ph.head!r}"


def _motion_form(word: str) -> str:
    if word.endswith("ing"):
        return "ing"
    if word.endswith("ly") or word in ("fast", "slow"):
        return "ly"
    if word in ("up", "down", "upward", "downward", "upwards", "downwards", "leftward", "rightward", "leftwards",
                "rightwards"):
        return "dir"
    return "s"


def _motion_candidates(prompt: str, vocab: str, rng: np.random.Generator) -> Iterator[tuple[str, str]]:
    from ..risk.strata import MOTION_OF

    tokens = _tokens(prompt)
    words = _alpha_words(tokens)
    if vocab == "embedded":
        # the world's motions: a direction word flipped, or "rises" <-> "falls"/"sinks"
        flips = {"up": "down", "down": "up", "upward": "downward", "downward": "upward", "upwards": "downwards",
                 "downwards": "upwards", "rises": "falls", "falls": "rises", "sinks": "rises", "climbs": "falls",
                 "leftward": "rightward", "rightward": "leftward", "leftwards": "rightwards",
                 "rightwards": "leftwards", "left": "right", "right": "left"}
        for w in _order([w for w in words if w.lower in flips], rng):
            yield _replace(tokens, w, flips[w.lower]), f"replace {w.lower!r} -> {flips[w.lower]!r}"
        return
    for w in _order([w for w in words if w.lower in MOTION_OF], rng):
        form = _EN_MOTION_FORMS[_motion_form(w.lower)]
        for new in _order([m for m in form if MOTION_OF.get(m) != MOTION_OF[w.lower]], rng)[:4]:
            yield _replace(tokens, w, new), f"replace {w.lower!r} -> {new!r}"
    for w in _order([w for w in words if w.lower in ("left", "right")], rng):  # "moves to the left"
        yield _replace(tokens, w, _FLIP[w.lower]), f"replace {w.lower!r} -> {_FLIP[w.lower]!r}"


def _background_candidates(prompt: str, vocab: str, rng: np.random.Generator) -> Iterator[tuple[str, str]]:
    from ..risk.strata import BACKGROUND_OF

    tokens = _tokens(prompt)
    if vocab == "embedded":  # the world's own background phrases ("on a sandy beach" -> "under the stars")
        from ..embedded import world

        phrases = getattr(world, "_BACKGROUND_PHRASES", {})
        text = " ".join(tokens)
        for bg, ours in phrases.items():
            for old in (p for p in ours if p in text):
                for other in _order([b for b in phrases if b != bg], rng)[:4]:
                    new = _order(list(phrases[other]), rng)[0]
                    yield text.replace(old, new, 1), f"replace {old!r} -> {new!r}"
    options = _world_words("background") if vocab == "embedded" else _EN_BACKGROUNDS
    for w in _order([w for w in _alpha_words(tokens) if w.lower in BACKGROUND_OF], rng):
        for new in _order([b for b in options if BACKGROUND_OF.get(b) != BACKGROUND_OF[w.lower]], rng)[:4]:
            yield _replace(tokens, w, new), f"replace {w.lower!r} -> {new!r}"


def _plural(noun: str) -> str:
    if noun.endswith(("s", "x", "ch", "sh")):
        return noun + "es"
    if noun.endswith("y") and noun[-2:-1] not in "aeiou":
        return noun[:-1] + "ies"
    if noun in ("man", "woman"):
        return noun[:-2] + "en"
    if noun == "child":
        return "children"
    if noun == "person":
        return "people"
    return noun + "s"


def _object_candidates(prompt: str, vocab: str, rng: np.random.Generator) -> Iterator[tuple[str, str]]:
    from ..risk.strata import canonical_noun

    tokens = _tokens(prompt)
    words = _alpha_words(tokens)
    for ph in _order(_objects(prompt), rng):
        wid = _head_wid(tokens, ph)
        surf = [w for w in words if w.wid == wid]
        if not surf:
            continue
        w = surf[-1]
        if "-" in tokens[wid] or "'" in tokens[wid]:  # "sci-fi", "Amelia's": not a noun to swap alone
            continue
        if vocab == "embedded":
            options = [ws[0] for ws in _world_shape_words() if canonical_noun(ws[0]) != canonical_noun(ph.head)]
        else:
            group = next((g for g in _EN_NOUN_GROUPS if ph.head in g), _EN_OTHER_NOUNS)
            options = [n for n in group if canonical_noun(n) != canonical_noun(ph.head)]
        plural = w.lower != ph.head and w.lower.rstrip("s") != w.lower and vocab != "embedded"
        for new in _order(options, rng)[:4]:
            new = _plural(new) if plural else new
            text = _replace(tokens, w, new)
            toks = text.split()
            _fix_article(toks, wid)
            yield " ".join(toks), f"replace {w.lower!r} -> {new!r}"


def _rewording_candidates(prompt: str, vocab: str, rng: np.random.Generator) -> Iterator[tuple[str, str]]:
    tokens = _tokens(prompt)
    parts = [p.strip() for p in " ".join(tokens).split(", ")]
    if len(parts) > 1 and all(parts):
        for k in range(1, len(parts)):
            yield ", ".join(parts[k:] + parts[:k]), f"rotate clauses by {k}"
    words = _alpha_words(tokens)
    for w in _order([w for w in words if w.lower in ("a", "an", "the")], rng):
        new = "the" if w.lower in ("a", "an") else "a"
        after = tokens[w.wid + 1].lower() if w.wid + 1 < len(tokens) else ""
        if new == "a" and (not after[:1].isalpha() or after.rstrip(".,;!?").endswith("s")):
            continue  # "the shoes" has no "a shoes"
        toks = _replace(tokens, w, new).split()
        if new == "a" and w.wid + 1 < len(toks):
            _fix_article(toks, w.wid + 1)
        yield " ".join(toks), f"replace {w.lower!r} -> {new!r}"
    if vocab == "embedded":
        from ..embedded import world

        groups = [*world.SHAPE_WORDS.values(), *world.COLOUR_WORDS.values(), *world.SIZE_WORDS.values()]
        syn = {w: g for g in groups for w in g}
        for w in _order([w for w in words if w.lower in syn], rng):
            for new in _order([s for s in syn[w.lower] if s != w.lower], rng):
                toks = _replace(tokens, w, new).split()
                _fix_article(toks, w.wid)
                yield " ".join(toks), f"synonym {w.lower!r} -> {new!r}"


def _world_words(kind: str, value: Optional[str] = None) -> tuple[str, ...]:
    """The embedded world's words of a kind (first synonym of each value, or every synonym of ``value``)."""
    from ..embedded import world

    table = {"colour": world.COLOUR_WORDS, "size": world.SIZE_WORDS,
             "background": {k: tuple(w for w in v if w not in ("grey", "gray", "pink")) for k, v in
                            world.BACKGROUND_WORDS.items()}}[kind]
    if value is not None:
        return tuple(table[value])
    return tuple(ws[0] for ws in table.values())


def _world_shape_words() -> tuple[tuple[str, ...], ...]:
    from ..embedded import world

    return tuple(world.SHAPE_WORDS.values())


_CANDIDATES: dict[str, Callable[[str, str, np.random.Generator], Iterator[tuple[str, str]]]] = {
    "rewording": _rewording_candidates, "colour": _colour_candidates, "size": _size_candidates,
    "position": _position_candidates, "motion": _motion_candidates, "background": _background_candidates,
    "object": _object_candidates,
}


# ----------------------------------------------------------------------------------------------- the world's check
def _scene_ok(scene) -> bool:
    """A complete scene the embedded world can render: every attribute named, colours visible on the
    background, two objects apart in every frame."""
    from ..embedded import world

    if scene.background is None or not scene.objects or len(scene.objects) > 2:
        return False
    for o in scene.objects:
        if None in (o.shape, o.colour, o.size, o.position, o.motion) or not world.compatible(o.colour,
                                                                                             scene.background):
            return False
    if len(scene.objects) == 2:
        a, b = (world.object_alpha(o) > 0 for o in scene.objects)
        grown = b.copy()
        grown[:, 1:, :] |= b[:, :-1, :]
        grown[:, :-1, :] |= b[:, 1:, :]
        grown[:, :, 1:] |= b[:, :, :-1]
        grown[:, :, :-1] |= b[:, :, 1:]
        if bool((a & grown).any()):
            return False
    return True


_SCENE_FIELD = {"colour": "colour", "size": "size", "position": "position", "motion": "motion", "object": "shape"}


def _world_change(old, new) -> Optional[str]:
    """The one attribute in which two parsed scenes differ ("" for none), or None for several / another count."""
    if len(old.objects) != len(new.objects):
        return None
    changed = {"background"} if old.background != new.background else set()
    for a, b in zip(old.objects, new.objects):
        for kind, field in _SCENE_FIELD.items():
            if getattr(a, field) != getattr(b, field):
                changed.add(kind)
    if len(changed) > 1:
        return None
    return next(iter(changed), "")


def world_checks(source: str, prompt: str, kind: str) -> bool:
    """Whether ``prompt`` is, for the embedded world, an edit of ``source`` of ``kind``: both captions name a
    complete, renderable scene, and the scenes differ in exactly that attribute (reseed and rewording: not at
    all)."""
    from ..embedded import world

    old, new = world.parse_caption(source), world.parse_caption(prompt)
    if not (_scene_ok(old) and _scene_ok(new)):
        return False
    want = "" if kind in ("reseed", "rewording") else kind
    return _world_change(old, new) == want


# ----------------------------------------------------------------------------------------------- the contract
def make_edit(prompt: str, seed: int, kind: str, *, vocabulary: str = "english", salt: int = 0) -> Optional[Edit]:
    """An edit of ``(prompt, seed)`` of kind ``kind``, classified by ``risk.strata.stratum_of`` as that kind (and,
    in the embedded world, changing its scene in exactly that attribute), or None (module docstring).
    Raises ValueError for an unknown kind or vocabulary."""
    from ..risk.strata import normalise, stratum_of

    if kind not in KINDS:
        raise ValueError(f"unknown kind of edit {kind!r}; expected one of {KINDS}")
    if vocabulary not in VOCABULARIES:
        raise ValueError(f"unknown vocabulary {vocabulary!r}; expected one of {VOCABULARIES}")
    prompt = str(prompt)
    if not prompt.strip():
        return None
    if kind == "reseed":
        return Edit(kind, prompt, int(seed), prompt, _new_seed(int(seed), salt), "new seed")
    if vocabulary == "embedded" and not _scene_ok(_parse_world(prompt)):
        return None
    rng = _rng(prompt, kind, vocabulary, salt)
    tried = 0
    seen: set[str] = set()
    # every candidate is made; ``salt`` picks which of the valid ones (in the rng's order) is returned
    skip = int(salt)
    for text, how in _CANDIDATES[kind](prompt, vocabulary, rng):
        if tried >= MAX_TRIES:
            break
        if text in seen or normalise(text) == normalise(prompt):
            continue
        seen.add(text)
        tried += 1
        if stratum_of(text, prompt, same_seed=True) != kind:
            continue
        if vocabulary == "embedded" and not world_checks(prompt, text, kind):
            continue
        if skip > 0:
            skip -= 1
            continue
        return Edit(kind, prompt, int(seed), text, int(seed), how)
    return None


def _parse_world(prompt: str):
    from ..embedded import world

    return world.parse_caption(prompt)


def make_edits(prompt: str, seed: int, *, kinds: Sequence[str] = KINDS, vocabulary: str = "english",
               salt: int = 0) -> dict[str, Edit]:
    """One edit per kind of ``kinds`` that ``prompt`` offers (``make_edit``), by kind."""
    out = {}
    for kind in kinds:
        e = make_edit(prompt, seed, kind, vocabulary=vocabulary, salt=salt)
        if e is not None:
            out[kind] = e
    return out


__all__ = ["Edit", "KINDS", "VOCABULARIES", "make_edit", "make_edits", "world_checks"]
