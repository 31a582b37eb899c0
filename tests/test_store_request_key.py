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


def test_an_answer_only_entry_is_checked_found_by_key_and_evicted_like_any(tmp_path):
    from carnator.carnator_core.cache.entry import decode_entry, encode_entry

    store = open_store(tmp_path)
    reused = store.put(make_entry(1))
    with pytest.raises(ValueError, match="answer_of"):
        dataclasses.replace(make_entry(2), request_key=KEY_A, answer_of="not an id")
    with pytest.raises(ValueError, match="request key"):
        dataclasses.replace(make_entry(2), answer_of=reused)  # an answer is found by its key alone
    answer = store.put(dataclasses.replace(make_entry(2), request_key=KEY_A, answer_of=reused))
    assert store.find_request(KEY_A) == answer and store.load(answer, count_hit=False).answer_of == reused
    # A dense result under the same key (never written by serve: the keys are domain-separated) is preferred.
    dense = store.put(dataclasses.replace(make_entry(3, prompt="other"), request_key=KEY_A))
    assert store.find_request(KEY_A) == dense
    store.delete(dense)
    assert store.find_request(KEY_A) == answer
    # The file carries the record: a decoded copy names the reused entry.
    enc = encode_entry(dataclasses.replace(make_entry(4), request_key=KEY_B, answer_of=reused), entry_id="0" * 16,
                       created=0.0)
    assert decode_entry(enc.blob).answer_of == reused
    small = open_store(tmp_path / "small", max_bytes=int(len(enc.blob) * 2.5))
    first = small.put(dataclasses.replace(make_entry(5), request_key=KEY_B, answer_of=reused))
    for i in range(6, 9):
        small.put(make_entry(i))
    assert small.find_request(KEY_B) is None and first not in small.entry_ids()  # evicted like any entry
    assert small.verify().ok and store.verify().ok
