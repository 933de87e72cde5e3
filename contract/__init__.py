"""What the router and the backends both stand on: the session contract (``session``), the one
exception tree and OpenAI's error shape (``errors``), request ids and the session hash (``ids``),
and aiohttp's parser-level error pages in that shape (``aiohttp_json_errors``).

Nothing here imports ``router`` or ``backends``.
"""
