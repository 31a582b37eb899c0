"""Cache nodes inside an in-process ComfyUI: schemas, Cache loader path confinement, Writer -> Retriever -> Stats."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_cache_store import CFG, GRID, make_sig

pytestmark = pytest.mark.comfy


@pytest.fixture()
def cache_nodes(comfy_dirs):
    import carnator.nodes.cache as cache

    return cache


def _probe(seed: int = 3, prompt: str = "a red cat on a sofa", emb_seed: int = 0):
    from carnator.carnator_core.types import Probe

    g = torch.Generator().manual_seed(seed)
    return Probe(arch="wan21", model_fingerprint="tiny-wan-fp", config=CFG, prompt=prompt, seed=seed, objects=(),
                 object_source="none", object_maps={}, grid=GRID, patch=(1, 2, 2),
                 x0_probe=torch.randn(CFG.latent_shape, generator=g),
                 latent_probe=torch.randn(CFG.latent_shape, generator=g),
                 latent_rgb_factors=None, latent_rgb_bias=None,
                 embedding=np.random.default_rng(emb_seed).standard_normal(64).astype(np.float32),
                 timings={"probe_ms": 12.0})


def _report(decision: str = "miss"):
    from carnator.carnator_core.reuse import RunReport
    from carnator.carnator_core.types import BlockStructure

    bs = BlockStructure(keep=np.random.default_rng(0).random((2, 2, 4, 4)) < 0.5, layers=(1, 2), block_size=64,
                        n_tokens=200, steps=(4,))
    return RunReport(decision=decision, mode="dense" if decision != "hit" else "joint",
                     entry_id=None if decision != "hit" else "0123456789abcdef", active_fraction=1.0,
                     block_density=bs.density, steps_total=10, steps_probe=2, model_calls=8, replayed_calls=2,
                     skipped_calls=0, token_fraction=1.0, attention_fraction=1.0, timings_ms={"sample": 5.0},
                     block_structure=bs if decision != "hit" else None)


def test_schemas(cache_nodes):
    ids = {n.define_schema().node_id for n in cache_nodes.NODES}
    assert ids == {"CarnatorCacheLoader", "CarnatorCacheStats", "CarnatorCacheRetriever", "CarnatorCacheWriter"}
    for node in cache_nodes.NODES:
        schema = node.define_schema()
        assert schema.display_name.startswith("Carnator ") and schema.category == "Carnator"
        for inp in schema.inputs:
            assert inp.tooltip, (schema.node_id, inp.id)
        info = node.GET_NODE_INFO_V1()
        assert info["name"] == schema.node_id
    adv = {(n.define_schema().node_id, i.id) for n in cache_nodes.NODES for i in n.define_schema().inputs
           if i.as_dict().get("advanced")}
    assert adv == {("CarnatorCacheLoader", "max_gb"), ("CarnatorCacheLoader", "policy"),
                   ("CarnatorCacheRetriever", "k"), ("CarnatorCacheRetriever", "min_similarity"),
                   ("CarnatorCacheWriter", "store_reused")}
    assert cache_nodes.CarnatorCacheWriter.define_schema().is_output_node
    assert cache_nodes.CarnatorCacheStats.define_schema().is_output_node


def test_loader_confines_the_directory(cache_nodes, tmp_path, monkeypatch):
    from carnator.carnator_core.cache import CacheHandle, CachePathError

    Loader = cache_nodes.CarnatorCacheLoader
    h = Loader.execute(directory="carnator_cache", max_gb=1.5, policy="lru").result[0]
    assert isinstance(h, CacheHandle) and h.path == str((tmp_path / "output" / "carnator_cache").resolve())
    assert h.max_bytes == int(1.5 * 2**30) and h.policy == "lru"
    assert (tmp_path / "output" / "carnator_cache" / "carnator-cache.json").exists()
    assert (tmp_path / "user" / "carnator" / "index-hmac.key").exists()  # the key lives outside the cache dir
    assert Loader.execute(directory=str(tmp_path / "user" / "mycache")).result[0].path.endswith("mycache")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "output" / "link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    for bad in ("../elsewhere", "link", "link/c", str(tmp_path / "elsewhere" / "c"), "/etc/carnator"):
        msg = Loader.validate_inputs(directory=bad)
        assert isinstance(msg, str) and "CARNATOR_CACHE_ROOTS" in msg, bad
        with pytest.raises(CachePathError):
            Loader.execute(directory=bad)
    assert not list((tmp_path / "elsewhere").iterdir())
    assert Loader.validate_inputs(directory="carnator_cache") is True
    monkeypatch.setenv("CARNATOR_CACHE_ROOTS", str(tmp_path / "elsewhere"))  # the server owner adds a root
    assert Loader.validate_inputs(directory=str(tmp_path / "elsewhere" / "c")) is True
    assert Loader.execute(directory=str(tmp_path / "elsewhere" / "c")).result[0].path.endswith("c")


def test_writer_retriever_stats(cache_nodes):
    from carnator.carnator_core.types import Candidates, namespace_key

    handle = cache_nodes.CarnatorCacheLoader.execute(directory="carnator_cache").result[0]
    probe, sig = _probe(), make_sig(("cat",))
    latent = {"samples": torch.randn((1, *CFG.latent_shape))}
    Writer, Retriever = cache_nodes.CarnatorCacheWriter, cache_nodes.CarnatorCacheRetriever
    Stats = cache_nodes.CarnatorCacheStats
    out = Writer.execute(cache=handle, probe=probe, signature=sig, latent=latent, report=_report())
    eid = out.result[0]
    assert len(eid) == 16 and "stored entry" in out.ui.as_dict()["text"][0]
    assert "attention block structure" in out.ui.as_dict()["text"][0]
    again = Writer.execute(cache=handle, probe=probe, signature=sig, latent=latent, report=_report())
    assert again.result[0] == eid and "already cached" in again.ui.as_dict()["text"][0]
    skipped = Writer.execute(cache=handle, probe=_probe(seed=4), signature=sig, latent=latent, report=_report("hit"))
    assert skipped.result[0] == "" and "not stored" in skipped.ui.as_dict()["text"][0]

    found = Retriever.execute(cache=handle, probe=_probe(seed=9), k=5, min_similarity=0.0).result[0]
    assert isinstance(found, Candidates) and found.namespace == namespace_key("tiny-wan-fp", CFG)
    assert [c.entry_id for c in found.items] == [eid] and found.items[0].similarity == pytest.approx(1.0, abs=1e-5)
    assert found.items[0].signature.object_names() == ("cat",) and found.retrieval_ms > 0
    entry = handle.store().load(eid)
    assert torch.equal(entry.tensors["latent_final"], latent["samples"][0])
    assert torch.equal(entry.tensors["x0_probe"], probe.x0_probe) and entry.block_structure.layers == (1, 2)
    assert entry.meta["report"]["decision"] == "miss" and entry.meta["probe_timings_ms"]["probe_ms"] == 12.0

    text = Stats.execute(cache=handle, purge=False, namespace="").result[0]
    # The Retriever alone counts no lookup: the Joint Reuse Sampler counts it when the request is served (so an
    # interrupted request counts nothing); the direct load above counted a hit.
    assert "entries: 1" in text and "lookups: 0  hits: 1" in text
    assert Stats.fingerprint_inputs() != Stats.fingerprint_inputs()  # always re-runs
    text = Stats.execute(cache=handle, purge=True, namespace="").result[0]
    assert "purged 1 entries" in text and "entries: 0" in text
    assert Retriever.execute(cache=handle, probe=_probe(seed=9), k=5, min_similarity=0.0).result[0].items == ()


def test_writer_and_retriever_errors(cache_nodes):
    handle = cache_nodes.CarnatorCacheLoader.execute(directory="carnator_cache").result[0]
    Writer, Retriever = cache_nodes.CarnatorCacheWriter, cache_nodes.CarnatorCacheRetriever
    with pytest.raises(ValueError, match="belongs to this probe"):
        Writer.execute(cache=handle, probe=_probe(), signature=make_sig(),
                       latent={"samples": torch.zeros(1, 16, 3, 4, 4)})
    with pytest.raises(ValueError, match="video LATENT"):
        Writer.execute(cache=handle, probe=_probe(), signature=make_sig(), latent={"samples": torch.zeros(1, 16, 4, 4)})
    with pytest.raises(TypeError, match="CARNATOR_SIGNATURE"):
        Writer.execute(cache=handle, probe=_probe(), signature="nope",
                       latent={"samples": torch.zeros(1, *CFG.latent_shape)})
    with pytest.raises(TypeError, match="Early Probe"):
        Retriever.execute(cache=handle, probe=object(), k=5, min_similarity=0.0)
    with pytest.raises(TypeError, match="Carnator Cache node"):
        Retriever.execute(cache="/tmp/x", probe=_probe(), k=5, min_similarity=0.0)
