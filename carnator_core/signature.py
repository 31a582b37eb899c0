"""The Signature Builder: an Early Probe -> the request's Early Signature.

Per object (one per ``probe.objects`` entry, in that order):

* **mask** — float32 [T, H, W] soft support over the token grid. The object's cross-attention map is first
  smoothed with a small Gaussian (``smooth_sigma_t`` / ``smooth_sigma_hw`` tokens: single-token attention spikes
  are noise, objects span several tokens), then read relative to its own range:
  ``r = (map - baseline) / (peak - baseline)`` where ``baseline`` is the ``baseline_quantile`` of the map (most
  of the grid is *not* the object, so a middle quantile is the level of attention that background tokens pay to
  the object's words) and ``peak`` its maximum. Then a linear ramp:
  ``mask = clip((r - low) / (high - low), 0, 1)``. A flat map (peak ≈ baseline: the probe found no localised
  attention) gives an empty mask and a note.
* **size** — the object's visible extent at the probe as a fraction of the grid, in [0, 1]: the tokens of its
  support grown by ``context_dilation`` whose colour is nearer the object's colour (below) than the context
  reference. (Attention mass alone hardly tells a big object from a small one — on the embedded model v2 a
  position change moved it as much as a size change — while the colour extent follows the size words: see
  tests/test_signature_semantics.py.)
* **lab** — mean CIELAB (scikit-image ``rgb2lab``, D65) of the x0 prediction over the *distinct half* of the
  object's support, weighted by the mask: the tokens whose colour is at least the (mask-weighted) median
  CIELAB distance from the context reference colour (the mean colour outside every object's mask). The
  early x0 is blurred, so the outer part of a support blends object and background; averaging it in pulls
  every object colour towards its background (measured on the embedded model v2 at the default probe step:
  the colour under the whole final mask names the final colour in 70% of clips, its distinct half in 94%).
  Latent -> RGB at token-grid resolution: average the latent cells of each token (``probe.patch``), apply the
  model's latent format ``latent_rgb_factors``/``latent_rgb_bias`` the way ComfyUI's latent previewer does
  (``v = x·F + b`` is RGB in [-1, 1]; ``rgb = clamp((v + 1) / 2, 0, 1)``). An empty mask takes the colour of the
  token where the object's attention peaks.

Context: the non-object weight of each token is ``1 - union`` where union is the elementwise max of the object
masks, grown by ``context_dilation`` tokens in H and W (an object's visible extent is usually a little larger
than where its words draw attention, and object pixels leaking into the context would make an object change
look like a background change); ``context_lab`` [gh, gw, 3] holds the context-weighted mean CIELAB of each cell
of a coarse ``context_grid`` over (H, W), averaged over time. Cells without context weight hold the global
context mean.

Pure numpy + scikit-image (no ComfyUI, no torch import: ``x0_probe`` is read through ``.detach()`` if it is a
tensor). Deterministic: the same probe gives a bit-identical signature.
"""
from __future__ import annotations

import functools
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
from scipy.ndimage import gaussian_filter, maximum_filter
from skimage.color import lab2rgb, rgb2lab

from .types import ObjectSignature, Probe, Signature, stable_digest

CONTEXT_ONLY_NOTE = "no recognisable objects: context-only signature"
META_KEY = "carnator_signature"


class MissingLatentRGBFactorsError(ValueError):
    """The model's latent format has no latent -> RGB factors, so colours cannot be measured."""


@dataclass(frozen=True)
class SignatureConfig:
    """Knobs of the Signature Builder (the defaults are the calibrated ones; risk rules are calibrated with them,
    so changing a knob means recalibrating the rule).

    baseline_quantile: quantile of an object's attention map taken as "not the object" (0 <= q < 1). 0.5 suits
                       objects that cover less than half of the frame.
    low, high:         soft-mask ramp on the normalised map (0 <= low <= high <= 1): below ``low`` -> 0, above
                       ``high`` -> 1, linear in between (``low == high`` gives a hard threshold).
    min_contrast:      a map whose (peak - baseline) is at most this fraction of its peak is flat: the object is
                       not localised, its mask is empty (noted in the signature).
    smooth_sigma_t, smooth_sigma_hw: Gaussian smoothing of each attention map before thresholding, in tokens
                       along time and along height/width (0 disables).
    context_dilation:  how many tokens (in H and W) the object union is grown by before the context weight is
                       taken; 0 uses the masks as they are.
    context_grid:      (rows, cols) of the coarse context-appearance grid over the token grid's (H, W).

    The defaults were chosen on the embedded model's probes (colour- and background-change prompt pairs, see
    tests/test_signature_semantics.py): smoothing and a 1-token context dilation roughly halve how much an object
    colour change moves the context axis, without changing the object axes.
    """

    baseline_quantile: float = 0.5
    low: float = 0.3
    high: float = 0.6
    min_contrast: float = 1e-3
    smooth_sigma_t: float = 0.5
    smooth_sigma_hw: float = 1.0
    context_dilation: int = 1
    context_grid: tuple[int, int] = (4, 4)

    def __post_init__(self) -> None:
        def finite(name: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"SignatureConfig.{name} must be a finite number, got {v!r}")
            return float(v)

        q, lo, hi, mc, st, shw = (finite(n) for n in ("baseline_quantile", "low", "high", "min_contrast",
                                                       "smooth_sigma_t", "smooth_sigma_hw"))
        if not 0.0 <= q < 1.0:
            raise ValueError(f"SignatureConfig.baseline_quantile must be in [0, 1), got {q}")
        if not 0.0 <= lo <= hi <= 1.0:
            raise ValueError(f"SignatureConfig needs 0 <= low <= high <= 1, got low={lo}, high={hi}")
        if not 0.0 <= mc < 1.0:
            raise ValueError(f"SignatureConfig.min_contrast must be in [0, 1), got {mc}")
        if st < 0 or shw < 0:
            raise ValueError(f"SignatureConfig smoothing sigmas must be >= 0, got t={st}, hw={shw}")
        d = self.context_dilation
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0:
            raise ValueError(f"SignatureConfig.context_dilation must be an integer >= 0, got {d!r}")
        g = tuple(self.context_grid)
        if len(g) != 2 or any(isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 1 for x in g):
            raise ValueError(f"SignatureConfig.context_grid must be two positive integers, got {self.context_grid!r}")
        object.__setattr__(self, "context_grid", (int(g[0]), int(g[1])))

    def to_meta(self) -> dict[str, Any]:
        return {"baseline_quantile": self.baseline_quantile, "low": self.low, "high": self.high,
                "min_contrast": self.min_contrast, "smooth_sigma_t": self.smooth_sigma_t,
                "smooth_sigma_hw": self.smooth_sigma_hw, "context_dilation": int(self.context_dilation),
                "context_grid": list(self.context_grid)}

    def digest(self, capture_layers: Sequence[int] = ()) -> str:
        """What a signature records of the settings it was built with — these and the probe's requested capture
        layers (() = the model's default, left out so that every default-built signature has one digest): two
        signatures compare (and a rule applies to them) only when their digests agree."""
        meta = self.to_meta()
        if capture_layers:
            meta["capture_layers"] = [int(i) for i in capture_layers]
        return stable_digest(meta, 12)


@functools.lru_cache(maxsize=1)
def _default_digest() -> str:
    return SignatureConfig().digest()


def settings_digest(signature: Signature) -> str:
    """The Signature Builder settings ``signature`` was built with (``SignatureConfig.digest``); a signature that
    records none was built before they were recorded, with the defaults."""
    return signature.config or _default_digest()


# --- latent -> RGB -> CIELAB on the token grid ---------------------------------------------------------------
def _as_numpy(x: Any) -> np.ndarray:
    """float32 numpy view/copy of an array or a torch tensor (without importing torch)."""
    if hasattr(x, "detach"):
        x = x.detach().to("cpu").float().numpy()
    return np.asarray(x, dtype=np.float32)


def _pool_to_grid(x: np.ndarray, grid: tuple[int, int, int], patch: tuple[int, int, int]) -> np.ndarray:
    """[C, T, H, W] -> [C, gT, gH, gW] float64 mean over each token's latent cells. A latent not a multiple of
    the patch is edge-padded first (as the models pad before patchify); a larger latent is cropped."""
    c = x.shape[0]
    want = tuple(g * p for g, p in zip(grid, patch))
    pads = [(0, 0)] + [(0, max(0, w - s)) for w, s in zip(want, x.shape[1:])]
    if any(p[1] for p in pads):
        x = np.pad(x, pads, mode="edge")
    x = x[:, : want[0], : want[1], : want[2]]
    (gt, gh, gw), (pt, ph, pw) = grid, patch
    # Accumulate in float64 (deterministic, no float32 rounding drift) without a float64 copy of the latent.
    return x.reshape(c, gt, pt, gh, ph, gw, pw).mean(axis=(2, 4, 6), dtype=np.float64)


def token_lab(probe: Probe) -> np.ndarray:
    """float64 [T, H, W, 3] CIELAB of the probe's x0 prediction, one colour per token of the grid."""
    if probe.latent_rgb_factors is None:
        raise MissingLatentRGBFactorsError(
            f"the {probe.arch!r} model's latent format has no latent_rgb_factors, so the Signature Builder cannot "
            "measure colours. Use a model whose ComfyUI latent format defines them (Wan 2.1, Wan 2.2, LTX-Video and "
            "the embedded model do)."
        )
    x = _as_numpy(probe.x0_probe)
    factors = np.asarray(probe.latent_rgb_factors, dtype=np.float64)
    if x.ndim != 4:
        raise ValueError(f"probe.x0_probe must be [C, T, H, W], got shape {x.shape}")
    if factors.shape != (x.shape[0], 3):
        raise ValueError(
            f"latent_rgb_factors has shape {factors.shape}, expected ({x.shape[0]}, 3) for a {x.shape[0]}-channel "
            f"latent: the probe's latent format does not match its model ({probe.arch!r})"
        )
    bias = np.zeros(3) if probe.latent_rgb_bias is None else np.asarray(probe.latent_rgb_bias, dtype=np.float64)
    if bias.shape != (3,):
        raise ValueError(f"latent_rgb_bias must have shape (3,), got {bias.shape}")
    tiled = tuple(-(-int(n) // int(p)) for n, p in zip(x.shape[1:], probe.patch))
    if tiled != tuple(int(g) for g in probe.grid):
        raise ValueError(
            f"probe.x0_probe {tuple(x.shape)} with patch {tuple(probe.patch)} gives a token grid {tiled}, but the "
            f"probe's grid is {tuple(probe.grid)}: the probe recorded the wrong patch size for this model"
        )
    if not np.all(np.isfinite(x)):
        raise ValueError("probe.x0_probe contains NaN/inf: the probe run diverged; check the model and sampler")
    # Project to RGB first, then average each token's cells: both are linear, so the order does not change the
    # value, and pooling 3 channels instead of C is what keeps this fast at 480p (C = 16..128).
    v = np.einsum("ck,cthw->kthw", factors.astype(np.float32), x)  # [3, T, H, W] in [-1, 1] (preview space)
    pooled = _pool_to_grid(v, tuple(probe.grid), tuple(probe.patch))  # [3, gT, gH, gW], float64
    rgb = np.clip((np.moveaxis(pooled, 0, -1) + bias + 1.0) * 0.5, 0.0, 1.0)
    return rgb2lab(rgb)


# --- masks ---------------------------------------------------------------------------------------------------
def object_mask(attn: np.ndarray, config: SignatureConfig) -> tuple[np.ndarray, bool]:
    """(soft mask float32 in [0, 1], localised?) of one attention map; see the module docstring."""
    m = np.asarray(attn, dtype=np.float64)
    if not np.all(np.isfinite(m)):
        raise ValueError("attention map contains NaN/inf: the probe's attention capture failed")
    if m.ndim == 3 and m.size and (config.smooth_sigma_t > 0 or config.smooth_sigma_hw > 0):
        m = gaussian_filter(m, sigma=(config.smooth_sigma_t, config.smooth_sigma_hw, config.smooth_sigma_hw),
                            mode="nearest")
    peak = float(m.max()) if m.size else 0.0
    base = float(np.quantile(m, config.baseline_quantile)) if m.size else 0.0
    span = peak - base
    if m.size == 0 or span <= config.min_contrast * max(abs(peak), 1e-12) or span <= 0.0:
        return np.zeros(m.shape, dtype=np.float32), False
    r = (m - base) / span
    if config.high > config.low:
        mask = np.clip((r - config.low) / (config.high - config.low), 0.0, 1.0)
    else:
        mask = (r >= config.low).astype(np.float64)
    return mask.astype(np.float32), True


def _cell_bounds(n: int, k: int) -> list[tuple[int, int]]:
    edges = [(i * n) // k for i in range(k + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _grow(mask: np.ndarray, dilation: int) -> np.ndarray:
    """``mask`` [T, H, W] grown by ``dilation`` tokens in H and W (a maximum filter; unchanged for 0)."""
    if dilation <= 0:
        return mask
    size = 2 * int(dilation) + 1
    return maximum_filter(mask, size=(1, size, size), mode="nearest")


def _context_reference(lab: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Weighted mean CIELAB outside the objects (the whole grid's mean where objects cover every token)."""
    w = weight.astype(np.float64)
    total = float(w.sum())
    if total <= 1e-9:
        return lab.reshape(-1, 3).mean(axis=0)
    return (lab * w[..., None]).reshape(-1, 3).sum(axis=0) / total


def _distinct_colour(lab: np.ndarray, mask: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Mask-weighted mean CIELAB over the tokens at least the weighted-median distance from ``reference``."""
    flat, w = lab.reshape(-1, 3), mask.reshape(-1)
    keep = w > 0
    flat, w = flat[keep], w[keep]
    dist = np.linalg.norm(flat - reference, axis=-1)
    order = np.argsort(dist, kind="stable")
    cum = np.cumsum(w[order])
    median = dist[order][int(np.searchsorted(cum, 0.5 * cum[-1]))]
    sel = dist >= median
    return (flat[sel] * w[sel, None]).sum(axis=0) / w[sel].sum()


def _colour_support(lab: np.ndarray, mask: np.ndarray, colour: np.ndarray, reference: np.ndarray,
                    dilation: int) -> float:
    """Tokens near the object's support (grown by ``dilation``) whose colour is nearer the object's than the
    context's: the object's visible extent at the probe, in tokens."""
    support = _grow(mask > 0, dilation)
    nearer = np.linalg.norm(lab - colour, axis=-1) < np.linalg.norm(lab - reference, axis=-1)
    return float(np.count_nonzero(support & nearer))


def context_lab(lab: np.ndarray, weight: np.ndarray, grid: tuple[int, int]) -> tuple[np.ndarray, str]:
    """[gh, gw, 3] context-weighted mean CIELAB per coarse cell over (H, W), all frames; and a note ("" if none).

    lab: [T, H, W, 3]; weight: [T, H, W] in [0, 1] (non-object weight)."""
    w = weight.astype(np.float64)
    note = ""
    if float(w.sum()) <= 1e-9:
        # Objects cover every token: the context colour is undefined, fall back to the whole frame's mean.
        w = np.ones_like(w)
        note = "objects cover the whole frame: context is the whole-frame mean"
    wl = lab * w[..., None]
    global_mean = _context_reference(lab, w)
    gh, gw = grid
    out = np.empty((gh, gw, 3), dtype=np.float64)
    for i, (r0, r1) in enumerate(_cell_bounds(lab.shape[1], gh)):
        for j, (c0, c1) in enumerate(_cell_bounds(lab.shape[2], gw)):
            cw = float(w[:, r0:r1, c0:c1].sum())
            if cw <= 1e-6:
                out[i, j] = global_mean
            else:
                out[i, j] = wl[:, r0:r1, c0:c1].reshape(-1, 3).sum(axis=0) / cw
    return out.astype(np.float32), note


# --- the builder ---------------------------------------------------------------------------------------------
def build_signature(probe: Probe, config: Optional[SignatureConfig] = None) -> Signature:
    """The Early Signature of ``probe`` (see the module docstring). Deterministic; never modifies the probe.

    Raises MissingLatentRGBFactorsError when the model has no latent -> RGB factors, ValueError for an
    inconsistent probe (an object without a map, a map off the token grid, NaN values).
    A probe without objects gives a context-only signature whose note says so.
    """
    cfg = config or SignatureConfig()
    grid = tuple(int(g) for g in probe.grid)
    if len(grid) != 3 or min(grid) < 1:
        raise ValueError(f"probe.grid must be three positive sizes (T, H, W), got {probe.grid!r}")
    lab = token_lab(probe)
    notes: list[str] = []
    objects: list[ObjectSignature] = []
    union = np.zeros(grid, dtype=np.float64)
    masks: list[tuple[Any, np.ndarray, np.ndarray]] = []
    for ot in probe.objects:
        if ot.name not in probe.object_maps:
            raise ValueError(f"the probe names object {ot.name!r} but captured no attention map for it: the probe "
                             "result is incomplete; re-run the Early Probe")
        attn = np.asarray(probe.object_maps[ot.name])
        if tuple(attn.shape) != grid:
            raise ValueError(f"attention map of {ot.name!r} has shape {tuple(attn.shape)}, expected the token grid "
                             f"{grid}")
        mask, localised = object_mask(attn, cfg)
        if not localised:
            notes.append(f"object {ot.name!r}: no localised attention (empty mask)")
        masks.append((ot, attn, mask))
        union = np.maximum(union, mask)
    reference = _context_reference(lab, 1.0 - union)
    for ot, attn, mask in masks:
        mass = float(mask.sum(dtype=np.float64))
        if mass > 0.0:
            colour = _distinct_colour(lab, mask.astype(np.float64), reference)
            size = _colour_support(lab, mask, colour, reference, cfg.context_dilation) / mask.size
        else:
            # No support: the colour where the object's words draw the most attention (first such token).
            colour = lab.reshape(-1, 3)[int(np.argmax(attn.reshape(-1)))]
            size = 0.0
        objects.append(ObjectSignature(name=ot.name, mask=mask, size=size,
                                       lab=tuple(float(v) for v in colour)))  # type: ignore[arg-type]
    if not objects:
        notes.insert(0, CONTEXT_ONLY_NOTE + (f" (object source: {probe.object_source})"
                                             if probe.object_source else ""))
    if objects:
        union = _grow(union, cfg.context_dilation)
    ctx, ctx_note = context_lab(lab, 1.0 - union, cfg.context_grid)
    if ctx_note:
        notes.append(ctx_note)
    return Signature(objects=tuple(objects), context_lab=ctx, grid=grid, note="; ".join(notes),
                     config=cfg.digest(getattr(probe, "capture_layers", ())))


def build_signature_timed(probe: Probe, config: Optional[SignatureConfig] = None) -> tuple[Signature, float]:
    """``build_signature`` and its wall time in milliseconds (for the per-run cost report)."""
    t0 = time.perf_counter()
    sig = build_signature(probe, config)
    return sig, (time.perf_counter() - t0) * 1000.0


# --- serialization -------------------------------------------------------------------------------------------
def signature_to_bytes(sig: Signature) -> bytes:
    """One safetensors blob: the tensors of ``Signature.to_tensors()`` + the JSON ``to_meta()`` in its header."""
    from safetensors.numpy import save

    return save(sig.to_tensors(), metadata={META_KEY: json.dumps(sig.to_meta(), sort_keys=True)})


def signature_from_bytes(blob: bytes) -> Signature:
    """Inverse of :func:`signature_to_bytes` (no pickle: safetensors tensors + JSON)."""
    from safetensors.numpy import load

    tensors = load(blob)
    # safetensors.numpy.load drops the header metadata: read it from the header (8-byte length + JSON).
    try:
        n = int.from_bytes(blob[:8], "little")
        header = json.loads(blob[8: 8 + n].decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"not a safetensors signature blob: {exc}") from exc
    meta_raw = (header.get("__metadata__") or {}).get(META_KEY)
    if meta_raw is None:
        raise ValueError(f"not a Carnator signature: the safetensors header has no {META_KEY!r} metadata")
    return Signature.from_parts(json.loads(meta_raw), tensors)


def save_signature(sig: Signature, path: str | Path) -> int:
    """Write ``sig`` as a .safetensors file (JSON metadata in the header); returns the file size in bytes."""
    blob = signature_to_bytes(sig)
    Path(path).write_bytes(blob)
    return len(blob)


def load_signature(path: str | Path) -> Signature:
    return signature_from_bytes(Path(path).read_bytes())


# --- size at a real geometry ---------------------------------------------------------------------------------
#: Wan 2.1 at 480p (832x480), 81 frames: latent [16, 21, 60, 104], patch (1, 2, 2) -> token grid (21, 30, 52).
WAN21_480P_81F = {"latent_shape": (16, 21, 60, 104), "patch": (1, 2, 2)}


def signature_bytes_at(latent_shape: tuple[int, int, int, int] = WAN21_480P_81F["latent_shape"],
                       patch: tuple[int, int, int] = WAN21_480P_81F["patch"], n_objects: int = 2,
                       context_grid: tuple[int, int] = (4, 4)) -> dict[str, Any]:
    """Serialized size of a signature at a generation geometry (default: Wan 2.1 480p / 81 frames, 2 objects).

    Returns {"grid", "n_objects", "nbytes" (Signature.nbytes: raw tensors + JSON), "file_bytes" (the actual
    safetensors blob of :func:`signature_to_bytes`)}. Sizes do not depend on values, only on the geometry.
    """
    _, t, h, w = latent_shape
    grid = (math.ceil(t / patch[0]), math.ceil(h / patch[1]), math.ceil(w / patch[2]))
    objs = tuple(ObjectSignature(f"object{i}", np.zeros(grid, np.float32), 0.0, (50.0, 0.0, 0.0))
                 for i in range(n_objects))
    sig = Signature(objs, np.zeros(tuple(context_grid) + (3,), np.float32), grid, "")
    return {"grid": grid, "n_objects": n_objects, "nbytes": sig.nbytes(), "file_bytes": len(signature_to_bytes(sig))}


# --- human-readable summary ----------------------------------------------------------------------------------
def lab_to_hex(lab: tuple[float, float, float]) -> str:
    """An sRGB hex code for a CIELAB colour (for summaries)."""
    rgb = np.clip(lab2rgb(np.asarray(lab, dtype=np.float64)[None, None, :])[0, 0], 0.0, 1.0)
    return "#" + "".join(f"{int(round(c * 255)):02x}" for c in rgb)


def summarize(sig: Signature, build_ms: Optional[float] = None) -> str:
    """A short multi-line text: objects with size, CIELAB and hex colour; context grid; bytes; note."""
    lines = [f"Early Signature on token grid {tuple(sig.grid)}: {len(sig.objects)} object(s)"]
    for o in sig.objects:
        lines.append(f"  {o.name}: size {o.size:.3f}, Lab ({o.lab[0]:.1f}, {o.lab[1]:.1f}, {o.lab[2]:.1f}) "
                     f"{lab_to_hex(o.lab)}")
    ctx = np.asarray(sig.context_lab, dtype=np.float64).reshape(-1, 3).mean(axis=0)
    lines.append(f"  context: {sig.context_lab.shape[0]}x{sig.context_lab.shape[1]} cells, mean Lab "
                 f"({ctx[0]:.1f}, {ctx[1]:.1f}, {ctx[2]:.1f}) {lab_to_hex(tuple(ctx))}")
    lines.append(f"  size: {sig.nbytes()} bytes" + (f", built in {build_ms:.1f} ms" if build_ms is not None else ""))
    if sig.note:
        lines.append(f"  note: {sig.note}")
    return "\n".join(lines)


__all__ = ["SignatureConfig", "MissingLatentRGBFactorsError", "CONTEXT_ONLY_NOTE", "build_signature",
           "build_signature_timed", "token_lab", "object_mask", "context_lab", "signature_to_bytes",
           "signature_from_bytes", "save_signature", "load_signature", "signature_bytes_at", "WAN21_480P_81F",
           "summarize", "lab_to_hex"]
