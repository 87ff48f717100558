"""Tensor-parallel collectives: the process group and the shared-memory all-reduce."""
