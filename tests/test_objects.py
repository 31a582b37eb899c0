"""Object extraction (spaCy, offline) and object word -> conditioning position mapping.

Pure-core tests use the installed spaCy English pipeline; the ``comfy`` tests run ComfyUI's real tokenizer
classes in-process: LTX-Video's T5 tokenizer with the vocabulary shipped in ComfyUI's tree, and Wan's umT5
tokenizer class with a SentencePiece vocabulary trained here (ComfyUI does not ship umT5's vocabulary: it comes
inside the text-encoder checkpoint, which cannot be downloaded on this machine).
"""
from __future__ import annotations

import io
import json
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from carnator.carnator_core import objects as objects_mod
from carnator.carnator_core.comfy_tokens import comfy_word_tokens
from carnator.carnator_core.embedded import world
from carnator.carnator_core.embedded.text import encode, word_tokens as embedded_word_tokens
from carnator.carnator_core.objects import (
    MAX_OBJECTS,
    ObjectPhrase,
    SpacyUnavailableError,
    align_word_ids,
    extract_objects,
    token_positions,
    whitespace_words,
)

REPO = Path(__file__).resolve().parents[1]
VIDPROM = REPO / ".." / "shared" / "data" / "vidprom_4k.jsonl"
SHAPE_WORD = {w: canon for canon, ws in world.SHAPE_WORDS.items() for w in ws}


@pytest.fixture(scope="module")
def nlp():
    t0 = time.perf_counter()
    loaded = objects_mod.load_spacy()
    print(f"spaCy load {1000 * (time.perf_counter() - t0):.0f} ms")
    return loaded


def world_captions(n: int, seed: int = 7) -> list[tuple[world.Scene, str]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        scene = world.sample_scene(rng, p_two=0.5)
        out.append((scene, world.caption(scene, rng)))
    return out


def _check_word_ids(prompt: str, phrases: list[ObjectPhrase]) -> None:
    words = [prompt[s:e].lower() for s, e in whitespace_words(prompt)]
    for ph in phrases:
        assert len(ph.words) == len(ph.word_ids)
        for w, wid in zip(ph.words, ph.word_ids):
            assert w in words[wid - 1], (w, wid, words)


# --- extraction on the embedded world -----------------------------------------------------------------------
def test_embedded_world_objects_are_the_shapes(nlp):
    captions = world_captions(80)
    for scene, cap in captions:
        phrases, source = extract_objects(cap)
        assert source == "spacy"
        heads_in_caption = [w for w in world.split_words(cap) if w in SHAPE_WORD]
        assert [p.head for p in phrases] == heads_in_caption, cap
        assert len(phrases) == len(scene.objects)
        for ph, obj in zip(phrases, scene.objects):
            # The object's modifiers are its colour and size words; positions/backgrounds are context.
            assert any(w in world.COLOUR_WORDS[obj.colour] for w in ph.words), (cap, ph)
            assert any(w in world.SIZE_WORDS[obj.size] for w in ph.words), (cap, ph)
            assert not set(ph.words) & {"top", "bottom", "left", "right", "corner", "center", "centre"}
        _check_word_ids(cap, phrases)


def test_examples_and_misparsed_motion_verbs(nlp):
    phrases, _ = extract_objects("a small red ball rolls to the right, on green grass")
    assert [(p.name, p.words) for p in phrases] == [("ball", ("small", "red", "ball"))]
    assert phrases[0].word_ids == (2, 3, 4)
    # spaCy's small model tags "orb" as an adjective here; the run reading still finds it.
    phrases, _ = extract_objects("a cobalt little orb glides towards the left at the top right, inside a pink bedroom")
    assert [p.name for p in phrases] == ["orb"]


def test_duplicates_are_disambiguated(nlp):
    phrases, _ = extract_objects("a red ball and a blue ball bounce next to a cube and another ball")
    assert [p.name for p in phrases] == ["ball", "ball#2", "cube", "ball#3"]
    assert phrases[1].words == ("blue", "ball")
    assert len({p.word_ids[-1] for p in phrases}) == 4


def test_no_objects_means_empty_list(nlp):
    for prompt in ("green grass under a blue sky, cinematic shot, 4k", "", "   ", "at night"):
        phrases, source = extract_objects(prompt)
        assert phrases == [] and source == "spacy"


def test_weight_syntax_is_read_as_words(nlp):
    prompt = "a (red ball:1.2) rolls past a (blue cube)"
    phrases, _ = extract_objects(prompt)
    assert [(p.name, p.words) for p in phrases] == [("ball", ("red", "ball")), ("cube", ("blue", "cube"))]
    _check_word_ids(prompt, phrases)


def test_max_objects_and_stop_list_override(nlp):
    prompt = "a cat, a dog, a bird and a fish"
    assert [p.name for p in extract_objects(prompt, max_objects=2)[0]] == ["cat", "dog"]
    assert [p.name for p in extract_objects(prompt, non_objects={"dog"})[0]] == ["cat", "bird", "fish"]
    with pytest.raises(ValueError):
        extract_objects(prompt, max_objects=-1)


# --- VidProM prompts ---------------------------------------------------------------------------------------
def _vidprom() -> dict[str, str]:
    if not VIDPROM.exists():
        pytest.skip(f"VidProM sample not found at {VIDPROM} (the shared/ folder sits next to the repository)")
    return {r["id"]: r["text"] for r in map(json.loads, filter(None, VIDPROM.read_text(encoding="utf-8").split("\n")))}


@pytest.mark.parametrize("pid, expected, not_objects", [
    ("vidprom-95a3d287", ["boy", "friend"], []),                     # A boy playing with his friend
    ("vidprom-faf96707", ["lady"], ["street"]),                      # a beatiful blonde lady in the streets of lagos
    ("vidprom-7e783637", ["granny", "door"], []),                    # the granny smiles and closes the door
    ("vidprom-43f269e5", ["rocket"], ["motion", "camera", "pan"]),   # rocket launching -ar 9:16 -motion 4 ...
    ("vidprom-77bb2ca6", [], ["sky", "cloud", "camera", "zoom"]),    # sky and clouds -m 2 -camera zoom out ...
    ("vidprom-1f97fcb3", ["horse"], []),                             # a horse running on the milky way
])
def test_vidprom_examples(nlp, pid, expected, not_objects):
    prompt = _vidprom()[pid]
    names = [p.head for p in extract_objects(prompt)[0]]
    for e in expected:
        assert e in names, (prompt, names)
    if expected and pid != "vidprom-faf96707":
        assert names[: len(expected)] == expected, (prompt, names)
    assert not set(names) & set(not_objects), (prompt, names)


def test_vidprom_robustness(nlp):
    # Robustness only: the extraction's speed is measured by the benchmarks (BENCHMARKS.md), never asserted here —
    # a wall-time bound fails on a busy machine and says nothing on an idle one.
    prompts = list(_vidprom().values())[:60]
    for prompt in prompts:
        phrases, _ = extract_objects(prompt)
        assert len(phrases) <= MAX_OBJECTS
        assert len({p.name for p in phrases}) == len(phrases)
        _check_word_ids(prompt, phrases)


# --- user override -----------------------------------------------------------------------------------------
def test_override_list():
    prompt = "A red Ball rolls next to two cubes, and a red ball."
    phrases, source = extract_objects(prompt, "red ball, cube; ball")
    assert source == "user"
    assert [(p.name, p.head, p.words) for p in phrases] == [
        ("ball", "ball", ("red", "ball")), ("cube", "cube", ("cube",)), ("ball#2", "ball", ("ball",))]
    assert phrases[0].word_ids == (2, 3)
    assert phrases[1].word_ids == (8,)  # "cubes," matches "cube"
    assert phrases[2].word_ids == (12,)  # the second occurrence of ball ("ball.")
    # Blank override -> extraction.
    assert extract_objects("a cat", "  ")[1] == "spacy"


def test_override_must_name_prompt_words():
    with pytest.raises(ValueError, match="'dog' from the object list is not in the prompt"):
        extract_objects("a red ball", "dog")
    with pytest.raises(ValueError, match="occurrence 2"):
        extract_objects("a red ball", "ball, ball")


def test_spacy_missing_error_says_how_to_install(monkeypatch):
    monkeypatch.setattr(objects_mod, "_NLP", None)
    monkeypatch.setattr(objects_mod, "SPACY_MODELS", ("carnator_no_such_spacy_model",))
    with pytest.raises(SpacyUnavailableError, match=r"pip install -r requirements.txt"):
        extract_objects("a red ball")
    # A user list needs no spaCy.
    assert extract_objects("a red ball", "ball")[1] == "user"


# --- word ids and positions --------------------------------------------------------------------------------
def test_align_sentencepiece_clip_and_weights():
    prompt = "A small (red ball:1.2), Grass-field 4k"
    pieces = [None, "\u2581A", "\u2581small", "\u2581red", "\u2581ball", ",", "\u2581", "Gra", "ss", "-", "field",
              "\u25814", "k", None, None]
    assert align_word_ids(prompt, pieces) == [0, 1, 2, 3, 4, 0, 5, 5, 5, 0, 5, 6, 6, 0, 0]
    clip_pieces = ["<|startoftext|>", "a</w>", "small</w>", "red</w>", "ball</w>"]
    assert align_word_ids("a small red ball", [None] + clip_pieces[1:]) == [0, 1, 2, 3, 4]
    # An unknown piece takes the current word and does not derail the rest.
    assert align_word_ids("a \u2603snow ball", ["\u2581a", "<unk>", "snow", "\u2581ball"]) == [1, 2, 2, 3]


def test_token_positions_multi_token_words_and_warnings():
    prompt = "a crimson sphere rolls"
    phrases = [ObjectPhrase("sphere", "sphere", ("crimson", "sphere"), (2, 3))]
    word_tokens = [(0, 1), (1, 2), (2, 2), (3, 2), (4, 3), (5, 4), (6, 0), (7, 0)]
    (ot,) = token_positions(prompt, phrases, word_tokens)
    assert (ot.name, ot.words, ot.positions) == ("sphere", ("crimson", "sphere"), (1, 2, 3, 4))
    with pytest.warns(UserWarning, match="no conditioning tokens"):
        (empty,) = token_positions(prompt, phrases, [(0, 1), (1, 0)])
    assert empty.positions == ()
    with pytest.raises(ValueError, match="different prompt"):
        token_positions(prompt, phrases, [(0, 9)])


def test_embedded_encoder_positions_match_its_own_word_spans(nlp):
    for scene, cap in world_captions(30, seed=11):
        phrases, _ = extract_objects(cap)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the world's captions are all in-vocabulary
            obj_tokens = token_positions(cap, phrases, embedded_word_tokens(cap))
        enc = encode(cap, warn=False)
        for slot, ot in enumerate(obj_tokens):
            assert list(ot.positions) == sorted(enc.object_tokens(slot, kinds=("shape", "colour", "size"))), cap


# --- ComfyUI's real tokenizers (in-process) ----------------------------------------------------------------
def _clip_with(tokenizer):
    import comfy.sd

    clip = comfy.sd.CLIP(no_init=True)  # the real CLIP.tokenize, without building a text-encoder model
    clip.tokenizer = tokenizer
    clip.tokenizer_options = {}
    return clip


def _decoded(clip, prompt, key):
    inner = getattr(clip.tokenizer, f"clip_{key}")
    batch = clip.tokenize(prompt, return_word_ids=True)[key][0]
    return [inner.inv_vocab[t] for t, _, _ in batch], batch


PROMPTS = [
    "a tiny crimson sphere rolls left; a big ebony gem rises in the sky",
    "A small red ball, rolls past the (blue cube:1.2) on grass-field, 4k",
    "two dogs chase a frisbee on the beach",
]


def _check_tokenizer(clip, key):
    for prompt in PROMPTS:
        pieces, batch = _decoded(clip, prompt, key)
        wt = comfy_word_tokens(clip, prompt)
        assert [p for p, _ in wt] == list(range(len(batch)))
        # Special and padding tokens (ComfyUI word id 0) have no word; every other token is inside its word.
        words = [w.lower() for w in prompt.split()]
        for (pos, wid), piece, (_, _, comfy_wid) in zip(wt, pieces, batch):
            if comfy_wid == 0:
                assert wid == 0
            elif wid:
                text = piece.replace("\u2581", "").lower()
                assert text in words[wid - 1], (piece, words[wid - 1])
        phrases, _ = extract_objects(prompt)
        for ot, ph in zip(token_positions(prompt, phrases, wt), phrases):
            assert ot.positions, (prompt, ph)
            text = "".join(pieces[p].replace("\u2581", "") for p in ot.positions).lower()
            assert text == "".join(ph.words), (prompt, ph, text)


@pytest.mark.comfy
def test_ltxv_t5_tokenizer(comfy_env, nlp):
    from comfy.text_encoders.lt import LTXVT5Tokenizer

    clip = _clip_with(LTXVT5Tokenizer())
    _check_tokenizer(clip, "t5xxl")
    # No start token: the first prompt token is position 0; padded to ComfyUI's 128-token minimum.
    pieces, batch = _decoded(clip, "the red ball", "t5xxl")
    assert pieces[:4] == ["\u2581the", "\u2581red", "\u2581ball", "</s>"] and len(batch) == 128
    assert comfy_word_tokens(clip, "the red ball")[:5] == [(0, 1), (1, 2), (2, 3), (3, 0), (4, 0)]


def _trained_spiece() -> bytes:
    """A small unigram SentencePiece vocabulary trained on the embedded world's captions (stand-in for umT5's,
    which ships inside the umT5 checkpoint). Small on purpose: many words split into several pieces."""
    import sentencepiece as spm

    lines = [cap for _, cap in world_captions(400, seed=3)] + PROMPTS * 5
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=120,
                                   model_type="unigram", character_coverage=1.0, pad_id=0, eos_id=1, unk_id=2,
                                   bos_id=-1, minloglevel=2)
    return model.getvalue()


@pytest.mark.comfy
def test_wan_umt5_tokenizer_class(comfy_env, nlp):
    from comfy.text_encoders.wan import WanT5Tokenizer

    clip = _clip_with(WanT5Tokenizer(tokenizer_data={"spiece_model": _trained_spiece()}))
    _check_tokenizer(clip, "umt5xxl")
    pieces, batch = _decoded(clip, "a crimson sphere", "umt5xxl")
    assert len(batch) == 512  # Wan pads umT5 to 512 positions, no start token
    wt = comfy_word_tokens(clip, "a crimson sphere")
    assert sum(1 for _, w in wt if w == 2) >= 2, pieces  # "crimson" is several pieces with this vocabulary


def test_synonyms_share_a_name_through_the_text_encoders_hook(nlp):
    """A paraphrase that names an object by a synonym ("wedge" for "triangle") must match it across requests:
    the embedded text encoder gives synonyms one concept and says so through carnator_canonical_name."""
    from carnator.carnator_core.probe import canonical_objects, objects_for

    class Hooked:
        def carnator_word_tokens(self, prompt):
            return embedded_word_tokens(prompt)

        def carnator_canonical_name(self, noun):
            return world.canonical_noun(noun)

    a, _ = objects_for("a red wedge and a blue orb on the grass", Hooked(), None)
    b, _ = objects_for("a red triangle and a blue ball on the grass", Hooked(), None)
    assert [o.name for o in a] == [o.name for o in b] == ["triangle", "ball"]
    assert [o.positions for o in a] == [o.positions for o in b]  # same token layout, names only
    # two synonyms of one concept stay two objects with unique names
    c, _ = objects_for("a red ball and a blue sphere", Hooked(), None)
    assert [o.name for o in c] == ["ball", "ball#2"]
    # no hook: the prompt's lemmas, unchanged; the input tuple is not mutated
    plain, _ = objects_for("a red wedge on the grass", None, None)
    assert [o.name for o in plain] == ["wedge"]
    assert canonical_objects(plain, object()) == plain
    assert world.canonical_noun("Wedge") == "triangle" and world.canonical_noun("grass") == "grass"
