"""The memory ledger: KV and weight bytes, reports, presets, the PD split, byte units."""
