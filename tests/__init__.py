"""vserve tests, grouped by the layer they exercise; shared helpers live in tests.support."""
