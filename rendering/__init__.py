"""Rendering, shared by the router (tokens mode) and the backends (render server, scale-out).

OpenAI request -> ``GenerateRequest`` (chat template, tokenizer, vLLM's sampling defaults) and the
way back: tokens -> OpenAI answers and SSE chunks (incremental detokenization, stop strings). One
implementation, built on Hugging Face ``tokenizers`` and ``jinja2``; it imports only ``contract/``.
"""
