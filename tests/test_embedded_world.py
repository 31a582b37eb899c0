"""Embedded world, codec, text encoder and checker (pure core: no ComfyUI)."""
from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch

from carnator.carnator_core.embedded import checker, codec, config, text, world


def _scenes(n: int, seed: int = 0, **kw):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        s = world.sample_scene(rng, **kw)
        out.append((s, world.caption(s, rng)))
    return out


def test_world_covers_required_attribute_ranges() -> None:
    assert len(world.SHAPES) >= 4 and len(world.COLOURS) >= 8 and len(world.SIZES) >= 2
    assert len(world.POSITIONS) >= 5 and len(world.MOTIONS) >= 4 and "still" in world.MOTIONS
    assert len(world.BACKGROUNDS) >= 6
    c, t, h, w = config.LATENT_SHAPE
    tokens = (t // config.PATCH_SIZE[0]) * (h // config.PATCH_SIZE[1]) * (w // config.PATCH_SIZE[2])
    assert config.FRAMES >= 8 and tokens >= 256


def test_render_is_deterministic_and_in_range() -> None:
    (scene, _), = _scenes(1, seed=3)
    a, ma = world.render(scene)
    b, mb = world.render(scene)
    assert a.shape == (config.FRAMES, config.HEIGHT, config.WIDTH, 3)
    assert np.array_equal(a, b) and np.array_equal(ma, mb)
    assert a.min() >= 0.0 and a.max() <= 1.0
    assert [c for _, c in _scenes(5, seed=9)] == [c for _, c in _scenes(5, seed=9)]


def test_captions_parse_back_to_their_scene() -> None:
    for scene, cap in _scenes(400, seed=1):
        assert world.parse_caption(cap) == scene, cap


def test_issue_examples_parse() -> None:
    s = world.parse_caption("a small red ball rolls to the right across green grass")
    assert s.objects[0] == world.ObjectSpec("ball", "red", "small", None, "right") and s.background == "grass"
    s = world.parse_caption("on a sandy beach, a big blue cube sits still in the top left")
    assert s.objects[0] == world.ObjectSpec("cube", "blue", "big", "top left", "still") and s.background == "sand"


def test_held_out_split_is_never_sampled_for_training() -> None:
    assert len(world.HELD_OUT) == 20
    for scene, _ in _scenes(500, seed=2):
        assert not any(world.is_held_out(o) for o in scene.objects)
    for scene, _ in _scenes(50, seed=2, held_out=True):
        assert world.is_held_out(scene.objects[0])
    # every single value is still trained
    trained = {o.triple() for s, _ in _scenes(3000, seed=4) for o in s.objects}
    for i, values in enumerate((world.SHAPES, world.COLOURS, world.POSITIONS)):
        assert {t[i] for t in trained} == set(values)


def test_codec_round_trip_and_coords() -> None:
    (scene, _), = _scenes(1, seed=5)
    rgb, alpha = world.render(scene)
    z = codec.rgb_to_latent(rgb)
    assert tuple(z.shape) == config.LATENT_SHAPE
    assert torch.allclose(codec.latent_to_rgb(z), torch.from_numpy(rgb), atol=1e-6)
    assert torch.all(z[12:] == 0)
    zb = codec.rgb_to_latent(np.stack([rgb, rgb]))
    assert zb.shape[0] == 2 and torch.equal(zb[1], z)
    assert tuple(codec.mask_to_latent(alpha[0]).shape) == config.LATENT_SHAPE[1:]
    coords = codec.coord_channels(*config.LATENT_SHAPE[1:])
    assert tuple(coords.shape) == (config.COORD_CHANNELS,) + config.LATENT_SHAPE[1:]



def test_coordinate_channels_scale_and_octaves() -> None:
    """A version's coordinate channels: v2's 3 ramps unchanged (its weights' in_dim stays 19); scale multiplies
    every channel; each octave adds sin/cos of x and y, which vary along their own axis only."""
    t, h, w = 4, 6, 8
    ramps = codec.coord_channels(t, h, w)
    assert config.version("v2").coord_channels == config.COORD_CHANNELS == 3
    assert config.version("v2").model_config()["in_dim"] == config.LATENT_CHANNELS + 3
    assert float(ramps[0, 0, 0, 0]) == -1.0 and float(ramps[0, 0, 0, -1]) == 1.0  # x left to right
    assert float(ramps[1, 0, 0, 0]) == -1.0 and float(ramps[1, 0, -1, 0]) == 1.0  # y top to bottom
    rich = codec.coord_channels(t, h, w, scale=2.5, octaves=2)
    assert tuple(rich.shape) == (3 + 4 * 2, t, h, w)
    assert torch.allclose(rich[:3], 2.5 * ramps)
    assert float(rich.abs().max()) <= 2.5 + 1e-6
    x = ramps[0]
    assert torch.allclose(rich[3], 2.5 * torch.sin(torch.pi * x), atol=1e-6)
    assert torch.allclose(rich[8], 2.5 * torch.cos(2 * torch.pi * x), atol=1e-6)
    assert torch.all(rich[3].std(dim=(0, 1)) < 1e-6) and torch.all(rich[5].std(dim=(0, 2)) < 1e-6)

def test_text_encoder_word_spans_and_synonyms() -> None:
    enc = text.encode("a small red ball rolls to the right across green grass")
    assert enc.cond.shape == (config.TEXT_LEN, config.TEXT_DIM)
    words = [w.word for w in enc.words]
    assert words == "a small red ball rolls to the right across green grass".split()
    ball = enc.words[words.index("ball")]
    assert ball.concept == "shape:ball" and ball.slot == 0 and len(ball.tokens) == 1
    other = text.encode("a small red ball rolls to the right across green grass")
    assert np.array_equal(enc.cond[ball.tokens[0]], other.cond[ball.tokens[0]])
    assert enc.words[words.index("right")].concept == "motion:right"
    assert enc.words[words.index("green")].concept == "bgmod:green" and enc.words[words.index("green")].slot is None
    assert sorted(enc.object_tokens(0)) == sorted(enc.words[words.index(w)].tokens[0] for w in ("red", "ball"))
    # synonyms are close but distinct tokens
    a = text.encode("a red ball").cond[1]
    b = text.encode("a crimson ball").cond[1]
    c = text.encode("a blue ball").cond[1]
    assert not np.array_equal(a, b) and np.linalg.norm(a - b) < 0.6 * np.linalg.norm(a - c)
    assert np.all(text.encode("").cond == 0)
    assert "ball" in text.OBJECT_NOUNS and "red" in text.COLOUR_ADJECTIVES


def test_two_object_slots_and_position_vs_motion_words() -> None:
    enc = text.encode("a red ball in the top left moves to the right and a blue cube falls in the bottom right, "
                      "at night")
    by = {(w.word, w.index): w for w in enc.words}
    assert [w.slot for w in enc.words if w.word in ("ball", "cube")] == [0, 1]
    lefts = [w for w in enc.words if w.word in ("left", "right")]
    assert [w.concept for w in lefts] == ["pos:left", "motion:right", "pos:right"]
    assert by[("night", len(enc.words) - 1)].slot is None


def test_unknown_words_are_ignored_with_a_warning() -> None:
    with pytest.warns(UserWarning, match="unknown word"):
        enc = text.encode("a big red flamingo ball sits still in the middle")
    flamingo = [w for w in enc.words if w.word == "flamingo"][0]
    assert flamingo.tokens == () and flamingo.concept is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        known = text.encode("a big red ball sits still in the middle")
    assert np.array_equal(enc.cond, known.cond)


def test_checker_passes_ground_truth_renders() -> None:
    results = []
    for scene, cap in _scenes(120, seed=6) + _scenes(40, seed=7, held_out=True):
        rgb, _ = world.render(scene)
        r = checker.check(rgb, cap)
        assert r.all_ok, (cap, [o.measured for o in r.objects])
        results.append(r)
    rates = checker.pass_rates(results)
    assert all(rates[k] == 1.0 for k in ("colour", "size", "position", "motion"))


def test_motion_axis_and_sign_tell_a_time_reversed_clip() -> None:
    """The training diagnostic: a clip played backwards moves on the named axis with the wrong sign."""
    forward, backward = [], []
    scenes = [(s, c) for s, c in _scenes(60, seed=9, n_objects=1) if s.objects[0].motion != "still"]
    assert len(scenes) >= 20
    for scene, cap in scenes:
        rgb, _ = world.render(scene)
        forward.append(checker.check(rgb, cap))
        backward.append(checker.check(rgb[::-1].copy(), cap))
    assert checker.motion_axis_and_sign(forward) == {"motion_axis": 1.0, "motion_sign": 1.0}
    assert checker.motion_axis_and_sign(backward) == {"motion_axis": 1.0, "motion_sign": 0.0}


@pytest.mark.parametrize("attr,other", [("colour", None), ("size", None), ("position", None), ("motion", None)])
def test_checker_rejects_perturbed_captions(attr: str, other) -> None:
    values = {"colour": world.COLOURS, "size": world.SIZES, "position": world.POSITIONS, "motion": world.MOTIONS}
    rng = np.random.default_rng(11)
    for scene, _ in _scenes(25, seed=8, n_objects=1):
        rgb, _ = world.render(scene)
        obj = scene.objects[0]
        choices = [v for v in values[attr] if v != getattr(obj, attr)]
        wrong = dataclasses.replace(obj, **{attr: choices[int(rng.integers(len(choices)))]})
        r = checker.check(rgb, world.Scene((wrong,), scene.background))
        assert getattr(r.objects[0], f"{attr}_ok") is False, (attr, obj, wrong, r.objects[0].measured)


def test_checker_flags_missing_object_and_accepts_torch() -> None:
    blank = np.broadcast_to(world.background_image("grass"), (config.FRAMES, config.HEIGHT, config.WIDTH, 3))
    r = checker.check(torch.from_numpy(np.ascontiguousarray(blank)),
                      "a big red ball sits still in the middle, on the grass")
    assert not r.objects[0].found and r.objects[0].colour_ok is False and r.background_ok is True
    with pytest.raises(ValueError, match="expects a clip"):
        checker.check(np.zeros((8, 32, 32)), "a red ball")


# --- v3: a 48 x 48 frame and the contextual text encoder ----------------------------------------------------
V3 = config.version("v3")
V3_FRAME = world.Frame(V3.frames, V3.height, V3.width)


def test_v3_geometry_is_finer_and_deeper_than_v2() -> None:
    v2 = config.version("v2")
    assert V3.num_layers >= 8 and 2 / V3.num_layers <= 0.25  # always-dense first + last block <= 25 %
    assert V3.tokens > v2.tokens and V3.latent_shape == (config.LATENT_CHANNELS, 8, 24, 24)
    assert world.anchors(32, 32) == world.ANCHORS  # v2's frame's anchors are the table's
    assert world.DEFAULT_FRAME == V3_FRAME  # v3 is the default version
    assert V3_FRAME.anchors["center"] == (24.0, 24.0)
    rgb, alpha = world.render(world.Scene((world.ObjectSpec("ball", "red", "big", "center", "still"),), "grass"),
                              V3_FRAME)
    assert rgb.shape == (8, 48, 48, 3) and alpha.shape == (1, 8, 48, 48)
    # the same object covers a smaller share of the larger frame (sizes are in pixels)
    _, alpha2 = world.render(world.Scene((world.ObjectSpec("ball", "red", "big", "center", "still"),), "grass"),
                             world.Frame(v2.frames, v2.height, v2.width))
    assert (alpha > 0.5).mean() < 0.5 * (alpha2 > 0.5).mean()


def test_checker_passes_ground_truth_renders_in_the_v3_frame() -> None:
    rng = np.random.default_rng(16)
    results = []
    for k in range(120):
        scene = world.sample_scene(rng, held_out=k % 3 == 0, p_two=0.6, frame=V3_FRAME)
        cap = world.caption(scene, rng)
        rgb, _ = world.render(scene, V3_FRAME)
        r = checker.check(rgb, cap)
        assert r.all_ok, (cap, [o.measured for o in r.objects])
        results.append(r)
    assert sum(len(r.objects) == 2 for r in results) > 40
    # ... and a wrong position is caught there too (anchors scale with the clip's frame)
    scene = world.Scene((world.ObjectSpec("cube", "blue", "small", "top left", "still"),), "sand")
    rgb, _ = world.render(scene, V3_FRAME)
    wrong = world.Scene((dataclasses.replace(scene.objects[0], position="center"),), "sand")
    assert checker.check(rgb, scene).all_ok and checker.check(rgb, wrong).objects[0].position_ok is False


def test_v3_text_encoder_binds_each_word_to_its_object() -> None:
    """v3 adds the object's phrase context to its words: object 0's position word changes with object 0's colour
    (not with object 1's); v2's bag of words does not bind. Token positions are the same in both versions."""
    base = "a red ball in the top left moves up and a blue cube sits still in the bottom right, at night"
    own = base.replace("red", "green")
    other = base.replace("blue", "yellow")
    enc = {v: {k: text.encode(p, version=v) for k, p in (("base", base), ("own", own), ("other", other))}
           for v in ("v2", "v3")}
    top = [w for w in enc["v3"]["base"].words if w.word == "top"][0].tokens[0]
    night = [w for w in enc["v3"]["base"].words if w.word == "night"][0].tokens[0]
    assert np.array_equal(enc["v2"]["base"].cond[top], enc["v2"]["own"].cond[top])
    assert not np.array_equal(enc["v3"]["base"].cond[top], enc["v3"]["own"].cond[top])
    assert np.array_equal(enc["v3"]["base"].cond[top], enc["v3"]["other"].cond[top])
    assert np.array_equal(enc["v3"]["base"].cond[night], enc["v2"]["base"].cond[night])  # global words: unchanged
    assert [w.tokens for w in enc["v3"]["base"].words] == [w.tokens for w in enc["v2"]["base"].words]
    assert np.all(text.encode("", version="v3").cond == 0)
    assert np.array_equal(text.encode(base).cond, enc["v3"]["base"].cond)  # the default version's encoder


def test_motion_axes_encode_a_direction_as_its_axis_and_a_sign() -> None:
    """With ``motion_axes`` a a direction word is axis + a x signed direction: "left" and "right" share their
    axis and differ by an exact opposite (cosine (1 - a^2) / (1 + a^2); independent concepts without it);
    up/down have another axis; every other word, and the default encoding, are unchanged."""
    def word_vec(prompt: str, word: str, **kw) -> np.ndarray:
        enc = text.encode(prompt, version="v2", **kw)  # v2: no phrase context, so a word token is its own
        return enc.cond[[w for w in enc.words if w.word == word][0].tokens[0]]

    def concept(word: str, verb: str = "moves to the", **kw) -> np.ndarray:
        base = word_vec(f"a red ball {verb} {word}", "ball", **kw)  # same slot vector for the same slot
        return word_vec(f"a red ball {verb} {word}", word, **kw) - 0.3 * text._vector("word:" + word) \
            - (base - text._vector("concept:shape:ball") - 0.3 * text._vector("word:ball"))

    def cos(a: np.ndarray, b: np.ndarray) -> float:
        return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))

    left, right = concept("left", motion_axes=1.0), concept("right", motion_axes=1.0)
    up, down = concept("up", "moves", motion_axes=1.0), concept("down", "moves", motion_axes=1.0)
    assert abs(cos(concept("left"), concept("right"))) < 0.1  # independent random concepts by default
    assert cos(left, right) == pytest.approx(0.0, abs=0.1)  # a = 1: axis and sign weigh the same
    assert cos(left + right, up + down) == pytest.approx(0.0, abs=0.1)  # two different axes
    axis = text._vector("axis:h") / np.sqrt(2.0)
    assert np.allclose(left + right, 2 * axis, atol=1e-4)  # the signed parts cancel exactly
    strong = concept("left", motion_axes=3.0), concept("right", motion_axes=3.0)
    weak = concept("left", motion_axes=0.3), concept("right", motion_axes=0.3)
    assert cos(*strong) < -0.7 and cos(*weak) > 0.8  # the weight decides how much of a word is its sign
    assert np.linalg.norm(left) == pytest.approx(np.linalg.norm(concept("left")), rel=0.1)
    p = "a red ball in the top left moves to the left, on the grass"
    a, b = text.encode(p, version="v3"), text.encode(p, version="v3", motion_axes=1.0)
    grass = [w for w in a.words if w.word == "grass"][0].tokens[0]
    assert np.array_equal(a.cond[grass], b.cond[grass])
    assert not np.array_equal(a.cond[0], b.cond[0])  # v3: the phrase context carries the motion concept
