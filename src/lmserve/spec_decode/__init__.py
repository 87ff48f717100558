"""Speculative decoding: proposers (n-gram lookup, a draft model) and the rejection sampler that verifies
their proposals against the target in one forward pass. See docs/architecture.md, "Speculative decoding"."""
