"""Digests that decide what may be shared between requests: the exact-request key and the conditioning key.

Two keys, two purposes:

* ``request_key`` — everything that decides a dense generation's output: model fingerprint (weights and
  patches), the MODEL's ``model_options`` (sampler CFG functions, wrappers, transformer patches), the sampler,
  scheduler, steps, cfg, the full sigma schedule, denoise, seed, every tensor and every extra key of the positive
  and negative conditioning, and the input latent (samples, noise mask, batch index). Two requests with the same
  key produce the same latent, so a cached dense result is returned for it without any model call.
* ``conditioning_digest`` — the conditioning *beyond the prompt text*: start images and concat latents (Wan 2.2
  TI2V puts the start image into the latent and its noise mask, Wan I2V into ``concat_latent_image``), reference
  latents, CLIP-vision outputs, areas, masks and any other extra key, plus a non-empty input latent. It becomes
  part of the cache namespace (``types.GenConfig.conditioning``), so generations with a different start image are
  never recalled, let alone reused. The prompt's own tensors (the text embedding, its pooled output and
  attention mask) are left out: prompt similarity is what cross-request reuse is about.

Values that cannot be digested faithfully (an arbitrary object without inspectable state, a cycle too deep)
raise ``Opaque``: the caller then answers nothing from the cache for such a request (``request_key`` returns
None) or gives it a namespace of its own (``conditioning_digest``) — never a key that could equal another
request's. No ComfyUI import: conditioning and model options are plain lists, dicts, tensors and callables.
"""
from __future__ import annotations

import functools
import hashlib
import secrets
import types
from typing import Any, Mapping

import numpy as np
import torch

KEY_VERSION = "carnator-request-v1"
# Conditioning keys a text encoder produces alongside the embedding: they describe the prompt, not the request's
# other inputs, so they stay out of the (cross-prompt) conditioning digest. They are in the exact key.
TEXT_KEYS = frozenset({"pooled_output", "attention_mask"})
OPAQUE_PREFIX = "opaque-"
_MAX_DEPTH = 12
# Tensor bytes one digest may read: conditioning and latents are megabytes; a wrapper that holds a whole model
# (or a ModelPatcher) is not something to hash per request, so it makes the request opaque instead.
_MAX_TENSOR_BYTES = 512 << 20


class Opaque(ValueError):
    """A value whose content cannot be digested faithfully."""


class _Hasher:
    """sha256 plus a budget of tensor bytes."""

    def __init__(self, seed: bytes = b"") -> None:
        self.h = hashlib.sha256(seed)
        self.left = _MAX_TENSOR_BYTES

    def update(self, b: bytes) -> None:
        self.h.update(b)

    def hexdigest(self) -> str:
        return self.h.hexdigest()


def _tensor(h: _Hasher, t: torch.Tensor) -> None:
    t = t.detach()
    if t.layout != torch.strided:
        raise Opaque(f"a {t.layout} tensor")
    n = t.numel() * t.element_size()
    h.left -= n
    if h.left < 0:
        raise Opaque("more tensor data than a request key reads")
    t = t.to("cpu").contiguous()
    h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
    if n:
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())


def stable_module_name(name: str | None) -> str:
    """A module's name as a digest may use it: the same on every machine and install.

    ComfyUI loads ``comfy_extras`` and custom-node packs by file path and names the module after that path, dots
    written as ``_x_`` (``/opt/ComfyUI/comfy_extras/nodes_easycache_x_py``, ``/srv/ComfyUI/custom_nodes/pack.nodes``).
    Digesting that name would tie a model fingerprint or request key to where ComfyUI is installed: a rule
    certified in one process would not apply in a server, and farm workers with different install paths would
    never share an entry. Keep the last directory and the module path inside it (``comfy_extras.nodes_easycache``,
    ``custom_nodes.pack.nodes``) — what a plain ``import`` of the same file is called."""
    name = name or ""
    if "/" not in name and "\\" not in name:
        return name
    head, _, tail = name.replace("\\", "/").rpartition("/")
    parent = head.rpartition("/")[2]
    first, dot, rest = tail.partition(".")
    if first.endswith("_x_py"):
        first = first[: -len("_x_py")]
    return f"{parent}.{first}{dot}{rest}" if parent else f"{first}{dot}{rest}"


def _feed(h: _Hasher, obj: Any, depth: int, path: tuple[int, ...]) -> None:
    """Feed a canonical description of ``obj`` into ``h``; raises Opaque for what cannot be described."""
    if depth > _MAX_DEPTH:
        raise Opaque("nested too deeply")
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        h.update(f"{type(obj).__name__}:{obj!r};".encode())
        return
    if isinstance(obj, torch.Tensor):
        _tensor(h, obj)
        return
    if isinstance(obj, np.ndarray):
        _tensor(h, torch.from_numpy(np.ascontiguousarray(obj)))
        return
    if isinstance(obj, (np.generic, torch.dtype, torch.device)):
        h.update(f"{type(obj).__name__}:{obj!r};".encode())
        return
    if id(obj) in path:  # a cycle: describe it by its depth so the key stays deterministic
        h.update(f"cycle:{path.index(id(obj))};".encode())
        return
    path = path + (id(obj),)
    if isinstance(obj, Mapping):
        h.update(f"map{len(obj)}{{".encode())
        for k in sorted(obj, key=lambda k: (type(k).__name__, str(k))):
            _feed(h, k, depth + 1, path)
            _feed(h, obj[k], depth + 1, path)
        h.update(b"}")
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = sorted(obj, key=repr) if isinstance(obj, (set, frozenset)) else obj
        h.update(f"{type(obj).__name__}{len(obj)}[".encode())
        for v in items:
            _feed(h, v, depth + 1, path)
        h.update(b"]")
        return
    if isinstance(obj, functools.partial):
        h.update(b"partial(")
        for part in (obj.func, obj.args, obj.keywords or {}):
            _feed(h, part, depth + 1, path)
        h.update(b")")
        return
    if isinstance(obj, types.MethodType):
        h.update(b"method(")
        _feed(h, obj.__func__, depth + 1, path)
        _feed(h, obj.__self__, depth + 1, path)
        h.update(b")")
        return
    if isinstance(obj, types.FunctionType):
        # Name, code and everything the function closes over: RescaleCFG's multiplier lives in a closure.
        code = obj.__code__
        h.update(f"fn:{stable_module_name(obj.__module__)}.{obj.__qualname__}:".encode())
        h.update(hashlib.sha256(code.co_code).digest())
        h.update(repr(tuple(c for c in code.co_consts if isinstance(c, (int, float, str, bytes, bool)))).encode())
        _feed(h, obj.__defaults__, depth + 1, path)
        _feed(h, obj.__kwdefaults__, depth + 1, path)
        cells = []
        for c in obj.__closure__ or ():
            try:
                cells.append(c.cell_contents)
            except ValueError:  # an empty cell
                cells.append(None)
        _feed(h, cells, depth + 1, path)
        return
    if isinstance(obj, (types.BuiltinFunctionType, type)):
        module = stable_module_name(getattr(obj, "__module__", ""))
        h.update(f"named:{module}.{getattr(obj, '__qualname__', repr(obj))};".encode())
        return
    if isinstance(obj, types.ModuleType):
        h.update(f"module:{stable_module_name(obj.__name__)};".encode())
        return
    state = getattr(obj, "__dict__", None)
    slots = [s for c in type(obj).__mro__ for s in getattr(c, "__slots__", ()) if isinstance(s, str)]
    if state is None and not slots:
        raise Opaque(f"a {type(obj).__module__}.{type(obj).__qualname__} has no inspectable state")
    h.update(f"obj:{stable_module_name(type(obj).__module__)}.{type(obj).__qualname__}(".encode())
    fields = dict(state or {})
    for s in slots:
        if hasattr(obj, s):
            fields[s] = getattr(obj, s)
    _feed(h, fields, depth + 1, path)
    h.update(b")")


def value_digest(obj: Any) -> str:
    """sha256 hex digest of a canonical description of ``obj`` (tensors by content). Raises Opaque."""
    h = _Hasher()
    _feed(h, obj, 0, ())
    return h.hexdigest()


def _items(cond: Any, what: str) -> list[tuple[Any, Mapping[str, Any]]]:
    if cond is None:
        return []
    if not isinstance(cond, (list, tuple)):
        raise Opaque(f"{what} is a {type(cond).__name__}, not a ComfyUI CONDITIONING list")
    out = []
    for item in cond:
        if not isinstance(item, (list, tuple)) or len(item) != 2 or not isinstance(item[1], Mapping):
            raise Opaque(f"{what} holds an item that is not [tensor, dict]")
        out.append((item[0], item[1]))
    return out


def _latent_parts(latent: Mapping[str, Any] | None, full: bool) -> dict[str, Any]:
    """The latent's content that decides the output. Not ``full`` (namespace): an all-zero latent without a noise
    mask is the empty latent of a text-to-video request and contributes nothing beyond its shape."""
    if not latent:
        return {}
    samples = latent.get("samples")
    mask = latent.get("noise_mask")
    parts: dict[str, Any] = {}
    if full:
        parts = {"samples": samples, "noise_mask": mask, "batch_index": latent.get("batch_index")}
    elif mask is not None or (isinstance(samples, torch.Tensor) and bool(samples.detach().abs().amax() > 0)):
        parts = {"samples": samples, "noise_mask": mask}
    return parts


def conditioning_digest(positive: Any, negative: Any, latent: Mapping[str, Any] | None = None) -> str:
    """Digest of the non-text conditioning of a request (16 hex), or "" for a plain text-to-video request.

    Covers every extra key of every conditioning item (except ``TEXT_KEYS``) on both sides and a non-empty input
    latent (start image / source video + noise mask). When something cannot be digested the request gets a
    one-off namespace ("opaque-..."), so it is never reused and nothing is reused for it.
    """
    try:
        extras = []
        for side, cond in (("positive", positive), ("negative", negative)):
            for i, (_, d) in enumerate(_items(cond, side)):
                rest = {k: v for k, v in d.items() if k not in TEXT_KEYS}
                if rest:
                    extras.append((side, i, rest))
        lat = _latent_parts(latent, full=False)
        if not extras and not lat:
            return ""
        return value_digest({"conditioning": extras, "latent": lat})[:16]
    except Opaque:
        return OPAQUE_PREFIX + secrets.token_hex(8)


def model_options_digest(model_options: Mapping[str, Any] | None) -> str:
    """Digest of a MODEL's ``model_options`` (CFG functions, wrappers, transformer patches). Raises Opaque."""
    return value_digest(dict(model_options or {}))


def request_key(*, model_fingerprint: str, model_options: Mapping[str, Any] | None, arch: str,
                latent_shape: tuple[int, ...], steps: int, sampler: str, scheduler: str, cfg: float,
                sigmas_digest: str, denoise: float, seed: int, positive: Any, negative: Any,
                latent: Mapping[str, Any], split: Mapping[str, Any] | None = None) -> str | None:
    """The exact-request key (32 hex), or None when part of the request cannot be digested faithfully (then the
    request is never answered from the cache by key). Equal keys mean equal dense outputs.

    ``split``: a split schedule's facts beyond the first model (its stage, the second model's fingerprint and
    ``model_options``); None for the whole schedule on one model, whose key is unchanged by the parameter."""
    try:
        h = _Hasher(KEY_VERSION.encode())
        head: dict[str, Any] = {
            "model": str(model_fingerprint), "arch": str(arch), "latent_shape": [int(x) for x in latent_shape],
            "steps": int(steps), "sampler": str(sampler), "scheduler": str(scheduler), "cfg": float(cfg),
            "sigmas": str(sigmas_digest), "denoise": float(denoise), "seed": int(seed)}
        if split is not None:
            head["split"] = dict(split)
        _feed(h, head, 0, ())
        _feed(h, dict(model_options or {}), 0, ())
        for side, cond in (("positive", positive), ("negative", negative)):
            h.update(side.encode())
            _feed(h, [[c, dict(d)] for c, d in _items(cond, side)], 0, ())
        _feed(h, _latent_parts(latent, full=True), 0, ())
        return h.hexdigest()[:32]
    except Opaque:
        return None


def answer_key(request_key: str, serving: Mapping[str, Any]) -> str:
    """The key an exact repeat of a *hit* is answered by: the request's ``request_key`` and ``serving``, a
    JSON-like description of everything past the request that decided the hit (filter, rule, recall limits, probe,
    signature and reuse settings, the prompt label recall embeds; ``request.serving_settings``). Same length and
    alphabet as a request key, and domain-separated from it, so an answer is never taken for a dense result.
    Raises Opaque for an undigestable value (then the hit is simply not kept as an answer)."""
    if not request_key:
        raise ValueError("answer_key needs the request's key")
    return value_digest(["carnator-answer", str(request_key), dict(serving)])[:32]
