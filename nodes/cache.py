"""Cache nodes: Carnator Cache (loader), Cache Stats, Cache Retriever, Cache Writer.

The loader confines its directory to ComfyUI's output / user directories or roots the server owner lists in
``CARNATOR_CACHE_ROOTS`` (a workflow JSON cannot point it anywhere else). Instead of a directory it takes a
credential-free ``redis://host:port/db`` URL (or ``redis://`` for the server's Redis), which must match a Redis
the server owner configured in ``CARNATOR_REDIS_URL`` (where the password lives): the shared store of a farm of
workers. The Store itself is opened once per process and directory/URL (``carnator_core.cache.handle``); the
CARNATOR_CACHE value is a small frozen handle.
"""
from __future__ import annotations

import math
import weakref
from pathlib import Path
from typing import Any

from ..carnator_core.cache import (
    POLICIES,
    CacheHandle,
    CachePathError,
    CacheUnavailableError,
    RedisConfigError,
    adoption_problem,
    is_redis_url,
    open_store,
    resolve_cache_dir,
    resolve_redis_url,
    roots_from_env,
)
from ..carnator_core.cache.store import MARKER
from ..carnator_core.request import DEFAULT_MIN_SIMILARITY, DEFAULT_TOP_K, node_cache_report, recall, write_result
from ..carnator_core.types import Probe, Signature, namespace_key
from . import _history
from ._api import CACHE, CANDIDATES, PROBE, REPORT, SIGNATURE, io, ui
from ._common import advanced


def allowed_roots() -> list[Path]:
    """ComfyUI's output directory (relative paths resolve here), its user directory, then CARNATOR_CACHE_ROOTS."""
    import folder_paths

    return [Path(folder_paths.get_output_directory()), Path(folder_paths.get_user_directory()), *roots_from_env()]


def key_path() -> str:
    """The index-signing key: in ComfyUI's user directory, outside any cache directory under output/."""
    import folder_paths

    return str(Path(folder_paths.get_user_directory()) / "carnator" / "index-hmac.key")


def _need(obj: Any, name: str, what: str, source: str) -> Any:
    value = getattr(obj, name, None)
    if value is None:
        raise TypeError(f"the {what!r} input has no {name!r}: connect the {source}")
    return value


def _probe_parts(probe: Any) -> tuple[str, Any, str, int, Any]:
    src = "CARNATOR_PROBE output of a Carnator Early Probe node"
    fp = _need(probe, "model_fingerprint", "probe", src)
    config = _need(probe, "config", "probe", src)
    prompt = getattr(probe, "prompt", "")
    seed = _need(probe, "seed", "probe", src)
    _need(probe, "x0_probe", "probe", src)  # a probe at all (its embedding may be None: prompt not embeddable)
    emb = getattr(probe, "embedding", None)
    return str(fp), config, str(prompt or ""), int(seed), emb


class CarnatorCacheLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CarnatorCacheLoader",
            display_name="Carnator Cache",
            category="Carnator",
            description="Opens (or creates) a Carnator cache directory, or the shared Redis cache of several "
                        "ComfyUI servers (redis://). Several ComfyUI processes may share either.",
            inputs=[
                io.String.Input("directory", default="carnator_cache",
                                tooltip="Cache directory, relative to ComfyUI's output directory. Absolute paths must "
                                        "lie under the output or user directory, or a root the server owner lists "
                                        "in CARNATOR_CACHE_ROOTS. Or redis:// (the server's Redis) / "
                                        "redis://host:port/db to share one cache between servers: the server owner "
                                        "sets the full URL with its password in CARNATOR_REDIS_URL; never put a "
                                        "password here."),
                advanced(io.Float.Input("max_gb", default=0.0, min=0.0, max=1e6, step=1.0,
                                        tooltip="Byte budget of the cache in GiB; the least valuable entries are "
                                                "evicted beyond it. 0 = no limit.")),
                advanced(io.Combo.Input("policy", options=list(POLICIES), default="lcbfu",
                                        tooltip="Eviction policy: lcbfu keeps entries that were reused and save the "
                                                "most denoising per byte (aged); lru keeps the most recently used.")),
            ],
            outputs=[CACHE.Output(display_name="cache", tooltip="The cache, for the Retriever, Writer and sampler.")],
        )

    @classmethod
    def validate_inputs(cls, directory: str = "carnator_cache") -> bool | str:
        # Only `directory` is named: ComfyUI keeps checking max_gb's range and policy's options itself.
        if directory is None:  # linked from another node: checked at execution
            return True
        if is_redis_url(directory):
            try:
                resolve_redis_url(directory)
            except RedisConfigError as e:
                return str(e)
            return True
        try:
            path = resolve_cache_dir(directory, allowed_roots())
        except CachePathError as e:
            return str(e)
        return adoption_problem(path) or True

    @classmethod
    def fingerprint_inputs(cls, directory: str = "carnator_cache", max_gb: float = 0.0, policy: str = "lcbfu",
                           **kwargs: Any) -> Any:
        # ComfyUI re-runs a node, and everything downstream of it, when this value changes. It follows the cache's
        # purge count: after a purge the same graph runs again (and fills the emptied cache) instead of ComfyUI's
        # node cache handing back the previous output. Writes do not change it, so a requeued identical graph is
        # still answered by ComfyUI's node cache.
        try:
            if not is_redis_url(directory):
                path = resolve_cache_dir(directory, allowed_roots())
                if adoption_problem(path) or not (path / MARKER).is_file():
                    return (str(path), 0)  # not a cache yet: as a fresh one (its first purge makes it 1)
            handle = _loader_handle(directory, max_gb, policy)
            return (handle.path, purge_count(open_store(handle)))
        except Exception as e:  # noqa: BLE001 — validation and execute report the problem; here only stay stable
            return ("unusable", str(e))

    @classmethod
    def execute(cls, directory: str, max_gb: float = 0.0, policy: str = "lcbfu") -> io.NodeOutput:
        handle = _loader_handle(directory, max_gb, policy)
        # Create/validate now, so a bad directory fails here and not downstream. Never fails for an unreachable
        # Redis: requests then run dense (one log line).
        open_store(handle)
        return io.NodeOutput(handle)


def _loader_handle(directory: str, max_gb: float, policy: str) -> CacheHandle:
    """The handle the Cache loader gives for these inputs (confined directory or configured Redis URL)."""
    if not math.isfinite(max_gb) or max_gb < 0:
        raise ValueError(f"max_gb must be a finite number >= 0, got {max_gb}")
    budget = int(max_gb * 2**30) or None
    if is_redis_url(directory):
        return CacheHandle(path=resolve_redis_url(directory), max_bytes=budget, policy=policy)
    path = resolve_cache_dir(directory, allowed_roots())
    return CacheHandle(path=str(path), max_bytes=budget, policy=policy, key_path=key_path())


class CarnatorCacheStats(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CarnatorCacheStats",
            display_name="Carnator Cache Stats",
            category="Carnator",
            description="Shows entries, size, hits and hit rate of a cache; optionally purges it.",
            is_output_node=True,
            inputs=[
                CACHE.Input("cache", tooltip="The cache to inspect (from Carnator Cache)."),
                io.Boolean.Input("purge", default=False,
                                 tooltip="Delete entries before reporting: all of them, or only the namespace below. "
                                         "Runs on every queue while enabled."),
                io.String.Input("namespace", default="",
                                tooltip="Restrict the report (and a purge) to this namespace; empty = all."),
            ],
            outputs=[io.String.Output(display_name="stats", tooltip="The statistics as text.")],
        )

    @classmethod
    def fingerprint_inputs(cls, **kwargs: Any) -> Any:
        return float("nan")  # statistics change without any input changing: always re-run

    @classmethod
    def execute(cls, cache: CacheHandle, purge: bool = False, namespace: str = "") -> io.NodeOutput:
        store = open_store(_handle(cache))
        ns = (namespace or "").strip() or None
        lines = []
        try:
            if purge:
                n = store.purge(ns)
                _history.mark_purge()
                lines.append(f"purged {n} entries" + (f" of namespace {ns}" if ns else ""))
            lines.append(store.stats(ns).to_text())
        except CacheUnavailableError as e:
            lines.append(str(e))
        text = "\n".join(lines)
        return io.NodeOutput(text, ui=ui.PreviewText(text))


class CarnatorCacheRetriever(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CarnatorCacheRetriever",
            display_name="Carnator Cache Retriever",
            category="Carnator",
            description="Recalls the cached generations whose prompts are most similar to the probed request, "
                        "among entries of the same model and generation config only. Like any ComfyUI node it "
                        "re-runs when its inputs change (a new prompt, seed or setting gives a new probe).",
            inputs=[
                CACHE.Input("cache", tooltip="The cache to search (from Carnator Cache)."),
                PROBE.Input("probe", tooltip="The probed request (from Carnator Early Probe)."),
                advanced(io.Int.Input("k", default=DEFAULT_TOP_K, min=1, max=64,
                                      tooltip="How many candidates to recall (top-K by prompt similarity).")),
                advanced(io.Float.Input("min_similarity", default=DEFAULT_MIN_SIMILARITY, min=-1.0, max=1.0, step=0.01,
                                        tooltip="Drop candidates whose cosine prompt similarity is below this.")),
            ],
            outputs=[CANDIDATES.Output(display_name="candidates", tooltip="Top-K candidates for the Risk Filter.")],
        )

    @classmethod
    def execute(cls, cache: CacheHandle, probe: Any, k: int = DEFAULT_TOP_K,
                min_similarity: float = DEFAULT_MIN_SIMILARITY) -> io.NodeOutput:
        _probe_parts(probe)
        return io.NodeOutput(recall(open_store(_handle(cache)), _as_probe(probe), int(k), float(min_similarity)))


class CarnatorCacheWriter(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CarnatorCacheWriter",
            display_name="Carnator Cache Writer",
            category="Carnator",
            description="Stores the finished generation (latents, signature, attention structure) as a cache entry.",
            is_output_node=True,
            inputs=[
                CACHE.Input("cache", tooltip="The cache to write to (from Carnator Cache)."),
                PROBE.Input("probe", tooltip="The probed request (from Carnator Early Probe)."),
                SIGNATURE.Input("signature",
                                tooltip="The request's Early Signature (from Carnator Signature Builder)."),
                io.Latent.Input("latent",
                                tooltip="The finished LATENT of this request (from the Joint Reuse Sampler)."),
                REPORT.Input("report", optional=True,
                             tooltip="The sampler's run report: adds the recorded attention block structure."),
                advanced(io.Boolean.Input("store_reused", default=False,
                                          tooltip="Also store results that were themselves produced by reusing an "
                                                  "entry (approximations could compound). Off: only dense runs.")),
            ],
            outputs=[io.String.Output(display_name="entry_id", tooltip="The stored entry's id (empty if skipped).")],
        )

    @classmethod
    def fingerprint_inputs(cls, **kwargs: Any) -> Any:
        # Always runs (a duplicate write is one indexed query): when ComfyUI's node cache answers a requeued
        # identical graph, no other Carnator node runs, and this node is what puts the run's report into /history.
        return float("nan")

    @classmethod
    def execute(cls, cache: CacheHandle, probe: Any, signature: Signature, latent: dict, report: Any = None,
                store_reused: bool = False) -> io.NodeOutput:
        _probe_parts(probe)
        if not isinstance(signature, Signature):
            raise TypeError("the 'signature' input is not a Carnator signature: connect the CARNATOR_SIGNATURE output "
                            "of a Carnator Signature Builder node")
        samples = latent.get("samples") if isinstance(latent, dict) else None
        # A hit is kept as its answer at the sampler (never reused itself) unless store_reused keeps it as an entry.
        done = write_result(open_store(_handle(cache)), _as_probe(probe), signature, samples, report,
                            store_reused=bool(store_reused), answer_key=getattr(report, "answer_key", "") or "")
        served = None
        if report is not None and _seen_before(report):
            # The same report object again: ComfyUI's node cache served the sampler's output without running it.
            served = node_cache_report(_as_probe(probe), report, done.entry_id).to_meta()
            p = _as_probe(probe)
            _history.record(namespace_key(p.model_fingerprint, p.config), served, prompt=p.prompt, seed=p.seed)
        if done.not_cached and report is not None:
            # The clip is fine but the cache could not keep it (full disk, read-only, unreachable): say so on the
            # badge, with the run's report.
            served = {**(served or report.to_meta()), "not_cached": done.not_cached}
        return io.NodeOutput(done.entry_id, ui=_WriterText(done.text, served))


class _WriterText(ui.PreviewText):
    """The Writer's preview text, plus the run's ``carnator_report`` when the node cache answered the graph."""

    def __init__(self, value: str, report: dict | None = None) -> None:
        super().__init__(value)
        self.report = report

    def as_dict(self) -> dict:
        out = dict(super().as_dict())
        if self.report is not None:
            out["carnator_report"] = [self.report]
        return out


# Reports this process's Writers have seen, by identity (weak: nothing is kept alive). ComfyUI hands a cached
# node output to the next prompt as the very same object, and a sampler run always makes a new report.
_SEEN_REPORTS: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()


def _seen_before(report: Any) -> bool:
    try:
        if _SEEN_REPORTS.get(id(report)) is report:
            return True
        _SEEN_REPORTS[id(report)] = report
    except TypeError:  # not weak-referenceable: cannot tell, report nothing extra
        pass
    return False


def purge_count(store: Any) -> int:
    """How often ``store`` was purged (0 for a store that does not count its purges)."""
    count = getattr(store, "purge_count", None)
    return int(count()) if callable(count) else 0


def _as_probe(probe: Any) -> Probe:
    if not isinstance(probe, Probe):
        raise TypeError(f"the 'probe' input is a {type(probe).__name__}: connect the CARNATOR_PROBE output of a "
                        "Carnator Early Probe node")
    return probe


def _handle(cache: Any) -> CacheHandle:
    if not isinstance(cache, CacheHandle):
        raise TypeError("the 'cache' input is not a Carnator cache: connect the output of a Carnator Cache node")
    return cache


NODES = [CarnatorCacheLoader, CarnatorCacheStats, CarnatorCacheRetriever, CarnatorCacheWriter]
