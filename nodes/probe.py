"""Carnator Early Probe node: runs the first k steps of the request's real schedule (thin: one core call)."""
from __future__ import annotations

import comfy.samplers
import comfy.utils

from ..carnator_core.cache import CacheHandle, open_store
from ..carnator_core.probe import ProbeConfig, ProbeConfigError, stage_bounds
from ..carnator_core.request import RULE_CONTEXT_KV_MB, RequestSpec, probe_request
from ..carnator_core.types import STAGE_END_MAX, Stage
from ._api import CACHE, PROBE, TEXT_ENCODER, io
from ._common import advanced, mark_advanced, parse_int_list, stage_from, stage_inputs


class CarnatorEarlyProbe(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CarnatorEarlyProbe",
            display_name="Carnator Early Probe",
            category="Carnator",
            description="Runs the first steps of this request's real schedule and looks inside the model "
                        "(object cross-attention, x0 prediction). The Joint Reuse Sampler resumes from it, so "
                        "the probe is never wasted. With a cache connected, an exact repeat of a cached request "
                        "(same model, settings, conditioning, seed and latent) is answered from the cache without "
                        "running the model. Split schedules (Wan 2.2 14B's two experts): set the advanced "
                        "stage inputs as on KSamplerAdvanced and connect the second expert to second_model.",
            inputs=[
                io.Model.Input("model", tooltip="Wan 2.1, Wan 2.2 TI2V, LTX-Video or the Carnator embedded model."),
                io.Conditioning.Input("positive", tooltip="Positive text conditioning of the request."),
                io.Conditioning.Input("negative", tooltip="Negative text conditioning of the request."),
                io.Latent.Input("latent_image", tooltip="The empty video latent to generate into."),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=True,
                             tooltip="Noise seed (the same seed as a plain KSampler gives the same clip)."),
                io.Int.Input("steps", default=20, min=2, max=10000, tooltip="Total sampling steps of the request."),
                io.Float.Input("cfg", default=5.0, min=0.0, max=100.0, step=0.1, round=0.01,
                               tooltip="Classifier-free guidance scale."),
                io.Combo.Input("sampler_name", options=comfy.samplers.SAMPLER_NAMES, default="euler",
                               tooltip="Sampler; must be resumable (one model call per step)."),
                io.Combo.Input("scheduler", options=comfy.samplers.SCHEDULER_NAMES, default="simple",
                               tooltip="Sigma schedule."),
                mark_advanced(io.Int.Input("probe_steps", default=4, min=0, max=1000,
                                           tooltip="How many of the first steps to probe (0 = use probe_fraction). "
                                                   "Risk rules are calibrated at a given k (4 for the shipped "
                                                   "ones).")),
                io.String.Input("prompt", multiline=True, default="",
                                tooltip="The prompt text (the same text the positive conditioning was encoded "
                                        "from): objects are the nouns it names."),
                io.Clip.Input("clip", optional=True,
                              tooltip="The text encoder used for the positive prompt: maps object words to token "
                                      "positions. Without it objects cannot be located."),
                TEXT_ENCODER.Input("text_encoder", optional=True,
                                   tooltip="For the Carnator embedded model: its text encoder (instead of a CLIP)."),
                CACHE.Input("cache", optional=True,
                            tooltip="Optional Carnator Cache: an exact repeat of a cached dense generation is "
                                    "answered from it before the probe, with no model call."),
                io.String.Input("objects", default="", optional=True,
                                tooltip="Optional override: comma-separated objects (e.g. 'red ball, cube'). "
                                        "Empty = extract nouns from the prompt."),
                advanced(io.Float.Input("probe_fraction", default=0.2, min=0.01, max=0.95, step=0.01,
                               tooltip="Fraction of the schedule to probe when probe_steps is 0.")),
                advanced(io.Float.Input("probe_sigma", default=0.0, min=0.0, max=1000.0, step=0.01,
                                        tooltip="When > 0 and probe_steps is 0: probe until sigma first drops to "
                                                "this value (k by noise level instead of step count).")),
                advanced(io.String.Input("capture_layers", default="",
                                tooltip="Blocks whose cross-attention is captured, e.g. '1,2'. Empty = middle "
                                        "layers (what risk rules are calibrated with: the Risk Filter rejects "
                                        "signatures from other capture layers than its rule's).")),
                advanced(io.Float.Input("denoise", default=1.0, min=0.0, max=1.0, step=0.01,
                               tooltip="Denoise strength, as in KSampler.")),
                *stage_inputs("probe"),
                advanced(io.Float.Input("context_kv_mb", default=RULE_CONTEXT_KV_MB, min=0.0, max=1.0e6, step=16.0,
                                        tooltip="Keep every token's attention keys/values of the last probe step "
                                                "when they fit in this many MiB (0 = never), as a hit's first "
                                                "context (the Joint Reuse Sampler's probe_context). The shipped "
                                                f"rule was certified with them at {RULE_CONTEXT_KV_MB:g}: below "
                                                "that its hits continue dense. The embedded model needs ~10; "
                                                "Wan at 480p keeps nothing (~12 GiB; its hits refresh densely). "
                                                "Held with the probe's output until the next run.")),
                io.Model.Input("second_model", optional=True,
                               tooltip="Split schedules only: the model that finishes the schedule after "
                                       "end_at_step (Wan 2.2 14B: the low-noise expert; a single-model split: the "
                                       "same MODEL). Required when the stage returns leftover noise: it and the "
                                       "switch step are part of the cache namespace."),
            ],
            outputs=[PROBE.Output(display_name="probe"), io.String.Output(display_name="summary")],
        )

    @classmethod
    def validate_inputs(cls, steps: int | None = None, probe_steps: int | None = None, start_at_step: int = 0,
                        end_at_step: int = STAGE_END_MAX, return_with_leftover_noise: str = "disable") -> bool | str:
        # Checked at POST /prompt so the client gets a 400 at once, not an error after the probe ran. Naming
        # these inputs turns off ComfyUI's own min/max check for them, so the ranges are checked here too.
        # Linked inputs are absent here (None or the default): they are checked at execution.
        if start_at_step is None or end_at_step is None:
            return True
        stage = Stage(int(start_at_step), int(end_at_step), True, return_with_leftover_noise == "enable")
        if steps is None:
            try:
                stage.bounds(STAGE_END_MAX)
            except ValueError as e:
                return str(e)
            return True
        if not 2 <= int(steps) <= 10000:
            return f"steps must be in [2, 10000], got {steps}"
        try:
            stage.bounds(int(steps))
            # second_model is a link (not known here): only the stage itself is checked
            start, end = stage_bounds(stage, int(steps), second_connected=stage.leaves_noise(int(steps)))
            if probe_steps is not None:
                if not 0 <= int(probe_steps) <= 1000:
                    return f"probe_steps must be in [0, 1000], got {probe_steps}"
                if int(probe_steps) > 0:
                    ProbeConfig(probe_steps=int(probe_steps)).resolve_steps(
                        end - start, of="the total steps" if stage.is_whole(int(steps)) else
                        f"the steps of its stage [{start}, {end})")
        except (ProbeConfigError, ValueError) as e:
            return str(e)
        return True

    @classmethod
    def execute(cls, model, positive, negative, latent_image, seed, steps, cfg, sampler_name, scheduler,
                probe_steps, prompt, clip=None, text_encoder=None, objects="", probe_fraction=0.2, probe_sigma=0.0,
                capture_layers="", denoise=1.0, cache=None, add_noise="enable", start_at_step=0,
                end_at_step=STAGE_END_MAX, return_with_leftover_noise="disable", second_model=None,
                context_kv_mb=RULE_CONTEXT_KV_MB) -> io.NodeOutput:
        config = ProbeConfig(probe_steps=probe_steps, probe_fraction=probe_fraction, probe_sigma=probe_sigma,
                             layers=parse_int_list(capture_layers, "capture_layers"),
                             context_kv_mb=float(context_kv_mb))
        if cache is not None and not isinstance(cache, CacheHandle):
            raise TypeError("the 'cache' input is not a Carnator cache: connect the output of a Carnator Cache node")
        spec = RequestSpec(prompt=prompt, seed=seed, steps=steps, cfg=cfg, sampler=sampler_name, scheduler=scheduler,
                           objects=objects or None, denoise=denoise,
                           stage=stage_from(add_noise, start_at_step, end_at_step, return_with_leftover_noise))
        # The probe is the start of the generation: its bar counts the request's steps (the sampler finishes it).
        pbar = comfy.utils.ProgressBar(steps)
        probe = probe_request(model, positive, negative, latent_image, spec, config,
                              clip if clip is not None else text_encoder,
                              store=open_store(cache) if cache is not None else None,
                              progress=lambda i: pbar.update_absolute(start_at_step + i + 1, steps),
                              second_model=second_model)
        if probe.answered is not None:
            pbar.update_absolute(steps, steps)
            return io.NodeOutput(probe, probe.note)
        source = probe.object_source
        k = probe.probe_steps
        names = ", ".join(f"{o.name}({len(o.positions)} tok)" for o in probe.objects) or "none"
        g = probe.config
        where = f" of stage [{g.start_step}, {g.stage_end})" + (" + second model" if g.second_model else "") \
            if g.split else ""
        summary = (f"probe {k}/{steps} steps{where} on {probe.arch} in {probe.timings['probe_ms']:.0f} ms; "
                   f"objects [{source}]: {names}" + (f"; {probe.note}" if probe.note else ""))
        return io.NodeOutput(probe, summary)


NODES = [CarnatorEarlyProbe]
