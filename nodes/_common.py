"""Small helpers shared by Carnator's node modules (not a node module itself: discovery skips '_' names)."""
from __future__ import annotations

from typing import Any, TypeVar

T = TypeVar("T")


def advanced(inp: T) -> T:
    """Mark a tuning knob as advanced (the frontend folds such widgets away) and optional, so API-format
    prompts may omit it and get its default (``execute`` must declare the same default). ComfyUI 0.3.75's V3
    widget constructors have no ``advanced`` argument, so the flag goes into the input's extra dict."""
    inp.extra_dict["advanced"] = True  # type: ignore[attr-defined]
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
