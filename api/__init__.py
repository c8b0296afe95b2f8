"""OpenAI-compatible HTTP API, SSE streaming, metrics and the command line."""
