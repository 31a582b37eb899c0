"""Exact repeats answered before the probe, vanished entries, and start images in the key — on tiny models from
ComfyUI's own classes, through the nodes and through ``request.serve`` (the same stage functions).

* An identical request (model incl. patches, settings, positive and negative conditioning, seed, latent) is
  answered from the cache with zero model calls, bit-identical to the stored dense result (= KSampler), and counts
  as a hit in the report, the store's counters and the ``carnator request:`` log line; a fresh Store instance
  (a restarted server) answers it too. Anything that differs (seed, negative prompt, noise mask, a CFG patch on
  the MODEL, batch) runs the model.
* An accepted entry that vanishes before the sampler loads it (evicted, purged, quarantined) gives a dense
  resume with one log line, never a failed prompt.
* Wan 2.2 TI2V: a different start image is another namespace, so it is never recalled or reused.
"""
from __future__ import annotations

import logging

import pytest
import torch

pytestmark = pytest.mark.comfy

PROMPT = "a red ball"


@pytest.fixture(scope="module")
def env(comfy_env, tmp_path_factory):
    import tiny_models as tm

    d = tmp_path_factory.mktemp("tiny")
    return tm, {name: tm.load_tiny_model(name, d) for name in ("wan21", "wan22")}


def _graph(model, pos, neg, lat, handle, seed=5, steps=8):
    """The node graph of one request: probe -> signature -> retriever -> filter -> sampler -> writer."""
    from carnator.nodes.cache import CarnatorCacheRetriever, CarnatorCacheWriter
    from carnator.nodes.probe import CarnatorEarlyProbe
    from carnator.nodes.risk import CarnatorRiskFilter
    from carnator.nodes.sampler import CarnatorJointReuseSampler
    from carnator.nodes.signature import CarnatorSignatureBuilder

    probe = CarnatorEarlyProbe.execute(model, pos, neg, lat, seed, steps, 5.0, "euler", "simple", 2, PROMPT, None,
                                       None, "ball", cache=handle).result[0]
    sig = CarnatorSignatureBuilder.execute(probe).result[0]
    cands = CarnatorCacheRetriever.execute(cache=handle, probe=probe, k=5, min_similarity=0.0).result[0]
    decision = CarnatorRiskFilter.execute(cands, "", "prompt_only", 0.99, False, signature=sig, probe=probe).result[0]
    out = CarnatorJointReuseSampler.execute(model, pos, neg, lat, probe, decision, sig, handle, "joint")
    latent, report, summary = out.result
    written = CarnatorCacheWriter.execute(cache=handle, probe=probe, signature=sig, latent=latent, report=report)
    return probe, decision, latent, report, out.ui["carnator_report"][0], written


def test_exact_repeat_through_the_nodes_is_bit_identical_with_zero_model_calls(env, comfy_dirs, caplog):
    import nodes as comfy_nodes
    from carnator.nodes.cache import CarnatorCacheLoader

    tm, models = env
    m = models["wan21"]
    pos, neg = tm.conditioning("wan21")
    lat = tm.empty_latent("wan21")
    handle = CarnatorCacheLoader.execute(directory="exact").result[0]
    store = handle.store()
    ref = comfy_nodes.common_ksampler(m, 5, 8, 5.0, "euler", "simple", pos, neg, lat)[0]["samples"]
    with tm.count_calls(m) as calls:
        probe, decision, first, report, _, written = _graph(m, pos, neg, lat, handle)
    assert len(calls) == 8 and report.decision == "miss" and probe.request_key and probe.answered is None
    assert torch.equal(first["samples"], ref)
    entry_id = written.result[0]
    assert len(entry_id) == 16 and store.find_request(probe.request_key) == entry_id
    before = store.stats()

    caplog.set_level(logging.INFO, logger="carnator")
    with tm.count_calls(m) as calls:
        probe2, decision2, again, report2, ui, written2 = _graph(m, pos, neg, lat, handle)
    assert calls == [], f"{len(calls)} model calls on an exact repeat"
    assert probe2.answered is not None and probe2.answered.entry_id == entry_id
    assert decision2.accepted and decision2.mode == "exact" and decision2.candidate.entry_id == entry_id
    assert torch.equal(again["samples"], first["samples"]) and again["samples"].dtype == first["samples"].dtype
    assert (report2.decision, report2.mode, report2.entry_id) == ("hit", "exact", entry_id)
    assert report2.model_calls == 0 and report2.compute_fraction == 0.0 and report2.skipped_calls == 8
    assert ui["decision"] == "hit" and ui["mode"] == "exact" and ui["entry_id"] == entry_id
    assert written2.result[0] == entry_id and "already cached" in written2.ui.as_dict()["text"][0]
    after = store.stats()
    assert (after.lookups - before.lookups, after.hits - before.hits, after.entries) == (1, 1, before.entries)
    assert any("carnator request: HIT" in r.getMessage() and "mode=exact" in r.getMessage() for r in caplog.records)
    from carnator.nodes.sampler import CarnatorJointReuseSampler

    with pytest.raises(ValueError, match="MODEL differs"):  # the answer is for the probe's model only
        CarnatorJointReuseSampler.execute(models["wan22"], pos, neg, lat, probe2, decision2, None, handle, "joint")


def test_anything_that_decides_the_output_is_part_of_the_key(env, comfy_dirs):
    from carnator.carnator_core.cache.store import Store
    from carnator.carnator_core.probe import ProbeConfig
    from carnator.carnator_core.request import RequestSpec, ServeOptions, serve

    tm, models = env
    m = models["wan21"]
    pos, neg = tm.conditioning("wan21")
    lat = tm.empty_latent("wan21")
    store = Store.open(comfy_dirs / "c", key_path=comfy_dirs / "key")
    opts = ServeOptions(method="prompt_only", prompt_threshold=2.0, probe=ProbeConfig(probe_steps=2))

    def run(model=m, p=pos, n=neg, latent=lat, seed=5, options=opts, st=store):
        with tm.count_calls(model) as calls:
            res = serve(model, None, p, n, latent, RequestSpec(PROMPT, seed, 8, 5.0, objects="ball"), st, options)
        return res, len(calls)

    first, n_first = run()
    assert n_first == 8 and first.entry_id and not first.exact
    restarted = Store.open(comfy_dirs / "c", key_path=comfy_dirs / "key")  # what a server restart sees
    again, n_again = run(st=restarted)
    assert n_again == 0 and again.exact and torch.equal(again.latent["samples"], first.latent["samples"])
    assert again.report.decision == "hit" and again.entry_id == first.entry_id

    patched = m.clone()
    patched.set_model_sampler_post_cfg_function(lambda args: args["denoised"] * 0.9)  # RescaleCFG-like
    mask_lat = dict(lat, noise_mask=torch.ones(1, 1, 3, 8, 8))
    for what, kwargs in {"seed": {"seed": 6}, "negative": {"n": tm.conditioning("wan21", seed=9)[1]},
                         "noise mask": {"latent": mask_lat}, "model patch": {"model": patched},
                         "exact off": {"options": ServeOptions(method="prompt_only", prompt_threshold=2.0,
                                                               exact=False, probe=ProbeConfig(probe_steps=2))}}.items():
        res, n = run(**kwargs)
        assert not res.exact and n > 0, what
    # "never" (calibration's dense path) and "dense" always compute.
    for method in ("never", "dense"):
        res, n = run(options=ServeOptions(method=method, write=False, probe=ProbeConfig(probe_steps=2)))
        assert not res.exact and n == 8, method


def test_exact_repeat_through_the_shared_redis_cache(env, comfy_dirs):
    """Another worker on the same Redis answers an identical request with zero model calls, bit-identical, counted
    as one lookup and one hit; once the entry is deleted the request runs again (and is cached again)."""
    from harness_redis import RedisServer

    from carnator.carnator_core.cache.redis_store import RedisStore
    from carnator.carnator_core.probe import ProbeConfig
    from carnator.carnator_core.request import RequestSpec, ServeOptions, serve

    tm, models = env
    m = models["wan21"]
    pos, neg = tm.conditioning("wan21")
    lat = tm.empty_latent("wan21")
    opts = ServeOptions(method="prompt_only", prompt_threshold=2.0, probe=ProbeConfig(probe_steps=2))
    spec = RequestSpec(PROMPT, 5, 8, 5.0, objects="ball")
    srv = RedisServer(comfy_dirs / "redis")
    try:
        srv.start()
        worker_a = RedisStore.open(srv.url, full_url=srv.url)
        worker_b = RedisStore.open(srv.url, full_url=srv.url)

        def run(st):
            with tm.count_calls(m) as calls:
                res = serve(m, None, pos, neg, lat, spec, st, opts)
            return res, len(calls)

        first, n_first = run(worker_a)
        assert n_first == 8 and first.entry_id and not first.exact
        assert worker_b.find_request(first.probe.request_key) == first.entry_id
        before = worker_b.stats()
        again, n_again = run(worker_b)
        assert n_again == 0 and again.exact and again.entry_id == first.entry_id
        assert torch.equal(again.latent["samples"], first.latent["samples"]) and again.report.decision == "hit"
        after = worker_a.stats()
        assert (after.lookups - before.lookups, after.hits - before.hits, after.entries) == (1, 1, before.entries)
        assert worker_a.delete(first.entry_id)
        third, n_third = run(worker_b)  # the entry is gone: never answered from a stale key
        assert n_third == 8 and not third.exact and third.entry_id != first.entry_id
        assert torch.equal(third.latent["samples"], first.latent["samples"])
        assert worker_a.find_request(first.probe.request_key) == third.entry_id
    finally:
        srv.stop()


def test_a_batch_is_never_answered_by_key(env, comfy_dirs):
    from carnator.carnator_core.cache.store import Store
    from carnator.carnator_core.probe import ProbeConfig
    from carnator.carnator_core.request import RequestSpec, ServeOptions, serve

    tm, models = env
    m = models["wan21"]
    pos, neg = tm.conditioning("wan21")
    store = Store.open(comfy_dirs / "b", key_path=comfy_dirs / "key")
    opts = ServeOptions(method="prompt_only", prompt_threshold=2.0, probe=ProbeConfig(probe_steps=2))
    spec = RequestSpec(PROMPT, 5, 8, 5.0, objects="ball")
    first = serve(m, None, pos, neg, tm.empty_latent("wan21", batch=2), spec, store, opts)
    assert first.entry_id and store.find_request(first.probe.request_key) is None  # only item 0 is stored
    again = serve(m, None, pos, neg, tm.empty_latent("wan21", batch=2), spec, store, opts)
    assert not again.exact and again.latent["samples"].shape[0] == 2


@pytest.mark.parametrize("how", ["deleted", "purged", "quarantined"])
def test_accepted_entry_that_vanishes_means_a_dense_resume(env, comfy_dirs, caplog, how):
    import nodes as comfy_nodes
    from carnator.carnator_core.probe import ProbeConfig
    from carnator.carnator_core.request import RequestSpec, probe_request, write_result
    from carnator.carnator_core.signature import build_signature
    from carnator.carnator_core.types import Candidate, Decision
    from carnator.nodes.cache import CarnatorCacheLoader
    from carnator.nodes.sampler import CarnatorJointReuseSampler

    tm, models = env
    m = models["wan21"]
    pos, neg = tm.conditioning("wan21")
    lat = tm.empty_latent("wan21")
    handle = CarnatorCacheLoader.execute(directory=f"vanish-{how}").result[0]
    store = handle.store()
    spec = RequestSpec(PROMPT, 5, 8, 5.0, objects="ball")
    probe = probe_request(m, pos, neg, lat, spec, ProbeConfig(probe_steps=2))
    sig = build_signature(probe)
    dense = comfy_nodes.common_ksampler(m, 5, 8, 5.0, "euler", "simple", pos, neg, lat)[0]["samples"]
    from carnator.carnator_core.reuse import RunReport

    entry_id = write_result(store, probe, sig, dense, RunReport(
        decision="dense", mode="dense", entry_id=None, active_fraction=1.0, block_density=None, steps_total=8,
        steps_probe=2, model_calls=6, replayed_calls=2, skipped_calls=0, token_fraction=1.0, attention_fraction=1.0,
        timings_ms={})).entry_id
    decision = Decision(True, Candidate(entry_id, 0.99, PROMPT, sig), (), "signature", summary="accepted")
    if how == "deleted":
        store.delete(entry_id)
    elif how == "purged":
        store.purge()
    else:
        path = next((store.root / "entries").glob(f"*/{entry_id}.safetensors"))
        blob = bytearray(path.read_bytes())
        blob[-16:] = bytes(16)  # a flipped tail: the checksum fails and the entry is quarantined on load
        path.write_bytes(bytes(blob))
    caplog.set_level(logging.INFO, logger="carnator")
    out = CarnatorJointReuseSampler.execute(m, pos, neg, lat, probe, decision, sig, handle, "joint")
    latent, report, summary = out.result
    assert report.decision == "miss" and report.mode == "dense" and entry_id in report.reason
    assert torch.equal(latent["samples"], dense)  # the dense result, as if nothing had been accepted
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
             and r.getMessage().startswith("carnator request:")]  # the store logs its quarantine on its own
    assert len(lines) == 1 and "continuing dense" in lines[0], lines
    assert ("quarantined" if how == "quarantined" else "no longer in the cache") in lines[0]


def _ti2v_latent(value: float) -> dict:
    """What Wan22ImageToVideoLatent produces for a start image: its latent in frame 0, noise mask 0 there."""
    samples = torch.zeros(1, 48, 3, 8, 8)
    samples[:, :, :1] = value
    mask = torch.ones(1, 1, 3, 8, 8)
    mask[:, :, :1] = 0.0
    return {"samples": samples, "noise_mask": mask}


def test_a_different_start_image_is_never_reused_on_wan22(env, comfy_dirs):
    from carnator.carnator_core.cache.store import Store
    from carnator.carnator_core.probe import ProbeConfig
    from carnator.carnator_core.request import RequestSpec, ServeOptions, serve
    from carnator.carnator_core.reuse import ReuseConfig

    tm, models = env
    m = models["wan22"]
    pos, neg = tm.conditioning("wan22")
    store = Store.open(comfy_dirs / "w22", key_path=comfy_dirs / "key")
    # prompt_only with a threshold every candidate passes: only the key can keep a request from reusing.
    # max_active=1: the positive control (c) must reuse however large its region on random weights.
    opts = ServeOptions(method="prompt_only", prompt_threshold=-1.0, probe=ProbeConfig(probe_steps=2),
                        reuse=ReuseConfig(max_active=1.0))

    def run(image: float, seed: int):
        return serve(m, None, pos, neg, _ti2v_latent(image), RequestSpec(PROMPT, seed, 8, 5.0, objects="ball"), store,
                     opts)

    a = run(0.5, 1)
    assert a.report.decision == "miss" and a.entry_id and a.probe.config.conditioning
    b = run(-0.5, 2)  # another start image, same prompt
    assert b.candidates.items == () and b.report.decision == "miss"
    assert b.probe.config.conditioning != a.probe.config.conditioning
    c = run(0.5, 3)  # the first start image again, another seed: same namespace, recalled and reused
    assert [x.entry_id for x in c.candidates.items] == [a.entry_id] and c.report.decision == "hit"
    assert not c.exact
