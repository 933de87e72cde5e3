"""Backends found at runtime, per pool (``[discovery.<pool>]``): static (the configured list, the
default), ``kubernetes`` (the Ready pods of a label selector, ``kubernetes``) or ``dns`` (a name's
A/AAAA or SRV records, ``dns``).

A source only reports the set of backend URLs it currently sees (``Target.update``); one
``PoolReconciler`` per pool (``reconcile``) diffs that set against what it added before and changes
the pool through ``router.backend_changes`` (the admin API's path: a joiner is health-checked before
it takes traffic, a leaver drains). ``Discovery`` (``service``) builds them from the configuration;
the app's lifecycle starts and stops it. A source that cannot reach its API or its DNS server keeps
the backends it has and retries with bounded, jittered exponential backoff (``backoff``).
"""
