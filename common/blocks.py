"""The token block: the unit the engine keeps compressed state in, and the unit the KV cache
shares state by (a prompt's full blocks form the hash chain its cache keys come from). Both
sides must agree on it; the engine's state layout id includes it."""

BLOCK_SIZE = 128
