"""What a client learns at POST /prompt (the nodes' validate_inputs, run in-process here) and from the cache
panel's routes, instead of after a probe ran or as a 500: a missing rule file, probe_steps >= steps, a foreign
cache folder, over-long paths and bodies. And a prompt Carnator cannot embed continues dense (the probe succeeds,
nothing is retrieved or stored). In-process ComfyUI on the CPU with a tiny model."""
from __future__ import annotations

import asyncio
import json

import pytest
import torch

pytestmark = pytest.mark.comfy


def test_probe_steps_are_checked_at_queue_time(comfy_dirs):
    from carnator.nodes.probe import CarnatorEarlyProbe as P

    assert P.validate_inputs(steps=20, probe_steps=4) is True
    assert P.validate_inputs(steps=20, probe_steps=0) is True  # 0 = derived from probe_fraction
    assert "fewer than the total steps" in P.validate_inputs(steps=6, probe_steps=6)
    assert "fewer than the total steps" in P.validate_inputs(steps=6, probe_steps=9)
    assert "steps must be in" in P.validate_inputs(steps=1, probe_steps=0)  # the range check ComfyUI skips now
    assert P.validate_inputs(steps=None, probe_steps=4) is True  # linked input: checked when it runs


def test_refresh_placement_is_checked_at_queue_time(comfy_dirs):
    from carnator.nodes.sampler import CarnatorJointReuseSampler as S

    assert S.validate_inputs(refreshes=3, refresh_at="") is True
    assert S.validate_inputs(refreshes=3, refresh_at="0.6, 0.9") is True
    assert "refreshes=3 asks for 2 after the first record" in S.validate_inputs(refreshes=3, refresh_at="0.9")
    assert "comma-separated fractions" in S.validate_inputs(refreshes=2, refresh_at="late")
    assert S.validate_inputs(refreshes=None, refresh_at="late") is True  # linked input: checked when it runs


def test_rule_file_is_checked_at_queue_time(comfy_dirs):
    from carnator.nodes.risk import CarnatorRiskFilter as F

    assert F.validate_inputs(rule_file="embedded.json", mode="signature", allow_uncertified=False) is True
    # a rule file that does not exist yet is learning mode (served dense, a rule learned under that name): no 400
    assert F.validate_inputs(rule_file="nope.json", mode="signature", allow_uncertified=False) is True
    assert "too long" in F.validate_inputs(rule_file="r" * 5000, mode="signature", allow_uncertified=False)
    assert "escapes" in F.validate_inputs(rule_file="../../x.json", mode="signature", allow_uncertified=False)
    assert F.validate_inputs(rule_file="nope.json", mode="never", allow_uncertified=False) is True
    assert "mode must be one of" in F.validate_inputs(rule_file="embedded.json", mode="bogus", allow_uncertified=False)
    rules = comfy_dirs / "user" / "carnator" / "rules"
    rules.mkdir(parents=True)
    (rules / "deep.json").write_text("[" * 100000 + "]" * 100000)
    assert "nests too deeply" in F.validate_inputs(rule_file="deep.json", mode="signature", allow_uncertified=False)


def test_cache_loader_refuses_a_foreign_folder_at_queue_time(comfy_dirs):
    from carnator.nodes.cache import CarnatorCacheLoader as L

    out = comfy_dirs / "output"
    (out / "renders").mkdir()
    (out / "renders" / "shot_0001.png").write_bytes(b"png")
    msg = L.validate_inputs(directory="renders")
    assert isinstance(msg, str) and "not a Carnator cache" in msg
    assert L.validate_inputs(directory="carnator_cache") is True and not (out / "carnator_cache").exists()
    assert "too long" in L.validate_inputs(directory="d" * 6000)
    with pytest.raises(Exception, match="not a Carnator cache"):
        L.execute(directory="renders")
    assert (out / "renders" / "shot_0001.png").read_bytes() == b"png" and len(list((out / "renders").iterdir())) == 1


def _call_route(path: str, method: str, body: bytes | None = None, query: str = "") -> tuple[int, dict]:
    from aiohttp import web
    from aiohttp.streams import StreamReader
    from aiohttp.test_utils import make_mocked_request

    from carnator.nodes import routes as r

    table = web.RouteTableDef()
    r.register(table)
    handler = next(d.handler for d in table if d.path == path and d.method == method)

    async def go():
        headers = {"Content-Type": "application/json"}
        if body is not None:
            headers["Content-Length"] = str(len(body))
        req = make_mocked_request(method, path + query, headers=headers)
        if body is not None:
            protocol = req.protocol
            stream = StreamReader(protocol, 2**16, loop=asyncio.get_running_loop())
            stream.feed_data(body[: 1 << 20])  # the handler must refuse before reading all of a large body
            stream.feed_eof()
            req = req.clone()
            req._payload = stream
        resp = await handler(req)
        return resp.status, json.loads(resp.body)

    return asyncio.run(go())


def test_routes_answer_400_or_413_with_the_reason(comfy_dirs):
    status, body = _call_route("/carnator/cache/stats", "GET", query="?directory=" + "d" * 6000)
    assert status == 400 and "too long" in body["error"] and len(body["error"]) < 2000
    status, body = _call_route("/carnator/cache/purge", "POST", body=b'{"directory": "' + b"x" * (50 << 20) + b'"}')
    assert status == 413 and "larger than" in body["error"]
    status, body = _call_route("/carnator/cache/purge", "POST", body=b"[" * 60000)  # nests past the JSON parser
    assert status == 400
    status, body = _call_route("/carnator/cache/purge", "POST", body=json.dumps({"directory": "d" * 6000}).encode())
    assert status == 400 and "too long" in body["error"]


@pytest.mark.parametrize("prompt_tokens", ["empty", "zeros"])
def test_a_prompt_that_cannot_be_embedded_continues_dense(comfy_dirs, tmp_path_factory, prompt_tokens):
    import tiny_models as tm

    from carnator.carnator_core.probe import ProbeConfig, run_probe
    from carnator.carnator_core.types import Signature
    from carnator.nodes.cache import CarnatorCacheLoader, CarnatorCacheRetriever, CarnatorCacheWriter

    m = tm.load_tiny_model("wan21", tmp_path_factory.mktemp("tiny"))
    pos, neg = tm.conditioning("wan21")
    # What an empty / emoji-only prompt gives: no valid token (all padding, zeroed), or a zero-width sequence.
    pos = [[torch.zeros_like(pos[0][0]) if prompt_tokens == "zeros" else pos[0][0][:, :0], {}]]
    probe = run_probe(m, pos, neg, tm.empty_latent("wan21"), seed=1, steps=6, cfg=5.0, sampler_name="euler",
                      scheduler="simple", prompt="", objects=(), object_source="none",
                      config=ProbeConfig(probe_steps=2))
    assert probe.embedding is None and "continues dense" in probe.note
    cache = CarnatorCacheLoader.execute(directory="carnator_cache").args[0]
    found = CarnatorCacheRetriever.execute(cache=cache, probe=probe).args[0]
    assert found.items == () and "no retrieval embedding" in found.note
    sig = Signature(objects=(), context_lab=torch.zeros(2, 2, 3).numpy(), grid=(1, 2, 2), note="")
    latent = {"samples": torch.zeros((1,) + tuple(probe.config.latent_shape))}
    out = CarnatorCacheWriter.execute(cache=cache, probe=probe, signature=sig, latent=latent)
    assert out.args[0] == "" and cache.store().stats().entries == 0
