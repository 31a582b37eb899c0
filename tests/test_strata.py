"""Strata (carnator_core/risk/strata.py): what changed between a request and a candidate, from the prompts alone.

Real spaCy (the object parser), real prompts: the embedded world's captions (every edit kind of the workload, with
the world's own caption generator) and VidProM-like open prompts.
"""
from __future__ import annotations

import numpy as np
import pytest

from carnator_core.embedded import world
from carnator_core.lab import workload as wl
from carnator_core.risk.strata import (
    BACKGROUND_OF,
    COLOUR_OF,
    EXACT,
    MOTION_OF,
    NOUN_OF,
    SIZE_OF,
    STRATA,
    read_prompt,
    stratum_of,
)


def test_contract_names():
    for name in ("reseed", "rewording", "colour", "size", "position", "motion", "background", "object", "count",
                 "mixed"):
        assert name in STRATA
    assert EXACT == "exact" and EXACT not in STRATA


def test_exact_and_reseed_fold_case_and_whitespace():
    p = "A small red ball rolls to the right, on green grass"
    assert stratum_of(p, p, same_seed=True) == "exact"
    assert stratum_of(p, "a small red  ball rolls to the right, on green grass ", same_seed=True) == "exact"
    assert stratum_of(p, p, same_seed=False) == "reseed"


@pytest.mark.parametrize("target,candidate,expected", [
    # the embedded world's captions, one edit each
    ("a small red ball rolls to the right in the top left, on green grass",
     "a small blue ball rolls to the right in the top left, on green grass", "colour"),
    ("a small red ball rolls to the right in the top left, on green grass",
     "a big red ball rolls to the right in the top left, on green grass", "size"),
    ("a small red ball rolls to the right in the top left, on green grass",
     "a small red ball rolls to the right in the bottom right, on green grass", "position"),
    ("a small red ball rolls to the right in the top left, on green grass",
     "a small red ball rises in the top left, on green grass", "motion"),
    ("a small red ball rolls to the right in the top left, on green grass",
     "a small red ball sits still in the top left, on green grass", "motion"),
    ("a small red ball rolls to the right in the top left, on green grass",
     "a small red ball rolls to the right in the top left, in a pink room", "background"),
    ("a small red ball rolls to the right in the top left, on green grass",
     "a small red cube rolls to the right in the top left, on green grass", "object"),
    ("a small red ball rolls to the right in the top left, on green grass",
     "a small red ball rolls to the right in the top left and a big blue cube rests in the center, on green grass",
     "count"),
    # synonyms, templates and order: the same content
    ("a small red ball rolls to the right in the top left, on green grass",
     "on a grassy field, a tiny crimson orb in the upper left corner moves to the right", "rewording"),
    ("a big blue cube sits still at the centre, under the stars",
     "a large cobalt block is stationary in the middle, on a dark night", "rewording"),
    # two objects: a swap of colours between them is a colour change, not a rewording
    ("a small red ball moves up in the top left and a big blue cube falls in the bottom right, against a blue sky",
     "a small blue ball moves up in the top left and a big red cube falls in the bottom right, against a blue sky",
     "colour"),
    # the order of the clauses does not matter
    ("a small red ball moves up in the top left and a big blue cube falls in the bottom right, against a blue sky",
     "a big blue cube falls in the bottom right while a small red ball moves up in the top left, in the clouds",
     "rewording"),
    # two kinds at once
    ("a small red ball rolls to the right in the top left, on green grass",
     "a big blue ball rolls to the right in the top left, on green grass", "mixed"),
    ("a small red ball rolls to the right in the top left, on green grass",
     "a small red ball rolls to the right in the top left, in a pink room, with a yellow cube", "mixed"),
])
def test_embedded_world_edits(target, candidate, expected):
    assert stratum_of(target, candidate, same_seed=True) == expected
    # another seed does not change the stratum of a changed prompt
    assert stratum_of(target, candidate, same_seed=False) == expected


@pytest.mark.parametrize("target,candidate,expected", [
    ("a golden retriever running on the beach at sunset, cinematic, 4k",
     "a golden retriever running on the beach at sunset, cinematic, 4k, highly detailed", "rewording"),
    ("a cat sitting on a windowsill, soft light", "a dog sitting on a windowsill, soft light", "object"),
    ("a cat sitting on a windowsill, soft light", "a kitten sitting on a windowsill, soft light", "rewording"),
    ("a red sports car driving through a city street at night",
     "a blue sports car driving through a city street at night", "colour"),
    ("an astronaut riding a horse in space", "an astronaut riding a horse in a forest", "background"),
    ("a woman walking on the left side of a busy street", "a woman walking on the right side of a busy street",
     "position"),
    ("a tiny dragon flying over a castle", "a giant dragon flying over a castle", "size"),
    ("a boat drifts to the left on a calm lake", "a boat drifts to the right on a calm lake", "motion"),
    ("a man talking in a cafe", "a man and a woman talking in a cafe", "count"),
    # the head noun changes and objects are added: two kinds
    ("two people talking in a cafe", "a man and a woman and a child talking in a cafe", "mixed"),
])
def test_open_prompts(target, candidate, expected):
    assert stratum_of(target, candidate, same_seed=False) == expected


def test_every_workload_edit_lands_in_its_stratum():
    """The world's own workload: a request against its parent is in the stratum of its kind (every kind, two
    workloads, seeds never used for data)."""
    expected = {"reroll": "reseed", "paraphrase": "rewording", "exact": "exact",
                **{f"edit:{a}": a for a in wl.EDIT_ATTRIBUTES}}
    seen: dict[str, int] = {}
    for seed in (901, 902):
        w = wl.build_workload(wl.WorkloadSpec(n_warm=40, n_stream=60, seed=seed, p_two=0.5))
        by_rid = {r.rid: r for r in list(w.warm) + list(w.stream)}
        for r in list(w.warm) + list(w.stream):
            if r.parent is None:
                continue
            p = by_rid[r.parent]
            if r.kind == "reroll" and r.seed == p.seed:
                continue  # a reroll that drew its parent's seed is an exact repeat
            got = stratum_of(r.prompt, p.prompt, same_seed=r.seed == p.seed)
            assert got == expected[r.kind], (r.kind, r.prompt, p.prompt)
            seen[r.kind] = seen.get(r.kind, 0) + 1
    assert set(seen) >= {"reroll", "paraphrase"} | {f"edit:{a}" for a in wl.EDIT_ATTRIBUTES}, seen


def test_word_lists_cover_the_embedded_world():
    """Every attribute word the world's captions use is read as its kind (a world change cannot be missed)."""
    for words in world.COLOUR_WORDS.values():
        assert all(w in COLOUR_OF for w in words)
    for canon, words in world.SIZE_WORDS.items():
        assert all(SIZE_OF[w] == canon for w in words)
    for canon, words in world.SHAPE_WORDS.items():
        assert all(NOUN_OF[w] == canon for w in words)
    for canon, words in world.BACKGROUND_WORDS.items():
        nouns = [w for w in words if w not in COLOUR_OF]
        assert all(w in BACKGROUND_OF for w in nouns), (canon, nouns)
    for word, canon in world.MOTION_ONLY_WORDS.items():
        assert MOTION_OF[word] == canon
    # every background phrase of the captions reads as exactly one background value
    rng = np.random.default_rng(0)
    for bg in world.BACKGROUNDS:
        values = set()
        for _ in range(30):
            obj = world.ObjectSpec("ball", "red" if bg != "room" else "blue", "small", "center", "still")
            values.add(read_prompt(world.caption(world.Scene((obj,), bg), rng)).background)
        assert len(values) == 1, (bg, values)
