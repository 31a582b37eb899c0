"""What the Carnator panel relies on, against the session's shared real ComfyUI server (no browser):

* a purge makes ComfyUI run the same graph again: the Cache node's change fingerprint follows the cache's purge
  count, so the requeued identical graph is no longer answered by ComfyUI's node cache (and the cache refills),
  while a requeue without a purge still is;
* ``GET /carnator/requests`` lists the requests this server served, per namespace, with the decision, the share of
  compute saved and a PNG thumbnail of the result; it refuses a bad ``limit`` with the reason;
* the rule line says which strata the deciding rule certified: the shipped embedded rule certifies two (attempt 21,
  with the request and the cached entry as the unit: size, colour), report and panel list them, a colour edit of a
  cached request is served by reuse over it and a motion edit of it is refused although it passes the thresholds.
"""
from __future__ import annotations

import base64
import io
import urllib.error

import pytest
from harness_server import ComfyServer
from repo_package import ROOT
from test_server_exact import PROMPT, graph, queue_without_client, reports, stats

pytestmark = [pytest.mark.server, pytest.mark.slow]

DIRECTORY = "panel_routes"


def test_purge_makes_the_same_graph_run_again_and_requests_are_listed(comfy_server: ComfyServer) -> None:
    server = comfy_server
    prompt = graph(DIRECTORY, seed=11)
    first = reports(queue_without_client(server, prompt))[0]
    assert first["decision"] in ("miss", "dense") and first["model_calls"] > 0, first
    # Control: without a purge, ComfyUI's node cache answers the identical graph (nothing of Carnator runs).
    again = reports(queue_without_client(server, prompt))[0]
    assert (again["decision"], again["mode"], again["model_calls"]) == ("hit", "node_cache", 0), again
    assert stats(server, DIRECTORY)["entries"] == 1
    purged = server.post("/carnator/cache/purge", {"directory": DIRECTORY})
    assert purged["purged"] == 1 and stats(server, DIRECTORY)["entries"] == 0, purged
    # After the purge the same graph runs: the model is called, and the emptied cache has its entry again.
    after = reports(queue_without_client(server, prompt))[0]
    assert after["mode"] != "node_cache" and after["model_calls"] > 0, after
    assert stats(server, DIRECTORY)["entries"] == 1

    listed = server.get("/carnator/requests?limit=200")
    ours = [e for events in listed["namespaces"].values() for e in events if e.get("seed") == 11]
    # The node-cache answer is recorded by the Cache Writer (no thumbnail: no new result was made): not run, so
    # neither a lookup nor a hit, by the one definition the routes state.
    assert [e["mode"] for e in ours][-3:] == [first["mode"], "node_cache", after["mode"]], ours
    assert [e["outcome"] for e in ours][-3:] == [first["decision"], "not_run", after["decision"]], ours
    assert not ours[-2]["lookup"] and set(listed["definitions"]) == {"lookup", "hit", "not_run"}, listed
    ns = next(ns for ns, events in listed["namespaces"].items() if any(e.get("seed") == 11 for e in events))
    counts = listed["counts"][ns]
    held = listed["namespaces"][ns]
    assert counts["not_run"] == sum(e["outcome"] == "not_run" for e in held) >= 1, (counts, held)
    # the namespace in words, from the graph that served it: its MODEL's loader and the probe's schedule
    assert "CarnatorEmbeddedLoader" in listed["titles"][ns]["model"], listed["titles"]
    assert listed["titles"][ns]["config"] == "probe 2 of 8 steps · euler/simple · cfg 5", listed["titles"]
    assert listed["purges"], listed
    thumbs = [e["thumbnail"] for e in ours if e.get("thumbnail")]
    assert len(thumbs) >= 2, ours
    from PIL import Image

    img = Image.open(io.BytesIO(base64.b64decode(thumbs[-1].split(",", 1)[1])))
    assert img.format == "PNG" and max(img.size) == 96 and min(img.size) >= 32, (img.format, img.size)
    assert len(set(img.convert("RGB").getdata())) > 8, "the thumbnail is flat: no picture in it"
    one = server.get("/carnator/requests?limit=1")
    assert all(len(v) == 1 for v in one["namespaces"].values()), one
    for bad in ("0", "x", "1000"):
        with pytest.raises(urllib.error.HTTPError) as err:
            server.get(f"/carnator/requests?limit={bad}")
        assert err.value.code == 400 and b"limit must be an integer" in err.value.read()


def test_the_rule_line_says_which_strata_are_certified(comfy_server: ComfyServer) -> None:
    from carnator.carnator_core.risk.rule import RiskRule

    server = comfy_server
    rule = RiskRule.load(ROOT / "rules" / "embedded.json")
    assert rule.certificate.passed and rule.strata is not None  # certified on average and per stratum (attempt 21):
    assert "colour" in rule.strata.certified and "motion" not in rule.strata.certified  # colour edits serve, motion not
    moved = PROMPT.replace("rolls to the right", "moves up")  # against the first request, the motion changed
    recoloured = PROMPT.replace("red", "blue")  # ... and here the colour
    shown: list[dict] = []
    for text in (PROMPT, moved, recoloured):  # the first fills the cache; then a motion edit and a colour edit of it
        prompt = graph(DIRECTORY + "_strata", seed=21)
        prompt["2"]["inputs"]["text"] = prompt["5"]["inputs"]["prompt"] = text
        prompt["5"]["inputs"].update(steps=20, cfg=2.0)  # the rule's config (probe 2 of 20 steps, CFG 2)
        prompt["13"]["inputs"]["mode"] = "signature"
        shown.append(reports(queue_without_client(server, prompt))[0])
    for rep in shown:
        assert rep["rule_id"] == rule.rule_id and rep["certified_strata"] == list(rule.strata.certified), rep
    first, motion, colour = shown
    assert first["decision"] == "miss", first
    # the motion edit passes the thresholds, but its stratum did not certify: refused, served dense
    assert motion["decision"] == "miss" and motion["model_calls"] > 0, motion
    assert any("stratum 'motion'" in v["reason"] and "refused" in v["reason"] for v in motion["verdicts"]), motion
    # the colour edit passes them and its stratum certified: served by reuse over the cached first request
    assert colour["decision"] == "hit" and colour["compute_fraction"] < 1.0, colour
    assert any("stratum 'colour'" in v["reason"] and "(certified)" in v["reason"] for v in colour["verdicts"]), colour
    listed = server.get("/carnator/requests?limit=200")
    ours = [e for events in listed["namespaces"].values() for e in events if e.get("seed") == 21]
    assert [e["certified_strata"] for e in ours] == [list(rule.strata.certified)] * 3, ours
