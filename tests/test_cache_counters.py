"""The cache's counters agree with what happened: one lookup per request that used the cache, one hit per clip
actually served from reuse (an accepted entry the sampler did not reuse is no hit; a repeat of an earlier hit
answered at the sampler is one lookup, not two; a request interrupted after its recall counts nothing). Checked
through the stage API (``request.serve`` and the node graph's stages) on a tiny model built from ComfyUI's own
classes, on disk and on a real ``redis-server``: after every request the stats equal the per-request reports."""
from __future__ import annotations

from dataclasses import replace

import pytest

pytestmark = pytest.mark.comfy

PROMPT = "a red ball"


def _serve(tm, m, store, seed, options):
    return tm.serve_wan21(m, store, seed, options, PROMPT)[0].report


def _graph(tm, m, store, seed, opts):
    """The node graph's stages for one request (Early Probe with the cache, Signature Builder, Retriever, Risk
    Filter, Joint Reuse Sampler answering repeated hits, Cache Writer): its report."""
    from carnator.carnator_core.request import (
        RequestSpec,
        decide_stage,
        probe_request,
        recall,
        reuse_stage,
        signature_stage,
        write_result,
    )

    pos, neg = tm.conditioning("wan21")
    lat = tm.empty_latent("wan21")
    probe = probe_request(m, pos, neg, lat, RequestSpec(PROMPT, seed, 8, 5.0, objects="ball"), opts.probe,
                          tm.WordTokens(), store=store)
    sig, _ = signature_stage(probe, opts.signature)
    decision = decide_stage(sig, recall(store, probe, 5, 0.0), probe, method="prompt_only",
                            prompt_threshold=opts.prompt_threshold)
    samples, report = reuse_stage(m, pos, neg, lat, probe, decision, store, opts.hit_reuse, signature=sig,
                                  answer_hits=True)
    write_result(store, probe, sig, samples, report, answer_key=report.answer_key or "")
    return report


def _check_counters(tm, m, store):
    opts = tm.prompt_only_options()
    reports = []

    def agree(report, what):
        reports.append(report)
        s = store.stats()
        hits = sum(r.decision == "hit" for r in reports)
        assert (s.lookups, s.hits) == (len(reports), hits), (what, [(r.decision, r.mode) for r in reports])

    agree(_serve(tm, m, store, 5, opts), "a dense miss")
    # Accepted, but the region is larger than max_active: the sampler continues dense. Not a hit.
    declined = _serve(tm, m, store, 6,
                      tm.prompt_only_options(reuse=replace(opts.reuse, max_active=0.0), write=False))
    assert declined.decision == "miss" and "max_active" in declined.reason
    agree(declined, "an accepted entry the sampler did not reuse")
    hit = _graph(tm, m, store, 6, opts)
    assert hit.decision == "hit" and hit.mode == "joint"
    agree(hit, "a reuse hit in the graph")
    again = _graph(tm, m, store, 6, opts)
    assert (again.decision, again.mode) == ("hit", "exact")
    agree(again, "a repeat of that hit, answered at the sampler")
    agree(_serve(tm, m, store, 5, opts), "an exact repeat of the dense request, answered before the probe")
    agree(_serve(tm, m, store, 7, opts), "a reuse hit through serve")
    # A request interrupted (or its server killed) after its recall and before it was served counts nothing.
    from carnator.carnator_core.request import RequestSpec, probe_request, recall

    pos, neg = tm.conditioning("wan21")
    probe = probe_request(m, pos, neg, tm.empty_latent("wan21"), RequestSpec(PROMPT, 8, 8, 5.0, objects="ball"),
                          opts.probe, tm.WordTokens(), store=store)
    assert recall(store, probe, 5, 0.0).items
    s = store.stats()
    assert (s.lookups, s.hits) == (len(reports), sum(r.decision == "hit" for r in reports))


def test_counters_equal_the_reports_on_disk(tiny_wan21, comfy_dirs):
    from carnator.carnator_core.cache.store import Store

    tm, m = tiny_wan21
    _check_counters(tm, m, Store.open(comfy_dirs / "counters", key_path=comfy_dirs / "key"))


def test_counters_equal_the_reports_on_redis(tiny_wan21, comfy_dirs):
    from harness_redis import RedisServer

    from carnator.carnator_core.cache.redis_store import RedisStore

    tm, m = tiny_wan21
    srv = RedisServer(comfy_dirs / "redis-counters")
    try:
        srv.start()
        _check_counters(tm, m, RedisStore.open(srv.url, full_url=srv.url))
    finally:
        srv.stop()
