"""Path confinement of cache directories (pure core): relative paths, '..', absolute paths, symlink escapes,
roots from CARNATOR_CACHE_ROOTS, and the store refusing links that lead out of its directory."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_cache_store import make_entry, open_store

from carnator.carnator_core.cache import CacheError, CachePathError, resolve_cache_dir, roots_from_env


@pytest.fixture()
def roots(tmp_path):
    out, user, elsewhere = tmp_path / "output", tmp_path / "user", tmp_path / "elsewhere"
    for d in (out, user, elsewhere):
        d.mkdir()
    return out, user, elsewhere


def test_relative_and_absolute_inside(roots):
    out, user, _ = roots
    assert resolve_cache_dir("carnator_cache", [out, user]) == out.resolve() / "carnator_cache"
    assert resolve_cache_dir("a/b/../c", [out, user]) == out.resolve() / "a" / "c"
    assert resolve_cache_dir(str(user / "caches" / "x"), [out, user]) == user.resolve() / "caches" / "x"


@pytest.mark.parametrize("bad", ["../elsewhere", "carnator_cache/../../elsewhere", "../../../../etc", "/etc",
                                 "/tmp/carnator_cache", "", "   ", ".", "a\x00b"])
def test_escapes_are_rejected(roots, bad):
    out, user, _ = roots
    with pytest.raises(CachePathError) as e:
        resolve_cache_dir(bad, [out, user])
    msg = str(e.value)
    assert "CARNATOR_CACHE_ROOTS" in msg and str(out.resolve()) in msg


def test_symlink_escape_is_rejected(roots):
    out, user, elsewhere = roots
    (out / "link").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(CachePathError, match="outside the allowed roots"):
        resolve_cache_dir("link", [out, user])
    with pytest.raises(CachePathError):
        resolve_cache_dir("link/cache", [out, user])
    (out / "inner").mkdir()
    (out / "ok_link").symlink_to(out / "inner", target_is_directory=True)
    assert resolve_cache_dir("ok_link", [out, user]) == (out / "inner").resolve()


def test_roots_from_env(roots, monkeypatch, caplog):
    out, user, elsewhere = roots
    env = {"CARNATOR_CACHE_ROOTS": os.pathsep.join([str(elsewhere), "relative/ignored", ""])}
    extra = roots_from_env(env)
    assert extra == [elsewhere]
    assert resolve_cache_dir(str(elsewhere / "c"), [out, user, *extra]) == elsewhere.resolve() / "c"
    monkeypatch.setenv("CARNATOR_CACHE_ROOTS", str(elsewhere))
    assert roots_from_env() == [elsewhere]
    with pytest.raises(CachePathError, match="no cache root"):
        resolve_cache_dir("x", [])


def test_store_refuses_links_out_of_its_directory(tmp_path):
    st = open_store(tmp_path)
    ns = make_entry(1).namespace
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "cache" / "entries" / ns).symlink_to(outside, target_is_directory=True)
    with pytest.raises(CacheError, match="outside the cache directory"):
        st.put(make_entry(1))
    assert not list(outside.iterdir()) and st.stats().entries == 0
    st.close()
    (tmp_path / "cache" / "entries" / ns).unlink()
    (tmp_path / "cache" / "tmp").rmdir()
    (tmp_path / "cache" / "tmp").symlink_to(outside, target_is_directory=True)
    with pytest.raises(CacheError, match="symbolic link"):
        open_store(tmp_path)
    assert not list(Path(outside).iterdir())


@pytest.mark.parametrize("bad,match", [("d" * 6000, "too long"), ("a/" + "b" * 300, "too long"),
                                       ("loop/x", "cannot be resolved")])
def test_overlong_or_looping_paths_are_refused_with_a_message(roots, bad, match):
    out, user, _ = roots
    (out / "loop").symlink_to(out / "loop")  # a symlink loop: ELOOP while resolving
    with pytest.raises(CachePathError, match=match) as e:
        resolve_cache_dir(bad, [out, user])
    assert len(str(e.value)) < 2000  # the user's 6,000 characters are not echoed back


def test_rule_and_pairs_names_are_confined_by_the_same_module(tmp_path):
    from carnator.carnator_core import paths
    from carnator.carnator_core.paths import PathNotAllowedError, resolve_confined

    assert resolve_confined is paths.resolve_confined and issubclass(CachePathError, PathNotAllowedError)
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "ok.json").write_text("{}")
    assert resolve_confined("ok.json", [rules], must_exist=True) == rules / "ok.json"
    for bad, match in (("x" * 5000 + ".json", "too long"), ("../escape.json", "escapes"), ("", "no rule"),
                       ("a\x00b", "NUL")):
        with pytest.raises(PathNotAllowedError, match=match):
            resolve_confined(bad, [rules], must_exist=True, what="rule")
