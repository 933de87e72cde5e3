"""``KVIndex.has_events``: which backends' events reach the index (placement trusts a 0 only there)."""

from __future__ import annotations

from contract.kv_events import KVEventBatch
from router.kv.index import KVIndex
from tests.router.kv.events import stored

URL = "http://127.0.0.1:8100"


def test_a_backend_has_events_from_its_first_batch_until_it_is_removed() -> None:
    index = KVIndex(max_blocks=100)
    assert not index.has_events(URL)
    index.reset_backend(URL)  # a reset of a backend never heard of does not vouch for it
    assert not index.has_events(URL)
    index.apply(URL, KVEventBatch(0.0, [stored(list(range(32)), "s")]))
    assert index.has_events(URL) and index.session_tokens("s")[URL] > 0
    index.reset_backend(URL)  # engine restart: its cache is empty, and the index still hears it
    assert index.has_events(URL) and index.session_tokens("s") == {}
    index.remove_backend(URL)
    assert not index.has_events(URL)
