"""The embedded model inside ComfyUI: loader, nodes and the stock KSampler (in-process, CPU)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.comfy


@pytest.fixture(scope="module")
def glue(comfy_env):
    from carnator.carnator_core.embedded import comfy_glue

    return comfy_glue


def test_loader_builds_a_real_wan_model_patcher(glue) -> None:
    import comfy.ldm.wan.model
    import comfy.model_base
    import comfy.model_patcher
    import comfy.model_sampling

    from carnator.carnator_core.embedded import config

    model, te, dec = glue.load_embedded()
    assert isinstance(model, comfy.model_patcher.ModelPatcher)
    assert isinstance(model.model, comfy.model_base.WAN21)
    assert type(model.model.diffusion_model) is comfy.ldm.wan.model.WanModel
    assert isinstance(model.model.model_sampling, comfy.model_sampling.ModelSamplingDiscreteFlow)
    assert model.model.model_sampling.shift == pytest.approx(config.SHIFT)
    meta = model.model.carnator_embedded_meta
    assert meta["config"]["dim"] == config.DIM and meta["seed"] == 0
    cond = te.encode("a big red ball sits still in the middle, on the grass")
    assert cond[0][0].shape == (1, config.TEXT_LEN, config.TEXT_DIM)
    frames = dec.decode(glue.empty_latent(2)["samples"])
    assert frames.shape == (2 * config.FRAMES, config.HEIGHT, config.WIDTH, 3)


def test_stock_ksampler_runs_and_matches_generate(glue) -> None:
    import nodes as comfy_nodes
    from carnator.carnator_core.embedded import config

    model, te, dec = glue.load_embedded()
    prompt = "a big yellow cube moves down in the top right, at night"
    latent = comfy_nodes.common_ksampler(model, 7, 6, config.DEFAULT_CFG, config.DEFAULT_SAMPLER,
                                         config.DEFAULT_SCHEDULER, te.encode(prompt), te.encode(""),
                                         glue.empty_latent(1))[0]
    assert latent["samples"].shape == (1,) + tuple(config.LATENT_SHAPE)
    assert torch.isfinite(latent["samples"]).all()
    gen = glue.generate([prompt], seed=7, steps=6, probe_step=2)
    assert torch.allclose(gen.latents, latent["samples"].float(), atol=1e-4)
    assert gen.x0_probe.shape == latent["samples"].shape
    assert gen.cross_attn.shape == (1, config.NUM_LAYERS, config.TEXT_LEN) + tuple(config.TOKEN_GRID)
    # attention rows are distributions over the text tokens
    assert torch.allclose(gen.cross_attn.sum(2), torch.ones(1), atol=1e-4)


def test_nodes_chain(glue) -> None:
    import nodes as comfy_nodes
    from carnator.carnator_core.embedded import config
    from carnator.nodes import embedded as emb_nodes

    model, te, dec = emb_nodes.CarnatorEmbeddedLoader.execute("").result
    prompt = "a small green diamond rises in the bottom left, in a pink room"
    (cond,) = emb_nodes.CarnatorEmbeddedTextEncode.execute(te, prompt).result
    (neg,) = emb_nodes.CarnatorEmbeddedTextEncode.execute(te, "").result
    (latent,) = emb_nodes.CarnatorEmbeddedEmptyLatent.execute(2).result
    out = comfy_nodes.common_ksampler(model, 1, 3, 4.0, "euler", "simple", cond, neg, latent)[0]
    (frames,) = emb_nodes.CarnatorEmbeddedDecode.execute(dec, out, 2).result
    assert frames.shape == (2 * config.FRAMES, 2 * config.HEIGHT, 2 * config.WIDTH, 3)
    assert float(frames.min()) >= 0.0 and float(frames.max()) <= 1.0
    ids = {n.define_schema().node_id for n in emb_nodes.NODES}
    assert ids == {"CarnatorEmbeddedLoader", "CarnatorEmbeddedTextEncode", "CarnatorEmbeddedEmptyLatent",
                   "CarnatorEmbeddedDecode"}


def test_unknown_words_warn_not_crash(glue) -> None:
    _, te, _ = glue.load_embedded()
    with pytest.warns(UserWarning, match="unknown word"):
        cond = te.encode("a big red zeppelin ball sits still")
    assert cond[0][0].shape[1:] == (32, 4096)


def test_missing_weights_say_how_to_fix(glue, tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="retrained"):
        glue.load_embedded(tmp_path / "nope.safetensors")


def test_latent_preview_factors_follow_comfyui_convention(glue) -> None:
    """ComfyUI's previewer maps rgb = ((latent @ factors + bias) + 1) / 2; for the embedded codec that must give
    each 2x2 pixel cell's mean colour back (the Signature Builder measures object colours this way)."""
    from carnator.carnator_core.embedded import codec, config

    g = torch.Generator().manual_seed(3)
    rgb = torch.rand(1, config.FRAMES, config.HEIGHT, config.WIDTH, 3, generator=g)
    latent = codec.rgb_to_latent(rgb)[0]  # [C, T, h, w]
    fmt = glue.EmbeddedLatent()
    factors = torch.tensor(fmt.latent_rgb_factors)
    bias = torch.tensor(fmt.latent_rgb_factors_bias)
    preview = ((torch.einsum("cthw,ck->thwk", latent, factors) + bias) + 1.0) / 2.0
    cells = rgb[0].reshape(config.FRAMES, config.HEIGHT // 2, 2, config.WIDTH // 2, 2, 3).mean(dim=(2, 4))
    assert preview.shape == cells.shape
    assert torch.allclose(preview, cells, atol=1e-5)


def test_v3_weights_load_as_v3_and_sample(glue, tmp_path) -> None:
    """A v3 weights file (here: the initialised model; trained ones come from the chunked training) loads with
    v3's WanModel, text encoder and geometry, and the probe sees v3's token grid and blocks."""
    from carnator.carnator_core.embedded import config, train
    from carnator.carnator_core.embedded.model import build_wan

    v3 = config.version("v3")
    torch.manual_seed(0)
    path = tmp_path / "v3.safetensors"
    train.save_weights(build_wan(init=True, **v3.model_config()).state_dict(), path,
                       {"config": v3.model_config(), "seed": 0, "version": "v3"})
    model, te, _ = glue.load_embedded(path)
    assert glue.model_version(model).name == "v3" and te.version == "v3"
    assert te.name != glue.load_embedded()[1].name  # v2 and v3 conditioning never mix in a cache
    assert len(model.model.diffusion_model.blocks) == v3.num_layers
    gen = glue.generate(["a big red ball moves up in the top left and a small blue cube rests in the center"],
                        seed=1, model=model, steps=3, probe_step=1)
    assert gen.latents.shape == (1,) + v3.latent_shape and gen.clips.shape == (1, 8, 48, 48, 3)
    assert gen.cross_attn.shape == (1, v3.num_layers, config.TEXT_LEN) + v3.token_grid
    # pair labelling on v3 weights runs at v3's geometry, with the reuse settings it is given
    from carnator.carnator_core.cache.store import Store
    from carnator.carnator_core.lab import pairs
    from carnator.carnator_core.reuse import ReuseConfig

    assert pairs.weights_version(path) == "v3"  # without loading: what make_pairs draws its scenes for
    store = Store.open(tmp_path / "store", key_path=tmp_path / "index.key", durable=False)
    ctx = pairs.embedded_context(store, path, reuse=ReuseConfig(probe_context=True, refreshes=4))
    assert tuple(ctx.latent["samples"].shape) == (1,) + v3.latent_shape
    assert ctx.options.hit_reuse.probe_context and ctx.options.hit_reuse.refreshes == 4
    assert ctx.options.probe.context_kv_mb > 0  # the probe keeps the keys/values those hits use
    plain = pairs.embedded_context(store, path)
    assert plain.options.hit_reuse == ReuseConfig() and plain.options.probe.context_kv_mb == 0
    # labelling for Carnator + EasyCache runs on the EasyCache-patched clone: another model fingerprint (so the
    # rule it makes applies to that composition only)
    from carnator.carnator_core.comfy_patch import model_fingerprint

    easy = pairs.embedded_context(store, path, easycache=(0.2, 0.15, 0.95))
    assert tuple(easy.latent["samples"].shape) == (1,) + v3.latent_shape
    assert model_fingerprint(easy.model, "embedded") != model_fingerprint(plain.model, "embedded")
    # a file whose config is none of the versions is refused with the versions it could have been
    bad = tmp_path / "bad.safetensors"
    train.save_weights(build_wan(init=True, **{**v3.model_config(), "num_layers": 3}).state_dict(), bad,
                       {"config": {**v3.model_config(), "num_layers": 3}})
    with pytest.raises(ValueError, match="none of this code's versions"):
        glue.load_embedded(bad)


def test_the_weights_file_says_what_the_denoiser_predicts(glue, tmp_path) -> None:
    """A file trained with ``prediction: x0`` samples through ModelSamplingFlowX0 (still a flow model to ComfyUI;
    denoised = the WanModel's output); a file without the key is a velocity model (denoised = x - sigma * out);
    an unknown prediction is refused with what it could be."""
    import comfy.model_sampling

    from carnator.carnator_core.embedded import config, train
    from carnator.carnator_core.embedded.model import build_wan

    v2 = config.version("v2")
    torch.manual_seed(0)
    sd = build_wan(init=True, **v2.model_config()).state_dict()
    x = torch.randn((1,) + v2.latent_shape, generator=torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.7])
    denoised = {}
    for prediction in ("v", "x0"):
        path = tmp_path / f"{prediction}.safetensors"
        meta = {"config": v2.model_config(), "seed": 0, "version": "v2"}
        train.save_weights(sd, path, meta if prediction == "v" else {**meta, "prediction": "x0"})
        model, te, _ = glue.load_embedded(path)
        ms = model.get_model_object("model_sampling")
        assert isinstance(ms, comfy.model_sampling.CONST)
        assert isinstance(ms, comfy.model_sampling.ModelSamplingDiscreteFlow)
        assert isinstance(ms, glue.ModelSamplingFlowX0) == (prediction == "x0")
        assert ms.shift == pytest.approx(config.SHIFT)
        ctx = te.encode("a big red ball sits still in the middle, on the grass")[0][0]
        mm = model.model
        with torch.no_grad():
            den = mm.apply_model(x, sigma, c_crossattn=ctx, c_concat=mm.concat_cond(noise=x))
            raw = mm.diffusion_model(torch.cat([x, mm.concat_cond(noise=x)], 1), sigma * 1000.0, ctx)
        denoised[prediction] = den
        expected = raw if prediction == "x0" else x - 0.7 * raw
        assert torch.allclose(den, expected, atol=1e-4)
    assert not torch.allclose(denoised["v"], denoised["x0"], atol=1e-2)
    bad = tmp_path / "bad.safetensors"
    train.save_weights(sd, bad, {"config": v2.model_config(), "seed": 0, "version": "v2", "prediction": "eps"})
    with pytest.raises(ValueError, match="expected 'v' or 'x0'"):
        glue.load_embedded(bad)


def test_each_version_samples_at_its_own_cfg(glue, tmp_path) -> None:
    """The stock CFG scale belongs to the weights' version (v3 overshoots into halos at v2's 5): generate,
    the gate and the pairs labelling sample at it unless told otherwise, and the module default is the default
    version's."""
    from carnator.carnator_core.cache.store import Store
    from carnator.carnator_core.embedded import config, train
    from carnator.carnator_core.embedded.model import build_wan
    from carnator.carnator_core.lab import pairs

    assert config.version("v2").cfg == 5.0 and config.version("v3").cfg == 2.0
    assert config.DEFAULT_CFG == config.version(config.DEFAULT_VERSION).cfg
    v3 = config.version("v3")
    torch.manual_seed(0)
    path = tmp_path / "v3.safetensors"
    # the initialised model's zeroed output layers would make cond and uncond agree (then no scale matters)
    sd = {k: (torch.randn_like(t) * 0.05 if t.is_floating_point() and not t.any() else t)
          for k, t in build_wan(init=True, **v3.model_config()).state_dict().items()}
    train.save_weights(sd, path, {"config": v3.model_config(), "seed": 0, "version": "v3"})
    model, _, _ = glue.load_embedded(path)
    cap = ["a big red ball moves up in the top left"]
    own = glue.generate(cap, seed=1, model=model, steps=2).latents
    assert torch.equal(own, glue.generate(cap, seed=1, model=model, steps=2, cfg=2.0).latents)
    assert not torch.equal(own, glue.generate(cap, seed=1, model=model, steps=2, cfg=5.0).latents)
    store = Store.open(tmp_path / "store", key_path=tmp_path / "index.key", durable=False)
    assert pairs.embedded_context(store, path).cfg == 2.0
    assert pairs.embedded_context(store, None).cfg == config.DEFAULT_CFG


def test_the_weights_file_says_how_loud_the_time_coordinate_is(glue, tmp_path) -> None:
    """A file trained with ``coord_time_scale`` gets the same scaled t ramp at inference (the channels the
    trainer fed); a file without the key gets 1.0; a nonsense value is refused."""
    from carnator.carnator_core.embedded import codec, config, train
    from carnator.carnator_core.embedded.model import build_wan

    v2 = config.version("v2")
    torch.manual_seed(0)
    sd = build_wan(init=True, **v2.model_config()).state_dict()
    x = torch.zeros((1,) + v2.latent_shape)
    chans = {}
    for scale in (None, 4.0):
        path = tmp_path / f"t{scale}.safetensors"
        meta = {"config": v2.model_config(), "seed": 0, "version": "v2"}
        train.save_weights(sd, path, meta if scale is None else {**meta, "coord_time_scale": scale})
        model, _, _ = glue.load_embedded(path)
        chans[scale] = model.model.concat_cond(noise=x)[0]
    plain = codec.coord_channels(*v2.latent_shape[1:])
    assert torch.equal(chans[None], plain)
    assert torch.equal(chans[4.0][2], 4.0 * plain[2])  # the t ramp, and only it
    assert torch.equal(chans[4.0][:2], plain[:2])
    bad = tmp_path / "bad.safetensors"
    train.save_weights(sd, bad, {"config": v2.model_config(), "seed": 0, "version": "v2", "coord_time_scale": -1})
    with pytest.raises(ValueError, match="coord_time_scale"):
        glue.load_embedded(bad)


def test_attention_peak_rate_reads_only_the_chosen_layers(glue) -> None:
    """The gate's attention-peak rule: the peak of object 0's word attention, averaged over the given layers,
    must land on a token the final object covers; per-layer figures choose a version's probe layers."""
    import numpy as np

    from carnator.carnator_core.embedded import checker, config, text, world

    ver = config.version("v2")
    frame = world.Frame(ver.frames, ver.height, ver.width)
    cap = "a big red ball sits still in the top left corner, on the grass"
    scene = world.parse_caption(cap)
    clip, _ = world.render(scene, frame)
    result = checker.check(clip, cap)
    assert result.objects[0].found
    pt, ph, pw = ver.patch_size[0], ver.patch_size[1] * config.UNSHUFFLE, ver.patch_size[2] * config.UNSHUFFLE
    grid = (ver.frames // pt, ver.height // ph, ver.width // pw)
    on = np.unravel_index(int(np.argmax(result.masks[0][:pt].reshape(pt, grid[1], ph, grid[2], pw)
                                        .mean(axis=(0, 2, 4)))), grid[1:])
    attn = torch.zeros(1, ver.num_layers, config.TEXT_LEN, *grid)
    toks = text.encode(cap, warn=False, version=ver.name).object_tokens(0)
    attn[0, 1, toks, 0, on[0], on[1]] = 1.0  # layer 1 looks at the object
    attn[0, 2, toks, 0, grid[1] - 1, grid[2] - 1] = 1.0  # layer 2 at the far corner, away from it
    gen = glue.Generation(clips=torch.from_numpy(clip)[None], latents=torch.zeros(1), cross_attn=attn)
    assert glue.attention_peak_rate(gen, [cap], [result], (1,), ver) == 1.0
    assert glue.attention_peak_rate(gen, [cap], [result], (2,), ver) == 0.0
    assert np.isnan(glue.attention_peak_rate(glue.Generation(clips=gen.clips, latents=gen.latents), [cap],
                                             [result], (1,), ver))
