"""Carnator's core: everything that does the work. Imports without ComfyUI (see docs/ARCHITECTURE.md)."""

__version__ = "0.1.0"
