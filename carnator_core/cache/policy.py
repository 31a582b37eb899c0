"""Eviction policies for the cache's byte budget.

Two policies; ``lcbfu`` is the default.

* ``lru``: evict the entry whose last use (write or reuse) is oldest.
* ``lcbfu``: value-aware, after NIRVANA's *Least Computationally Beneficial and Frequently Used* (Agarwal et al.,
  NSDI '24), made to age the way GreedyDual-Size-Frequency does (Cherkasova '98). Each entry has a priority

      H = L + (1 + hits) * work / nbytes

  where ``work`` is the denoising work one reuse of the entry saves (``(steps - probe_steps) * prod(latent
  shape)``: latent-element-steps, a model-independent proxy), ``nbytes`` its file size, ``hits`` how often it
  was reused, and ``L`` the priority of the last evicted entry (the "inflation" clock, stored in the catalogue).
  The lowest H is evicted. A hit recomputes H with the current L, so entries in use keep rising; untouched
  entries fall behind as L rises. No wall-clock half-life to tune.

Why value-aware by default: within one namespace every entry saves the same work per byte, so LCBFU reduces to
aged LFU. That is what a reuse cache wants: requests recur around a few scenes, and a burst of one-off prompts
(common in API serving) would flush those popular entries out of an LRU, while under LCBFU a one-off entry
(hits = 0) goes before an entry that was reused. Across namespaces it prefers the entries that save the most
denoising per byte on disk (many steps, big latents), where LRU would treat them alike. LRU stays available for
purely recency-driven use (one creator iterating on one scene).
"""
from __future__ import annotations

import math

POLICIES = ("lcbfu", "lru")


def work_of(steps: int, probe_steps: int, latent_shape: tuple[int, ...]) -> float:
    """Denoising work one reuse saves: remaining steps x latent elements (>= 1, so priorities stay positive)."""
    return float(max(1, int(steps) - int(probe_steps)) * max(1, math.prod(int(x) for x in latent_shape)))


def priority(inflation: float, hits: int, work: float, nbytes: int) -> float:
    """GDSF-style LCBFU priority H = L + (1 + hits) * work / nbytes (higher = keep)."""
    return float(inflation) + (1.0 + max(0, int(hits))) * float(work) / float(max(1, int(nbytes)))


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"eviction policy must be one of {POLICIES}, got {policy!r}")
    return policy


#: Eviction order per policy (first = evicted first), as SQL over the catalogue's ``entries`` table. ``priority``
#: is maintained with ``priority()`` above (registered in SQLite as ``carnator_priority`` by ``catalog.connect``).
EVICTION_ORDER = {"lcbfu": "priority ASC, seq ASC", "lru": "last_access ASC, seq ASC"}
