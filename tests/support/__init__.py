"""Helpers shared by the tests: fakes, tiny models, references, server and process utilities."""
