"""Sampling: the batched sampler, speculative decoding's rejection sampler, grammar masks."""
