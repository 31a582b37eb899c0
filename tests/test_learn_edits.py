"""Warm-up edits (carnator_core/learn/edits.py): one kind of change at a time, on the embedded world's captions and
on real English prompts, each classified by risk/strata.py as the kind it claims.

Real spaCy (the object parser behind the strata), real prompts: the world's own caption generator and hand-written
English prompts; the VidProM sample (../shared/data/vidprom_4k.jsonl next to the repository) when it is there.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from carnator_core.embedded import world
from carnator_core.learn.edits import KINDS, Edit, make_edit, make_edits, world_checks
from carnator_core.risk.strata import read_prompt, stratum_of

ROOT = Path(__file__).resolve().parents[1]
VIDPROM = ROOT.parent / "shared" / "data" / "vidprom_4k.jsonl"
ARTICLES = {"a", "an", "the"}


def _classified(e: Edit) -> None:
    assert stratum_of(e.prompt, e.source, same_seed=e.seed == e.source_seed) == e.kind, e
    assert (e.seed != e.source_seed) == (e.kind == "reseed"), e
    if e.kind != "reseed":
        assert e.prompt != e.source


def _content_words(text: str) -> list[str]:
    return sorted(w for w in re.findall(r"[a-z]+", text.lower()) if w not in ARTICLES)


def test_world_captions_every_kind_classified_and_changes_the_scene_in_that_attribute() -> None:
    rng = np.random.default_rng(640)
    seen = {k: 0 for k in KINDS}
    for i in range(30):
        cap = world.caption(world.sample_scene(rng), rng)
        for kind, e in make_edits(cap, i, vocabulary="embedded").items():
            _classified(e)
            assert world_checks(cap, e.prompt, kind), e
            old, new = world.parse_caption(cap), world.parse_caption(e.prompt)
            assert (old == new) == (kind in ("reseed", "rewording")), e
            # only the world's words: the embedded text encoder knows every word of the edit
            vocab = set(world.vocabulary())
            assert set(world.split_words(e.prompt)) - {",", ";", "."} <= vocab | set(world.split_words(cap)), e
            seen[kind] += 1
    assert all(n > 0 for n in seen.values()), seen  # every kind is reachable in the world


def test_world_edit_is_refused_for_text_that_is_not_a_world_scene() -> None:
    assert make_edit("a red car drives down a street", 1, "colour", vocabulary="embedded") is None
    # a colour the background would hide is never proposed (white on white is not in the palette's contrast)
    cap = "a small red ball rolls to the right in the top left, on green grass"
    for salt in range(6):
        e = make_edit(cap, 1, "colour", vocabulary="embedded", salt=salt)
        if e is None:
            break
        obj = world.parse_caption(e.prompt).objects[0]
        assert obj.colour != "red" and world.compatible(obj.colour, "grass")


@pytest.mark.parametrize("prompt,kind,pattern", [
    ("a red car drives down a city street at night", "colour", r"^a (?!red)\w+ car drives"),
    ("a tiny puppy plays with a ball in the garden", "size", r"^a (big|huge|large) puppy"),
    ("an old man sits on the left of a bench", "position", r"on the right of a bench"),
    ("a woman walking her dog in the park", "object",
     r"^an? (?!woman)\w+ walking her dog|walking her (?!dog)\w+ in"),
    ("a bird flying slowly over the ocean", "motion", r"bird \w+ slowly|bird flying \w+ over"),
    ("a cat sleeping on a sofa, soft light, cinematic", "rewording", r"cinematic"),
])
def test_english_edits_of_each_kind(prompt: str, kind: str, pattern: str) -> None:
    e = make_edit(prompt, 5, kind)
    assert e is not None and e.kind == kind
    _classified(e)
    assert re.search(pattern, e.prompt), e


def test_english_insertions_where_the_prompt_names_no_such_attribute() -> None:
    p = "an astronaut riding a horse on the moon"
    colour, size, position = (make_edit(p, 1, k) for k in ("colour", "size", "position"))
    for e in (colour, size, position):
        assert e is not None and e.how.startswith("insert")
        _classified(e)
    assert read_prompt(colour.prompt).objects != read_prompt(p).objects


def test_rewording_keeps_every_content_word_and_reseed_always_works() -> None:
    for p in ("a cat sleeping on a sofa, soft light, cinematic", "a dog runs on the beach",
              "Hyper realistic video of a lighthouse in a storm"):
        e = make_edit(p, 3, "rewording")
        assert e is not None
        _classified(e)
        assert _content_words(e.prompt) == _content_words(p), e
        r = make_edit(p, 3, "reseed")
        assert r is not None and r.prompt == p and r.seed != 3
    assert make_edit("", 3, "reseed") is None


def test_deterministic_and_salt_gives_another_edit() -> None:
    p = "a red car and a blue truck drive past a green house"
    a, b = make_edit(p, 9, "colour"), make_edit(p, 9, "colour")
    assert a == b
    others = {make_edit(p, 9, "colour", salt=s).prompt for s in range(4)}
    assert len(others) > 1
    assert make_edit(p, 9, "reseed", salt=1).seed != make_edit(p, 9, "reseed").seed
    with pytest.raises(ValueError):
        make_edit(p, 9, "count")
    with pytest.raises(ValueError):
        make_edit(p, 9, "colour", vocabulary="french")


def test_vidprom_prompts_every_edit_classified() -> None:
    """Real prompts (the first 150 of the VidProM sample): every edit made is of its kind; reseed always exists;
    rewordings keep every content word."""
    if not VIDPROM.is_file():
        pytest.skip(f"the VidProM sample is not next to the repository ({VIDPROM})")
    rows = [json.loads(line) for line in VIDPROM.read_text(encoding="utf-8").split("\n") if line.strip()][:150]
    assert len(rows) == 150
    made = {k: 0 for k in KINDS}
    for i, r in enumerate(rows):
        edits = make_edits(r["text"], i)
        assert "reseed" in edits
        for kind, e in edits.items():
            _classified(e)
            if kind == "rewording":
                assert _content_words(e.prompt) == _content_words(r["text"]), e
            made[kind] += 1
    assert all(made[k] > 0 for k in KINDS), made
