"""The embedded world's text encoder: prompt -> conditioning [TEXT_LEN, TEXT_DIM] plus word -> token positions.

It is a fixed, deterministic, weight-free encoder built on the world's lexicon (``world.analyse``):
each known word becomes one token whose vector is

    concept vector (shared by synonyms, e.g. red/crimson/scarlet)
  + 0.3 x word vector (keeps synonyms distinct tokens)
  + slot vector (which object of the prompt the word describes: object 0, object 1, or global)

Each vector is a fixed pseudo-random Gaussian vector seeded by the sha256 of its name, so the encoder
needs no weights file and gives the same output on every machine. The slot vector does the binding work a
contextual language model would do (which colour belongs to which shape); the denoiser's own text
projection (WanModel.text_embedding) stays at its seeded random initialisation (``train.py
--freeze-text-embedding``, since the v2 weights: trained, its GELU died for every word that was not useful
early, which silenced size, position and motion words; see docs/MODEL_CARD.md). Tokens are packed in word
order and zero-padded to ``TEXT_LEN`` (the empty prompt is all zeros: the unconditional input used for
classifier-free guidance).

Version v3 adds the object's *phrase context* to each of its word tokens: ``+ text_context x`` the normalised
sum of the concept vectors of every attribute word of that object (shape, colour, size, position, motion),
as a contextual encoder (umT5) mixes a phrase into each of its tokens. Why: with v2's bag of words, binding
"red" to "top left" of the same object takes two cross-attention hops (position word -> slot -> colour word),
and v2 got every attribute of a two-object clip right in 2 % of them; with the context a frame token that
attends to any word of an object reads all of that object's attributes in one hop. Token positions, word
spans and the empty prompt are unchanged, so the probe's word -> token contract holds for every version.

Unknown words are ignored with a ``UserWarning`` (they get no token); words past ``TEXT_LEN`` tokens are
dropped with a warning. Torch/numpy only; no ComfyUI.
"""
from __future__ import annotations

import functools
import hashlib
import warnings
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .config import TEXT_DIM, TEXT_LEN, version as model_version
from .world import COLOUR_ADJECTIVES, OBJECT_NOUNS, WordInfo, analyse, is_word

WORD_SCALE = 0.3
SLOT_SCALE = 1.0


@functools.lru_cache(maxsize=4096)
def _vector(name: str) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    v = np.random.default_rng(seed).standard_normal(TEXT_DIM).astype(np.float32)
    v.setflags(write=False)
    return v


# Direction words as an axis plus a signed direction (``motion_axes`` > 0): "left" = axis:h - a * sign:h,
# "right" = axis:h + a * sign:h (normalised to a concept vector's length), so the two share their axis and
# differ by a vector of opposite sign, as antonyms do in a learned text encoder. With independent random
# concepts a warm-started v3 learned the axis of a motion but never its sign
# (docs/history/MODEL_CARD_HISTORY.md, "Stage 4").
_DIRECTIONS = {"left": ("h", -1.0), "right": ("h", 1.0), "up": ("v", -1.0), "down": ("v", 1.0)}


def _concept_vector(concept: str, motion_axes: float = 0.0) -> np.ndarray:
    kind, _, value = concept.partition(":")
    if motion_axes and kind == "motion" and value in _DIRECTIONS:
        axis, sign = _DIRECTIONS[value]
        v = _vector("axis:" + axis) + sign * motion_axes * _vector("sign:" + axis)
        return (v / np.sqrt(1.0 + motion_axes ** 2)).astype(np.float32)
    return _vector("concept:" + concept)


def _token_vector(info: WordInfo, motion_axes: float = 0.0) -> np.ndarray:
    slot_name = "slot:global" if info.slot is None else f"slot:{info.slot}"
    return _concept_vector(str(info.concept), motion_axes) + WORD_SCALE * _vector("word:" + info.word) \
        + SLOT_SCALE * _vector(slot_name)


@dataclass(frozen=True)
class WordSpan:
    """One word of the prompt (in order, punctuation excluded) and the conditioning token positions that
    encode it (empty for an unknown word or one truncated away). ``concept``/``slot`` as in world.WordInfo."""

    index: int
    word: str
    tokens: tuple[int, ...]
    concept: Optional[str]
    slot: Optional[int]


@dataclass(frozen=True)
class Encoded:
    """Conditioning of one prompt: ``cond`` float32 [TEXT_LEN, TEXT_DIM], ``n_tokens`` used, word spans."""

    cond: np.ndarray
    n_tokens: int
    words: tuple[WordSpan, ...]

    def object_tokens(self, slot: int = 0, kinds: tuple[str, ...] = ("shape", "colour")) -> list[int]:
        """Token positions of object ``slot``'s words of the given concept kinds (default: shape + colour)."""
        return [t for w in self.words if w.slot == slot and w.concept and w.concept.split(":")[0] in kinds
                for t in w.tokens]


def _few(words: list[str], n: int = 8, width: int = 40) -> str:
    """Words for a log line, bounded: a client-supplied prompt must not grow the server log with its size."""
    shown = [w if len(w) <= width else w[:width] + f"...({len(w)} chars)" for w in words[:n]]
    return str(shown) + (f" and {len(words) - n} more" if len(words) > n else "")


def tokenize_with_words(prompt: str, *, warn: bool = True) -> tuple[list[str], list[WordSpan]]:
    """(token words in conditioning order, one WordSpan per prompt word). Unknown words are warned about
    (``UserWarning``) and get no token."""
    infos = [i for i in analyse(prompt) if is_word(i)]
    tokens: list[str] = []
    spans: list[WordSpan] = []
    unknown: list[str] = []
    truncated: list[str] = []
    for idx, info in enumerate(infos):
        if info.concept is None:
            unknown.append(info.word)
            spans.append(WordSpan(idx, info.word, (), None, None))
        elif len(tokens) >= TEXT_LEN:
            truncated.append(info.word)
            spans.append(WordSpan(idx, info.word, (), info.concept, info.slot))
        else:
            spans.append(WordSpan(idx, info.word, (len(tokens),), info.concept, info.slot))
            tokens.append(info.word)
    if warn and unknown:
        warnings.warn(f"carnator embedded text encoder: ignoring unknown word(s) {_few(sorted(set(unknown)))}; "
                      "the embedded model only knows its world's vocabulary (see docs/MODEL_CARD.md)",
                      UserWarning, stacklevel=2)
    if warn and truncated:
        warnings.warn(f"carnator embedded text encoder: prompt longer than {TEXT_LEN} known words; "
                      f"dropped {_few(truncated)}", UserWarning, stacklevel=2)
    return tokens, spans


_CONTEXT_KINDS = ("shape", "colour", "size", "pos", "motion")


def _contexts(infos: list[WordInfo], motion_axes: float = 0.0) -> dict[int, np.ndarray]:
    """Per object slot: the normalised sum of its attribute words' concept vectors (the phrase context)."""
    sums: dict[int, list[np.ndarray]] = {}
    for info in infos:
        if info.slot is not None and info.concept and info.concept.split(":")[0] in _CONTEXT_KINDS:
            sums.setdefault(info.slot, []).append(_concept_vector(info.concept, motion_axes))
    return {k: np.sum(v, axis=0) / np.sqrt(len(v)) for k, v in sums.items()}


def encode(prompt: str, *, warn: bool = True, version: Optional[str] = None, motion_axes: float = 0.0) -> Encoded:
    """Encode a prompt for a model version (default: the default version); see the module docstring.
    ``motion_axes`` > 0 encodes direction words as axis + signed direction (``_concept_vector``; a property of
    a weights file, ``train.Recipe.motion_axes``). Deterministic."""
    context_scale = model_version(version).text_context
    infos = [i for i in analyse(prompt) if is_word(i)]
    _, spans = tokenize_with_words(prompt, warn=warn)
    contexts = _contexts(infos, motion_axes) if context_scale else {}
    cond = np.zeros((TEXT_LEN, TEXT_DIM), dtype=np.float32)
    n = 0
    for span, info in zip(spans, infos):
        if span.tokens:
            vec = _token_vector(info, motion_axes)
            if info.slot in contexts:
                vec = vec + context_scale * contexts[info.slot]
            cond[span.tokens[0]] = vec
            n = span.tokens[0] + 1
    return Encoded(cond, n, tuple(spans))


def word_tokens(prompt: str) -> list[tuple[int, int]]:
    """``(conditioning position, 1-based whitespace word id)`` per token: the probe's text-encoder contract
    (``carnator_word_tokens``, see docs/ARCHITECTURE.md). One token per known word; unknown words get none;
    positions past the used tokens are zero padding and not listed."""
    from ..objects import align_word_ids

    tokens, _ = tokenize_with_words(prompt, warn=False)
    return list(enumerate(align_word_ids(prompt, tokens)))


__all__ = ["encode", "tokenize_with_words", "word_tokens", "Encoded", "WordSpan", "OBJECT_NOUNS",
           "COLOUR_ADJECTIVES"]
