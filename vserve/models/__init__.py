"""Model definitions (device side), their registry and weight loading."""
