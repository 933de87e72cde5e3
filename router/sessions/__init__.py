"""Sessions on the router's side: ``table`` (the live sessions, their pins and counters),
``derive`` (the ids the router stamps on requests that come without one: derived from the
conversation, or minted) and ``responses`` (which backend created a Responses API response id).

The session contract both the router and the backends read (how a request names its session) is
``contract.session``."""
