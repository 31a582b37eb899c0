"""Judges: per-clip verdicts "does this clip show what its prompt asks", and the excess label built on any judge.

A judge sees one decoded clip and its request; it never sees the other clip of a pair. The excess label
(:func:`excess_label`) holds a reuse clip and the dense clip of the same request and seed against one judge:
b = the reuse clip fails where the dense clip passes, c = it passes where the dense clip fails. This module is
part of the runtime (learning mode labels served traffic with it), so it imports neither ComfyUI nor the lab.
"""
from .base import ExcessLabel, Judge, JudgeRequest, Verdict, excess_label

__all__ = ["ExcessLabel", "Judge", "JudgeRequest", "Verdict", "excess_label"]
