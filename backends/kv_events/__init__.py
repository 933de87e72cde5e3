"""KV-cache events: the backend publishes what vLLM 0.32 publishes, byte-compatible.

vLLM (``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'``): the
scheduler gathers the prefix cache's changes of each engine step -- blocks stored (a newly full block
gets its key; on a prefix hit only when the request asks with ``kv_cache_report_mode: "full"``),
blocks evicted, the cache cleared -- into one ``KVEventBatch`` and a ZMQ publisher sends it as
``(topic, seq, msgpack batch)`` on a PUB socket, with a ROUTER socket that replays the last
``buffer_steps`` batches. ``GET /kv_event_sources`` says where. The wire format, the frames and the
bind/connect rule are documented once, in ``contract/kv_events.py``.

Here:

- ``recorder.StepEvents`` is the engine's event sink: ``backends.engine.kv_cache`` reports stores,
  reported hits, evictions and resets as plain data (the engine imports nothing of this package);
  the recorder builds vLLM's event Structs and, when the core flushes at each step, one batch.
- ``publisher.ZmqPublisher`` sends the batches (its own thread; a bounded queue in front that drops
  and counts when full, so the engine loop never waits) and serves replays.
- ``service.KVEvents`` ties them to the app (``KV_EVENTS``; sockets opened before the engine starts,
  closed after it stops); ``routes`` serves ``GET /kv_event_sources`` and ``POST /reset_prefix_cache``.

Differences from vLLM, all invisible on the wire: block hashes come from our 16-byte blake2b keys
(vLLM: sha256), published as vLLM publishes its own (the low 64 bits as an int by default, the bytes
with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``); a full queue drops a batch instead of stalling the engine; a reset on an idle
engine is published at once (vLLM holds it until its next step); blocks a P/D pull put in are
reported stored when the first request hits them, tagged with its session (vLLM's decode instance
stores them for the request that loaded them), and never reported if evicted before that.
"""
