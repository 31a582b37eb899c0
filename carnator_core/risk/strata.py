"""Strata: what changed in a request against a cached candidate, from the two prompts (and the seeds) alone.

A certificate averaged over kinds of request hides the risky kinds, so the rule is certified per *stratum*, and the
filter refuses a candidate whose stratum did not certify. The stratum must be computable at run time, before any
reuse, from what the runtime has: the target prompt, the candidate's prompt, and whether the seeds are equal.

Contract
--------
``stratum_of(target_prompt, candidate_prompt, *, same_seed) -> str`` returns one of :data:`STRATA`, or
``"exact"`` for an exact repeat (same normalised prompt, same seed), which is answered before the filter and is
never certified ("exact" is not in :data:`STRATA`):

* ``"reseed"``     — the same prompt (after case/whitespace normalisation), another seed;
* ``"rewording"``  — the same objects with the same attributes, said in other words (synonyms, word order,
                     templates), any seed;
* ``"colour"`` / ``"size"`` / ``"position"`` / ``"motion"`` — exactly one of these attribute kinds differs, on
                     one or more objects;
* ``"background"`` — only the scene words differ (the background nouns and their modifiers);
* ``"object"``     — the same number of objects but some object noun changed ("ball" -> "cube"), nothing else;
* ``"count"``      — the number of objects differs, the objects both prompts share keep their attributes and the
                     background is the same;
* ``"mixed"``      — more than one of the above kinds changed.

A different seed with a changed prompt is classified by the prompt change alone (the seed is part of every
stratum's population; the calibration data holds both).

How a prompt is read (pure Python, no ComfyUI, no torch)
--------------------------------------------------------
Objects are those of :func:`carnator_core.objects.extract_objects` (spaCy; the object nouns the signature uses),
compared through :data:`NOUN_SYNONYMS` ("orb" and "sphere" are a "ball"). The prompt is cut into clauses at
``, ; .`` and at "and"/"while"; an attribute word (colour, size, position, motion: the word lists below) belongs to
the object(s) of its clause, or, in a clause without an object, to the prompt as a whole. A colour word directly in
front of a scene noun describes the background ("a pink room"); a colour that is the usual colour of its scene noun
("green grass", "blue sky") says nothing and is dropped. "left"/"right" are a direction of travel after a motion
verb or "to/towards", otherwise a position. The word lists cover the embedded world's vocabulary exactly (a test
pins that) plus common words of real prompts; a word in no list is "other wording".

Objects of the two prompts are matched so that the change is explained most simply (fewest kinds, then fewest
changed words); a matched pair with different nouns is an "object" change.
"""
from __future__ import annotations

import functools
import itertools
import re
from dataclasses import dataclass
from typing import Optional

from ..objects import SCENE_NOUNS, extract_objects

#: The strata a rule is certified on, in the fixed order certificates and reports use. "exact" is not one of them.
STRATA: tuple[str, ...] = ("reseed", "rewording", "colour", "size", "position", "motion", "background", "object",
                           "count", "mixed")
EXACT = "exact"

# --- word lists ---------------------------------------------------------------------------------------------
# Canonical value -> words. The first groups are the embedded world's synonyms (world.COLOUR_WORDS etc.), the
# rest common words of real prompts.
_COLOURS: dict[str, tuple[str, ...]] = {
    "red": ("red", "crimson", "scarlet", "ruby", "maroon"),
    "orange": ("orange", "amber"),
    "yellow": ("yellow", "golden", "gold", "blonde"),
    "green": ("green", "emerald", "lime", "olive"),
    "blue": ("blue", "cobalt", "navy", "azure", "turquoise", "teal", "cyan"),
    "purple": ("purple", "violet", "lavender", "magenta"),
    "white": ("white", "ivory", "snowy"),
    "black": ("black", "ebony"),
    "grey": ("grey", "gray", "silver"),
    "pink": ("pink",),
    "brown": ("brown", "tan", "beige"),
}
_SIZES: dict[str, tuple[str, ...]] = {
    "small": ("small", "little", "tiny", "mini", "miniature"),
    "big": ("big", "large", "huge", "giant", "enormous", "massive"),
}
# Motion words that need no context.
_MOTIONS: dict[str, tuple[str, ...]] = {
    "still": ("still", "motionless", "rests", "stationary", "static", "resting", "sits", "stays", "stands"),
    "up": ("up", "upward", "upwards", "rises", "rising", "climbs", "climbing", "ascends", "ascending"),
    "down": ("down", "downward", "downwards", "falls", "falling", "sinks", "sinking", "descends", "descending",
             "drops"),
    "left": ("leftward", "leftwards"),
    "right": ("rightward", "rightwards"),
    "spin": ("spins", "spinning", "rotates", "rotating", "turns", "turning"),
    "bounce": ("bounces", "bouncing", "jumps", "jumping"),
    "fast": ("fast", "quickly", "rapidly", "speeding"),
    "slow": ("slowly", "slow", "gently"),
    "walk": ("walks", "walking", "runs", "running", "flies", "flying", "swims", "swimming", "dances", "dancing"),
}
# Verbs after which left/right mean a direction of travel; alone they carry no attribute (the world's captions
# say "moves up" as often as "rises"), so they are wording.
MOTION_VERBS: frozenset[str] = frozenset(
    "moves move moving slides slide sliding drifts drift drifting glides glide gliding rolls roll rolling travels "
    "travel travelling traveling goes go going floats float floating heads heading".split())
_TOWARDS = frozenset(("to", "towards", "toward"))
_VERTICAL = {"top": "top", "upper": "top", "bottom": "bottom", "lower": "bottom"}
_HORIZONTAL = {"left": "left", "right": "right"}
_CENTRE = frozenset(("center", "centre", "middle"))
# Scene nouns -> canonical background (the world's BACKGROUND_WORDS first; every objects.SCENE_NOUNS word is a
# background word too, as itself).
_BACKGROUNDS: dict[str, tuple[str, ...]] = {
    "grass": ("grass", "grassy", "lawn", "meadow", "field"),
    "sky": ("sky", "skies", "clouds", "cloud"),
    "sand": ("sand", "sandy", "beach", "desert"),
    "night": ("night", "stars", "nighttime", "star"),
    "wall": ("wall", "concrete"),
    "room": ("room", "bedroom"),
}
# The usual colour of a scene noun: saying it changes nothing ("green grass" is grass).
_USUAL_COLOUR: dict[str, frozenset[str]] = {
    "grass": frozenset(("green",)), "sky": frozenset(("blue",)), "sand": frozenset(("yellow",)),
    "wall": frozenset(("grey",)), "room": frozenset(("pink",)), "night": frozenset(("black",)),
}
# Scene adjectives that name the scene without a noun ("a dark night" is night, "a clear sky" is sky).
_SCENE_FILLERS = frozenset(("dark", "clear", "open"))
#: Object nouns that name the same thing (canonical first). The embedded world's shape synonyms, plus a few
#: everyday ones.
NOUN_SYNONYMS: dict[str, tuple[str, ...]] = {
    "ball": ("ball", "sphere", "orb"),
    "cube": ("cube", "box", "block"),
    "triangle": ("triangle", "wedge"),
    "diamond": ("diamond", "rhombus", "gem"),
    "dog": ("dog", "puppy", "pup", "doggy"),
    "cat": ("cat", "kitten", "kitty"),
    "car": ("car", "automobile"),
    "person": ("person", "human"),
    "man": ("man", "guy"),
    "woman": ("woman", "lady"),
    "child": ("child", "kid"),
}


def _invert(groups: dict[str, tuple[str, ...]]) -> dict[str, str]:
    return {w: canon for canon, words in groups.items() for w in words}


COLOUR_OF = _invert(_COLOURS)
SIZE_OF = _invert(_SIZES)
MOTION_OF = _invert(_MOTIONS)
# Words that say "this is a scene" without saying which: wording, not a background.
_GENERIC_SCENE = frozenset("background backdrop scene scenery setting landscape environment surroundings surrounding "
                           "world".split())
BACKGROUND_OF = {**{w: w for w in SCENE_NOUNS - _GENERIC_SCENE}, **_invert(_BACKGROUNDS)}
NOUN_OF = _invert(NOUN_SYNONYMS)
# Words that break a prompt into clauses (attributes bind to the object of their clause).
_CLAUSE_WORDS = frozenset(("and", "while", "as", "whereas"))
_PUNCT = frozenset((",", ";", ".", "!", "?"))


def canonical_noun(word: str) -> str:
    """The canonical name of an object noun ("orb" -> "ball"); other nouns as given, lower-case."""
    w = word.lower()
    return NOUN_OF.get(w, w)


@dataclass(frozen=True)
class ReadPrompt:
    """A prompt as the strata read it.

    objects:    per object in prompt order: (canonical noun, attributes), attributes being a frozenset of
                "kind:value" items for kind in colour/size/position/motion.
    background: canonical background values and their non-usual colour modifiers ("room", "colour:red@room").
    loose:      attribute items said in a clause without an object (they apply to the whole prompt).
    """

    objects: tuple[tuple[str, frozenset[str]], ...]
    background: frozenset[str]
    loose: frozenset[str]


def normalise(prompt: str) -> str:
    """Case and whitespace folded: two prompts equal under this are the same request text."""
    return " ".join(prompt.lower().split())


def _words(prompt: str) -> list[tuple[str, int]]:
    """Lower-case words and clause punctuation, each with the 1-based whitespace word id holding it."""
    out: list[tuple[str, int]] = []
    for wid, raw in enumerate(prompt.split(), start=1):
        for item in re.findall(r"[a-z]+|[,;.!?]", raw.lower().replace("-", " ")):
            out.append((item, wid))
    return out


def _attribute(items: list[tuple[str, int]], i: int) -> Optional[str]:
    """The "kind:value" attribute the i-th word names (context decides left/right and scene colours), or None."""
    w = items[i][0]
    prev = [x for x, _ in items[max(0, i - 2):i]]
    nxt = items[i + 1][0] if i + 1 < len(items) else ""
    if w in COLOUR_OF:
        if nxt in BACKGROUND_OF:
            return None  # a scene modifier; read with the background
        return "colour:" + COLOUR_OF[w]
    if w in SIZE_OF:
        return "size:" + SIZE_OF[w]
    if w in _HORIZONTAL:
        moving = any(p in _TOWARDS for p in prev) or (bool(prev) and prev[-1] in MOTION_VERBS)
        return ("motion:" if moving else "pos:") + _HORIZONTAL[w]
    if w in _VERTICAL:
        # "moves up" is motion ("up" is in the motion list); "top"/"bottom" are positions.
        return "pos:" + _VERTICAL[w]
    if w in _CENTRE:
        return "pos:center"
    if w in MOTION_OF:
        return "motion:" + MOTION_OF[w]
    return None


def _background(items: list[tuple[str, int]]) -> frozenset[str]:
    out: set[str] = set()
    for i, (w, _) in enumerate(items):
        if w not in BACKGROUND_OF:
            continue
        canon = BACKGROUND_OF[w]
        out.add(canon)
        j = i - 1
        while j >= 0 and (items[j][0] in COLOUR_OF or items[j][0] in _SCENE_FILLERS):
            colour = COLOUR_OF.get(items[j][0])
            if colour is not None and colour not in _USUAL_COLOUR.get(canon, ()):
                out.add(f"colour:{colour}@{canon}")
            j -= 1
    return frozenset(out)


@functools.lru_cache(maxsize=4096)
def read_prompt(prompt: str) -> ReadPrompt:
    """Objects with their attributes, background and loose attributes of ``prompt`` (see module docstring).
    Deterministic; cached (prompts repeat across candidates). Raises
    :class:`carnator_core.objects.SpacyUnavailableError` when spaCy is not installed."""
    phrases, _ = extract_objects(prompt)
    items = _words(prompt)
    # Clause index per item.
    clause_of: list[int] = []
    c = 0
    for w, _ in items:
        if w in _PUNCT or w in _CLAUSE_WORDS:
            c += 1
        clause_of.append(c)
    # The clause of each object: that of its head word (last word id of the phrase).
    obj_clause: list[int] = []
    for ph in phrases:
        head_id = ph.word_ids[-1]
        at = [k for k, (w, wid) in enumerate(items) if wid == head_id and w not in _PUNCT]
        obj_clause.append(clause_of[at[-1]] if at else -1)
    attrs: list[set[str]] = [set() for _ in phrases]
    loose: set[str] = set()
    # Colour/size words inside a phrase belong to that object even when its clause holds two objects.
    word_owner: dict[int, int] = {}
    for k, ph in enumerate(phrases):
        for wid in ph.word_ids:
            word_owner.setdefault(wid, k)
    for i, (w, wid) in enumerate(items):
        a = _attribute(items, i)
        if a is None:
            continue
        owners = [word_owner[wid]] if wid in word_owner and a.split(":")[0] in ("colour", "size") else \
            [k for k, cl in enumerate(obj_clause) if cl == clause_of[i]]
        if not owners:
            loose.add(a)
        for k in owners:
            attrs[k].add(a)
    objects = tuple((canonical_noun(ph.head), frozenset(attrs[k])) for k, ph in enumerate(phrases))
    return ReadPrompt(objects, _background(items), frozenset(loose))


_KIND_OF_PREFIX = {"colour": "colour", "size": "size", "pos": "position", "motion": "motion"}
#: Up to this many objects per prompt the object matching is exhaustive; beyond, greedy by noun.
EXHAUSTIVE_OBJECTS = 6


def _pair_kinds(x: tuple[str, frozenset[str]], y: tuple[str, frozenset[str]]) -> tuple[set[str], int]:
    kinds = {_KIND_OF_PREFIX[item.split(":", 1)[0]] for item in x[1] ^ y[1]}
    if x[0] != y[0]:
        kinds.add("object")
    return kinds, len(x[1] ^ y[1]) + (x[0] != y[0])


def _match(a: tuple[tuple[str, frozenset[str]], ...], b: tuple[tuple[str, frozenset[str]], ...]
           ) -> list[tuple[int, int]]:
    """Pairs (i, j) of objects of a and b (min(len(a), len(b)) of them) that explain the change most simply:
    fewest kinds of change, then fewest changed items, then prompt order (exhaustive up to
    :data:`EXHAUSTIVE_OBJECTS` objects; beyond, equal nouns first in prompt order, then the rest in order)."""
    if max(len(a), len(b)) <= EXHAUSTIVE_OBJECTS:
        swap = len(a) > len(b)
        small, large = (b, a) if swap else (a, b)
        best: Optional[tuple[tuple[int, int], list[tuple[int, int]]]] = None
        for perm in itertools.permutations(range(len(large)), len(small)):
            kinds: set[str] = set()
            cost = 0
            for i, j in enumerate(perm):
                k, c = _pair_kinds(small[i], large[j])
                kinds |= k
                cost += c
            if best is None or (len(kinds), cost) < best[0]:
                best = ((len(kinds), cost), [(j, i) if swap else (i, j) for i, j in enumerate(perm)])
        return best[1] if best else []
    free_b = list(range(len(b)))
    pairs: list[tuple[int, int]] = []
    rest_a: list[int] = []
    for i, (noun, _) in enumerate(a):
        j = next((j for j in free_b if b[j][0] == noun), None)
        if j is None:
            rest_a.append(i)
        else:
            free_b.remove(j)
            pairs.append((i, j))
    return pairs + list(zip(rest_a, free_b))




def changed_kinds(target_prompt: str, candidate_prompt: str) -> frozenset[str]:
    """The kinds of change between two prompts: a subset of {"colour", "size", "position", "motion",
    "background", "object", "count"} (empty = the same content; see module docstring)."""
    a, b = read_prompt(target_prompt), read_prompt(candidate_prompt)
    kinds: set[str] = set()
    if len(a.objects) != len(b.objects):
        kinds.add("count")
    for i, j in _match(a.objects, b.objects):
        kinds |= _pair_kinds(a.objects[i], b.objects[j])[0]
    for item in a.loose ^ b.loose:
        kinds.add(_KIND_OF_PREFIX[item.split(":", 1)[0]])
    if a.background != b.background:
        kinds.add("background")
    return frozenset(kinds)


def stratum_of(target_prompt: str, candidate_prompt: str, *, same_seed: bool) -> str:
    """The stratum of a (request, candidate) pair: one of :data:`STRATA`, or ``"exact"`` for an exact repeat.

    Contract (shared with the learning and judge layers): pure function of the two prompts and ``same_seed``;
    prompts equal after :func:`normalise` give "exact" (same seed) or "reseed"; otherwise the kinds of change of
    :func:`changed_kinds`: none -> "rewording", one -> its name, several -> "mixed".
    """
    if normalise(target_prompt) == normalise(candidate_prompt):
        return EXACT if same_seed else "reseed"
    kinds = changed_kinds(target_prompt, candidate_prompt)
    if not kinds:
        return "rewording"
    if len(kinds) == 1:
        return next(iter(kinds))
    return "mixed"


__all__ = ["STRATA", "EXACT", "NOUN_SYNONYMS", "MOTION_VERBS", "ReadPrompt", "canonical_noun", "changed_kinds",
           "normalise", "read_prompt", "stratum_of"]
