"""The KV cache system: inference state by key, across tiers, with checksums and leases."""
