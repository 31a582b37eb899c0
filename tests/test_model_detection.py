"""Model detection (carnator_core.adapters.detect_arch): the supported backbones are recognised; the families
Carnator cannot reuse across are refused with a message that names what was found, why, and what is supported.

Real ComfyUI 0.3.75 classes wherever it has them (tiny random-weight WAN21 / WAN22 / LTXV models loaded through
ComfyUI's own detection; the WAN21 variants built bare: detection reads only classes and attributes). Families
that only newer ComfyUI releases have are class stand-ins carrying the upstream names and traits: WAN21_FlowRVS
(a WAN21 subclass with prediction type IMG_TO_IMG_FLOW), WAN21_CausalAR (backbone CausalWanModel from
comfy.ldm.wan.ar_model) and LTXAV (LTX-2, a BaseModel with backbone LTXAVModel from comfy.ldm.lightricks.av_model).
"""
from __future__ import annotations

import enum
from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.comfy


@pytest.fixture(scope="module")
def env(comfy_env, tmp_path_factory):
    import comfy.model_base as mb
    import comfy.ops
    import tiny_models as tm
    from comfy.ldm.wan.model import WanModel

    from carnator.carnator_core.adapters import UnsupportedModelError, detect_arch

    d = tmp_path_factory.mktemp("tiny_detect")
    models = {name: tm.load_tiny_model(name, d) for name in tm.SPECS}
    wan_t2v = WanModel(model_type="t2v", dim=256, ffn_dim=256, num_heads=2, num_layers=1,
                       operations=comfy.ops.manual_cast)
    return SimpleNamespace(mb=mb, models=models, wan_t2v=wan_t2v, detect=detect_arch, Error=UnsupportedModelError)


def bare(cls: type, **attrs: Any) -> Any:
    """An instance of a torch module class without running its __init__ (no weights): what detection reads."""
    import torch

    obj = cls.__new__(cls)
    torch.nn.Module.__init__(obj)
    for k, v in attrs.items():
        setattr(obj, k, v)
    return obj


def patcher(base: Any) -> Any:
    return SimpleNamespace(model=base)


def refusal(env: Any, base: Any) -> str:
    with pytest.raises(env.Error) as e:
        env.detect(patcher(base))
    msg = str(e.value)
    assert "Supported:" in msg or "Carnator works with" in msg, msg  # says what would work
    return msg


@pytest.mark.parametrize("name", ["wan21", "wan22", "ltxv"])
def test_supported_models_are_recognised(env, name):
    assert env.detect(env.models[name]) == name


def test_image_to_image_flow_wan_is_refused(env):
    # Upstream: class WAN21_FlowRVS(WAN21) with model_type=ModelType.IMG_TO_IMG_FLOW and a plain t2v WanModel.
    img2img_flow = enum.Enum("ModelType", {"IMG_TO_IMG_FLOW": 11}).IMG_TO_IMG_FLOW  # 0.3.75's enum lacks it
    flow_rvs = type("WAN21_FlowRVS", (env.mb.WAN21,), {})
    msg = refusal(env, bare(flow_rvs, diffusion_model=env.wan_t2v, model_type=img2img_flow))
    assert "image-to-image flow" in msg and "WAN21_FlowRVS" in msg, msg
    # The trait alone is enough: the plain WAN21 class with that prediction type (a renamed variant).
    msg = refusal(env, bare(env.mb.WAN21, diffusion_model=env.wan_t2v, model_type=img2img_flow))
    assert "image-to-image flow" in msg, msg
    # And any prediction type other than flow matching (e.g. a Wan finetune switched to EPS).
    msg = refusal(env, bare(env.mb.WAN21, diffusion_model=env.wan_t2v, model_type=env.mb.ModelType.EPS))
    assert "prediction type EPS" in msg, msg


def test_causal_autoregressive_wan_is_refused(env):
    from comfy.ldm.wan.model import WanModel

    # Upstream: class WAN21_CausalAR(WAN21) with unet_model=comfy.ldm.wan.ar_model.CausalWanModel.
    causal_dm = type("CausalWanModel", (WanModel,), {"__module__": "comfy.ldm.wan.ar_model"})
    causal = type("WAN21_CausalAR", (env.mb.WAN21,), {})
    msg = refusal(env, bare(causal, diffusion_model=bare(causal_dm, model_type="t2v"),
                            model_type=env.mb.ModelType.FLOW))
    assert "causal / autoregressive" in msg and "WAN21_CausalAR" in msg, msg
    # The backbone alone gives it away, under the plain WAN21 class too.
    msg = refusal(env, bare(env.mb.WAN21, diffusion_model=bare(causal_dm, model_type="t2v"),
                            model_type=env.mb.ModelType.FLOW))
    assert "causal / autoregressive" in msg, msg


def test_ltx2_is_refused(env):
    import torch

    # Upstream: class LTXAV(BaseModel) with unet_model=comfy.ldm.lightricks.av_model.LTXAVModel.
    av_dm = type("LTXAVModel", (torch.nn.Module,), {"__module__": "comfy.ldm.lightricks.av_model"})
    ltxav = type("LTXAV", (env.mb.BaseModel,), {})
    msg = refusal(env, bare(ltxav, diffusion_model=bare(av_dm), model_type=env.mb.ModelType.FLUX))
    assert "LTX-2" in msg, msg


@pytest.mark.parametrize("base_name, dm_path", [
    ("WAN21_Vace", "comfy.ldm.wan.model.VaceWanModel"),
    ("WAN21_Camera", "comfy.ldm.wan.model.CameraWanModel"),
    ("WAN21_HuMo", "comfy.ldm.wan.model.HumoWanModel"),
    ("WAN22_S2V", "comfy.ldm.wan.model.WanModel_S2V"),
    ("WAN22_Animate", "comfy.ldm.wan.model_animate.AnimateWanModel"),
])
def test_conditioned_wan_variants_of_the_host_are_refused(env, base_name, dm_path):
    import importlib

    module, cls = dm_path.rsplit(".", 1)
    dm = bare(getattr(importlib.import_module(module), cls), model_type="t2v")
    msg = refusal(env, bare(getattr(env.mb, base_name), diffusion_model=dm, model_type=env.mb.ModelType.FLOW))
    assert f"Wan variant {base_name}" in msg and "extra conditioning" in msg, msg


def test_image_to_video_wan_and_other_video_models_are_refused(env):
    from comfy.ldm.wan.model import WanModel

    msg = refusal(env, bare(env.mb.WAN21, diffusion_model=bare(WanModel, model_type="i2v"),
                            model_type=env.mb.ModelType.FLOW))
    assert "Wan text-to-video" in msg and "model_type=i2v" in msg, msg
    msg = refusal(env, bare(env.mb.HunyuanVideo, diffusion_model=None, model_type=env.mb.ModelType.FLOW))
    assert "got HunyuanVideo" in msg, msg
