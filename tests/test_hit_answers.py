"""Exact repeats of a *hit*: the hit's result is kept as an answer-only entry under ``keys.answer_key`` (the request
key and the serving settings that decided the hit), answered with zero model calls, bit-identical to the first hit,
and never recalled or reused (reuse never chains on reuse) — in the on-disk store (also after a catalogue rebuild)
and in the shared Redis store. Any change to what decided the hit (threshold, reuse settings, prompt label) runs the
request again. On tiny models from ComfyUI's own classes, through ``request.serve``; in a node graph (whose probe
cannot see the downstream settings) a repeated hit is answered at the sampler, after its probe.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.comfy

PROMPT = "a red ball"


def _run(tm, m, store, seed, options, prompt=PROMPT):
    return tm.serve_wan21(m, store, seed, options, prompt)


def _recallable(store, res) -> set[str]:
    from carnator.carnator_core.types import namespace_key

    ns = namespace_key(res.probe.model_fingerprint, res.probe.config)
    cands = store.candidates(ns, np.asarray(res.probe.embedding), 50, min_similarity=-1.0,
                             model_fingerprint=res.probe.model_fingerprint)
    return {c.entry_id for c in cands.items}


def _check_hit_answers(tm, m, store, reopen):
    from carnator.carnator_core.cache.errors import CacheError
    from carnator.carnator_core.probe import ProbeConfig
    from carnator.carnator_core.request import RequestSpec, answer_key_for

    opts = tm.prompt_only_options()
    dense, n = _run(tm, m, store, 5, opts)
    assert n == 8 and dense.report.decision == "miss" and dense.entry_id
    hit, n_hit = _run(tm, m, store, 6, opts)
    assert hit.report.decision == "hit" and hit.report.entry_id == dense.entry_id and n_hit > 0
    key = answer_key_for(hit.probe.request_key, RequestSpec(PROMPT, 6, 8, 5.0, objects="ball"), opts.following_rule())
    answer_id = store.find_request(key)
    assert answer_id and answer_id != dense.entry_id
    assert store.find_request(hit.probe.request_key) is None  # a hit is never taken for the request's dense output
    entry = store.load(answer_id, count_hit=False)
    assert entry.answer_of == dense.entry_id and torch.equal(entry.tensors["latent_final"], hit.latent["samples"][0])
    assert set(entry.tensors) == {"latent_final"}  # never reused: the probe's tensors are not kept
    with pytest.raises(CacheError, match="answer-only"):
        entry.cached_run()

    before = store.stats()
    again, n_again = _run(tm, m, reopen(), 6, opts)  # another handle: a restarted server or another worker
    assert n_again == 0 and again.exact and again.probe.answered.answer_of == dense.entry_id
    assert torch.equal(again.latent["samples"], hit.latent["samples"])
    assert (again.report.decision, again.report.mode, again.report.entry_id) == ("hit", "exact", answer_id)
    assert "earlier hit" in again.report.reason and dense.entry_id in again.report.reason
    after = store.stats()
    assert (after.lookups - before.lookups, after.hits - before.hits, after.entries) == (1, 1, before.entries)
    assert (after.answers, after.to_meta()["answers"]) == (1, 1) and "1 answers of hits" in after.to_text()

    # Never a recall candidate: a third seed recalls (and reuses) the dense entry only.
    assert _recallable(store, dense) == {dense.entry_id}
    third, _ = _run(tm, m, store, 7, opts)
    assert third.report.decision == "hit" and third.report.entry_id == dense.entry_id
    assert store.verify().ok, store.verify().problems

    # Anything that decided the hit, changed, runs the request again (write off: each variant sees only the
    # entries above; a variant that ran dense would otherwise leave the request's dense result, a valid answer).
    for what, changed in {"threshold": tm.prompt_only_options(prompt_threshold=0.4, write=False),
                          "reuse settings": tm.prompt_only_options(reuse=replace(opts.reuse, dilation=1), write=False),
                          "probe steps": tm.prompt_only_options(probe=ProbeConfig(probe_steps=3), write=False)}.items():
        res, n = _run(tm, m, store, 6, changed)
        assert not res.exact and n > 0, what
    # another label: other recall text
    res, n = _run(tm, m, store, 6, tm.prompt_only_options(write=False), prompt=PROMPT + "!")
    assert not res.exact and n > 0
    # Deleting the reused entry leaves the answer (it is a finished result, not a reference) ...
    assert store.delete(dense.entry_id)
    last, n_last = _run(tm, m, store, 6, opts)
    assert n_last == 0 and last.exact and torch.equal(last.latent["samples"], hit.latent["samples"])
    # ... and deleting the answer means the request runs again.
    assert store.delete(answer_id)
    gone, n_gone = _run(tm, m, store, 6, opts)
    assert n_gone > 0 and not gone.exact
    return answer_id


def test_a_repeated_hit_is_answered_on_disk_and_never_recalled(tiny_wan21, comfy_dirs):
    from carnator.carnator_core.cache.store import Store

    tm, m = tiny_wan21
    root, key = comfy_dirs / "answers", comfy_dirs / "key"
    store = Store.open(root, key_path=key)
    _check_hit_answers(tm, m, store, lambda: Store.open(root, key_path=key))


def test_a_rebuilt_catalogue_keeps_answers_out_of_recall(tiny_wan21, comfy_dirs):
    from carnator.carnator_core.cache.store import Store
    from carnator.carnator_core.types import namespace_key

    tm, m = tiny_wan21
    root, key = comfy_dirs / "rebuilt", comfy_dirs / "key"
    store = Store.open(root, key_path=key)
    opts = tm.prompt_only_options()
    dense, _ = _run(tm, m, store, 5, opts)
    hit, _ = _run(tm, m, store, 6, opts)
    assert hit.report.decision == "hit"
    assert len(store.entry_ids()) == 2
    store.rebuild_catalog("test")  # the catalogue is rebuilt from the entry files alone
    fresh = Store.open(root, key_path=key)
    ns = namespace_key(dense.probe.model_fingerprint, dense.probe.config)
    cands = fresh.candidates(ns, np.asarray(dense.probe.embedding), 50, min_similarity=-1.0)
    assert [c.entry_id for c in cands.items] == [dense.entry_id]
    assert fresh.verify().ok, fresh.verify().problems
    again, n = _run(tm, m, fresh, 6, opts)
    assert n == 0 and again.exact and torch.equal(again.latent["samples"], hit.latent["samples"])


def test_a_repeated_hit_is_answered_through_the_shared_redis_cache(tiny_wan21, comfy_dirs):
    from harness_redis import RedisServer

    from carnator.carnator_core.cache.redis_store import RedisStore

    tm, m = tiny_wan21
    srv = RedisServer(comfy_dirs / "redis-answers")
    try:
        srv.start()
        worker_a = RedisStore.open(srv.url, full_url=srv.url)
        _check_hit_answers(tm, m, worker_a, lambda: RedisStore.open(srv.url, full_url=srv.url))
    finally:
        srv.stop()


def test_the_graph_writer_does_not_store_a_hit_without_store_reused(tiny_wan21, comfy_dirs):
    """Called without the sampler's answer key, a hit is still refused as a reusable entry unless store_reused."""
    from carnator.carnator_core.cache.store import Store
    from carnator.carnator_core.request import write_result

    tm, m = tiny_wan21
    store = Store.open(comfy_dirs / "graph", key_path=comfy_dirs / "key")
    opts = tm.prompt_only_options(write=False)
    _run(tm, m, store, 5, tm.prompt_only_options())
    hit, _ = _run(tm, m, store, 6, opts)
    assert hit.report.decision == "hit" and hit.report.answer_key
    res = write_result(store, hit.probe, hit.signature, hit.latent["samples"], hit.report)
    assert res.entry_id == "" and "store_reused" in res.text and len(store.entry_ids()) == 1


def _graph_hit(tm, m, handle, seed, opts):
    """The node graph's stages for one request (Early Probe with the cache, Signature Builder, Retriever, Risk
    Filter, Joint Reuse Sampler with the cache, Cache Writer node); model calls counted."""
    from carnator.carnator_core.request import (
        RequestSpec,
        decide_stage,
        probe_request,
        recall,
        reuse_stage,
        signature_stage,
    )
    from carnator.nodes.cache import CarnatorCacheWriter

    pos, neg = tm.conditioning("wan21")
    lat = tm.empty_latent("wan21")
    store = handle.store()
    with tm.count_calls(m) as calls:
        probe = probe_request(m, pos, neg, lat, RequestSpec(PROMPT, seed, 8, 5.0, objects="ball"), opts.probe,
                              tm.WordTokens(), store=store)
        probe_calls = len(calls)
        sig, _ = signature_stage(probe, opts.signature)
        decision = decide_stage(sig, recall(store, probe, 5, 0.0), probe, method="prompt_only",
                                prompt_threshold=opts.prompt_threshold)
        samples, report = reuse_stage(m, pos, neg, lat, probe, decision, store, opts.hit_reuse, signature=sig,
                                      answer_hits=True)
    written = CarnatorCacheWriter.execute(cache=handle, probe=probe, signature=sig,
                                          latent={**lat, "samples": samples}, report=report)
    _graph_hit.last = (probe, sig, decision)
    return samples, report, written.result[0], probe_calls, len(calls)


def test_a_repeated_hit_in_a_node_graph_is_answered_at_the_sampler(tiny_wan21, comfy_dirs):
    """In a node graph the Early Probe cannot know the downstream settings, so a repeated hit is answered at the
    sampler: the Writer keeps the hit under ``hit_answer_key`` (request, probe, accepted entry, reuse settings,
    target signature), and the same request reusing the same entry the same way gets that result with no model call
    after its probe, bit-identical; other reuse settings compute again; the answer is never recalled."""
    from carnator.carnator_core.request import RequestSpec, serve
    from carnator.nodes.cache import CarnatorCacheLoader

    tm, m = tiny_wan21
    handle = CarnatorCacheLoader.execute(directory="hit-graph").result[0]
    store = handle.store()
    opts = tm.prompt_only_options()
    pos, neg = tm.conditioning("wan21")
    dense = serve(m, tm.WordTokens(), pos, neg, tm.empty_latent("wan21"),
                  RequestSpec(PROMPT, 5, 8, 5.0, objects="ball"), store, opts)
    assert dense.report.decision == "miss" and dense.entry_id
    first, rep1, answer_id, k, n1 = _graph_hit(tm, m, handle, 6, opts)
    assert rep1.decision == "hit" and rep1.entry_id == dense.entry_id and n1 > k == 2
    assert answer_id and store.load(answer_id, count_hit=False).answer_of == dense.entry_id
    before = store.stats()
    again, rep2, answer2, k2, n2 = _graph_hit(tm, m, handle, 6, opts)
    assert n2 == k2 == 2, "the sampler called the model on a repeated hit"
    assert torch.equal(again, first)
    assert (rep2.decision, rep2.mode, rep2.entry_id, rep2.model_calls) == ("hit", "exact", answer_id, 0)
    assert rep2.compute_fraction == pytest.approx(2 / 8) and "after the probe" in rep2.reason
    assert answer2 == answer_id  # the Writer stores nothing new
    after = store.stats()
    assert (after.hits - before.hits, after.entries, after.answers) == (1, before.entries, 1)
    assert _recallable(store, dense) == {dense.entry_id}
    other, rep3, _, k3, n3 = _graph_hit(tm, m, handle, 6,
                                        tm.prompt_only_options(reuse=replace(opts.reuse, refreshes=2)))
    assert rep3.decision == "hit" and n3 > k3 and rep3.mode == "joint"
    # A decision whose rule certified other settings than the sampler's is no hit (reuse.sample continues dense), so
    # no answer kept under another rule may stand in for it: there is no key to look up.
    from carnator.carnator_core.request import hit_answer_key

    probe, sig, decision = _graph_hit.last
    cfg = tm.prompt_only_options(reuse=replace(opts.reuse, refreshes=2)).hit_reuse
    assert hit_answer_key(probe, decision, cfg, sig)
    assert hit_answer_key(probe, replace(decision, reuse_config=opts.hit_reuse.to_meta()), cfg, sig) == ""
    assert hit_answer_key(probe, replace(decision, reuse_config=cfg.to_meta()), cfg, sig) == \
        hit_answer_key(probe, decision, cfg, sig)
