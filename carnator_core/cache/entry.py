"""The entry format: one cache entry = one self-describing, checksummed safetensors blob.

Bytes-level API (no file system, no catalogue; a Redis-backed or any other store reuses it)::

    encode_entry(data: EntryData, *, entry_id: str, created: float) -> EncodedEntry
        EncodedEntry.blob: the bytes to store; .meta_digest: sha256 of the metadata JSON (a catalogue keeps it to
        detect a swapped file); .embedding: the normalised retrieval vector. Raises ValueError / TypeError /
        CacheError naming the bad input.
    decode_entry(raw: bytes, *, entry_id=None, namespace=None, meta_digest=None) -> DecodedEntry
        Parses and fully validates ``raw``: safetensors structure, every tensor's sha256 against the manifest in
        the metadata, the metadata against ``meta_digest`` (if given), the claimed id / namespace (if given), and
        that the namespace is the one the model fingerprint and config derive. Raises ``EntryFormatError`` for
        any defect; never returns torn or foreign data.
    read_entry_parts(path, names, prefix="", expect_size=None) -> (meta, meta_json, arrays)
        Reads the header and a few float32 tensors of an entry *file* without mmap (a file truncated under an
        mmap would SIGBUS the process), checksummed like ``decode_entry`` (used for signatures and rebuilds).
    signature_tensors(signature) -> {"sig.*": tensor}; signature_from(meta, tensors) -> Signature
        The signature's part of the format, for a store that keeps signatures apart for recall.

Format (version 1): safetensors with tensors ``embedding`` [D] float32, the user tensors (``latent_final``,
``x0_probe``, ...), the signature's arrays under ``sig.*``, the bit-packed attention block structure as
``blocks.keep``, and the string metadata key ``carnator`` holding sorted-keys JSON::

    {"format": "carnator-entry", "version": 1, "id", "namespace", "model_fingerprint", "config", "prompt",
     "seed", "created", "dim", "signature", "block_structure", "meta",
     "tensors": {name: {"dtype", "shape", "sha256"}}}

An entry names its own namespace, model and config, so a catalogue can always be rebuilt from entries alone.
Never pickle: tensors are parsed by safetensors, metadata by ``json``.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from safetensors.torch import load as st_load, save as st_save

from ..types import BlockStructure, GenConfig, Signature, namespace_key
from .errors import CacheError, EntryFormatError
from .index import normalize_rows

ENTRY_FORMAT = "carnator-entry"
ENTRY_VERSION = 1
MAX_HEADER = 64 << 20

NS_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
ID_RE = re.compile(r"^[0-9a-f]{16}$")
_TENSOR_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
RESERVED = ("sig.", "blocks.")
_ALLOWED_DTYPES = {
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool,
}


def valid_namespace(ns: str) -> bool:
    return isinstance(ns, str) and bool(NS_RE.match(ns)) and ".." not in ns


def valid_entry_id(entry_id: str) -> bool:
    return isinstance(entry_id, str) and bool(ID_RE.match(entry_id))


# ---------------------------------------------------------------------------------------------- values
@dataclass(frozen=True, kw_only=True)
class EntryData:
    """What a finished generation contributes to the cache (input of ``Store.put`` / ``encode_entry``).

    namespace: derived from ``model_fingerprint`` x ``config`` (``types.namespace_key``); passing a different
               one is an error. model_fingerprint: includes LoRA/patches (the probe computes it).
    embedding: retrieval embedding [D] (normalised on write). signature: the request's Early Signature.
    tensors:   name -> torch.Tensor | np.ndarray, e.g. "latent_probe", "latent_final", "x0_probe", "noise"
               (names: letters, digits, ``_ . -``; not starting with "sig." / "blocks.", not "embedding").
    block_structure: recorded attention block structure of the dense run, if any.
    meta:      JSON-able extra metadata (e.g. the run report).
    request_key: ``keys.request_key`` of the request whose *dense* output ``tensors["latent_final"]`` is ("" when
               unknown or when the result came from reuse): ``Store.find_request`` answers exact repeats by it.
    answer_of: "" for an ordinary entry. Otherwise the id of the entry whose reuse produced ``latent_final``: an
               *answer-only* entry, stored under ``request_key`` (then ``keys.answer_key``: the request and the
               serving settings that decided the hit) so that an exact repeat of a hit is answered too. Answer-only
               entries are never recall candidates and never reused (``Entry.cached_run`` refuses them): reuse
               never chains on reuse. They count towards the budget and are evicted like any entry.
    """

    model_fingerprint: str
    config: GenConfig
    prompt: str
    seed: int
    embedding: np.ndarray
    signature: Signature
    tensors: Mapping[str, Any] = field(default_factory=dict)
    block_structure: BlockStructure | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)
    namespace: str = ""
    request_key: str = ""
    answer_of: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.request_key, str) or not REQUEST_KEY_RE.match(self.request_key):
            raise ValueError("EntryData.request_key must be '' or 16-64 lowercase hex digits (keys.request_key)")
        if not isinstance(self.answer_of, str) or (self.answer_of and not valid_entry_id(self.answer_of)):
            raise ValueError("EntryData.answer_of must be '' or the id of the entry the result reused")
        if self.answer_of and not self.request_key:
            raise ValueError("an answer-only entry (answer_of set) must carry the request key it answers")
        if not isinstance(self.model_fingerprint, str) or not self.model_fingerprint:
            raise ValueError("EntryData.model_fingerprint must be a non-empty string")
        if not isinstance(self.config, GenConfig):
            raise TypeError(f"EntryData.config must be a GenConfig, got {type(self.config).__name__}")
        if not isinstance(self.signature, Signature):
            raise TypeError(f"EntryData.signature must be a types.Signature, got {type(self.signature).__name__}")
        if self.block_structure is not None and not isinstance(self.block_structure, BlockStructure):
            raise TypeError("EntryData.block_structure must be a types.BlockStructure or None")
        if not isinstance(self.prompt, str):
            raise TypeError("EntryData.prompt must be a string")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)):
            raise TypeError(f"EntryData.seed must be an int, got {type(self.seed).__name__}")
        expected = namespace_key(self.model_fingerprint, self.config)
        if self.namespace and self.namespace != expected:
            raise ValueError(
                f"EntryData.namespace {self.namespace!r} does not match namespace_key(model_fingerprint, config) = "
                f"{expected!r}; leave it empty to derive it"
            )
        object.__setattr__(self, "namespace", expected)


@dataclass(frozen=True)
class Entry:
    """A loaded cache entry (immutable; tensors are fresh CPU tensors owned by the caller)."""

    entry_id: str
    namespace: str
    model_fingerprint: str
    config: GenConfig
    prompt: str
    seed: int
    created: float
    hits: int
    nbytes: int
    embedding: np.ndarray
    signature: Signature
    tensors: Mapping[str, torch.Tensor]
    block_structure: BlockStructure | None
    meta: Mapping[str, Any]
    answer_of: str = ""  # see EntryData.answer_of: an answer-only entry, never reused

    def cached_run(self) -> Any:
        """This entry as ``reuse.CachedRun`` (needs tensors "latent_final" and "x0_probe"). An answer-only entry
        (``answer_of``) is a reuse result and is never reused itself: CacheError."""
        from ..reuse import CachedRun  # local: reuse is a sibling core module, keep import graph acyclic

        if self.answer_of:
            raise CacheError(f"cache entry {self.entry_id} is an answer-only entry (a result that reused entry "
                             f"{self.answer_of}): it answers exact repeats only and is never reused")
        missing = [k for k in ("latent_final", "x0_probe") if k not in self.tensors]
        if missing:
            raise CacheError(f"cache entry {self.entry_id} has no {missing}: it was written without them and "
                             "cannot be reused for joint reuse")
        return CachedRun(entry_id=self.entry_id, final_latent=self.tensors["latent_final"],
                         x0_probe=self.tensors["x0_probe"], signature=self.signature, structure=self.block_structure)


@dataclass(frozen=True)
class EncodedEntry:
    """``encode_entry``'s result: the bytes to store and what a catalogue records about them."""

    blob: bytes
    meta_json: str
    meta_digest: str
    embedding: np.ndarray


@dataclass(frozen=True)
class DecodedEntry:
    """``decode_entry``'s result: a fully validated entry (``tensors`` holds the user tensors only)."""

    entry_id: str
    namespace: str
    model_fingerprint: str
    config: GenConfig
    prompt: str
    seed: int
    created: float
    embedding: np.ndarray
    signature: Signature
    tensors: Mapping[str, torch.Tensor]
    block_structure: BlockStructure | None
    meta: Mapping[str, Any]
    meta_digest: str
    answer_of: str = ""


# ---------------------------------------------------------------------------------------------- encode
def _sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _jsonable(obj: Any, where: str = "meta") -> Any:
    """A JSON-able copy of ``obj`` (numpy/torch scalars unwrapped); raises ValueError naming the bad key."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return obj.item()
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v, f"{where}.{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    raise ValueError(f"{where} is a {type(obj).__name__}, which cannot be stored as JSON metadata; "
                     "put tensors in EntryData.tensors and plain values in meta")


def _to_tensor(name: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu")
    elif isinstance(value, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(value))
    else:
        raise TypeError(f"tensor {name!r} is a {type(value).__name__}; give a torch.Tensor or numpy array")
    if t.dtype not in _ALLOWED_DTYPES:
        raise TypeError(f"tensor {name!r} has dtype {t.dtype}, which the cache does not store "
                        f"(use one of {sorted(_dtype_name(torch.empty(0, dtype=d)) for d in _ALLOWED_DTYPES)})")
    return t.contiguous()


def signature_tensors(signature: Signature) -> dict[str, torch.Tensor]:
    """The Early Signature's arrays as the float32 tensors an entry stores under ``sig.*``; ``signature_from``
    reads them back together with the metadata's ``"signature"`` (``Signature.to_meta()``). A store that also
    keeps each signature apart from its entry for recall (``redis_store``) uses it, so that copy has the entry's
    layout."""
    return {name: torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
            for name, arr in signature.to_tensors("sig.").items()}


def encode_entry(data: EntryData, *, entry_id: str, created: float) -> EncodedEntry:
    """Serialise ``data`` as entry ``entry_id`` (see the module docstring). Pure: touches no file."""
    if not isinstance(data, EntryData):
        raise TypeError(f"encode_entry takes an EntryData, got {type(data).__name__}")
    if not valid_entry_id(entry_id):
        raise ValueError(f"invalid entry id {entry_id!r} (16 lowercase hex digits)")
    emb = normalize_rows(data.embedding)
    if emb.ndim != 1:
        raise ValueError(f"EntryData.embedding must be one vector [D], got shape {np.shape(data.embedding)}")
    tensors: dict[str, torch.Tensor] = {"embedding": torch.from_numpy(emb)}
    seen_storage: set[int] = set()
    for name, value in data.tensors.items():
        if not isinstance(name, str) or not _TENSOR_RE.match(name) or name == "embedding" or name.startswith(RESERVED):
            raise ValueError(f"tensor name {name!r} is not allowed (letters, digits, '_.-'; not 'embedding', "
                             "not starting with 'sig.' or 'blocks.')")
        t = _to_tensor(name, value)
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen_storage and t.numel():
            t = t.clone()  # safetensors refuses tensors sharing memory
        seen_storage.add(ptr)
        tensors[name] = t
    tensors.update(signature_tensors(data.signature))
    block_meta = None
    if data.block_structure is not None:
        bs = data.block_structure
        keep = np.asarray(bs.keep, dtype=bool)
        if keep.ndim != 4 or keep.shape[0] != len(bs.layers):
            raise ValueError(f"block_structure.keep must be bool [L, H, Qb, Kb] with L = len(layers) = "
                             f"{len(bs.layers)}, got shape {keep.shape}")
        # Bit-packed along the key-block axis: 8x smaller (a per-head Wan 480p/81f structure is ~88 MB as
        # bool, ~11 MB packed).
        tensors["blocks.keep"] = torch.from_numpy(np.ascontiguousarray(np.packbits(keep, axis=-1)))
        block_meta = {"layers": [int(x) for x in bs.layers], "block_size": int(bs.block_size),
                      "n_tokens": int(bs.n_tokens), "steps": [int(x) for x in bs.steps],
                      "shape": list(keep.shape), "packing": "packbits-last-axis"}
    meta = {
        "format": ENTRY_FORMAT, "version": ENTRY_VERSION, "id": entry_id, "namespace": data.namespace,
        "model_fingerprint": data.model_fingerprint, "config": data.config.to_meta(), "prompt": data.prompt,
        "seed": int(data.seed), "created": float(created), "dim": int(emb.shape[0]),
        "signature": data.signature.to_meta(), "block_structure": block_meta, "meta": _jsonable(dict(data.meta)),
        "request_key": data.request_key, **({"answer_of": data.answer_of} if data.answer_of else {}),
        "tensors": {k: {"dtype": _dtype_name(t), "shape": list(t.shape), "sha256": _sha256(t)}
                    for k, t in tensors.items()},
    }
    meta_json = json.dumps(meta, sort_keys=True)
    blob = st_save(tensors, metadata={"carnator": meta_json})
    return EncodedEntry(blob=blob, meta_json=meta_json, meta_digest=meta_digest_of(meta_json), embedding=emb)


def meta_digest_of(meta_json: str) -> str:
    return hashlib.sha256(meta_json.encode()).hexdigest()


# ---------------------------------------------------------------------------------------------- decode
def _header_meta(data: bytes) -> str:
    n = int.from_bytes(data[:8], "little")
    if n <= 1 or n > MAX_HEADER or 8 + n > len(data):
        raise ValueError("safetensors header length is out of range (truncated file?)")
    header = json.loads(data[8 : 8 + n])
    meta = (header.get("__metadata__") or {}).get("carnator") if isinstance(header, dict) else None
    if not isinstance(meta, str):
        raise ValueError("not a Carnator entry (no 'carnator' metadata)")
    return meta


def check_meta(meta: Any, entry_id: str | None, ns: str | None) -> None:
    """Raise ValueError unless ``meta`` is entry metadata of a supported version (claiming id / namespace)."""
    if not isinstance(meta, dict) or meta.get("format") != ENTRY_FORMAT:
        raise ValueError("not a Carnator entry")
    if meta.get("version") != ENTRY_VERSION:
        raise ValueError(f"entry format version {meta.get('version')!r} is not supported")
    if ((entry_id is not None and meta.get("id") != entry_id) or (ns is not None and meta.get("namespace") != ns)
            or not valid_entry_id(meta.get("id")) or not valid_namespace(meta.get("namespace"))):
        raise ValueError(f"file claims id {meta.get('id')!r} in namespace {meta.get('namespace')!r}")


def signature_from(meta: dict, tensors: Mapping[str, Any]) -> Signature:
    """The Early Signature of entry metadata ``meta`` (its ``"signature"`` key) and its ``sig.*`` tensors (torch
    or numpy; other names are ignored). Raises ValueError (or KeyError / TypeError from the parser) for a
    signature that does not parse or whose masks do not match its grid: callers treat that as a corrupt entry."""
    arrays = {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in tensors.items()}
    sig = Signature.from_parts(meta["signature"], arrays, prefix="sig.")
    grid = tuple(sig.grid)
    for o in sig.objects:
        if o.mask.ndim != 3 or (len(grid) == 3 and tuple(o.mask.shape) != grid):
            raise ValueError(f"signature mask of {o.name!r} has shape {o.mask.shape}, grid is {grid}")
    return sig


def _block_from(meta: dict, tensors: Mapping[str, torch.Tensor]) -> BlockStructure | None:
    bm = meta.get("block_structure")
    if bm is None:
        if "blocks.keep" in tensors:
            raise ValueError("block structure tensor without its metadata")
        return None
    if bm.get("packing") != "packbits-last-axis":
        raise ValueError(f"unknown block structure packing {bm.get('packing')!r}")
    shape = [int(x) for x in bm["shape"]]
    packed = tensors["blocks.keep"]
    if (packed.dtype != torch.uint8 or len(shape) != 4
            or list(packed.shape) != shape[:3] + [(shape[3] + 7) // 8]):
        raise ValueError(f"blocks.keep is {packed.dtype}{list(packed.shape)}, inconsistent with shape {shape}")
    keep = np.unpackbits(packed.numpy(), axis=-1, count=shape[3]).astype(bool)
    layers = tuple(int(x) for x in bm["layers"])
    if len(layers) != shape[0]:
        raise ValueError(f"block structure lists {len(layers)} layers for {shape[0]} rows")
    return BlockStructure(keep=keep, layers=layers, block_size=int(bm["block_size"]),
                          n_tokens=int(bm["n_tokens"]), steps=tuple(int(x) for x in bm.get("steps", ())))


def decode_entry(raw: bytes, *, entry_id: str | None = None, namespace: str | None = None,
                 meta_digest: str | None = None) -> DecodedEntry:
    """Parse and validate entry bytes (see the module docstring). Raises EntryFormatError for any defect."""
    try:
        return _decode(raw, entry_id, namespace, meta_digest)
    except EntryFormatError:
        raise
    except (Exception, RecursionError) as e:  # noqa: BLE001 - any defect of foreign bytes is a format error
        raise EntryFormatError(f"{type(e).__name__}: {e}") from None


def _decode(raw: bytes, entry_id: str | None, ns: str | None, meta_digest: str | None) -> DecodedEntry:
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise TypeError(f"decode_entry takes bytes, got {type(raw).__name__}")
    if not isinstance(raw, bytes):
        raw = bytes(raw)
    meta_json = _header_meta(raw)
    digest = meta_digest_of(meta_json)
    if meta_digest is not None and digest != meta_digest:
        raise ValueError("metadata checksum mismatch")
    tensors = st_load(raw)
    meta = json.loads(meta_json)
    check_meta(meta, entry_id, ns)
    manifest = meta["tensors"]
    if set(manifest) != set(tensors):
        raise ValueError(f"tensor set {sorted(tensors)} differs from the manifest {sorted(manifest)}")
    for name, t in tensors.items():
        m = manifest[name]
        if _dtype_name(t) != m["dtype"] or list(t.shape) != list(m["shape"]):
            raise ValueError(f"tensor {name} is {_dtype_name(t)}{list(t.shape)}, manifest says "
                             f"{m['dtype']}{m['shape']}")
        if _sha256(t) != m["sha256"]:
            raise ValueError(f"tensor {name} checksum mismatch")
    config = GenConfig.from_meta(meta["config"])
    if namespace_key(meta["model_fingerprint"], config) != meta["namespace"]:
        raise ValueError("metadata's model/config does not match the entry's namespace")
    signature = signature_from(meta, {k: v for k, v in tensors.items() if k.startswith("sig.")})
    block = _block_from(meta, tensors)
    embedding = tensors["embedding"].numpy()
    if embedding.ndim != 1 or embedding.shape[0] != int(meta["dim"]):
        raise ValueError(f"embedding has shape {tuple(embedding.shape)}, expected [{meta['dim']}]")
    user = {k: v for k, v in tensors.items() if k != "embedding" and not k.startswith(RESERVED)}
    return DecodedEntry(entry_id=meta["id"], namespace=meta["namespace"], model_fingerprint=meta["model_fingerprint"],
                        config=config, prompt=str(meta["prompt"]), seed=int(meta["seed"]),
                        created=float(meta.get("created", 0.0)), embedding=embedding, signature=signature,
                        tensors=user, block_structure=block, meta=meta.get("meta") or {}, meta_digest=digest,
                        answer_of=adopted_answer_of(meta))


def read_entry_parts(path: Path, names: tuple[str, ...] | None, prefix: str = "", expect_size: int | None = None
                     ) -> tuple[dict, str, dict[str, np.ndarray]]:
    """Read the header and a few float32 tensors of an entry file without mmap: ``names`` and/or all tensors
    starting with ``prefix``. Checks the file size against the header (truncation) and every tensor read against
    its sha256 in the metadata. Raises ValueError (or OSError) for a bad file."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if expect_size is not None and size != expect_size:
            raise ValueError(f"file is {size} bytes, the catalogue recorded {expect_size} (truncated?)")
        head = f.read(8)
        if len(head) != 8:
            raise ValueError("file is shorter than a safetensors header")
        n = int.from_bytes(head, "little")
        if n <= 1 or n > MAX_HEADER or 8 + n > size:
            raise ValueError("safetensors header length is out of range (truncated file?)")
        try:
            header = json.loads(f.read(n))
        except RecursionError:
            raise ValueError("safetensors header nests too deeply") from None
        meta_json = (header.get("__metadata__") or {}).get("carnator") if isinstance(header, dict) else None
        if not isinstance(meta_json, str):
            raise ValueError("not a Carnator entry (no 'carnator' metadata)")
        try:
            meta = json.loads(meta_json)
        except RecursionError:
            raise ValueError("entry metadata nests too deeply") from None
        if not isinstance(meta, dict):
            raise ValueError("not a Carnator entry")
        infos = {k: v for k, v in header.items() if k != "__metadata__"}
        end = max((int(v["data_offsets"][1]) for v in infos.values()), default=0)
        if 8 + n + end != size:
            raise ValueError(f"file is {size} bytes but its header describes {8 + n + end} (truncated?)")
        wanted = [k for k in infos if (names and k in names) or (prefix and k.startswith(prefix))]
        for k in names or ():
            if k not in infos:
                raise ValueError(f"tensor {k!r} is missing")
        manifest = meta.get("tensors") or {}
        out = {}
        for k in wanted:
            info = infos[k]
            if info.get("dtype") != "F32":
                raise ValueError(f"tensor {k} has dtype {info.get('dtype')}, expected F32")
            shape = [int(x) for x in info["shape"]]
            s, e = int(info["data_offsets"][0]), int(info["data_offsets"][1])
            if e - s != 4 * math.prod(shape) or s < 0:
                raise ValueError(f"tensor {k} has inconsistent offsets")
            f.seek(8 + n + s)
            buf = f.read(e - s)
            if len(buf) != e - s:
                raise ValueError(f"tensor {k} is truncated")
            m = manifest.get(k)
            if m is None or list(m.get("shape", [])) != shape or hashlib.sha256(buf).hexdigest() != m.get("sha256"):
                raise ValueError(f"tensor {k} does not match its manifest (checksum/shape)")
            out[k] = np.frombuffer(buf, dtype="<f4").reshape(shape).copy()
    return meta, meta_json, out



# An exact-request key as stored (``keys.request_key``): hex, or "" for none.
REQUEST_KEY_RE = re.compile(r"^(|[0-9a-f]{16,64})$")


def adopted_request_key(meta: Mapping[str, Any]) -> str:
    """The request key an entry file carries ("" for files written before keys existed, or a malformed one)."""
    key = meta.get("request_key", "")
    return key if isinstance(key, str) and REQUEST_KEY_RE.match(key) else ""


def adopted_answer_of(meta: Mapping[str, Any]) -> str:
    """The reused entry an answer-only entry names ("" for an ordinary entry). A malformed value, or one on an
    entry without a request key, is refused (ValueError): such a file could be taken for a recall candidate."""
    a = meta.get("answer_of", "")
    if a == "":
        return ""
    if not isinstance(a, str) or not valid_entry_id(a) or not adopted_request_key(meta):
        raise ValueError(f"metadata's answer_of {a!r} is not a valid answer-only record")
    return a


__all__ = [
    "REQUEST_KEY_RE", "adopted_answer_of", "adopted_request_key",
    "DecodedEntry", "ENTRY_FORMAT", "ENTRY_VERSION", "EncodedEntry", "Entry", "EntryData", "check_meta",
    "decode_entry", "encode_entry", "meta_digest_of", "read_entry_parts", "signature_from", "signature_tensors",
    "valid_entry_id", "valid_namespace",
]
