"""Retrieval embeddings from a workflow's own text conditioning (no extra model).

Contract: ``embed_conditioning`` mean-pools the token embeddings of a conditioning tensor over its *valid*
tokens and returns an L2-normalised float32 vector [D]. Valid tokens are those the attention mask marks (when
one is given), otherwise the non-zero rows: ComfyUI's Wan/UMT5 encoder pads to 512 tokens and zeroes the
padding (``zero_out_masked``), so without this the padding would dominate short prompts. A batch [B, L, D] is
pooled per item and the items averaged (one request = one prompt; a batch of identical rows is unchanged).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch


def _as_numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float32).numpy()
    return np.asarray(x, dtype=np.float32)


def embed_conditioning(cond_tensor: torch.Tensor | np.ndarray, attention_mask: Any = None) -> np.ndarray:
    """Mean-pooled, L2-normalised retrieval embedding of ``cond_tensor`` ([L, D] or [B, L, D]).

    ``attention_mask``: optional [L] or [B, L] (non-zero = valid token). Raises ValueError with what is wrong
    when the tensor has the wrong rank or no valid token carries any signal.
    """
    c = _as_numpy(cond_tensor)
    if c.ndim == 2:
        c = c[None]
    if c.ndim != 3 or c.shape[1] == 0 or c.shape[2] == 0:
        raise ValueError(
            "conditioning tensor must be [tokens, dim] or [batch, tokens, dim], got shape "
            f"{tuple(np.shape(cond_tensor))}"
        )
    if attention_mask is not None:
        m = _as_numpy(attention_mask)
        m = m.reshape(1, -1) if m.ndim == 1 else m.reshape(m.shape[0], -1)
        if m.shape[1] < c.shape[1]:  # a mask shorter than the sequence: missing positions are padding
            m = np.pad(m, ((0, 0), (0, c.shape[1] - m.shape[1])))
        w = (m[:, : c.shape[1]] != 0).astype(np.float32)
        if w.shape[0] != c.shape[0]:
            w = np.broadcast_to(w[:1], (c.shape[0], c.shape[1]))
    else:
        w = (np.abs(c).sum(axis=2) > 0).astype(np.float32)
    counts = w.sum(axis=1, keepdims=True)
    pooled = (c * w[:, :, None]).sum(axis=1) / np.maximum(counts, 1.0)
    pooled = pooled[counts[:, 0] > 0]
    if len(pooled) == 0:
        raise ValueError("conditioning has no valid (non-padding) token: is the prompt empty?")
    e = pooled.mean(axis=0)
    if not np.isfinite(e).all():
        raise ValueError("conditioning contains NaN or inf: the text encoder output is broken")
    n = float(np.linalg.norm(e))
    if n <= 1e-12:
        raise ValueError("conditioning pools to the zero vector: it cannot be used for retrieval")
    return (e / n).astype(np.float32)


def embed_comfy_conditioning(conditioning: Sequence) -> np.ndarray:
    """Embedding of a ComfyUI CONDITIONING value (a list of ``[tensor [B, L, D], dict]``). Several entries
    (combined conditioning) are pooled separately and averaged, then re-normalised."""
    if not conditioning:
        raise ValueError("conditioning is empty: connect a text encoder's CONDITIONING output")
    vecs = []
    for item in conditioning:
        tensor, extra = item[0], (item[1] if len(item) > 1 else {})
        mask = extra.get("attention_mask") if isinstance(extra, dict) else None
        vecs.append(embed_conditioning(tensor, mask))
    if len({v.shape for v in vecs}) != 1:
        raise ValueError("conditioning entries have different widths: they come from different text encoders")
    e = np.mean(vecs, axis=0)
    return (e / max(float(np.linalg.norm(e)), 1e-12)).astype(np.float32)
