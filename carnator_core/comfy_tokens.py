"""Word ids of conditioning positions, from a ComfyUI CLIP object (the embedded encoder has its own: ``embedded.text``).

Imports nothing from ComfyUI: a CLIP object is used by duck typing (``clip.tokenize`` and its tokenizer's
vocabulary), so this module stays importable in pure-core tests.

Why not ComfyUI's own word ids: ``SDTokenizer.tokenize_with_weights(text, return_word_ids=True)`` (ComfyUI
0.3.75) numbers *weighted prompt segments* ("a (red ball:1.2) rolls" -> 1, 2, 3), not words: the whole of an
unweighted prompt has word id 1. The id 0 does reliably mark special/padding tokens. So the positions and the
special-token marks come from ComfyUI, and the word of each token comes from aligning the token strings with the
prompt (:func:`.objects.align_word_ids`). The UMT5 (Wan) and T5 (LTXV) tokenizers add no start token, so a
token's index in its batch is its conditioning position.
"""
from __future__ import annotations

from typing import Any, Optional

from .objects import align_word_ids


def _inner_tokenizer(tokenizer: Any, key: str) -> Any:
    """The SDTokenizer that produced output key ``key`` (SD1Tokenizer stores it as ``clip_<key>`` or ``<key>``)."""
    for attr in (f"clip_{key}", key):
        inner = getattr(tokenizer, attr, None)
        if inner is not None and hasattr(inner, "inv_vocab"):
            return inner
    if hasattr(tokenizer, "inv_vocab"):
        return tokenizer
    raise TypeError(
        f"cannot map tokens of CLIP output {key!r} back to text: its tokenizer ({type(tokenizer).__name__}) has no "
        "vocabulary (inv_vocab). Carnator supports ComfyUI's SDTokenizer-based text encoders (umT5 for Wan, T5 for "
        "LTX-Video) and the embedded model; give the object list explicitly for other encoders is not enough — "
        "the probe needs token positions, so use a supported text encoder."
    )


def comfy_word_tokens(clip: Any, prompt: str) -> list[tuple[int, int]]:
    """``(position, word_id)`` for every token of the first CLIP output of ``prompt`` (first key, first batch).

    word_id: 1-based index of the whitespace-separated prompt word the token encodes, 0 for special/padding
    tokens — the contract of :func:`.objects.token_positions`.

    A CLIP-like object may provide ``carnator_word_tokens(prompt)`` itself (the embedded model's glue does);
    it is used as is. Otherwise ``clip.tokenize(prompt, return_word_ids=True)`` and the tokenizer's vocabulary
    are used. Raises TypeError with a clear message for an object that offers neither.
    """
    own = getattr(clip, "carnator_word_tokens", None)
    if callable(own):
        return [(int(p), int(w)) for p, w in own(prompt)]
    tokenize = getattr(clip, "tokenize", None)
    if not callable(tokenize):
        raise TypeError(f"expected a ComfyUI CLIP (with .tokenize), got {type(clip).__name__}: connect the CLIP "
                        "output of a CLIPLoader / checkpoint loader")
    out = tokenize(prompt, return_word_ids=True)
    if not isinstance(out, dict) or not out:
        raise TypeError(f"clip.tokenize returned {type(out).__name__}, expected a non-empty dict of token batches")
    key = next(iter(out))
    batches = out[key]
    if not batches:
        return []
    batch = batches[0]
    inner = _inner_tokenizer(getattr(clip, "tokenizer", clip), key)
    pieces: list[Optional[str]] = []
    for item in batch:
        token, word = item[0], item[2] if len(item) > 2 else 1
        if word == 0 or not isinstance(token, int):
            # Special/padding tokens (word id 0) and textual-inversion embedding vectors belong to no word.
            pieces.append(None)
        else:
            pieces.append(inner.inv_vocab.get(token))
    return list(enumerate(align_word_ids(prompt, pieces)))


__all__ = ["comfy_word_tokens"]
