"""Tokens mode (``[tokens] upstream_api = "tokens"``, DESIGN.md §10): the router as the coordinator of
vLLM's disaggregated layout. It renders OpenAI requests to token ids (locally or on render servers),
places them as in text mode, sends them to the engines' ``/inference/v1/generate`` and derenders the
tokens that come back into OpenAI's answers. One concern per module: ``renderers`` (the render
protocol and the local renderer), ``prompt_cache`` (per-session incremental render state),
``engine`` (generate and abort calls), ``flow`` (the data path of the two routes)."""
