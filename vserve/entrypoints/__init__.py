"""User-facing entry points: the offline `LLM`, the HTTP server and the CLI."""
