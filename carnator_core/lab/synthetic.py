"""Synthetic labelled pairs with a known risk model — for tests and for trying the calibration CLI without a model.

Nothing here touches a model: the pairs are drawn from a simple generative story so that the calibration and
certification machinery can be checked against known ground truth. Do not use such pairs to certify a rule for
real use; a rule must be calibrated on pairs generated with the model and config it will serve
(docs/CALIBRATION.md).

Story: each request has 1..``max_candidates`` recalled entries. For each pair a latent incompatibility
z ~ U(0, 1) drives the four discrepancies (scaled to typical magnitudes, plus noise) and the unsafe
probability (a logistic in z centred at ``z_unsafe``). The prompt similarity only weakly tracks z
(``prompt_corr``), which is the situation where prompt-only acceptance is riskier than signature checks.
"""
from __future__ import annotations

import numpy as np

from ..risk.certify import LabelledPair

#: Rough scale of each axis when z = 1 (ΔE units for colours, |log ratio| for size, 1 − IoU for shape).
AXIS_SCALE = (30.0, 1.5, 0.9, 40.0)


def synthetic_pairs(
    n_requests: int,
    *,
    seed: int = 0,
    max_candidates: int = 3,
    z_unsafe: float = 0.55,
    steepness: float = 25.0,
    noise: float = 0.08,
    prompt_corr: float = 0.3,
    p_missing: float = 0.05,
    base_unsafe: float = 0.0,
    request_prefix: str = "r",
    similarity_decimals: int | None = None,
) -> list[LabelledPair]:
    """Draw labelled pairs (see module docstring). Deterministic for a given seed.

    base_unsafe: an extra probability that any pair is unsafe regardless of z (a floor no rule can beat).
    similarity_decimals: round similarities (to create exact ties, exercising tie-breaks).
    """
    rng = np.random.default_rng(seed)
    out: list[LabelledPair] = []
    scale = np.array(AXIS_SCALE)
    for r in range(n_requests):
        m = int(rng.integers(1, max_candidates + 1))
        for j in range(m):
            z = float(rng.uniform(0.0, 1.0))
            axes = np.clip(z * scale * (1.0 + noise * rng.standard_normal(4))
                           + noise * scale * np.abs(rng.standard_normal(4)) * 0.2, 0.0, None)
            p_unsafe = base_unsafe + (1.0 - base_unsafe) / (1.0 + np.exp(-steepness * (z - z_unsafe)))
            missing = bool(rng.uniform() < p_missing)
            unsafe = bool(rng.uniform() < p_unsafe) or missing
            zp = prompt_corr * z + (1.0 - prompt_corr) * float(rng.uniform())
            sim = 1.0 - 0.5 * zp
            if similarity_decimals is not None:
                sim = round(sim, similarity_decimals)
            out.append(
                LabelledPair(
                    request_id=f"{request_prefix}{r}",
                    entry_id=f"e{r}_{j}",
                    similarity=float(sim),
                    context=float(axes[0]),
                    size=float(axes[1]),
                    shape=float(min(axes[2], 1.0)),
                    appearance=float(axes[3]),
                    missing=missing,
                    unsafe=unsafe,
                )
            )
    return out
