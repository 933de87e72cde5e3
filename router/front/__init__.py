"""The HTTP fronts of the router: what turns client connections into ``Proxy.handle`` calls.

Each front implements the proxy's seam, ``router.exchange`` (``RequestView``, ``ResponseWriter``,
the request headers a proxy never forwards), which the proxy owns.

- ``aiohttp_adapter``: those interfaces over aiohttp's ``web.Request``/``web.StreamResponse``;
  the aiohttp app's proxied routes use it (``front = "aiohttp"``, the internal app of the raw
  front, and the in-process tests).
- ``wire``: HTTP/1.x response heads for the raw front (status lines, Date/Server, framing).
- ``connection``: the raw front's ``asyncio.Protocol`` + ``httptools`` parser, one per client
  connection, given the front's ``settings`` (``ConnectionSettings``) and ``ConnectionHooks``.
- ``raw_exchange``: one request on a raw connection, implementing both interfaces on its transport.
- ``relay``: every request that is not a hot proxied route goes to the aiohttp app on its
  internal loopback listener over the raw upstream pool.
- ``server``: the listening socket, the connection registry, the idle sweeper and the drain.
"""
