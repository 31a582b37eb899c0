"""The store's exact-request index: one lookup by key, duplicates per (namespace, prompt, seed, key), the key in
the self-describing entry file (a rebuilt catalogue still finds it), gone with the entry."""
from __future__ import annotations

import dataclasses

import pytest
from test_cache_store import make_entry, open_store

KEY_A, KEY_B = "a" * 32, "b" * 32


def test_find_request_and_duplicates(tmp_path):
    store = open_store(tmp_path)
    plain = store.put(make_entry(1, prompt="p", seed=1))
    assert store.find_request(KEY_A) is None and store.find_request("") is None
    a = store.put(dataclasses.replace(make_entry(2, prompt="p", seed=1), request_key=KEY_A))
    b = store.put(dataclasses.replace(make_entry(3, prompt="p", seed=1), request_key=KEY_B))
    assert len({plain, a, b}) == 3  # same prompt and seed, another request (e.g. another negative prompt)
    assert store.find_request(KEY_A) == a and store.find_request(KEY_B) == b
    assert store.put(dataclasses.replace(make_entry(4, prompt="p", seed=1), request_key=KEY_A)) == a  # cached once
    assert store.find_request("not hex") is None
    with pytest.raises(ValueError, match="request_key"):
        dataclasses.replace(make_entry(5), request_key="XYZ")
    store.delete(a)
    assert store.find_request(KEY_A) is None


def test_key_survives_a_catalogue_rebuild(tmp_path):
    store = open_store(tmp_path)
    a = store.put(dataclasses.replace(make_entry(1), request_key=KEY_A))
    root = store.root
    store.close()
    for p in root.glob("catalog.sqlite3*"):
        p.write_bytes(b"this is not a database")  # unusable: set aside and rebuilt from the entry files
    again = open_store(tmp_path)
    assert again.find_request(KEY_A) == a and again.load(a).entry_id == a
