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


def parse_int_list(text: str, what: str) -> tuple[int, ...]:
    text = (text or "").strip()
    if not text:
        return ()
    try:
        return tuple(int(t) for t in text.replace(";", ",").split(",") if t.strip())
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers like '2,3,4' (got {text!r})") from None
