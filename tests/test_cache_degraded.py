"""The Cache nodes when the cache cannot write: a full disk at the Cache Writer returns the clip and says on the
badge and in the log that it was not cached (the prompt does not fail); a read-only cache serves recalls and
exact repeats through the Loader and Retriever and writes nothing, saying so. Real tmpfs mounts (real ENOSPC,
a real read-only remount) inside an in-process ComfyUI."""
from __future__ import annotations

import logging
import os
import subprocess

import numpy as np
import pytest
import torch
from test_cache_nodes import _probe, _report
from test_cache_recovery import _fill
from test_cache_store import CFG, carnator_warnings, make_sig

pytestmark = pytest.mark.comfy


@pytest.fixture()
def mounted(comfy_dirs, monkeypatch):
    """A 3 MiB tmpfs allowed as a cache root (CARNATOR_CACHE_ROOTS); unmounted afterwards."""
    mnt = comfy_dirs / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()}); needs root in a container")
    monkeypatch.setenv("CARNATOR_CACHE_ROOTS", str(mnt))
    try:
        yield mnt
    finally:
        from carnator.carnator_core.cache import handle

        for st in list(handle._STORES.values()):  # noqa: SLF001 - close this test's stores before unmounting
            if str(st.root).startswith(str(mnt)):
                st.close()
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _write(nodes, handle, seed, decision="miss"):
    return nodes.CarnatorCacheWriter.execute(cache=handle, probe=_probe(seed=seed, emb_seed=seed), signature=make_sig(),
                                             latent={"samples": torch.randn(1, *CFG.latent_shape)},
                                             report=_report(decision))


def test_the_writer_on_a_full_disk_returns_the_clip_and_says_it_was_not_cached(mounted, caplog):
    import carnator.nodes.cache as nodes

    handle = nodes.CarnatorCacheLoader.execute(directory=str(mounted / "cache")).result[0]
    assert _write(nodes, handle, 1).result[0]  # stored while there is room
    _fill(mounted / "filler")
    with caplog.at_level(logging.INFO, logger="carnator"):
        out = _write(nodes, handle, 2)  # the prompt does not fail
    ui = out.ui.as_dict()
    assert out.result[0] == "" and "not stored" in ui["text"][0] and "full" in ui["text"][0]
    badge = ui["carnator_report"][0]
    assert badge["not_cached"] == "the disk is full" and badge["decision"] == "miss"
    assert any("not cached" in r.getMessage() and "full" in r.getMessage() for r in caplog.records
               if r.name == "carnator")
    (mounted / "filler").unlink()
    assert _write(nodes, handle, 3).result[0]  # room again: stored


def test_a_read_only_cache_serves_through_the_nodes_and_writes_nothing(mounted, caplog):
    import carnator.nodes.cache as nodes

    handle = nodes.CarnatorCacheLoader.execute(directory=str(mounted / "cache")).result[0]
    stored = _write(nodes, handle, 1).result[0]
    assert stored
    handle.store().close()
    subprocess.run(["mount", "-o", "remount,ro", str(mounted)], check=True, capture_output=True)
    files = sorted(os.path.relpath(p, mounted) for p in mounted.rglob("*"))
    with caplog.at_level(logging.WARNING, logger="carnator"):
        handle = nodes.CarnatorCacheLoader.execute(directory=str(mounted / "cache")).result[0]
        assert nodes.CarnatorCacheLoader.validate_inputs(directory=str(mounted / "cache")) is True
        for seed in (2, 3):
            cands = nodes.CarnatorCacheRetriever.execute(cache=handle, probe=_probe(seed=seed, emb_seed=1), k=5,
                                                         min_similarity=-1.0).result[0]
            assert [c.entry_id for c in cands.items] == [stored]
            out = _write(nodes, handle, seed)
            assert out.result[0] == "" and out.ui.as_dict()["carnator_report"][0]["not_cached"] == \
                "the cache is read-only"
    said = [r.getMessage() for r in carnator_warnings(caplog)]
    assert sum("read-only" in m and "serves recalls" in m for m in said) == 1, said
    assert sorted(os.path.relpath(p, mounted) for p in mounted.rglob("*")) == files
    assert np.isfinite(handle.store().stats().hit_rate)
