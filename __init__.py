"""Carnator: cross-request computation reuse for text-to-video diffusion in ComfyUI.

ComfyUI loads this folder as a package. The node classes are imported lazily inside `comfy_entrypoint`
so that `carnator_core` (and this package) import without ComfyUI, e.g. in unit tests.
"""

WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    from .nodes import CarnatorExtension

    return CarnatorExtension()


__all__ = ["WEB_DIRECTORY", "comfy_entrypoint"]
