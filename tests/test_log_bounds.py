"""A client-supplied prompt must not grow the server log with its size: the unknown-word, truncation and
object warnings stay bounded for a 100,000-character prompt (they used to repeat it in full, 100-200 KB a line).
Pure core (spaCy + the embedded model's tokenizer; no ComfyUI)."""
from __future__ import annotations

import warnings

import pytest

from carnator.carnator_core.embedded.text import tokenize_with_words
from carnator.carnator_core.objects import extract_objects, token_positions


@pytest.mark.parametrize("prompt", ["x" * 100000, "a red ball " + "zq" * 50000, " ".join(f"w{i}" for i in range(3000))])
def test_warnings_about_a_huge_prompt_stay_short(prompt):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokenize_with_words(prompt)
        phrases, _ = extract_objects(prompt, None)
        token_positions(prompt, phrases, [])  # no tokens at all: every object is warned about
    sizes = [len(str(w.message)) for w in caught]
    assert sizes, "expected the unknown-word / object warnings"
    assert max(sizes) < 1000, sizes
    assert sum(sizes) < 10000, sizes  # bounded, whatever the prompt's length
