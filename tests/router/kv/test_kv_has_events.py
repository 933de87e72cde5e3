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


def test_the_index_has_events_while_some_backends_events_reach_it() -> None:
    """``any_events``: False only while no backend's events reach the index; placement then skips it,
    which is right only because such an index answers nothing for any session, prompt or backend."""
    other = "http://127.0.0.1:8101"
    index = KVIndex(max_blocks=100)
    assert not index.any_events
    index.reset_backend(URL)
    assert not index.any_events
    index.apply(URL, KVEventBatch(0.0, []))  # a first batch, even an empty one: the backend is heard
    assert index.any_events
    index.apply(other, KVEventBatch(0.0, [stored(list(range(32)), "s")]))
    index.reset_backend(other)
    assert index.any_events
    index.remove_backend(URL)
    assert index.any_events and index.has_events(other)
    index.remove_backend(other)
    assert not index.any_events
    assert index.session_tokens("s") == {} and index.prefix_tokens(list(range(32))) == {}
    assert not index.has_events(URL) and not index.has_events(other)
