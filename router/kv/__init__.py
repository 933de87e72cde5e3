"""Where each session's KV is resident: the engines' KV events, subscribed to and indexed.

``index``: ``KVIndex``, the bounded index placement reads (``session_tokens``, ``prefix_tokens``);
``subscriber``: one engine's ZMQ stream (bind or connect, seq, replay, resets, slices);
``service``: ``KVEvents``, every backend's streams, following the pools; ``metrics``:
``session_router_kv_*``.
"""
