"""session-backend: a vLLM-compatible inference server with an embedded, simulated engine core."""
