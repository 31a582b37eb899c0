"""Small helpers shared by Carnator's node modules (not a node module itself: discovery skips '_' names)."""
from __future__ import annotations

import inspect
from typing import TypeVar

from ._api import io

T = TypeVar("T")

#: Newer hosts take ``Input(advanced=...)`` and serialise it themselves; ComfyUI 0.3.75's V3 inputs have no
#: such argument, so there the flag goes into the input's extra dict (which the frontend reads the same way).
HOST_HAS_ADVANCED = "advanced" in inspect.signature(io.Input.__init__).parameters


def mark_advanced(inp: T) -> T:
    """Mark a tuning knob as advanced: the frontend folds such widgets away."""
    if HOST_HAS_ADVANCED:
        inp.advanced = True  # type: ignore[attr-defined]
    else:
        inp.extra_dict["advanced"] = True  # type: ignore[attr-defined]
    return inp


def advanced(inp: T) -> T:
    """Mark a tuning knob as advanced and optional, so API-format prompts may omit it and get its default
    (``execute`` must declare the same default)."""
    mark_advanced(inp)
    inp.optional = True  # type: ignore[attr-defined]
    return inp


def optional(inp: T) -> T:
    """An optional input that stays on the node (not advanced): API-format prompts may omit it and get its default
    (``execute`` must declare the same default). Optional inputs come after the required ones in the widget order,
    so turning an advanced knob into a shown one with this keeps saved workflows' widget values in place."""
    inp.optional = True  # type: ignore[attr-defined]
    return inp


def parse_int_list(text: str, what: str) -> tuple[int, ...]:
    text = (text or "").strip()
    if not text:
        return ()
    try:
        return tuple(int(t) for t in text.replace(";", ",").split(",") if t.strip())
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers like '2,3,4' (got {text!r})") from None


def stage_inputs(who: str) -> list:
    """KSamplerAdvanced's stage inputs (same names, values and defaults), as advanced widgets: which steps of the
    schedule this node runs, for split schedules such as Wan 2.2 14B's two experts."""
    from ..carnator_core.types import STAGE_END_MAX

    return [
        advanced(io.Combo.Input("add_noise", options=["enable", "disable"], default="enable",
                                tooltip=f"As in KSamplerAdvanced: add the seed's noise to the latent. 'disable' for "
                                        f"a stage that continues another stage's leftover noise ({who})." )),
        advanced(io.Int.Input("start_at_step", default=0, min=0, max=STAGE_END_MAX,
                              tooltip="As in KSamplerAdvanced: the first step of the schedule this node runs (the "
                                      "switch step for a second stage).")),
        advanced(io.Int.Input("end_at_step", default=STAGE_END_MAX, min=0, max=STAGE_END_MAX,
                              tooltip="As in KSamplerAdvanced: the step this node stops at (10000 = the end of the "
                                      "schedule; Wan 2.2 14B's high-noise expert: the switch step).")),
        advanced(io.Combo.Input("return_with_leftover_noise", options=["disable", "enable"], default="disable",
                                tooltip="As in KSamplerAdvanced: a stage ending before the schedule returns its "
                                        "latent with the noise left for the next stage ('enable') instead of "
                                        "denoising it fully.")),
    ]


def stage_from(add_noise: str, start_at_step: int, end_at_step: int, return_with_leftover_noise: str):
    """The core's ``Stage`` from the node inputs of ``stage_inputs``."""
    from ..carnator_core.types import Stage

    return Stage(int(start_at_step), int(end_at_step), add_noise != "disable", return_with_leftover_noise == "enable")
