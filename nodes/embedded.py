"""Nodes for Carnator's embedded default model (a small WanModel trained on a procedural video world).

Loader -> MODEL + CARNATOR_TEXT_ENCODER + CARNATOR_EMBEDDED_DECODER; text encode -> CONDITIONING; empty
latent of the model's geometry; decode LATENT -> IMAGE frames. ComfyUI's stock KSampler samples the MODEL.
See docs/MODEL_CARD.md for the world, vocabulary and measured quality.
"""
from __future__ import annotations

from ..carnator_core.embedded import comfy_glue, config
from ._api import EMBEDDED_DECODER, TEXT_ENCODER, io
from ._common import advanced


class CarnatorEmbeddedLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CarnatorEmbeddedLoader",
            display_name="Carnator Embedded Model Loader",
            category="Carnator",
            description="Loads Carnator's embedded text-to-video model (ComfyUI WanModel trained on a "
                        "procedural world of coloured shapes; ships with the extension, needs no download).",
            inputs=[
                advanced(io.String.Input("weights_path", default="",
                                tooltip="Path to a weights file; empty uses the shipped "
                                        f"{config.DEFAULT_WEIGHTS.name}.")),
            ],
            outputs=[
                io.Model.Output(display_name="MODEL", tooltip="The denoiser, for the stock KSampler."),
                TEXT_ENCODER.Output(display_name="TEXT_ENCODER",
                                   tooltip="The embedded world's text encoder (use Carnator Embedded Text Encode)."),
                EMBEDDED_DECODER.Output(display_name="DECODER",
                                        tooltip="Latent-to-frames decoder (Carnator Embedded Decode)."),
            ],
        )

    @classmethod
    def execute(cls, weights_path: str = "") -> io.NodeOutput:
        model, enc, dec = comfy_glue.load_embedded(weights_path.strip() or None)
        return io.NodeOutput(model, enc, dec)


class CarnatorEmbeddedTextEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CarnatorEmbeddedTextEncode",
            display_name="Carnator Embedded Text Encode",
            category="Carnator",
            description="Encodes a prompt for the embedded model. Unknown words are ignored with a warning.",
            inputs=[
                TEXT_ENCODER.Input("text_encoder", tooltip="From Carnator Embedded Model Loader."),
                io.String.Input("text", multiline=True,
                                default="a big red ball moves to the right in the top left, on green grass",
                                tooltip="Prompt in the embedded world's vocabulary (see docs/MODEL_CARD.md); "
                                        "leave empty for the negative/unconditional prompt."),
            ],
            outputs=[io.Conditioning.Output(tooltip="Conditioning for KSampler.")],
        )

    @classmethod
    def execute(cls, text_encoder: comfy_glue.EmbeddedTextEncoder, text: str) -> io.NodeOutput:
        return io.NodeOutput(text_encoder.encode(text))


class CarnatorEmbeddedEmptyLatent(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        c, t, h, w = config.LATENT_SHAPE
        return io.Schema(
            node_id="CarnatorEmbeddedEmptyLatent",
            display_name="Carnator Embedded Empty Latent",
            category="Carnator",
            description=f"An empty latent of the embedded model's fixed geometry [{c}, {t}, {h}, {w}] "
                        f"({t} frames of {config.WIDTH}x{config.HEIGHT} px).",
            inputs=[io.Int.Input("batch_size", default=1, min=1, max=256,
                                 tooltip="Number of clips to generate at once.")],
            outputs=[io.Latent.Output(tooltip="Empty latent for KSampler.")],
        )

    @classmethod
    def execute(cls, batch_size: int = 1) -> io.NodeOutput:
        return io.NodeOutput(comfy_glue.empty_latent(batch_size))


class CarnatorEmbeddedDecode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CarnatorEmbeddedDecode",
            display_name="Carnator Embedded Decode",
            category="Carnator",
            description="Decodes embedded-model latents to IMAGE frames (all clips' frames in order).",
            inputs=[
                EMBEDDED_DECODER.Input("decoder", tooltip="From Carnator Embedded Model Loader."),
                io.Latent.Input("samples", tooltip="Latent from KSampler."),
                advanced(io.Int.Input("upscale", default=4, min=1, max=16,
                             tooltip="Nearest-neighbour enlargement for viewing (1 = native 32x32).")),
            ],
            outputs=[io.Image.Output(tooltip="Frames [batch*frames, H, W, 3] in 0..1.")],
        )

    @classmethod
    def execute(cls, decoder: comfy_glue.EmbeddedDecoder, samples: dict, upscale: int = 4) -> io.NodeOutput:
        frames = decoder.decode(samples["samples"])
        if upscale > 1:
            frames = frames.repeat_interleave(upscale, dim=1).repeat_interleave(upscale, dim=2)
        return io.NodeOutput(frames.contiguous())


NODES = [CarnatorEmbeddedLoader, CarnatorEmbeddedTextEncode, CarnatorEmbeddedEmptyLatent, CarnatorEmbeddedDecode]
