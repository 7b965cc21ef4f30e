"""The engine: wire messages, the engine core and its step loops, clients, front-end processing."""
