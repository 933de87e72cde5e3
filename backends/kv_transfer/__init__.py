"""P/D KV transfer between backend processes (vLLM NixlConnector semantics, simulated).

Modules: ``agent`` (``KVTransfer``, one per backend: pulls and preloads on the decode side, counts
prompt tokens by source), ``side_channel`` (the prefill side's HTTP routes: serve a pull, take a
release), ``pull_client`` (the decode side's HTTP client of a side channel), ``wire`` (the side
channel's paths and msgpack/JSON bodies, and the ``kv_transfer_params`` a decode request names),
``allow_list`` (which side channels a decode instance may reach), ``metrics``.

Roles: a *prefill* instance finishes a ``kv_transfer_params.do_remote_decode`` request after one
token and HOLDS its KV blocks (the engine core does that); a *decode* instance that gets
``kv_transfer_params.do_remote_prefill`` pulls those blocks over the side channel, puts them in its
prefix cache (``preload_blocks``) and decodes without computing the prompt again. Role ``both``
does either, as vLLM's ``kv_both``.

Side channel (a real transfer between the two processes)::

    decode                                              prefill (remote_host:remote_port)
      POST /internal/kv/pull   application/x-msgpack  ->  KVPullRequest
                                                    <-  200 KVPullResponse (token ids, block keys)
                                                        ... and the prefill frees the blocks
                                                    <-  404 unknown / already freed / expired
                                                    <-  409 engine id, block size or prompt differ

The endpoint is served on the prefill's HTTP server (``remote_host``/``remote_port`` then name the
address the prefill leg reached, or ``--kv-host`` and the HTTP port), or on a dedicated listener
when ``--kv-port`` is given (then the data port does not serve it). A pull must name the held
request's engine id and carry a digest of the prompt (and cache salt) it is for, so only a
request for the same prompt can take (and free) held blocks. Bodies are msgpack (``msgspec``).

Release (vLLM's "notify rejected" path: the decode leg will not come)::

    router                                              prefill (the backend the prefill leg went to)
      POST /internal/kv/release  application/json  ->  the kv_transfer_params the prefill returned
                                                        (remote_engine_id, remote_request_id,
                                                        remote_block_ids; other keys ignored)
                                                   <-  200 {"released": true, ...}: blocks freed
                                                   <-  404 nothing held (already pulled, expired)
                                                   <-  409 engine id or block ids differ

The router sends it when a decode leg fails (connect error, error status, timeout) or its client
leaves before the decode answered, so the blocks are freed at once instead of after the hold
timeout. It is served on the data port of every prefill (or ``both``) instance, and on the
dedicated side-channel listener too: only the holder of the returned parameters can name the
exact engine id, request id and block ids, and the worst a forged release can do is make one
decode instance recompute a prompt. Holds are also bounded per request, in total and under
block pressure (``backends/engine/holds.py``).

Allow-list (decode side): ``--kv-allow HOST:PORT`` (repeatable) names the only side channels a
decode instance connects to, compared with ``remote_host`` as written (no name is resolved to
decide). With none given, only loopback hosts are allowed (127.0.0.0/8, ::1 and the name
``localhost``). Parameters naming anything else are refused BEFORE any connection: a
client-supplied ``kv_transfer_params`` cannot aim a decode instance at another host.

Failures on the decode side (invalid or missing parameters, a host not allowed, an unreachable
prefill, a timeout, freed/unknown blocks, a prompt mismatch, a bad reply) never fail the request:
the prompt is recomputed locally, a WARNING is logged and ``session_backend_kv_pull_failures_total
{reason}`` counts it, as vLLM does ("Got invalid KVTransferParams" -> recompute).

Metrics (labels ``model_name``, ``engine``; counters exposed with ``_total``):

- ``session_backend_kv_pulls`` / ``session_backend_kv_pulled_tokens``: successful pulls and the
  prompt tokens they brought (full blocks); ``session_backend_kv_pull_failures{reason}``.
- ``session_backend_kv_pulls_served`` (prefill side) and the gauges
  ``session_backend_kv_held_requests`` / ``session_backend_kv_held_blocks`` (requests whose
  blocks wait for a pull, and those blocks); ``session_backend_kv_holds_freed{reason=pulled|
  released|expired|evicted|pressure|replaced}`` (how holds ended) and
  ``session_backend_kv_holds_refused{reason=over_request_limit}`` (requests not held).
- vLLM's ``vllm:external_prefix_cache_queries`` / ``vllm:external_prefix_cache_hits`` (tokens asked
  of / loaded through the connector) and ``vllm:prompt_tokens_by_source{source=local_compute|
  local_cache_hit|external_kv_transfer}`` (every finished request's prompt, by where it came from).
"""
