"""Prefill worker: prompt -> state in the cache service + first token -> decode."""
