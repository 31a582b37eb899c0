"""The embedded procedural video world: scenes, rendering and natural-English captions.

A scene is 1-2 flat-coloured objects over one of 6 backgrounds; each object has a shape (4), colour (8),
size (2), position (5) and motion (5, including still). ``render`` draws a clip of ``FRAMES`` RGB frames
in [0, 1] with anti-aliased, crisp edges; ``caption`` describes a scene with randomly chosen templates and
synonyms; ``parse_caption`` maps any such English back to the attributes it names (the checker and the
text encoder share this lexicon, so both read captions the same way).

Contract: everything is deterministic given the ``numpy.random.Generator`` passed in; nothing here imports
torch or ComfyUI. Attribute values are canonical lower-case strings (``SHAPES``, ``COLOURS``...).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np

from .config import FRAMES, HEIGHT, WIDTH

# --- canonical attribute values ------------------------------------------------------------------------------
SHAPES = ("ball", "cube", "triangle", "diamond")
COLOURS = ("red", "orange", "yellow", "green", "blue", "purple", "white", "black")
SIZES = ("small", "big")
POSITIONS = ("top left", "top right", "bottom left", "bottom right", "center")
MOTIONS = ("still", "left", "right", "up", "down")
BACKGROUNDS = ("grass", "sky", "sand", "night", "wall", "room")

PALETTE: dict[str, tuple[float, float, float]] = {
    "red": (0.90, 0.10, 0.10),
    "orange": (1.00, 0.55, 0.00),
    "yellow": (1.00, 0.92, 0.10),
    "green": (0.10, 0.78, 0.20),
    "blue": (0.15, 0.30, 0.95),
    "purple": (0.60, 0.20, 0.80),
    "white": (1.00, 1.00, 1.00),
    "black": (0.05, 0.05, 0.05),
}
BACKGROUND_RGB: dict[str, tuple[float, float, float]] = {
    "grass": (0.33, 0.55, 0.24),
    "sky": (0.55, 0.75, 0.95),
    "sand": (0.88, 0.80, 0.58),
    "night": (0.07, 0.08, 0.22),
    "wall": (0.50, 0.50, 0.50),
    "room": (0.95, 0.72, 0.80),
}
# Pixel geometry: object half-extent by size, anchor centre by position, total travel by motion.
HALF_EXTENT = {"small": 4.0, "big": 7.0}
ANCHOR_FRAME = 32.0  # ANCHORS are given in a square frame of this many pixels (v2's) and scale with the frame
ANCHORS: dict[str, tuple[float, float]] = {  # (x, y) of the clip-average centre in the 32 x 32 frame
    "top left": (10.0, 10.0),
    "top right": (22.0, 10.0),
    "bottom left": (10.0, 22.0),
    "bottom right": (22.0, 22.0),
    "center": (16.0, 16.0),
}
TRAVEL = 8.0  # pixels travelled between the first and the last frame by a moving object
MOTION_DIR: dict[str, tuple[float, float]] = {
    "still": (0.0, 0.0),
    "left": (-1.0, 0.0),
    "right": (1.0, 0.0),
    "up": (0.0, -1.0),
    "down": (0.0, 1.0),
}
MIN_CONTRAST = 0.30  # an object colour is never used on a background closer than this (RGB distance)


@dataclass(frozen=True)
class Frame:
    """Clip geometry: frames x height x width pixels. Object sizes and travel are in pixels and do not
    scale; the position anchors scale with the frame (``anchors``), so a larger frame shows the same objects
    covering a smaller share of it. The default frame is the default model version's (``config``)."""

    frames: int = FRAMES
    height: int = HEIGHT
    width: int = WIDTH

    @property
    def anchors(self) -> dict[str, tuple[float, float]]:
        return anchors(self.height, self.width)


DEFAULT_FRAME = Frame()


def anchors(height: int, width: int) -> dict[str, tuple[float, float]]:
    """``ANCHORS`` scaled to a ``width`` x ``height`` frame (the same fractions of the frame; at 32 x 32 px
    exactly ``ANCHORS``)."""
    return {k: (x * width / ANCHOR_FRAME, y * height / ANCHOR_FRAME) for k, (x, y) in ANCHORS.items()}


def compatible(colour: str, background: str) -> bool:
    """Whether ``colour`` is visible enough on ``background`` to appear in this world."""
    a = np.asarray(PALETTE[colour])
    b = np.asarray(BACKGROUND_RGB[background])
    return float(np.linalg.norm(a - b)) >= MIN_CONTRAST


@dataclass(frozen=True)
class ObjectSpec:
    """One object of a scene; every field is a canonical value, or None when a caption does not say."""

    shape: Optional[str]
    colour: Optional[str]
    size: Optional[str]
    position: Optional[str]
    motion: Optional[str]

    def triple(self) -> tuple[Optional[str], Optional[str], Optional[str]]:
        """(shape, colour, position): the combination the held-out split is defined on."""
        return (self.shape, self.colour, self.position)


@dataclass(frozen=True)
class Scene:
    """A structured scene description: 1-2 objects (in caption order) over a background."""

    objects: tuple[ObjectSpec, ...]
    background: Optional[str]


# --- held-out split ---------------------------------------------------------------------------------------
def _held_out_triples() -> frozenset[tuple[str, str, str]]:
    """20 of the 160 (shape, colour, position) combinations that training never shows.

    Chosen once with a fixed seed; every single shape, colour and position value stays in training, only
    these combinations are new at test time. The split is part of the model's definition (do not change it
    without retraining).
    """
    rng = np.random.default_rng(20261129)
    chosen: set[tuple[str, str, str]] = set()
    # A cyclic assignment first so each colour is held out with 2-3 shapes and each position 4 times.
    order = list(rng.permutation(len(COLOURS) * len(SHAPES)))
    for k, idx in enumerate(order[:20]):
        colour = COLOURS[idx % len(COLOURS)]
        shape = SHAPES[idx // len(COLOURS)]
        position = POSITIONS[k % len(POSITIONS)]
        chosen.add((shape, colour, position))
    return frozenset(chosen)


HELD_OUT = _held_out_triples()


def is_held_out(obj: ObjectSpec) -> bool:
    return obj.triple() in HELD_OUT


# --- sampling ---------------------------------------------------------------------------------------------
def sample_object(rng: np.random.Generator, background: str, *, held_out: bool = False,
                  avoid_colours: Iterable[str] = (), avoid_positions: Iterable[str] = ()) -> ObjectSpec:
    """Draw one object visible on ``background``; ``held_out`` selects from (or excludes) the held-out split."""
    avoid_c, avoid_p = set(avoid_colours), set(avoid_positions)
    for _ in range(10000):
        if held_out:
            shape, colour, position = sorted(HELD_OUT)[int(rng.integers(len(HELD_OUT)))]
        else:
            shape = SHAPES[int(rng.integers(len(SHAPES)))]
            colour = COLOURS[int(rng.integers(len(COLOURS)))]
            position = POSITIONS[int(rng.integers(len(POSITIONS)))]
            if (shape, colour, position) in HELD_OUT:
                continue
        if colour in avoid_c or position in avoid_p or not compatible(colour, background):
            continue
        size = SIZES[int(rng.integers(len(SIZES)))]
        motion = MOTIONS[int(rng.integers(len(MOTIONS)))]
        return ObjectSpec(shape, colour, size, position, motion)
    raise RuntimeError("could not sample an object: the constraints exclude every combination")


def sample_scene(rng: np.random.Generator, *, held_out: bool = False, p_two: float = 0.3,
                 n_objects: Optional[int] = None, frame: Frame = DEFAULT_FRAME) -> Scene:
    """Draw a scene. Two-object scenes use distinct colours and positions and never overlap in any frame
    (of ``frame``'s geometry).

    With ``held_out=True`` the first object is a held-out combination (the second, if any, is not).
    """
    for _ in range(1000):
        background = BACKGROUNDS[int(rng.integers(len(BACKGROUNDS)))]
        n = n_objects if n_objects is not None else (2 if rng.random() < p_two else 1)
        first = sample_object(rng, background, held_out=held_out)
        objects = [first]
        if n == 2:
            objects.append(sample_object(rng, background, avoid_colours=[first.colour],
                                         avoid_positions=[first.position]))
        scene = Scene(tuple(objects), background)
        if n == 1 or not _overlaps(scene, frame):
            return scene
    raise RuntimeError("could not sample a non-overlapping scene")


# --- rendering --------------------------------------------------------------------------------------------
def object_centres(obj: ObjectSpec, frame: Frame = DEFAULT_FRAME) -> np.ndarray:
    """[frames, 2] (x, y) centre per frame: the clip-average centre is the position anchor."""
    ax, ay = frame.anchors[obj.position]
    dx, dy = MOTION_DIR[obj.motion]
    s = (np.arange(frame.frames, dtype=np.float32) / (frame.frames - 1) - 0.5) * TRAVEL
    return np.stack([ax + dx * s, ay + dy * s], axis=1)


def object_alpha(obj: ObjectSpec, frame: Frame = DEFAULT_FRAME) -> np.ndarray:
    """[frames, H, W] coverage in [0, 1] of one object (signed distance with a 1-pixel anti-aliased edge)."""
    centres = object_centres(obj, frame)
    ys, xs = np.mgrid[0:frame.height, 0:frame.width].astype(np.float32) + 0.5
    dx = xs[None] - centres[:, 0, None, None]
    dy = ys[None] - centres[:, 1, None, None]
    r = HALF_EXTENT[obj.size]
    if obj.shape == "ball":
        sdf = np.sqrt(dx * dx + dy * dy) - r
    elif obj.shape == "cube":
        sdf = np.maximum(np.abs(dx), np.abs(dy)) - r
    elif obj.shape == "diamond":
        sdf = (np.abs(dx) + np.abs(dy) - r) / np.sqrt(2.0)
    elif obj.shape == "triangle":  # apex up, base down, base half-width r
        sdf = np.maximum(dy - r, (2.0 * np.abs(dx) - (dy + r)) / np.sqrt(5.0))
        sdf = np.maximum(sdf, -r - dy)
    else:
        raise ValueError(f"unknown shape {obj.shape!r}; expected one of {SHAPES}")
    return np.clip(0.5 - sdf, 0.0, 1.0).astype(np.float32)


def background_image(background: str, frame: Frame = DEFAULT_FRAME) -> np.ndarray:
    """[H, W, 3] background: a flat colour with a gentle, fixed vertical gradient (same in every frame)."""
    base = np.asarray(BACKGROUND_RGB[background], dtype=np.float32)
    ramp = (np.arange(frame.height, dtype=np.float32) / (frame.height - 1) - 0.5)[:, None, None]
    img = base[None, None, :] + 0.06 * ramp * np.ones((1, frame.width, 1), np.float32)
    return np.clip(img, 0.0, 1.0)


def render(scene: Scene, frame: Frame = DEFAULT_FRAME) -> tuple[np.ndarray, np.ndarray]:
    """Render a scene: returns (rgb [frames, H, W, 3] float32 in [0, 1], alpha [n_objects, frames, H, W]).

    Objects are painted in caption order (a later object covers an earlier one).
    """
    rgb = np.broadcast_to(background_image(scene.background, frame),
                          (frame.frames, frame.height, frame.width, 3)).copy()
    alphas = []
    for obj in scene.objects:
        a = object_alpha(obj, frame)
        colour = np.asarray(PALETTE[obj.colour], dtype=np.float32)
        rgb = rgb * (1.0 - a[..., None]) + colour * a[..., None]
        alphas.append(a)
    return rgb.astype(np.float32), np.stack(alphas).astype(np.float32)


def _overlaps(scene: Scene, frame: Frame = DEFAULT_FRAME) -> bool:
    if len(scene.objects) < 2:
        return False
    a = object_alpha(scene.objects[0], frame) > 0
    b = object_alpha(scene.objects[1], frame) > 0
    # A one-pixel margin keeps the objects separable by the checker.
    b_grown = b.copy()
    b_grown[:, 1:, :] |= b[:, :-1, :]
    b_grown[:, :-1, :] |= b[:, 1:, :]
    b_grown[:, :, 1:] |= b[:, :, :-1]
    b_grown[:, :, :-1] |= b[:, :, 1:]
    return bool((a & b_grown).any())


# --- lexicon (shared by captions, parse_caption and the text encoder) -------------------------------------------
SHAPE_WORDS = {
    "ball": ("ball", "sphere", "orb"),
    "cube": ("cube", "box", "block"),
    "triangle": ("triangle", "wedge"),
    "diamond": ("diamond", "rhombus", "gem"),
}
COLOUR_WORDS = {
    "red": ("red", "crimson", "scarlet"),
    "orange": ("orange", "amber"),
    "yellow": ("yellow", "golden"),
    "green": ("green", "emerald"),
    "blue": ("blue", "cobalt"),
    "purple": ("purple", "violet"),
    "white": ("white", "ivory"),
    "black": ("black", "ebony"),
}
SIZE_WORDS = {"small": ("small", "little", "tiny"), "big": ("big", "large", "huge")}
BACKGROUND_WORDS = {
    "grass": ("grass", "grassy", "lawn", "meadow"),
    "sky": ("sky", "clouds"),
    "sand": ("sand", "sandy", "beach"),
    "night": ("night", "stars", "nighttime"),
    "wall": ("wall", "grey", "gray", "concrete"),
    "room": ("room", "pink", "bedroom"),
}
# Position words: vertical part, horizontal part, centre.
VERTICAL_WORDS = {"top": "top", "upper": "top", "bottom": "bottom", "lower": "bottom"}
CENTRE_WORDS = ("center", "centre", "middle")
HORIZONTAL_WORDS = {"left": "left", "right": "right"}
# Motion words that need no context, and the verbs after which left/right mean a direction of travel.
MOTION_ONLY_WORDS = {
    "still": "still", "motionless": "still", "rests": "still", "stationary": "still",
    "up": "up", "upward": "up", "upwards": "up", "rises": "up", "climbs": "up",
    "down": "down", "downward": "down", "downwards": "down", "falls": "down", "sinks": "down",
    "leftward": "left", "leftwards": "left", "rightward": "right", "rightwards": "right",
}
MOTION_VERBS = ("moves", "slides", "drifts", "glides", "rolls", "travels", "goes", "floats", "drops")
TOWARDS_WORDS = ("to", "towards", "toward")
FUNCTION_WORDS = ("a", "an", "the", "in", "at", "on", "of", "across", "against", "under", "front", "before",
                  "inside", "corner", "frame", "and", "while", "is", "sits", "stays", "stands", "put",
                  "near", "with", "clear", "open", "dark", "field", "scene", "there") + MOTION_VERBS \
    + TOWARDS_WORDS
CLAUSE_BREAKS = ("and", "while")

_WORD_CONCEPT: dict[str, str] = {}
for _canon, _words in SHAPE_WORDS.items():
    _WORD_CONCEPT.update({w: f"shape:{_canon}" for w in _words})
for _canon, _words in COLOUR_WORDS.items():
    _WORD_CONCEPT.update({w: f"colour:{_canon}" for w in _words})
for _canon, _words in SIZE_WORDS.items():
    _WORD_CONCEPT.update({w: f"size:{_canon}" for w in _words})
for _canon, _words in BACKGROUND_WORDS.items():
    _WORD_CONCEPT.update({w: f"bg:{_canon}" for w in _words})


def canonical_noun(word: str) -> str:
    """The world's canonical name of an object noun ("wedge" -> "triangle", "orb" -> "ball"); other words as
    given (lower-case). The text encoder gives synonyms one concept vector, so a paraphrase names the same
    object: the Early Signature matches objects by this name across requests."""
    w = word.lower()
    c = _WORD_CONCEPT.get(w, "")
    return c.split(":", 1)[1] if c.startswith("shape:") else w


def vocabulary() -> tuple[str, ...]:
    """Every word the world's captions, parser and text encoder know (sorted)."""
    words = set(_WORD_CONCEPT) | set(VERTICAL_WORDS) | set(CENTRE_WORDS) | set(HORIZONTAL_WORDS)
    words |= set(MOTION_ONLY_WORDS) | set(FUNCTION_WORDS)
    return tuple(sorted(words))


OBJECT_NOUNS: tuple[str, ...] = tuple(sorted(w for ws in SHAPE_WORDS.values() for w in ws))
COLOUR_ADJECTIVES: tuple[str, ...] = tuple(sorted(w for ws in COLOUR_WORDS.values() for w in ws))


@dataclass(frozen=True)
class WordInfo:
    """How one word of a prompt is read: its concept (e.g. ``colour:red``, ``pos:left``, ``motion:up``,
    ``func:the``; None for unknown words) and the object slot it belongs to (0, 1, or None = global)."""

    word: str
    concept: Optional[str]
    slot: Optional[int]


def split_words(text: str) -> list[str]:
    """Lower-case words and the clause separators ',' and ';' as their own items; hyphens split words."""
    text = text.lower().replace("-", " ")
    return re.findall(r"[a-z]+|[,;.]", text)


def analyse(text: str) -> list[WordInfo]:
    """Read a prompt word by word: concept per word (context decides whether left/right is a position or a
    direction of travel; a colour word right before a background noun describes the background) and the
    object slot per word (clauses are split at ',', ';', '.', 'and', 'while'; each clause holding a shape
    noun is the next object; background words are always global).

    Punctuation items are returned with concept None and slot None but are not words: callers use
    ``is_word``.
    """
    items = split_words(text)
    infos: list[WordInfo] = []
    concepts: list[Optional[str]] = []
    for i, w in enumerate(items):
        prev = items[max(0, i - 2):i]
        if w in (",", ";", "."):
            concepts.append(None)
        elif w in _WORD_CONCEPT:
            c = _WORD_CONCEPT[w]
            nxt = items[i + 1] if i + 1 < len(items) else ""
            if c.startswith("colour:") and _WORD_CONCEPT.get(nxt, "").startswith("bg:"):
                c = "bgmod:" + c.split(":")[1]
            concepts.append(c)
        elif w in VERTICAL_WORDS:
            concepts.append("pos:" + VERTICAL_WORDS[w])
        elif w in CENTRE_WORDS:
            concepts.append("pos:center")
        elif w in HORIZONTAL_WORDS:
            is_motion = any(p in TOWARDS_WORDS for p in prev) or (prev and prev[-1] in MOTION_VERBS)
            concepts.append(("motion:" if is_motion else "pos:") + HORIZONTAL_WORDS[w])
        elif w in MOTION_ONLY_WORDS:
            concepts.append("motion:" + MOTION_ONLY_WORDS[w])
        elif w in FUNCTION_WORDS:
            concepts.append("func:" + w)
        else:
            concepts.append(None)
    # Clause segmentation and slots.
    clauses: list[list[int]] = [[]]
    for i, w in enumerate(items):
        if w in (",", ";", ".") or w in CLAUSE_BREAKS:
            clauses.append([])
            if w in CLAUSE_BREAKS:
                clauses[-1].append(i)
        else:
            clauses[-1].append(i)
    slot_of = [None] * len(items)
    next_slot = 0
    for clause in clauses:
        if any((concepts[i] or "").startswith("shape:") for i in clause):
            for i in clause:
                slot_of[i] = next_slot
            next_slot += 1
    for i, w in enumerate(items):
        c = concepts[i]
        slot = slot_of[i]
        if c is None or c.startswith("bg") or w in (",", ";", "."):
            slot = None
        infos.append(WordInfo(w, c, slot))
    return infos


def is_word(info: WordInfo) -> bool:
    return info.word not in (",", ";", ".")


def parse_caption(text: str) -> Scene:
    """The scene a caption names (attributes it does not mention are None). Unknown words are ignored."""
    infos = analyse(text)
    slots: dict[int, dict[str, object]] = {}
    background: Optional[str] = None
    for info in infos:
        c = info.concept
        if c is None:
            continue
        kind, _, value = c.partition(":")
        if kind == "bg":
            background = background or value
            continue
        if info.slot is None:
            continue
        d = slots.setdefault(info.slot, {"vert": None, "horiz": None})
        if kind in ("shape", "colour", "size", "motion"):
            d.setdefault(kind, value)
        elif kind == "pos":
            if value in ("top", "bottom"):
                d["vert"] = value
            elif value in ("left", "right"):
                d["horiz"] = value
            else:
                d["center"] = True
    objects = []
    for k in sorted(slots):
        d = slots[k]
        if d.get("center"):
            pos = "center"
        elif d["vert"] and d["horiz"]:
            pos = f"{d['vert']} {d['horiz']}"
        else:
            pos = None
        objects.append(ObjectSpec(d.get("shape"), d.get("colour"), d.get("size"), pos, d.get("motion")))
    return Scene(tuple(objects), background)


# --- captions ---------------------------------------------------------------------------------------------
_POSITION_PHRASES = {
    "top left": ("in the top left", "in the upper left corner", "at the top left", "in the top left corner"),
    "top right": ("in the top right", "in the upper right corner", "at the top right", "in the top right corner"),
    "bottom left": ("in the bottom left", "in the lower left corner", "at the bottom left",
                    "in the bottom left corner"),
    "bottom right": ("in the bottom right", "in the lower right corner", "at the bottom right",
                     "in the bottom right corner"),
    "center": ("in the middle", "in the center", "at the centre", "in the center of the frame"),
}
_MOTION_PHRASES = {
    "still": ("sits still", "stays still", "rests", "stands motionless", "is stationary"),
    "left": ("moves to the left", "slides left", "drifts leftward", "glides towards the left",
             "travels to the left"),
    "right": ("moves to the right", "slides right", "drifts rightward", "glides towards the right",
              "travels to the right"),
    "up": ("moves up", "rises", "floats upward", "drifts up", "climbs up"),
    "down": ("moves down", "falls", "sinks downward", "drops down", "slides down"),
}
_BACKGROUND_PHRASES = {
    "grass": ("on green grass", "on a grassy field", "across a lawn", "in a meadow", "on the grass"),
    "sky": ("against a blue sky", "in the sky", "under a clear sky", "in the clouds"),
    "sand": ("on a sandy beach", "on the sand", "on a beach", "on golden sand"),
    "night": ("at night", "under the stars", "in the night", "on a dark night"),
    "wall": ("in front of a grey wall", "against a gray wall", "before a concrete wall"),
    "room": ("in a pink room", "inside a pink bedroom", "in a pink room scene"),
}


def _object_phrase(obj: ObjectSpec, rng: np.random.Generator) -> str:
    size = _pick(SIZE_WORDS[obj.size], rng)
    colour = _pick(COLOUR_WORDS[obj.colour], rng)
    shape = _pick(SHAPE_WORDS[obj.shape], rng)
    words = f"{colour} {size} {shape}" if rng.random() < 0.15 else f"{size} {colour} {shape}"
    article = "an" if words[0] in "aeiou" else "a"
    return f"{article} {words}"


def _pick(options: Sequence[str], rng: np.random.Generator) -> str:
    return options[int(rng.integers(len(options)))]


def _clause(obj: ObjectSpec, rng: np.random.Generator) -> str:
    thing = _object_phrase(obj, rng)
    pos = _pick(_POSITION_PHRASES[obj.position], rng)
    mot = _pick(_MOTION_PHRASES[obj.motion], rng)
    if obj.motion == "right" and obj.shape == "ball" and rng.random() < 0.5:
        mot = "rolls to the right"
    elif obj.motion == "left" and obj.shape == "ball" and rng.random() < 0.5:
        mot = "rolls to the left"
    if rng.random() < 0.5:
        return f"{thing} {mot} {pos}"
    return f"{thing} {pos} {mot}"


def caption(scene: Scene, rng: np.random.Generator) -> str:
    """A natural-English caption of ``scene`` from randomly chosen templates and synonyms."""
    bg = _pick(_BACKGROUND_PHRASES[scene.background], rng)
    clauses = [_clause(o, rng) for o in scene.objects]
    body = clauses[0]
    if len(clauses) == 2:
        join = _pick((" and ", " while ", "; ", ", and "), rng)
        body = body + join + clauses[1]
    if rng.random() < 0.5:
        return f"{bg}, {body}"
    return f"{body}, {bg}"
