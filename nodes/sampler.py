"""Carnator Joint Reuse Sampler node: finishes the request the Early Probe started (thin: one core call)."""
from __future__ import annotations

import logging

import comfy.utils

from ..carnator_core.cache.handle import open_store
from ..carnator_core.request import reuse_stage
from ..carnator_core.reuse import MODES, SPARSE_KERNELS, ReuseConfig, certified_settings
from ..carnator_core.types import STAGE_END_MAX, Stage, namespace_key
from ._api import CACHE, DECISION, PROBE, REPORT, SIGNATURE, io
from . import _history
from ._common import advanced, optional, stage_from, stage_inputs

log = logging.getLogger("carnator")

SETTINGS = ("certified", "custom")


class CarnatorJointReuseSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CarnatorJointReuseSampler",
            display_name="Carnator Joint Reuse Sampler",
            category="Carnator",
            description="Finishes a probed request. If the Risk Filter accepted a cache entry, only the region that "
                        "differs is recomputed, over the attention structure of the cached run; otherwise it "
                        "continues dense (identical to KSampler) and records the attention structure for the cache. "
                        "On a split schedule (Wan 2.2 14B) use one per expert, with KSamplerAdvanced's stage inputs: "
                        "the probe's stage on the first, the rest (add_noise disabled) on the second.",
            inputs=[
                io.Model.Input("model", tooltip="The same MODEL the Early Probe ran on."),
                io.Conditioning.Input("positive", tooltip="The same positive conditioning as the probe."),
                io.Conditioning.Input("negative", tooltip="The same negative conditioning as the probe."),
                io.Latent.Input("latent_image", tooltip="The same latent as the probe."),
                PROBE.Input("probe", tooltip="Early Probe output: the sampler resumes from it (the probe's steps "
                                             "are replayed, not recomputed)."),
                DECISION.Input("decision", optional=True,
                               tooltip="Risk Filter decision. Not connected = dense generation."),
                SIGNATURE.Input("signature", optional=True,
                                tooltip="The request's Early Signature (needed to derive the active region)."),
                CACHE.Input("cache", optional=True, tooltip="The cache the accepted entry comes from."),
                io.Combo.Input("mode", options=list(MODES), default="joint",
                               tooltip="joint = region + sparse attention; latent / attention = one axis only "
                                       "(ablations); dense = never reuse. The attention axis is OFF wherever it "
                                       "cannot pay (sparse_kernel = cost): at the embedded model's 576 tokens on "
                                       "the CPU and for every token subset on CUDA the recorded structure is never "
                                       "applied, so joint = latent there, and attention mode computes every token "
                                       "and pair: it continues dense and is reported as a miss."),
                advanced(io.Int.Input("dense_first_layers", default=0, min=0, max=100,
                                      tooltip="First transformer blocks always computed densely (0: every block "
                                              "computes only the changed region, over the full context).")),
                advanced(io.Int.Input("dense_last_layers", default=0, min=0, max=100,
                                      tooltip="Last transformer blocks always computed densely.")),
                advanced(io.Int.Input("refreshes", default=3, min=1, max=1000,
                                      tooltip="Dense calls (spread over the steps after the probe) that refresh "
                                              "the keys/values the changed region attends to; more = closer to "
                                              "dense, costlier.")),
                advanced(io.Float.Input("x0_threshold", default=1.0, min=0.0, max=100.0, step=0.05,
                                        tooltip="Tokens whose x0 predictions differ by more than this multiple "
                                                "of the typical magnitude are recomputed.")),
                advanced(io.Int.Input("dilation", default=1, min=0, max=16,
                                      tooltip="Tokens of margin around the active region.")),
                advanced(io.Float.Input("max_active", default=0.6, min=0.0, max=1.0, step=0.05,
                                        tooltip="Largest changed region (fraction of the tokens) worth reusing; a "
                                                "larger one continues dense (reported as a miss): it would cost "
                                                "about a dense run. The shipped rule is certified at 0.6.")),
                advanced(io.Int.Input("block_size", default=0, min=0, max=1024,
                                      tooltip="Tokens per attention block when recording structure "
                                              "(0 = automatic: ~16 blocks, 16..128 tokens).")),
                advanced(io.Float.Input("record_mass", default=0.9, min=0.5, max=1.0, step=0.01,
                                        tooltip="Attention mass the recorded key blocks must cover.")),
                *stage_inputs("the second expert's sampler"),
                advanced(io.Boolean.Input("probe_context", default=False,
                                          tooltip="On a hit, attend to the keys/values the Early Probe kept at its "
                                                  "last step instead of computing the first step after the probe "
                                                  "densely (one dense step fewer, same quality on the embedded "
                                                  "model). Needs the Early Probe's context_kv_mb (default "
                                                  "64 MiB). The shipped rule was certified with it on "
                                                  "(settings = certified: the rule's value).")),
                optional(io.Combo.Input("settings", options=list(SETTINGS), default="certified",
                                        tooltip="certified: on a hit, reuse with exactly the settings the risk "
                                                "rule was certified with (the decision carries them; the tuning "
                                                "inputs above then apply only where the rule records none). "
                                                "custom: the inputs above, always — a hit whose rule certified "
                                                "other settings then continues dense and names them. Shown on the "
                                                "node (the tuning inputs are advanced).")),
                advanced(io.Float.Input("motion_shift", default=0.0, min=0.0, max=1.0, step=0.005,
                                        tooltip="Recompute an object whole when its drift over the clip (the "
                                                "probe's mask centroid, first to last frame) differs from the "
                                                "cached run's by more than this fraction of the frame: a changed "
                                                "motion the masks do not show yet. 0 = off, as the shipped plain "
                                                "rule was certified (settings = certified: the rule's value).")),
                advanced(io.Combo.Input("sparse_kernel", options=list(SPARSE_KERNELS), default="cost",
                                        tooltip="joint mode: cost = restrict a layer's attention to the cached "
                                                "run's recorded blocks only where that is estimated to be faster "
                                                "than attending to every key (CPU, long sequences, sparse "
                                                "structure); that is never at the embedded model's 576 tokens and "
                                                "never for a token subset on CUDA (measured slower than plain "
                                                "attention on an H200), so there the attention axis is off; "
                                                "always = wherever the structure is not nearly dense (what rules "
                                                "certified before this setting ran; slower where cost says no).")),
                advanced(io.String.Input("refresh_at", default="",
                                         tooltip="Where the dense refreshes after the first run, as fractions of "
                                                 "the steps after the probe, one per refresh after the first "
                                                 "(e.g. 0.6,0.9 with refreshes 3: late, where the details form). "
                                                 "Empty = spread evenly. settings = certified: the rule's value.")),
            ],
            outputs=[io.Latent.Output(display_name="LATENT"), REPORT.Output(display_name="report"),
                     io.String.Output(display_name="summary")],
        )

    @classmethod
    def validate_inputs(cls, start_at_step: int = 0, end_at_step: int = STAGE_END_MAX, refreshes: int = 3,
                        refresh_at: str = "") -> bool | str:
        # The placement of the refreshes is checked here, at queue time; with settings = certified the rule's
        # placement replaces it on a hit, but a malformed one is a mistake either way.
        if isinstance(refreshes, int) and isinstance(refresh_at, str):
            try:
                ReuseConfig(refreshes=refreshes, refresh_at=refresh_at).validate()
            except ValueError as e:
                return str(e)
        # The steps are the probe's (known at execution): here only the stage's own range is checked.
        if start_at_step is None or end_at_step is None:  # linked: checked at execution
            return True
        try:
            Stage(int(start_at_step), int(end_at_step)).bounds(STAGE_END_MAX)
        except ValueError as e:
            return str(e)
        return True

    @classmethod
    def execute(cls, model, positive, negative, latent_image, probe, decision=None, signature=None, cache=None,
                mode="joint", dense_first_layers=0, dense_last_layers=0, refreshes=3, x0_threshold=1.0,
                dilation=1, max_active=0.6, block_size=0, record_mass=0.9, add_noise="enable", start_at_step=0,
                end_at_step=STAGE_END_MAX, return_with_leftover_noise="disable", probe_context=False,
                settings="certified", motion_shift=0.0, sparse_kernel="cost", refresh_at="") -> io.NodeOutput:
        if settings not in SETTINGS:
            raise ValueError(f"settings must be one of {list(SETTINGS)}, got {settings!r}")
        config = ReuseConfig(mode=mode, first_dense=dense_first_layers, last_dense=dense_last_layers,
                             refreshes=refreshes, refresh_at=str(refresh_at or ""), x0_threshold=x0_threshold,
                             dilation=dilation, max_active=max_active, block_size=block_size, record_mass=record_mass,
                             probe_context=bool(probe_context), motion_shift=float(motion_shift),
                             sparse_kernel=sparse_kernel).validate()
        if settings == "certified":
            config = certified_settings(config, decision)
        total = probe.config.steps
        pbar = comfy.utils.ProgressBar(total)
        samples, report = reuse_stage(model, positive, negative, latent_image, probe, decision,
                                      open_store(cache) if cache is not None else None, config, signature=signature,
                                      progress=lambda i: pbar.update_absolute(i + 1, total),
                                      upstream_ms={"filter": decision.filter_ms} if decision is not None else None,
                                      stage=stage_from(add_noise, start_at_step, end_at_step,
                                                       return_with_leftover_noise),
                                      answer_hits=cache is not None)
        if probe.answered is not None:
            pbar.update_absolute(total, total)
        log.info("carnator request: %s", report.summary())
        out = latent_image.copy()
        out["samples"] = samples
        out.pop("noise_mask", None)
        meta = report.to_meta()
        if decision is not None:
            meta["verdicts"] = decision.to_meta()["verdicts"]
            meta["decision_summary"] = decision.summary
            meta["rule_id"] = decision.rule_id  # which certified rule decided ("" for prompt-only or forced)
            if decision.certified_strata is not None:  # the badge names them: a rule may certify none of them
                meta["certified_strata"] = list(decision.certified_strata)
            if decision.learning is not None:
                meta["rule_state"] = learning_state(model, positive, negative, latent_image, probe, signature,
                                                    decision, samples, report, cache, config)
            meta["filter_mode"] = decision.mode  # "never": the Risk Filter was told to keep every request dense
        # What the node was asked for: mode "dense" forces dense whatever the filter said (the badge says DENSE).
        meta["requested_mode"] = mode
        meta["settings"] = settings
        _history.record(namespace_key(probe.model_fingerprint, probe.config), meta, prompt=probe.prompt,
                        seed=probe.seed, thumb=_history.thumbnail(samples, model))
        return io.NodeOutput(out, report, report.summary(), ui={"carnator_report": [meta]})


def learning_state(model, positive, negative, latent_image, probe, signature, decision, samples, report, cache,
                   config) -> dict:
    """Learning mode after the request is served (``carnator_core.learn.runtime.observe``): label within the
    budget, and the rule_state the badge shows. The record is the cache's: ``learn.sqlite`` in a cache folder, or
    the Redis cache's own (every worker on that Redis learns the same rule). A record that cannot be used (Redis
    down, a damaged or unwritable learn.sqlite) costs the label, never the request: the state says so."""
    from ..carnator_core.learn.labels import LabelStoreError
    from ..carnator_core.learn.runtime import observe

    ns = str((decision.learning or {}).get("namespace", ""))
    if cache is None:
        return {"state": "learning", "labels": 0, "needed": 0, "namespace": ns,
                "message": "learning — no labels: connect a Carnator Cache; served dense, reuse stays off"}
    served_s = (float(report.timings_ms.get("resume", 0.0)) + float(probe.timings.get("probe_ms", 0.0))) / 1000.0
    try:
        state = observe(directory=cache.path, model=model, positive=positive, negative=negative, latent=latent_image,
                        probe=probe, signature=signature, decision=decision, samples=samples, report=report,
                        store=open_store(cache), reuse_config=config, served_s=served_s, pending=_pending_prompts)
        from .warmup import remember_request  # the idle-time worker edits this namespace's cached scenes

        remember_request(model, negative, latent_image, probe, signature, decision, cache, config)
        return state
    except LabelStoreError as e:
        # the clip is served whatever the record's trouble (damaged, unwritable, a link, Redis down): said on the
        # badge every time, in the log once per cause
        if str(e) not in _SAID:
            _SAID.add(str(e))
            log.warning("carnator learning: %s", e)
        return {"state": "learning", "labels": 0, "needed": 0, "namespace": ns,
                "message": f"learning — no label this time: {e}"}


_SAID: set[str] = set()


def _pending_prompts() -> int:
    """Prompts waiting in ComfyUI's queue besides the one running (0 when the server cannot be asked)."""
    import sys

    server = sys.modules.get("server")
    instance = getattr(getattr(server, "PromptServer", None), "instance", None)
    queue = getattr(instance, "prompt_queue", None)
    try:
        return max(int(queue.get_tasks_remaining()) - 1, 0) if queue is not None else 0
    except Exception:  # noqa: BLE001 — only a preference; never fail a request over it
        return 0


NODES = [CarnatorJointReuseSampler]
