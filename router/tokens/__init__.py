"""Tokens mode (``[tokens] upstream_api = "tokens"``, DESIGN.md §10): the router as the coordinator of
vLLM's disaggregated layout. It renders OpenAI requests to token ids (locally or on render servers),
places them as in text mode, sends them to the engines' ``/inference/v1/generate`` and derenders the
tokens that come back into OpenAI's answers. One concern per module:

- ``mode``: assembled once at start-up (model, renderer, prompt cache, aborts, the route handlers
  ``Proxy.tokens`` calls instead of forwarding);
- ``renderers``: the render protocol and the local renderer; ``render_client``: render servers;
- ``prompt_cache``: each session's last prompt, for the incremental render of its next turn;
- ``flow``: chat and completions: render, then the engine leg;
- ``generate``: the engine leg of one request (place, send, stream/whole/collect, aborts, usage);
  ``fanout``: a completions request with several prompts; ``answers``: derenderer adapters;
- ``engine``: the generate payload and ``abort_requests``; ``sse``: reading an engine's stream;
- ``render_routes``: ``/tokenize``, ``/detokenize`` and ``/v1/responses`` in tokens mode.
"""
