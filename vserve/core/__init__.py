"""The control plane: requests, KV block accounting and the scheduler. Imports no torch."""
