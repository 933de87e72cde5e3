"""Router replicas and workers that agree: the optional shared state in Redis (issue 15 §2).

Without it every router process (replica, or ``--workers`` worker) keeps its own session table. First
placements agree anyway (rendezvous hashing over the same backends); what only one process knows is
where a session's pin *moved* (a spill, a re-pin after a failure) and which backend stored a Responses
id. ``shared_state = "redis://…"`` puts both in one Redis:

**What is stored** (every key starts with ``[shared_state] key_prefix``, default ``session-router:``)

- ``<prefix>pins:<session id>``: a hash, pool name -> ``"<reason> <backend URL>"`` (reason: why the
  placement put it there). Every pin is written: a session's first pin with ``HSETNX`` (the first
  process to place it wins; a process that meets the session later reads it rather than placing it by
  its own view of the load), a move (any pin change of a session that had one) with ``HSET``.
  ``EXPIRE`` = ``[sessions] ttl_s`` on every write; a pin still in use is written again once per
  ``ttl_s / 2`` (from the request path's clock read, no Redis work there), so it outlives no idle
  session and expires with none in use.
- ``<prefix>resp:<response id>``: ``"<backend URL>\\t<session id>"``; the newest ``[sessions]
  max_response_ids`` ids are kept (a Lua script pushes the id on ``<prefix>resp-ids`` and deletes the
  oldest past the bound, atomically; standalone Redis, not Redis Cluster).
- ``<prefix>pins`` (a pub/sub channel): each move is published as
  ``[origin, session, pool, url, reason]``; every process subscribes and applies moves made by others
  (``origin`` = a random id per process) to sessions it already knows. Sticky requests therefore
  never read Redis: moves are pushed.

**The request path.** Writes never wait on it: ``pin_moved`` / ``response_stored`` append to a bounded
queue (``queue_size``; when full the write is dropped and counted) drained by a background task that
sends each batch as one pipeline. Reads happen only on first sight, each one round trip bounded by
``read_timeout_s``: a session with no local entry reads its pins once (``HGETALL``) before it is
placed; a ``previous_response_id`` (or a ``/v1/responses/{id}`` path) unknown locally is read once
(``GET``) and remembered locally. A client can be faster than the write of the replica that stored
the response (it got the answer before that replica's writer ran), so a missing id is read again a
few times, backing off from 4 ms, within the same ``read_timeout_s`` (result ``late`` when found
then). A session already known locally costs no Redis work at all.

**Start-up.** A process makes its first connection attempt before it listens (bounded by a PING
and a SUBSCRIBE of ``write_timeout_s`` each), so a replica or worker that joins a running fleet reads
what the others wrote from its first request on. A Redis that refuses or does not answer in time is
logged and the process serves from local state, reconnecting as below.

**Redis down or slow.** A failed or timed-out read or write, or a broken subscription, marks the
shared state down: reads are skipped (the router decides from local state as without Redis), writes
queue up to the bound, and a keeper task reconnects with exponential backoff (``backoff_min_s`` ..
``backoff_max_s``), then re-subscribes and flushes the queue. No request fails because of Redis; a
slow Redis delays a first-sight request by at most ``read_timeout_s``. Moves published while a
process was disconnected are not replayed to it: it keeps its local pins for the sessions it knows
until their next move. Metrics: ``session_router_shared_state_up`` (1/0),
``..._shared_state_errors_total{op}``, ``..._shared_state_dropped_writes_total``,
``..._shared_state_read_timeouts_total``, ``..._shared_state_reads_total{kind,result}``,
``..._shared_state_writes_total{kind}``, ``..._shared_state_pushes_total``.

**Agreement** (with or without Redis): ``session_router_off_first_choice_total{reason}`` counts the
requests of sessions placed off their first-choice (rendezvous) backend, by reason (``agreement``).

``--workers N`` processes are replicas on one machine: with the same ``shared_state`` they agree the
same way.
"""

from router.shared.agreement import Agreement
from router.shared.store import SharedState

__all__ = ["Agreement", "SharedState"]
