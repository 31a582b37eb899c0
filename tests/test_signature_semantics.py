"""Early Signature semantics on the embedded model: each kind of prompt change moves its own discrepancy axis.

For each of four kinds of single-attribute change of an embedded-world scene — object colour, object position,
object size, background — N_PAIRS prompt pairs are probed with the same seed (default sampler, schedule and
probe step of the embedded model), signed, and compared with the four discrepancies of the risk filter
(``risk.discrepancy.discrepancies``: context, size, shape, appearance).

The axes have different units (ΔE, |log ratio|, 1 − IoU), so each axis is normalised by its mean response over
the four kinds (median over pairs per kind). Asserted, with the margins below:

* column ordering — each axis responds more to its own kind of change than to any other kind:
  median(axis | own kind) >= COLUMN_MARGIN x median(axis | other kind);
* row ordering — each kind of change moves its own axis most: normalised(own axis) >= ROW_MARGIN x
  normalised(any other axis);
* per pair — in at least PAIR_FRACTION of the pairs of a kind, the own axis has the largest normalised value.

The orderings are only meaningful for kinds of change the *model* follows (when the model ignores the changed
word, its probe barely changes: no axis moves by a just-noticeable amount, ``_responds``). Which kinds each
shipped weight file follows is stated up front (``FOLLOWS``, from docs/MODEL_CARD.md), never inferred from the
run: ``test_model_follows_the_kinds_it_should`` fails when the model follows a stated kind in fewer than
RESPONSIVE_FRACTION of the pairs, and the orderings are asserted over every stated kind — so a model that stops
following a kind fails these tests instead of shrinking them. v2 follows all four kinds (measured:
each axis responds 3-10x more to its own kind than to any other; own axis largest in 75-100% of the pairs of
each kind).

Also: the same prompt + seed gives a bit-identical signature.
Needs the embedded model's weights (carnator_core/embedded/weights/) and its ComfyUI glue; fails without them.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.comfy]

N_PAIRS = 16
KINDS = ("background", "size", "position", "colour")  # in AXES order: context, size, shape, appearance
AXIS_OF = {"background": "context", "size": "size", "position": "shape", "colour": "appearance"}
COLUMN_MARGIN = 1.5
ROW_MARGIN = 1.2
PAIR_FRACTION = 0.75
RESPONSIVE_FRACTION = 0.75
# A pair "responds" when some axis moves by at least this much: 1 CIEDE2000 unit is about a just-noticeable
# colour difference; 0.02 of mask IoU / log size is a fraction of one token at the embedded grid (256 tokens).
JND = {"context": 1.0, "size": 0.02, "shape": 0.02, "appearance": 1.0}


# The shipped weight files this test runs on (v2, at its own CFG 5, follows every kind of change).
WEIGHTS = {"v2": "carnator_embedded_v2.safetensors"}
FOLLOWS = {"v2": KINDS}


@pytest.fixture(scope="module", params=sorted(WEIGHTS))
def embedded(comfy_env, request):
    from carnator.carnator_core.embedded import config as ecfg

    path = ecfg.WEIGHTS_DIR / WEIGHTS[request.param]
    if not path.exists():
        pytest.fail(f"shipped embedded model weights not found at {path}")
    import torch

    from carnator.carnator_core.embedded import comfy_glue

    # Two intra-op threads, as the quality gate (tests/test_embedded_gate.py): even v2's 256-token clip takes about
    # 0.6x the time of one thread on an idle 2-core machine, with the same bits (the suite runs one process at a time).
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    model, enc, _dec = comfy_glue.load_embedded(path)
    yield ecfg, comfy_glue, model, enc, FOLLOWS[request.param]
    torch.set_num_threads(threads)


def _signature(embedded, prompt: str, seed: int):
    from carnator.carnator_core.embedded.text import word_tokens as embedded_word_tokens
    from carnator.carnator_core.objects import extract_objects, token_positions
    from carnator.carnator_core.probe import ProbeConfig, run_probe
    from carnator.carnator_core.signature import build_signature

    ecfg, glue, model, enc, _ = embedded
    phrases, source = extract_objects(prompt)
    objects = token_positions(prompt, phrases, embedded_word_tokens(prompt))
    version = glue.model_version(model)  # the weights' own geometry and CFG, not the default version's
    probe = run_probe(model, enc.encode(prompt), enc.encode(""), glue.empty_latent(1, version.name), seed=seed,
                      steps=ecfg.DEFAULT_STEPS, cfg=version.cfg, sampler_name=ecfg.DEFAULT_SAMPLER,
                      scheduler=ecfg.DEFAULT_SCHEDULER, prompt=prompt, objects=objects, object_source=source,
                      config=ProbeConfig(probe_steps=ecfg.DEFAULT_PROBE_STEP))
    return build_signature(probe)


def _change(kind: str, scene, rng):
    """The scene with exactly one attribute changed (object colours stay visible on the background)."""
    from carnator.carnator_core.embedded import world

    obj = scene.objects[0]
    if kind == "background":
        options = [b for b in world.BACKGROUNDS if b != scene.background and world.compatible(obj.colour, b)]
        return dataclasses.replace(scene, background=options[int(rng.integers(len(options)))])
    if kind == "colour":
        options = [c for c in world.COLOURS if c != obj.colour and world.compatible(c, scene.background)]
        new = dataclasses.replace(obj, colour=options[int(rng.integers(len(options)))])
    elif kind == "position":
        options = [p for p in world.POSITIONS if p != obj.position]
        new = dataclasses.replace(obj, position=options[int(rng.integers(len(options)))])
    elif kind == "size":
        new = dataclasses.replace(obj, size="big" if obj.size == "small" else "small")
    else:
        raise ValueError(kind)
    return dataclasses.replace(scene, objects=(new,))


def _pairs(kind: str, n: int, seed: int, version: str) -> list[tuple[str, str, int]]:
    """n (prompt, changed prompt, probe seed), scenes drawn in ``version``'s frame; both captions are drawn with
    the same template choices."""
    from carnator.carnator_core.embedded import config as ecfg, world

    v = ecfg.version(version)
    frame = world.Frame(v.frames, v.height, v.width)
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        scene = world.sample_scene(rng, n_objects=1, frame=frame)
        changed = _change(kind, scene, rng)
        cap_seed = int(rng.integers(2**31))
        a = world.caption(scene, np.random.default_rng(cap_seed))
        b = world.caption(changed, np.random.default_rng(cap_seed))
        out.append((a, b, int(rng.integers(2**31))))
    return out


def _responds(vector, axes) -> bool:
    return any(v >= JND[a] for v, a in zip(vector, axes))


@pytest.fixture(scope="module")
def measured(embedded):
    from carnator.carnator_core.risk.discrepancy import AXES, discrepancies

    values = {}
    for i, kind in enumerate(KINDS):
        rows = []
        for a, b, seed in _pairs(kind, N_PAIRS, seed=1000 + i, version=embedded[1].model_version(embedded[2]).name):
            d = discrepancies(_signature(embedded, a, seed), _signature(embedded, b, seed))
            assert not d.missing, (a, b, d.missing_objects)
            rows.append(d.vector())
        values[kind] = np.asarray(rows, dtype=np.float64)  # [pairs, 4 axes]
    responsive = {k: float(np.mean([_responds(v, AXES) for v in values[k]])) for k in KINDS}
    kinds = tuple(k for k in KINDS if k in embedded[-1])  # stated, not measured: see the module docstring
    med = np.stack([np.median(values[k], axis=0) for k in KINDS])  # [kind, axis]
    print("\nmedian discrepancy per kind of change (rows) and axis (columns " + ", ".join(AXES) + "):")
    for k, row in zip(KINDS, med):
        print(f"  {k:>10}: " + "  ".join(f"{v:8.4f}" for v in row) + f"   (model responds in {responsive[k]:.0%})")
    rows = [KINDS.index(k) for k in kinds]
    scale = med[rows].mean(axis=0)
    return values, med, scale, AXES, kinds, responsive


def test_identical_prompt_and_seed_identical_signature(embedded):
    from carnator.carnator_core.signature import signature_to_bytes

    prompt = "a small red ball moves to the right in the top left, on green grass"
    assert signature_to_bytes(_signature(embedded, prompt, 7)) == signature_to_bytes(_signature(embedded, prompt, 7))


def test_model_follows_the_kinds_it_should(measured):
    """Every kind of change the weights are stated to follow moves the probe (some axis by a just-noticeable
    amount) in at least RESPONSIVE_FRACTION of its pairs."""
    *_, kinds, responsive = measured
    assert len(kinds) >= 2, kinds
    ignored = {k: responsive[k] for k in kinds if responsive[k] < RESPONSIVE_FRACTION}
    assert not ignored, ("the embedded model no longer follows " + ", ".join(
        f"{k} words ({r:.0%} of pairs change its probe, need {RESPONSIVE_FRACTION:.0%})" for k, r in ignored.items()))


def test_each_axis_responds_most_to_its_own_change(measured):
    values, med, scale, axes, kinds, _ = measured
    for kind in kinds:
        a = axes.index(AXIS_OF[kind])
        own = med[KINDS.index(kind), a]
        for other in kinds:
            if other == kind:
                continue
            ratio = own / max(med[KINDS.index(other), a], 1e-9)
            print(f"{AXIS_OF[kind]}: {kind} / {other} = {ratio:.2f}")
            assert ratio >= COLUMN_MARGIN, (AXIS_OF[kind], kind, other, ratio)


def test_each_change_moves_its_own_axis_most(measured):
    values, med, scale, axes, kinds, _ = measured
    norm = med / np.maximum(scale, 1e-12)
    # Only the axes of the kinds the model is stated to follow compete (an ignored kind's axis has no scale).
    live = [axes.index(AXIS_OF[k]) for k in kinds]
    for kind in kinds:
        a = axes.index(AXIS_OF[kind])
        row = norm[KINDS.index(kind)]
        others = max(row[j] for j in live if j != a)
        print(f"{kind}: own axis {row[a]:.2f} vs next {others:.2f} (ratio {row[a] / max(others, 1e-12):.2f})")
        assert row[a] >= ROW_MARGIN * others, (kind, row)
        per_pair = (values[kind] / np.maximum(scale, 1e-12))[:, live]
        frac = float(np.mean(np.asarray(live)[np.argmax(per_pair, axis=1)] == a))
        print(f"{kind}: own axis largest in {frac:.0%} of {len(per_pair)} pairs")
        assert frac >= PAIR_FRACTION, (kind, frac)
