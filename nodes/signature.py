"""Carnator Signature Builder node: Early Probe -> Early Signature (thin: validate, build config, one core call)."""
from __future__ import annotations

from ..carnator_core.request import signature_stage
from ..carnator_core.signature import SignatureConfig, summarize
from ..carnator_core.types import Probe
from ._api import PROBE, SIGNATURE, io
from ._common import advanced

_DEFAULT = SignatureConfig()


class CarnatorSignatureBuilder(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CarnatorSignatureBuilder",
            display_name="Carnator Signature Builder",
            category="Carnator",
            description=(
                "Builds the request's Early Signature from the Early Probe: per object a soft spatiotemporal "
                "support mask over the token grid, its relative size and mean CIELAB colour, plus the colour of "
                "the non-object context on a coarse grid. The Risk Filter compares it with cached generations. "
                "Risk rules are calibrated with the settings below at their defaults (or record others): the "
                "Risk Filter rejects a signature built with settings other than its rule's, and a cached one "
                "built with settings other than the request's."
            ),
            inputs=[
                PROBE.Input("probe", tooltip="The Early Probe of this request (Carnator Early Probe)."),
                advanced(io.Float.Input(
                    "baseline_quantile", default=_DEFAULT.baseline_quantile, min=0.0, max=0.99, step=0.01,
                    tooltip="Quantile of an object's attention map read as 'not the object' (0.5 suits objects "
                            "smaller than half the frame). Risk rules are calibrated with the defaults.")),
                advanced(io.Float.Input(
                    "mask_low", default=_DEFAULT.low, min=0.0, max=1.0, step=0.01,
                    tooltip="Normalised attention below this is outside the object's mask.")),
                advanced(io.Float.Input(
                    "mask_high", default=_DEFAULT.high, min=0.0, max=1.0, step=0.01,
                    tooltip="Normalised attention above this is fully inside the mask (linear ramp from mask_low; "
                            "equal values give a hard threshold).")),
                advanced(io.Float.Input(
                    "min_contrast", default=_DEFAULT.min_contrast, min=0.0, max=0.99, step=0.001,
                    tooltip="An attention map whose peak exceeds its baseline by at most this fraction of the peak "
                            "is treated as not localised (empty mask).")),
                advanced(io.Float.Input(
                    "smooth_sigma_hw", default=_DEFAULT.smooth_sigma_hw, min=0.0, max=8.0, step=0.1,
                    tooltip="Gaussian smoothing of each attention map across height/width, in tokens (0 = off).")),
                advanced(io.Float.Input(
                    "smooth_sigma_t", default=_DEFAULT.smooth_sigma_t, min=0.0, max=8.0, step=0.1,
                    tooltip="Gaussian smoothing of each attention map across time, in tokens (0 = off).")),
                advanced(io.Int.Input(
                    "context_dilation", default=_DEFAULT.context_dilation, min=0, max=16,
                    tooltip="Grow the object masks by this many tokens before measuring the context colour, so "
                            "object pixels at the edges do not count as background.")),
                advanced(io.Int.Input(
                    "context_rows", default=_DEFAULT.context_grid[0], min=1, max=64,
                    tooltip="Rows of the coarse grid on which the context (non-object) colour is measured.")),
                advanced(io.Int.Input(
                    "context_cols", default=_DEFAULT.context_grid[1], min=1, max=64,
                    tooltip="Columns of the coarse context-colour grid.")),
            ],
            outputs=[SIGNATURE.Output(display_name="signature"), io.String.Output(display_name="summary")],
        )

    @classmethod
    def execute(cls, probe, baseline_quantile=_DEFAULT.baseline_quantile, mask_low=_DEFAULT.low,
                mask_high=_DEFAULT.high, min_contrast=_DEFAULT.min_contrast, smooth_sigma_hw=_DEFAULT.smooth_sigma_hw,
                smooth_sigma_t=_DEFAULT.smooth_sigma_t, context_dilation=_DEFAULT.context_dilation,
                context_rows=_DEFAULT.context_grid[0], context_cols=_DEFAULT.context_grid[1]) -> io.NodeOutput:
        if not isinstance(probe, Probe):
            raise TypeError(f"'probe' must come from a Carnator Early Probe node, got {type(probe).__name__}")
        config = SignatureConfig(baseline_quantile=float(baseline_quantile), low=float(mask_low),
                                 high=float(mask_high), min_contrast=float(min_contrast),
                                 smooth_sigma_t=float(smooth_sigma_t), smooth_sigma_hw=float(smooth_sigma_hw),
                                 context_dilation=int(context_dilation),
                                 context_grid=(int(context_rows), int(context_cols)))
        signature, ms = signature_stage(probe, config)
        if probe.answered is not None:
            return io.NodeOutput(signature, f"exact repeat: the stored signature of entry {probe.answered.entry_id}")
        return io.NodeOutput(signature, summarize(signature, build_ms=ms))


NODES = [CarnatorSignatureBuilder]
