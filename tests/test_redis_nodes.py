"""Cache nodes on the shared Redis store, inside an in-process ComfyUI: the loader takes redis:// (never a
password; only a Redis the server owner configured), Writer -> Retriever -> Stats work against it, and an
unreachable Redis costs the prompt nothing (the Writer reports "not stored")."""
from __future__ import annotations

import pytest
import torch
from harness_redis import RedisServer
from test_cache_nodes import _probe, _report, cache_nodes  # noqa: F401 - cache_nodes is a fixture
from test_cache_store import CFG, make_sig

pytestmark = pytest.mark.comfy


@pytest.fixture()
def redis_env(tmp_path, monkeypatch):
    srv = RedisServer(tmp_path / "redis")
    srv.start()
    try:
        monkeypatch.setenv("CARNATOR_REDIS_URL", srv.url)
        yield srv
    finally:
        srv.stop()


def test_loader_takes_a_configured_redis_url_only(cache_nodes, redis_env, monkeypatch):  # noqa: F811
    from carnator.carnator_core.cache import CacheHandle
    from carnator.carnator_core.cache.redis_store import RedisStore

    Loader = cache_nodes.CarnatorCacheLoader
    assert Loader.validate_inputs(directory="redis://") is True
    assert Loader.validate_inputs(directory=redis_env.url) is True
    msg = Loader.validate_inputs(directory=f"redis://:hunter2@127.0.0.1:{redis_env.port}/0")
    assert isinstance(msg, str) and "never be saved in a workflow" in msg and "hunter2" not in msg
    msg = Loader.validate_inputs(directory="redis://10.1.2.3:6379/0")
    assert isinstance(msg, str) and "CARNATOR_REDIS_URL" in msg
    h = Loader.execute(directory="redis://", max_gb=0.5, policy="lru").result[0]
    assert isinstance(h, CacheHandle) and h.path == redis_env.url and h.max_bytes == 2**29
    st = h.store()
    assert isinstance(st, RedisStore) and st.max_bytes == 2**29 and st.policy == "lru"
    monkeypatch.delenv("CARNATOR_REDIS_URL")
    assert "CARNATOR_REDIS_URL" in Loader.validate_inputs(directory="redis://")


def test_writer_retriever_stats_on_redis(cache_nodes, redis_env):  # noqa: F811
    from carnator.carnator_core.types import namespace_key

    handle = cache_nodes.CarnatorCacheLoader.execute(directory="redis://").result[0]
    probe, sig = _probe(), make_sig(("cat",))
    latent = {"samples": torch.randn((1, *CFG.latent_shape))}
    Writer, Retriever, Stats = (cache_nodes.CarnatorCacheWriter, cache_nodes.CarnatorCacheRetriever,
                                cache_nodes.CarnatorCacheStats)
    eid = Writer.execute(cache=handle, probe=probe, signature=sig, latent=latent, report=_report()).result[0]
    assert len(eid) == 16
    again = Writer.execute(cache=handle, probe=probe, signature=sig, latent=latent, report=_report())
    assert again.result[0] == eid and "already cached" in again.ui.as_dict()["text"][0]
    found = Retriever.execute(cache=handle, probe=_probe(seed=9), k=5, min_similarity=0.0).result[0]
    assert found.namespace == namespace_key("tiny-wan-fp", CFG) and [c.entry_id for c in found.items] == [eid]
    assert torch.equal(handle.store().load(eid).tensors["latent_final"], latent["samples"][0])
    text = Stats.execute(cache=handle, purge=False, namespace="").result[0]
    # The Retriever alone counts no lookup (the sampler counts it when the request is served); the load counted a hit.
    assert f"Carnator cache at {redis_env.url}" in text and "entries: 1" in text and "lookups: 0  hits: 1" in text
    text = Stats.execute(cache=handle, purge=True, namespace="").result[0]
    assert "purged 1 entries" in text and "entries: 0" in text

    redis_env.stop()  # Redis goes away mid-run: nodes answer, nothing raises
    out = Writer.execute(cache=handle, probe=_probe(seed=5), signature=sig, latent=latent, report=_report())
    assert out.result[0] == "" and "not stored" in out.ui.as_dict()["text"][0]
    found = Retriever.execute(cache=handle, probe=_probe(seed=9), k=5, min_similarity=0.0).result[0]
    assert found.items == () and "cache unavailable" in found.note
    assert "unreachable" in Stats.execute(cache=handle, purge=False, namespace="").result[0]
